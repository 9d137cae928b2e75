//! The eight scenarios of the chaos suite, one test each. Every one ends in
//! `Scenario::finish`: zero trades lost or duplicated, `audit` clean, the
//! dead-letter topic exactly the bad events, the group committed to the
//! end, and every worker exiting 0 on SIGTERM.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use testkit::{free_port, http_get, poll_until, WorkerProcess};

use crate::harness::*;
use crate::hostile::{harden_goods, produce_compressed, with_hostile, CODECS};
use crate::verdict::committed_but_not_stored;

/// A kill -9'd worker is restarted after an orchestrator's short back-off,
/// while the broker still holds the dead member for its session (10 s in
/// the test settings): the new member's join waits for that session to
/// expire, and the dead member's partitions are handed on then.
const RESTART_BACKOFF: Duration = Duration::from_secs(1);

/// 1. Crash loop: kill -9 the only worker at random moments of the ingest,
///    restarting it each time; after every kill, everything committed is
///    stored and the buckets are sound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_crash_loop_kill9_at_random_moments() {
    let n = events(20_000, 200_000);
    let kills = kills(3, 25);
    // Apache Kafka hands the backlog over as fast as the worker writes
    // it: unlimited, the reduced set was committed before the first kill
    // and every kill landed on an idle worker. Limited, the ingest lasts
    // about 10 s (40 s at full size), over which the kills spread.
    let rate = pick("2000", "5000");
    let mut s = Scenario::start(
        "s1-crash-loop",
        "Crash loop: kill -9 at random moments of the ingest",
        4,
        &[("TRADEBUCKET__RATE_LIMIT__EVENTS_PER_SECOND", rate)],
    )
    .await;
    let recs = number(good_events(1, n, true));
    let placed = produce(&s.stack.env.kafka, &s.stack.env.topic, &recs).await;
    // Start once the broker answers promptly after the bulk load: the
    // first worker would take a slow broker for a dead coordinator.
    s.stack
        .wait_broker_responsive(Duration::from_secs(300))
        .await;
    let seen = crash_loop(&mut s, &recs, &placed, kills).await;
    judge_the_kills(&mut s, seen);
    let w = s.fleet.start();
    s.finish(vec![w], &recs, &placed).await;
}

/// What s1 saw after its kills.
#[derive(Default)]
struct Kills {
    during_ingest: usize,
    committed_but_not_stored: Vec<String>,
    audit_violations: Vec<usize>,
}

/// `kills` lives of the only worker, each killed with kill -9 at a random
/// moment after a random share of the ingest is committed, and what was
/// stored and audited right after each kill.
async fn crash_loop(s: &mut Scenario, recs: &[Rec], placed: &[(i32, i64)], kills: usize) -> Kills {
    let total = recs.len() as i64;
    let mut rng = StdRng::seed_from_u64(101);
    let mut seen = Kills::default();
    for k in 0..kills {
        let w = s.fleet.start();
        let from = s.stack.committed_total();
        // A random share of what is left, so the kills spread over the
        // whole ingest and some are always left for the last ones.
        // Never past the end: commits move in steps while trades are held
        // under the backlog (`batch.hold_trades`), so a life may commit
        // everything before its kill, and the next ones are killed idle.
        let share = rng.random_range(0.1..0.9) / (kills - k) as f64;
        let target = (from + (((total - from) as f64) * share).max(1.0) as i64).min(total);
        // Or a random 2 to 15 s into its life, whichever comes first: under
        // the rate-limited backlog, commits wait for the held trades
        // (`batch.hold_max_age`, 10 s), so a life may die having written
        // trades it never committed, which the next life reads again.
        // The last worker, in `finish`, must still store everything once.
        let life = Duration::from_millis(rng.random_range(2000..15000));
        poll_until(life, POLL, || async { s.stack.committed_total() >= target }).await;
        // A random moment after that: mid-batch, mid-commit, mid-fetch.
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..250))).await;
        w.kill9();
        let killed_at = Instant::now();
        after_a_kill(s, recs, placed, &mut seen).await;
        let rest = RESTART_BACKOFF.saturating_sub(killed_at.elapsed());
        tokio::time::sleep(rest).await;
    }
    seen
}

/// Right after a kill: everything committed is stored and the buckets are
/// sound.
async fn after_a_kill(s: &mut Scenario, recs: &[Rec], placed: &[(i32, i64)], seen: &mut Kills) {
    let total = recs.len() as i64;
    let at = s.stack.committed_total();
    if at < total {
        seen.during_ingest += 1;
    }
    s.fault(format!("kill -9 worker at {at}/{total} committed"));
    let not_stored = committed_but_not_stored(&s.stack, recs, placed).await;
    seen.committed_but_not_stored.extend(not_stored);
    let audit = s.stack.env.audit(CAPACITY).await;
    seen.audit_violations.push(audit.violations.len());
}

