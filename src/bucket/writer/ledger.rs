//! One `write` call's events and what lasts across its rounds: the
//! outcomes, the customers still pending, and what the database told us
//! about their keys. The writer asks and tells it through its methods; a
//! `Round` (`writer/round.rs`) reports refusals to it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::LazyLock;

use crate::bucket::id::Prefix;
use crate::bucket::plan::{
    plan_customer_owned, BucketHead, CustomerPlan, Event, Known, Limits, UnreadableBucket,
};
use crate::bucket::writer::{Events, Outcome, WriteStats};
use crate::event::{CustomerId, Reject, RejectKind, Source, Trade};
use crate::prefetch::prefetch;

/// What a customer the database told us nothing about is planned with.
static NOTHING_KNOWN: LazyLock<Known> = LazyLock::new(Known::default);

/// Events by trade key: what a lookup asks for.
pub(super) type ByKey<'a> = HashMap<&'a str, Vec<usize>>;

/// A pending customer's events: their indices in stream order, and for
/// each partition they come from, the one with the lowest offset.
///
/// A bucket's watermark covers an event when the event's offset is at or
/// below the partition's watermark, so it covers one of the customer's
/// events of a partition only if it covers the lowest. Checking those few
/// first spares the check of every event, the common case (nothing
/// redelivered), and with it a read of each event where it lies in the
/// batch: a cache miss per event, 4 % of the worker's CPU on a keyed
/// backlog (docs/benchmarks.md, "Session 35").
#[derive(Debug, Default)]
struct Group<'a> {
    idx: Vec<usize>,
    lowest: Vec<&'a Source>,
}

impl<'a> Group<'a> {
    fn add(&mut self, i: usize, source: &'a Source) {
        self.idx.push(i);
        let same = |s: &&Source| s.partition == source.partition && s.topic == source.topic;
        match self.lowest.iter_mut().find(|s| same(s)) {
            Some(low) if source.offset < low.offset => *low = source,
            Some(_) => {}
            None => self.lowest.push(source),
        }
    }

    /// Whether `head` may cover one of the events: false only if it
    /// covers none (see the type).
    fn may_be_covered(&self, head: &BucketHead) -> bool {
        self.lowest.iter().any(|s| head.covers(s))
    }
}

/// One `write` call: the events, their outcomes, and what the rounds learn
/// about them along the way.
pub(super) struct Ledger<'a> {
    events: Events<'a>,
    /// One per event; `Pending` until settled.
    outcomes: &'a mut [Outcome],
    /// Customers not yet done, with their events. A customer leaves when
    /// all its writes held (or it needed none).
    pending: BTreeMap<CustomerId, Group<'a>>,
    /// Keys the database showed us beyond each customer's newest bucket.
    known: HashMap<CustomerId, Known>,
    /// Customers MongoDB refused a write of several events for, with how
    /// many events each of their writes may hold until the culprit is
    /// found.
    isolate: HashMap<CustomerId, usize>,
    /// Events already looked up by `below_watermark_unverified`.
    verified: HashSet<usize>,
    /// Events already looked up by `cached_keys_unverified`.
    verified_cached: HashSet<usize>,
    /// Customers whose newest bucket this call read from MongoDB.
    loaded: HashSet<CustomerId>,
    /// Customers whose newest bucket we cannot plan against, this call.
    unreadable: HashMap<CustomerId, UnreadableBucket>,
    /// The call's `hold` (see `BucketWriter::write`).
    hold_from: Option<usize>,
    stats: WriteStats,
}

