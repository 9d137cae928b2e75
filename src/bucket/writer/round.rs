//! The writer's bookkeeping: a `Batch` (what lasts across rounds: the
//! outcomes, the customers still pending, what the database told us) and a
//! `Round` (one round's plans, which of them held, and what went wrong).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;

use super::Outcome;
use crate::bucket::plan::{CustomerPlan, Fill, Known, UnreadableBucket};
use crate::bucket::store::StatementError;
use crate::bucket::writer::WriteStats;
use crate::event::{CustomerId, Reject, RejectKind, Source, Trade};

/// One `write` call: the events, their outcomes, and what the rounds learn
/// about them along the way.
pub(super) struct Batch<'a> {
    pub(super) events: &'a [(Trade, Source)],
    /// One per event; `Pending` until settled.
    pub(super) outcomes: &'a mut [Outcome],
    /// Customers not yet done, with their events' indices in stream order.
    /// A customer leaves when all its writes held (or it needed none).
    pub(super) pending: BTreeMap<CustomerId, Vec<usize>>,
    /// Keys the database showed us beyond each customer's newest bucket.
    pub(super) known: HashMap<CustomerId, Known>,
    /// Customers MongoDB refused a write of several events for, with how
    /// many events each of their writes may hold until the culprit is
    /// found.
    pub(super) isolate: HashMap<CustomerId, usize>,
    /// Events already looked up by `verify_below_watermark`.
    pub(super) verified: HashSet<usize>,
    /// Events already looked up by `verify_cached_keys`.
    pub(super) verified_cached: HashSet<usize>,
    /// Customers whose newest bucket this call read from MongoDB.
    pub(super) loaded: HashSet<CustomerId>,
    /// Customers whose newest bucket we cannot plan against, this call.
    pub(super) unreadable: HashMap<CustomerId, UnreadableBucket>,
    pub(super) stats: WriteStats,
}

impl<'a> Batch<'a> {
    /// Every customer with an event not yet settled (a retried batch keeps
    /// the outcomes of the failed call).
    pub(super) fn new(events: &'a [(Trade, Source)], outcomes: &'a mut [Outcome]) -> Self {
        let mut pending: BTreeMap<CustomerId, Vec<usize>> = BTreeMap::new();
        for (i, (trade, _)) in events.iter().enumerate() {
            if !outcomes[i].is_final() {
                pending.entry(trade.customer.clone()).or_default().push(i);
            }
        }
        let stats = WriteStats {
            customers: pending.len(),
            ..WriteStats::default()
        };
        Batch {
            events,
            outcomes,
            pending,
            known: HashMap::new(),
            isolate: HashMap::new(),
            verified: HashSet::new(),
            verified_cached: HashSet::new(),
            loaded: HashSet::new(),
            unreadable: HashMap::new(),
            stats,
        }
    }

    /// Dead-letters every pending event of a customer whose newest bucket
    /// cannot be read, naming the bucket and its fault: one bad bucket
    /// must not stop every partition, and the events are safe in the
    /// dead-letter topic until it is mended and they are replayed.
    pub(super) fn reject_unreadable(&mut self) {
        for (customer, bucket) in std::mem::take(&mut self.unreadable) {
            let Some(idx) = self.pending.remove(&customer) else {
                continue;
            };
            let reject = Reject::new(
                RejectKind::Rejected,
                format!("the customer's newest {bucket}"),
            );
            record(self.outcomes, &idx, Outcome::DeadLetter(reject));
        }
    }

    /// How many events have an outcome: the stall rule's measure of progress.
    pub(super) fn settled(&self) -> usize {
        self.outcomes.iter().filter(|o| o.is_final()).count()
    }

    pub(super) fn trades(&self, idx: &[usize]) -> Vec<&'a Trade> {
        idx.iter().map(|&i| &self.events[i].0).collect()
    }

    /// MongoDB refused a write for its data. A single event is the culprit
    /// and is dead-lettered, and the customer's writes go back to full
    /// size. With several, the customer's writes hold half as many events
    /// from now on: the first half goes in (or is refused and halved
    /// again), the next write is the second half, and so on, so one
    /// offender among n events costs about 2·log2(n) extra writes, not n.
    pub(super) fn refused(&mut self, customer: &CustomerId, idx: &[usize], message: &str) {
        if idx.len() == 1 {
            let reject = Reject::new(
                RejectKind::Rejected,
                format!("MongoDB refused the bucket write: {message}"),
            );
            record(self.outcomes, idx, Outcome::DeadLetter(reject));
            self.isolate.remove(customer);
        } else {
            self.isolate.insert(customer.clone(), idx.len().div_ceil(2));
        }
    }
}

