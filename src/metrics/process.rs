//! The standard `process_*` series, with the CPU counter to the kernel's
//! precision.
//!
//! The prometheus crate's `ProcessCollector` keeps
//! `process_cpu_seconds_total` in whole seconds (an `IntCounter`:
//! tikv/rust-prometheus#451 and #560, both open), so `rate()` over it, the
//! dashboard's "cores in use", is a step function for a worker that uses
//! a tenth of a core: nothing for ten seconds, then a whole core-second.
//! This collector answers with the crate's families and replaces that
//! one value by the kernel's own count, in clock ticks (10 ms).

use prometheus::core::{Collector, Desc};
use prometheus::process_collector::ProcessCollector;
use prometheus::proto::{self, MetricFamily};

const CPU_SECONDS: &str = "process_cpu_seconds_total";

/// `ProcessCollector::for_self`, but for the CPU counter's precision.
pub(super) struct ProcessMetrics(ProcessCollector);

impl ProcessMetrics {
    pub(super) fn for_self() -> Self {
        ProcessMetrics(ProcessCollector::for_self())
    }
}

impl Collector for ProcessMetrics {
    fn desc(&self) -> Vec<&Desc> {
        self.0.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut families = self.0.collect();
        if let Some(seconds) = cpu_seconds() {
            let cpu = families.iter_mut().filter(|f| f.name() == CPU_SECONDS);
            for metric in cpu.flat_map(|f| f.mut_metric().iter_mut()) {
                let mut counter = proto::Counter::default();
                counter.set_value(seconds);
                metric.set_counter(counter);
            }
        }
        families
    }
}

/// User and system CPU time of this process, every thread, in seconds;
/// `None` if /proc cannot be read (the crate's own value stays then).
fn cpu_seconds() -> Option<f64> {
    let stat = procfs::process::Process::myself().ok()?.stat().ok()?;
    let ticks = procfs::ticks_per_second() as f64;
    Some((stat.utime + stat.stime) as f64 / ticks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exported(families: &[MetricFamily]) -> f64 {
        let cpu = families.iter().find(|f| f.name() == CPU_SECONDS);
        cpu.expect("the CPU counter is exported").get_metric()[0]
            .get_counter()
            .value()
    }

    /// With this process a fraction of a second past a whole one, the
    /// exported counter has that fraction: the crate's own collector
    /// rounds it down to the whole second (the test fails without the
    /// replacement), and it lies between two reads of the kernel's count.
    #[test]
    fn the_cpu_counter_keeps_the_fraction_of_a_second() {
        let collector = ProcessMetrics::for_self();
        let mid_second = |s: f64| (0.1..0.9).contains(&s.fract());
        let mut spin = 0u64;
        while !cpu_seconds().is_some_and(mid_second) {
            spin = std::hint::black_box(spin.wrapping_add(1));
        }
        let before = cpu_seconds().expect("read above");
        let value = exported(&collector.collect());
        let after = cpu_seconds().expect("read above");
        assert!(
            (before..=after).contains(&value),
            "{value} outside {before}..={after}"
        );
        let whole = exported(&ProcessCollector::for_self().collect());
        assert_eq!(whole, whole.trunc(), "the crate's own counts whole seconds");
    }
}
