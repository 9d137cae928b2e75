//! The differential test of the default-schema decoder: generated payloads
//! (valid trades in any field order, optional fields left out, strings with
//! and without escapes, numbers in every spelling, duplicate names plain
//! and escaped, extras with nested and bad names, wrong types, garbage)
//! decoded by [`decode_as`] and by the pre-optimisation decoder kept in
//! `oracle`: the outcomes must be identical, the entry's bytes and every
//! reject's kind and message included.

use proptest::prelude::*;
use proptest::strategy::BoxedStrategy;

use super::oracle;
use crate::event::{decode_as, Identity, Reject, Source, Trade};

/// `s` as a JSON string literal: `escape` 0 writes it plainly, 1 escapes
/// its first character as `\uXXXX`, 2 every character, 3 uses the short
/// escapes (`\/`, `\t`) serde_json never writes.
fn lit(s: &str, escape: u8) -> String {
    let u = |c: char| {
        let mut units = [0u16; 2];
        c.encode_utf16(&mut units)
            .iter()
            .map(|n| format!("\\u{n:04x}"))
            .collect::<String>()
    };
    let plain = |c: char| {
        let t = serde_json::to_string(&c.to_string()).unwrap_or_default();
        t[1..t.len() - 1].to_string()
    };
    let body: String = match escape {
        1 => s
            .chars()
            .enumerate()
            .map(|(i, c)| if i == 0 { u(c) } else { plain(c) })
            .collect(),
        2 => s.chars().map(u).collect(),
        3 => s
            .chars()
            .map(|c| match c {
                '/' => "\\/".to_string(),
                '\t' => "\\t".to_string(),
                c => plain(c),
            })
            .collect(),
        _ => s.chars().map(plain).collect(),
    };
    format!("\"{body}\"")
}

fn escaped(content: impl Strategy<Value = String>) -> impl Strategy<Value = String> {
    (
        content,
        prop_oneof![6 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)],
    )
        .prop_map(|(s, e)| lit(&s, e))
}

fn one_of(items: &'static [&'static str]) -> impl Strategy<Value = String> {
    proptest::sample::select(items).prop_map(str::to_string)
}

/// JSON values of the types no trade field has, and some it has.
fn other_value() -> BoxedStrategy<String> {
    prop_oneof![
        one_of(&[
            "true",
            "false",
            "null",
            "{}",
            "[]",
            "[1,2]",
            r#"{"a":1}"#,
            "[\"x\"]"
        ]),
        number(),
        escaped("[a-z0-9]{0,6}".prop_map(String::from)),
    ]
    .boxed()
}

/// Number spellings: valid JSON numbers of every form (sign, leading and
/// trailing zeros, exponents, beyond 34 digits, beyond i64 and u64,
/// beyond f64), and edge cases.
fn number() -> BoxedStrategy<String> {
    prop_oneof![
        4 => "-?(0|[1-9][0-9]{0,20})",
        4 => "-?(0|[1-9][0-9]{0,38})(\\.[0-9]{1,38})?([eE][+-]?[0-9]{1,5})?",
        1 => "[1-9][0-9]{300,320}",
        2 => one_of(&[
            "0", "-0", "-0.0", "0.000", "-0.00", "1e3", "1E+3", "0e0", "0e-7000", "1e6111",
            "1e6112", "1E-6176", "1e-6177", "1e40000", "0e99999", "1e99999",
            "9223372036854775807", "9223372036854775808", "-9223372036854775808",
            "-9223372036854775809", "18446744073709551615", "18446744073709551616",
            "99999999999999999999", "1234567890123456789012345678901234",
            "12345678901234567890123456789012340", "12345678901234567890123456789012345",
            "0.0000000000000000000000000000000000000001", "1698335223434", "9999999999999",
            "10000000000000", "1698335223434.5",
        ]),
    ]
    .boxed()
}

/// Decimal texts as strings may be anything: also what no JSON number is.
fn decimal_string() -> BoxedStrategy<String> {
    prop_oneof![
        4 => number(),
        1 => one_of(&[
            "NaN", "Infinity", "-Infinity", "inf", "1,50", " 1.5", "0x10", ".5", "1.", "+1",
            "00", "0001.5", "-", "", "1e", "1e+", "abc", "1.5 ", "١",
        ]),
    ]
    .prop_flat_map(|s| escaped(Just(s)))
    .boxed()
}

