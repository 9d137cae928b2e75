//! Kafka: the group consumer (manual offsets, rebalance bookkeeping) and
//! the dead-letter producer.
//!
//! Offsets: `enable.auto.offset.store=false` and `enable.auto.commit=false`.
//! After a batch is durably handled, the pipeline stores the *next* offset
//! to read (last handled + 1, Kafka's convention) and commits it. The
//! rebalance callback runs inside `recv()` on the pipeline's own task, so it
//! never races a batch being written: between batches nothing is in flight
//! but the unwritten buffer, which the pipeline still writes (see
//! `Pipeline::apply_revocations` for why) but commits only for partitions
//! it still owns.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaResult;
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::statistics::Statistics;
use rdkafka::TopicPartitionList;

use crate::config::Settings;
use crate::event::Reject;
use crate::metrics::Metrics;
use crate::offsets::TopicPartition;

/// Header names on dead-letter records.
pub const H_ERROR_KIND: &str = "tradebucket.error.kind";
pub const H_ERROR_MESSAGE: &str = "tradebucket.error.message";
pub const H_SOURCE_TOPIC: &str = "tradebucket.source.topic";
pub const H_SOURCE_PARTITION: &str = "tradebucket.source.partition";
pub const H_SOURCE_OFFSET: &str = "tradebucket.source.offset";

/// What the rebalance callback tells the pipeline.
#[derive(Debug, Default)]
pub struct GroupState {
    /// Partitions revoked since the pipeline last looked.
    pub revoked: Vec<TopicPartition>,
    /// The current assignment.
    pub assignment: BTreeSet<TopicPartition>,
    /// Bumped on every assignment change.
    pub generation: u64,
}

pub struct ConsumerCtx {
    pub group: Arc<Mutex<GroupState>>,
    pub metrics: Metrics,
}

impl ClientContext for ConsumerCtx {
    fn stats(&self, stats: Statistics) {
        for (topic, t) in &stats.topics {
            for (partition, p) in &t.partitions {
                // -1 is librdkafka's "unknown" (and the internal UA partition).
                if *partition >= 0 && p.consumer_lag >= 0 {
                    self.metrics
                        .consumer_lag
                        .with_label_values(&[topic.as_str(), &partition.to_string()])
                        .set(p.consumer_lag);
                }
            }
        }
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
            let mut g = self.group.lock().expect("group state lock");
            for tp in &revoked {
                g.assignment.remove(tp);
            }
            g.revoked.extend(revoked);
            g.generation += 1;
            self.metrics
                .assigned_partitions
                .set(g.assignment.len() as i64);
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
                let mut g = self.group.lock().expect("group state lock");
                g.assignment.extend(assigned);
                g.generation += 1;
                self.metrics
                    .assigned_partitions
                    .set(g.assignment.len() as i64);
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
        c.set(key, value);
    }
    for (key, value) in fixed {
        c.set(*key, value);
    }
    c
}

pub fn consumer(
    settings: &Settings,
    metrics: Metrics,
) -> KafkaResult<(StreamConsumer<ConsumerCtx>, Arc<Mutex<GroupState>>)> {
    let k = &settings.kafka;
    let group = Arc::new(Mutex::new(GroupState::default()));
    let c = client_config(
        settings,
        &[
            ("auto.offset.reset", k.auto_offset_reset.clone()),
            ("session.timeout.ms", k.session_timeout_ms.to_string()),
            ("max.poll.interval.ms", k.max_poll_interval_ms.to_string()),
            // Lag per partition comes from librdkafka's statistics.
            ("statistics.interval.ms", "5000".to_string()),
        ],
        &[
            ("group.id", k.group_id.clone()),
            ("enable.auto.commit", "false".to_string()),
            ("enable.auto.offset.store", "false".to_string()),
            ("enable.partition.eof", "false".to_string()),
        ],
    );
    let consumer: StreamConsumer<ConsumerCtx> = c.create_with_context(ConsumerCtx {
        group: group.clone(),
        metrics,
    })?;
    let topics: Vec<&str> = k.topics.iter().map(String::as_str).collect();
    consumer.subscribe(&topics)?;
    Ok((consumer, group))
}

pub fn producer(settings: &Settings) -> KafkaResult<FutureProducer> {
    client_config(
        settings,
        &[
            ("linger.ms", "5".to_string()),
            ("message.timeout.ms", "30000".to_string()),
        ],
        // Idempotence: a retried send never writes a dead letter twice in
        // one producer session (acks=all comes with it).
        &[("enable.idempotence", "true".to_string())],
    )
    .create()
}

/// One event bound for the dead-letter topic.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    /// The original record's headers, kept.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    pub reject: Reject,
}

/// Sends one dead letter and waits for the broker's acknowledgement.
pub async fn send_dead_letter(
    producer: &FutureProducer,
    dlq_topic: &str,
    dl: &DeadLetter,
) -> Result<(), rdkafka::error::KafkaError> {
    let mut headers = OwnedHeaders::new_with_capacity(dl.headers.len() + 5);
    for (k, v) in &dl.headers {
        headers = headers.insert(Header {
            key: k,
            value: v.as_deref(),
        });
    }
    let partition = dl.partition.to_string();
    let offset = dl.offset.to_string();
    for (k, v) in [
        (H_ERROR_KIND, dl.reject.kind.as_str()),
        (H_ERROR_MESSAGE, dl.reject.message.as_str()),
        (H_SOURCE_TOPIC, dl.topic.as_str()),
        (H_SOURCE_PARTITION, partition.as_str()),
        (H_SOURCE_OFFSET, offset.as_str()),
    ] {
        headers = headers.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(dlq_topic).headers(headers);
    if let Some(k) = &dl.key {
        record = record.key(k.as_slice());
    }
    if let Some(p) = &dl.payload {
        record = record.payload(p.as_slice());
    }
    producer
        .send(record, Duration::from_secs(5))
        .await
        .map(|_| ())
        .map_err(|(e, _)| e)
}

/// Copies a message's headers (for dead letters).
pub fn copy_headers<H: Headers>(headers: Option<&H>) -> Vec<(String, Option<Vec<u8>>)> {
    headers
        .map(|h| {
            h.iter()
                .map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec)))
                .collect()
        })
        .unwrap_or_default()
}
