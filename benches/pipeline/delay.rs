//! Step 6, the delay: steady loads at the target's rate and at fractions of
//! the measured throughput, the worker's own delay histogram, and sampled
//! trades timed from the producer's acknowledgement to readable in MongoDB.

use std::time::{Duration, Instant};

use mongodb::bson::doc;
use rdkafka::ClientConfig;
use serde_json::json;

use testkit::{free_port, http_get, poll_until};
use tradebucket::bucket::store::BucketStore;
use tradebucket::cli;
use tradebucket::config::Settings;

use crate::cpu::{Cpu, CpuSnapshot};
use crate::scrape::{counter, gauge, histogram, quantile, since, stage_breakdown, write_work};
use crate::target::{committed_reached, end_offsets, kafka_consumer, stop, Target};
use crate::{median_by, produce_options, Args};

/// Step 6: delay at the target's steady load (with sampled trades), then
/// the delay curve: steady loads at `args.steady_fractions` of the append
/// ceiling (`appends_per_second`), up to well above it, each checked to
/// have stored every trade once.
pub(crate) async fn delays(
    args: &Args,
    target: &Target,
    appends_per_second: f64,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let steady = (args.steady_rate > 0).then_some((args.steady_rate, None));
    let curve = args.steady_fractions.iter().map(|&f| {
        let rate = ((appends_per_second * f) as u64).max(1);
        (rate, Some(f))
    });
    let mut delays = Vec::new();
    let mut n = 0;
    for (rate, fraction) in steady.into_iter().chain(curve) {
        let mut runs = Vec::new();
        for _ in 0..repeats(fraction) {
            let latency = steady_delay(target, args, rate, n).await?;
            n += 1;
            eprintln!(
                "bench: delay at {rate} events/s: p50 {:.3} s, p99 {:.3} s, max {:.3} s; sampled {}",
                latency["p50_seconds"],
                latency["p99_seconds"],
                latency["sampled"]["max_seconds"],
                latency["sampled"]
            );
            runs.push(latency);
        }
        let mut latency = median_by(runs, "p99_seconds", "p99_repeats");
        latency["fraction_of_append_ceiling"] = json!(fraction);
        delays.push(latency);
    }
    Ok(delays)
}

/// The fraction of the append ceiling the steady capacity target asks
/// for (≥ 0.8 ×), measured [`TARGET_REPEATS`] times: the knee sits near
/// it, and one phase's draw decided on which side of 1 s its p99 fell
/// (0.49 s in one run, 1.63 s in the next, the same code; three phases
/// at that rate after the second: 0.96, 0.31, 0.22 s; docs/benchmarks.md,
/// "Session 40").
const TARGET_FRACTION: f64 = 0.8;
const TARGET_REPEATS: usize = 3;

fn repeats(fraction: Option<f64>) -> usize {
    match fraction {
        Some(f) if (f - TARGET_FRACTION).abs() < 1e-9 => TARGET_REPEATS,
        _ => 1,
    }
}

