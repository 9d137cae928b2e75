//! Every customer's chain of buckets, checked by the test from the stored
//! documents against what docs/design.md promises ("The bucket document",
//! "Why the effect is exactly-once"), without the product's code: the
//! binary's `audit` checks the same things, and the verdict runs it too,
//! but a bug shared by the writer and the audit would pass that one.
//!
//! Per bucket: `_id` is `<customer>_<10-digit seconds>` or with a
//! `_<6-digit suffix>`, at the second of its first trade unless that does
//! not sort after its predecessor (then the predecessor's second and the
//! next suffix); `customerId` matches the `_id` and keeps one spelling
//! along the chain; `count` equals the history's length, between 1 and
//! `cap`; `cap` is a capacity some worker was given; `capBytes` is the
//! documented 7,864,011; `bytes` bounds the document's BSON size and stays
//! under 16 MiB - 512 KiB; `tickers` are the history's. Per chain: the
//! first bucket's `prev` is `<customer>_`, every later one's its
//! predecessor's `_id`; every bucket but the newest is full by its own
//! limits (count at `cap`, or `bytes` at `capBytes`), and took no trade
//! once full nor after its successor was opened (its watermarks within
//! the successor's). Across the collection: no trade key twice.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use mongodb::bson::{Bson, Document};

/// `capBytes` of every bucket this version opens (docs/design.md: 16 MiB
/// - 512 KiB - 8 MiB - 309).
pub const CAP_BYTES: i64 = 7_864_011;
/// What a bucket's size stays under, whatever its trades.
const MAX_BUCKET_BYTES: i64 = 16 * 1024 * 1024 - 512 * 1024;
/// The most a trade's charge adds to its entry besides the ticker and the
/// watermark key: the history element (type, seven index digits, NUL) and
/// the ticker element (type, seven index digits, NUL, the string's length
/// and NUL) and the watermark element (type, NUL, int64).
const CHARGE_FIXED: i64 = 9 + 9 + 5 + 1 + 1 + 8;

/// What the check found.
#[derive(Debug, Default)]
pub struct Chains {
    pub customers: usize,
    pub buckets: usize,
    /// Buckets followed by a successor, full by size below their `cap`.
    pub closed_by_size: usize,
    /// Buckets followed by a successor, full at their `cap`.
    pub closed_by_count: usize,
    /// Buckets per stored `cap`.
    pub caps: BTreeMap<i64, usize>,
    pub violations: Vec<String>,
}

impl Chains {
    fn violation(&mut self, v: String) {
        if self.violations.len() < 100 {
            self.violations.push(v);
        }
    }
}

/// What one bucket says, as read.
struct Bucket<'a> {
    id: &'a str,
    customer: &'a str,
    position: (i64, u32),
    /// The second of its first trade.
    first_secs: Option<i64>,
    spelling: Option<&'a Bson>,
    count: i64,
    cap: i64,
    bytes: i64,
    cap_bytes: i64,
    wm: BTreeMap<String, i64>,
    /// BSON length of the last history entry.
    last_entry: i64,
    /// Longest watermark key: bounds the last trade's charge.
    longest_wm_key: i64,
    longest_ticker: i64,
}

fn number(d: &Document, field: &str) -> Option<i64> {
    match d.get(field)? {
        Bson::Int32(n) => Some(i64::from(*n)),
        Bson::Int64(n) => Some(*n),
        _ => None,
    }
}

/// `<10 digits>` or `<10 digits>_<6 digits>` after the customer's `_`.
fn position(rest: &str) -> Option<(i64, u32)> {
    let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
    let (secs, suffix) = match rest.split_once('_') {
        Some((secs, suffix)) if digits(suffix, 6) => (secs, suffix.parse().ok()?),
        Some(_) => return None,
        None => (rest, 0),
    };
    digits(secs, 10).then(|| Some((secs.parse().ok()?, suffix)))?
}

