//! The store's encoder against the previous one ([`super`]): the same bytes
//! for every generated fill, bucket and `update` command.

use std::collections::BTreeMap;

use mongodb::bson::{doc, Bson, DateTime, Document, RawDocumentBuf};
use proptest::prelude::*;

use crate::bucket::plan::{Fill, Limits, NewBucket};
use crate::bucket::store::{bucket_document, chunk_by_size, fill_statement, update_command};
use crate::event::{CustomerId, Trade};

/// A scalar of a history entry.
fn leaf() -> impl Strategy<Value = Bson> {
    prop_oneof![
        any::<i32>().prop_map(Bson::Int32),
        any::<i64>().prop_map(Bson::Int64),
        any::<f64>().prop_map(Bson::Double),
        ".{0,40}".prop_map(Bson::String),
        any::<bool>().prop_map(Bson::Boolean),
        Just(Bson::Null),
        any::<i64>().prop_map(|ms| Bson::DateTime(DateTime::from_millis(ms))),
    ]
}

/// Field names as decoded entries have them: any text but NUL.
fn field_name() -> impl Strategy<Value = String> {
    "[^\u{0}]{1,12}"
}

/// Any entry value, nested a few levels deep.
fn value() -> impl Strategy<Value = Bson> {
    leaf().prop_recursive(3, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Bson::Array),
            prop::collection::vec((field_name(), inner), 0..6)
                .prop_map(|kv| Bson::Document(kv.into_iter().collect::<Document>())),
        ]
    })
}

/// A trade whose history entry (`doc`, the only part encoded) is a `key`
/// and up to a dozen fields of any size and nesting.
fn trade() -> impl Strategy<Value = Trade> {
    let fields = prop::collection::vec((field_name(), value()), 0..12);
    ("t:[a-z0-9]{1,20}", fields, ".{0,12}").prop_map(|(key, fields, ticker)| {
        let mut entry = doc! {"key": key.as_str()};
        for (k, v) in fields {
            entry.insert(k, v);
        }
        Trade {
            key: key.into(),
            legacy_key: None,
            customer: CustomerId::Int(1),
            ticker: ticker.into(),
            date_ms: 0,
            doc: RawDocumentBuf::from_document(&entry).expect("no NUL in names"),
        }
    })
}

/// 0 to 1,500 trades (array indices of up to four digits), cycled from a
/// few generated ones so a long fill costs little to generate.
fn trades() -> impl Strategy<Value = Vec<Trade>> {
    let count = prop_oneof![0..4usize, 0..40usize, 90..130usize, 990..1500usize];
    (prop::collection::vec(trade(), 1..6), count)
        .prop_map(|(pool, n)| pool.into_iter().cycle().take(n).collect())
}

/// Watermark keys as `Source::partition_key` spells them (`~` for `.`),
/// and odd ones a stored bucket might hold.
fn watermarks() -> impl Strategy<Value = BTreeMap<String, i64>> {
    let key = prop_oneof![
        ("[A-Za-z0-9_~-]{1,30}", any::<i32>()).prop_map(|(t, p)| format!("{t}:{p}")),
        "[^\u{0}]{0,10}",
    ];
    prop::collection::btree_map(key, any::<i64>(), 0..6)
}

fn shard_key() -> impl Strategy<Value = Option<CustomerId>> {
    prop_oneof![
        Just(None),
        any::<i64>().prop_map(|i| Some(CustomerId::Int(i))),
        "[A-Za-z0-9-]{1,64}".prop_map(|s| Some(CustomerId::Str(s))),
        ".{0,20}".prop_map(|s| Some(CustomerId::Str(s))),
    ]
}

fn fill() -> impl Strategy<Value = Fill> {
    let counts = prop_oneof![any::<u32>(), Just(u32::MAX), Just(0)];
    let bytes = prop_oneof![
        Just(None),
        any::<u64>().prop_map(Some),
        Just(Some(u64::MAX))
    ];
    (".{0,40}", counts, watermarks(), bytes).prop_map(|(bucket_id, expected_count, wm, bytes)| {
        Fill {
            bucket_id,
            expected_count,
            events: Vec::new(),
            wm,
            bytes,
        }
    })
}

/// A `customerId` as the decoder makes it, or as another tool may have
/// stored it in the bucket it is copied from.
fn customer() -> impl Strategy<Value = Bson> {
    prop_oneof![
        any::<i64>().prop_map(Bson::Int64),
        any::<i32>().prop_map(Bson::Int32),
        ".{0,64}".prop_map(Bson::String),
        value(),
    ]
}

