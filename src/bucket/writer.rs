//! Writes one batch of trades into buckets: plan every customer, send all
//! fills in one command, then every customer's first new bucket in one
//! unordered insert and the rest of the chains in one ordered insert, and
//! re-plan whoever hit a conflict, until every event has an outcome.
//!
//! The writer keeps each customer's newest bucket in a bounded LRU cache
//! while we own its partitions, so the steady state costs no reads. The
//! cache is an optimisation only: every write is guarded (see
//! [`super::plan`]), so a stale entry costs a reload, never a wrong write.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::num::NonZeroUsize;

use lru::LruCache;
use mongodb::bson::RawDocumentBuf;

use super::id::Prefix;
use super::plan::{plan_customer, BucketHead, CustomerPlan, Event, Known};
use super::store::{bucket_document, fill_statement, BucketStore, StoreError};
use crate::event::{CustomerId, Reject, RejectKind, Source, Trade};
use crate::metrics::Metrics;

/// A conflict is resolved by one reload; this many rounds in a row that
/// settle no event mean something keeps writing the same customers (a
/// zombie that will not die): give the batch back to the retry loop, which
/// backs off.
const MAX_STALLED_ROUNDS: usize = 32;

/// The fate of one event of a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Pending,
    /// Appended by this delivery.
    Written,
    /// Already stored by an earlier delivery (at or below the watermark).
    AlreadyApplied,
    /// Its key is already stored (an upstream duplicate).
    Duplicate,
    /// Must go to the dead-letter topic.
    DeadLetter(Reject),
}

impl Outcome {
    pub fn is_final(&self) -> bool {
        !matches!(self, Outcome::Pending)
    }
}

/// Counts for one `write` call, for metrics and logs.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct WriteStats {
    pub rounds: usize,
    pub customers: usize,
    pub fills: usize,
    pub buckets_created: usize,
    pub conflicts: usize,
    pub heads_loaded: usize,
    /// Events at or below their partition's watermark whose trade was not
    /// stored (offsets went backwards), written as new.
    pub below_watermark_unstored: usize,
}

pub struct BucketWriter {
    store: BucketStore,
    capacity: u32,
    cache: LruCache<CustomerId, Option<BucketHead>>,
    metrics: Metrics,
}

impl BucketWriter {
    pub fn new(
        store: BucketStore,
        capacity: u32,
        cache_customers: usize,
        metrics: Metrics,
    ) -> Self {
        BucketWriter {
            store,
            capacity,
            cache: LruCache::new(NonZeroUsize::new(cache_customers.max(1)).expect("max(1)")),
            metrics,
        }
    }

    fn timer(&self, operation: &str) -> prometheus::HistogramTimer {
        self.metrics
            .mongodb_write_duration
            .with_label_values(&[operation])
            .start_timer()
    }

    pub fn store(&self) -> &BucketStore {
        &self.store
    }

    /// Forgets every cached bucket: after a rebalance another instance may
    /// have written our former customers.
    pub fn forget_all(&mut self) {
        self.cache.clear();
    }

    /// Writes `events` (in stream order). `outcomes` has one slot per event
    /// and survives a failed call, so a retry keeps what is already known.
    /// On `Err`, events still `Pending` must be retried.
    pub async fn write(
        &mut self,
        events: &[(Trade, Source)],
        outcomes: &mut [Outcome],
    ) -> Result<WriteStats, StoreError> {
        assert_eq!(events.len(), outcomes.len(), "one outcome per event");
        let mut by_customer: BTreeMap<CustomerId, Vec<usize>> = BTreeMap::new();
        for (i, (trade, _)) in events.iter().enumerate() {
            if !outcomes[i].is_final() {
                by_customer
                    .entry(trade.customer.clone())
                    .or_default()
                    .push(i);
            }
        }
        let mut stats = WriteStats {
            customers: by_customer.len(),
            ..WriteStats::default()
        };
        let mut known: HashMap<CustomerId, Known> = HashMap::new();
        let mut isolate: HashSet<CustomerId> = HashSet::new();
        let result = self
            .rounds(
                events,
                outcomes,
                &mut by_customer,
                &mut known,
                &mut isolate,
                &mut stats,
            )
            .await;
        if result.is_err() {
            // Whatever we were doing, we no longer know the state of these
            // customers.
            for c in by_customer.keys() {
                self.cache.pop(c);
            }
        }
        result.map(|()| stats)
    }

