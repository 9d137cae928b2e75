//! The trade event: decoding and validating one Kafka payload (JSON) into a
//! [`Trade`] ready to be stored. Pure: no I/O, every rejection typed. This
//! file holds the types and the entry points; `decode` reads the object,
//! `values` parses each of the trade's fields. A topic with a mapping
//! (`[[mappings]]`) is read by `mapping` (its pointers walked by `pointer`,
//! its date formats read by `dates`) into the same fields and the same
//! checks; `replay` decodes a whole record as the worker does (a replayed
//! dead letter under its original identity); `sample` shows what a payload
//! would become.
//!
//! Money and quantities never pass through a binary float: the JSON text of
//! a number is kept as written (`RawValue`) and parsed exactly into
//! Decimal128 or an integer, as the MongoDB manual's monetary-data page asks.

use std::fmt;

use compact_str::CompactString;
use mongodb::bson::{self, Bson, Document, RawDocumentBuf};

/// Latest instant whose epoch seconds still have ten digits. Bucket `_id`s
/// carry ten zero-padded digits so that string order is time order; a later
/// date would break `sort({_id: 1})`.
pub const MAX_EPOCH_SECONDS: i64 = 9_999_999_999;

/// Longest ticker symbol; also bounds what a trade adds to a bucket's
/// `tickers` (see `bucket::size`).
pub const MAX_TICKER_LEN: usize = 16;

/// The largest history entry (one trade as stored, in BSON) the decoder
/// admits; a larger trade is dead-lettered (`oversize`): no bucket could
/// take it. Lowering it is always safe; raising it is not, because buckets
/// opened earlier close at a `capBytes` computed for the old limit
/// (`bucket::size`).
pub const MAX_ENTRY_BYTES: u64 = 8 * 1024 * 1024;

/// Why an event was rejected. The kind is the dead-letter header value and
/// the metric label, so the set is closed and stable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectKind {
    /// The payload is larger than `kafka.max_message_bytes`, or the trade
    /// as stored (BSON) is larger than any bucket can take
    /// ([`MAX_ENTRY_BYTES`]).
    Oversize,
    /// No payload at all (a tombstone or an empty message).
    Empty,
    /// The payload is not UTF-8.
    NotUtf8,
    /// The payload is not JSON.
    NotJson,
    /// The JSON is not an object.
    NotObject,
    /// The same field appears twice: which one was meant is unknowable.
    DuplicateField,
    /// A required field is absent.
    MissingField,
    /// A field has the wrong type or an out-of-range value.
    InvalidField,
    /// The trade id is already stored for another customer.
    TradeIdConflict,
    /// MongoDB refused the document permanently (validation, size).
    Rejected,
    /// An Avro or Protobuf topic's record is not in the Confluent wire
    /// format (no magic byte, a truncated header), or its bytes do not
    /// decode by the schema they name.
    InvalidFormat,
    /// The schema id a record names does not exist in the registry (404).
    UnknownSchema,
    /// The registry's answer for the record's schema id is not a schema
    /// this worker can read (the message names the id).
    InvalidSchema,
}

impl RejectKind {
    pub const ALL: [RejectKind; 13] = [
        RejectKind::Oversize,
        RejectKind::Empty,
        RejectKind::NotUtf8,
        RejectKind::NotJson,
        RejectKind::NotObject,
        RejectKind::DuplicateField,
        RejectKind::MissingField,
        RejectKind::InvalidField,
        RejectKind::TradeIdConflict,
        RejectKind::Rejected,
        RejectKind::InvalidFormat,
        RejectKind::UnknownSchema,
        RejectKind::InvalidSchema,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RejectKind::Oversize => "oversize",
            RejectKind::Empty => "empty",
            RejectKind::NotUtf8 => "not_utf8",
            RejectKind::NotJson => "not_json",
            RejectKind::NotObject => "not_object",
            RejectKind::DuplicateField => "duplicate_field",
            RejectKind::MissingField => "missing_field",
            RejectKind::InvalidField => "invalid_field",
            RejectKind::TradeIdConflict => "trade_id_conflict",
            RejectKind::Rejected => "rejected_by_database",
            RejectKind::InvalidFormat => "invalid_format",
            RejectKind::UnknownSchema => "unknown_schema",
            RejectKind::InvalidSchema => "invalid_schema",
        }
    }
}

