//! The cluster scenarios: three Apache Kafka nodes (each broker and
//! controller), the source and dead-letter topics replicated to all three
//! with `min.insync.replicas=2`, so one node can die without losing an
//! acknowledged record. A node is killed -9 where it hurts most: the
//! leader of partitions being consumed, and the group's coordinator while
//! a rebalance is in progress. Each runs under both group protocols
//! (`kafka.group_protocol`: classic, and consumer, KIP-848). The verdict
//! is `Scenario::finish`; the time the workers took to resume is noted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use testkit::{free_port, poll_until, WorkerProcess};

use crate::harness::*;

/// Nodes of the scenarios' cluster.
const NODES: usize = 3;
/// Partitions of the source topic.
const PARTITIONS: i32 = 4;
/// `offsets.topic.num.partitions` of `scripts/stack kafka-node`.
const OFFSETS_PARTITIONS: i32 = 5;

/// 14. The leader of the partitions being consumed killed -9 mid-stream,
///     restarted later on its data. Classic group protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s14_cluster_leader_kill9() {
    leader_killed("s14-cluster-leader", "classic").await;
}

/// 14b. Scenario 14 under the consumer group protocol (KIP-848).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s14b_cluster_leader_kill9_consumer_protocol() {
    leader_killed("s14b-cluster-leader-kip848", "consumer").await;
}

/// 15. The group's coordinator killed -9 while a member joins (a rebalance
///     in progress), restarted later. Classic group protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15_cluster_coordinator_kill9_mid_rebalance() {
    coordinator_killed_mid_rebalance("s15-cluster-rebalance", "classic").await;
}

/// 15b. Scenario 15 under the consumer group protocol (KIP-848).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s15b_cluster_coordinator_kill9_mid_rebalance_consumer_protocol() {
    coordinator_killed_mid_rebalance("s15b-cluster-rebalance-kip848", "consumer").await;
}

