//! Decoding one payload: the JSON object read field by field (each value
//! kept as its raw text), the trade's own fields parsed (see `values`), the
//! other fields kept as they are, after the checks that keep a bucket
//! storable (field names, nesting depth, the entry's size).

use compact_str::CompactString;
use mongodb::bson::spec::ElementType;
use mongodb::bson::{Bson, Decimal128, Document, RawBson, RawDocumentBuf};

use super::pointer::{self, LevelError, Members};
use super::values::*;
use super::*;

/// The payload as text, if it is present, within the limit and UTF-8.
pub(super) fn payload_text(payload: Option<&[u8]>, max_bytes: usize) -> Result<&str, Reject> {
    let bytes = match payload {
        None => return Err(Reject::new(RejectKind::Empty, "message has no payload")),
        Some([]) => return Err(Reject::new(RejectKind::Empty, "payload is empty")),
        Some(b) => b,
    };
    check_payload_len(bytes.len(), max_bytes)?;
    std::str::from_utf8(bytes)
        .map_err(|e| Reject::new(RejectKind::NotUtf8, format!("payload is not UTF-8 ({e})")))
}

/// A payload (or a binary payload's JSON form) of `len` bytes is over
/// the limit: `oversize`.
pub fn check_payload_len(len: usize, max_bytes: usize) -> Result<(), Reject> {
    if len > max_bytes {
        return Err(Reject::new(
            RejectKind::Oversize,
            format!("payload is {len} bytes, limit is {max_bytes}"),
        ));
    }
    Ok(())
}

/// The fields of one trade as they are read, each checked on its own.
#[derive(Default)]
pub(super) struct TradeFields {
    pub(super) trade_id: Option<TradeId>,
    pub(super) customer: Option<CustomerId>,
    pub(super) side: Option<&'static str>,
    pub(super) ticker: Option<CompactString>,
    pub(super) qty: Option<Qty>,
    pub(super) price: Option<Decimal128>,
    pub(super) currency: Option<Currency>,
    pub(super) date: Option<(i64, Option<i32>)>,
    /// Fields of no meaning to us, kept as they are. Made at the first, so
    /// never empty: an empty `Document` costs a hasher's random seed (its
    /// map's), and nearly every trade has no extras.
    pub(super) extras: Option<Document>,
}

impl TradeFields {
    /// Reads one top-level field (`raw` is its JSON text).
    pub(super) fn read(&mut self, name: &str, raw: &str) -> Result<(), Reject> {
        match name {
            "tradeId" => self.trade_id = Some(parse_trade_id(raw)?),
            "customerId" => self.customer = Some(parse_customer(raw)?),
            "type" => self.side = Some(parse_side(raw)?),
            "ticker" => self.ticker = Some(parse_ticker(raw)?),
            "qty" | "quantity" if self.qty.is_some() => {
                return Err(Reject::new(
                    RejectKind::DuplicateField,
                    "both qty and quantity are present",
                ));
            }
            "qty" | "quantity" => self.qty = Some(parse_qty(raw)?),
            "price" if raw != "null" => self.price = Some(parse_price(raw)?),
            "currency" if raw != "null" => self.currency = Some(parse_currency(raw)?),
            "price" | "currency" => {}
            "date" => self.date = Some(parse_date(raw)?),
            other => self.read_extra(other, raw)?,
        }
        Ok(())
    }

    pub(super) fn read_extra(&mut self, name: &str, raw: &str) -> Result<(), Reject> {
        if DERIVED_FIELDS.contains(&name) {
            return Err(field_err(name, "is reserved for a derived field"));
        }
        check_field_name(name)?;
        let value: serde_json::Value = serde_json::from_str(raw)
            .map_err(|e| Reject::new(RejectKind::NotJson, e.to_string()))?;
        check_nested_names(&value, name)?;
        let value = Bson::try_from(value).map_err(|e| field_err(name, &e.to_string()))?;
        self.extras
            .get_or_insert_with(Document::new)
            .insert(name.to_string(), value);
        Ok(())
    }

    /// The trade, once every required field is there.
    pub(super) fn into_trade(self, identity: Identity<'_>) -> Result<Trade, Reject> {
        let missing = |f: &str| Reject::new(RejectKind::MissingField, format!("{f} is required"));
        let customer = self.customer.ok_or_else(|| missing("customerId"))?;
        let side = self.side.ok_or_else(|| missing("type"))?;
        let ticker = self.ticker.ok_or_else(|| missing("ticker"))?;
        let qty = self.qty.ok_or_else(|| missing("qty"))?;
        let (date_ms, offset_minutes) = self.date.ok_or_else(|| missing("date"))?;
        let (key, id, legacy_key) = match self.trade_id {
            Some(TradeId { key, int }) => (key, Some(int), None),
            None => (identity.key(), None, identity.legacy_key()),
        };
        let head = Head {
            id,
            side,
            ticker: &ticker,
            qty,
            price: self.price,
            currency: self.currency,
            date_ms,
            offset_minutes,
        };
        let doc = entry(&head, self.extras, &key)?;
        check_entry_size(&doc)?;
        Ok(Trade {
            key,
            legacy_key,
            customer,
            ticker,
            date_ms,
            doc,
        })
    }
}

