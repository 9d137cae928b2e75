# tradebucket container image.
#
#   docker build -t tradebucket .
#   docker run --rm tradebucket check-config
#
# Two stages: the Rust toolchain and C build tools stay in the builder; the
# runtime image holds the binary, the shared libraries it links and what
# Kerberos needs at run time.
# Only classic Dockerfile syntax is used (no RUN --mount), so the legacy
# builder that docker-compose 1.x drives builds it as well as BuildKit does.

# The toolchain the project is built and tested with (CI's). It must not be
# older than any locked crate's rust-version (uuid needs 1.89):
# scripts/check-deploy checks that. Both stages are on Debian 13 (trixie),
# the current stable.
FROM rust:1.95-trixie AS builder

# rdkafka builds librdkafka from its bundled source with ./configure and
# make (C and C++), against the system OpenSSL (feature "ssl"), zlib, Cyrus
# SASL (feature "gssapi": Kerberos) and libcurl (feature "curl": OAUTHBEARER
# with OIDC). Without libcurl4-openssl-dev, curl-sys would quietly compile
# its own libcurl instead, one Debian's security updates never reach. The
# rust image already carries most of these; naming them keeps the build
# working if that ever changes. Versions are not pinned (hadolint DL3008):
# Debian stable carries only the current, security-patched version, so a
# pin would break the build at its next update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential perl pkg-config libssl-dev zlib1g-dev \
        libsasl2-dev libcurl4-openssl-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /build

# `-p tradebucket`: the workspace's default members include testkit (so
# that a plain `cargo build` or `clippy` covers it), which the image does
# not need and which does not compile against the stub sources below.
# (Found by the first build of this image, scripts/image.)
#
# Dependencies first, with stub sources: this layer (librdkafka and several
# hundred crates, the slow part) is rebuilt only when Cargo.toml, Cargo.lock,
# benches/ or testkit/ change, not on every source edit. benches/ is here because
# Cargo.toml declares a [[bench]] target, and cargo refuses a manifest whose
# declared targets have no file (any [[test]] or [[example]] declared later
# needs the same). testkit/ likewise: it is a workspace member and a
# dev-dependency, and cargo loads every member's manifest even for a build
# that never compiles it.
COPY Cargo.toml Cargo.lock ./
COPY benches ./benches
COPY testkit ./testkit
RUN mkdir src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && cargo build --release --locked -p tradebucket \
    && rm -rf src

# The real sources. config/default.toml is compiled into the binary
# (include_str!), so it is part of the build input.
COPY src ./src
COPY config ./config
# Forget the stub build of our own crate: COPY keeps the files' original
# modification times, which can be older than the stub's artifacts, and
# cargo would then take the stub for up to date.
RUN rm -rf target/release/.fingerprint/tradebucket-* \
        target/release/deps/tradebucket-* \
        target/release/deps/libtradebucket-* \
    && cargo build --release --locked -p tradebucket \
    && install -D -m 0755 target/release/tradebucket /out/tradebucket


FROM debian:trixie-slim

# The shared libraries the binary links (its NEEDED entries): libssl3t64
# (librdkafka's TLS), libcurl4t64 (OIDC token requests), libsasl2-2 (Cyrus
# SASL); zlib and libgcc are in the base image. (Debian 13 renamed libssl3
# and libcurl4 for its 64-bit time_t transition; the libraries, libssl.so.3
# and libcurl.so.4, are the same, so a binary built on Debian 12 runs here.)
# ca-certificates: to verify brokers', MongoDB's and the OIDC token
# endpoint's certificates.
# Kerberos (sasl.mechanism=GSSAPI) also needs, at run time only: the Cyrus
# SASL GSSAPI plugin, which libsasl2 loads from a directory rather than
# links (libsasl2-modules-gssapi-mit), and kinit (krb5-user), which
# librdkafka runs to log in with the keytab (sasl.kerberos.kinit.cmd).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        libssl3t64 libcurl4t64 libsasl2-2 ca-certificates \
        libsasl2-modules-gssapi-mit krb5-user \
    && rm -rf /var/lib/apt/lists/*

# A fixed numeric uid/gid: Kubernetes' runAsNonRoot can only verify a
# numeric USER, and host volumes or policies can refer to it.
RUN groupadd --system --gid 10001 tradebucket \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin tradebucket

COPY --from=builder /out/tradebucket /usr/local/bin/tradebucket

# The default listen address is loopback, which nothing outside the
# container can reach; JSON logs are what log collectors expect.
ENV TRADEBUCKET__HTTP__LISTEN=0.0.0.0:8080 \
    TRADEBUCKET__LOG__FORMAT=json

USER 10001:10001
# /metrics, /healthz, /readyz
EXPOSE 8080
# SIGTERM (Docker's default stop signal) makes `run` drain, commit and
# leave the consumer group; give it more than shutdown.drain_timeout
# (10 s) before the kill (docker stop -t 30, stop_grace_period,
# terminationGracePeriodSeconds).
ENTRYPOINT ["/usr/local/bin/tradebucket"]
CMD ["run"]