impl<'a> Ledger<'a> {
    /// Every customer with an event not yet settled (a retried batch keeps
    /// the outcomes of the failed call). `hold_from`: the call's `hold`
    /// (see `BucketWriter::write`).
    pub(super) fn new(
        events: Events<'a>,
        outcomes: &'a mut [Outcome],
        hold_from: Option<usize>,
    ) -> Self {
        // Grouped in a hash map by reference (a tree walk and a clone per
        // event were 2 % of the worker's instructions), then ordered: the
        // plans, and so the commands' bytes, follow the customers' order.
        // foldhash's seed is random per process, so a producer cannot pick
        // customer ids that collide.
        let mut groups: HashMap<&CustomerId, Group<'a>, foldhash::fast::RandomState> =
            HashMap::default();
        for (i, (trade, source)) in events.iter().enumerate() {
            if !outcomes[i].is_final() {
                groups.entry(&trade.customer).or_default().add(i, source);
            }
        }
        let pending: BTreeMap<CustomerId, Group<'a>> = groups
            .into_iter()
            .map(|(customer, group)| (customer.clone(), group))
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

    /// Whether every customer is done.
    pub(super) fn is_done(&self) -> bool {
        self.pending.is_empty()
    }

    /// How many customers are not yet done.
    pub(super) fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// The customers not yet done.
    pub(super) fn pending_customers(&self) -> impl Iterator<Item = &CustomerId> {
        self.pending.keys()
    }

    pub(super) fn stats_mut(&mut self) -> &mut WriteStats {
        &mut self.stats
    }

    pub(super) fn into_stats(self) -> WriteStats {
        self.stats
    }

    /// How many events have an outcome: the stall rule's measure of progress.
    pub(super) fn settled(&self) -> usize {
        self.outcomes.iter().filter(|o| o.is_final()).count()
    }

    pub(super) fn trade(&self, i: usize) -> &'a Trade {
        &self.events.get(i).0
    }

