//! Operator-facing features of issue #16 beyond `dlq`: the write-rate
//! limit, measured from the worker's own counters; the process metrics as
//! a real Prometheus scrapes them; the MongoDB driver's wire compression.

use std::time::{Duration, Instant};

use mongodb::bson::doc;
use testkit::*;

use crate::bin;

/// A counter's value in a `/metrics` text.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

async fn scrape(listen: &str, name: &str) -> f64 {
    let (_, body) = http_get(&format!("http://{listen}/metrics"))
        .await
        .expect("/metrics answers");
    sample(&body, name).unwrap_or_else(|| panic!("{name} not in /metrics"))
}

/// With `rate_limit.events_per_second = 400` and a backlog of 40 s of it,
/// the written counter grows at 400/s (within 10 %) over a 20 s window,
/// the time spent throttled is counted, and nothing is dropped: every
/// event is stored in the end. Prometheus meanwhile scrapes the process
/// metrics.
#[tokio::test]
async fn the_rate_limit_holds_the_written_rate_and_prometheus_sees_process_metrics() {
    let env = TestEnv::new("rate-limit", 2).await;
    let (rate, total) = (400u64, 12_000u64);
    let events: Vec<Produced> = (0..total)
        .map(|i| Produced {
            key: Some((i % 50).to_string()),
            payload: Some(trade(format!("RL{i}")).customer(i % 50).payload()),
            ..Produced::default()
        })
        .collect();
    produce_fast(&env.kafka, &env.topic, &events).await;
    let listen = format!("127.0.0.1:{}", free_port());
    let prometheus = Prometheus::start(&listen).await;
    let rate_text = rate.to_string();
    let vars = env.vars(&[
        ("TRADEBUCKET__HTTP__LISTEN", &listen),
        ("TRADEBUCKET__RATE_LIMIT__EVENTS_PER_SECOND", &rate_text),
        // Small batches: the counter moves in steps of 50, not 400, so a
        // 20 s window measures the rate to within 1 %.
        ("TRADEBUCKET__BATCH__MAX_EVENTS", "50"),
    ]);
    let worker = WorkerProcess::start(bin(), &vars, Log::Quiet);
    let written = "tradebucket_events_written_total";
    eventually("the worker writes", Duration::from_secs(60), || async {
        http_get(&format!("http://{listen}/metrics"))
            .await
            .and_then(|(_, b)| sample(&b, written))
            .is_some_and(|n| n > 0.0)
    })
    .await;
    // Past the first second's credit, then a 20 s window.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (n0, t0) = (scrape(&listen, written).await, Instant::now());
    tokio::time::sleep(Duration::from_secs(20)).await;
    let (n1, t1) = (scrape(&listen, written).await, Instant::now());
    let measured = (n1 - n0) / (t1 - t0).as_secs_f64();
    eprintln!(
        "rate limit {rate}/s: measured {measured:.1} events/s over {:.1} s",
        (t1 - t0).as_secs_f64()
    );
    assert!(
        (measured - rate as f64).abs() <= rate as f64 * 0.10,
        "measured {measured:.1}/s against a limit of {rate}/s"
    );
    let throttled = scrape(&listen, "tradebucket_throttled_seconds_total").await;
    assert!(throttled > 5.0, "throttled {throttled} s");

    // The process metrics, as Prometheus has them.
    for (query, at_least) in [
        ("process_resident_memory_bytes{job=\"tradebucket\"}", 1e6),
        ("process_cpu_seconds_total{job=\"tradebucket\"}", 0.01),
        ("process_open_fds{job=\"tradebucket\"}", 3.0),
        (
            "tradebucket_throttled_seconds_total{job=\"tradebucket\"}",
            1.0,
        ),
    ] {
        eventually(query, Duration::from_secs(30), || async {
            prometheus.query(query).await.is_some_and(|v| v >= at_least)
        })
        .await;
    }

    // Backpressure, not loss: everything is stored once the backlog drains.
    env.wait_committed_to_end(Duration::from_secs(90)).await;
    assert_eq!(audit_clean(&env, 10).await.trades, total);
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));
    env.cleanup().await;
}

