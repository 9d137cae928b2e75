//! Writes one batch of trades into buckets, in rounds until every event has
//! an outcome. A `Ledger` holds what lasts across rounds (outcomes, the
//! customers still pending, what the database told us; `writer/ledger.rs`);
//! a `Round` holds one round's plans and which of them held
//! (`writer/round.rs`).
//! Each round:
//!
//! 1. `verify_cached_keys` / `load_missing` / `verify_below_watermark`:
//!    check what the cache would settle alone, read what it lacks;
//! 2. `plan`: plan every pending customer, settle what needs no write;
//! 3. `fill`: every customer's append to its open bucket, one command;
//! 4. `insert_firsts`: every customer's first new bucket, one unordered
//!    insert;
//! 5. `insert_chains`: the rest of the chains, one ordered insert;
//! 6. `settle`: customers whose writes all held are done; the others are
//!    reloaded and planned again next round (`learn_stored_keys` first
//!    finds out where their conflicting keys are).
//!
//! The writer keeps each customer's newest bucket in a bounded LRU cache
//! while we own its partitions, so the steady state costs no reads. The
//! cache is an optimisation only: every write is guarded (see
//! [`super::plan`]), so a stale entry costs a reload, never a wrong write;
//! and an event the cached keys alone would settle without a write (a
//! duplicate, already applied) is looked up once (`verify_cached_keys`), so
//! buckets deleted or restored by hand never make the worker skip a trade.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroUsize;

use lru::LruCache;
use mongodb::bson::RawDocumentBuf;

use super::db::BucketDb;
use super::id::Prefix;
use super::plan::{BucketHead, Limits, Room};
use super::store::{bucket_document, fill_statement, BucketStore, InsertOutcome, StoreError};
use crate::event::{CustomerId, Reject};
use crate::metrics::{Metrics, WriteOperation};

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
    /// Not written: it would only part-fill a bucket, and the call allowed
    /// holding (see [`BucketWriter::write`]). The caller writes it again
    /// in a later call, before the customer's newer events. With what
    /// the bucket it would go to takes before it is full: the caller may
    /// hold the customer's next trades that fit without writing them
    /// ([`Room`]).
    Held(Room),
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

/// Writes batches through `S`: MongoDB in production ([`BucketStore`]),
/// an in-memory database in the model test (see [`super::db`]).
pub struct BucketWriter<S = BucketStore> {
    store: S,
    /// Trades per bucket this writer opens (`buckets.capacity`); a bucket
    /// is full at its own stored `cap`, whatever this says.
    capacity: u32,
    /// Heads boxed: an entry is moved out and back for every customer of
    /// every batch (see `take_head`).
    cache: LruCache<CustomerId, Option<Box<BucketHead>>>,
    metrics: Metrics,
    /// How a round's new buckets go out as `insert` commands at once.
    insert_split: InsertSplit,
}

impl<S: BucketDb> BucketWriter<S> {
    pub fn new(store: S, capacity: u32, cache_customers: usize, metrics: Metrics) -> Self {
        BucketWriter {
            store,
            capacity,
            cache: LruCache::new(NonZeroUsize::new(cache_customers.max(1)).expect("max(1)")),
            metrics,
            insert_split: InsertSplit::new(1),
        }
    }

    /// Sends a round's new buckets as up to `split.commands` `insert`
    /// commands at once (`mongodb.insert_concurrency`); without it, each
    /// insert is one command.
    pub fn with_insert_split(mut self, split: InsertSplit) -> Self {
        self.insert_split = split;
        self
    }

    fn timer(&self, operation: WriteOperation) -> prometheus::HistogramTimer {
        self.metrics.write_duration(operation).start_timer()
    }

    pub fn store(&self) -> &S {
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
    ///
    /// `hold`: `Some(first)` lets every customer none of whose events comes
    /// before index `first` write only whole buckets, its last events that
    /// would part-fill one left [`Outcome::Held`] (the caller puts events
    /// it held before, and will not hold again, below `first`). `None`
    /// writes everything.
    pub async fn write<'a>(
        &mut self,
        events: impl Into<Events<'a>>,
        outcomes: &mut [Outcome],
        hold: Option<usize>,
    ) -> Result<WriteStats, StoreError> {
        let events = events.into();
        assert_eq!(events.len(), outcomes.len(), "one outcome per event");
        let mut ledger = Ledger::new(events, outcomes, hold);
        let result = match self.verify_legacy_keys(&mut ledger).await {
            Ok(()) => self.rounds(&mut ledger).await,
            Err(e) => Err(e),
        };
        if result.is_err() {
            // Whatever we were doing, we no longer know the state of these
            // customers.
            for c in ledger.pending_customers() {
                self.cache.pop(c);
            }
        }
        result.map(|()| ledger.into_stats())
    }

