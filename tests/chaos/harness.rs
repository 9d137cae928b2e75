//! What every chaos scenario shares: sizes, private servers, the event set
//! (good trades from the product's own generator, poison, upstream
//! duplicates), an ordered fast producer, worker processes with log files,
//! and the oracle that compares MongoDB and the dead-letter topic with an
//! independent recount of what was produced.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};

use crate::helpers::*;
use tradebucket::cli::{synthetic_event, ProduceOptions};

/// Trades per bucket in every scenario: small, so that thousands of
/// customers still roll over into new buckets often.
pub const CAPACITY: u32 = 4;
/// Customers in every scenario ("several thousand").
pub const CUSTOMERS: u64 = 3000;

pub fn full() -> bool {
    std::env::var("TRADEBUCKET_CHAOS").as_deref() == Ok("full")
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Events of a scenario: the reduced (CI) or the full size, unless
/// `TRADEBUCKET_CHAOS_EVENTS` says otherwise.
pub fn events(reduced: usize, full_size: usize) -> usize {
    env_usize("TRADEBUCKET_CHAOS_EVENTS").unwrap_or(if full() { full_size } else { reduced })
}

/// Worker kills of the crash loop (`TRADEBUCKET_CHAOS_KILLS` overrides).
pub fn kills(reduced: usize, full_size: usize) -> usize {
    env_usize("TRADEBUCKET_CHAOS_KILLS").unwrap_or(if full() { full_size } else { reduced })
}

pub fn pick<T>(reduced: T, full_size: T) -> T {
    if full() {
        full_size
    } else {
        reduced
    }
}

/// `<target dir>/chaos`: found from the test binary's own path
/// (`<target>/<profile>/deps/chaos-*`), so it follows CARGO_TARGET_DIR.
pub fn report_dir() -> PathBuf {
    if let Ok(d) = std::env::var("TRADEBUCKET_CHAOS_REPORT_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("test binary path");
    exe.ancestors()
        .nth(3)
        .map(|t| t.join("chaos"))
        .unwrap_or_else(|| PathBuf::from("target/chaos"))
}

// ---------------------------------------------------------------- servers

/// A Kafka-protocol broker and a MongoDB-protocol server of the scenario's
/// own, so killing or stopping them never touches anything else, plus the
/// topic, dead-letter topic, group and database on them.
pub struct Stack {
    pub kafka: PrivateKafka,
    pub mongo: PrivateMongo,
    pub env: TestEnv,
    /// One long-lived client for the group's committed offsets: a new
    /// client per poll costs the loaded broker a metadata round each time.
    group: BaseConsumer,
}

impl Stack {
    pub async fn start(name: &str, partitions: i32) -> Stack {
        let kafka = PrivateKafka::start().await;
        let mongo = PrivateMongo::start().await;
        let env = TestEnv::on(kafka.brokers(), mongo.uri(), name, partitions).await;
        let group = ClientConfig::new()
            .set("bootstrap.servers", &env.kafka)
            .set("group.id", &env.group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("group client");
        Stack {
            kafka,
            mongo,
            env,
            group,
        }
    }

    /// The group's committed offsets (next to read) per partition, or
    /// `None` when the broker does not answer in time (it may be down, or
    /// busy: callers poll again).
    pub fn committed(&self) -> Option<BTreeMap<i32, i64>> {
        self.env.committed_via(&self.group).ok()
    }

    /// The end of each partition, retried until the broker answers.
    pub fn end_offsets(&self) -> BTreeMap<i32, i64> {
        let deadline = Instant::now() + Duration::from_secs(120);
        (0..self.env.partitions)
            .map(|p| loop {
                match self
                    .group
                    .fetch_watermarks(&self.env.topic, p, Duration::from_secs(10))
                {
                    Ok((_, high)) => break (p, high),
                    Err(e) => assert!(Instant::now() < deadline, "watermarks: {e}"),
                }
            })
            .collect()
    }

    /// The workers' settings for this scenario.
    pub fn vars(&self, extra: &[(&str, &str)]) -> BTreeMap<String, String> {
        let cap = CAPACITY.to_string();
        let mut all = vec![
            ("TRADEBUCKET__BUCKETS__CAPACITY", cap.as_str()),
            // Smaller than the default so a run has many commits, hence
            // many distinct moments a kill can land between.
            ("TRADEBUCKET__BATCH__MAX_EVENTS", "1000"),
            // Longer than the helpers' 10 s: the local broker has stalled
            // heartbeats for 10 s (its missing header index, since fixed),
            // and a member that times out and rejoins is never assigned
            // again by it (see docs/reliability.md). A kill -9'd worker is
            // restarted after it.
            ("TRADEBUCKET__KAFKA__SESSION_TIMEOUT_MS", "30000"),
        ];
        all.extend_from_slice(extra);
        self.env.vars(&all)
    }

    /// Waits until the broker answers a watermark query within a second,
    /// three times in a row.
    pub async fn wait_broker_responsive(&self, timeout: Duration) {
        let probe: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.env.kafka)
            .create()
            .expect("probe client");
        let deadline = Instant::now() + timeout;
        let mut quick = 0;
        while quick < 3 {
            assert!(
                Instant::now() < deadline,
                "the broker did not answer promptly within {timeout:?}"
            );
            let asked = Instant::now();
            let answered = probe
                .fetch_watermarks(&self.env.topic, 0, Duration::from_secs(5))
                .is_ok();
            quick = if answered && asked.elapsed() < Duration::from_secs(1) {
                quick + 1
            } else {
                0
            };
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Sum of the group's committed offsets (the cheap progress measure).
    pub fn committed_total(&self) -> i64 {
        self.committed().map_or(0, |c| c.values().sum())
    }
}

// ------------------------------------------------------------- event set

/// What a produced record is, according to the producer: the oracle's
/// ground truth, independent of anything the worker computes.
#[derive(Debug, Clone)]
pub enum Class {
    /// A valid trade seen for the first time.
    Good { key: String, customer: String },
    /// A valid trade whose `tradeId` was produced before (upstream duplicate).
    Duplicate { key: String },
    /// Poison: `poison` names how it was made, `kind` the dead-letter kind
    /// the README promises for it.
    Bad {
        poison: &'static str,
        kind: &'static str,
    },
}

#[derive(Debug, Clone)]
pub struct Rec {
    pub msg: Produced,
    pub class: Class,
}

/// `n` valid trades from the product's generator (`tradebucket produce`),
/// keyed by customer or not.
pub fn good_events(seed: u64, n: usize, keyed: bool) -> Vec<Rec> {
    let opts = ProduceOptions {
        topic: None,
        count: n as u64,
        customers: CUSTOMERS,
        skewed: false,
        tickers: 8,
        rate: 0,
        seed,
        no_keys: !keyed,
        first_id: 0,
    };
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n as u64)
        .map(|i| {
            let (json, customer) = synthetic_event(&mut rng, i, &opts, 1_700_000_000_000);
            let id = serde_json::from_str::<Value>(&json).unwrap()["tradeId"]
                .as_str()
                .unwrap()
                .to_string();
            Rec {
                msg: Produced {
                    key: keyed.then(|| customer.clone()),
                    payload: Some(json.into_bytes()),
                    ..Produced::default()
                },
                class: Class::Good {
                    key: format!("t:{id}"),
                    customer,
                },
            }
        })
        .collect()
}

/// The poison kinds: name, and the dead-letter kind README.md specifies.
pub const POISON: [(&str, &str); 15] = [
    ("not_json", "not_json"),
    ("not_object", "not_object"),
    ("wrong_type", "invalid_field"),
    ("missing_field", "missing_field"),
    ("zero_qty", "invalid_field"),
    ("negative_qty", "invalid_field"),
    ("nan_price", "invalid_field"),
    ("price_40_digits", "invalid_field"),
    ("impossible_date", "invalid_field"),
    ("customer_with_underscore", "invalid_field"),
    ("duplicate_field", "duplicate_field"),
    ("oversize", "oversize"),
    ("empty_payload", "empty"),
    ("null_payload", "empty"),
    ("invalid_utf8", "not_utf8"),
];

/// One bad event of kind `POISON[k]`. Each starts from a complete trade
/// with its own `tradeId`, so a bad event that got stored anyway would show
/// up in MongoDB as an unexpected trade.
fn poison(k: usize, i: usize, rng: &mut StdRng) -> Rec {
    let (name, kind) = POISON[k];
    let customer = rng.random_range(0..CUSTOMERS).to_string();
    let mut t = json!({
        "tradeId": format!("BAD-{i}"), "customerId": customer.parse::<u64>().unwrap(),
        "type": "buy", "ticker": "MDB", "qty": 5, "price": "1.25", "currency": "USD",
        "date": "2024-01-01T00:00:00Z",
    });
    let payload: Option<Vec<u8>> = match name {
        "not_json" => {
            let s = t.to_string();
            Some(s.as_bytes()[..rng.random_range(1..s.len() - 1)].to_vec())
        }
        "not_object" => Some(json!([t]).to_string().into_bytes()),
        "wrong_type" => {
            let (field, value) = [
                ("ticker", json!(42)),
                ("customerId", json!(true)),
                ("qty", json!("many")),
                ("type", json!(["buy"])),
                ("date", json!({"t": 1})),
            ][rng.random_range(0..5)]
            .clone();
            t[field] = value;
            Some(t.to_string().into_bytes())
        }
        "missing_field" => {
            let field = ["customerId", "type", "ticker", "qty", "date"][rng.random_range(0..5)];
            t.as_object_mut().unwrap().remove(field);
            Some(t.to_string().into_bytes())
        }
        "zero_qty" => {
            t["qty"] = [json!(0), json!("0.000"), json!(-0)][rng.random_range(0..3)].clone();
            Some(t.to_string().into_bytes())
        }
        "negative_qty" => {
            t["qty"] = [json!(-3), json!("-0.5")][rng.random_range(0..2)].clone();
            Some(t.to_string().into_bytes())
        }
        "nan_price" => {
            t["price"] = json!(["NaN", "Infinity", "-inf", "nan"][rng.random_range(0..4)]);
            Some(t.to_string().into_bytes())
        }
        "price_40_digits" => {
            let digits = "1234567890".repeat(4);
            // As a string, and as a bare JSON number (kept as text, never a float).
            let s = t.to_string().replace(
                "\"price\":\"1.25\"",
                &if rng.random_bool(0.5) {
                    format!("\"price\":\"{digits}\"")
                } else {
                    format!("\"price\":{digits}")
                },
            );
            Some(s.into_bytes())
        }
        "impossible_date" => {
            t["date"] = json!(
                [
                    "2023-02-30T10:00:00Z",
                    "2023-13-01T00:00:00Z",
                    "2023-04-31T25:61:00Z",
                    "1969-12-31T23:59:59Z",
                    "2300-01-01T00:00:00Z"
                ][rng.random_range(0..5)]
            );
            Some(t.to_string().into_bytes())
        }
        "customer_with_underscore" => {
            t["customerId"] = json!(format!("c_{customer}"));
            Some(t.to_string().into_bytes())
        }
        "duplicate_field" => {
            let s = t.to_string().replacen('{', "{\"qty\":7,", 1);
            Some(s.into_bytes())
        }
        "oversize" => {
            t["pad"] = json!("x".repeat(70_000));
            Some(t.to_string().into_bytes())
        }
        "empty_payload" => Some(Vec::new()),
        "null_payload" => None,
        "invalid_utf8" => {
            let mut b = t.to_string().into_bytes();
            let at = b.iter().position(|&c| c == b'M').unwrap();
            b.insert(at, 0xff);
            Some(b)
        }
        other => unreachable!("{other}"),
    };
    Rec {
        msg: Produced {
            key: Some(customer),
            payload,
            headers: vec![("chaos.origin".into(), "poison".into())],
            ..Produced::default()
        },
        class: Class::Bad { poison: name, kind },
    }
}

/// Interleaves `fraction` of bad events (every kind at least once, the
/// 70 kB oversize ones rarer) at random positions among `goods`.
pub fn with_poison(goods: Vec<Rec>, fraction: f64, seed: u64) -> Vec<Rec> {
    let mut rng = StdRng::seed_from_u64(seed);
    let total = ((goods.len() as f64) / (1.0 - fraction)).round() as usize;
    let bad = total - goods.len();
    let positions: HashSet<usize> = rand::seq::index::sample(&mut rng, total, bad)
        .into_iter()
        .collect();
    let mut goods = goods.into_iter();
    let mut made = 0;
    let mut out = Vec::with_capacity(total);
    for i in 0..total {
        if positions.contains(&i) {
            let k = if made < POISON.len() {
                made
            } else {
                // Weight 1 for oversize, 10 for every other kind.
                let w = rng.random_range(0..(POISON.len() - 1) * 10 + 1);
                if w == 0 {
                    11
                } else {
                    let k = (w - 1) / 10;
                    if k >= 11 {
                        k + 1
                    } else {
                        k
                    }
                }
            };
            out.push(poison(k, made, &mut rng));
            made += 1;
        } else if let Some(g) = goods.next() {
            out.push(g);
        }
    }
    out.extend(goods);
    out
}

/// Produces `fraction` of the events again, same payload and key (so same
/// `tradeId`, same partition), at random later positions.
pub fn with_duplicates(goods: Vec<Rec>, fraction: f64, seed: u64) -> Vec<Rec> {
    let mut rng = StdRng::seed_from_u64(seed);
    let originals = goods.len();
    let total = originals + ((originals as f64) * fraction).round() as usize;
    let dup_at: HashSet<usize> = rand::seq::index::sample(&mut rng, total, total - originals)
        .into_iter()
        .collect();
    let mut goods = goods.into_iter();
    let mut out: Vec<Rec> = Vec::with_capacity(total);
    let mut placed: Vec<usize> = Vec::new();
    for i in 0..total {
        let dup = dup_at.contains(&i) && !placed.is_empty();
        let next = if dup { None } else { goods.next() };
        match next {
            Some(g) => {
                placed.push(out.len());
                out.push(g);
            }
            None => {
                let src = &out[placed[rng.random_range(0..placed.len())]];
                let Class::Good { key, .. } = &src.class else {
                    unreachable!()
                };
                out.push(Rec {
                    msg: src.msg.clone(),
                    class: Class::Duplicate { key: key.clone() },
                });
            }
        }
    }
    out
}

/// Gives every record a `chaos.seq` header: its index in the event set.
/// The dead-letter check uses it to see the original headers survive.
pub fn number(mut recs: Vec<Rec>) -> Vec<Rec> {
    for (i, r) in recs.iter_mut().enumerate() {
        r.msg.headers.push(("chaos.seq".into(), i.to_string()));
    }
    recs
}

// -------------------------------------------------------------- producing

/// Produces `recs` in order, fast: every send is queued before any is
/// awaited. The idempotent producer keeps the order within a partition.
/// Returns each record's (partition, offset).
pub async fn produce(brokers: &str, topic: &str, recs: &[Rec]) -> Vec<(i32, i64)> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "100000")
        .set("message.timeout.ms", "120000")
        .create()
        .expect("producer");
    let mut pending = Vec::with_capacity(recs.len());
    for r in recs {
        let mut headers = OwnedHeaders::new();
        for (k, v) in &r.msg.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(headers);
        if let Some(k) = &r.msg.key {
            record = record.key(k.as_bytes());
        }
        if let Some(p) = &r.msg.payload {
            record = record.payload(p.as_slice());
        }
        if let Some(p) = r.msg.partition {
            record = record.partition(p);
        }
        let delivery = tradebucket::kafka::enqueue(&producer, record)
            .await
            .unwrap_or_else(|e| panic!("produce: {e}"));
        pending.push(delivery);
    }
    let mut out = Vec::with_capacity(pending.len());
    for f in pending {
        let delivery = f
            .await
            .expect("delivery not cancelled")
            .map_err(|(e, _)| e)
            .expect("delivered");
        out.push((delivery.partition, delivery.offset));
    }
    out
}

/// Produces `recs` in `chunks` chunks with `pause` between them, in the
/// background, so that faults land while events are still arriving.
pub fn produce_paced(
    brokers: String,
    topic: String,
    recs: Arc<Vec<Rec>>,
    chunks: usize,
    pause: Duration,
) -> tokio::task::JoinHandle<Vec<(i32, i64)>> {
    tokio::spawn(async move {
        let size = recs.len().div_ceil(chunks.max(1)).max(1);
        let mut out = Vec::with_capacity(recs.len());
        for chunk in recs.chunks(size) {
            out.extend(produce(&brokers, &topic, chunk).await);
            tokio::time::sleep(pause).await;
        }
        out
    })
}

// ---------------------------------------------------------------- workers

/// Starts real `tradebucket run` processes, each logging to its own file
/// under `<report dir>/logs/<scenario>/`.
pub struct Fleet {
    vars: BTreeMap<String, String>,
    dir: PathBuf,
    started: usize,
    pids: Vec<u32>,
}

impl Drop for Fleet {
    /// A failed scenario must not leave workers behind: kill -9 those of
    /// ours still running (checked by executable, since a reaped pid may
    /// belong to someone else by now).
    fn drop(&mut self) {
        let ours = std::fs::canonicalize(env!("CARGO_BIN_EXE_tradebucket")).ok();
        for pid in &self.pids {
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
            if exe.is_some() && exe == ours {
                let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            }
        }
    }
}

impl Fleet {
    pub fn new(scenario: &str, vars: BTreeMap<String, String>) -> Fleet {
        let dir = report_dir().join("logs").join(scenario);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("log dir");
        Fleet {
            vars,
            dir,
            started: 0,
            pids: Vec::new(),
        }
    }

    pub fn start(&mut self) -> WorkerProcess {
        self.start_with(&[])
    }

    pub fn start_with(&mut self, extra: &[(&str, String)]) -> WorkerProcess {
        let log = self.dir.join(format!("worker-{}.log", self.started));
        self.started += 1;
        let child = Command::new(env!("CARGO_BIN_EXE_tradebucket"))
            .arg("run")
            .envs(&self.vars)
            .envs(extra.iter().map(|(k, v)| (*k, v.as_str())))
            .env("TRADEBUCKET__LOG__FORMAT", "text")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start tradebucket");
        self.pids.push(child.id());
        WorkerProcess { child }
    }
}

/// SIGTERM and wait: the exit code, or `None` (killed) if it did not exit
/// within `timeout`.
pub fn sigterm(w: WorkerProcess, timeout: Duration) -> Option<i32> {
    w.signal(15);
    let WorkerProcess { mut child } = w;
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls until `f` holds or `timeout` passes; whether it held.
pub async fn wait_for<F: FnMut() -> bool>(timeout: Duration, mut f: F) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ----------------------------------------------------------------- oracle

/// The trade identity and source position of every record expected in
/// MongoDB (first occurrence of each good trade).
fn expected(recs: &[Rec], placed: &[(i32, i64)]) -> HashMap<String, (String, i32, i64)> {
    let mut out = HashMap::new();
    for (r, &(p, o)) in recs.iter().zip(placed) {
        if let Class::Good { key, customer } = &r.class {
            out.entry(key.clone()).or_insert((customer.clone(), p, o));
        }
    }
    out
}

/// Commit after write: after a crash, every event below the group's
/// committed offsets is stored. Returns the keys that are not.
pub async fn committed_but_not_stored(
    stack: &Stack,
    recs: &[Rec],
    placed: &[(i32, i64)],
) -> Vec<String> {
    let committed = loop {
        if let Some(c) = stack.committed() {
            break c;
        }
    };
    let stored: HashSet<String> = stack
        .env
        .histories()
        .await
        .into_values()
        .flatten()
        .collect();
    let mut missing = Vec::new();
    for (r, &(p, o)) in recs.iter().zip(placed) {
        let key = match &r.class {
            Class::Good { key, .. } | Class::Duplicate { key } => key,
            Class::Bad { .. } => continue,
        };
        if o < committed.get(&p).copied().unwrap_or(0) && !stored.contains(key) {
            missing.push(format!("{key} at {p}/{o}"));
        }
    }
    missing
}

/// `tradebucket audit` (the binary): exit code and its summary numbers.
pub fn audit_binary(vars: &BTreeMap<String, String>) -> (Option<i32>, BTreeMap<String, u64>) {
    let out = Command::new(env!("CARGO_BIN_EXE_tradebucket"))
        .arg("audit")
        .envs(vars)
        .env("TRADEBUCKET__LOG__FORMAT", "text")
        .output()
        .expect("run tradebucket audit");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // "audit: 3 customers, 5 buckets, 17 trades, 0 violations"
    let mut numbers = BTreeMap::new();
    if let Some(line) = stdout.lines().find(|l| l.starts_with("audit:")) {
        for part in line.trim_start_matches("audit:").split(',') {
            let mut words = part.split_whitespace();
            if let (Some(n), Some(what)) = (words.next(), words.next()) {
                if let Ok(n) = n.parse() {
                    numbers.insert(what.to_string(), n);
                }
            }
        }
    }
    for v in stdout
        .lines()
        .filter(|l| l.starts_with("violation:"))
        .take(20)
    {
        eprintln!("audit {v}");
    }
    (out.status.code(), numbers)
}

/// Every record of the dead-letter topic, from the start to its end.
pub fn read_dead_letters(env: &TestEnv) -> Vec<OwnedMessage> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &env.kafka)
        .set("group.id", unique("dlq-audit"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let (_, high) = consumer
        .fetch_watermarks(&env.dlq, 0, Duration::from_secs(10))
        .expect("dead-letter watermarks");
    let mut out = Vec::new();
    if high <= 0 {
        return out;
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&env.dlq, 0, Offset::Beginning)
        .unwrap();
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let last = m.offset() + 1 >= high;
                out.push(m.detach());
                if last {
                    break;
                }
            }
            Some(Err(e)) => panic!("reading the dead-letter topic: {e}"),
            None => {}
        }
    }
    out
}

