//! The worker's hot path without servers (issue #29): the loop to iterate
//! on, where `scripts/bench` (both servers on the same cores) only confirms.
//!
//! A stream like `tradebucket produce` sends (its own `synthetic_event`,
//! keyed by customer) is cut into batches of the worker's default size and
//! taken through the product's own code, stage by stage:
//!
//! - `intake`: records detached from librdkafka's buffers, as
//!   `KafkaIntake::recv` copies them (topic, key, payload), pushed into a
//!   growing batch as the loop's open batch grows;
//! - `decode`: `pipeline::decode_batch`, what the loop calls on a closed
//!   batch;
//! - `plan`: the batch grouped by customer (as the writer's `Ledger::new`
//!   does) and `plan::plan_customer_owned` against each customer's newest
//!   bucket;
//! - `encode`: those plans as the statements sent (`fill_statement`,
//!   `bucket_document`);
//! - `write`: the real `BucketWriter::write`, which plans and encodes again
//!   itself, with its bookkeeping, against [`MemDb`]: an in-memory database
//!   that holds every customer's newest bucket, builds the commands the
//!   store builds and counts what it was sent;
//! - `free`: dropping the batch's records and trades, which the loop does
//!   once the batch is committed.
//!
//! Steady state: heads loaded and cached, after `--warmup` batches. Cold:
//! a fresh writer (empty cache) whose database holds the same heads, on the
//! first measured batch, so `write (cold)` includes loading every head.
//!
//! Per stage it reports ns, allocations and bytes allocated per event (a
//! counting global allocator, this program's only), and what was sent per
//! trade. Times on this shared machine are noisy; `scripts/hotpath-callgrind`
//! counts instructions per stage (`--stage`), which repeat to the unit.
//!
//! `cargo bench --bench hotpath [-- --batches 10]`; with glibc's allocator
//! instead of mimalloc, the product's: `--features bench-system-alloc`
//! (docs/benchmarks.md, "The allocator").

use std::alloc::{GlobalAlloc, Layout};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Instant;

use clap::Parser;
use mongodb::bson::{rawdoc, RawDocumentBuf};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_json::json;

use tradebucket::bucket::db::BucketDb;
use tradebucket::bucket::plan::{
    plan_customer_owned, BucketHead, CustomerPlan, Event, Known, Limits, LoadedHead,
};
use tradebucket::bucket::store::{
    bucket_document, chunk_by_size, fill_statement, update_command, FillOutcome, InsertOutcome,
    StoreError,
};
use tradebucket::bucket::writer::{BucketWriter, Outcome};
use tradebucket::cli::{synthetic_event, ProduceOptions};
use tradebucket::config::Settings;
use tradebucket::event::{CustomerId, Mappings, Source, Trade};
use tradebucket::metrics::Metrics;
use tradebucket::pipeline::{decode_batch, Decoded, Record};
use tradebucket::registry::{Formats, RawSchema, Schema};

// ---------------------------------------------------------------------
// The counting allocator: every allocation of this program passes through
// it, so a stage's count is the difference of two readings around it (the
// program is single-threaded while measuring).

#[cfg(feature = "bench-system-alloc")]
type Inner = std::alloc::System;
#[cfg(feature = "bench-system-alloc")]
const INNER: Inner = std::alloc::System;
#[cfg(not(feature = "bench-system-alloc"))]
type Inner = mimalloc::MiMalloc;
#[cfg(not(feature = "bench-system-alloc"))]
const INNER: Inner = mimalloc::MiMalloc;

const ALLOCATOR: &str = if cfg!(feature = "bench-system-alloc") {
    "system (glibc)"
} else {
    "mimalloc"
};

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static FREES: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

struct Counting;

// SAFETY: every call is passed on unchanged to the inner allocator; the
// counters are only read.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(layout.size() as u64, Relaxed);
        unsafe { INNER.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(layout.size() as u64, Relaxed);
        unsafe { INNER.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        FREES.fetch_add(1, Relaxed);
        unsafe { INNER.dealloc(ptr, layout) }
    }

    // A growing Vec or String: counted as an allocation of its new size,
    // since that is what it may cost (a new block and a copy).
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(new_size as u64, Relaxed);
        unsafe { INNER.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    allocs: u64,
    frees: u64,
    bytes: u64,
}

fn counts() -> Counts {
    Counts {
        allocs: ALLOCS.load(Relaxed),
        frees: FREES.load(Relaxed),
        bytes: BYTES.load(Relaxed),
    }
}

// ---------------------------------------------------------------------
// Arguments.

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value_t = 10_000)]
    customers: u64,
    #[arg(long, default_value_t = 8)]
    partitions: i32,
    /// Events per batch; default: the worker's `batch.max_events`.
    #[arg(long)]
    batch: Option<usize>,
    /// Batches written before measuring, so every customer has an open
    /// bucket at some fill, as after a while of running.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Batches measured in the steady state.
    #[arg(long, default_value_t = 10)]
    batches: usize,
    /// Times the cold write is measured (a fresh writer each time).
    #[arg(long, default_value_t = 5)]
    cold_repeats: usize,
    /// Rounds of the mapped-against-default decode comparison (issue #28).
    #[arg(long, default_value_t = 10)]
    mapped_rounds: usize,
    /// Run the stages up to this one only, and no cold write: for
    /// `valgrind --tool=callgrind --toggle-collect='*hotpath::stage_<name>*'`
    /// (scripts/hotpath-callgrind).
    #[arg(long, value_enum)]
    stage: Option<Stage>,
    /// Where the figures go as JSON (not written with --stage).
    #[arg(long, default_value = "target/bench/hotpath.json")]
    json: PathBuf,
    // `cargo bench` passes --bench; accept and ignore it.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
