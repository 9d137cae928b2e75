//! Fuzzing the event decoder with a structure-aware generator: objects
//! built from the real field names with values of every shape (huge and
//! exponent numbers, NaN strings, impossible dates, control characters,
//! nested objects with illegal names, duplicate fields), then sometimes
//! byte-mutated. The decoder must never panic, and whatever it accepts must
//! be storable and within the documented rules.
//!
//! `TRADEBUCKET_FUZZ_CASES` sets the number of inputs (default 20,000 in the
//! normal run); the count is printed and written to `<target>/chaos/fuzz.json`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use mongodb::bson::{self, Bson, Document};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};

use tradebucket::event::{decode, CustomerId, RejectKind, Source, Trade, MAX_EPOCH_SECONDS};

use crate::harness::report_dir;

const MAX_BYTES: usize = 4096;

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

/// Raw JSON texts of every shape a field might arrive in.
fn value() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        // Numbers: long, signed, fractional, exponent, leading zeros.
        "-?[0-9]{1,45}",
        "-?[0-9]{1,20}\\.[0-9]{1,25}",
        "-?[0-9]{1,3}(\\.[0-9]{1,3})?[eE][+-]?[0-9]{1,6}",
        Just("-0".to_string()),
        Just("0.000".to_string()),
        Just("1e400".to_string()),
        Just("18446744073709551616".to_string()),
        Just("9223372036854775807".to_string()),
        // Numbers and words as strings.
        "\"-?[0-9]{0,40}(\\.[0-9]{0,10})?([eE][+-]?[0-9]{1,5})?\"",
        prop_oneof![
            Just("NaN"),
            Just("Infinity"),
            Just("-inf"),
            Just("snan"),
            Just("buy"),
            Just("sell"),
            Just("MDB"),
            Just("USD")
        ]
        .prop_map(json_string),
        // Dates, plausible and not.
        "\"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{1,12})?(Z|z|[+-][0-9]{2}:[0-9]{2})?\"",
        // Any text at all, escaped properly.
        any::<String>().prop_map(|s| json_string(&s)),
        "\\PC{0,70}".prop_map(|s| json_string(&s)),
        Just("null".to_string()),
        Just("true".to_string()),
        Just("false".to_string()),
        // Not JSON at all.
        "[^\"]{0,4}",
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4)
                .prop_map(|items| format!("[{}]", items.join(","))),
            proptest::collection::vec((name(), inner), 0..4).prop_map(|fields| {
                let body: Vec<String> = fields
                    .iter()
                    .map(|(k, v)| format!("{}:{v}", json_string(k)))
                    .collect();
                format!("{{{}}}", body.join(","))
            }),
        ]
    })
}

/// Field names: the decoder's own, reserved and illegal ones, and any.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop_oneof![
            Just("tradeId"), Just("customerId"), Just("type"), Just("ticker"),
            Just("qty"), Just("quantity"), Just("price"), Just("currency"), Just("date"),
        ]
        .prop_map(str::to_string),
        2 => prop_oneof![
            Just("key"), Just("offsetMinutes"), Just("$set"), Just("a.b"), Just(""),
            Just("\u{0}"), Just("venue"), Just("_id"),
        ]
        .prop_map(str::to_string),
        1 => any::<String>(),
    ]
}

/// A valid event's fields, as (name, raw JSON): the README's example
/// trade from the test kit.
fn base() -> Vec<(String, String)> {
    testkit::trade("T-1")
        .fields()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[derive(Debug, Clone)]
enum Edit {
    Set(String, String),
    Remove(usize),
    Add(String, String),
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, u8),
    Delete(usize),
    Truncate(usize),
}

/// An input: a valid event with edits, as text, then byte mutations.
fn input() -> impl Strategy<Value = Vec<u8>> {
    let edit = prop_oneof![
        (name(), value()).prop_map(|(k, v)| Edit::Set(k, v)),
        any::<usize>().prop_map(Edit::Remove),
        (name(), value()).prop_map(|(k, v)| Edit::Add(k, v)),
    ];
    let mutation = prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Delete),
        any::<usize>().prop_map(Mutation::Truncate),
    ];
    (
        proptest::collection::vec(edit, 0..5),
        prop_oneof![
            3 => Just(Vec::new()),
            1 => proptest::collection::vec(mutation, 1..4),
        ],
        prop_oneof![6 => Just(false), 1 => Just(true)],
    )
        .prop_map(|(edits, mutations, top_level_value)| {
            let mut fields = base();
            for e in edits {
                match e {
                    Edit::Set(k, v) => match fields.iter_mut().find(|(n, _)| *n == k) {
                        Some(f) => f.1 = v,
                        None => fields.push((k, v)),
                    },
                    Edit::Remove(i) => {
                        if !fields.is_empty() {
                            let i = i % fields.len();
                            fields.remove(i);
                        }
                    }
                    Edit::Add(k, v) => fields.push((k, v)),
                }
            }
            let mut text = if top_level_value {
                fields.first().map(|f| f.1.clone()).unwrap_or_default()
            } else {
                let body: Vec<String> = fields
                    .iter()
                    .map(|(k, v)| format!("{}:{v}", json_string(k)))
                    .collect();
                format!("{{{}}}", body.join(","))
            }
            .into_bytes();
            for m in mutations {
                let len = text.len().max(1);
                match m {
                    Mutation::Flip(i, b) => {
                        if !text.is_empty() {
                            text[i % len] = b;
                        }
                    }
                    Mutation::Insert(i, b) => text.insert(i % (text.len() + 1), b),
                    Mutation::Delete(i) => {
                        if !text.is_empty() {
                            text.remove(i % len);
                        }
                    }
                    Mutation::Truncate(i) => text.truncate(i % len),
                }
            }
            text
        })
}