fn decimal_value() -> BoxedStrategy<String> {
    let plain = "[1-9][0-9]{0,8}(\\.[0-9]{1,6})?";
    prop_oneof![
        24 => plain,
        24 => escaped(plain),
        3 => number(),
        3 => decimal_string(),
        1 => Just("null".to_string()),
        1 => other_value(),
    ]
    .boxed()
}

fn trade_id() -> BoxedStrategy<String> {
    prop_oneof![
        30 => escaped("[A-Za-z0-9 _./-]{1,20}"),
        15 => "(0|[1-9][0-9]{0,17})",
        2 => escaped(prop_oneof![
            "[A-Za-z0-9 _./-]{0,20}".prop_map(String::from),
            Just(String::new()),
            Just("a".repeat(128)),
            Just("a".repeat(129)),
            Just("é".repeat(128)),
            Just("é".repeat(129)),
            Just("a\u{0}b".to_string()),
            Just("tab\there".to_string()),
            Just("\u{7f}".to_string()),
            Just("\u{1F600}x".to_string()),
            Just("\u{85}".to_string()),
        ]),
        1 => number(),
        1 => other_value(),
    ]
    .boxed()
}

fn customer() -> BoxedStrategy<String> {
    prop_oneof![
        25 => "(0|[1-9][0-9]{0,17})",
        25 => escaped("[A-Za-z0-9-]{1,12}"),
        2 => number(),
        2 => escaped(prop_oneof![
            "[A-Za-z0-9-]{1,12}".prop_map(String::from),
            "(0|[1-9][0-9]{0,20})".prop_map(String::from),
            Just("007".to_string()),
            Just(String::new()),
            Just("a_b".to_string()),
            Just("a b".to_string()),
            Just("-1".to_string()),
            Just("+1".to_string()),
            Just("c".repeat(64)),
            Just("c".repeat(65)),
            Just("é".to_string()),
        ]),
        1 => other_value(),
    ]
    .boxed()
}

fn side() -> BoxedStrategy<String> {
    prop_oneof![
        40 => escaped(one_of(&["buy", "sell"])),
        2 => escaped(one_of(&["buy", "sell", "BUY", "hold", "", "buy "])),
        1 => other_value(),
    ]
    .boxed()
}

fn ticker() -> BoxedStrategy<String> {
    prop_oneof![
        40 => escaped("[A-Z0-9.-]{1,16}"),
        2 => escaped("[A-Z0-9.-]{0,18}".prop_map(String::from)),
        1 => escaped("[a-zA-Z é]{0,5}".prop_map(String::from)),
        1 => other_value(),
    ]
    .boxed()
}

fn currency() -> BoxedStrategy<String> {
    prop_oneof![
        40 => escaped("[A-Z]{3}"),
        2 => escaped(one_of(&["USD", "EUR", "usd", "US", "EURO", "U$D", "ÉUR"])),
        1 => Just("null".to_string()),
        1 => other_value(),
    ]
    .boxed()
}

fn date() -> BoxedStrategy<String> {
    let rfc = (-10i64..10_100_000_000, 0u32..1000, -1000i32..1000, 0u8..4).prop_map(
        |(secs, ms, off, form)| {
            let utc = chrono::DateTime::from_timestamp(secs, ms * 1_000_000)
                .unwrap_or(chrono::DateTime::UNIX_EPOCH);
            let offset = chrono::FixedOffset::east_opt(off * 60 + i32::from(form == 3) * 7)
                .unwrap_or(chrono::FixedOffset::east_opt(0).unwrap());
            let dt = utc.with_timezone(&offset);
            let secs_form = match form {
                0 => chrono::SecondsFormat::Millis,
                1 => chrono::SecondsFormat::Secs,
                _ => chrono::SecondsFormat::Nanos,
            };
            dt.to_rfc3339_opts(secs_form, form == 0)
        },
    );
    prop_oneof![
        30 => escaped(rfc),
        10 => (0i64..10_000_000_000_000).prop_map(|ms| ms.to_string()),
        1 => escaped(one_of(&[
            "2023-10-26T15:47:03.434Z", "2023-02-30T10:00:00Z", "2023-10-26T15:47:03",
            "yesterday", "2023-10-26t15:47:03z", "2023-10-26 15:47:03Z", "",
        ])),
        1 => number(),
        1 => other_value(),
    ]
    .boxed()
}