/// One operation of a customer's plan.
#[derive(Debug, Clone, Copy)]
pub(super) enum Op {
    Fill,
    /// The plan's new bucket at this position in its chain.
    NewBucket(usize),
}

/// One round: the plans with writes, and what the database said of them.
pub(super) struct Round {
    pub(super) plans: Vec<(CustomerId, CustomerPlan)>,
    /// Per plan: every operation so far went in. Once false, none of the
    /// plan's later operations is sent (a chain never skips a bucket).
    pub(super) held: Vec<bool>,
    /// Hit a duplicate key: reloaded, and their stored keys looked up.
    pub(super) conflicted: Vec<CustomerId>,
    /// Our view of them is wrong or unknown (a guard missed, a refusal, a
    /// write not attempted): reloaded.
    pub(super) stale: Vec<CustomerId>,
    /// A statement failed for a reason other than its data: the batch is
    /// retried once the round is settled.
    pub(super) transient: Option<StatementError>,
}

impl Round {
    pub(super) fn new(plans: Vec<(CustomerId, CustomerPlan)>) -> Self {
        Round {
            held: vec![true; plans.len()],
            plans,
            conflicted: Vec::new(),
            stale: Vec::new(),
            transient: None,
        }
    }

    pub(super) fn fill(&self, p: usize) -> &Fill {
        self.plans[p].1.fill.as_ref().expect("a plan with a fill")
    }

    /// The batch indices an operation writes.
    pub(super) fn events(&self, p: usize, op: Op) -> &[usize] {
        match op {
            Op::Fill => &self.fill(p).events,
            Op::NewBucket(b) => &self.plans[p].1.new_buckets[b].events,
        }
    }

    /// `(plan, bucket)` for the new buckets `which(n)` selects of each plan
    /// of `n` new buckets whose operations have all held so far.
    pub(super) fn new_buckets(&self, which: impl Fn(usize) -> Range<usize>) -> Vec<(usize, usize)> {
        self.plans
            .iter()
            .enumerate()
            .filter(|&(p, _)| self.held[p])
            .flat_map(|(p, (_, plan))| which(plan.new_buckets.len()).map(move |b| (p, b)))
            .collect()
    }

    /// MongoDB refused `op` of plan `p`. A duplicate key means another
    /// write got there first: a conflict, settled from the true state. A
    /// refusal of the data is permanent (see [`Batch::refused`]); any other
    /// code makes the batch retry.
    pub(super) fn failed(&mut self, batch: &mut Batch<'_>, p: usize, op: Op, e: &StatementError) {
        self.held[p] = false;
        if e.is_duplicate_key() {
            self.conflicted.push(self.plans[p].0.clone());
        } else if e.refuses_data() {
            batch.refused(&self.plans[p].0, self.events(p, op), &e.message);
            self.stale.push(self.plans[p].0.clone());
        } else {
            self.stale.push(self.plans[p].0.clone());
            self.transient.get_or_insert_with(|| e.clone());
        }
    }

    /// Plan `p` is not known to have gone in: if it had held so far, it is
    /// stale (a plan that already failed is accounted for).
    pub(super) fn mark_stale(&mut self, p: usize) {
        if self.held[p] {
            self.held[p] = false;
            self.stale.push(self.plans[p].0.clone());
        }
    }
}

/// The `(customer, key)` pairs to look up: each key with the customer of
/// every event that holds it.
pub(super) fn keys_of(
    events: &[(Trade, Source)],
    by_key: &HashMap<&str, Vec<usize>>,
) -> Vec<(CustomerId, String)> {
    by_key
        .iter()
        .flat_map(|(key, idx)| {
            idx.iter()
                .map(|&i| (events[i].0.customer.clone(), key.to_string()))
        })
        .collect()
}

/// Records a final outcome unless one is already known (a write we saw
/// succeed stays `Written` when a later round finds it below the watermark).
pub(super) fn record(outcomes: &mut [Outcome], idx: &[usize], outcome: Outcome) {
    for &i in idx {
        if !outcomes[i].is_final() {
            outcomes[i] = outcome.clone();
        }
    }
}

pub(super) fn all_final(idx: Option<&Vec<usize>>, outcomes: &[Outcome]) -> bool {
    idx.is_none_or(|idx| idx.iter().all(|&i| outcomes[i].is_final()))
}
