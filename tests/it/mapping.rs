//! Input mappings end to end, with the product binary (the release one
//! under `cargo test --release`) and the real servers: two upstreams that
//! send other JSON than ours, each on its own topic with its own mapping,
//! written into one collection exactly as the default schema stores the
//! same trades, beside a topic of the default schema; a side code outside
//! the map dead-lettered, naming it; `reconcile` decoding by the same
//! mappings; `map --sample` showing it all before deployment.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use mongodb::bson::{Bson, Document};
use serde_json::Value;
use testkit::*;
use tradebucket::event::{decode, Source};
use tradebucket::kafka::{H_ERROR_KIND, H_ERROR_MESSAGE};

use crate::bin;

const T: Duration = Duration::from_secs(60);

/// The two mappings, for topics `<fix>` and `<broker>`.
fn config(fix: &str, broker: &str) -> String {
    format!(
        r#"
[[mappings]]
topic = "{fix}"
keep = "none"
fields.customerId = {{ from = "key" }}
fields.tradeId = {{ from = "/ExecID" }}
fields.type = {{ from = "/Side", values = {{ buy = ["1"], sell = ["2"] }}, unknown = "reject" }}
fields.ticker = {{ from = "/Symbol" }}
fields.qty = {{ from = "/LastQty" }}
fields.price = {{ from = "/LastPx" }}
fields.currency = {{ from = "/Currency" }}
fields.date = {{ from = "/TransactTime", format = "fix" }}

[[mappings]]
topic = "{broker}"
keep = {{ venue = "/fill/venue" }}
fields.customerId = {{ from = "/account/id" }}
fields.tradeId = {{ from = "header:fill-id" }}
fields.type = {{ from = "/side", values = {{ buy = ["BUY", "B"], sell = ["SELL", "S"] }}, unknown = "reject" }}
fields.ticker = {{ from = "/instrument/ticker" }}
fields.qty = {{ from = "/fill/qty" }}
fields.price = {{ from = "/fill/px" }}
fields.date = {{ from = "/ts", format = "epoch_millis" }}
"#
    )
}

/// A FIX-style execution report for account 123, keyed by the account.
fn execution(exec_id: &str, side: &str, qty: &str, px: &str, time: &str) -> Produced {
    let payload = serde_json::json!({
        "Account": "123", "Symbol": "MDB", "Side": side, "LastQty": qty, "LastPx": px,
        "Currency": "USD", "TransactTime": time, "ExecID": exec_id,
    });
    Produced {
        key: Some("123".into()),
        payload: Some(payload.to_string().into_bytes()),
        ..Produced::default()
    }
}

/// A nested broker fill, its id in a header.
fn fill(id: &str, account: u64, side: &str, qty: u64, px: &str, ts: i64) -> Produced {
    let payload = format!(
        r#"{{"account":{{"id":{account}}},"instrument":{{"ticker":"MDB"}},"side":"{side}","fill":{{"qty":{qty},"px":{px},"venue":"XNAS"}},"ts":{ts}}}"#
    );
    Produced {
        payload: Some(payload.into_bytes()),
        headers: vec![("fill-id".into(), id.into())],
        ..Produced::default()
    }
}

/// Each upstream record with the same trade in the default schema.
type Feed = Vec<(Produced, Value)>;

/// The FIX-style feed and the broker's.
fn trades() -> (Feed, Feed) {
    let fix = vec![
        (
            execution("E-9001", "1", "419", "61.25", "20231026-15:47:03.434"),
            serde_json::json!({"tradeId": "E-9001", "customerId": 123, "type": "buy", "ticker": "MDB",
                "qty": 419, "price": "61.25", "currency": "USD", "date": "2023-10-26T15:47:03.434Z"}),
        ),
        (
            execution("E-9002", "2", "0.5", "61.30", "20231026-15:47:04"),
            serde_json::json!({"tradeId": "E-9002", "customerId": 123, "type": "sell", "ticker": "MDB",
                "qty": "0.5", "price": "61.30", "currency": "USD", "date": 1_698_335_224_000_i64}),
        ),
    ];
    let broker = vec![
        (
            fill("F-1", 123, "BUY", 419, "61.25", 1_698_335_225_434),
            serde_json::json!({"tradeId": "F-1", "customerId": 123, "type": "buy", "ticker": "MDB",
                "qty": 419, "price": 61.25, "date": 1_698_335_225_434_i64, "venue": "XNAS"}),
        ),
        (
            fill("F-2", 77, "S", 10, "\"100.10\"", 1_698_335_226_000),
            serde_json::json!({"tradeId": "F-2", "customerId": "77", "type": "sell", "ticker": "MDB",
                "qty": 10, "price": "100.10", "date": "2023-10-26T15:47:06Z", "venue": "XNAS"}),
        ),
    ];
    (fix, broker)
}

/// The history entry the default schema stores for `json`, without its
/// key (which holds the record's position only when there is no trade id).
fn default_entry(json: &Value) -> Document {
    let source = Source {
        topic: "any".into(),
        partition: 0,
        offset: 0,
    };
    decode(Some(json.to_string().as_bytes()), &source, 1 << 20)
        .expect("the default schema reads it")
        .entry()
        .expect("entry")
}

