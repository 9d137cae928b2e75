//! What the bucket writer sends to MongoDB, recorded with the driver's
//! command monitoring (every command as it leaves the client): the reads
//! that decide what is stored are majority reads from the primary whatever
//! the URI says, and in sharded mode every read filter, every update
//! statement and every inserted bucket names the customer (the shard key),
//! so mongos can send each to one shard. The local server is no mongos:
//! what mongos does with those commands is not shown here
//! (docs/testing.md says what remains unproven).

use std::process::Command;
use std::sync::{Arc, Mutex};

use mongodb::bson::{doc, Bson, Document};
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use serde_json::Value;
use testkit::*;
use tradebucket::bucket::store::{BucketStore, InitError, ShardState};
use tradebucket::bucket::writer::{BucketWriter, Outcome, WriteStats};
use tradebucket::cli::AuditReport;
use tradebucket::config::Settings;
use tradebucket::event::{CustomerId, RejectKind, Source, Trade};
use tradebucket::metrics::Metrics;

use crate::bin;

const CAPACITY: u32 = 4;
const SHARDED: &str = "TRADEBUCKET__MONGODB__SHARDED";
/// What a URI may ask of every read; the decisive reads must ignore it.
const URI_READS: &str = "readPreference=secondaryPreferred&readConcernLevel=local";

/// Every command started on one database, as sent.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<(String, Document)>>>);

impl Recorder {
    fn handler(&self, db: &str) -> EventHandler<CommandEvent> {
        let (log, db) = (self.0.clone(), db.to_string());
        EventHandler::callback(move |event| {
            if let CommandEvent::Started(s) = event {
                if s.db == db {
                    log.lock().unwrap().push((s.command_name, s.command));
                }
            }
        })
    }

    fn clear(&self) {
        self.0.lock().unwrap().clear();
    }

    fn all(&self) -> Vec<(String, Document)> {
        self.0.lock().unwrap().clone()
    }
}

/// `uri` with `extra` query options.
fn with_options(uri: &str, extra: &str) -> String {
    if uri.contains('?') {
        format!("{uri}&{extra}")
    } else {
        format!("{}/?{extra}", uri.trim_end_matches('/'))
    }
}

/// The test server as a replica set the driver discovers (no direct
/// connection), if it is one: its `setName` from `hello`.
async fn discovered_uri(direct: &str) -> Option<String> {
    let client = mongodb::Client::with_uri_str(direct).await.ok()?;
    let hello = client
        .database("admin")
        .run_command(doc! {"hello": 1})
        .await
        .ok()?;
    let set = hello.get_str("setName").ok()?;
    Some(direct.replace("directConnection=true", &format!("replicaSet={set}")))
}

fn event(id: &str, customer: Value, offset: i64, topic: &str) -> (Trade, Source) {
    let payload = trade(id)
        .customer(customer)
        .qty(1)
        .date(1_700_000_000_000i64 + offset * 1000)
        .payload();
    decoded(&payload, topic, offset, 1 << 20)
}

async fn write(
    writer: &mut BucketWriter,
    events: &[(Trade, Source)],
) -> (Vec<Outcome>, WriteStats) {
    let mut outcomes = vec![Outcome::Pending; events.len()];
    let stats = writer
        .write(events, &mut outcomes, None)
        .await
        .expect("write");
    (outcomes, stats)
}

fn is_conflict(o: &Outcome) -> bool {
    matches!(o, Outcome::DeadLetter(r) if r.kind == RejectKind::TradeIdConflict)
}

/// Whether a find filter names the customer: at its top, or in every
/// branch of its `$or`.
fn names_customer(filter: &Document) -> bool {
    filter.contains_key("customerId")
        || filter.get_array("$or").is_ok_and(|branches| {
            !branches.is_empty()
                && branches.iter().all(|b| {
                    b.as_document()
                        .is_some_and(|d| d.contains_key("customerId"))
                })
        })
}

