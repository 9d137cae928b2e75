use std::collections::{BTreeMap, HashMap, HashSet};

use mongodb::bson::{self, doc, rawdoc, DateTime, Document};
use proptest::prelude::*;

use super::*;
use crate::bucket::store::bucket_document;

/// This version's limits at `cap`: trades of a few dozen bytes never close
/// a bucket by size.
fn cap(cap: u32) -> Limits {
    Limits::with_capacity(cap)
}

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
    sized_trade(customer, key, secs, ticker, 0)
}

/// A trade whose history entry carries `pad` more bytes.
fn sized_trade(customer: i64, key: &str, secs: i64, ticker: &str, pad: usize) -> Trade {
    let pad = "x".repeat(pad);
    Trade {
        key: key.into(),
        legacy_key: None,
        customer: CustomerId::Int(customer),
        ticker: ticker.into(),
        date_ms: secs * 1000,
        doc: rawdoc! {"key": key, "date": DateTime::from_millis(secs * 1000), "pad": pad},
    }
}

/// A bucket of this version with room by size.
fn head_of(id: &str, count: u32, cap: u32) -> BucketHead {
    BucketHead {
        id: id.into(),
        customer: Bson::Int64(5),
        count,
        cap: Some(cap),
        size: Some(Size {
            bytes: 1_000,
            cap_bytes: size::CAP_BYTES,
        }),
        keys: KeySet::default(),
        wm: BTreeMap::new(),
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
    let plan = plan_customer(
        &CustomerId::Int(123),
        None,
        &events,
        &Known::default(),
        cap(10),
    );
    assert!(plan.fill.is_none());
    assert_eq!(plan.new_buckets.len(), 1);
    let b = &plan.new_buckets[0];
    assert_eq!(b.id, "123_1698335223");
    assert_eq!(b.prev, "123_");
    assert_eq!(b.events, vec![0, 1, 2]);
    assert_eq!(b.wm.get("t~x:0"), Some(&2));
}

#[test]
fn fills_the_open_bucket_then_opens_successors_in_order() {
    let head = BucketHead {
        id: "5_0000000100".into(),
        customer: Bson::Int64(5),
        count: 8,
        cap: Some(10),
        size: None,
        keys: ["k0".into()].into_iter().collect(),
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
        cap(10),
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
        cap: Some(10),
        size: None,
        keys: ["dup-in-bucket".into()].into_iter().collect(),
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
    let plan = plan_customer(&CustomerId::Int(5), Some(&head), &events, &known, cap(10));
    assert_eq!(plan.already_applied, vec![0]);
    assert_eq!(plan.duplicates, vec![1, 2]);
    // A copy of an earlier event of the batch waits for its first.
    assert_eq!(plan.copies, vec![(4, 3)]);
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
        cap: Some(10),
        size: None,
        keys: KeySet::default(),
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
    let plan = plan_customer(&CustomerId::Int(5), Some(&head), &events, &known, cap(10));
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
        cap: None,
        size: None,
        keys: KeySet::default(),
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
        cap(10),
    );
    assert!(!plan.has_writes());
    assert_eq!(plan.unplaceable.len(), 1);
}

#[test]
fn each_bucket_is_full_at_its_own_cap_not_the_writers() {
    let trades = [trade(5, "a", 100, "A"), trade(5, "b", 100, "A")];
    let sources = [src(0, 1), src(0, 2)];
    let events = events_of(&trades, &sources);
    let customer = CustomerId::Int(5);
    // Opened at 10 and holding 10: a writer opening buckets of 20 gives it
    // a successor (of 20) rather than appending.
    let full = head_of("5_0000000100", 10, 10);
    let plan = plan_customer(&customer, Some(&full), &events, &Known::default(), cap(20));
    assert!(plan.fill.is_none());
    assert_eq!(plan.new_buckets.len(), 1);
    assert_eq!(plan.new_buckets[0].prev, "5_0000000100");
    assert_eq!(plan.new_buckets[0].limits.cap, 20);
    // Opened at 20 and holding 10: a writer opening buckets of 10 fills it.
    let open = head_of("5_0000000100", 10, 20);
    let plan = plan_customer(&customer, Some(&open), &events, &Known::default(), cap(10));
    assert_eq!(plan.fill.unwrap().events, vec![0, 1]);
    assert!(plan.new_buckets.is_empty());
    assert_eq!(plan.after.unwrap().count, 12);
}

#[test]
fn a_legacy_bucket_is_full_at_the_writers_capacity_and_never_by_size() {
    let mut legacy = head_of("5_0000000100", 8, 0);
    legacy.cap = None;
    legacy.size = None;
    let trades: Vec<Trade> = (0..3)
        .map(|i| sized_trade(5, &format!("k{i}"), 100, "A", 10_000))
        .collect();
    let sources: Vec<Source> = (0..3).map(|o| src(0, o)).collect();
    let events = events_of(&trades, &sources);
    let limits = Limits {
        cap: 10,
        cap_bytes: 1_000,
    };
    let plan = plan_customer(
        &CustomerId::Int(5),
        Some(&legacy),
        &events,
        &Known::default(),
        limits,
    );
    let fill = plan.fill.unwrap();
    assert_eq!(fill.events, vec![0, 1]);
    // No `$inc` of a `bytes` the bucket does not have.
    assert_eq!(fill.bytes, None);
    assert_eq!(plan.new_buckets.len(), 1);
    assert_eq!(plan.new_buckets[0].limits, limits);
}

#[test]
fn buckets_close_by_size_counting_what_is_planned_into_them() {
    let limits = Limits {
        cap: 10,
        cap_bytes: 2_500,
    };
    let mut head = head_of("5_0000000100", 1, 10);
    head.size = Some(Size {
        bytes: 1_000,
        cap_bytes: 2_500,
    });
    let trades: Vec<Trade> = (0..9)
        .map(|i| sized_trade(5, &format!("k{i}"), 100 + i, "A", 1_000))
        .collect();
    let sources: Vec<Source> = (0..9).map(|o| src(0, o)).collect();
    let events = events_of(&trades, &sources);
    let charge = size::charge(&trades[0], &sources[0]);
    assert!(charge > 1_000 && charge < 1_500, "{charge}");
    let plan = plan_customer(
        &CustomerId::Int(5),
        Some(&head),
        &events,
        &Known::default(),
        limits,
    );
    // 1,000 + one charge is below 2,500, + two is not: the fill takes two.
    let fill = plan.fill.unwrap();
    assert_eq!(fill.events, vec![0, 1]);
    assert_eq!(fill.bytes, Some(2 * charge));
    let mut taken = 2;
    for (i, b) in plan.new_buckets.iter().enumerate() {
        // Its `wm` starts with the one partition all events come from.
        let empty = size::empty_bucket(&b.id, &b.customer, &b.prev, &b.wm);
        assert_eq!(b.bytes, empty + charge * b.events.len() as u64);
        // Not full before its last event, and full after it unless newest.
        assert!(b.bytes - charge < limits.cap_bytes, "{b:?}");
        assert!(i + 1 == plan.new_buckets.len() || b.bytes >= limits.cap_bytes);
        taken += b.events.len();
    }
    assert_eq!(taken, 9);
    assert!(plan.new_buckets.len() >= 3, "{:?}", plan.new_buckets);
}

#[test]
fn a_new_bucket_takes_one_trade_however_small_its_limits() {
    let trades: Vec<Trade> = (0..3)
        .map(|i| trade(5, &format!("k{i}"), 100, "A"))
        .collect();
    let sources: Vec<Source> = (0..3).map(|o| src(0, o)).collect();
    let events = events_of(&trades, &sources);
    let limits = Limits {
        cap: 10,
        cap_bytes: 1,
    };
    let plan = plan_customer(
        &CustomerId::Int(5),
        None,
        &events,
        &Known::default(),
        limits,
    );
    let sizes: Vec<usize> = plan.new_buckets.iter().map(|b| b.events.len()).collect();
    assert_eq!(sizes, vec![1, 1, 1]);
}

// ---------------------------------------------------------------------------
// A model of the collection with MongoDB's guarantees (atomic guarded
// update, unique `_id`, `prev` and `history.key`), and a driver that runs
// plans against it the way the store does. It also keeps every bucket as
// MongoDB would hold it (the store's `bucket_document`, then each fill's
// `$push`, `$inc`, `$max` and `$addToSet`), to hold `bytes` to the true
// BSON size. Properties: any delivery history (batches of any size,
// crashes at any point, replays from any committed offset) ends in the
// state of one clean pass; writers with different limits sharing a
// customer keep every bucket but the newest full by its own limits and
// never append to a bucket that has a successor.

#[derive(Debug, Clone, PartialEq)]
struct ModelBucket {
    prev: String,
    history: Vec<String>,
    wm: BTreeMap<String, i64>,
    /// As stored; `None` for a legacy bucket.
    cap: Option<u32>,
    size: Option<Size>,
}

impl ModelBucket {
    /// The bucket's own rule; `legacy_cap` only without `cap`.
    fn is_full(&self, legacy_cap: u32) -> bool {
        self.history.len() as u32 >= self.cap.unwrap_or(legacy_cap)
            || self.size.is_some_and(|s| s.bytes >= s.cap_bytes)
    }
}

#[derive(Default, Clone)]
struct Model {
    docs: BTreeMap<String, ModelBucket>,
    /// Each bucket as MongoDB would hold it.
    encoded: BTreeMap<String, Document>,
    /// Operations so far, and per bucket the number of its last append
    /// and of its successor's insert.
    ops: u64,
    last_append: BTreeMap<String, u64>,
    successor_at: BTreeMap<String, u64>,
}

impl Model {
    /// A bucket written before buckets stored their limits, holding
    /// `count` trades no stream repeats.
    fn with_legacy(customer: i64, count: usize) -> Model {
        let prefix = Prefix::of(&CustomerId::Int(customer));
        let id = format!("{}0000000500", prefix.as_str());
        let history: Vec<String> = (0..count).map(|i| format!("legacy-{i}")).collect();
        let entries: Vec<Document> = history.iter().map(|k| doc! {"key": k}).collect();
        let mut model = Model::default();
        model.encoded.insert(
            id.clone(),
            doc! {"_id": id.clone(), "customerId": customer, "count": count as i64,
            "history": entries, "tickers": [], "prev": prefix.as_str(), "wm": {}},
        );
        let bucket = ModelBucket {
            prev: prefix.as_str().to_string(),
            history,
            wm: BTreeMap::new(),
            cap: None,
            size: None,
        };
        model.docs.insert(id, bucket);
        model
    }

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
            cap: b.cap,
            size: b.size,
            keys: b.history.iter().map(|k| k.as_str().into()).collect(),
            wm: b.wm.clone(),
        })
    }

    fn key_exists(&self, key: &str) -> bool {
        self.docs
            .values()
            .any(|b| b.history.iter().any(|k| k == key))
    }

    fn fill(&mut self, f: &Fill, trades: &[&Trade]) -> bool {
        if trades.iter().any(|t| {
            self.docs
                .iter()
                .any(|(id, b)| *id != f.bucket_id && b.history.iter().any(|k| *k == t.key))
        }) {
            return false;
        }
        match self.docs.get_mut(&f.bucket_id) {
            Some(b) if b.history.len() as u32 == f.expected_count => {
                b.history.extend(trades.iter().map(|t| t.key.to_string()));
                for (k, v) in &f.wm {
                    let e = b.wm.entry(k.clone()).or_insert(*v);
                    *e = (*e).max(*v);
                }
                if let (Some(s), Some(growth)) = (b.size.as_mut(), f.bytes) {
                    s.bytes += growth;
                }
                let encoded = self.encoded.get_mut(&f.bucket_id).expect("encoded");
                apply_fill(encoded, f, trades);
                self.ops += 1;
                self.last_append.insert(f.bucket_id.clone(), self.ops);
                true
            }
            _ => false,
        }
    }

    fn insert(&mut self, nb: &NewBucket, trades: &[&Trade]) -> bool {
        if self.docs.contains_key(&nb.id)
            || self.docs.values().any(|b| b.prev == nb.prev)
            || trades.iter().any(|t| self.key_exists(&t.key))
        {
            return false;
        }
        let encoded = bucket_document(nb, trades)
            .to_document()
            .expect("valid BSON");
        self.encoded.insert(nb.id.clone(), encoded);
        self.docs.insert(
            nb.id.clone(),
            ModelBucket {
                prev: nb.prev.clone(),
                history: trades.iter().map(|t| t.key.to_string()).collect(),
                wm: nb.wm.clone(),
                cap: Some(nb.limits.cap),
                size: Some(Size {
                    bytes: nb.bytes,
                    cap_bytes: nb.limits.cap_bytes,
                }),
            },
        );
        self.ops += 1;
        self.last_append.insert(nb.id.clone(), self.ops);
        self.successor_at.insert(nb.prev.clone(), self.ops);
        true
    }
}

