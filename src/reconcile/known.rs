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
//!
//! What it must hold is set by the topic, not by the collection. Reconcile
//! reads one partition after the other. On a keyed topic a bucket's
//! records are all in one partition, a few thousand records apart, so a
//! remembered key is used soon. On an unkeyed topic a bucket holds trades
//! of every partition: a bucket read for partition 0 answers for records
//! of partitions 1 to 7, read much later, and the keys waiting for them
//! are most of the topic's (about 76 % of 250,000 at 8 partitions, as
//! measured on the benchmark's unkeyed set). Reading the partitions
//! together hardly shortens the wait, since a backlog's buckets are filled
//! in the order the worker read, not by record time (replayed over the same
//! set as stored: 63 % of the keys at once merged by record time, 60 % in
//! turns of 5,000 records). So memory per key is what counts:
//!
//! - a key is kept as a 128-bit fingerprint of its slot (two SipHash-1-3
//!   hashes under one random key per run) with its bucket's `_id`, about
//!   37 bytes, where the key itself with its list of buckets in an LRU
//!   took about 190;
//! - a key is forgotten once its record used it: the memory holds only
//!   keys whose records may still come (a later record of the same key, an
//!   upstream duplicate or a replay, is looked up again);
//! - keys that never come (trades outside the checked spans) age out in
//!   two generations of [`GENERATION`] remembered keys each: a key lives
//!   until two generations later were filled, so memory is bounded whatever
//!   is read.
//!
//! A fingerprint shared by two slots would answer for a key that is not
//! stored: with `n` keys remembered and `m` looked for, the chance is about
//! `n·m/2¹²⁸` (2·10⁻²⁶ for two million of each), and the random key keeps
//! anyone from choosing trade ids that collide.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use crate::bucket::id::Prefix;
use crate::event::CustomerId;

/// Keys remembered per generation; two generations are held, so at most
/// twice this many keys (about 37 MiB). The benchmark's unkeyed set of
/// 250,000 records fits in one, so each of its buckets is read once.
pub const GENERATION: usize = 500_000;

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

/// A slot's fingerprint: two hashes of it under the run's random key.
type Fingerprint = (u64, u64);

/// The bucket of every key of the buckets read lately, by slot's
/// fingerprint, until its record comes.
pub struct KnownKeys {
    hasher: RandomState,
    /// Remembered since the last turn of generations.
    young: Generation,
    /// Remembered in the generation before.
    old: Generation,
    generation: usize,
}

#[derive(Default)]
struct Generation {
    keys: HashMap<Fingerprint, Arc<str>>,
    /// Keys put in, used or not: when the young generation is full.
    remembered: usize,
}

impl KnownKeys {
    /// Memory for two generations of `generation` keys each.
    pub fn new(generation: usize) -> KnownKeys {
        KnownKeys {
            hasher: RandomState::new(),
            young: Generation::default(),
            old: Generation::default(),
            generation: generation.max(1),
        }
    }

    /// The bucket holding the slot's key, if a bucket read before holds
    /// it; the key is forgotten, as its record is judged now.
    pub fn take(&mut self, slot: &str) -> Option<Arc<str>> {
        let f = self.fingerprint(slot);
        self.young
            .keys
            .remove(&f)
            .or_else(|| self.old.keys.remove(&f))
    }

    /// Remembers what one query read ([`Slots::group`]). A key twice in
    /// one bucket is not remembered: its next record is looked up and
    /// sees both.
    pub fn remember(&mut self, read: &HashMap<String, Vec<Arc<str>>>) {
        for (slot, buckets) in read {
            if let [bucket] = buckets.as_slice() {
                if self.young.remembered >= self.generation {
                    self.old = std::mem::take(&mut self.young);
                }
                let f = self.fingerprint(slot);
                self.young.keys.insert(f, bucket.clone());
                self.young.remembered += 1;
            }
        }
    }

