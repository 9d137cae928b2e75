//! The storm (issue #25): every other scenario tests one condition; real
//! incidents combine them. Each seed draws a combination: keyed and
//! unkeyed producers; upstream duplicates within and across partitions and
//! across spellings of the customer id (`7` and `"7"`); one to three
//! workers with different capacities and batch sizes, joining, leaving,
//! killed; MongoDB write replies dropped after the write, MongoDB or Kafka
//! black-holed, a broker restart; a few hot customers among many cold
//! ones, and some bad records. The oracle is `Scenario::finish`: every
//! distinct trade stored exactly once under its customer, each customer's
//! pages one valid chain (the binary's audit), every bad record
//! dead-lettered (and nothing else), offsets committed to the end, no exit
//! nobody asked for, and `tradebucket reconcile` clean. Dead letters may repeat when a partition moves or a
//! worker dies between a dead letter and its commit: the product promises
//! them at least once (docs/design.md, "Known limits"); the report counts
//! the repeats (`dead_letters` against `dead_letters_distinct`).
//!
//! Seeds: [`DEFAULT_SEEDS`] in the default run (reduced size);
//! `TRADEBUCKET_STORM_SEEDS=4,9,20-29` chooses others; with
//! `TRADEBUCKET_CHAOS=full`, full size. Every seed prints its conditions
//! first, so a failure can be rerun alone.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use testkit::{free_port, poll_until, Produced, WorkerProcess};
use tradebucket::cli::{synthetic_event, ProduceOptions};

use crate::harness::*;

/// The seeds of the default run. A seed that ever failed stays here, with
/// what it found:
/// - 3: dead letters repeated after a rebalance (35 for 31 bad records):
///   the oracle now allows repeats of one source position, as documented;
/// - 8: a worker left while the broker restarted, its LeaveGroup was lost,
///   and the local broker left its partitions unassigned: a join now
///   follows a group that stays short;
/// - 14: a leave, a join and a leave inside one rebalance stuck the local
///   broker's group: membership changes now come one rebalance at a time.
const DEFAULT_SEEDS: [u64; 5] = [1, 2, 3, 8, 14];

/// Session timeout of the storm's workers: short, so a killed worker's
/// partitions move on soon (it is restarted only after it expired, as
/// STACK.md asks of the local broker).
const SESSION: Duration = Duration::from_secs(10);

/// One worker's settings.
#[derive(Debug, Clone)]
struct Spec {
    capacity: u32,
    max_events: usize,
}

#[derive(Debug, Clone)]
enum Fault {
    /// kill -9 a worker; restarted after its session expired.
    Kill,
    /// SIGTERM a worker and start it again at once.
    Restart,
    /// Another worker joins (up to three).
    Join,
    /// A worker leaves for good (SIGTERM), if another stays.
    Leave,
    /// MongoDB write replies dropped after the write, for a while.
    DropReplies {
        share: f64,
        secs: u64,
    },
    MongoHole {
        secs: u64,
    },
    /// Shorter than the session timeout: nobody is thrown out of the group.
    KafkaHole {
        secs: u64,
    },
    BrokerRestart,
}

/// What a seed drew.
#[derive(Debug, Clone)]
struct Conditions {
    seed: u64,
    events: usize,
    partitions: i32,
    /// Share of records produced with the customer as key.
    keyed: f64,
    /// Most trades for a few customers.
    hot: bool,
    workers: Vec<Spec>,
    /// Shares of trades sent again: later on the same partition; at once
    /// on another partition (unkeyed only); in the other spelling.
    dup_same: f64,
    dup_cross: f64,
    /// Share of trades whose customer id is sent as text (`"7"`).
    text_ids: f64,
    poison: f64,
    faults: Vec<Fault>,
}

fn spec(r: &mut StdRng) -> Spec {
    Spec {
        capacity: [2, 3, 4, 10][r.random_range(0..4)],
        max_events: [10, 50, 200, 1000][r.random_range(0..4)],
    }
}

fn fault(r: &mut StdRng) -> Fault {
    match r.random_range(0..8) {
        0 => Fault::Kill,
        1 => Fault::Restart,
        2 => Fault::Join,
        3 => Fault::Leave,
        4 => Fault::DropReplies {
            share: r.random_range(0.1..0.5),
            secs: r.random_range(3..10),
        },
        5 => Fault::MongoHole {
            secs: r.random_range(3..15),
        },
        6 => Fault::KafkaHole {
            secs: r.random_range(2..6),
        },
        _ => Fault::BrokerRestart,
    }
}

