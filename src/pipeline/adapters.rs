//! The production side of the loop's seams: the Kafka consumer as its
//! [`Intake`], the dead-letter producer as its [`DeadLetterSink`], the
//! bucket writer as its [`BucketSink`], and the watchers that keep
//! readiness current apart from the loop: MongoDB reachable, Kafka
//! partitions read.

use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use super::seams::{
    BucketSink, Commit, ConsumerError, DeadLetterSink, Intake, Record, RecordKey, SendError,
};
use crate::bucket::store::{BucketStore, StoreError};
use crate::bucket::writer::{BucketWriter, Events, Outcome, WriteStats};
use crate::config::{Settings, TimeoutSettings};
use crate::health::Health;
use crate::kafka::stall::{self, StallWatch};
use crate::kafka::{self, ConsumerCtx, DeadLetter, GroupEvent};
use crate::metrics::{CommitResult, Metrics, RetryKind};
use crate::offsets::TopicPartition;

pub(crate) struct KafkaIntake {
    consumer: StreamConsumer<ConsumerCtx>,
    events: Receiver<GroupEvent>,
    /// Told which partitions are paused on purpose (never stalled).
    stalls: Arc<Mutex<StallWatch>>,
    metrics: Metrics,
    /// The names of the topics read so far, each shared by every record
    /// read from it (and its `Source`): one copy per topic, not two
    /// allocations per event.
    topics: Vec<Arc<str>>,
}

impl KafkaIntake {
    pub fn new(group: kafka::GroupConsumer, metrics: Metrics) -> Self {
        KafkaIntake {
            consumer: group.consumer,
            events: group.events,
            stalls: group.stalls,
            metrics,
            topics: Vec::new(),
        }
    }

    fn list(tps: &[TopicPartition]) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        for (topic, partition) in tps {
            tpl.add_partition(topic, *partition);
        }
        tpl
    }

    fn commit_failed(&self, e: &KafkaError) {
        let m = &self.metrics;
        m.commit(CommitResult::Error).inc();
        m.retry(RetryKind::Commit).inc();
        tracing::warn!(error = %e, "offset commit failed; the next one supersedes it");
    }
}

/// Commits the stored offsets without waiting, the result delivered to
/// `ConsumerCtx::commit_callback` when the loop polls the consumer.
///
/// rust-rdkafka 0.39's `commit_consumer_state(Async)` calls librdkafka's
/// `rd_kafka_commit` with no reply queue, so an asynchronous commit's
/// result is never delivered and the callback never runs
/// (fede1024/rust-rdkafka#856): `tradebucket_offset_commits_total` stayed
/// at 0 and a failed commit went unseen by its alert. librdkafka's
/// `rd_kafka_commit_queue` with the consumer's own queue (which the loop
/// polls through `recv`) delivers the result there as the offset-commit
/// event rust-rdkafka hands to the callback; that is also the fix
/// proposed upstream (fede1024/rust-rdkafka#857).
fn commit_async(consumer: &StreamConsumer<ConsumerCtx>) -> Result<(), KafkaError> {
    use rdkafka::bindings as rd;
    let rk = consumer.client().native_ptr();
    // SAFETY: `rk` is the handle of a consumer that lives through this
    // call. `rd_kafka_queue_get_consumer` returns a new reference to its
    // queue (null if it has none); the commit takes a reference of its own
    // for its reply (librdkafka's `RD_KAFKA_REPLYQ`), so ours is released
    // at once. Null offsets mean "the stored offsets", as for
    // `commit_consumer_state`.
    let err = unsafe {
        let queue = rd::rd_kafka_queue_get_consumer(rk);
        if queue.is_null() {
            return Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::Fail));
        }
        let err =
            rd::rd_kafka_commit_queue(rk, std::ptr::null(), queue, None, std::ptr::null_mut());
        rd::rd_kafka_queue_destroy(queue);
        err
    };
    match RDKafkaErrorCode::from(err) {
        RDKafkaErrorCode::NoError => Ok(()),
        code => Err(KafkaError::ConsumerCommit(code)),
    }
}

/// The shared name of `topic` among those read so far. A worker reads a few
/// topics at most, so a scan beats a map.
fn shared(topics: &mut Vec<Arc<str>>, topic: &str) -> Arc<str> {
    if let Some(t) = topics.iter().find(|t| ***t == *topic) {
        return t.clone();
    }
    let t: Arc<str> = topic.into();
    topics.push(t.clone());
    t
}

impl Intake for KafkaIntake {
    async fn recv(&mut self) -> Result<Record, ConsumerError> {
        let m = self.consumer.recv().await.map_err(|e| ConsumerError {
            kind: kafka::consumer_error_kind(&e),
            message: e.to_string(),
        })?;
        let topic = shared(&mut self.topics, m.topic());
        Ok(Record {
            tp: (topic, m.partition()),
            offset: m.offset(),
            key: m.key().map(RecordKey::from_slice),
            payload: m.payload().map(<[u8]>::to_vec),
            headers: kafka::headers::read(m.headers()),
            timestamp_ms: m.timestamp().to_millis(),
        })
    }