    pub(super) fn trades(&self, idx: &[usize]) -> Vec<&'a Trade> {
        idx.iter().map(|&i| &self.events.get(i).0).collect()
    }

    /// Records a final outcome unless one is already known (a write we saw
    /// succeed stays `Written` when a later round finds it below the
    /// watermark).
    pub(super) fn record(&mut self, idx: &[usize], outcome: Outcome) {
        for &i in idx {
            if !self.outcomes[i].is_final() {
                self.outcomes[i] = outcome.clone();
            }
        }
    }

    /// `customer`'s newest bucket was read from MongoDB by this call;
    /// `unreadable` if we cannot plan against it (see [`Self::reject_unreadable`]).
    pub(super) fn loaded(&mut self, customer: &CustomerId, unreadable: Option<UnreadableBucket>) {
        self.loaded.insert(customer.clone());
        if let Some(bucket) = unreadable {
            self.unreadable.insert(customer.clone(), bucket);
        }
    }

    /// Dead-letters every pending event of a customer whose newest bucket
    /// cannot be read, naming the bucket and its fault: one bad bucket
    /// must not stop every partition, and the events are safe in the
    /// dead-letter topic until it is mended and they are replayed.
    pub(super) fn reject_unreadable(&mut self) {
        for (customer, bucket) in std::mem::take(&mut self.unreadable) {
            let Some(Group { idx, .. }) = self.pending.remove(&customer) else {
                continue;
            };
            let reject = Reject::new(
                RejectKind::Rejected,
                format!("the customer's newest {bucket}"),
            );
            self.record(&idx, Outcome::DeadLetter(reject));
        }
    }

    /// The pending events whose key their customer's cached head (not read
    /// by this call; `head_of` looks it up) holds and that no earlier
    /// round looked up, by key (see `BucketWriter::verify_cached_keys`).
    pub(super) fn cached_keys_unverified<'h>(
        &mut self,
        head_of: impl Fn(&CustomerId) -> Option<&'h BucketHead>,
    ) -> ByKey<'a> {
        let loaded = &self.loaded;
        let unread = |c: &CustomerId, _: &Group<'_>| {
            if loaded.contains(c) {
                None
            } else {
                head_of(c)
            }
        };
        let holds = |head: &BucketHead, (trade, _): &(Trade, Source)| {
            head.keys.contains(trade.key.as_str())
        };
        let (pending, outcomes) = (&self.pending, &*self.outcomes);
        let asked = &mut self.verified_cached;
        unverified(self.events, pending, outcomes, unread, holds, asked)
    }

    /// The pending events at or below their cached head's watermark whose
    /// key the head does not hold and that no earlier round looked up, by
    /// key. Each event is looked up at most once per batch (see
    /// `BucketWriter::verify_below_watermark`).
    pub(super) fn below_watermark_unverified<'h>(
        &mut self,
        head_of: impl Fn(&CustomerId) -> Option<&'h BucketHead>,
    ) -> ByKey<'a> {
        let below = |head: &BucketHead, (trade, source): &(Trade, Source)| {
            head.covers(source) && !head.keys.contains(trade.key.as_str())
        };
        // A head that covers none of a customer's lowest offsets covers
        // none of its events: the customer is passed by (see `Group`).
        let covered = |c: &CustomerId, group: &Group<'_>| {
            head_of(c).filter(|head| group.may_be_covered(head))
        };
        let (pending, outcomes) = (&self.pending, &*self.outcomes);
        let asked = &mut self.verified;
        unverified(self.events, pending, outcomes, covered, below, asked)
    }

    /// The `(customer, key)` pairs to look up: each key with the customer
    /// of every event that holds it.
    pub(super) fn keys_of(&self, by_key: &ByKey<'_>) -> Vec<(CustomerId, String)> {
        by_key
            .iter()
            .flat_map(|(key, idx)| {
                idx.iter()
                    .map(|&i| (self.events.get(i).0.customer.clone(), key.to_string()))
            })
            .collect()
    }

    /// The events of `asked` whose key `found` (`(key, bucket _id)`) shows
    /// in one of their own customer's buckets.
    pub(super) fn stored_in_own_bucket(
        &self,
        asked: &ByKey<'_>,
        found: &[(String, String)],
    ) -> HashSet<usize> {
        let mut stored = HashSet::new();
        for (key, bucket_id) in found {
            for &i in asked.get(key.as_str()).map(Vec::as_slice).unwrap_or(&[]) {
                if Prefix::of(&self.events.get(i).0.customer).owns(bucket_id) {
                    stored.insert(i);
                }
            }
        }
        stored
    }

    /// The legacy keys of the pending replays, by key (see
    /// `BucketWriter::verify_legacy_keys`).
    pub(super) fn legacy_keys(&self) -> ByKey<'a> {
        let events = self.events;
        let mut asked = ByKey::new();
        for Group { idx, .. } in self.pending.values() {
            for &i in idx {
                if let Some(legacy) = &events.get(i).0.legacy_key {
                    asked.entry(legacy.as_str()).or_default().push(i);
                }
            }
        }
        asked
    }

    /// Event `i`'s trade is stored in one of its customer's buckets under
    /// its legacy key: its key is a duplicate.
    pub(super) fn stored_as_legacy(&mut self, i: usize) {
        let trade = &self.events.get(i).0;
        self.known_elsewhere(&trade.customer, &trade.key);
    }

    /// `key` is stored in one of `customer`'s buckets other than its
    /// newest.
    fn known_elsewhere(&mut self, customer: &CustomerId, key: &str) {
        let known = self.known.entry(customer.clone()).or_default();
        known.elsewhere.insert(key.to_string());
    }

    /// Event `i` is at or below its partition's watermark, and its trade
    /// is in none of its customer's buckets: planned as new.
    pub(super) fn not_stored(&mut self, i: usize) {
        let trade = &self.events.get(i).0;
        self.known
            .entry(trade.customer.clone())
            .or_default()
            .not_stored
            .insert(trade.key.to_string());
    }

    /// Plans `customer`, whose pending events are `idx`, against `head`
    /// with what the database told us.
    pub(super) fn plan(
        &self,
        customer: &CustomerId,
        idx: &[usize],
        head: Option<Box<BucketHead>>,
        limits: Limits,
    ) -> CustomerPlan {
        let events = self.events;
        let mut evs: Vec<Event<'_>> = idx
            .iter()
            .filter(|&&i| !self.outcomes[i].is_final())
            .map(|&i| Event {
                index: i,
                trade: &events.get(i).0,
                source: &events.get(i).1,
            })
            .collect();
        // After MongoDB refused a write of several of this customer's
        // events, write at most half as many at a time until the offender
        // is alone (see `refused`).
        if let Some(&limit) = self.isolate.get(customer) {
            evs.truncate(limit);
        }
        let learnt = self.known.get(customer).unwrap_or(&NOTHING_KNOWN);
        let hold = self.may_hold(customer, idx);
        plan_customer_owned(customer, head, &evs, learnt, limits, hold)
    }

    /// Records what `plan` settles without a write: already applied, held,
    /// duplicates, unplaceable.
    pub(super) fn planned(&mut self, plan: &CustomerPlan) {
        self.record(&plan.already_applied, Outcome::AlreadyApplied);
        self.record(&plan.held, Outcome::Held(plan.room));
        self.record(&plan.duplicates, Outcome::Duplicate);
        self.settle_copies(&plan.copies);
        for (i, why) in &plan.unplaceable {
            let reject = Reject::new(RejectKind::Rejected, why.clone());
            self.record(&[*i], Outcome::DeadLetter(reject));
        }
    }

    /// Whether `customer`, whose events are `idx`, may hold back a partial
    /// bucket: the call allows it from its first event on, and MongoDB has
    /// not refused one of its writes (isolating the offender writes a few
    /// events at a time, whatever they fill).
    fn may_hold(&self, customer: &CustomerId, idx: &[usize]) -> bool {
        let first = idx.first().copied().unwrap_or(0);
        self.hold_from.is_some_and(|from| first >= from) && !self.isolate.contains_key(customer)
    }

    /// The pending customers, each with its events, asked for while the
    /// customer before is handled (see [`ahead`]).
    pub(super) fn pending(&self) -> impl Iterator<Item = (&CustomerId, &[usize])> {
        ahead(self.events, self.outcomes, &self.pending).map(|(c, g)| (c, g.idx.as_slice()))
    }

    /// Whether every event of `customer` has an outcome (or it is not
    /// pending).
    fn all_final(&self, customer: &CustomerId) -> bool {
        self.pending
            .get(customer)
            .is_none_or(|g| g.idx.iter().all(|&i| self.outcomes[i].is_final()))
    }

    /// `customer` is done if every event of it has an outcome.
    pub(super) fn done_if_settled(&mut self, customer: &CustomerId) {
        if self.all_final(customer) {
            self.pending.remove(customer);
        }
    }

    /// Settles each `(copy, first)` of a batch by what became of its first:
    /// a duplicate once the first is stored (written, or found stored),
    /// held while it is held. A copy whose first was dead-lettered stays
    /// pending and is planned on its own next round (an upstream copy may
    /// carry another payload, which may be stored where the first's was
    /// refused); one whose first is pending waits. design.md: an event is
    /// settled only on proof that its own trade is stored.
    pub(super) fn settle_copies(&mut self, copies: &[(usize, usize)]) {
        for &(copy, first) in copies {
            let settled = match &self.outcomes[first] {
                Outcome::Written | Outcome::AlreadyApplied | Outcome::Duplicate => {
                    Outcome::Duplicate
                }
                Outcome::Held(room) => Outcome::Held(*room),
                Outcome::DeadLetter(_) | Outcome::Pending => continue,
            };
            self.record(&[copy], settled);
        }
    }

    /// The keys to look up after the `conflicted` customers hit a
    /// duplicate key: those of their events not settled, or settled as
    /// written (see `BucketWriter::learn_stored_keys`).
    pub(super) fn keys_in_conflict(&self, conflicted: &[CustomerId]) -> ByKey<'a> {
        let events = self.events;
        let mut owner_of = ByKey::new();
        for customer in conflicted {
            let idx = self.pending.get(customer).map(|g| g.idx.as_slice());
            for &i in idx.unwrap_or(&[]) {
                let outcome = &self.outcomes[i];
                if !outcome.is_final() || *outcome == Outcome::Written {
                    owner_of
                        .entry(events.get(i).0.key.as_str())
                        .or_default()
                        .push(i);
                }
            }
        }
        owner_of
    }

    /// Event `i`'s key is stored in the bucket `bucket_id`. In one of its
    /// customer's own buckets, it is a duplicate; in another customer's,
    /// the trade id is contested and the event is dead-lettered.
    pub(super) fn key_stored(&mut self, i: usize, key: &str, bucket_id: &str) {
        let customer = &self.events.get(i).0.customer;
        if Prefix::of(customer).owns(bucket_id) {
            self.known_elsewhere(customer, key);
        } else {
            let reject = Reject::new(
                RejectKind::TradeIdConflict,
                // Not where: the other customer's bucket `_id` would put
                // their id in this producer's dead letter.
                format!("trade {key} is already stored for another customer"),
            );
            self.record(&[i], Outcome::DeadLetter(reject));
        }
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
            self.record(idx, Outcome::DeadLetter(reject));
            self.isolate.remove(customer);
        } else {
            self.isolate.insert(customer.clone(), idx.len().div_ceil(2));
        }
    }
}

