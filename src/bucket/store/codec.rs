//! The bucket document as stored, and back: a new bucket, the guarded
//! fill statement, and our view of a stored bucket (`BucketHead`).

use std::collections::BTreeMap;

use compact_str::CompactString;
use mongodb::bson::{Bson, Document, RawBson, RawDocumentBuf};

use super::bson_out::{self, document, element, BsonOut, Name};
use super::layout::SHARD_KEY_FIELD;
use crate::bucket::plan::{BucketHead, Fill, NewBucket, UnreadableBucket};
use crate::event::{CustomerId, Trade};
use crate::prefetch::prefetch_bytes;

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
        .filter_map(|e| {
            e.as_document()?
                .get_str("key")
                .ok()
                .map(CompactString::from)
        })
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
///
/// `{q: {_id, count[, customerId]}, u: {$push: {history: {$each: [..]}},
/// $inc: {count[, bytes]}, $max: {wm.<key>: offset, ..}, $addToSet:
/// {tickers: {$each: [..]}}}}`, written in one buffer of its exact size.
pub fn fill_statement(
    fill: &Fill,
    trades: &[&Trade],
    shard_key: Option<&CustomerId>,
) -> RawDocumentBuf {
    prefetch_entries(trades);
    let tickers = distinct_tickers(trades);
    let mut out = BsonOut::with_capacity(fill_statement_size(fill, trades, &tickers, shard_key));
    let top = out.begin();
    let q = out.document("q");
    out.string("_id", &fill.bucket_id);
    out.int64("count", i64::from(fill.expected_count));
    match shard_key {
        Some(CustomerId::Int(i)) => out.int64(SHARD_KEY_FIELD, *i),
        Some(CustomerId::Str(s)) => out.string(SHARD_KEY_FIELD, s),
        None => {}
    }
    out.end(q);
    let u = out.document("u");
    let push = out.document("$push");
    let field = out.document("history");
    let each = out.array("$each");
    history(&mut out, trades);
    out.end(each);
    out.end(field);
    out.end(push);
    let inc = out.document("$inc");
    out.int64("count", trades.len() as i64);
    if let Some(bytes) = fill.bytes {
        // As the previous encoder did: `as`, not a checked conversion
        // (a bound over i64::MAX is no bucket's).
        out.int64("bytes", bytes as i64);
    }
    out.end(inc);
    let max = out.document("$max");
    for (k, v) in watermarks(&fill.wm) {
        out.int64(Name::Joined("wm.", k), *v);
    }
    out.end(max);
    let add = out.document("$addToSet");
    let field = out.document("tickers");
    let each = out.array("$each");
    write_tickers(&mut out, &tickers);
    out.end(each);
    out.end(field);
    out.end(add);
    out.end(u);
    out.end(top);
    out.finish()
}

/// The exact size of [`fill_statement`]'s document, field for field.
fn fill_statement_size(
    fill: &Fill,
    trades: &[&Trade],
    tickers: &[&str],
    shard_key: Option<&CustomerId>,
) -> usize {
    let shard = match shard_key {
        Some(CustomerId::Int(_)) => element(SHARD_KEY_FIELD, 8),
        Some(CustomerId::Str(s)) => element(SHARD_KEY_FIELD, bson_out::string(s)),
        None => 0,
    };
    let q = element("_id", bson_out::string(&fill.bucket_id)) + element("count", 8) + shard;
    let push = element("history", document(element("$each", history_size(trades))));
    let inc = element("count", 8) + fill.bytes.map_or(0, |_| element("bytes", 8));
    let max: usize = watermarks(&fill.wm)
        .map(|(k, _)| element(Name::Joined("wm.", k), 8))
        .sum();
    let add = element("tickers", document(element("$each", tickers_size(tickers))));
    let u = element("$push", document(push))
        + element("$inc", document(inc))
        + element("$max", document(max))
        + element("$addToSet", document(add));
    document(element("q", document(q)) + element("u", document(u)))
}

/// A new bucket document, written in one buffer of its exact size.
pub fn bucket_document(bucket: &NewBucket, trades: &[&Trade]) -> RawDocumentBuf {
    prefetch_entries(trades);
    let customer = CustomerValue::of(&bucket.customer);
    let tickers = distinct_tickers(trades);
    let size = bucket_document_size(bucket, trades, &tickers, &customer);
    let mut out = BsonOut::with_capacity(size);
    let top = out.begin();
    // Field for field what `size::empty_bucket` counts.
    out.string("_id", &bucket.id);
    customer.write(&mut out);
    out.int64("count", trades.len() as i64);
    out.int64("cap", i64::from(bucket.limits.cap));
    // `as`, as the previous encoder did (no bound is over i64::MAX).
    out.int64("capBytes", bucket.limits.cap_bytes as i64);
    out.int64("bytes", bucket.bytes as i64);
    let array = out.array("history");
    history(&mut out, trades);
    out.end(array);
    let array = out.array("tickers");
    write_tickers(&mut out, &tickers);
    out.end(array);
    out.string("prev", &bucket.prev);
    let wm = out.document("wm");
    for (k, v) in watermarks(&bucket.wm) {
        out.int64(k.as_str(), *v);
    }
    out.end(wm);
    out.end(top);
    out.finish()
}

