use std::collections::{BTreeMap, HashMap, HashSet};

use mongodb::bson::{rawdoc, DateTime};
use proptest::prelude::*;

use super::*;

/// The planner's view of `trades` read from `sources`, in batch order.
fn events_of<'a>(trades: &'a [Trade], sources: &'a [Source]) -> Vec<Event<'a>> {
    trades
        .iter()
        .zip(sources)
        .enumerate()
        .map(|(index, (trade, source))| Event {
            index,
            trade,
            source,
        })
        .collect()
}
fn trade(customer: i64, key: &str, secs: i64, ticker: &str) -> Trade {
    Trade {
        key: key.to_string(),
        customer: CustomerId::Int(customer),
        ticker: ticker.to_string(),
        date_ms: secs * 1000,
        doc: rawdoc! {"key": key, "date": DateTime::from_millis(secs * 1000)},
    }
}

fn src(partition: i32, offset: i64) -> Source {
    Source {
        topic: "t.x".into(),
        partition,
        offset,
    }
}

#[test]
fn the_manual_example_fills_one_bucket_per_customer() {
    // The manual's flat trades, then its MSFT update.
    let trades = [
        trade(123, "a", 1_698_335_223, "MDB"),
        trade(123, "b", 1_698_658_377, "MDB"),
        trade(123, "d", 1_698_925_390, "MSFT"),
    ];
    let sources: Vec<Source> = (0..3).map(|o| src(0, o)).collect();
    let events = events_of(&trades, &sources);
    let plan = plan_customer(&CustomerId::Int(123), None, &events, &Known::default(), 10);
    assert!(plan.fill.is_none());
    assert_eq!(plan.new_buckets.len(), 1);
    let b = &plan.new_buckets[0];
    assert_eq!(b.id, "123_1698335223");
    assert_eq!(b.prev, "123_");
    assert_eq!(b.events, vec![0, 1, 2]);
    assert_eq!(b.tickers.iter().collect::<Vec<_>>(), ["MDB", "MSFT"]);
    assert_eq!(b.wm.get("t~x:0"), Some(&2));
}

#[test]
fn fills_the_open_bucket_then_opens_successors_in_order() {
    let head = BucketHead {
        id: "5_0000000100".into(),
        customer: Bson::Int64(5),
        count: 8,
        keys: ["k0".to_string()].into_iter().collect(),
        wm: [("t~x:0".to_string(), 9)].into_iter().collect(),
    };
    // 5 events, same second as the head: 2 fill it, 3 open a successor
    // that must sort after it despite the equal second.
    let trades: Vec<Trade> = (0..5)
        .map(|i| trade(5, &format!("k{}", i + 1), 100, "A"))
        .collect();
    let sources: Vec<Source> = (10..15).map(|o| src(0, o)).collect();
    let events = events_of(&trades, &sources);
    let plan = plan_customer(
        &CustomerId::Int(5),
        Some(&head),
        &events,
        &Known::default(),
        10,
    );
    let fill = plan.fill.as_ref().unwrap();
    assert_eq!(fill.expected_count, 8);
    assert_eq!(fill.events, vec![0, 1]);
    assert_eq!(fill.wm.get("t~x:0"), Some(&11));
    assert_eq!(plan.new_buckets.len(), 1);
    let b = &plan.new_buckets[0];
    assert_eq!(b.id, "5_0000000100_000001");
    assert_eq!(b.prev, "5_0000000100");
    assert_eq!(b.events, vec![2, 3, 4]);
    assert_eq!(b.wm.get("t~x:0"), Some(&14));
    let after = plan.after.unwrap();
    assert_eq!((after.id.as_str(), after.count), ("5_0000000100_000001", 3));
}