async fn leader_killed(name: &'static str, protocol: &str) {
    let n = events(20_000, 100_000);
    let title = "Three brokers: the consumed partitions' leader killed -9 mid-stream";
    let (mut s, recs) = start(name, title, protocol, 14).await;
    let producer = paced(&s, &recs);
    let w = s.fleet.start();
    progress(&s, (n / 5) as i64).await;
    let topic = s.stack.env.topic.clone();
    let leader = s
        .stack
        .kafka
        .leader_of(&topic, 0)
        .expect("partition 0 has a leader");
    let led: Vec<i32> = (0..PARTITIONS)
        .filter(|&p| s.stack.kafka.leader_of(&topic, p) == Some(leader))
        .collect();
    let before = s.stack.committed().unwrap_or_default();
    s.stack.kafka.kill9_node(leader);
    let killed = Instant::now();
    s.fault(format!(
        "kill -9 node {leader}, leader of partitions {led:?} ({protocol} protocol)"
    ));
    let resumed = resumed_on(&s, &led, &before).await;
    note_resume(
        &mut s,
        "seconds_to_commit_again_on_its_partitions",
        resumed,
        killed,
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    s.stack.kafka.restart().await;
    s.fault(format!("node {leader} restarted on its data"));
    let placed = producer.await.expect("producer task");
    s.finish(vec![w], &recs, &placed).await;
}

async fn coordinator_killed_mid_rebalance(name: &'static str, protocol: &str) {
    let n = events(20_000, 100_000);
    let title = "Three brokers: the group coordinator killed -9 while a member joins";
    let (mut s, recs) = start(name, title, protocol, 15).await;
    let producer = paced(&s, &recs);
    let mut workers: Vec<(WorkerProcess, u16)> = (0..2).map(|_| start_worker(&mut s)).collect();
    progress(&s, (n / 5) as i64).await;
    let coordinator = coordinator_of(&s).expect("the group has a coordinator");
    let old: Vec<u16> = workers.iter().map(|w| w.1).collect();
    let revoked = revocations(&old).await;
    workers.push(start_worker(&mut s));
    // The join's rebalance is under way once a member is told to give
    // partitions up (all of them under classic, the moving ones under
    // consumer), before the newcomer has them.
    let joined = Instant::now();
    let moving = poll_until(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || async { revocations(&old).await > revoked },
    )
    .await;
    assert!(moving, "the join started no rebalance within 60 s");
    s.stack.kafka.kill9_node(coordinator);
    let killed = Instant::now();
    s.fault(format!(
        "a third worker joins; at the first revocation ({:.1} s later) kill -9 node {coordinator}, \
         the group's coordinator ({protocol} protocol)",
        killed.duration_since(joined).as_secs_f64()
    ));
    let ports: Vec<u16> = workers.iter().map(|w| w.1).collect();
    let settled = all_assigned(&ports, Duration::from_secs(120)).await;
    note_resume(
        &mut s,
        "seconds_to_every_partition_assigned",
        settled,
        killed,
    );
    let before = s.stack.committed().unwrap_or_default();
    let every: Vec<i32> = (0..PARTITIONS).collect();
    let resumed = resumed_on(&s, &every, &before).await;
    note_resume(
        &mut s,
        "seconds_to_commit_again_everywhere",
        resumed,
        killed,
    );
    s.stack.kafka.restart().await;
    s.fault(format!("node {coordinator} restarted on its data"));
    let placed = producer.await.expect("producer task");
    s.finish(workers.into_iter().map(|w| w.0).collect(), &recs, &placed)
        .await;
}

/// The scenario on its own cluster, and its event set (keyed trades).
async fn start(
    name: &'static str,
    title: &'static str,
    protocol: &str,
    seed: u64,
) -> (Scenario, Arc<Vec<Rec>>) {
    let n = events(20_000, 100_000);
    let stack = Stack::start_cluster(name, PARTITIONS, NODES).await;
    let vars = [("TRADEBUCKET__KAFKA__GROUP_PROTOCOL", protocol)];
    let mut s = Scenario::on(stack, name, title, &vars);
    // A kill can land between a dead letter and its commit.
    s.dead_letters_at_least_once = true;
    s.note("group_protocol", json!(protocol));
    (s, Arc::new(number(good_events(seed, n, true))))
}

/// The events arrive over the whole scenario: 40 chunks a second apart
/// (reduced: 20), so the kill lands mid-stream.
fn paced(s: &Scenario, recs: &Arc<Vec<Rec>>) -> tokio::task::JoinHandle<Vec<(i32, i64)>> {
    produce_paced(
        s.stack.env.kafka.clone(),
        s.stack.env.topic.clone(),
        recs.clone(),
        pick(20, 40),
        Duration::from_secs(1),
    )
}

/// A worker with its own metrics port.
fn start_worker(s: &mut Scenario) -> (WorkerProcess, u16) {
    let port = free_port();
    let listen = ("TRADEBUCKET__HTTP__LISTEN", format!("127.0.0.1:{port}"));
    (s.fleet.start_with(&[listen]), port)
}

/// Until the group has committed `target` records in all.
async fn progress(s: &Scenario, target: i64) {
    let reached = poll_until(Duration::from_secs(120), POLL, || async {
        s.stack.committed_total() >= target
    })
    .await;
    assert!(reached, "no progress to {target} committed within 120 s");
}

/// Until the group's commit moved past `before` on every partition of
/// `partitions`; when it did, or `None` after two minutes.
async fn resumed_on(
    s: &Scenario,
    partitions: &[i32],
    before: &std::collections::BTreeMap<i32, i64>,
) -> Option<Instant> {
    let moved = poll_until(Duration::from_secs(120), POLL, || async {
        let now = s.stack.committed().unwrap_or_default();
        partitions
            .iter()
            .all(|p| now.get(p).copied().unwrap_or(-1) > before.get(p).copied().unwrap_or(-1))
    })
    .await;
    moved.then(Instant::now)
}

/// Until the workers on `ports` own every partition between them, each
/// at least one (the newcomer included: the rebalance is over).
async fn all_assigned(ports: &[u16], limit: Duration) -> Option<Instant> {
    let all = poll_until(limit, POLL, || async {
        let mut owned = Vec::new();
        for &port in ports {
            owned.push(worker_metric(port, ASSIGNED).await.unwrap_or(0));
        }
        owned.iter().sum::<u64>() == PARTITIONS as u64 && owned.iter().all(|&n| n > 0)
    })
    .await;
    all.then(Instant::now)
}

/// Revocations the workers on `ports` have seen in all.
async fn revocations(ports: &[u16]) -> u64 {
    let mut total = 0;
    for &port in ports {
        total += worker_metric(port, REVOKED).await.unwrap_or(0);
    }
    total
}

/// Notes how long after `fault` the workers resumed, or fails the
/// scenario when they did not.
fn note_resume(s: &mut Scenario, key: &str, resumed: Option<Instant>, fault: Instant) {
    match resumed {
        Some(at) => s.note(key, json!(at.duration_since(fault).as_secs_f64())),
        None => s.failures.push(format!("{key}: never within the limit")),
    }
}

/// The node that coordinates the scenario's group: the leader of the
/// `__consumer_offsets` partition the group id hashes to (Kafka's
/// `Utils.abs(groupId.hashCode()) % offsets.topic.num.partitions`).
fn coordinator_of(s: &Scenario) -> Option<u32> {
    let hash = java_hash(&s.stack.env.group);
    let partition = if hash == i32::MIN { 0 } else { hash.abs() } % OFFSETS_PARTITIONS;
    s.stack.kafka.leader_of("__consumer_offsets", partition)
}

/// Java's `String.hashCode` (UTF-16 code units; group ids here are ASCII).
fn java_hash(text: &str) -> i32 {
    text.encode_utf16()
        .fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)))
}