enum Stage {
    Intake,
    Decode,
    Plan,
    Encode,
    Write,
    Free,
}

impl Stage {
    const ALL: [Stage; 6] = [
        Stage::Intake,
        Stage::Decode,
        Stage::Plan,
        Stage::Encode,
        Stage::Write,
        Stage::Free,
    ];

    fn name(self) -> &'static str {
        match self {
            Stage::Intake => "intake",
            Stage::Decode => "decode",
            Stage::Plan => "plan",
            Stage::Encode => "encode",
            Stage::Write => "write",
            Stage::Free => "free",
        }
    }
}

// ---------------------------------------------------------------------
// The event stream.

/// A message as librdkafka holds it, before the worker copies it out.
struct Wire {
    partition: i32,
    offset: i64,
    key: Vec<u8>,
    payload: Vec<u8>,
    timestamp_ms: i64,
}

/// `tradebucket produce`'s events (same generator, seed and options as
/// `benches/pipeline/`), keyed by customer. The broker's partitioner
/// (a hash of the key) is stood in for by `customer % partitions`: what
/// counts here is that each customer stays on one partition, in order.
struct Stream {
    rng: StdRng,
    opts: ProduceOptions,
    n: u64,
    next_offset: Vec<i64>,
}

impl Stream {
    fn new(customers: u64, partitions: i32) -> Stream {
        let opts = ProduceOptions {
            topic: None,
            count: 0,
            customers,
            skewed: false,
            tickers: 8,
            rate: 0,
            seed: 1,
            no_keys: false,
            first_id: 0,
        };
        Stream {
            rng: StdRng::seed_from_u64(opts.seed),
            opts,
            n: 0,
            next_offset: vec![0; partitions.max(1) as usize],
        }
    }

    fn batch(&mut self, len: usize) -> Vec<Wire> {
        let base_ms = 1_700_000_000_000i64;
        (0..len)
            .map(|_| {
                let (json, key) = synthetic_event(&mut self.rng, self.n, &self.opts, base_ms);
                self.n += 1;
                let customer: u64 = key.parse().expect("numeric customer");
                let partition = (customer % self.next_offset.len() as u64) as usize;
                let offset = self.next_offset[partition];
                self.next_offset[partition] += 1;
                Wire {
                    partition: partition as i32,
                    offset,
                    key: key.into_bytes(),
                    payload: json.into_bytes(),
                    timestamp_ms: base_ms + self.n as i64,
                }
            })
            .collect()
    }
}

// ---------------------------------------------------------------------
// The in-memory database.

/// What `MemDb` was asked and sent.
#[derive(Debug, Default, Clone, serde::Serialize)]
struct Sent {
    update_commands: u64,
    fill_statements: u64,
    fill_statement_bytes: u64,
    insert_commands: u64,
    inserted_buckets: u64,
    bucket_bytes: u64,
    /// The commands as framed before the driver's own OP_MSG header.
    command_bytes: u64,
    head_loads: u64,
    heads_loaded: u64,
    key_lookups: u64,
}

/// The writer's database, in memory: every customer's newest bucket as a
/// warmed-up worker would find it, and a count of what it is sent. Each
/// guard holds (one writer, no one else writing), so nothing conflicts.
struct MemDb {
    heads: Arc<HashMap<CustomerId, Option<BucketHead>>>,
    sent: Mutex<Sent>,
}

impl MemDb {
    fn sent(&self) -> std::sync::MutexGuard<'_, Sent> {
        self.sent.lock().expect("not poisoned")
    }
}

impl BucketDb for MemDb {
    fn shard_key(&self, _: &CustomerId) -> Option<CustomerId> {
        None
    }

    // A clone stands in for decoding the stored bucket the driver returns.
    async fn load_heads(
        &self,
        customers: Vec<CustomerId>,
    ) -> Result<Vec<(CustomerId, LoadedHead)>, StoreError> {
        let mut sent = self.sent();
        sent.head_loads += 1;
        sent.heads_loaded += customers.len() as u64;
        Ok(customers
            .into_iter()
            .map(|c| {
                let head = self.heads.get(&c).cloned().flatten();
                (c, Ok(head))
            })
            .collect())
    }

    // Asked only for redeliveries and conflicts, which this stream has not.
    async fn find_keys(
        &self,
        _: &[(CustomerId, String)],
    ) -> Result<Vec<(String, String)>, StoreError> {
        self.sent().key_lookups += 1;
        Ok(Vec::new())
    }

    /// The `update` commands exactly as `BucketStore::apply_fills` builds
    /// them (its own chunking and command builder).
    async fn apply_fills(
        &self,
        statements: Vec<RawDocumentBuf>,
    ) -> Result<FillOutcome, StoreError> {
        let matched = statements.len() as u64;
        let mut sent = self.sent();
        let write_concern = rawdoc! {"w": "majority", "j": true, "wtimeout": 10_000_i64};
        for chunk in chunk_by_size(&statements) {
            for s in &statements[chunk.clone()] {
                sent.fill_statements += 1;
                sent.fill_statement_bytes += s.as_bytes().len() as u64;
            }
            let command = update_command("buckets", &statements[chunk], &write_concern);
            sent.update_commands += 1;
            sent.command_bytes += command.as_bytes().len() as u64;
        }
        Ok(FillOutcome {
            matched,
            errors: Vec::new(),
        })
    }

