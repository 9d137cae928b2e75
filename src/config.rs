//! Settings: the documented defaults in `config/default.toml` (compiled in),
//! then an optional file, then `TRADEBUCKET__SECTION__KEY` environment
//! variables. Unknown keys are rejected so a typo never falls back to a
//! default silently; cross-field rules are checked in [`Settings::validate`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The defaults, exactly as documented for operators.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// BSON's document size limit is 16 MiB; a full bucket must stay below it
/// with room for the bookkeeping fields.
const MAX_BUCKET_PAYLOAD_BYTES: u64 = 15 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot load configuration: {0}")]
    Load(#[from] config::ConfigError),
    #[error("invalid setting {field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}

fn invalid(field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        message: message.into(),
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub kafka: KafkaSettings,
    pub mongodb: MongoSettings,
    pub buckets: BucketSettings,
    pub batch: BatchSettings,
    pub retry: RetrySettings,
    pub shutdown: ShutdownSettings,
    pub http: HttpSettings,
    pub log: LogSettings,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSettings {
    /// Bootstrap servers, comma-separated.
    pub brokers: String,
    /// Source topics.
    pub topics: Vec<String>,
    /// Consumer group shared by all instances of a deployment.
    pub group_id: String,
    /// Dead-letter topic; empty means `<source topic>.dlq`.
    pub dlq_topic: String,
    /// Client id reported to the broker.
    pub client_id: String,
    /// Where a group without a committed offset starts.
    pub auto_offset_reset: String,
    /// librdkafka `session.timeout.ms`.
    pub session_timeout_ms: u64,
    /// librdkafka `max.poll.interval.ms`.
    pub max_poll_interval_ms: u64,
    /// Largest accepted payload; larger events are dead-lettered.
    pub max_message_bytes: usize,
    /// librdkafka properties passed through (security, tuning).
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MongoSettings {
    /// Connection string (may hold credentials: redacted when printed).
    pub uri: String,
    pub database: String,
    pub collection: String,
    /// "majority" or a node count.
    pub write_concern: String,
    /// Wait for the journal before acknowledging.
    pub journal: bool,
    /// Parallel newest-bucket loads for first-seen customers.
    pub load_concurrency: usize,
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
    pub max_events: usize,
    pub max_bytes: usize,
    pub linger_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrySettings {
    pub initial_interval_ms: u64,
    pub max_interval_ms: u64,
    pub multiplier: f64,
    pub randomization_factor: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownSettings {
    pub drain_timeout_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSettings {
    pub listen: SocketAddr,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogSettings {
    /// "auto", "text" or "json".
    pub format: String,
    pub level: String,
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
            .list_separator(",")
            .with_list_parse_key("kafka.topics")
            .try_parsing(true)
            .source(env.map(|m| m.into_iter().collect()));
        let mut settings: Settings = builder.add_source(environment).build()?.try_deserialize()?;
        settings.kafka.options =
            normalize_kafka_options(std::mem::take(&mut settings.kafka.options));
        settings.validate()?;
        Ok(settings)
    }

    /// Cross-field and range rules that types alone cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let k = &self.kafka;
        if k.brokers.trim().is_empty() {
            return Err(invalid("kafka.brokers", "must not be empty"));
        }
        if k.topics.is_empty() || k.topics.iter().any(|t| !valid_topic(t)) {
            return Err(invalid(
                "kafka.topics",
                "must list at least one topic of 1-249 characters from [A-Za-z0-9._-]",
            ));
        }
        if !k.dlq_topic.is_empty() && !valid_topic(&k.dlq_topic) {
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
        if !matches!(k.auto_offset_reset.as_str(), "earliest" | "latest") {
            return Err(invalid(
                "kafka.auto_offset_reset",
                "must be \"earliest\" or \"latest\"",
            ));
        }
        if k.max_message_bytes == 0 {
            return Err(invalid("kafka.max_message_bytes", "must be positive"));
        }
        // The drain must end before the broker gives our partitions away,
        // or a "graceful" stop would still overlap with the next owner.
        if self.shutdown.drain_timeout_ms >= k.session_timeout_ms {
            return Err(invalid(
                "shutdown.drain_timeout_ms",
                format!(
                    "must be below kafka.session_timeout_ms ({})",
                    k.session_timeout_ms
                ),
            ));
        }
        let m = &self.mongodb;
        if m.database.is_empty() || m.collection.is_empty() {
            return Err(invalid(
                "mongodb.database",
                "database and collection must not be empty",
            ));
        }
        if m.write_concern != "majority" && m.write_concern.parse::<u32>().is_err() {
            return Err(invalid(
                "mongodb.write_concern",
                "must be \"majority\" or a number of nodes",
            ));
        }
        if m.load_concurrency == 0 {
            return Err(invalid("mongodb.load_concurrency", "must be positive"));
        }
        // Syntax and option values only: no DNS (SRV) lookup, no connection.
        if let Err(e) = mongodb::options::ConnectionString::parse(&m.uri) {
            return Err(invalid("mongodb.uri", e.to_string()));
        }
        let b = &self.buckets;
        if !(1..=1000).contains(&b.capacity) {
            return Err(invalid("buckets.capacity", "must be between 1 and 1000"));
        }
        if u64::from(b.capacity) * k.max_message_bytes as u64 > MAX_BUCKET_PAYLOAD_BYTES {
            return Err(invalid(
                "buckets.capacity",
                "capacity x kafka.max_message_bytes must stay below 15 MiB \
                 (a full bucket must fit MongoDB's 16 MiB document limit)",
            ));
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
        let r = &self.retry;
        if r.initial_interval_ms == 0 || r.max_interval_ms < r.initial_interval_ms {
            return Err(invalid(
                "retry.max_interval_ms",
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
        if !matches!(self.log.format.as_str(), "auto" | "text" | "json") {
            return Err(invalid("log.format", "must be auto, text or json"));
        }
        Ok(())
    }

    /// The dead-letter topic for events read from `source`.
    pub fn dlq_topic_for(&self, source: &str) -> String {
        if self.kafka.dlq_topic.is_empty() {
            format!("{source}.dlq")
        } else {
            self.kafka.dlq_topic.clone()
        }
    }

    pub fn linger(&self) -> Duration {
        Duration::from_millis(self.batch.linger_ms)
    }

    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.shutdown.drain_timeout_ms)
    }

    /// The effective settings as TOML with secrets replaced, for
    /// `check-config` and the start-up log.
    pub fn redacted_toml(&self) -> String {
        let mut copy = self.clone();
        copy.mongodb.uri = redact_uri(&copy.mongodb.uri);
        for (key, value) in copy.kafka.options.iter_mut() {
            let key = key.to_ascii_lowercase();
            if key.contains("password")
                || key.contains("secret")
                || key.ends_with(".key.pem")
                || key == "sasl.oauthbearer.config"
            {
                *value = "<redacted>".to_string();
            }
        }
        toml_string(&copy)
    }
}

/// librdkafka property names are dotted (`sasl.password`), but a dot cannot
/// appear in a portable environment variable name. So an underscore stands
/// for a dot (`TRADEBUCKET__KAFKA__OPTIONS__SASL_PASSWORD`): no string-valued
/// librdkafka property has an underscore in its name (only callbacks do, and
/// those cannot be set from text). When both spellings of one property are
/// present, the underscore one wins, because it can only have come from the
/// environment, the later layer (or from a file that chose that spelling).
fn normalize_kafka_options(options: BTreeMap<String, String>) -> BTreeMap<String, String> {
    let (underscored, dotted): (Vec<_>, Vec<_>) =
        options.into_iter().partition(|(k, _)| k.contains('_'));
    let mut out: BTreeMap<String, String> = dotted.into_iter().collect();
    for (key, value) in underscored {
        out.insert(key.to_ascii_lowercase().replace('_', "."), value);
    }
    out
}

fn toml_string(settings: &Settings) -> String {
    // Our own plain structs always serialise; Debug is a fallback, not a panic.
    toml::to_string_pretty(settings).unwrap_or_else(|_| format!("{settings:#?}"))
}

/// Kafka's legal topic names.
fn valid_topic(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 249
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Replaces the password in `scheme://user:password@host/...`.
pub fn redact_uri(uri: &str) -> String {
    let Some(scheme_end) = uri.find("://") else {
        return uri.to_string();
    };
    let rest = &uri[scheme_end + 3..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    match (authority.rfind('@'), authority.find(':')) {
        (Some(at), Some(colon)) if colon < at => format!(
            "{}{}:<redacted>{}",
            &uri[..scheme_end + 3],
            &authority[..colon],
            &rest[at..]
        ),
        _ => uri.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Option<BTreeMap<String, String>> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn defaults_are_valid_and_match_the_documented_file() {
        let s = Settings::load_from(None, env(&[])).unwrap();
        assert_eq!(s.buckets.capacity, 10);
        assert_eq!(s.kafka.topics, vec!["trades".to_string()]);
        assert_eq!(s.mongodb.write_concern, "majority");
        assert_eq!(s.dlq_topic_for("trades"), "trades.dlq");
    }

    #[test]
    fn environment_overrides_with_double_underscores_and_lists() {
        let s = Settings::load_from(
            None,
            env(&[
                ("TRADEBUCKET__KAFKA__TOPICS", "a,b"),
                ("TRADEBUCKET__KAFKA__BROKERS", "k1:9092,k2:9092"),
                ("TRADEBUCKET__BUCKETS__CAPACITY", "25"),
                ("TRADEBUCKET__MONGODB__DATABASE", "db1"),
                ("TRADEBUCKET__KAFKA__DLQ_TOPIC", "dead"),
                ("TRADEBUCKET__HTTP__LISTEN", "127.0.0.1:0"),
            ]),
        )
        .unwrap();
        assert_eq!(s.kafka.topics, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(s.kafka.brokers, "k1:9092,k2:9092");
        assert_eq!(s.buckets.capacity, 25);
        assert_eq!(s.mongodb.database, "db1");
        assert_eq!(s.dlq_topic_for("a"), "dead");
    }

    #[test]
    fn a_single_topic_from_the_environment_is_still_a_list() {
        let s =
            Settings::load_from(None, env(&[("TRADEBUCKET__KAFKA__TOPICS", "orders")])).unwrap();
        assert_eq!(s.kafka.topics, vec!["orders".to_string()]);
    }

    #[test]
    fn invalid_values_name_the_field() {
        let cases = [
            ("TRADEBUCKET__BUCKETS__CAPACITY", "0", "buckets.capacity"),
            ("TRADEBUCKET__KAFKA__TOPICS", "bad topic", "kafka.topics"),
            (
                "TRADEBUCKET__MONGODB__WRITE_CONCERN",
                "most",
                "mongodb.write_concern",
            ),
            (
                "TRADEBUCKET__SHUTDOWN__DRAIN_TIMEOUT_MS",
                "60000",
                "shutdown.drain_timeout_ms",
            ),
            ("TRADEBUCKET__LOG__FORMAT", "xml", "log.format"),
            (
                "TRADEBUCKET__MONGODB__URI",
                "mongodb://h:99999/",
                "mongodb.uri",
            ),
            (
                "TRADEBUCKET__MONGODB__URI",
                "localhost:27017",
                "mongodb.uri",
            ),
        ];
        for (key, value, field) in cases {
            let err = Settings::load_from(None, env(&[(key, value)])).unwrap_err();
            assert!(err.to_string().contains(field), "{key}={value}: {err}");
        }
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err =
            Settings::load_from(None, env(&[("TRADEBUCKET__BUCKETS__CAPACTIY", "5")])).unwrap_err();
        assert!(err.to_string().contains("capactiy"), "{err}");
    }

    #[test]
    fn a_file_overrides_defaults_and_the_environment_overrides_the_file() {
        let dir = std::env::temp_dir().join(format!("tb-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("local.toml");
        std::fs::write(
            &path,
            "[buckets]\ncapacity = 50\n[batch]\nlinger_ms = 7\n[kafka.options]\n\"security.protocol\" = \"SASL_SSL\"\n\"sasl.password\" = \"hunter2\"\n",
        )
        .unwrap();
        let s = Settings::load_from(Some(&path), env(&[("TRADEBUCKET__BATCH__LINGER_MS", "9")]))
            .unwrap();
        assert_eq!(s.buckets.capacity, 50);
        assert_eq!(s.batch.linger_ms, 9);
        assert_eq!(s.kafka.options["security.protocol"], "SASL_SSL");
        let printed = s.redacted_toml();
        assert!(!printed.contains("hunter2"), "{printed}");
        assert!(printed.contains("SASL_SSL"), "{printed}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn kafka_options_from_the_environment_take_dots_as_underscores() {
        let dir = std::env::temp_dir().join(format!("tb-config-opt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("local.toml");
        std::fs::write(
            &path,
            "[kafka.options]\n\"security.protocol\" = \"SSL\"\n\"sasl.mechanism\" = \"PLAIN\"\n",
        )
        .unwrap();
        let s = Settings::load_from(
            Some(&path),
            env(&[
                ("TRADEBUCKET__KAFKA__OPTIONS__SECURITY_PROTOCOL", "SASL_SSL"),
                ("TRADEBUCKET__KAFKA__OPTIONS__SASL_PASSWORD", "hunter2"),
                ("TRADEBUCKET__KAFKA__OPTIONS__FETCH_MAX_BYTES", "1048576"),
            ]),
        )
        .unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let options: Vec<(&str, &str)> = s
            .kafka
            .options
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            options,
            vec![
                ("fetch.max.bytes", "1048576"),
                ("sasl.mechanism", "PLAIN"),
                ("sasl.password", "hunter2"),
                ("security.protocol", "SASL_SSL"),
            ]
        );
        let printed = s.redacted_toml();
        assert!(!printed.contains("hunter2"), "{printed}");
    }

    #[test]
    fn uri_passwords_are_redacted() {
        assert_eq!(
            redact_uri("mongodb://app:s3cret@db1:27017,db2/?replicaSet=rs0"),
            "mongodb://app:<redacted>@db1:27017,db2/?replicaSet=rs0"
        );
        assert_eq!(
            redact_uri("mongodb://127.0.0.1:27017/"),
            "mongodb://127.0.0.1:27017/"
        );
        assert_eq!(redact_uri("mongodb+srv://user@h/"), "mongodb+srv://user@h/");
    }
}
