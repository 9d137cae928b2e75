//! Every metric tradebucket exports, defined once. Names follow
//! `tradebucket_<what>_<unit>[_total]`; label values are bounded (reasons,
//! operations, topics and partitions, never customer ids). Each pipeline
//! owns its registry, so tests running several in one process stay apart.

mod labels;
#[cfg(target_os = "linux")]
mod process;

pub use labels::{
    CommitResult, ConsumerErrorKind, DelayStage, RebalanceKind, RegistryErrorKind, RetryKind,
    SkipReason, TimeoutOperation, WriteOperation,
};
use prometheus::core::Collector;
use prometheus::{
    Counter, Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// A metric's name and help text.
type Def = (&'static str, &'static str);

const EVENTS_CONSUMED_TOTAL: Def = (
    "tradebucket_events_consumed_total",
    "Kafka messages read from the source topics.",
);
const EVENTS_WRITTEN_TOTAL: Def = (
    "tradebucket_events_written_total",
    "Trades appended to bucket documents (durable at the configured write concern).",
);
const BUCKETS_CREATED_TOTAL: Def = (
    "tradebucket_buckets_created_total",
    "New bucket documents inserted.",
);
const BUCKET_UPDATES_TOTAL: Def = (
    "tradebucket_bucket_updates_total",
    "Guarded appends sent to open buckets.",
);
const BUCKET_HEADS_LOADED_TOTAL: Def = (
    "tradebucket_bucket_heads_loaded_total",
    "Customers' newest buckets read from MongoDB (not in the writer's cache).",
);
const BUCKET_CONFLICTS_TOTAL: Def = (
    "tradebucket_bucket_conflicts_total",
    "Writes that met another writer's change (duplicate key) and were re-planned.",
);
const IN_FLIGHT_EVENTS: Def = (
    "tradebucket_in_flight_events",
    "Events consumed whose offsets are not yet committable.",
);
const HELD_TRADES: Def = (
    "tradebucket_held_trades",
    "Trades held back under a backlog to go into whole buckets with a later batch (batch.hold_trades).",
);
const ASSIGNED_PARTITIONS: Def = (
    "tradebucket_assigned_partitions",
    "Partitions currently assigned to this instance.",
);
const SOURCE_PARTITIONS: Def = (
    "tradebucket_source_partitions",
    "Partitions of the source topics, as this instance's Kafka client knows them from the cluster's metadata.",
);
const STALLED_PARTITIONS: Def = (
    "tradebucket_stalled_partitions",
    "Assigned partitions with records waiting that the consumer has not read for timeouts.partition_stall.",
);
const READY: Def = (
    "tradebucket_ready",
    "1 when the worker is ready (subscribed, MongoDB reachable, not draining), else 0.",
);
const EVENTS_SKIPPED_TOTAL: Def = ("tradebucket_events_skipped_total", "Events not written because they were already stored: redelivered (already_applied) or an upstream duplicate trade id (duplicate).");
const EVENTS_DEAD_LETTERED_TOTAL: Def = (
    "tradebucket_events_dead_lettered_total",
    "Events sent to the dead-letter topic, by reason.",
);
const CONSUMER_ERRORS_TOTAL: Def = (
    "tradebucket_consumer_errors_total",
    "Errors the Kafka consumer reported, by kind: transport, offset_reset, unknown_topic_or_partition, authorization, fatal, skipped_records, other.",
);
const RETRIES_TOTAL: Def = (
    "tradebucket_retries_total",
    "Retries after transient failures, by what was retried.",
);
const TIMEOUTS_TOTAL: Def = (
    "tradebucket_timeouts_total",
    "Network operations that hit their time limit (timeouts.*), by operation: mongodb_read, mongodb_write, mongodb_write_concern, mongodb_ping, kafka_request, dead_letter.",
);
const OFFSET_COMMITS_TOTAL: Def = (
    "tradebucket_offset_commits_total",
    "Kafka offset commits, by result.",
);
const REBALANCES_TOTAL: Def = (
    "tradebucket_rebalances_total",
    "Consumer-group rebalance events, by kind.",
);

// Avro and Protobuf topics (issue #48): the Schema Registry.
const SCHEMA_FETCHES_TOTAL: Def = (
    "tradebucket_schema_fetches_total",
    "Schemas fetched from the Schema Registry by id (answers received, a schema or not).",
);
const SCHEMA_CACHE_HITS_TOTAL: Def = (
    "tradebucket_schema_cache_hits_total",
    "Avro and Protobuf records whose writer's schema was already in memory.",
);
const SCHEMA_REGISTRY_ERRORS_TOTAL: Def = (
    "tradebucket_schema_registry_errors_total",
    "Schema fetches that failed, by kind: unavailable (retried, the partition waits), not_found, invalid_schema (dead-lettered).",
);

// Operator tools (issue #16): the write-rate limit's waiting.
const THROTTLED_SECONDS_TOTAL: Def = (
    "tradebucket_throttled_seconds_total",
    "Seconds the worker waited before writing because of rate_limit.events_per_second (consumption paused meanwhile).",
);

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub events_consumed: IntCounter,
    pub events_written: IntCounter,
    /// reason: [`SkipReason`]
    pub events_skipped: IntCounterVec,
    /// reason: a [`RejectKind`](crate::event::RejectKind)
    pub events_dead_lettered: IntCounterVec,
    pub buckets_created: IntCounter,
    pub bucket_updates: IntCounter,
    pub bucket_conflicts: IntCounter,
    pub bucket_heads_loaded: IntCounter,
    pub batch_events: Histogram,
    pub batch_customers: Histogram,
    /// operation: [`WriteOperation`]
    pub mongodb_write_duration: HistogramVec,
    /// kind: [`RetryKind`]
    pub retries: IntCounterVec,
    /// operation: [`TimeoutOperation`]
    pub timeouts: IntCounterVec,
    /// kind: [`ConsumerErrorKind`]
    pub consumer_errors: IntCounterVec,
    /// result: [`CommitResult`]
    pub offset_commits: IntCounterVec,
    /// kind: [`RebalanceKind`]
    pub rebalances: IntCounterVec,
    pub consumer_lag: IntGaugeVec,
    pub end_to_end_delay: Histogram,
    /// stage: [`DelayStage`]
    pub stage_delay: HistogramVec,
    pub in_flight_events: IntGauge,
    pub held_trades: IntGauge,
    pub assigned_partitions: IntGauge,
    /// Compared with the group's assigned partitions, it shows partitions
    /// no member reads: no member reports such a partition's lag.
    pub source_partitions: IntGauge,
    pub stalled_partitions: IntGauge,
    /// 1 when `/readyz` answers 200; set at each scrape, so alerts see
    /// exactly what the probe sees.
    pub ready: IntGauge,
    /// Time spent waiting for the write-rate limit.
    pub throttled_seconds: Counter,
    pub schema_fetches: IntCounter,
    pub schema_cache_hits: IntCounter,
    /// kind: [`RegistryErrorKind`]
    pub schema_registry_errors: IntCounterVec,
}

