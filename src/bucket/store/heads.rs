//! Loading customers' newest buckets. One `find` per customer (its `_id`
//! range, newest first, one document) is one index seek, but also one
//! round trip, and after a start or a rebalance the writer asks for every
//! customer it sees. Most of those answers are "none" when the customers
//! are new (a new deployment, a new topic, a backfill): then one *probe*
//! per [`PROBE_CUSTOMERS`] customers settles them together. The probe is a
//! `find` of their ranges' `$or`, only `_id`s, newest first, at most one
//! per customer asked ([`resolve`] says what that proves), and one `$in`
//! read of the heads it found; whatever it cannot settle goes on to the
//! one-per-customer loads.
//!
//! A probe of customers that all have buckets settles few of them (the
//! `_id`s of the first ones' older buckets use up its limit), so it is
//! only a cost there. The store probes while most customers of its last
//! load had no bucket, and loads one per customer otherwise: both give
//! the same heads, so the choice is speed only. Sharded mode always loads
//! one per customer: each of those `find`s carries its shard key and goes
//! to one shard.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use futures::{StreamExt, TryStreamExt};
use mongodb::bson::{doc, Document};
use mongodb::options::{FindOneOptions, FindOptions};

use super::{bounded, head_from_document, BucketStore, StoreError};
use crate::bucket::id::Prefix;
use crate::bucket::plan::LoadedHead;
use crate::event::CustomerId;

/// Customers one probe asks about: one `$or` branch each, and the probe's
/// limit.
pub const PROBE_CUSTOMERS: usize = 64;

/// What a probe's answer proves about one customer it asked about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probed {
    /// Its newest bucket has this `_id`.
    Head(String),
    /// It has no bucket.
    NoBucket,
    /// The answer stopped at its limit before this customer's range.
    Unknown,
}

/// What a probe's `ids` (every `_id` in the asked `prefixes`' ranges,
/// highest first, cut at `limit`) prove about each prefix, in order.
///
/// Every `_id` of a prefix's range sorts at or after the prefix itself, so
/// the `_id`s above the last one returned were all returned: a prefix with
/// an `_id` among them has the first one as its highest; one without any
/// has no bucket if the answer was not cut, or if the prefix sorts above
/// the last `_id` returned (its whole range was read). Otherwise it is
/// unknown. Strings compare by bytes here as in MongoDB (the collection's
/// simple collation, which the `_id` ranges rely on throughout, and
/// which `init` checks: [`super::layout::collection_conflict`]).
pub fn resolve(prefixes: &[Prefix], ids: &[String], limit: usize) -> Vec<Probed> {
    let mut newest: HashMap<&str, &str> = HashMap::new();
    for id in ids {
        if let Some(p) = prefixes.iter().find(|p| p.owns(id)) {
            newest.entry(p.as_str()).or_insert(id.as_str());
        }
    }
    let cut = (ids.len() >= limit).then(|| ids.last()).flatten();
    prefixes
        .iter()
        .map(|p| match (newest.get(p.as_str()), cut) {
            (Some(id), _) => Probed::Head((*id).to_string()),
            (None, None) => Probed::NoBucket,
            (None, Some(cut)) if p.as_str() > cut.as_str() => Probed::NoBucket,
            (None, Some(_)) => Probed::Unknown,
        })
        .collect()
}

/// The fields planning reads of a newest bucket.
fn head_fields() -> Document {
    doc! {
        "count": 1, "cap": 1, "capBytes": 1, "bytes": 1,
        "customerId": 1, "wm": 1, "history.key": 1,
    }
}

impl BucketStore {
    /// The newest bucket of `customer` (highest `_id` in its prefix range),
    /// with just the fields planning needs; a bucket whose fields we cannot
    /// plan against is reported, not an error (see [`UnreadableBucket`](crate::bucket::plan::UnreadableBucket)).
    pub async fn load_head(&self, customer: &CustomerId) -> Result<LoadedHead, StoreError> {
        let options = FindOneOptions::builder()
            .sort(doc! {"_id": -1})
            .projection(head_fields())
            .max_time(self.operation_limit)
            .build();
        let find = self
            .reads
            .find_one(self.customer_filter(customer))
            .with_options(options);
        let doc = bounded("find", self.operation_limit, find).await?;
        Ok(doc.map(|d| head_from_document(&d)).transpose())
    }

