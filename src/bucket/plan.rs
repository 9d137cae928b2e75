//! Bucket planning: given what we know of a customer's newest bucket and the
//! customer's events from one batch, decide which events are already
//! stored, which fill the open bucket and which open new buckets. Pure.
//!
//! Why the plan is safe to execute against a database other writers may
//! touch (a zombie after a rebalance, a customer spread over partitions):
//! - the fill is guarded on the bucket's `count`: counts only grow, so a
//!   matching count means nobody appended since we last saw the bucket, and
//!   our copy of its keys and watermark is exact;
//! - a new bucket names its predecessor in `prev`, under a unique index: one
//!   successor per bucket, and we only plan a successor for a bucket we have
//!   seen full, so every bucket but the newest is full;
//! - `history.key` is unique across documents, so a trade cannot land in two
//!   buckets; within the open bucket the exact key copy catches it;
//! - `wm` (watermark) maps each source partition to the highest offset whose
//!   event is in the customer's buckets, advanced in the same atomic update
//!   as the append. Events of one partition are applied in offset order, so
//!   everything at or below it is already stored: replays skip it. (Unless
//!   the offsets went backwards under the same topic name; the writer looks
//!   such events' keys up, see [`Known::not_stored`].)
//!
//! Any guard miss or duplicate key means our view was stale: reload the
//! newest bucket and plan again. Re-planning is idempotent by the rules
//! above, which is what makes the effect exactly-once.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use mongodb::bson::Bson;

use super::id::{Position, Prefix};
use crate::event::{CustomerId, Source, Trade};

/// What we know of a customer's newest bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketHead {
    pub id: String,
    /// The stored `customerId` value, copied into successors so every bucket
    /// of a customer carries the same type.
    pub customer: Bson,
    pub count: u32,
    /// `history.key` of every trade in this bucket.
    pub keys: HashSet<String>,
    /// Partition key -> highest applied offset.
    pub wm: BTreeMap<String, i64>,
}

impl BucketHead {
    /// Whether `source`'s offset is at or below this bucket's watermark for
    /// its partition: stored by an earlier delivery, if offsets only grew.
    pub fn covers(&self, source: &Source) -> bool {
        self.wm
            .get(&source.partition_key())
            .is_some_and(|&wm| source.offset <= wm)
    }
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
    pub tickers: BTreeSet<String>,
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
    pub tickers: BTreeSet<String>,
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
    /// Same key as a stored trade or an earlier event of this batch.
    pub duplicates: Vec<usize>,
    /// Events that cannot be placed (the `_id` space after the newest bucket
    /// is exhausted, or the newest bucket has a foreign `_id`), with why.
    pub unplaceable: Vec<(usize, String)>,
    /// The newest bucket once every operation above has succeeded.
    pub after: Option<BucketHead>,
}

impl CustomerPlan {
    pub fn has_writes(&self) -> bool {
        self.fill.is_some() || !self.new_buckets.is_empty()
    }
}

