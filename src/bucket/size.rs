//! How large a bucket may grow, in BSON bytes, and the arithmetic behind
//! the size bound each bucket stores (`bytes`). Pure.
//!
//! MongoDB refuses a document over 16 MiB, and a bucket that cannot grow
//! past it would refuse every later trade of its customer (the bucket is
//! never full by count, so no successor is ever opened). So a bucket is
//! closed by size as well as by count: it stores `capBytes`, the size at
//! which it closes, and `bytes`, an upper bound of its BSON size. A bucket
//! is full when `bytes >= capBytes`, and only a bucket that is not full
//! takes another trade. Every admissible trade adds at most
//! [`MAX_ENTRY_BYTES`] + [`MAX_CHARGE_OVERHEAD`] (what [`charge`] counts),
//! so a bucket ends below
//! `CAP_BYTES + MAX_ENTRY_BYTES + MAX_CHARGE_OVERHEAD = 16 MiB - SIZE_MARGIN`.
//!
//! `bytes` is a sum of per-trade charges on the empty bucket's exact size,
//! never the encoded length of what was sent. That way a bucket's `bytes`
//! depends only on which trades it holds, not on whether they arrived in
//! its insert or in later fills, so the pages a stream makes do not depend
//! on how it was batched (the planner's property tests replay streams in
//! any batching and expect the same buckets). It is exact for an empty
//! bucket and over-counts each trade by a few hundred bytes at most.

use std::collections::BTreeMap;

use mongodb::bson::{self, doc, Bson};

use crate::config::MAX_TOPIC_LEN;
use crate::event::{Source, Trade, MAX_ENTRY_BYTES, MAX_TICKER_LEN};

/// MongoDB's limit on a stored document (`maxBsonObjectSize`).
pub const MAX_DOCUMENT_BYTES: u64 = 16 * 1024 * 1024;

/// Room left under [`MAX_DOCUMENT_BYTES`] that the bound does not account
/// for: fields another tool might add to a bucket, and the query and
/// operators around the trades of a fill, so that an `update` command
/// holding one fill (its trades are at most the bucket's growth) stays
/// under the server's command limit of 16 MiB + 16 KiB.
pub const SIZE_MARGIN: u64 = 512 * 1024;

/// Array indices are decimal strings. No array in a document of at most
/// 16 MiB has 10^7 elements (each takes at least 3 bytes), so seven digits
/// bound every index.
const MAX_INDEX_DIGITS: u64 = 7;

/// The longest watermark key: `<topic>:<partition>`, with Kafka's longest
/// topic name (249) and a non-negative 32-bit partition (10 digits).
const MAX_PARTITION_KEY_LEN: u64 = MAX_TOPIC_LEN as u64 + 1 + 10;

/// The most [`charge`] adds to a trade's entry length.
pub const MAX_CHARGE_OVERHEAD: u64 = charge_overhead(MAX_TICKER_LEN as u64, MAX_PARTITION_KEY_LEN);

/// The `capBytes` of a bucket opened by this version: a bucket below it
/// has room for any trade the decoder admits (see the module docs). About
/// 7.5 MiB.
pub const CAP_BYTES: u64 = MAX_DOCUMENT_BYTES - SIZE_MARGIN - MAX_ENTRY_BYTES - MAX_CHARGE_OVERHEAD;

/// An upper bound of what `trade`, read from `source`, adds to a bucket:
/// its history entry, that entry's array element (type byte, index, NUL),
/// its ticker's element in `tickers` and its partition's element in `wm`,
/// both counted as if new. The same whether the trade goes into a new
/// bucket or a fill.
pub fn charge(trade: &Trade, source: &Source) -> u64 {
    trade.doc.as_bytes().len() as u64
        + charge_overhead(trade.ticker.len() as u64, source.partition_key_len() as u64)
}

const fn charge_overhead(ticker_len: u64, key_len: u64) -> u64 {
    let history_element = 1 + MAX_INDEX_DIGITS + 1;
    let ticker_element = 1 + MAX_INDEX_DIGITS + 1 + string(ticker_len);
    let wm_element = element(key_len, 8);
    history_element + ticker_element + wm_element
}

/// The exact BSON size of a new bucket before its first trade, as
/// `store::bucket_document` writes it: `_id`, `customerId`, `count`,
/// `cap`, `capBytes`, `bytes` (int64s), empty `history` and `tickers`,
/// `prev`, and `wm` holding `wm`'s keys (int64 offsets). A unit test of
/// the store holds the two to each other.
pub fn empty_bucket(id: &str, customer: &Bson, prev: &str, wm: &BTreeMap<String, i64>) -> u64 {
    let wm_doc: u64 = wm.keys().map(|k| element(k.len() as u64, 8)).sum::<u64>() + 5;
    let fields = [
        element(3, string(id.len() as u64)),
        element(10, value_size(customer)),
        element(5, 8), // count
        element(3, 8), // cap
        element(8, 8), // capBytes
        element(5, 8), // bytes
        element(7, 5), // history: []
        element(7, 5), // tickers: []
        element(4, string(prev.len() as u64)),
        element(2, wm_doc),
    ];
    4 + fields.iter().sum::<u64>() + 1
}