#[test]
fn skips_what_the_watermark_and_keys_say_is_stored() {
    let head = BucketHead {
        id: "5_0000000100".into(),
        customer: Bson::Int64(5),
        count: 3,
        keys: ["dup-in-bucket".to_string()].into_iter().collect(),
        wm: [("t~x:0".to_string(), 20)].into_iter().collect(),
    };
    let trades = [
        trade(5, "old", 100, "A"),           // offset 20 <= wm
        trade(5, "dup-in-bucket", 101, "A"), // key already in the open bucket
        trade(5, "dup-elsewhere", 101, "A"), // key found in an older bucket
        trade(5, "new", 102, "A"),
        trade(5, "new", 103, "A"), // upstream duplicate within the batch
        trade(5, "other-part", 104, "B"),
    ];
    let sources = [
        src(0, 20),
        src(0, 21),
        src(0, 22),
        src(0, 23),
        src(0, 24),
        src(1, 3),
    ];
    let events = events_of(&trades, &sources);
    let known = Known {
        elsewhere: ["dup-elsewhere".to_string()].into_iter().collect(),
        ..Known::default()
    };
    let plan = plan_customer(&CustomerId::Int(5), Some(&head), &events, &known, 10);
    assert_eq!(plan.already_applied, vec![0]);
    assert_eq!(plan.duplicates, vec![1, 2, 4]);
    let fill = plan.fill.unwrap();
    assert_eq!(fill.events, vec![3, 5]);
    assert_eq!(fill.wm.get("t~x:0"), Some(&23));
    assert_eq!(fill.wm.get("t~x:1"), Some(&3));
}

#[test]
fn a_key_known_not_stored_is_planned_even_below_the_watermark() {
    // The topic was recreated: offsets 0 and 1 are below the stored
    // watermark 20, but the writer found "reborn" in no bucket.
    let head = BucketHead {
        id: "5_0000000100".into(),
        customer: Bson::Int64(5),
        count: 3,
        keys: HashSet::new(),
        wm: [("t~x:0".to_string(), 20)].into_iter().collect(),
    };
    let trades = [
        trade(5, "stored-long-ago", 100, "A"),
        trade(5, "reborn", 101, "A"),
    ];
    let sources = [src(0, 0), src(0, 1)];
    let events = events_of(&trades, &sources);
    let known = Known {
        not_stored: ["reborn".to_string()].into_iter().collect(),
        ..Known::default()
    };
    let plan = plan_customer(&CustomerId::Int(5), Some(&head), &events, &known, 10);
    assert_eq!(plan.already_applied, vec![0]);
    let fill = plan.fill.unwrap();
    assert_eq!(fill.events, vec![1]);
    // `$max`: the watermark never moves back.
    assert_eq!(plan.after.unwrap().wm.get("t~x:0"), Some(&20));
}

#[test]
fn a_foreign_newest_bucket_makes_events_unplaceable_not_misplaced() {
    let head = BucketHead {
        id: "5_legacy".into(),
        customer: Bson::Int64(5),
        count: 10,
        keys: HashSet::new(),
        wm: BTreeMap::new(),
    };
    let t = trade(5, "k", 100, "A");
    let s = src(0, 1);
    let plan = plan_customer(
        &CustomerId::Int(5),
        Some(&head),
        &[Event {
            index: 0,
            trade: &t,
            source: &s,
        }],
        &Known::default(),
        10,
    );
    assert!(!plan.has_writes());
    assert_eq!(plan.unplaceable.len(), 1);
}

// ---------------------------------------------------------------------------
// A model of the collection with MongoDB's guarantees (atomic guarded
// update, unique `_id`, `prev` and `history.key`), and a driver that runs
// plans against it the way the store does. Property: any delivery history
// (batches of any size, crashes at any point, replays from any committed
// offset) ends in the state of one clean pass.

#[derive(Debug, Clone, PartialEq)]
struct ModelBucket {
    prev: String,
    history: Vec<String>,
    wm: BTreeMap<String, i64>,
}

#[derive(Default, Clone)]
struct Model {
    docs: BTreeMap<String, ModelBucket>,
}

