//! Settings: the documented defaults in `config/default.toml` (compiled in),
//! then an optional file, then `TRADEBUCKET__SECTION__KEY` environment
//! variables. Unknown keys are rejected so a typo never falls back to a
//! default silently; cross-field rules are checked in [`Settings::validate`]
//! (`validate.rs`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use secrecy::SecretString;
use serde::{Deserialize, Deserializer, Serialize};

pub mod mapping;
pub mod registry;
mod secret;
mod validate;

pub use mapping::{MappingError, MappingSettings};
pub use registry::{PayloadFormat, RegistrySettings, TopicFormat};
pub use secret::{redact_uri, Scrubber, REDACTED, SECRET_KAFKA_OPTIONS};

/// The defaults, exactly as documented for operators.
pub const DEFAULT_TOML: &str = include_str!("../../config/default.toml");

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot load configuration: {0}")]
    Load(#[from] config::ConfigError),
    #[error("invalid setting {field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    /// A `[[mappings]]` entry: names the topic, the field and the rule.
    #[error("invalid setting mappings: {0}")]
    Mapping(#[from] MappingError),
}

/// Every setting. `Debug` and `Serialize` never show a secret: they are
/// what `check-config` and the start-up log print.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// The source topics, the consumer group and the dead-letter topic.
    pub kafka: KafkaSettings,
    /// Where the buckets are and how writes are acknowledged.
    pub mongodb: MongoSettings,
    /// The page size and the cache of open buckets.
    pub buckets: BucketSettings,
    /// When a batch of consumed events is written.
    pub batch: BatchSettings,
    /// How fast trades may be written (backfills that spare the primary).
    pub rate_limit: RateLimitSettings,
    /// How transient failures are retried.
    pub retry: RetrySettings,
    /// Time limits and check intervals of the network clients and probes.
    pub timeouts: TimeoutSettings,
    /// How long a stop may take.
    pub shutdown: ShutdownSettings,
    /// The metrics and health endpoints.
    pub http: HttpSettings,
    /// Log format and level.
    pub log: LogSettings,
    /// Per source topic, how its upstream's JSON is read (`[[mappings]]`);
    /// a topic without one is read by the default schema.
    #[serde(default)]
    pub mappings: Vec<MappingSettings>,
    /// Per source topic, how its payloads are encoded (`[[formats]]`); a
    /// topic not listed is JSON.
    #[serde(default)]
    pub formats: Vec<TopicFormat>,
    /// Where Avro and Protobuf topics' schemas are fetched by id.
    #[serde(default)]
    pub schema_registry: Option<RegistrySettings>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSettings {
    /// Bootstrap servers, comma-separated `host:port`.
    pub brokers: String,
    /// Source topics (a list, or comma-separated text from the environment).
    #[serde(deserialize_with = "list_or_comma_separated")]
    pub topics: Vec<String>,
    /// Consumer group shared by all instances of a deployment.
    pub group_id: String,
    /// Dead-letter topic; empty means `<source topic>.dlq`.
    pub dlq_topic: String,
    /// Client id reported to the broker (broker logs, quotas).
    pub client_id: String,
    /// Where a group without a committed offset starts.
    pub auto_offset_reset: OffsetReset,
    /// The consumer group protocol: `classic` (JoinGroup/SyncGroup, the
    /// client's `session_timeout`) or `consumer` (KIP-848: the broker
    /// assigns partitions incrementally and owns the session timeout).
    #[serde(default)]
    pub group_protocol: GroupProtocol,
    /// librdkafka `session.timeout.ms`: a member silent this long is
    /// removed. Under the `consumer` protocol the broker's
    /// `group.consumer.session.timeout.ms` removes it instead; this still
    /// bounds how long the worker waits for its group to settle.
    #[serde(with = "humantime_serde")]
    pub session_timeout: Duration,
    /// librdkafka `max.poll.interval.ms`: the longest a batch may hold the
    /// poll loop before the member is considered stuck.
    #[serde(with = "humantime_serde")]
    pub max_poll_interval: Duration,
    /// librdkafka `fetch.wait.max.ms`: how long a broker may hold a fetch
    /// that has no data yet. Apache Kafka answers as soon as data arrives,
    /// so there it only sets how often an idle consumer asks; a broker
    /// that holds every fetch until this ends adds up to twice it to each
    /// event's delay.
    #[serde(with = "humantime_serde")]
    pub fetch_wait_max: Duration,
    /// Largest accepted payload (JSON bytes); larger events are
    /// dead-lettered. It bounds what a record costs to read, not a bucket:
    /// buckets close by BSON size, and a trade too large for any bucket
    /// is dead-lettered at decode (`bucket::size`), so it places no limit
    /// on `buckets.capacity`.
    pub max_message_bytes: usize,
    /// librdkafka properties passed through (security, tuning). Values are
    /// secrets unless the property is known to be public
    /// (see `secret::PUBLIC_KAFKA_OPTIONS`).
    #[serde(default, serialize_with = "secret::serialize_kafka_options")]
    pub options: BTreeMap<String, SecretString>,
}

/// librdkafka's `group.protocol` (see docs/operations.md, "The group
/// protocol").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupProtocol {
    #[default]
    Classic,
    Consumer,
}

