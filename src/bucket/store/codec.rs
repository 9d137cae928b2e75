//! The bucket document as stored, and back: a new bucket, the guarded
//! fill statement, and our view of a stored bucket (`BucketHead`).

use std::collections::BTreeMap;

use mongodb::bson::{rawdoc, Bson, Document, RawArrayBuf, RawBson, RawDocumentBuf};

use super::layout::SHARD_KEY_FIELD;
use crate::bucket::plan::{BucketHead, Fill, NewBucket, UnreadableBucket};
use crate::event::{CustomerId, Trade};

/// Builds our view of a bucket from its stored form; or says why this
/// version cannot plan against it. `count` must be a whole number the
/// guard can match exactly: a `2.5` read as 2 would make every guarded
/// fill miss, for ever.
pub fn head_from_document(d: &Document) -> Result<BucketHead, UnreadableBucket> {
    let id = d
        .get_str("_id")
        // Not the document: messages reach the logs and dead letters, and a
        // bucket is up to 16 MiB of trades.
        .map_err(|_| UnreadableBucket {
            id: format!("{:?}", d.get("_id").map(Bson::element_type)),
            why: "its _id is not a string".to_string(),
        })?
        .to_string();
    let count = stored_number(d, "count")
        .and_then(|c| u32::try_from(c).ok())
        .ok_or_else(|| UnreadableBucket {
            id: id.clone(),
            why: format!(
                "its count is {}, not a whole number from 0 to 2^32-1",
                describe(d.get("count"))
            ),
        })?;
    // Without them the bucket is a legacy one (see `BucketHead::cap` and
    // `BucketHead::size`); a value that is not a count counts as absent.
    let cap = stored_number(d, "cap").and_then(|c| u32::try_from(c).ok());
    let size = match (stored_number(d, "bytes"), stored_number(d, "capBytes")) {
        (Some(bytes), Some(cap_bytes)) => Some(crate::bucket::plan::Size { bytes, cap_bytes }),
        _ => None,
    };
    let keys = d
        .get_array("history")
        .map(|a| a.as_slice())
        .unwrap_or(&[])
        .iter()
        .filter_map(|e| e.as_document()?.get_str("key").ok().map(str::to_string))
        .collect();
    let mut wm = BTreeMap::new();
    if let Ok(w) = d.get_document("wm") {
        for (k, v) in w {
            let Some(offset) = whole_number(v) else {
                continue;
            };
            wm.insert(k.clone(), offset);
        }
    }
    Ok(BucketHead {
        id,
        customer: d.get("customerId").cloned().unwrap_or(Bson::Null),
        count,
        cap,
        size,
        keys,
        wm,
    })
}

/// A stored value's type and, if short, the value: enough to find the
/// bucket's fault without copying a whole field into a dead letter.
pub(super) fn describe(v: Option<&Bson>) -> String {
    match v {
        None => "missing".to_string(),
        Some(v @ (Bson::Int32(_) | Bson::Int64(_) | Bson::Double(_) | Bson::Decimal128(_))) => {
            format!("{v}")
        }
        Some(v) => format!("of type {:?}", v.element_type()),
    }
}

/// A non-negative integer field, as any numeric BSON type.
pub(crate) fn stored_number(d: &Document, field: &str) -> Option<u64> {
    whole_number(d.get(field)?).and_then(|n| u64::try_from(n).ok())
}

/// A whole number in any of BSON's numeric types a server or a tool may
/// have written it as (the shell writes doubles); `None` for a fraction,
/// a number out of range or anything else.
pub(crate) fn whole_number(v: &Bson) -> Option<i64> {
    match v {
        Bson::Int32(n) => Some(i64::from(*n)),
        Bson::Int64(n) => Some(*n),
        // In range of i64 and whole: the cast is exact.
        Bson::Double(n) if n.fract() == 0.0 && n.abs() < 9.2e18 => Some(*n as i64),
        _ => None,
    }
}