    async fn rounds(
        &mut self,
        events: &[(Trade, Source)],
        outcomes: &mut [Outcome],
        pending: &mut BTreeMap<CustomerId, Vec<usize>>,
        known: &mut HashMap<CustomerId, Known>,
        isolate: &mut HashSet<CustomerId>,
        stats: &mut WriteStats,
    ) -> Result<(), StoreError> {
        let mut stalled = 0;
        let mut verified: HashSet<usize> = HashSet::new();
        while !pending.is_empty() {
            stats.rounds += 1;
            let settled_before = outcomes.iter().filter(|o| o.is_final()).count();
            if stalled > MAX_STALLED_ROUNDS {
                return Err(StoreError::Failed(format!(
                    "{} customers still conflicting after {MAX_STALLED_ROUNDS} rounds without progress",
                    pending.len()
                )));
            }
            self.load_missing(pending, stats).await?;
            self.verify_below_watermark(events, outcomes, pending, &mut verified, known, stats)
                .await?;

            // Plan every pending customer against its cached head.
            let nothing_known = Known::default();
            let mut plans: Vec<(CustomerId, CustomerPlan)> = Vec::with_capacity(pending.len());
            for (customer, idx) in pending.iter() {
                let head = self.cache.get(customer).cloned().flatten();
                let mut evs: Vec<Event<'_>> = idx
                    .iter()
                    .filter(|&&i| !outcomes[i].is_final())
                    .map(|&i| Event {
                        index: i,
                        trade: &events[i].0,
                        source: &events[i].1,
                    })
                    .collect();
                // After MongoDB refused one of this customer's writes, go
                // one event per operation, so only the offending event is
                // dead-lettered, not the good ones that shared its write.
                if isolate.contains(customer) {
                    evs.truncate(1);
                }
                let learnt = known.get(customer).unwrap_or(&nothing_known);
                let plan = plan_customer(customer, head.as_ref(), &evs, learnt, self.capacity);
                settle(outcomes, &plan.already_applied, Outcome::AlreadyApplied);
                settle(outcomes, &plan.duplicates, Outcome::Duplicate);
                for (i, why) in &plan.unplaceable {
                    settle(
                        outcomes,
                        &[*i],
                        Outcome::DeadLetter(Reject::new(RejectKind::Rejected, why.clone())),
                    );
                }
                plans.push((customer.clone(), plan));
            }
            plans.retain(|(customer, plan)| {
                // Without writes every planned event is settled; an isolated
                // customer may still have events after the one planned.
                if !plan.has_writes() && idx_all_final(pending.get(customer), outcomes) {
                    pending.remove(customer);
                }
                plan.has_writes()
            });
            if plans.is_empty() {
                continue;
            }

            let mut conflicted: Vec<CustomerId> = Vec::new();
            let mut stale: Vec<CustomerId> = Vec::new();

            // Phase 1: fills, one unordered command for all customers.
            let fillers: Vec<usize> = (0..plans.len())
                .filter(|&p| plans[p].1.fill.is_some())
                .collect();
            let mut fill_ok: Vec<bool> = vec![true; plans.len()];
            if !fillers.is_empty() {
                let statements: Vec<RawDocumentBuf> = fillers
                    .iter()
                    .map(|&p| {
                        let fill = plans[p].1.fill.as_ref().expect("filtered");
                        fill_statement(fill, &trades_of(events, &fill.events))
                    })
                    .collect();
                let timer = self.timer("fill");
                let outcome = self.store.apply_fills(statements).await?;
                timer.observe_duration();
                stats.fills += fillers.len();
                let mut failed: HashSet<usize> = HashSet::new();
                for e in &outcome.errors {
                    let p = fillers[e.index];
                    failed.insert(p);
                    fill_ok[p] = false;
                    if e.is_duplicate_key() {
                        conflicted.push(plans[p].0.clone());
                    } else {
                        let fill = plans[p].1.fill.as_ref().expect("filtered");
                        refused(outcomes, isolate, &plans[p].0, &fill.events, &e.message);
                        stale.push(plans[p].0.clone());
                    }
                }
                let expected = (fillers.len() - failed.len()) as u64;
                if outcome.matched != expected {
                    // Some guard missed and the command does not say which:
                    // treat every customer of it as stale.
                    for &p in &fillers {
                        if fill_ok[p] {
                            fill_ok[p] = false;
                            stale.push(plans[p].0.clone());
                        }
                    }
                } else {
                    for &p in &fillers {
                        if fill_ok[p] {
                            let fill = plans[p].1.fill.as_ref().expect("filtered");
                            settle(outcomes, &fill.events, Outcome::Written);
                        }
                    }
                }
            }

            // Phase 2: new buckets of customers whose fill (if any) held.
            // A chain must never get a bucket after a missing one, and one
            // customer's refused bucket (an upstream duplicate trips the
            // unique key index) must not hold back everyone after it, which
            // an ordered insert of everything would: each refusal would
            // cost a round and a reload of every later customer. So first
            // every customer's first new bucket in one unordered insert,
            // then the rest of the chains (only customers with more than
            // `capacity` new events in the batch), chain by chain in one
            // ordered insert, for the customers whose first bucket went in.
            let mut chain_ok = fill_ok.clone();
            for ordered in [false, true] {
                let owner: Vec<(usize, usize)> = plans
                    .iter()
                    .enumerate()
                    .filter(|&(p, _)| chain_ok[p])
                    .flat_map(|(p, (_, plan))| {
                        let n = plan.new_buckets.len();
                        let buckets = if ordered { 1..n } else { 0..n.min(1) };
                        buckets.map(move |b| (p, b))
                    })
                    .collect();
                if owner.is_empty() {
                    continue;
                }
                let docs: Vec<RawDocumentBuf> = owner
                    .iter()
                    .map(|&(p, b)| {
                        let nb = &plans[p].1.new_buckets[b];
                        bucket_document(nb, &trades_of(events, &nb.events))
                    })
                    .collect();
                let timer = self.timer("insert");
                let outcome = self.store.insert_buckets(docs, ordered).await?;
                timer.observe_duration();
                let mut refused_docs: HashSet<usize> = HashSet::new();
                for e in &outcome.errors {
                    refused_docs.insert(e.index);
                    let (p, b) = owner[e.index];
                    chain_ok[p] = false;
                    if e.is_duplicate_key() {
                        conflicted.push(plans[p].0.clone());
                    } else {
                        let nb = &plans[p].1.new_buckets[b];
                        refused(outcomes, isolate, &plans[p].0, &nb.events, &e.message);
                        stale.push(plans[p].0.clone());
                    }
                }
                // An ordered insert attempted nothing after its refusal:
                // those customers are planned again from their true state.
                let attempted = match (ordered, outcome.errors.first()) {
                    (true, Some(e)) => e.index + 1,
                    _ => owner.len(),
                };
                for &(q, _) in &owner[attempted..] {
                    if chain_ok[q] {
                        chain_ok[q] = false;
                        stale.push(plans[q].0.clone());
                    }
                }
                for (i, &(p, b)) in owner[..attempted].iter().enumerate() {
                    if !refused_docs.contains(&i) {
                        settle(
                            outcomes,
                            &plans[p].1.new_buckets[b].events,
                            Outcome::Written,
                        );
                        stats.buckets_created += 1;
                    }
                }
            }

            // Customers whose every operation held are done; the cache now
            // holds their new newest bucket.
            let unsettled: HashSet<&CustomerId> = conflicted.iter().chain(stale.iter()).collect();
            for (p, (customer, plan)) in plans.iter().enumerate() {
                if chain_ok[p] && !unsettled.contains(customer) {
                    self.cache.put(customer.clone(), plan.after.clone());
                    // An isolated customer wrote one event: more may wait.
                    let done = idx_all_final(pending.get(customer), outcomes);
                    if done || !isolate.contains(customer) {
                        pending.remove(customer);
                    }
                }
            }
            for customer in unsettled {
                self.cache.pop(customer);
            }
            stats.conflicts += conflicted.len();
            let settled_after = outcomes.iter().filter(|o| o.is_final()).count();
            stalled = if settled_after > settled_before {
                0
            } else {
                stalled + 1
            };
            if !conflicted.is_empty() {
                self.learn_stored_keys(events, outcomes, pending, &conflicted, known)
                    .await?;
            }
        }
        Ok(())
    }

