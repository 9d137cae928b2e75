//! The pipelined loop: one task that fills batches, has the write stage
//! write them and commits their offsets, all three overlapping; at the
//! in-flight bound it holds the consumer, pausing its partitions after
//! [`HOLD_GRACE`]. How and why: docs/design.md, "The pipelined loop".
//!
//! The loop owns the consumer, its phase ([`Phase`]), the hold ([`Hold`])
//! and the commits; the batches and the idle write stage are
//! [`Batches`]'.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use prometheus::local::LocalHistogram;
use prometheus::Histogram;
use tokio::time::Instant as TokioInstant;
use tokio_util::sync::CancellationToken;

use super::batches::Batches;
use super::seams::{BucketSink, Commit, ConsumerError, DeadLetterSink, Intake, Record};
use super::stage::{Cache, Closed, Done, Handling, Partial, Stage};
use super::PipelineError;
use crate::config::Settings;
use crate::event::Mappings;
use crate::health::{now_ms, Health};
use crate::kafka::GroupEvent;
use crate::metrics::{ConsumerErrorKind, DelayStage, Metrics, SkipReason};
use crate::offsets::{OffsetTracker, TopicPartition};
use crate::registry::Formats;
use crate::throttle::Throttle;

/// How long the loop may hold (take no records) before it pauses its
/// partitions and polls again: long enough that an ordinary write at the
/// in-flight bound never pauses (a pause drops librdkafka's prefetched
/// records, fetched again on resume), short against `max.poll.interval.ms`
/// (at most a quarter of it, see `hold_grace`).
pub(super) const HOLD_GRACE: Duration = Duration::from_secs(5);

/// How often an idle loop turns (and ticks liveness) without a record.
const IDLE_TICK: Duration = Duration::from_secs(1);

/// Backpressure at the in-flight bound (see `Worker::hold_or_release`).
#[derive(Debug, Default, PartialEq)]
enum Hold {
    /// Below the bound: records are taken.
    #[default]
    Free,
    /// At the bound since then: no records are taken, the consumer is not
    /// polled, until the grace is over.
    Holding(TokioInstant),
    /// Past the grace: these partitions are paused and the consumer is
    /// polled on. The set may be empty (an eager rebalance revoked
    /// everything during a slow write): still paused, still polling, so
    /// the new assignment arrives and is paused in turn.
    Paused(BTreeSet<TopicPartition>),
}

/// Where the loop is in its life. It only moves down this list.
#[derive(Debug, PartialEq)]
enum Phase {
    /// Taking records and writing them.
    Running,
    /// A fatal consumer error: no more records; the batches in hand are
    /// written, then the loop ends with this error (the process exits
    /// non-zero, to be restarted).
    Failing(String),
    /// Shutdown was asked: no more records; the batches in hand are written
    /// until `deadline` (`shutdown.drain_timeout`), then abandoned. A fatal
    /// error seen before is still returned.
    Draining {
        deadline: TokioInstant,
        fatal: Option<String>,
    },
}

impl Phase {
    /// Whether records are taken.
    fn running(&self) -> bool {
        matches!(self, Phase::Running)
    }

    /// The fatal error, if any: the loop stops.
    fn fail(&mut self, error: String) {
        match self {
            Phase::Running => *self = Phase::Failing(error),
            Phase::Draining { fatal, .. } => {
                fatal.get_or_insert(error);
            }
            Phase::Failing(_) => {}
        }
    }

    /// Shutdown was asked; `true` the first time.
    fn drain(&mut self, timeout: Duration) -> bool {
        let fatal = match std::mem::replace(self, Phase::Running) {
            Phase::Running => None,
            Phase::Failing(e) => Some(e),
            draining @ Phase::Draining { .. } => {
                *self = draining;
                return false;
            }
        };
        let deadline = TokioInstant::now() + timeout;
        *self = Phase::Draining { deadline, fatal };
        true
    }

    fn deadline(&self) -> Option<TokioInstant> {
        match self {
            Phase::Draining { deadline, .. } => Some(*deadline),
            Phase::Running | Phase::Failing(_) => None,
        }
    }