/// A JSON value for an extra field: nested objects and arrays whose names
/// may be ones MongoDB cannot store.
fn extra_value() -> BoxedStrategy<String> {
    let name = escaped(prop_oneof![
        8 => one_of(&["a", "b", "mic", "ü"]),
        1 => one_of(&["$set", "a.b", "", "x\u{0}y"]),
    ])
    .boxed();
    let leaf = prop_oneof![
        number(),
        other_value(),
        escaped("[ -~]{0,8}".prop_map(String::from))
    ];
    let tree = leaf.prop_recursive(4, 24, 4, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4)
                .prop_map(|v| format!("[{}]", v.join(","))),
            proptest::collection::vec((name.clone(), inner), 0..4).prop_map(|v| {
                let members: Vec<String> = v.iter().map(|(k, v)| format!("{k}:{v}")).collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    });
    let deep = (94usize..100, any::<bool>()).prop_map(|(levels, arrays)| {
        let (open, close) = if arrays { ("[", "]") } else { ("{\"a\":", "}") };
        format!("{}1{}", open.repeat(levels), close.repeat(levels))
    });
    prop_oneof![10 => tree, 1 => deep].boxed()
}

fn extra_name() -> BoxedStrategy<String> {
    escaped(prop_oneof![
        8 => "[a-z]{1,8}".prop_map(String::from),
        1 => one_of(&["$x", "a.b", "", "key", "offsetMinutes", "a\u{0}b", "ü", "Type", "quantity"]),
    ])
    .boxed()
}

/// The fields of a payload: (name as a JSON literal, value as JSON text).
fn fields() -> impl Strategy<Value = Vec<(String, String)>> {
    let named = |name: &'static str, value: BoxedStrategy<String>, present: f64| {
        proptest::option::weighted(present, (escaped(Just(name.to_string())), value))
    };
    (
        (
            named("tradeId", trade_id(), 0.8),
            named("customerId", customer(), 0.95),
            named("type", side(), 0.95),
            named("ticker", ticker(), 0.95),
        ),
        (
            prop_oneof![Just("qty"), Just("quantity")]
                .prop_flat_map(move |n| named(n, decimal_value(), 0.95)),
            named("price", decimal_value(), 0.8),
            named("currency", currency(), 0.8),
            named("date", date(), 0.95),
        ),
        prop_oneof![
            2 => Just(Vec::new()),
            1 => proptest::collection::vec((extra_name(), extra_value()), 1..3),
        ],
    )
        .prop_map(|((a, b, c, d), (e, f, g, h), extras)| {
            let mut v: Vec<_> = [a, b, c, d, e, f, g, h].into_iter().flatten().collect();
            v.extend(extras);
            v
        })
        .prop_shuffle()
}

/// A duplicate of one of the fields (its name written plainly or with
/// escapes, with its value or another), or the other name of qty.
fn with_duplicate(fields: Vec<(String, String)>) -> impl Strategy<Value = Vec<(String, String)>> {
    let n = fields.len();
    (
        Just(fields),
        0..n.max(1),
        0..=n,
        0u8..4,
        prop_oneof![
            Just(None),
            number().prop_map(Some),
            Just(Some("\"x\"".to_string()))
        ],
    )
        .prop_map(|(mut fields, from, at, escape, value)| {
            if let Some((name, old)) = fields.get(from).cloned() {
                let plain: String = serde_json::from_str(&name).unwrap_or_default();
                let twin = match plain.as_str() {
                    "qty" if escape == 3 => "quantity".to_string(),
                    _ => plain,
                };
                fields.insert(
                    at.min(fields.len()),
                    (lit(&twin, escape), value.unwrap_or(old)),
                );
            }
            fields
        })
}

/// `fields()`, with a duplicate added to one payload in `1 + as_is`.
fn fields_maybe_duplicated(as_is: u32) -> impl Strategy<Value = Vec<(String, String)>> {
    fields().prop_flat_map(move |f| prop_oneof![as_is => Just(f.clone()), 1 => with_duplicate(f)])
}

/// `fields` with every top-level string (names and values) written as
/// serializers write them, escaping only what JSON requires: the payloads
/// upstreams send, which the one-pass reader (`event::flat`) takes.
/// Numbers, literals and nested values keep their spelling.
fn plain(fields: Vec<(String, String)>) -> Vec<(String, String)> {
    let plain_text = |text: String| match serde_json::from_str::<String>(&text) {
        Ok(s) => serde_json::to_string(&s).unwrap_or(text),
        Err(_) => text,
    };
    fields
        .into_iter()
        .map(|(name, value)| (plain_text(name), plain_text(value)))
        .collect()
}