/// Every stored entry, by trade key, with its customer's `_id` prefix.
async fn stored(env: &TestEnv) -> BTreeMap<String, (String, Document)> {
    let mut out = BTreeMap::new();
    for b in env.buckets().await {
        let customer = b
            .get_str("_id")
            .unwrap()
            .split('_')
            .next()
            .unwrap()
            .to_string();
        for h in b.get_array("history").unwrap() {
            let entry = h.as_document().unwrap().clone();
            out.insert(
                entry.get_str("key").unwrap().to_string(),
                (customer.clone(), entry),
            );
        }
    }
    out
}

/// `tradebucket reconcile --json` with `vars`: (exit code, the report).
fn reconcile(vars: &BTreeMap<String, String>) -> (Option<i32>, Value) {
    let out = Command::new(bin())
        .args(["reconcile", "--json", "--rate", "0"])
        .envs(vars)
        .output()
        .expect("run tradebucket reconcile");
    let report = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code(), report)
}

fn write_config(env: &TestEnv, text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("{}.toml", env.group));
    std::fs::write(&path, text).expect("write the config file");
    path
}

#[tokio::test]
async fn two_upstreams_map_into_one_collection_as_the_default_schema_stores_them() {
    let env = TestEnv::new("mapping", 1).await;
    let (fix_topic, broker_topic) = (
        format!("{}.fix", env.topic),
        format!("{}.broker", env.topic),
    );
    create_topic(&env.kafka, &fix_topic, 1).await;
    create_topic(&env.kafka, &broker_topic, 2).await;
    let file = write_config(&env, &config(&fix_topic, &broker_topic));
    let topics = format!("{},{fix_topic},{broker_topic}", env.topic);
    let mut vars = env.vars(&[("TRADEBUCKET__KAFKA__TOPICS", &topics)]);
    vars.insert("TRADEBUCKET_CONFIG".into(), file.display().to_string());

    let (fix, broker) = trades();
    let mut sent: Vec<Produced> = fix.iter().map(|(p, _)| p.clone()).collect();
    // A side code outside the map: dead-lettered, naming it and its pointer.
    sent.push(execution("E-9003", "5", "1", "1", "20231026-15:47:05"));
    produce_fast(&env.kafka, &fix_topic, &sent).await;
    produce_fast(&env.kafka, &broker_topic, broker.iter().map(|(p, _)| p)).await;
    // The default schema's own topic, beside them in the same collection.
    let plain = serde_json::json!({"tradeId": "P-1", "customerId": 123, "type": "buy", "ticker": "MDB",
        "qty": 1, "date": "2023-10-26T15:47:07Z", "note": "plain"});
    env.produce_json(std::slice::from_ref(&plain)).await;

    let worker = WorkerProcess::start(bin(), &vars, Log::Quiet);
    eventually("every trade stored", T, || async {
        stored(&env).await.len() == 5
    })
    .await;
    let dead = env.dead_letters(1, T).await;
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));

    let stored = stored(&env).await;
    let expected = fix.iter().chain(&broker).map(|(_, v)| v).chain([&plain]);
    for json in expected {
        let id = json["tradeId"].as_str().unwrap();
        let (customer, entry) = &stored[&format!("t:{id}")];
        assert_eq!(
            customer,
            &json["customerId"].to_string().trim_matches('"'),
            "{id}"
        );
        assert_eq!(
            entry,
            &default_entry(json),
            "{id}: stored as the default schema stores it"
        );
    }
    assert!(matches!(
        stored["t:E-9001"].1.get("price"),
        Some(Bson::Decimal128(_))
    ));
    assert_eq!(dead.len(), 1);
    assert_eq!(
        header(&dead[0], H_ERROR_KIND).as_deref(),
        Some("invalid_field")
    );
    assert_eq!(
        header(&dead[0], H_ERROR_MESSAGE).as_deref(),
        Some("type (from /Side): \"5\" is not in the value map, and unknown values are rejected")
    );

    // Reconcile decodes by the same mappings: the fill ids from headers
    // are found, the dead letter matched.
    let (code, report) = reconcile(&vars);
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(report["total"]["stored"], 5, "{report}");
    assert_eq!(report["total"]["dead_lettered"], 1, "{report}");

    let _ = admin(&env.kafka)
        .delete_topics(
            &[&fix_topic, &broker_topic],
            &rdkafka::admin::AdminOptions::new(),
        )
        .await;
    let _ = std::fs::remove_file(file);
    env.cleanup().await;
}

