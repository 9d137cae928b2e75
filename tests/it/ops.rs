//! What an operator touches: `check-config`, `/readyz` and `/healthz`, and
//! the metrics as a real Prometheus sees them.

use std::process::Command;
use std::time::Duration;

use mongodb::bson::doc;
use rdkafka::consumer::Consumer;
use testkit::*;

use tradebucket::config::SECRET_KAFKA_OPTIONS;

use crate::bin;
use crate::pipeline::stream;

/// Runs `tradebucket check-config` with only the given environment.
fn check_config(args: &[&str], vars: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let out = Command::new(bin())
        .args(args)
        .arg("check-config")
        .env_clear()
        .envs(vars.iter().copied())
        .output()
        .expect("run tradebucket");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_config_prints_the_effective_layers_with_secrets_redacted() {
    let dir = std::env::temp_dir().join(unique("check-config"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("site.toml");
    std::fs::write(
        &file,
        "[buckets]\ncapacity = 50\n[batch]\nlinger = \"7ms\"\n\
         [kafka.options]\n\"security.protocol\" = \"SASL_SSL\"\n\"sasl.mechanism\" = \"SCRAM-SHA-256\"\n",
    )
    .unwrap();
    let (code, stdout, stderr) = check_config(
        &["--config", file.to_str().unwrap()],
        &[
            ("TRADEBUCKET__BATCH__LINGER", "9ms"),
            ("TRADEBUCKET__KAFKA__GROUP_ID", "0042"),
            (
                "TRADEBUCKET__MONGODB__URI",
                "mongodb://app:s3cr3t-pw@db1:27017,db2:27017/?replicaSet=rs0&tls=true",
            ),
            ("TRADEBUCKET__KAFKA__OPTIONS__SASL_USERNAME", "tb"),
            ("TRADEBUCKET__KAFKA__OPTIONS__SASL_PASSWORD", "hunter2-pw"),
        ],
    );
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(code, Some(0), "stderr: {stderr}");
    // Layers: default < file < environment.
    assert!(stdout.contains("capacity = 50"), "{stdout}");
    assert!(stdout.contains("linger = \"9ms\""), "{stdout}");
    // Environment values are the text they are.
    assert!(stdout.contains("group_id = \"0042\""), "{stdout}");
    assert!(stdout.contains("max_events = 20000"), "{stdout}");
    assert!(
        stdout.contains("\"security.protocol\" = \"SASL_SSL\""),
        "{stdout}"
    );
    assert!(stdout.contains("\"sasl.username\" = \"tb\""), "{stdout}");
    // Secrets never printed.
    assert!(!stdout.contains("s3cr3t-pw") && !stdout.contains("hunter2-pw"));
    assert!(
        stdout.contains("mongodb://app:<redacted>@db1:27017,db2:27017/?replicaSet=rs0&tls=true"),
        "{stdout}"
    );
    assert!(
        stdout.contains("\"sasl.password\" = \"<redacted>\""),
        "{stdout}"
    );
}

fn secret_env(uri: &str) -> Vec<(String, String)> {
    // Every librdkafka option that carries a secret, with a value of its own.
    let mut vars: Vec<(String, String)> = SECRET_KAFKA_OPTIONS
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let name = o.to_ascii_uppercase().replace('.', "_");
            (
                format!("TRADEBUCKET__KAFKA__OPTIONS__{name}"),
                format!("kafka-secret-{i}"),
            )
        })
        .collect();
    vars.push(("TRADEBUCKET__MONGODB__URI".into(), uri.into()));
    vars
}

fn assert_no_secret(text: &str) {
    for i in 0..SECRET_KAFKA_OPTIONS.len() {
        assert!(!text.contains(&format!("kafka-secret-{i}")), "{text}");
    }
    for p in ["uri-pw", "uri-token"] {
        assert!(!text.contains(p), "{p}: {text}");
    }
}

/// Each secret-bearing librdkafka option, a URI password, a secret URI
/// option, and a password under a misspelt name (`sasl.passwor`, which
/// librdkafka refuses, and the refusal quotes the value): `check-config`
/// names the refusal and shows none of them.
#[test]
fn check_config_and_its_errors_carry_no_secret() {
    let uri = "mongodb://app:uri-pw@db1/?authMechanismProperties=AWS_SESSION_TOKEN:uri-token";
    let mut vars = secret_env(uri);
    vars.push((
        "TRADEBUCKET__KAFKA__OPTIONS__SASL_PASSWOR".into(),
        "misspelt-secret".into(),
    ));
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (code, stdout, stderr) = check_config(&[], &vars);
    assert_eq!(code, Some(64), "the misspelt option is refused: {stderr}");
    assert!(stderr.contains("sasl.passwor"), "{stderr}");
    let text = format!("{stdout}{stderr}");
    assert_no_secret(&text);
    assert!(!text.contains("misspelt-secret"), "{text}");
}

/// The start-up log prints the effective configuration, and MongoDB
/// errors follow while the database is away: neither shows a secret.
#[test]
fn the_start_up_log_carries_no_secret() {
    let port = free_port();
    let uri = format!(
        "mongodb://app:uri-pw@127.0.0.1:{port}/?directConnection=true\
         &authMechanismProperties=AWS_SESSION_TOKEN:uri-token&serverSelectionTimeoutMS=200"
    );
    let mut vars = secret_env(&uri);
    // Only the options librdkafka takes, so the worker gets past checks.
    vars.retain(|(k, _)| !k.contains("OAUTHBEARER"));
    vars.push(("TRADEBUCKET__HTTP__LISTEN".into(), "127.0.0.1:0".into()));
    vars.push(("TRADEBUCKET__LOG__FORMAT".into(), "text".into()));
    let child = Command::new(env!("CARGO_BIN_EXE_tradebucket"))
        .arg("run")
        .envs(vars)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("starting"), "{log}");
    assert!(log.contains("cannot create indexes"), "{log}");
    assert!(log.contains("<redacted>"), "{log}");
    assert_no_secret(&log);
}