impl fmt::Display for RejectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rejected event: the kind and a message naming the field and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct Reject {
    pub kind: RejectKind,
    pub message: String,
}

impl Reject {
    pub fn new(kind: RejectKind, message: impl Into<String>) -> Self {
        Reject {
            kind,
            message: message.into(),
        }
    }
}

fn field_err(field: &str, rule: &str) -> Reject {
    Reject::new(RejectKind::InvalidField, format!("{field}: {rule}"))
}

/// A customer's identity. `123` and `"123"` are one customer (they share
/// one `_id` prefix), so a decoded id is always in its
/// [canonical](CustomerId::canonical) form: an integer written as text is
/// the integer. Other text ids stay text.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CustomerId {
    Int(i64),
    Str(String),
}

impl CustomerId {
    /// The id as text: how it is shown, and the customer part of its
    /// buckets' `_id` (see [`crate::bucket::id::Prefix`]).
    pub fn id_text(&self) -> String {
        match self {
            CustomerId::Int(i) => i.to_string(),
            CustomerId::Str(s) => s.clone(),
        }
    }

    pub fn to_bson(&self) -> Bson {
        match self {
            CustomerId::Int(i) => Bson::Int64(*i),
            CustomerId::Str(s) => Bson::String(s.clone()),
        }
    }

    /// Parses the `--customer` argument of the CLI: digits are an integer id.
    pub fn parse_cli(text: &str) -> Result<CustomerId, Reject> {
        let id = match integer_text(text) {
            Some(i) => CustomerId::Int(i),
            None => CustomerId::Str(text.to_string()),
        };
        validate_customer(&id)?;
        Ok(id)
    }

    /// The one value per `_id` prefix: a text id that is an integer written
    /// plainly (`"123"`) becomes the integer, as the CLI reads it. Every
    /// decoded id is in this form: the writer groups a batch by it, and in
    /// sharded mode the shard key and the customer-scoped unique indexes
    /// tell `123` from `"123"` while their buckets share one `_id` prefix.
    pub fn canonical(&self) -> CustomerId {
        match self {
            CustomerId::Str(s) => match integer_text(s) {
                Some(i) => CustomerId::Int(i),
                None => self.clone(),
            },
            CustomerId::Int(_) => self.clone(),
        }
    }
}

/// `text` as a non-negative integer if it is one written plainly: digits
/// only, no sign, no leading zero, within Int64. Exactly the texts an
/// integer id prints as, so `Int(i).id_text()` reads back as `i`.
fn integer_text(text: &str) -> Option<i64> {
    let plain = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && !(text.len() > 1 && text.starts_with('0'));
    if plain {
        text.parse().ok()
    } else {
        None
    }
}

fn validate_customer(id: &CustomerId) -> Result<(), Reject> {
    match id {
        CustomerId::Int(i) if *i < 0 => Err(field_err("customerId", "must not be negative")),
        CustomerId::Int(_) => Ok(()),
        CustomerId::Str(s) => validate_customer_text(s),
    }
}

/// The rules of a text customer id, checked before it is owned.
fn validate_customer_text(s: &str) -> Result<(), Reject> {
    if s.is_empty() || s.len() > 64 {
        return Err(field_err("customerId", "must have 1 to 64 characters"));
    }
    if !s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        // `_` in particular: see `bucket::id` for why a bucket `_id`
        // depends on it.
        return Err(field_err(
            "customerId",
            "may only contain A-Z, a-z, 0-9 and '-'",
        ));
    }
    Ok(())
}

