//! End-to-end benchmark (not a timed test): one pre-loaded event set,
//! measured in one run against the local stack:
//!
//! - tradebucket, the release binary, from a fresh group and database, until
//!   every offset is committed and every trade is in MongoDB; then a second
//!   set of the same size into the same collection;
//! - the naive baseline: the manual's one conditional upsert per trade;
//! - the database ceiling: the final bucket documents, planned offline,
//!   written with unordered bulk inserts;
//! - the Kafka read ceiling: reading the topic without processing;
//! - the worker's floor: a plain consumer of the same backlog in a process
//!   of its own (this program, `--plain-consumer`), with its own CPU; and
//!   the same consumer again at the worker's rate (`--plain-rate`), whose
//!   phase lasts as long as the worker's, for the broker's CPU per event;
//! - the servers at rest: their CPU with no client at all, in cores;
//! - CPU-seconds per million events of the worker, the broker and the
//!   database server in each phase (`Cpu`, from /proc/PID/stat);
//! - the worker's peak RSS, and the delay from message timestamp to
//!   committed write at the target's steady 1,000 events/s (with a sample
//!   of trades timed from producer acknowledgement to readable in MongoDB);
//! - the append ceiling: the database's capacity for one-trade appends to
//!   open buckets; the database alone, those appends paced at 0.8 × it,
//!   with the machine to itself and beside a steady phase's Kafka load;
//!   and the delay curve at steady loads below and above it;
//! - last, the worker and the paced plain consumer again, for the broker's
//!   CPU per event on a broker that has compiled its code.
//!
//! Run through `scripts/bench`, which starts the stack, builds, runs this
//! and renders `docs/benchmarks.md` and its chart from the JSON it writes.
//!
//! This file runs the steps in order; beside it, one file a job: `target`
//! (a run's target, reading its topic and offsets), `worker` (the worker
//! runs, sampled), `ceiling` (the database ceiling), `appends` (the append
//! ceiling), `naive` (the naive
//! baseline), `delay` (the steady phases and sampled delays), `cpu` (CPU
//! time from `/proc`) and `scrape` (reading the worker's `/metrics`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use rdkafka::consumer::Consumer;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use serde_json::json;

use tradebucket::bucket::store::BucketStore;
use tradebucket::cli::{self, ProduceOptions};

use appends::{append_ceiling, paced_appends};
use ceiling::{database_ceiling, index_keys, Heads};
use cpu::{cpu_model, Cpu};
use delay::delays;
use naive::naive_baseline;
use target::{end_offsets, kafka_consumer, read_topic, Target};
use worker::{run_worker, Sample, WorkerRun};

mod appends;
mod ceiling;
mod cpu;
mod delay;
mod naive;
mod scrape;
mod target;
mod worker;

#[derive(Parser, Debug)]
struct Args {
    /// Events in the pre-loaded set (and again in the second set).
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    #[arg(long, default_value_t = 10_000)]
    customers: u64,
    #[arg(long, default_value_t = 8)]
    partitions: i32,
    /// Events the naive baseline writes (one round trip each).
    #[arg(long, default_value_t = 20_000)]
    naive_events: usize,
    /// Bulk inserts in flight for the database ceiling.
    #[arg(long, default_value_t = 4)]
    ceiling_concurrency: usize,
    /// Seconds of steady load for the delay measurement.
    #[arg(long, default_value_t = 60)]
    latency_seconds: u64,
    /// The delay curve: steady loads as fractions of the append ceiling
    /// (the database's capacity for one-trade appends to open buckets,
    /// what each trade is under a steady load over many customers), from
    /// well below it to well above it.
    #[arg(long, value_delimiter = ',', default_values_t = [0.5, 0.8, 1.0, 1.5, 3.0])]
    steady_fractions: Vec<f64>,
    /// The steady load of the delay target (issue #18: p99 within 100 ms
    /// at 1,000 events/s, default settings), measured besides the curve,
    /// with a sample of trades timed from the producer's acknowledgement
    /// to being readable in MongoDB; 0 skips it.
    #[arg(long, default_value_t = 1000)]
    steady_rate: u64,
    /// Skip the second set (quicker runs while optimising).
    #[arg(long)]
    no_second_set: bool,
    /// Events of the unkeyed set (a topic of its own, produced without
    /// keys, so each customer's trades spread over every partition),
    /// stored by the worker and then reconciled; default a quarter of
    /// `--events`, 0 skips it.
    #[arg(long)]
    unkeyed_events: Option<u64>,
    /// Sample a worker over the first set's topic, run again last with
    /// `perf record -e cpu-clock` (Debian's linux-perf; step 8), and keep
    /// `perf report`'s per-symbol table in `perf.worker.txt`, which
    /// report.py sorts by library: where the worker's own CPU goes,
    /// outside the product and in it. The first set's worker, whose CPU
    /// the targets judge, runs without the profiler.
    #[arg(long)]
    profile: bool,
    /// Where results.json and timeline.csv go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    // `cargo bench` passes --bench; accept and ignore it.
    #[arg(long, hide = true)]
    bench: bool,
    /// Internal: be the plain consumer of this topic (`--events` records
    /// from `--partitions` partitions), a process of its own so that its
    /// CPU is its own (see `plain_consumer`).
    #[arg(long, hide = true)]
    plain_consumer: Option<String>,
    /// Internal, with `--plain-consumer`: read at most this many records a
    /// second (0: as fast as it can).
    #[arg(long, hide = true, default_value_t = 0.0)]
    plain_rate: f64,
}

