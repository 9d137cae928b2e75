//! The append ceiling: the database's own capacity for the product's
//! one-trade appends to open buckets, what every trade is under a steady
//! load spread over many customers (each sees a trade every few seconds,
//! so its bucket is open and the trade is appended to it).

use std::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt};
use mongodb::bson::RawDocumentBuf;
use serde_json::json;

use tradebucket::bucket::plan;
use tradebucket::bucket::store::BucketStore;

use crate::ceiling::{final_work, insert_all, side_collection, Heads};
use crate::cpu::Cpu;
use crate::target::{Msg, Target};

/// Concurrency levels tried, each on fresh appends; the ceiling is the best.
/// Two rounds of one append per customer each, after a first trade that
/// opens every customer's bucket: 1 + 2 × 4 = 9 trades per customer, so
/// every append goes into a bucket still open at the default capacity 10.
const LEVELS: [usize; 4] = [1, 2, 4, 8];
const ROUNDS_PER_LEVEL: usize = 2;

/// Appends per `update` command: about one batch's worth at 2,000 events/s
/// over `batch.linger` (50 ms), one statement per customer in it.
const PER_COMMAND: usize = 100;

/// Measures the append ceiling for `customers` customers in a collection of
/// its own, and returns its JSON entry: appends per second at each level
/// and the best.
pub(crate) async fn append_ceiling(
    target: &Target,
    customers: u64,
) -> anyhow::Result<serde_json::Value> {
    let (s, store) = side_collection(target, "append_ceiling").await?;
    let limits = plan::Limits::with_capacity(s.buckets.capacity);
    anyhow::ensure!(
        s.buckets.capacity as usize > LEVELS.len() * ROUNDS_PER_LEVEL,
        "buckets.capacity {} leaves no room for the append rounds",
        s.buckets.capacity
    );
    // Every customer's bucket opened with one trade: setup, not timed.
    let opening = final_work(&target.topic, &round(0, customers), limits, &Heads::new())?;
    let docs = opening.docs.chunks(1000).map(<[_]>::to_vec).collect();
    let raw = store.collection().clone_with_type::<RawDocumentBuf>();
    insert_all(&raw, docs, 4, s.mongodb.journal).await?;
    let mut heads = opening.heads;
    // The database's CPU per append and the cores it used: its capacity
    // beside what a steady phase asks of it (`delay::server_load`).
    let cpu = Cpu::of_stack();
    let mut levels = Vec::new();
    for (n, &concurrency) in LEVELS.iter().enumerate() {
        let mut fills = Vec::new();
        for r in 0..ROUNDS_PER_LEVEL {
            let number = 1 + n * ROUNDS_PER_LEVEL + r;
            let work = final_work(&target.topic, &round(number, customers), limits, &heads)?;
            anyhow::ensure!(
                work.docs.is_empty() && work.filled == customers as usize,
                "round {number} is not one append per customer"
            );
            fills.push(work.fills);
            heads = work.heads;
        }
        let before = cpu.snapshot(None);
        let seconds = apply_concurrently(&store, fills, concurrency).await?;
        let used = cpu.snapshot(None).since(&before).database;
        let appends = (ROUNDS_PER_LEVEL as u64 * customers) as f64;
        levels.push(json!({"concurrency": concurrency, "appends": appends,
                           "seconds": seconds, "appends_per_second": appends / seconds,
                           "database_cores": used.map(|u| u / seconds),
                           "database_us_per_append": used.map(|u| u / appends * 1e6)}));
        eprintln!(
            "bench: append ceiling at concurrency {concurrency}: {:.0} appends/s",
            appends / seconds
        );
    }
    let best = levels
        .iter()
        .filter_map(|l| l["appends_per_second"].as_f64())
        .fold(0.0, f64::max);
    Ok(json!({"customers": customers, "per_command": PER_COMMAND,
              "appends_per_second": best, "levels": levels}))
}

/// One trade for every customer, as messages the product's decoder reads.
/// Trade ids are unique across rounds; the date is the generator's.
fn round(number: usize, customers: u64) -> Vec<Msg> {
    (0..customers)
        .map(|c| Msg {
            partition: 0,
            offset: (number as u64 * customers + c) as i64,
            payload: testkit::event::trade(format!("A-{number}-{c}"))
                .customer(c)
                .payload(),
        })
        .collect()
}

/// Applies each round's statements in order, `concurrency` streams at once:
/// a customer's appends stay in one stream (its statements are guarded by
/// its bucket's count, so they must land in order), `PER_COMMAND` to a
/// command. Returns the seconds it took; every statement must match.
async fn apply_concurrently(
    store: &BucketStore,
    rounds: Vec<Vec<RawDocumentBuf>>,
    concurrency: usize,
) -> anyhow::Result<f64> {
    let total: usize = rounds.iter().map(Vec::len).sum();
    let mut streams: Vec<Vec<RawDocumentBuf>> = vec![Vec::new(); concurrency];
    for statement in rounds.into_iter().flatten() {
        streams[stream_of(&statement, concurrency)?].push(statement);
    }
    let started = Instant::now();
    let mut running: FuturesUnordered<_> = streams
        .into_iter()
        .map(|stream| apply_in_order(store, stream))
        .collect();
    let mut matched = 0;
    while let Some(n) = running.next().await {
        matched += n?;
    }
    let seconds = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        matched == total as u64,
        "{matched} of {total} appends matched"
    );
    Ok(seconds)
}

/// The stream of a statement: by the bucket it appends to (`q._id`), so a
/// customer's appends, all to its one open bucket, share a stream.
fn stream_of(statement: &RawDocumentBuf, streams: usize) -> anyhow::Result<usize> {
    use std::hash::{Hash, Hasher};
    let bucket = statement.get_document("q")?.get_str("_id")?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    bucket.hash(&mut hasher);
    Ok((hasher.finish() % streams as u64) as usize)
}

async fn apply_in_order(store: &BucketStore, stream: Vec<RawDocumentBuf>) -> anyhow::Result<u64> {
    let mut matched = 0;
    for command in stream.chunks(PER_COMMAND) {
        let outcome = store.apply_fills(command.to_vec()).await?;
        anyhow::ensure!(
            outcome.errors.is_empty(),
            "an append was refused: {:?}",
            outcome.errors.first()
        );
        matched += outcome.matched;
    }
    Ok(matched)
}