/// Where a message came from; the fallback identity of a trade without
/// `tradeId` and the key of the applied-offset watermark.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Source {
    pub topic: std::sync::Arc<str>,
    pub partition: i32,
    pub offset: i64,
}

impl Source {
    /// The watermark key of this source's partition. Field names in MongoDB
    /// update paths may not contain '.', which topic names may; '~' is not
    /// legal in topic names, so the mapping stays one-to-one.
    pub fn partition_key(&self) -> String {
        use std::fmt::Write;
        // One allocation: planning asks for it several times per event.
        let mut key = String::with_capacity(self.topic.len() + 12);
        key.extend(self.topic.chars().map(|c| if c == '.' { '~' } else { c }));
        // Writing to a String cannot fail.
        let _ = write!(key, ":{}", self.partition);
        key
    }

    /// Whether `key` is [`Source::partition_key`], without building it:
    /// planning asks for each event's key in a bucket's watermarks
    /// several times, and building a `String` for each was a fifth of
    /// planning's cost (docs/benchmarks.md, "Hot path").
    pub fn is_partition_key(&self, key: &str) -> bool {
        let (key, topic) = (key.as_bytes(), self.topic.as_bytes());
        // The same length as the one spelling `partition_key` writes, so
        // "+3" or "03" (longer than "3") are not it.
        if key.len() != self.partition_key_len() {
            return false;
        }
        let (name, rest) = key.split_at(topic.len());
        let Some((b':', digits)) = rest.split_first() else {
            return false;
        };
        // A topic without a '.' is its own key text: one memcmp.
        let dotted = |(&k, &t): (&u8, &u8)| k == if t == b'.' { b'~' } else { t };
        let named = if topic.contains(&b'.') {
            name.iter().zip(topic).all(dotted)
        } else {
            name == topic
        };
        named && is_number(digits, self.partition)
    }

    /// `partition_key().len()`, without building it ('~' replaces '.'
    /// byte for byte).
    pub fn partition_key_len(&self) -> usize {
        let digits = self.partition.unsigned_abs().checked_ilog10().unwrap_or(0) as usize + 1;
        self.topic.len() + 1 + usize::from(self.partition < 0) + digits
    }
}

/// Whether `text` is `n` in decimal: an optional '-', then digits (the
/// caller has checked the length, so no sign or zero is extra).
fn is_number(text: &[u8], n: i32) -> bool {
    let (negative, digits) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    // At most 10 digits (the length check), so no overflow in a u64.
    let value = digits.iter().try_fold(0u64, |v, &b| {
        b.is_ascii_digit().then(|| v * 10 + u64::from(b - b'0'))
    });
    !digits.is_empty() && negative == (n < 0) && value == Some(u64::from(n.unsigned_abs()))
}

/// A valid trade, ready to be appended to its customer's bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct Trade {
    /// The dedup identity: `t:<tradeId>`, or without one
    /// `o:<topic>/<partition>/<offset>` of the position it was first read
    /// at (for a replay, the position `tradebucket.replay.of` names, so a
    /// replay and its original are one trade to the unique index).
    /// Stored as `history.key` under a unique index. Inline up to 24
    /// bytes (`t:` and an id of up to 22), as the ticker is: the write
    /// stage reads both for every event, and a block of their own was an
    /// allocation each and a cache miss each (docs/benchmarks.md,
    /// "Session 35").
    pub key: CompactString,
    /// The key an earlier version stored this trade under, if it had
    /// another: `r:<original position>` for a replay without `tradeId`
    /// (before replays took their original's `o:` key). The writer looks
    /// it up, so a trade replayed before an upgrade is not stored again.
    pub legacy_key: Option<String>,
    pub customer: CustomerId,
    pub ticker: CompactString,
    /// UTC milliseconds since the epoch.
    pub date_ms: i64,
    /// The history entry as stored (includes `key`), already encoded: the
    /// writer copies these bytes into its commands as they are, and they
    /// take a fraction of the memory of a `Document` (a map of boxed
    /// values), which is what a batch's memory is made of.
    pub doc: RawDocumentBuf,
}