/// The release binary `cargo bench` built alongside this program.
fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tradebucket"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(topic) = &args.plain_consumer {
        return plain_consumer_child(&args, topic);
    }
    std::fs::create_dir_all(&args.out)?;
    let run_id = chrono::Utc::now().format("%Y%m%d%H%M%S").to_string();
    let target = Target::new(
        &testkit::settings::from_process_env(),
        &format!("bench-{run_id}"),
        &format!("bench_{run_id}"),
        &format!("bench-{run_id}-1"),
        0,
    );
    eprintln!("bench: topic {}, database {}", target.topic, target.db);

    // 1. The event set.
    let settings = target.settings();
    cli::init(&settings, Some(args.partitions)).await?;
    let (_, _, secs) = cli::produce(
        &settings,
        &produce_options(&args, 0, args.events, 0, &target.topic),
        false,
    )
    .await?;
    let produce_rate = args.events as f64 / secs;
    eprintln!("bench: produced {} events in {secs:.1} s", args.events);

    let (ceilings, heads) = ceilings(&args, &target).await?;
    let rest = servers_at_rest().await;
    let mut samples = Vec::new();
    let (first, paced, second) = worker_runs(&args, &target, &mut samples, &heads).await?;
    let (second, second_ceiling) = second.unzip();
    let (audit, reconcile) = check_runs(&args, &target, &ceilings, &first, &second).await?;
    let unkeyed = unkeyed_set(&args, &run_id).await?;
    let appends = append_ceiling(&target, args.customers).await?;
    let per_second = appends["appends_per_second"].as_f64().unwrap_or(0.0);
    eprintln!("bench: append ceiling {per_second:.0} appends/s");
    // The database alone at 0.8 x its ceiling: what the server's own delay
    // is at the steady capacity's target (customers past the ceiling's),
    // with the machine to itself and then beside a steady phase's Kafka load.
    let pace = 0.8 * per_second;
    let secs = args.latency_seconds;
    let none = std::future::ready(Ok(()));
    let append_paced =
        paced_appends(&target, "append_paced", args.customers, pace, secs, none).await?;
    eprintln!("bench: appends paced at 0.8 x the ceiling: {append_paced}");
    let load = kafka_load(&args, &target, pace).await?;
    let append_paced_beside =
        paced_appends(&target, "append_beside", args.customers, pace, secs, load).await?;
    eprintln!("bench: the same, beside a steady Kafka load: {append_paced_beside}");
    let delays = delays(&args, &target, per_second).await?;
    let broker_warm = warm_broker_pair(&args, &target).await?;
    let profiled = match args.profile {
        true => Some(profiled_worker(&args, &target).await?),
        false => None,
    };

    let results = json!({
        "run_id": run_id,
        "machine": machine(),
        "events": args.events,
        "customers": args.customers,
        "partitions": args.partitions,
        "produce_events_per_second": produce_rate,
        "servers_at_rest": rest,
        "kafka_read_ceiling": ceilings["kafka_read_ceiling"],
        "plain_consumer": ceilings["plain_consumer"],
        "plain_consumer_paced": paced,
        "database_ceiling": ceilings["database_ceiling"],
        "database_ceiling_second": second_ceiling,
        "naive_baseline": ceilings["naive_baseline"],
        "tradebucket_first": first,
        "tradebucket_second": second,
        "append_ceiling": appends,
        "append_paced": append_paced,
        "append_paced_beside": append_paced_beside,
        "hold_max_age_seconds": settings.batch.hold_max_age.as_secs_f64(),
        "delays": delays,
        "broker_warm": broker_warm,
        "tradebucket_profiled": profiled,
        "reconcile": reconcile,
        "tradebucket_unkeyed": unkeyed.as_ref().map(|u| &u.0),
        "reconcile_unkeyed": unkeyed.as_ref().map(|u| &u.1),
        "final_audit": {"trades": audit.trades, "buckets": audit.buckets, "customers": audit.customers},
    });
    write_results(&args.out, &results, &samples)
}

