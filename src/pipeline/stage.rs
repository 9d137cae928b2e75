//! The write stage: one closed batch at a time, its trades written to
//! buckets (retried until every event has an outcome), then its dead
//! letters sent and acknowledged. The stage owns the bucket writer and the
//! dead-letter producer, and moves into the future of the batch it handles
//! and back out when that is done, so the loop keeps polling the consumer,
//! filling the next batch and committing meanwhile (see `Worker::run`).
//!
//! One stage, one batch at a time, is what keeps each customer's order:
//! batch k+1's trades are written only after batch k's are settled.

use std::sync::Arc;
use std::time::Instant;

use tokio::time::Instant as TokioInstant;

use held::{Held, HeldTrades};

use super::seams::{BucketSink, DeadLetterSink, Record, SendError};
use crate::bucket::plan::Room;
use crate::bucket::writer::{Events, Outcome, WriteStats};
use crate::config::Settings;
use crate::errors::error_chain;
use crate::event::{Mappings, RecordParts, Reject, Source, Trade};
use crate::health::Health;
use crate::kafka::DeadLetter;
use crate::metrics::{Metrics, RetryKind, TimeoutOperation};
use crate::prefetch::prefetch_bytes;
use crate::registry::{Decode, Formats, SchemaId};
use crate::retry::Backoff;
use crate::throttle::Throttle;

mod held;
mod schemas;

/// A batch's events after decoding.
#[derive(Default)]
pub struct Decoded {
    pub events: Vec<(Trade, Source)>,
    /// For each event, the index of its record in the batch.
    record_of: Vec<usize>,
    /// Records to dead-letter, by batch index, with why.
    dead: Vec<(usize, Reject)>,
    /// Avro and Protobuf records whose writer's schema is not in memory,
    /// by batch index, with its id: the stage fetches the schemas before
    /// it writes the batch (`schemas`).
    pending: Vec<(usize, SchemaId)>,
}

impl Decoded {
    /// How many of the batch's records decoded to trades (what the rate
    /// limit counts).
    pub fn events(&self) -> usize {
        self.events.len()
    }
}

/// A batch closed for writing: its records (for dead letters and the
/// commit) and their decoding.
pub(super) struct Closed {
    pub records: Vec<Record>,
    pub decoded: Decoded,
    /// When it was closed (the `queued` stage of the delay metric).
    pub closed: TokioInstant,
    /// Closed under a backlog: its customers' partial buckets may be held
    /// back (see `held`).
    pub backlog: bool,
}

impl Closed {
    /// A batch of no records: it writes the held trades.
    pub fn flush() -> Closed {
        Closed {
            records: Vec::new(),
            decoded: Decoded::default(),
            closed: TokioInstant::now(),
            backlog: false,
        }
    }
}

/// What the loop tells the stage with a batch (see `Worker::handling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Handling {
    pub cache: Cache,
    pub partial: Partial,
}

/// The stage's cached buckets, before a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum Cache {
    /// Kept: no partition was revoked since the last batch.
    #[default]
    Keep,
    /// Forgotten first: a partition was revoked since the last batch, and
    /// another instance may now write our former customers.
    Forget,
}

/// What a batch does with trades that would only part-fill a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Partial {
    /// Holds them back for a later batch (see `held`).
    Hold,
    /// Writes them, and every trade held before.
    Write,
}

/// A batch whose every event is handled: written, found already stored,
/// or dead-lettered and acknowledged.
pub(super) struct Done {
    pub records: Vec<Record>,
    pub counts: OutcomeCounts,
    pub stats: WriteStats,
    /// When the stage took the batch (the loop's clock, as every stage of
    /// the delay metric).
    pub started: TokioInstant,
}

#[derive(Debug, Default)]
pub(super) struct OutcomeCounts {
    pub written: u64,
    pub applied: u64,
    pub duplicates: u64,
    pub dead_lettered: u64,
}

pub(super) struct Stage<B, D> {
    buckets: B,
    dead_letters: D,
    settings: Settings,
    metrics: Metrics,
    health: Arc<Health>,
    /// Dead letters are logged at warn at most once per second.
    dead_letter_log: Throttle,
    /// Held trades by customer.
    held: HeldTrades,
    /// For the records whose schema the stage fetches: how each topic is
    /// read, as in `decode_batch`.
    mappings: Arc<Mappings>,
    formats: Arc<Formats>,
}