    /// Several customers' heads: probed first while most customers turn
    /// out to have none (see the module docs), then one `find` each,
    /// `load_concurrency` at a time.
    pub async fn load_heads(
        &self,
        customers: Vec<CustomerId>,
    ) -> Result<Vec<(CustomerId, LoadedHead)>, StoreError> {
        let mut heads = Vec::with_capacity(customers.len());
        let rest = if self.probes_first() {
            let mut rest = Vec::new();
            for group in customers.chunks(PROBE_CUSTOMERS) {
                self.probe(group, &mut heads, &mut rest).await?;
            }
            rest
        } else {
            customers
        };
        heads.extend(self.load_each(rest).await?);
        let none = heads.iter().filter(|(_, h)| matches!(h, Ok(None))).count();
        if !heads.is_empty() {
            self.probe_first
                .store(2 * none >= heads.len(), Ordering::Relaxed);
        }
        Ok(heads)
    }

    /// Whether the next [`load_heads`](Self::load_heads) probes first: in
    /// unsharded mode, while at least half of the customers of the last
    /// load had no bucket (and at first).
    pub fn probes_first(&self) -> bool {
        !self.sharded && self.probe_first.load(Ordering::Relaxed)
    }

    /// One `find` per customer, `load_concurrency` at a time.
    async fn load_each(
        &self,
        customers: Vec<CustomerId>,
    ) -> Result<Vec<(CustomerId, LoadedHead)>, StoreError> {
        futures::stream::iter(customers)
            .map(|c| async move {
                let head = self.load_head(&c).await?;
                Ok::<_, StoreError>((c, head))
            })
            .buffer_unordered(self.load_concurrency)
            .try_collect()
            .await
    }

    /// Probes `group`: the heads it settles go to `heads`, the customers
    /// it cannot (and those whose head was gone by the second read) to
    /// `rest`.
    async fn probe(
        &self,
        group: &[CustomerId],
        heads: &mut Vec<(CustomerId, LoadedHead)>,
        rest: &mut Vec<CustomerId>,
    ) -> Result<(), StoreError> {
        let prefixes: Vec<Prefix> = group.iter().map(Prefix::of).collect();
        let ranges: Vec<Document> = prefixes.iter().map(Prefix::range).collect();
        let ids = self.newest_ids(doc! {"$or": ranges}, group.len()).await?;
        let verdicts = resolve(&prefixes, &ids, group.len());
        let found: Vec<&str> = verdicts
            .iter()
            .filter_map(|v| match v {
                Probed::Head(id) => Some(id.as_str()),
                _ => None,
            })
            .collect();
        let mut docs = self.heads_by_id(&found).await?;
        for (customer, verdict) in group.iter().zip(verdicts) {
            match verdict {
                Probed::NoBucket => heads.push((customer.clone(), Ok(None))),
                Probed::Head(id) => match docs.remove(&id) {
                    Some(d) => heads.push((customer.clone(), head_from_document(&d).map(Some))),
                    None => rest.push(customer.clone()),
                },
                Probed::Unknown => rest.push(customer.clone()),
            }
        }
        Ok(())
    }

    /// The string `_id`s `filter` matches, highest first, at most `limit`.
    async fn newest_ids(&self, filter: Document, limit: usize) -> Result<Vec<String>, StoreError> {
        let options = FindOptions::builder()
            .projection(doc! {"_id": 1})
            .sort(doc! {"_id": -1})
            .limit(i64::try_from(limit).unwrap_or(i64::MAX))
            .build();
        let docs = self.read_all(filter, options).await?;
        Ok(docs
            .into_iter()
            .filter_map(|d| d.get_str("_id").ok().map(str::to_string))
            .collect())
    }