/// The mode of `$readPreference`, if the command carries one.
fn read_preference(command: &Document) -> Option<String> {
    command
        .get_document("$readPreference")
        .ok()
        .and_then(|p| p.get_str("mode").ok())
        .map(str::to_string)
}

fn audit_settings(env: &TestEnv, sharded: bool) -> Settings {
    let capacity = CAPACITY.to_string();
    env.settings(&[
        ("TRADEBUCKET__BUCKETS__CAPACITY", &capacity),
        (SHARDED, if sharded { "true" } else { "false" }),
    ])
}

async fn audit(env: &TestEnv, sharded: bool) -> AuditReport {
    let report = tradebucket::cli::audit(&audit_settings(env, sharded), None)
        .await
        .expect("audit");
    assert!(report.violations.is_empty(), "{:#?}", report.violations);
    report
}

/// One batch through every path of the writer, recorded: first writes
/// (heads of unknown customers loaded), new buckets and chains, a trade id
/// two customers share, a customer whose id comes as `7` and as `"7"`,
/// fills, a stale cache (another writer appended), an upstream duplicate
/// (duplicate key, `find_keys`, reload), and a full redelivery to a cold
/// writer (below the watermark: `find_keys`). Checks every recorded
/// command, and the outcomes the mode implies.
async fn every_path(sharded: bool, uri: &str, direct: bool) {
    let uri = with_options(uri, URI_READS);
    let env = TestEnv::on(kafka_brokers(), uri, "commands", 1).await;
    let settings = audit_settings(&env, sharded);
    let recorder = Recorder::default();
    let first = connect_recorded(&settings, &recorder, &env).await;
    first.init().await.expect("init");
    let coll = first.collection().name().to_string();
    // What the writer sends, not what `init` did.
    recorder.clear();
    write_every_path(&settings, &recorder, &env, first.clone(), sharded).await;
    // The control: `page` keeps the URI's read preference and concern.
    first.page(&CustomerId::Int(1), 1).await.expect("page");
    let all = recorder.all();
    let sent = |name: &str| -> Vec<&Document> {
        all.iter()
            .filter(|(n, c)| n == name && c.get_str(name) == Ok(coll.as_str()))
            .map(|(_, c)| c)
            .collect()
    };
    let filters = check_decisive_reads(&sent, direct);
    check_writes_name_the_customer(&sent, &filters, sharded);
    let report = audit(&env, sharded).await;
    // Batch A holds 21 trades, one of them not stored unsharded.
    assert_eq!(report.trades, 20 + u64::from(sharded) + 2 + 1 + 1 + 1);
    env.cleanup().await;
}

async fn connect_recorded(settings: &Settings, recorder: &Recorder, env: &TestEnv) -> BucketStore {
    BucketStore::connect_with(settings, Some(recorder.handler(&env.db)))
        .await
        .expect("MongoDB client")
}

/// Batch A: six trades each for customers 1-3 (a full bucket and a second
/// one), customer 1's and 2's first trade share an id, and customer 7 as a
/// number and as text.
fn batch_a(next: &mut impl FnMut(&str, Value) -> (Trade, Source)) -> Vec<(Trade, Source)> {
    let mut a = Vec::new();
    for c in 1..=3 {
        for j in 0..6 {
            let id = if j == 0 && c < 3 {
                "shared".to_string()
            } else {
                format!("a{c}-{j}")
            };
            a.push(next(&id, c.into()));
        }
    }
    a.push(next("n7-0", 7.into()));
    a.push(next("s7-0", "7".into()));
    a.push(next("n7-1", 7.into()));
    a
}

/// Customer 2's second event of batch A shares customer 1's trade id:
/// unsharded, a trade id is unique across customers, so it conflicts; every
/// other event has `expected`.
fn assert_batch_a(outcomes: &[Outcome], expected: Outcome, sharded: bool) {
    let shared_of_2 = 6;
    for (i, o) in outcomes.iter().enumerate() {
        if i == shared_of_2 && !sharded {
            assert!(is_conflict(o), "{o:?}");
        } else {
            assert_eq!(*o, expected, "event {i}");
        }
    }
}

