//! The bucket writer against the real MongoDB-protocol server: what one
//! batch costs when some of its new buckets are refused. Each test runs in
//! both modes (`mongodb.sharded` false and true).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use mongodb::bson::doc;
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use testkit::*;
use tradebucket::bucket::plan::LoadedHead;
use tradebucket::bucket::store::{BucketStore, PROBE_CUSTOMERS};
use tradebucket::bucket::writer::{BucketWriter, InsertSplit, Outcome, WriteStats};
use tradebucket::cli::AuditReport;
use tradebucket::event::{CustomerId, Source, Trade};
use tradebucket::metrics::Metrics;

const CAPACITY: u32 = 4;

/// The mode's settings: capacity, and sharded or not.
fn mode(sharded: bool) -> [(&'static str, &'static str); 2] {
    [
        ("TRADEBUCKET__BUCKETS__CAPACITY", "4"), // CAPACITY
        (
            "TRADEBUCKET__MONGODB__SHARDED",
            if sharded { "true" } else { "false" },
        ),
    ]
}

async fn store(env: &TestEnv, sharded: bool) -> BucketStore {
    let store = BucketStore::connect(&env.settings(&mode(sharded)))
        .await
        .expect("MongoDB client");
    store.init().await.expect("indexes");
    store
}

/// A counter of the `command` commands a client with the returned handler
/// sends to the test's database.
fn counting(
    env: &TestEnv,
    command: &'static str,
) -> (Arc<AtomicUsize>, EventHandler<CommandEvent>) {
    let count = Arc::new(AtomicUsize::new(0));
    let counter = count.clone();
    let db = env.db.clone();
    let handler = EventHandler::callback(move |e| {
        if matches!(e, CommandEvent::Started(s) if s.command_name == command && s.db == db) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    });
    (count, handler)
}

/// The audit of the mode, which must find nothing wrong.
async fn audit_mode_clean(env: &TestEnv, sharded: bool) -> AuditReport {
    let report = tradebucket::cli::audit(&env.settings(&mode(sharded)), None)
        .await
        .expect("audit");
    assert!(report.violations.is_empty(), "{:#?}", report.violations);
    report
}

fn event(id: &str, customer: i64, offset: i64, topic: &str) -> (Trade, Source) {
    let payload = trade(id)
        .customer(customer)
        .qty(1)
        .price("10.50")
        .no_currency()
        .date(1_700_000_000_000i64 + offset * 1000)
        .payload();
    decoded(&payload, topic, offset, 1 << 20)
}

/// Upstream duplicates of trades in a customer's *older* bucket are only
/// found by the unique key index, when the new bucket holding them is
/// refused. Forty customers with such a duplicate, plus one whose second
/// new bucket of the batch holds one: every refusal is learnt in the first
/// round and settled in the second, and only the refused customers are
/// reloaded. (An ordered insert of all new buckets stopped at the first
/// refusal and re-planned everyone after it: 41 rounds here, and 154 for a
/// batch of the chaos suite's scenario 6.) The same with each insert split
/// into three commands sent at once (`mongodb.insert_concurrency`, here
/// with no minimum size): the chained customer's refusal then stops only
/// its own command's later chains, and nothing else changes.
#[tokio::test]
async fn refused_new_buckets_cost_one_more_round_not_one_each() {
    for sharded in [false, true] {
        for commands in [1, 3] {
            refused_new_buckets(sharded, commands).await;
        }
    }
}