#[test]
fn check_config_exits_64_naming_the_bad_field() {
    let dir = std::env::temp_dir().join(unique("check-config-bad"));
    std::fs::create_dir_all(&dir).unwrap();
    let typo = dir.join("typo.toml");
    std::fs::write(&typo, "[batch]\nlinger_ms = 5\n").unwrap();
    let missing = dir.join("missing.toml");
    let typo_arg = ["--config", typo.to_str().unwrap()];
    let missing_arg = ["--config", missing.to_str().unwrap()];
    // (arguments, environment, what stderr must name)
    type Case<'a> = (&'a [&'a str], Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            &[],
            vec![("TRADEBUCKET__BUCKETS__CAPACITY", "0")],
            "buckets.capacity",
        ),
        (&[], vec![("TRADEBUCKET__BATCH__LINGER", "soon")], "linger"),
        (
            &[],
            vec![("TRADEBUCKET__MONGODB__URI", "localhost:27017")],
            "mongodb.uri",
        ),
        (
            &[],
            vec![("TRADEBUCKET__HTTP__LISTEN", "8080")],
            "http.listen",
        ),
        (
            &[],
            vec![("TRADEBUCKET__KAFKA__OPTIONS__SASL_PASWORD", "x")],
            "sasl.pasword",
        ),
        (
            &[],
            vec![("TRADEBUCKET__KAFKA__OPTIONS__SECURITY_PROTOCOL", "TLS")],
            "security.protocol",
        ),
        (&typo_arg, vec![], "linger_ms"),
        (&missing_arg, vec![], "missing.toml"),
    ];
    for (args, vars, field) in cases {
        let (code, stdout, stderr) = check_config(args, &vars);
        assert_eq!(code, Some(64), "{args:?} {vars:?}: {stdout}{stderr}");
        assert!(stderr.contains(field), "{args:?} {vars:?}: {stderr}");
        assert!(stdout.is_empty(), "nothing printed on error: {stdout}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Runs `tradebucket audit` (text) with the given environment: exit code
/// and stdout.
fn audit_text(vars: &std::collections::BTreeMap<String, String>) -> (Option<i32>, String) {
    let out = Command::new(bin())
        .arg("audit")
        .envs(vars)
        .output()
        .expect("run tradebucket audit");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// `audit --json` is the text report, machine-readable (what the harnesses
/// and scripts/demo read): same counts, same violations, same exit code,
/// for a clean database and for one with violations. Buckets are audited
/// by the `cap` stored in them, so the configured capacity does not matter
/// to them; with `cap` removed (as in buckets of earlier versions) the
/// configured capacity is their cap, and too small a one is a violation.
#[tokio::test]
async fn audit_json_matches_the_text_report() {
    let env = TestEnv::new("audit-json", 2).await;
    let events = stream(91, 300, 12);
    env.produce_json(&events).await;
    let worker = Worker::spawn(env.settings(&[("TRADEBUCKET__BUCKETS__CAPACITY", "4")]));
    env.wait_committed_to_end(Duration::from_secs(60)).await;
    worker.stop().await;
    let customers: std::collections::HashSet<String> =
        events.iter().map(|e| e["customerId"].to_string()).collect();

    // (remove `cap` first, capacity the audit assumes, exit code expected)
    for (legacy, capacity, exit) in [
        (false, "4", 0),
        (false, "2", 0),
        (true, "4", 0),
        (true, "2", 1),
    ] {
        if legacy {
            env.store()
                .await
                .collection()
                .update_many(doc! {}, doc! {"$unset": {"cap": ""}})
                .await
                .expect("unset cap");
        }
        let vars = env.vars(&[("TRADEBUCKET__BUCKETS__CAPACITY", capacity)]);
        let (text_code, text) = audit_text(&vars);
        let (json_code, report) = audit_json(bin(), &vars);
        assert_eq!(text_code, Some(exit), "capacity {capacity}: {text}");
        assert_eq!(json_code, text_code, "capacity {capacity}");
        assert_eq!(report.trades, 300);
        assert_eq!(report.customers, customers.len() as u64);
        let summary = format!(
            "audit: {} customers, {} buckets, {} trades, {} violations",
            report.customers,
            report.buckets,
            report.trades,
            report.violations.len()
        );
        assert_eq!(text.lines().next(), Some(summary.as_str()));
        let listed: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("violation: "))
            .collect();
        assert_eq!(listed, report.violations, "capacity {capacity}");
        assert_eq!(report.violations.is_empty(), exit == 0);
    }
    env.cleanup().await;
}

#[tokio::test]
async fn readyz_follows_mongodb_and_healthz_stays_up() {
    let mut mongo = PrivateMongo::start().await;
    let env = TestEnv {
        mongo_uri: mongo.uri(),
        ..TestEnv::new("readyz", 2).await
    };
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let worker = WorkerProcess::start(
        bin(),
        &env.vars(&[("TRADEBUCKET__HTTP__LISTEN", &listen)]),
        Log::Quiet,
    );
    let readyz = format!("http://{listen}/readyz");
    let healthz = format!("http://{listen}/healthz");
    let metrics = format!("http://{listen}/metrics");

    let status = |url: String| async move { http_get(&url).await.map(|(s, _)| s) };
    eventually("ready", Duration::from_secs(30), || async {
        status(readyz.clone()).await == Some(200)
    })
    .await;
    let events = stream(61, 200, 20);
    env.produce_json(&events).await;
    env.wait_committed_to_end(Duration::from_secs(60)).await;

    // Idle worker, database gone: not ready, with the reason; still alive.
    mongo.stop();
    eventually(
        "not ready while MongoDB is down",
        Duration::from_secs(20),
        || async {
            matches!(http_get(&readyz).await, Some((503, body)) if body.contains("MongoDB"))
        },
    )
    .await;
    assert_eq!(status(healthz.clone()).await, Some(200));
    let (_, text) = http_get(&metrics).await.unwrap();
    assert!(text.contains("\ntradebucket_ready 0\n"), "{text}");

    // Trades arriving during the outage wait, then land.
    let more = stream(62, 100, 20);
    env.produce_json(&more).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(status(readyz.clone()).await, Some(503));

    mongo.restart().await;
    eventually("ready again", Duration::from_secs(30), || async {
        status(readyz.clone()).await == Some(200)
    })
    .await;
    let (_, text) = http_get(&metrics).await.unwrap();
    assert!(text.contains("\ntradebucket_ready 1\n"), "{text}");
    env.wait_committed_to_end(Duration::from_secs(60)).await;
    let report = audit_clean(&env, 10).await;
    assert_eq!(report.trades, 300);

    worker.signal(15);
    assert_eq!(worker.wait(Duration::from_secs(30)), Some(0));
    env.cleanup().await;
}

/// `total` trades over 500 customers from the product's generator.
async fn produce_generated(env: &TestEnv, total: u64) {
    let opts = tradebucket::cli::ProduceOptions {
        topic: Some(env.topic.clone()),
        count: total,
        customers: 500,
        skewed: false,
        tickers: 8,
        rate: 0,
        seed: 7,
        no_keys: false,
        first_id: 0,
    };
    let (_, sent, _) = tradebucket::cli::produce(&env.settings(&[]), &opts, false)
        .await
        .expect("produce");
    assert_eq!(sent, total);
}

#[tokio::test]
async fn prometheus_sees_every_written_event_and_the_lag_drain() {
    let env = TestEnv::new("prometheus", 3).await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let prometheus = Prometheus::start(&listen).await;
    // The worker is scraped first, and then a backlog arrives that it
    // writes at a limited rate, so it needs five seconds for it whatever
    // the machine's speed (a backlog produced before the start was once
    // written before Prometheus' first scrape). With statistics every
    // 200 ms, Prometheus (scraping every second) sees the lag high and
    // then drain to 0.
    let total = 20_000u64;
    let vars = env.vars(&[
        ("TRADEBUCKET__HTTP__LISTEN", &listen),
        ("TRADEBUCKET__KAFKA__OPTIONS__STATISTICS_INTERVAL_MS", "200"),
        ("TRADEBUCKET__BATCH__MAX_EVENTS", "50"),
        ("TRADEBUCKET__RATE_LIMIT__EVENTS_PER_SECOND", "4000"),
    ]);
    let worker = WorkerProcess::start(bin(), &vars, Log::Quiet);
    eventually(
        "Prometheus scrapes the worker",
        Duration::from_secs(30),
        || async { prometheus.query("up{job=\"tradebucket\"}").await == Some(1.0) },
    )
    .await;
    produce_generated(&env, total).await;
    eventually(
        "Prometheus: written == produced",
        Duration::from_secs(90),
        || async {
            prometheus
                .query("tradebucket_events_written_total{job=\"tradebucket\"}")
                .await
                == Some(total as f64)
        },
    )
    .await;
    // Lag comes from librdkafka statistics: every partition's
    // series must exist and reach 0.
    eventually(
        "Prometheus: lag 0 on every partition",
        Duration::from_secs(60),
        || async {
            let partitions = prometheus
                .query("count(tradebucket_consumer_lag_messages{job=\"tradebucket\"})")
                .await;
            let lag = prometheus
                .query("sum(tradebucket_consumer_lag_messages{job=\"tradebucket\"})")
                .await;
            partitions == Some(3.0) && lag == Some(0.0)
        },
    )
    .await;
    // Lag was seen above 0 before it drained (not a series stuck at 0).
    let peak = prometheus
        .query("max(max_over_time(tradebucket_consumer_lag_messages{job=\"tradebucket\"}[5m]))")
        .await;
    assert!(peak.is_some_and(|p| p > 0.0), "peak lag {peak:?}");
    // The counter agrees with the database and with the other counters.
    let report = audit_clean(&env, 10).await;
    assert_eq!(report.trades, total);
    assert_eq!(
        prometheus
            .query("tradebucket_events_consumed_total{job=\"tradebucket\"}")
            .await,
        Some(total as f64)
    );
    assert_eq!(
        prometheus
            .query("tradebucket_ready{job=\"tradebucket\"}")
            .await,
        Some(1.0)
    );

    worker.signal(15);
    assert_eq!(worker.wait(Duration::from_secs(30)), Some(0));
    env.cleanup().await;
}

/// `produce --rate` paces the sends themselves: the topic fills while it
/// runs, instead of receiving everything in one burst at the end (which a
/// paced load test would silently measure instead). And the pacing starts
/// at the first acknowledgement: events paced from the producer's creation
/// would queue behind its start-up (connecting, and the idempotent
/// producer's id, which librdkafka 2.12 asks for again only after 500 ms),
/// land together, and count that wait as their time in Kafka.
#[tokio::test]
async fn produce_paces_its_sends_from_the_first_acknowledgement() {
    let env = TestEnv::new("produce-rate", 1).await;
    let (count, rate) = (300u64, 150u64);
    let opts = tradebucket::cli::ProduceOptions {
        topic: Some(env.topic.clone()),
        count,
        customers: 20,
        skewed: false,
        tickers: 8,
        rate,
        seed: 3,
        no_keys: false,
        first_id: 1000,
    };
    let settings = env.settings(&[]);
    let producing = tokio::spawn(async move {
        tradebucket::cli::produce(&settings, &opts, false)
            .await
            .expect("produce")
    });
    let watermarks = env.group_client();
    let end = || {
        let (_, high) = watermarks
            .fetch_watermarks(&env.topic, 0, Duration::from_secs(10))
            .expect("watermarks");
        high
    };
    let first_seen = loop {
        match end() {
            0 => tokio::time::sleep(Duration::from_millis(5)).await,
            n => break n,
        }
    };
    // At 150/s, a few events at most between two looks; the events of a
    // producer's start-up queued up would land as one batch.
    assert!(
        first_seen <= 10,
        "the topic's first look held {first_seen} events: they waited for the producer together"
    );
    // A second into the 2 s of pacing, about half the events are in.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let halfway = end();
    let (_, sent, seconds) = producing.await.unwrap();
    assert_eq!(sent, count);
    assert!(
        seconds >= 1.9,
        "300 events at 150/s took only {seconds:.2} s"
    );
    assert!(
        (90..=240).contains(&halfway),
        "1 s into a 2 s paced run the topic held {halfway} events"
    );
    assert_eq!(end(), count as i64);
    env.cleanup().await;
}

/// A partition whose records the consumer cannot fetch looked like an idle
/// one. Here the unreadable record is larger than the consumer may receive
/// (`receive.message.max.bytes`, lowered for the test; in production, a
/// topic whose `max.message.bytes` was raised past the consumers' limit):
/// Apache Kafka returns the whole record batch however small the fetch
/// limit, librdkafka drops every such response as too large and fetches
/// again, for ever, as it would from a broker that keeps failing. Whatever
/// the cause, the partition holds records past its fetch position, its
/// position does not move, and nothing of it waits for the worker:
/// readiness names it.
#[tokio::test]
async fn a_partition_the_consumer_cannot_read_fails_readiness_with_its_name() {
    let env = TestEnv::new("stall", 2).await;
    let listen = format!("127.0.0.1:{}", free_port());
    let vars = env.vars(&[
        ("TRADEBUCKET__HTTP__LISTEN", &listen),
        ("TRADEBUCKET__TIMEOUTS__PARTITION_STALL", "5s"),
        // librdkafka wants fetch.max.bytes >= message.max.bytes and
        // receive.message.max.bytes above fetch.max.bytes.
        ("TRADEBUCKET__KAFKA__OPTIONS__MESSAGE_MAX_BYTES", "100000"),
        ("TRADEBUCKET__KAFKA__OPTIONS__FETCH_MAX_BYTES", "100000"),
        (
            "TRADEBUCKET__KAFKA__OPTIONS__RECEIVE_MESSAGE_MAX_BYTES",
            "200000",
        ),
    ]);
    let worker = WorkerProcess::start(bin(), &vars, Log::Quiet);
    let readyz = format!("http://{listen}/readyz");
    env.produce_json(&stream(63, 40, 4)).await;
    env.wait_committed_to_end(Duration::from_secs(60)).await;
    assert_eq!(http_get(&readyz).await.map(|r| r.0), Some(200));

    let big = Produced {
        payload: Some(vec![b'x'; 500_000]),
        partition: Some(1),
        ..Produced::default()
    };
    env.produce(&[big]).await;
    let expected = format!("{}/1 (1 records waiting unread)", env.topic);
    eventually("readiness names the partition", T_STALL, || async {
        matches!(http_get(&readyz).await, Some((503, body)) if body.contains(&expected))
    })
    .await;
    let (_, text) = http_get(&format!("http://{listen}/metrics")).await.unwrap();
    assert!(
        text.contains("\ntradebucket_stalled_partitions 1\n"),
        "{text}"
    );
    worker.signal(15);
    assert_eq!(worker.wait(Duration::from_secs(30)), Some(0));
    env.cleanup().await;
}

/// The partition window (5 s) plus two checks (10 s each) and slack.
const T_STALL: Duration = Duration::from_secs(60);

/// `check-config` with a `--config` file holding `text` and the
/// environment `vars`: (exit code, stdout and stderr together).
fn check_config_file(text: &str, vars: &[(&str, &str)]) -> (Option<i32>, String) {
    let dir = std::env::temp_dir().join(unique("check-config-registry"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("site.toml");
    std::fs::write(&file, text).unwrap();
    let (code, stdout, stderr) = check_config(&["--config", file.to_str().unwrap()], vars);
    std::fs::remove_dir_all(&dir).ok();
    (code, format!("{stdout}{stderr}"))
}

/// The Schema Registry's basic-auth password (from the environment) and
/// bearer token (from the file) are printed `<redacted>`; a refused
/// registry section, and a URL carrying credentials, name the setting,
/// not the secret.
#[test]
fn check_config_never_prints_the_registry_secrets() {
    let formats = "[kafka]\ntopics = [\"trades-avro\"]\n\
                   [[formats]]\ntopic = \"trades-avro\"\nformat = \"avro\"\n";
    let basic = format!(
        "{formats}[schema_registry]\nurl = \"https://registry.example:8081\"\nusername = \"reg-user\"\n"
    );
    let pw = [("TRADEBUCKET__SCHEMA_REGISTRY__PASSWORD", "reg-pw-s3cret")];
    let (code, text) = check_config_file(&basic, &pw);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("username = \"reg-user\""), "{text}");
    assert!(text.contains("password = \"<redacted>\""), "{text}");
    assert!(!text.contains("reg-pw-s3cret"), "{text}");

    let bearer = format!(
        "{formats}[schema_registry]\nurl = \"https://registry.example:8081\"\nbearer_token = \"tok-s3cret\"\n"
    );
    let (code, text) = check_config_file(&bearer, &[]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("bearer_token = \"<redacted>\""), "{text}");
    assert!(!text.contains("tok-s3cret"), "{text}");

    // Both at once: refused, naming the setting, showing neither.
    let both = format!("{basic}bearer_token = \"tok-s3cret\"\n");
    let (code, text) = check_config_file(&both, &pw);
    assert_eq!(code, Some(64), "{text}");
    assert!(text.contains("schema_registry.bearer_token"), "{text}");
    assert!(
        !text.contains("reg-pw-s3cret") && !text.contains("tok-s3cret"),
        "{text}"
    );

    // Credentials in the URL: refused without echoing them.
    let in_url = format!(
        "{formats}[schema_registry]\nurl = \"https://reg-user:url-s3cret@registry.example\"\n"
    );
    let (code, text) = check_config_file(&in_url, &[]);
    assert_eq!(code, Some(64), "{text}");
    assert!(text.contains("schema_registry.url"), "{text}");
    assert!(!text.contains("url-s3cret"), "{text}");
}