    /// How the loop ends once it has stopped.
    fn end(self) -> Result<(), PipelineError> {
        match self {
            Phase::Failing(e) | Phase::Draining { fatal: Some(e), .. } => {
                Err(PipelineError::FatalConsumer(e))
            }
            Phase::Running | Phase::Draining { fatal: None, .. } => Ok(()),
        }
    }
}

/// What woke the loop.
enum Wake<B, D> {
    /// Boxed: the stage (settings, clients) dwarfs the other variants.
    Written(Box<Stage<B, D>>, Done),
    Received(Result<Record, ConsumerError>),
    DrainOver,
    Tick,
}

/// The loop and what it owns, over any [`Intake`], [`BucketSink`] and
/// [`DeadLetterSink`].
pub(crate) struct Worker<I, B, D> {
    settings: Settings,
    intake: I,
    phase: Phase,
    /// From the open batch to the write stage.
    batches: Batches<B, D>,
    tracker: OffsetTracker,
    /// The partitions this member owns, from the intake's group events.
    assignment: BTreeSet<TopicPartition>,
    /// Backpressure at the bound. The partitions a hold paused are all
    /// resumed when it ends: librdkafka keeps a partition paused across a
    /// revoke and reassign.
    hold: Hold,
    metrics: Metrics,
    /// `tradebucket_stage_delay_seconds{stage="in_kafka"}`, observed per
    /// record, so looked up once.
    in_kafka: Histogram,
    health: Arc<Health>,
    /// [`Cache::Forget`] after a revocation, until the next dispatch.
    cache: Cache,
    consumer_error_log: Throttle,
}

impl<I: Intake, B: BucketSink, D: DeadLetterSink> Worker<I, B, D> {
    pub fn new(
        settings: Settings,
        (mappings, formats): (Mappings, Arc<Formats>),
        intake: I,
        buckets: B,
        dead_letters: D,
        metrics: Metrics,
        health: Arc<Health>,
    ) -> Self {
        let mappings = Arc::new(mappings);
        let stage = Stage::new(
            buckets,
            dead_letters,
            settings.clone(),
            metrics.clone(),
            health.clone(),
            (mappings.clone(), formats.clone()),
        );
        Worker {
            batches: Batches::new(&settings, (mappings, formats), metrics.clone(), stage),
            intake,
            tracker: OffsetTracker::new(),
            assignment: BTreeSet::new(),
            hold: Hold::Free,
            in_kafka: metrics.stage_delay(DelayStage::InKafka),
            metrics,
            health,
            cache: Cache::Keep,
            phase: Phase::Running,
            consumer_error_log: Throttle::hot_path(),
            settings,
        }
    }