async fn refused_new_buckets(sharded: bool, commands: usize) {
    let env = TestEnv::new("writer-refusals", 1).await;
    let (inserts, handler) = counting(&env, "insert");
    let store = BucketStore::connect_with(&env.settings(&mode(sharded)), Some(handler))
        .await
        .expect("MongoDB client");
    store.init().await.expect("indexes");
    let split = InsertSplit {
        commands,
        min_buckets: 1,
    };
    let mut writer =
        BucketWriter::new(store, CAPACITY, 10_000, Metrics::new()).with_insert_split(split);
    let topic = env.topic.clone();
    let chained: i64 = 100;
    let customers: Vec<i64> = (0..40).chain([chained]).collect();

    // Batch A: eight trades each, so two full buckets per customer.
    let mut offset = 0;
    let mut first = Vec::new();
    for &c in &customers {
        for j in 0..8 {
            first.push(event(&format!("a{c}-{j}"), c, offset, &topic));
            offset += 1;
        }
    }
    let mut outcomes = vec![Outcome::Pending; first.len()];
    writer
        .write(&first, &mut outcomes, None)
        .await
        .expect("batch A");
    assert!(outcomes.iter().all(|o| *o == Outcome::Written));
    // 41 first new buckets, then 41 second ones, each insert in `commands`.
    assert_eq!(inserts.load(Ordering::Relaxed), 2 * commands);

    // Batch B: a duplicate of each customer's first trade (in its older
    // bucket) and a new trade; the chained customer gets four new trades,
    // then the duplicate, then one more, so the duplicate lands in its
    // second new bucket of the batch.
    let mut second = Vec::new();
    let mut expected = Vec::new();
    for &c in &customers {
        let ids: Vec<String> = if c == chained {
            let mut v: Vec<String> = (0..4).map(|j| format!("b{c}-{j}")).collect();
            v.push(format!("a{c}-0"));
            v.push(format!("b{c}-4"));
            v
        } else {
            vec![format!("a{c}-0"), format!("b{c}-0")]
        };
        for id in ids {
            expected.push(if id.starts_with('a') {
                Outcome::Duplicate
            } else {
                Outcome::Written
            });
            second.push(event(&id, c, offset, &topic));
            offset += 1;
        }
    }
    let mut outcomes = vec![Outcome::Pending; second.len()];
    let stats = writer
        .write(&second, &mut outcomes, None)
        .await
        .expect("batch B");
    assert_eq!(outcomes, expected);
    assert_eq!(stats.rounds, 2, "{stats:?}");
    assert_eq!(stats.conflicts, customers.len(), "{stats:?}");
    assert_eq!(stats.heads_loaded, customers.len(), "{stats:?}");

    // Every chain is dense, ordered and capped; nothing stored twice.
    let report = audit_mode_clean(&env, sharded).await;
    assert_eq!(report.trades, 40 * 9 + 13);
    // Trade keys are `t:` and the trade id (src/event.rs).
    let chain: Vec<String> = (0..8)
        .map(|j| format!("t:a{chained}-{j}"))
        .chain((0..5).map(|j| format!("t:b{chained}-{j}")))
        .collect();
    assert_eq!(
        env.histories().await.get(&chained.to_string()),
        Some(&chain)
    );
    env.cleanup().await;
}

/// A topic deleted and recreated under the same name starts its offsets
/// at 0 again, below the watermarks stored for it. The new topic's trades
/// must be stored, not skipped as already applied, while a redelivery of
/// the old topic's events (to a writer with a cold cache, as after a
/// restart) is still recognised and skipped.
#[tokio::test]
async fn offsets_going_backwards_never_skip_an_unstored_trade() {
    for sharded in [false, true] {
        offsets_going_backwards(sharded).await;
    }
}

