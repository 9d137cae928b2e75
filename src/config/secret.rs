//! Secrets in the settings: which values are secret, how they print, and
//! how they are scrubbed from text that a client library produced.
//!
//! Both lists are allowlists of what is *not* secret: an option this
//! version does not know (a new librdkafka property, a new URI option) is
//! treated as a secret, so a mistake here costs an operator a
//! `<redacted>` in `check-config`, never a leaked credential.

use std::collections::BTreeMap;

use secrecy::{ExposeSecret, SecretString};
use serde::Serializer;

/// What a secret prints as, everywhere.
pub const REDACTED: &str = "<redacted>";

/// The librdkafka properties (librdkafka 2.12) known to carry secrets. Not
/// what decides redaction (see [`PUBLIC_KAFKA_OPTIONS`]: anything not known
/// to be public is redacted); the tests set each of these.
pub const SECRET_KAFKA_OPTIONS: [&str; 11] = [
    "sasl.password",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.client.credentials.client.secret",
    "sasl.oauthbearer.config",
    "sasl.oauthbearer.extensions",
    "sasl.oauthbearer.assertion.private.key.passphrase",
    "sasl.oauthbearer.assertion.private.key.pem",
    "ssl.key.password",
    "ssl.key.pem",
    "ssl.keystore.password",
    // A command line, which may carry a password.
    "sasl.kerberos.kinit.cmd",
];

/// librdkafka properties (CONFIGURATION.md of librdkafka 2.12) whose values
/// are not secret: every property but the [`SECRET_KAFKA_OPTIONS`] and the
/// callbacks (which cannot be set from text).
const PUBLIC_KAFKA_OPTIONS: &[&str] = &[
    "acks",
    "allow.auto.create.topics",
    "api.version.fallback.ms",
    "api.version.request",
    "api.version.request.timeout.ms",
    "auto.commit.enable",
    "auto.commit.interval.ms",
    "auto.offset.reset",
    "batch.num.messages",
    "batch.size",
    "bootstrap.servers",
    "broker.address.family",
    "broker.address.ttl",
    "broker.version.fallback",
    "check.crcs",
    "client.dns.lookup",
    "client.id",
    "client.rack",
    "compression.codec",
    "compression.level",
    "compression.type",
    "connections.max.idle.ms",
    "consume.callback.max.messages",
    "coordinator.query.interval.ms",
    "debug",
    "delivery.report.only.error",
    "delivery.timeout.ms",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "enable.gapless.guarantee",
    "enable.idempotence",
    "enable.metrics.push",
    "enable.partition.eof",
    "enable.random.seed",
    "enable.sasl.oauthbearer.unsecure.jwt",
    "enable.ssl.certificate.verification",
    "fetch.error.backoff.ms",
    "fetch.max.bytes",
    "fetch.message.max.bytes",
    "fetch.min.bytes",
    "fetch.queue.backoff.ms",
    "fetch.wait.max.ms",
    "group.id",
    "group.instance.id",
    "group.protocol",
    "group.protocol.type",
    "group.remote.assignor",
    "heartbeat.interval.ms",
    "https.ca.location",
    "https.ca.pem",
    "interceptors",
    "internal.termination.signal",
    "isolation.level",
    "linger.ms",
    "log.connection.close",
    "log.queue",
    "log.thread.name",
    "max.in.flight",
    "max.in.flight.requests.per.connection",
    "max.partition.fetch.bytes",
    "max.poll.interval.ms",
    "message.copy.max.bytes",
    "message.max.bytes",
    "message.send.max.retries",
    "message.timeout.ms",
    "metadata.broker.list",
    "metadata.max.age.ms",
    "metadata.recovery.rebootstrap.trigger.ms",
    "metadata.recovery.strategy",
    "offset.store.method",
    "offset.store.path",
    "offset.store.sync.interval.ms",
    "partition.assignment.strategy",
    "partitioner",
    "plugin.library.paths",
    "produce.offset.report",
    "queue.buffering.backpressure.threshold",
    "queue.buffering.max.kbytes",
    "queue.buffering.max.messages",
    "queue.buffering.max.ms",
    "queued.max.messages.kbytes",
    "queued.min.messages",
    "queuing.strategy",
    "receive.message.max.bytes",
    "reconnect.backoff.jitter.ms",
    "reconnect.backoff.max.ms",
    "reconnect.backoff.ms",
    "request.required.acks",
    "request.timeout.ms",
    "retries",
    "retry.backoff.max.ms",
    "retry.backoff.ms",
    "sasl.kerberos.keytab",
    "sasl.kerberos.min.time.before.relogin",
    "sasl.kerberos.principal",
    "sasl.kerberos.service.name",
    "sasl.mechanism",
    "sasl.mechanisms",
    "sasl.oauthbearer.assertion.algorithm",
    "sasl.oauthbearer.assertion.claim.aud",
    "sasl.oauthbearer.assertion.claim.exp.seconds",
    "sasl.oauthbearer.assertion.claim.iss",
    "sasl.oauthbearer.assertion.claim.jti.include",
    "sasl.oauthbearer.assertion.claim.nbf.seconds",
    "sasl.oauthbearer.assertion.claim.sub",
    "sasl.oauthbearer.assertion.file",
    "sasl.oauthbearer.assertion.jwt.template.file",
    "sasl.oauthbearer.assertion.private.key.file",
    "sasl.oauthbearer.client.credentials.client.id",
    "sasl.oauthbearer.client.id",
    "sasl.oauthbearer.grant.type",
    "sasl.oauthbearer.metadata.authentication.type",
    "sasl.oauthbearer.method",
    "sasl.oauthbearer.scope",
    "sasl.oauthbearer.token.endpoint.url",
    "sasl.username",
    "security.protocol",
    "session.timeout.ms",
    "socket.blocking.max.ms",
    "socket.connection.setup.timeout.ms",
    "socket.keepalive.enable",
    "socket.max.fails",
    "socket.nagle.disable",
    "socket.receive.buffer.bytes",
    "socket.send.buffer.bytes",
    "socket.timeout.ms",
    "ssl.ca.certificate.stores",
    "ssl.ca.location",
    "ssl.ca.pem",
    "ssl.certificate.location",
    "ssl.certificate.pem",
    "ssl.cipher.suites",
    "ssl.crl.location",
    "ssl.curves.list",
    "ssl.endpoint.identification.algorithm",
    "ssl.engine.id",
    "ssl.engine.location",
    "ssl.key.location",
    "ssl.keystore.location",
    "ssl.providers",
    "ssl.sigalgs.list",
    "statistics.interval.ms",
    "sticky.partitioning.linger.ms",
    "topic.blacklist",
    "topic.metadata.propagation.max.ms",
    "topic.metadata.refresh.fast.cnt",
    "topic.metadata.refresh.fast.interval.ms",
    "topic.metadata.refresh.interval.ms",
    "topic.metadata.refresh.sparse",
    "transaction.timeout.ms",
    "transactional.id",
];