    /// Plans, writes and re-plans until every event has an outcome. A
    /// round settles every customer whose writes all held; the others are
    /// reloaded and planned again in the next round.
    async fn rounds(&mut self, ledger: &mut Ledger<'_>) -> Result<(), StoreError> {
        let mut stalled = 0;
        while !ledger.is_done() {
            ledger.stats_mut().rounds += 1;
            let settled_before = ledger.settled();
            if stalled > MAX_STALLED_ROUNDS {
                return Err(StoreError::Failed(format!(
                    "{} customers still conflicting after {MAX_STALLED_ROUNDS} rounds without progress",
                    ledger.pending_customers().count()
                )));
            }
            self.verify_cached_keys(ledger).await?;
            self.load_missing(ledger).await?;
            self.verify_below_watermark(ledger).await?;
            let mut round = self.plan(ledger);
            if round.is_empty() {
                // Planning alone settled every planned event.
                continue;
            }
            self.fill(ledger, &mut round).await?;
            self.insert_firsts(ledger, &mut round).await?;
            self.insert_chains(ledger, &mut round).await?;
            self.settle(ledger, &mut round);
            if let Some(e) = round.transient {
                // Whatever went in stays recorded; the rest is retried with
                // backoff, from reloaded heads.
                return Err(StoreError::Statement {
                    code: e.code,
                    message: e.message,
                });
            }
            // The stall rule: rounds that settle no event in a row.
            stalled = if ledger.settled() > settled_before {
                0
            } else {
                stalled + 1
            };
            if !round.conflicted.is_empty() {
                self.learn_stored_keys(ledger, &round.conflicted).await?;
            }
        }
        Ok(())
    }

    /// A replay without `tradeId` is keyed as its original (`o:`); a
    /// version before issue #46 stored replays under `r:`, which no unique
    /// index ties to the `o:` key. So the legacy keys of the call's
    /// pending replays are looked up once: one found in the customer's own
    /// buckets makes the replay a duplicate, as its `o:` key would. Those
    /// entries only shrink in number (no version writes them any more), so
    /// a lookup is as good as a guard, except against pods of the earlier
    /// version still running (docs/operations.md, "Replay"). One query,
    /// only for batches holding replays.
    async fn verify_legacy_keys(&mut self, ledger: &mut Ledger<'_>) -> Result<(), StoreError> {
        let asked = ledger.legacy_keys();
        if asked.is_empty() {
            return Ok(());
        }
        for i in self.stored_in_own_bucket(ledger, &asked).await? {
            ledger.stored_as_legacy(i);
        }
        Ok(())
    }

    /// Loads the newest bucket of every pending customer not in the cache.
    /// One we cannot plan against is kept for this call only (see
    /// [`UnreadableBucket`]): `plan` dead-letters that customer's events,
    /// and a later batch reads the bucket again, mended or not.
    async fn load_missing(&mut self, ledger: &mut Ledger<'_>) -> Result<(), StoreError> {
        let missing: Vec<CustomerId> = ledger
            .pending_customers()
            .filter(|c| !self.cache.contains(*c))
            .cloned()
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        ledger.stats_mut().heads_loaded += missing.len();
        let timer = self.timer(WriteOperation::Load);
        let heads = self.store.load_heads(missing).await?;
        timer.observe_duration();
        for (customer, head) in heads {
            match head {
                Ok(head) => {
                    ledger.loaded(&customer, None);
                    self.cache.put(customer, head.map(Box::new));
                }
                Err(unreadable) => ledger.loaded(&customer, Some(unreadable)),
            }
        }
        Ok(())
    }

    /// An event whose key the cached newest bucket holds is settled
    /// without a write (a duplicate, or already applied). Keys are never
    /// removed by the product, but an operator can delete or restore
    /// buckets while it runs (and then replay what reconcile found
    /// missing): so such keys of a head this call did not read are looked
    /// up once per batch, and a customer whose cached keys are gone from
    /// MongoDB has its head dropped and read again. Costs one query, only
    /// for a batch holding such events (redeliveries, upstream copies).
    async fn verify_cached_keys(&mut self, ledger: &mut Ledger<'_>) -> Result<(), StoreError> {
        let asked = ledger.cached_keys_unverified(|c| self.cached_head(c));
        if asked.is_empty() {
            return Ok(());
        }
        let stored = self.stored_in_own_bucket(ledger, &asked).await?;
        let mut stale: HashSet<&CustomerId> = HashSet::new();
        for &i in asked.values().flatten() {
            if !stored.contains(&i) {
                stale.insert(&ledger.trade(i).customer);
            }
        }
        if !stale.is_empty() {
            tracing::warn!(
                customers = stale.len(),
                "trades the cached newest bucket holds are not in MongoDB (buckets deleted or \
                 restored while the worker ran?): reading those customers' buckets again"
            );
        }
        for customer in stale {
            self.cache.pop(customer);
        }
        Ok(())
    }

