//! The append ceiling: the database's own capacity for the product's
//! one-trade appends to open buckets, what every trade is under a steady
//! load spread over many customers (each sees a trade every few seconds,
//! so its bucket is open and the trade is appended to it).

use std::future::Future;
use std::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt};
use mongodb::bson::RawDocumentBuf;
use serde_json::json;

use tradebucket::bucket::plan;
use tradebucket::bucket::store::BucketStore;
use tradebucket::config::Settings;

use crate::ceiling::{final_work, insert_all, side_collection, Heads};
use crate::cpu::Cpu;
use crate::delay::sampled_figures;
use crate::target::{Msg, Target};

/// Concurrency levels tried; the ceiling is the best. Each level has a
/// block of customers of its own (a quarter of them), whose buckets are
/// opened with one trade (setup, not timed) and then take one append each
/// round until full: every append of a bucket's life, from one trade to
/// `buckets.capacity`, as a steady load sends them. The stand-in's cost of
/// an append grows with the bucket (about 320 µs at one trade, 350 to 410
/// at eight or nine: docs/benchmarks.md, "Session 27"), so a ceiling over
/// new buckets only overstated the capacity, and levels measured one after
/// another on the same buckets confused concurrency with size.
const LEVELS: [usize; 4] = [1, 2, 4, 8];

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
    let (s, store) = append_collection(target, "append_ceiling").await?;
    let limits = plan::Limits::with_capacity(s.buckets.capacity);
    let appends_per_bucket = s.buckets.capacity as usize - 1;
    let block = customers / LEVELS.len() as u64;
    anyhow::ensure!(
        appends_per_bucket > 0 && block > 0,
        "no appends to measure: buckets.capacity {}, {customers} customers",
        s.buckets.capacity
    );
    // The database's CPU per append and the cores it used: its capacity
    // beside what a steady phase asks of it (`delay::server_load`).
    let cpu = Cpu::of_stack();
    let mut levels = Vec::new();
    for (n, &concurrency) in LEVELS.iter().enumerate() {
        let first = n as u64 * block;
        let customers = first..first + block;
        let fills = bucket_lives(
            &store,
            &target.topic,
            s.mongodb.journal,
            limits,
            customers,
            appends_per_bucket,
        )
        .await?;
        let before = cpu.snapshot(None);
        let seconds = apply_concurrently(&store, fills, concurrency).await?;
        let used = cpu.snapshot(None).since(&before).database;
        let appends = (appends_per_bucket as u64 * block) as f64;
        levels.push(json!({"concurrency": concurrency, "customers": block,
                           "appends": appends,
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
              "appends_per_bucket": appends_per_bucket,
              "appends_per_second": best, "levels": levels}))
}

/// A collection of its own for appends the caller paces: each command
/// goes as one, never split by the product's `mongodb.fill_concurrency`
/// (a ceiling's command can hold two appends to one bucket at a round's
/// edge, which split commands would race).
async fn append_collection(target: &Target, name: &str) -> anyhow::Result<(Settings, BucketStore)> {
    let whole = target
        .clone()
        .with_var("TRADEBUCKET__MONGODB__FILL_CONCURRENCY", "1");
    side_collection(&whole, name).await
}

/// Opens one bucket for each of `customers` (inserted, not timed) and
/// returns the rounds of fill statements that fill them: `appends` rounds
/// of one trade per customer (read as from `topic`), each round's planned
/// after the one before.
async fn bucket_lives(
    store: &BucketStore,
    topic: &str,
    journal: bool,
    limits: plan::Limits,
    customers: std::ops::Range<u64>,
    appends: usize,
) -> anyhow::Result<Vec<Vec<RawDocumentBuf>>> {
    let opening = final_work(topic, &round(0, customers.clone()), limits, &Heads::new())?;
    let docs = opening.docs.chunks(1000).map(<[_]>::to_vec).collect();
    let raw = store.collection().clone_with_type::<RawDocumentBuf>();
    insert_all(&raw, docs, 4, journal).await?;
    let mut heads = opening.heads;
    let mut rounds = Vec::with_capacity(appends);
    for number in 1..=appends {
        let work = final_work(topic, &round(number, customers.clone()), limits, &heads)?;
        anyhow::ensure!(
            work.docs.is_empty() && work.filled as u64 == customers.end - customers.start,
            "round {number} is not one append per customer"
        );
        rounds.push(work.fills);
        heads = work.heads;
    }
    Ok(rounds)
}

