//! The batches between the consumer and the write stage: the open one being
//! filled, the closed ones queued for the stage, and the stage itself while
//! it is idle. Which batch goes to the stage, and when, is decided here: its
//! bounds, its linger, the in-flight bound, the rate limit, and a batch of
//! no records for held trades (docs/design.md, "The pipelined loop").
//!
//! The loop ([`super::worker`]) takes the records from the consumer and
//! tells the stage what it knows of each batch (a revocation, shutdown);
//! it keeps the phase, the hold and the commits.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant as TokioInstant;

use super::seams::{BucketSink, DeadLetterSink, Record};
use super::stage::{decode_batch, Closed, Stage};
use crate::config::{BatchSettings, Settings};
use crate::event::Mappings;
use crate::metrics::{DelayStage, Metrics};
use crate::ratelimit::RateLimit;
use crate::registry::Formats;

/// The batch being filled.
#[derive(Default)]
struct Open {
    records: Vec<Record>,
    bytes: usize,
    /// When its first record came (the linger bound counts from it).
    since: Option<TokioInstant>,
}

/// The open batch, the closed ones and the idle write stage.
pub(super) struct Batches<B, D> {
    limits: BatchSettings,
    /// `kafka.max_message_bytes`, for decoding.
    max_message_bytes: usize,
    /// See [`Batches::flush_held`].
    idle_flush_after: Duration,
    /// The topics' input mappings, compiled once (`event::mapping`).
    mappings: Arc<Mappings>,
    /// The topics' payload formats and the Schema Registry (`registry`).
    formats: Arc<Formats>,
    metrics: Metrics,
    /// The write stage while idle; `None` while it writes: its future (a
    /// local of `Worker::run`, so that its type stays concrete and `Send`
    /// where B and D are) holds it then.
    stage: Option<Stage<B, D>>,
    open: Open,
    /// Closed batches waiting for the stage, oldest first.
    queued: VecDeque<Closed>,
    /// Whether the last batch closed full (see `close`).
    last_full: bool,
    /// Since when the stage, holding trades, has had nothing to write.
    idle_since: Option<TokioInstant>,
    /// `rate_limit.events_per_second`, reserved for each batch before it
    /// goes to the stage.
    rate_limit: RateLimit,
    /// When the oldest queued batch, already reserved under the rate
    /// limit, may go to the stage.
    write_at: Option<TokioInstant>,
}

impl<B: BucketSink, D: DeadLetterSink> Batches<B, D> {
    pub fn new(
        settings: &Settings,
        (mappings, formats): (Arc<Mappings>, Arc<Formats>),
        metrics: Metrics,
        stage: Stage<B, D>,
    ) -> Self {
        Batches {
            limits: settings.batch.clone(),
            max_message_bytes: settings.kafka.max_message_bytes,
            idle_flush_after: idle_flush_after(settings),
            mappings,
            formats,
            metrics,
            stage: Some(stage),
            open: Open::default(),
            queued: VecDeque::new(),
            last_full: false,
            idle_since: None,
            rate_limit: RateLimit::new(settings.rate_limit.events_per_second),
            write_at: None,
        }
    }

    /// Batches in flight besides the open one: being written or waiting.
    fn closed_in_flight(&self) -> usize {
        self.queued.len() + usize::from(self.stage.is_none())
    }

    /// Closed batches waiting for the stage.
    pub fn queued(&self) -> usize {
        self.queued.len()
    }

    /// Whether the bound leaves room for the open batch: fewer than
    /// `batch.max_in_flight` batches are closed (the open one is the
    /// last). Records that arrive while held (the consumer is polled while
    /// paused, and a partition assigned meanwhile may deliver before it is
    /// paused) are kept in the open batch, but give it no room: it neither
    /// grows on from them nor closes until a closed batch is handled.
    fn room(&self) -> bool {
        self.closed_in_flight() < self.limits.max_in_flight
    }

    /// Whether the open batch is full.
    fn full(&self) -> bool {
        // Under a rate limit a batch holds one second of it at most, so a
        // batch's wait for the limit stays about a second.
        let max_events = self.rate_limit.batch_cap(self.limits.max_events);
        self.open.records.len() >= max_events || self.open.bytes >= self.limits.max_bytes
    }

    /// Whether the open batch may take another record.
    pub fn may_take(&self) -> bool {
        self.room() && !self.full()
    }

    /// The stage is idle and nothing waits for it: a batch closed now is
    /// written at once.
    pub fn stage_free(&self) -> bool {
        self.stage.is_some() && self.queued.is_empty()
    }

    /// Whether the fill stops before the consumer's queue is empty: the
    /// stage is free and the open batch has lingered its bound.
    pub fn linger_over(&self) -> bool {
        let linger = self.limits.linger;
        self.stage_free() && self.open.since.is_some_and(|t| t.elapsed() >= linger)
    }

    /// Takes a record into the open batch.
    pub fn take(&mut self, record: Record) {
        self.open.bytes += record.size();
        self.open.since.get_or_insert_with(TokioInstant::now);
        self.open.records.push(record);
    }

    /// At the end of a fill: closes the open batch when full, or when the
    /// stage is free (nothing more was queued, or the linger passed), if
    /// the bound leaves room. `in_flight` as for [`Self::close`].
    pub fn close_if_due(&mut self, in_flight: usize) {
        let due = self.full() || self.stage_free();
        if !self.open.records.is_empty() && self.room() && due {
            self.close(in_flight);
        }
    }