/// Every path of the writer once: fills from the cache, a missed guard, a
/// duplicate key, and a cold writer below the watermark.
async fn write_every_path(
    settings: &Settings,
    recorder: &Recorder,
    env: &TestEnv,
    first: BucketStore,
    sharded: bool,
) {
    let new_writer = |store| BucketWriter::new(store, CAPACITY, 10_000, Metrics::new());
    let mut w1 = new_writer(first);
    let topic = env.topic.clone();
    let mut offset = 0;
    let mut next = |id: &str, customer: Value| {
        offset += 1;
        event(id, customer, offset, &topic)
    };
    let a = batch_a(&mut next);
    assert_batch_a(&write(&mut w1, &a).await.0, Outcome::Written, sharded);
    // Customer 1 fills its open bucket from the cache: no read.
    let b = vec![next("b1-0", 1.into()), next("b1-1", 1.into())];
    assert_eq!(write(&mut w1, &b).await.0, vec![Outcome::Written; 2]);
    // Another writer appends to customer 2 behind w1's back ...
    let mut w2 = new_writer(connect_recorded(settings, recorder, env).await);
    let c = vec![next("c2-0", 2.into())];
    assert_eq!(write(&mut w2, &c).await.0, vec![Outcome::Written]);
    // ... so w1's fill misses its guard, and w1 reloads.
    let d = vec![next("d2-0", 2.into())];
    let (outcomes, stats) = write(&mut w1, &d).await;
    assert_eq!(outcomes, vec![Outcome::Written]);
    assert_eq!((stats.rounds, stats.heads_loaded), (2, 1), "{stats:?}");
    // An upstream duplicate of a trade in customer 3's older bucket: the
    // unique key index refuses the fill, `find_keys` finds it.
    let e = vec![next("a3-0", 3.into()), next("e3-0", 3.into())];
    let (outcomes, stats) = write(&mut w1, &e).await;
    assert_eq!(outcomes, vec![Outcome::Duplicate, Outcome::Written]);
    assert_eq!(stats.conflicts, 1, "{stats:?}");
    // Batch A again, to a writer with a cold cache (as after a restart):
    // below the watermark and not in the newest buckets, so looked up.
    let mut w3 = new_writer(connect_recorded(settings, recorder, env).await);
    let (outcomes, stats) = write(&mut w3, &a).await;
    assert_batch_a(&outcomes, Outcome::AlreadyApplied, sharded);
    let unstored = usize::from(!sharded);
    assert_eq!(stats.below_watermark_unstored, unstored, "{stats:?}");
}

/// Whether a find filter looks trade keys up (at its top or in a branch).
fn is_key_lookup(f: &Document) -> bool {
    f.contains_key("history.key")
        || f.get_array("$or").is_ok_and(|b| {
            b.iter().any(|d| {
                d.as_document()
                    .is_some_and(|d| d.contains_key("history.key"))
            })
        })
}

/// The reads that decide what is stored went to the primary at
/// "majority"; the last find (the control, `page`) kept the URI's. Returns
/// the decisive finds' filters.
fn check_decisive_reads<'a>(
    sent: &impl Fn(&str) -> Vec<&'a Document>,
    direct: bool,
) -> Vec<&'a Document> {
    let finds = sent("find");
    let (page, decisive) = finds.split_last().expect("finds were sent");
    let filters: Vec<&Document> = decisive
        .iter()
        .map(|f| f.get_document("filter").expect("a filter"))
        .collect();
    // `load_heads`: a customer's `_id` prefix range.
    assert!(filters.iter().any(|f| f.contains_key("_id")), "load_heads");
    assert!(
        filters.iter().filter(|f| is_key_lookup(f)).count() >= 2,
        "find_keys"
    );
    for f in decisive.iter().chain(sent("aggregate").iter()) {
        let level = f
            .get_document("readConcern")
            .and_then(|r| r.get_str("level"));
        assert_eq!(level, Ok("majority"), "{f}");
        // The driver spells "primary" as primaryPreferred to a server it
        // is directly connected to (the server-selection spec, so that a
        // direct connection to a secondary can read at all), and as
        // nothing to a replica set it discovered.
        let expected = direct.then(|| "primaryPreferred".to_string());
        assert_eq!(read_preference(f), expected, "{f}");
    }
    let level = page
        .get_document("readConcern")
        .and_then(|r| r.get_str("level"));
    assert_eq!(level, Ok("local"));
    assert_eq!(read_preference(page).as_deref(), Some("secondaryPreferred"));
    filters
}