impl Trade {
    /// The history entry as a `Document`, for reading it field by field.
    pub fn entry(&self) -> Result<Document, bson::raw::Error> {
        self.doc.to_document()
    }

    pub fn epoch_seconds(&self) -> i64 {
        self.date_ms.div_euclid(1000)
    }
}

/// Fields the decoder derives; an input field of the same name would be
/// ambiguous, so it is rejected rather than silently overwritten.
const DERIVED_FIELDS: [&str; 2] = ["key", "offsetMinutes"];

/// Decodes one payload. `max_bytes` is `kafka.max_message_bytes`.
pub fn decode(payload: Option<&[u8]>, source: &Source, max_bytes: usize) -> Result<Trade, Reject> {
    decode_as(payload, Identity::Read(source), max_bytes)
}

/// Where a trade without `tradeId` takes its identity from.
#[derive(Debug, Clone, Copy)]
pub enum Identity<'a> {
    /// The position it was read at: `o:<topic>/<partition>/<offset>`.
    Read(&'a Source),
    /// The original position of a replayed record (header
    /// `tradebucket.replay.of`): `o:<topic>/<partition>/<offset>`, the
    /// original's own key, so that the unique key index stores a replay
    /// and its original once, whichever is read first (a replay of a record
    /// not yet handled, or of a dead letter whose record was stored after
    /// all). Before, replays had a namespace of their own (`r:`), and both
    /// were stored (issue #46); that key is the trade's `legacy_key`.
    ReplayOf(&'a Source),
}

impl Identity<'_> {
    fn key(self) -> CompactString {
        let s = match self {
            Identity::Read(s) | Identity::ReplayOf(s) => s,
        };
        position_key("o", s).into()
    }

    /// The key a version before issue #46 stored a replay under.
    fn legacy_key(self) -> Option<String> {
        match self {
            Identity::Read(_) => None,
            Identity::ReplayOf(s) => Some(position_key("r", s)),
        }
    }
}

/// `<ns>:<topic>/<partition>/<offset>`.
fn position_key(ns: &str, s: &Source) -> String {
    use std::fmt::Write;
    // Sized once: namespace, separators, partition and offset take at
    // most 35 bytes ("o:", "/" twice, 11 and 20 digits with signs).
    let mut key = String::with_capacity(s.topic.len() + 35);
    // Writing to a String cannot fail.
    let _ = write!(key, "{ns}:{}/{}/{}", s.topic, s.partition, s.offset);
    key
}

/// [`decode`], with the identity of a trade without `tradeId` given.
pub fn decode_as(
    payload: Option<&[u8]>,
    identity: Identity<'_>,
    max_bytes: usize,
) -> Result<Trade, Reject> {
    let text = payload_text(payload, max_bytes)?;
    let mut fields = TradeFields::default();
    // The whole object is read before any field, on either path, so a
    // syntax error or a duplicate name wins over a bad field as before.
    match flat::members(text) {
        Some(members) => {
            for (name, raw) in members.iter() {
                fields.read(name, raw)?;
            }
        }
        None => {
            for (name, raw) in parse_object(text)? {
                fields.read(&name, raw.get())?;
            }
        }
    }
    fields.into_trade(identity)
}

pub mod avro;
mod dates;
mod decode;
mod flat;
pub mod mapping;
mod pointer;
pub mod protobuf;
mod replay;
mod sample;
mod values;
pub mod wire;

pub use decode::check_payload_len;
use decode::{parse_object, payload_text, TradeFields};
pub use mapping::{decode_mapped, Mapping, Mappings, RecordParts};
pub use replay::{decode_record, position_text, replay_origin, with_identity, H_REPLAY_OF};
pub use sample::{sample, sample_of};

#[cfg(test)]
mod tests;
