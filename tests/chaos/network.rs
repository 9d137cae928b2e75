//! Scenarios 9-12 (issue #17): the network lies. Both servers sit behind
//! `testkit::FaultProxy`; the worker reaches them only through it, and
//! never sees a refused connection: replies are dropped after the write
//! was applied, connections hang, links turn slow. Each ends in
//! `Scenario::finish` (every trade once, dense and in order, dead letters
//! exact, offsets at the end, every exit 0), and checks that `/healthz`
//! never failed while the worker waited on a bound of its own.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use testkit::{free_port, http_get, poll_until, WorkerProcess};

use crate::harness::*;

/// Time limits in these scenarios: short, so a reduced run spends its time
/// on the faults and not on waiting (the defaults are 30 s / 20 s / 30 s).
const LIMITS: [(&str, &str); 3] = [
    ("TRADEBUCKET__TIMEOUTS__MONGODB_OPERATION", "10s"),
    ("TRADEBUCKET__TIMEOUTS__MONGODB_WRITE_CONCERN", "5s"),
    ("TRADEBUCKET__TIMEOUTS__KAFKA_REQUEST", "10s"),
];

/// What the probes of `/healthz` and `/readyz` saw.
#[derive(Default)]
struct Probed {
    probes: AtomicUsize,
    unhealthy: AtomicUsize,
    not_ready: Mutex<BTreeSet<String>>,
}

/// Probes both endpoints every 500 ms until dropped (the task ends with
/// the returned guard's handle aborted).
struct Prober {
    port: u16,
    seen: Arc<Probed>,
    task: tokio::task::JoinHandle<()>,
}