/// How many times step 7 runs its pair: one pair's two halves run a
/// minute apart on a broker whose CPU at rest moves between windows (0.010
/// to 0.031 cores) and is most of either half's figure at the worker's
/// pace, so one pair is one draw of that noise (standalone pairs of the
/// same binaries on one warm broker gave ratios a fifth apart).
const WARM_PAIRS: usize = 3;

/// Step 7: the broker target's pair again, last, on the broker as the
/// run leaves it: by then it has served every phase's worker and compiled
/// their code, as a broker that has run for days has. A young broker
/// runs a consumer group's paths (join, heartbeats, commits) slowly until
/// it has compiled them, and compiles meanwhile, so steps 5 and 5a, on a
/// broker started for the run, measure its start as much as the worker
/// (docs/benchmarks.md, "Session 31"). Each pair: a fresh group and
/// database read the first set's topic from the start; then the plain
/// consumer reads at that worker's pace. [`WARM_PAIRS`] pairs, alternating;
/// the pair of the median ratio is the target's, beside every ratio.
async fn warm_broker_pair(args: &Args, target: &Target) -> anyhow::Result<serde_json::Value> {
    let mut pairs = Vec::new();
    for (i, phase) in WARM_PHASES.into_iter().enumerate() {
        let run = reread(args, target, phase, None).await?;
        let paced = plain_consumer(
            args,
            target,
            &Cpu::of_stack(),
            run["events_per_second"].as_f64().unwrap_or(0.0),
        )?;
        let broker = |v: &serde_json::Value| v["cpu_per_million"]["broker"].as_f64();
        let ratio = broker(&run).zip(broker(&paced)).map(|(w, p)| w / p);
        let pair = json!({"worker": run, "plain_consumer_paced": paced, "ratio": ratio});
        eprintln!("bench: the broker pair again, warm ({}): {pair}", i + 1);
        pairs.push(pair);
    }
    Ok(median_by(pairs, "ratio", "ratios"))
}

/// The run of the median `key` among `runs` (one or more; one without it
/// sorts last), with every run's `key` listed as `all` when there were
/// several: how a measurement repeated against the host's noise is
/// judged (the warm broker pairs, the steady capacity's target rate).
fn median_by(mut runs: Vec<serde_json::Value>, key: &str, all: &str) -> serde_json::Value {
    let value = |x: &serde_json::Value| x[key].as_f64();
    let listed: Vec<f64> = runs.iter().filter_map(value).collect();
    let order = |x: &serde_json::Value| value(x).unwrap_or(f64::INFINITY);
    runs.sort_by(|a, b| order(a).total_cmp(&order(b)));
    let several = runs.len() > 1;
    let mut median = runs.swap_remove(runs.len() / 2);
    if several {
        median[all] = json!(listed);
    }
    median
}

/// The phases (groups and databases) of step 7's pairs.
const WARM_PHASES: [&str; WARM_PAIRS] = ["warm", "warm2", "warm3"];