    /// Runs until `shutdown` is cancelled, then drains (at most
    /// `shutdown.drain_timeout`) and leaves the group; or, after a fatal
    /// consumer error, writes what it holds and returns the error (the
    /// process then exits non-zero, to be restarted).
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<(), PipelineError>
    where
        Self: Send + 'static,
    {
        let mut ticker = tokio::time::interval(IDLE_TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut writing = None;
        loop {
            let running = self.turn(&shutdown);
            if let Some((stage, batch)) = self.batches.dispatch() {
                let handling = self.handling(&batch);
                writing = Some(Box::pin(stage.handle(batch, handling)));
            }
            if !running && self.batches.stage_free() {
                break;
            }
            let polling = running && self.hold_or_release();
            let deadline = self.phase.deadline();
            let wake = tokio::select! {
                biased;
                (stage, done) = written(&mut writing) => Wake::Written(Box::new(stage), done),
                _ = shutdown.cancelled(), if deadline.is_none() => Wake::Tick,
                _ = sleep_until(deadline) => Wake::DrainOver,
                _ = sleep_until(self.batches.write_at()) => Wake::Tick,
                _ = sleep_until(self.pause_due()), if running => Wake::Tick,
                _ = sleep_until(self.batches.flush_due()), if running => Wake::Tick,
                r = self.intake.recv(), if polling => Wake::Received(r),
                _ = ticker.tick() => Wake::Tick,
            };
            match wake {
                Wake::Written(stage, done) => {
                    writing = None;
                    self.finish(*stage, done);
                }
                Wake::Received(r) => {
                    let in_kafka = self.in_kafka.local();
                    self.received(r, now_ms(), &in_kafka);
                }
                Wake::DrainOver => {
                    tracing::warn!(
                        drain_timeout = ?self.settings.shutdown.drain_timeout,
                        batches = self.batches.queued() + 1,
                        "in-flight batches abandoned at shutdown; their uncommitted events will be redelivered"
                    );
                    break;
                }
                Wake::Tick => {}
            }
        }
        drop(writing);
        self.stop().await
    }

    /// The final commit, leaving the group and closing the consumer.
    async fn stop(mut self) -> Result<(), PipelineError>
    where
        Self: Send + 'static,
    {
        self.health.draining();
        self.commit(Commit::Sync);
        self.intake.leave();
        let end = std::mem::replace(&mut self.phase, Phase::Running).end();
        if end.is_ok() {
            tracing::info!("stopped: offsets committed, left the consumer group");
        }
        // Dropping the consumer closes it, and that blocks: librdkafka
        // leaves the group and runs the revoke callback, whose commit is
        // synchronous. On a blocking thread, so the runtime's other tasks
        // (the watchers, the MongoDB driver's; in tests, another worker of
        // the same group, which the close may be waiting for) run meanwhile.
        let _ = tokio::task::spawn_blocking(move || drop(self)).await;
        end
    }

    /// A turn's start: liveness, the group's news, shutdown asked; then
    /// the open batch filled (or, once no records are taken, closed) and
    /// held trades flushed when due. Returns whether the loop was taking
    /// records as the turn began: the rest of the turn goes by that.
    fn turn(&mut self, shutdown: &CancellationToken) -> bool {
        self.health.tick();
        self.apply_group_events();
        if shutdown.is_cancelled() && self.phase.drain(self.settings.shutdown.drain_timeout) {
            self.health.draining();
        }
        let running = self.phase.running();
        if running {
            self.fill();
        } else {
            self.batches.close(self.tracker.in_flight());
        }
        // A fatal error met by the fill counts already.
        self.batches.flush_held(self.phase.running());
        running
    }

    /// Takes what the consumer has queued, without waiting, while the open
    /// batch may grow; closes it when due (see [`Batches::close_if_due`]).
    ///
    /// The wall clock is read once per call, not per record: a call takes
    /// at most what librdkafka has prefetched (`queued.max.messages`), a
    /// millisecond or two, below the `in_kafka` histogram's resolution.
    fn fill(&mut self) {
        let (now, in_kafka) = (now_ms(), self.in_kafka.local());
        while self.batches.may_take() && self.phase.running() {
            match self.intake.recv().now_or_never() {
                Some(r) => self.received(r, now, &in_kafka),
                None => break, // nothing queued
            }
            if self.batches.linger_over() {
                break;
            }
        }
        in_kafka.flush();
        self.batches.close_if_due(self.tracker.in_flight());
    }

    /// Takes a record into the open batch; `now` is the wall clock's
    /// milliseconds, for its time in Kafka.
    fn received(&mut self, r: Result<Record, ConsumerError>, now: u64, in_kafka: &LocalHistogram) {
        match r {
            Ok(record) => {
                if let Some(ts) = record.timestamp_ms {
                    in_kafka.observe(seconds_between(ts, now));
                }
                self.tracker.consumed(&record.tp, record.offset);
                self.batches.take(record);
            }
            Err(e) => self.consumer_error(&e),
        }
    }

    /// What the stage is told with `batch`: to forget its cached buckets
    /// after a revocation; and that the batch may hold trades back if it
    /// closed under a backlog and neither a revocation nor shutdown came
    /// since: a revoked partition's trades are written now, for the new
    /// owner's sake, and so are all of them when the loop stops.
    fn handling(&mut self, batch: &Closed) -> Handling {
        let cache = std::mem::take(&mut self.cache);
        let hold = batch.backlog && cache == Cache::Keep && self.phase.running();
        let partial = if hold { Partial::Hold } else { Partial::Write };
        Handling { cache, partial }
    }

    /// A batch is handled: its offsets may be committed.
    fn finish(&mut self, stage: Stage<B, D>, done: Done) {
        self.batches.stage_back(stage);
        self.observe_stage(DelayStage::Writing, done.started.elapsed());
        self.tracker
            .handled_all(done.records.iter().map(|r| (&r.tp, r.offset)));
        self.commit(Commit::Async);
        self.observe(&done);
    }

    /// Holds at the in-flight bound: no records are taken; after the grace
    /// the assigned partitions are paused and the consumer is polled again.
    /// Releases (resumes) once there is room. `true` if the consumer is to
    /// be polled.
    fn hold_or_release(&mut self) -> bool {
        if self.batches.may_take() {
            if let Hold::Paused(paused) = std::mem::take(&mut self.hold) {
                let paused: Vec<TopicPartition> = paused.into_iter().collect();
                tracing::info!(partitions = paused.len(), "resuming the consumer");
                self.intake.resume(&paused);
            }
            return true;
        }
        match self.hold {
            Hold::Free => self.hold = Hold::Holding(TokioInstant::now()),
            Hold::Holding(since) if since.elapsed() >= self.hold_grace() => {
                let tps: Vec<TopicPartition> = self.assignment.iter().cloned().collect();
                tracing::info!(
                    partitions = tps.len(),
                    "batches in flight at the bound: pausing the consumer and polling on"
                );
                self.intake.pause(&tps);
                self.hold = Hold::Paused(tps.into_iter().collect());
            }
            Hold::Holding(_) | Hold::Paused(_) => {}
        }
        matches!(self.hold, Hold::Paused(_))
    }

    /// When a hold that has not paused yet reaches its grace: the loop
    /// wakes then to pause, rather than at its next idle tick.
    fn pause_due(&self) -> Option<TokioInstant> {
        match self.hold {
            Hold::Holding(since) => Some(since + self.hold_grace()),
            Hold::Free | Hold::Paused(_) => None,
        }
    }

    fn hold_grace(&self) -> Duration {
        HOLD_GRACE.min(self.settings.kafka.max_poll_interval / 4)
    }

    /// Counts and logs a consumer error; a fatal one ends the loop after
    /// the batches in hand. The broker being away shows up here, and
    /// librdkafka reconnects by itself. An offset reset means records were
    /// skipped or will be read again: an operator must know, so it is
    /// logged at error.
    fn consumer_error(&mut self, e: &ConsumerError) {
        let kind = e.kind;
        self.metrics.consumer_error(kind).inc();
        let admitted = self.consumer_error_log.admit(Instant::now());
        match (kind, admitted) {
            (ConsumerErrorKind::Fatal, _) => {
                tracing::error!(error = %e, "fatal Kafka consumer error: stopping");
                self.phase.fail(e.to_string());
            }
            (ConsumerErrorKind::OffsetReset, _) => {
                tracing::error!(error = %e, "Kafka consumer reset an offset (out of range)");
            }
            (ConsumerErrorKind::SkippedRecords, _) => self.records_skipped(e),
            (_, Some(suppressed)) => {
                let kind = kind.as_str();
                tracing::warn!(error = %e, kind, suppressed, "Kafka consumer error");
            }
            (_, None) => {}
        }
    }

    /// The client skipped records it could not read, and does not say of
    /// which partition: nothing consumed from now on may be committed, or a
    /// commit could pass records neither stored nor dead-lettered. Writing
    /// goes on (a replay is harmless); readiness says why, and an operator
    /// decides (docs/operations.md, TradebucketRecordsSkipped).
    fn records_skipped(&mut self, e: &ConsumerError) {
        tracing::error!(
            error = %e,
            "the Kafka client skipped records it could not read: offsets are no longer committed past them"
        );
        self.tracker.freeze();
        self.health.records_skipped();
    }

    /// Follows the assignment. After a revocation, the stage forgets its
    /// cached buckets before its next batch: another instance may now
    /// write our former customers. Records of revoked partitions already
    /// taken are *kept* and written, and only their commit is left to the
    /// owner (see `commit`): a delivered record may not be delivered again
    /// (docs/design.md, "Offsets: commit after write", on rebalances).
    fn apply_group_events(&mut self) {
        for event in self.intake.group_events() {
            match event {
                GroupEvent::Assigned(tps) => {
                    if let Hold::Paused(paused) = &mut self.hold {
                        // Holding: new partitions wait too.
                        self.intake.pause(&tps);
                        paused.extend(tps.iter().cloned());
                    }
                    self.assignment.extend(tps);
                }
                GroupEvent::Revoked(tps) => {
                    for tp in &tps {
                        self.assignment.remove(tp);
                        self.tracker.revoked(tp);
                    }
                    self.cache = Cache::Forget;
                }
            }
        }
    }

    /// Commits the offsets that advanced, for the partitions we own.
    /// `Sync` at shutdown.
    fn commit(&mut self, mode: Commit) {
        // Rebalance callbacks may have run since the last look.
        self.apply_group_events();
        // Progress on partitions given away belongs to their new owner,
        // which re-reads from the last commit; committing it here could
        // race that owner's commits.
        let assignment = &self.assignment;
        let commits = self.tracker.take_commits(|tp| assignment.contains(tp));
        self.intake.commit(&commits, mode);
    }

    fn observe_stage(&self, stage: DelayStage, took: Duration) {
        self.metrics.stage_delay(stage).observe(took.as_secs_f64());
    }

    /// Metrics and the debug line of a handled batch.
    fn observe(&self, done: &Done) {
        let (batch, counts, stats) = (&done.records, &done.counts, &done.stats);
        let (m, now) = (&self.metrics, now_ms());
        for ts in batch.iter().filter_map(|r| r.timestamp_ms) {
            m.end_to_end_delay.observe(seconds_between(ts, now));
        }
        m.events_written.inc_by(counts.written);
        m.skipped(SkipReason::AlreadyApplied).inc_by(counts.applied);
        m.skipped(SkipReason::Duplicate).inc_by(counts.duplicates);
        m.batch_events.observe(batch.len() as f64);
        m.batch_customers.observe(stats.customers as f64);
        m.buckets_created.inc_by(stats.buckets_created as u64);
        m.bucket_updates.inc_by(stats.fills as u64);
        m.bucket_conflicts.inc_by(stats.conflicts as u64);
        m.bucket_heads_loaded.inc_by(stats.heads_loaded as u64);
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
            elapsed_ms = done.started.elapsed().as_millis() as u64,
            "batch committed"
        );
    }
}

