use super::*;
use crate::config::{ConfigError, Settings};

fn settings_with(file_text: &str) -> Result<Settings, ConfigError> {
    let dir = std::env::temp_dir().join(format!(
        "tradebucket-mapping-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.toml");
    std::fs::write(&path, file_text).unwrap();
    let out = Settings::load_from(Some(&path), Some(Default::default()));
    let _ = std::fs::remove_dir_all(&dir);
    out
}

const TWO_TOPICS: &str = r#"
[kafka]
topics = ["trades", "fix-execs", "broker.fills"]

[[mappings]]
topic = "fix-execs"
keep = "none"
fields.customerId = { from = "key" }
fields.tradeId = { from = "header:exec-id" }
fields.type = { from = "/Side", values = { buy = ["1"], sell = ["2", "5"] }, unknown = "reject" }
fields.date = { from = "/TransactTime", format = "fix" }

[[mappings]]
topic = "broker.fills"
keep = { venueMic = "/venue/mic" }
fields.qty = { from = "/fill/qty" }
fields.price = { from = "/fill/px" }
fields.date = { from = "/ts", format = "pattern", pattern = "%Y-%m-%d %H:%M:%S", offset = "+01:00" }
"#;

#[test]
fn mappings_load_from_a_file_and_print_back_as_they_load() {
    let s = settings_with(TWO_TOPICS).unwrap();
    assert_eq!(s.mappings.len(), 2);
    let plans = s.mapping_plans().unwrap();
    assert_eq!(
        plans[0].places[TradeField::CustomerId.index()],
        Some(Place::Key)
    );
    assert_eq!(
        plans[0].places[TradeField::Ticker.index()],
        Some(Place::default_for(TradeField::Ticker)),
        "a field not named is read where the default schema reads it"
    );
    assert_eq!(
        plans[1].keep,
        Some(vec![(
            "venueMic".to_string(),
            vec!["venue".to_string(), "mic".to_string()]
        )])
    );
    // check-config prints what loads again to the same mappings.
    let printed = s.redacted_toml();
    assert!(printed.contains("[[mappings]]"), "{printed}");
    let again = settings_with(&printed).unwrap();
    assert_eq!(again.mapping_plans().unwrap(), plans);
}

#[test]
fn no_mapping_is_the_default_schema_for_every_topic() {
    let s = Settings::load_from(None, Some(Default::default())).unwrap();
    assert!(s.mappings.is_empty());
}

/// Each rule broken, with the field and the words the error must hold.
#[test]
fn every_mapping_error_names_the_topic_the_field_and_the_rule() {
    let cases: &[(&str, &str, &str)] = &[
        ("fields.ticker = { from = \"Symbol\" }", "ticker", "JSON Pointer starting with '/'"),
        ("fields.ticker = { from = \"\" }", "ticker", "the whole payload"),
        ("fields.ticker = { from = \"/legs/-\" }", "ticker", "never exists"),
        ("fields.ticker = { from = \"/a~2b\" }", "ticker", "RFC 6901"),
        ("fields.ticker = { from = \"header:\" }", "ticker", "needs a header name"),
        ("fields.ticker = { from = \"header:tradebucket.replay.of\" }", "ticker", "tradebucket's own"),
        ("fields.type = { from = \"/Side\", values = { buy = [\"1\"] } }", "type", "a rule for values not in it"),
        ("fields.type = { from = \"/Side\", unknown = \"reject\" }", "type", "without `values`"),
        ("fields.type = { from = \"/S\", values = { buy = [\"1\"], sell = [\"1\"] }, unknown = \"reject\" }", "type", "listed twice"),
        ("fields.qty = { from = \"/q\", values = { buy = [\"1\"] }, unknown = \"buy\" }", "qty", "apply to `type` only"),
        ("fields.price = { from = \"/p\", format = \"fix\" }", "price", "apply to `date` only"),
        ("fields.customerId = { from = \"/Account\" }\nfields.tradeId = { from = \"/Account\" }", "tradeId", "two fields from one place"),
        ("fields.customerId = { from = \"key\" }\nfields.tradeId = { from = \"key\" }", "tradeId", "two fields from one place"),
        ("fields.tradeId = { from = \"/qty\" }", "tradeId", "overlaps qty's /qty (qty is not named here"),
        ("fields.customerId = { from = \"/account\" }\nfields.tradeId = { from = \"/account/id\" }", "tradeId", "/account/id overlaps customerId's /account: one field's value"),
        ("fields.date = { from = \"/d\", format = \"pattern\" }", "date", "needs `pattern`"),
        ("fields.date = { from = \"/d\", format = \"pattern\", pattern = \"%Y-%m-%d %H:%M\" }", "date", "has no offset"),
        ("fields.date = { from = \"/d\", format = \"pattern\", pattern = \"%Y %z\" }", "date", "cannot read back"),
        ("fields.date = { from = \"/d\", format = \"pattern\", pattern = \"%Q\", offset = \"Z\" }", "date", "not a valid pattern"),
        ("fields.date = { from = \"/d\", format = \"pattern\", pattern = \"%+\", offset = \"Z\" }", "date", "`offset` would be ignored"),
        ("fields.date = { from = \"/d\", format = \"pattern\", pattern = \"%Y%m%d%H%M%S\", offset = \"+25:00\" }", "date", "must be \"Z\""),
        ("fields.date = { from = \"/d\", format = \"rfc3339\", offset = \"Z\" }", "date", "go with format = \"pattern\""),
        ("keep = { price = \"/p\" }", "keep.price", "trade field's"),
        ("keep = { \"$x\" = \"/p\" }", "keep.$x", "stored name"),
        ("keep = { x = \"p\" }", "keep.x", "JSON Pointer"),
        ("keep = \"some\"", "", "keep must be \"all\", \"none\" or a table"),
    ];
    for (entry, field, words) in cases {
        let text = format!("[kafka]\ntopics = [\"fx\"]\n[[mappings]]\ntopic = \"fx\"\n{entry}\n");
        let e = settings_with(&text).expect_err(entry).to_string();
        assert!(e.contains(words), "{entry}: {e}");
        if field.is_empty() {
            continue; // refused by the file's types, before the rules
        }
        assert!(
            e.starts_with(&format!(
                "invalid setting mappings: mapping of topic \"fx\", {field}: "
            )),
            "{entry}: {e}"
        );
        assert!(e.contains(words), "{entry}: {e}");
    }
}

#[test]
fn a_mapping_must_be_for_a_topic_the_worker_reads_and_only_one() {
    let e = settings_with("[[mappings]]\ntopic = \"other\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"other\", topic: is not in kafka.topics"),
        "{e}"
    );
    let e = settings_with("[[mappings]]\ntopic = \"trades\"\n[[mappings]]\ntopic = \"trades\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("has two mappings"), "{e}");
    let e = settings_with("[[mappings]]\ntopic = \"trades\"\nfields.side = { from = \"/s\" }\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `side`"), "{e}");
}

#[test]
fn pointers_unescape_as_rfc_6901_says() {
    assert_eq!(parse_pointer("/a~1b/c~0d/0").unwrap(), ["a/b", "c~d", "0"]);
    assert_eq!(parse_pointer("/").unwrap(), [""]);
    let place = Place::Pointer(parse_pointer("/a~1b/~0").unwrap());
    assert_eq!(place.to_string(), "/a~1b/~0");
}