/// Every inserted bucket carries the customer; sharded, every filter and
/// fill guard names it too, in one canonical form; unsharded, key lookups
/// do not (a trade id is unique across customers).
fn check_writes_name_the_customer<'a>(
    sent: &impl Fn(&str) -> Vec<&'a Document>,
    filters: &[&Document],
    sharded: bool,
) {
    let statements = |command: &str, field: &str| -> Vec<&'a Document> {
        let each = |c: &'a Document| c.get_array(field).expect("statements").iter();
        let docs = sent(command).into_iter().flat_map(each);
        docs.map(|s| s.as_document().expect("a document")).collect()
    };
    let updates = statements("update", "updates");
    let inserted = statements("insert", "documents");
    // Batch A opens two buckets for each of customers 1-3 and one for
    // customer 7 (`7` and `"7"` are one customer); fills follow. (8 inserts
    // were once sent sharded: the two spellings raced for one bucket.)
    let (u, i) = (updates.len(), inserted.len());
    assert!(
        u >= 4 && i >= 7,
        "fills and inserts: {u} updates, {i} inserts"
    );
    for d in &inserted {
        assert!(d.contains_key("customerId"), "{d}");
    }
    if !sharded {
        let lookups = filters.iter().filter(|f| is_key_lookup(f));
        assert!(lookups.clone().all(|f| !names_customer(f)));
        return;
    }
    for f in filters {
        assert!(names_customer(f), "{f}");
    }
    for s in &updates {
        let q = s.get_document("q").expect("q");
        assert!(q.contains_key("customerId"), "{q}");
    }
    // Customer 7 has one shard key value: its canonical form.
    let sevens = inserted
        .iter()
        .filter(|d| d.get_str("_id").unwrap().starts_with("7_"));
    for d in sevens {
        assert_eq!(d.get("customerId"), Some(&Bson::Int64(7)), "{d}");
    }
}

#[tokio::test]
async fn unsharded_decisive_reads_are_majority_reads_from_the_primary() {
    let direct = mongodb_uri();
    every_path(false, &direct, direct.contains("directConnection=true")).await;
    if let Some(discovered) = discovered_uri(&direct).await {
        every_path(false, &discovered, false).await;
    }
}

#[tokio::test]
async fn sharded_mode_names_the_customer_in_every_filter_update_and_insert() {
    let direct = mongodb_uri();
    every_path(true, &direct, direct.contains("directConnection=true")).await;
    if let Some(discovered) = discovered_uri(&direct).await {
        every_path(true, &discovered, false).await;
    }
}

