//! Scenario 16: an Avro topic (issue #48). The records are written by
//! confluent-kafka's own `AvroSerializer` against the test kit's Schema
//! Registry, so the bytes come from a client nobody here wrote; the worker
//! is killed -9 and restarted, the registry is down while the
//! fresh worker (its schema cache empty) takes the partitions, and the
//! writer's schema evolves mid-run (a new id), with another kill -9 in the
//! middle of the evolved records. The verdict is every scenario's:
//! nothing lost or doubled, no dead letter (each fault was transient),
//! committed to the end, `audit` and `reconcile` clean.

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use testkit::registry::{avro_trade_schema, Enveloped};
use testkit::{free_port, http_get, poll_until, produce_avro_placed, SchemaRegistry};

use crate::harness::*;
use crate::scenarios::probe_readyz_until;

/// The writer's first schema: money as an exact decimal (cents, as the
/// generator writes them), the date as `timestamp-millis`.
static V1: LazyLock<String> = LazyLock::new(|| avro_trade_schema(2, false));

/// Evolved for the last third: `currency` removed, `venue` added with a
/// default; registered under the same subject, so a new id.
static V2: LazyLock<String> = LazyLock::new(|| avro_trade_schema(2, true));

/// 16. An Avro topic through the registry: kill -9, a registry outage met
///     by a fresh worker, a schema change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s16_avro_topic_kill9_and_registry_outage() {
    let n = events(10_000, 100_000);
    let outage = Duration::from_secs(pick(10, 30));
    let mut registry = SchemaRegistry::start().await;
    let stack = Stack::start("s16-avro-registry", 4).await;
    let config = avro_config(&stack, &registry.url());
    let mut s = Scenario::on(
        stack,
        "s16-avro-registry",
        "An Avro topic: kill -9, registry outage, schema change",
        &[("TRADEBUCKET_CONFIG", config.as_str())],
    );
    s.reconcile = true;
    let recs = number(good_events(16, n, true));
    let (third, url) = (n / 3, registry.url());
    let mut placed = produce_avro(&s, &url, &V1, &recs[..third]).await;
    // Killed at its first trades written (its own metrics): the group's
    // commits move too seldom to land a kill mid-ingest on so few records.
    let (w, port) = worker(&mut s);
    kill_when(&mut s, w, port, WRITTEN, 1).await;
    // The second third waits in Kafka for the next worker, which will
    // meet it with no schema in memory and the registry down.
    placed.extend(produce_avro(&s, &url, &V1, &recs[third..2 * third]).await);
    registry.stop().await;
    s.fault("registry stopped".into());
    let w = registry_outage(&mut s, outage).await;
    registry.restart().await;
    s.fault("registry restarted on the same port and schemas".into());
    ready_again(&mut s).await;
    // The last third under an evolved schema, produced while the worker
    // reads it; killed at its first commit of them, and the next worker
    // starts with an empty cache and fetches the evolved schema's id.
    let env = &s.stack.env;
    let last = avro_records(&recs[2 * third..], true);
    let (kafka, topic) = (env.kafka.clone(), env.topic.clone());
    let producer =
        tokio::spawn(async move { produce_avro_placed(&kafka, &url, &topic, &V2, &last).await });
    s.fault("the last third written under an evolved schema (a new id)".into());
    let port = port_of(&s);
    kill_when(&mut s, w, port, FETCHES, 2).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let w = s.fleet.start();
    placed.extend(producer.await.expect("the Avro producer"));
    s.finish(vec![w], &recs, &placed).await;
}

/// `tradebucket_events_written_total`: trades a worker stored.
const WRITTEN: &str = "tradebucket_events_written_total";
/// `tradebucket_schema_fetches_total`: schemas a worker fetched.
const FETCHES: &str = "tradebucket_schema_fetches_total";

/// A worker with its HTTP port (readiness, metrics).
fn worker(s: &mut Scenario) -> (testkit::WorkerProcess, u16) {
    let port = free_port();
    let w = s
        .fleet
        .start_with(&[("TRADEBUCKET__HTTP__LISTEN", format!("127.0.0.1:{port}"))]);
    s.note("http_port", json!(port));
    (w, port)
}

/// The port of the last worker [`worker`] started.
fn port_of(s: &Scenario) -> u16 {
    let port = s.notes["http_port"].as_u64().unwrap_or_default();
    u16::try_from(port).unwrap_or_default()
}

/// Kills `w` with kill -9 once its `series` reaches `at_least`; records
/// where the group's commits and the topic stood.
async fn kill_when(
    s: &mut Scenario,
    w: testkit::WorkerProcess,
    port: u16,
    series: &str,
    at_least: u64,
) {
    let reached = poll_until(
        Duration::from_secs(120),
        Duration::from_millis(10),
        || async { worker_metric(port, series).await >= Some(at_least) },
    )
    .await;
    if !reached {
        s.failures
            .push(format!("{series} never reached {at_least} within 120 s"));
    }
    w.kill9();
    let (at, end) = (s.stack.committed_total(), s.stack.end_offsets());
    s.fault(format!(
        "kill -9 worker at {series} >= {at_least}: {at} committed of {} produced",
        end.values().sum::<i64>()
    ));
}