/// Step 8 (`--profile`): the first set's topic read again, `perf record`
/// attached (`perf.worker.txt`). Apart from the first set, whose worker's
/// CPU the targets judge: the profiler costs the process it samples CPU
/// of its own (docs/benchmarks.md, "Session 32").
async fn profiled_worker(args: &Args, target: &Target) -> anyhow::Result<serde_json::Value> {
    let profile = Some(args.out.join("perf.worker"));
    let run = reread(args, target, "profiled", profile).await?;
    eprintln!("bench: the worker again, profiled: {run}");
    Ok(run)
}

/// A worker reading the first set's topic from the start (the second
/// set's events too, if there was one) with a fresh group and database,
/// both named after `phase`: its seconds, rate and CPU per million.
async fn reread(
    args: &Args,
    target: &Target,
    phase: &'static str,
    profile: Option<PathBuf>,
) -> anyhow::Result<serde_json::Value> {
    let t = Target::new(
        &target.vars,
        &target.topic,
        &format!("{}_{phase}", target.db),
        &format!("{}-{phase}", target.group),
        0,
    );
    cli::init(&t.settings(), None).await?;
    let total = if args.no_second_set { 1 } else { 2 } * args.events;
    let run = run_worker(&t, total, total, phase, &mut Vec::new(), profile).await?;
    Ok(
        json!({"seconds": run.seconds, "events_per_second": run.events_per_second,
              "cpu_per_million": run.cpu_per_million}),
    )
}

/// Step 4b: what the servers cost with no client at all, in cores (CPU-s
/// a second), over a window after a pause for the phases before to settle.
/// A KRaft node spends CPU on its own (the controller's quorum, the
/// metadata log, timers) whether or not anyone reads: spread over a
/// phase's events it is part of every per-event figure, the more the
/// longer the phase. report.py shows what it adds to the worker's and
/// the full-speed read's broker figures; the broker target compares the
/// worker with the plain consumer at its pace instead (step 5a), as this
/// rate varies too much between windows (0.017 to 0.031 cores) to be
/// subtracted.
async fn servers_at_rest() -> serde_json::Value {
    const SETTLE: Duration = Duration::from_secs(5);
    const WINDOW: Duration = Duration::from_secs(20);
    tokio::time::sleep(SETTLE).await;
    let cpu = Cpu::of_stack();
    let before = cpu.snapshot(None);
    tokio::time::sleep(WINDOW).await;
    let used = cpu.snapshot(None).since(&before);
    let cores = |s: Option<f64>| s.map(|s| s / WINDOW.as_secs_f64());
    let rest = json!({
        "seconds": WINDOW.as_secs_f64(),
        "broker_cores": cores(used.broker),
        "database_cores": cores(used.database),
    });
    eprintln!("bench: servers at rest {rest}");
    rest
}

/// After the worker runs: the audit (every trade stored once), reconcile
/// over the same records, and the ceiling's indexes checked against the
/// product's.
async fn check_runs(
    args: &Args,
    target: &Target,
    ceilings: &serde_json::Value,
    first: &WorkerRun,
    second: &Option<WorkerRun>,
) -> anyhow::Result<(cli::AuditReport, serde_json::Value)> {
    let settings = target.settings();
    let audit = cli::audit(&settings, None).await?;
    let worker_seconds = first.seconds + second.as_ref().map_or(0.0, |s| s.seconds);
    let reconcile = reconcile_run(target, worker_seconds).await?;
    // The ceiling is only a ceiling of the same work with the same indexes.
    let store = BucketStore::connect(&settings).await?;
    let product_indexes = index_keys(store.collection()).await?;
    anyhow::ensure!(
        json!(product_indexes) == ceilings["database_ceiling"]["indexes"],
        "the ceiling collection's indexes {} differ from the product's {product_indexes:?}",
        ceilings["database_ceiling"]["indexes"]
    );
    let expected = if second.is_some() { 2 } else { 1 } * args.events;
    anyhow::ensure!(
        audit.violations.is_empty() && audit.trades == expected,
        "after the runs: {} trades (expected {expected}), violations {:?}",
        audit.trades,
        audit.violations
    );
    Ok((audit, reconcile))
}

