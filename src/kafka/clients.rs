//! The Kafka clients, built from the settings in one place each: the
//! group consumer, the dead-letter producer, the clients that join no
//! group (end offsets, readers), and the checks of `kafka.options`.

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::admin::AdminClient;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::TopicPartitionList;

use secrecy::ExposeSecret;

use crate::config::{GroupProtocol, KafkaSettings, Settings};
use crate::health::Health;
use crate::metrics::Metrics;
use crate::offsets::TopicPartition;

use super::acked::AckedProducer;
use super::context::{ConsumerCtx, Producer, ScrubbedLogs};
use super::stall::StallWatch;
use super::GroupEvent;

/// Layering: our tunables, then the operator's `kafka.options` (security,
/// tuning), then the settings the guarantees depend on, which no option
/// may override.
fn client_config(
    settings: &Settings,
    tunables: &[(&str, String)],
    fixed: &[(&str, String)],
) -> ClientConfig {
    let k = &settings.kafka;
    // librdkafka's own debug contexts (`kafka.options.debug`) log at debug
    // level; without this they would be dropped before `log.level` sees them.
    let level = if k.options.contains_key("debug") {
        RDKafkaLogLevel::Debug
    } else {
        RDKafkaLogLevel::Warning
    };
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &k.brokers)
        .set("client.id", &k.client_id)
        // Every request's time limit, for every client (fetch, join,
        // heartbeat, commit, ListOffsets, produce): a broker that stops
        // answering is disconnected and retried, never waited on.
        .set("socket.timeout.ms", millis(settings.timeouts.kafka_request))
        .set_log_level(level);
    for (key, value) in tunables {
        c.set(*key, value);
    }
    for (key, value) in &k.options {
        c.set(key, value.expose_secret());
    }
    for (key, value) in fixed {
        c.set(*key, value);
    }
    c
}

/// How far a reading consumer fetches ahead of what it has handed out:
/// the worker's consumer and the readers (`dlq`, `reconcile`) alike.
const PREFETCH: [(&str, &str); 4] = [
    // Prefetched messages waiting for the loop: librdkafka's 64 MiB
    // default would be most of the worker's memory; 16 MiB still holds
    // several default batches of typical events.
    ("queued.max.messages.kbytes", "16384"),
    // That bound counts values only (librdkafka 2.12 sizes a queued record
    // by its payload), and every fetch response stays in memory while one
    // of its records is queued: records with large keys or headers were
    // prefetched far ahead (147 MiB peak with 20,000 records of 8 KiB
    // headers, 84-88 MiB with this). A record count bounds them too: 2,000
    // records of 8 KiB headers are the same 16 MiB, and one fetch brings
    // thousands of typical events anyway.
    ("queued.min.messages", "2000"),
    // Once the queue is full, librdkafka looks again only after this long;
    // its 1 s default would idle the loop most of a second after each 2,000
    // records.
    ("fetch.queue.backoff.ms", "10"),
    // A fetch response stays in memory until its last record is read:
    // Kafka returns up to `max.partition.fetch.bytes` (1 MiB) for each
    // partition asked, up to this, whose 50 MiB default a consumer of many
    // partitions reaches (32 partitions of 8 KiB-header records peaked at
    // 142 MiB with 16 MiB here, 118 to 126 with 4 MiB). On Apache Kafka,
    // which answers a backlog's fetches at once, 4 MiB still kept the
    // worker at 171 to 175 MiB over a million-event backlog, against 133
    // to 137 with 1 MiB, which also cut its CPU by a fifth (measured, not
    // yet explained; docs/benchmarks.md, "Session 28").
    // 1 MiB is still about 5,000 typical events a fetch. librdkafka refuses
    // less than `message.max.bytes` (1,000,000 by default): raise both
    // together in `kafka.options`.
    ("fetch.max.bytes", "1048576"),
];

fn prefetch() -> impl Iterator<Item = (&'static str, String)> {
    PREFETCH.iter().map(|(k, v)| (*k, v.to_string()))
}