/// MongoDB connection-string options whose values are not secret (the
/// driver specification's names, compared case-insensitively as the
/// driver does). Secret or unknown, and so redacted: among others
/// `authMechanismProperties` (may hold `AWS_SESSION_TOKEN:...`),
/// `tlsCertificateKeyFilePassword` and `proxyPassword`.
const PUBLIC_URI_OPTIONS: &[&str] = &[
    "appname",
    "authmechanism",
    "authsource",
    "compressors",
    "connecttimeoutms",
    "directconnection",
    "heartbeatfrequencyms",
    "journal",
    "loadbalanced",
    "localthresholdms",
    "maxconnecting",
    "maxidletimems",
    "maxpoolsize",
    "maxstalenessseconds",
    "minpoolsize",
    "proxyhost",
    "proxyport",
    "proxyusername",
    "readconcernlevel",
    "readpreference",
    "readpreferencetags",
    "replicaset",
    "retryreads",
    "retrywrites",
    "servermonitoringmode",
    "serverselectiontimeoutms",
    "serverselectiontryonce",
    "sockettimeoutms",
    "srvmaxhosts",
    "srvservicename",
    "ssl",
    "timeoutms",
    "tls",
    "tlsallowinvalidcertificates",
    "tlsallowinvalidhostnames",
    "tlscafile",
    "tlscertificatekeyfile",
    "tlsdisablecertificaterevocationcheck",
    "tlsdisableocspendpointcheck",
    "tlsinsecure",
    "uuidrepresentation",
    "w",
    "waitqueuetimeoutms",
    "wtimeoutms",
    "zlibcompressionlevel",
];

