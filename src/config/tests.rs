use secrecy::ExposeSecret;

use super::validate::{CLASSIC_ONLY_OPTIONS, OWNED_OPTIONS};
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
    assert_eq!(s.mongodb.write_concern, WriteAcknowledgment::Majority);
    assert_eq!(s.batch.linger, Duration::from_millis(50));
    assert_eq!(s.log.format, LogFormat::Auto);
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
    let s = Settings::load_from(None, env(&[("TRADEBUCKET__KAFKA__TOPICS", "orders")])).unwrap();
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
            "TRADEBUCKET__SHUTDOWN__DRAIN_TIMEOUT",
            "60s",
            "shutdown.drain_timeout",
        ),
        ("TRADEBUCKET__LOG__FORMAT", "xml", "log.format"),
        (
            "TRADEBUCKET__MONGODB__INSERT_CONCURRENCY",
            "0",
            "mongodb.insert_concurrency",
        ),
        (
            "TRADEBUCKET__TIMEOUTS__MONGODB_WRITE_CONCERN",
            "30s",
            "timeouts.mongodb_write_concern",
        ),
        (
            "TRADEBUCKET__TIMEOUTS__KAFKA_REQUEST",
            "60s",
            "timeouts.kafka_request",
        ),
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
fn capacity_and_message_size_are_independent() {
    // 1000 x 8 MiB: refused while buckets closed by count alone.
    let s = Settings::load_from(
        None,
        env(&[
            ("TRADEBUCKET__BUCKETS__CAPACITY", "1000"),
            ("TRADEBUCKET__KAFKA__MAX_MESSAGE_BYTES", "8388608"),
        ]),
    )
    .unwrap();
    assert_eq!(s.buckets.capacity, 1000);
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
        "[buckets]\ncapacity = 50\n[batch]\nlinger = \"7ms\"\n[kafka.options]\n\"security.protocol\" = \"SASL_SSL\"\n\"sasl.password\" = \"hunter2\"\n",
    )
    .unwrap();
    let s =
        Settings::load_from(Some(&path), env(&[("TRADEBUCKET__BATCH__LINGER", "9ms")])).unwrap();
    assert_eq!(s.buckets.capacity, 50);
    assert_eq!(s.batch.linger, Duration::from_millis(9));
    assert_eq!(
        s.kafka.options["security.protocol"].expose_secret(),
        "SASL_SSL"
    );
    let printed = s.redacted_toml();
    assert!(!printed.contains("hunter2"), "{printed}");
    assert!(printed.contains("SASL_SSL"), "{printed}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A time limit (or any setting of ours) has one place: an option
/// that would replace it is refused, naming the setting to use.
#[test]
fn options_that_replace_a_setting_are_refused() {
    for (option, setting) in OWNED_OPTIONS {
        let var = format!(
            "TRADEBUCKET__KAFKA__OPTIONS__{}",
            option.replace('.', "_").to_uppercase()
        );
        let err = Settings::load_from(None, env(&[(&var, "1000")])).unwrap_err();
        let said = err.to_string();
        assert!(
            said.contains("kafka.options") && said.contains(option) && said.contains(setting),
            "{var}: {said}"
        );
    }
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
        .map(|(k, v)| (k.as_str(), v.expose_secret()))
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
fn environment_values_stay_the_text_they_are() {
    let s = Settings::load_from(
        None,
        env(&[
            ("TRADEBUCKET__KAFKA__GROUP_ID", "0042"),
            ("TRADEBUCKET__KAFKA__CLIENT_ID", "true"),
            ("TRADEBUCKET__KAFKA__OPTIONS__SASL_PASSWORD", "007"),
            ("TRADEBUCKET__MONGODB__WRITE_CONCERN", "2"),
            ("TRADEBUCKET__MONGODB__JOURNAL", "false"),
            ("TRADEBUCKET__KAFKA__AUTO_OFFSET_RESET", "latest"),
            ("TRADEBUCKET__LOG__FORMAT", "json"),
        ]),
    )
    .unwrap();
    assert_eq!(s.kafka.group_id, "0042");
    assert_eq!(s.kafka.client_id, "true");
    assert_eq!(s.kafka.options["sasl.password"].expose_secret(), "007");
    assert_eq!(s.mongodb.write_concern, WriteAcknowledgment::Nodes(2));
    assert!(!s.mongodb.journal);
    assert_eq!(s.kafka.auto_offset_reset, OffsetReset::Latest);
    assert_eq!(s.log.format, LogFormat::Json);
}

#[test]
fn sharded_mode_is_off_by_default_and_set_from_the_environment() {
    assert!(!Settings::load_from(None, env(&[])).unwrap().mongodb.sharded);
    let s = Settings::load_from(None, env(&[("TRADEBUCKET__MONGODB__SHARDED", "true")])).unwrap();
    assert!(s.mongodb.sharded);
    assert!(s.redacted_toml().contains("sharded = true"));
    let err =
        Settings::load_from(None, env(&[("TRADEBUCKET__MONGODB__SHARDED", "maybe")])).unwrap_err();
    assert!(err.to_string().contains("sharded"), "{err}");
}

#[test]
fn durations_read_as_human_text() {
    let s = Settings::load_from(
        None,
        env(&[
            ("TRADEBUCKET__KAFKA__SESSION_TIMEOUT", "1m 30s"),
            ("TRADEBUCKET__RETRY__MAX_INTERVAL", "2s"),
        ]),
    )
    .unwrap();
    assert_eq!(s.kafka.session_timeout, Duration::from_secs(90));
    assert_eq!(s.retry.max_interval, Duration::from_secs(2));
    let printed = s.redacted_toml();
    assert!(
        printed.contains("session_timeout = \"1m 30s\""),
        "{printed}"
    );
    let err = Settings::load_from(None, env(&[("TRADEBUCKET__BATCH__LINGER", "50")])).unwrap_err();
    assert!(err.to_string().contains("linger"), "{err}");
}

#[test]
fn no_secret_is_printed_or_debug_formatted() {
    let secret_options = SECRET_KAFKA_OPTIONS;
    let mut vars: Vec<(String, String)> = secret_options
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let key = format!("TRADEBUCKET__KAFKA__OPTIONS__{}", o.replace('.', "_"));
            (key, format!("kafkasecret{i}x"))
        })
        .collect();
    vars.push((
        "TRADEBUCKET__MONGODB__URI".into(),
        "mongodb://app:uripass1@h/?authMechanismProperties=AWS_SESSION_TOKEN:uripass3\
         &replicaSet=rs0"
            .into(),
    ));
    let s = Settings::load_from(None, Some(vars.into_iter().collect())).unwrap();
    let printed = format!("{}\n{:?}", s.redacted_toml(), s);
    for i in 0..secret_options.len() {
        assert!(!printed.contains(&format!("kafkasecret{i}x")), "{printed}");
    }
    for p in ["uripass1", "uripass3"] {
        assert!(!printed.contains(p), "{p}: {printed}");
    }
    assert!(printed.contains("replicaSet=rs0"), "{printed}");
}

