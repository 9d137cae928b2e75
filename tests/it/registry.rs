//! Avro and Protobuf topics through a Schema Registry (issue #48), end to
//! end with the real broker and database. The records are written by
//! confluent-kafka's own `AvroSerializer` and `ProtobufSerializer`
//! (Python, `testkit::produce_avro`, `testkit::produce_protobuf`), so the
//! bytes come from a client nobody here wrote; the registry is the test
//! kit's (`testkit::SchemaRegistry`), stopped and restarted mid-run.

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use mongodb::bson::{Bson, Document};
use rdkafka::Message;
use serde_json::{json, Value};
use testkit::registry::avro_trade_schema;
use testkit::*;
use tradebucket::config::{PayloadFormat, RegistrySettings, Settings, TopicFormat};
use tradebucket::kafka::H_ERROR_KIND;

const T: Duration = Duration::from_secs(60);

/// The writer's first schema: money as an exact decimal, the date as
/// `timestamp-millis`, an optional currency.
static V1: LazyLock<String> = LazyLock::new(|| avro_trade_schema(4, false));

/// Evolved: `currency` removed, `venue` added with a default.
static V2: LazyLock<String> = LazyLock::new(|| avro_trade_schema(4, true));

/// The same trades in Protobuf: the date a `google.protobuf.Timestamp`,
/// money a decimal string, the side an enum whose 0 is `buy`; `Trade` is
/// the file's second message (message indexes `[1]`).
const P1: &str = r#"syntax = "proto3";
package example.trades;
import "google/protobuf/timestamp.proto";
message Envelope { string source = 1; }
message Trade {
  enum Side { buy = 0; sell = 1; }
  string trade_id = 1;
  int64 customer_id = 2;
  Side type = 3;
  string ticker = 4;
  int64 qty = 5;
  string price = 6;
  optional string currency = 7;
  google.protobuf.Timestamp date = 8;
}
"#;

/// Evolved as V2: `currency` removed, `venue` added.
const P2: &str = r#"syntax = "proto3";
package example.trades;
import "google/protobuf/timestamp.proto";
message Envelope { string source = 1; }
message Trade {
  enum Side { buy = 0; sell = 1; }
  reserved 7;
  string trade_id = 1;
  int64 customer_id = 2;
  Side type = 3;
  string ticker = 4;
  int64 qty = 5;
  string price = 6;
  google.protobuf.Timestamp date = 8;
  string venue = 9;
}
"#;

/// Trade `n` for customer `c`, as the Avro producer is given it.
fn avro_trade(prefix: &str, n: i64, c: i64, v2: bool) -> Value {
    let mut t = json!({"tradeId": format!("{prefix}-{n}"), "customerId": c, "type": side(n),
        "ticker": "MDB", "qty": 100 + n, "price": format!("61.{n:02}00"),
        "date": 1_698_335_223_434_i64 + n * 1000});
    if v2 {
        t["venue"] = json!("XNYS");
    } else {
        t["currency"] = json!("USD");
    }
    t
}

/// Trade `n` for customer `c` in proto3's JSON form, as the Protobuf
/// producer is given it: the JSON upstream's form.
fn proto_trade(prefix: &str, n: i64, c: i64, v2: bool) -> Value {
    json_trade(prefix, n, c, v2)
}

/// Every other trade a sell, so both enum values are read (`buy` is the
/// Protobuf enum's 0).
fn side(n: i64) -> &'static str {
    if n % 2 == 0 {
        "sell"
    } else {
        "buy"
    }
}

/// The same trade as a JSON upstream writes it.
fn json_trade(prefix: &str, n: i64, c: i64, v2: bool) -> Value {
    let date = chrono_text(1_698_335_223_434_i64 + n * 1000);
    let mut t = json!({"tradeId": format!("{prefix}-{n}"), "customerId": c, "type": side(n),
        "ticker": "MDB", "qty": 100 + n, "price": format!("61.{n:02}00"), "date": date});
    if v2 {
        t["venue"] = json!("XNYS");
    } else {
        t["currency"] = json!("USD");
    }
    t
}

fn chrono_text(ms: i64) -> String {
    let secs = ms / 1000;
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    // 2023-10-26, the day of every trade here.
    format!("2023-10-26T{h:02}:{m:02}:{s:02}.{:03}Z", ms % 1000)
}

