//! Decoding one payload: the JSON object read field by field (each value
//! kept as its raw text), the trade's own fields parsed (see `values`), the
//! other fields kept as they are, after the checks that keep a bucket
//! storable (field names, nesting depth, the entry's size).

use std::collections::HashSet;
use std::fmt;

use mongodb::bson::{self, Bson, Decimal128, Document, RawBson, RawDocumentBuf};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::values::*;
use super::*;

/// The payload as text, if it is present, within the limit and UTF-8.
pub(super) fn payload_text(payload: Option<&[u8]>, max_bytes: usize) -> Result<&str, Reject> {
    let bytes = match payload {
        None => return Err(Reject::new(RejectKind::Empty, "message has no payload")),
        Some([]) => return Err(Reject::new(RejectKind::Empty, "payload is empty")),
        Some(b) => b,
    };
    if bytes.len() > max_bytes {
        return Err(Reject::new(
            RejectKind::Oversize,
            format!("payload is {} bytes, limit is {max_bytes}", bytes.len()),
        ));
    }
    std::str::from_utf8(bytes)
        .map_err(|e| Reject::new(RejectKind::NotUtf8, format!("payload is not UTF-8 ({e})")))
}

/// The fields of one trade as they are read, each checked on its own.
#[derive(Default)]
pub(super) struct TradeFields {
    pub(super) trade_id: Option<(Bson, String)>,
    pub(super) customer: Option<CustomerId>,
    pub(super) side: Option<String>,
    pub(super) ticker: Option<String>,
    pub(super) qty: Option<Bson>,
    pub(super) price: Option<Decimal128>,
    pub(super) currency: Option<String>,
    pub(super) date: Option<(i64, Option<i32>)>,
    /// Fields of no meaning to us, kept as they are.
    pub(super) extras: Document,
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
        self.extras.insert(name.to_string(), value);
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
        let key = match &self.trade_id {
            Some((_, text)) => format!("t:{text}"),
            None => identity.key(),
        };
        // Encoded field by field, straight into the bytes the writer sends:
        // a `Document` first (a map of boxed values) and then its encoding
        // cost an allocation per field and a second pass, per event. Every
        // name appended is one of ours or an extra's, which
        // `check_field_name` keeps free of NUL (the one thing `append`
        // refuses, by panicking).
        let mut doc = RawDocumentBuf::new();
        if let Some((value, _)) = self.trade_id {
            doc.append("tradeId", raw_value(value)?);
        }
        doc.append("type", side);
        doc.append("ticker", ticker.as_str());
        doc.append("qty", raw_value(qty)?);
        if let Some(p) = self.price {
            doc.append("price", p);
        }
        if let Some(c) = self.currency {
            doc.append("currency", c);
        }
        doc.append("date", bson::DateTime::from_millis(date_ms));
        if let Some(minutes) = offset_minutes {
            doc.append("offsetMinutes", minutes);
        }
        for (name, value) in self.extras {
            doc.append(name, raw_value(value)?);
        }
        doc.append("key", key.as_str());
        check_entry_size(&doc)?;
        Ok(Trade {
            key,
            customer,
            ticker,
            date_ms,
            doc,
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
/// duplicate names.
pub(super) fn parse_object(text: &str) -> Result<Vec<(String, &RawValue)>, Reject> {
    struct Fields<'a>(Vec<(String, &'a RawValue)>);

    impl<'de> Deserialize<'de> for Fields<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Fields<'de>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                    let mut out = Vec::new();
                    let mut seen = HashSet::new();
                    while let Some(name) = map.next_key::<String>()? {
                        if !seen.insert(name.clone()) {
                            return Err(serde::de::Error::custom(format!(
                                "duplicate field {name:?}"
                            )));
                        }
                        out.push((name, map.next_value::<&'de RawValue>()?));
                    }
                    Ok(Fields(out))
                }
            }
            d.deserialize_map(V)
        }
    }

    // A valid JSON value that is not an object reaches the visitor as the
    // wrong type (a data error); anything unparseable is a syntax/EOF error.
    match serde_json::from_str::<Fields<'_>>(text) {
        Ok(f) => Ok(f.0),
        Err(e) if e.is_data() && e.to_string().starts_with("duplicate field") => {
            Err(Reject::new(RejectKind::DuplicateField, e.to_string()))
        }
        Err(e) if e.is_data() => Err(Reject::new(
            RejectKind::NotObject,
            format!("payload must be a JSON object ({e})"),
        )),
        Err(e) => Err(Reject::new(RejectKind::NotJson, e.to_string())),
    }
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
