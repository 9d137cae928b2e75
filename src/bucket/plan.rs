//! Bucket planning: given what we know of a customer's newest bucket and the
//! customer's events from one batch, decide which events are already
//! stored, which fill the open bucket and which open new buckets. Pure.
//!
//! The plan is safe to execute against a database other writers touch (a
//! zombie after a rebalance, a customer spread over partitions) because of
//! the rules argued in docs/design.md, "Why the effect is exactly-once":
//! the fill is guarded on the bucket's `count`; a new bucket names its
//! predecessor under a unique `prev`; "full" is a property of the stored
//! bucket (`cap`, `capBytes`, `bytes`: [`super::size`]), never of this
//! process; `history.key` is unique; and the watermark `wm` advances in the
//! same update as the append (offsets that went backwards:
//! [`Known::not_stored`]). Any guard miss or duplicate key means our view
//! was stale: the writer reloads the newest bucket and plans again, which
//! those rules make idempotent.

use std::collections::{BTreeMap, HashMap, HashSet};

use compact_str::CompactString;
use mongodb::bson::Bson;

use super::id::{Position, Prefix};
use super::size;
use crate::event::{CustomerId, Source, Trade};

/// The limits a new bucket is opened with, stored in it as `cap` and
/// `capBytes`; they decide when that bucket is full for every writer,
/// whatever limits the writer itself would open buckets with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Trades per bucket: `buckets.capacity`. Also the count at which a
    /// legacy bucket (one stored without `cap`) is full.
    pub cap: u32,
    /// The size bound at which a bucket is full.
    pub cap_bytes: u64,
}

impl Limits {
    /// This version's limits for `capacity` trades per bucket.
    pub fn with_capacity(capacity: u32) -> Limits {
        Limits {
            cap: capacity,
            cap_bytes: size::CAP_BYTES,
        }
    }
}

/// A bucket's size bound and the bound it closes at, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    /// `bytes`: at least the bucket's BSON size.
    pub bytes: u64,
    /// `capBytes`: full at or above this.
    pub cap_bytes: u64,
}

/// A bucket's trade keys. Hashed with foldhash, not SipHash: planning
/// looks up and inserts every event's key here, and SipHash was a seventh
/// of planning's work (docs/benchmarks.md, "Hot path"). SipHash's
/// resistance to chosen collisions is not needed: the set holds one
/// bucket's keys, at most `buckets.capacity` (1,000), so colliding keys
/// cost a producer no more than a bucket's worth of comparisons.
pub type KeySet = HashSet<CompactString, foldhash::fast::RandomState>;

/// What we know of a customer's newest bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketHead {
    pub id: String,
    /// The stored `customerId` value, copied into successors so every bucket
    /// of a customer carries the same type.
    pub customer: Bson,
    pub count: u32,
    /// `cap`: the count it is full at. `None` for a legacy bucket (written
    /// before buckets stored their limits, or by another tool): full at the
    /// writer's own capacity, as the version that wrote it decided.
    pub cap: Option<u32>,
    /// `bytes` and `capBytes`. `None` for a legacy bucket: never full by
    /// size, and its fills leave `bytes` absent (an `$inc` would create it
    /// holding only the growth, below the true size).
    pub size: Option<Size>,
    /// `history.key` of every trade in this bucket.
    pub keys: KeySet,
    /// Partition key -> highest applied offset.
    pub wm: BTreeMap<String, i64>,
}

impl BucketHead {
    /// Whether this bucket takes no more trades, by its own stored limits;
    /// `legacy_cap` counts only for a bucket stored without `cap`.
    pub fn is_full(&self, legacy_cap: u32) -> bool {
        self.count >= self.cap.unwrap_or(legacy_cap)
            || self.size.is_some_and(|s| s.bytes >= s.cap_bytes)
    }

    /// The bucket once `ev` is appended to it.
    fn push(&mut self, ev: &Event<'_>) {
        self.count += 1;
        self.keys.insert(ev.trade.key.clone());
        advance(&mut self.wm, ev.source);
        if let Some(s) = self.size.as_mut() {
            s.bytes += size::charge(ev.trade, ev.source);
        }
    }

