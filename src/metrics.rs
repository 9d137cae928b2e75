//! Every metric tradebucket exports, defined once. Names follow
//! `tradebucket_<what>_<unit>[_total]`; label values are bounded (reasons,
//! operations, topics and partitions, never customer ids). Each pipeline
//! owns its registry, so tests running several in one process stay apart.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub events_consumed: IntCounter,
    pub events_written: IntCounter,
    /// reason: already_applied | duplicate
    pub events_skipped: IntCounterVec,
    /// reason: a reject kind
    pub events_dead_lettered: IntCounterVec,
    pub buckets_created: IntCounter,
    pub bucket_updates: IntCounter,
    pub bucket_conflicts: IntCounter,
    pub batch_events: Histogram,
    pub batch_customers: Histogram,
    /// operation: load | find_keys | fill | insert (see `bucket::writer`)
    pub mongodb_write_duration: HistogramVec,
    /// kind: mongodb | dead_letter | commit
    pub retries: IntCounterVec,
    /// result: ok | error
    pub offset_commits: IntCounterVec,
    /// kind: assigned | revoked
    pub rebalances: IntCounterVec,
    pub consumer_lag: IntGaugeVec,
    pub end_to_end_delay: Histogram,
    pub in_flight_events: IntGauge,
    pub assigned_partitions: IntGauge,
    /// 1 when `/readyz` answers 200; set at each scrape, so alerts see
    /// exactly what the probe sees.
    pub ready: IntGauge,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let m = Metrics {
            events_consumed: IntCounter::new(
                "tradebucket_events_consumed_total",
                "Kafka messages read from the source topics.",
            )
            .expect("valid metric"),
            events_written: IntCounter::new(
                "tradebucket_events_written_total",
                "Trades appended to bucket documents (durable at the configured write concern).",
            )
            .expect("valid metric"),
            events_skipped: IntCounterVec::new(
                Opts::new(
                    "tradebucket_events_skipped_total",
                    "Events not written because they were already stored: redelivered (already_applied) or an upstream duplicate trade id (duplicate).",
                ),
                &["reason"],
            )
            .expect("valid metric"),
            events_dead_lettered: IntCounterVec::new(
                Opts::new(
                    "tradebucket_events_dead_lettered_total",
                    "Events sent to the dead-letter topic, by reason.",
                ),
                &["reason"],
            )
            .expect("valid metric"),
            buckets_created: IntCounter::new(
                "tradebucket_buckets_created_total",
                "New bucket documents inserted.",
            )
            .expect("valid metric"),
            bucket_updates: IntCounter::new(
                "tradebucket_bucket_updates_total",
                "Guarded appends sent to open buckets.",
            )
            .expect("valid metric"),
            bucket_conflicts: IntCounter::new(
                "tradebucket_bucket_conflicts_total",
                "Writes that met another writer's change (duplicate key) and were re-planned.",
            )
            .expect("valid metric"),
            batch_events: Histogram::with_opts(
                HistogramOpts::new("tradebucket_batch_events", "Events per batch.").buckets(
                    vec![1.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0],
                ),
            )
            .expect("valid metric"),
            batch_customers: Histogram::with_opts(
                HistogramOpts::new("tradebucket_batch_customers", "Distinct customers per batch.")
                    .buckets(vec![1.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 5000.0, 10000.0]),
            )
            .expect("valid metric"),
            mongodb_write_duration: HistogramVec::new(
                HistogramOpts::new(
                    "tradebucket_mongodb_request_duration_seconds",
                    "Duration of MongoDB requests made by the writer, by operation: load (newest buckets), find_keys (where trade keys are stored), fill (appends), insert (new buckets).",
                )
                .buckets(vec![
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                ]),
                &["operation"],
            )
            .expect("valid metric"),
            retries: IntCounterVec::new(
                Opts::new(
                    "tradebucket_retries_total",
                    "Retries after transient failures, by what was retried.",
                ),
                &["kind"],
            )
            .expect("valid metric"),
            offset_commits: IntCounterVec::new(
                Opts::new(
                    "tradebucket_offset_commits_total",
                    "Kafka offset commits, by result.",
                ),
                &["result"],
            )
            .expect("valid metric"),
            rebalances: IntCounterVec::new(
                Opts::new(
                    "tradebucket_rebalances_total",
                    "Consumer-group rebalance events, by kind.",
                ),
                &["kind"],
            )
            .expect("valid metric"),
            consumer_lag: IntGaugeVec::new(
                Opts::new(
                    "tradebucket_consumer_lag_messages",
                    "Messages between the partition's end and the group's committed offset.",
                ),
                &["topic", "partition"],
            )
            .expect("valid metric"),
            end_to_end_delay: Histogram::with_opts(
                HistogramOpts::new(
                    "tradebucket_end_to_end_delay_seconds",
                    "From the Kafka message timestamp to its offset being committed.",
                )
                .buckets(vec![
                    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                ]),
            )
            .expect("valid metric"),
            in_flight_events: IntGauge::new(
                "tradebucket_in_flight_events",
                "Events consumed whose offsets are not yet committable.",
            )
            .expect("valid metric"),
            assigned_partitions: IntGauge::new(
                "tradebucket_assigned_partitions",
                "Partitions currently assigned to this instance.",
            )
            .expect("valid metric"),
            ready: IntGauge::new(
                "tradebucket_ready",
                "1 when the worker is ready (subscribed, MongoDB reachable, not draining), else 0.",
            )
            .expect("valid metric"),
            registry,
        };
        let build_info = IntGaugeVec::new(
            Opts::new(
                "tradebucket_build_info",
                "Always 1; labels carry the version.",
            ),
            &["version"],
        )
        .expect("valid metric");
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.events_consumed.clone()),
            Box::new(m.events_written.clone()),
            Box::new(m.events_skipped.clone()),
            Box::new(m.events_dead_lettered.clone()),
            Box::new(m.buckets_created.clone()),
            Box::new(m.bucket_updates.clone()),
            Box::new(m.bucket_conflicts.clone()),
            Box::new(m.batch_events.clone()),
            Box::new(m.batch_customers.clone()),
            Box::new(m.mongodb_write_duration.clone()),
            Box::new(m.retries.clone()),
            Box::new(m.offset_commits.clone()),
            Box::new(m.rebalances.clone()),
            Box::new(m.consumer_lag.clone()),
            Box::new(m.end_to_end_delay.clone()),
            Box::new(m.in_flight_events.clone()),
            Box::new(m.assigned_partitions.clone()),
            Box::new(m.ready.clone()),
            Box::new(build_info),
        ];
        for c in collectors {
            m.registry.register(c).expect("metric names are unique");
        }
        // Pre-create the label values operators alert on, so the series
        // exist (at 0) before the first incident.
        for kind in crate::event::RejectKind::ALL {
            m.events_dead_lettered.with_label_values(&[kind.as_str()]);
        }
        for reason in ["already_applied", "duplicate"] {
            m.events_skipped.with_label_values(&[reason]);
        }
        for result in ["ok", "error"] {
            m.offset_commits.with_label_values(&[result]);
        }
        for kind in ["mongodb", "dead_letter", "commit"] {
            m.retries.with_label_values(&[kind]);
        }
        m
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

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
