//! The previous encoder, kept as the reference the new one is held to:
//! `fill_statement`, `bucket_document` and `apply_fills`' `update` command
//! as they were built with `rawdoc!` and `RawArrayBuf` (bson 2.15) before
//! the store wrote them with [`super::bson_out`]. What MongoDB is sent must
//! stay byte for byte what it was, and the property tests below compare
//! the two on generated fills, buckets and commands.

use std::collections::BTreeSet;

use mongodb::bson::{rawdoc, RawArrayBuf, RawBson, RawDocumentBuf};

use super::layout::SHARD_KEY_FIELD;
use crate::bucket::plan::{Fill, NewBucket};
use crate::event::{CustomerId, Trade};

/// The previous `codec::fill_statement`, unchanged.
pub(super) fn fill_statement(
    fill: &Fill,
    trades: &[&Trade],
    shard_key: Option<&CustomerId>,
) -> RawDocumentBuf {
    let mut max = RawDocumentBuf::new();
    for (k, v) in &fill.wm {
        max.append(format!("wm.{k}"), *v);
    }
    let tickers: RawArrayBuf = tickers_of(trades).into_iter().collect();
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

/// The previous `codec::bucket_document`, unchanged.
pub(super) fn bucket_document(bucket: &NewBucket, trades: &[&Trade]) -> RawDocumentBuf {
    let mut wm = RawDocumentBuf::new();
    for (k, v) in &bucket.wm {
        wm.append(k, *v);
    }
    let customer = RawBson::try_from(bucket.customer.clone())
        .expect("a customer id taken from BSON re-encodes as BSON");
    let tickers: RawArrayBuf = tickers_of(trades).into_iter().collect();
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

/// The tickers the planner collected from the trades (a set, in order),
/// before the codec took them from the trades itself.
fn tickers_of<'t>(trades: &[&'t Trade]) -> BTreeSet<&'t str> {
    trades.iter().map(|t| t.ticker.as_str()).collect()
}

/// The previous `codec::history`, unchanged.
fn history(trades: &[&Trade]) -> RawArrayBuf {
    let mut history = RawArrayBuf::new();
    for t in trades {
        history.push(t.doc.clone());
    }
    history
}

/// The previous `BucketStore::apply_fills`' command for one chunk.
pub(super) fn update_command(
    collection: &str,
    chunk: Vec<RawDocumentBuf>,
    write_concern_doc: &RawDocumentBuf,
) -> RawDocumentBuf {
    let mut updates = RawArrayBuf::new();
    for statement in chunk {
        updates.push(statement);
    }
    rawdoc! {
        "update": collection,
        "updates": updates,
        "ordered": false,
        "writeConcern": write_concern_doc.clone(),
    }
}

mod tests;