    /// `customer`'s cached newest bucket, if it has one.
    fn cached_head(&self, customer: &CustomerId) -> Option<&BucketHead> {
        self.cache.peek(customer).and_then(Option::as_deref)
    }

    /// The events of `asked` whose key is stored in one of their own
    /// customer's buckets: one lookup of every key asked.
    async fn stored_in_own_bucket(
        &self,
        ledger: &Ledger<'_>,
        asked: &ByKey<'_>,
    ) -> Result<HashSet<usize>, StoreError> {
        let found = self.find_keys(&ledger.keys_of(asked)).await?;
        Ok(ledger.stored_in_own_bucket(asked, &found))
    }

    /// Where the `wanted` keys are stored (see [`BucketDb::find_keys`]),
    /// timed.
    async fn find_keys(
        &self,
        wanted: &[(CustomerId, String)],
    ) -> Result<Vec<(String, String)>, StoreError> {
        let timer = self.timer(WriteOperation::FindKeys);
        let found = self.store.find_keys(wanted).await?;
        timer.observe_duration();
        Ok(found)
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
    async fn verify_below_watermark(&mut self, ledger: &mut Ledger<'_>) -> Result<(), StoreError> {
        let asked = ledger.below_watermark_unverified(|c| self.cached_head(c));
        if asked.is_empty() {
            return Ok(());
        }
        let stored = self.stored_in_own_bucket(ledger, &asked).await?;
        let mut unstored = 0;
        for &i in asked.values().flatten() {
            if !stored.contains(&i) {
                ledger.not_stored(i);
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
        ledger.stats_mut().below_watermark_unstored += unstored;
        Ok(())
    }

    /// Plans every pending customer against its cached newest bucket and
    /// settles at once what needs no write (already applied, duplicates,
    /// unplaceable). The round holds the plans that do write.
    fn plan(&mut self, ledger: &mut Ledger<'_>) -> Round {
        ledger.reject_unreadable();
        let limits = Limits::with_capacity(self.capacity);
        // Sized up front: a plan is some 270 bytes and a batch plans
        // thousands of customers, so a vector grown by doubling copied
        // megabytes per round (docs/benchmarks.md, "Session 32").
        let mut plans = Vec::with_capacity(ledger.pending_len());
        plans.extend(ledger.pending().filter_map(|(customer, idx)| {
            // Not cached is not "no bucket" (see `take_head`): it stays
            // pending and is loaded again next round.
            let head = self.take_head(customer)?;
            Some(Planned::new(
                customer.clone(),
                ledger.plan(customer, idx, head, limits),
            ))
        }));
        for planned in &plans {
            ledger.planned(&planned.plan);
        }
        // Without writes every planned event is settled (an isolated
        // customer may still have events after the one planned), and the
        // head is unchanged: back into the cache.
        for planned in plans.extract_if(.., |p| !p.plan.has_writes()) {
            ledger.done_if_settled(&planned.customer);
            self.cache.put(planned.customer, planned.plan.after);
        }
        Round::new(plans)
    }

    /// The customer's newest bucket as cached (`Some(None)`: it has none),
    /// taken out of the cache, not cloned: a head holds up to `cap` keys,
    /// and this runs for every customer of every round. The plan's `after`
    /// goes back in once its writes held (`settle`) or at once if it has
    /// none; otherwise the customer is read again, which a failed write
    /// needs anyway. `None`: not cached, which is not "no bucket": a head
    /// loaded by this call and evicted since (a write of more customers
    /// than the cache holds). Planned as new, such a customer started a
    /// second chain where its first bucket was gone or had no `prev`.
    fn take_head(&mut self, customer: &CustomerId) -> Option<Option<Box<BucketHead>>> {
        self.cache.pop(customer)
    }

    /// Every fill of the round in one unordered `update` command: each
    /// statement is one customer's, guarded on its bucket's count.
    async fn fill(&mut self, ledger: &mut Ledger<'_>, round: &mut Round) -> Result<(), StoreError> {
        let fillers = round.fillers();
        if fillers.is_empty() {
            return Ok(());
        }
        let statements: Vec<RawDocumentBuf> = fillers
            .iter()
            .map(|&p| {
                let fill = round.fill(p);
                let shard_key = self.store.shard_key(round.customer(p));
                fill_statement(fill, &ledger.trades(&fill.events), shard_key.as_ref())
            })
            .collect();
        let timer = self.timer(WriteOperation::Fill);
        let outcome = self.store.apply_fills(statements).await?;
        timer.observe_duration();
        ledger.stats_mut().fills += fillers.len();
        let mut failed: HashSet<PlanId> = HashSet::new();
        for e in &outcome.errors {
            let p = fillers[e.index];
            failed.insert(p);
            round.failed(ledger, p, Op::Fill, e);
        }
        let expected = (fillers.len() - failed.len()) as u64;
        if outcome.matched != expected {
            self.find_missed(ledger, round, &fillers).await?;
        }
        for &p in &fillers {
            if round.held(p) {
                ledger.record(&round.fill(p).events, Outcome::Written);
            }
        }
        Ok(())
    }

    /// Some guard missed and the `update` reply gives only a total: which
    /// fills went in? None can be proven to have, so every one that has not
    /// failed otherwise is stale: its customer is reloaded and the rest of
    /// its plan (new buckets planned after a fill we cannot vouch for) is
    /// not sent. What can be proven is settled: a fill's trades that are
    /// *all* in its customer's buckets, whoever put them there, are stored
    /// exactly once (the key index allows one copy), and need no write.
    /// One key per fill proves nothing: another writer may have stored
    /// that one trade (an upstream duplicate) while the guard turned ours
    /// away; and settling the fill does not vouch for its bucket, which may
    /// not be as full as our plan had it (docs/design.md, "A guard that
    /// missed").
    async fn find_missed(
        &mut self,
        ledger: &mut Ledger<'_>,
        round: &mut Round,
        fillers: &[PlanId],
    ) -> Result<(), StoreError> {
        let asked: Vec<PlanId> = fillers.iter().copied().filter(|&p| round.held(p)).collect();
        let wanted: Vec<(CustomerId, String)> = asked
            .iter()
            .flat_map(|&p| {
                let customer = round.customer(p);
                let keys = round.fill(p).events.iter().map(|&i| &ledger.trade(i).key);
                keys.map(move |k| (customer.clone(), k.to_string()))
            })
            .collect();
        let found = self.find_keys(&wanted).await?;
        let mut stored_in: HashMap<&str, Vec<&str>> = HashMap::new();
        for (key, bucket_id) in &found {
            stored_in.entry(key).or_default().push(bucket_id);
        }
        for p in asked {
            let prefix = Prefix::of(round.customer(p));
            let all_stored = round.fill(p).events.iter().all(|&i| {
                let buckets = stored_in.get(ledger.trade(i).key.as_str());
                buckets.is_some_and(|ids| ids.iter().any(|id| prefix.owns(id)))
            });
            if all_stored {
                // Ours or another's: written either way, and not again.
                ledger.record(&round.fill(p).events, Outcome::Written);
            }
            round.mark_stale(p);
        }
        Ok(())
    }

    /// New buckets go in two inserts, of customers whose fill (if any)
    /// held. A chain must never get a bucket after a missing one, and one
    /// customer's refused bucket (an upstream duplicate trips the unique
    /// key index) must not hold back everyone after it, which an ordered
    /// insert of everything would: each refusal would cost a round and a
    /// reload of every later customer. So first every customer's first new
    /// bucket, in one unordered insert ...
    async fn insert_firsts(
        &mut self,
        ledger: &mut Ledger<'_>,
        round: &mut Round,
    ) -> Result<(), StoreError> {
        let firsts = round.new_buckets(|n| 0..n.min(1));
        self.insert(ledger, round, firsts, false).await
    }

    /// ... then the rest of the chains (only customers whose new events
    /// fill more than one bucket), chain by chain in one ordered
    /// insert, for the customers whose first bucket went in.
    async fn insert_chains(
        &mut self,
        ledger: &mut Ledger<'_>,
        round: &mut Round,
    ) -> Result<(), StoreError> {
        let rest = round.new_buckets(|n| 1..n);
        self.insert(ledger, round, rest, true).await
    }

    /// Inserts the new buckets `docs` names, `ordered` or not, as up to
    /// `insert_split` commands at once, and records what went in.
    async fn insert(
        &mut self,
        ledger: &mut Ledger<'_>,
        round: &mut Round,
        docs: Vec<NewBucketId>,
        ordered: bool,
    ) -> Result<(), StoreError> {
        if docs.is_empty() {
            return Ok(());
        }
        let plans: Vec<PlanId> = docs.iter().map(|b| b.plan).collect();
        let runs = self.insert_split.commands(&plans, ordered);
        let commands: Vec<Vec<RawDocumentBuf>> = runs
            .iter()
            .map(|run| {
                docs[run.clone()]
                    .iter()
                    .map(|&b| {
                        let nb = round.new_bucket(b);
                        bucket_document(nb, &ledger.trades(&nb.events))
                    })
                    .collect()
            })
            .collect();
        let timer = self.timer(WriteOperation::Insert);
        // Every command is awaited, also after one has failed (`join_all`,
        // not `try_join_all`, which would drop the others in flight): no
        // insert of a round may still be on its way when its customers are
        // reloaded.
        let store = &self.store;
        let outcomes = futures::future::join_all(
            commands
                .into_iter()
                .map(|c| store.insert_buckets(c, ordered)),
        )
        .await;
        timer.observe_duration();
        let mut failed = None;
        for (run, outcome) in runs.into_iter().zip(outcomes) {
            match outcome {
                Ok(outcome) => Self::inserted(ledger, round, &docs[run], &outcome, ordered),
                // As for a single command: the batch is retried from
                // reloaded heads; what the other commands put in is
                // recorded, and would be found stored anyway.
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Records what one insert command of `docs` put in, from its reply.
    fn inserted(
        ledger: &mut Ledger<'_>,
        round: &mut Round,
        docs: &[NewBucketId],
        outcome: &InsertOutcome,
        ordered: bool,
    ) {
        let mut refused_docs: HashSet<usize> = HashSet::new();
        for e in &outcome.errors {
            refused_docs.insert(e.index);
            let b = docs[e.index];
            round.failed(ledger, b.plan, Op::NewBucket(b.nth), e);
        }
        // An ordered insert attempted nothing after its refusal: those
        // customers are planned again from their true state.
        let attempted = match (ordered, outcome.errors.first()) {
            (true, Some(e)) => e.index + 1,
            _ => docs.len(),
        };
        for b in &docs[attempted..] {
            round.mark_stale(b.plan);
        }
        for (i, &b) in docs[..attempted].iter().enumerate() {
            if !refused_docs.contains(&i) {
                ledger.record(&round.new_bucket(b).events, Outcome::Written);
                ledger.stats_mut().buckets_created += 1;
            }
        }
    }

    /// Customers whose every operation held are done, and the cache now
    /// holds their new newest bucket; the others are forgotten, to be
    /// reloaded next round.
    /// The round's plans are used up: their new heads move into the cache
    /// (a head holds up to `cap` keys, and cloning them was 7 % of a
    /// write).
    fn settle(&mut self, ledger: &mut Ledger<'_>, round: &mut Round) {
        let plans = round.take_plans();
        let unsettled: HashSet<&CustomerId> =
            round.conflicted.iter().chain(round.stale.iter()).collect();
        for planned in plans {
            let customer = planned.customer;
            ledger.settle_copies(&planned.plan.copies);
            if planned.held && !unsettled.contains(&customer) {
                // An isolated customer wrote part of its events, and a copy
                // whose first was refused is planned on its own: more may
                // wait.
                ledger.done_if_settled(&customer);
                self.cache.put(customer, planned.plan.after);
            }
        }
        for customer in unsettled {
            self.cache.pop(customer);
            // Settled after all (a missed fill whose trades are all
            // stored): nothing left to plan, so nothing to reload.
            ledger.done_if_settled(customer);
        }
        ledger.stats_mut().conflicts += round.conflicted.len();
    }

    /// After a duplicate-key error: which of the conflicted customers'
    /// keys are already stored? In one of their own buckets, the event is a
    /// duplicate; in another customer's, the trade id is contested and the
    /// event is dead-lettered (unsharded only: sharded, a trade id is
    /// unique per customer, and `find_keys` looks in the customer's own
    /// buckets).
    async fn learn_stored_keys(
        &mut self,
        ledger: &mut Ledger<'_>,
        conflicted: &[CustomerId],
    ) -> Result<(), StoreError> {
        let owner_of = ledger.keys_in_conflict(conflicted);
        let found = self.find_keys(&ledger.keys_of(&owner_of)).await?;
        for (key, bucket_id) in found {
            for &i in owner_of.get(key.as_str()).map(Vec::as_slice).unwrap_or(&[]) {
                ledger.key_stored(i, &key, &bucket_id);
            }
        }
        Ok(())
    }
}

mod events;
mod ledger;
mod round;
mod split;

pub use events::Events;
pub use split::InsertSplit;

use ledger::{ByKey, Ledger};
use round::{NewBucketId, Op, PlanId, Planned, Round};

#[cfg(test)]
mod model;
