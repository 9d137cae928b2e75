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
use tradebucket::pipeline::{decode_batch, Decoded, Record, RecordKey};
use tradebucket::registry::{Formats, RawSchema, Schema};

mod alloc;
mod decodes;
mod memdb;
mod report;

use alloc::{counts, Counts, ALLOCATOR};
use decodes::{avro_decode, library_floor, mapped_decode};
use memdb::MemDb;
use report::Report;

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
// What the in-memory database (`memdb`) counts.

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
            key: Some(RecordKey::from_slice(&w.key)),
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

type Heads = HashMap<CustomerId, Option<Box<BucketHead>>>;

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
