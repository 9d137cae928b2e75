//! One round of the writer: its plans, each with whether it held, and
//! what went wrong, addressed by typed indices (`PlanId`, `NewBucketId`).
//! What lasts across rounds is the `Ledger`'s (`writer/ledger.rs`).

use std::ops::Range;

use super::ledger::Ledger;
use crate::bucket::plan::{CustomerPlan, Fill, NewBucket};
use crate::bucket::store::StatementError;
use crate::event::CustomerId;

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

impl Planned {
    /// A plan none of whose operations has been sent yet.
    pub(super) fn new(customer: CustomerId, plan: CustomerPlan) -> Self {
        Planned {
            customer,
            plan,
            held: true,
        }
    }
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
    pub(super) fn new(plans: Vec<Planned>) -> Self {
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