    /// The documents as the driver's `insert_many` lays them out: one
    /// command of the documents' bytes (its framing is not modelled).
    async fn insert_buckets(
        &self,
        docs: Vec<RawDocumentBuf>,
        _ordered: bool,
    ) -> Result<InsertOutcome, StoreError> {
        let total: usize = docs.iter().map(|d| d.as_bytes().len()).sum();
        let mut body = Vec::with_capacity(total);
        for d in &docs {
            body.extend_from_slice(d.as_bytes());
        }
        let mut sent = self.sent();
        sent.insert_commands += 1;
        sent.inserted_buckets += docs.len() as u64;
        sent.bucket_bytes += total as u64;
        sent.command_bytes += body.len() as u64;
        Ok(InsertOutcome::default())
    }
}

// ---------------------------------------------------------------------
// The stages. Each is its own function, never inlined, so callgrind can
// count it alone (`--toggle-collect='*hotpath::stage_decode*'`).

/// `KafkaIntake::recv`'s copy of each message, pushed into a batch that
/// grows as the loop's open batch does (`Vec::push` from empty). The topic's
/// name is shared, as the intake shares it among a topic's records.
#[inline(never)]
fn stage_intake(topic: &str, wire: &[Wire]) -> Vec<Record> {
    let topic: Arc<str> = topic.into();
    let mut records = Vec::new();
    for w in wire {
        records.push(Record {
            tp: (topic.clone(), w.partition),
            offset: w.offset,
            key: Some(w.key.to_vec()),
            payload: Some(w.payload.to_vec()),
            // The generator sends none: `headers::read` of none is empty.
            headers: Vec::new(),
            timestamp_ms: Some(w.timestamp_ms),
        });
    }
    records
}

#[inline(never)]
fn stage_decode(records: &[Record], max_bytes: usize) -> Decoded {
    decode_batch(
        records,
        &Mappings::default(),
        &Formats::default(),
        max_bytes,
    )
}

type Heads = HashMap<CustomerId, Option<BucketHead>>;

/// The writer's planning of one round, outside the writer: the batch
/// grouped by customer as `Ledger::new` groups it, each customer planned
/// against its newest bucket, taken out of `heads` as the writer takes it
/// out of its cache (the caller puts each plan's `after` back).
#[inline(never)]
fn stage_plan(
    heads: &mut Heads,
    events: &[(Trade, Source)],
    limits: Limits,
) -> Vec<(CustomerId, CustomerPlan)> {
    let mut pending: BTreeMap<CustomerId, Vec<usize>> = BTreeMap::new();
    for (i, (trade, _)) in events.iter().enumerate() {
        pending.entry(trade.customer.clone()).or_default().push(i);
    }
    let known = Known::default();
    let mut plans = Vec::with_capacity(pending.len());
    for (customer, idx) in &pending {
        let head = heads.remove(customer).flatten();
        let evs: Vec<Event<'_>> = idx
            .iter()
            .map(|&i| Event {
                index: i,
                trade: &events[i].0,
                source: &events[i].1,
            })
            .collect();
        let plan = plan_customer_owned(customer, head, &evs, &known, limits, false);
        plans.push((customer.clone(), plan));
    }
    plans
}

/// The statements of `plans`, as the writer builds them.
#[inline(never)]
fn stage_encode(
    plans: &[(CustomerId, CustomerPlan)],
    events: &[(Trade, Source)],
) -> Vec<RawDocumentBuf> {
    let trades = |idx: &[usize]| idx.iter().map(|&i| &events[i].0).collect::<Vec<_>>();
    let mut out = Vec::with_capacity(plans.len() * 2);
    for (_, plan) in plans {
        if let Some(fill) = &plan.fill {
            out.push(fill_statement(fill, &trades(&fill.events), None));
        }
        for b in &plan.new_buckets {
            out.push(bucket_document(b, &trades(&b.events)));
        }
    }
    out
}

/// One batch through the real writer, as the write stage calls it (the
/// outcomes allocated as `Stage::write_until_done` allocates them).
#[inline(never)]
fn stage_write(writer: &mut BucketWriter<MemDb>, events: &[(Trade, Source)]) -> Vec<Outcome> {
    let mut outcomes = vec![Outcome::Pending; events.len()];
    futures::executor::block_on(writer.write(events, &mut outcomes, None))
        .expect("the in-memory database never fails");
    outcomes
}

/// What the loop frees once a batch is committed.
#[inline(never)]
fn stage_free(records: Vec<Record>, decoded: Decoded) {
    drop(records);
    drop(decoded);
}

// ---------------------------------------------------------------------
// Measuring.

/// One stage's readings over the batches it ran on.
#[derive(Debug, Default, Clone)]
struct Meter {
    /// ns per event of each batch.
    ns_per_event: Vec<f64>,
    events: u64,
    counts: Counts,
}