    fn group_events(&mut self) -> Vec<GroupEvent> {
        self.events.try_iter().collect()
    }

    fn commit(&mut self, offsets: &[(TopicPartition, i64)], commit: Commit) {
        let mode = match commit {
            Commit::Sync => CommitMode::Sync,
            Commit::Async => CommitMode::Async,
        };
        if !offsets.is_empty() {
            let mut tpl = TopicPartitionList::new();
            for ((topic, partition), next) in offsets {
                if let Err(e) = tpl.add_partition_offset(topic, *partition, Offset::Offset(*next)) {
                    tracing::warn!(error = %e, "bad offset");
                }
            }
            if let Err(e) = self.consumer.store_offsets(&tpl) {
                // The partition was taken from us meanwhile; the new owner
                // re-reads from the last commit, and replays are harmless.
                tracing::warn!(error = %e, "cannot store offsets");
                return;
            }
        } else if matches!(mode, CommitMode::Async) {
            return;
        }
        let committed = match mode {
            CommitMode::Async => {
                self.consumer.context().commit_asked();
                commit_async(&self.consumer)
            }
            CommitMode::Sync => self.consumer.commit_consumer_state(mode),
        };
        match committed {
            // Async commits are counted by the commit callback.
            Ok(()) if matches!(mode, CommitMode::Sync) => {
                self.metrics.commit(CommitResult::Ok).inc();
            }
            Ok(()) => {}
            Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => self.commit_failed(&e),
        }
    }

    /// librdkafka (2.12, `rd_kafka_toppar_pause_resume`) bumps the
    /// partition's op version, so records it had fetched and not yet
    /// delivered are dropped from its queue, and sets the next fetch to
    /// the position after the last record *delivered* to us: nothing
    /// delivered is lost (it is in our batches) and nothing undelivered is
    /// skipped (it is fetched again on resume).
    fn pause(&mut self, tps: &[TopicPartition]) {
        if let Ok(mut stalls) = self.stalls.lock() {
            stalls.paused(tps);
        }
        if let Err(e) = self.consumer.pause(&Self::list(tps)) {
            tracing::warn!(error = %e, "cannot pause partitions");
        }
    }

    fn resume(&mut self, tps: &[TopicPartition]) {
        if let Err(e) = self.consumer.resume(&Self::list(tps)) {
            tracing::warn!(error = %e, "cannot resume partitions");
        }
        if let Ok(mut stalls) = self.stalls.lock() {
            stalls.resumed(tps, Instant::now());
        }
    }

    fn leave(&mut self) {
        // Closing the consumer (on drop) then leaves the group.
        self.consumer.unsubscribe();
    }
}

/// The dead-letter producer and where each source topic's dead letters go.
pub(crate) struct KafkaDeadLetters {
    /// Replaced after a fatal error (see `send`), with a generation so that
    /// many sends failing together replace it once. Cloning an
    /// `AckedProducer` is cheap: each send holds the lock only to clone.
    producer: RwLock<(u64, kafka::AckedProducer)>,
    settings: Settings,
}

impl KafkaDeadLetters {
    pub fn new(producer: kafka::AckedProducer, settings: Settings) -> Self {
        KafkaDeadLetters {
            producer: RwLock::new((0, producer)),
            settings,
        }
    }

    /// An idempotent producer that hit a fatal error (librdkafka's
    /// `ERR__FATAL`: for example a sequence gap it cannot recover) fails
    /// every later send, so retrying through it would hold the partition
    /// forever. A new producer starts a new idempotent session.
    fn replace_after_fatal(&self, e: &KafkaError, generation: u64) {
        if e.rdkafka_error_code() != Some(RDKafkaErrorCode::Fatal) {
            return;
        }
        let Ok(mut current) = self.producer.write() else {
            return;
        };
        if current.0 != generation {
            return; // another send replaced it already
        }
        match kafka::dead_letter_producer(&self.settings) {
            Ok(fresh) => {
                tracing::error!(error = %e, "dead-letter producer failed fatally; replaced");
                let (_, failed) = std::mem::replace(&mut *current, (generation + 1, fresh));
                // Dropping the last handle waits for its polling thread (a
                // second at most): not on the loop's thread.
                std::thread::spawn(move || drop(failed));
            }
            Err(err) => tracing::error!(error = %err, "cannot replace the dead-letter producer"),
        }
    }
}