/// The exact size of [`bucket_document`]'s document.
fn bucket_document_size(
    bucket: &NewBucket,
    trades: &[&Trade],
    tickers: &[&str],
    customer: &CustomerValue,
) -> usize {
    let wm: usize = watermarks(&bucket.wm)
        .map(|(k, _)| element(k.as_str(), 8))
        .sum();
    let fields = element("_id", bson_out::string(&bucket.id))
        + customer.size()
        + element("count", 8)
        + element("cap", 8)
        + element("capBytes", 8)
        + element("bytes", 8)
        + element("history", history_size(trades))
        + element("tickers", tickers_size(tickers))
        + element("prev", bson_out::string(&bucket.prev))
        + element("wm", document(wm));
    document(fields)
}

/// A bucket's `customerId`: an int64 or a string as the decoder makes
/// them, written directly; any other type another tool stored in the
/// bucket it is copied from, encoded by bson as before.
enum CustomerValue<'a> {
    Int64(i64),
    Int32(i32),
    Str(&'a str),
    /// `{customerId: value}` as bson encodes it.
    Other(RawDocumentBuf),
}

impl<'a> CustomerValue<'a> {
    const NAME: &'static str = "customerId";

    fn of(customer: &'a Bson) -> Self {
        match customer {
            Bson::Int64(i) => CustomerValue::Int64(*i),
            Bson::Int32(i) => CustomerValue::Int32(*i),
            Bson::String(s) => CustomerValue::Str(s),
            other => {
                // Only an embedded document with a NUL in a field name (or
                // a regex with one) fails to re-encode, and this value was
                // either decoded from BSON (which cannot hold such a name)
                // or built from a customer id.
                let value = RawBson::try_from(other.clone())
                    .expect("a customer id taken from BSON re-encodes as BSON");
                let mut element = RawDocumentBuf::new();
                element.append(Self::NAME, value);
                CustomerValue::Other(element)
            }
        }
    }

    /// The element's bytes (type, name, value).
    fn size(&self) -> usize {
        match self {
            CustomerValue::Int64(_) => element(Self::NAME, 8),
            CustomerValue::Int32(_) => element(Self::NAME, 4),
            CustomerValue::Str(s) => element(Self::NAME, bson_out::string(s)),
            CustomerValue::Other(d) => Self::element_of(d).len(),
        }
    }

    fn write(&self, out: &mut BsonOut) {
        match self {
            CustomerValue::Int64(i) => out.int64(Self::NAME, *i),
            CustomerValue::Int32(i) => out.int32(Self::NAME, *i),
            CustomerValue::Str(s) => out.string(Self::NAME, s),
            CustomerValue::Other(d) => out.element_bytes(Self::element_of(d)),
        }
    }

    /// The one element of a one-element document: between the length and
    /// the final NUL.
    fn element_of(d: &RawDocumentBuf) -> &[u8] {
        let bytes = d.as_bytes();
        bytes.get(4..bytes.len() - 1).unwrap_or_default()
    }
}

/// The watermarks we can name. A name is NUL-ended, and none of ours can
/// hold a NUL: a watermark key is `Source::partition_key` of a Kafka topic
/// (legal names are `[A-Za-z0-9._-]`) or a field name read back from a
/// stored bucket (a BSON name, NUL-ended itself). Should one ever hold a
/// NUL, it is left out rather than sent as a broken document (which the
/// previous encoder refused with a panic): a missing watermark is safe, as
/// its partition's events are then guarded by their keys alone.
fn watermarks(wm: &BTreeMap<String, i64>) -> impl Iterator<Item = (&String, &i64)> {
    wm.iter().filter(|(k, _)| nameable(k))
}

/// Whether `name` can be a BSON name: it holds no NUL.
fn nameable(name: &str) -> bool {
    !name.as_bytes().contains(&0)
}

/// Asks for the trades' entries, which `history` copies last (see
/// [`crate::prefetch`]): each was written by the decoder a batch or more
/// ago, so the copy waited on memory for each; asked for first, they
/// arrive while the tickers and the size are worked out.
fn prefetch_entries(trades: &[&Trade]) {
    for t in trades {
        prefetch_bytes(t.doc.as_bytes());
    }
}

/// The trades' history entries, copied as encoded bytes, as an array's
/// elements.
fn history(out: &mut BsonOut, trades: &[&Trade]) {
    for (i, t) in trades.iter().enumerate() {
        out.raw_document(i, &t.doc);
    }
}

/// The bytes of the array [`history`] writes.
fn history_size(trades: &[&Trade]) -> usize {
    bson_out::array(trades.iter().map(|t| t.doc.as_bytes().len()))
}

/// The distinct tickers of `trades`, in byte order: a bucket's `tickers`
/// field, or what a fill adds to it. Taken from the trades when the
/// statement is written, not copied into sets as they are planned (a
/// `String` and a tree node per ticker per bucket).
fn distinct_tickers<'t>(trades: &[&'t Trade]) -> Vec<&'t str> {
    let mut tickers: Vec<&str> = trades.iter().map(|t| t.ticker.as_str()).collect();
    tickers.sort_unstable();
    tickers.dedup();
    tickers
}

/// The tickers as an array's string elements.
fn write_tickers(out: &mut BsonOut, tickers: &[&str]) {
    for (i, t) in tickers.iter().enumerate() {
        out.string(i, t);
    }
}

/// The bytes of the array [`write_tickers`] writes.
fn tickers_size(tickers: &[&str]) -> usize {
    bson_out::array(tickers.iter().map(|t| bson_out::string(t)))
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