impl GroupProtocol {
    /// The librdkafka value.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupProtocol::Classic => "classic",
            GroupProtocol::Consumer => "consumer",
        }
    }
}

/// librdkafka's `auto.offset.reset` choices that make sense here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffsetReset {
    Earliest,
    Latest,
}

impl OffsetReset {
    /// The librdkafka value.
    pub fn as_str(self) -> &'static str {
        match self {
            OffsetReset::Earliest => "earliest",
            OffsetReset::Latest => "latest",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MongoSettings {
    /// Connection string. Its password and secret query options never
    /// print (see [`redact_uri`]).
    #[serde(serialize_with = "secret::serialize_uri")]
    pub uri: SecretString,
    /// Database holding the bucket collection.
    pub database: String,
    /// The bucket collection.
    pub collection: String,
    /// Acknowledgement every bucket write waits for.
    pub write_concern: WriteAcknowledgment,
    /// Wait for the journal before acknowledging.
    pub journal: bool,
    /// Parallel newest-bucket loads for first-seen customers.
    pub load_concurrency: usize,
    /// Fill (`update`) commands a round's appends are split into and sent
    /// at once.
    pub fill_concurrency: usize,
    /// `insert` commands a round's new buckets are split into and sent at
    /// once (rounds of fewer than 200 new buckets stay one command).
    pub insert_concurrency: usize,
    /// Sharded mode: the unique indexes are scoped to the customer (they
    /// start with `customerId`, the shard key), every filter carries the
    /// customer so mongos targets its shard, and a trade id is unique per
    /// customer only. See `bucket::store` and docs/operations.md#sharding.
    pub sharded: bool,
}

/// The `w` of the write concern: "majority" or a number of nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteAcknowledgment {
    Majority,
    Nodes(u32),
}

impl Serialize for WriteAcknowledgment {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            WriteAcknowledgment::Majority => s.serialize_str("majority"),
            WriteAcknowledgment::Nodes(n) => s.serialize_str(&n.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for WriteAcknowledgment {
    /// "majority", or a node count written as a number or as text (the
    /// environment only has text).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u32),
            Text(String),
        }
        let bad =
            || serde::de::Error::custom("write_concern must be \"majority\" or a number of nodes");
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(WriteAcknowledgment::Nodes(n)),
            Raw::Text(t) if t == "majority" => Ok(WriteAcknowledgment::Majority),
            Raw::Text(t) => t.parse().map(WriteAcknowledgment::Nodes).map_err(|_| bad()),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketSettings {
    /// Trades per bucket (page size).
    pub capacity: u32,
    /// Customers whose open bucket is cached in memory.
    pub cache_customers: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchSettings {
    /// A batch is written once it holds this many events...
    pub max_events: usize,
    /// ...or this many payload bytes...
    pub max_bytes: usize,
    /// ...or, while nothing is being written, as soon as the consumer has
    /// nothing more queued, and at the latest this long after its first
    /// event even if records keep coming.
    #[serde(with = "humantime_serde")]
    pub linger: Duration,
    /// Batches taken from the consumer and not yet committed, counting the
    /// one being filled: bounds memory to about this many times
    /// `max_bytes`. One batch is written at a time; the others are filled
    /// and decoded meanwhile. 1 is the sequential loop.
    pub max_in_flight: usize,
    /// Under a backlog (a batch filled to its bound), trades that would
    /// only part-fill a bucket wait for the customer's next trades in a
    /// later batch; a batch whose events and held trades together exceed
    /// this writes everything. 0 never holds a trade.
    pub hold_trades: usize,
    /// A held trade is written with the first batch at least this long
    /// after it was first held, whatever that batch holds.
    #[serde(with = "humantime_serde")]
    pub hold_max_age: Duration,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitSettings {
    /// Trades written per second at most, per instance; 0 is no limit.
    /// Over it the worker waits before a batch (consumption pauses, lag
    /// grows): nothing is dropped.
    pub events_per_second: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrySettings {
    /// First wait after a transient failure.
    #[serde(with = "humantime_serde")]
    pub initial_interval: Duration,
    /// Longest wait between two attempts.
    #[serde(with = "humantime_serde")]
    pub max_interval: Duration,
    /// Growth of the wait per failed attempt.
    pub multiplier: f64,
    /// Each wait is randomised by +/- this fraction.
    pub randomization_factor: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutSettings {
    /// How long a MongoDB request waits for a suitable server before it
    /// fails (and is retried with backoff).
    #[serde(with = "humantime_serde")]
    pub mongodb_server_selection: Duration,
    /// Time limit of opening one connection to MongoDB.
    #[serde(with = "humantime_serde")]
    pub mongodb_connect: Duration,
    /// How often readiness pings MongoDB while the worker is idle.
    #[serde(with = "humantime_serde")]
    pub mongodb_ping_interval: Duration,
    /// Time limit of one of those pings.
    #[serde(with = "humantime_serde")]
    pub mongodb_ping: Duration,
    /// Time limit of every other MongoDB operation the worker sends (a
    /// find, an `update` or `insert` command), waited for on the client:
    /// the driver (3.9) has no operation timeout of its own, and a
    /// connection whose replies stop would hold a write without bound.
    /// Reads also carry it as `maxTimeMS`. An expired one is a transient
    /// failure, retried with backoff; a write it cut short is
    /// indeterminate, which the writer's guards make safe to retry.
    #[serde(with = "humantime_serde")]
    pub mongodb_operation: Duration,
    /// `wtimeout` of the write concern: how long the server waits for
    /// `mongodb.write_concern` to be satisfied before it answers with a
    /// write-concern error (the write may still be applied). Below
    /// `mongodb_operation`, so the server's answer comes first.
    #[serde(with = "humantime_serde")]
    pub mongodb_write_concern: Duration,
    /// librdkafka `socket.timeout.ms` of every Kafka client: the time
    /// limit of each request to a broker (fetch, metadata, join, offset
    /// commit, ListOffsets, produce). A request that expires disconnects
    /// the broker and is retried by librdkafka. Below
    /// `liveness_stall`: a synchronous commit blocks the loop up to it.
    #[serde(with = "humantime_serde")]
    pub kafka_request: Duration,
    /// librdkafka `message.timeout.ms` of the dead-letter producer: a dead
    /// letter not acknowledged within it fails, and is sent again. Also the
    /// longest wait for room in the producer's local queue.
    #[serde(with = "humantime_serde")]
    pub dead_letter_delivery: Duration,
    /// `/healthz` answers 503 once the worker loop has not turned for this
    /// long.
    #[serde(with = "humantime_serde")]
    pub liveness_stall: Duration,
    /// `/readyz` answers 503 once an assigned partition with records
    /// waiting has not been read for this long (while nothing of it waited
    /// for the worker).
    #[serde(with = "humantime_serde")]
    pub partition_stall: Duration,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownSettings {
    /// After SIGTERM, how long an in-flight batch may take before it is
    /// abandoned (its offsets stay uncommitted).
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSettings {
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    pub listen: SocketAddr,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogSettings {
    /// Human-readable or JSON lines.
    pub format: LogFormat,
    /// Default level filter; `RUST_LOG` overrides it.
    pub level: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Text on a terminal, JSON otherwise.
    Auto,
    Text,
    Json,
}

/// A list from a file, or comma-separated text from the environment.
fn list_or_comma_separated<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        List(Vec<String>),
        Text(String),
    }
    Ok(match Raw::deserialize(d)? {
        Raw::List(l) => l,
        Raw::Text(t) => t.split(',').map(|s| s.trim().to_string()).collect(),
    })
}

impl Settings {
    /// Defaults, then `file`, then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_from(file, None)
    }

    /// Like [`Settings::load`] with an explicit environment (for tests, so
    /// they never depend on or race over the process environment).
    pub fn load_from(
        file: Option<&Path>,
        env: Option<BTreeMap<String, String>>,
    ) -> Result<Self, ConfigError> {
        let mut builder = config::Config::builder().add_source(config::File::from_str(
            DEFAULT_TOML,
            config::FileFormat::Toml,
        ));
        if let Some(path) = file {
            builder = builder.add_source(config::File::from(path).required(true));
        }
        let environment = config::Environment::with_prefix("TRADEBUCKET")
            .prefix_separator("__")
            .separator("__")
            // Values stay the text they are: `GROUP_ID=0042` is the group
            // "0042" and a password "007" stays "007". Numbers and flags
            // are parsed by their fields' types; lists by
            // `list_or_comma_separated`.
            .try_parsing(false)
            .source(env.map(|m| m.into_iter().collect()));
        let mut settings: Settings = builder.add_source(environment).build()?.try_deserialize()?;
        settings.kafka.options =
            normalize_kafka_options(std::mem::take(&mut settings.kafka.options));
        settings.validate()?;
        Ok(settings)
    }

    /// Every `[[mappings]]` entry checked and parsed, for `event::mapping`
    /// to compile.
    pub fn mapping_plans(&self) -> Result<Vec<mapping::Plan>, MappingError> {
        mapping::validate(&self.kafka.topics, &self.mappings)
    }

    /// The dead-letter topic for events read from `source`.
    pub fn dlq_topic_for(&self, source: &str) -> String {
        if self.kafka.dlq_topic.is_empty() {
            format!("{source}.dlq")
        } else {
            self.kafka.dlq_topic.clone()
        }
    }

    /// The effective settings as TOML with secrets replaced, for
    /// `check-config` and the start-up log. (`Serialize` itself redacts.)
    pub fn redacted_toml(&self) -> String {
        // Our own plain structs always serialise; Debug (which redacts
        // too) is a fallback, not a panic.
        toml::to_string_pretty(self).unwrap_or_else(|_| format!("{self:#?}"))
    }

    /// Removes this configuration's secrets from a client library's text.
    pub fn scrubber(&self) -> Scrubber {
        let registry = self.schema_registry.iter().flat_map(|r| r.secrets());
        Scrubber::new(&self.mongodb.uri, &self.kafka.options).with(registry)
    }
}

/// librdkafka property names are dotted (`sasl.password`), but a dot cannot
/// appear in a portable environment variable name. So an underscore stands
/// for a dot (`TRADEBUCKET__KAFKA__OPTIONS__SASL_PASSWORD`): no string-valued
/// librdkafka property has an underscore in its name (only callbacks do, and
/// those cannot be set from text). When both spellings of one property are
/// present, the underscore one wins, because it can only have come from the
/// environment, the later layer (or from a file that chose that spelling).
fn normalize_kafka_options(
    options: BTreeMap<String, SecretString>,
) -> BTreeMap<String, SecretString> {
    let (underscored, dotted): (Vec<_>, Vec<_>) =
        options.into_iter().partition(|(k, _)| k.contains('_'));
    let mut out: BTreeMap<String, SecretString> = dotted.into_iter().collect();
    for (key, value) in underscored {
        out.insert(key.to_ascii_lowercase().replace('_', "."), value);
    }
    out
}

/// Kafka's longest topic name.
pub const MAX_TOPIC_LEN: usize = 249;

/// Whether `name` is a legal Kafka topic name: 1-249 characters from
/// `[A-Za-z0-9._-]`, and not `.` or `..`. The watermark key and the
/// dead-letter position header rely on the characters it excludes.
pub fn legal_topic(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TOPIC_LEN
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests;