/// Delay from message timestamp to committed write, from the worker's own
/// histogram, while the generator produces at `rate` for a while.
pub(crate) async fn steady_delay(
    target: &Target,
    args: &Args,
    rate: u64,
    run: usize,
) -> anyhow::Result<serde_json::Value> {
    let port = free_port();
    let t = Target::new(
        &target.vars,
        &format!("{}-steady{run}", target.topic),
        &format!("{}_steady{run}", target.db),
        &format!("{}-steady{run}", target.group),
        port,
    );
    let s = t.settings();
    cli::init(&s, Some(args.partitions)).await?;
    let child = t.spawn_worker();
    let metrics_url = format!("http://127.0.0.1:{port}/metrics");
    // Start the load once partitions are assigned, so start-up is not
    // counted as delay.
    wait_assigned(&metrics_url, args.partitions).await?;
    let warm = warm_up(&s, &t.topic, args.customers, run)?;
    // What the warm-up made the worker observe is taken off the phase's.
    let baseline = drained_metrics(&t, &metrics_url).await?;
    let count = rate * args.latency_seconds;
    let load = produce_options(args, 0, count, rate, &t.topic);
    let sampling = async {
        let store = BucketStore::connect(&s).await?;
        let span = Duration::from_secs(args.latency_seconds);
        sampled_delays(&s, &t.topic, &store, span, run).await
    };
    let cpu = Cpu::of_stack();
    let worker = Some(child.id());
    let before = (cpu.snapshot(worker), Instant::now());
    let (produced, sampled) = tokio::join!(cli::produce(&s, &load, false), sampling);
    produced?;
    let sampled = sampled?;
    let loaded = cpu.snapshot(worker);
    let load_seconds = before.1.elapsed().as_secs_f64();
    let text = since(&drained_metrics(&t, &metrics_url).await?, &baseline);
    let servers = server_load(&before, (loaded, load_seconds), cpu.snapshot(worker), count);
    stop(child)?;
    let audit = cli::audit(&s, None).await?;
    let expected = warm + count + sampled.len() as u64;
    anyhow::ensure!(
        audit.violations.is_empty() && audit.trades == expected,
        "steady load at {rate}/s: {} trades stored of {expected}, violations {:?}",
        audit.trades,
        audit.violations
    );
    let mut figures = phase_figures(rate, count, &text, sampled);
    figures["servers"] = servers;
    figures["stored_trades"] = json!(audit.trades);
    figures["expected_trades"] = json!(expected);
    Ok(figures)
}

/// Before a steady phase's load: customer `c` gets `c % capacity + 1`
/// trades (dated before the load's), which the worker stores untimed.
/// Returns how many. A long steady load over many customers leaves their
/// open buckets at every size, as many at each, and the worker with every
/// customer's newest bucket in its cache; a phase started on an empty
/// collection instead opens every customer's bucket within its first
/// seconds, so all of them fill in step and the phase's middle appends
/// only to nearly full buckets, which cost this server the most (session
/// 27: 298 to 414 µs from 2 to 9 trades). The paced appends
/// (`appends::paced_appends`) stagger their customers for the same
/// reason. docs/benchmarks.md, "Session 31".
fn warm_up(s: &Settings, topic: &str, customers: u64, run: usize) -> anyhow::Result<u64> {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &s.kafka.brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "20")
        .create()?;
    let capacity = u64::from(s.buckets.capacity);
    let mut sent = 0u64;
    for customer in 0..customers {
        for nth in 0..=customer % capacity {
            let id = format!("W-{run}-{customer}-{nth}");
            // Milliseconds apart, before the load's first (1.7e12).
            let date = 1_699_000_000_000 + 3 * sent;
            let payload = testkit::event::trade(id)
                .customer(customer)
                .date(date)
                .payload();
            let key = customer.to_string();
            let mut record = BaseRecord::to(topic).key(&key).payload(&payload);
            while let Err((e, back)) = producer.send(record) {
                use rdkafka::error::{KafkaError, RDKafkaErrorCode};
                anyhow::ensure!(
                    matches!(
                        e,
                        KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull)
                    ),
                    "warm-up send: {e}"
                );
                producer.poll(Duration::from_millis(10));
                record = back;
            }
            sent += 1;
        }
    }
    // A send that failed is a trade short in the phase's audit.
    producer.flush(Duration::from_secs(60))?;
    Ok(sent)
}

