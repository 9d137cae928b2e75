//! The worker loop: fetch -> batch -> decode -> write buckets -> dead-letter
//! -> commit, one batch at a time.
//!
//! One sequential loop is enough for correctness and, with large batches,
//! for throughput: librdkafka keeps fetching in its own threads while a
//! batch is written, and a batch costs a couple of MongoDB round trips for
//! thousands of events. Sequential also means the rebalance callbacks
//! (which run inside `recv()`) never overlap a write; what they saw reaches
//! the loop as [`GroupEvent`] messages.
//!
//! Offsets are committed only after every event of a batch is handled:
//! written at the configured write concern, found already stored, or
//! acknowledged by the dead-letter topic. A failure anywhere before that
//! retries with backoff ([`crate::retry`]); nothing is skipped to make
//! progress.
//!
//! The loop talks to Kafka and MongoDB through the traits in [`seams`], so
//! its timing and ordering rules are unit-tested on a paused clock
//! (`tests.rs`); [`adapters`] has the production implementations.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::CommitMode;
use rdkafka::error::KafkaError;
use tokio_util::sync::CancellationToken;

mod adapters;
mod seams;
#[cfg(test)]
mod tests;

use adapters::{watch_mongodb, watch_partitions, KafkaDeadLetters, KafkaIntake};
pub use seams::Record;
use seams::{BucketSink, DeadLetterSink, Intake};

use crate::bucket::store::{BucketStore, InitError, StoreError};
use crate::bucket::writer::{BucketWriter, Outcome, WriteStats};
use crate::config::{OffsetReset, Settings};
use crate::event::{self, Identity, Reject, Source, Trade};
use crate::health::{now_ms, Health};
use crate::kafka::{self, DeadLetter, GroupEvent};
use crate::metrics::Metrics;
use crate::offsets::{OffsetTracker, TopicPartition};
use crate::ratelimit::RateLimit;
use crate::retry::Backoff;
use crate::throttle::Throttle;

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("Kafka client setup failed: {0}")]
    Kafka(#[from] kafka::SetupError),
    #[error("MongoDB setup failed: {0}")]
    Store(#[from] StoreError),
    /// librdkafka says the consumer cannot go on (for example a static
    /// member fenced by another with its `group.instance.id`).
    #[error("fatal Kafka consumer error: {0}")]
    FatalConsumer(String),
}

/// At most one warning per this interval on a hot path.
const HOT_LOG_EVERY: Duration = Duration::from_secs(1);
/// How often an idle loop turns (and ticks liveness) without a record.
const IDLE_TICK: Duration = Duration::from_secs(1);

/// The worker, connected to Kafka and MongoDB.
pub struct Pipeline(Worker<KafkaIntake, BucketWriter, KafkaDeadLetters>);

impl Pipeline {
    /// Connects to MongoDB (creating the indexes) and Kafka. MongoDB being
    /// down at start-up is retried until `shutdown` (then `Ok(None)`).
    pub async fn build(
        settings: Settings,
        metrics: Metrics,
        health: Arc<Health>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Pipeline>, PipelineError> {
        if settings.kafka.auto_offset_reset == OffsetReset::Latest {
            tracing::warn!(
                "kafka.auto_offset_reset = \"latest\": a group without a committed offset \
                 starts at the end of each partition, and never reads the events before it"
            );
        }
        let store = BucketStore::connect(&settings).await?;
        if !create_indexes(&store, &settings, shutdown).await? {
            return Ok(None);
        }
        health.mongodb_ok.store(true, Ordering::Relaxed);
        health.mongodb_reachable.store(true, Ordering::Relaxed);
        tokio::spawn(watch_mongodb(
            store.clone(),
            health.clone(),
            metrics.clone(),
            settings.timeouts.clone(),
            shutdown.clone(),
        ));
        let writer = BucketWriter::new(
            store,
            settings.buckets.capacity,
            settings.buckets.cache_customers,
            metrics.clone(),
        );
        let dead_letters = KafkaDeadLetters::new(kafka::producer(&settings)?, settings.clone());
        let group = kafka::consumer(&settings, metrics.clone(), health.clone())?;
        tokio::spawn(watch_partitions(
            group.stalls.clone(),
            kafka::end_offsets_client(&settings)?,
            health.clone(),
            metrics.clone(),
            shutdown.clone(),
        ));
        let intake = KafkaIntake::new(group, metrics.clone());
        health.subscribed.store(true, Ordering::Relaxed);
        health.tick();
        let worker = Worker::new(settings, intake, writer, dead_letters, metrics, health);
        Ok(Some(Pipeline(worker)))
    }

    /// Runs until `shutdown` is cancelled, then drains and leaves the
    /// group. `Err` only when the consumer cannot go on.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), PipelineError> {
        self.0.run(shutdown).await
    }
}

/// Awaits `work`, ticking liveness every idle tick meanwhile: a batch
/// write can take long (a backfill's isolation, a slow primary) and is
/// not a wedged loop. What bounds it is MongoDB's own time limits.
async fn ticking<F: std::future::Future>(health: &Health, work: F) -> F::Output {
    tokio::pin!(work);
    let mut every = tokio::time::interval(IDLE_TICK);
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = every.tick() => health.tick(),
        }
    }
}