async fn offsets_going_backwards(sharded: bool) {
    let env = TestEnv::new("writer-backwards", 1).await;
    let store = store(&env, sharded).await;
    let topic = env.topic.clone();
    let batch = |prefix: &str, n: i64| -> Vec<(Trade, Source)> {
        (0..n)
            .map(|o| event(&format!("{prefix}{o}"), o % 5, o, &topic))
            .collect()
    };
    let old = batch("old-", 50);
    let reborn = batch("new-", 20);

    let mut writer = BucketWriter::new(store.clone(), CAPACITY, 10_000, Metrics::new());
    let mut outcomes = vec![Outcome::Pending; old.len()];
    writer
        .write(&old, &mut outcomes, None)
        .await
        .expect("old topic");
    assert!(outcomes.iter().all(|o| *o == Outcome::Written));

    let mut outcomes = vec![Outcome::Pending; reborn.len()];
    let stats = writer
        .write(&reborn, &mut outcomes, None)
        .await
        .expect("new topic");
    assert_eq!(outcomes, vec![Outcome::Written; reborn.len()]);
    assert_eq!(stats.below_watermark_unstored, reborn.len(), "{stats:?}");

    let mut cold = BucketWriter::new(store, CAPACITY, 10_000, Metrics::new());
    let mut outcomes = vec![Outcome::Pending; old.len()];
    let stats = cold
        .write(&old, &mut outcomes, None)
        .await
        .expect("redelivery");
    assert_eq!(outcomes, vec![Outcome::AlreadyApplied; old.len()]);
    assert_eq!(stats.below_watermark_unstored, 0, "{stats:?}");

    let report = audit_mode_clean(&env, sharded).await;
    assert_eq!(report.trades, 70);
    env.cleanup().await;
}

/// One event MongoDB refuses among 20,000 of one customer: the refused
/// write is halved until the offender is alone, then the customer's writes
/// go back to full size. Going one event per write after the refusal cost
/// a write per remaining event (thousands here).
#[tokio::test]
async fn a_refused_event_among_twenty_thousand_costs_a_logarithmic_number_of_writes() {
    let env = TestEnv::new("writer-halving", 1).await;
    env.refuse_ticker("BAD").await;
    let store = env.store().await;
    store.init().await.expect("indexes");
    let metrics = Metrics::new();
    let mut writer = BucketWriter::new(store, 1000, 10_000, metrics.clone());
    let (n, bad) = (20_000, 12_345);
    let events: Vec<(Trade, Source)> = (0..n)
        .map(|o| {
            let mut e = event(&format!("h{o}"), 1, o, &env.topic);
            if o == bad {
                e = bad_event(&format!("h{o}"), o, &env.topic);
            }
            e
        })
        .collect();
    let mut outcomes = vec![Outcome::Pending; events.len()];
    writer
        .write(&events, &mut outcomes, None)
        .await
        .expect("batch");
    let refused: Vec<usize> = outcomes
        .iter()
        .enumerate()
        .filter(|(_, o)| matches!(o, Outcome::DeadLetter(_)))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(refused, vec![bad as usize]);
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Written).count(),
        n as usize - 1
    );
    let writes: u64 = ["fill", "insert"]
        .iter()
        .map(|op| {
            metrics
                .mongodb_write_duration
                .with_label_values(&[op])
                .get_sample_count()
        })
        .sum();
    // Without the refusal: one insert of the first bucket, one of the
    // chain. Each halving step costs a write, and each held half one more.
    let bound = 2 + 2 * (n as f64).log2().ceil() as u64 + 2;
    eprintln!("{writes} MongoDB writes for {n} events with one refused (bound {bound})");
    assert!(writes <= bound, "{writes} writes");
    let report = audit_clean(&env, 1000).await;
    assert_eq!(report.trades, n as u64 - 1);
    env.cleanup().await;
}

fn bad_event(id: &str, offset: i64, topic: &str) -> (Trade, Source) {
    let payload = trade(id)
        .customer(1)
        .ticker("BAD")
        .date(1_700_000_000_000i64 + offset * 1000)
        .payload();
    decoded(&payload, topic, offset, 1 << 20)
}

/// A fill command's reply gives only the number of guards that matched.
/// When one customer's guard misses (another writer appended), only that
/// customer is reloaded, not every customer of the command. The round's
/// fills go in one command, or split over three sent at once
/// (`mongodb.fill_concurrency`), whose matched counts add up.
#[tokio::test]
async fn a_missed_guard_reloads_only_its_customer() {
    for fill_concurrency in ["1", "3"] {
        missed_guard(fill_concurrency).await;
    }
}

