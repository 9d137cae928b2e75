//! Step 5's worker runs: the release binary until every offset is
//! committed, sampled meanwhile (written count, RSS, CPU), and profiled
//! with `perf` on request.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::stream::StreamExt;
use mongodb::bson::{doc, Bson};
use rdkafka::consumer::BaseConsumer;
use serde_json::json;

use testkit::{free_port, http_get, WorkerProcess};
use tradebucket::bucket::store::BucketStore;

use crate::cpu::{Cpu, CpuSnapshot};
use crate::scrape::{counter, write_work};
use crate::target::{committed_reached, end_offsets, kafka_consumer, stop, Target};

/// One sample of a running worker.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    pub(crate) phase: &'static str,
    pub(crate) seconds: f64,
    pub(crate) written: u64,
    pub(crate) rss_mib: f64,
    /// CPU-seconds so far of the worker and both servers.
    pub(crate) cpu: CpuSnapshot,
}

#[derive(Debug, serde::Serialize)]
pub(crate) struct WorkerRun {
    pub(crate) events: u64,
    pub(crate) seconds: f64,
    pub(crate) events_per_second: f64,
    pub(crate) peak_rss_mib: f64,
    /// CPU-seconds per million events of the worker, the broker and the
    /// database server over the run.
    pub(crate) cpu_per_million: serde_json::Value,
    /// The same between 10 % and 90 % of the run's events written: what
    /// each further event costs once the worker runs, without its start
    /// (connecting, and reading each customer's newest bucket once).
    pub(crate) steady_cpu_per_million: serde_json::Value,
    /// What it asked of the database, by command type ([`write_work`]).
    pub(crate) write_work: serde_json::Value,
}

/// Starts the release binary and waits until the group's committed offsets
/// reach the end of the topic and `expected_total` trades are stored
/// (`new_events` of them by this run: what its CPU is counted against).
pub(crate) async fn run_worker(
    target: &Target,
    expected_total: u64,
    new_events: u64,
    phase: &'static str,
    samples: &mut Vec<Sample>,
    profile: Option<PathBuf>,
) -> anyhow::Result<WorkerRun> {
    let port = free_port();
    let t = target
        .clone()
        .with_var("TRADEBUCKET__HTTP__LISTEN", &format!("127.0.0.1:{port}"));
    let s = t.settings();
    let ends = end_offsets(&s, &t.topic)?;
    let cpu = Cpu::of_stack();
    let cpu_before = cpu.snapshot(None);
    let started = Instant::now();
    let mut child = t.spawn_worker();
    let profiler = profile.map(|out| Profiler::attach(child.id(), out));
    let store = BucketStore::connect(&s).await?;
    let progress = Progress {
        metrics_url: format!("http://127.0.0.1:{port}/metrics"),
        checker: kafka_consumer(&s, &t.group)?,
        ends,
        new_events,
        started,
        phase,
        cpu,
    };
    progress
        .sample_until_committed(&t.topic, &mut child, samples)
        .await?;
    let seconds = started.elapsed().as_secs_f64();
    let cpu_after = cpu.snapshot(Some(child.id()));
    if let Some(p) = profiler {
        p.finish()?;
    }
    let stored = stored_trades(&store).await?;
    anyhow::ensure!(
        stored == expected_total,
        "offsets committed to the end but {stored} trades stored, expected {expected_total}"
    );
    let peak_rss_mib = child.status_kib("VmHWM:").unwrap_or(0) as f64 / 1024.0;
    let write_work = http_get(&progress.metrics_url)
        .await
        .map_or(serde_json::Value::Null, |(_, text)| write_work(&text));
    stop(child)?;
    let events = expected_total;
    Ok(WorkerRun {
        events,
        seconds,
        events_per_second: events as f64 / seconds,
        peak_rss_mib,
        cpu_per_million: cpu_before.per_million(&cpu_after, new_events),
        steady_cpu_per_million: steady_cpu(samples, phase, new_events),
        write_work,
    })
}

/// CPU per million events of `phase`'s worker and servers between its
/// samples at 10 % and 90 % of `events` written, and its rate there
/// (`null` if the run was too short to have both).
pub(crate) fn steady_cpu(samples: &[Sample], phase: &str, events: u64) -> serde_json::Value {
    let run: Vec<&Sample> = samples.iter().filter(|s| s.phase == phase).collect();
    let from = run.iter().find(|s| s.written * 10 >= events);
    let to = run.iter().rev().find(|s| s.written * 10 <= events * 9);
    match (from, to) {
        (Some(a), Some(b)) if b.written > a.written => {
            let mut out = a.cpu.per_million(&b.cpu, b.written - a.written);
            out["from_written"] = json!(a.written);
            out["to_written"] = json!(b.written);
            // The rate over the same stretch: what the co-located bound
            // (from CPU per event) is comparable with, without the start.
            let seconds = b.seconds - a.seconds;
            out["events_per_second"] = json!((b.written - a.written) as f64 / seconds);
            out
        }
        _ => serde_json::Value::Null,
    }
}