fn judge_the_kills(s: &mut Scenario, seen: Kills) {
    let not_stored = seen.committed_but_not_stored;
    s.note("kills_during_ingest", json!(seen.during_ingest));
    s.note(
        "committed_but_not_stored_after_kills",
        json!(not_stored.len()),
    );
    s.note(
        "audit_violations_after_each_kill",
        json!(seen.audit_violations),
    );
    if !not_stored.is_empty() {
        s.failures.push(format!(
            "committed but not stored after a kill: {:?}",
            &not_stored[..not_stored.len().min(5)]
        ));
    }
    if seen.audit_violations.iter().any(|&v| v > 0) {
        s.failures
            .push("audit violations right after a kill".to_string());
    }
}

/// 2. A consumer group of three: rolling SIGTERM restarts, and kill -9 of
///    one instance followed by its restart, while events keep arriving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_group_rolling_restarts_and_a_kill() {
    group_of_three("s2-group", "classic").await;
}

/// 2b. Scenario 2 under the consumer group protocol (KIP-848): the broker
///     assigns, member by member, and the session is the broker's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2b_group_rolling_restarts_and_a_kill_consumer_protocol() {
    group_of_three("s2b-group-kip848", "consumer").await;
}

async fn group_of_three(name: &'static str, protocol: &str) {
    let n = events(20_000, 100_000);
    let rounds = pick(1, 2);
    let mut s = Scenario::start(
        name,
        "Group of three: rolling SIGTERM restarts, kill -9 and restart",
        6,
        &[("TRADEBUCKET__KAFKA__GROUP_PROTOCOL", protocol)],
    )
    .await;
    s.note("group_protocol", json!(protocol));
    let recs = Arc::new(number(good_events(2, n, true)));
    let producer = produce_paced(
        s.stack.env.kafka.clone(),
        s.stack.env.topic.clone(),
        recs.clone(),
        pick(20, 60),
        Duration::from_millis(pick(1000, 1000)),
    );
    let mut workers: Vec<Option<WorkerProcess>> = (0..3).map(|_| Some(s.fleet.start())).collect();
    let mut rng = StdRng::seed_from_u64(202);
    poll_until(Duration::from_secs(60), POLL, || async {
        s.stack.committed_total() > 0
    })
    .await;
    for round in 0..rounds {
        for (i, slot) in workers.iter_mut().enumerate() {
            tokio::time::sleep(Duration::from_millis(rng.random_range(1000..3000))).await;
            s.sigterm(slot.take().unwrap());
            s.fault(format!(
                "round {round}: SIGTERM instance {i} (exit {:?}) and restart",
                s.exit_codes.last().unwrap()
            ));
            *slot = Some(s.fleet.start());
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(1000..3000))).await;
        let j = rng.random_range(0..3);
        workers[j].take().unwrap().kill9();
        s.fault(format!(
            "round {round}: kill -9 instance {j} at {} committed, restarted while still a member",
            s.stack.committed_total()
        ));
        tokio::time::sleep(RESTART_BACKOFF).await;
        workers[j] = Some(s.fleet.start());
    }
    let placed = producer.await.expect("producer task");
    s.finish(workers.into_iter().flatten().collect(), &recs, &placed)
        .await;
}

/// 3. The broker killed -9 and restarted on its data while the worker is
///    mid-ingest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_broker_kill9_and_restart() {
    let n = events(20_000, 100_000);
    let restarts = pick(1, 3);
    let mut s = Scenario::start(
        "s3-broker-restart",
        "Broker kill -9 and restart on the same data, mid-stream",
        4,
        &[],
    )
    .await;
    let recs = number(good_events(3, n, true));
    let segment = n.div_ceil(restarts + 1);
    let mut placed = Vec::with_capacity(n);
    let mut rng = StdRng::seed_from_u64(303);
    let first = produce(&s.stack.env.kafka, &s.stack.env.topic, &recs[..segment]).await;
    placed.extend(first);
    let w = s.fleet.start();
    for k in 0..restarts {
        // Mid-ingest of what has been produced so far.
        let target = (placed.len() as f64 * rng.random_range(0.3..0.8)) as i64;
        poll_until(Duration::from_secs(120), POLL, || async {
            s.stack.committed_total() >= target
        })
        .await;
        s.stack.kafka.kill9();
        s.fault(format!(
            "kill -9 broker at {target}+ of {} committed",
            placed.len()
        ));
        tokio::time::sleep(Duration::from_millis(rng.random_range(500..3000))).await;
        s.stack.kafka.restart().await;
        let range = (k + 1) * segment..((k + 2) * segment).min(n);
        // A new producer after the restart: the event set goes on.
        let more = produce(&s.stack.env.kafka, &s.stack.env.topic, &recs[range]).await;
        placed.extend(more);
    }
    s.finish(vec![w], &recs, &placed).await;
}