async fn missed_guard(fill_concurrency: &str) {
    let env = TestEnv::new("writer-shortfall", 1).await;
    let split = [("TRADEBUCKET__MONGODB__FILL_CONCURRENCY", fill_concurrency)];
    let store = BucketStore::connect(&env.settings(&split))
        .await
        .expect("MongoDB client");
    store.init().await.expect("indexes");
    let topic = env.topic.clone();
    let mut ours = BucketWriter::new(store.clone(), CAPACITY, 10_000, Metrics::new());
    let customers = 50;
    let round = |r: i64| -> Vec<(Trade, Source)> {
        (0..customers)
            .map(|c| event(&format!("r{r}-{c}"), c, r * customers + c, &topic))
            .collect()
    };
    write_all(&mut ours, round(0)).await;
    // Another writer appends to customer 7 behind our cache's back.
    let mut other = BucketWriter::new(store, CAPACITY, 10_000, Metrics::new());
    write_all(&mut other, vec![event("theirs", 7, 10_000, &topic)]).await;
    let stats = write_all(&mut ours, round(1)).await;
    assert_eq!((stats.rounds, stats.heads_loaded), (2, 1), "{stats:?}");
    let report = audit_clean(&env, CAPACITY).await;
    assert_eq!(report.trades, 2 * customers as u64 + 1);
    env.cleanup().await;
}

/// A newest bucket written by another tool with `count: 2.5` (a guard on
/// it can never match) costs only its customer: that customer's events are
/// dead-lettered with a reason naming the bucket and the field, the other
/// customers' are written in the same call, and nothing is retried. Before,
/// the count was read as 2 and every batch stalled and retried for ever.
/// Mended, the bucket takes the customer's trades again.
#[tokio::test]
async fn a_bucket_whose_count_is_not_whole_dead_letters_only_its_customer() {
    let env = TestEnv::new("writer-bad-count", 1).await;
    let store = env.store().await;
    store.init().await.expect("indexes");
    let topic = env.topic.clone();
    let mut writer = BucketWriter::new(store.clone(), CAPACITY, 10_000, Metrics::new());
    let round = |r: i64| -> Vec<(Trade, Source)> {
        (0..5)
            .map(|c| event(&format!("r{r}-{c}"), c, r * 5 + c, &topic))
            .collect()
    };
    write_all(&mut writer, round(0)).await;
    let bad = buckets_of(&env, 3).await[0]
        .get_str("_id")
        .unwrap()
        .to_string();
    let set_count = |count: mongodb::bson::Bson| {
        let coll = store.collection().clone();
        let bad = bad.clone();
        async move {
            coll.update_one(doc! {"_id": bad}, doc! {"$set": {"count": count}})
                .await
                .expect("update");
        }
    };
    set_count(2.5.into()).await;
    // A cold writer, as after a restart: it must load the bad bucket.
    let mut cold = BucketWriter::new(store.clone(), CAPACITY, 10_000, Metrics::new());
    let batch = round(1);
    let mut outcomes = vec![Outcome::Pending; batch.len()];
    cold.write(&batch, &mut outcomes, None)
        .await
        .expect("no endless retry");
    for (i, o) in outcomes.iter().enumerate() {
        match (i, o) {
            (3, Outcome::DeadLetter(r)) => {
                assert!(
                    r.message.contains(&bad) && r.message.contains("count is 2.5"),
                    "{r:?}"
                );
            }
            (3, other) => panic!("customer 3: {other:?}"),
            (_, other) => assert_eq!(*other, Outcome::Written, "customer {i}"),
        }
    }
    set_count(1i64.into()).await;
    write_all(&mut cold, vec![batch[3].clone()]).await;
    assert_eq!(
        buckets_of(&env, 3)
            .await
            .iter()
            .map(keys_of)
            .map(|k| k.len())
            .sum::<usize>(),
        2
    );
    env.cleanup().await;
}