/// The worker's `--config` file: the scenario's topic is Avro.
fn avro_config(stack: &Stack, registry: &str) -> String {
    let text = format!(
        "[[formats]]\ntopic = \"{}\"\nformat = \"avro\"\n\n\
         [schema_registry]\nurl = \"{registry}\"\nrequest_timeout = \"2s\"\n",
        stack.env.topic
    );
    let path = report_dir().join(format!("{}-avro.toml", stack.env.group));
    std::fs::create_dir_all(report_dir()).expect("the report folder");
    std::fs::write(&path, text).expect("write the config file");
    path.display().to_string()
}

/// `recs` written by confluent-kafka's `AvroSerializer` under `schema`,
/// keyed and with their headers as [`produce`] writes them.
async fn produce_avro(s: &Scenario, registry: &str, schema: &str, recs: &[Rec]) -> Vec<(i32, i64)> {
    let records = avro_records(recs, schema == V2.as_str());
    let env = &s.stack.env;
    produce_avro_placed(&env.kafka, registry, &env.topic, schema, &records).await
}

/// `recs` as the Avro producer takes them: key, headers, value.
fn avro_records(recs: &[Rec], v2: bool) -> Vec<Enveloped> {
    recs.iter()
        .map(|r| {
            let payload = r.msg.payload.as_deref().expect("a good record");
            let t: Value = serde_json::from_slice(payload).expect("the generator's JSON");
            (r.msg.key.clone(), r.msg.headers.clone(), avro_value(&t, v2))
        })
        .collect()
}

/// The generator's trade as the Avro producer is given it (the price as
/// decimal text, which the producer makes a `Decimal`).
fn avro_value(t: &Value, v2: bool) -> Value {
    let mut v = json!({"tradeId": t["tradeId"], "customerId": t["customerId"], "type": t["type"],
        "ticker": t["ticker"], "qty": t["qty"], "price": t["price"], "date": t["date"]});
    if v2 {
        v["venue"] = json!("XNYS");
    } else {
        v["currency"] = t["currency"].clone();
    }
    v
}

/// A fresh worker (no schema in memory) started with the registry down:
/// once it owns every partition it is held for `outage` and must commit
/// nothing, dead-letter nothing, and say why it is not ready.
async fn registry_outage(s: &mut Scenario, outage: Duration) -> testkit::WorkerProcess {
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (w, port) = worker(s);
    let owned = poll_until(Duration::from_secs(90), POLL, || async {
        worker_metric(port, ASSIGNED).await == Some(4)
    })
    .await;
    if !owned {
        s.failures
            .push("the restarted worker never owned every partition".into());
    }
    let (committed, dead) = (s.stack.committed(), s.stack.env.dead_letters_to_end().len());
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    // Its first batch has to close and meet the registry before readiness
    // can say so; from then on every probe must.
    let held = poll_until(Duration::from_secs(30), POLL, || async {
        matches!(http_get(&readyz).await, Some((503, _)))
    })
    .await;
    if !held {
        s.failures
            .push("readiness never said the registry was down".into());
    }
    let (probes, not_ready, reasons) = probe_readyz_until(&readyz, Instant::now() + outage).await;
    let (moved, dead_after) = (
        s.stack.committed() != committed,
        s.stack.env.dead_letters_to_end().len() - dead,
    );
    s.fault(format!(
        "a fresh worker held {} s with the registry down",
        outage.as_secs()
    ));
    s.note("readyz_probes_during_outage", json!(probes));
    s.note("readyz_not_ready_during_outage", json!(not_ready));
    s.note("readyz_reasons", json!(reasons));
    s.note("committed_moved_during_outage", json!(moved));
    s.note("dead_letters_during_outage", json!(dead_after));
    let names_it = reasons.iter().any(|r| r.contains("Schema Registry"));
    if moved || dead_after > 0 || not_ready < probes || !names_it {
        s.failures.push(format!(
            "during the registry outage: committed moved {moved}, {dead_after} dead letters, \
             {not_ready}/{probes} probes not ready, reasons {reasons:?}"
        ));
    }
    w
}

/// Once the registry is back, the held worker is ready again.
async fn ready_again(s: &mut Scenario) {
    let port = port_of(s);
    let back = Instant::now();
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    let ready = poll_until(Duration::from_secs(60), POLL, || async {
        matches!(http_get(&readyz).await, Some((200, _)))
    })
    .await;
    s.note(
        "seconds_to_ready_after_registry_restart",
        json!(ready.then(|| back.elapsed().as_secs_f64())),
    );
    if !ready {
        s.failures
            .push("not ready within 60 s of the registry's restart".into());
    }
}