/// Asks `readyz` every 500 ms until `end`: how many probes, how many
/// answered not ready, and the distinct answers other than 200.
pub(crate) async fn probe_readyz_until(
    readyz: &str,
    end: Instant,
) -> (usize, usize, std::collections::BTreeSet<String>) {
    let mut not_ready = 0;
    let mut reasons = std::collections::BTreeSet::new();
    let mut probes = 0;
    while Instant::now() < end {
        probes += 1;
        match http_get(readyz).await {
            Some((200, _)) => {}
            Some((code, body)) => {
                not_ready += 1;
                reasons.insert(format!("{code} {}", body.trim()));
            }
            None => {
                reasons.insert("no answer".to_string());
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    (probes, not_ready, reasons)
}

/// 4. The database stopped mid-stream and restarted on its data: the worker
///    is not ready and commits nothing meanwhile, and heals by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_database_outage() {
    let n = events(20_000, 100_000);
    let outage = Duration::from_secs(pick(10, 30));
    let mut s = Scenario::start(
        "s4-database-outage",
        "Database stopped mid-stream and restarted on the same data",
        4,
        &[],
    )
    .await;
    let recs = Arc::new(number(good_events(4, n, true)));
    let half = n / 2;
    let mut placed = produce(&s.stack.env.kafka, &s.stack.env.topic, &recs[..half]).await;
    let port = free_port();
    let w = s
        .fleet
        .start_with(&[("TRADEBUCKET__HTTP__LISTEN", format!("127.0.0.1:{port}"))]);
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    if !ready_within(&readyz, 60).await {
        s.failures.push("never ready before the outage".into());
    }
    let target = (half as f64 * 0.3) as i64;
    poll_until(Duration::from_secs(120), POLL, || async {
        s.stack.committed_total() >= target
    })
    .await;
    s.stack.mongo.stop();
    let stopped = Instant::now();
    s.fault(format!(
        "SIGTERM the database at {} of {half} committed, down {} s",
        s.stack.committed_total(),
        outage.as_secs()
    ));
    // The rest of the events arrive during the outage.
    let producer = produce_paced(
        s.stack.env.kafka.clone(),
        s.stack.env.topic.clone(),
        Arc::new(recs[half..].to_vec()),
        5,
        Duration::from_millis(500),
    );
    let seen = during_the_outage(&s, &readyz, stopped + outage).await;
    placed.extend(producer.await.expect("producer task"));
    s.stack.mongo.restart().await;
    let back = Instant::now();
    s.fault("database restarted on the same data".into());
    let recovered = ready_within(&readyz, 120)
        .await
        .then(|| back.elapsed().as_secs_f64());
    judge_the_outage(&mut s, seen, recovered);
    s.finish(vec![w], &recs, &placed).await;
}

/// What readiness and the commits did while the database was down.
struct Outage {
    probes: usize,
    not_ready: usize,
    reasons: std::collections::BTreeSet<String>,
    committed_during: i64,
}

/// Whether `readyz` answers 200 within `secs`.
async fn ready_within(readyz: &str, secs: u64) -> bool {
    let every = Duration::from_millis(200);
    poll_until(Duration::from_secs(secs), every, || async {
        matches!(http_get(readyz).await, Some((200, _)))
    })
    .await
}

/// Probes readiness until `end` and counts the commits meanwhile. A batch
/// acknowledged just before the stop may still commit; after that,
/// nothing may.
async fn during_the_outage(s: &Scenario, readyz: &str, end: Instant) -> Outage {
    tokio::time::sleep(Duration::from_secs(3)).await;
    let frozen = s.stack.committed_total();
    let (probes, not_ready, reasons) = probe_readyz_until(readyz, end).await;
    Outage {
        probes,
        not_ready,
        reasons,
        committed_during: s.stack.committed_total() - frozen,
    }
}

/// Not ready during the outage, no commit during it, ready again after.
fn judge_the_outage(s: &mut Scenario, seen: Outage, recovered: Option<f64>) {
    s.note("readyz_probes_during_outage", json!(seen.probes));
    s.note("readyz_not_ready_during_outage", json!(seen.not_ready));
    s.note("readyz_reasons", json!(seen.reasons));
    s.note("commits_during_outage", json!(seen.committed_during));
    s.note("seconds_to_ready_after_restart", json!(recovered));
    if seen.not_ready == 0 {
        let why = "the worker never reported not-ready during the outage";
        s.failures.push(why.into());
    }
    if seen.committed_during != 0 {
        s.failures.push(format!(
            "{} offsets committed while the database was down",
            seen.committed_during
        ));
    }
    if recovered.is_none() {
        let why = "not ready again within 120 s of the restart";
        s.failures.push(why.into());
    }
}

/// 5. Poison: 5% bad events of fifteen kinds interleaved with good ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_poison_mix() {
    let n = events(20_000, 100_000);
    let mut s = Scenario::start(
        "s5-poison",
        "Poison mix: 5% bad events of fifteen kinds",
        4,
        &[],
    )
    .await;
    // n events in all, 5% of them bad.
    let goods = n - n / 20;
    let recs = number(with_poison(good_events(5, goods, true), 0.05, 55));
    let placed = produce(&s.stack.env.kafka, &s.stack.env.topic, &recs).await;
    let w = s.fleet.start();
    s.fault(format!(
        "{} bad events among {} interleaved",
        recs.iter()
            .filter(|r| matches!(r.class, Class::Bad { .. }))
            .count(),
        recs.len()
    ));
    s.finish(vec![w], &recs, &placed).await;
}

/// 6. Upstream duplicates: 10% of the events produced again, same
///    `tradeId`, at later offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_upstream_duplicates() {
    let n = events(20_000, 100_000);
    let mut s = Scenario::start(
        "s6-duplicates",
        "Upstream duplicates: 10% produced again at later offsets",
        4,
        &[],
    )
    .await;
    let recs = number(with_duplicates(good_events(6, n, true), 0.10, 66));
    let placed = produce(&s.stack.env.kafka, &s.stack.env.topic, &recs).await;
    let w = s.fleet.start();
    s.fault(format!(
        "{} upstream duplicates among {}",
        recs.iter()
            .filter(|r| matches!(r.class, Class::Duplicate { .. }))
            .count(),
        recs.len()
    ));
    s.finish(vec![w], &recs, &placed).await;
}