/// No `$`-prefixed, dotted, empty or NUL-carrying names anywhere.
fn names_are_storable(doc: &Document) -> Result<(), String> {
    fn walk(b: &Bson) -> Result<(), String> {
        match b {
            Bson::Document(d) => {
                for (k, v) in d {
                    if k.is_empty() || k.starts_with('$') || k.contains('.') || k.contains('\0') {
                        return Err(format!("unstorable field name {k:?}"));
                    }
                    walk(v)?;
                }
                Ok(())
            }
            Bson::Array(items) => items.iter().try_for_each(walk),
            _ => Ok(()),
        }
    }
    walk(&Bson::Document(doc.clone()))
}

/// What must hold of one input's outcome; whether it was accepted.
fn check(bytes: &[u8]) -> Result<bool, TestCaseError> {
    let source = Source {
        topic: "fuzz.trades".into(),
        partition: 2,
        offset: 77,
    };
    let result = decode(Some(bytes), &source, MAX_BYTES);
    prop_assert_eq!(
        &result,
        &decode(Some(bytes), &source, MAX_BYTES),
        "deterministic"
    );
    match result {
        Err(reject) => {
            prop_assert!(RejectKind::ALL.contains(&reject.kind));
            prop_assert!(!reject.message.is_empty());
            if bytes.is_empty() {
                prop_assert_eq!(reject.kind, RejectKind::Empty);
            } else if bytes.len() > MAX_BYTES {
                prop_assert_eq!(reject.kind, RejectKind::Oversize);
            } else if std::str::from_utf8(bytes).is_err() {
                prop_assert_eq!(reject.kind, RejectKind::NotUtf8);
            }
        }
        Ok(t) => {
            check_accepted(bytes, &t)?;
            return Ok(true);
        }
    }
    Ok(false)
}

/// What the decoder accepted is valid JSON, an object, and within every
/// rule of README.md, and stores as BSON.
fn check_accepted(bytes: &[u8], t: &Trade) -> Result<(), TestCaseError> {
    // Accepted: valid JSON (by RFC 8259's grammar, which bounds no
    // exponent: `1e400` is JSON and an exact Decimal128), an object,
    // and every rule of README.md.
    let raw: Box<serde_json::value::RawValue> = serde_json::from_slice(bytes)
        .map_err(|e| TestCaseError::fail(format!("accepted non-JSON: {e}")))?;
    prop_assert!(raw.get().starts_with('{'), "not an object");
    prop_assert!(t.key.starts_with("t:") || t.key == "o:fuzz.trades/2/77");
    prop_assert_eq!(t.doc.get_str("key").ok(), Some(t.key.as_str()));
    match &t.customer {
        CustomerId::Int(i) => prop_assert!(*i >= 0),
        CustomerId::Str(s) => prop_assert!(
            !s.is_empty()
                && s.len() <= 64
                && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        ),
    }
    prop_assert!(!t.customer.id_text().contains('_'));
    prop_assert!((0..=MAX_EPOCH_SECONDS * 1000 + 999).contains(&t.date_ms));
    prop_assert!(
        !t.ticker.is_empty()
            && t.ticker.len() <= 16
            && t.ticker
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
    );
    // The stored entry is raw BSON already; read it back as a map.
    let entry = t
        .entry()
        .map_err(|e| TestCaseError::fail(format!("entry does not read back: {e}")))?;
    match entry.get("qty") {
        Some(Bson::Int64(q)) => prop_assert!(*q > 0),
        Some(Bson::Decimal128(d)) => {
            let text = d.to_string();
            prop_assert!(
                !text.starts_with('-') && text.bytes().any(|b| (b'1'..=b'9').contains(&b)),
                "qty {}",
                text
            );
        }
        other => prop_assert!(false, "qty stored as {:?}", other),
    }
    if let Some(p) = entry.get("price") {
        let Bson::Decimal128(d) = p else {
            return Err(TestCaseError::fail(format!("price stored as {p:?}")));
        };
        let text = d.to_string();
        prop_assert!(
            !text.contains("NaN") && !text.contains("Inf"),
            "price {}",
            text
        );
    }
    names_are_storable(&entry).map_err(TestCaseError::fail)?;
    bson::to_vec(&entry).map_err(|e| TestCaseError::fail(format!("not serialisable: {e}")))?;
    Ok(())
}

#[test]
fn the_decoder_survives_fuzzing() {
    let cases: u32 = std::env::var("TRADEBUCKET_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let config = Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/decoder-fuzz.txt",
        ))),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let inputs = AtomicU64::new(0);
    let accepted = AtomicU64::new(0);
    let started = Instant::now();
    let result = runner.run(&input(), |bytes| {
        inputs.fetch_add(1, Ordering::Relaxed);
        if check(&bytes)? {
            accepted.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    let inputs = inputs.load(Ordering::Relaxed);
    let report = serde_json::json!({
        "inputs": inputs,
        "accepted": accepted.load(Ordering::Relaxed),
        "seconds": (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        "failure": result.as_ref().err().map(|e| e.to_string()),
    });
    let dir = report_dir();
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(
        dir.join("fuzz.json"),
        serde_json::to_string_pretty(&report).unwrap(),
    );
    eprintln!("decoder fuzz: {report}");
    result.unwrap();
}
