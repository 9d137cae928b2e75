//! Exactly-once under combined conditions (issue #25): each condition alone
//! was tested and held; together they lost trades silently (audit clean,
//! nothing dead-lettered, offsets at the end). The real binary against the
//! real servers; the oracle counts every trade key in every bucket.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use testkit::*;

use crate::bin;

/// Small buckets and batches: many guarded fills, many bucket changes,
/// many chances for two writers to meet on one customer.
const CAPACITY: u32 = 3;

fn worker_vars(env: &TestEnv) -> BTreeMap<String, String> {
    env.vars(&[
        ("TRADEBUCKET__BUCKETS__CAPACITY", "3"), // CAPACITY
        ("TRADEBUCKET__BATCH__MAX_EVENTS", "25"),
        ("TRADEBUCKET__BATCH__LINGER", "5ms"),
    ])
}

/// One trade record: `tradeId` `id` of `customer` (as JSON: a number or a
/// text), to `partition`, unkeyed.
fn record(id: &str, customer: Value, n: i64, partition: i32) -> Produced {
    let payload = trade(id)
        .customer(customer)
        .date(1_700_000_000_000i64 + n * 250)
        .payload();
    Produced {
        key: None,
        payload: Some(payload),
        partition: Some(partition),
        headers: Vec::new(),
        raw_headers: Vec::new(),
    }
}

/// Every distinct trade sent is stored exactly once, under its customer's
/// `_id` prefix; the audit is clean.
async fn assert_each_stored_once(env: &TestEnv, sent: &BTreeMap<String, String>) {
    let mut stored: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (prefix, keys) in env.histories().await {
        for k in keys {
            stored.entry(k).or_default().push(prefix.clone());
        }
    }
    let lost: Vec<&String> = sent.keys().filter(|k| !stored.contains_key(*k)).collect();
    let doubled: Vec<&String> = stored
        .iter()
        .filter(|(_, p)| p.len() > 1)
        .map(|(k, _)| k)
        .collect();
    let misfiled: Vec<&String> = sent
        .iter()
        .filter(|(k, c)| stored.get(*k).is_some_and(|p| p.iter().any(|p| p != *c)))
        .map(|(k, _)| k)
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {} lost: {lost:?}",
        lost.len(),
        sent.len()
    );
    assert!(doubled.is_empty(), "doubled: {doubled:?}");
    assert!(misfiled.is_empty(), "misfiled: {misfiled:?}");
    assert_eq!(stored.len(), sent.len(), "stored keys nobody sent");
    audit_clean(env, CAPACITY).await;
}

/// Two workers of one group read a topic of 4 partitions; an unkeyed
/// upstream sends every trade of a few hot customers (and some cold ones)
/// to a random partition, and about a third of them again at once, same
/// `tradeId`, to another partition: the two copies are read by different
/// workers. Before, a fill whose guard missed was taken as applied if its
/// bucket held its *last* key, which the other worker's copy could put
/// there: the fill's other trades were committed and never stored (3 of
/// 20,000 in the run).
#[tokio::test]
async fn two_workers_and_duplicates_across_partitions_store_every_trade_once() {
    let env = TestEnv::new("combined-two-workers", 4).await;
    let vars = worker_vars(&env);
    let workers = [
        WorkerProcess::start(bin(), &vars, Log::Quiet),
        WorkerProcess::start(bin(), &vars, Log::Quiet),
    ];
    let mut rng = StdRng::seed_from_u64(25);
    let (mut records, mut sent) = (Vec::new(), BTreeMap::new());
    for n in 0..4_000i64 {
        let customer: i64 = if rng.random_bool(0.8) {
            rng.random_range(1..4)
        } else {
            rng.random_range(100..300)
        };
        let id = format!("x-{n}");
        let p = rng.random_range(0..4);
        records.push(record(&id, customer.into(), n, p));
        if rng.random_bool(0.33) {
            records.push(record(
                &id,
                customer.into(),
                n,
                (p + rng.random_range(1..4)) % 4,
            ));
        }
        sent.insert(format!("t:{id}"), customer.to_string());
    }
    // In slices, so both workers are writing while more arrives.
    for slice in records.chunks(500) {
        env.produce(slice).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    env.wait_committed_to_end(Duration::from_secs(180)).await;
    for w in workers {
        assert_eq!(w.sigterm(Duration::from_secs(30)), Some(0), "a clean exit");
    }
    assert_each_stored_once(&env, &sent).await;
    assert!(
        env.dead_letters_to_end().is_empty(),
        "nothing dead-lettered"
    );
    env.cleanup().await;
}

/// One customer sent by one system as the number `7` and by another as the
/// text `"7"`, a fifth of the trades sent again in the other spelling: one
/// customer to anybody upstream, and one `_id` prefix. Before, unsharded,
/// a batch planned them as two customers against one bucket, and 57 of
/// 3,000 trades were never stored.
#[tokio::test]
async fn one_customer_in_two_spellings_stores_every_trade_once() {
    let env = TestEnv::new("combined-spellings", 1).await;
    let worker = WorkerProcess::start(bin(), worker_vars(&env), Log::Quiet);
    let mut rng = StdRng::seed_from_u64(7);
    let spell = |text: bool| {
        if text {
            Value::from("7")
        } else {
            Value::from(7)
        }
    };
    let (mut records, mut sent) = (Vec::new(), BTreeMap::new());
    for n in 0..3_000i64 {
        let id = format!("s-{n}");
        let text = rng.random_bool(0.5);
        records.push(record(&id, spell(text), n, 0));
        if rng.random_bool(0.2) {
            records.push(record(&id, spell(!text), n, 0));
        }
        sent.insert(format!("t:{id}"), "7".to_string());
    }
    env.produce(&records).await;
    env.wait_committed_to_end(Duration::from_secs(120)).await;
    assert_eq!(
        worker.sigterm(Duration::from_secs(30)),
        Some(0),
        "a clean exit"
    );
    assert_each_stored_once(&env, &sent).await;
    let types: BTreeSet<String> = env
        .buckets()
        .await
        .iter()
        .map(|b| format!("{:?}", b.get("customerId").map(|c| c.element_type())))
        .collect();
    assert_eq!(types.len(), 1, "one spelling stored: {types:?}");
    env.cleanup().await;
}
