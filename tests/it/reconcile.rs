//! `tradebucket reconcile` against what the real worker stored: every
//! record accounted for on a clean run; trades removed by hand (one bucket
//! whole) named by their offsets, put back by `--replay-missing`, and clean
//! again; bad records matched to their dead letters, and reported when
//! their dead letters are out of the picture; upstream duplicates counted,
//! not reported; in sharded mode, every lookup names the customer.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mongodb::bson::{doc, Document};
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use serde_json::Value;
use testkit::*;
use tradebucket::bucket::store::BucketStore;
use tradebucket::reconcile::io::{run_with, Options};

use crate::bin;

const CAPACITY: &str = "4";

/// `tradebucket reconcile --json ARGS` with the test's settings and
/// `extra` variables: (exit code, the report).
fn reconcile(env: &TestEnv, extra: &[(&str, &str)], args: &[&str]) -> (Option<i32>, Value) {
    let out = Command::new(bin())
        .args(["reconcile", "--json", "--rate", "0"])
        .args(args)
        .envs(env.vars(extra))
        .output()
        .expect("run tradebucket reconcile");
    let text = String::from_utf8_lossy(&out.stdout);
    let report = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{e}: {text} / {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code(), report)
}

/// (kind, partition, offset) of every problem listed.
fn problems(report: &Value) -> BTreeSet<(String, i64, i64)> {
    report["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let kind = p["kind"].as_str().unwrap().to_string();
            (
                kind,
                p["partition"].as_i64().unwrap(),
                p["offset"].as_i64().unwrap(),
            )
        })
        .collect()
}

fn total(report: &Value, field: &str) -> u64 {
    report["total"][field].as_u64().unwrap()
}

/// What a produced record is stored as.
#[derive(Clone)]
enum Stored {
    /// `t:<tradeId>`.
    ById(String),
    /// Without `tradeId`: `o:<its position>`.
    ByPosition,
    /// Not a trade: dead-lettered.
    Bad,
}

/// 60 trades of six customers (one in five without `tradeId`), six of them
/// sent again by the upstream, and three records that are not JSON.
fn records() -> Vec<(Produced, Stored)> {
    let keyed = |customer: i64, json: Value| Produced {
        key: Some(customer.to_string()),
        payload: Some(json.to_string().into_bytes()),
        ..Produced::default()
    };
    let mut out = Vec::new();
    for i in 0..60_i64 {
        let t = trade(format!("C{i}"))
            .customer(i % 6)
            .date(1_700_000_000_000_i64 + i * 1000);
        let (json, stored) = if i % 5 == 4 {
            (t.no_id().json(), Stored::ByPosition)
        } else {
            (t.json(), Stored::ById(format!("t:C{i}")))
        };
        out.push((keyed(i % 6, json), stored));
    }
    for i in [0_usize, 7, 13, 21, 33, 41] {
        let copy = out[i].clone();
        out.push(copy);
    }
    for _ in 0..3 {
        let bad = Produced {
            key: Some("x".into()),
            payload: Some(b"{not json".to_vec()),
            ..Produced::default()
        };
        out.push((bad, Stored::Bad));
    }
    out
}