    /// Loads the newest bucket of every pending customer not in the cache.
    async fn load_missing(
        &mut self,
        pending: &BTreeMap<CustomerId, Vec<usize>>,
        stats: &mut WriteStats,
    ) -> Result<(), StoreError> {
        let missing: Vec<CustomerId> = pending
            .keys()
            .filter(|c| !self.cache.contains(*c))
            .cloned()
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        stats.heads_loaded += missing.len();
        let timer = self.timer("load");
        let heads = self.store.load_heads(missing).await?;
        timer.observe_duration();
        for (customer, head) in heads {
            self.cache.put(customer, head);
        }
        Ok(())
    }

    /// An event at or below its partition's watermark is normally a
    /// redelivery of a stored trade. But a partition's offsets can go
    /// backwards under the same topic name (a topic deleted and recreated,
    /// a log truncated), and then the watermark would skip trades that were
    /// never stored, silently. So the key of every such event not in the
    /// cached newest bucket is looked up once per batch: in one of the
    /// customer's buckets, it is a redelivery; anywhere else or nowhere,
    /// its offset is stale and it is planned like a new event (its key
    /// still guards against a double). Costs one query, and only when a
    /// batch holds redelivered events.
    async fn verify_below_watermark(
        &mut self,
        events: &[(Trade, Source)],
        outcomes: &[Outcome],
        pending: &BTreeMap<CustomerId, Vec<usize>>,
        verified: &mut HashSet<usize>,
        known: &mut HashMap<CustomerId, Known>,
        stats: &mut WriteStats,
    ) -> Result<(), StoreError> {
        let mut asked: HashMap<&str, Vec<usize>> = HashMap::new();
        for (customer, idx) in pending {
            let Some(Some(head)) = self.cache.peek(customer) else {
                continue;
            };
            for &i in idx {
                let (trade, source) = &events[i];
                if head.covers(source)
                    && !outcomes[i].is_final()
                    && !head.keys.contains(&trade.key)
                    && verified.insert(i)
                {
                    asked.entry(trade.key.as_str()).or_default().push(i);
                }
            }
        }
        if asked.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = asked.keys().map(|k| k.to_string()).collect();
        let timer = self.timer("find_keys");
        let found = self.store.find_keys(&keys).await?;
        timer.observe_duration();
        let mut stored: HashSet<usize> = HashSet::new();
        for (key, bucket_id) in &found {
            for &i in asked.get(key.as_str()).map(Vec::as_slice).unwrap_or(&[]) {
                if Prefix::of(&events[i].0.customer).owns(bucket_id) {
                    stored.insert(i);
                }
            }
        }
        let mut unstored = 0;
        for &i in asked.values().flatten() {
            if !stored.contains(&i) {
                let trade = &events[i].0;
                known
                    .entry(trade.customer.clone())
                    .or_default()
                    .not_stored
                    .insert(trade.key.clone());
                unstored += 1;
            }
        }
        if unstored > 0 {
            tracing::warn!(
                events = unstored,
                "events at or below their partition's stored watermark are not stored: \
                 the partition's offsets went backwards (topic recreated or log truncated?); \
                 writing them as new"
            );
        }
        stats.below_watermark_unstored += unstored;
        Ok(())
    }