/// `map --sample` prints what the worker would store or dead-letter, and
/// `check-config` refuses a broken mapping naming topic and field.
#[tokio::test]
async fn map_sample_shows_each_trade_or_dead_letter_before_deployment() {
    let env = TestEnv::new("mapsample", 1).await;
    let (fix_topic, broker_topic) = (
        format!("{}.fix", env.topic),
        format!("{}.broker", env.topic),
    );
    let file = write_config(&env, &config(&fix_topic, &broker_topic));
    let topics = format!("{fix_topic},{broker_topic}");
    let mut vars = env.vars(&[("TRADEBUCKET__KAFKA__TOPICS", &topics)]);
    vars.insert("TRADEBUCKET_CONFIG".into(), file.display().to_string());
    let samples = std::env::temp_dir().join(format!("{}.jsonl", env.group));
    let (_, broker) = trades();
    let lines: Vec<String> = broker
        .iter()
        .map(|(p, _)| String::from_utf8(p.payload.clone().unwrap()).unwrap())
        .chain([String::from_utf8(fill("F-3", 1, "HOLD", 1, "1", 0).payload.unwrap()).unwrap()])
        .collect();
    std::fs::write(&samples, lines.join("\n")).unwrap();
    let run = |extra: &[&str]| {
        let out = Command::new(bin())
            .args([
                "map",
                "--sample",
                samples.to_str().unwrap(),
                "--topic",
                &broker_topic,
            ])
            .args(extra)
            .envs(&vars)
            .output()
            .expect("run tradebucket map");
        let shown: Vec<Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        (out.status.code(), shown)
    };
    let (code, shown) = run(&["--header", "fill-id=F-1"]);
    assert_eq!(code, Some(1), "one sample would be dead-lettered");
    assert_eq!(shown[0]["customerId"], 123);
    assert_eq!(shown[0]["entry"]["key"], "t:F-1");
    assert_eq!(shown[0]["entry"]["price"]["$numberDecimal"], "61.25");
    assert_eq!(shown[1]["customerId"], 77);
    assert_eq!(shown[2]["deadLetter"]["kind"], "invalid_field");
    let message = shown[2]["deadLetter"]["message"].as_str().unwrap();
    assert!(
        message.contains("(from /side)") && message.contains("HOLD"),
        "{message}"
    );
    let (_, shown) = run(&[]);
    assert_eq!(
        shown[0]["entry"]["key"],
        "o:".to_string() + &broker_topic + "/0/0",
        "no header: the position"
    );

    std::fs::write(
        &file,
        config(&fix_topic, &broker_topic).replace(", unknown = \"reject\"", ""),
    )
    .unwrap();
    let out = Command::new(bin())
        .arg("check-config")
        .envs(&vars)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "mapping of topic {fix_topic:?}, type: a value map needs a rule"
        )),
        "{err}"
    );
    let _ = std::fs::remove_file(file);
    let _ = std::fs::remove_file(samples);
    env.cleanup().await;
}

/// A dead letter of a mapped topic, replayed with a corrected payload
/// (twice), is read by the mapping again: its customer from the record key
/// and its trade id from a header, both carried by the replay, so it is
/// stored once, under that customer and that id.
#[tokio::test]
async fn a_mapped_dead_letter_replays_under_its_key_and_header_identity() {
    let env = TestEnv::new("mapreplay", 1).await;
    let mapping = config(&env.topic, "unused")
        .split("\n[[mappings]]")
        .nth(1)
        .map(|fix| format!("[[mappings]]{fix}"))
        .unwrap()
        .replace(r#"{ from = "/ExecID" }"#, r#"{ from = "header:exec-id" }"#);
    let file = write_config(&env, &mapping);
    let mut vars = env.vars(&[]);
    vars.insert("TRADEBUCKET_CONFIG".into(), file.display().to_string());
    let mut bad = execution("ignored", "5", "7", "10.5", "20231026-15:47:03");
    bad.headers = vec![("exec-id".into(), "X-1".into())];
    env.produce(&[bad.clone()]).await;
    let worker = WorkerProcess::start(bin(), &vars, Log::Quiet);
    assert_eq!(env.dead_letters(1, T).await.len(), 1);

    let corrected = std::env::temp_dir().join(format!("{}.json", env.group));
    let payload = String::from_utf8(bad.payload.unwrap()).unwrap();
    std::fs::write(
        &corrected,
        payload.replace(r#""Side":"5""#, r#""Side":"2""#),
    )
    .unwrap();
    for round in 0..2 {
        let out = Command::new(bin())
            .args(["dlq", "replay", "--all", "--rate", "0", "--payload"])
            .arg(&corrected)
            .envs(&vars)
            .output()
            .expect("run tradebucket dlq replay");
        assert_eq!(out.status.code(), Some(0), "round {round}: {out:?}");
        env.wait_committed_to_end(T).await;
    }
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));
    let stored = stored(&env).await;
    assert_eq!(stored.len(), 1, "stored once: {stored:?}");
    let (customer, entry) = &stored["t:X-1"];
    assert_eq!(customer, "123", "the customer from the replayed key");
    assert_eq!(entry.get_str("type").unwrap(), "sell");
    assert_eq!(
        env.dead_letters_to_end().len(),
        1,
        "nothing more dead-lettered"
    );
    let _ = std::fs::remove_file(file);
    let _ = std::fs::remove_file(corrected);
    env.cleanup().await;
}