/// The trade's own fields of a history entry, in the order stored.
struct Head<'a> {
    /// `Some(Some(i))`: an integer trade id; `Some(None)`: a text one (the
    /// key's text after `t:`); `None`: none.
    id: Option<Option<i64>>,
    side: &'static str,
    ticker: &'a str,
    qty: Qty,
    price: Option<Decimal128>,
    currency: Option<Currency>,
    date_ms: i64,
    offset_minutes: Option<i32>,
}

impl Head<'_> {
    /// The size of the entry these fields and `key` make without extras,
    /// so that its buffer is allocated once, at its size.
    fn len(&self, key: &str) -> usize {
        let element = |name: &str, size: usize| 1 + name.len() + 1 + size;
        let string = |name: &str, value: &str| element(name, 4 + value.len() + 1);
        let id = match self.id {
            Some(Some(_)) => element("tradeId", 8),
            Some(None) => string("tradeId", id_text(key)),
            None => 0,
        };
        let qty = match self.qty {
            Qty::Int(_) => 8,
            Qty::Decimal(_) => 16,
        };
        4 + id
            + string("type", self.side)
            + string("ticker", self.ticker)
            + element("qty", qty)
            + self.price.map_or(0, |_| element("price", 16))
            + self.currency.map_or(0, |c| string("currency", c.as_str()))
            + element("date", 8)
            + self
                .offset_minutes
                .map_or(0, |_| element("offsetMinutes", 4))
            + string("key", key)
            + 1
    }

    fn write(&self, w: &mut EntryWriter, key: &str) {
        match self.id {
            Some(Some(i)) => w.int64("tradeId", i),
            Some(None) => w.string("tradeId", id_text(key)),
            None => {}
        }
        w.string("type", self.side);
        w.string("ticker", self.ticker);
        match self.qty {
            Qty::Int(i) => w.int64("qty", i),
            Qty::Decimal(d) => w.decimal128("qty", d),
        }
        if let Some(p) = self.price {
            w.decimal128("price", p);
        }
        if let Some(c) = self.currency {
            w.string("currency", c.as_str());
        }
        w.datetime("date", self.date_ms);
        if let Some(minutes) = self.offset_minutes {
            w.int32("offsetMinutes", minutes);
        }
    }
}

/// A text trade id, as its key (`t:<id>`) holds it.
fn id_text(key: &str) -> &str {
    key.get(2..).unwrap_or_default()
}

/// The history entry: the trade's fields, its extras, its key. Encoded
/// field by field, straight into the bytes the writer sends: a `Document`
/// first (a map of boxed values) and then its encoding cost an allocation
/// per field and a second pass, per event.
fn entry(head: &Head<'_>, extras: Option<Document>, key: &str) -> Result<RawDocumentBuf, Reject> {
    let mut w = EntryWriter::with_capacity(head.len(key));
    head.write(&mut w, key);
    let Some(extras) = extras else {
        w.string("key", key);
        return w.finish();
    };
    // Every name appended is an extra's, which `check_field_name` keeps
    // free of NUL (the one thing `append` refuses, by panicking).
    let mut doc = w.finish()?;
    for (name, value) in extras {
        doc.append(name, raw_value(value)?);
    }
    doc.append("key", key);
    Ok(doc)
}

/// A BSON document written element by element, byte for byte as
/// `RawDocumentBuf::append` writes them, without its per-element checks
/// and growth: the names are ours (no NUL) and the buffer is sized first.
struct EntryWriter(Vec<u8>);

impl EntryWriter {
    fn with_capacity(len: usize) -> Self {
        let mut bytes = Vec::with_capacity(len);
        // The length, filled in by `finish`.
        bytes.extend_from_slice(&[0; 4]);
        EntryWriter(bytes)
    }

    fn element(&mut self, kind: ElementType, name: &str) {
        self.0.push(kind as u8);
        self.0.extend_from_slice(name.as_bytes());
        self.0.push(0);
    }

    fn string(&mut self, name: &str, value: &str) {
        self.element(ElementType::String, name);
        self.0
            .extend_from_slice(&(value.len() as i32 + 1).to_le_bytes());
        self.0.extend_from_slice(value.as_bytes());
        self.0.push(0);
    }

    fn int32(&mut self, name: &str, value: i32) {
        self.element(ElementType::Int32, name);
        self.0.extend_from_slice(&value.to_le_bytes());
    }

    fn int64(&mut self, name: &str, value: i64) {
        self.element(ElementType::Int64, name);
        self.0.extend_from_slice(&value.to_le_bytes());
    }

