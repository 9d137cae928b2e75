//! Kafka: the group consumer (manual offsets, rebalance bookkeeping) and
//! the dead-letter producer.
//!
//! Offsets: `enable.auto.offset.store=false` and `enable.auto.commit=false`.
//! After a batch is durably handled, the pipeline stores the *next* offset
//! to read (last handled + 1, Kafka's convention) and commits it. The
//! rebalance callbacks run inside `recv()` on the pipeline's own task and
//! tell it what changed as [`GroupEvent`] messages, which it reads before
//! it commits: it commits only partitions it still owns.

use std::collections::BTreeSet;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::ToBytes;
use rdkafka::producer::{BaseProducer, DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::TopicPartitionList;

use secrecy::ExposeSecret;

use crate::config::Settings;
use crate::metrics::Metrics;
use crate::offsets::TopicPartition;

mod dead_letter;
pub mod headers;

pub use dead_letter::{send_dead_letter, DeadLetter, OUR_HEADER_PREFIX};

/// Header names on dead-letter records.
pub const H_ERROR_KIND: &str = "tradebucket.error.kind";
pub const H_ERROR_MESSAGE: &str = "tradebucket.error.message";
pub const H_SOURCE_TOPIC: &str = "tradebucket.source.topic";
pub const H_SOURCE_PARTITION: &str = "tradebucket.source.partition";
pub const H_SOURCE_OFFSET: &str = "tradebucket.source.offset";
/// On a dead letter shortened to fit the dead-letter topic (see
/// [`DeadLetter::shortened`]): what was left out, and the original
/// payload's length and SHA-256, so it can be matched with its source.
pub const H_SHORTENED: &str = "tradebucket.shortened";
pub const H_PAYLOAD_LENGTH: &str = "tradebucket.payload.length";
pub const H_PAYLOAD_SHA256: &str = "tradebucket.payload.sha256";

/// What kind of consumer error, as the `kind` label of
/// `tradebucket_consumer_errors_total` (a bounded set).
pub fn consumer_error_kind(e: &KafkaError) -> &'static str {
    use RDKafkaErrorCode as C;
    if matches!(e, KafkaError::MessageConsumptionFatal(_)) {
        return "fatal";
    }
    match e.rdkafka_error_code() {
        Some(C::BrokerTransportFailure | C::AllBrokersDown | C::Resolve | C::RequestTimedOut) => {
            "transport"
        }
        Some(C::AutoOffsetReset | C::OffsetOutOfRange) => "offset_reset",
        Some(C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition) => {
            "unknown_topic_or_partition"
        }
        Some(
            C::TopicAuthorizationFailed
            | C::GroupAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::Authentication
            | C::SaslAuthenticationFailed,
        ) => "authorization",
        Some(C::Fatal) => "fatal",
        _ => "other",
    }
}

/// Every value [`consumer_error_kind`] returns.
pub const CONSUMER_ERROR_KINDS: [&str; 6] = [
    "transport",
    "offset_reset",
    "unknown_topic_or_partition",
    "authorization",
    "fatal",
    "other",
];

/// A change of this member's assignment, sent by the rebalance callbacks
/// in the order they ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupEvent {
    Assigned(Vec<TopicPartition>),
    Revoked(Vec<TopicPartition>),
}

pub struct ConsumerCtx {
    /// Where the rebalance callbacks report to the loop.
    events: Sender<GroupEvent>,
    /// The partitions this member owns, for the statistics callback's lag
    /// series only (it runs on librdkafka's own thread, not the loop's).
    owned: Mutex<BTreeSet<TopicPartition>>,
    metrics: Metrics,
}

impl ClientContext for ConsumerCtx {
    fn stats(&self, stats: Statistics) {
        // Only partitions this member owns: a partition handed to another
        // member is reported there, and a stale series here would make a
        // group-wide sum of lag wrong.
        let assigned = match self.owned.lock() {
            Ok(owned) => owned.clone(),
            Err(_) => return,
        };
        for (topic, t) in &stats.topics {
            for (partition, p) in &t.partitions {
                // -1 is librdkafka's "unknown" (and the internal UA partition).
                if *partition < 0 {
                    continue;
                }
                let label = partition.to_string();
                if assigned.contains(&(topic.clone(), *partition)) {
                    if p.consumer_lag >= 0 {
                        self.metrics
                            .consumer_lag
                            .with_label_values(&[topic.as_str(), &label])
                            .set(p.consumer_lag);
                    }
                } else {
                    self.forget_lag(topic, *partition);
                }
            }
        }
    }
}