/// The generator's options for `count` events from trade number `first_id`
/// at `rate` per second (0: full speed).
fn produce_options(
    args: &Args,
    first_id: u64,
    count: u64,
    rate: u64,
    topic: &str,
) -> ProduceOptions {
    ProduceOptions {
        topic: Some(topic.to_string()),
        count,
        customers: args.customers,
        skewed: false,
        tickers: 8,
        rate,
        seed: 1,
        no_keys: false,
        first_id,
    }
}

/// Steps 2 to 4: the Kafka read ceiling (keeping the messages for the offline
/// plan), the database ceiling and the naive baseline, as the results'
/// JSON entries, and each customer's newest bucket in the ceiling
/// collection, which the second set's ceiling chains onto.
async fn ceilings(args: &Args, target: &Target) -> anyhow::Result<(serde_json::Value, Heads)> {
    let settings = target.settings();
    let cpu = Cpu::of_stack();
    let before = cpu.snapshot(None);
    let (kafka_secs, messages) =
        read_topic(&settings, &target.topic, args.partitions, args.events, None)?;
    let kafka_cpu = before.per_million(&cpu.snapshot(None), args.events);
    let kafka_rate = args.events as f64 / kafka_secs;
    eprintln!("bench: Kafka read ceiling {kafka_rate:.0} events/s, CPU-s per million {kafka_cpu}");
    let plain = plain_consumer(args, target, &cpu, 0.0)?;
    eprintln!(
        "bench: plain consumer (own process), CPU-s per million {}",
        plain["cpu_per_million"]
    );

    let db = database_ceiling(
        target,
        &messages,
        args.ceiling_concurrency,
        &cpu,
        &Heads::new(),
    )
    .await?;
    let db_rate = args.events as f64 / db.seconds;
    eprintln!(
        "bench: database ceiling {db_rate:.0} events/s ({} documents), CPU-s per million {}",
        db.documents, db.cpu
    );

    let before = cpu.snapshot(None);
    let naive_rate = naive_baseline(target, &messages, args.naive_events).await?;
    let naive_cpu = before.per_million(&cpu.snapshot(None), args.naive_events as u64);
    eprintln!("bench: naive baseline {naive_rate:.0} events/s");
    let entries = json!({
        "kafka_read_ceiling": {"seconds": kafka_secs, "events_per_second": kafka_rate,
                               "cpu_per_million": kafka_cpu},
        "plain_consumer": plain,
        "database_ceiling": {"seconds": db.seconds, "events_per_second": db_rate,
                             "documents": db.documents, "concurrency": args.ceiling_concurrency,
                             "indexes": db.indexes, "cpu_per_million": db.cpu,
                             "client_cpu_per_million": db.client_cpu_per_million},
        "naive_baseline": {"events": args.naive_events, "events_per_second": naive_rate,
                           "cpu_per_million": naive_cpu},
    });
    Ok((entries, db.heads))
}

/// Step 2b, the worker's floor: a plain consumer reading the same backlog
/// in a process of its own (this program again, `--plain-consumer`), so
/// that its CPU, which the in-process read ceiling above cannot tell from
/// this program's, is measured as the worker's is: from /proc/PID/stat of
/// its process (it reads its own before exiting). The servers' CPU over
/// its run is measured beside it.
///
/// At `rate` > 0 it reads no faster than that (step 5a, at the worker's
/// rate): a broker spends CPU by the second whoever reads (a KRaft node's
/// quorum, metadata log and timers: 0.02 to 0.03 cores with no client at
/// all), which over the worker's tens of seconds is as large as what the
/// reading itself costs it, and over a full-speed read's few seconds is
/// nothing. Read at the worker's pace, the plain consumer's phase lasts
/// as long as the worker's, so the broker's per-event figures compare.
fn plain_consumer(
    args: &Args,
    target: &Target,
    cpu: &Cpu,
    rate: f64,
) -> anyhow::Result<serde_json::Value> {
    let before = cpu.snapshot(None);
    let started = Instant::now();
    let out = plain_consumer_command(args, target, args.events, rate)?.output()?;
    let seconds = started.elapsed().as_secs_f64();
    let mut cpu_per_million = before.per_million(&cpu.snapshot(None), args.events);
    anyhow::ensure!(out.status.success(), "the plain consumer failed");
    let own: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let own_seconds = own["cpu_seconds"].as_f64().unwrap_or(f64::NAN);
    cpu_per_million["consumer"] = json!(own_seconds / args.events.max(1) as f64 * 1e6);
    Ok(json!({
        "rate_limit": rate,
        "seconds": seconds,
        "read_seconds": own["seconds"],
        "events_per_second": args.events as f64 / seconds,
        "cpu_per_million": cpu_per_million,
    }))
}