impl Conditions {
    fn draw(seed: u64) -> Conditions {
        let r = &mut StdRng::seed_from_u64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let keyed = [0.0, 0.5, 1.0][r.random_range(0..3)];
        Conditions {
            seed,
            events: events(3_000, 40_000),
            partitions: r.random_range(2..=6),
            keyed,
            hot: r.random_bool(0.7),
            workers: (0..r.random_range(1..=3)).map(|_| spec(r)).collect(),
            dup_same: r.random_range(0.0..0.1),
            dup_cross: if keyed < 1.0 {
                r.random_range(0.0..0.35)
            } else {
                0.0
            },
            text_ids: [0.0, 0.2, 0.5][r.random_range(0..3)],
            poison: [0.0, 0.01][r.random_range(0..2)],
            faults: (0..r.random_range(1..=3)).map(|_| fault(r)).collect(),
        }
    }
}

impl Conditions {
    /// One line for the table in docs/reliability.md (tests/chaos/render.py).
    fn summary(&self) -> String {
        let pct = |x: f64| format!("{:.0}%", x * 100.0);
        let workers: Vec<String> = self
            .workers
            .iter()
            .map(|w| format!("{}/{}", w.capacity, w.max_events))
            .collect();
        let faults: Vec<&str> = self.faults.iter().map(Fault::name).collect();
        format!(
            "{} partitions, keyed {}, {}, workers (capacity/batch) {}, dups {} same + {} cross, text ids {}, poison {}; {}",
            self.partitions,
            pct(self.keyed),
            if self.hot { "hot" } else { "even" },
            workers.join(" "),
            pct(self.dup_same),
            pct(self.dup_cross),
            pct(self.text_ids),
            pct(self.poison),
            faults.join(", "),
        )
    }
}

impl Fault {
    fn name(&self) -> &'static str {
        match self {
            Fault::Kill => "kill -9",
            Fault::Restart => "restart",
            Fault::Join => "join",
            Fault::Leave => "leave",
            Fault::DropReplies { .. } => "replies dropped",
            Fault::MongoHole { .. } => "MongoDB hole",
            Fault::KafkaHole { .. } => "Kafka hole",
            Fault::BrokerRestart => "broker restart",
        }
    }
}

/// `TRADEBUCKET_STORM_SEEDS` (`1,2,10-19`), or the default seeds.
fn seeds() -> Vec<u64> {
    let Ok(list) = std::env::var("TRADEBUCKET_STORM_SEEDS") else {
        return DEFAULT_SEEDS.to_vec();
    };
    let mut out = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<u64>().unwrap()..=b.parse::<u64>().unwrap()),
            None => out.push(part.parse().expect("TRADEBUCKET_STORM_SEEDS: numbers")),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm() {
    for seed in seeds() {
        let c = Conditions::draw(seed);
        eprintln!(
            "storm seed {seed} (rerun: TRADEBUCKET_STORM_SEEDS={seed} cargo test --test chaos -- storm::storm --exact): {c:?}"
        );
        run(c).await;
    }
}

/// One seed: the records, the workers, the faults while records arrive,
/// then the verdict.
async fn run(c: Conditions) {
    let name: &'static str = Box::leak(format!("storm-{}", c.seed).into_boxed_str());
    let (stack, proxies) = Stack::start_behind_proxies(name, c.partitions).await;
    let session = format!("{}s", SESSION.as_secs());
    let extra = [("TRADEBUCKET__KAFKA__SESSION_TIMEOUT", session.as_str())];
    let mut s = Scenario::on(stack, name, "The storm: conditions drawn per seed", &extra);
    s.note("conditions", json!(format!("{c:?}")));
    s.note("drawn", json!(c.summary()));
    // Rebalances and kills are drawn: a dead letter sent before a partition
    // moved, or before a crash, is sent again by the next owner.
    s.dead_letters_at_least_once = true;
    s.reconcile = true;
    let recs = Arc::new(records(&c));
    let producer = produce_paced(
        s.stack.env.kafka.clone(),
        s.stack.env.topic.clone(),
        recs.clone(),
        pick(10, 40),
        Duration::from_millis(500),
    );
    let mut storm = Storm {
        workers: Vec::new(),
        proxies,
        rng: StdRng::seed_from_u64(c.seed),
        partitions: c.partitions,
    };
    for w in &c.workers {
        storm.start(&mut s, w);
        storm.settle(&mut s, "a worker joined").await;
    }
    for f in &c.faults {
        storm.wait_for_progress(&s, recs.len()).await;
        storm.apply(&mut s, f, &c).await;
        if matches!(f, Fault::Kill | Fault::Restart | Fault::Join | Fault::Leave) {
            storm.settle(&mut s, "a membership change").await;
        }
    }
    let placed = producer.await.expect("producer");
    let workers = storm.workers.into_iter().map(|(w, _, _)| w).collect();
    s.finish(workers, &recs, &placed).await;
}