fn new_bucket() -> impl Strategy<Value = NewBucket> {
    let limits =
        (any::<u32>(), any::<u64>()).prop_map(|(cap, cap_bytes)| Limits { cap, cap_bytes });
    let texts = (".{0,40}", ".{0,40}");
    let parts = (texts, customer(), watermarks(), limits, any::<u64>());
    parts.prop_map(|((id, prev), customer, wm, limits, bytes)| NewBucket {
        id,
        prev,
        customer,
        events: Vec::new(),
        wm,
        limits,
        bytes,
    })
}

/// A write concern as `write::write_concern_doc` writes one.
fn write_concern() -> impl Strategy<Value = RawDocumentBuf> {
    let w = prop_oneof![
        any::<u32>().prop_map(|n| Bson::Int64(i64::from(n))),
        "[a-z]{1,10}".prop_map(Bson::String),
    ];
    (w, any::<Option<bool>>(), any::<Option<i64>>()).prop_map(|(w, j, wtimeout)| {
        let mut d = doc! {"w": w};
        if let Some(j) = j {
            d.insert("j", j);
        }
        if let Some(t) = wtimeout {
            d.insert("wtimeout", t);
        }
        RawDocumentBuf::from_document(&d).expect("no NUL in names")
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn fill_statements_are_the_previous_encoders_bytes(
        fill in fill(),
        trades in trades(),
        shard_key in shard_key(),
    ) {
        let trades: Vec<&Trade> = trades.iter().collect();
        let new = fill_statement(&fill, &trades, shard_key.as_ref());
        let old = super::fill_statement(&fill, &trades, shard_key.as_ref());
        prop_assert_eq!(new.as_bytes(), old.as_bytes());
    }

    #[test]
    fn new_buckets_are_the_previous_encoders_bytes(
        bucket in new_bucket(),
        trades in trades(),
    ) {
        let trades: Vec<&Trade> = trades.iter().collect();
        let new = bucket_document(&bucket, &trades);
        let old = super::bucket_document(&bucket, &trades);
        prop_assert_eq!(new.as_bytes(), old.as_bytes());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Each chunk's command as `apply_fills` built it from its statements
    /// (fill statements, as sent, of up to a few hundred per command).
    #[test]
    fn update_commands_are_the_previous_encoders_bytes(
        collection in "[^\u{0}]{1,30}",
        fills in prop::collection::vec((fill(), 0..20usize), 0..150),
        pool in prop::collection::vec(trade(), 1..4),
        shard_key in shard_key(),
        write_concern in write_concern(),
    ) {
        let pool: Vec<&Trade> = pool.iter().collect();
        let statements: Vec<RawDocumentBuf> = fills
            .iter()
            .map(|(f, n)| {
                let trades: Vec<&Trade> = pool.iter().copied().cycle().take(*n).collect();
                fill_statement(f, &trades, shard_key.as_ref())
            })
            .collect();
        for chunk in chunk_by_size(&statements) {
            let new = update_command(&collection, &statements[chunk.clone()], &write_concern);
            let old = super::update_command(&collection, statements[chunk].to_vec(), &write_concern);
            prop_assert_eq!(new.as_bytes(), old.as_bytes());
        }
        let empty = update_command(&collection, &[], &write_concern);
        let old = super::update_command(&collection, Vec::new(), &write_concern);
        prop_assert_eq!(empty.as_bytes(), old.as_bytes());
    }
}

/// A watermark key with a NUL cannot be a BSON name: the previous encoder
/// panicked on it; this one leaves that one watermark out (see
/// `codec::watermarks`) and writes the rest as before.
#[test]
fn a_watermark_key_holding_a_nul_is_left_out_not_a_panic() {
    let good: BTreeMap<String, i64> = [("t~a:0".to_string(), 5_i64)].into();
    let mut bad = good.clone();
    bad.insert("t\0b:1".to_string(), 7);
    let fill = |wm: &BTreeMap<String, i64>| Fill {
        bucket_id: "7_1700000000".into(),
        expected_count: 3,
        events: Vec::new(),
        wm: wm.clone(),
        bytes: Some(10),
    };
    let new = fill_statement(&fill(&bad), &[], None);
    let old = super::fill_statement(&fill(&good), &[], None);
    assert_eq!(new.as_bytes(), old.as_bytes());
    let bucket = |wm: &BTreeMap<String, i64>| NewBucket {
        id: "7_1700000001".into(),
        prev: "7_1700000000".into(),
        customer: Bson::Int64(7),
        events: Vec::new(),
        wm: wm.clone(),
        limits: Limits::with_capacity(100),
        bytes: 200,
    };
    let new = bucket_document(&bucket(&bad), &[]);
    let old = super::bucket_document(&bucket(&good), &[]);
    assert_eq!(new.as_bytes(), old.as_bytes());
}