/// The fields written as one object, with whitespace in the places JSON
/// allows it.
fn object_text(fields: &[(String, String)], spacing: u8) -> String {
    let (colon, comma, edge) = match spacing {
        0 => (":", ",", ""),
        1 => (" : ", " ,\n", " "),
        _ => (":\t", ",\r\n ", "\n"),
    };
    let members: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{k}{colon}{v}"))
        .collect();
    format!("{edge}{{{edge}{}{edge}}}{edge}", members.join(comma))
}

/// Damage done to a payload after it is written.
#[derive(Debug, Clone)]
enum Damage {
    None,
    Append(&'static str),
    Cut(usize),
    Byte(usize, u8),
    WrapInArray,
    Replace(&'static str),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        20 => Just(Damage::None),
        1 => proptest::sample::select(&[" x", "}", "{}", "  \n", ",", "\u{0}"][..]).prop_map(Damage::Append),
        1 => any::<usize>().prop_map(Damage::Cut),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Damage::Byte(i, b)),
        1 => Just(Damage::WrapInArray),
        1 => proptest::sample::select(&["\"text\"", "null", "123", "[]", "", " ", "{", "{}"][..])
            .prop_map(Damage::Replace),
    ]
}

fn damaged(text: String, damage: &Damage) -> Vec<u8> {
    let mut bytes = text.into_bytes();
    match *damage {
        Damage::None => {}
        Damage::Append(s) => bytes.extend_from_slice(s.as_bytes()),
        Damage::Cut(i) => bytes.truncate(i % (bytes.len() + 1)),
        Damage::Byte(i, b) => {
            let len = bytes.len();
            if let Some(x) = bytes.get_mut(i % len.max(1)) {
                *x = b;
            }
        }
        Damage::WrapInArray => {
            bytes.insert(0, b'[');
            bytes.push(b']');
        }
        Damage::Replace(s) => bytes = s.as_bytes().to_vec(),
    }
    bytes
}

fn source() -> impl Strategy<Value = (Source, bool)> {
    ("[a-z.]{1,10}", any::<i32>(), any::<i64>(), any::<bool>()).prop_map(
        |(topic, partition, offset, replay)| {
            (
                Source {
                    topic: topic.into(),
                    partition,
                    offset,
                },
                replay,
            )
        },
    )
}

/// Both decoders' outcomes, which must be equal, the entry's bytes too.
fn same_outcome(
    payload: Option<&[u8]>,
    identity: Identity<'_>,
    max: usize,
) -> Result<(), TestCaseError> {
    let new: Result<Trade, Reject> = decode_as(payload, identity, max);
    let old: Result<Trade, Reject> = oracle::decode_as(payload, identity, max);
    if let (Ok(n), Ok(o)) = (&new, &old) {
        prop_assert_eq!(n.doc.as_bytes(), o.doc.as_bytes());
    }
    prop_assert_eq!(new, old);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// The optimised decoder and the pre-optimisation one agree on every
    /// generated payload: the same trade (entry bytes included) or the
    /// same reject (kind and message).
    #[test]
    fn decode_matches_the_pre_optimisation_decoder(
        fields in fields_maybe_duplicated(4),
        spacing in 0u8..3,
        damage in damage(),
        (source, replay) in source(),
        max in prop_oneof![8 => Just(65536usize), 1 => 0usize..300],
    ) {
        let text = object_text(&fields, spacing);
        let payload = damaged(text, &damage);
        let identity = if replay { Identity::ReplayOf(&source) } else { Identity::Read(&source) };
        same_outcome(Some(&payload), identity, max)?;
    }

    /// The same on payloads as serializers write them (strings escaped
    /// only where JSON requires), most of which the one-pass reader takes.
    #[test]
    fn plain_payloads_decode_as_before(
        fields in fields_maybe_duplicated(6).prop_map(plain),
        spacing in 0u8..3,
        (source, replay) in source(),
    ) {
        let payload = object_text(&fields, spacing);
        let identity = if replay { Identity::ReplayOf(&source) } else { Identity::Read(&source) };
        same_outcome(Some(payload.as_bytes()), identity, 65536)?;
    }

    /// Any bytes at all (mostly not JSON): the same outcome too.
    #[test]
    fn arbitrary_bytes_decode_as_before(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        let source = Source { topic: "t".into(), partition: 0, offset: 1 };
        same_outcome(Some(&bytes), Identity::Read(&source), 65536)?;
    }
}

#[test]
fn no_payload_decodes_as_before() {
    let source = Source {
        topic: "t".into(),
        partition: 0,
        offset: 1,
    };
    let identity = Identity::Read(&source);
    assert_eq!(
        decode_as(None, identity, 10),
        oracle::decode_as(None, identity, 10)
    );
}