/// Whether the value of librdkafka property `key` may be printed.
pub fn is_public_kafka_option(key: &str) -> bool {
    PUBLIC_KAFKA_OPTIONS.contains(&key)
}

fn is_public_uri_option(name: &str) -> bool {
    PUBLIC_URI_OPTIONS.contains(&name.to_ascii_lowercase().as_str())
}

/// A connection string split where its secrets are: the password of
/// `scheme://user:password@hosts/...` and the values of the query options
/// that are not known to be public.
struct UriParts<'a> {
    /// Everything before the password (`scheme://user:`), or before the
    /// authority when there is no password.
    head: &'a str,
    password: Option<&'a str>,
    /// From the `@` (or the hosts) up to the `?`.
    middle: &'a str,
    /// `(name, value)` of every query option, in order.
    options: Vec<(&'a str, &'a str)>,
}

fn split_uri(uri: &str) -> UriParts<'_> {
    let scheme_end = uri.find("://").map_or(0, |i| i + 3);
    let (before_query, query) = match uri.find('?') {
        Some(q) => (&uri[..q], &uri[q + 1..]),
        None => (uri, ""),
    };
    let rest = &before_query[scheme_end.min(before_query.len())..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let (head_len, password, middle_start) = match (authority.rfind('@'), authority.find(':')) {
        (Some(at), Some(colon)) if colon < at => (
            scheme_end + colon + 1,
            Some(&authority[colon + 1..at]),
            scheme_end + at,
        ),
        _ => (scheme_end, None, scheme_end),
    };
    let options = query
        .split('&')
        .filter(|o| !o.is_empty())
        .map(|o| o.split_once('=').unwrap_or((o, "")))
        .collect();
    UriParts {
        head: &uri[..head_len.min(uri.len())],
        password,
        middle: &before_query[middle_start.min(before_query.len())..],
        options,
    }
}

/// The connection string with its password and secret option values
/// replaced by [`REDACTED`].
pub fn redact_uri(uri: &str) -> String {
    let parts = split_uri(uri);
    let mut out = String::with_capacity(uri.len());
    out.push_str(parts.head);
    if parts.password.is_some() {
        out.push_str(REDACTED);
    }
    out.push_str(parts.middle);
    for (i, (name, value)) in parts.options.iter().enumerate() {
        out.push(if i == 0 { '?' } else { '&' });
        out.push_str(name);
        out.push('=');
        out.push_str(if is_public_uri_option(name) {
            value
        } else {
            REDACTED
        });
    }
    out
}

/// The secret pieces of a connection string, as written and decoded.
fn uri_secrets(uri: &str) -> Vec<String> {
    let parts = split_uri(uri);
    let mut secrets: Vec<&str> = parts.password.into_iter().collect();
    secrets.extend(
        parts
            .options
            .iter()
            .filter(|(name, _)| !is_public_uri_option(name))
            .map(|(_, value)| *value),
    );
    let mut out = Vec::new();
    for s in secrets {
        out.push(s.to_string());
        let decoded = percent_decode(s);
        if decoded != s {
            out.push(decoded);
        }
    }
    out
}

/// `%XX` decoding, enough to also recognise a decoded password in a
/// driver's message. Invalid sequences are kept as they are.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Replaces every secret of the settings it was built from wherever it
/// appears in a text: client libraries echo values they refuse (librdkafka
/// does for any property), and such a message must not carry a secret to a
/// log or a terminal.
#[derive(Clone, Default)]
pub struct Scrubber {
    /// Longest first, so a secret containing another is replaced whole.
    secrets: Vec<SecretString>,
}

impl std::fmt::Debug for Scrubber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Scrubber({} secrets)", self.secrets.len())
    }
}

impl Scrubber {
    /// From the MongoDB URI and the librdkafka options.
    pub fn new(uri: &SecretString, kafka_options: &BTreeMap<String, SecretString>) -> Self {
        let mut values: Vec<String> = uri_secrets(uri.expose_secret());
        values.extend(
            kafka_options
                .iter()
                .filter(|(k, _)| !is_public_kafka_option(k))
                .map(|(_, v)| v.expose_secret().to_string()),
        );
        values.retain(|v| !v.is_empty());
        values.sort_by_key(|v| std::cmp::Reverse(v.len()));
        values.dedup();
        Scrubber {
            secrets: values.into_iter().map(SecretString::from).collect(),
        }
    }