/// `fill_statement`'s update, as MongoDB applies it to `d`.
fn apply_fill(d: &mut Document, f: &Fill, trades: &[&Trade]) {
    let history = d.get_array_mut("history").expect("history");
    history.extend(
        trades
            .iter()
            .map(|t| Bson::Document(t.entry().expect("entry"))),
    );
    let count = d.get_i64("count").expect("count");
    d.insert("count", count + trades.len() as i64);
    if let Some(growth) = f.bytes {
        let bytes = d.get_i64("bytes").expect("bytes");
        d.insert("bytes", bytes + growth as i64);
    }
    let wm = d.get_document_mut("wm").expect("wm");
    for (k, v) in &f.wm {
        if wm.get_i64(k).map_or(true, |old| old < *v) {
            wm.insert(k.clone(), *v);
        }
    }
    let tickers = d.get_array_mut("tickers").expect("tickers");
    for t in trades {
        let t = Bson::String(t.ticker.to_string());
        if !tickers.contains(&t) {
            tickers.push(t);
        }
    }
}

/// Writes one batch; `budget` counts operations left before a simulated
/// crash (None: no crash). Returns false if the crash happened.
fn write_batch(
    model: &mut Model,
    cache: &mut HashMap<CustomerId, Option<BucketHead>>,
    batch: &[(Trade, Source)],
    limits: Limits,
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
            let plan = plan_customer(&customer, head.as_ref(), &events, &known, limits);
            let trades_of = |idx: &[usize]| idx.iter().map(|&i| &batch[i].0).collect::<Vec<_>>();
            let ops = usize::from(plan.fill.is_some()) + plan.new_buckets.len();
            if let Some(b) = budget.as_mut() {
                if *b < ops {
                    // Crash part-way: the first `b` operations land.
                    apply_some(model, &plan, *b, &trades_of);
                    return false;
                }
                *b -= ops;
            }
            let ok = apply_some(model, &plan, ops, &trades_of);
            if ok {
                cache.insert(customer.clone(), plan.after.clone().map(|h| *h));
                break;
            }
            // Conflict: reload, and learn which keys are stored elsewhere.
            cache.remove(&customer);
            for ev in &events {
                if model.key_exists(&ev.trade.key) {
                    known.elsewhere.insert(ev.trade.key.to_string());
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
fn apply_some<'t>(
    model: &mut Model,
    plan: &CustomerPlan,
    n: usize,
    trades_of: &dyn Fn(&[usize]) -> Vec<&'t Trade>,
) -> bool {
    let mut left = n;
    if let Some(f) = &plan.fill {
        if left == 0 {
            return true;
        }
        if !model.fill(f, &trades_of(&f.events)) {
            return false;
        }
        left -= 1;
    }
    for nb in &plan.new_buckets {
        if left == 0 {
            return true;
        }
        if !model.insert(nb, &trades_of(&nb.events)) {
            return false;
        }
        left -= 1;
    }
    true
}

fn clean_pass(start: &Model, stream: &[(Trade, Source)], limits: Limits) -> Model {
    let mut model = start.clone();
    let mut cache = HashMap::new();
    write_batch(&mut model, &mut cache, stream, limits, &mut None);
    model
}

fn stream_strategy() -> impl Strategy<Value = Vec<(Trade, Source)>> {
    // (customer, key id, seconds delta, partition, entry padding)
    let event = (0i64..4, 0u32..60, -3i64..4, 0i32..2, 0usize..400);
    proptest::collection::vec(event, 1..80).prop_map(|raw| {
        let mut secs = 1_000i64;
        let mut next_offset = [0i64; 2];
        raw.into_iter()
            .map(|(c, k, delta, p, pad)| {
                secs = (secs + delta).max(0);
                let offset = next_offset[p as usize];
                next_offset[p as usize] += 1;
                // Key ids repeat: upstream duplicates of the same trade.
                let t = sized_trade(
                    c,
                    &format!("t:{c}-{k}"),
                    secs,
                    if k % 2 == 0 { "A" } else { "B" },
                    pad,
                );
                (t, src(p, offset))
            })
            .collect()
    })
}

/// Limits small enough that trades of a few hundred bytes close buckets
/// by size as often as by count.
fn limits_strategy() -> impl Strategy<Value = Limits> {
    // Above an empty bucket's ~250 bytes: a bucket full before its first
    // trade still takes one (unit-tested above), which the invariants'
    // bound on overfilling does not allow for.
    (1u32..6, 300u64..2_500).prop_map(|(cap, cap_bytes)| Limits { cap, cap_bytes })
}

/// The largest charge of any trade of `stream`.
fn max_charge(stream: &[(Trade, Source)]) -> u64 {
    stream
        .iter()
        .map(|(t, s)| size::charge(t, s))
        .max()
        .unwrap_or(0)
}

/// Every bucket invariant, each bucket by its own limits (`legacy_cap` for
/// a bucket stored without them).
fn check_invariants(model: &Model, legacy_cap: u32, max_charge: u64) {
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
            assert!(
                b.history.len() as u32 <= b.cap.unwrap_or(legacy_cap),
                "{id} over its cap"
            );
            if i + 1 < buckets.len() {
                assert!(b.is_full(legacy_cap), "{id} not full but not newest: {b:?}");
                let next = buckets[i + 1].0;
                assert!(
                    model.last_append.get(*id) < model.successor_at.get(*id),
                    "{id} got a trade after its successor {next} was inserted"
                );
            }
            if let Some(s) = b.size {
                let encoded = bson::to_vec(&model.encoded[*id]).unwrap().len() as u64;
                assert!(
                    encoded <= s.bytes,
                    "{id}: {encoded} bytes, bound {}",
                    s.bytes
                );
                // Only a bucket that was not full took its last trade.
                assert!(s.bytes < s.cap_bytes + max_charge, "{id} overfilled: {s:?}");
            }
            for k in &b.history {
                assert!(all_keys.insert(k.clone()), "duplicate {k}");
            }
            prev = (*id).clone();
        }
    }
}