/// The workers running (with their HTTP port), and the means to hurt them.
struct Storm {
    workers: Vec<(WorkerProcess, Spec, u16)>,
    proxies: Proxies,
    rng: StdRng,
    partitions: i32,
}

impl Storm {
    fn start(&mut self, s: &mut Scenario, w: &Spec) {
        let port = free_port();
        let vars = [
            ("TRADEBUCKET__BUCKETS__CAPACITY", w.capacity.to_string()),
            ("TRADEBUCKET__BATCH__MAX_EVENTS", w.max_events.to_string()),
            ("TRADEBUCKET__HTTP__LISTEN", format!("127.0.0.1:{port}")),
        ];
        let mut all: Vec<(&str, String)> = self.proxies.vars();
        all.extend(vars);
        self.workers
            .push((s.fleet.start_with(&all), w.clone(), port));
    }

    /// Waits (up to `limit`) until the live workers own every partition
    /// between them: the rebalance a membership change started is over.
    /// Shaped around the local broker: Tansu 0.6.0's coordinator can get
    /// stuck when members join and leave inside one rebalance (seed 14
    /// stayed unassigned for minutes after a leave, a join and a leave
    /// within a second; docs/testing.md), which Apache Kafka handles. So
    /// membership changes come one rebalance at a time.
    async fn settled(&self, limit: Duration) -> bool {
        let ports: Vec<u16> = self.workers.iter().map(|w| w.2).collect();
        let total = self.partitions as u64;
        poll_until(limit, Duration::from_millis(250), || async {
            let mut owned = 0;
            for &port in &ports {
                owned += worker_metric(port, ASSIGNED).await.unwrap_or(0);
            }
            owned == total
        })
        .await
    }

    /// Until a random share of what is produced so far is committed, so
    /// faults land mid-stream.
    async fn wait_for_progress(&mut self, s: &Scenario, total: usize) {
        let target = (total as f64 * self.rng.random_range(0.05..0.4)) as i64;
        poll_until(Duration::from_secs(120), POLL, || async {
            s.stack.committed_total() >= target
        })
        .await;
    }

    async fn apply(&mut self, s: &mut Scenario, f: &Fault, c: &Conditions) {
        let at = s.stack.committed_total();
        s.fault(format!("{f:?} at {at} committed"));
        match f {
            Fault::Kill | Fault::Restart | Fault::Leave => self.stop_one(s, f).await,
            Fault::Join if self.workers.len() < 3 => {
                let w = c.workers[0].clone();
                self.start(s, &w);
            }
            Fault::Join => {}
            Fault::DropReplies { share, secs } => {
                self.proxies.mongo.drop_write_replies(*share);
                tokio::time::sleep(Duration::from_secs(*secs)).await;
                self.proxies.mongo.drop_write_replies(0.0);
            }
            Fault::MongoHole { secs } => hole(&self.proxies.mongo, *secs).await,
            Fault::KafkaHole { secs } => hole(&self.proxies.kafka, *secs).await,
            Fault::BrokerRestart => {
                s.stack.kafka.kill9();
                tokio::time::sleep(Duration::from_millis(self.rng.random_range(500..3000))).await;
                s.stack.kafka.restart().await;
            }
        }
    }

    /// Kill, restart or let leave one worker (a leave only if another
    /// stays).
    async fn stop_one(&mut self, s: &mut Scenario, f: &Fault) {
        if matches!(f, Fault::Leave) && self.workers.len() < 2 {
            return;
        }
        let i = self.rng.random_range(0..self.workers.len());
        let (w, spec, _) = self.workers.remove(i);
        match f {
            Fault::Kill => {
                w.kill9();
                tokio::time::sleep(SESSION + Duration::from_secs(2)).await;
                self.start(s, &spec);
            }
            Fault::Restart => {
                s.sigterm(w);
                self.settle(s, "a worker left to restart").await;
                self.start(s, &spec);
            }
            _ => s.sigterm(w),
        }
    }
}