fn settings_for(env: &TestEnv, registry: &str, topics: &[(&str, PayloadFormat)]) -> Settings {
    let names: Vec<&str> = topics.iter().map(|(t, _)| *t).collect();
    let mut s = env.settings(&[("TRADEBUCKET__KAFKA__TOPICS", &names.join(","))]);
    s.formats = topics
        .iter()
        .map(|(t, f)| TopicFormat {
            topic: t.to_string(),
            format: *f,
        })
        .collect();
    s.schema_registry = Some(RegistrySettings {
        url: registry.to_string(),
        username: None,
        password: None,
        bearer_token: None,
        ca_file: None,
        client_identity_file: None,
        request_timeout: Duration::from_secs(2),
        cache_schemas: 100,
    });
    s.validate().expect("valid settings");
    s
}

/// Every stored entry by trade id, without `tradeId` and `key`.
async fn entries(env: &TestEnv) -> BTreeMap<String, Document> {
    let mut out = BTreeMap::new();
    for b in env.buckets().await {
        for h in b.get_array("history").unwrap() {
            let mut e = h.as_document().unwrap().clone();
            let id = e.get_str("tradeId").unwrap().to_string();
            e.remove("tradeId");
            e.remove("key");
            out.insert(id, e);
        }
    }
    out
}

/// Six trades each to an Avro and a Protobuf topic, the writers' schemas
/// evolving after the third (`A-n`, `P-n`), and the same six to the JSON
/// topic `env.topic` (`J-n`).
async fn produce_three_formats(env: &TestEnv, registry: &str, avro: &str, proto: &str) {
    let v1: Vec<Value> = (1..=3).map(|n| avro_trade("A", n, 7, false)).collect();
    let v2: Vec<Value> = (4..=6).map(|n| avro_trade("A", n, 7, true)).collect();
    produce_avro(&env.kafka, registry, avro, &V1, &v1).await;
    // Mid-topic, the upstream's schema evolves (a new id).
    produce_avro(&env.kafka, registry, avro, &V2, &v2).await;
    let p1: Vec<Value> = (1..=3).map(|n| proto_trade("P", n, 7, false)).collect();
    let p2: Vec<Value> = (4..=6).map(|n| proto_trade("P", n, 7, true)).collect();
    let message = "example.trades.Trade";
    produce_protobuf(&env.kafka, registry, proto, P1, message, &p1).await;
    produce_protobuf(&env.kafka, registry, proto, P2, message, &p2).await;
    let json: Vec<Value> = (1..=6).map(|n| json_trade("J", n, 7, n > 3)).collect();
    env.produce_json(&json).await;
}

#[tokio::test]
async fn avro_protobuf_and_json_topics_store_equal_trades_across_a_schema_change() {
    let registry = SchemaRegistry::start().await;
    let env = TestEnv::new("registry-formats", 1).await;
    let (avro_topic, proto_topic) = (
        format!("{}.avro", env.topic),
        format!("{}.proto", env.topic),
    );
    create_topic(&env.kafka, &avro_topic, 2).await;
    create_topic(&env.kafka, &proto_topic, 2).await;
    produce_three_formats(&env, &registry.url(), &avro_topic, &proto_topic).await;

    let settings = settings_for(
        &env,
        &registry.url(),
        &[
            (&env.topic, PayloadFormat::Json),
            (&avro_topic, PayloadFormat::Avro),
            (&proto_topic, PayloadFormat::Protobuf),
        ],
    );
    let worker = Worker::spawn(settings);
    eventually("all eighteen trades stored", T, || async {
        entries(&env).await.len() == 18
    })
    .await;
    let metrics = worker.stop().await;
    let stored = entries(&env).await;
    for n in 1..=6 {
        let j = &stored[&format!("J-{n}")];
        let (a, p) = (&stored[&format!("A-{n}")], &stored[&format!("P-{n}")]);
        assert_eq!(a, j, "trade {n}: Avro entry differs from the JSON one");
        assert_eq!(p, j, "trade {n}: Protobuf entry differs from the JSON one");
        // In the same order too (a Document's equality ignores it).
        assert!(
            a.keys().eq(j.keys()) && p.keys().eq(j.keys()),
            "{a}\n{p}\n{j}"
        );
    }
    // Exact money: Decimal128, the scale kept; the Timestamp is the date.
    for id in ["A-1", "P-1", "J-1"] {
        match stored[id].get("price") {
            Some(Bson::Decimal128(d)) => assert_eq!(d.to_string(), "61.0100", "{id}"),
            other => panic!("{id}: price is not a Decimal128: {other:?}"),
        }
        let date = stored[id].get_datetime("date").unwrap();
        assert_eq!(date.timestamp_millis(), 1_698_335_224_434, "{id}");
    }
    assert_eq!(stored["P-2"].get_str("type").unwrap(), "sell");
    assert_eq!(stored["P-4"].get_str("venue").unwrap(), "XNYS");
    assert_eq!(metrics.schema_fetches.get(), 4, "one fetch per schema id");
    assert!(metrics.schema_cache_hits.get() >= 8);
    assert_eq!(env.committed().values().sum::<i64>(), 6);
    for topic in [&avro_topic, &proto_topic] {
        let _ = admin(&env.kafka)
            .delete_topics(&[topic], &rdkafka::admin::AdminOptions::new())
            .await;
    }
    env.cleanup().await;
}