impl Metrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let m = Metrics {
            events_consumed: counter(&r, EVENTS_CONSUMED_TOTAL),
            events_written: counter(&r, EVENTS_WRITTEN_TOTAL),
            events_skipped: counter_vec(&r, EVENTS_SKIPPED_TOTAL, "reason"),
            events_dead_lettered: counter_vec(&r, EVENTS_DEAD_LETTERED_TOTAL, "reason"),
            buckets_created: counter(&r, BUCKETS_CREATED_TOTAL),
            bucket_updates: counter(&r, BUCKET_UPDATES_TOTAL),
            bucket_conflicts: counter(&r, BUCKET_CONFLICTS_TOTAL),
            bucket_heads_loaded: counter(&r, BUCKET_HEADS_LOADED_TOTAL),
            batch_events: histogram(&r, batch_events_opts()),
            batch_customers: histogram(&r, batch_customers_opts()),
            mongodb_write_duration: histogram_vec(&r, request_duration_opts(), "operation"),
            retries: counter_vec(&r, RETRIES_TOTAL, "kind"),
            timeouts: counter_vec(&r, TIMEOUTS_TOTAL, "operation"),
            consumer_errors: counter_vec(&r, CONSUMER_ERRORS_TOTAL, "kind"),
            offset_commits: counter_vec(&r, OFFSET_COMMITS_TOTAL, "result"),
            rebalances: counter_vec(&r, REBALANCES_TOTAL, "kind"),
            consumer_lag: register(&r, consumer_lag_gauges()),
            end_to_end_delay: histogram(&r, end_to_end_delay_opts()),
            stage_delay: histogram_vec(&r, stage_delay_opts(), "stage"),
            in_flight_events: gauge(&r, IN_FLIGHT_EVENTS),
            held_trades: gauge(&r, HELD_TRADES),
            assigned_partitions: gauge(&r, ASSIGNED_PARTITIONS),
            source_partitions: gauge(&r, SOURCE_PARTITIONS),
            stalled_partitions: gauge(&r, STALLED_PARTITIONS),
            ready: gauge(&r, READY),
            throttled_seconds: register(
                &r,
                Counter::new(THROTTLED_SECONDS_TOTAL.0, THROTTLED_SECONDS_TOTAL.1),
            ),
            schema_fetches: counter(&r, SCHEMA_FETCHES_TOTAL),
            schema_cache_hits: counter(&r, SCHEMA_CACHE_HITS_TOTAL),
            schema_registry_errors: counter_vec(&r, SCHEMA_REGISTRY_ERRORS_TOTAL, "kind"),
            registry: r,
        };
        m.register_build_and_process();
        m.precreate_series();
        m
    }

    /// `tradebucket_build_info{version}` at 1, and the standard process_*
    /// series (resident memory, CPU seconds to the clock tick, open fds),
    /// read from /proc at each scrape; Linux only.
    fn register_build_and_process(&self) {
        let build_info: IntGaugeVec = register(
            &self.registry,
            IntGaugeVec::new(
                Opts::new(
                    "tradebucket_build_info",
                    "Always 1; labels carry the version.",
                ),
                &["version"],
            ),
        );
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        #[cfg(target_os = "linux")]
        self.registry
            .register(Box::new(process::ProcessMetrics::for_self()))
            .expect("process metric names are unique");
    }

    /// Pre-creates the label values operators alert on, so the series
    /// exist (at 0) before the first incident.
    fn precreate_series(&self) {
        for kind in crate::event::RejectKind::ALL {
            self.dead_lettered(kind);
        }
        SkipReason::ALL.iter().for_each(|&r| drop(self.skipped(r)));
        CommitResult::ALL.iter().for_each(|&r| drop(self.commit(r)));
        RetryKind::ALL.iter().for_each(|&k| drop(self.retry(k)));
        ConsumerErrorKind::ALL
            .iter()
            .for_each(|&k| drop(self.consumer_error(k)));
        TimeoutOperation::ALL
            .iter()
            .for_each(|&o| drop(self.timeout(o)));
        DelayStage::ALL
            .iter()
            .for_each(|&s| drop(self.stage_delay(s)));
        RegistryErrorKind::ALL
            .iter()
            .for_each(|&k| drop(self.registry_error(k)));
    }

    /// `tradebucket_schema_registry_errors_total{kind}`.
    pub fn registry_error(&self, kind: RegistryErrorKind) -> IntCounter {
        self.schema_registry_errors
            .with_label_values(&[kind.as_str()])
    }

    /// `tradebucket_events_skipped_total{reason}`.
    pub fn skipped(&self, reason: SkipReason) -> IntCounter {
        self.events_skipped.with_label_values(&[reason.as_str()])
    }

    /// `tradebucket_events_dead_lettered_total{reason}`.
    pub fn dead_lettered(&self, kind: crate::event::RejectKind) -> IntCounter {
        self.events_dead_lettered
            .with_label_values(&[kind.as_str()])
    }

    /// `tradebucket_offset_commits_total{result}`.
    pub fn commit(&self, result: CommitResult) -> IntCounter {
        self.offset_commits.with_label_values(&[result.as_str()])
    }

    /// `tradebucket_retries_total{kind}`.
    pub fn retry(&self, kind: RetryKind) -> IntCounter {
        self.retries.with_label_values(&[kind.as_str()])
    }

    /// `tradebucket_timeouts_total{operation}`.
    pub fn timeout(&self, operation: TimeoutOperation) -> IntCounter {
        self.timeouts.with_label_values(&[operation.as_str()])
    }

    /// `tradebucket_consumer_errors_total{kind}`.
    pub fn consumer_error(&self, kind: ConsumerErrorKind) -> IntCounter {
        self.consumer_errors.with_label_values(&[kind.as_str()])
    }

    /// `tradebucket_stage_delay_seconds{stage}`. The loop keeps the
    /// per-event one (`in_kafka`) at hand: a label lookup per event would
    /// cost more than the observation.
    pub fn stage_delay(&self, stage: DelayStage) -> Histogram {
        self.stage_delay.with_label_values(&[stage.as_str()])
    }

    /// `tradebucket_mongodb_request_duration_seconds{operation}`.
    pub fn write_duration(&self, operation: WriteOperation) -> Histogram {
        self.mongodb_write_duration
            .with_label_values(&[operation.as_str()])
    }

    /// `tradebucket_rebalances_total{kind}`.
    pub fn rebalance(&self, kind: RebalanceKind) -> IntCounter {
        self.rebalances.with_label_values(&[kind.as_str()])
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("encoding to a Vec cannot fail");
        String::from_utf8(buf).expect("the text format is UTF-8")
    }
}