fn consumer_config(settings: &Settings) -> ClientConfig {
    let k = &settings.kafka;
    let tunables: Vec<(&str, String)> = [
        (
            "auto.offset.reset",
            k.auto_offset_reset.as_str().to_string(),
        ),
        ("group.protocol", k.group_protocol.as_str().to_string()),
        ("max.poll.interval.ms", millis(k.max_poll_interval)),
        // Lag per partition comes from librdkafka's statistics.
        ("statistics.interval.ms", "5000".to_string()),
        ("fetch.wait.max.ms", millis(k.fetch_wait_max)),
    ]
    .into_iter()
    .chain(session(k))
    .chain(prefetch())
    .collect();
    client_config(
        settings,
        &tunables,
        &[
            ("group.id", k.group_id.clone()),
            ("enable.auto.commit", "false".to_string()),
            ("enable.auto.offset.store", "false".to_string()),
            ("enable.partition.eof", "false".to_string()),
        ],
    )
}

/// The classic protocol's session timeout is the client's to set; under
/// the `consumer` protocol (KIP-848) the broker's
/// `group.consumer.session.timeout.ms` rules and librdkafka refuses it.
fn session(k: &KafkaSettings) -> Option<(&'static str, String)> {
    (k.group_protocol == GroupProtocol::Classic)
        .then(|| ("session.timeout.ms", millis(k.session_timeout)))
}

fn producer_config(settings: &Settings) -> ClientConfig {
    client_config(
        settings,
        &[
            ("linger.ms", "5".to_string()),
            (
                "message.timeout.ms",
                millis(settings.timeouts.dead_letter_delivery),
            ),
        ],
        // Idempotence: a retried send never writes a dead letter twice in
        // one producer session (acks=all comes with it).
        &[("enable.idempotence", "true".to_string())],
    )
}

/// The group consumer, subscribed; the receiving end of its rebalance
/// callbacks' [`GroupEvent`]s; and the fetch progress its statistics
/// report.
pub struct GroupConsumer {
    pub consumer: StreamConsumer<ConsumerCtx>,
    pub events: Receiver<GroupEvent>,
    pub stalls: Arc<Mutex<StallWatch>>,
}

pub fn consumer(
    settings: &Settings,
    metrics: Metrics,
    health: Arc<Health>,
) -> Result<GroupConsumer, SetupError> {
    let (events, received) = channel();
    let stalls = Arc::new(Mutex::new(StallWatch::new(
        settings.timeouts.partition_stall,
    )));
    let context = ConsumerCtx::new(settings, events, stalls.clone(), metrics, health);
    let consumer: StreamConsumer<ConsumerCtx> = consumer_config(settings)
        .create_with_context(context)
        .map_err(|e| SetupError::new(settings, e))?;
    let topics: Vec<&str> = settings.kafka.topics.iter().map(String::as_str).collect();
    consumer
        .subscribe(&topics)
        .map_err(|e| SetupError::new(settings, e))?;
    Ok(GroupConsumer {
        consumer,
        events: received,
        stalls,
    })
}

/// A client of its own for asking Kafka where partitions end: it joins no
/// group and fetches nothing. The stall watcher's queries block, so they
/// run on a blocking thread, away from the loop's consumer.
pub fn end_offsets_client(settings: &Settings) -> Result<BaseConsumer<ScrubbedLogs>, SetupError> {
    client_config(settings, &[], &[])
        .create_with_context(ScrubbedLogs::new(settings))
        .map_err(|e| SetupError::new(settings, e))
}

/// A consumer for reading assigned partitions (`tradebucket dlq`): it
/// never subscribes or commits, but librdkafka refuses to assign without a
/// `group.id`, so it names `group` without joining it.
pub fn reader_client(
    settings: &Settings,
    group: &str,
) -> Result<BaseConsumer<ScrubbedLogs>, SetupError> {
    let fixed = [
        ("group.id", group.to_string()),
        ("enable.auto.commit", "false".to_string()),
        ("enable.auto.offset.store", "false".to_string()),
    ];
    let tunables: Vec<(&str, String)> = prefetch().collect();
    client_config(settings, &tunables, &fixed)
        .create_with_context(ScrubbedLogs::new(settings))
        .map_err(|e| SetupError::new(settings, e))
}

/// The partitions of `topic`, from the cluster's metadata; none if the
/// topic does not exist (or Kafka answered it with an error).
pub fn partitions(
    client: &BaseConsumer<ScrubbedLogs>,
    topic: &str,
    timeout: Duration,
) -> KafkaResult<Vec<i32>> {
    let metadata = client.fetch_metadata(Some(topic), timeout)?;
    Ok(metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect())
}