impl Meter {
    fn run<R>(&mut self, events: usize, f: impl FnOnce() -> R) -> R {
        let before = counts();
        let started = Instant::now();
        let r = f();
        let ns = started.elapsed().as_nanos() as f64;
        let after = counts();
        self.ns_per_event.push(ns / events.max(1) as f64);
        self.events += events as u64;
        self.counts.allocs += after.allocs - before.allocs;
        self.counts.frees += after.frees - before.frees;
        self.counts.bytes += after.bytes - before.bytes;
        r
    }

    fn add(&mut self, other: Meter) {
        self.ns_per_event.extend(other.ns_per_event);
        self.events += other.events;
        self.counts.allocs += other.counts.allocs;
        self.counts.frees += other.counts.frees;
        self.counts.bytes += other.counts.bytes;
    }

    fn median(&self) -> f64 {
        let mut v = self.ns_per_event.clone();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }

    fn min(&self) -> f64 {
        self.ns_per_event
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min)
    }

    fn per_event(&self, n: u64) -> f64 {
        n as f64 / self.events.max(1) as f64
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "ns_per_event_median": self.median(),
            "ns_per_event_min": self.min(),
            "allocs_per_event": self.per_event(self.counts.allocs),
            "frees_per_event": self.per_event(self.counts.frees),
            "bytes_per_event": self.per_event(self.counts.bytes),
            "events": self.events,
            "batches": self.ns_per_event.len(),
        })
    }
}

/// Everything the steady loop carries from batch to batch.
struct Pipeline {
    topic: String,
    max_bytes: usize,
    limits: Limits,
    /// The planner's view of every customer's newest bucket: what the
    /// writer's cache holds, kept beside it for the `plan` stage.
    heads: Heads,
    writer: BucketWriter<MemDb>,
    meters: BTreeMap<Stage, Meter>,
    /// The last stage to run (`--stage`); every stage otherwise.
    last: Stage,
}

impl Pipeline {
    fn new(settings: &Settings, last: Stage) -> Pipeline {
        let db = MemDb {
            heads: Arc::default(),
            sent: Mutex::default(),
        };
        Pipeline {
            topic: settings.kafka.topics[0].clone(),
            max_bytes: settings.kafka.max_message_bytes,
            limits: Limits::with_capacity(settings.buckets.capacity),
            heads: HashMap::new(),
            writer: new_writer(settings, db),
            meters: BTreeMap::new(),
            last,
        }
    }

    /// Runs `f` on `n` events; its readings count for `stage` if
    /// `measure` (the warm-up does the same work unmeasured).
    fn timed<R>(
        &mut self,
        stage: Stage,
        n: usize,
        measure: bool,
        f: impl FnOnce(&mut Self) -> R,
    ) -> R {
        let mut meter = Meter::default();
        let r = meter.run(n, || f(self));
        if measure {
            self.meters.entry(stage).or_default().add(meter);
        }
        r
    }

    /// One batch through every stage up to `self.last`.
    fn batch(&mut self, wire: &[Wire], measure: bool) -> anyhow::Result<()> {
        let n = wire.len();
        let records = self.timed(Stage::Intake, n, measure, |p| stage_intake(&p.topic, wire));
        let decoded = self.timed(Stage::Decode, n, measure, |p| {
            stage_decode(&records, p.max_bytes)
        });
        anyhow::ensure!(decoded.events.len() == n, "a generated event was rejected");
        let events = &decoded.events;
        if self.last >= Stage::Plan {
            let plans = self.timed(Stage::Plan, n, measure, |p| {
                stage_plan(&mut p.heads, events, p.limits)
            });
            if self.last >= Stage::Encode {
                let statements =
                    self.timed(Stage::Encode, n, measure, |_| stage_encode(&plans, events));
                drop(statements);
            }
            // What the writer's cache holds after this batch, too.
            for (customer, plan) in plans {
                self.heads.insert(customer, plan.after);
            }
        }
        if self.last >= Stage::Write {
            let outcomes = self.timed(Stage::Write, n, measure, |p| {
                stage_write(&mut p.writer, events)
            });
            let all_written = outcomes.iter().all(|o| *o == Outcome::Written);
            anyhow::ensure!(all_written, "an event of a fresh stream was not written");
        }
        self.timed(Stage::Free, n, measure, |_| stage_free(records, decoded));
        Ok(())
    }
}

fn new_writer(settings: &Settings, db: MemDb) -> BucketWriter<MemDb> {
    BucketWriter::new(
        db,
        settings.buckets.capacity,
        settings.buckets.cache_customers,
        Metrics::new(),
    )
}

/// The first batch after a start or a rebalance: a fresh writer whose
/// database holds every head, so each customer's head is loaded first.
fn cold_write(
    settings: &Settings,
    heads: &Heads,
    events: &[(Trade, Source)],
    repeats: usize,
) -> (Meter, Sent) {
    let heads = Arc::new(heads.clone());
    let mut meter = Meter::default();
    let mut sent = Sent::default();
    for _ in 0..repeats.max(1) {
        let db = MemDb {
            heads: heads.clone(),
            sent: Mutex::default(),
        };
        let mut writer = new_writer(settings, db);
        let outcomes = meter.run(events.len(), || stage_write(&mut writer, events));
        assert!(outcomes.iter().all(|o| *o == Outcome::Written));
        sent = writer.store().sent().clone();
        // The writer and its cache are freed outside the measurement.
        drop(writer);
    }
    (meter, sent)
}

// ---------------------------------------------------------------------
// A mapped decode (issue #28) against the default one: the same trades,
// once in the product's own schema and once as the FIX-style execution
// reports of docs/operations.md, read through their mapping.