/// One trade for every customer, as messages the product's decoder reads.
/// Trade ids are unique across rounds; the date is the generator's. The
/// offsets grow from round to round (while customers number under a
/// billion), so the planner takes no round for a redelivery of the one
/// before (a bucket's watermark is the highest offset it holds).
fn round(number: usize, customers: std::ops::Range<u64>) -> Vec<Msg> {
    customers
        .map(|c| Msg {
            partition: 0,
            offset: (number as u64 * 1_000_000_000 + c) as i64,
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
    let bucket = stream_key(statement)?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    bucket.hash(&mut hasher);
    Ok((hasher.finish() % streams as u64) as usize)
}

/// The bucket a fill statement appends to (`q._id`): its customer's open
/// bucket, the same in every round of a bucket's life.
fn stream_key(statement: &RawDocumentBuf) -> anyhow::Result<String> {
    Ok(statement.get_document("q")?.get_str("_id")?.to_string())
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

/// The database's own delay under appends arriving at a steady `rate`
/// (issue #45: the steady capacity's knee): the same one-trade appends to
/// open buckets, sent by one client as the worker would send them, with
/// no Kafka, no decoding, no planning and no other work on the machine
/// but this process's. One stream: whenever the previous command has
/// answered, everything due by then goes in the next (at least one
/// append, waited for; never one customer twice), as the worker's batches
/// close while its writes run. Each append's delay runs from its due time
/// to its command's answer. If the server alone cannot keep its p99
/// within a second at a rate, no client of it can.
///
/// `beside` runs alongside the sending, started with it (its setup done
/// before): nothing, or the Kafka side of a steady phase (`kafka_load` in
/// main.rs), so that the server is paced on the machine as the steady
/// phases share it; the database's cost per append rises on a busy
/// machine (docs/benchmarks.md, "Session 37"). Each check writes to a
/// `collection` of its own.
pub(crate) async fn paced_appends(
    target: &Target,
    collection: &str,
    first_customer: u64,
    rate: f64,
    seconds: u64,
    beside: impl Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<serde_json::Value> {
    let (s, store) = append_collection(target, collection).await?;
    let limits = plan::Limits::with_capacity(s.buckets.capacity);
    let appends_per_bucket = s.buckets.capacity as usize - 1;
    let count = (rate * seconds as f64) as usize;
    let customers = count.div_ceil(appends_per_bucket.max(1)) as u64;
    let range = first_customer..first_customer + customers;
    let rounds = bucket_lives(
        &store,
        &target.topic,
        s.mongodb.journal,
        limits,
        range,
        appends_per_bucket,
    )
    .await?;
    let steady = Steady::of(rounds)?;
    let cpu = Cpu::of_stack();
    let before = cpu.snapshot(None);
    let (sent, beside) = tokio::join!(send_paced(&store, &steady, rate), beside);
    let used = cpu.snapshot(None).since(&before);
    let (delays, seconds) = sent?;
    beside?;
    // Only the appends due while every bucket size is being appended to.
    let mut measured: Vec<f64> = delays
        .iter()
        .zip(&steady.measured)
        .filter_map(|(&d, &m)| m.then_some(d))
        .collect();
    measured.sort_by(f64::total_cmp);
    anyhow::ensure!(!measured.is_empty(), "no paced appends measured");
    // The same quantiles as the steady phases' sampled trades.
    let mut figures = sampled_figures(&measured);
    figures["rate"] = json!(rate);
    figures["appends"] = json!(delays.len());
    figures["measured"] = json!(measured.len());
    figures["seconds"] = json!(seconds);
    let cores = |used: Option<f64>| json!(used.map(|u| u / seconds));
    figures["database_cores"] = cores(used.database);
    figures["broker_cores"] = cores(used.broker);
    figures["bench_cores"] = cores(used.bench);
    figures["machine_cores"] = cores(used.machine);
    Ok(figures)
}

/// Bucket lives laid out in time as a steady load appends to them: at
/// any moment buckets of every size take appends (the stand-in's cost
/// grows with the bucket), not the whole set's first appends and then its
/// last. Customer `j`'s `a`-th append is at position `j + a * gap`, with
/// `gap` a ninetieth of the customers, so each customer's appends are in
/// order, a tenth of the run apart, and only the first and last tenth or
/// so (`measured` false) are a ramp where some sizes are missing.
struct Steady {
    appends: Vec<RawDocumentBuf>,
    customer: Vec<usize>,
    measured: Vec<bool>,
}

impl Steady {
    fn of(mut rounds: Vec<Vec<RawDocumentBuf>>) -> anyhow::Result<Steady> {
        // The planner's order of customers differs from round to round:
        // by bucket, so `j` is one customer (one open bucket) in every round.
        for round in &mut rounds {
            let mut keyed = round
                .drain(..)
                .map(|d| Ok((stream_key(&d)?, d)))
                .collect::<anyhow::Result<Vec<_>>>()?;
            keyed.sort_by(|a, b| a.0.cmp(&b.0));
            round.extend(keyed.into_iter().map(|(_, d)| d));
        }
        let customers = rounds.first().map_or(0, Vec::len);
        let last = rounds.len().saturating_sub(1);
        let gap = (customers / 90).max(1);
        let mut slots: Vec<(usize, usize, RawDocumentBuf)> = rounds
            .into_iter()
            .enumerate()
            .flat_map(|(a, round)| {
                round
                    .into_iter()
                    .enumerate()
                    .map(move |(j, d)| (j + a * gap, j, d))
            })
            .collect();
        slots.sort_by_key(|&(position, j, _)| (position, j));
        let full = last * gap..customers;
        let mut steady = Steady {
            appends: Vec::new(),
            customer: Vec::new(),
            measured: Vec::new(),
        };
        for (position, j, d) in slots {
            steady.measured.push(full.contains(&position));
            steady.customer.push(j);
            steady.appends.push(d);
        }
        Ok(steady)
    }
}

/// Sends `steady`'s appends in order, paced at `rate` (see
/// [`paced_appends`]): each one's delay, and the seconds it all took.
async fn send_paced(
    store: &BucketStore,
    steady: &Steady,
    rate: f64,
) -> anyhow::Result<(Vec<f64>, f64)> {
    let total = steady.appends.len();
    let started = tokio::time::Instant::now();
    let due = |i: usize| started + std::time::Duration::from_secs_f64(i as f64 / rate);
    let mut delays = Vec::with_capacity(total);
    let mut sent = 0;
    while sent < total {
        tokio::time::sleep_until(due(sent)).await;
        let elapsed = started.elapsed().as_secs_f64();
        let mut upto = ((elapsed * rate) as usize + 1).clamp(sent + 1, total);
        // One statement per customer in a command, as the worker's.
        let mut seen = std::collections::HashSet::new();
        if let Some(repeat) = (sent..upto).find(|&i| !seen.insert(steady.customer[i])) {
            upto = repeat;
        }
        let outcome = store
            .apply_fills(steady.appends[sent..upto].to_vec())
            .await?;
        anyhow::ensure!(
            outcome.errors.is_empty() && outcome.matched == (upto - sent) as u64,
            "a paced append did not match: {} of {}",
            outcome.matched,
            upto - sent
        );
        let answered = tokio::time::Instant::now();
        delays
            .extend((sent..upto).map(|i| answered.saturating_duration_since(due(i)).as_secs_f64()));
        sent = upto;
    }
    Ok((delays, started.elapsed().as_secs_f64()))
}