/// Checks `buckets` (every bucket of the collection, in `_id` order)
/// against the capacities the workers were given.
pub fn check(buckets: &[Document], capacities: &BTreeSet<u32>) -> Chains {
    let mut out = Chains::default();
    let mut keys: HashSet<String> = HashSet::new();
    let mut before: Option<Bucket<'_>> = None;
    for d in buckets {
        out.buckets += 1;
        let Some(b) = read(d, capacities, &mut keys, &mut out) else {
            before = None;
            continue;
        };
        let prev = d.get_str("prev").unwrap_or("<none>");
        match before.take() {
            Some(p) if p.customer == b.customer => successor(&p, &b, prev, &mut out),
            _ => {
                out.customers += 1;
                if prev != format!("{}_", b.customer) {
                    out.violation(format!("{}: first of its customer, prev {prev}", b.id));
                }
                if b.first_secs.is_some_and(|secs| b.position != (secs, 0)) {
                    out.violation(format!(
                        "{}: its first trade is at {:?}",
                        b.id, b.first_secs
                    ));
                }
            }
        }
        before = Some(b);
    }
    out
}

/// One bucket on its own; `None` if its `_id` cannot be read.
fn read<'a>(
    d: &'a Document,
    capacities: &BTreeSet<u32>,
    keys: &mut HashSet<String>,
    out: &mut Chains,
) -> Option<Bucket<'a>> {
    let (id, customer, position) = id_parts(d, out)?;
    let spelling = d.get("customerId");
    let spelled = match spelling {
        Some(Bson::Int64(n)) => n.to_string(),
        Some(Bson::Int32(n)) => n.to_string(),
        Some(Bson::String(s)) => s.clone(),
        other => format!("{other:?}"),
    };
    if spelled != customer {
        out.violation(format!("{id}: customerId {spelled}"));
    }
    let history: Vec<&Document> = d
        .get_array("history")
        .map(|a| a.iter().filter_map(Bson::as_document).collect())
        .unwrap_or_default();
    let (count, cap, bytes, cap_bytes) = check_sizes(d, id, history.len(), capacities, out);
    let tickers = check_history(d, id, &history, keys, out);
    let first_secs = history
        .first()
        .and_then(|h| h.get_datetime("date").ok())
        .map(|t| t.timestamp_millis().div_euclid(1000));
    let wm: BTreeMap<String, i64> = d
        .get_document("wm")
        .map(|w| {
            w.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_i64()?)))
                .collect()
        })
        .unwrap_or_default();
    let b = Bucket {
        id,
        customer,
        position,
        first_secs,
        spelling,
        count,
        cap,
        bytes,
        cap_bytes,
        last_entry: history
            .last()
            .and_then(|h| mongodb::bson::to_vec(h).ok())
            .map_or(0, |v| v.len() as i64),
        longest_wm_key: wm.keys().map(|k| k.len() as i64).max().unwrap_or(0),
        longest_ticker: tickers.iter().map(|t| t.len() as i64).max().unwrap_or(0),
        wm,
    };
    took_while_below(&b, out);
    Some(b)
}

/// The `_id`, its customer and its position, or `None` (a violation)
/// when it is not `<customer>_<10 digits>[_<6 digits>]`.
fn id_parts<'a>(d: &'a Document, out: &mut Chains) -> Option<(&'a str, &'a str, (i64, u32))> {
    let Ok(id) = d.get_str("_id") else {
        out.violation(format!(
            "a bucket whose _id is not text: {:?}",
            d.get("_id")
        ));
        return None;
    };
    let Some((customer, rest)) = id.split_once('_') else {
        out.violation(format!("{id}: no '_' in the _id"));
        return None;
    };
    let Some(position) = position(rest) else {
        out.violation(format!("{id}: not <customer>_<10 digits>[_<6 digits>]"));
        return None;
    };
    Some((id, customer, position))
}