impl Prober {
    fn start(port: u16) -> Prober {
        let seen = Arc::new(Probed::default());
        let shared = seen.clone();
        let task = tokio::spawn(async move {
            let base = format!("http://127.0.0.1:{port}");
            loop {
                shared.probes.fetch_add(1, Ordering::Relaxed);
                if !matches!(http_get(&format!("{base}/healthz")).await, Some((200, _))) {
                    shared.unhealthy.fetch_add(1, Ordering::Relaxed);
                }
                if let Some((code, body)) = http_get(&format!("{base}/readyz")).await {
                    if code != 200 {
                        shared
                            .not_ready
                            .lock()
                            .unwrap()
                            .insert(body.trim().to_string());
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        Prober { port, seen, task }
    }

    /// After a heal: waits (up to 120 s) for `/readyz` to answer 200 again,
    /// without a restart; notes how long it took, or fails the scenario.
    async fn ready_again(&self, s: &mut Scenario, healed: Instant) {
        let readyz = format!("http://127.0.0.1:{}/readyz", self.port);
        let ready = poll_until(
            Duration::from_secs(120),
            Duration::from_millis(200),
            || async { matches!(http_get(&readyz).await, Some((200, _))) },
        )
        .await;
        s.note(
            "seconds_to_ready_after_heal",
            json!(healed.elapsed().as_secs_f64()),
        );
        if !ready {
            s.failures
                .push("not ready again within 120 s of the heal".into());
        }
    }

    /// Stops probing; records what was seen, and fails the scenario on a
    /// failed liveness probe.
    fn stop(self, s: &mut Scenario) -> BTreeSet<String> {
        self.task.abort();
        let unhealthy = self.seen.unhealthy.load(Ordering::Relaxed);
        let reasons = self.seen.not_ready.lock().unwrap().clone();
        s.note(
            "healthz_probes",
            json!(self.seen.probes.load(Ordering::Relaxed)),
        );
        s.note("healthz_failures", json!(unhealthy));
        s.note("readyz_reasons", json!(reasons));
        if unhealthy > 0 {
            s.failures.push(format!(
                "/healthz failed {unhealthy} times during the scenario"
            ));
        }
        reasons
    }
}

/// A scenario behind fault proxies, with the first `now` of its `n`
/// events produced, one worker started, ready, and probed.
async fn start(
    name: &'static str,
    title: &'static str,
    seed: u64,
    (n, now): (usize, usize),
    extra: &[(&str, &str)],
) -> (
    Scenario,
    testkit::FaultProxy,
    testkit::FaultProxy,
    Vec<Rec>,
    Vec<(i32, i64)>,
    WorkerProcess,
    Prober,
) {
    let (stack, proxies) = Stack::start_behind_proxies(name, 4).await;
    let mut all: Vec<(&str, &str)> = LIMITS.to_vec();
    all.extend_from_slice(extra);
    let mut s = Scenario::on(stack, name, title, &all);
    let recs = number(good_events(seed, n, true));
    let placed = produce(&s.stack.env.kafka, &s.stack.env.topic, &recs[..now]).await;
    let (w, prober, _) = start_worker_behind(&mut s, &proxies).await;
    (s, proxies.kafka, proxies.mongo, recs, placed, w, prober)
}

/// Waits until the group committed `share` of `n`; after 5 minutes
/// (15 at full size: s9's 100,000 events with a fifth of the write replies
/// dropped take about 6) the scenario fails, saying how far it got (the
/// verdict would count missing trades too, but not say at which step).
async fn committed_share(s: &mut Scenario, n: usize, share: f64) {
    let target = (n as f64 * share) as i64;
    let limit = Duration::from_secs(pick(300, 900));
    let reached = poll_until(limit, POLL, || async {
        s.stack.committed_total() >= target
    })
    .await;
    if !reached {
        s.failures.push(format!(
            "{} of {target} committed after {} s",
            s.stack.committed_total(),
            limit.as_secs()
        ));
    }
}

/// After a heal: everything committed (and how long it took), readiness
/// back without a restart, and readiness having named `server` during the
/// fault.
async fn after_heal(s: &mut Scenario, prober: Prober, n: usize, healed: Instant, server: &str) {
    committed_share(s, n, 1.0).await;
    s.note(
        "seconds_to_end_after_heal",
        json!(healed.elapsed().as_secs_f64()),
    );
    prober.ready_again(s, healed).await;
    let reasons = prober.stop(s);
    if !reasons.iter().any(|r| r.contains(server)) {
        s.failures
            .push(format!("readiness never named {server}: {reasons:?}"));
    }
}

/// 9. Indeterminate writes: replies to `update`/`insert` dropped after
///    MongoDB applied them, and the connection cut, at random moments,
///    hundreds of times, in small batches (many writes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s9_indeterminate_writes() {
    let n = events(10_000, 100_000);
    let (mut s, _kafka, mongo, recs, placed, w, prober) = start(
        "s9-indeterminate-writes",
        "Write replies dropped after MongoDB applied the write, then the connection cut",
        9,
        (n, n),
        &[("TRADEBUCKET__BATCH__MAX_EVENTS", "100")],
    )
    .await;
    mongo.drop_write_replies(0.2);
    s.fault("drop 20% of write replies after the write, from the start".into());
    committed_share(&mut s, n, 0.95).await;
    mongo.drop_write_replies(0.0);
    let dropped = mongo.dropped_replies();
    s.fault(format!("stopped dropping after {dropped} dropped replies"));
    s.note("dropped_write_replies", json!(dropped));
    s.note("mongodb_connections", json!(mongo.connections()));
    if dropped < pick(20, 200) {
        s.failures.push(format!("only {dropped} replies dropped"));
    }
    prober.stop(&mut s);
    s.finish(vec![w], &recs, &placed).await;
}

/// 10. MongoDB black-holed mid-stream (connections kept open, nothing
///     answered), then healed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s10_mongodb_black_hole() {
    let n = events(10_000, 100_000);
    let hole = Duration::from_secs(pick(25, 60));
    let (mut s, _kafka, mongo, recs, placed, w, prober) = start(
        "s10-mongodb-black-hole",
        "MongoDB black-holed mid-stream, then healed",
        10,
        (n, n),
        &[],
    )
    .await;
    committed_share(&mut s, n, 0.3).await;
    mongo.black_hole();
    s.fault(format!(
        "black-hole MongoDB for {} s at {} committed",
        hole.as_secs(),
        s.stack.committed_total()
    ));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let frozen = s.stack.committed_total();
    tokio::time::sleep(hole - Duration::from_secs(3)).await;
    let during = s.stack.committed_total() - frozen;
    mongo.heal();
    s.fault("healed".into());
    s.note("commits_during_black_hole", json!(during));
    if during != 0 {
        s.failures.push(format!(
            "{during} offsets committed while MongoDB was black-holed"
        ));
    }
    let healed = Instant::now();
    after_heal(&mut s, prober, n, healed, "MongoDB").await;
    s.finish(vec![w], &recs, &placed).await;
}

/// 11. Kafka black-holed for longer than the session timeout, then healed:
///     the worker, the group's only member and so its leader, is removed
///     from the group and must rejoin and take every partition again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s11_kafka_black_hole() {
    let n = events(10_000, 100_000);
    // Reduced: a 10 s session (drain below it), a 20 s hole; full: the
    // scenarios' 30 s session, a 45 s hole.
    let (session, drain, hole) = pick(("10s", "5s", 20), ("30s", "10s", 45));
    let (mut s, kafka, _mongo, recs, placed, w, prober) = start(
        "s11-kafka-black-hole",
        "Kafka black-holed for longer than the session timeout, then healed",
        11,
        (n, n / 2),
        &[
            ("TRADEBUCKET__KAFKA__SESSION_TIMEOUT", session),
            ("TRADEBUCKET__SHUTDOWN__DRAIN_TIMEOUT", drain),
            // librdkafka's broker and group lines in the worker's log, so a
            // failed run shows what the client saw after the heal.
            ("TRADEBUCKET__KAFKA__OPTIONS__DEBUG", "broker,cgrp"),
            ("TRADEBUCKET__LOG__LEVEL", "info,librdkafka=debug"),
        ],
    )
    .await;
    committed_share(&mut s, n, 0.3).await;
    let before = s.stack.committed_total();
    kafka.black_hole();
    s.fault(format!(
        "black-hole Kafka for {hole} s (session {session}) at {before} committed"
    ));
    tokio::time::sleep(Duration::from_secs(hole)).await;
    kafka.heal_closing();
    s.fault("healed, the held connections closed; the second half of the events produced".into());
    let healed = Instant::now();
    let mut placed = placed;
    placed.extend(produce(&s.stack.env.kafka, &s.stack.env.topic, &recs[n / 2..]).await);
    after_heal(&mut s, prober, n, healed, "Kafka").await;
    note_broker(&mut s, kafka.connections());
    s.finish(vec![w], &recs, &placed).await;
}

/// What the broker itself says after a failed heal: whether it answers a
/// client that bypasses the proxy (a hung broker and a broken proxy look
/// the same from the worker), and the tail of its own log.
fn note_broker(s: &mut Scenario, proxy_connections: usize) {
    s.note("kafka_proxy_connections", json!(proxy_connections));
    if s.failures.is_empty() {
        return;
    }
    let direct = s.stack.kafka.answers_directly(Duration::from_secs(10));
    s.note("broker_answers_directly_after_heal", json!(direct));
    s.note("broker_log_tail", json!(s.stack.kafka.log_tail(40)));
}

/// 12. Slow links: 50 ms each way to both servers. The first half of the
///     events goes over normal links, the second over slow ones; the
///     throughput of each is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s12_slow_links() {
    let n = events(10_000, 100_000);
    let (mut s, kafka, mongo, recs, placed, w, prober) = start(
        "s12-slow-links",
        "Slow links: 50 ms each way to both servers (throughput beside normal links)",
        12,
        (n, n / 2),
        &[],
    )
    .await;
    let t0 = Instant::now();
    committed_share(&mut s, n / 2, 1.0).await;
    let normal = (n / 2) as f64 / t0.elapsed().as_secs_f64();
    let d = Duration::from_millis(50);
    kafka.delay(d, d);
    mongo.delay(d, d);
    s.fault("50 ms each way to Kafka and MongoDB".into());
    let t1 = Instant::now();
    let mut placed = placed;
    placed.extend(produce(&s.stack.env.kafka, &s.stack.env.topic, &recs[n / 2..]).await);
    committed_share(&mut s, n, 1.0).await;
    let slow = (n - n / 2) as f64 / t1.elapsed().as_secs_f64();
    s.note("events_per_second_normal_links", json!(normal.round()));
    s.note("events_per_second_slow_links", json!(slow.round()));
    eprintln!("[s12] normal links {normal:.0} events/s, 50 ms each way {slow:.0} events/s");
    prober.stop(&mut s);
    s.finish(vec![w], &recs, &placed).await;
}

/// The `client.id` of [`Leader`], which the Kafka proxy spares.
const LEADER_ID: &str = "chaos-leader";

/// A member of the worker's group, owned by the test, that joins first (so
/// it leads the group) and is never cut off: the proxy spares its
/// `client.id`. It polls to stay a member, never commits, and leaves when
/// dropped, handing its partitions back.
struct Leader {
    assigned: Arc<AtomicUsize>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Leader {
    fn join(env: &testkit::TestEnv, session: &str) -> Leader {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let consumer: BaseConsumer = rdkafka::config::ClientConfig::new()
            .set("bootstrap.servers", &env.kafka)
            .set("group.id", &env.group)
            .set("client.id", LEADER_ID)
            .set(
                "session.timeout.ms",
                (humantime::parse_duration(session).unwrap().as_millis()).to_string(),
            )
            .set("enable.auto.commit", "false")
            .create()
            .expect("leader consumer");
        consumer
            .subscribe(&[env.topic.as_str()])
            .expect("subscribe");
        let assigned = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (a, s) = (assigned.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let _ = consumer.poll(Duration::from_millis(100));
                let n = consumer.assignment().map_or(0, |l| l.count());
                a.store(n, Ordering::Relaxed);
            }
            consumer.unsubscribe();
        });
        Leader {
            assigned,
            stop,
            thread: Some(thread),
        }
    }