/// Plans one customer's events (in stream order) against `head`, its
/// newest bucket as we know it. `known` holds what the writer learnt from
/// the database about keys the head does not show (see [`Known`]).
pub fn plan_customer(
    customer: &CustomerId,
    head: Option<&BucketHead>,
    events: &[Event<'_>],
    known: &Known,
    capacity: u32,
) -> CustomerPlan {
    let mut plan = CustomerPlan::default();
    let accepted = classify(head, events, known, &mut plan);
    let mut head = head.cloned();
    let mut rest = accepted.as_slice();

    if let Some(h) = head
        .as_mut()
        .filter(|h| h.count < capacity && !rest.is_empty())
    {
        let (now, later) = rest.split_at(rest.len().min((capacity - h.count) as usize));
        plan.fill = Some(fill(h, now));
        rest = later;
    }

    let prefix = Prefix::of(customer);
    while !rest.is_empty() {
        let at = match next_position(&prefix, head.as_ref(), rest[0].trade.epoch_seconds()) {
            Ok(at) => at,
            Err(why) => {
                plan.unplaceable
                    .extend(rest.iter().map(|ev| (ev.index, why.clone())));
                break;
            }
        };
        let (now, later) = rest.split_at(rest.len().min(capacity as usize));
        let (bucket, after) = open_bucket(&prefix, customer, head.as_ref(), at, now);
        plan.new_buckets.push(bucket);
        head = Some(after);
        rest = later;
    }

    plan.after = head;
    plan
}

/// Records in `plan` the events already stored (at or below the watermark,
/// unless known not to be) and the duplicates (key in the open bucket,
/// known elsewhere, or earlier in the batch); returns the rest, in order.
fn classify<'a>(
    head: Option<&BucketHead>,
    events: &[Event<'a>],
    known: &Known,
    plan: &mut CustomerPlan,
) -> Vec<Event<'a>> {
    let mut accepted: Vec<Event<'a>> = Vec::with_capacity(events.len());
    let mut seen: HashSet<&str> = HashSet::new();
    for ev in events {
        let applied =
            !known.not_stored.contains(&ev.trade.key) && head.is_some_and(|h| h.covers(ev.source));
        if applied {
            plan.already_applied.push(ev.index);
        } else if head.is_some_and(|h| h.keys.contains(&ev.trade.key))
            || known.elsewhere.contains(&ev.trade.key)
            || !seen.insert(&ev.trade.key)
        {
            plan.duplicates.push(ev.index);
        } else {
            accepted.push(*ev);
        }
    }
    accepted
}

/// The guarded append of `events` to the open bucket `head`, which has
/// room for them; `head` becomes the bucket as it will be after it.
fn fill(head: &mut BucketHead, events: &[Event<'_>]) -> Fill {
    let mut fill = Fill {
        bucket_id: head.id.clone(),
        expected_count: head.count,
        events: Vec::with_capacity(events.len()),
        wm: BTreeMap::new(),
        tickers: BTreeSet::new(),
    };
    for ev in events {
        fill.events.push(ev.index);
        advance(&mut fill.wm, ev.source);
        fill.tickers.insert(ev.trade.ticker.clone());
        head.keys.insert(ev.trade.key.clone());
    }
    head.count += events.len() as u32;
    for (k, v) in &fill.wm {
        advance_to(&mut head.wm, k, *v);
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

/// A new bucket at `at` holding `events`, after `head` (or the customer's
/// first); and the newest bucket once it is in.
fn open_bucket(
    prefix: &Prefix,
    customer: &CustomerId,
    head: Option<&BucketHead>,
    at: Position,
    events: &[Event<'_>],
) -> (NewBucket, BucketHead) {
    // A new bucket carries the customer's whole watermark, so the newest
    // bucket alone tells what is applied.
    let mut wm = head.map(|h| h.wm.clone()).unwrap_or_default();
    let mut bucket = NewBucket {
        id: prefix.id(at),
        prev: head.map_or_else(|| prefix.as_str().to_string(), |h| h.id.clone()),
        customer: head.map_or_else(|| customer.to_bson(), |h| h.customer.clone()),
        events: Vec::with_capacity(events.len()),
        wm: BTreeMap::new(),
        tickers: BTreeSet::new(),
    };
    let mut keys = HashSet::with_capacity(events.len());
    for ev in events {
        bucket.events.push(ev.index);
        advance(&mut wm, ev.source);
        bucket.tickers.insert(ev.trade.ticker.clone());
        keys.insert(ev.trade.key.clone());
    }
    bucket.wm = wm.clone();
    let after = BucketHead {
        id: bucket.id.clone(),
        customer: bucket.customer.clone(),
        count: events.len() as u32,
        keys,
        wm,
    };
    (bucket, after)
}

fn advance(wm: &mut BTreeMap<String, i64>, source: &Source) {
    advance_to(wm, &source.partition_key(), source.offset);
}

fn advance_to(wm: &mut BTreeMap<String, i64>, key: &str, offset: i64) {
    let entry = wm.entry(key.to_string()).or_insert(offset);
    *entry = (*entry).max(offset);
}

#[cfg(test)]
mod tests;
