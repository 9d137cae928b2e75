//! The rules types alone cannot express: ranges, fields that must differ
//! or nest, and the `kafka.options` that a setting of ours owns. Checked
//! once, when the settings are loaded (so at start and by `check-config`).

use std::time::Duration;

use secrecy::ExposeSecret;

use super::{legal_topic, ConfigError, GroupProtocol, Settings};

/// librdkafka properties tradebucket sets from a setting of its own, which
/// `kafka.options` may therefore not set.
pub(super) const OWNED_OPTIONS: [(&str, &str); 10] = [
    ("bootstrap.servers", "kafka.brokers"),
    ("group.id", "kafka.group_id"),
    ("client.id", "kafka.client_id"),
    ("auto.offset.reset", "kafka.auto_offset_reset"),
    ("session.timeout.ms", "kafka.session_timeout"),
    ("group.protocol", "kafka.group_protocol"),
    ("max.poll.interval.ms", "kafka.max_poll_interval"),
    ("fetch.wait.max.ms", "kafka.fetch_wait_max"),
    ("socket.timeout.ms", "timeouts.kafka_request"),
    ("message.timeout.ms", "timeouts.dead_letter_delivery"),
];

/// librdkafka properties of the classic group protocol only (the client
/// assigns and heartbeats); the `consumer` protocol leaves them to the
/// broker's `group.consumer.*` settings.
pub(super) const CLASSIC_ONLY_OPTIONS: [&str; 3] = [
    "heartbeat.interval.ms",
    "partition.assignment.strategy",
    "group.protocol.type",
];

pub(super) fn invalid(field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        message: message.into(),
    }
}