fn batch_events_opts() -> HistogramOpts {
    HistogramOpts::new("tradebucket_batch_events", "Events per batch.").buckets(vec![
        1.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0,
    ])
}

fn batch_customers_opts() -> HistogramOpts {
    HistogramOpts::new(
        "tradebucket_batch_customers",
        "Distinct customers per batch.",
    )
    .buckets(vec![1.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 5000.0, 10000.0])
}

fn request_duration_opts() -> HistogramOpts {
    HistogramOpts::new(
        "tradebucket_mongodb_request_duration_seconds",
        "Duration of MongoDB requests made by the writer, by operation: load (newest buckets), find_keys (where trade keys are stored), fill (appends), insert (new buckets).",
    )
    .buckets(vec![
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    ])
}

fn end_to_end_delay_opts() -> HistogramOpts {
    HistogramOpts::new(
        "tradebucket_end_to_end_delay_seconds",
        "From the Kafka message timestamp to its offset being committed.",
    )
    .buckets(vec![
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ])
}

fn stage_delay_opts() -> HistogramOpts {
    HistogramOpts::new(
        "tradebucket_stage_delay_seconds",
        "Where the delay goes, by stage: in_kafka (per event: from the message timestamp to the worker receiving it), batching (per batch: from its first record received to the batch closed), decode (per batch), queued (per batch: closed to taken by the write stage), writing (per batch: head loads, writes, retries and dead letters), commit (from the oldest unacknowledged offset commit to the group coordinator's answer).",
    )
    .buckets(vec![
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        30.0,
    ])
}

