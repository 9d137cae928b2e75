//! The worker loop: fetch -> batch -> decode -> write buckets -> dead-letter
//! -> commit, one batch at a time.
//!
//! One sequential loop is enough for correctness and, with large batches,
//! for throughput: librdkafka keeps fetching in its own threads while a
//! batch is written, and a batch costs a couple of MongoDB round trips for
//! thousands of events. Sequential also means the rebalance callback (which
//! runs inside `recv()`) never overlaps a write.
//!
//! Offsets are committed only after every event of a batch is handled:
//! written at the configured write concern, found already stored, or
//! acknowledged by the dead-letter topic. A failure anywhere before that
//! retries with backoff; nothing is skipped to make progress.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use backoff::backoff::Backoff;
use backoff::{ExponentialBackoff, ExponentialBackoffBuilder};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use crate::bucket::store::{BucketStore, StoreError};
use crate::bucket::writer::{BucketWriter, Outcome};
use crate::config::Settings;
use crate::event::{self, Reject, Source, Trade};
use crate::kafka::{self, ConsumerCtx, DeadLetter, GroupState};
use crate::metrics::Metrics;
use crate::offsets::{OffsetTracker, TopicPartition};
use crate::throttle::Throttle;

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("Kafka client setup failed: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("MongoDB setup failed: {0}")]
    Store(#[from] StoreError),
}

/// What `/healthz` and `/readyz` report, updated by the loop.
#[derive(Debug, Default)]
pub struct Health {
    /// Subscribed to the group (assigned partitions or waiting for them).
    pub subscribed: AtomicBool,
    /// The last MongoDB write succeeded.
    pub mongodb_ok: AtomicBool,
    /// The last periodic ping succeeded (see [`watch_mongodb`]).
    pub mongodb_reachable: AtomicBool,
    /// Shutting down: no new batches.
    pub draining: AtomicBool,
    /// Unix millis of the loop's last turn; a stale value means wedged.
    pub last_tick_ms: AtomicU64,
}

impl Health {
    pub fn tick(&self) {
        self.last_tick_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// `Err(reason)` when the worker should not receive traffic.
    pub fn readiness(&self) -> Result<(), &'static str> {
        if self.draining.load(Ordering::Relaxed) {
            Err("draining: shutting down")
        } else if !self.subscribed.load(Ordering::Relaxed) {
            Err("starting: not yet subscribed to the consumer group")
        } else if !self.mongodb_ok.load(Ordering::Relaxed) {
            Err("MongoDB writes failing: being retried")
        } else if !self.mongodb_reachable.load(Ordering::Relaxed) {
            Err("MongoDB unreachable")
        } else {
            Ok(())
        }
    }

    /// `Err(reason)` when the loop has not turned for `stall`.
    pub fn liveness(&self, stall: Duration) -> Result<(), String> {
        let last = self.last_tick_ms.load(Ordering::Relaxed);
        let age = now_ms().saturating_sub(last);
        if last != 0 && age > stall.as_millis() as u64 {
            Err(format!("the worker loop has not turned for {age} ms"))
        } else {
            Ok(())
        }
    }
}

/// How often [`watch_mongodb`] pings, and how long a ping may take.
const PING_EVERY: Duration = Duration::from_secs(2);
const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// Keeps `Health::mongodb_reachable` current. Writes alone would not: a
/// worker with nothing to write would stay ready through a whole outage.
async fn watch_mongodb(store: BucketStore, health: Arc<Health>, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(PING_EVERY) => {}
        }
        let ok = matches!(
            tokio::time::timeout(PING_TIMEOUT, store.ping()).await,
            Ok(Ok(()))
        );
        if health.mongodb_reachable.swap(ok, Ordering::Relaxed) != ok {
            if ok {
                tracing::info!("MongoDB reachable again");
            } else {
                tracing::warn!("MongoDB ping failed: not ready");
            }
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A consumed message, detached from the consumer's buffer.
struct Msg {
    tp: TopicPartition,
    offset: i64,
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
    timestamp_ms: Option<i64>,
}

pub struct Pipeline {
    settings: Settings,
    consumer: StreamConsumer<ConsumerCtx>,
    group: Arc<Mutex<GroupState>>,
    producer: FutureProducer,
    writer: BucketWriter,
    tracker: OffsetTracker,
    metrics: Metrics,
    health: Arc<Health>,
    /// Hot-path warnings (dead letters, consumer errors): one per second.
    dead_letter_log: Throttle,
    consumer_error_log: Throttle,
}

/// At most one warning per this interval on a hot path.
const HOT_LOG_EVERY: Duration = Duration::from_secs(1);

impl Pipeline {
    /// Connects to MongoDB (creating the indexes) and Kafka. MongoDB being
    /// down at start-up is retried until `shutdown`.
    pub async fn build(
        settings: Settings,
        metrics: Metrics,
        health: Arc<Health>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Pipeline>, PipelineError> {
        let store = BucketStore::connect(&settings.mongodb).await?;
        let mut backoff = backoff_for(&settings);
        loop {
            match store.init().await {
                Ok(()) => break,
                Err(e) => {
                    let wait = backoff.next_backoff().unwrap_or(Duration::from_secs(10));
                    tracing::warn!(error = %error_chain(&e), retry_in = ?wait, "cannot create indexes; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(None),
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
        health.mongodb_ok.store(true, Ordering::Relaxed);
        health.mongodb_reachable.store(true, Ordering::Relaxed);
        tokio::spawn(watch_mongodb(
            store.clone(),
            health.clone(),
            shutdown.clone(),
        ));
        let writer = BucketWriter::new(
            store,
            settings.buckets.capacity,
            settings.buckets.cache_customers,
            metrics.clone(),
        );
        let producer = kafka::producer(&settings)?;
        let (consumer, group) = kafka::consumer(&settings, metrics.clone())?;
        health.subscribed.store(true, Ordering::Relaxed);
        health.tick();
        Ok(Some(Pipeline {
            settings,
            consumer,
            group,
            producer,
            writer,
            tracker: OffsetTracker::new(),
            metrics,
            health,
            dead_letter_log: Throttle::new(HOT_LOG_EVERY),
            consumer_error_log: Throttle::new(HOT_LOG_EVERY),
        }))
    }

    /// Runs until `shutdown` is cancelled, then drains and leaves the group.
    pub async fn run(mut self, shutdown: CancellationToken) {
        loop {
            let batch = self.collect(&shutdown).await;
            if !batch.is_empty() {
                let drain = self.settings.drain_timeout();
                let stopping = shutdown.is_cancelled();
                let health = self.health.clone();
                let done = {
                    let work = self.process(batch);
                    tokio::pin!(work);
                    if stopping {
                        tokio::time::timeout(drain, &mut work).await.is_ok()
                    } else {
                        tokio::select! {
                            _ = &mut work => true,
                            _ = shutdown.cancelled() => {
                                health.draining.store(true, Ordering::Relaxed);
                                tokio::time::timeout(drain, &mut work).await.is_ok()
                            }
                        }
                    }
                };
                if !done {
                    tracing::warn!(
                        drain_timeout = ?drain,
                        "in-flight batch abandoned at shutdown; its uncommitted events will be redelivered"
                    );
                }
            }
            if shutdown.is_cancelled() {
                break;
            }
        }
        self.health.draining.store(true, Ordering::Relaxed);
        self.commit(CommitMode::Sync);
        // Dropping the consumer closes it, which leaves the group so the
        // partitions move to another member at once.
        self.consumer.unsubscribe();
        tracing::info!("stopped: offsets committed, left the consumer group");
    }

    /// Fills a batch: up to `max_events` / `max_bytes`, or `linger` after
    /// its first message, or until shutdown.
    async fn collect(&mut self, shutdown: &CancellationToken) -> Vec<Msg> {
        let mut batch: Vec<Msg> = Vec::new();
        let mut bytes = 0usize;
        let mut deadline: Option<tokio::time::Instant> = None;
        let idle_tick = Duration::from_secs(1);
        loop {
            self.health.tick();
            let wake = deadline.unwrap_or_else(|| tokio::time::Instant::now() + idle_tick);
            let received = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                r = tokio::time::timeout_at(wake, self.consumer.recv()) => r,
            };
            match received {
                Err(_) if deadline.is_some() => break, // linger elapsed
                Err(_) => {}                           // idle: tick and wait on
                Ok(Err(e)) => {
                    // The broker being away shows up here; librdkafka
                    // reconnects by itself.
                    if let Some(suppressed) = self.consumer_error_log.admit(Instant::now()) {
                        tracing::warn!(error = %e, suppressed, "Kafka consumer error");
                    }
                }
                Ok(Ok(m)) => {
                    let tp = (m.topic().to_string(), m.partition());
                    let msg = Msg {
                        offset: m.offset(),
                        key: m.key().map(<[u8]>::to_vec),
                        payload: m.payload().map(<[u8]>::to_vec),
                        headers: kafka::copy_headers(m.headers()),
                        timestamp_ms: m.timestamp().to_millis(),
                        tp,
                    };
                    self.tracker.consumed(&msg.tp, msg.offset);
                    bytes += msg.payload.as_ref().map_or(0, Vec::len);
                    batch.push(msg);
                    deadline.get_or_insert_with(|| {
                        tokio::time::Instant::now() + self.settings.linger()
                    });
                }
            }
            self.apply_revocations();
            if batch.len() >= self.settings.batch.max_events
                || bytes >= self.settings.batch.max_bytes
            {
                break;
            }
            if batch.is_empty() {
                deadline = None;
            }
        }
        self.metrics.events_consumed.inc_by(batch.len() as u64);
        self.metrics
            .in_flight_events
            .set(self.tracker.in_flight() as i64);
        batch
    }

    /// After a rebalance, forgets cached buckets: another instance may now
    /// write our former customers.
    ///
    /// Buffered messages of revoked partitions are *kept* and written. A
    /// message librdkafka has delivered may not be delivered again: when a
    /// partition is revoked and handed straight back, it resumes after the
    /// last delivered message, not at the committed offset, so dropping the
    /// buffer would lose those trades (a test caught exactly that). Writing
    /// them is safe whoever owns the partition now, because every write is
    /// guarded; only their commit is left to the owner (see `commit`).
    fn apply_revocations(&mut self) {
        let revoked = std::mem::take(&mut self.group.lock().expect("group state lock").revoked);
        if !revoked.is_empty() {
            self.writer.forget_all();
        }
    }

    async fn process(&mut self, batch: Vec<Msg>) {
        let started = Instant::now();
        let max_bytes = self.settings.kafka.max_message_bytes;
        let mut events: Vec<(Trade, Source)> = Vec::with_capacity(batch.len());
        let mut event_msg: Vec<usize> = Vec::with_capacity(batch.len());
        let mut dead: Vec<(usize, Reject)> = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            let source = Source {
                topic: m.tp.0.clone(),
                partition: m.tp.1,
                offset: m.offset,
            };
            match event::decode(m.payload.as_deref(), &source, max_bytes) {
                Ok(trade) => {
                    events.push((trade, source));
                    event_msg.push(i);
                }
                Err(reject) => dead.push((i, reject)),
            }
        }

        let mut outcomes = vec![Outcome::Pending; events.len()];
        let mut backoff = backoff_for(&self.settings);
        let stats = loop {
            match self.writer.write(&events, &mut outcomes).await {
                Ok(stats) => {
                    self.health.mongodb_ok.store(true, Ordering::Relaxed);
                    break stats;
                }
                Err(e) => {
                    self.health.mongodb_ok.store(false, Ordering::Relaxed);
                    self.metrics.retries.with_label_values(&["mongodb"]).inc();
                    let wait = backoff.next_backoff().unwrap_or(Duration::from_secs(10));
                    tracing::warn!(error = %error_chain(&e), retry_in = ?wait, "bucket write failed; retrying");
                    tokio::time::sleep(wait).await;
                    self.health.tick();
                }
            }
        };

        let (mut written, mut applied, mut duplicates) = (0u64, 0u64, 0u64);
        for (j, outcome) in outcomes.into_iter().enumerate() {
            match outcome {
                Outcome::Written => written += 1,
                Outcome::AlreadyApplied => applied += 1,
                Outcome::Duplicate => duplicates += 1,
                Outcome::DeadLetter(r) => dead.push((event_msg[j], r)),
                Outcome::Pending => unreachable!("write returned Ok with a pending event"),
            }
        }
        self.dead_letter(&batch, &dead).await;

        for m in &batch {
            self.tracker.handled(&m.tp, m.offset);
        }
        self.commit(CommitMode::Async);
        let now = now_ms() as i64;
        for m in &batch {
            if let Some(ts) = m.timestamp_ms {
                self.metrics
                    .end_to_end_delay
                    .observe(((now - ts).max(0) as f64) / 1000.0);
            }
        }

        let m = &self.metrics;
        m.events_written.inc_by(written);
        m.events_skipped
            .with_label_values(&["already_applied"])
            .inc_by(applied);
        m.events_skipped
            .with_label_values(&["duplicate"])
            .inc_by(duplicates);
        m.batch_events.observe(batch.len() as f64);
        m.batch_customers.observe(stats.customers as f64);
        m.buckets_created.inc_by(stats.buckets_created as u64);
        m.bucket_updates.inc_by(stats.fills as u64);
        m.bucket_conflicts.inc_by(stats.conflicts as u64);
        m.in_flight_events.set(self.tracker.in_flight() as i64);
        tracing::debug!(
            events = batch.len(),
            written,
            already_applied = applied,
            duplicates,
            dead_lettered = dead.len(),
            customers = stats.customers,
            rounds = stats.rounds,
            heads_loaded = stats.heads_loaded,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "batch committed"
        );
    }

    /// Sends every dead letter and waits for all acknowledgements; retries
    /// the failed ones until they succeed, because committing past an
    /// unrecorded bad event would lose it silently.
    async fn dead_letter(&mut self, batch: &[Msg], dead: &[(usize, Reject)]) {
        if dead.is_empty() {
            return;
        }
        let mut todo: Vec<DeadLetter> = dead
            .iter()
            .map(|(i, reject)| {
                let m = &batch[*i];
                DeadLetter {
                    topic: m.tp.0.clone(),
                    partition: m.tp.1,
                    offset: m.offset,
                    key: m.key.clone(),
                    payload: m.payload.clone(),
                    headers: m.headers.clone(),
                    reject: reject.clone(),
                }
            })
            .collect();
        let mut backoff = backoff_for(&self.settings);
        loop {
            let sends = todo.iter().map(|dl| {
                let topic = self.settings.dlq_topic_for(&dl.topic);
                let producer = &self.producer;
                async move { kafka::send_dead_letter(producer, &topic, dl).await }
            });
            let results = futures::future::join_all(sends).await;
            let mut failed = Vec::new();
            let mut last_error = None;
            for (dl, r) in todo.into_iter().zip(results) {
                match r {
                    Ok(()) => {
                        // Every one at debug; at warn, one per second with
                        // the count of those held back.
                        let admitted = self.dead_letter_log.admit(Instant::now());
                        if let Some(suppressed) = admitted {
                            tracing::warn!(
                                kind = dl.reject.kind.as_str(),
                                error = %dl.reject.message,
                                topic = %dl.topic, partition = dl.partition, offset = dl.offset,
                                suppressed,
                                "event dead-lettered"
                            );
                        } else {
                            tracing::debug!(
                                kind = dl.reject.kind.as_str(),
                                error = %dl.reject.message,
                                topic = %dl.topic, partition = dl.partition, offset = dl.offset,
                                "event dead-lettered"
                            );
                        }
                        self.metrics
                            .events_dead_lettered
                            .with_label_values(&[dl.reject.kind.as_str()])
                            .inc();
                    }
                    Err(e) => {
                        last_error = Some(e);
                        failed.push(dl);
                    }
                }
            }
            if failed.is_empty() {
                return;
            }
            self.metrics
                .retries
                .with_label_values(&["dead_letter"])
                .inc();
            let wait = backoff.next_backoff().unwrap_or(Duration::from_secs(10));
            tracing::error!(
                failed = failed.len(),
                error = ?last_error,
                retry_in = ?wait,
                "cannot write to the dead-letter topic; the partition waits"
            );
            tokio::time::sleep(wait).await;
            self.health.tick();
            todo = failed;
        }
    }

    /// Stores and commits the offsets that advanced, for the partitions we
    /// own. `Sync` at shutdown.
    fn commit(&mut self, mode: CommitMode) {
        // Progress on partitions given away belongs to their new owner,
        // which re-reads from the last commit; committing it here could
        // race that owner's commits.
        let assignment = self
            .group
            .lock()
            .expect("group state lock")
            .assignment
            .clone();
        self.tracker.retain(|tp| assignment.contains(tp));
        let commits = self.tracker.take_commits();
        if !commits.is_empty() {
            let mut tpl = TopicPartitionList::new();
            for ((topic, partition), next) in &commits {
                // `next` is last handled + 1: the offset to resume from.
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
        match self.consumer.commit_consumer_state(mode) {
            Ok(()) => {
                if matches!(mode, CommitMode::Sync) {
                    self.metrics.offset_commits.with_label_values(&["ok"]).inc();
                }
            }
            Err(rdkafka::error::KafkaError::ConsumerCommit(
                rdkafka::types::RDKafkaErrorCode::NoOffset,
            )) => {}
            Err(e) => {
                self.metrics
                    .offset_commits
                    .with_label_values(&["error"])
                    .inc();
                self.metrics.retries.with_label_values(&["commit"]).inc();
                tracing::warn!(error = %e, "offset commit failed; the next one supersedes it");
            }
        }
    }
}

pub fn backoff_for(settings: &Settings) -> ExponentialBackoff {
    let r = &settings.retry;
    ExponentialBackoffBuilder::new()
        .with_initial_interval(Duration::from_millis(r.initial_interval_ms))
        .with_max_interval(Duration::from_millis(r.max_interval_ms))
        .with_multiplier(r.multiplier)
        .with_randomization_factor(r.randomization_factor)
        // Never give up: the alternative is skipping trades.
        .with_max_elapsed_time(None)
        .build()
}

/// "outer: inner: innermost", for logs.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Runs the worker with its HTTP endpoints until `shutdown`.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    let health = Arc::new(Health::default());
    let listener = tokio::net::TcpListener::bind(settings.http.listen).await?;
    tracing::info!(listen = %listener.local_addr()?, "HTTP endpoints up");
    let http = tokio::spawn(crate::http::serve(
        listener,
        metrics.clone(),
        health.clone(),
        shutdown.clone(),
    ));
    let result = match Pipeline::build(settings, metrics, health, &shutdown).await {
        Ok(Some(p)) => {
            p.run(shutdown.clone()).await;
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(e) => Err(e.into()),
    };
    shutdown.cancel();
    let _ = http.await;
    result
}