/// What the servers did in a steady phase: the cores each used while the
/// load was sent (one core of the database's is all its serial apply can
/// use), and the CPU per trade over the whole phase, drain included: the
/// database's work per trade at this rate, beside its work per append in
/// the append ceiling (`appends::append_ceiling`), says whether the
/// database's capacity sets the knee. Beside them, the cores the worker,
/// this process (the load's producer and the sampler) and the whole
/// machine used under the load: the append ceiling had the machine to
/// itself; a steady phase shares it with the broker and the load's own
/// producer.
fn server_load(
    (start, started): &(CpuSnapshot, Instant),
    (loaded, load_seconds): (CpuSnapshot, f64),
    drained: CpuSnapshot,
    trades: u64,
) -> serde_json::Value {
    let phase_seconds = started.elapsed().as_secs_f64();
    let (load, phase) = (loaded.since(start), drained.since(start));
    let cores = |used: Option<f64>| used.map(|u| u / load_seconds);
    let per_trade = |used: Option<f64>| used.map(|u| u / trades.max(1) as f64 * 1e6);
    json!({
        "load_seconds": load_seconds,
        "phase_seconds": phase_seconds,
        "database_cores_under_load": cores(load.database),
        "broker_cores_under_load": cores(load.broker),
        "worker_cores_under_load": cores(load.worker),
        "bench_cores_under_load": cores(load.bench),
        "machine_cores_under_load": cores(load.machine),
        "machine_cores": std::thread::available_parallelism().map_or(0, usize::from),
        "database_us_per_trade": per_trade(phase.database),
        "broker_us_per_trade": per_trade(phase.broker),
    })
}

/// The worker's metrics once the group has committed to the topic's end.
async fn drained_metrics(t: &Target, metrics_url: &str) -> anyhow::Result<String> {
    let s = t.settings();
    let ends = end_offsets(&s, &t.topic)?;
    let checker = kafka_consumer(&s, &t.group)?;
    // A broker error while asking counts as not yet: asked again.
    let drained = poll_until(Duration::from_secs(120), Duration::from_millis(200), || {
        std::future::ready(committed_reached(&checker, &t.topic, &ends).unwrap_or(false))
    })
    .await;
    anyhow::ensure!(drained, "steady load not drained");
    // The last commit's delay is observed right after the commit.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, text) = http_get(metrics_url)
        .await
        .ok_or_else(|| anyhow::anyhow!("no metrics from the worker"))?;
    Ok(text)
}

/// A steady phase's delay figures: the worker's histogram, the sampled
/// delays (also in the order sent), and the worst of each third of the
/// samples in that order: whether the delay still grows at the end of the
/// phase. Thirds, not halves: above capacity the first part starts from an
/// empty backlog and climbs for a `hold_max_age` and a write or two before
/// the delay can reach its bound, so only the later two compare plateau
/// with plateau (a 60 s phase's middle third starts at 20 s).
fn phase_figures(rate: u64, count: u64, text: &str, mut sampled: Vec<f64>) -> serde_json::Value {
    let buckets = histogram(text, "tradebucket_end_to_end_delay_seconds");
    let worst = |part: &[f64]| part.iter().copied().fold(0.0, f64::max);
    let third = sampled.len() / 3;
    let thirds = json!({"first_third_max_seconds": worst(&sampled[..third]),
                        "middle_third_max_seconds": worst(&sampled[third..2 * third]),
                        "last_third_max_seconds": worst(&sampled[2 * third..])});
    let in_order = json!(sampled);
    sampled.sort_by(f64::total_cmp);
    let mut figures = delay_figures(rate, count, &buckets, &sampled);
    figures["sampled_thirds"] = thirds;
    figures["sampled_in_order_seconds"] = in_order;
    figures["stages"] = stage_breakdown(text);
    // Guard misses (each reloads its customer) and the requests by type:
    // what splitting the fills (`mongodb.fill_concurrency`) cost or saved.
    figures["conflicts"] = json!(counter(text, "tradebucket_bucket_conflicts_total"));
    figures["heads_loaded"] = json!(counter(text, "tradebucket_bucket_heads_loaded_total"));
    figures["write_work"] = write_work(text);
    figures
}

/// Waits until the worker behind `metrics_url` has all `partitions`.
pub(crate) async fn wait_assigned(metrics_url: &str, partitions: i32) -> anyhow::Result<()> {
    let assigned = poll_until(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            http_get(metrics_url).await.is_some_and(|(_, body)| {
                gauge(&body, "tradebucket_assigned_partitions").unwrap_or(0.0)
                    >= f64::from(partitions)
            })
        },
    )
    .await;
    anyhow::ensure!(assigned, "no assignment within 60 s");
    Ok(())
}