    /// After a duplicate-key error: which of the conflicted customers'
    /// keys are already stored? In one of their own buckets, the event is a
    /// duplicate; in another customer's, the trade id is contested and the
    /// event is dead-lettered.
    async fn learn_stored_keys(
        &mut self,
        events: &[(Trade, Source)],
        outcomes: &mut [Outcome],
        pending: &BTreeMap<CustomerId, Vec<usize>>,
        conflicted: &[CustomerId],
        known: &mut HashMap<CustomerId, Known>,
    ) -> Result<(), StoreError> {
        let mut owner_of: HashMap<&str, Vec<usize>> = HashMap::new();
        for customer in conflicted {
            for &i in pending.get(customer).map(Vec::as_slice).unwrap_or(&[]) {
                if !outcomes[i].is_final() || outcomes[i] == Outcome::Written {
                    owner_of
                        .entry(events[i].0.key.as_str())
                        .or_default()
                        .push(i);
                }
            }
        }
        let keys: Vec<String> = owner_of.keys().map(|k| k.to_string()).collect();
        let timer = self.timer("find_keys");
        let found = self.store.find_keys(&keys).await?;
        timer.observe_duration();
        for (key, bucket_id) in found {
            for &i in owner_of.get(key.as_str()).map(Vec::as_slice).unwrap_or(&[]) {
                let customer = &events[i].0.customer;
                if Prefix::of(customer).owns(&bucket_id) {
                    known
                        .entry(customer.clone())
                        .or_default()
                        .elsewhere
                        .insert(key.clone());
                } else if !outcomes[i].is_final() {
                    outcomes[i] = Outcome::DeadLetter(Reject::new(
                        RejectKind::TradeIdConflict,
                        format!(
                            "trade {key} is already stored for another customer in {bucket_id}"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

fn trades_of<'a>(events: &'a [(Trade, Source)], idx: &[usize]) -> Vec<&'a Trade> {
    idx.iter().map(|&i| &events[i].0).collect()
}

/// Records a final outcome unless one is already known (a write we saw
/// succeed stays `Written` when a later round finds it below the watermark).
fn settle(outcomes: &mut [Outcome], idx: &[usize], outcome: Outcome) {
    for &i in idx {
        if !outcomes[i].is_final() {
            outcomes[i] = outcome.clone();
        }
    }
}

fn idx_all_final(idx: Option<&Vec<usize>>, outcomes: &[Outcome]) -> bool {
    idx.is_none_or(|idx| idx.iter().all(|&i| outcomes[i].is_final()))
}

/// MongoDB refused a write permanently. A single event is the culprit and is
/// dead-lettered; with several, the customer switches to one event per
/// write to find which.
fn refused(
    outcomes: &mut [Outcome],
    isolate: &mut HashSet<CustomerId>,
    customer: &CustomerId,
    idx: &[usize],
    message: &str,
) {
    if idx.len() == 1 {
        settle(
            outcomes,
            idx,
            Outcome::DeadLetter(Reject::new(
                RejectKind::Rejected,
                format!("MongoDB refused the bucket write: {message}"),
            )),
        );
    } else {
        isolate.insert(customer.clone());
    }
}