impl ConsumerCtx {
    /// Records an assignment change for the lag series and the gauge, and
    /// tells the loop.
    fn changed(&self, event: GroupEvent) {
        if let Ok(mut owned) = self.owned.lock() {
            match &event {
                GroupEvent::Assigned(tps) => owned.extend(tps.iter().cloned()),
                GroupEvent::Revoked(tps) => tps.iter().for_each(|tp| {
                    owned.remove(tp);
                }),
            }
            self.metrics.assigned_partitions.set(owned.len() as i64);
        }
        // The receiver is gone only when the loop has ended.
        let _ = self.events.send(event);
    }

    fn forget_lag(&self, topic: &str, partition: i32) {
        // Err only means the series did not exist.
        let _ = self
            .metrics
            .consumer_lag
            .remove_label_values(&[topic, &partition.to_string()]);
    }
}

fn partitions(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_string(), e.partition()))
        .collect()
}

impl ConsumerContext for ConsumerCtx {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            // Hand over cleanly: commit the stored (durably handled) offsets
            // now, so the next owner starts right after them.
            if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
                // "No offset stored" is the normal case after a commit.
                tracing::debug!(error = %e, "commit on revoke");
            }
            let revoked = partitions(tpl);
            tracing::info!(partitions = ?revoked, "partitions revoked");
            self.metrics
                .rebalances
                .with_label_values(&["revoked"])
                .inc();
            for (topic, partition) in &revoked {
                self.forget_lag(topic, *partition);
            }
            self.changed(GroupEvent::Revoked(revoked));
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let assigned = partitions(tpl);
                tracing::info!(partitions = ?assigned, "partitions assigned");
                self.metrics
                    .rebalances
                    .with_label_values(&["assigned"])
                    .inc();
                self.changed(GroupEvent::Assigned(assigned));
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        match result {
            Ok(()) => self.metrics.offset_commits.with_label_values(&["ok"]).inc(),
            Err(e) => {
                self.metrics
                    .offset_commits
                    .with_label_values(&["error"])
                    .inc();
                tracing::warn!(error = %e, "offset commit failed; the next commit supersedes it");
            }
        }
    }
}

/// Layering: our tunables, then the operator's `kafka.options` (security,
/// tuning), then the settings the guarantees depend on, which no option
/// may override.
fn client_config(
    settings: &Settings,
    tunables: &[(&str, String)],
    fixed: &[(&str, String)],
) -> ClientConfig {
    let k = &settings.kafka;
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &k.brokers)
        .set("client.id", &k.client_id)
        .set_log_level(RDKafkaLogLevel::Warning);
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