#[tokio::test]
async fn reconcile_names_the_trades_removed_by_hand_and_replay_restores_them() {
    let env = TestEnv::new("reconcile", 2).await;
    let recs = records();
    let sent: Vec<Produced> = recs.iter().map(|(p, _)| p.clone()).collect();
    let positions = env.produce(&sent).await;
    let keys: Vec<Option<String>> = recs
        .iter()
        .zip(&positions)
        .map(|((_, stored), (p, o))| match stored {
            Stored::ById(key) => Some(key.clone()),
            Stored::ByPosition => Some(format!("o:{}/{p}/{o}", env.topic)),
            Stored::Bad => None,
        })
        .collect();
    let vars = [("TRADEBUCKET__BUCKETS__CAPACITY", CAPACITY)];
    let worker = WorkerProcess::start(bin(), env.vars(&vars), Log::Quiet);
    env.wait_committed_to_end(Duration::from_secs(60)).await;
    env.dead_letters(3, Duration::from_secs(30)).await;

    let (code, clean) = reconcile(&env, &vars, &[]);
    assert_eq!(code, Some(0), "{clean}");
    let counts = [
        "records",
        "stored",
        "upstream_duplicates",
        "dead_lettered",
        "problems",
    ];
    let got: Vec<u64> = counts.iter().map(|f| total(&clean, f)).collect();
    assert_eq!(got, vec![69, 60, 6, 3, 0], "{clean}");

    let removed = remove_by_hand(&env).await;
    let expected: BTreeSet<(String, i64, i64)> = keys
        .iter()
        .zip(&positions)
        .filter(|(k, _)| k.as_ref().is_some_and(|k| removed.contains(k)))
        .map(|(_, (p, o))| ("missing".to_string(), i64::from(*p), *o))
        .collect();
    assert!(
        expected.len() >= removed.len() && removed.len() >= 4,
        "{removed:?}"
    );
    let (code, found) = reconcile(&env, &vars, &[]);
    assert_eq!(code, Some(1));
    assert_eq!(problems(&found), expected, "{found}");

    let (code, replay) = reconcile(&env, &vars, &["--replay-missing"]);
    assert_eq!(code, Some(1));
    let replayed = replay["replayed"].as_u64().unwrap();
    assert_eq!(replayed, expected.len() as u64, "{replay}");
    env.wait_committed_to_end(Duration::from_secs(60)).await;
    let (code, again) = reconcile(&env, &vars, &[]);
    assert_eq!(code, Some(0), "{again}");
    assert_eq!(total(&again, "stored"), 60);
    assert_eq!(total(&again, "upstream_duplicates"), 6 + replayed);

    dead_letters_out_of_the_picture(&env, &vars, &keys, &positions);
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));
    env.cleanup().await;
}

/// Deletes customer 1's newest bucket whole, and pulls one trade with
/// `tradeId` and one without (stored under its position) out of customer
/// 4's buckets; returns the keys gone.
async fn remove_by_hand(env: &TestEnv) -> BTreeSet<String> {
    let buckets = env.buckets().await;
    let coll = env.store().await.collection().clone();
    let of = |prefix: &str| -> Vec<&Document> {
        buckets
            .iter()
            .filter(|b| b.get_str("_id").unwrap().starts_with(prefix))
            .collect()
    };
    let keys_of = |b: &Document| -> Vec<String> {
        b.get_array("history")
            .unwrap()
            .iter()
            .map(|h| h.as_document().unwrap().get_str("key").unwrap().to_string())
            .collect()
    };
    let newest = *of("1_").last().unwrap();
    let mut removed: BTreeSet<String> = keys_of(newest).into_iter().collect();
    coll.delete_one(doc! {"_id": newest.get_str("_id").unwrap()})
        .await
        .unwrap();
    let four: Vec<String> = of("4_").into_iter().flat_map(keys_of).collect();
    let by_id = four.iter().find(|k| k.starts_with("t:")).unwrap();
    let by_position = four.iter().find(|k| k.starts_with("o:")).unwrap();
    for key in [by_id, by_position] {
        take_out(&coll, key).await;
        removed.insert(key.clone());
    }
    removed
}

/// Takes the trade `key` out of the bucket holding it, as an operator's
/// `$pull` would (its `count` left as it was). Done as delete and re-insert:
/// the local stand-in for MongoDB leaves a `$pull`ed value in the unique
/// multikey index (STACK.md; mongod removes it), and the replay of a
/// trade without `tradeId`, stored under its original key since issue #46,
/// would then meet a duplicate key no bucket holds.
async fn take_out(coll: &mongodb::Collection<Document>, key: &str) {
    let mut bucket = coll
        .find_one(doc! {"history.key": key})
        .await
        .unwrap()
        .expect("a bucket holds the key");
    let history: Vec<mongodb::bson::Bson> = bucket
        .get_array("history")
        .unwrap()
        .iter()
        .filter(|h| h.as_document().unwrap().get_str("key") != Ok(key))
        .cloned()
        .collect();
    bucket.insert("history", history);
    let id = bucket.get_str("_id").unwrap().to_string();
    coll.delete_one(doc! {"_id": &id}).await.unwrap();
    coll.insert_one(bucket).await.unwrap();
}