#[test]
fn a_refused_uri_is_reported_without_its_secrets() {
    // The driver quotes a malformed authMechanismProperties entry, and
    // refuses tlsCertificateKeyFilePassword (a feature not built in).
    for uri in [
        "mongodb://app:uripass1@h/?authMechanismProperties=AWS_SESSION_TOKENuripass2",
        "mongodb://app:uripass1@h/?tlsCertificateKeyFilePassword=uripass2",
    ] {
        let err = Settings::load_from(None, env(&[("TRADEBUCKET__MONGODB__URI", uri)]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("mongodb.uri"), "{err}");
        for p in ["uripass1", "uripass2"] {
            assert!(!err.contains(p), "{p}: {err}");
        }
    }
}

/// `kafka.fetch_wait_max` is librdkafka's range, and a held fetch must end
/// at least a second before the request's own time limit.
#[test]
fn the_fetch_wait_is_bounded_by_the_request_limit() {
    let load = |pairs: &[(&str, &str)]| Settings::load_from(None, env(pairs));
    let wait = "TRADEBUCKET__KAFKA__FETCH_WAIT_MAX";
    let s = load(&[(wait, "10ms")]).unwrap();
    assert_eq!(s.kafka.fetch_wait_max, Duration::from_millis(10));
    for bad in ["0ms", "301s"] {
        let said = load(&[(wait, bad)]).unwrap_err().to_string();
        assert!(said.contains("kafka.fetch_wait_max"), "{bad}: {said}");
    }
    let said = load(&[
        (wait, "29500ms"),
        ("TRADEBUCKET__TIMEOUTS__KAFKA_REQUEST", "30s"),
    ])
    .unwrap_err()
    .to_string();
    assert!(said.contains("timeouts.kafka_request"), "{said}");
}

/// Under the consumer group protocol the broker assigns and heartbeats:
/// the classic protocol's client-side properties are refused at start-up,
/// naming the reason; under the classic protocol they pass.
#[test]
fn classic_only_options_are_refused_under_the_consumer_protocol() {
    for option in CLASSIC_ONLY_OPTIONS {
        let var = format!(
            "TRADEBUCKET__KAFKA__OPTIONS__{}",
            option.replace('.', "_").to_uppercase()
        );
        let consumer = [
            ("TRADEBUCKET__KAFKA__GROUP_PROTOCOL", "consumer"),
            (&var, "x"),
        ];
        let said = Settings::load_from(None, env(&consumer))
            .unwrap_err()
            .to_string();
        assert!(
            said.contains(option) && said.contains("classic group protocol"),
            "{var}: {said}"
        );
        assert!(
            Settings::load_from(None, env(&[(&var, "x")])).is_ok(),
            "{var}"
        );
    }
}