/// Seconds from a Kafka timestamp to `now` (both milliseconds since the
/// epoch); 0 for a timestamp in the future (the producer's clock is ahead).
fn seconds_between(timestamp_ms: i64, now: u64) -> f64 {
    ((now as i64 - timestamp_ms).max(0) as f64) / 1000.0
}

/// The write stage's result, or never while it is idle.
async fn written<F: Future + Unpin>(writing: &mut Option<F>) -> F::Output {
    match writing {
        Some(w) => w.await,
        None => std::future::pending().await,
    }
}

/// `sleep_until(at)`, or never.
async fn sleep_until(at: Option<TokioInstant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_fatal_error_survives_the_drain_and_ends_the_loop() {
        let mut phase = Phase::Running;
        phase.fail("fenced".into());
        assert!(!phase.running());
        assert_eq!(phase.deadline(), None, "failing has no time limit");
        assert!(phase.drain(Duration::from_secs(5)), "the first drain");
        assert!(!phase.drain(Duration::from_secs(9)), "only once");
        let deadline = TokioInstant::now() + Duration::from_secs(5);
        assert_eq!(phase.deadline(), Some(deadline));
        phase.fail("later".into());
        assert!(matches!(phase.end(), Err(PipelineError::FatalConsumer(e)) if e == "fenced"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_alone_ends_well() {
        let mut phase = Phase::Running;
        assert!(phase.drain(Duration::from_secs(5)));
        assert!(!phase.running());
        assert!(phase.end().is_ok());
    }
}