/// Pointed at a dead-letter topic without the bad records' dead letters,
/// reconcile names exactly those three records.
fn dead_letters_out_of_the_picture(
    env: &TestEnv,
    vars: &[(&str, &str)],
    keys: &[Option<String>],
    positions: &[(i32, i64)],
) {
    let elsewhere = format!("{}.elsewhere", env.dlq);
    let mut moved = vars.to_vec();
    moved.push(("TRADEBUCKET__KAFKA__DLQ_TOPIC", &elsewhere));
    let (code, report) = reconcile(env, &moved, &[]);
    assert_eq!(code, Some(1));
    let bad: BTreeSet<(String, i64, i64)> = keys
        .iter()
        .zip(positions)
        .filter(|(k, _)| k.is_none())
        .map(|(_, (p, o))| ("missing".to_string(), i64::from(*p), *o))
        .collect();
    assert_eq!(bad.len(), 3);
    assert_eq!(problems(&report), bad, "{report}");
}

#[tokio::test]
async fn sharded_reconcile_names_the_customer_in_every_lookup() {
    let env = TestEnv::new("reconcile-sharded", 2).await;
    let vars = [("TRADEBUCKET__MONGODB__SHARDED", "true")];
    let events: Vec<Value> = (0..30_i64)
        .map(|i| trade(format!("S{i}")).customer(i % 7).json())
        .collect();
    env.produce_json(&events).await;
    let worker = WorkerProcess::start(bin(), env.vars(&vars), Log::Quiet);
    env.wait_committed_to_end(Duration::from_secs(60)).await;
    let settings = env.settings(&vars);
    let finds: Arc<Mutex<Vec<Document>>> = Arc::default();
    let log = finds.clone();
    let handler = EventHandler::callback(move |event| {
        if let CommandEvent::Started(s) = event {
            if s.command_name == "find" {
                log.lock().unwrap().push(s.command);
            }
        }
    });
    let store = BucketStore::connect_with(&settings, Some(handler))
        .await
        .unwrap();
    let report = run_with(&settings, &options(), store, false).await.unwrap();
    assert!(report.clean(), "{report:?}");
    assert_eq!(report.total.stored, 30);
    let finds = finds.lock().unwrap().clone();
    assert!(!finds.is_empty());
    for f in &finds {
        let filter = f.get_document("filter").unwrap();
        let branches: Vec<&Document> = match filter.get_array("$or") {
            Ok(b) => b.iter().map(|b| b.as_document().unwrap()).collect(),
            Err(_) => vec![filter],
        };
        assert!(
            branches.iter().all(|b| b.contains_key("customerId")),
            "{filter}"
        );
    }
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));
    env.cleanup().await;
}

fn options() -> Options {
    Options {
        since: None,
        from: Vec::new(),
        to_end: false,
        replay_missing: false,
        rate: 0,
        timeout: Duration::from_secs(60),
        json: true,
    }
}

/// `--from` checks only the partitions it names, from its offsets; with
/// nothing committed, nothing is promised.
#[tokio::test]
async fn from_and_uncommitted_partitions_bound_what_is_checked() {
    let env = TestEnv::new("reconcile-from", 2).await;
    let events: Vec<Value> = (0..20_i64)
        .map(|i| trade(format!("F{i}")).customer(i % 3).json())
        .collect();
    let positions = env.produce_json(&events).await;
    let settings = env.settings(&[]);
    let store = env.store().await;
    // Nothing committed yet: nothing read, nothing reported.
    let report = run_with(&settings, &options(), store, false).await.unwrap();
    assert_eq!((report.total.records, report.clean()), (0, true));
    assert!(report.partitions.iter().all(|p| p.span.uncommitted));
    let worker = WorkerProcess::start(bin(), env.vars(&[]), Log::Quiet);
    env.wait_committed_to_end(Duration::from_secs(60)).await;
    let ends: BTreeMap<i32, i64> = env.end_offsets();
    let (p, _) = positions[0];
    let opts = Options {
        from: vec![(p, 1)],
        ..options()
    };
    let report = run_with(&settings, &opts, env.store().await, false)
        .await
        .unwrap();
    assert_eq!(report.partitions.len(), 1);
    assert_eq!(report.total.records as i64, ends[&p] - 1);
    assert_eq!(report.total.stored as i64, ends[&p] - 1);
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));
    env.cleanup().await;
}