/// What the audit can see of the losses this class of bug leaves: one
/// customer under two spellings (`1` and `"1"` in one chain), a bucket
/// that took a trade after its successor was opened (its watermark past
/// the successor's), and, not a violation but counted, customers an
/// earlier version stored as text of digits.
#[tokio::test]
async fn audit_reports_two_spellings_appends_after_a_successor_and_text_ids() {
    let env = TestEnv::new("writer-audit-classes", 1).await;
    let store = env.store().await;
    store.init().await.expect("indexes");
    let topic = env.topic.clone();
    let mut writer = BucketWriter::new(store.clone(), 2, 10_000, Metrics::new());
    // Three trades each: two buckets per customer at capacity 2.
    let batch = (1..=3).flat_map(|c| (0..3).map(move |j| (c, j)));
    let batch = batch.map(|(c, j)| event(&format!("a{c}-{j}"), c, c * 10 + j, &topic));
    write_all(&mut writer, batch.collect()).await;
    let clean = tradebucket::cli::audit(
        &env.settings(&[("TRADEBUCKET__BUCKETS__CAPACITY", "2")]),
        None,
    )
    .await
    .expect("audit");
    assert!(clean.violations.is_empty(), "{:#?}", clean.violations);
    let coll = store.collection();
    let (one, two) = (bucket_ids(&env, 1).await, bucket_ids(&env, 2).await);
    coll.update_one(doc! {"_id": &one[1]}, doc! {"$set": {"customerId": "1"}})
        .await
        .unwrap();
    let partition = format!("{}:0", topic.replace('.', "~"));
    let past = doc! {"$set": {format!("wm.{partition}"): 1_000_000i64}};
    coll.update_one(doc! {"_id": &two[0]}, past).await.unwrap();
    coll.update_many(
        doc! {"customerId": 3i64},
        doc! {"$set": {"customerId": "3"}},
    )
    .await
    .unwrap();
    let report = tradebucket::cli::audit(
        &env.settings(&[("TRADEBUCKET__BUCKETS__CAPACITY", "2")]),
        None,
    )
    .await
    .expect("audit");
    let v = &report.violations;
    assert_eq!(v.len(), 2, "{v:#?}");
    assert!(
        v[0].starts_with(&one[1]) && v[0].contains("two spellings"),
        "{v:#?}"
    );
    assert!(
        v[1].starts_with(&two[0]) && v[1].contains("after its successor"),
        "{v:#?}"
    );
    assert_eq!(report.text_digit_customers, 1);
    env.cleanup().await;
}

async fn bucket_ids(env: &TestEnv, customer: i64) -> Vec<String> {
    let buckets = buckets_of(env, customer).await;
    buckets
        .iter()
        .map(|d| d.get_str("_id").unwrap().to_string())
        .collect()
}

/// Writes `batch`, which must be written whole.
async fn write_all(w: &mut BucketWriter, batch: Vec<(Trade, Source)>) -> WriteStats {
    let mut outcomes = vec![Outcome::Pending; batch.len()];
    let stats = w.write(&batch, &mut outcomes, None).await.expect("write");
    assert!(outcomes.iter().all(|o| *o == Outcome::Written));
    stats
}

/// A trade whose `legs` extra holds `n` zeros: 2 bytes an element in
/// JSON, about 12 in BSON (type, index digits, NUL, int32).
fn heavy_event(id: &str, customer: i64, offset: i64, topic: &str, legs: usize) -> (Trade, Source) {
    let mut json = trade(id)
        .customer(customer)
        .date(1_700_000_000_000i64 + offset * 1000)
        .json();
    json["legs"] = serde_json::Value::Array(vec![0.into(); legs]);
    let payload = json.to_string().into_bytes();
    decoded(&payload, topic, offset, 16 << 20)
}

/// The buckets whose `_id` starts with `<customer>_`, in page order.
async fn buckets_of(env: &TestEnv, customer: i64) -> Vec<mongodb::bson::Document> {
    let prefix = format!("{customer}_");
    env.buckets()
        .await
        .into_iter()
        .filter(|b| b.get_str("_id").unwrap().starts_with(&prefix))
        .collect()
}