impl Model {
    fn head(&self, customer: &CustomerId) -> Option<BucketHead> {
        let prefix = Prefix::of(customer);
        let (id, b) = self
            .docs
            .range(prefix.as_str().to_string()..)
            .take_while(|(k, _)| prefix.owns(k))
            .last()?;
        Some(BucketHead {
            id: id.clone(),
            customer: customer.to_bson(),
            count: b.history.len() as u32,
            keys: b.history.iter().cloned().collect(),
            wm: b.wm.clone(),
        })
    }

    fn key_exists(&self, key: &str) -> bool {
        self.docs
            .values()
            .any(|b| b.history.iter().any(|k| k == key))
    }

    fn fill(&mut self, f: &Fill, keys: &[String]) -> bool {
        if keys.iter().any(|k| {
            self.docs
                .iter()
                .any(|(id, b)| *id != f.bucket_id && b.history.contains(k))
        }) {
            return false;
        }
        match self.docs.get_mut(&f.bucket_id) {
            Some(b) if b.history.len() as u32 == f.expected_count => {
                b.history.extend(keys.iter().cloned());
                for (k, v) in &f.wm {
                    let e = b.wm.entry(k.clone()).or_insert(*v);
                    *e = (*e).max(*v);
                }
                true
            }
            _ => false,
        }
    }

    fn insert(&mut self, nb: &NewBucket, keys: &[String]) -> bool {
        if self.docs.contains_key(&nb.id)
            || self.docs.values().any(|b| b.prev == nb.prev)
            || keys.iter().any(|k| self.key_exists(k))
        {
            return false;
        }
        self.docs.insert(
            nb.id.clone(),
            ModelBucket {
                prev: nb.prev.clone(),
                history: keys.to_vec(),
                wm: nb.wm.clone(),
            },
        );
        true
    }
}

/// Writes one batch; `budget` counts operations left before a simulated
/// crash (None: no crash). Returns false if the crash happened.
fn write_batch(
    model: &mut Model,
    cache: &mut HashMap<CustomerId, Option<BucketHead>>,
    batch: &[(Trade, Source)],
    capacity: u32,
    budget: &mut Option<usize>,
) -> bool {
    let mut by_customer: BTreeMap<CustomerId, Vec<Event<'_>>> = BTreeMap::new();
    for (index, (trade, source)) in batch.iter().enumerate() {
        by_customer
            .entry(trade.customer.clone())
            .or_default()
            .push(Event {
                index,
                trade,
                source,
            });
    }
    for (customer, events) in by_customer {
        let mut known = Known::default();
        for _round in 0..100 {
            let head = cache
                .entry(customer.clone())
                .or_insert_with(|| model.head(&customer))
                .clone();
            let plan = plan_customer(&customer, head.as_ref(), &events, &known, capacity);
            let keys_of = |idx: &[usize]| {
                idx.iter()
                    .map(|&i| batch[i].0.key.clone())
                    .collect::<Vec<_>>()
            };
            let ops = usize::from(plan.fill.is_some()) + plan.new_buckets.len();
            if let Some(b) = budget.as_mut() {
                if *b < ops {
                    // Crash part-way: the first `b` operations land.
                    apply_some(model, &plan, *b, &keys_of);
                    return false;
                }
                *b -= ops;
            }
            let ok = apply_some(model, &plan, ops, &keys_of);
            if ok {
                cache.insert(customer.clone(), plan.after.clone());
                break;
            }
            // Conflict: reload, and learn which keys are stored elsewhere.
            cache.remove(&customer);
            for ev in &events {
                if model.key_exists(&ev.trade.key) {
                    known.elsewhere.insert(ev.trade.key.clone());
                }
            }
        }
    }
    true
}