/// A BSON element: type byte, name, NUL, value.
const fn element(name_len: u64, value_len: u64) -> u64 {
    1 + name_len + 1 + value_len
}

/// A BSON string value: length, bytes, NUL.
const fn string(len: u64) -> u64 {
    4 + len + 1
}

/// The encoded size of a `customerId` value: an int64 or a string as the
/// decoder makes them, or whatever another tool stored in the bucket it
/// is copied from.
fn value_size(value: &Bson) -> u64 {
    match value {
        Bson::Int64(_) | Bson::Double(_) => 8,
        Bson::Int32(_) => 4,
        Bson::String(s) => string(s.len() as u64),
        // `{v: value}` is 4 + (1 + 2 + value) + 1 bytes.
        other => bson::to_vec(&doc! {"v": other.clone()}).map_or(0, |v| v.len() as u64 - 8),
    }
}

#[cfg(test)]
mod tests {
    use mongodb::bson::Document;

    use super::*;
    use crate::bucket::plan::{Fill, Limits, NewBucket, Size};
    use crate::bucket::store::{bucket_document, fill_statement, head_from_document};

    #[test]
    fn a_bucket_below_its_cap_has_room_for_the_largest_trade() {
        assert_eq!(
            CAP_BYTES + MAX_ENTRY_BYTES + MAX_CHARGE_OVERHEAD,
            MAX_DOCUMENT_BYTES - SIZE_MARGIN
        );
        assert_eq!(MAX_CHARGE_OVERHEAD, 9 + 30 + 270);
        assert_eq!(CAP_BYTES, 7_864_011);
    }

    #[test]
    fn value_sizes_match_the_encoding() {
        for v in [
            Bson::Int64(5),
            Bson::Int32(5),
            Bson::String("c-7".into()),
            Bson::Null,
            Bson::Document(doc! {"a": [1, "x"]}),
        ] {
            let encoded = bson::to_vec(&doc! {"v": v.clone()}).unwrap().len() as u64;
            assert_eq!(value_size(&v), encoded - 8, "{v:?}");
        }
    }

    #[test]
    fn limits_are_read_back_and_absent_in_legacy_buckets() {
        let mut d = doc! {"_id": "5_0000000100", "customerId": 5_i64, "count": 2_i64,
        "history": [{"key": "a"}, {"key": "b"}], "wm": {"t:0": 17_i64}};
        // Written before buckets stored their limits.
        let h = head_from_document(&d).unwrap();
        assert_eq!((h.cap, h.size), (None, None));
        d.extend(doc! {"cap": 20_i64, "capBytes": 1_000_i32, "bytes": 700.0});
        let h = head_from_document(&d).unwrap();
        let size = Size {
            bytes: 700,
            cap_bytes: 1_000,
        };
        assert_eq!((h.cap, h.size), (Some(20), Some(size)));
    }

    /// `bytes` of a new bucket is the empty bucket's exact size plus the
    /// trades' charges (`empty_bucket` counts what this file writes).
    #[test]
    fn a_new_bucket_stores_its_limits_and_its_size_bound() {
        let wm: BTreeMap<String, i64> = [("trades:0".to_string(), 7), ("t~x:12".into(), 1)].into();
        for customer in [Bson::Int64(5), Bson::String("c-7".into()), Bson::Int32(5)] {
            let (id, prev) = ("5_0000000100_000001", "5_0000000100");
            let bytes = empty_bucket(id, &customer, prev, &wm);
            let bucket = NewBucket {
                id: id.into(),
                prev: prev.into(),
                customer,
                events: Vec::new(),
                wm: wm.clone(),
                limits: Limits::with_capacity(10),
                bytes,
            };
            let d = bucket_document(&bucket, &[]);
            assert_eq!(d.as_bytes().len() as u64, bytes);
            let h = head_from_document(&d.to_document().unwrap()).unwrap();
            let size = Size {
                bytes,
                cap_bytes: CAP_BYTES,
            };
            assert_eq!((h.cap, h.size), (Some(10), Some(size)));
        }
    }

    #[test]
    fn fills_advance_bytes_only_of_buckets_that_have_it() {
        let fill = |bytes| Fill {
            bucket_id: "5_0000000100".into(),
            expected_count: 3,
            events: Vec::new(),
            wm: BTreeMap::new(),
            bytes,
        };
        let inc = |f: &Fill| -> Document {
            let s = fill_statement(f, &[], None).to_document().unwrap();
            s.get_document("u")
                .unwrap()
                .get_document("$inc")
                .unwrap()
                .clone()
        };
        assert_eq!(
            inc(&fill(Some(120))),
            doc! {"count": 0_i64, "bytes": 120_i64}
        );
        assert_eq!(inc(&fill(None)), doc! {"count": 0_i64});
    }
}