fn keys_of(bucket: &mongodb::bson::Document) -> Vec<String> {
    bucket
        .get_array("history")
        .unwrap()
        .iter()
        .map(|h| h.as_document().unwrap().get_str("key").unwrap().to_string())
        .collect()
}

fn int(bucket: &mongodb::bson::Document, field: &str) -> i64 {
    bucket
        .get_i64(field)
        .unwrap_or_else(|_| panic!("{field} in {:?}", bucket.get("_id")))
}

/// A trade of 6 MiB of BSON (from about 1 MiB of JSON) with capacity 10:
/// it is stored, and the bucket it fills is closed by size, so a later big
/// trade opens a new bucket rather than pushing one past MongoDB's 16 MiB
/// (which was refused, and then refused every later trade of the
/// customer). One customer's trades arrive over two batches (the big ones
/// go in by a fill of about 12 MiB, one `update` command on its own); the
/// other's in one (a 12 MiB bucket inserted, then its successor).
#[tokio::test]
async fn six_mib_trades_close_buckets_by_size_instead_of_failing() {
    let env = TestEnv::new("writer-big", 1).await;
    let store = env.store().await;
    store.init().await.expect("indexes");
    let mut writer = BucketWriter::new(store, 10, 10_000, Metrics::new());
    let topic = env.topic.clone();
    // Small, small, small, BIG, small, small, BIG, BIG, small, small, small.
    let big = [3, 6, 7];
    let stream = |customer: i64, first_offset: i64| -> Vec<(Trade, Source)> {
        (0..11)
            .map(|i| {
                let id = format!("c{customer}-{i}");
                let offset = first_offset + i;
                if big.contains(&i) {
                    heavy_event(&id, customer, offset, &topic, 540_000)
                } else {
                    event(&id, customer, offset, &topic)
                }
            })
            .collect()
    };
    let split = stream(1, 0);
    let whole = stream(2, 100);
    let bson = split[3].0.doc.as_bytes().len();
    assert!((6 << 20..7 << 20).contains(&bson), "{bson} bytes of BSON");

    for batch in [&split[..3], &split[3..], &whole[..]] {
        let mut outcomes = vec![Outcome::Pending; batch.len()];
        writer
            .write(batch, &mut outcomes, None)
            .await
            .expect("batch");
        assert_eq!(outcomes, vec![Outcome::Written; batch.len()]);
    }

    let report = audit_clean(&env, 10).await;
    assert_eq!(report.trades, 22);
    for (customer, events) in [(1, &split), (2, &whole)] {
        let buckets = buckets_of(&env, customer).await;
        let pages: Vec<Vec<String>> = buckets.iter().map(keys_of).collect();
        let key = |i: usize| events[i].0.key.clone();
        // The second big trade left the first bucket at seven trades and
        // about 12 MiB: full by size, so the third opened the next.
        assert_eq!(
            pages,
            vec![
                (0..7).map(key).collect::<Vec<_>>(),
                (7..11).map(key).collect::<Vec<_>>()
            ],
            "customer {customer}"
        );
        let first = &buckets[0];
        assert_eq!(int(first, "cap"), 10);
        assert!(int(first, "bytes") >= int(first, "capBytes"));
        let stored = mongodb::bson::to_vec(first).unwrap().len() as i64;
        assert!((12 << 20..16 << 20).contains(&stored), "{stored}");
        assert!(int(first, "bytes") - stored < 4096, "a tight bound");
    }
    env.cleanup().await;
}