/// Creates the indexes, retrying until it works; `false` if `shutdown`
/// came first. A collection laid out for the other mode (or sharded on
/// another key) is refused at once: waiting would not change it.
async fn create_indexes(
    store: &BucketStore,
    settings: &Settings,
    shutdown: &CancellationToken,
) -> Result<bool, StoreError> {
    let mut backoff = Backoff::new(&settings.retry);
    loop {
        let e = match store.init().await {
            Ok(_) => return Ok(true),
            Err(InitError::Layout(why)) => return Err(StoreError::Failed(why)),
            Err(InitError::Store(e)) => e,
        };
        let wait = backoff.next_wait();
        tracing::warn!(error = %error_chain(&e), retry_in = ?wait, "cannot create indexes; retrying");
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(false),
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// The loop and what it owns, over any [`Intake`], [`BucketSink`] and
/// [`DeadLetterSink`].
pub(crate) struct Worker<I, B, D> {
    settings: Settings,
    intake: I,
    buckets: B,
    dead_letters: D,
    tracker: OffsetTracker,
    /// The partitions this member owns, from the intake's group events.
    assignment: BTreeSet<TopicPartition>,
    metrics: Metrics,
    health: Arc<Health>,
    /// Hot-path warnings (dead letters, consumer errors): one per second.
    dead_letter_log: Throttle,
    /// A fatal consumer error: the loop ends after the batch in hand.
    fatal: Option<String>,
    consumer_error_log: Throttle,
    /// `rate_limit.events_per_second`: waited out before each write.
    rate_limit: RateLimit,
}

/// A batch's events after decoding.
struct Decoded {
    events: Vec<(Trade, Source)>,
    /// For each event, the index of its record in the batch.
    record_of: Vec<usize>,
    /// Records to dead-letter, by batch index, with why.
    dead: Vec<(usize, Reject)>,
}

impl<I: Intake, B: BucketSink, D: DeadLetterSink> Worker<I, B, D> {
    pub fn new(
        settings: Settings,
        intake: I,
        buckets: B,
        dead_letters: D,
        metrics: Metrics,
        health: Arc<Health>,
    ) -> Self {
        Worker {
            rate_limit: RateLimit::new(settings.rate_limit.events_per_second),
            settings,
            intake,
            buckets,
            dead_letters,
            tracker: OffsetTracker::new(),
            assignment: BTreeSet::new(),
            metrics,
            health,
            dead_letter_log: Throttle::new(HOT_LOG_EVERY),
            fatal: None,
            consumer_error_log: Throttle::new(HOT_LOG_EVERY),
        }
    }

    /// Runs until `shutdown` is cancelled, then drains and leaves the
    /// group; or, after a fatal consumer error, writes what it holds and
    /// returns the error (the process then exits non-zero, to be restarted).
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<(), PipelineError> {
        loop {
            let batch = self.collect(&shutdown).await;
            if !batch.is_empty() && !self.process_or_drain(batch, &shutdown).await {
                tracing::warn!(
                    drain_timeout = ?self.settings.shutdown.drain_timeout,
                    "in-flight batch abandoned at shutdown; its uncommitted events will be redelivered"
                );
            }
            if shutdown.is_cancelled() || self.fatal.is_some() {
                break;
            }
        }
        self.health.draining.store(true, Ordering::Relaxed);
        self.commit(CommitMode::Sync);
        self.intake.leave();
        if let Some(fatal) = self.fatal.take() {
            return Err(PipelineError::FatalConsumer(fatal));
        }
        tracing::info!("stopped: offsets committed, left the consumer group");
        Ok(())
    }

    /// Processes `batch`; once `shutdown` is cancelled (before or during),
    /// gives it at most the drain timeout. `false` if it was abandoned.
    async fn process_or_drain(&mut self, batch: Vec<Record>, shutdown: &CancellationToken) -> bool {
        let drain = self.settings.shutdown.drain_timeout;
        let stopping = shutdown.is_cancelled();
        let health = self.health.clone();
        let work = self.process(batch);
        tokio::pin!(work);
        if stopping {
            return tokio::time::timeout(drain, &mut work).await.is_ok();
        }
        tokio::select! {
            _ = &mut work => true,
            _ = shutdown.cancelled() => {
                health.draining.store(true, Ordering::Relaxed);
                tokio::time::timeout(drain, &mut work).await.is_ok()
            }
        }
    }

    /// Fills a batch: up to `max_events` / `max_bytes` (payloads, keys and
    /// headers), or `linger` after its first record, or until shutdown.
    async fn collect(&mut self, shutdown: &CancellationToken) -> Vec<Record> {
        let mut batch: Vec<Record> = Vec::new();
        let mut bytes = 0usize;
        let mut deadline: Option<tokio::time::Instant> = None;
        loop {
            self.health.tick();
            let wake = deadline.unwrap_or_else(|| tokio::time::Instant::now() + IDLE_TICK);
            let received = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                r = tokio::time::timeout_at(wake, self.intake.recv()) => r,
            };
            match received {
                Err(_) if deadline.is_some() => break, // linger elapsed
                Err(_) => {}                           // idle: tick and wait on
                Ok(Err(e)) => {
                    if self.consumer_error(&e) {
                        break;
                    }
                }
                Ok(Ok(record)) => {
                    self.tracker.consumed(&record.tp, record.offset);
                    bytes += record.size();
                    batch.push(record);
                    let linger = self.settings.batch.linger;
                    deadline.get_or_insert_with(|| tokio::time::Instant::now() + linger);
                }
            }
            self.apply_group_events();
            let limits = &self.settings.batch;
            // Under a rate limit a batch holds one second of it at most.
            let max_events = self.rate_limit.batch_cap(limits.max_events);
            if batch.len() >= max_events || bytes >= limits.max_bytes {
                break;
            }
        }
        self.metrics.events_consumed.inc_by(batch.len() as u64);
        self.metrics
            .in_flight_events
            .set(self.tracker.in_flight() as i64);
        batch
    }

    /// Counts and logs a consumer error; `true` if it is fatal. The broker
    /// being away shows up here, and librdkafka reconnects by itself. An
    /// offset reset means records were skipped or will be read again: an
    /// operator must know, so it is logged at error.
    fn consumer_error(&mut self, e: &KafkaError) -> bool {
        let kind = kafka::consumer_error_kind(e);
        self.metrics
            .consumer_errors
            .with_label_values(&[kind])
            .inc();
        let admitted = self.consumer_error_log.admit(Instant::now());
        match (kind, admitted) {
            ("fatal", _) => {
                tracing::error!(error = %e, "fatal Kafka consumer error: stopping");
                self.fatal = Some(e.to_string());
                return true;
            }
            ("offset_reset", _) => {
                tracing::error!(error = %e, "Kafka consumer reset an offset (out of range)");
            }
            ("skipped_records", _) => self.records_skipped(e),
            (_, Some(suppressed)) => {
                tracing::warn!(error = %e, kind, suppressed, "Kafka consumer error");
            }
            (_, None) => {}
        }
        false
    }

    /// The client skipped records it could not read, and does not say of
    /// which partition: nothing consumed from now on may be committed, or a
    /// commit could pass records neither stored nor dead-lettered. Writing
    /// goes on (a replay is harmless); readiness says why, and an operator
    /// decides (docs/operations.md, TradebucketRecordsSkipped).
    fn records_skipped(&mut self, e: &KafkaError) {
        tracing::error!(
            error = %e,
            "the Kafka client skipped records it could not read: offsets are no longer committed past them"
        );
        self.tracker.freeze();
        self.health.records_skipped.store(true, Ordering::Relaxed);
    }

    /// Follows the assignment. After a revocation, forgets cached buckets:
    /// another instance may now write our former customers.
    ///
    /// Buffered records of revoked partitions are *kept* and written. A
    /// record librdkafka has delivered may not be delivered again: when a
    /// partition is revoked and handed straight back, it resumes after the
    /// last delivered record, not at the committed offset, so dropping the
    /// buffer would lose those trades (a test caught exactly that). Writing
    /// them is safe whoever owns the partition now, because every write is
    /// guarded; only their commit is left to the owner (see `commit`).
    fn apply_group_events(&mut self) {
        for event in self.intake.group_events() {
            match event {
                GroupEvent::Assigned(tps) => self.assignment.extend(tps),
                GroupEvent::Revoked(tps) => {
                    for tp in &tps {
                        self.assignment.remove(tp);
                    }
                    self.buckets.forget_all();
                }
            }
        }
    }

    async fn process(&mut self, batch: Vec<Record>) {
        let started = Instant::now();
        let Decoded {
            events,
            record_of,
            mut dead,
        } = decode_batch(&batch, self.settings.kafka.max_message_bytes);
        // The write-rate limit: wait (ticking liveness, not polling: the
        // batch cap keeps this to about a second) before writing.
        let wait = self
            .rate_limit
            .reserve(events.len(), tokio::time::Instant::now());
        if !wait.is_zero() {
            ticking(&self.health, tokio::time::sleep(wait)).await;
            self.metrics.throttled_seconds.inc_by(wait.as_secs_f64());
        }
        let (outcomes, stats) = self.write_until_done(&events).await;
        let mut counts = OutcomeCounts::default();
        for (j, outcome) in outcomes.into_iter().enumerate() {
            match outcome {
                Outcome::Written => counts.written += 1,
                Outcome::AlreadyApplied => counts.applied += 1,
                Outcome::Duplicate => counts.duplicates += 1,
                Outcome::DeadLetter(r) => dead.push((record_of[j], r)),
                Outcome::Pending => unreachable!("write returned Ok with a pending event"),
            }
        }
        counts.dead_lettered = dead.len() as u64;
        self.dead_letter(&batch, &dead).await;
        for r in &batch {
            self.tracker.handled(&r.tp, r.offset);
        }
        self.commit(CommitMode::Async);
        self.observe(&batch, &counts, &stats, started);
    }

    /// Writes the batch's events, retrying with backoff until every event
    /// has an outcome.
    async fn write_until_done(&mut self, events: &[(Trade, Source)]) -> (Vec<Outcome>, WriteStats) {
        let mut outcomes = vec![Outcome::Pending; events.len()];
        let mut backoff = Backoff::new(&self.settings.retry);
        let health = self.health.clone();
        loop {
            let write = self.buckets.write(events, &mut outcomes);
            match ticking(&health, write).await {
                Ok(stats) => {
                    self.health.write_succeeded();
                    return (outcomes, stats);
                }
                Err(e) => {
                    self.health.write_failed(e.readiness_reason());
                    if let Some(operation) = e.timeout_operation() {
                        self.metrics.timeouts.with_label_values(&[operation]).inc();
                    }
                    self.metrics.retries.with_label_values(&["mongodb"]).inc();
                    let wait = backoff.next_wait();
                    tracing::warn!(error = %error_chain(&e), retry_in = ?wait, "bucket write failed; retrying");
                    tokio::time::sleep(wait).await;
                    self.health.tick();
                }
            }
        }
    }

    /// Sends every dead letter and waits for all acknowledgements; retries
    /// the failed ones until they succeed, because committing past an
    /// unrecorded bad event would lose it silently. A record refused for
    /// its size is sent again at once, shortened (it would never fit);
    /// any other refusal holds the partition, and readiness says so.
    async fn dead_letter(&mut self, batch: &[Record], dead: &[(usize, Reject)]) {
        let mut todo: Vec<DeadLetter> = dead
            .iter()
            .map(|(i, reject)| dead_letter_of(&batch[*i], reject))
            .collect();
        let mut backoff = Backoff::new(&self.settings.retry);
        while !todo.is_empty() {
            let sends = todo.iter().map(|dl| self.dead_letters.send(dl));
            let results = futures::future::join_all(sends).await;
            let (mut failed, mut last_error) = (Vec::new(), None);
            // Refused for their size: sent again at once, shortened.
            let mut shortened = Vec::new();
            for (dl, r) in todo.into_iter().zip(results) {
                match r {
                    Ok(()) => self.dead_lettered(&dl),
                    Err(e) if DeadLetter::is_size_refusal(&e) && dl.shortened.is_none() => {
                        tracing::warn!(topic = %dl.topic, partition = dl.partition, offset = dl.offset,
                            "dead letter too large for the dead-letter topic; sending it shortened");
                        shortened.push(dl.shortened());
                    }
                    Err(e) => {
                        last_error = Some(e);
                        failed.push(dl);
                    }
                }
            }
            self.health
                .dead_letters_failing
                .store(!failed.is_empty(), Ordering::Relaxed);
            if !failed.is_empty() {
                self.dead_letter_retry(failed.len(), last_error, &mut backoff)
                    .await;
            }
            todo = failed;
            todo.append(&mut shortened);
        }
    }

    async fn dead_letter_retry(
        &mut self,
        failed: usize,
        error: Option<KafkaError>,
        backoff: &mut Backoff,
    ) {
        self.metrics
            .retries
            .with_label_values(&["dead_letter"])
            .inc();
        if error.as_ref().is_some_and(kafka::timed_out) {
            self.metrics
                .timeouts
                .with_label_values(&["dead_letter"])
                .inc();
        }
        let wait = backoff.next_wait();
        tracing::error!(
            failed,
            error = ?error,
            retry_in = ?wait,
            "cannot write to the dead-letter topic; the partition waits"
        );
        tokio::time::sleep(wait).await;
        self.health.tick();
    }

    /// Counts one acknowledged dead letter and logs it: every one at debug;
    /// at warn, one per second with the count of those held back.
    fn dead_lettered(&mut self, dl: &DeadLetter) {
        let (kind, error) = (dl.reject.kind.as_str(), &dl.reject.message);
        if let Some(suppressed) = self.dead_letter_log.admit(Instant::now()) {
            tracing::warn!(kind, error = %error, topic = %dl.topic, partition = dl.partition,
                offset = dl.offset, suppressed, "event dead-lettered");
        } else {
            tracing::debug!(kind, error = %error, topic = %dl.topic, partition = dl.partition,
                offset = dl.offset, "event dead-lettered");
        }
        self.metrics
            .events_dead_lettered
            .with_label_values(&[kind])
            .inc();
    }

    /// Commits the offsets that advanced, for the partitions we own.
    /// `Sync` at shutdown.
    fn commit(&mut self, mode: CommitMode) {
        // Rebalance callbacks may have run since the last look.
        self.apply_group_events();
        // Progress on partitions given away belongs to their new owner,
        // which re-reads from the last commit; committing it here could
        // race that owner's commits.
        let assignment = &self.assignment;
        self.tracker.retain(|tp| assignment.contains(tp));
        let commits = self.tracker.take_commits();
        self.intake.commit(&commits, mode);
    }

    /// Metrics and the debug line of a finished batch.
    fn observe(
        &self,
        batch: &[Record],
        counts: &OutcomeCounts,
        stats: &WriteStats,
        started: Instant,
    ) {
        let m = &self.metrics;
        let now = now_ms() as i64;
        for ts in batch.iter().filter_map(|r| r.timestamp_ms) {
            m.end_to_end_delay
                .observe(((now - ts).max(0) as f64) / 1000.0);
        }
        m.events_written.inc_by(counts.written);
        let skipped = &m.events_skipped;
        skipped
            .with_label_values(&["already_applied"])
            .inc_by(counts.applied);
        skipped
            .with_label_values(&["duplicate"])
            .inc_by(counts.duplicates);
        m.batch_events.observe(batch.len() as f64);
        m.batch_customers.observe(stats.customers as f64);
        m.buckets_created.inc_by(stats.buckets_created as u64);
        m.bucket_updates.inc_by(stats.fills as u64);
        m.bucket_conflicts.inc_by(stats.conflicts as u64);
        m.in_flight_events.set(self.tracker.in_flight() as i64);
        tracing::debug!(
            events = batch.len(),
            written = counts.written,
            already_applied = counts.applied,
            duplicates = counts.duplicates,
            dead_lettered = counts.dead_lettered,
            customers = stats.customers,
            rounds = stats.rounds,
            heads_loaded = stats.heads_loaded,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "batch committed"
        );
    }
}

#[derive(Debug, Default)]
struct OutcomeCounts {
    written: u64,
    applied: u64,
    duplicates: u64,
    dead_lettered: u64,
}

/// Decodes every record; the undecodable ones are to be dead-lettered.
fn decode_batch(batch: &[Record], max_bytes: usize) -> Decoded {
    let mut d = Decoded {
        events: Vec::with_capacity(batch.len()),
        record_of: Vec::with_capacity(batch.len()),
        dead: Vec::new(),
    };
    for (i, r) in batch.iter().enumerate() {
        let source = Source {
            topic: r.tp.0.clone(),
            partition: r.tp.1,
            offset: r.offset,
        };
        // A replayed dead letter keeps its original identity; `source`
        // (its real position) stays the watermark key.
        let decoded = kafka::replay_origin(&r.headers).and_then(|origin| {
            let identity = origin
                .as_ref()
                .map_or(Identity::Read(&source), Identity::ReplayOf);
            event::decode_as(r.payload.as_deref(), identity, max_bytes)
        });
        match decoded {
            Ok(trade) => {
                d.events.push((trade, source));
                d.record_of.push(i);
            }
            Err(reject) => d.dead.push((i, reject)),
        }
    }
    d
}

fn dead_letter_of(r: &Record, reject: &Reject) -> DeadLetter {
    DeadLetter {
        topic: r.tp.0.clone(),
        partition: r.tp.1,
        offset: r.offset,
        key: r.key.clone(),
        payload: r.payload.clone(),
        headers: r.headers.clone(),
        reject: reject.clone(),
        shortened: None,
    }
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
        settings.timeouts.liveness_stall,
        shutdown.clone(),
    ));
    let result = match Pipeline::build(settings, metrics, health, &shutdown).await {
        Ok(Some(p)) => p.run(shutdown.clone()).await.map_err(Into::into),
        Ok(None) => Ok(()),
        Err(e) => Err(e.into()),
    };
    shutdown.cancel();
    let _ = http.await;
    result
}