/// `count`, `cap`, `bytes` and `capBytes`, each checked against the
/// history, the workers' capacities and the BSON size.
fn check_sizes(
    d: &Document,
    id: &str,
    entries: usize,
    capacities: &BTreeSet<u32>,
    out: &mut Chains,
) -> (i64, i64, i64, i64) {
    let count = number(d, "count").unwrap_or(-1);
    let cap = number(d, "cap").unwrap_or(-1);
    let bytes = number(d, "bytes").unwrap_or(-1);
    let cap_bytes = number(d, "capBytes").unwrap_or(-1);
    *out.caps.entry(cap).or_default() += 1;
    if count != entries as i64 || count < 1 || count > cap {
        out.violation(format!(
            "{id}: count {count}, {entries} in history, cap {cap}"
        ));
    }
    if !u32::try_from(cap).is_ok_and(|c| capacities.contains(&c)) {
        out.violation(format!(
            "{id}: cap {cap}, no worker had it ({capacities:?})"
        ));
    }
    if cap_bytes != CAP_BYTES {
        out.violation(format!("{id}: capBytes {cap_bytes}"));
    }
    let size = mongodb::bson::to_vec(d).map_or(0, |v| v.len() as i64);
    if bytes < size || bytes >= MAX_BUCKET_BYTES {
        out.violation(format!("{id}: bytes {bytes}, its BSON size {size}"));
    }
    (count, cap, bytes, cap_bytes)
}

/// Every trade's key once in the whole collection, and the bucket's
/// `tickers` equal to its history's; returns those tickers.
fn check_history<'a>(
    d: &Document,
    id: &str,
    history: &[&'a Document],
    keys: &mut HashSet<String>,
    out: &mut Chains,
) -> BTreeSet<&'a str> {
    let mut tickers = BTreeSet::new();
    for h in history {
        match h.get_str("key") {
            Ok(k) if !keys.insert(k.to_string()) => {
                out.violation(format!("{id}: trade {k} stored twice"))
            }
            Ok(_) => {}
            Err(_) => out.violation(format!("{id}: a trade without key")),
        }
        tickers.extend(h.get_str("ticker").ok());
    }
    let stored: BTreeSet<&str> = d
        .get_array("tickers")
        .map(|a| a.iter().filter_map(Bson::as_str).collect())
        .unwrap_or_default();
    if stored != tickers {
        out.violation(format!("{id}: tickers {stored:?}, history {tickers:?}"));
    }
    tickers
}

/// The bucket took its last trade while below capBytes: what it holds
/// without that trade's charge (at most its entry and the fixed parts,
/// the longest ticker and watermark key) is below capBytes.
fn took_while_below(b: &Bucket<'_>, out: &mut Chains) {
    let charge = b.last_entry + CHARGE_FIXED + b.longest_ticker + b.longest_wm_key;
    if b.bytes - charge >= b.cap_bytes {
        out.violation(format!(
            "{}: bytes {} with a last trade of at most {charge}: it took a trade while full",
            b.id, b.bytes
        ));
    }
}

/// `b` follows `p`, of the same customer, and names `prev`.
fn successor(p: &Bucket<'_>, b: &Bucket<'_>, prev: &str, out: &mut Chains) {
    if prev != p.id {
        out.violation(format!(
            "{}: prev {prev}, the bucket before is {}",
            b.id, p.id
        ));
    }
    if p.count >= p.cap {
        out.closed_by_count += 1;
    } else if p.bytes >= p.cap_bytes {
        out.closed_by_size += 1;
    } else {
        out.violation(format!(
            "{}: not full ({} of cap {}, {} of {} bytes) but {} follows it",
            p.id, p.count, p.cap, p.bytes, p.cap_bytes, b.id
        ));
    }
    // At its first trade's second, unless that does not sort after the
    // predecessor: then the predecessor's second and the next suffix.
    let (secs, suffix) = p.position;
    let expected = match b.first_secs {
        Some(first) if first > secs => (first, 0),
        _ if suffix < 999_999 => (secs, suffix + 1),
        _ => (secs + 1, 0),
    };
    if b.position != expected || b.first_secs.is_none() {
        out.violation(format!(
            "{}: after {} with its first trade at second {:?}, expected at {expected:?}",
            b.id, p.id, b.first_secs
        ));
    }
    if p.spelling.map(Bson::element_type) != b.spelling.map(Bson::element_type) {
        out.violation(format!("{}: customerId spelled unlike {}", b.id, p.id));
    }
    for (partition, &offset) in &p.wm {
        if b.wm.get(partition).is_none_or(|&o| o < offset) {
            out.violation(format!(
                "{}: offset {offset} of {partition}, past its successor {}'s watermark",
                p.id, b.id
            ));
        }
    }
}
