//! Shared by every integration test: which servers to use, an isolated
//! topic / group / database per test, producing, reading back, and
//! running the worker (in-process, or as the real binary for crash tests).
//!
//! Servers: `TRADEBUCKET_TEST_KAFKA` (bootstrap servers) and
//! `TRADEBUCKET_TEST_MONGODB` (URI) if set, so the same suite runs against
//! Apache Kafka and MongoDB; otherwise the local stack (`scripts/stack`).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use mongodb::bson::{doc, Document};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use tradebucket::bucket::store::BucketStore;
use tradebucket::config::Settings;

static COUNTER: AtomicU32 = AtomicU32::new(0);

pub fn kafka_brokers() -> String {
    std::env::var("TRADEBUCKET_TEST_KAFKA").unwrap_or_else(|_| {
        let port = std::env::var("TRADEBUCKET_KAFKA_PORT").unwrap_or_else(|_| "19092".into());
        format!("127.0.0.1:{port}")
    })
}

pub fn mongodb_uri() -> String {
    std::env::var("TRADEBUCKET_TEST_MONGODB").unwrap_or_else(|_| {
        let port = std::env::var("TRADEBUCKET_MONGO_PORT").unwrap_or_else(|_| "27117".into());
        format!("mongodb://127.0.0.1:{port}/?directConnection=true")
    })
}

/// A name no other test (or earlier run) uses.
pub fn unique(name: &str) -> String {
    format!(
        "tb-{name}-{}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        rand::random::<u16>()
    )
}

pub fn admin(brokers: &str) -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client")
}

pub async fn create_topic(brokers: &str, name: &str, partitions: i32) {
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let results = admin(brokers)
        .create_topics(
            [&topic],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap_or_else(|e| {
            panic!("cannot reach Kafka at {brokers} ({e}); start it with scripts/stack start")
        });
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
    }
}

/// One test's private slice of the servers.
pub struct TestEnv {
    pub kafka: String,
    pub mongo_uri: String,
    pub db: String,
    pub topic: String,
    pub dlq: String,
    pub group: String,
    pub partitions: i32,
}

impl TestEnv {
    pub async fn new(name: &str, partitions: i32) -> TestEnv {
        TestEnv::on(kafka_brokers(), mongodb_uri(), name, partitions).await
    }

    /// The same, on the given servers (private ones, for fault tests).
    pub async fn on(kafka: String, mongo_uri: String, name: &str, partitions: i32) -> TestEnv {
        let base = unique(name);
        let env = TestEnv {
            kafka,
            mongo_uri,
            db: base.replace('-', "_"),
            topic: format!("{base}.trades"),
            dlq: format!("{base}.trades.dlq"),
            group: format!("{base}-group"),
            partitions,
        };
        create_topic(&env.kafka, &env.topic, partitions).await;
        create_topic(&env.kafka, &env.dlq, 1).await;
        env
    }