const FIX_TOPIC: &str = "fix-execs";

const FIX_MAPPING: &str = r#"
[kafka]
topics = ["fix-execs"]

[[mappings]]
topic = "fix-execs"
keep = "none"
fields.customerId = { from = "/Account" }
fields.tradeId = { from = "/ExecID" }
fields.type = { from = "/Side", values = { buy = ["1"], sell = ["2"] }, unknown = "reject" }
fields.ticker = { from = "/Symbol" }
fields.qty = { from = "/LastQty" }
fields.price = { from = "/LastPx" }
fields.currency = { from = "/Currency" }
fields.date = { from = "/TransactTime", format = "fix" }
"#;

/// One of `produce`'s payloads as a FIX-style execution report: every
/// value a string, the side a code, the time a FIX `UTCTimestamp`.
fn as_fix_report(payload: &[u8]) -> anyhow::Result<Vec<u8>> {
    let t: serde_json::Value = serde_json::from_slice(payload)?;
    let text = |f: &str| match &t[f] {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let millis = t["date"].as_i64().unwrap_or_default();
    let time = chrono::DateTime::from_timestamp_millis(millis)
        .ok_or_else(|| anyhow::anyhow!("date out of range: {millis}"))?;
    let side = if text("type") == "buy" { "1" } else { "2" };
    let report = json!({
        "Account": text("customerId"), "Symbol": text("ticker"), "Side": side,
        "LastQty": text("qty"), "LastPx": text("price"), "Currency": text("currency"),
        "TransactTime": time.format("%Y%m%d-%H:%M:%S%.3f").to_string(),
        "ExecID": text("tradeId"),
    });
    Ok(serde_json::to_vec(&report)?)
}

/// `rounds` decodes of `records` by `mappings`.
fn decode_rounds(
    records: &[Record],
    mappings: &Mappings,
    max_bytes: usize,
    rounds: usize,
) -> (Meter, Decoded) {
    let mut meter = Meter::default();
    let mut last = None;
    for _ in 0..rounds.max(1) {
        last = Some(meter.run(records.len(), || {
            decode_batch(records, mappings, &Formats::default(), max_bytes)
        }));
    }
    (meter, last.expect("at least one round"))
}

// ---------------------------------------------------------------------
// The libraries' least per event (issue #29's "2.5 × a plain consumer"):
// serde_json's derive into borrowed fields, nothing else. Every worker
// that reads these trades with serde_json spends at least this before it
// checks, converts or stores a field (the product's decode does all of
// that, and writes the BSON entry, in its own stage above).

/// A trade as `produce` sends it, borrowed from the payload. Its fields
/// are only parsed: that is the work measured.
#[allow(dead_code)]
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeastTrade<'a> {
    trade_id: &'a str,
    customer_id: u64,
    #[serde(rename = "type")]
    side: &'a str,
    ticker: &'a str,
    qty: i64,
    price: &'a str,
    currency: &'a str,
    date: i64,
}

#[inline(never)]
fn stage_least(wire: &[Wire]) -> anyhow::Result<Vec<u64>> {
    wire.iter()
        .map(|w| {
            let t: LeastTrade = serde_json::from_slice(&w.payload)?;
            Ok(std::hint::black_box(t).customer_id)
        })
        .collect()
}

/// [`stage_least`] over the batch `rounds` times.
fn library_floor(wire: &[Wire], rounds: usize) -> anyhow::Result<Meter> {
    let mut meter = Meter::default();
    for _ in 0..rounds.max(1) {
        let customers = meter.run(wire.len(), || stage_least(wire))?;
        anyhow::ensure!(customers.len() == wire.len(), "a trade was lost");
    }
    Ok(meter)
}