impl<B: BucketSink, D: DeadLetterSink> Stage<B, D> {
    pub fn new(
        buckets: B,
        dead_letters: D,
        settings: Settings,
        metrics: Metrics,
        health: Arc<Health>,
        (mappings, formats): (Arc<Mappings>, Arc<Formats>),
    ) -> Self {
        Stage {
            mappings,
            formats,
            buckets,
            dead_letters,
            settings,
            metrics,
            health,
            dead_letter_log: Throttle::hot_path(),
            held: HeldTrades::default(),
        }
    }

    /// Whether trades are held, waiting for a later batch.
    pub fn holds(&self) -> bool {
        self.held.count() > 0
    }

    /// Handles `batch` and hands the stage back with the result. A batch
    /// being written when a revocation happened goes on with its cache:
    /// every write is guarded, so a stale entry costs a conflict, never a
    /// wrong write; the next batch comes with [`Cache::Forget`].
    ///
    /// The trades held by earlier batches are written first, before this
    /// batch's (each customer's order). With [`Partial::Hold`] this batch
    /// may hold trades back in turn; the done records are then all but the
    /// held ones'.
    pub async fn handle(mut self, batch: Closed, handling: Handling) -> (Self, Done) {
        let started = TokioInstant::now();
        if handling.cache == Cache::Forget {
            self.buckets.forget_all();
            self.held.forget_rooms();
        }
        let batch = self.resolve_schemas(batch).await;
        let (mut work, outcomes, hold_from) = self.with_held(batch, handling.partial, started);
        let (outcomes, stats) = self
            .write_until_done(work.events(), outcomes, hold_from)
            .await;
        let mut counts = OutcomeCounts::default();
        let mut held = Vec::new();
        for (j, outcome) in outcomes.into_iter().enumerate() {
            match outcome {
                Outcome::Written => counts.written += 1,
                Outcome::AlreadyApplied => counts.applied += 1,
                Outcome::Duplicate => counts.duplicates += 1,
                Outcome::DeadLetter(r) => work.dead.push((work.record_of[j], r)),
                Outcome::Held(room) => held.push((j, room)),
                Outcome::Pending => unreachable!("write returned Ok with a pending event"),
            }
        }
        counts.dead_lettered = work.dead.len() as u64;
        let dead = std::mem::take(&mut work.dead);
        self.dead_letter(|i| work.record(i), &dead).await;
        let records = self.hold(work, &held, started);
        let done = Done {
            records,
            counts,
            stats,
            started,
        };
        (self, done)
    }

    /// What this write handles, the events' outcomes so far, and the
    /// writer's `hold`: the held trades it takes, then `batch`. A write
    /// that may hold takes the held trades of the batch's customers only,
    /// and of those whose oldest held trade is `batch.hold_max_age` old,
    /// those first (they are written whole); the others wait, unplanned,
    /// for a batch that brings their customer, and so do the batch's
    /// trades that fit in their customer's held bucket (see `held`). A
    /// write that may not hold, or whose held trades would pass
    /// `batch.hold_trades`, takes them all and holds nothing.
    fn with_held(
        &mut self,
        batch: Closed,
        partial: Partial,
        now: TokioInstant,
    ) -> (Work, Vec<Outcome>, Option<usize>) {
        let limits = &self.settings.batch;
        let events = batch.decoded.events.len();
        let hold = partial == Partial::Hold && self.held.count() + events <= limits.hold_trades;
        if !hold {
            let taken = self.held.take_all();
            let outcomes = vec![Outcome::Pending; taken.len() + events];
            return (Work::new(taken, batch), outcomes, None);
        }
        let due = self
            .held
            .take_due(&batch.decoded.events, now, limits.hold_max_age);
        let mut outcomes = vec![Outcome::Pending; due.taken.len()];
        outcomes.extend(due.outcomes);
        (Work::new(due.taken, batch), outcomes, Some(due.expired))
    }

    /// Keeps the `held` events (by index, ascending, each with what its
    /// bucket takes) with their records for a later batch; returns the
    /// other records: the done ones, in no particular order (the offset
    /// tracker takes them in any).
    fn hold(
        &mut self,
        mut work: Work,
        held: &[(usize, Room)],
        started: TokioInstant,
    ) -> Vec<Record> {
        // Taken last first: kept first first, in stream order.
        for (h, room) in work.take_held(held, started).into_iter().rev() {
            self.held.keep(h, room);
        }
        self.metrics.held_trades.set(self.held.count() as i64);
        work.into_done_records()
    }

