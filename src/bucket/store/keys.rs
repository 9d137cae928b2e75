//! The filters of a key lookup (`find_keys`, `find_buckets_of_keys`), cut
//! to a size MongoDB takes. A write that takes every held trade asks for
//! up to `batch.hold_trades + batch.max_events` keys at once (120,000 by
//! default); with long trade ids one `$in` of them all passed the 16 MiB a
//! command may be, and the lookup failed the same way on every retry.

use std::collections::{BTreeMap, HashSet};

use mongodb::bson::{doc, Document};

use super::SHARD_KEY_FIELD;
use crate::bucket::id::Prefix;
use crate::event::CustomerId;

/// Bytes of keys one filter carries at most: half of MongoDB's 16 MiB
/// document limit, leaving room for the command around the filter.
pub const FILTER_BUDGET: usize = 8 * 1024 * 1024;

/// What a key adds to a filter beyond its bytes: the array element's type
/// byte, its index (up to 7 digits) and NUL, the string's length and NUL.
const KEY_OVERHEAD: usize = 14;

/// What a customer's `$or` branch adds beyond its keys: the branch
/// document, its customer and the `history.key`/`$in` wrapping.
const BRANCH_OVERHEAD: usize = 64;

/// Customers per filter in sharded mode: each is one branch of an `$or`,
/// which the server plans branch by branch.
const CUSTOMERS_PER_FILTER: usize = 500;

/// The filters that together ask for every key of `wanted`: unsharded,
/// `{history.key: {$in}}` over the distinct keys; sharded, one branch per
/// customer (`{customerId, history.key: {$in}}`, `$or`-ed), so mongos asks
/// only their shards. Each holds at most [`FILTER_BUDGET`] bytes of keys
/// (a key longer than that alone); a customer whose keys do not fit is
/// split over filters. A bucket can match more than one filter.
pub fn key_filters(wanted: &[(CustomerId, String)], sharded: bool) -> Vec<Document> {
    if !sharded {
        let mut seen: HashSet<&str> = HashSet::new();
        let keys: Vec<&str> = wanted
            .iter()
            .map(|(_, k)| k.as_str())
            .filter(|k| seen.insert(k))
            .collect();
        return budget_chunks(keys, |k| k.len() + KEY_OVERHEAD, usize::MAX)
            .into_iter()
            .map(|keys| doc! {"history.key": {"$in": keys}})
            .collect();
    }
    let mut by_customer: BTreeMap<CustomerId, Vec<&str>> = BTreeMap::new();
    let mut seen: HashSet<(CustomerId, &str)> = HashSet::new();
    for (customer, key) in wanted {
        let customer = customer.canonical();
        if seen.insert((customer.clone(), key.as_str())) {
            by_customer.entry(customer).or_default().push(key.as_str());
        }
    }
    // One branch per customer and budget's worth of its keys.
    let branches: Vec<(CustomerId, Vec<&str>)> = by_customer
        .into_iter()
        .flat_map(|(customer, keys)| {
            let parts = budget_chunks(keys, |k| k.len() + KEY_OVERHEAD, usize::MAX);
            parts.into_iter().map(move |keys| (customer.clone(), keys))
        })
        .collect();
    let cost = |(_, keys): &(CustomerId, Vec<&str>)| {
        BRANCH_OVERHEAD + keys.iter().map(|k| k.len() + KEY_OVERHEAD).sum::<usize>()
    };
    budget_chunks(branches, cost, CUSTOMERS_PER_FILTER)
        .into_iter()
        .map(|chunk| {
            let mut branches: Vec<Document> = chunk
                .into_iter()
                .map(|(customer, keys)| {
                    doc! {SHARD_KEY_FIELD: customer.to_bson(), "history.key": {"$in": keys}}
                })
                .collect();
            match branches.len() {
                1 => branches.pop().expect("one branch"),
                _ => doc! {"$or": branches},
            }
        })
        .collect()
}