/// Large objects (past the linear duplicate check) decode as before, with
/// and without a duplicate far apart.
#[test]
fn large_objects_decode_as_before() {
    let source = Source {
        topic: "t".into(),
        partition: 0,
        offset: 1,
    };
    let base = r#""customerId":1,"type":"buy","ticker":"A","qty":1,"date":0"#;
    for n in [0usize, 5, 10, 11, 12, 20, 300] {
        for dup in [None, Some(0), Some(n / 2), Some(n.saturating_sub(1))] {
            let mut members: Vec<String> = (0..n).map(|i| format!("\"f{i}\":{i}")).collect();
            if let Some(d) = dup.filter(|_| n > 0) {
                members.push(format!("\"f{d}\":true"));
            }
            let text = format!("{{{base},{}}}", members.join(","));
            let text = text.replace(",}", "}");
            let new = decode_as(Some(text.as_bytes()), Identity::Read(&source), 1 << 20);
            let old = oracle::decode_as(Some(text.as_bytes()), Identity::Read(&source), 1 << 20);
            assert_eq!(new, old, "{n} {dup:?}");
        }
    }
}

/// The generator reaches what the comparison is for: a good share of
/// accepted trades, and every kind of reject the decoder makes.
#[test]
fn the_payloads_generated_reach_every_outcome() {
    use proptest::strategy::ValueTree;
    use std::collections::BTreeMap;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (fields_maybe_duplicated(4), 0u8..3, damage());
    let source = Source {
        topic: "t".into(),
        partition: 0,
        offset: 1,
    };
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for _ in 0..2000 {
        let (fields, spacing, damage) = strategy.new_tree(&mut runner).unwrap().current();
        let payload = damaged(object_text(&fields, spacing), &damage);
        let outcome = match decode_as(Some(&payload), Identity::Read(&source), 65536) {
            Ok(_) => "accepted".to_string(),
            Err(e) => e.kind.as_str().to_string(),
        };
        *seen.entry(outcome).or_default() += 1;
    }
    eprintln!("{seen:?}");
    assert!(
        seen.get("accepted").copied().unwrap_or(0) >= 200,
        "{seen:?}"
    );
    for kind in [
        "duplicate_field",
        "missing_field",
        "invalid_field",
        "not_json",
        "not_object",
    ] {
        assert!(
            seen.get(kind).copied().unwrap_or(0) >= 10,
            "{kind}: {seen:?}"
        );
    }
}

/// Decimal texts of every shape the decimal parsers meet (as validated
/// JSON numbers, and beyond): sign, leading zeros, fraction lengths up to
/// past the exponent range, 30 to 40 digits, exponents of every size.
fn decimal_text() -> BoxedStrategy<String> {
    prop_oneof![
        4 => "-?[0-9]{1,3}(\\.[0-9]{1,4})?",
        4 => "-?(0|[1-9][0-9]{0,36})(\\.[0-9]{1,38})?([eE][+-]?[0-9]{1,6})?",
        2 => "-?0{0,40}[0-9]{30,40}(\\.0{0,10})?([eE][+-]?[0-9]{1,5})?",
        2 => "-?0\\.0{6100,6200}[1-9]{1,3}",
        1 => "-?[0-9]{1,4}[eE][+-]?(6[01][0-9]{2}|617[0-9]|99999|32767|32768)",
        1 => "[+-]?[0-9.eE+-]{0,12}",
    ]
    .boxed()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    /// The direct Decimal128 encoding is bson's parse of the same text,
    /// byte for byte, and leaves to that parser every text it does not
    /// take (so errors stay bson's, message included).
    #[test]
    fn decimals_encode_as_bson_parses_them(text in decimal_text()) {
        use mongodb::bson::Decimal128;
        let parsed = text.parse::<Decimal128>();
        if let Some(d) = crate::event::values::plain_decimal128(&text) {
            let bson = parsed.ok().map(|p| p.bytes());
            prop_assert_eq!(Some(d.bytes()), bson, "{}", text);
        }
        let new = crate::event::values::exact_decimal(&text, "price");
        let old = oracle::exact_decimal(&text, "price");
        prop_assert_eq!(new.map(|d| d.bytes()), old.map(|d| d.bytes()));
    }
}

