//! What every chaos scenario shares: sizes, private servers, the event set
//! (good trades from the product's own generator, poison, upstream
//! duplicates), an ordered fast producer, and the scenario's run (its
//! workers, each logging to its own file, and the faults injected). The
//! verdict at the end is in `verdict.rs`; servers, processes and polling
//! come from the test kit.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::consumer::{BaseConsumer, Consumer};
use serde_json::{json, Value};

use testkit::{
    free_port, poll_until, produce_fast, produce_fast_with, trade, FaultProxy, Fleet, PrivateKafka,
    PrivateMongo, Produced, Protocol, TestEnv, WorkerProcess,
};
use tradebucket::cli::{synthetic_event, ProduceOptions};

/// How often the scenarios look at the group's progress: often enough that
/// a kill lands soon after the commit it was aimed at.
pub const POLL: Duration = Duration::from_millis(50);

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

/// Apache Kafka (one node or a cluster) and a MongoDB-protocol server of
/// the scenario's own, so killing or stopping them never touches anything else, plus the
/// topic, dead-letter topic, group and database on them.
pub struct Stack {
    pub kafka: PrivateKafka,
    pub mongo: PrivateMongo,
    pub env: TestEnv,
    /// One long-lived client for the group's committed offsets: a new
    /// client per poll costs the loaded broker a metadata round each time.
    group: BaseConsumer,
}

/// Fault proxies in front of a stack's two servers (see
/// [`Stack::start_behind_proxies`]).
pub struct Proxies {
    pub kafka: FaultProxy,
    pub mongo: FaultProxy,
}

impl Proxies {
    /// The workers' settings that send them through the proxies.
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        vec![
            ("TRADEBUCKET__KAFKA__BROKERS", self.kafka.address()),
            (
                "TRADEBUCKET__MONGODB__URI",
                format!("mongodb://{}/?directConnection=true", self.mongo.address()),
            ),
        ]
    }
}

impl Stack {
    pub async fn start(name: &str, partitions: i32) -> Stack {
        let kafka = PrivateKafka::start().await;
        let mongo = PrivateMongo::start().await;
        Self::on(kafka, mongo, name, partitions).await
    }

    /// A stack whose broker advertises a fault proxy, and a fault proxy in
    /// front of its MongoDB server. The harness's own MongoDB client goes
    /// direct; Kafka clients all pass the proxy once bootstrapped.
    pub async fn start_behind_proxies(name: &str, partitions: i32) -> (Stack, Proxies) {
        let port = free_port();
        let kafka_proxy = FaultProxy::start(&format!("127.0.0.1:{port}"), 0, Protocol::Tcp).await;
        let kafka = PrivateKafka::start_advertising(port, Some(kafka_proxy.address())).await;
        let mongo = PrivateMongo::start().await;
        let mongo_proxy =
            FaultProxy::start(&format!("127.0.0.1:{}", mongo.port), 0, Protocol::Mongo).await;
        let stack = Self::on(kafka, mongo, name, partitions).await;
        let proxies = Proxies {
            kafka: kafka_proxy,
            mongo: mongo_proxy,
        };
        (stack, proxies)
    }

    /// A stack on a cluster of `nodes` Kafka nodes, its topics replicated
    /// to every node with `min.insync.replicas=2`.
    pub async fn start_cluster(name: &str, partitions: i32, nodes: usize) -> Stack {
        let kafka = PrivateKafka::cluster(nodes).await;
        let mongo = PrivateMongo::start().await;
        let (brokers, uri) = (kafka.brokers(), mongo.uri());
        let env = TestEnv::on_replicated(brokers, uri, name, partitions, nodes as i32).await;
        Self::with(kafka, mongo, env)
    }

    async fn on(kafka: PrivateKafka, mongo: PrivateMongo, name: &str, partitions: i32) -> Stack {
        let env = TestEnv::on(kafka.brokers(), mongo.uri(), name, partitions).await;
        Self::with(kafka, mongo, env)
    }