/// Whether the key lookup asked for `key` of the customer owning bucket
/// `id` (sharded: a bucket's other keys may be another asker's, or none).
pub struct Asked<'a> {
    keys: HashSet<&'a str>,
    /// Sharded: `(customer prefix, key)`.
    owned: Option<HashSet<(String, &'a str)>>,
}

impl<'a> Asked<'a> {
    pub fn new(wanted: &'a [(CustomerId, String)], sharded: bool) -> Self {
        let owned = sharded.then(|| {
            wanted
                .iter()
                .map(|(c, k)| (Prefix::of(c).as_str().to_string(), k.as_str()))
                .collect()
        });
        Asked {
            keys: wanted.iter().map(|(_, k)| k.as_str()).collect(),
            owned,
        }
    }

    pub fn has(&self, bucket: &str, key: &str) -> bool {
        match &self.owned {
            None => self.keys.contains(key),
            Some(owned) => Prefix::of_id(bucket)
                .is_some_and(|p| owned.contains(&(p.as_str().to_string(), key))),
        }
    }
}

/// `items` in order, cut where the next would take a chunk past `budget`
/// bytes by `cost` or past `max_items` (one item over budget goes alone).
fn budget_chunks<T>(items: Vec<T>, cost: impl Fn(&T) -> usize, max_items: usize) -> Vec<Vec<T>> {
    let mut chunks: Vec<Vec<T>> = Vec::new();
    let mut bytes = 0;
    for item in items {
        let size = cost(&item);
        let full = chunks.last().is_none_or(|c| {
            !c.is_empty() && (bytes + size > FILTER_BUDGET || c.len() >= max_items)
        });
        if full {
            chunks.push(Vec::new());
            bytes = 0;
        }
        bytes += size;
        chunks.last_mut().expect("pushed").push(item);
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MongoDB's document limit; a filter is a document.
    const MAX_BSON: usize = 16 * 1024 * 1024;

    fn long_keys(customers: i64, n: usize) -> Vec<(CustomerId, String)> {
        (0..n)
            .map(|i| {
                let c = CustomerId::Int(i as i64 % customers);
                (c, format!("t:{i:0>190}"))
            })
            .collect()
    }

    /// 110,000 held fills with 192-byte trade ids: about 22 MiB of keys,
    /// one `$in` past the limit before issue #46. Every filter now fits,
    /// and together they ask for every key once.
    #[test]
    fn a_lookup_of_many_long_keys_is_cut_into_filters_mongodb_takes() {
        for (sharded, customers) in [(false, 1_000), (true, 1_000), (true, 1)] {
            let wanted = long_keys(customers, 110_000);
            let filters = key_filters(&wanted, sharded);
            assert!(filters.len() > 1, "sharded {sharded}: one filter");
            let mut asked = 0;
            for f in &filters {
                let bytes = mongodb::bson::to_vec(f).unwrap().len();
                assert!(
                    bytes < MAX_BSON,
                    "sharded {sharded}: a filter of {bytes} bytes"
                );
                let branches = match f.get_array("$or") {
                    Ok(b) => b.iter().map(|b| b.as_document().unwrap().clone()).collect(),
                    Err(_) => vec![f.clone()],
                };
                for b in branches {
                    assert_eq!(b.contains_key(SHARD_KEY_FIELD), sharded);
                    let keys = b.get_document("history.key").unwrap();
                    asked += keys.get_array("$in").unwrap().len();
                }
            }
            assert_eq!(asked, wanted.len(), "sharded {sharded}");
        }
    }

    #[test]
    fn a_small_lookup_is_one_filter_and_a_key_asked_twice_is_asked_once() {
        let c = CustomerId::Int(7);
        let wanted = vec![(c.clone(), "t:a".into()), (c, "t:a".into())];
        let f = key_filters(&wanted, false);
        assert_eq!(f, vec![doc! {"history.key": {"$in": ["t:a"]}}]);
        let f = key_filters(&wanted, true);
        assert_eq!(
            f,
            vec![doc! {SHARD_KEY_FIELD: 7_i64, "history.key": {"$in": ["t:a"]}}]
        );
        assert!(key_filters(&[], false).is_empty());
    }
}