#[tokio::test]
async fn a_registry_outage_holds_and_permanent_faults_are_dead_letters() {
    let mut registry = SchemaRegistry::start().await;
    let env = TestEnv::new("registry-outage", 1).await;
    // The test's own topic is the Avro one here (its committed offsets
    // are what `env` reads).
    let avro_topic = env.topic.clone();
    produce_good_and_bad(&registry, &env).await;

    registry.stop().await;
    let settings = settings_for(&env, &registry.url(), &[(&avro_topic, PayloadFormat::Avro)]);
    let worker = Worker::spawn(settings);
    eventually("readiness names the registry", T, || async {
        worker
            .health
            .readiness()
            .err()
            .is_some_and(|r| r.contains("Schema Registry unavailable"))
    })
    .await;
    // Held: a few retries, and still nothing stored, committed or
    // dead-lettered (the bad records wait in the same batch).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(entries(&env).await.is_empty());
    assert!(
        env.committed().values().all(|&o| o <= 0),
        "{:?}",
        env.committed()
    );
    assert!(env.dead_letters(1, Duration::from_secs(2)).await.is_empty());

    registry.restart().await;
    eventually("every good trade stored", T, || async {
        entries(&env).await.len() == 8
    })
    .await;
    let dead = env.dead_letters(4, T).await;
    let mut kinds: Vec<String> = dead
        .iter()
        .map(|m| header(m, H_ERROR_KIND).unwrap_or_default())
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "invalid_format",
            "invalid_format",
            "invalid_schema",
            "unknown_schema"
        ]
    );
    env.wait_committed_to_end(T).await;
    assert!(worker.health.readiness().is_ok());
    let metrics = worker.stop().await;
    assert!(
        metrics
            .registry_error(tradebucket::metrics::RegistryErrorKind::Unavailable)
            .get()
            >= 1
    );
    // Nothing doubled: each trade once.
    assert_eq!(entries(&env).await.len(), 8);
    assert_eq!(env.dead_letters(5, Duration::from_secs(2)).await.len(), 4);
    env.cleanup().await;
}