    /// The buckets with these `_id`s, with the fields planning reads, by
    /// `_id`.
    async fn heads_by_id(&self, ids: &[&str]) -> Result<HashMap<String, Document>, StoreError> {
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        let options = FindOptions::builder().projection(head_fields()).build();
        let docs = self.read_all(doc! {"_id": {"$in": ids}}, options).await?;
        Ok(docs
            .into_iter()
            .filter_map(|d| Some((d.get_str("_id").ok()?.to_string(), d)))
            .collect())
    }

    /// Every document of a decisive read (see the store's module docs),
    /// within the operation limit.
    async fn read_all(
        &self,
        filter: Document,
        mut options: FindOptions,
    ) -> Result<Vec<Document>, StoreError> {
        options.max_time = Some(self.operation_limit);
        let read = async {
            let cursor = self.reads.find(filter).with_options(options).await?;
            cursor.try_collect::<Vec<Document>>().await
        };
        bounded("find", self.operation_limit, read).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn prefix(c: u8) -> Prefix {
        Prefix::of(&CustomerId::Int(i64::from(c)))
    }

    #[test]
    fn a_whole_answer_settles_everyone_and_a_cut_one_what_it_passed() {
        let asked: Vec<Prefix> = [1, 2, 3, 4].map(prefix).to_vec();
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let whole = resolve(&asked, &ids(&["4_2", "4_1", "2_1"]), 4);
        assert_eq!(
            whole,
            vec![
                Probed::NoBucket,
                Probed::Head("2_1".into()),
                Probed::NoBucket,
                Probed::Head("4_2".into()),
            ]
        );
        // Cut at 2: "1_", "2_" and "3_" sort below "4_1", the last `_id`
        // returned, so the answer may have stopped before their ranges.
        let cut = resolve(&asked, &ids(&["4_2", "4_1"]), 2);
        assert_eq!(cut[3], Probed::Head("4_2".into()));
        assert_eq!(
            cut[..3],
            [Probed::Unknown, Probed::Unknown, Probed::Unknown]
        );
    }

    proptest! {
        /// Against the truth (every customer's buckets): whatever the
        /// buckets and the limit, a verdict other than `Unknown` is right,
        /// `Unknown` comes only from a cut answer, and a cut answer settles
        /// at least the customer of its first `_id`.
        #[test]
        fn verdicts_are_never_wrong(
            stored in proptest::collection::btree_map(0u8..40, proptest::collection::btree_set("[0-9a-z_]{1,4}", 0..5), 0..20),
            asked in proptest::collection::btree_set(0u8..40, 1..12),
            limit in 1usize..16,
        ) {
            let prefixes: Vec<Prefix> = asked.iter().map(|&c| prefix(c)).collect();
            let id_of = |c: u8, s: &str| format!("{}{s}", prefix(c).as_str());
            let mut ids: Vec<String> = stored
                .iter()
                .filter(|(c, _)| asked.contains(c))
                .flat_map(|(&c, suffixes)| suffixes.iter().map(move |s| id_of(c, s)))
                .collect();
            ids.sort_unstable_by(|a, b| b.cmp(a));
            ids.truncate(limit);
            let verdicts = resolve(&prefixes, &ids, limit);
            for (c, v) in asked.iter().zip(&verdicts) {
                let truth = stored.get(c).and_then(|s| s.iter().map(|s| id_of(*c, s)).max());
                match v {
                    Probed::Head(id) => prop_assert_eq!(Some(id.clone()), truth),
                    Probed::NoBucket => prop_assert_eq!(None, truth),
                    // Only an answer filled to its limit may have been cut.
                    Probed::Unknown => prop_assert_eq!(ids.len(), limit),
                }
            }
            if let Some(first) = ids.first() {
                let owner = prefixes.iter().position(|p| p.owns(first)).unwrap();
                prop_assert_eq!(&verdicts[owner], &Probed::Head(first.clone()));
            }
        }
    }
}
