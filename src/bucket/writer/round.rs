//! The writer's bookkeeping: a `Ledger` (one `write` call's events and
//! what lasts across its rounds: the outcomes, the customers still pending,
//! what the database told us) and a `Round` (one round's plans, each with
//! whether it held, and what went wrong), addressed by typed indices
//! (`PlanId`, `NewBucketId`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;

use super::Outcome;
use crate::bucket::plan::{CustomerPlan, Fill, Known, NewBucket, UnreadableBucket};
use crate::bucket::store::StatementError;
use crate::bucket::writer::WriteStats;
use crate::event::{CustomerId, Reject, RejectKind, Source, Trade};

/// One `write` call: the events, their outcomes, and what the rounds learn
/// about them along the way.
pub(super) struct Ledger<'a> {
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
    /// The call's `hold` (see `BucketWriter::write`).
    hold_from: Option<usize>,
    pub(super) stats: WriteStats,
}

impl<'a> Ledger<'a> {
    /// Every customer with an event not yet settled (a retried batch keeps
    /// the outcomes of the failed call). `hold_from`: the call's `hold`
    /// (see `BucketWriter::write`).
    pub(super) fn new(
        events: &'a [(Trade, Source)],
        outcomes: &'a mut [Outcome],
        hold_from: Option<usize>,
    ) -> Self {
        // Grouped in a hash map by reference (a tree walk and a clone per
        // event were 2 % of the worker's instructions), then ordered: the
        // plans, and so the commands' bytes, follow the customers' order.
        // foldhash's seed is random per process, so a producer cannot pick
        // customer ids that collide.
        let mut groups: HashMap<&CustomerId, Vec<usize>, foldhash::fast::RandomState> =
            HashMap::default();
        for (i, (trade, _)) in events.iter().enumerate() {
            if !outcomes[i].is_final() {
                groups.entry(&trade.customer).or_default().push(i);
            }
        }
        let pending: BTreeMap<CustomerId, Vec<usize>> = groups
            .into_iter()
            .map(|(customer, idx)| (customer.clone(), idx))
            .collect();
        let stats = WriteStats {
            customers: pending.len(),
            ..WriteStats::default()
        };
        Ledger {
            events,
            outcomes,
            pending,
            known: HashMap::new(),
            isolate: HashMap::new(),
            verified: HashSet::new(),
            verified_cached: HashSet::new(),
            loaded: HashSet::new(),
            unreadable: HashMap::new(),
            hold_from,
            stats,
        }
    }

    /// Whether `customer`, whose events are `idx`, may hold back a partial
    /// bucket: the call allows it from its first event on, and MongoDB has
    /// not refused one of its writes (isolating the offender writes a few
    /// events at a time, whatever they fill).
    pub(super) fn may_hold(&self, customer: &CustomerId, idx: &[usize]) -> bool {
        let first = idx.first().copied().unwrap_or(0);
        self.hold_from.is_some_and(|from| first >= from) && !self.isolate.contains_key(customer)
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

/// A plan's place in its round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct PlanId(usize);

/// One new bucket of a round: its plan, and its place in the plan's chain.
#[derive(Debug, Clone, Copy)]
pub(super) struct NewBucketId {
    pub(super) plan: PlanId,
    pub(super) nth: usize,
}

/// One customer's plan in a round.
pub(super) struct Planned {
    pub(super) customer: CustomerId,
    pub(super) plan: CustomerPlan,
    /// Every operation so far went in. Once false, none of the plan's
    /// later operations is sent (a chain never skips a bucket).
    pub(super) held: bool,
}

/// One round: the plans with writes, and what the database said of them.
pub(super) struct Round {
    plans: Vec<Planned>,
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
        let plans = plans
            .into_iter()
            .map(|(customer, plan)| Planned {
                customer,
                plan,
                held: true,
            })
            .collect();
        Round {
            plans,
            conflicted: Vec::new(),
            stale: Vec::new(),
            transient: None,
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.plans.is_empty()
    }

    /// The plans, once the round's writes are done (see
    /// `BucketWriter::settle`); the round keeps what went wrong.
    pub(super) fn take_plans(&mut self) -> Vec<Planned> {
        std::mem::take(&mut self.plans)
    }

    /// Every plan, in order.
    pub(super) fn plans(&self) -> impl Iterator<Item = (PlanId, &Planned)> {
        self.plans
            .iter()
            .enumerate()
            .map(|(p, planned)| (PlanId(p), planned))
    }

    pub(super) fn get(&self, p: PlanId) -> &Planned {
        &self.plans[p.0]
    }

    pub(super) fn customer(&self, p: PlanId) -> &CustomerId {
        &self.get(p).customer
    }

    pub(super) fn held(&self, p: PlanId) -> bool {
        self.get(p).held
    }

    /// The fill of a plan that has one (the caller chose `p` for it).
    pub(super) fn fill(&self, p: PlanId) -> &Fill {
        self.get(p).plan.fill.as_ref().expect("a plan with a fill")
    }

    pub(super) fn new_bucket(&self, b: NewBucketId) -> &NewBucket {
        &self.get(b.plan).plan.new_buckets[b.nth]
    }

    /// The batch indices an operation writes.
    pub(super) fn events(&self, p: PlanId, op: Op) -> &[usize] {
        match op {
            Op::Fill => &self.fill(p).events,
            Op::NewBucket(nth) => &self.new_bucket(NewBucketId { plan: p, nth }).events,
        }
    }

    /// The plans with a fill.
    pub(super) fn fillers(&self) -> Vec<PlanId> {
        self.plans()
            .filter(|(_, planned)| planned.plan.fill.is_some())
            .map(|(p, _)| p)
            .collect()
    }

    /// The new buckets `which(n)` selects of each plan of `n` new buckets
    /// whose operations have all held so far.
    pub(super) fn new_buckets(&self, which: impl Fn(usize) -> Range<usize>) -> Vec<NewBucketId> {
        self.plans()
            .filter(|(_, planned)| planned.held)
            .flat_map(|(plan, planned)| {
                which(planned.plan.new_buckets.len()).map(move |nth| NewBucketId { plan, nth })
            })
            .collect()
    }

    /// MongoDB refused `op` of plan `p`. A duplicate key means another
    /// write got there first: a conflict, settled from the true state. A
    /// refusal of the data is permanent (see [`Ledger::refused`]); any
    /// other code makes the batch retry.
    pub(super) fn failed(
        &mut self,
        ledger: &mut Ledger<'_>,
        p: PlanId,
        op: Op,
        e: &StatementError,
    ) {
        self.plans[p.0].held = false;
        let customer = self.customer(p).clone();
        if e.is_duplicate_key() {
            self.conflicted.push(customer);
        } else if e.refuses_data() {
            ledger.refused(&customer, self.events(p, op), &e.message);
            self.stale.push(customer);
        } else {
            self.stale.push(customer);
            self.transient.get_or_insert_with(|| e.clone());
        }
    }

    /// Plan `p` is not known to have gone in: if it had held so far, it is
    /// stale (a plan that already failed is accounted for).
    pub(super) fn mark_stale(&mut self, p: PlanId) {
        let planned = &mut self.plans[p.0];
        if planned.held {
            planned.held = false;
            self.stale.push(planned.customer.clone());
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