/// This program as the plain consumer (`plain_consumer_child`) of
/// `target`'s topic: `events` records, at most `rate` a second (0: no limit).
fn plain_consumer_command(
    args: &Args,
    target: &Target,
    events: u64,
    rate: f64,
) -> anyhow::Result<std::process::Command> {
    let mut command = std::process::Command::new(std::env::current_exe()?);
    command
        .args(["--plain-consumer", &target.topic])
        .args(["--plain-rate", &rate.to_string()])
        .args(["--partitions", &args.partitions.to_string()])
        .args(["--events", &events.to_string()])
        .env_clear()
        .envs(&target.vars)
        .stderr(std::process::Stdio::inherit());
    Ok(command)
}

/// The Kafka side of a steady phase, without a worker: the load's
/// producer sending `rate` events a second for `--latency-seconds` into a
/// topic of its own (created here, before the returned work starts), and a
/// plain consumer process reading them as they arrive, so the broker
/// serves a consumer's fetches as it serves the worker's. What the
/// database-alone check is paced beside (`appends::paced_appends`): in a
/// steady phase the broker and the producer used about 0.4 of the two
/// cores (docs/benchmarks.md, "Session 37"). The phases' delay sampler is
/// left out: its trades would wait for a worker that is not there.
async fn kafka_load(
    args: &Args,
    target: &Target,
    rate: f64,
) -> anyhow::Result<impl std::future::Future<Output = anyhow::Result<()>>> {
    let t = Target::new(
        &target.vars,
        &format!("{}-beside", target.topic),
        &target.db,
        &format!("{}-beside", target.group),
        testkit::free_port(),
    );
    let s = t.settings();
    cli::init(&s, Some(args.partitions)).await?;
    let count = (rate * args.latency_seconds as f64) as u64;
    let load = produce_options(args, 0, count, rate as u64, &t.topic);
    let mut consumer = plain_consumer_command(args, &t, count, 0.0)?;
    Ok(async move {
        let consumer = tokio::task::spawn_blocking(move || consumer.output());
        let (produced, read) = tokio::join!(cli::produce(&s, &load, false), consumer);
        produced?;
        anyhow::ensure!(read??.status.success(), "the load's plain consumer failed");
        Ok(())
    })
}

