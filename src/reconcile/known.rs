//! Where the keys of buckets already read are stored, so that reconcile
//! reads a bucket once for all its keys instead of once per key (a bucket
//! of ten trades is otherwise fetched ten times, one lookup batch after
//! another: the lookups were most of the database server's work).
//!
//! Sound only while MongoDB keeps trade keys unique (one bucket per key,
//! per customer when sharded: the index `init` creates): then a bucket read
//! once says where each of its keys is, and that nowhere else holds them.
//! Reconcile checks the index before it trusts this
//! (`BucketStore::trade_keys_are_unique`) and looks every key up otherwise.
//! A key added after its bucket was read is not here, and is looked up.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::Arc;

use lru::LruCache;

use crate::bucket::id::Prefix;
use crate::event::CustomerId;

/// Keys remembered at most, each with its bucket `_id` (shared by the
/// bucket's keys): about 19 MiB of peak RSS in the benchmark (127 MiB in
/// all against 108 MiB without), where it spared the database server 87 %
/// of its lookups. A keyed topic's buckets hold keys a few thousand
/// records apart in one partition, well within it.
pub const KNOWN_KEYS: usize = 100_000;

/// Names where a customer's key is stored: its slot. Sharded, a key is
/// unique per customer, so its slot names the customer; unsharded it is
/// unique in the collection.
#[derive(Debug, Clone, Copy)]
pub struct Slots {
    pub sharded: bool,
}

impl Slots {
    /// The slot of a customer's key: the key, after the customer's `_id`
    /// prefix when sharded (a prefix ends at its only `_`, so the two never
    /// run together ambiguously).
    pub fn slot(self, customer: &CustomerId, key: &str) -> String {
        if self.sharded {
            format!("{}{key}", Prefix::of(customer).as_str())
        } else {
            key.to_string()
        }
    }

    /// The slot a bucket's key fills; none for a bucket `_id` that is not
    /// ours (sharded: its customer is unknown).
    fn of_bucket(self, bucket: &str, key: &str) -> Option<String> {
        if self.sharded {
            Some(format!("{}{key}", Prefix::of_id(bucket)?.as_str()))
        } else {
            Some(key.to_string())
        }
    }

    /// One query's `(key, bucket _id)` pairs by slot (a key twice in one
    /// bucket is there twice).
    pub fn group(self, entries: Vec<(String, String)>) -> HashMap<String, Vec<Arc<str>>> {
        let mut ids: HashMap<String, Arc<str>> = HashMap::new();
        let mut read: HashMap<String, Vec<Arc<str>>> = HashMap::new();
        for (key, bucket) in entries {
            let Some(slot) = self.of_bucket(&bucket, &key) else {
                continue;
            };
            let id = ids
                .entry(bucket)
                .or_insert_with_key(|b| Arc::from(b.as_str()))
                .clone();
            read.entry(slot).or_default().push(id);
        }
        read
    }
}

/// The buckets of every key of the buckets read lately, by slot.
pub struct KnownKeys {
    slots: LruCache<String, Vec<Arc<str>>>,
}

impl KnownKeys {
    pub fn new(capacity: usize) -> KnownKeys {
        let capacity = NonZeroUsize::new(capacity.max(1)).expect("max(1)");
        KnownKeys {
            slots: LruCache::new(capacity),
        }
    }

    /// Every bucket holding the slot's key, if a bucket read before holds
    /// it.
    pub fn get(&mut self, slot: &str) -> Option<&[Arc<str>]> {
        self.slots.get(slot).map(Vec::as_slice)
    }

    /// Remembers what one query read ([`Slots::group`]).
    pub fn remember(&mut self, read: &HashMap<String, Vec<Arc<str>>>) {
        for (slot, buckets) in read {
            self.slots.put(slot.clone(), buckets.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(k, b)| (k.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn a_bucket_read_once_answers_for_each_of_its_keys() {
        let slots = Slots { sharded: false };
        let mut known = KnownKeys::new(10);
        let read = slots.group(entries(&[("a", "7_01"), ("b", "7_01"), ("c", "8_01")]));
        assert_eq!(read["a"].len(), 1);
        known.remember(&read);
        let slot = slots.slot(&CustomerId::Int(7), "b");
        assert_eq!(
            known.get(&slot).map(|b| b[0].to_string()),
            Some("7_01".into())
        );
        // Unsharded, a key is the collection's: another customer's record
        // of it finds the bucket (and reconcile calls it misfiled).
        let slot = slots.slot(&CustomerId::Int(9), "c");
        assert_eq!(known.get(&slot).map(<[_]>::len), Some(1));
        assert!(known.get("d").is_none());
    }

    #[test]
    fn sharded_a_key_belongs_to_its_bucket_s_customer() {
        let slots = Slots { sharded: true };
        let mut known = KnownKeys::new(10);
        known.remember(&slots.group(entries(&[("t:1", "7_01"), ("t:1", "8_01")])));
        let of = |known: &mut KnownKeys, c: i64| {
            let slot = slots.slot(&CustomerId::Int(c), "t:1");
            known
                .get(&slot)
                .map(|b| b.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        };
        assert_eq!(of(&mut known, 7), Some(vec!["7_01".to_string()]));
        assert_eq!(of(&mut known, 8), Some(vec!["8_01".to_string()]));
        assert_eq!(of(&mut known, 9), None);
        // A bucket that is not ours names no customer: not remembered.
        assert!(slots.group(entries(&[("t:2", "foreign")])).is_empty());
    }

    #[test]
    fn a_key_twice_in_one_bucket_is_there_twice_and_the_oldest_slots_go_first() {
        let slots = Slots { sharded: false };
        let mut known = KnownKeys::new(2);
        let read = slots.group(entries(&[("a", "7_01"), ("a", "7_01")]));
        assert_eq!(read["a"].len(), 2);
        known.remember(&read);
        known.remember(&slots.group(entries(&[("b", "7_02")])));
        known.remember(&slots.group(entries(&[("c", "7_03")])));
        assert!(known.get("a").is_none());
        assert!(known.get("c").is_some());
    }
}