/// The heads of a batch's newly seen customers are the right heads: a
/// cold writer's next batch fills every customer's open bucket in one round
/// (a missing or wrong head would insert a bucket whose `prev` collides, or
/// miss a guard, and cost more rounds). Each head is one indexed `find`
/// (newest `_id` in the customer's prefix range): a query for many
/// customers at once must not read their whole history (docs/design.md).
async fn cold_heads(sharded: bool) {
    let env = TestEnv::new("heads", 1).await;
    let settings = audit_settings(&env, sharded);
    let recorder = Recorder::default();
    let store = BucketStore::connect_with(&settings, Some(recorder.handler(&env.db)))
        .await
        .expect("MongoDB client");
    store.init().await.expect("init");
    let customers = 1_200i64;
    let batch = |round: i64| -> Vec<(Trade, Source)> {
        (0..customers)
            .map(|c| {
                let offset = round * customers + c;
                event(&format!("h{round}-{c}"), c.into(), offset, &env.topic)
            })
            .collect()
    };
    let new_writer = || BucketWriter::new(store.clone(), CAPACITY, 10_000, Metrics::new());

    recorder.clear();
    let (outcomes, stats) = write(&mut new_writer(), &batch(0)).await;
    assert!(outcomes.iter().all(|o| *o == Outcome::Written));
    assert_eq!(stats.heads_loaded, customers as usize, "{stats:?}");

    // A cold writer (as after a restart or rebalance): every head exists.
    recorder.clear();
    let (outcomes, stats) = write(&mut new_writer(), &batch(1)).await;
    assert!(outcomes.iter().all(|o| *o == Outcome::Written));
    assert_eq!(
        (
            stats.rounds,
            stats.fills,
            stats.buckets_created,
            stats.conflicts
        ),
        (1, customers as usize, 0, 0),
        "{stats:?}"
    );
    let report = audit(&env, sharded).await;
    assert_eq!(report.trades, 2 * customers as u64);
    env.cleanup().await;
}

#[tokio::test]
async fn a_cold_writer_loads_every_head_and_fills_in_one_round() {
    cold_heads(false).await;
    cold_heads(true).await;
}