/// Issue #46, as an operator met it: trades without `tradeId`, unkeyed,
/// on four partitions; the worker, rate-limited, stopped part-way; then,
/// as the runbook says, `reconcile --to-end --replay-missing` replays every
/// record not yet handled, and the worker runs to the end. Before, every
/// replayed trade was stored twice (`o:<position>` and `r:<position>`).
/// Each trade is counted by an id of the test's own (`ref`), not the
/// product's key. Then a double planted by hand, under the key an earlier
/// version stored a replay under, whose replay's partition is read before
/// its original's: reconcile reports it.
#[tokio::test]
async fn replaying_what_a_stopped_worker_left_stores_every_trade_once() {
    const TRADES: usize = 1_200;
    let env = TestEnv::new("reconcile-replay-lag", 4).await;
    let sent: Vec<Produced> = (0..TRADES)
        .map(|i| {
            let mut json = trade("").no_id().customer(i as i64 % 40).json();
            json["ref"] = Value::from(i as i64);
            Produced {
                payload: Some(json.to_string().into_bytes()),
                ..Produced::default()
            }
        })
        .collect();
    let positions = env.produce(&sent).await;
    let used: BTreeSet<i32> = positions.iter().map(|(p, _)| *p).collect();
    assert!(used.len() > 1, "unkeyed records spread: {used:?}");
    let vars = [
        ("TRADEBUCKET__BUCKETS__CAPACITY", "10"),
        ("TRADEBUCKET__RATE_LIMIT__EVENTS_PER_SECOND", "100"),
    ];
    let lagging = WorkerProcess::start(bin(), env.vars(&vars), Log::Quiet);
    let part_way = poll_until(
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async { env.committed().values().sum::<i64>() >= 150 },
    )
    .await;
    assert!(part_way, "the worker committed nothing");
    assert_eq!(lagging.sigterm(Duration::from_secs(30)), Some(0));
    let left: i64 = (TRADES as i64) - env.committed().values().sum::<i64>();
    assert!(left > 0, "the worker was stopped too late");

    let (code, replay) = reconcile(&env, &vars[..1], &["--to-end", "--replay-missing"]);
    assert_eq!(code, Some(1), "{replay}");
    assert!(replay["replayed"].as_u64().unwrap() > 0, "{replay}");
    let worker = WorkerProcess::start(bin(), env.vars(&vars[..1]), Log::Quiet);
    env.wait_committed_to_end(Duration::from_secs(120)).await;
    let refs = stored_refs(&env).await;
    let doubled = refs.windows(2).filter(|w| w[0] == w[1]).count();
    assert_eq!(doubled, 0, "trades stored twice");
    assert_eq!(refs, (0..TRADES as i64).collect::<Vec<_>>(), "every trade");
    let (code, clean) = reconcile(&env, &vars[..1], &[]);
    assert_eq!(code, Some(0), "{clean}");
    assert_eq!(total(&clean, "stored"), TRADES as u64, "{clean}");

    let (key, replay_at) = plant_a_legacy_double(&env, &sent, &positions).await;
    let (code, found) = reconcile(&env, &vars[..1], &[]);
    assert_eq!(code, Some(1), "{found}");
    let expected = BTreeSet::from([("stored_twice".to_string(), replay_at.0, replay_at.1)]);
    assert_eq!(problems(&found), expected, "{key}: {found}");
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));
    env.cleanup().await;
}

/// Every `ref` stored, sorted (a trade stored twice is there twice).
async fn stored_refs(env: &TestEnv) -> Vec<i64> {
    let mut refs: Vec<i64> = env
        .buckets()
        .await
        .iter()
        .flat_map(|b| b.get_array("history").unwrap().clone())
        .map(|h| match h.as_document().unwrap().get("ref") {
            Some(mongodb::bson::Bson::Int32(n)) => i64::from(*n),
            Some(mongodb::bson::Bson::Int64(n)) => *n,
            other => panic!("ref: {other:?}"),
        })
        .collect();
    refs.sort_unstable();
    refs
}