fn consumer_config(settings: &Settings) -> ClientConfig {
    let k = &settings.kafka;
    client_config(
        settings,
        &[
            (
                "auto.offset.reset",
                k.auto_offset_reset.as_str().to_string(),
            ),
            ("session.timeout.ms", millis(k.session_timeout)),
            ("max.poll.interval.ms", millis(k.max_poll_interval)),
            // Lag per partition comes from librdkafka's statistics.
            ("statistics.interval.ms", "5000".to_string()),
            // Prefetched messages waiting for the loop: librdkafka's 64 MiB
            // default would be most of the worker's memory; 16 MiB still
            // holds several default batches of typical events.
            ("queued.max.messages.kbytes", "16384".to_string()),
            // That bound counts values only (librdkafka 2.12 sizes a
            // queued record by its payload), and every fetch response stays
            // in memory while one of its records is queued: records with
            // large keys or headers were prefetched far ahead (147 MiB
            // peak with 20,000 records of 8 KiB headers, 84-88 MiB with
            // this). A record count bounds them too: 2,000 records of
            // 8 KiB headers are the same 16 MiB, and one fetch brings
            // thousands of typical events anyway.
            ("queued.min.messages", "2000".to_string()),
            // Once the queue is full, librdkafka looks again only after
            // this long; its 1 s default would idle the loop most of a
            // second after each 2,000 records.
            ("fetch.queue.backoff.ms", "10".to_string()),
            // Kafka answers a fetch as soon as data is there, but a broker
            // that holds it until the wait ends (the local test broker does)
            // would add up to 500 ms to every event's delay at low rates.
            // Idle, this costs one empty fetch per broker every 100 ms.
            ("fetch.wait.max.ms", "100".to_string()),
        ],
        &[
            ("group.id", k.group_id.clone()),
            ("enable.auto.commit", "false".to_string()),
            ("enable.auto.offset.store", "false".to_string()),
            ("enable.partition.eof", "false".to_string()),
        ],
    )
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

/// The group consumer, subscribed, and the receiving end of its
/// rebalance callbacks' [`GroupEvent`]s.
pub fn consumer(
    settings: &Settings,
    metrics: Metrics,
) -> Result<(StreamConsumer<ConsumerCtx>, Receiver<GroupEvent>), SetupError> {
    let (events, received) = channel();
    let context = ConsumerCtx {
        events,
        owned: Mutex::new(BTreeSet::new()),
        metrics,
    };
    let consumer: StreamConsumer<ConsumerCtx> = consumer_config(settings)
        .create_with_context(context)
        .map_err(|e| SetupError::new(settings, e))?;
    let topics: Vec<&str> = settings.kafka.topics.iter().map(String::as_str).collect();
    consumer
        .subscribe(&topics)
        .map_err(|e| SetupError::new(settings, e))?;
    Ok((consumer, received))
}

pub fn producer(settings: &Settings) -> Result<FutureProducer, SetupError> {
    producer_config(settings)
        .create()
        .map_err(|e| SetupError::new(settings, e))
}

/// Hands `record` to librdkafka now, waiting while its local queue is full
/// (the producer's own thread empties it as the broker acknowledges). The
/// async `FutureProducer::send` would only enqueue when first polled, so a
/// caller that gathers its futures would send nothing until it awaits them.
pub async fn enqueue<K, P>(
    producer: &FutureProducer,
    mut record: FutureRecord<'_, K, P>,
) -> KafkaResult<DeliveryFuture>
where
    K: ToBytes + ?Sized,
    P: ToBytes + ?Sized,
{
    loop {
        match producer.send_result(record) {
            Ok(delivery) => return Ok(delivery),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                record = back;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err((e, _)) => return Err(e),
        }
    }
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
/// without joining the group or sending anything: a misspelt or unsupported
/// `kafka.options` entry fails `check-config`, not the first deployment.
pub fn check_options(settings: &Settings) -> Result<(), SetupError> {
    let scrubbed = |e| SetupError::new(settings, e);
    consumer_config(settings)
        .create::<BaseConsumer>()
        .map_err(scrubbed)?;
    producer_config(settings)
        .create::<BaseProducer>()
        .map_err(scrubbed)?;
    Ok(())
}

/// librdkafka's `*.ms` properties.
fn millis(d: Duration) -> String {
    d.as_millis().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn settings_with(options: &[(&str, &str)]) -> Settings {
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
            ("fetch.max.bytes", "1048576"),
        ]);
        let c = consumer_config(&s);
        assert_eq!(c.get("enable.auto.commit"), Some("false"));
        assert_eq!(c.get("enable.auto.offset.store"), Some("false"));
        assert_eq!(c.get("fetch.max.bytes"), Some("1048576"));
        assert_eq!(producer_config(&s).get("enable.idempotence"), Some("true"));
    }

    /// librdkafka quotes the value of a property it cannot take (here: the
    /// OAuth/OIDC ones, which need libcurl, not built in), so a refused
    /// secret would reach `check-config`'s output and the start-up error.
    #[test]
    fn librdkafka_refusals_never_carry_a_secret() {
        let secret_options = crate::config::SECRET_KAFKA_OPTIONS;
        let mut echoed = 0;
        for protocol in ["PLAINTEXT", "SSL", "SASL_SSL"] {
            for option in secret_options {
                let value = "Se5cret-value";
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