    fn with(kafka: PrivateKafka, mongo: PrivateMongo, env: TestEnv) -> Stack {
        let group = env.group_client();
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
        ];
        all.extend_from_slice(extra);
        self.env.vars(&all)
    }

    /// Waits until the broker answers a watermark query within a second,
    /// three times in a row.
    pub async fn wait_broker_responsive(&self, timeout: Duration) {
        let probe: BaseConsumer = rdkafka::config::ClientConfig::new()
            .set("bootstrap.servers", &self.env.kafka)
            .create()
            .expect("probe client");
        let mut quick = 0;
        let responsive = poll_until(timeout, Duration::from_millis(500), || {
            let asked = Instant::now();
            let answered = probe
                .fetch_watermarks(&self.env.topic, 0, Duration::from_secs(5))
                .is_ok();
            quick = if answered && asked.elapsed() < Duration::from_secs(1) {
                quick + 1
            } else {
                0
            };
            std::future::ready(quick >= 3)
        })
        .await;
        assert!(
            responsive,
            "the broker did not answer promptly within {timeout:?}"
        );
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
    /// the README promises for it. `shortened`: the record is too large for
    /// the dead-letter topic (over the dead-letter producer's 1,000,000-byte
    /// `message.max.bytes`), so its dead letter is the shortened form.
    Bad {
        poison: &'static str,
        kind: &'static str,
        shortened: bool,
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

/// The complete trade a bad event starts from, with its own `tradeId`, so
/// a bad event that got stored anyway would show up in MongoDB as an
/// unexpected trade.
pub fn bad_trade(id: String, customer: u64) -> Value {
    trade(id)
        .customer(customer)
        .qty(5)
        .price("1.25")
        .date("2024-01-01T00:00:00Z")
        .json()
}

/// One bad event of kind `POISON[k]`, from a [`bad_trade`].
fn poison(k: usize, i: usize, rng: &mut StdRng) -> Rec {
    let (name, kind) = POISON[k];
    let customer = rng.random_range(0..CUSTOMERS);
    let t = bad_trade(format!("BAD-{i}"), customer);
    Rec {
        msg: Produced {
            key: Some(customer.to_string()),
            payload: poison_payload(name, t, customer, rng),
            headers: vec![("chaos.origin".into(), "poison".into())],
            ..Produced::default()
        },
        class: Class::Bad {
            poison: name,
            kind,
            shortened: false,
        },
    }
}

/// Dates the decoder must refuse: no such day or time, or outside
/// 1970..2286.
const IMPOSSIBLE_DATES: [&str; 5] = [
    "2023-02-30T10:00:00Z",
    "2023-13-01T00:00:00Z",
    "2023-04-31T25:61:00Z",
    "1969-12-31T23:59:59Z",
    "2300-01-01T00:00:00Z",
];

/// The payload of poison `name`, made from the valid trade `t`.
fn poison_payload(name: &str, mut t: Value, customer: u64, rng: &mut StdRng) -> Option<Vec<u8>> {
    match name {
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
            t["date"] = json!(IMPOSSIBLE_DATES[rng.random_range(0..5)]);
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

/// Produces `recs` in order, fast (every send queued before any is
/// awaited); returns each record's (partition, offset).
pub async fn produce(brokers: &str, topic: &str, recs: &[Rec]) -> Vec<(i32, i64)> {
    // Collected first: a `map` closure held across the await would make
    // the future unusable in `tokio::spawn` (higher-ranked lifetimes).
    let messages: Vec<&Produced> = recs.iter().map(|r| &r.msg).collect();
    produce_fast(brokers, topic, messages).await
}

/// [`produce`] with librdkafka producer `options` on top (a codec, a
/// larger `message.max.bytes`).
pub async fn produce_with(
    brokers: &str,
    topic: &str,
    recs: &[Rec],
    options: &[(&str, &str)],
) -> Vec<(i32, i64)> {
    let messages: Vec<&Produced> = recs.iter().map(|r| &r.msg).collect();
    produce_fast_with(brokers, topic, messages, options).await
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

/// The binary under test: only the root package's tests know its path.
pub fn bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_tradebucket"))
}

/// The scenario's workers: real `tradebucket run` processes, each logging
/// to its own file under `<report dir>/logs/<scenario>/`, killed -9 if
/// still running when the scenario ends (a failed one must not leave
/// workers behind).
pub fn fleet(scenario: &str, vars: BTreeMap<String, String>) -> Fleet {
    Fleet::new(bin(), vars, report_dir().join("logs").join(scenario))
}

// --------------------------------------------------------------- scenario

/// One scenario's run: its servers, workers, the faults injected, and at
/// the end the verdict (`Scenario::finish`, in `verdict.rs`).
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
    /// Dead letters may repeat (same source position): what the product
    /// promises when a partition moves or a worker dies between a dead
    /// letter and its commit (docs/design.md, "Known limits"). Scenarios
    /// without rebalances or crashes keep the exact count.
    pub dead_letters_at_least_once: bool,
    /// Also run `tradebucket reconcile` at the end: every record the group
    /// committed past must be accounted for (the storm).
    pub reconcile: bool,
    /// Count trades by the `ref` each good record carries in its payload
    /// (an id of the test's own, stored with the trade as an extra field)
    /// rather than by the product's key, and check each stored entry's
    /// product key is the one its first record gives it (the storm).
    pub by_ref: bool,
    /// Check every customer's chain of buckets in the test too
    /// (`chains.rs`), against these capacities (those the workers had).
    pub chains: Option<BTreeSet<u32>>,
    /// MongoDB refuses (or refused for a while) trades of this ticker:
    /// their dead letters are expected, and their trades still stored
    /// once (replayed).
    pub refused_ticker: Option<&'static str>,
}

impl Scenario {
    pub async fn start(
        name: &'static str,
        title: &'static str,
        partitions: i32,
        extra: &[(&str, &str)],
    ) -> Scenario {
        let stack = Stack::start(name, partitions).await;
        Self::on(stack, name, title, extra)
    }

    /// A scenario on `stack` (one behind fault proxies, say).
    pub fn on(
        stack: Stack,
        name: &'static str,
        title: &'static str,
        extra: &[(&str, &str)],
    ) -> Scenario {
        let vars = stack.vars(extra);
        Scenario {
            name,
            title,
            fleet: fleet(name, vars.clone()),
            vars,
            stack,
            started: Instant::now(),
            faults: Vec::new(),
            exit_codes: Vec::new(),
            failures: Vec::new(),
            notes: serde_json::Map::new(),
            dead_letters_at_least_once: false,
            reconcile: false,
            by_ref: false,
            chains: None,
            refused_ticker: None,
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
        let code = w.sigterm(Duration::from_secs(60));
        self.exit_codes.push(code);
    }
}

/// `tradebucket_assigned_partitions`: the partitions a worker owns now.
pub const ASSIGNED: &str = "tradebucket_assigned_partitions";
/// `tradebucket_rebalances_total{kind="revoked"}`: revocations so far.
pub const REVOKED: &str = "tradebucket_rebalances_total{kind=\"revoked\"}";

/// The value of one series (name and labels, as exposed) of the worker
/// listening on `port`, from its `/metrics`.
pub async fn worker_metric(port: u16, series: &str) -> Option<u64> {
    let (_, body) = testkit::http_get(&format!("http://127.0.0.1:{port}/metrics")).await?;
    let line = body
        .lines()
        .find(|l| l.split_whitespace().next() == Some(series))?;
    line.split_whitespace()
        .nth(1)?
        .parse::<f64>()
        .ok()
        .map(|v| v as u64)
}