/// The pending events of customers with a cached head that have no
/// outcome yet, that `wanted` picks, and that no earlier round looked up
/// (`asked`, which records them), by key. `head_of` gives a customer's
/// head, or none to pass the customer by: also when the customer's events
/// as a whole show that `wanted` picks none of them.
fn unverified<'a, 'h>(
    events: Events<'a>,
    pending: &BTreeMap<CustomerId, Group<'a>>,
    outcomes: &[Outcome],
    head_of: impl Fn(&CustomerId, &Group<'a>) -> Option<&'h BucketHead>,
    wanted: impl Fn(&BucketHead, &(Trade, Source)) -> bool,
    asked: &mut HashSet<usize>,
) -> ByKey<'a> {
    let mut by_key = ByKey::new();
    for (customer, group) in ahead(events, outcomes, pending) {
        let Some(head) = head_of(customer, group) else {
            continue;
        };
        for &i in &group.idx {
            if !outcomes[i].is_final() && wanted(head, events.get(i)) && asked.insert(i) {
                by_key
                    .entry(events.get(i).0.key.as_str())
                    .or_default()
                    .push(i);
            }
        }
    }
    by_key
}

/// `pending`'s customers in order, each given once the next customer's
/// events and outcomes are asked for (see [`crate::prefetch`]): a
/// customer's events lie anywhere in the write's events (megabytes), so a
/// pass that goes customer by customer waits on memory for each event
/// unless the next customer's arrive while this one's are handled.
fn ahead<'p, 'a>(
    events: Events<'a>,
    outcomes: &'p [Outcome],
    pending: &'p BTreeMap<CustomerId, Group<'a>>,
) -> impl Iterator<Item = (&'p CustomerId, &'p Group<'a>)> {
    let mut next = pending.values().skip(1);
    pending.iter().inspect(move |_| {
        for &i in next.next().map_or(&[][..], |g| g.idx.as_slice()) {
            prefetch(events.get(i));
            if let Some(outcome) = outcomes.get(i) {
                prefetch(outcome);
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use mongodb::bson::Bson;
    use proptest::prelude::*;

    use super::*;
    use crate::bucket::plan::KeySet;

    fn source(topic: &Arc<str>, partition: i32, offset: i64) -> Source {
        Source {
            topic: topic.clone(),
            partition,
            offset,
        }
    }

    proptest! {
        /// The lowest offsets say exactly what checking every event says,
        /// also with a partition's offsets out of order (redelivered
        /// within one batch) and two topics sharing partition numbers.
        #[test]
        fn the_lowest_offsets_tell_whether_any_event_is_covered(
            events in proptest::collection::vec((0usize..2, 0i32..3, 0i64..50), 1..40),
            wm in proptest::collection::vec((0usize..2, 0i32..3, 0i64..50), 0..4),
        ) {
            let topics: [Arc<str>; 2] = ["a.b".into(), "c".into()];
            let sources: Vec<Source> = events
                .iter()
                .map(|&(t, p, o)| source(&topics[t], p, o))
                .collect();
            let mut group = Group::default();
            for (i, s) in sources.iter().enumerate() {
                group.add(i, s);
            }
            let head = BucketHead {
                id: "c_1".into(),
                customer: Bson::Int64(1),
                count: 1,
                cap: None,
                size: None,
                keys: KeySet::default(),
                wm: wm
                    .iter()
                    .map(|&(t, p, o)| (source(&topics[t], p, o).partition_key(), o))
                    .collect(),
            };
            let any = sources.iter().any(|s| head.covers(s));
            prop_assert_eq!(group.may_be_covered(&head), any);
            prop_assert_eq!(group.idx, (0..sources.len()).collect::<Vec<_>>());
        }
    }
}