/// 7. Unfriendly keys: no customer keys (every customer spread over every
///    partition), two instances of one group, one restarted mid-stream;
///    order holds per source partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_unfriendly_keys() {
    let n = events(20_000, 100_000);
    let mut s = Scenario::start(
        "s7-unfriendly-keys",
        "No customer keys, two instances, one restarted mid-stream",
        4,
        &[],
    )
    .await;
    let recs = Arc::new(number(good_events(7, n, false)));
    let producer = produce_paced(
        s.stack.env.kafka.clone(),
        s.stack.env.topic.clone(),
        recs.clone(),
        pick(10, 30),
        Duration::from_millis(700),
    );
    let a = s.fleet.start();
    let b = s.fleet.start();
    poll_until(Duration::from_secs(60), POLL, || async {
        s.stack.committed_total() > (n / 20) as i64
    })
    .await;
    s.sigterm(a);
    s.fault(format!(
        "SIGTERM instance 0 mid-stream (exit {:?}) and restart",
        s.exit_codes.last().unwrap()
    ));
    let a = s.fleet.start();
    let placed = producer.await.expect("producer task");
    s.finish(vec![a, b], &recs, &placed).await;
}

/// 8. Hostile records: between valid trades, every record shape a real
///    cluster can deliver (header bytes of any kind on good and bad
///    records, records just over 1 MB, tombstones, forged `tradebucket.*`
///    headers, extras nested at and one over the limit), in batches of
///    every codec the local broker serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_hostile_records() {
    let n = events(10_000, 100_000);
    let bad = pick(60, 400);
    let big = pick(3, 20);
    let (odd, deep) = (pick(200, 2000), pick(20, 200));
    let chunks = pick(8, 20);
    let mut s = Scenario::start(
        "s8-hostile",
        "Hostile records: odd header bytes, over 1 MB, tombstones, forged headers, deep nesting, every codec",
        4,
        &[],
    )
    .await;
    let mut goods = good_events(8, n - bad, true);
    harden_goods(&mut goods, odd, deep, 808);
    let recs = number(with_hostile(goods, bad, big, 88));
    let placed = produce_compressed(&s.stack.env.kafka, &s.stack.env.topic, &recs, chunks).await;
    let w = s.fleet.start();
    s.fault(format!(
        "{bad} hostile records ({big} over 1 MB) among {} in {chunks} chunks compressed {}",
        recs.len(),
        CODECS.join("/")
    ));
    s.note("good_trades_with_odd_headers", json!(odd));
    s.note("good_trades_nested_97_levels", json!(deep));
    s.finish(vec![w], &recs, &placed).await;
}