fn header(m: &OwnedMessage, name: &str) -> Option<String> {
    m.headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .map(|v| String::from_utf8_lossy(v).to_string())
}

/// One scenario's run: its servers, workers, the faults injected, and at
/// the end the verdict.
pub struct Scenario {
    pub name: &'static str,
    pub title: &'static str,
    pub stack: Stack,
    pub fleet: Fleet,
    pub vars: BTreeMap<String, String>,
    pub started: Instant,
    pub faults: Vec<String>,
    /// Exit codes of every SIGTERM'd worker (rolling restarts and the end).
    pub exit_codes: Vec<Option<i32>>,
    /// Scenario-specific checks that failed.
    pub failures: Vec<String>,
    pub notes: serde_json::Map<String, Value>,
}

impl Scenario {
    pub async fn start(
        name: &'static str,
        title: &'static str,
        partitions: i32,
        extra: &[(&str, &str)],
    ) -> Scenario {
        let stack = Stack::start(name, partitions).await;
        let vars = stack.vars(extra);
        Scenario {
            name,
            title,
            fleet: Fleet::new(name, vars.clone()),
            vars,
            stack,
            started: Instant::now(),
            faults: Vec::new(),
            exit_codes: Vec::new(),
            failures: Vec::new(),
            notes: serde_json::Map::new(),
        }
    }

