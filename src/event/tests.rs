use super::*;
use chrono::{DateTime, FixedOffset};
use proptest::prelude::*;

mod differential;
mod oracle;

fn src() -> Source {
    Source {
        topic: "trades".into(),
        partition: 3,
        offset: 42,
    }
}

fn ok(json: &str) -> Trade {
    decode(Some(json.as_bytes()), &src(), 65536).unwrap_or_else(|e| panic!("{json}: {e}"))
}

/// The Decimal128 at `field`, as text.
fn dec(t: &Trade, field: &str) -> String {
    match t.entry().unwrap().get(field) {
        Some(Bson::Decimal128(d)) => d.to_string(),
        other => panic!("{field} is not a Decimal128: {other:?}"),
    }
}

fn rejected(json: &str) -> Reject {
    match decode(Some(json.as_bytes()), &src(), 65536) {
        Ok(t) => panic!("accepted {json}: {t:?}"),
        Err(e) => e,
    }
}

/// A valid event with one field replaced (or removed when `value` is None).
fn with(field: &str, value: Option<&str>) -> String {
    let mut fields = vec![
        ("tradeId", r#""T-1""#),
        ("customerId", "123"),
        ("type", r#""buy""#),
        ("ticker", r#""MDB""#),
        ("qty", "419"),
        ("price", r#""61.25""#),
        ("currency", r#""USD""#),
        ("date", r#""2023-10-26T15:47:03.434Z""#),
    ];
    fields.retain(|(k, _)| *k != field);
    if let Some(v) = value {
        fields.push((field, v));
    }
    let body: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    format!("{{{}}}", body.join(","))
}

#[test]
fn the_issue_example_decodes_exactly() {
    let t = ok(
        r#"{"tradeId":"T-9001","customerId":123,"type":"buy","ticker":"MDB","qty":419,"price":"61.25","currency":"USD","date":"2023-10-26T15:47:03.434Z"}"#,
    );
    assert_eq!(t.key, "t:T-9001");
    assert_eq!(t.customer, CustomerId::Int(123));
    assert_eq!(t.epoch_seconds(), 1_698_335_223);
    assert_eq!(t.entry().unwrap().get_i64("qty").unwrap(), 419);
    assert_eq!(dec(&t, "price"), "61.25");
    assert_eq!(t.entry().unwrap().get_str("type").unwrap(), "buy");
    assert_eq!(
        t.entry()
            .unwrap()
            .get_datetime("date")
            .unwrap()
            .timestamp_millis(),
        1_698_335_223_434
    );
    assert!(
        t.entry().unwrap().get("offsetMinutes").is_none(),
        "Z is UTC: no offset stored"
    );
    assert_eq!(t.entry().unwrap().get_str("key").unwrap(), "t:T-9001");
}

#[test]
fn quantity_is_an_alias_of_qty_and_stored_as_qty() {
    let t = ok(&with("qty", None).replace('}', ",\"quantity\":50}"));
    assert_eq!(t.entry().unwrap().get_i64("qty").unwrap(), 50);
    assert!(t.entry().unwrap().get("quantity").is_none());
    let e = rejected(&with("qty", Some("1")).replace('}', ",\"quantity\":2}"));
    assert_eq!(e.kind, RejectKind::DuplicateField);
}

#[test]
fn fractional_qty_and_numeric_price_stay_exact() {
    let t = ok(&with("qty", Some("0.1")).replace(r#""61.25""#, "0.30000000000000004"));
    let qty = dec(&t, "qty");
    assert_eq!(qty, "0.1");
    let price = dec(&t, "price");
    assert_eq!(price, "0.30000000000000004");
    // 34 significant digits are the most Decimal128 holds exactly.
    let t = ok(&with(
        "price",
        Some(r#""1234567890123456789012345678.901234""#),
    ));
    assert_eq!(dec(&t, "price"), "1234567890123456789012345678.901234");
}

#[test]
fn string_customer_ids_keep_their_type() {
    let t = ok(&with("customerId", Some(r#""acme-42""#)));
    assert_eq!(t.customer, CustomerId::Str("acme-42".into()));
    assert_eq!(t.customer.to_bson(), Bson::String("acme-42".into()));
}

#[test]
fn a_non_utc_offset_is_kept_in_minutes_east_of_utc() {
    let t = ok(&with("date", Some(r#""2023-10-26T11:47:03.434-04:00""#)));
    assert_eq!(t.date_ms, 1_698_335_223_434, "stored as the UTC instant");
    assert_eq!(t.entry().unwrap().get_i32("offsetMinutes").unwrap(), -240);
    let t = ok(&with("date", Some(r#""2023-10-27T01:17:03+09:30""#)));
    assert_eq!(t.entry().unwrap().get_i32("offsetMinutes").unwrap(), 570);
    let t = ok(&with("date", Some("1698335223434")));
    assert_eq!(t.date_ms, 1_698_335_223_434);
}

#[test]
fn without_trade_id_the_identity_is_the_source_position() {
    let t = ok(&with("tradeId", None));
    assert_eq!(t.key, "o:trades/3/42");
    assert!(t.entry().unwrap().get("tradeId").is_none());
}

#[test]
fn numeric_trade_ids_share_the_identity_of_their_text() {
    let t = ok(&with("tradeId", Some("9001")));
    assert_eq!(t.key, "t:9001");
    assert_eq!(t.entry().unwrap().get_i64("tradeId").unwrap(), 9001);
}

#[test]
fn unknown_fields_are_kept() {
    let t = ok(&with("venue", Some(r#"{"mic":"XNAS","legs":[1,2]}"#)));
    let entry = t.entry().unwrap();
    let venue = entry.get_document("venue").unwrap();
    assert_eq!(venue.get_str("mic").unwrap(), "XNAS");
    assert_eq!(venue.get_array("legs").unwrap().len(), 2);
}

/// The entry is written straight as BSON, field by field: the same fields,
/// in the same order, as the document it used to be encoded from, and
/// bytes that decode and re-encode to themselves.
#[test]
fn the_history_entry_is_encoded_field_by_field_in_a_fixed_order() {
    let t = ok(
        r#"{"note":{"a":[1,"x",null]},"tradeId":7,"customerId":5,"type":"sell",
        "ticker":"MDB","qty":"1.5","price":"2","currency":"EUR",
        "date":"2023-10-26T15:47:03.434+02:00","venue":"XNAS"}"#,
    );
    let entry = t.entry().unwrap();
    let names: Vec<&str> = entry.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "tradeId",
            "type",
            "ticker",
            "qty",
            "price",
            "currency",
            "date",
            "offsetMinutes",
            "note",
            "venue",
            "key"
        ]
    );
    assert_eq!(
        RawDocumentBuf::from_document(&entry).unwrap().as_bytes(),
        t.doc.as_bytes()
    );
    assert_eq!(entry.get_i64("tradeId").unwrap(), 7);
    assert_eq!(entry.get_str("key").unwrap(), "t:7");
}

#[test]
fn optional_price_and_currency_may_be_absent_or_null() {
    let t = ok(&with("price", None));
    assert!(t.entry().unwrap().get("price").is_none());
    let t = ok(&with("currency", Some("null")));
    assert!(t.entry().unwrap().get("currency").is_none());
}

#[test]
fn payload_level_rejects_have_their_own_kinds() {
    let d = |p: Option<&[u8]>, max| decode(p, &src(), max).unwrap_err().kind;
    assert_eq!(d(None, 100), RejectKind::Empty);
    assert_eq!(d(Some(b""), 100), RejectKind::Empty);
    assert_eq!(d(Some(&[b'{', 0xff, 0xfe, b'}']), 100), RejectKind::NotUtf8);
    assert_eq!(d(Some(b"not json"), 100), RejectKind::NotJson);
    assert_eq!(d(Some(b"{\"customerId\":1"), 100), RejectKind::NotJson);
    assert_eq!(d(Some(b"{} trailing"), 100), RejectKind::NotJson);
    assert_eq!(d(Some(b"[1,2]"), 100), RejectKind::NotObject);
    assert_eq!(d(Some(b"\"text\""), 100), RejectKind::NotObject);
    assert_eq!(d(Some(b"null"), 100), RejectKind::NotObject);
    let big = with("note", Some(&format!("\"{}\"", "x".repeat(200))));
    assert_eq!(d(Some(big.as_bytes()), 100), RejectKind::Oversize);
    let dup = r#"{"customerId":1,"customerId":2,"type":"buy","ticker":"A","qty":1,"date":0}"#;
    assert_eq!(d(Some(dup.as_bytes()), 1000), RejectKind::DuplicateField);
}

/// BSON can be several times the JSON: an array of zeros is 2 bytes an
/// element in JSON and up to 12 in BSON (type, index digits, NUL, int32).
/// A trade under `max_message_bytes` but over `MAX_ENTRY_BYTES` as stored
/// is refused at decode, naming its BSON size; one just under is stored.
#[test]
fn a_trade_too_large_as_bson_for_any_bucket_is_oversize() {
    let array = |n: usize| with("legs", Some(&format!("[{}0]", "0,".repeat(n - 1))));
    let small = array(300_000);
    let trade = decode(Some(small.as_bytes()), &src(), 16 << 20).unwrap();
    let bson = trade.doc.as_bytes().len();
    assert!(
        bson > 5 * small.len(),
        "{bson} bytes of BSON from {}",
        small.len()
    );

    let big = array(800_000);
    assert!(big.len() < 2 << 20, "{} bytes of JSON", big.len());
    let e = decode(Some(big.as_bytes()), &src(), 16 << 20).unwrap_err();
    assert_eq!(e.kind, RejectKind::Oversize);
    assert!(e.message.contains("bytes of BSON"), "{e}");
}

#[test]
fn every_required_field_is_named_when_missing() {
    for field in ["customerId", "type", "ticker", "qty", "date"] {
        let e = rejected(&with(field, None));
        assert_eq!(e.kind, RejectKind::MissingField, "{field}");
        assert!(e.message.contains(field), "{field}: {e}");
    }
}

#[test]
fn invalid_field_values_are_rejected_with_the_field_named() {
    let cases: &[(&str, &str)] = &[
        ("customerId", "-1"),
        ("customerId", "1.5"),
        ("customerId", "1e3"),
        ("customerId", "true"),
        ("customerId", "null"),
        ("customerId", "9223372036854775808"),
        ("customerId", r#""12_3""#),
        ("customerId", r#""""#),
        ("customerId", r#""a b""#),
        ("customerId", &format!("\"{}\"", "a".repeat(65))),
        ("type", r#""BUY""#),
        ("type", r#""hold""#),
        ("type", "1"),
        ("ticker", r#""mdb""#),
        ("ticker", r#""""#),
        ("ticker", r#""ABCDEFGHIJKLMNOPQ""#),
        ("ticker", r#""M DB""#),
        ("ticker", "7"),
        ("qty", "0"),
        ("qty", "-5"),
        ("qty", "0.000"),
        ("qty", r#""abc""#),
        ("qty", "null"),
        ("qty", "99999999999999999999"),
        ("price", r#""NaN""#),
        ("price", r#""Infinity""#),
        ("price", r#""-Infinity""#),
        ("price", r#""1234567890123456789012345678901234567890""#),
        ("price", "1234567890123456789012345678901234567891"),
        ("price", r#""-1.50""#),
        ("price", r#""1,50""#),
        ("price", r#"" 1.5""#),
        ("price", r#""0x10""#),
        ("price", r#"".5""#),
        ("price", r#""1e99999""#),
        ("price", "true"),
        ("currency", r#""usd""#),
        ("currency", r#""US""#),
        ("currency", r#""EURO""#),
        ("date", r#""2023-02-30T10:00:00Z""#),
        ("date", r#""2023-10-26T15:47:03""#),
        ("date", r#""yesterday""#),
        ("date", r#""1969-12-31T23:59:59Z""#),
        ("date", r#""2300-01-01T00:00:00Z""#),
        ("date", "-1"),
        ("date", "1698335223434.5"),
        ("date", "true"),
        ("tradeId", r#""""#),
        ("tradeId", "-3"),
        ("tradeId", "1.5"),
        ("tradeId", r#""a\u0000b""#),
        ("key", r#""sneaky""#),
        ("offsetMinutes", "5"),
        ("$where", "1"),
        ("nested", r#"{"$set":1}"#),
        ("nested", r#"{"a.b":1}"#),
    ];
    for (field, value) in cases {
        let json = with(field, Some(value));
        let e = rejected(&json);
        assert_eq!(e.kind, RejectKind::InvalidField, "{json}: {e}");
        let named = field.trim_start_matches('$');
        assert!(
            e.message.contains(named),
            "{json}: message {e} does not name {field}"
        );
    }
}

#[test]
fn zero_price_and_negative_zero_are_allowed() {
    assert!(ok(&with("price", Some("0")))
        .entry()
        .unwrap()
        .get("price")
        .is_some());
    assert!(ok(&with("price", Some(r#""-0.00""#)))
        .entry()
        .unwrap()
        .get("price")
        .is_some());
}

#[test]
fn cli_customer_ids_parse_like_the_json_ones() {
    assert_eq!(CustomerId::parse_cli("123").unwrap(), CustomerId::Int(123));
    assert_eq!(
        CustomerId::parse_cli("0123").unwrap(),
        CustomerId::Str("0123".into())
    );
    assert_eq!(
        CustomerId::parse_cli("ab-1").unwrap(),
        CustomerId::Str("ab-1".into())
    );
    assert!(CustomerId::parse_cli("a_b").is_err());
    // "-0" is not how 0 prints, so it is text, with its own prefix.
    assert_eq!(
        CustomerId::parse_cli("-0").unwrap(),
        CustomerId::Str("-0".into())
    );
}

#[test]
fn the_canonical_customer_id_is_one_value_per_id_prefix() {
    let int = |i| CustomerId::Int(i);
    let text = |s: &str| CustomerId::Str(s.into());
    assert_eq!(text("123").canonical(), int(123));
    assert_eq!(text("0").canonical(), int(0));
    assert_eq!(int(123).canonical(), int(123));
    assert_eq!(text("9223372036854775807").canonical(), int(i64::MAX));
    for kept in ["0123", "9223372036854775808", "-1", "+1", "12a", "C-7"] {
        assert_eq!(text(kept).canonical(), text(kept), "{kept}");
    }
    // Same prefix before and after.
    for c in [text("123"), text("0123"), int(5)] {
        assert_eq!(c.canonical().id_text(), c.id_text());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Whatever bytes arrive, decoding returns a value or a reject: never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(Some(&bytes), &src(), 400);
    }

    /// Mutated valid events (the shape fuzzers find bugs in) never panic either.
    #[test]
    fn mutated_events_never_panic(cut in 0usize..200, byte in any::<u8>()) {
        let mut v = with("venue", Some(r#"{"x":[1,"2",null]}"#)).into_bytes();
        let i = cut % v.len();
        v[i] = byte;
        let _ = decode(Some(&v), &src(), 65536);
    }

    /// The watermark key's length, counted without building the key, is
    /// its length ('.' becomes '~'; size charges rest on it).
    #[test]
    fn partition_key_len_is_the_keys_length(topic in "[a-zA-Z0-9._-]{1,40}", partition in any::<i32>()) {
        let source = Source { topic: topic.into(), partition, offset: 0 };
        let key = source.partition_key();
        prop_assert_eq!(source.partition_key_len(), key.len());
        prop_assert_eq!(key, format!("{}:{}", source.topic.replace('.', "~"), partition));
    }

    /// `is_partition_key` says yes to a source's own key and to nothing
    /// else: another partition, another topic, or another spelling of the
    /// same number ("+3", "03").
    #[test]
    fn a_partition_key_is_recognised_without_building_it(
        topic in "[a-z.]{1,8}",
        other in "[a-z.~]{1,8}",
        partition in -3i32..300,
        delta in 1i32..5,
        junk in "[a-z.~:0-9+-]{1,12}",
        at in any::<prop::sample::Index>(),
        ch in "[a-z.~:0-9+-]",
    ) {
        let source = Source { topic: topic.as_str().into(), partition, offset: 0 };
        prop_assert!(source.is_partition_key(&source.partition_key()));
        let moved = Source { partition: partition + delta, ..source.clone() };
        prop_assert!(!source.is_partition_key(&moved.partition_key()));
        let elsewhere = Source { topic: other.into(), ..source.clone() };
        prop_assert_eq!(
            source.is_partition_key(&elsewhere.partition_key()),
            elsewhere.partition_key() == source.partition_key()
        );
        let key = source.partition_key();
        let (name, number) = key.rsplit_once(':').expect("a colon");
        for spelling in [format!("{name}:+{number}"), format!("{name}:0{number}")] {
            prop_assert!(!source.is_partition_key(&spelling), "{}", spelling);
        }
        // Any other text, of any length: only the key itself is it.
        prop_assert_eq!(source.is_partition_key(&junk), junk == key, "{}", junk);
        // One character changed, so the length matches (the key is ASCII).
        let i = at.index(key.len());
        let changed = format!("{}{ch}{}", &key[..i], &key[i + 1..]);
        prop_assert_eq!(source.is_partition_key(&changed), changed == key, "{}", changed);
    }

    /// Any decimal with at most 34 significant digits survives exactly.
    #[test]
    fn prices_round_trip_exactly(int in "[1-9][0-9]{0,20}", frac in "[0-9]{1,13}") {
        let text = format!("{int}.{frac}");
        let t = ok(&with("price", Some(&format!("\"{text}\""))));
        let stored = dec(&t, "price");
        prop_assert_eq!(stored, text);
    }

    /// Dates survive as the same instant, with the offset kept.
    #[test]
    fn dates_keep_instant_and_offset(secs in 0i64..4_000_000_000, ms in 0i64..1000, off_min in -720i32..=840) {
        let utc = DateTime::from_timestamp(secs, (ms * 1_000_000) as u32).unwrap();
        let offset = FixedOffset::east_opt(off_min * 60).unwrap();
        let text = utc.with_timezone(&offset).to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let t = ok(&with("date", Some(&format!("\"{text}\""))));
        prop_assert_eq!(t.date_ms, secs * 1000 + ms);
        let stored = t.entry().unwrap().get_i32("offsetMinutes").ok();
        prop_assert_eq!(stored, (off_min != 0).then_some(off_min));
    }
}

/// `{"a":{"a":...{"a":1}}}` with `levels` objects, or arrays when `arrays`.
fn nested(levels: usize, arrays: bool) -> String {
    let (open, close) = if arrays { ("[", "]") } else { ("{\"a\":", "}") };
    format!("{}1{}", open.repeat(levels), close.repeat(levels))
}

#[test]
fn extras_nest_only_as_deep_as_a_bucket_can_store() {
    use crate::event::decode::MAX_EXTRA_NESTING;
    for arrays in [false, true] {
        let fits = ok(&with("note", Some(&nested(MAX_EXTRA_NESTING, arrays))));
        // Bucket, history, entry, then the value's own levels: 100.
        assert!(fits.entry().unwrap().contains_key("note"));
        let e = rejected(&with("note", Some(&nested(MAX_EXTRA_NESTING + 1, arrays))));
        assert_eq!(e.kind, RejectKind::InvalidField, "{e}");
        assert!(
            e.message.contains("note") && e.message.contains("deeper"),
            "{e}"
        );
    }
}

/// One customer, one identity, in every mode: `7` and `"7"` decode to the
/// same id (and so one key of the writer's batch), while text that is not
/// an integer written plainly keeps its own prefix.
#[test]
fn a_customer_id_of_digits_sent_as_text_decodes_as_the_number() {
    let customer = |id: &str| {
        let json = format!(
            r#"{{"customerId":{id},"type":"buy","ticker":"MDB","qty":1,"date":"2023-10-26T15:47:03.434Z"}}"#
        );
        ok(&json).customer
    };
    assert_eq!(customer("7"), CustomerId::Int(7));
    assert_eq!(customer(r#""7""#), CustomerId::Int(7));
    assert_eq!(customer(r#""0""#), CustomerId::Int(0));
    assert_eq!(customer(r#""07""#), CustomerId::Str("07".into()));
    assert_eq!(customer(r#""C-7""#), CustomerId::Str("C-7".into()));
    // Past Int64: text, as before.
    let huge = r#""92233720368547758070""#;
    assert_eq!(
        customer(huge),
        CustomerId::Str("92233720368547758070".into())
    );
}

/// The entry's buffer is allocated at its size: no growth while it is
/// written, and no slack kept in every batch's memory.
#[test]
fn the_history_entry_is_allocated_at_its_size() {
    let trades = [
        with("venue", None),
        with("tradeId", None),
        with("tradeId", Some("9001")),
        with("price", None).replace(r#""USD""#, "null"),
        with("qty", Some(r#""1.5""#)),
        with("date", Some(r#""2023-10-26T11:47:03.434-04:00""#)),
        with("ticker", Some(r#""BRK.B""#)),
    ];
    for json in trades {
        let bytes = ok(&json).doc.into_bytes();
        assert_eq!(bytes.capacity(), bytes.len(), "{json}");
    }
}