/// Two writers opening buckets of 10 and of 20 write one customer at the
/// same time, each its own partition's trades (a customer spread over
/// partitions, during a rolling update that changes the capacity). Every
/// bucket is filled to its own `cap`, whichever writer appends: every
/// bucket but the newest holds exactly its cap (so none got a trade after
/// its successor existed: it was full when the successor was opened), and
/// each partition's trades are in stream order across the pages.
#[tokio::test]
async fn writers_with_capacities_10_and_20_fill_each_bucket_to_its_own() {
    let env = TestEnv::new("writer-caps", 2).await;
    let store = env.store().await;
    store.init().await.expect("indexes");
    let topic = env.topic.clone();
    let customer = 7;
    // 300 trades, alternating partitions, dated in stream order.
    let stream: Vec<(Trade, Source)> = (0..300)
        .map(|i: i64| {
            let (trade, mut source) = event(&format!("s{i}"), customer, i, &topic);
            source.partition = (i % 2) as i32;
            source.offset = i / 2;
            (trade, source)
        })
        .collect();
    let of_partition = |p: i32| -> Vec<(Trade, Source)> {
        stream
            .iter()
            .filter(|(_, s)| s.partition == p)
            .cloned()
            .collect()
    };
    let run = |mut writer: BucketWriter, events: Vec<(Trade, Source)>, seed: usize| async move {
        let mut rest = events.as_slice();
        let mut n = seed;
        while !rest.is_empty() {
            // Batches of 1 to 7 events, varying.
            n = (n * 5 + 3) % 7;
            let (batch, later) = rest.split_at((n + 1).min(rest.len()));
            let mut outcomes = vec![Outcome::Pending; batch.len()];
            writer
                .write(batch, &mut outcomes, None)
                .await
                .expect("batch");
            assert_eq!(outcomes, vec![Outcome::Written; batch.len()]);
            rest = later;
        }
    };
    let ten = BucketWriter::new(store.clone(), 10, 10_000, Metrics::new());
    let twenty = BucketWriter::new(store, 20, 10_000, Metrics::new());
    tokio::join!(
        run(ten, of_partition(0), 1),
        run(twenty, of_partition(1), 4)
    );

    let buckets = buckets_of(&env, customer).await;
    let caps: Vec<i64> = buckets.iter().map(|b| int(b, "cap")).collect();
    let counts: Vec<i64> = buckets.iter().map(|b| int(b, "count")).collect();
    let (newest, older) = counts.split_last().unwrap();
    assert_eq!(
        older,
        &caps[..caps.len() - 1],
        "counts {counts:?} caps {caps:?}"
    );
    assert!(*newest <= caps[caps.len() - 1]);
    assert!(caps.contains(&10) && caps.contains(&20), "caps {caps:?}");
    assert_eq!(counts.iter().sum::<i64>(), 300);
    // Per partition, page order is stream order.
    let keys: Vec<String> = buckets.iter().flat_map(keys_of).collect();
    for p in 0..2 {
        let expected: Vec<String> = of_partition(p)
            .into_iter()
            .map(|(t, _)| t.key.into())
            .collect();
        let stored: Vec<String> = keys
            .iter()
            .filter(|k| expected.contains(k))
            .cloned()
            .collect();
        assert_eq!(stored, expected, "partition {p}");
    }
    audit_clean(&env, 10).await;
    env.cleanup().await;
}

/// The cache is an optimisation only: after a customer's buckets are
/// deleted by hand while the writer runs (a restore, an operator's
/// mistake), the same trades sent again are stored again, not settled as
/// duplicates or as already applied from the cached newest bucket. Before
/// `verify_cached_keys`, all six came back `Duplicate` or
/// `AlreadyApplied`, and nothing was stored.
#[tokio::test]
async fn trades_of_a_cached_bucket_deleted_by_hand_are_stored_when_sent_again() {
    for sharded in [false, true] {
        let env = TestEnv::new("writer-deleted", 1).await;
        let store = store(&env, sharded).await;
        let topic = env.topic.clone();
        let mut writer = BucketWriter::new(store.clone(), CAPACITY, 10_000, Metrics::new());
        let first: Vec<_> = (0..6)
            .map(|o| event(&format!("d{o}"), 1, o, &topic))
            .collect();
        write_all(&mut writer, first.clone()).await;
        store.collection().delete_many(doc! {}).await.unwrap();
        // The same trades: a redelivery (same offsets, at or below the
        // cached watermark) and a replay (new offsets) of them.
        let again: Vec<_> = (0..6)
            .map(|o| event(&format!("d{o}"), 1, if o < 3 { o } else { o + 10 }, &topic))
            .collect();
        write_all(&mut writer, again).await;
        let report = audit_mode_clean(&env, sharded).await;
        assert_eq!(report.trades, 6, "sharded {sharded}");
        env.cleanup().await;
    }
}