/// The end offset (at the client's `isolation.level`: the last stable
/// offset by default) of each of `tps`, in one ListOffsets request per
/// broker. Partitions Kafka answered with an error are left out.
pub fn end_offsets(
    client: &BaseConsumer<ScrubbedLogs>,
    tps: &[TopicPartition],
    timeout: Duration,
) -> KafkaResult<BTreeMap<TopicPartition, i64>> {
    let mut query = TopicPartitionList::new();
    for (topic, partition) in tps {
        // The "timestamp" -1 asks ListOffsets for the end (Kafka's LATEST).
        query.add_partition_offset(topic, *partition, rdkafka::Offset::End)?;
    }
    let answer = client.offsets_for_times(query, timeout)?;
    Ok(answer
        .elements()
        .iter()
        .filter(|e| e.error().is_ok())
        .filter_map(|e| match e.offset() {
            rdkafka::Offset::Offset(end) => Some(((e.topic().into(), e.partition()), end)),
            _ => None,
        })
        .collect())
}

/// The dead-letter producer's settings, for `dlq replay`.
pub fn producer(settings: &Settings) -> Result<Producer, SetupError> {
    producer_config(settings)
        .create_with_context(ScrubbedLogs::new(settings))
        .map_err(|e| SetupError::new(settings, e))
}

/// The worker's dead-letter producer: the same settings as [`producer`],
/// and a polling thread that sleeps while there is nothing to send
/// ([`AckedProducer`]).
pub fn dead_letter_producer(settings: &Settings) -> Result<AckedProducer, SetupError> {
    AckedProducer::new(&producer_config(settings), ScrubbedLogs::new(settings))
        .map_err(|e| SetupError::new(settings, e))
}

/// The producer of `tradebucket produce`: synthetic trades in bulk, so
/// larger batches and a deeper local queue than the dead-letter producer,
/// and a minute for each delivery.
pub fn bulk_producer(settings: &Settings) -> Result<Producer, SetupError> {
    let tunables = [
        ("linger.ms", "20".to_string()),
        ("batch.num.messages", "10000".to_string()),
        ("queue.buffering.max.messages", "200000".to_string()),
        ("message.timeout.ms", "60000".to_string()),
    ];
    client_config(
        settings,
        &tunables,
        &[("enable.idempotence", "true".to_string())],
    )
    .create_with_context(ScrubbedLogs::new(settings))
    .map_err(|e| SetupError::new(settings, e))
}

/// An admin client (`tradebucket init --partitions` creates topics).
pub fn admin(settings: &Settings) -> Result<AdminClient<ScrubbedLogs>, SetupError> {
    client_config(settings, &[], &[])
        .create_with_context(ScrubbedLogs::new(settings))
        .map_err(|e| SetupError::new(settings, e))
}

/// A Kafka client librdkafka refused to create. The message is librdkafka's
/// with every secret of the settings removed: it quotes the value of a
/// property it refuses, and that may be a password.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SetupError(String);

impl SetupError {
    fn new(settings: &Settings, e: KafkaError) -> Self {
        SetupError(settings.scrubber().scrub(&e.to_string()))
    }
}

/// Has librdkafka check every property of both clients, names and values,
/// without joining the group or sending anything to a broker: a misspelt or
/// unsupported `kafka.options` entry fails `check-config`, not the first
/// deployment. Creating a client does start librdkafka's own login work,
/// though: with OIDC it requests a token from the token endpoint, with
/// GSSAPI it runs `sasl.kerberos.kinit.cmd`. Their failures are not errors
/// here (librdkafka only logs them); the brokers refuse the worker later.
pub fn check_options(settings: &Settings) -> Result<(), SetupError> {
    let scrubbed = |e| SetupError::new(settings, e);
    let logs = ScrubbedLogs::new(settings);
    consumer_config(settings)
        .create_with_context::<_, BaseConsumer<ScrubbedLogs>>(logs.clone())
        .map_err(scrubbed)?;
    // Created to be judged, then dropped.
    let _judged = producer_config(settings)
        .create_with_context::<_, Producer>(logs)
        .map_err(scrubbed)?;
    Ok(())
}