    /// The worker's environment: TRADEBUCKET__* variables, for the binary
    /// and (through `settings`) for in-process workers alike.
    pub fn vars(&self, extra: &[(&str, &str)]) -> BTreeMap<String, String> {
        let mut v: BTreeMap<String, String> = [
            ("TRADEBUCKET__KAFKA__BROKERS", self.kafka.as_str()),
            ("TRADEBUCKET__KAFKA__TOPICS", self.topic.as_str()),
            ("TRADEBUCKET__KAFKA__GROUP_ID", self.group.as_str()),
            ("TRADEBUCKET__KAFKA__DLQ_TOPIC", self.dlq.as_str()),
            ("TRADEBUCKET__MONGODB__URI", self.mongo_uri.as_str()),
            ("TRADEBUCKET__MONGODB__DATABASE", self.db.as_str()),
            ("TRADEBUCKET__HTTP__LISTEN", "127.0.0.1:0"),
            ("TRADEBUCKET__BATCH__LINGER_MS", "20"),
            // Short sessions so group changes in tests settle quickly.
            ("TRADEBUCKET__KAFKA__SESSION_TIMEOUT_MS", "10000"),
            ("TRADEBUCKET__SHUTDOWN__DRAIN_TIMEOUT_MS", "5000"),
            ("TRADEBUCKET__RETRY__MAX_INTERVAL_MS", "1000"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        for (k, val) in extra {
            v.insert(k.to_string(), val.to_string());
        }
        v
    }

    pub fn settings(&self, extra: &[(&str, &str)]) -> Settings {
        Settings::load_from(None, Some(self.vars(extra))).expect("test settings are valid")
    }

    pub async fn store(&self) -> BucketStore {
        BucketStore::connect(&self.settings(&[]).mongodb)
            .await
            .expect("MongoDB client")
    }

    fn producer(&self) -> FutureProducer {
        ClientConfig::new()
            .set("bootstrap.servers", &self.kafka)
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .create()
            .expect("producer")
    }

    /// Produces messages in order and returns each one's (partition, offset).
    pub async fn produce(&self, messages: &[Produced]) -> Vec<(i32, i64)> {
        let producer = self.producer();
        let mut out = Vec::with_capacity(messages.len());
        // Sequential sends keep the order within a partition exact.
        for m in messages {
            let mut headers = OwnedHeaders::new();
            for (k, v) in &m.headers {
                headers = headers.insert(Header {
                    key: k,
                    value: Some(v.as_bytes()),
                });
            }
            let mut record: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(&self.topic).headers(headers);
            if let Some(k) = &m.key {
                record = record.key(k.as_bytes());
            }
            if let Some(p) = &m.payload {
                record = record.payload(p.as_slice());
            }
            if let Some(p) = m.partition {
                record = record.partition(p);
            }
            let delivery = producer
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(e, _)| e)
                .expect("produce");
            out.push((delivery.partition, delivery.offset));
        }
        out
    }

    /// Produces JSON events keyed by their customer.
    pub async fn produce_json(&self, events: &[serde_json::Value]) -> Vec<(i32, i64)> {
        let messages: Vec<Produced> = events
            .iter()
            .map(|e| Produced {
                key: e
                    .get("customerId")
                    .map(|c| c.to_string().trim_matches('"').to_string()),
                payload: Some(e.to_string().into_bytes()),
                ..Produced::default()
            })
            .collect();
        self.produce(&messages).await
    }

    fn group_consumer(&self) -> BaseConsumer {
        ClientConfig::new()
            .set("bootstrap.servers", &self.kafka)
            .set("group.id", &self.group)
            .create()
            .expect("consumer")
    }

    /// The group's committed offsets (next to read) per partition.
    pub fn committed(&self) -> BTreeMap<i32, i64> {
        self.committed_via(&self.group_consumer())
            .expect("committed offsets")
    }

    /// The same through `consumer` (any client of this group), or the
    /// broker's error, for callers that poll through a slow broker.
    pub fn committed_via(&self, consumer: &BaseConsumer) -> KafkaResult<BTreeMap<i32, i64>> {
        let mut tpl = TopicPartitionList::new();
        for p in 0..self.partitions {
            tpl.add_partition(&self.topic, p);
        }
        let committed = consumer.committed_offsets(tpl, Duration::from_secs(10))?;
        Ok(committed
            .elements()
            .iter()
            .map(|e| {
                (
                    e.partition(),
                    match e.offset() {
                        Offset::Offset(o) => o,
                        _ => 0,
                    },
                )
            })
            .collect())
    }

    /// The end of each partition.
    pub fn end_offsets(&self) -> BTreeMap<i32, i64> {
        let consumer = self.group_consumer();
        (0..self.partitions)
            .map(|p| {
                let (_, high) = consumer
                    .fetch_watermarks(&self.topic, p, Duration::from_secs(10))
                    .expect("watermarks");
                (p, high)
            })
            .collect()
    }

    /// Waits until the group has committed every partition to its end.
    pub async fn wait_committed_to_end(&self, timeout: Duration) {
        let end = self.end_offsets();
        let deadline = Instant::now() + timeout;
        loop {
            let committed = self.committed();
            if committed == end {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "committed {committed:?} did not reach the end {end:?} within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Every bucket, in `_id` order.
    pub async fn buckets(&self) -> Vec<Document> {
        self.store()
            .await
            .collection()
            .find(doc! {})
            .sort(doc! {"_id": 1})
            .await
            .expect("find")
            .try_collect()
            .await
            .expect("read buckets")
    }

    /// Trade keys per customer prefix, concatenated in page order.
    pub async fn histories(&self) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for b in self.buckets().await {
            let id = b.get_str("_id").unwrap();
            let customer = id.split('_').next().unwrap().to_string();
            for h in b.get_array("history").unwrap() {
                let key = h.as_document().unwrap().get_str("key").unwrap().to_string();
                out.entry(customer.clone()).or_default().push(key);
            }
        }
        out
    }

    /// Reads the dead-letter topic until `expected` records arrived.
    pub async fn dead_letters(&self, expected: usize, timeout: Duration) -> Vec<OwnedMessage> {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.kafka)
            .set("group.id", unique("dlq-reader"))
            .set("auto.offset.reset", "earliest")
            .create()
            .expect("consumer");
        consumer.subscribe(&[&self.dlq]).expect("subscribe");
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + timeout;
        while out.len() < expected {
            match tokio::time::timeout_at(deadline, consumer.recv()).await {
                Ok(Ok(m)) => out.push(m.detach()),
                Ok(Err(e)) => panic!("reading the dead-letter topic: {e}"),
                Err(_) => break,
            }
        }
        out
    }

    /// Drops the database and deletes the topics.
    pub async fn cleanup(self) {
        if let Ok(store) = BucketStore::connect(&self.settings(&[]).mongodb).await {
            let _ = store.client().database(&self.db).drop().await;
        }
        let _ = admin(&self.kafka)
            .delete_topics(&[&self.topic, &self.dlq], &AdminOptions::new())
            .await;
    }
}

/// A message to produce.
#[derive(Debug, Clone, Default)]
pub struct Produced {
    pub key: Option<String>,
    pub payload: Option<Vec<u8>>,
    pub partition: Option<i32>,
    pub headers: Vec<(String, String)>,
}

/// A worker running in this process, stopped through its token; its
/// metrics are readable by the test.
pub struct Worker {
    token: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
    pub metrics: tradebucket::metrics::Metrics,
}

impl Worker {
    pub fn spawn(settings: Settings) -> Worker {
        if std::env::var_os("TEST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new("info,tradebucket=debug"))
                .with_test_writer()
                .try_init();
        }
        let token = CancellationToken::new();
        let metrics = tradebucket::metrics::Metrics::new();
        let (t, m) = (token.clone(), metrics.clone());
        let handle = tokio::spawn(async move {
            let health = std::sync::Arc::new(tradebucket::pipeline::Health::default());
            let pipeline = tradebucket::pipeline::Pipeline::build(settings, m, health, &t)
                .await
                .expect("worker starts");
            if let Some(p) = pipeline {
                p.run(t).await;
            }
        });
        Worker {
            token,
            handle,
            metrics,
        }
    }

    pub async fn stop(self) -> tradebucket::metrics::Metrics {
        self.token.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("worker stops within 30 s")
            .expect("worker task");
        self.metrics
    }
}

/// The real `tradebucket` binary, for kill -9 and signal tests.
pub struct WorkerProcess {
    pub child: Child,
}

impl WorkerProcess {
    pub fn start(vars: &BTreeMap<String, String>) -> WorkerProcess {
        let child = Command::new(env!("CARGO_BIN_EXE_tradebucket"))
            .arg("run")
            .envs(vars)
            .env("TRADEBUCKET__LOG__FORMAT", "text")
            .stdout(Stdio::null())
            .stderr(if std::env::var_os("TEST_LOG").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn()
            .expect("start tradebucket");
        WorkerProcess { child }
    }

    pub fn kill9(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY-free: the `kill` command, to avoid a libc dependency.
        let status = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits for exit; returns the exit code.
    pub fn wait(mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code();
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("worker did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A trade event as JSON.
pub fn trade(
    id: &str,
    customer: serde_json::Value,
    ticker: &str,
    qty: u32,
    date: &str,
) -> serde_json::Value {
    serde_json::json!({
        "tradeId": id, "customerId": customer, "type": "buy", "ticker": ticker,
        "qty": qty, "price": "10.50", "currency": "USD", "date": date,
    })
}

/// Runs `tradebucket audit` logic over the test's database.
pub async fn audit_clean(env: &TestEnv, capacity: u32) -> tradebucket::cli::AuditReport {
    let cap = capacity.to_string();
    let settings = env.settings(&[("TRADEBUCKET__BUCKETS__CAPACITY", &cap)]);
    let report = tradebucket::cli::audit(&settings, None)
        .await
        .expect("audit");
    assert!(
        report.violations.is_empty(),
        "audit violations: {:#?}",
        report.violations
    );
    report
}

/// A MongoDB-protocol server of this test's own (secantusd-rs from the
/// stack's tools folder), for tests that stop and restart the database
/// without disturbing the shared one.
pub struct PrivateMongo {
    pub port: u16,
    dir: std::path::PathBuf,
    child: Option<Child>,
}

impl PrivateMongo {
    pub fn binary() -> std::path::PathBuf {
        let tools = std::env::var("TRADEBUCKET_TOOLS").unwrap_or_else(|_| {
            format!(
                "{}/.cache/tradebucket/tools",
                std::env::var("HOME").unwrap_or_default()
            )
        });
        std::path::PathBuf::from(tools).join("secantus-0.5.3-beta.196/bin/secantusd-rs")
    }

    pub async fn start() -> PrivateMongo {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(unique("mongo"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut m = PrivateMongo {
            port,
            dir,
            child: None,
        };
        m.restart().await;
        m
    }

    pub fn uri(&self) -> String {
        format!("mongodb://127.0.0.1:{}/?directConnection=true", self.port)
    }

    /// Starts the server on the same port and data, and waits until it answers.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "already running");
        let child = Command::new(Self::binary())
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &self.port.to_string(),
                "--storage-path",
            ])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "start {:?}: {e} (scripts/stack install builds it)",
                    Self::binary()
                )
            });
        self.child = Some(child);
        let client = mongodb::Client::with_uri_str(self.uri()).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while client
            .database("admin")
            .run_command(doc! {"ping": 1})
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "private MongoDB did not come up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGTERM and wait for exit: this server loses acknowledged writes on
    /// kill -9 (STACK.md), which would test the surrogate, not us.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

impl Drop for PrivateMongo {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `f` until it returns true.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A Kafka-protocol broker of this test's own (Tansu, sqlite storage), for
/// tests that kill and restart the broker on the same data.
pub struct PrivateKafka {
    pub port: u16,
    dir: std::path::PathBuf,
    child: Option<Child>,
}

impl PrivateKafka {
    fn binary() -> std::path::PathBuf {
        PrivateMongo::binary()
            .parent()
            .and_then(|p| p.parent())
            .and_then(|p| p.parent())
            .expect("tools dir")
            .join("tansu-0.6.0/bin/tansu")
    }

    pub async fn start() -> PrivateKafka {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(unique("kafka"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut k = PrivateKafka {
            port,
            dir,
            child: None,
        };
        k.restart().await;
        k
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the broker on the same port and data; waits until it answers.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "already running");
        let url = format!("tcp://127.0.0.1:{}", self.port);
        // The sqlite path is relative to the working directory (STACK.md).
        let child = Command::new(Self::binary())
            .current_dir(&self.dir)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .args(["--storage-engine", "sqlite://tansu.db"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {:?}: {e}", Self::binary()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let probe: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", self.brokers())
                .create()
                .expect("client");
            if probe.fetch_metadata(None, Duration::from_secs(2)).is_ok() {
                // The index Tansu's per-record header lookup lacks; without
                // it a topic with headers (every dead letter has them)
                // makes each fetch scan all headers per record and the
                // broker stalls for minutes (scripts/stack explains).
                let db = self.dir.join("tansu.db");
                let status = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack"))
                    .arg("index-kafka")
                    .arg(&db)
                    .status()
                    .expect("run scripts/stack index-kafka");
                assert!(status.success(), "index-kafka {db:?}: {status}");
                return;
            }
            assert!(Instant::now() < deadline, "private Kafka did not come up");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// kill -9, and wait until the process is gone (the port is free).
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateKafka {
    fn drop(&mut self) {
        self.kill9();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A port free at the time of asking (for servers that need it up front).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET `url`: (status, body), or `None` when nothing answers.
pub async fn http_get(url: &str) -> Option<(u16, String)> {
    let response = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

/// A real Prometheus (Debian's package, installed by scripts/stack) of this
/// test's own, scraping `target` every second.
pub struct Prometheus {
    pub port: u16,
    dir: std::path::PathBuf,
    child: Child,
}

impl Prometheus {
    pub async fn start(target: &str) -> Prometheus {
        let port = free_port();
        let dir = std::env::temp_dir().join(unique("prometheus"));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: tradebucket\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("start prometheus: {e} (scripts/stack install installs Debian's package)")
            });
        let p = Prometheus { port, dir, child };
        let ready = format!("http://127.0.0.1:{port}/-/ready");
        eventually("Prometheus ready", Duration::from_secs(30), || async {
            matches!(http_get(&ready).await, Some((200, _)))
        })
        .await;
        p
    }

    /// The value of an instant query returning one sample, if it returns one.
    pub async fn query(&self, promql: &str) -> Option<f64> {
        let url = format!("http://127.0.0.1:{}/api/v1/query", self.port);
        let body: serde_json::Value = reqwest::Client::new()
            .get(&url)
            .query(&[("query", promql)])
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let result = body["data"]["result"].as_array()?;
        if result.len() != 1 {
            return None;
        }
        result[0]["value"][1].as_str()?.parse().ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