/// A replay of a trade whose original is on partition 1 or later, sent
/// to partition 0 (read first), as `dlq replay` sends one: a duplicate to
/// the worker. Then its trade planted again by hand, in a bucket of its
/// own, under the key versions before issue #46 stored a replay under
/// (`r:`). Returns that key and the replay's position.
async fn plant_a_legacy_double(
    env: &TestEnv,
    sent: &[Produced],
    positions: &[(i32, i64)],
) -> (String, (i64, i64)) {
    let (i, (p, o)) = positions
        .iter()
        .enumerate()
        .find(|(_, (p, _))| *p > 0)
        .expect("a record past partition 0");
    let origin = format!("{}/{p}/{o}", env.topic);
    let replay = Produced {
        partition: Some(0),
        headers: vec![("tradebucket.replay.of".into(), origin.clone())],
        ..sent[i].clone()
    };
    let at = env.produce(&[replay]).await[0];
    env.wait_committed_to_end(Duration::from_secs(60)).await;
    let key = format!("o:{origin}");
    let buckets = env.buckets().await;
    let holder = buckets.iter().find(|b| {
        let h = b.get_array("history").unwrap();
        h.iter()
            .any(|e| e.as_document().unwrap().get_str("key") == Ok(key.as_str()))
    });
    let customer = holder
        .expect("the original stored")
        .get_i64("customerId")
        .unwrap();
    let legacy = format!("r:{origin}");
    let bucket = doc! {
        "_id": format!("{customer}_0000000001"), "customerId": customer, "count": 1,
        "history": [{"key": &legacy}], "prev": "planted", "wm": {},
    };
    env.store()
        .await
        .collection()
        .insert_one(bucket)
        .await
        .unwrap();
    (legacy, (i64::from(at.0), at.1))
}

/// What a worker catching up does, record after record from `from` on
/// partition 0 (each bad): its dead letter, acknowledged, then the
/// group's commit past it; until `done` or `to`. Returns the offset it
/// committed last (the next to read).
async fn dead_letter_and_commit(
    env: &TestEnv,
    from: i64,
    to: i64,
    done: &std::sync::atomic::AtomicBool,
) -> i64 {
    let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &env.kafka)
        .create()
        .expect("producer");
    let group = env.group_client();
    let mut next = from;
    while next < to && !done.load(std::sync::atomic::Ordering::SeqCst) {
        let (partition, offset) = (0.to_string(), next.to_string());
        let headers = [
            ("tradebucket.error.kind", "not_json"),
            ("tradebucket.error.message", "by hand"),
            ("tradebucket.source.topic", env.topic.as_str()),
            ("tradebucket.source.partition", partition.as_str()),
            ("tradebucket.source.offset", offset.as_str()),
        ]
        .into_iter()
        .fold(rdkafka::message::OwnedHeaders::new(), |h, (key, v)| {
            h.insert(rdkafka::message::Header {
                key,
                value: Some(v.as_bytes()),
            })
        });
        let letter = rdkafka::producer::FutureRecord::<[u8], [u8]>::to(&env.dlq)
            .payload(b"{not json")
            .headers(headers);
        producer
            .send(letter, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .expect("dead letter acknowledged");
        next += 1;
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition_offset(&env.topic, 0, rdkafka::Offset::Offset(next))
            .unwrap();
        rdkafka::consumer::Consumer::commit(&group, &tpl, rdkafka::consumer::CommitMode::Sync)
            .expect("commit");
    }
    next
}

