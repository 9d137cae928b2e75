//! CPU time from `/proc`: of the worker, the broker and the database server
//! (the stack's PID files), or of this process.

use std::path::PathBuf;

use serde_json::json;

pub(crate) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default()
}

/// CPU-seconds (user + system, from `/proc/PID/stat`) of the processes a
/// phase costs: the worker, the Kafka-protocol broker and the
/// MongoDB-protocol server. CPU time, unlike wall-clock time, is what a
/// process cost whatever else shared the cores, so phases compare even
/// though all three run on the same two cores.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cpu {
    /// `/proc/PID/stat` counts in clock ticks (`getconf CLK_TCK`).
    pub(crate) tick: f64,
    pub(crate) broker: Option<u32>,
    pub(crate) database: Option<u32>,
}

/// CPU-seconds so far of each process.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpuSnapshot {
    pub(crate) worker: Option<f64>,
    pub(crate) broker: Option<f64>,
    /// The broker's JIT compiler threads ([`Cpu::jit_seconds`]), counted in
    /// `broker` too.
    pub(crate) broker_jit: Option<f64>,
    pub(crate) database: Option<f64>,
    /// This process: the bench's own producer, sampler and clients.
    pub(crate) bench: Option<f64>,
    /// Every process of the machine, every core summed: what the three
    /// and the bench leave to nothing else, and how near the cores are to
    /// full.
    pub(crate) machine: Option<f64>,
}

impl Cpu {
    /// The stack's servers, by the PID files `scripts/stack` writes into
    /// `TRADEBUCKET_STACK_DIR`. A missing file leaves that process unmeasured
    /// (`null` in the results), never fails the run.
    pub(crate) fn of_stack() -> Cpu {
        let dir = PathBuf::from(std::env::var("TRADEBUCKET_STACK_DIR").unwrap_or_default());
        let pid = |name: &str| -> Option<u32> {
            let p = std::fs::read_to_string(dir.join(name))
                .ok()?
                .trim()
                .parse()
                .ok();
            if p.is_none() {
                eprintln!(
                    "bench: no PID in {}: its CPU is not measured",
                    dir.join(name).display()
                );
            }
            p
        };
        Cpu {
            broker: pid("kafka.pid"),
            database: pid("mongodb.pid"),
            ..Cpu::of_process()
        }
    }

    /// Only the clock, for a process's own CPU ([`Cpu::seconds`]).
    pub(crate) fn of_process() -> Cpu {
        let tick = std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok())
            .unwrap_or(100.0);
        Cpu {
            tick,
            broker: None,
            database: None,
        }
    }

    /// utime + stime of `pid`, in seconds.
    pub(crate) fn seconds(&self, pid: u32) -> Option<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        self.stat_seconds(&stat)
    }

    /// utime + stime of a `stat` line, in seconds.
    fn stat_seconds(&self, stat: &str) -> Option<f64> {
        // The command name may hold spaces: fields count from after ')'.
        // There, field 3 (state) is the first, so utime (14) and stime
        // (15) are the 12th and 13th.
        let mut rest = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
        let utime: f64 = rest.next()?.parse().ok()?;
        let stime: f64 = rest.next()?.parse().ok()?;
        Some((utime + stime) / self.tick)
    }

    /// utime + stime of the JVM's JIT compiler threads of `pid` (HotSpot
    /// names them `C1 CompilerThread<n>` and `C2 CompilerThread<n>`, which
    /// `/proc` cuts to 15 bytes), in seconds. A young broker keeps
    /// compiling its code for minutes, the more the newer the kind of
    /// client (a consumer group's join, heartbeats and commits): a cost of
    /// the broker's start, not of the events a phase reads
    /// (docs/benchmarks.md, "Session 31"). A compiler thread that exits
    /// takes its time out of this sum (not out of the process's): then a
    /// phase's figure without it is, if anything, too high.
    fn jit_seconds(&self, pid: u32) -> Option<f64> {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
        let stats = tasks.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok());
        let jit = stats.filter(|stat| {
            let name = stat.split_once('(').map_or("", |(_, rest)| rest);
            name.starts_with("C1 CompilerThre") || name.starts_with("C2 CompilerThre")
        });
        Some(jit.filter_map(|stat| self.stat_seconds(&stat)).sum())
    }

    pub(crate) fn snapshot(&self, worker: Option<u32>) -> CpuSnapshot {
        CpuSnapshot {
            worker: worker.and_then(|p| self.seconds(p)),
            broker: self.broker.and_then(|p| self.seconds(p)),
            broker_jit: self.broker.and_then(|p| self.jit_seconds(p)),
            database: self.database.and_then(|p| self.seconds(p)),
            bench: self.seconds(std::process::id()),
            machine: self.machine_busy_seconds(),
        }
    }

    /// Busy CPU-seconds of the whole machine since boot, every core
    /// summed: the first line of `/proc/stat`, every field but idle and
    /// iowait (and guest time, which user time already counts).
    fn machine_busy_seconds(&self) -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let fields: Vec<f64> = stat
            .lines()
            .next()?
            .strip_prefix("cpu ")?
            .split_whitespace()
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal
        let busy: f64 = fields
            .iter()
            .take(8)
            .enumerate()
            .filter(|(i, _)| *i != 3 && *i != 4)
            .map(|(_, v)| v)
            .sum();
        Some(busy / self.tick)
    }
}

impl CpuSnapshot {
    /// CPU-seconds each process used from `earlier` to `self` (`None`
    /// where either reading is missing).
    pub(crate) fn since(&self, earlier: &CpuSnapshot) -> CpuSnapshot {
        let used = |a: Option<f64>, b: Option<f64>| Some(b? - a?);
        CpuSnapshot {
            worker: used(earlier.worker, self.worker),
            broker: used(earlier.broker, self.broker),
            broker_jit: used(earlier.broker_jit, self.broker_jit),
            database: used(earlier.database, self.database),
            bench: used(earlier.bench, self.bench),
            machine: used(earlier.machine, self.machine),
        }
    }

    /// CPU-seconds per million events between `self` and `later`, per
    /// process (`null` where unmeasured). A worker is a fresh process per
    /// phase, so its figure is its whole life up to `later`.
    pub(crate) fn per_million(&self, later: &CpuSnapshot, events: u64) -> serde_json::Value {
        let per = |a: Option<f64>, b: Option<f64>| {
            let used = b? - a.unwrap_or(0.0);
            Some(used / events.max(1) as f64 * 1e6)
        };
        json!({
            "events": events,
            "worker": per(self.worker, later.worker),
            "broker": per(self.broker, later.broker),
            "broker_jit": per(self.broker_jit, later.broker_jit),
            "database": per(self.database, later.database),
        })
    }
}