impl Storm {
    /// [`Storm::settled`], or a failure of the seed saying after what. A
    /// group still short of partitions a session timeout after a change
    /// gets a worker more, as an orchestrator keeping its replica count
    /// would: the local broker hands a departed member's partitions on
    /// only when a member joins (STACK.md), and a member whose LeaveGroup
    /// was lost (it left while the broker restarted) has departed so
    /// (seed 8). Apache Kafka reassigns them when the session expires.
    async fn settle(&mut self, s: &mut Scenario, after: &str) {
        let first = SESSION + Duration::from_secs(5);
        if self.workers.is_empty() || self.settled(first).await {
            return;
        }
        s.fault(format!("not settled after {after}: a worker joins"));
        let spec = self.workers[0].1.clone();
        self.start(s, &spec);
        if !self.settled(Duration::from_secs(90)).await {
            let why = format!("the group did not settle after {after}, nor after a join");
            s.failures.push(why);
        }
    }
}

async fn hole(proxy: &testkit::FaultProxy, secs: u64) {
    proxy.black_hole();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    proxy.heal();
}

/// The seed's records, in production order.
fn records(c: &Conditions) -> Vec<Rec> {
    let rng = &mut StdRng::seed_from_u64(c.seed ^ 0xa5a5);
    // Later copies on the same partition first: `with_duplicates` copies
    // originals only.
    let sent = with_duplicates(goods(c, rng), c.dup_same, c.seed);
    let mut recs = Vec::with_capacity(sent.len() * 2);
    for r in sent {
        let original = matches!(r.class, Class::Good { .. });
        let copy = (original && rng.random_bool(c.dup_cross)).then(|| cross_copy(&r, c, rng));
        recs.push(r);
        recs.extend(copy);
    }
    number(with_poison(recs, c.poison, c.seed))
}

/// The good trades: the product's generator, each keyed or sent to a
/// random partition, its customer id as a number or as text.
fn goods(c: &Conditions, rng: &mut StdRng) -> Vec<Rec> {
    let opts = ProduceOptions {
        topic: None,
        count: c.events as u64,
        customers: CUSTOMERS,
        skewed: c.hot,
        tickers: 8,
        rate: 0,
        seed: c.seed,
        no_keys: true,
        first_id: 0,
    };
    (0..c.events as u64)
        .map(|i| {
            let (json, customer) = synthetic_event(rng, i, &opts, 1_700_000_000_000);
            let mut v: Value = serde_json::from_str(&json).unwrap();
            let key = format!("t:{}", v["tradeId"].as_str().unwrap());
            if rng.random_bool(c.text_ids) {
                v["customerId"] = Value::String(customer.clone());
            }
            let keyed = rng.random_bool(c.keyed);
            let msg = Produced {
                key: keyed.then(|| customer.clone()),
                payload: Some(v.to_string().into_bytes()),
                partition: (!keyed).then(|| rng.random_range(0..c.partitions)),
                ..Produced::default()
            };
            Rec {
                msg,
                class: Class::Good { key, customer },
            }
        })
        .collect()
}

/// The same trade sent again at once by an unkeyed upstream: to another
/// partition, sometimes in the other spelling of the customer id.
fn cross_copy(g: &Rec, c: &Conditions, rng: &mut StdRng) -> Rec {
    let Class::Good { key, .. } = &g.class else {
        unreachable!("goods only")
    };
    let mut msg = g.msg.clone();
    let from = msg.partition.unwrap_or(0);
    msg.key = None;
    msg.partition = Some((from + rng.random_range(1..c.partitions)) % c.partitions);
    if rng.random_bool(0.5) {
        let mut v: Value = serde_json::from_slice(msg.payload.as_deref().unwrap()).unwrap();
        v["customerId"] = match &v["customerId"] {
            Value::String(s) => Value::from(s.parse::<u64>().unwrap()),
            other => Value::String(other.to_string()),
        };
        msg.payload = Some(v.to_string().into_bytes());
    }
    Rec {
        msg,
        class: Class::Duplicate { key: key.clone() },
    }
}