/// A steady phase's results: the worker's delay histogram (`buckets`) and
/// its quantiles, and the `sampled` delays (sorted) with theirs.
pub(crate) fn delay_figures(
    rate: u64,
    count: u64,
    buckets: &[(f64, f64)],
    sampled: &[f64],
) -> serde_json::Value {
    let total = buckets.last().map(|b| b.1).unwrap_or(0.0);
    json!({
        "rate_events_per_second": rate,
        "sampled": sampled_figures(sampled),
        "events": count,
        "observed": total,
        "p50_seconds": quantile(buckets, 0.50),
        "p90_seconds": quantile(buckets, 0.90),
        "p99_seconds": quantile(buckets, 0.99),
        "buckets": buckets.iter().map(|(le, c)| json!([le, c])).collect::<Vec<_>>(),
    })
}

/// The count, nearest-rank p50, p90 and p99, and the max of `sorted`
/// delays (`null` where there are none).
pub(crate) fn sampled_figures(sorted: &[f64]) -> serde_json::Value {
    let rank = |q: f64| sorted.get(((sorted.len() as f64 * q).ceil() as usize).saturating_sub(1));
    json!({"trades": sorted.len(), "p50_seconds": rank(0.50),
           "p90_seconds": rank(0.90), "p99_seconds": rank(0.99),
           "max_seconds": sorted.last()})
}

/// One trade every this often, on top of the generator's steady load, is
/// timed from its producer acknowledgement to being readable in MongoDB.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_millis(200);

/// How often, at least, a sampled trade's key is looked up until it is
/// stored: the resolution of the sampled delays, and light on the server
/// (an indexed point query, one or two samples in flight).
pub(crate) const SAMPLE_POLL: Duration = Duration::from_millis(5);

/// Delays, in seconds and in the order sent, from the broker's
/// acknowledgement of a sampled trade
/// (`acks=all`) to its key being readable in the worker's collection at
/// read concern "majority" (what the decisive reads use), for `span`.
pub(crate) async fn sampled_delays(
    settings: &Settings,
    topic: &str,
    store: &BucketStore,
    span: Duration,
    run: usize,
) -> anyhow::Result<Vec<f64>> {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &settings.kafka.brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "0")
        .create()?;
    // Each sample waits in its own task, so its clock stops when its trade
    // is found, not when this loop next looks.
    let mut waits = tokio::task::JoinSet::new();
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < span {
        tick.tick().await;
        n += 1;
        let id = format!("S-{run}-{n}");
        let customer = n % 1000;
        let date = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let payload = testkit::event::trade(id.as_str())
            .customer(customer)
            .date(date)
            .payload();
        let key = customer.to_string();
        let record = FutureRecord::to(topic).key(&key).payload(&payload);
        producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)?;
        let acked = Instant::now();
        let readable = readable_after(store.clone(), format!("t:{id}"), acked);
        waits.spawn(async move { readable.await.map(|delay| (n, delay)) });
    }
    let mut delays = Vec::new();
    while let Some(r) = waits.join_next().await {
        delays.push(r??);
    }
    // In the order sent, so a phase's thirds can be told apart.
    delays.sort_by_key(|&(n, _)| n);
    Ok(delays.into_iter().map(|(_, delay)| delay).collect())
}

/// Seconds from `acked` until a bucket holds `key`.
pub(crate) async fn readable_after(
    store: BucketStore,
    key: String,
    acked: Instant,
) -> anyhow::Result<f64> {
    loop {
        let found = store
            .collection()
            .find_one(doc! {"history.key": &key})
            .projection(doc! {"_id": 1})
            .await?;
        if found.is_some() {
            return Ok(acked.elapsed().as_secs_f64());
        }
        // As long as the steady phase waits for its commits.
        anyhow::ensure!(
            acked.elapsed() < Duration::from_secs(120),
            "{key} not stored in 120 s"
        );
        // A fiftieth of the delay so far: 2 % resolution, and above the
        // steady capacity, where delays reach seconds, no flood of reads.
        tokio::time::sleep(SAMPLE_POLL.max(acked.elapsed() / 50)).await;
    }
}