    /// Writes the batch's events, retrying with backoff until every event
    /// has an outcome. The loop keeps polling the consumer meanwhile (its
    /// partitions paused once it holds), so an outage of any length costs
    /// no rebalance.
    async fn write_until_done(
        &mut self,
        events: Events<'_>,
        mut outcomes: Vec<Outcome>,
        hold: Option<usize>,
    ) -> (Vec<Outcome>, WriteStats) {
        let mut backoff = Backoff::new(&self.settings.retry);
        loop {
            match self.buckets.write(events, &mut outcomes, hold).await {
                Ok(stats) => {
                    self.health.write_succeeded();
                    return (outcomes, stats);
                }
                Err(e) => {
                    self.health.write_failed(e.readiness_reason());
                    if let Some(operation) = e.timeout_operation() {
                        self.metrics.timeout(operation).inc();
                    }
                    self.metrics.retry(RetryKind::Mongodb).inc();
                    let wait = backoff.next_wait();
                    tracing::warn!(error = %error_chain(&e), retry_in = ?wait, "bucket write failed; retrying");
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Sends every dead letter and waits for all acknowledgements; retries
    /// the failed ones until they succeed, because committing past an
    /// unrecorded bad event would lose it silently. A record refused for
    /// its size is sent again at once, shortened (it would never fit);
    /// any other refusal holds the partition, and readiness says so.
    async fn dead_letter<'r>(
        &mut self,
        record: impl Fn(usize) -> &'r Record,
        dead: &[(usize, Reject)],
    ) {
        let mut todo: Vec<DeadLetter> = dead
            .iter()
            .map(|(i, reject)| dead_letter_of(record(*i), reject))
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
                    Err(SendError::TooLarge(_)) if dl.shortened.is_none() => {
                        tracing::warn!(topic = %dl.source.topic, partition = dl.source.partition, offset = dl.source.offset,
                            "dead letter too large for the dead-letter topic; sending it shortened");
                        shortened.push(dl.shortened());
                    }
                    Err(e) => {
                        last_error = Some(e);
                        failed.push(dl);
                    }
                }
            }
            self.health.dead_letters_failing(!failed.is_empty());
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
        error: Option<SendError>,
        backoff: &mut Backoff,
    ) {
        self.metrics.retry(RetryKind::DeadLetter).inc();
        if matches!(error, Some(SendError::TimedOut(_))) {
            self.metrics.timeout(TimeoutOperation::DeadLetter).inc();
        }
        let wait = backoff.next_wait();
        tracing::error!(
            failed,
            error = ?error,
            retry_in = ?wait,
            "cannot write to the dead-letter topic; the partition waits"
        );
        tokio::time::sleep(wait).await;
    }

    /// Counts one acknowledged dead letter and logs it: every one at debug;
    /// at warn, one per second with the count of those held back.
    fn dead_lettered(&mut self, dl: &DeadLetter) {
        let (kind, error) = (dl.reject.kind.as_str(), &dl.reject.message);
        if let Some(suppressed) = self.dead_letter_log.admit(Instant::now()) {
            tracing::warn!(kind, error = %error, topic = %dl.source.topic,
                partition = dl.source.partition, offset = dl.source.offset, suppressed, "event dead-lettered");
        } else {
            tracing::debug!(kind, error = %error, topic = %dl.source.topic,
                partition = dl.source.partition, offset = dl.source.offset, "event dead-lettered");
        }
        self.metrics.dead_lettered(dl.reject.kind).inc();
    }
}

/// What one write handles: the held trades, then the batch's. The two are
/// kept apart, each in its own vectors, and read as one ([`Events`]): the
/// batch's events and records are not copied behind the held ones.
struct Work {
    held_events: Vec<(Trade, Source)>,
    events: Vec<(Trade, Source)>,
    /// The held trades' records: records `0..held_records.len()`.
    held_records: Vec<Record>,
    /// The batch's records: the records after those.
    records: Vec<Record>,
    /// For each event, the index of its record.
    record_of: Vec<usize>,
    dead: Vec<(usize, Reject)>,
    /// When each held trade (the first events) was first held.
    held_since: Vec<TokioInstant>,
}

impl Work {
    /// `held` (their records first), then `batch`.
    fn new(held: Vec<Held>, batch: Closed) -> Work {
        let n = held.len();
        let Decoded {
            events,
            record_of,
            dead,
            pending: _,
        } = batch.decoded;
        let mut work = Work {
            held_events: Vec::with_capacity(n),
            events,
            held_records: Vec::with_capacity(n),
            records: batch.records,
            record_of: Vec::with_capacity(n + record_of.len()),
            dead: dead.into_iter().map(|(i, r)| (n + i, r)).collect(),
            held_since: Vec::with_capacity(n),
        };
        for (i, h) in held.into_iter().enumerate() {
            work.held_events.push(h.event);
            work.held_records.push(h.record);
            work.record_of.push(i);
            work.held_since.push(h.since);
        }
        work.record_of.extend(record_of.into_iter().map(|i| n + i));
        work
    }