    /// Closes the open batch (if it holds anything), decodes it and queues
    /// it for the stage. `in_flight`: the events consumed and not yet
    /// handled, which `tradebucket_in_flight_events` shows as of each
    /// close.
    pub fn close(&mut self, in_flight: usize) {
        if self.open.records.is_empty() {
            return;
        }
        // Full: it filled to its bound before the stage was free for it,
        // so records come faster than they are written (a backlog). The
        // batch after a full one is still part of it even if short:
        // mid-backlog the stage often frees up while librdkafka's queue is
        // momentarily empty, and ending the backlog there wrote every held
        // trade as a part-filled bucket (docs/design.md, "Holding partial
        // buckets under a backlog"). Two short batches in a row end it.
        let full = self.full();
        let was_full = std::mem::replace(&mut self.last_full, full);
        let backlog = full || was_full;
        // The next batch starts with this one's size reserved: under a
        // backlog it fills to the same bound, so it is not grown by
        // doubling (a copy of every record so far at each step, and large
        // blocks freed and asked for again); under light load it is small.
        let next = Open {
            records: Vec::with_capacity(self.open.records.len()),
            ..Open::default()
        };
        let open = std::mem::replace(&mut self.open, next);
        if let Some(since) = open.since {
            self.observe_stage(DelayStage::Batching, since.elapsed());
        }
        self.metrics
            .events_consumed
            .inc_by(open.records.len() as u64);
        self.metrics.in_flight_events.set(in_flight as i64);
        let decoding = TokioInstant::now();
        let decoded = decode_batch(
            &open.records,
            &self.mappings,
            &self.formats,
            self.max_message_bytes,
        );
        self.observe_stage(DelayStage::Decode, decoding.elapsed());
        self.queued.push_back(Closed {
            records: open.records,
            decoded,
            closed: TokioInstant::now(),
            backlog,
        });
    }

    /// Queues a batch of no records when held trades would otherwise wait:
    /// the stage is idle with nothing to write and the open batch stays
    /// empty for `idle_flush_after`, or the loop no longer takes records
    /// (`running` false: shutdown, a fatal error). It is dispatched at
    /// once: nothing else is queued.
    pub fn flush_held(&mut self, running: bool) {
        let idle = self.stage_free() && self.open.records.is_empty();
        if !idle || !self.stage.as_ref().is_some_and(|s| s.holds()) {
            self.idle_since = None;
            return;
        }
        let since = *self.idle_since.get_or_insert_with(TokioInstant::now);
        if running && since.elapsed() < self.idle_flush_after {
            return;
        }
        self.idle_since = None;
        self.queued.push_back(Closed::flush());
    }

    /// When an idle loop flushes its held trades (see `flush_held`).
    pub fn flush_due(&self) -> Option<TokioInstant> {
        self.idle_since.map(|t| t + self.idle_flush_after)
    }

    /// The one place a batch goes to the write stage: the oldest queued
    /// one, with the stage, once the stage is idle and the rate limit lets
    /// the batch's events through. Waiting for the limit, the batch stays
    /// queued: the in-flight bound is reached, and the loop holds the
    /// consumer as for any other backpressure (`Worker::hold_or_release`),
    /// so a low limit never costs a rebalance.
    pub fn dispatch(&mut self) -> Option<(Stage<B, D>, Closed)> {
        if self.stage.is_none() || !self.rate_limit_passed()? {
            return None;
        }
        let stage = self.stage.take()?;
        let batch = self.queued.pop_front()?;
        self.observe_stage(DelayStage::Queued, batch.closed.elapsed());
        Some((stage, batch))
    }

    /// The stage is back from a write: idle again.
    pub fn stage_back(&mut self, stage: Stage<B, D>) {
        self.stage = Some(stage);
    }

    /// Whether the oldest queued batch may be written now; `None` if
    /// nothing is queued. Its events are reserved once, the wait counted
    /// in `tradebucket_throttled_seconds_total`, and `write_at` wakes the
    /// loop when it is over.
    fn rate_limit_passed(&mut self) -> Option<bool> {
        let events = self.queued.front()?.decoded.events();
        let now = TokioInstant::now();
        let at = *self.write_at.get_or_insert_with(|| {
            let wait = self.rate_limit.reserve(events, now);
            self.metrics.throttled_seconds.inc_by(wait.as_secs_f64());
            now + wait
        });
        if at > now {
            return Some(false);
        }
        self.write_at = None;
        Some(true)
    }

    /// When the rate limit lets the oldest queued batch through, if it
    /// waits for it.
    pub fn write_at(&self) -> Option<TokioInstant> {
        self.write_at
    }

    fn observe_stage(&self, stage: DelayStage, took: Duration) {
        self.metrics.stage_delay(stage).observe(took.as_secs_f64());
    }
}

/// How long the loop has nothing to write before it writes its held
/// trades: two fetch waits and the linger. A broker answers a fetch as
/// soon as it has data and holds it at most `kafka.fetch_wait_max` when it
/// has none, so a whole wait without a record means the backlog is over;
/// the local stand-in holds every fetch to the end of the wait, so a gap
/// of up to two waits is normal there mid-backlog, and at `batch.linger`
/// alone such gaps wrote held trades as part-filled buckets.
fn idle_flush_after(settings: &Settings) -> Duration {
    settings.batch.linger + 2 * settings.kafka.fetch_wait_max
}