/// The default and the mapped decode of the same batch, interleaved
/// round by round so both see the same machine; checks that both store
/// the same entries.
fn mapped_decode(wire: &[Wire], rounds: usize) -> anyhow::Result<(Meter, Meter)> {
    let dir = PathBuf::from("target/bench");
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("hotpath-mapping.toml");
    std::fs::write(&file, FIX_MAPPING)?;
    let settings = Settings::load_from(Some(&file), Some(BTreeMap::new()))?;
    let mappings = Mappings::from_settings(&settings)?;
    let fix: Vec<Wire> = wire
        .iter()
        .map(|w| {
            Ok(Wire {
                payload: as_fix_report(&w.payload)?,
                key: w.key.clone(),
                ..*w
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let (plain, mapped) = (stage_intake("trades", wire), stage_intake(FIX_TOPIC, &fix));
    let (none, max) = (Mappings::default(), settings.kafka.max_message_bytes);
    let (mut d, mut m) = (Meter::default(), Meter::default());
    for _ in 0..rounds.max(1) {
        let (dr, default_out) = decode_rounds(&plain, &none, max, 1);
        let (mr, mapped_out) = decode_rounds(&mapped, &mappings, max, 1);
        let same = default_out.events.len() == wire.len()
            && mapped_out
                .events
                .iter()
                .zip(&default_out.events)
                .all(|(a, b)| a.0.doc == b.0.doc);
        anyhow::ensure!(same, "the mapped trades are not stored as the default ones");
        d.add(dr);
        m.add(mr);
    }
    Ok((d, m))
}

// ---------------------------------------------------------------------
// Avro decode (issue #48) against the default JSON one: the same trades,
// once as `produce` writes them and once in the Confluent wire format
// under the product's Avro shape (docs/operations.md, tests/it/registry.rs),
// decoded through a registry whose cache holds the schema already, so no
// request is made and the decode alone is timed.

const AVRO_TOPIC: &str = "trades-avro";

/// The id the records' header names; any id, the cache is filled by hand.
const AVRO_SCHEMA_ID: u32 = 1;

/// Price at scale 2: `produce` writes cents, so the stored Decimal128s are
/// the JSON ones exactly and the check below can compare entries.
static AVRO_TRADE: LazyLock<String> =
    LazyLock::new(|| testkit::registry::avro_trade_schema(2, false));

/// The registry's URL in the settings: never contacted (nothing is
/// missing from the cache), and a closed port if it were.
const AVRO_CONFIG: &str = r#"
[kafka]
topics = ["trades-avro"]

[[formats]]
topic = "trades-avro"
format = "avro"

[schema_registry]
url = "http://127.0.0.1:9"
"#;

/// The decode's formats, with [`AVRO_TRADE`] in memory under its id.
fn avro_formats() -> anyhow::Result<(Formats, usize)> {
    let file = PathBuf::from("target/bench/hotpath-avro.toml");
    std::fs::create_dir_all("target/bench")?;
    std::fs::write(&file, AVRO_CONFIG)?;
    let settings = Settings::load_from(Some(&file), Some(BTreeMap::new()))?;
    let formats = Formats::from_settings(&settings, Metrics::new())?;
    let raw = RawSchema {
        schema_type: "AVRO".into(),
        text: AVRO_TRADE.clone(),
        references: Vec::new(),
    };
    let schema = Schema::parse(&raw).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(formats.remember(AVRO_SCHEMA_ID, schema), "no registry");
    Ok((formats, settings.kafka.max_message_bytes))
}

/// One of `produce`'s payloads as an upstream's Avro producer writes it:
/// magic byte, schema id, then the datum.
// The deprecated one-call writer is enough to make the bench's bytes.
#[allow(deprecated)]
fn as_avro_record(schema: &apache_avro::Schema, payload: &[u8]) -> anyhow::Result<Vec<u8>> {
    use apache_avro::types::Value as V;
    let t: serde_json::Value = serde_json::from_slice(payload)?;
    let text = |f: &str| t[f].as_str().unwrap_or_default().to_string();
    let long = |f: &str| t[f].as_i64().unwrap_or_default();
    let side = text("type");
    let cents: i64 = text("price").replace('.', "").parse()?;
    let value = V::Record(vec![
        ("tradeId".into(), V::String(text("tradeId"))),
        ("customerId".into(), V::Long(long("customerId"))),
        ("type".into(), V::Enum(u32::from(side == "sell"), side)),
        ("ticker".into(), V::String(text("ticker"))),
        ("qty".into(), V::Long(long("qty"))),
        ("price".into(), V::Decimal(cents.to_be_bytes().into())),
        (
            "currency".into(),
            V::Union(1, Box::new(V::String(text("currency")))),
        ),
        ("date".into(), V::TimestampMillis(long("date"))),
    ]);
    let mut record = vec![0];
    record.extend_from_slice(&AVRO_SCHEMA_ID.to_be_bytes());
    record.extend(apache_avro::to_avro_datum(schema, value)?);
    Ok(record)
}

/// The default decode and the Avro one of the same batch, interleaved
/// round by round; checks that both store the same entries.
fn avro_decode(wire: &[Wire], rounds: usize) -> anyhow::Result<(Meter, Meter, usize)> {
    let (formats, max) = avro_formats()?;
    let schema = apache_avro::Schema::parse_str(&AVRO_TRADE)?;
    let avro: Vec<Wire> = wire
        .iter()
        .map(|w| {
            Ok(Wire {
                payload: as_avro_record(&schema, &w.payload)?,
                key: w.key.clone(),
                ..*w
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let avro_bytes = avro.iter().map(|w| w.payload.len()).sum::<usize>() / avro.len().max(1);
    let (plain, binary) = (
        stage_intake("trades", wire),
        stage_intake(AVRO_TOPIC, &avro),
    );
    let none = Mappings::default();
    let (mut d, mut a) = (Meter::default(), Meter::default());
    for _ in 0..rounds.max(1) {
        let (mut dr, mut ar) = (Meter::default(), Meter::default());
        let default_out = dr.run(plain.len(), || stage_decode_json_twin(&plain, &none, max));
        let avro_out = ar.run(binary.len(), || stage_decode_avro(&binary, &formats, max));
        let same = default_out.events.len() == wire.len()
            && avro_out.events.len() == wire.len()
            && avro_out
                .events
                .iter()
                .zip(&default_out.events)
                .all(|(a, b)| a.0.doc == b.0.doc && a.0.key == b.0.key);
        anyhow::ensure!(same, "the Avro trades are not stored as the JSON ones");
        d.add(dr);
        a.add(ar);
    }
    Ok((d, a, avro_bytes))
}

/// The JSON decode beside the Avro one, a function of its own so that
/// callgrind's inclusive counts show the two side by side.
#[inline(never)]
fn stage_decode_json_twin(records: &[Record], none: &Mappings, max_bytes: usize) -> Decoded {
    decode_batch(records, none, &Formats::default(), max_bytes)
}

/// The Avro decode of a batch.
#[inline(never)]
fn stage_decode_avro(records: &[Record], formats: &Formats, max_bytes: usize) -> Decoded {
    decode_batch(records, &Mappings::default(), formats, max_bytes)
}

// ---------------------------------------------------------------------
// The run and its report.

fn main() -> anyhow::Result<()> {
    // The worker's mimalloc settings (src/main.rs does the same).
    if !cfg!(feature = "bench-system-alloc") {
        tradebucket::allocator::configure();
    }
    let args = Args::parse();
    let settings = Settings::load_from(None, Some(BTreeMap::new()))?;
    let batch = args.batch.unwrap_or(settings.batch.max_events);
    let load_before = load_average();
    let mut stream = Stream::new(args.customers, args.partitions);
    let mut p = Pipeline::new(&settings, args.stage.unwrap_or(Stage::Free));
    for _ in 0..args.warmup {
        p.batch(&stream.batch(batch), false)?;
    }
    // The cold write's batch is the first measured one, against the heads
    // the warm-up left.
    let first = stream.batch(batch);
    let (cold, entry_bytes) = if args.stage.is_none() {
        let records = stage_intake(&p.topic, &first);
        let decoded = stage_decode(&records, p.max_bytes);
        let entries: usize = decoded
            .events
            .iter()
            .map(|(t, _)| t.doc.as_bytes().len())
            .sum();
        let cold = cold_write(&settings, &p.heads, &decoded.events, args.cold_repeats);
        (Some(cold), entries / decoded.events.len().max(1))
    } else {
        (None, 0)
    };
    let sent_before = p.writer.store().sent().clone();
    measuring_starts();
    p.batch(&first, true)?;
    for _ in 1..args.batches {
        p.batch(&stream.batch(batch), true)?;
    }
    let sent = difference(&p.writer.store().sent(), &sent_before);
    if args.stage.is_some() {
        let measured = p.meters.get(&Stage::Intake).map_or(0, |m| m.events);
        eprintln!("hotpath: {measured} events measured");
        return Ok(());
    }
    let payload_bytes = first.iter().map(|w| w.payload.len()).sum::<usize>() / first.len();
    let (mapped, floor, avro) = decode_comparisons(&first, args.mapped_rounds)?;
    let report = Report {
        args: &args,
        batch,
        meters: &p.meters,
        cold: cold.as_ref(),
        sent: &sent,
        payload_bytes,
        entry_bytes,
        load: [load_before, load_average()],
        mapped: Some(&mapped),
        floor: Some(&floor),
        avro: Some(&avro),
    };
    report.print();
    report.write_json()
}

/// The other decodes of the first measured batch, `rounds` each: mapped
/// against default, the parse floor, Avro against default.
type Comparisons = ((Meter, Meter), Meter, (Meter, Meter, usize));

fn decode_comparisons(first: &[Wire], rounds: usize) -> anyhow::Result<Comparisons> {
    Ok((
        mapped_decode(first, rounds)?,
        library_floor(first, rounds)?,
        avro_decode(first, rounds)?,
    ))
}

/// Callgrind forgets the warm-up's counts here
/// (`--zero-before='*hotpath::measuring_starts*'`), so they are the
/// measured batches' alone.
#[inline(never)]
fn measuring_starts() {
    std::hint::black_box(());
}

fn difference(a: &Sent, b: &Sent) -> Sent {
    Sent {
        update_commands: a.update_commands - b.update_commands,
        fill_statements: a.fill_statements - b.fill_statements,
        fill_statement_bytes: a.fill_statement_bytes - b.fill_statement_bytes,
        insert_commands: a.insert_commands - b.insert_commands,
        inserted_buckets: a.inserted_buckets - b.inserted_buckets,
        bucket_bytes: a.bucket_bytes - b.bucket_bytes,
        command_bytes: a.command_bytes - b.command_bytes,
        head_loads: a.head_loads - b.head_loads,
        heads_loaded: a.heads_loaded - b.heads_loaded,
        key_lookups: a.key_lookups - b.key_lookups,
    }
}

/// The 1-minute load average: other work on the machine, which the times
/// (not the instruction counts) depend on.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

struct Report<'a> {
    args: &'a Args,
    batch: usize,
    meters: &'a BTreeMap<Stage, Meter>,
    cold: Option<&'a (Meter, Sent)>,
    sent: &'a Sent,
    payload_bytes: usize,
    /// A trade's history entry as stored (BSON), on average.
    entry_bytes: usize,
    load: [f64; 2],
    /// The default and the mapped decode of the same trades.
    mapped: Option<&'a (Meter, Meter)>,
    /// The parse floor ([`stage_least`]).
    floor: Option<&'a Meter>,
    /// The default and the Avro decode of the same trades, and the Avro
    /// records' mean size.
    avro: Option<&'a (Meter, Meter, usize)>,
}

impl Report<'_> {
    fn events(&self) -> f64 {
        (self.args.batches * self.batch) as f64
    }

    fn print(&self) {
        let a = self.args;
        println!(
            "hot path: {} batches of {} events ({} warm-up), {} customers, {} partitions; \
             allocator {ALLOCATOR}; load average {:.2} → {:.2}",
            a.batches, self.batch, a.warmup, a.customers, a.partitions, self.load[0], self.load[1]
        );
        println!(
            "\n{:<14} {:>10} {:>10} {:>13} {:>13} {:>12}",
            "stage", "ns/event", "min", "allocs/event", "frees/event", "bytes/event"
        );
        let mut rows: Vec<(String, &Meter)> = Stage::ALL
            .iter()
            .filter_map(|s| Some((s.name().to_string(), self.meters.get(s)?)))
            .collect();
        if let Some((cold, _)) = self.cold {
            rows.push(("write (cold)".to_string(), cold));
        }
        for (name, m) in rows {
            println!(
                "{name:<14} {:>10.0} {:>10.0} {:>13.2} {:>13.2} {:>12.0}",
                m.median(),
                m.min(),
                m.per_event(m.counts.allocs),
                m.per_event(m.counts.frees),
                m.per_event(m.counts.bytes)
            );
        }
        let total: f64 = self.meters.values().map(Meter::median).sum::<f64>()
            - self.meters.get(&Stage::Plan).map_or(0.0, Meter::median)
            - self.meters.get(&Stage::Encode).map_or(0.0, Meter::median);
        println!("{:<14} {total:>10.0}   (intake + decode + write + free; write plans and encodes itself)", "worker path");
        self.print_sent();
        self.print_mapped();
        self.print_avro();
        if let Some(f) = self.floor {
            println!(
                "\nthe parse floor (serde_json's derive into borrowed fields, nothing else; {} rounds): \
                 {:.0} ns, {:.2} allocs per event",
                f.ns_per_event.len(),
                f.median(),
                f.per_event(f.counts.allocs)
            );
        }
    }

    /// Issue #28's bound: a mapped decode at most 1.2 × the default one.
    fn print_mapped(&self) {
        let Some((d, m)) = self.mapped else {
            return;
        };
        println!(
            "\ndecode of the same trades ({} rounds, median ns/event, allocs/event): \
             default schema {:.0} ns, {:.2}; FIX-style through its mapping {:.0} ns, {:.2}; \
             ratio {:.2}",
            d.ns_per_event.len(),
            d.median(),
            d.per_event(d.counts.allocs),
            m.median(),
            m.per_event(m.counts.allocs),
            m.median() / d.median()
        );
    }

    /// Issue #48's bound: an Avro decode no slower than the default one.
    fn print_avro(&self) {
        let Some((d, a, bytes)) = self.avro else {
            return;
        };
        println!(
            "\ndecode of the same trades ({} rounds, median ns/event, allocs/event): \
             JSON default schema {:.0} ns, {:.2}; Avro ({bytes} B records) through the \
             registry's cache {:.0} ns, {:.2}; ratio {:.2}",
            d.ns_per_event.len(),
            d.median(),
            d.per_event(d.counts.allocs),
            a.median(),
            a.per_event(a.counts.allocs),
            a.median() / d.median()
        );
    }

    fn print_sent(&self) {
        let s = self.sent;
        let per = |x: u64| x as f64 / self.events();
        let per_batch = |x: u64| x as f64 / self.args.batches as f64;
        println!("\nsent, steady state (per trade unless said):");
        println!(
            "  fill statements {:.3}, new buckets {:.3}, statements {:.3}",
            per(s.fill_statements),
            per(s.inserted_buckets),
            per(s.fill_statements + s.inserted_buckets)
        );
        println!(
            "  BSON bytes: fills {:.0}, new buckets {:.0}, commands {:.0} \
             (payload JSON {} B/event, history entry {} B)",
            per(s.fill_statement_bytes),
            per(s.bucket_bytes),
            per(s.command_bytes),
            self.payload_bytes,
            self.entry_bytes
        );
        println!(
            "  per batch: {:.1} update commands, {:.1} insert commands, {:.1} head loads, {:.1} key lookups",
            per_batch(s.update_commands),
            per_batch(s.insert_commands),
            per_batch(s.head_loads),
            per_batch(s.key_lookups)
        );
        if let Some((_, cold)) = self.cold {
            println!(
                "  cold write: {} heads loaded in {} request(s)",
                cold.heads_loaded, cold.head_loads
            );
        }
    }

    fn write_json(&self) -> anyhow::Result<()> {
        let stages: serde_json::Map<String, serde_json::Value> = self
            .meters
            .iter()
            .map(|(s, m)| (s.name().to_string(), m.json()))
            .collect();
        let value = json!({
            "allocator": ALLOCATOR,
            "batch": self.batch,
            "batches": self.args.batches,
            "warmup": self.args.warmup,
            "customers": self.args.customers,
            "partitions": self.args.partitions,
            "load_average": self.load,
            "stages": stages,
            "write_cold": self.cold.map(|(m, s)| json!({"meter": m.json(), "sent": s})),
            "sent_steady": self.sent,
            "events_steady": self.events(),
            "payload_bytes_per_event": self.payload_bytes,
            "history_entry_bytes": self.entry_bytes,
            "decode_mapped": self.mapped.map(|(d, m)| json!({
                "default": d.json(),
                "mapped_fix_style": m.json(),
                "ratio_median": m.median() / d.median(),
            })),
            "library_floor": self.floor.map(Meter::json),
            "decode_avro": self.avro.map(|(d, a, bytes)| json!({
                "default_json": d.json(),
                "avro": a.json(),
                "avro_record_bytes": bytes,
                "ratio_median": a.median() / d.median(),
            })),
        });
        if let Some(dir) = self.args.json.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&self.args.json, serde_json::to_string_pretty(&value)?)?;
        println!("\nwrote {}", self.args.json.display());
        Ok(())
    }
}