impl Settings {
    /// Cross-field and range rules that types alone cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_kafka()?;
        self.validate_mongodb()?;
        self.validate_buckets_and_batch()?;
        self.validate_retry_and_timeouts()?;
        self.mapping_plans()?;
        self.validate_formats()?;
        Ok(())
    }

    /// `kafka.fetch_wait_max`: librdkafka's range, and well within a
    /// request's time limit.
    fn validate_fetch_wait(&self) -> Result<(), ConfigError> {
        let k = &self.kafka;
        // librdkafka's own range; below a millisecond an idle consumer
        // would send fetches back to back.
        if !(Duration::from_millis(1)..=Duration::from_secs(300)).contains(&k.fetch_wait_max) {
            return Err(invalid("kafka.fetch_wait_max", "must be from 1ms to 5m"));
        }
        // A held fetch must end well within the request's time limit, or
        // librdkafka times the fetch out and the requests queued behind it.
        if k.fetch_wait_max + Duration::from_secs(1) > self.timeouts.kafka_request {
            return Err(invalid(
                "kafka.fetch_wait_max",
                format!(
                    "must be at least 1s below timeouts.kafka_request ({:?})",
                    self.timeouts.kafka_request
                ),
            ));
        }
        Ok(())
    }

    fn validate_kafka(&self) -> Result<(), ConfigError> {
        let k = &self.kafka;
        if k.brokers.trim().is_empty() {
            return Err(invalid("kafka.brokers", "must not be empty"));
        }
        if k.topics.is_empty() || k.topics.iter().any(|t| !legal_topic(t)) {
            return Err(invalid(
                "kafka.topics",
                "must list at least one topic of 1-249 characters from [A-Za-z0-9._-]",
            ));
        }
        if !k.dlq_topic.is_empty() && !legal_topic(&k.dlq_topic) {
            return Err(invalid(
                "kafka.dlq_topic",
                "must be a topic name of 1-249 characters from [A-Za-z0-9._-]",
            ));
        }
        if k.topics.iter().any(|t| *t == self.dlq_topic_for(t)) {
            return Err(invalid(
                "kafka.dlq_topic",
                "must differ from every source topic",
            ));
        }
        if k.group_id.is_empty() {
            return Err(invalid("kafka.group_id", "must not be empty"));
        }
        if k.max_message_bytes == 0 {
            return Err(invalid("kafka.max_message_bytes", "must be positive"));
        }
        self.validate_fetch_wait()?;
        self.validate_group_protocol()?;
        // Each of these has one place, a setting of ours that other rules
        // and the docs rely on: an option would silently replace it.
        if let Some((option, setting)) = OWNED_OPTIONS
            .iter()
            .find(|(option, _)| k.options.contains_key(*option))
        {
            return Err(invalid(
                "kafka.options",
                format!("\"{option}\" is set by {setting}: set that instead"),
            ));
        }
        // The drain must end before the broker gives our partitions away,
        // or a "graceful" stop would still overlap with the next owner.
        below(
            ("shutdown.drain_timeout", self.shutdown.drain_timeout),
            ("kafka.session_timeout", k.session_timeout),
            "",
        )
    }

    /// Under the `consumer` protocol the broker assigns partitions and
    /// times sessions: librdkafka refuses the classic protocol's client-side
    /// properties, so they are refused here, at start-up, with the reason.
    fn validate_group_protocol(&self) -> Result<(), ConfigError> {
        let k = &self.kafka;
        if k.group_protocol == GroupProtocol::Classic {
            return Ok(());
        }
        match CLASSIC_ONLY_OPTIONS
            .iter()
            .find(|option| k.options.contains_key(**option))
        {
            Some(option) => Err(invalid(
                "kafka.options",
                format!(
                    "\"{option}\" belongs to the classic group protocol; under \
                     kafka.group_protocol = \"consumer\" the broker decides it"
                ),
            )),
            None => Ok(()),
        }
    }

    fn validate_mongodb(&self) -> Result<(), ConfigError> {
        let m = &self.mongodb;
        if m.database.is_empty() || m.collection.is_empty() {
            return Err(invalid(
                "mongodb.database",
                "database and collection must not be empty",
            ));
        }
        if m.load_concurrency == 0 {
            return Err(invalid("mongodb.load_concurrency", "must be positive"));
        }
        if m.fill_concurrency == 0 {
            return Err(invalid("mongodb.fill_concurrency", "must be positive"));
        }
        if m.insert_concurrency == 0 {
            return Err(invalid("mongodb.insert_concurrency", "must be positive"));
        }
        // Syntax and option values only: no DNS (SRV) lookup, no connection.
        // The driver's message may quote the URI: scrubbed.
        if let Err(e) = mongodb::options::ConnectionString::parse(m.uri.expose_secret()) {
            return Err(invalid(
                "mongodb.uri",
                self.scrubber().scrub(&e.to_string()),
            ));
        }
        Ok(())
    }

    fn validate_buckets_and_batch(&self) -> Result<(), ConfigError> {
        let b = &self.buckets;
        // No rule ties capacity to `kafka.max_message_bytes` any more: that
        // bounded JSON, and a bucket's size is BSON, which can be several
        // times larger. Buckets now close by their BSON size as well as by
        // count (`bucket::size`), so any capacity here fits MongoDB's limit.
        if !(1..=1000).contains(&b.capacity) {
            return Err(invalid("buckets.capacity", "must be between 1 and 1000"));
        }
        if b.cache_customers == 0 {
            return Err(invalid("buckets.cache_customers", "must be positive"));
        }
        if self.batch.max_events == 0 || self.batch.max_bytes == 0 {
            return Err(invalid(
                "batch.max_events",
                "batch.max_events and batch.max_bytes must be positive",
            ));
        }
        if self.batch.max_in_flight == 0 {
            return Err(invalid("batch.max_in_flight", "must be at least 1"));
        }
        Ok(())
    }

    fn validate_retry_and_timeouts(&self) -> Result<(), ConfigError> {
        let r = &self.retry;
        if r.initial_interval.is_zero() || r.max_interval < r.initial_interval {
            return Err(invalid(
                "retry.max_interval",
                "intervals must be positive with max >= initial",
            ));
        }
        if r.multiplier < 1.0 {
            return Err(invalid("retry.multiplier", "must be at least 1.0"));
        }
        if !(0.0..=1.0).contains(&r.randomization_factor) {
            return Err(invalid(
                "retry.randomization_factor",
                "must be between 0 and 1",
            ));
        }
        let t = &self.timeouts;
        let limits = [
            (
                "timeouts.mongodb_server_selection",
                t.mongodb_server_selection,
            ),
            ("timeouts.mongodb_connect", t.mongodb_connect),
            ("timeouts.mongodb_ping_interval", t.mongodb_ping_interval),
            ("timeouts.mongodb_ping", t.mongodb_ping),
            ("timeouts.mongodb_operation", t.mongodb_operation),
            ("timeouts.mongodb_write_concern", t.mongodb_write_concern),
            ("timeouts.kafka_request", t.kafka_request),
            ("timeouts.dead_letter_delivery", t.dead_letter_delivery),
            ("timeouts.liveness_stall", t.liveness_stall),
            ("timeouts.partition_stall", t.partition_stall),
        ];
        if let Some((field, _)) = limits.iter().find(|(_, d)| d.is_zero()) {
            return Err(invalid(field, "must be positive"));
        }
        self.validate_time_limit_order()
    }

    /// Bounds that must nest: the server's write-concern answer before the
    /// client gives up on the operation, and every wait that blocks the
    /// loop's thread within the liveness bound, so `/healthz` never fails
    /// while the worker waits on a bound it set itself.
    fn validate_time_limit_order(&self) -> Result<(), ConfigError> {
        let t = &self.timeouts;
        below(
            ("timeouts.mongodb_write_concern", t.mongodb_write_concern),
            ("timeouts.mongodb_operation", t.mongodb_operation),
            "",
        )?;
        below(
            ("timeouts.kafka_request", t.kafka_request),
            ("timeouts.liveness_stall", t.liveness_stall),
            ": a synchronous commit blocks the loop up to it",
        )
    }
}

/// The setting `field` must be below the setting `bound` (each a name and
/// its value); `why`, when the reason is not plain, ends the message.
fn below(
    (field, value): (&'static str, Duration),
    (bound, limit): (&str, Duration),
    why: &str,
) -> Result<(), ConfigError> {
    if value < limit {
        return Ok(());
    }
    let message = format!("must be below {bound} ({limit:?}){why}");
    Err(invalid(field, message))
}