    /// Whether `source`'s offset is at or below this bucket's watermark for
    /// its partition: stored by an earlier delivery, if offsets only grew.
    pub fn covers(&self, source: &Source) -> bool {
        watermark(&self.wm, source).is_some_and(|&wm| source.offset <= wm)
    }
}

/// A customer's newest bucket as loaded: none yet, one we can plan
/// against, or one we cannot read (see [`UnreadableBucket`]).
pub type LoadedHead = Result<Option<BucketHead>, UnreadableBucket>;

/// A newest bucket this version cannot plan against: a field the guard or
/// the planner relies on has a value no writer of ours stores (a `count`
/// that is not a whole number, say), written by another tool or by hand.
/// Only that customer's events are affected: they are dead-lettered with
/// this reason, and every other customer's are written and committed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bucket {id} cannot be read: {why}")]
pub struct UnreadableBucket {
    pub id: String,
    pub why: String,
}

/// One event of the batch, as the planner sees it.
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    /// Position in the caller's batch, used to refer back to it.
    pub index: usize,
    pub trade: &'a Trade,
    pub source: &'a Source,
}

/// Append to the open bucket, guarded on its current count.
#[derive(Debug, Clone, PartialEq)]
pub struct Fill {
    pub bucket_id: String,
    pub expected_count: u32,
    /// Batch indices of the appended events, in order.
    pub events: Vec<usize>,
    /// Watermark advances (partition key -> offset), applied with `$max`.
    pub wm: BTreeMap<String, i64>,
    /// What to add to the bucket's `bytes` (the sum of the events'
    /// [`size::charge`]); `None` for a legacy bucket, which has none.
    pub bytes: Option<u64>,
}

/// A whole new bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct NewBucket {
    pub id: String,
    /// The predecessor's `_id`, or `<customer>_` for the first bucket.
    pub prev: String,
    pub customer: Bson,
    pub events: Vec<usize>,
    pub wm: BTreeMap<String, i64>,
    /// The limits it is opened with (`cap`, `capBytes`).
    pub limits: Limits,
    /// Its size bound (`bytes`): the empty bucket's exact size plus each
    /// event's [`size::charge`].
    pub bytes: u64,
}

/// What the writer learnt from the database about a customer's keys,
/// beyond its newest bucket.
#[derive(Debug, Clone, Default)]
pub struct Known {
    /// Keys stored in one of the customer's older buckets: duplicates.
    pub elsewhere: HashSet<String>,
    /// Keys of events at or below their partition's watermark that are in
    /// none of the customer's buckets. The watermark is wrong for them: the
    /// partition's offsets went backwards under the same topic name (the
    /// topic was deleted and recreated, or its log truncated). They are
    /// planned like new events; their key still guards against a double.
    pub not_stored: HashSet<String>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct CustomerPlan {
    pub fill: Option<Fill>,
    pub new_buckets: Vec<NewBucket>,
    /// At or below the watermark: stored by an earlier delivery.
    pub already_applied: Vec<usize>,
    /// Same key as a stored trade: the open bucket holds it, or the
    /// writer found it in another of the customer's buckets.
    pub duplicates: Vec<usize>,
    /// Events whose key an earlier accepted event of this batch has, each
    /// as `(copy, first)`. Not settled by the plan: a copy is a duplicate
    /// only once its first is stored, and the first may yet be held or
    /// refused, leaving the copy's trade stored nowhere (the writer
    /// settles each copy by what became of its first).
    pub copies: Vec<(usize, usize)>,
    /// Events that cannot be placed (the `_id` space after the newest bucket
    /// is exhausted, or the newest bucket has a foreign `_id`), with why.
    pub unplaceable: Vec<(usize, String)>,
    /// Planned with `hold`: the customer's last events, which would only
    /// part-fill a bucket (the open one, or a new last one), left for a
    /// later batch. Always the tail of the accepted events, in order.
    pub held: Vec<usize>,
    /// With `held`: what the partial bucket they would go to takes before
    /// it is full (see [`Room`]).
    pub room: Room,
    /// The newest bucket once every operation above has succeeded. Boxed,
    /// as the writer caches it: a head is some 240 bytes, and a plan and a
    /// cache entry are moved for every customer of every batch.
    pub after: Option<Box<BucketHead>>,
}

/// What a held customer's partial bucket (the open one, or the new last
/// one) takes, with its held trades in it, and stays short of full: how
/// many more trades, of how many bytes ([`size::charge`]) in all. A plan
/// of the held trades and more trades that fit holds them all again, so
/// the caller may hold such trades without planning them (see
/// `pipeline::stage`). The default takes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Room {
    pub trades: u32,
    pub bytes: u64,
}

