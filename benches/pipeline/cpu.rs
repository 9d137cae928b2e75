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
        // The command name may hold spaces: fields count from after ')'.
        // There, field 3 (state) is the first, so utime (14) and stime
        // (15) are the 12th and 13th.
        let mut rest = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
        let utime: f64 = rest.next()?.parse().ok()?;
        let stime: f64 = rest.next()?.parse().ok()?;
        Some((utime + stime) / self.tick)
    }

    pub(crate) fn snapshot(&self, worker: Option<u32>) -> CpuSnapshot {
        CpuSnapshot {
            worker: worker.and_then(|p| self.seconds(p)),
            broker: self.broker.and_then(|p| self.seconds(p)),
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
            "database": per(self.database, later.database),
        })
    }
}