/// The plain consumer's process: reads `args.events` records of `topic`
/// from the beginning with librdkafka's defaults (the read ceiling's
/// client), looking at each payload and nothing more, then prints its own
/// CPU-seconds (after closing the client, whose threads count too).
fn plain_consumer_child(args: &Args, topic: &str) -> anyhow::Result<()> {
    let settings = testkit::settings::load(&testkit::settings::from_process_env());
    let consumer = kafka_consumer(&settings, "bench-plain")?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..args.partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let (mut read, mut bytes) = (0u64, 0usize);
    let started = Instant::now();
    while read < args.events {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "read only {read} of {}",
            args.events
        );
        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
            bytes += m?.payload().map_or(0, <[u8]>::len);
            read += 1;
            if args.plain_rate > 0.0 && read % 1000 == 0 {
                // Ahead of the pace: wait until the rate allows the next.
                let due = Duration::from_secs_f64(read as f64 / args.plain_rate);
                std::thread::sleep(due.saturating_sub(started.elapsed()));
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    drop(consumer);
    let cpu = Cpu::of_process().seconds(std::process::id());
    println!(
        "{}",
        json!({"events": read, "payload_bytes": bytes, "seconds": seconds, "cpu_seconds": cpu})
    );
    Ok(())
}

/// What `worker_runs` measures: the first set, the plain consumer at its
/// pace, and the second set with its database ceiling.
type WorkerRuns = (
    WorkerRun,
    serde_json::Value,
    Option<(WorkerRun, serde_json::Value)>,
);

/// Step 5, tradebucket: the first set; step 5a, the plain consumer at its
/// pace, at once (the broker then in the state the worker left it: the
/// same topic, a minute older, nothing produced since); then (same group,
/// same collection) a second set unless `--no-second-set`.
async fn worker_runs(
    args: &Args,
    target: &Target,
    samples: &mut Vec<Sample>,
    heads: &Heads,
) -> anyhow::Result<WorkerRuns> {
    let first = run_worker(target, args.events, args.events, "first", samples, None).await?;
    eprintln!(
        "bench: tradebucket {:.0} events/s, peak RSS {:.1} MiB, CPU-s per million {}",
        first.events_per_second, first.peak_rss_mib, first.cpu_per_million
    );
    let paced = plain_consumer(args, target, &Cpu::of_stack(), first.events_per_second)?;
    eprintln!(
        "bench: plain consumer at the worker's pace, CPU-s per million {}",
        paced["cpu_per_million"]
    );
    if args.no_second_set {
        return Ok((first, paced, None));
    }
    let more = produce_options(args, args.events, args.events, 0, &target.topic);
    let ends = end_offsets(&target.settings(), &target.topic)?;
    cli::produce(&target.settings(), &more, false).await?;
    let ceiling = second_ceiling(args, target, &ends, heads).await?;
    let run = run_worker(
        target,
        2 * args.events,
        args.events,
        "second",
        samples,
        None,
    )
    .await?;
    let run = WorkerRun {
        events: args.events,
        events_per_second: args.events as f64 / run.seconds,
        ..run
    };
    eprintln!(
        "bench: second set {:.0} events/s, peak RSS {:.1} MiB, CPU-s per million {}",
        run.events_per_second, run.peak_rss_mib, run.cpu_per_million
    );
    Ok((first, paced, Some((run, ceiling))))
}

/// The database ceiling for the second set: the least a worker restarted
/// on the first set's buckets must do (`heads`, each customer's newest
/// bucket in the ceiling collection, which holds the first set's): read
/// each customer's newest bucket, complete the open ones, insert the
/// rest as final buckets. What the database makes the second million cost
/// any writer, beside what the worker's second set shows.
async fn second_ceiling(
    args: &Args,
    target: &Target,
    from: &BTreeMap<i32, i64>,
    heads: &Heads,
) -> anyhow::Result<serde_json::Value> {
    let settings = target.settings();
    let (_, messages) = read_topic(
        &settings,
        &target.topic,
        args.partitions,
        args.events,
        Some(from),
    )?;
    let cpu = Cpu::of_stack();
    let db = database_ceiling(target, &messages, args.ceiling_concurrency, &cpu, heads).await?;
    let rate = db.trades as f64 / db.seconds;
    eprintln!(
        "bench: database ceiling, second set {rate:.0} trades/s ({} documents, {} trades, restart work {}), CPU-s per million trades {}",
        db.documents, db.trades, db.restart.clone().unwrap_or_default(), db.cpu
    );
    let entry = json!({"seconds": db.seconds, "trades_per_second": rate,
                       "documents": db.documents, "trades": db.trades,
                       "restart": db.restart, "cpu_per_million": db.cpu});
    Ok(entry)
}

/// Step 5c, the unkeyed set: its own topic (as many partitions),
/// database and group; produced without keys, so a customer's trades, and
/// each bucket's, come from every partition; stored by the worker (timed
/// as the first set is), then reconciled. `None` with `--unkeyed-events 0`.
async fn unkeyed_set(
    args: &Args,
    run_id: &str,
) -> anyhow::Result<Option<(WorkerRun, serde_json::Value)>> {
    let events = args.unkeyed_events.unwrap_or(args.events / 4);
    if events == 0 {
        return Ok(None);
    }
    let target = Target::new(
        &testkit::settings::from_process_env(),
        &format!("bench-{run_id}-unkeyed"),
        &format!("bench_{run_id}_unkeyed"),
        &format!("bench-{run_id}-unkeyed-1"),
        0,
    );
    let settings = target.settings();
    cli::init(&settings, Some(args.partitions)).await?;
    let opts = ProduceOptions {
        no_keys: true,
        ..produce_options(args, 0, events, 0, &target.topic)
    };
    cli::produce(&settings, &opts, false).await?;
    // Its samples stay out of the timeline, which charts the keyed sets.
    let mut samples = Vec::new();
    let run = run_worker(&target, events, events, "unkeyed", &mut samples, None).await?;
    eprintln!(
        "bench: unkeyed set {:.0} events/s, peak RSS {:.1} MiB",
        run.events_per_second, run.peak_rss_mib
    );
    let reconcile = reconcile_run(&target, run.seconds).await?;
    Ok(Some((run, reconcile)))
}

/// Step 5b: `tradebucket reconcile --rate 0` over every record the worker
/// runs stored (issue #26: no slower than the worker took to store them,
/// peak RSS under 150 MiB). Peak RSS is the process's high-water mark
/// (`VmHWM`), read until it exits: it only grows, so the last reading is
/// the peak.
async fn reconcile_run(target: &Target, worker_seconds: f64) -> anyhow::Result<serde_json::Value> {
    let cpu = Cpu::of_stack();
    let before = cpu.snapshot(None);
    let started = Instant::now();
    let mut child = std::process::Command::new(bin())
        .args(["reconcile", "--json", "--rate", "0"])
        .env_clear()
        .envs(&target.vars)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()?;
    let status = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0;
    // Its CPU read as it runs: the last reading before it is reaped (an
    // exited child keeps its final times until then) is its total.
    let mut own_cpu = None;
    loop {
        if let Some(kib) = std::fs::read_to_string(&status)
            .ok()
            .and_then(|s| vm_hwm_kib(&s))
        {
            peak_kib = peak_kib.max(kib);
        }
        own_cpu = cpu.seconds(child.id()).or(own_cpu);
        if child.try_wait()?.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let servers = cpu.snapshot(None).since(&before);
    let out = child.wait_with_output()?;
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    anyhow::ensure!(
        out.status.success() && report["total"]["problems"] == 0,
        "reconcile found problems: {}",
        report["total"]
    );
    let records = report["total"]["records"].as_u64().unwrap_or(0);
    let database_cpu = servers.database;
    eprintln!(
        "bench: reconcile {records} records in {seconds:.1} s (the worker: {worker_seconds:.1} s), peak RSS {:.1} MiB, CPU-s {own_cpu:?}, database CPU-s {database_cpu:?}, lookups {}",
        peak_kib as f64 / 1024.0,
        report["lookups"]
    );
    Ok(json!({
        "records": records,
        "seconds": seconds,
        "records_per_second": records as f64 / seconds,
        "worker_seconds": worker_seconds,
        "peak_rss_mib": peak_kib as f64 / 1024.0,
        "cpu_seconds": own_cpu,
        "database_cpu_seconds": database_cpu,
        "broker_cpu_seconds": servers.broker,
        "lookups": report["lookups"],
    }))
}

fn vm_hwm_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn machine() -> serde_json::Value {
    json!({
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu": cpu_model(),
        "tradebucket": env!("CARGO_PKG_VERSION"),
        "librdkafka": rdkafka::util::get_rdkafka_version().1,
        // scripts/bench names the broker scripts/stack runs.
        "kafka_server": std::env::var("BENCH_KAFKA_SERVER").unwrap_or_else(|_| "unknown".into()),
        "mongodb_server": "secantusd-rs 0.5.3-beta.196",
    })
}

/// `results.json` and `timeline.csv` in `out`; the results also on stdout.
fn write_results(
    out: &Path,
    results: &serde_json::Value,
    samples: &[Sample],
) -> anyhow::Result<()> {
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(results)?,
    )?;
    let mut csv = String::from("phase,seconds,written,rss_mib,worker_cpu_s,database_cpu_s\n");
    for s in samples {
        let cpu = |v: Option<f64>| v.map(|v| format!("{v:.2}")).unwrap_or_default();
        csv.push_str(&format!(
            "{},{:.3},{},{:.1},{},{}\n",
            s.phase,
            s.seconds,
            s.written,
            s.rss_mib,
            cpu(s.cpu.worker),
            cpu(s.cpu.database),
        ));
    }
    std::fs::write(out.join("timeline.csv"), csv)?;
    println!("{}", serde_json::to_string_pretty(results)?);
    Ok(())
}