/// librdkafka's `*.ms` properties.
fn millis(d: Duration) -> String {
    d.as_millis().to_string()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::BTreeMap;

    pub(crate) fn settings_with(options: &[(&str, &str)]) -> Settings {
        let mut s = Settings::load_from(None, Some(BTreeMap::new())).unwrap();
        s.kafka.options = options
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string().into()))
            .collect();
        s
    }

    #[test]
    fn sasl_ssl_and_scram_pass_through_to_librdkafka() {
        let s = settings_with(&[
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "tradebucket"),
            ("sasl.password", "secret"),
        ]);
        check_options(&s).expect("librdkafka is built with SSL and SASL/SCRAM");
        assert_eq!(
            consumer_config(&s).get("security.protocol"),
            Some("SASL_SSL")
        );
    }

    /// Kerberos needs librdkafka built with Cyrus SASL (feature `gssapi`);
    /// without it, librdkafka refuses the mechanism.
    #[test]
    fn kerberos_gssapi_passes_through_to_librdkafka() {
        let s = settings_with(&[
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "GSSAPI"),
            ("sasl.kerberos.service.name", "kafka"),
            ("sasl.kerberos.principal", "tradebucket@EXAMPLE.COM"),
            // Does not exist, so the kinit librdkafka starts fails at once.
            ("sasl.kerberos.keytab", "/nonexistent/tradebucket.keytab"),
        ]);
        check_options(&s).expect("librdkafka is built with Cyrus SASL (GSSAPI)");
    }

    /// A stand-in OIDC token endpoint on loopback. Each request, head and
    /// body as text, goes to the receiver. The answer is a 401, which
    /// librdkafka does not retry (it waits 5 s before retrying a 5xx), so a
    /// client's drop does not wait for another attempt.
    fn token_endpoint() -> (String, Receiver<String>) {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/oauth2/token", listener.local_addr().unwrap());
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                let mut reader = BufReader::new(&conn);
                let (mut request, mut body_len) = (String::new(), 0);
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        break;
                    }
                    if let Some((name, value)) = line.split_once(':') {
                        if name.eq_ignore_ascii_case("content-length") {
                            body_len = value.trim().parse().unwrap_or(0);
                        }
                    }
                    request.push_str(&line);
                    if line == "\r\n" {
                        break;
                    }
                }
                let mut body = vec![0; body_len];
                let _ = reader.read_exact(&mut body);
                request.push_str(&String::from_utf8_lossy(&body));
                let _ = conn.write_all(
                    b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
                if tx.send(request).is_err() {
                    break;
                }
            }
        });
        (url, rx)
    }

    fn oidc_settings(token_endpoint: &str) -> Settings {
        settings_with(&[
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "OAUTHBEARER"),
            ("sasl.oauthbearer.method", "oidc"),
            ("sasl.oauthbearer.client.id", "tradebucket"),
            ("sasl.oauthbearer.client.secret", "Se5cret-value"),
            ("sasl.oauthbearer.token.endpoint.url", token_endpoint),
        ])
    }

    /// OAUTHBEARER with OIDC needs librdkafka built with libcurl (feature
    /// `curl`); without it, librdkafka refuses the `sasl.oauthbearer.*`
    /// properties of OIDC.
    #[test]
    fn oauthbearer_oidc_passes_through_to_librdkafka() {
        let (url, _requests) = token_endpoint();
        check_options(&oidc_settings(&url)).expect("librdkafka is built with libcurl (OIDC)");
    }

    /// Accepting the properties is not all: librdkafka itself asks the
    /// token endpoint for a token (client-credentials grant, client id and
    /// secret as HTTP basic authentication) as soon as a client exists.
    #[test]
    fn oidc_clients_request_a_token_from_the_endpoint() {
        let (url, requests) = token_endpoint();
        let consumer = consumer_config(&oidc_settings(&url))
            .create::<BaseConsumer>()
            .expect("librdkafka is built with libcurl (OIDC)");
        let request = requests
            .recv_timeout(Duration::from_secs(30))
            .expect("no token request within 30 s");
        drop(consumer);
        assert!(
            request.starts_with("POST /oauth2/token HTTP/1.1\r\n"),
            "{request}"
        );
        // base64("tradebucket:Se5cret-value")
        assert!(
            request.contains("\r\nAuthorization: Basic dHJhZGVidWNrZXQ6U2U1Y3JldC12YWx1ZQ==\r\n"),
            "{request}"
        );
        assert!(
            request.ends_with("\r\n\r\ngrant_type=client_credentials"),
            "{request}"
        );
    }

    /// librdkafka's debug lines reach the log only when its debug
    /// contexts are asked for: at debug level they are many per second.
    #[test]
    fn librdkafka_logs_debug_lines_only_when_debug_contexts_are_set() {
        let level = |c: ClientConfig| c.log_level as i32;
        let quiet = settings_with(&[]);
        assert_eq!(
            level(consumer_config(&quiet)),
            RDKafkaLogLevel::Warning as i32
        );
        let debug = settings_with(&[("debug", "cgrp")]);
        assert_eq!(
            level(consumer_config(&debug)),
            RDKafkaLogLevel::Debug as i32
        );
        assert_eq!(
            level(producer_config(&debug)),
            RDKafkaLogLevel::Debug as i32
        );
    }

    /// The classic protocol's session timeout is the client's; under the
    /// consumer protocol the broker's, and librdkafka must not be given it.
    /// Either way the client librdkafka builds from it is valid.
    #[test]
    fn the_group_protocol_decides_who_times_the_session() {
        let mut s = settings_with(&[]);
        let classic = consumer_config(&s);
        assert_eq!(classic.get("group.protocol"), Some("classic"));
        assert_eq!(classic.get("session.timeout.ms"), Some("45000"));
        s.kafka.group_protocol = GroupProtocol::Consumer;
        let consumer = consumer_config(&s);
        assert_eq!(consumer.get("group.protocol"), Some("consumer"));
        assert_eq!(consumer.get("session.timeout.ms"), None);
        check_options(&s).expect("librdkafka takes the consumer protocol's settings");
    }

    #[test]
    fn a_misspelt_option_is_reported_by_name() {
        let s = settings_with(&[("sasl.pasword", "x")]);
        let err = check_options(&s).unwrap_err().to_string();
        assert!(err.contains("sasl.pasword"), "{err}");
    }

    #[test]
    fn options_cannot_override_what_the_guarantees_depend_on() {
        let s = settings_with(&[
            ("enable.auto.commit", "true"),
            ("enable.auto.offset.store", "true"),
            ("enable.idempotence", "false"),
            ("fetch.max.bytes", "2097152"),
        ]);
        let c = consumer_config(&s);
        assert_eq!(c.get("enable.auto.commit"), Some("false"));
        assert_eq!(c.get("enable.auto.offset.store"), Some("false"));
        assert_eq!(c.get("fetch.max.bytes"), Some("2097152"));
        assert_eq!(producer_config(&s).get("enable.idempotence"), Some("true"));
    }

    /// A property librdkafka refuses comes back with its value quoted
    /// (rdkafka's "Client config error: <why> <name> <value>"), so a refused
    /// secret would reach `check-config`'s output and the start-up error.
    /// Every secret option is tried under each protocol (a build without
    /// libcurl refused the OIDC ones), and each misspelt as an operator
    /// might (`sasl.passwor`): librdkafka refuses an unknown name, always
    /// with the value, and the allowlist must treat it as secret.
    #[test]
    fn librdkafka_refusals_never_carry_a_secret() {
        let value = "Se5cret-value";
        let secret_options = crate::config::SECRET_KAFKA_OPTIONS;
        let misspelt = secret_options.map(|o| o[..o.len() - 1].to_string());
        let mut echoed = 0;
        for protocol in ["PLAINTEXT", "SSL", "SASL_SSL"] {
            for option in secret_options
                .iter()
                .copied()
                .chain(misspelt.iter().map(String::as_str))
            {
                let s = settings_with(&[("security.protocol", protocol), (option, value)]);
                let raw = consumer_config(&s).create::<BaseConsumer>().err();
                echoed += usize::from(raw.is_some_and(|e| e.to_string().contains(value)));
                if let Err(e) = check_options(&s) {
                    let text = e.to_string();
                    assert!(!text.contains(value), "{option}: {text}");
                }
                let Err(e) = producer(&s) else { continue };
                assert!(!e.to_string().contains(value), "{option}: {e}");
            }
        }
        assert!(
            echoed > 0,
            "librdkafka no longer echoes values: this test checks nothing"
        );
    }
}
