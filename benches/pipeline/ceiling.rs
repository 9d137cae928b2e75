//! The database ceiling: the final bucket documents, planned offline with
//! the product's own planner, written with unordered bulk inserts.

use std::collections::HashMap;
use std::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt, TryStreamExt};
use mongodb::bson::{Bson, Document, RawDocumentBuf};
use mongodb::options::{Acknowledgment, WriteConcern};
use serde_json::json;

use tradebucket::bucket::plan::{self, Event};
use tradebucket::bucket::store::{bucket_document, fill_statement, BucketStore};
use tradebucket::config::Settings;
use tradebucket::event::{CustomerId, Trade};

use crate::cpu::Cpu;
use crate::target::{decode_all, Msg, Target};

/// The final bucket documents, planned offline with the product's own
/// planner after `heads`, inserted with unordered bulk inserts at the
/// worker's write concern: what the database can absorb at all. After an
/// earlier set (`heads` not empty) the least a restarted worker must do
/// first, [`restart_work`], counts too. CPU is per trade of the set.
pub(crate) async fn database_ceiling(
    target: &Target,
    messages: &[Msg],
    concurrency: usize,
    cpu: &Cpu,
    heads: &Heads,
) -> anyhow::Result<DatabaseCeiling> {
    let limits = plan::Limits::with_capacity(target.settings().buckets.capacity);
    let mut work = final_work(&target.topic, messages, limits, heads)?;
    let (n_docs, trades) = (work.docs.len(), work.inserted + work.filled);
    let (s, store) = side_collection(target, "ceiling").await?;
    // The same encoded documents the worker would send.
    let coll = store.collection().clone_with_type::<RawDocumentBuf>();
    let chunks: Vec<Vec<RawDocumentBuf>> = work
        .docs
        .chunks(1000)
        .map(<[RawDocumentBuf]>::to_vec)
        .collect();
    if !heads.is_empty() {
        // The heads read once, neither timed nor counted: the worker's
        // collection is in the server's cache (it has just written it),
        // the ceiling's was pushed out by the worker's first set, and on
        // the local server a cold read costs about ten times a warm one
        // (22.2 s of reads against the worker's 2.3, in 20261126200352).
        // Untimed, so with a longer operation limit than the worker's 30 s:
        // in two runs on 2026-11-28 single cold finds took 26 to 31 s
        // (docs/benchmarks.md, "Session 27") and the run died here.
        let patient = target
            .clone()
            .with_var("TRADEBUCKET__TIMEOUTS__MONGODB_OPERATION", "10m");
        let (_, warming) = side_collection(&patient, "ceiling").await?;
        read_heads(&warming, &work.customers, s.mongodb.load_concurrency).await?;
    }
    // Only the writes count: planning and encoding above are the bench's.
    // This process's own CPU meanwhile is the driver's for sending those
    // bytes: the floor of the worker's own writing.
    let (before, own) = (cpu.snapshot(None), cpu.seconds(std::process::id()));
    let started = Instant::now();
    let restart = if heads.is_empty() {
        None
    } else {
        Some(timed_restart(&store, &mut work, s.mongodb.load_concurrency).await?)
    };
    insert_all(&coll, chunks, concurrency, s.mongodb.journal).await?;
    let seconds = started.elapsed().as_secs_f64();
    let own_after = cpu.seconds(std::process::id());
    let client = own
        .zip(own_after)
        .map(|(a, b)| (b - a) / trades.max(1) as f64 * 1e6);
    Ok(DatabaseCeiling {
        client_cpu_per_million: client,
        seconds,
        documents: n_docs,
        trades,
        restart,
        indexes: index_keys(store.collection()).await?,
        cpu: before.per_million(&cpu.snapshot(None), trades as u64),
        heads: work.heads,
    })
}

/// [`restart_work`] for `work`, and what it did and took.
async fn timed_restart(
    store: &BucketStore,
    work: &mut FinalWork,
    load_concurrency: usize,
) -> anyhow::Result<serde_json::Value> {
    let fills = std::mem::take(&mut work.fills);
    let count = fills.len();
    let (head_seconds, fill_seconds) =
        restart_work(store, &work.customers, fills, load_concurrency).await?;
    Ok(
        json!({"heads": work.customers.len(), "head_seconds": head_seconds,
                "fills": count, "filled_trades": work.filled,
                "fill_seconds": fill_seconds}),
    )
}

/// The settings and store of collection `name` in the worker's database,
/// created with the product's indexes: a ceiling's own collection.
pub(crate) async fn side_collection(
    target: &Target,
    name: &str,
) -> anyhow::Result<(Settings, BucketStore)> {
    let s = target
        .clone()
        .with_var("TRADEBUCKET__MONGODB__COLLECTION", name)
        .settings();
    let store = BucketStore::connect(&s).await?;
    store.init().await?;
    Ok((s, store))
}

/// Each customer's newest bucket once the ceiling's buckets are in: the
/// second set's ceiling chains onto the first set's.
pub(crate) type Heads = HashMap<String, plan::BucketHead>;

/// The database work one clean pass would do, encoded as the worker
/// encodes it: every customer's trades planned after `heads` (its newest
/// bucket from an earlier set, if any).
pub(crate) struct FinalWork {
    /// The new buckets.
    pub(crate) docs: Vec<RawDocumentBuf>,
    /// Trades in `docs`.
    pub(crate) inserted: usize,
    /// One fill statement per customer whose newest bucket from an
    /// earlier set is open: the trades that complete it.
    pub(crate) fills: Vec<RawDocumentBuf>,
    /// Trades in `fills`.
    pub(crate) filled: usize,
    /// Every customer of this set, once.
    pub(crate) customers: Vec<CustomerId>,
    /// Each customer's newest bucket after this work.
    pub(crate) heads: Heads,
}