impl Room {
    /// What `bucket` takes and stays short of full by its own limits
    /// (`legacy_cap` for one stored without `cap`; one without a size is
    /// never full by size).
    fn left_in(bucket: &BucketHead, legacy_cap: u32) -> Room {
        let cap = bucket.cap.unwrap_or(legacy_cap);
        Room {
            trades: cap.saturating_sub(bucket.count).saturating_sub(1),
            bytes: bucket.size.map_or(u64::MAX, |s| {
                s.cap_bytes.saturating_sub(s.bytes).saturating_sub(1)
            }),
        }
    }

    /// Takes one more trade of `charge` bytes if the bucket stays short of
    /// full with it; otherwise takes nothing and says so.
    pub fn take(&mut self, charge: u64) -> bool {
        if self.trades == 0 || charge > self.bytes {
            return false;
        }
        self.trades -= 1;
        self.bytes -= charge;
        true
    }
}

impl CustomerPlan {
    pub fn has_writes(&self) -> bool {
        self.fill.is_some() || !self.new_buckets.is_empty()
    }
}

/// Plans one customer's events (in stream order) against `head`, its
/// newest bucket as we know it. `known` holds what the writer learnt from
/// the database about keys the head does not show (see [`Known`]); new
/// buckets are opened with `limits`.
///
/// Events fill the open bucket while it is not full, then open new
/// buckets, each taking events until it is full (counting the events
/// planned into it) or the events run out: a successor follows only a
/// bucket that is full by its own limits.
pub fn plan_customer(
    customer: &CustomerId,
    head: Option<&BucketHead>,
    events: &[Event<'_>],
    known: &Known,
    limits: Limits,
) -> CustomerPlan {
    let head = head.map(|h| Box::new(h.clone()));
    plan_customer_owned(customer, head, events, known, limits, false)
}

/// [`plan_customer`] on a head the caller gives up: it becomes the plan's
/// `after`, changed in place, so planning copies no key set. The writer
/// plans this way with the head it takes out of its cache (a head holds up
/// to `cap` keys and its watermarks, and every customer of every batch is
/// planned).
///
/// With `hold`, only whole buckets are written: a fill that would leave the
/// open bucket short of full, or a last new bucket that would not be full,
/// is left out and its events go to `held`, for a later batch to write
/// with the customer's next trades (see docs/design.md, "Holding partial
/// buckets under a backlog"). What is written is then exactly what the
/// plan without `hold` would write first, so a later plan of the held
/// events continues it as if nothing had been held.
pub fn plan_customer_owned(
    customer: &CustomerId,
    mut head: Option<Box<BucketHead>>,
    events: &[Event<'_>],
    known: &Known,
    limits: Limits,
    hold: bool,
) -> CustomerPlan {
    let mut plan = CustomerPlan::default();
    let accepted = classify(head.as_deref(), events, known, &mut plan);
    let mut rest = accepted.as_slice();

    if let Some(h) = head
        .as_mut()
        .filter(|h| !h.is_full(limits.cap) && !rest.is_empty())
    {
        if let Some(room) = hold.then(|| room_after(h, rest, limits.cap)).flatten() {
            plan.held.extend(rest.iter().map(|ev| ev.index));
            plan.room = room;
            rest = &[];
        } else {
            let fill = fill(h, rest, limits.cap);
            rest = &rest[fill.events.len()..];
            plan.fill = Some(fill);
        }
    }

    if !rest.is_empty() {
        head = open_buckets(customer, head, rest, limits, hold, &mut plan);
    }
    plan.after = head;
    plan
}

/// What the open bucket `head` still takes once `events` are appended,
/// or `None` if they make it full (the fill stops there): its room by
/// [`BucketHead::is_full`]'s limits, taken event by event.
fn room_after(head: &BucketHead, events: &[Event<'_>], legacy_cap: u32) -> Option<Room> {
    let mut room = Room::left_in(head, legacy_cap);
    let fit = events
        .iter()
        .all(|ev| room.take(size::charge(ev.trade, ev.source)));
    fit.then_some(room)
}

/// Opens the buckets `events` go to after `head` (the newest bucket, full
/// or absent), in `plan`; returns the newest bucket once they are in.
/// Events that cannot be placed are recorded there with why. With `hold`,
/// a last bucket that would not be full is not opened: its events are
/// held.
fn open_buckets(
    customer: &CustomerId,
    mut head: Option<Box<BucketHead>>,
    mut rest: &[Event<'_>],
    limits: Limits,
    hold: bool,
    plan: &mut CustomerPlan,
) -> Option<Box<BucketHead>> {
    let prefix = Prefix::of(customer);
    while !rest.is_empty() {
        let at = match next_position(&prefix, head.as_deref(), rest[0].trade.epoch_seconds()) {
            Ok(at) => at,
            Err(why) => {
                plan.unplaceable
                    .extend(rest.iter().map(|ev| (ev.index, why.clone())));
                break;
            }
        };
        let (bucket, after) = open_bucket(&prefix, customer, head.as_deref(), at, rest, limits);
        // A bucket stops taking events only when full: one that is not
        // took all the rest, and is the last.
        if hold && !after.is_full(limits.cap) {
            plan.held.extend(bucket.events);
            plan.room = Room::left_in(&after, limits.cap);
            break;
        }
        rest = &rest[bucket.events.len()..];
        plan.new_buckets.push(bucket);
        // The new bucket takes the old head's box.
        match head.as_mut() {
            Some(h) => **h = after,
            None => head = Some(Box::new(after)),
        }
    }
    head
}

/// Records in `plan` the events already stored (at or below the watermark,
/// unless known not to be), the duplicates (key in the open bucket or
/// known elsewhere) and the copies of an earlier event of the batch;
/// returns the rest, in order.
fn classify<'a>(
    head: Option<&BucketHead>,
    events: &[Event<'a>],
    known: &Known,
    plan: &mut CustomerPlan,
) -> Vec<Event<'a>> {
    let mut accepted: Vec<Event<'a>> = Vec::with_capacity(events.len());
    // foldhash, as `KeySet` and for its reason: every event's key goes in.
    // Sized at once: grown from empty, it reallocated and rehashed about
    // log2(n) times per customer.
    let mut seen: HashMap<&str, usize, foldhash::fast::RandomState> =
        HashMap::with_capacity_and_hasher(events.len(), Default::default());
    for ev in events {
        let applied = !known.not_stored.contains(ev.trade.key.as_str())
            && head.is_some_and(|h| h.covers(ev.source));
        if applied {
            plan.already_applied.push(ev.index);
        } else if head.is_some_and(|h| h.keys.contains(ev.trade.key.as_str()))
            || known.elsewhere.contains(ev.trade.key.as_str())
        {
            plan.duplicates.push(ev.index);
        } else if let Some(&first) = seen.get(ev.trade.key.as_str()) {
            plan.copies.push((ev.index, first));
        } else {
            seen.insert(&ev.trade.key, ev.index);
            accepted.push(*ev);
        }
    }
    accepted
}

/// The guarded append to the open bucket `head` (not full) of the first
/// `events` it takes before it is full; `head` becomes the bucket as it
/// will be after it.
fn fill(head: &mut BucketHead, events: &[Event<'_>], legacy_cap: u32) -> Fill {
    let mut fill = Fill {
        bucket_id: head.id.clone(),
        expected_count: head.count,
        events: Vec::with_capacity(events.len()),
        wm: BTreeMap::new(),
        bytes: head.size.map(|_| 0),
    };
    for ev in events {
        if head.is_full(legacy_cap) {
            break;
        }
        fill.events.push(ev.index);
        advance(&mut fill.wm, ev.source);
        if let Some(b) = fill.bytes.as_mut() {
            *b += size::charge(ev.trade, ev.source);
        }
        head.push(ev);
    }
    fill
}

/// Where the bucket after `head` goes when its first trade is at
/// `first_secs`; or why no bucket can follow `head`.
fn next_position(
    prefix: &Prefix,
    head: Option<&BucketHead>,
    first_secs: i64,
) -> Result<Position, String> {
    let prev = match head {
        None => None,
        Some(h) => Some(prefix.parse(&h.id).ok_or_else(|| {
            format!(
                "the newest bucket {:?} has an _id this version cannot extend",
                h.id
            )
        })?),
    };
    Position::next(prev, first_secs)
        .ok_or_else(|| "no bucket _id sorts after the newest bucket".to_string())
}

/// A new bucket at `at`, after `head` (or the customer's first), holding
/// the first `events` it takes before it is full by `limits`; and the
/// newest bucket once it is in.
fn open_bucket(
    prefix: &Prefix,
    customer: &CustomerId,
    head: Option<&BucketHead>,
    at: Position,
    events: &[Event<'_>],
    limits: Limits,
) -> (NewBucket, BucketHead) {
    let id = prefix.id(at);
    let prev = head.map_or_else(|| prefix.as_str().to_string(), |h| h.id.clone());
    let customer = head.map_or_else(|| customer.to_bson(), |h| h.customer.clone());
    // A new bucket carries the customer's whole watermark, so the newest
    // bucket alone tells what is applied.
    let wm = head.map(|h| h.wm.clone()).unwrap_or_default();
    let mut after = BucketHead {
        size: Some(Size {
            bytes: size::empty_bucket(&id, &customer, &prev, &wm),
            cap_bytes: limits.cap_bytes,
        }),
        id,
        customer,
        count: 0,
        cap: Some(limits.cap),
        keys: KeySet::with_capacity_and_hasher(events.len(), Default::default()),
        wm,
    };
    let mut taken = Vec::with_capacity(events.len());
    for ev in events {
        // At least one event, however small the limits: a bucket is never
        // empty, and the caller's loop must advance.
        if !taken.is_empty() && after.is_full(limits.cap) {
            break;
        }
        taken.push(ev.index);
        after.push(ev);
    }
    let bucket = NewBucket {
        id: after.id.clone(),
        prev,
        customer: after.customer.clone(),
        events: taken,
        wm: after.wm.clone(),
        limits,
        bytes: after.size.expect("opened with a size").bytes,
    };
    (bucket, after)
}

/// `source`'s partition's watermark. A bucket holds one per partition its
/// trades came from (a handful), so a scan that builds no key beats a
/// lookup that must build one.
fn watermark<'w>(wm: &'w BTreeMap<String, i64>, source: &Source) -> Option<&'w i64> {
    wm.iter()
        .find(|(key, _)| source.is_partition_key(key))
        .map(|(_, offset)| offset)
}

/// Raises `source`'s partition's watermark to its offset; the key is built
/// only for a partition new to the bucket.
fn advance(wm: &mut BTreeMap<String, i64>, source: &Source) {
    let found = wm.iter_mut().find(|(key, _)| source.is_partition_key(key));
    match found {
        Some((_, entry)) => *entry = (*entry).max(source.offset),
        None => {
            wm.insert(source.partition_key(), source.offset);
        }
    }
}

#[cfg(test)]
mod tests;