    pub fn fault(&mut self, what: String) {
        eprintln!(
            "[{} +{:.1}s] fault: {what}",
            self.name,
            self.started.elapsed().as_secs_f64()
        );
        self.faults.push(what);
    }

    pub fn note(&mut self, key: &str, value: Value) {
        self.notes.insert(key.to_string(), value);
    }

    /// Stops a worker with SIGTERM, recording its exit code.
    pub fn sigterm(&mut self, w: WorkerProcess) {
        let code = sigterm(w, Duration::from_secs(60));
        self.exit_codes.push(code);
    }

    /// Waits for the group to commit to the end of the topic, stops the
    /// workers with SIGTERM, and checks everything against the recount.
    /// Writes the report, then asserts on it.
    pub async fn finish(
        mut self,
        workers: Vec<WorkerProcess>,
        recs: &[Rec],
        placed: &[(i32, i64)],
    ) {
        assert_eq!(recs.len(), placed.len(), "every record was produced");
        let end = self.stack.end_offsets();
        let timeout = Duration::from_secs(pick(240, 1200));
        let reached = wait_for(timeout, || self.stack.committed().as_ref() == Some(&end)).await;
        let ingest_done = self.started.elapsed().as_secs_f64();
        for w in workers {
            let code = sigterm(w, Duration::from_secs(60));
            self.exit_codes.push(code);
        }
        let env = &self.stack.env;
        let committed = self.stack.committed();
        let committed_to_end = reached && committed.as_ref() == Some(&self.stack.end_offsets());

        // Trades: MongoDB against the recount, trade by trade.
        let expect = expected(recs, placed);
        let histories = env.histories().await;
        let mut seen: HashMap<&str, usize> = HashMap::new();
        let mut unexpected = Vec::new();
        let mut order_violations = Vec::new();
        let mut stored = 0usize;
        for (customer, keys) in &histories {
            let mut last: BTreeMap<i32, i64> = BTreeMap::new();
            for k in keys {
                stored += 1;
                *seen.entry(k.as_str()).or_default() += 1;
                match expect.get(k) {
                    None => unexpected.push(format!("{customer}: {k}")),
                    Some((c, _, _)) if c != customer => {
                        unexpected.push(format!("{customer}: {k} belongs to {c}"))
                    }
                    Some(&(_, p, o)) => {
                        // Within a customer, each source partition's events
                        // keep their order.
                        if let Some(prev) = last.insert(p, o) {
                            if prev >= o {
                                order_violations.push(format!(
                                    "{customer}: partition {p} offset {o} after {prev}"
                                ));
                            }
                        }
                    }
                }
            }
        }
        let lost: Vec<&String> = expect
            .keys()
            .filter(|k| !seen.contains_key(k.as_str()))
            .collect();
        let duplicated: usize = seen.values().map(|n| n - 1).sum();

        let (audit_code, audit) = audit_binary(&self.vars);

        // Dead letters: exactly the bad events, each once, with the
        // original key, payload and headers and the error/source headers.
        let by_pos: HashMap<(i32, i64), usize> =
            placed.iter().enumerate().map(|(i, &po)| (po, i)).collect();
        let bad_expected: HashSet<usize> = recs
            .iter()
            .enumerate()
            .filter(|(_, r)| matches!(r.class, Class::Bad { .. }))
            .map(|(i, _)| i)
            .collect();
        let dl = read_dead_letters(env);
        let mut dl_found: HashSet<usize> = HashSet::new();
        let mut dl_wrong = Vec::new();
        let mut kinds: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for &i in &bad_expected {
            if let Class::Bad { kind, .. } = recs[i].class {
                kinds.entry(kind.to_string()).or_default().0 += 1;
            }
        }
        let mut poisons: BTreeMap<&str, usize> = BTreeMap::new();
        for &i in &bad_expected {
            if let Class::Bad { poison, .. } = recs[i].class {
                *poisons.entry(poison).or_default() += 1;
            }
        }
        for m in &dl {
            let kind = header(m, "tradebucket.error.kind").unwrap_or_default();
            kinds.entry(kind.clone()).or_default().1 += 1;
            let pos = header(m, "tradebucket.source.partition")
                .and_then(|p| p.parse::<i32>().ok())
                .zip(header(m, "tradebucket.source.offset").and_then(|o| o.parse::<i64>().ok()));
            let Some(&i) = pos.and_then(|po| by_pos.get(&po)) else {
                dl_wrong.push(format!("dead letter for an unknown position {pos:?}"));
                continue;
            };
            if !dl_found.insert(i) {
                continue;
            }
            let r = &recs[i];
            let Class::Bad { kind: want, poison } = r.class else {
                dl_wrong.push(format!(
                    "record {i} ({:?}) dead-lettered as {kind}",
                    r.class
                ));
                continue;
            };
            let mut problems = Vec::new();
            if kind != want {
                problems.push(format!("kind {kind}, expected {want}"));
            }
            if header(m, "tradebucket.error.message").is_none_or(|s| s.is_empty()) {
                problems.push("no error message".into());
            }
            if header(m, "tradebucket.source.topic").as_deref() != Some(env.topic.as_str()) {
                problems.push("wrong source topic".into());
            }
            if m.key() != r.msg.key.as_ref().map(|k| k.as_bytes()) {
                problems.push("original key lost".into());
            }
            if m.payload().unwrap_or_default() != r.msg.payload.as_deref().unwrap_or_default() {
                problems.push("original payload changed".into());
            }
            for (k, v) in &r.msg.headers {
                if header(m, k).as_deref() != Some(v.as_str()) {
                    problems.push(format!("original header {k} lost"));
                }
            }
            if !problems.is_empty() {
                dl_wrong.push(format!("record {i} ({poison}): {}", problems.join(", ")));
            }
        }
        let dl_missing: Vec<usize> = bad_expected.difference(&dl_found).copied().collect();

        let trades_expected = expect.len();
        let customers: HashSet<&String> = expect.values().map(|(c, _, _)| c).collect();
        let duplicates_produced = recs
            .iter()
            .filter(|r| matches!(r.class, Class::Duplicate { .. }))
            .count();
        let audit_violations = audit.get("violations").copied();
        let report = json!({
            "scenario": self.name,
            "title": self.title,
            "size": if full() { "full" } else { "reduced" },
            "seconds_total": (self.started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
            "seconds_until_committed_to_end": (ingest_done * 10.0).round() / 10.0,
            "events_produced": recs.len(),
            "partitions": env.partitions,
            "customers": customers.len(),
            "capacity": CAPACITY,
            "trades_expected": trades_expected,
            "upstream_duplicates_produced": duplicates_produced,
            "bad_events_produced": bad_expected.len(),
            "poison_kinds": poisons,
            "faults_injected": self.faults.len(),
            "faults": self.faults,
            "trades_stored": stored,
            "lost": lost.len(),
            "duplicated": duplicated,
            "unexpected": unexpected.len(),
            "order_violations": order_violations.len(),
            "dead_letters_expected": bad_expected.len(),
            "dead_letters_actual": dl.len(),
            "dead_letters_distinct": dl_found.len(),
            "dead_letters_missing": dl_missing.len(),
            "dead_letters_wrong": dl_wrong.len(),
            "dead_letter_kinds_expected_actual": kinds,
            "audit_exit_code": audit_code,
            "audit": audit,
            "committed_to_end": committed_to_end,
            "committed": committed,
            "sigterm_exit_codes": self.exit_codes,
            "failures": self.failures,
            "notes": self.notes,
        });
        let text = serde_json::to_string_pretty(&report).unwrap();
        let dir = report_dir();
        std::fs::create_dir_all(&dir).expect("report dir");
        let path = dir.join(format!("{}.json", self.name));
        std::fs::write(&path, &text).expect("write report");
        eprintln!("chaos report {}:\n{text}", path.display());
        for (what, list) in [
            (
                "lost",
                lost.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            ),
            ("unexpected", unexpected.clone()),
            ("out of order", order_violations.clone()),
            ("dead letters wrong", dl_wrong.clone()),
            (
                "dead letters missing",
                dl_missing.iter().map(|i| format!("record {i}")).collect(),
            ),
        ] {
            for item in list.iter().take(10) {
                eprintln!("{what}: {item}");
            }
        }

        assert!(
            self.failures.is_empty(),
            "failed checks: {:?}",
            self.failures
        );
        assert_eq!(lost.len(), 0, "trades lost");
        assert_eq!(duplicated, 0, "trades duplicated");
        assert!(unexpected.is_empty(), "trades stored that should not be");
        assert!(order_violations.is_empty(), "partition order broken");
        assert_eq!(stored, trades_expected);
        assert_eq!(audit_code, Some(0), "tradebucket audit exits 0");
        assert_eq!(audit_violations, Some(0), "audit clean");
        assert_eq!(audit.get("trades").copied(), Some(trades_expected as u64));
        assert_eq!(
            dl.len(),
            bad_expected.len(),
            "dead letters: exactly the bad events"
        );
        assert!(
            dl_missing.is_empty() && dl_wrong.is_empty(),
            "dead letters wrong"
        );
        assert!(committed_to_end, "committed {committed:?} short of the end");
        assert!(
            self.exit_codes.iter().all(|c| *c == Some(0)),
            "every SIGTERM exits 0: {:?}",
            self.exit_codes
        );
        // Leave nothing behind: the private servers go with the stack.
        let _ = std::fs::remove_dir_all(report_dir().join("logs").join(self.name));
    }
}