    /// Keys remembered now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.young.keys.len() + self.old.keys.len()
    }

    fn fingerprint(&self, slot: &str) -> Fingerprint {
        // One key, two inputs: the two halves are independent hashes.
        (
            self.hasher.hash_one(slot),
            self.hasher.hash_one((slot, 1u8)),
        )
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

    fn bucket(known: &mut KnownKeys, slot: &str) -> Option<String> {
        known.take(slot).map(|b| b.to_string())
    }

    #[test]
    fn a_bucket_read_once_answers_for_each_of_its_keys_once() {
        let slots = Slots { sharded: false };
        let mut known = KnownKeys::new(10);
        let read = slots.group(entries(&[("a", "7_01"), ("b", "7_01"), ("c", "8_01")]));
        assert_eq!(read["a"].len(), 1);
        known.remember(&read);
        let slot = slots.slot(&CustomerId::Int(7), "b");
        assert_eq!(bucket(&mut known, &slot), Some("7_01".into()));
        // Used: the next record of the key (a duplicate, a replay) is
        // looked up.
        assert_eq!(bucket(&mut known, &slot), None);
        // Unsharded, a key is the collection's: another customer's record
        // of it finds the bucket (and reconcile calls it misfiled).
        let slot = slots.slot(&CustomerId::Int(9), "c");
        assert_eq!(bucket(&mut known, &slot), Some("8_01".into()));
        assert_eq!(bucket(&mut known, "d"), None);
        assert_eq!(known.len(), 1);
    }

    #[test]
    fn sharded_a_key_belongs_to_its_bucket_s_customer() {
        let slots = Slots { sharded: true };
        let mut known = KnownKeys::new(10);
        known.remember(&slots.group(entries(&[("t:1", "7_01"), ("t:1", "8_01")])));
        let of =
            |known: &mut KnownKeys, c: i64| bucket(known, &slots.slot(&CustomerId::Int(c), "t:1"));
        assert_eq!(of(&mut known, 7), Some("7_01".to_string()));
        assert_eq!(of(&mut known, 8), Some("8_01".to_string()));
        assert_eq!(of(&mut known, 9), None);
        // A bucket that is not ours names no customer: not remembered.
        assert!(slots.group(entries(&[("t:2", "foreign")])).is_empty());
    }

    #[test]
    fn a_key_twice_in_one_bucket_is_left_to_a_lookup() {
        let slots = Slots { sharded: false };
        let mut known = KnownKeys::new(10);
        let read = slots.group(entries(&[("a", "7_01"), ("a", "7_01"), ("b", "7_01")]));
        assert_eq!(read["a"].len(), 2);
        known.remember(&read);
        assert_eq!(bucket(&mut known, "a"), None);
        assert_eq!(bucket(&mut known, "b"), Some("7_01".into()));
    }

    #[test]
    fn a_key_lives_until_two_later_generations_were_filled() {
        let slots = Slots { sharded: false };
        let mut known = KnownKeys::new(2);
        let put =
            |known: &mut KnownKeys, k: &str| known.remember(&slots.group(entries(&[(k, "7_01")])));
        for k in ["a", "b", "c", "d"] {
            put(&mut known, k);
        }
        // a and b were the generation before c and d: still there.
        assert_eq!(known.len(), 4);
        assert!(known.take("a").is_some());
        put(&mut known, "e");
        // e opened a third generation: a and b's went, used or not.
        assert_eq!(bucket(&mut known, "b"), None);
        for k in ["c", "d", "e"] {
            assert_eq!(bucket(&mut known, k), Some("7_01".into()), "{k}");
        }
    }

    #[test]
    fn memory_never_holds_more_than_two_generations() {
        let slots = Slots { sharded: false };
        let mut known = KnownKeys::new(100);
        for i in 0..10_000 {
            known.remember(&slots.group(entries(&[(&format!("t:{i}"), "7_01")])));
            assert!(known.len() <= 200);
        }
        // The newest generation whole, the one before it whole.
        assert!((9_800..10_000).all(|i| known.take(&format!("t:{i}")).is_some()));
        assert_eq!(known.len(), 0);
    }
}