    fn events(&self) -> Events<'_> {
        Events::new(&self.held_events, &self.events)
    }

    fn record(&self, i: usize) -> &Record {
        match i.checked_sub(self.held_records.len()) {
            None => &self.held_records[i],
            Some(j) => &self.records[j],
        }
    }

    /// Takes the events `held` (by index, ascending) out, each with its
    /// record and room, in the opposite order (reversing them would move
    /// each twice more, and a held trade is some 300 bytes). Each is
    /// swapped with the last of its vector (from the highest index down,
    /// so no event or record to be taken is moved first): the events and
    /// records left are only dropped or handed back as done, in any order,
    /// and the rest are not moved.
    fn take_held(&mut self, held: &[(usize, Room)], started: TokioInstant) -> Vec<(Held, Room)> {
        let (n, nr) = (self.held_events.len(), self.held_records.len());
        let mut taken = Vec::with_capacity(held.len());
        for &(j, room) in held.iter().rev() {
            let event = match j.checked_sub(n) {
                None => self.held_events.swap_remove(j),
                Some(k) => self.events.swap_remove(k),
            };
            let r = self.record_of[j];
            let record = match r.checked_sub(nr) {
                None => self.held_records.swap_remove(r),
                Some(k) => self.records.swap_remove(k),
            };
            let since = self.held_since.get(j).copied().unwrap_or(started);
            let held = Held {
                event,
                record,
                since,
            };
            taken.push((held, room));
        }
        taken
    }

    /// The records left once the held ones are taken: the done ones.
    fn into_done_records(mut self) -> Vec<Record> {
        self.records.append(&mut self.held_records);
        self.records
    }
}

/// How many records ahead `decode_batch` asks for a payload.
const PREFETCH_AHEAD: usize = 2;

/// Decodes every record; the undecodable ones are to be dead-lettered.
/// A topic with an input mapping is read by it (`event::mapping`); any
/// other by the default schema, exactly as without mappings.
///
/// An Avro or Protobuf record whose schema is not in memory is left
/// pending, for the stage to fetch its schema (see `schemas`).
pub fn decode_batch(
    batch: &[Record],
    mappings: &Mappings,
    formats: &Formats,
    max_bytes: usize,
) -> Decoded {
    let mut d = Decoded {
        events: Vec::with_capacity(batch.len()),
        record_of: Vec::with_capacity(batch.len()),
        dead: Vec::new(),
        pending: Vec::new(),
    };
    for (i, r) in batch.iter().enumerate() {
        // Records copied in up to a batch ago are read from memory, not a
        // cache: the payload after next is asked for while this one
        // decodes (see `crate::prefetch`).
        if let Some(payload) = batch
            .get(i + PREFETCH_AHEAD)
            .and_then(|r| r.payload.as_deref())
        {
            prefetch_bytes(payload);
        }
        let source = r.source();
        let parts = RecordParts {
            payload: r.payload.as_deref(),
            key: r.key.as_deref(),
            headers: &r.headers,
        };
        let mapping = mappings.get(&source.topic).map(AsRef::as_ref);
        match formats.decode(parts, mapping, &source, max_bytes, None) {
            Decode::Done(Ok(trade)) => {
                d.events.push((trade, source));
                d.record_of.push(i);
            }
            Decode::Done(Err(reject)) => d.dead.push((i, reject)),
            Decode::Missing(id) => d.pending.push((i, id)),
        }
    }
    d
}

fn dead_letter_of(r: &Record, reject: &Reject) -> DeadLetter {
    DeadLetter {
        source: r.source(),
        key: r.key.as_deref().map(<[u8]>::to_vec),
        payload: r.payload.clone(),
        headers: r.headers.clone(),
        reject: reject.clone(),
        shortened: None,
    }
}