/// A worker dead-letters records and commits past them at any moment,
/// also while reconcile reads. The committed offsets are read before the
/// dead letters, so every record committed past has its dead letter among
/// those read. Read after them (before the storm found it), a bad record
/// whose dead letter came in between was reported missing (chaos storm
/// seed 313: seven of them, as the workers caught up after a MongoDB
/// outage), and `--replay-missing` put it back for nothing. Here the test
/// is the worker, dead-lettering and committing one record after another
/// for as long as reconcile runs.
#[tokio::test]
async fn bad_records_committed_past_while_reconcile_reads_are_not_missing() {
    const BAD: i64 = 2_000;
    let env = TestEnv::new("reconcile-race", 1).await;
    let bad: Vec<Produced> = (0..BAD)
        .map(|_| Produced {
            payload: Some(b"{not json".to_vec()),
            partition: Some(0),
            ..Produced::default()
        })
        .collect();
    produce_fast(&env.kafka, &env.topic, &bad).await;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let worker = {
        let (env, done) = (env.clone(), done.clone());
        tokio::spawn(async move { dead_letter_and_commit(&env, 0, BAD, &done).await })
    };
    // The worker under way before reconcile starts.
    eventually("the first commit", Duration::from_secs(30), || async {
        env.committed().values().sum::<i64>() > 0
    })
    .await;
    let vars = env.vars(&[]);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(bin())
            .args(["reconcile", "--json", "--rate", "0"])
            .envs(vars)
            .output()
            .expect("run tradebucket reconcile")
    })
    .await
    .unwrap();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let committed = worker.await.unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(committed < BAD, "the worker finished before reconcile did");
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert!(total(&report, "dead_lettered") > 0, "{report}");
    let (code, again) = reconcile(&env, &[], &[]);
    assert_eq!(code, Some(0), "{again}");
    assert_eq!(total(&again, "dead_lettered"), committed as u64, "{again}");
    env.cleanup().await;
}

/// An unkeyed topic: each customer's trades, and so each bucket's, on both
/// partitions (49 customers, trades alternating between partitions),
/// which reconcile reads one after the other. A bucket read
/// for partition 0 answers for its keys on partition 1 from memory
/// (`reconcile::known`), so each bucket is read once; and that memory
/// still names every trade taken out and every trade planted twice
/// (position-keyed trades, a copy under the key earlier versions stored a
/// replay under), in both partitions, early and late, and nothing else.
#[tokio::test]
async fn an_unkeyed_topic_s_buckets_are_read_once_and_every_miss_and_double_named() {
    const TRADES: i64 = 12_000;
    let env = TestEnv::new("reconcile-unkeyed", 2).await;
    let sent: Vec<Produced> = (0..TRADES)
        .map(|i| {
            let t = trade(format!("U{i}")).customer(i % 49);
            let t = if i % 5 == 3 { t.no_id() } else { t };
            Produced {
                payload: Some(t.json().to_string().into_bytes()),
                partition: Some((i % 2) as i32),
                ..Produced::default()
            }
        })
        .collect();
    let positions = produce_fast(&env.kafka, &env.topic, &sent).await;
    let worker = WorkerProcess::start(bin(), env.vars(&[]), Log::Quiet);
    env.wait_committed_to_end(Duration::from_secs(180)).await;
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));
    let coll = env.store().await.collection().clone();
    let mut expected = BTreeSet::new();
    for i in [100_i64, 10_001, 11_000] {
        take_out(&coll, &format!("t:U{i}")).await;
        let (p, o) = positions[i as usize];
        expected.insert(("missing".to_string(), i64::from(p), o));
    }
    for i in [3_i64, 9_013, 10_008] {
        let (p, o) = positions[i as usize];
        let legacy = format!("r:{}/{p}/{o}", env.topic);
        let customer = i % 49;
        let bucket = doc! {
            "_id": format!("{customer}_0000000001"), "customerId": customer, "count": 1,
            "history": [{"key": &legacy}], "prev": format!("planted-{i}"), "wm": {},
        };
        coll.insert_one(bucket).await.unwrap();
        expected.insert(("stored_twice".to_string(), i64::from(p), o));
    }
    let buckets = coll.count_documents(doc! {}).await.unwrap();
    let (code, report) = reconcile(&env, &[], &[]);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(problems(&report), expected, "{report}");
    assert_eq!(total(&report, "records"), TRADES as u64);
    assert_eq!(total(&report, "stored"), TRADES as u64 - 6);
    let lookups = &report["lookups"];
    let read = lookups["buckets_read"].as_u64().unwrap();
    assert!(
        read > 0 && read <= buckets,
        "{lookups} of {buckets} buckets"
    );
    assert!(
        lookups["keys_from_memory"].as_u64().unwrap() > 0,
        "{lookups}"
    );
    env.cleanup().await;
}