    fn decimal128(&mut self, name: &str, value: Decimal128) {
        self.element(ElementType::Decimal128, name);
        self.0.extend_from_slice(&value.bytes());
    }

    fn datetime(&mut self, name: &str, ms: i64) {
        self.element(ElementType::DateTime, name);
        self.0.extend_from_slice(&ms.to_le_bytes());
    }

    /// The document: its trailing NUL and its length written.
    fn finish(mut self) -> Result<RawDocumentBuf, Reject> {
        self.0.push(0);
        let len = (self.0.len() as i32).to_le_bytes();
        self.0[..4].copy_from_slice(&len);
        RawDocumentBuf::from_bytes(self.0).map_err(|e| {
            Reject::new(
                RejectKind::InvalidField,
                format!("the trade cannot be encoded as BSON: {e}"),
            )
        })
    }
}

/// A value as encoded BSON. Cannot fail for what the checks let through
/// (no NUL in names), but an encoding error is bad input, not a reason to
/// panic.
pub(super) fn raw_value(value: Bson) -> Result<RawBson, Reject> {
    RawBson::try_from(value).map_err(|e| {
        Reject::new(
            RejectKind::InvalidField,
            format!("the trade cannot be encoded as BSON: {e}"),
        )
    })
}

/// A trade whose history entry is larger than any bucket can take would
/// be refused by MongoDB in every bucket; BSON can be several times the
/// JSON (an array of small numbers: 2 bytes each in JSON, 7 to 12 in BSON),
/// so `kafka.max_message_bytes` alone does not bound it.
pub(super) fn check_entry_size(doc: &RawDocumentBuf) -> Result<(), Reject> {
    let len = doc.as_bytes().len() as u64;
    if len > MAX_ENTRY_BYTES {
        return Err(Reject::new(
            RejectKind::Oversize,
            format!(
                "the trade is {len} bytes of BSON as stored, limit is {MAX_ENTRY_BYTES}: \
                 no bucket can take it"
            ),
        ));
    }
    Ok(())
}

/// The top-level object as (name, raw JSON) pairs in input order, refusing
/// duplicate names. Names are borrowed from the payload unless escaped, and
/// duplicates are found without hashing in objects of a trade's size
/// (`pointer::object`, which a mapping's levels are read by too).
pub(super) fn parse_object(text: &str) -> Result<Members<'_>, Reject> {
    pointer::object(text).map_err(|e| match e {
        LevelError::Duplicate(m) => Reject::new(RejectKind::DuplicateField, m),
        // A valid JSON value that is not an object.
        LevelError::NotObject(m) => Reject::new(
            RejectKind::NotObject,
            format!("payload must be a JSON object ({m})"),
        ),
        LevelError::Syntax(m) => Reject::new(RejectKind::NotJson, m),
    })
}

/// MongoDB cannot take `$`-prefixed or dotted names inside an update's
/// pushed values portably; reject rather than store something unqueryable.
pub(super) fn check_field_name(name: &str) -> Result<(), Reject> {
    if name.is_empty() || name.starts_with('$') || name.contains('.') || name.contains('\0') {
        return Err(field_err(
            &format!("{name:?}"),
            "field names must be non-empty and contain no '$' prefix, '.' or NUL",
        ));
    }
    Ok(())
}

/// MongoDB stores documents nested at most 100 levels deep, counting every
/// object and array, the document itself included. A trade's extra field
/// sits at level 4 (bucket, `history` array, entry, field value), so its
/// value may hold at most this many levels of objects and arrays. Deeper
/// would pass here and be refused by the server for the whole write.
pub const MAX_EXTRA_NESTING: usize = 97;

/// Checks the names inside an extra field's value, and its depth.
pub(super) fn check_nested_names(value: &serde_json::Value, path: &str) -> Result<(), Reject> {
    check_nested(value, path, 0)
}

/// `depth`: the objects and arrays around `value` inside the extra field.
pub(super) fn check_nested(
    value: &serde_json::Value,
    path: &str,
    depth: usize,
) -> Result<(), Reject> {
    let is_container = matches!(
        value,
        serde_json::Value::Object(_) | serde_json::Value::Array(_)
    );
    if is_container && depth + 1 > MAX_EXTRA_NESTING {
        return Err(field_err(
            path,
            &format!("nests more than {MAX_EXTRA_NESTING} levels of objects and arrays, deeper than MongoDB stores"),
        ));
    }
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                check_field_name(k).map_err(|_| {
                    field_err(
                        &format!("{path}.{k}"),
                        "field names must be non-empty and contain no '$' prefix, '.' or NUL",
                    )
                })?;
                check_nested(v, &format!("{path}.{k}"), depth + 1)?;
            }
            Ok(())
        }
        serde_json::Value::Array(items) => items
            .iter()
            .try_for_each(|v| check_nested(v, path, depth + 1)),
        _ => Ok(()),
    }
}