/// Where the one-pass reader reads `text`, serde_json's general reader
/// (`pointer::object`) gives the same pairs, names and raw values.
fn flat_reads_as_serde_json(text: &str) -> Result<(), TestCaseError> {
    let Some(flat) = crate::event::flat::members(text) else {
        return Ok(());
    };
    let fast: Vec<(String, String)> = flat
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    let general = crate::event::pointer::object(text).ok().map(|members| {
        members
            .iter()
            .map(|(n, v)| (n.to_string(), v.get().to_string()))
            .collect::<Vec<_>>()
    });
    prop_assert_eq!(Some(fast), general, "{}", text);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Wherever the one-pass reader reads an object, serde_json's general
    /// reader reads the same members (names and raw values, in order), so
    /// the fast path can only ever be a shortcut; `decode_matches_...`
    /// above holds the whole decode to the oracle through either path.
    #[test]
    fn the_flat_reader_reads_what_serde_json_reads(
        fields in fields_maybe_duplicated(4),
        spacing in 0u8..3,
        damage in damage(),
        plainly in any::<bool>(),
    ) {
        let fields = if plainly { plain(fields) } else { fields };
        let payload = damaged(object_text(&fields, spacing), &damage);
        if let Ok(text) = std::str::from_utf8(&payload) {
            flat_reads_as_serde_json(text)?;
        }
    }

    /// Any text at all: the same.
    #[test]
    fn the_flat_reader_agrees_on_arbitrary_text(text in "[ {}\\[\\]\":,a-c0-9.eE+\\-tfrulsn\\\\\t\n]{0,40}") {
        flat_reads_as_serde_json(&text)?;
    }
}

/// The fast path is the common one: the generator's undamaged payloads
/// without escapes or nested extras are read by it, and what it declines
/// (escapes, nesting, duplicates, more than its members) is declined.
#[test]
fn the_flat_reader_takes_plain_trades_and_declines_the_rest() {
    use crate::event::flat::{members, MAX_MEMBERS};
    let plain = r#" {"tradeId":"G1-4", "customerId":1942,"type":"buy","ticker":"GOOG","qty":892,"price":"497.90","currency":null,"date":1700000000012,"ok":true,"no":false,"n":-1.5e3}
"#;
    let read: Vec<(&str, &str)> = members(plain).expect("plain").iter().collect();
    assert_eq!(read.len(), 11);
    assert_eq!(read[0], ("tradeId", "\"G1-4\""));
    assert_eq!(read[6], ("currency", "null"));
    assert_eq!(read[10], ("n", "-1.5e3"));
    assert_eq!(members("{}").map(|m| m.iter().count()), Some(0));
    let many: Vec<String> = (0..=MAX_MEMBERS).map(|i| format!("\"f{i}\":{i}")).collect();
    for declined in [
        r#"{"a":"x\"y"}"#,
        r#"{"a\u0041":1}"#,
        "{\"a\":\"\u{1}\"}",
        r#"{"a":{"b":1}}"#,
        r#"{"a":[1]}"#,
        r#"{"a":1,"a":2}"#,
        r#"{"a":01}"#,
        r#"{"a":1.}"#,
        r#"{"a":+1}"#,
        r#"{"a":nul}"#,
        r#"{"a":truex}"#,
        r#"{"a":1,}"#,
        r#"{"a":1} x"#,
        r#"{"a" 1}"#,
        "\u{feff}{}",
        &format!("{{{}}}", many.join(",")),
    ] {
        assert!(members(declined).is_none(), "{declined}");
    }
}

/// The flat reader's tests are not vacuous: the generator's payloads take
/// both paths, and their plain forms mostly the one-pass reader.
#[test]
fn the_payloads_generated_take_both_paths() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (fields_maybe_duplicated(4), 0u8..3, damage());
    let (mut flat, mut general, mut plain_flat) = (0, 0, 0);
    for _ in 0..2000 {
        let (fields, spacing, damage) = strategy.new_tree(&mut runner).unwrap().current();
        let plain_text = object_text(&plain(fields.clone()), spacing);
        plain_flat += usize::from(crate::event::flat::members(&plain_text).is_some());
        let payload = damaged(object_text(&fields, spacing), &damage);
        let text = std::str::from_utf8(&payload).unwrap_or("");
        match crate::event::flat::members(text) {
            Some(_) => flat += 1,
            None => general += 1,
        }
    }
    // The general payloads mostly decline (escapes everywhere); their
    // plain forms are mostly taken.
    assert!(
        flat >= 20 && general >= 1000,
        "flat {flat}, general {general}"
    );
    assert!(plain_flat >= 1000, "plain payloads read flat: {plain_flat}");
}