impl DeadLetterSink for KafkaDeadLetters {
    async fn send(&self, dead: &DeadLetter) -> Result<(), SendError> {
        let topic = self.settings.dlq_topic_for(&dead.source.topic);
        let (generation, producer) = match self.producer.read() {
            Ok(p) => p.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        let result = kafka::send_dead_letter(
            &producer,
            &topic,
            dead,
            self.settings.timeouts.dead_letter_delivery,
        )
        .await;
        // Not held past here: a replaced producer's last handle, dropped,
        // waits for its polling thread, which should not be this one.
        drop(producer);
        result.map_err(|e| {
            self.replace_after_fatal(&e, generation);
            send_error(e)
        })
    }
}

/// The class of a dead letter's failure, which the stage acts on.
fn send_error(e: KafkaError) -> SendError {
    if DeadLetter::is_size_refusal(&e) {
        SendError::TooLarge(e.to_string())
    } else if kafka::timed_out(&e) {
        SendError::TimedOut(e.to_string())
    } else {
        SendError::Failed(e.to_string())
    }
}

impl BucketSink for BucketWriter {
    async fn write(
        &mut self,
        events: Events<'_>,
        outcomes: &mut [Outcome],
        hold: Option<usize>,
    ) -> Result<WriteStats, StoreError> {
        BucketWriter::write(self, events, outcomes, hold).await
    }

    fn forget_all(&mut self) {
        BucketWriter::forget_all(self);
    }
}

/// Keeps `Health::mongodb_reachable` current. Writes alone would not: a
/// worker with nothing to write would stay ready through a whole outage.
pub(crate) async fn watch_mongodb(
    store: BucketStore,
    health: Arc<Health>,
    metrics: Metrics,
    timeouts: TimeoutSettings,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(timeouts.mongodb_ping_interval) => {}
        }
        let ping = store.ping().await;
        if let Some(operation) = ping.as_ref().err().and_then(StoreError::timeout_operation) {
            metrics.timeout(operation).inc();
        }
        let ok = ping.is_ok();
        if health.mongodb_reachable(ok) {
            if ok {
                tracing::info!("MongoDB reachable again");
            } else {
                tracing::warn!("MongoDB ping failed: not ready");
            }
        }
    }
}

/// How often the partition watcher looks (twice per statistics interval
/// would find nothing new).
const PARTITION_CHECK_EVERY: Duration = Duration::from_secs(10);

/// Keeps `Health::stalled_partitions` and its gauge current: asks Kafka
/// where the suspects of `stalls` end (see [`crate::kafka::stall`]), each
/// time waiting at most `limit` (`timeouts.kafka_request`).
pub(crate) async fn watch_partitions(
    stalls: Arc<Mutex<StallWatch>>,
    client: rdkafka::consumer::BaseConsumer<kafka::ScrubbedLogs>,
    limit: Duration,
    health: Arc<Health>,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let client = Arc::new(client);
    let mut reported: Vec<String> = Vec::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(PARTITION_CHECK_EVERY) => {}
        }
        let suspects = match stalls.lock() {
            Ok(watch) => watch.suspects(Instant::now()),
            Err(_) => return,
        };
        let Some(found) = judge(&client, suspects, limit).await else {
            continue; // Kafka did not answer: judge again next time
        };
        let now: Vec<String> = found.iter().map(ToString::to_string).collect();
        if now != reported {
            log_stalls(&found, reported.is_empty());
        }
        metrics.stalled_partitions.set(found.len() as i64);
        health.stalled_partitions(&now);
        reported = now;
    }
}

/// The suspects with records waiting, or `None` if Kafka could not say.
async fn judge(
    client: &Arc<rdkafka::consumer::BaseConsumer<kafka::ScrubbedLogs>>,
    suspects: Vec<(TopicPartition, i64)>,
    limit: Duration,
) -> Option<Vec<stall::Stalled>> {
    if suspects.is_empty() {
        return Some(Vec::new());
    }
    let tps: Vec<TopicPartition> = suspects.iter().map(|(tp, _)| tp.clone()).collect();
    let client = client.clone();
    let ends = tokio::task::spawn_blocking(move || kafka::end_offsets(&client, &tps, limit)).await;
    match ends {
        Ok(Ok(ends)) => Some(stall::stalled(&suspects, &ends)),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot ask Kafka where partitions end");
            None
        }
        Err(_) => None,
    }
}

fn log_stalls(found: &[stall::Stalled], first: bool) {
    if found.is_empty() {
        tracing::info!("every assigned Kafka partition is being read again");
    } else {
        let list: Vec<String> = found.iter().map(ToString::to_string).collect();
        tracing::error!(
            partitions = %list.join(", "),
            new = first,
            "Kafka partitions with records waiting are not being read (see the consumer errors logged)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letters_failure_is_classed_for_the_stage() {
        let size = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        assert!(matches!(send_error(size), SendError::TooLarge(_)));
        let late = KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut);
        assert!(matches!(send_error(late), SendError::TimedOut(_)));
        let other = KafkaError::MessageProduction(RDKafkaErrorCode::TopicAuthorizationFailed);
        assert!(matches!(send_error(other), SendError::Failed(_)));
        assert!(matches!(
            send_error(KafkaError::Canceled),
            SendError::Failed(_)
        ));
    }

    #[test]
    fn each_topic_name_is_allocated_once_and_shared() {
        let mut topics = Vec::new();
        let a = shared(&mut topics, "trades");
        let b = shared(&mut topics, "fills");
        let again = shared(&mut topics, "trades");
        assert!(Arc::ptr_eq(&a, &again));
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!((&*a, &*b), ("trades", "fills"));
        assert_eq!(topics.len(), 2);
    }
}