    fn assigned(&self) -> usize {
        self.assigned.load(Ordering::Relaxed)
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// 11b. Scenario 11 with another member: the worker is cut off from Kafka
/// for longer than its session timeout while the group's leader, a member
/// of the test's own, is not (as when a partition isolates one host of
/// several). The worker's session expires, the leader takes every
/// partition; after the heal the worker rejoins by itself, then the leader
/// leaves and the worker takes everything and stores every trade once: the
/// second half of the trades is produced after the heal and can only be
/// stored by a worker that rejoined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s11b_kafka_black_hole_while_another_member_leads() {
    let n = events(10_000, 100_000);
    let (session, drain, hole) = pick(("10s", "5s", 20), ("30s", "10s", 45));
    let name = "s11b-kafka-black-hole-not-leader";
    let (stack, proxies) = Stack::start_behind_proxies(name, 4).await;
    proxies.kafka.spare_client(LEADER_ID);
    let mut all: Vec<(&str, &str)> = LIMITS.to_vec();
    all.extend([
        ("TRADEBUCKET__KAFKA__SESSION_TIMEOUT", session),
        ("TRADEBUCKET__SHUTDOWN__DRAIN_TIMEOUT", drain),
    ]);
    let title = "Kafka black-holed for one member past its session; another member leads";
    let mut s = Scenario::on(stack, name, title, &all);
    let recs = number(good_events(111, n, true));
    let leader = Leader::join(&s.stack.env, session);
    poll_until(Duration::from_secs(60), POLL, || async {
        leader.assigned() > 0
    })
    .await;
    let (w, prober, port) = start_worker_behind(&mut s, &proxies).await;
    let mut placed = produce(&s.stack.env.kafka, &s.stack.env.topic, &recs[..n / 2]).await;
    committed_share(&mut s, n, 0.05).await;
    proxies.kafka.black_hole();
    s.fault(format!(
        "black-hole the worker's Kafka connections for {hole} s (session {session})"
    ));
    tokio::time::sleep(Duration::from_secs(hole)).await;
    // The worker's own account: its partitions were revoked in the hole.
    let revoked = worker_metric(port, REVOKED).await;
    s.note("worker_revocations_in_the_hole", json!(revoked));
    if revoked.unwrap_or(0) == 0 {
        s.failures
            .push("the worker's session did not expire in the hole".into());
    }
    proxies.kafka.heal_closing();
    let healed = Instant::now();
    s.fault("healed; the worker must rejoin; then the leader leaves".into());
    placed.extend(produce(&s.stack.env.kafka, &s.stack.env.topic, &recs[n / 2..]).await);
    poll_until(Duration::from_secs(60), POLL, || async {
        leader.assigned() < 4
    })
    .await;
    s.note(
        "seconds_to_rejoin_after_heal",
        json!(healed.elapsed().as_secs_f64()),
    );
    drop(leader);
    hand_on(&mut s, port, session).await;
    after_heal(&mut s, prober, n, healed, "Kafka").await;
    s.finish(vec![w], &recs, &placed).await;
}

/// Waits until the worker on `port` owns all four partitions after the
/// test's member left: Apache Kafka hands a departed member's partitions
/// on at the next rebalance, within a session timeout of its last
/// heartbeat. A failure when it does not.
async fn hand_on(s: &mut Scenario, port: u16, session: &str) {
    let wait = humantime::parse_duration(session).expect("a duration") + Duration::from_secs(5);
    let all = poll_until(wait, POLL, || async {
        worker_metric(port, ASSIGNED).await == Some(4)
    })
    .await;
    s.note("worker_took_every_partition_after_the_leave", json!(all));
    if !all {
        s.failures
            .push("the departed member's partitions were not handed on".into());
    }
}

/// One worker through the proxies, ready, and probed; and its HTTP port.
async fn start_worker_behind(s: &mut Scenario, proxies: &Proxies) -> (WorkerProcess, Prober, u16) {
    let port = free_port();
    let mut vars = proxies.vars();
    vars.push(("TRADEBUCKET__HTTP__LISTEN", format!("127.0.0.1:{port}")));
    let w = s.fleet.start_with(&vars);
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    let ready = poll_until(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async { matches!(http_get(&readyz).await, Some((200, _))) },
    )
    .await;
    if !ready {
        s.failures.push("never ready before the fault".into());
    }
    (w, Prober::start(port), port)
}