/// The guarded append: matches only if nobody appended since we looked.
/// In sharded mode `shard_key` is the customer's (see
/// [`super::BucketStore::shard_key`]), so mongos sends it to one shard. The same
/// count means the same `bytes` (both change only here, together), so the
/// guard also vouches for the size bound the plan started from.
pub fn fill_statement(
    fill: &Fill,
    trades: &[&Trade],
    shard_key: Option<&CustomerId>,
) -> RawDocumentBuf {
    let mut max = RawDocumentBuf::new();
    for (k, v) in &fill.wm {
        max.append(format!("wm.{k}"), *v);
    }
    let tickers: RawArrayBuf = fill.tickers.iter().map(String::as_str).collect();
    let mut q = rawdoc! {"_id": fill.bucket_id.as_str(), "count": fill.expected_count as i64};
    match shard_key {
        Some(CustomerId::Int(i)) => q.append(SHARD_KEY_FIELD, *i),
        Some(CustomerId::Str(s)) => q.append(SHARD_KEY_FIELD, s.as_str()),
        None => {}
    }
    let mut inc = rawdoc! {"count": trades.len() as i64};
    if let Some(bytes) = fill.bytes {
        inc.append("bytes", bytes as i64);
    }
    rawdoc! {
        "q": q,
        "u": {
            "$push": {"history": {"$each": history(trades)}},
            "$inc": inc,
            "$max": max,
            "$addToSet": {"tickers": {"$each": tickers}},
        },
    }
}

/// A new bucket document.
pub fn bucket_document(bucket: &NewBucket, trades: &[&Trade]) -> RawDocumentBuf {
    let mut wm = RawDocumentBuf::new();
    for (k, v) in &bucket.wm {
        wm.append(k, *v);
    }
    // Only an embedded document with a NUL in a field name fails to
    // re-encode, and this value was either decoded from BSON (which cannot
    // hold such a name) or built from a customer id.
    let customer = RawBson::try_from(bucket.customer.clone())
        .expect("a customer id taken from BSON re-encodes as BSON");
    let tickers: RawArrayBuf = bucket.tickers.iter().map(String::as_str).collect();
    // Field for field what `size::empty_bucket` counts.
    rawdoc! {
        "_id": bucket.id.as_str(),
        "customerId": customer,
        "count": trades.len() as i64,
        "cap": i64::from(bucket.limits.cap),
        "capBytes": bucket.limits.cap_bytes as i64,
        "bytes": bucket.bytes as i64,
        "history": history(trades),
        "tickers": tickers,
        "prev": bucket.prev.as_str(),
        "wm": wm,
    }
}

/// The trades' history entries, copied as encoded bytes.
fn history(trades: &[&Trade]) -> RawArrayBuf {
    let mut history = RawArrayBuf::new();
    for t in trades {
        history.push(t.doc.clone());
    }
    history
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::doc;

    #[test]
    fn whole_numbers_are_read_from_every_numeric_type_and_nothing_else() {
        assert_eq!(whole_number(&Bson::Int32(-3)), Some(-3));
        assert_eq!(whole_number(&Bson::Int64(1 << 40)), Some(1 << 40));
        assert_eq!(whole_number(&Bson::Double(-3.0)), Some(-3));
        for not in [
            Bson::Double(0.5),
            Bson::Double(f64::INFINITY),
            Bson::Double(f64::NAN),
            Bson::Double(1e19),
            Bson::String("1".into()),
            Bson::Boolean(true),
        ] {
            assert_eq!(whole_number(&not), None, "{not}");
        }
    }

    /// A `count` the guard could never match is the bucket's fault, told
    /// apart from a bucket we can plan against; integral doubles are fine.
    #[test]
    fn a_count_that_is_not_a_whole_number_makes_the_bucket_unreadable() {
        let bucket = |count: Bson| doc! {"_id": "7_1700000000", "count": count, "history": []};
        for bad in [
            Bson::Double(2.5),
            Bson::Int32(-1),
            Bson::String("2".into()),
            Bson::Null,
            Bson::Double(f64::NAN),
            Bson::Int64(1 << 33),
        ] {
            let e = head_from_document(&bucket(bad.clone())).unwrap_err();
            assert_eq!(e.id, "7_1700000000", "{bad}");
            assert!(e.why.contains("count"), "{bad}: {e}");
        }
        for good in [Bson::Double(2.0), Bson::Int32(2), Bson::Int64(2)] {
            assert_eq!(head_from_document(&bucket(good)).unwrap().count, 2);
        }
        let missing = doc! {"_id": "7_1700000000", "history": []};
        assert!(head_from_document(&missing)
            .unwrap_err()
            .why
            .contains("missing"));
    }

    #[test]
    fn heads_round_trip_through_the_stored_form() {
        let d = doc! {"_id": "5_0000000100", "customerId": 5_i64, "count": 2_i64,
        "history": [{"key": "a"}, {"key": "b"}], "wm": {"t:0": 17_i64}};
        let h = head_from_document(&d).unwrap();
        assert_eq!(h.count, 2);
        assert_eq!(h.keys.len(), 2);
        assert_eq!(h.wm.get("t:0"), Some(&17));
        assert_eq!(h.customer, Bson::Int64(5));
    }
}