/// Eight good Avro trades (customer 9) around four bad records: no magic
/// byte, a truncated header, a schema id the registry does not know (999)
/// and one it answers with no schema (garbled).
async fn produce_good_and_bad(registry: &SchemaRegistry, env: &TestEnv) {
    let avro_topic = &env.topic;
    let good: Vec<Value> = (1..=5).map(|n| avro_trade("A", n, 9, false)).collect();
    produce_avro(&env.kafka, &registry.url(), avro_topic, &V1, &good).await;
    // Ids 1 (V1) exists; 999 does not; id 2 answers with no schema.
    let garbled = registry.register("other-value", "AVRO", r#""string""#);
    registry.garble(garbled, r#"{"schema":"{\"type\":\"record\"}"}"#);
    let with_id = |id: u32, body: &[u8]| {
        let mut p = vec![0];
        p.extend_from_slice(&id.to_be_bytes());
        p.extend_from_slice(body);
        Produced {
            payload: Some(p),
            ..Produced::default()
        }
    };
    let bad = [
        Produced {
            payload: Some(br#"{"customerId":9}"#.to_vec()),
            ..Produced::default()
        },
        Produced {
            payload: Some(vec![0, 0, 1]),
            ..Produced::default()
        },
        with_id(999, b"\x02"),
        with_id(garbled, b"\x02"),
    ];
    produce_fast(&env.kafka, avro_topic, &bad).await;
    let more: Vec<Value> = (6..=8).map(|n| avro_trade("A", n, 9, false)).collect();
    produce_avro(&env.kafka, &registry.url(), avro_topic, &V1, &more).await;
}

/// The `--config` file of a deployment whose `topic` is Avro, read through
/// `registry`.
fn avro_config(env: &TestEnv, registry: &str, topic: &str) -> BTreeMap<String, String> {
    let text = format!(
        "[[formats]]\ntopic = \"{topic}\"\nformat = \"avro\"\n\n\
         [schema_registry]\nurl = \"{registry}\"\nrequest_timeout = \"2s\"\n"
    );
    let path = std::env::temp_dir().join(format!("{}-avro.toml", env.group));
    std::fs::write(&path, text).expect("write the config file");
    let mut vars = env.vars(&[]);
    vars.insert("TRADEBUCKET_CONFIG".into(), path.display().to_string());
    vars
}

/// `tradebucket ARGS` with `vars`: (exit code, stdout, stderr).
fn run(vars: &BTreeMap<String, String>, args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(crate::bin())
        .args(args)
        .envs(vars)
        .output()
        .expect("run tradebucket");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// `tradebucket reconcile --json ARGS`: (exit code, the report).
fn reconcile(vars: &BTreeMap<String, String>, args: &[&str]) -> (Option<i32>, Value) {
    let mut all = vec!["reconcile", "--json", "--rate", "0", "--timeout", "30s"];
    all.extend(args);
    let (code, out, err) = run(vars, &all);
    let report = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} / {err}"));
    (code, report)
}

/// Four Avro trades of customer 5 (`R-1`..`R-4`, offsets 0-3) and a
/// record without the magic byte (offset 4).
async fn produce_four_and_one_bad(env: &TestEnv, registry: &str) {
    let good: Vec<Value> = (1..=4).map(|n| avro_trade("R", n, 5, false)).collect();
    produce_avro(&env.kafka, registry, &env.topic, &V1, &good).await;
    let bad = Produced {
        payload: Some(br#"{"customerId":5}"#.to_vec()),
        ..Produced::default()
    };
    produce_fast(&env.kafka, &env.topic, &[bad]).await;
}

/// Runs the worker with `vars` until `n` trades are stored and the topic
/// is committed to its end.
async fn work_until_stored(env: &TestEnv, vars: &BTreeMap<String, String>, n: usize) {
    let worker = WorkerProcess::start(crate::bin(), vars, Log::Quiet);
    eventually("the trades stored", T, || async {
        entries(env).await.len() == n
    })
    .await;
    env.wait_committed_to_end(T).await;
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));
}

// Multi-threaded: the commands run blocking while the test kit's
// registry answers them from this process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_reads_avro_records_as_the_worker_does_and_replays_their_bytes() {
    let mut registry = SchemaRegistry::start().await;
    let env = TestEnv::new("registry-reconcile", 1).await;
    produce_four_and_one_bad(&env, &registry.url()).await;
    let vars = avro_config(&env, &registry.url(), &env.topic);
    work_until_stored(&env, &vars, 4).await;
    assert_eq!(env.dead_letters(1, T).await.len(), 1);

    // Read as JSON, the four would be bad records without dead letters.
    let (code, report) = reconcile(&vars, &[]);
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(report["total"]["stored"], 4, "{report}");
    assert_eq!(report["total"]["dead_lettered"], 1, "{report}");

    // Lost by hand: named by their offsets, and put back.
    let store = env.store().await;
    let buckets = store
        .client()
        .database(&env.db)
        .collection::<Document>("trades");
    buckets.delete_many(mongodb::bson::doc! {}).await.unwrap();
    let (code, report) = reconcile(&vars, &["--replay-missing"]);
    assert_eq!(code, Some(1), "{report}");
    let missing: Vec<i64> = report["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["offset"].as_i64().unwrap())
        .collect();
    assert_eq!(missing, [0, 1, 2, 3], "{report}");
    assert_eq!(report["replayed"], 4, "{report}");
    work_until_stored(&env, &vars, 4).await;
    // Each replay is its original's bytes: the worker read them as Avro.
    let records = env.records_to_end();
    assert_eq!(records.len(), 9);
    for i in 0..4 {
        assert_eq!(records[5 + i].payload(), records[i].payload(), "offset {i}");
    }
    let (code, report) = reconcile(&vars, &[]);
    assert_eq!(
        (code, &report["total"]["stored"]),
        (Some(0), &json!(4)),
        "{report}"
    );

    // A registry down: reconcile stops, naming it, rather than call the
    // records bad.
    registry.stop().await;
    let (code, _, err) = run(&vars, &["reconcile", "--timeout", "2s"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("Schema Registry unavailable"), "{err}");
    env.cleanup().await;
}

// Multi-threaded: the commands run blocking while the test kit's
// registry answers them from this process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_avro_topic_read_as_json_is_put_right_by_dlq_replay_with_its_bytes() {
    let registry = SchemaRegistry::start().await;
    let env = TestEnv::new("registry-replay", 1).await;
    produce_four_and_one_bad(&env, &registry.url()).await;
    // The format forgotten: every record a dead letter.
    let json_vars = env.vars(&[]);
    let worker = WorkerProcess::start(crate::bin(), &json_vars, Log::Quiet);
    assert_eq!(env.dead_letters(5, T).await.len(), 5);
    env.wait_committed_to_end(T).await;
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));

    // Put right: the dry run decodes each by the topic's format now.
    let vars = avro_config(&env, &registry.url(), &env.topic);
    let (code, out, err) = run(&vars, &["dlq", "replay", "--all", "--dry-run"]);
    assert_eq!(code, Some(0), "{err}");
    for n in 1..=4 {
        let line = format!(
            "as {}/0/{}: a trade of customer 5, key t:R-{n}",
            env.topic,
            n - 1
        );
        assert!(out.contains(&line), "{line} in\n{out}");
    }
    assert!(
        out.contains("/0/4: a dead letter again (invalid_format: first byte is 0x7b"),
        "{out}"
    );
    assert!(entries(&env).await.is_empty(), "a dry run sends nothing");

    let (code, _, err) = run(&vars, &["dlq", "replay", "--all", "--rate", "0"]);
    assert_eq!(code, Some(0), "{err}");
    work_until_stored(&env, &vars, 4).await;
    let records = env.records_to_end();
    assert_eq!(records.len(), 10);
    for i in 0..5 {
        assert_eq!(records[5 + i].payload(), records[i].payload(), "offset {i}");
    }
    // The bad one is dead-lettered again, the rest stored once.
    assert_eq!(env.dead_letters(6, T).await.len(), 6);
    assert_eq!(entries(&env).await.len(), 4);
    // The four originals are dead-lettered and stored, by replays that
    // reconcile reads too: accounted for, not a problem.
    let (code, report) = reconcile(&vars, &[]);
    assert_eq!(code, Some(0), "{report}");
    let total = &report["total"];
    assert_eq!(total["dead_letters_replayed"], 4, "{report}");
    assert_eq!(total["dead_lettered"], 6, "{report}");
    env.cleanup().await;
}