/// Loading heads by probe (while most customers asked have no bucket)
/// gives exactly what one `find` per customer gives, whatever the mix:
/// customers with no bucket, with one, with several (so a probe's limit
/// cuts its answer and the rest are loaded one by one), and with buckets
/// another tool named (`<customer>_legacy`, the highest `_id` of its
/// range). Two hundred customers, half never written: the probing load
/// sends at most one `find` per written customer plus two per group of 64
/// (where one per customer sends two hundred), and a load of customers
/// that all have buckets turns probing off, one of customers that have
/// none turns it back on.
#[tokio::test]
async fn probed_heads_are_the_heads_one_find_per_customer_reads() {
    let env = TestEnv::new("writer-probe", 1).await;
    let mut w = BucketWriter::new(store(&env, false).await, 10, 1000, Metrics::new());
    let mut batch = Vec::new();
    for c in 0..100i64 {
        for t in 0..(c % 4) * 12 {
            batch.push(event(&format!("p-{c}-{t}"), c, batch.len() as i64, "probe"));
        }
    }
    write_all(&mut w, batch).await;
    let coll = w.store().collection();
    for (id, c) in [("5_legacy", 5i64), ("150_legacy", 150)] {
        let legacy = doc! {"_id": id, "customerId": c, "count": 1, "history": [{"key": id}]};
        coll.insert_one(legacy).await.expect("a legacy bucket");
    }
    let (finds, handler) = counting(&env, "find");
    let probing = BucketStore::connect_with(&env.settings(&mode(false)), Some(handler))
        .await
        .expect("MongoDB client");
    let reference = store(&env, false).await;
    let by_customer = |mut v: Vec<(CustomerId, LoadedHead)>| {
        v.sort_by_key(|(c, _)| format!("{c:?}"));
        v
    };
    let customers: Vec<CustomerId> = (0..200).map(CustomerId::Int).collect();
    let mut want = Vec::new();
    for c in &customers {
        want.push((c.clone(), reference.load_head(c).await.expect("load")));
    }
    let want = by_customer(want);
    assert!(probing.probes_first(), "a new store probes first");
    let got = by_customer(probing.load_heads(customers.clone()).await.expect("probe"));
    assert_eq!(got, want);
    let probed_finds = finds.swap(0, Ordering::Relaxed);
    // The written customers may need one each (a probe's limit is used up
    // by their older buckets), plus a probe and an `$in` per group of 64:
    // the never written ones cost none of their own.
    let bound = 100 + 2 * customers.len().div_ceil(PROBE_CUSTOMERS);
    assert!(
        probed_finds <= bound,
        "{probed_finds} finds for 200 customers"
    );
    assert!(probing.probes_first(), "125 of 200 had no bucket");
    let written: Vec<CustomerId> = (0..100)
        .filter(|c| c % 4 != 0)
        .map(CustomerId::Int)
        .collect();
    probing.load_heads(written.clone()).await.expect("load");
    assert!(!probing.probes_first(), "every customer had buckets");
    finds.store(0, Ordering::Relaxed);
    let unwritten: Vec<CustomerId> = (151..200).map(CustomerId::Int).collect();
    probing.load_heads(unwritten.clone()).await.expect("load");
    assert_eq!(
        finds.load(Ordering::Relaxed),
        unwritten.len(),
        "one find each"
    );
    assert!(probing.probes_first(), "none of them had a bucket");
    probing.load_heads(written).await.expect("load");
    let one_each = by_customer(probing.load_heads(customers).await.expect("load"));
    assert_eq!(one_each, want);
    env.cleanup().await;
}