fn consumer_lag_gauges() -> prometheus::Result<IntGaugeVec> {
    IntGaugeVec::new(
        Opts::new(
            "tradebucket_consumer_lag_messages",
            "Messages between the partition's end and the group's committed offset.",
        ),
        &["topic", "partition"],
    )
}

/// Registers a metric built from constant names and help texts: both can
/// only fail on a programming error (an invalid or repeated name), which
/// every test that builds `Metrics` would show.
fn register<C: Collector + Clone + 'static>(r: &Registry, built: prometheus::Result<C>) -> C {
    let c = built.expect("valid metric");
    r.register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

fn counter(r: &Registry, (name, help): Def) -> IntCounter {
    register(r, IntCounter::new(name, help))
}

fn counter_vec(r: &Registry, (name, help): Def, label: &str) -> IntCounterVec {
    register(r, IntCounterVec::new(Opts::new(name, help), &[label]))
}

fn gauge(r: &Registry, (name, help): Def) -> IntGauge {
    register(r, IntGauge::new(name, help))
}

fn histogram(r: &Registry, opts: HistogramOpts) -> Histogram {
    register(r, Histogram::with_opts(opts))
}

fn histogram_vec(r: &Registry, opts: HistogramOpts, label: &str) -> HistogramVec {
    register(r, HistogramVec::new(opts, &[label]))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every series name the dashboard and the alerts query is in what
    /// `/metrics` renders (scripts/check-deploy checks the same from the
    /// sources), the process_* ones included.
    #[test]
    fn the_exposition_has_every_metric_the_dashboard_and_alerts_use() {
        let m = Metrics::new();
        m.throttled_seconds.inc_by(0.5);
        // Labelled series appear once a label value is used.
        m.consumer_lag.with_label_values(&["trades", "0"]).set(0);
        m.write_duration(WriteOperation::Load).observe(0.0);
        m.rebalance(RebalanceKind::Assigned).inc();
        let text = m.render();
        let exposed: std::collections::BTreeSet<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        for name in [
            "process_resident_memory_bytes",
            "process_cpu_seconds_total",
            "process_open_fds",
            "process_max_fds",
            "tradebucket_throttled_seconds_total",
        ] {
            assert!(exposed.contains(name), "{name} not in {exposed:?}");
        }
        let root = env!("CARGO_MANIFEST_DIR");
        for file in [
            "deploy/grafana/dashboards/tradebucket.json",
            "deploy/prometheus/alerts.yml",
        ] {
            let used = std::fs::read_to_string(format!("{root}/{file}")).unwrap();
            for word in used.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if !(word.starts_with("tradebucket_") || word.starts_with("process_")) {
                    continue;
                }
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| word.strip_suffix(s))
                    .unwrap_or(word);
                assert!(
                    exposed.contains(word) || exposed.contains(base),
                    "{file} uses {word}, which /metrics does not have"
                );
            }
        }
    }
}