// Multi-threaded: the command runs blocking while the test kit's registry
// answers it from this process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn map_reads_binary_samples_through_the_registry() {
    let registry = SchemaRegistry::start().await;
    let env = TestEnv::new("registry-map", 1).await;
    produce_four_and_one_bad(&env, &registry.url()).await;
    let records = env.records_to_end();
    let vars = avro_config(&env, &registry.url(), &env.topic);
    let dir = std::env::temp_dir();

    // One record as consumed, its bytes the whole file.
    let one = dir.join(format!("{}-one.bin", env.group));
    std::fs::write(&one, records[0].payload().unwrap()).unwrap();
    let (code, out, err) = run(&vars, &["map", "--sample", one.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let shown: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(shown["customerId"], 5, "{shown}");
    assert_eq!(shown["entry"]["key"], "t:R-1", "{shown}");
    assert_eq!(
        shown["entry"]["price"]["$numberDecimal"], "61.0100",
        "{shown}"
    );
    assert_eq!(shown["entry"]["date"]["$date"], "2023-10-26T15:47:04.434Z");

    // Records in base64, one a line: the bad one is the dead letter it was.
    let lines = dir.join(format!("{}-lines.txt", env.group));
    let text: String = [&records[1], &records[4]]
        .iter()
        .map(|m| format!("{}\n", base64(m.payload().unwrap())))
        .collect();
    std::fs::write(&lines, text).unwrap();
    let (code, out, err) = run(&vars, &["map", "--sample", lines.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    let shown: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(shown[0]["entry"]["key"], "t:R-2", "{out}");
    assert_eq!(shown[1]["deadLetter"]["kind"], "invalid_format", "{out}");
    assert!(err.contains("1 samples would be dead-lettered"), "{err}");
    env.cleanup().await;
}

/// Standard base64 with padding.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = (0..3).fold(0u32, |n, i| n << 8 | u32::from(*chunk.get(i).unwrap_or(&0)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}
