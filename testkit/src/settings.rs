//! The only place the kit builds `tradebucket::config::Settings`, and the
//! variables it builds them from. Tests configure workers through
//! `TRADEBUCKET__*` variables, the same for the binary (its environment)
//! and for in-process workers (through [`load`]), so both see one
//! configuration; a change to the settings' types touches this file only.

use std::collections::BTreeMap;

use tradebucket::config::Settings;

/// Variables as owned strings, later entries replacing earlier ones.
pub fn vars<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> BTreeMap<String, String> {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// What a test worker runs with: its topic, group, dead-letter topic and
/// database on the given servers, and timings short enough for tests.
pub fn test_worker(
    kafka: &str,
    topic: &str,
    group: &str,
    dlq: &str,
    mongo_uri: &str,
    db: &str,
) -> BTreeMap<String, String> {
    vars([
        ("TRADEBUCKET__KAFKA__BROKERS", kafka),
        ("TRADEBUCKET__KAFKA__TOPICS", topic),
        ("TRADEBUCKET__KAFKA__GROUP_ID", group),
        ("TRADEBUCKET__KAFKA__DLQ_TOPIC", dlq),
        ("TRADEBUCKET__MONGODB__URI", mongo_uri),
        ("TRADEBUCKET__MONGODB__DATABASE", db),
        ("TRADEBUCKET__HTTP__LISTEN", "127.0.0.1:0"),
        ("TRADEBUCKET__BATCH__LINGER", "20ms"),
        // Short sessions so group changes in tests settle quickly.
        ("TRADEBUCKET__KAFKA__SESSION_TIMEOUT", "10s"),
        ("TRADEBUCKET__SHUTDOWN__DRAIN_TIMEOUT", "5s"),
        ("TRADEBUCKET__RETRY__MAX_INTERVAL", "1s"),
    ])
}

/// The bucket capacity variable (tests and the audit must agree on it).
pub fn capacity(capacity: u32) -> (&'static str, String) {
    ("TRADEBUCKET__BUCKETS__CAPACITY", capacity.to_string())
}

/// The settings these variables give (defaults for the rest), exactly as
/// the binary would load them from its environment. Panics if invalid: a
/// test's configuration is part of the test.
pub fn load(vars: &BTreeMap<String, String>) -> Settings {
    Settings::load_from(None, Some(vars.clone()))
        .unwrap_or_else(|e| panic!("test settings are invalid: {e}"))
}

/// The `TRADEBUCKET__*` variables of this process (what `scripts/stack
/// env` exported), for programs run against the local stack.
pub fn from_process_env() -> BTreeMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| k.starts_with("TRADEBUCKET__"))
        .collect()
}