/// `tradebucket <command>` with these settings: exit code, stdout and
/// stderr.
fn binary(
    command: &str,
    vars: &std::collections::BTreeMap<String, String>,
) -> (Option<i32>, String, String) {
    let out = Command::new(bin())
        .arg(command)
        .envs(vars)
        .output()
        .expect("run tradebucket");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// A collection that would lose trades without an error is refused by
/// `init`, at the worker's start and by reconcile: one that compares text
/// other than byte by byte (under a case-insensitive default collation
/// `abc_1` and `ABC_1` are one `_id`; under a collated unique index on
/// trade keys `t1` and `T1` are one key, so the second of two different
/// trades would be taken for a copy), and one whose buckets MongoDB
/// deletes on its own (capped, or with a TTL index). Once the offending
/// index is dropped, `init` goes ahead.
#[tokio::test]
async fn a_collection_that_would_lose_trades_is_refused() {
    let case_insensitive = doc! {"locale": "en", "strength": 2};
    for (create, says) in [
        (doc! {"collation": case_insensitive.clone()}, "\"en\""),
        (doc! {"capped": true, "size": 1_048_576}, "capped"),
    ] {
        let env = TestEnv::new("collection-options", 1).await;
        let db = env.store().await.client().database(&env.db);
        let mut command = doc! {"create": "trades"};
        command.extend(create);
        db.run_command(command)
            .await
            .expect("create the collection");
        match env.store().await.init().await {
            Err(InitError::Layout(why)) => {
                assert!(why.contains(says) && why.contains(&env.db), "{why}")
            }
            other => panic!("expected a refusal ({says}), got {other:?}"),
        }
        let vars = env.vars(&[]);
        for command in ["init", "run", "reconcile"] {
            let (code, _, stderr) = binary(command, &vars);
            assert_ne!(code, Some(0), "{command}: {stderr}");
            assert!(
                stderr.contains("docs/operations.md#the-collection") && stderr.contains(says),
                "{command}: {stderr}"
            );
        }
        env.cleanup().await;
    }

    let env = TestEnv::new("collection-indexes", 1).await;
    let store = env.store().await;
    store.init().await.expect("a collection init made");
    let db = store.client().database(&env.db);
    for index in [
        doc! {"key": {"history.key": 1}, "name": "keys_ci", "unique": true,
        "collation": case_insensitive},
        doc! {"key": {"history.date": 1}, "name": "old_pages", "expireAfterSeconds": 86_400},
    ] {
        let name = index.get_str("name").unwrap().to_string();
        db.run_command(doc! {"createIndexes": "trades", "indexes": [index]})
            .await
            .expect("create the index");
        match store.init().await {
            Err(InitError::Layout(why)) => assert!(why.contains(&name), "{why}"),
            other => panic!("expected {name} refused, got {other:?}"),
        }
        store.collection().drop_index(&name).await.expect("drop it");
        store.init().await.expect("init once the index is gone");
    }
    env.cleanup().await;
}

/// A collection laid out for the other mode is refused, by `init` and at
/// the worker's start, with what to do; and `init` of sharded mode refuses
/// buckets whose `customerId` it would not find.
#[tokio::test]
async fn each_mode_refuses_a_collection_laid_out_for_the_other() {
    for (mode, other) in [("false", "true"), ("true", "false")] {
        one_mode_refuses_the_others_layout(mode, other).await;
    }
    sharded_mode_refuses_customer_ids_stored_as_text().await;
}

/// `init` in `mode` lays the indexes out; the other mode's `init`, the
/// binary's `init` and `run` refuse that collection, naming the docs.
async fn one_mode_refuses_the_others_layout(mode: &str, other: &str) {
    let env = TestEnv::new("layout", 1).await;
    let store = BucketStore::connect(&env.settings(&[(SHARDED, mode)]))
        .await
        .expect("client");
    // Sharded through mongos when the test servers are a cluster.
    let state = store.init_and_shard().await.expect("init");
    assert!(
        matches!(state, ShardState::NoMongos | ShardState::Sharded),
        "{state:?}"
    );
    let names: Vec<String> = store.collection().list_index_names().await.unwrap();
    let unique = if mode == "true" {
        [
            "customer_prev_unique",
            "customer_history_key_unique",
            "customer_id",
        ]
        .as_slice()
    } else {
        ["prev_unique", "history_key_unique"].as_slice()
    };
    for n in unique.iter().chain(&["customer_tickers"]) {
        assert!(names.iter().any(|x| x == n), "{n} in {names:?}");
    }

    let wrong = BucketStore::connect(&env.settings(&[(SHARDED, other)]))
        .await
        .expect("client");
    match wrong.init().await {
        Err(InitError::Layout(why)) => assert!(
            why.contains("docs/operations.md#sharding") && why.contains(&env.db),
            "{why}"
        ),
        other => panic!("expected a layout refusal, got {other:?}"),
    }
    let (code, stdout, stderr) = binary("init", &env.vars(&[(SHARDED, mode)]));
    assert_eq!(code, Some(0), "{stderr}");
    let layout = if mode == "true" {
        "indexes ready (sharded layout"
    } else {
        "indexes ready (unsharded layout"
    };
    assert!(stdout.starts_with(layout), "{stdout}");
    let vars = env.vars(&[(SHARDED, other)]);
    for command in ["init", "run"] {
        let (code, _, stderr) = binary(command, &vars);
        assert_eq!(code, Some(1), "{command}: {stderr}");
        assert!(
            stderr.contains("docs/operations.md#sharding"),
            "{command}: {stderr}"
        );
    }
    env.cleanup().await;
}

/// A bucket stored with customerId "42" (text) before the move to
/// sharded mode is refused by `init` and by the worker's start-up.
async fn sharded_mode_refuses_customer_ids_stored_as_text() {
    let env = TestEnv::new("layout-canonical", 1).await;
    let sharded = BucketStore::connect(&env.settings(&[(SHARDED, "true")]))
        .await
        .expect("client");
    sharded
        .collection()
        .insert_one(doc! {"_id": "42_1700000000", "customerId": "42", "count": 0})
        .await
        .expect("insert");
    // Refused by the worker's start-up too, not only by `init`: a worker
    // moved to sharded mode without `init` would not find the customer's
    // bucket, start a second chain and store redelivered trades again
    // (issue #46, item 3).
    for refusal in [sharded.init().await, sharded.init_and_shard().await] {
        match refusal {
            Err(InitError::Layout(why)) => assert!(why.contains("42_1700000000"), "{why}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    let (code, _, stderr) = binary("run", &env.vars(&[(SHARDED, "true")]));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("42_1700000000"), "{stderr}");
    env.cleanup().await;
}