/// `perf record` sampling one process (`--profile`).
pub(crate) struct Profiler {
    pub(crate) child: std::process::Child,
    pub(crate) out: PathBuf,
}

impl Profiler {
    /// Samples on the cpu-clock (a software event, so it works where
    /// hardware counters are not exposed, as in this host's VM) at 999 Hz,
    /// without call graphs: a release build has no frame pointers, and the
    /// question is only which library each sample is in.
    pub(crate) fn attach(pid: u32, out: PathBuf) -> Profiler {
        let child = std::process::Command::new("perf")
            .args(["record", "-q", "-e", "cpu-clock", "-F", "999", "-p"])
            .arg(pid.to_string())
            .arg("-o")
            .arg(format!("{}.data", out.display()))
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("perf record (apt-get install linux-perf) for --profile");
        Profiler { child, out }
    }

    /// Stops the sampling and writes `perf report`'s table of every
    /// symbol, self time only, as text beside the data.
    pub(crate) fn finish(mut self) -> anyhow::Result<()> {
        let stopped = testkit::process::send_signal(self.child.id(), testkit::process::SIGINT);
        anyhow::ensure!(stopped, "cannot stop perf record");
        self.child.wait()?;
        let report = std::process::Command::new("perf")
            .args(["report", "--stdio", "--no-children", "--sort", "dso,sym"])
            .args(["--percent-limit", "0", "-i"])
            .arg(format!("{}.data", self.out.display()))
            .output()?;
        anyhow::ensure!(report.status.success(), "perf report failed");
        std::fs::write(format!("{}.txt", self.out.display()), report.stdout)?;
        Ok(())
    }
}

/// A running worker's progress, watched by [`run_worker`].
pub(crate) struct Progress {
    pub(crate) metrics_url: String,
    /// Reads the group's committed offsets.
    pub(crate) checker: BaseConsumer,
    /// Each partition's end offset: done when the commits reach them.
    pub(crate) ends: BTreeMap<i32, i64>,
    /// The events this run writes: the commits are asked for once the
    /// worker says it wrote them (see `sample_until_committed`).
    pub(crate) new_events: u64,
    pub(crate) started: Instant,
    pub(crate) phase: &'static str,
    /// Reads the worker's and the servers' CPU at each sample.
    pub(crate) cpu: Cpu,
}

impl Progress {
    /// Samples the worker's written count and RSS every 250 ms until its
    /// group's committed offsets reach `ends`.
    ///
    /// The commits are asked of the broker only once the worker says it
    /// wrote this run's events, and every 5 s before (should its count
    /// never get there): asked every 250 ms, the offset fetches cost the
    /// broker about 0.06 µs per event of a million-event run, which the
    /// broker pair charged to the worker's side (docs/benchmarks.md,
    /// "Session 40").
    pub(crate) async fn sample_until_committed(
        &self,
        topic: &str,
        child: &mut WorkerProcess,
        samples: &mut Vec<Sample>,
    ) -> anyhow::Result<()> {
        let mut tick = 0u64;
        loop {
            tick += 1;
            tokio::time::sleep(Duration::from_millis(250)).await;
            anyhow::ensure!(child.exited().is_none(), "the worker exited early");
            anyhow::ensure!(
                self.started.elapsed() < Duration::from_secs(1800),
                "the worker did not finish in 30 minutes"
            );
            let written = http_get(&self.metrics_url)
                .await
                .and_then(|(_, body)| counter(&body, "tradebucket_events_written_total"));
            let all_written = written.is_some_and(|w| w >= self.new_events);
            if let Some(w) = written {
                samples.push(Sample {
                    phase: self.phase,
                    seconds: self.started.elapsed().as_secs_f64(),
                    written: w,
                    rss_mib: child.status_kib("VmRSS:").unwrap_or(0) as f64 / 1024.0,
                    cpu: self.cpu.snapshot(Some(child.id())),
                });
            }
            // Commits come after durable writes, so once they reach the end
            // every trade is stored; counting them is the check, once.
            let ask = all_written || tick.is_multiple_of(20);
            if ask && committed_reached(&self.checker, topic, &self.ends)? {
                return Ok(());
            }
        }
    }
}

pub(crate) async fn stored_trades(store: &BucketStore) -> anyhow::Result<u64> {
    let mut cursor = store
        .collection()
        .aggregate([doc! {"$group": {"_id": null, "n": {"$sum": "$count"}}}])
        .await?;
    Ok(match cursor.next().await {
        Some(d) => {
            let d = d?;
            match d.get("n") {
                Some(Bson::Int32(n)) => *n as u64,
                Some(Bson::Int64(n)) => *n as u64,
                _ => 0,
            }
        }
        None => 0,
    })
}