pub(crate) fn final_work(
    topic: &str,
    messages: &[Msg],
    limits: plan::Limits,
    heads: &Heads,
) -> anyhow::Result<FinalWork> {
    let (trades, sources) = decode_all(topic, messages)?;
    // Stream order per customer: by partition, then offset (keyed by
    // customer, so one partition each).
    let mut order: Vec<usize> = (0..trades.len()).collect();
    order.sort_by_key(|&i| (sources[i].partition, sources[i].offset));
    let mut per_customer: HashMap<String, Vec<usize>> = HashMap::new();
    for i in order {
        let customer = trades[i].customer.id_text();
        per_customer.entry(customer).or_default().push(i);
    }
    let mut work = FinalWork {
        docs: Vec::new(),
        inserted: 0,
        fills: Vec::new(),
        filled: 0,
        customers: Vec::new(),
        heads: Heads::new(),
    };
    for (key, indices) in &per_customer {
        let events: Vec<Event<'_>> = indices
            .iter()
            .map(|&i| Event {
                index: i,
                trade: &trades[i],
                source: &sources[i],
            })
            .collect();
        let customer = &trades[indices[0]].customer;
        work.customers.push(customer.clone());
        let head = heads.get(key);
        let p = plan::plan_customer(customer, head, &events, &plan::Known::default(), limits);
        let of = |idx: &[usize]| idx.iter().map(|&i| &trades[i]).collect::<Vec<&Trade>>();
        if let Some(fill) = &p.fill {
            work.filled += fill.events.len();
            work.fills
                .push(fill_statement(fill, &of(&fill.events), None));
        }
        for b in &p.new_buckets {
            work.inserted += b.events.len();
            work.docs.push(bucket_document(b, &of(&b.events)));
        }
        if let Some(h) = p.after {
            work.heads.insert(key.clone(), *h);
        }
    }
    Ok(work)
}

/// Each customer's newest bucket, one `find` each, `concurrency` at a time.
pub(crate) async fn read_heads(
    store: &BucketStore,
    customers: &[CustomerId],
    concurrency: usize,
) -> anyhow::Result<()> {
    let mut loads = futures::stream::iter(customers)
        .map(|c| store.load_head(c))
        .buffer_unordered(concurrency.max(1));
    while let Some(head) = loads.next().await {
        anyhow::ensure!(
            head?.is_ok_and(|h| h.is_some()),
            "a ceiling head is missing"
        );
    }
    Ok(())
}

/// What a worker restarted on a collection of open buckets must do before
/// its inserts, at the least: read each customer's newest bucket (one
/// indexed `find` each, `concurrency` at a time, as the worker does for
/// customers that have buckets at its `mongodb.load_concurrency`) and
/// complete each open one (one fill statement per customer, in the
/// worker's `update` commands). Returns the seconds of each.
pub(crate) async fn restart_work(
    store: &BucketStore,
    customers: &[CustomerId],
    fills: Vec<RawDocumentBuf>,
    concurrency: usize,
) -> anyhow::Result<(f64, f64)> {
    let started = Instant::now();
    read_heads(store, customers, concurrency).await?;
    let heads = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let statements = fills.len() as u64;
    let outcome = store.apply_fills(fills).await?;
    anyhow::ensure!(
        outcome.errors.is_empty() && outcome.matched == statements,
        "ceiling fills: {} of {statements} matched, first refusal {:?}",
        outcome.matched,
        outcome.errors.first()
    );
    Ok((heads, started.elapsed().as_secs_f64()))
}

/// Unordered inserts of `chunks` at majority, `concurrency` at a time.
pub(crate) async fn insert_all(
    coll: &mongodb::Collection<RawDocumentBuf>,
    chunks: Vec<Vec<RawDocumentBuf>>,
    concurrency: usize,
    journal: bool,
) -> anyhow::Result<()> {
    let wc = WriteConcern::builder()
        .w(Acknowledgment::Majority)
        .journal(journal)
        .build();
    let mut pending = FuturesUnordered::new();
    for chunk in chunks {
        let (coll, wc) = (coll.clone(), wc.clone());
        pending.push(async move {
            let insert = coll.insert_many(chunk).ordered(false).write_concern(wc);
            insert.await.map(|_| ())
        });
        while pending.len() >= concurrency {
            if let Some(r) = pending.next().await {
                r?;
            }
        }
    }
    while let Some(r) = pending.next().await {
        r?;
    }
    Ok(())
}

/// What the database ceiling measured.
pub(crate) struct DatabaseCeiling {
    pub(crate) seconds: f64,
    pub(crate) documents: usize,
    /// Trades written: all of the set's.
    pub(crate) trades: usize,
    /// After an earlier set, what [`restart_work`] did and took.
    pub(crate) restart: Option<serde_json::Value>,
    /// The ceiling collection's index key patterns: the product's own
    /// (`BucketStore::init` created them), checked against the worker's
    /// collection after its run.
    pub(crate) indexes: Vec<String>,
    pub(crate) cpu: serde_json::Value,
    /// The inserting process's own CPU-seconds per million trades.
    pub(crate) client_cpu_per_million: Option<f64>,
    /// Each customer's newest bucket after these inserts.
    pub(crate) heads: Heads,
}

/// The key patterns of a collection's indexes, sorted, as JSON text.
pub(crate) async fn index_keys(
    coll: &mongodb::Collection<Document>,
) -> anyhow::Result<Vec<String>> {
    let mut keys: Vec<String> = coll
        .list_indexes()
        .await?
        .map(|m| m.map(|m| Bson::Document(m.keys).into_relaxed_extjson().to_string()))
        .try_collect()
        .await?;
    keys.sort();
    Ok(keys)
}