/// Applies the first `n` operations of `plan` (fill first, then the new
/// buckets in order) as the writer would, stopping at the first refused
/// one; `true` if all `n` held. As in the writer, a customer whose fill was
/// refused gets no new bucket in that round (a successor of a bucket that
/// is not full would break the chain).
fn apply_some(
    model: &mut Model,
    plan: &CustomerPlan,
    n: usize,
    keys_of: &dyn Fn(&[usize]) -> Vec<String>,
) -> bool {
    let mut left = n;
    if let Some(f) = &plan.fill {
        if left == 0 {
            return true;
        }
        if !model.fill(f, &keys_of(&f.events)) {
            return false;
        }
        left -= 1;
    }
    for nb in &plan.new_buckets {
        if left == 0 {
            return true;
        }
        if !model.insert(nb, &keys_of(&nb.events)) {
            return false;
        }
        left -= 1;
    }
    true
}

fn clean_pass(stream: &[(Trade, Source)], capacity: u32) -> Model {
    let mut model = Model::default();
    let mut cache = HashMap::new();
    write_batch(&mut model, &mut cache, stream, capacity, &mut None);
    model
}

fn stream_strategy() -> impl Strategy<Value = Vec<(Trade, Source)>> {
    // (customer, key id, seconds delta, partition)
    proptest::collection::vec((0i64..4, 0u32..60, -3i64..4, 0i32..2), 1..80).prop_map(|raw| {
        let mut secs = 1_000i64;
        let mut next_offset = [0i64; 2];
        raw.into_iter()
            .map(|(c, k, delta, p)| {
                secs = (secs + delta).max(0);
                let offset = next_offset[p as usize];
                next_offset[p as usize] += 1;
                // Key ids repeat: upstream duplicates of the same trade.
                let t = trade(
                    c,
                    &format!("t:{c}-{k}"),
                    secs,
                    if k % 2 == 0 { "A" } else { "B" },
                );
                (t, src(p, offset))
            })
            .collect()
    })
}

fn check_invariants(model: &Model, capacity: u32) {
    let mut by_prefix: BTreeMap<String, Vec<(&String, &ModelBucket)>> = BTreeMap::new();
    for (id, b) in &model.docs {
        let prefix = Prefix::of_id(id).unwrap().as_str().to_string();
        by_prefix.entry(prefix).or_default().push((id, b));
    }
    let mut all_keys = HashSet::new();
    for (prefix, buckets) in by_prefix {
        let mut prev = prefix;
        for (i, (id, b)) in buckets.iter().enumerate() {
            assert_eq!(b.prev, prev, "chain broken at {id}");
            assert!(b.history.len() as u32 <= capacity);
            if i + 1 < buckets.len() {
                assert_eq!(
                    b.history.len() as u32,
                    capacity,
                    "{id} not full but not newest"
                );
            }
            for k in &b.history {
                assert!(all_keys.insert(k.clone()), "duplicate {k}");
            }
            prev = (*id).clone();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn replays_and_crashes_converge_to_the_clean_pass(
        stream in stream_strategy(),
        capacity in 1u32..5,
        cuts in proptest::collection::vec((1usize..20, proptest::option::of(0usize..6), 0usize..20), 1..12),
    ) {
        let expected = clean_pass(&stream, capacity);
        check_invariants(&expected, capacity);

        let mut model = Model::default();
        let mut committed = 0usize; // stream index of the next uncommitted event
        for (batch_len, crash_after, rewind) in cuts {
            let mut cache = HashMap::new(); // a restart forgets everything
            let mut pos = committed;
            loop {
                if pos >= stream.len() { break; }
                let end = (pos + batch_len).min(stream.len());
                let mut budget = crash_after;
                if !write_batch(&mut model, &mut cache, &stream[pos..end], capacity, &mut budget) {
                    break; // crashed mid-batch: nothing of it committed
                }
                pos = end;
                // Commits may lag: only some prefix of what was written.
                committed = committed.max(pos.saturating_sub(rewind));
                if crash_after.is_some() { break; }
            }
            check_invariants(&model, capacity);
        }
        // Finally a clean run to the end from the last commit.
        let mut cache = HashMap::new();
        write_batch(&mut model, &mut cache, &stream[committed..], capacity, &mut None);
        check_invariants(&model, capacity);
        prop_assert_eq!(&model.docs, &expected.docs);
    }
}