    /// These secrets too (the Schema Registry's credentials).
    pub fn with<'a>(mut self, more: impl IntoIterator<Item = &'a SecretString>) -> Self {
        let mut values: Vec<String> = self
            .secrets
            .iter()
            .map(|s| s.expose_secret().to_string())
            .collect();
        values.extend(more.into_iter().map(|s| s.expose_secret().to_string()));
        values.retain(|v| !v.is_empty());
        values.sort_by_key(|v| std::cmp::Reverse(v.len()));
        values.dedup();
        self.secrets = values.into_iter().map(SecretString::from).collect();
        self
    }

    pub fn scrub(&self, text: &str) -> String {
        let mut out = text.to_string();
        for s in &self.secrets {
            out = out.replace(s.expose_secret(), REDACTED);
        }
        out
    }
}

/// serde: the URI with its secrets redacted.
pub fn serialize_uri<S: Serializer>(uri: &SecretString, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_uri(uri.expose_secret()))
}

/// serde: librdkafka options, the values of the non-public ones redacted.
pub fn serialize_kafka_options<S: Serializer>(
    options: &BTreeMap<String, SecretString>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_map(options.iter().map(|(k, v)| {
        let shown = if is_public_kafka_option(k) {
            v.expose_secret()
        } else {
            REDACTED
        };
        (k, shown)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_passwords_and_secret_options_are_redacted() {
        assert_eq!(
            redact_uri("mongodb://app:s3cret@db1:27017,db2/?replicaSet=rs0&tls=true"),
            "mongodb://app:<redacted>@db1:27017,db2/?replicaSet=rs0&tls=true"
        );
        assert_eq!(
            redact_uri("mongodb://127.0.0.1:27017/"),
            "mongodb://127.0.0.1:27017/"
        );
        assert_eq!(redact_uri("mongodb+srv://user@h/"), "mongodb+srv://user@h/");
        assert_eq!(
            redact_uri(
                "mongodb://h/?authMechanism=MONGODB-AWS&authMechanismProperties=AWS_SESSION_TOKEN:tok\
                 &tlsCertificateKeyFilePassword=pw&futureOption=x"
            ),
            "mongodb://h/?authMechanism=MONGODB-AWS&authMechanismProperties=<redacted>\
             &tlsCertificateKeyFilePassword=<redacted>&futureOption=<redacted>"
        );
        // A password with ':' and a query without a path.
        assert_eq!(
            redact_uri("mongodb://u:a:b@h?w=majority"),
            "mongodb://u:<redacted>@h?w=majority"
        );
    }

    #[test]
    fn every_secret_of_the_uri_and_the_options_is_scrubbed_also_decoded() {
        let uri = SecretString::from(
            "mongodb://app:p%40ss@h/?authMechanismProperties=AWS_SESSION_TOKEN:tok123&w=1",
        );
        let options: BTreeMap<String, SecretString> = [
            ("sasl.password", "hunter2"),
            (
                "sasl.oauthbearer.assertion.private.key.passphrase",
                "phrase9",
            ),
            ("security.protocol", "SASL_SSL"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), SecretString::from(v)))
        .collect();
        let s = Scrubber::new(&uri, &options);
        let text = "refused p@ss, p%40ss, AWS_SESSION_TOKEN:tok123, hunter2, phrase9 over SASL_SSL";
        let out = s.scrub(text);
        for secret in ["p@ss", "p%40ss", "tok123", "hunter2", "phrase9"] {
            assert!(!out.contains(secret), "{secret} in {out}");
        }
        assert!(out.contains("SASL_SSL"), "{out}");
    }

    #[test]
    fn unknown_kafka_options_count_as_secret() {
        assert!(is_public_kafka_option("security.protocol"));
        assert!(!is_public_kafka_option("sasl.password"));
        assert!(!is_public_kafka_option(
            "sasl.oauthbearer.assertion.private.key.passphrase"
        ));
        assert!(!is_public_kafka_option("some.future.option"));
        for o in SECRET_KAFKA_OPTIONS {
            assert!(!is_public_kafka_option(o), "{o}");
        }
    }
}