/// Per customer and source partition, the stored trades in page order
/// must be in stream order: no trade landed in a bucket after a later one
/// of its partition had gone into a successor.
fn check_stream_order(model: &Model, stream: &[(Trade, Source)]) {
    let mut first: HashMap<&str, (i32, i64)> = HashMap::new();
    for (t, s) in stream {
        first
            .entry(t.key.as_str())
            .or_insert((s.partition, s.offset));
    }
    let mut last: HashMap<(String, i32), i64> = HashMap::new();
    for (id, b) in &model.docs {
        let prefix = Prefix::of_id(id).unwrap().as_str().to_string();
        for k in &b.history {
            // Legacy trades are not in the stream.
            let Some(&(p, o)) = first.get(k.as_str()) else {
                continue;
            };
            let seen = last.entry((prefix.clone(), p)).or_insert(-1);
            assert!(*seen < o, "{k} at {id} is out of stream order");
            *seen = o;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn replays_and_crashes_converge_to_the_clean_pass(
        stream in stream_strategy(),
        limits in limits_strategy(),
        legacy in proptest::option::of(1usize..7),
        cuts in proptest::collection::vec((1usize..20, proptest::option::of(0usize..6), 0usize..20), 1..12),
    ) {
        // A legacy bucket holds at most the capacity it was written with,
        // here the same.
        let start = legacy.map_or_else(Model::default, |n| {
            Model::with_legacy(0, n.min(limits.cap as usize))
        });
        let charge = max_charge(&stream);
        let expected = clean_pass(&start, &stream, limits);
        check_invariants(&expected, limits.cap, charge);

        let mut model = start.clone();
        let mut committed = 0usize; // stream index of the next uncommitted event
        for (batch_len, crash_after, rewind) in cuts {
            let mut cache = HashMap::new(); // a restart forgets everything
            let mut pos = committed;
            loop {
                if pos >= stream.len() { break; }
                let end = (pos + batch_len).min(stream.len());
                let mut budget = crash_after;
                if !write_batch(&mut model, &mut cache, &stream[pos..end], limits, &mut budget) {
                    break; // crashed mid-batch: nothing of it committed
                }
                pos = end;
                // Commits may lag: only some prefix of what was written.
                committed = committed.max(pos.saturating_sub(rewind));
                if crash_after.is_some() { break; }
            }
            check_invariants(&model, limits.cap, charge);
        }
        // Finally a clean run to the end from the last commit.
        let mut cache = HashMap::new();
        write_batch(&mut model, &mut cache, &stream[committed..], limits, &mut None);
        check_invariants(&model, limits.cap, charge);
        check_stream_order(&model, &stream);
        prop_assert_eq!(&model.docs, &expected.docs);
    }

    /// Two writers opening buckets with different limits (a rolling update
    /// that changes `buckets.capacity`), each with its own cache of what it
    /// last saw, take turns on the same customers' batches, with
    /// redeliveries. Each bucket is filled to its own limits, whichever
    /// writer fills it.
    #[test]
    fn writers_with_different_limits_keep_each_bucket_to_its_own(
        stream in stream_strategy(),
        limits in [limits_strategy(), limits_strategy()],
        turns in proptest::collection::vec((0usize..2, 1usize..20, 0usize..5), 1..16),
    ) {
        let mut model = Model::default();
        let mut caches = [HashMap::new(), HashMap::new()];
        let mut pos = 0usize;
        for (w, batch_len, rewind) in turns {
            let start = pos.saturating_sub(rewind);
            let end = (pos + batch_len).min(stream.len());
            write_batch(&mut model, &mut caches[w], &stream[start..end], limits[w], &mut None);
            pos = end;
        }
        write_batch(&mut model, &mut caches[0], &stream[pos..], limits[0], &mut None);
        // No legacy bucket here: both limits would claim it.
        check_invariants(&model, 0, max_charge(&stream));
        check_stream_order(&model, &stream);
        let stored: HashSet<&str> = model.docs.values().flat_map(|b| &b.history).map(String::as_str).collect();
        let sent: HashSet<&str> = stream.iter().map(|(t, _)| t.key.as_str()).collect();
        prop_assert_eq!(stored, sent);
    }
}

/// Trades `0..n` of customer 5, one second apart, all on partition 0.
fn run_of(n: usize, pad: usize) -> (Vec<Trade>, Vec<Source>) {
    let trades = (0..n)
        .map(|i| sized_trade(5, &format!("k{i}"), 1_000 + i as i64, "MDB", pad))
        .collect();
    let sources = (0..n).map(|i| src(0, i as i64)).collect();
    (trades, sources)
}

fn plan_holding(head: Option<&BucketHead>, events: &[Event<'_>], limits: Limits) -> CustomerPlan {
    let known = Known::default();
    plan_customer_owned(
        &CustomerId::Int(5),
        head.cloned().map(Box::new),
        events,
        &known,
        limits,
        true,
    )
}

#[test]
fn holding_leaves_out_a_last_bucket_that_would_not_be_full() {
    let (trades, sources) = run_of(23, 0);
    let events = events_of(&trades, &sources);
    let head = head_of("5_0000000900", 7, 10);
    let plan = plan_holding(Some(&head), &events, cap(10));
    // 3 fill the open bucket, 20 go into two full new ones; nothing held.
    assert_eq!(plan.fill.as_ref().map(|f| f.events.len()), Some(3));
    assert_eq!(plan.new_buckets.len(), 2);
    assert!(plan.held.is_empty());

    let plan = plan_holding(Some(&head), &events[..18], cap(10));
    assert_eq!(plan.fill.as_ref().map(|f| f.events.len()), Some(3));
    assert_eq!(plan.new_buckets.len(), 1, "the full one only");
    assert_eq!(plan.held, (13..18).collect::<Vec<_>>());
    let after = plan.after.expect("a newest bucket");
    assert_eq!(
        (after.id.as_str(), after.count),
        (plan.new_buckets[0].id.as_str(), 10)
    );
}

#[test]
fn holding_leaves_out_a_fill_that_would_not_fill_the_bucket() {
    let (trades, sources) = run_of(2, 0);
    let events = events_of(&trades, &sources);
    let head = head_of("5_0000000900", 7, 10);
    let plan = plan_holding(Some(&head), &events, cap(10));
    assert!(!plan.has_writes());
    assert_eq!(plan.held, vec![0, 1]);
    assert_eq!(
        plan.after,
        Some(Box::new(head.clone())),
        "the head as it was"
    );
    // Three fill it: written.
    let (trades, sources) = run_of(3, 0);
    let events = events_of(&trades, &sources);
    let plan = plan_holding(Some(&head), &events, cap(10));
    assert_eq!(plan.fill.map(|f| f.events), Some(vec![0, 1, 2]));
    assert!(plan.held.is_empty());
    // A customer's first trades: held until a bucket's worth.
    let plan = plan_holding(None, &events, cap(10));
    assert!(!plan.has_writes());
    assert_eq!((plan.held, plan.after), (vec![0, 1, 2], None));
}

#[test]
fn holding_counts_a_bucket_closed_by_size_as_full() {
    // Entries of about 3 MiB: the third closes a bucket by size, well
    // below its count.
    let (trades, sources) = run_of(3, 3 << 20);
    let events = events_of(&trades, &sources);
    let plan = plan_holding(None, &events, cap(10));
    assert_eq!(plan.new_buckets.len(), 1);
    assert_eq!(plan.new_buckets[0].events.len(), 3);
    assert!(plan.held.is_empty());
    let mut head = head_of("5_0000000900", 1, 10);
    head.size = Some(Size {
        bytes: size::CAP_BYTES - 100,
        cap_bytes: size::CAP_BYTES,
    });
    let plan = plan_holding(Some(&head), &events[..1], cap(10));
    assert_eq!(
        plan.fill.map(|f| f.events),
        Some(vec![0]),
        "it fills it up by size"
    );
}

proptest! {
    /// Holding writes exactly what the plan without it writes first, and
    /// only whole buckets; the held events are the rest, a tail of the
    /// accepted ones. So a later plan of the held events with the next
    /// ones continues as one plan of them all would.
    #[test]
    fn holding_writes_a_prefix_of_whole_buckets(
        count in 0u32..12,
        open in proptest::bool::ANY,
        n in 1usize..40,
        dup_every in 2usize..9,
        capacity in 1u32..12,
    ) {
        let (mut trades, sources) = run_of(n, 0);
        for (i, t) in trades.iter_mut().enumerate() {
            if i % dup_every == 0 && i > 0 {
                t.key = "k0".into(); // an in-batch duplicate
            }
        }
        let events = events_of(&trades, &sources);
        let head = open.then(|| head_of("5_0000000900", count.min(capacity), capacity));
        let known = Known::default();
        let c = CustomerId::Int(5);
        let all = plan_customer_owned(&c, head.clone().map(Box::new), &events, &known, cap(capacity), false);
        let held = plan_customer_owned(&c, head.clone().map(Box::new), &events, &known, cap(capacity), true);
        prop_assert_eq!(&held.duplicates, &all.duplicates);
        prop_assert_eq!(&held.copies, &all.copies);
        prop_assert_eq!(&held.already_applied, &all.already_applied);
        let written = held.new_buckets.len();
        prop_assert_eq!(&held.new_buckets[..], &all.new_buckets[..written]);
        for b in &held.new_buckets {
            prop_assert_eq!(b.events.len(), capacity as usize, "only full buckets");
        }
        match (&held.fill, &all.fill) {
            (Some(h), Some(a)) => {
                prop_assert_eq!(h, a);
                prop_assert_eq!(h.expected_count as usize + h.events.len(), capacity as usize);
            }
            (None, a) => prop_assert!(a.is_none() || written == 0),
            (Some(_), None) => prop_assert!(false, "a fill the plan without hold lacks"),
        }
        let mut placed: Vec<usize> = held.fill.iter().flat_map(|f| f.events.clone()).collect();
        placed.extend(held.new_buckets.iter().flat_map(|b| b.events.clone()));
        let mut accepted: Vec<usize> = all.fill.iter().flat_map(|f| f.events.clone()).collect();
        accepted.extend(all.new_buckets.iter().flat_map(|b| b.events.clone()));
        placed.extend(&held.held);
        prop_assert_eq!(placed, accepted, "held: the tail of the accepted events, in order");
    }
}

proptest! {
    /// A held plan's `room` is exact: the held events and the next ones
    /// that fit in it (each taken from it in turn) are all held again by
    /// a plan of them together, and one more that does not fit makes the
    /// plan write. So the stage, which holds trades that fit without
    /// planning them, holds exactly what the writer would, no longer.
    #[test]
    fn a_held_plan_holds_again_what_fits_its_room(
        count in 0u32..12,
        open in proptest::bool::ANY,
        pads in proptest::collection::vec(0usize..300, 1..30),
        capacity in 1u32..12,
        cap_bytes in 400u64..4_000,
        partitions in 1i32..3,
    ) {
        let trades: Vec<Trade> = pads
            .iter()
            .enumerate()
            .map(|(i, &pad)| sized_trade(5, &format!("k{i}"), 1_000 + i as i64, "MDB", pad))
            .collect();
        let sources: Vec<Source> = (0..trades.len())
            .map(|i| src(i as i32 % partitions, i as i64))
            .collect();
        let events = events_of(&trades, &sources);
        let limits = Limits { cap: capacity, cap_bytes };
        let mut head = open.then(|| head_of("5_0000000900", count.min(capacity), capacity));
        if let Some(h) = head.as_mut() {
            h.size = Some(Size { bytes: 300, cap_bytes });
        }
        let plan = |n: usize| plan_holding(head.as_ref(), &events[..n], limits);
        // The first plan that holds, as a batch ending there would.
        let Some(n) = (1..=events.len()).find(|&n| !plan(n).held.is_empty()) else {
            return Ok(());
        };
        let mut room = plan(n).room;
        let written = plan(n).has_writes();
        let fit = events[n..]
            .iter()
            .take_while(|ev| room.take(size::charge(ev.trade, ev.source)))
            .count();
        let again = plan(n + fit);
        prop_assert_eq!(again.has_writes(), written, "what fits is held, not written");
        prop_assert_eq!(again.held.len(), plan(n).held.len() + fit);
        if n + fit < events.len() {
            let over = plan(n + fit + 1);
            let placed = |p: &CustomerPlan| {
                p.fill.as_ref().map_or(0, |f| f.events.len())
                    + p.new_buckets.iter().map(|b| b.events.len()).sum::<usize>()
            };
            prop_assert!(placed(&over) > placed(&again), "one that does not fit is written");
        }
    }
}

/// A bucket is full at exactly `capBytes`: a trade that would take it
/// there does not fit in the room, and the plan writes it.
#[test]
fn a_trade_that_reaches_cap_bytes_exactly_does_not_fit() {
    let (trades, sources) = run_of(2, 40);
    let events = events_of(&trades, &sources);
    let second = size::charge(events[1].trade, events[1].source);
    let mut head = head_of("5_0000000900", 1, 10);
    let after_first = 1_000 + size::charge(events[0].trade, events[0].source);
    head.size = Some(Size {
        bytes: 1_000,
        cap_bytes: after_first + second,
    });
    let plan = plan_holding(Some(&head), &events[..1], cap(10));
    assert_eq!(plan.held, vec![0]);
    let mut room = plan.room;
    assert_eq!(room.bytes, second - 1);
    assert!(!room.take(second));
    let plan = plan_holding(Some(&head), &events, cap(10));
    assert_eq!(
        plan.fill.map(|f| f.events),
        Some(vec![0, 1]),
        "it fills it up"
    );
}