/// The mongodb driver is built with zstd, snappy and zlib: a URI asking
/// for them is accepted, the local server agrees to all three (so the
/// driver sends zstd, its first choice), and the worker stores through it.
#[tokio::test]
async fn a_uri_asking_for_wire_compression_works() {
    let env = TestEnv::new("compression", 1).await;
    let uri = format!(
        "{}&compressors=zstd,snappy,zlib&zlibCompressionLevel=6",
        env.mongo_uri
    );
    let client = mongodb::Client::with_uri_str(&uri)
        .await
        .expect("the URI parses");
    let hello = client
        .database("admin")
        .run_command(doc! {"hello": 1, "compression": ["zstd", "snappy", "zlib"]})
        .await
        .expect("hello");
    let agreed = hello
        .get_array("compression")
        .expect("the server agrees to compress");
    assert!(agreed.contains(&"zstd".into()), "{agreed:?}");
    let events: Vec<_> = (0..200)
        .map(|i| {
            serde_json::json!({"tradeId": format!("Z{i}"), "customerId": i % 7, "type": "buy",
            "ticker": "MDB", "qty": 1, "date": 1_700_000_000_000i64 + i})
        })
        .collect();
    env.produce_json(&events).await;
    let vars = env.vars(&[("TRADEBUCKET__MONGODB__URI", &uri)]);
    let worker = WorkerProcess::start(bin(), &vars, Log::Quiet);
    env.wait_committed_to_end(Duration::from_secs(60)).await;
    assert_eq!(audit_clean(&env, 10).await.trades, 200);
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));
    env.cleanup().await;
}

/// MONGODB-AWS is compiled in: a URI naming it parses (without the
/// driver's aws-auth feature it is refused as unsupported). Signing in
/// needs AWS, which no test here has.
#[tokio::test]
async fn a_uri_with_mongodb_aws_auth_parses() {
    let uri = "mongodb://127.0.0.1:1/?authSource=%24external&authMechanism=MONGODB-AWS";
    let options = mongodb::options::ClientOptions::parse(uri).await;
    let mechanism = options
        .expect("MONGODB-AWS is supported")
        .credential
        .unwrap()
        .mechanism;
    assert_eq!(mechanism, Some(mongodb::options::AuthMechanism::MongoDbAws));
}

/// The value of the series `name{labels}` in a `/metrics` text.
fn labelled(text: &str, name: &str, labels: &str) -> f64 {
    sample(text, &format!("{name}{{{labels}}}")).unwrap_or(0.0)
}

/// Every stage of the delay is observed (the per-event one once per
/// event, the per-batch ones once per batch), and every asynchronous
/// offset commit is answered and counted: rust-rdkafka 0.39 never delivers
/// an asynchronous commit's result unless it is asked for on the
/// consumer's queue (fede1024/rust-rdkafka#856), and then the commit
/// counter stayed at 0 and a failed commit would never have fired its
/// alert.
#[tokio::test]
async fn every_stage_of_the_delay_and_every_commit_are_counted() {
    let env = TestEnv::new("stages", 2).await;
    let total = 400u64;
    let events: Vec<Produced> = (0..total)
        .map(|i| Produced {
            key: Some((i % 20).to_string()),
            payload: Some(trade(format!("ST{i}")).customer(i % 20).payload()),
            ..Produced::default()
        })
        .collect();
    produce_fast(&env.kafka, &env.topic, &events).await;
    let listen = format!("127.0.0.1:{}", free_port());
    let vars = env.vars(&[
        ("TRADEBUCKET__HTTP__LISTEN", &listen),
        // Several batches, so several commits.
        ("TRADEBUCKET__BATCH__MAX_EVENTS", "50"),
    ]);
    let worker = WorkerProcess::start(bin(), &vars, Log::Quiet);
    let commits = |text: &str| labelled(text, "tradebucket_offset_commits_total", "result=\"ok\"");
    let url = format!("http://{listen}/metrics");
    let scrape_all = || async { http_get(&url).await.map(|(_, b)| b).unwrap_or_default() };
    eventually(
        "every event written and commits answered",
        Duration::from_secs(60),
        || async {
            let text = scrape_all().await;
            sample(&text, "tradebucket_events_written_total") == Some(total as f64)
                && commits(&text) >= 1.0
        },
    )
    .await;
    let text = scrape_all().await;
    let count = |stage: &str| {
        let name = "tradebucket_stage_delay_seconds_count";
        labelled(&text, name, &format!("stage=\"{stage}\""))
    };
    assert_eq!(count("in_kafka"), total as f64, "one per event");
    let batches = count("writing");
    assert!(batches >= (total / 50) as f64, "{batches} batches");
    for stage in ["batching", "decode", "queued"] {
        assert_eq!(count(stage), batches, "{stage}: one per batch");
    }
    assert!(count("commit") >= 1.0, "a commit's answer is timed");
    assert_eq!(
        labelled(
            &text,
            "tradebucket_offset_commits_total",
            "result=\"error\""
        ),
        0.0
    );
    drop(worker);
}
