//! The pre-optimisation decoder of the default schema (`decode_as` and
//! what it called in `decode` and `values`, as of d9a6252), kept verbatim
//! as the reference for the differential test (`differential`): for every
//! payload and identity, the optimised decoder must return the same
//! `Trade`, entry bytes included, or the same `Reject`, message included.
//! Only the shared types (`Trade`, `Reject`, `CustomerId`, ...) come from
//! the product; every function on the path is copied here, so changing
//! the product's cannot change the reference. Test-only; do not optimise.

#![allow(dead_code)]

use std::collections::HashSet;
use std::fmt;

use chrono::{DateTime, FixedOffset};
use mongodb::bson::{self, Bson, Decimal128, Document, RawBson, RawDocumentBuf};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::event::{
    CustomerId, Identity, Reject, RejectKind, Trade, DERIVED_FIELDS, MAX_ENTRY_BYTES,
    MAX_EPOCH_SECONDS, MAX_TICKER_LEN,
};

/// `event::decode_as`.
pub fn decode_as(
    payload: Option<&[u8]>,
    identity: Identity<'_>,
    max_bytes: usize,
) -> Result<Trade, Reject> {
    let text = payload_text(payload, max_bytes)?;
    let mut fields = TradeFields::default();
    for (name, raw) in &parse_object(text)? {
        fields.read(name, raw.get())?;
    }
    fields.into_trade(identity)
}

/// `Identity::key` and `Identity::legacy_key`.
fn identity_key(identity: Identity<'_>) -> (String, Option<String>) {
    let (replay, s) = match identity {
        Identity::Read(s) => (false, s),
        Identity::ReplayOf(s) => (true, s),
    };
    let position = format!("{}/{}/{}", s.topic, s.partition, s.offset);
    (
        format!("o:{position}"),
        replay.then(|| format!("r:{position}")),
    )
}

/// `event::field_err`.
fn field_err(field: &str, rule: &str) -> Reject {
    Reject::new(RejectKind::InvalidField, format!("{field}: {rule}"))
}

/// `event::integer_text`.
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

/// `CustomerId::canonical`.
fn canonical(id: &CustomerId) -> CustomerId {
    match id {
        CustomerId::Str(s) => match integer_text(s) {
            Some(i) => CustomerId::Int(i),
            None => id.clone(),
        },
        CustomerId::Int(_) => id.clone(),
    }
}

/// `event::validate_customer`.
fn validate_customer(id: &CustomerId) -> Result<(), Reject> {
    match id {
        CustomerId::Int(i) if *i < 0 => Err(field_err("customerId", "must not be negative")),
        CustomerId::Int(_) => Ok(()),
        CustomerId::Str(s) => {
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
    }
}

// ---- src/event/decode.rs, as it was ----

/// The payload as text, if it is present, within the limit and UTF-8.
fn payload_text(payload: Option<&[u8]>, max_bytes: usize) -> Result<&str, Reject> {
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
struct TradeFields {
    trade_id: Option<(Bson, String)>,
    customer: Option<CustomerId>,
    side: Option<String>,
    ticker: Option<String>,
    qty: Option<Bson>,
    price: Option<Decimal128>,
    currency: Option<String>,
    date: Option<(i64, Option<i32>)>,
    /// Fields of no meaning to us, kept as they are.
    extras: Document,
}

impl TradeFields {
    /// Reads one top-level field (`raw` is its JSON text).
    fn read(&mut self, name: &str, raw: &str) -> Result<(), Reject> {
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

    fn read_extra(&mut self, name: &str, raw: &str) -> Result<(), Reject> {
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
    fn into_trade(self, identity: Identity<'_>) -> Result<Trade, Reject> {
        let missing = |f: &str| Reject::new(RejectKind::MissingField, format!("{f} is required"));
        let customer = self.customer.ok_or_else(|| missing("customerId"))?;
        let side = self.side.ok_or_else(|| missing("type"))?;
        let ticker = self.ticker.ok_or_else(|| missing("ticker"))?;
        let qty = self.qty.ok_or_else(|| missing("qty"))?;
        let (date_ms, offset_minutes) = self.date.ok_or_else(|| missing("date"))?;
        let (key, legacy_key) = match &self.trade_id {
            Some((_, text)) => (format!("t:{text}"), None),
            None => identity_key(identity),
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
            key: key.into(),
            legacy_key,
            customer,
            ticker: ticker.into(),
            date_ms,
            doc,
        })
    }
}

/// A value as encoded BSON. Cannot fail for what the checks let through
/// (no NUL in names), but an encoding error is bad input, not a reason to
/// panic.
fn raw_value(value: Bson) -> Result<RawBson, Reject> {
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
fn check_entry_size(doc: &RawDocumentBuf) -> Result<(), Reject> {
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
fn parse_object(text: &str) -> Result<Vec<(String, &RawValue)>, Reject> {
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
fn check_field_name(name: &str) -> Result<(), Reject> {
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
const MAX_EXTRA_NESTING: usize = 97;

/// Checks the names inside an extra field's value, and its depth.
fn check_nested_names(value: &serde_json::Value, path: &str) -> Result<(), Reject> {
    check_nested(value, path, 0)
}

/// `depth`: the objects and arrays around `value` inside the extra field.
fn check_nested(value: &serde_json::Value, path: &str, depth: usize) -> Result<(), Reject> {
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

// ---- src/event/values.rs, as it was ----

fn parse_trade_id(raw: &str) -> Result<(Bson, String), Reject> {
    match serde_json::from_str::<serde_json::Value>(raw) {
        Ok(serde_json::Value::String(s)) => {
            if s.is_empty() || s.chars().count() > 128 {
                return Err(field_err("tradeId", "must have 1 to 128 characters"));
            }
            if s.chars().any(char::is_control) {
                return Err(field_err("tradeId", "must not contain control characters"));
            }
            Ok((Bson::String(s.clone()), s))
        }
        Ok(serde_json::Value::Number(n)) => match n.as_i64() {
            Some(i) if i >= 0 && is_json_integer(raw) => Ok((Bson::Int64(i), i.to_string())),
            _ => Err(field_err(
                "tradeId",
                "must be a string or a non-negative integer",
            )),
        },
        _ => Err(field_err(
            "tradeId",
            "must be a string or a non-negative integer",
        )),
    }
}

fn parse_customer(raw: &str) -> Result<CustomerId, Reject> {
    let id = match serde_json::from_str::<serde_json::Value>(raw) {
        Ok(serde_json::Value::String(s)) => CustomerId::Str(s),
        Ok(serde_json::Value::Number(n)) if is_json_integer(raw) => match n.as_i64() {
            Some(i) => CustomerId::Int(i),
            None => {
                return Err(field_err(
                    "customerId",
                    "integer is out of range (0 to 2^63-1)",
                ))
            }
        },
        _ => {
            return Err(field_err(
                "customerId",
                "must be a non-negative integer or a string",
            ))
        }
    };
    validate_customer(&id)?;
    // One customer, one identity, in every mode: `7` and `"7"` share one
    // `_id` prefix, so they must be one key to the writer too, or one batch
    // plans two "customers" against one bucket (docs/design.md, "One
    // spelling of a customer").
    Ok(canonical(&id))
}

fn parse_side(raw: &str) -> Result<String, Reject> {
    match serde_json::from_str::<String>(raw).as_deref() {
        Ok("buy") => Ok("buy".to_string()),
        Ok("sell") => Ok("sell".to_string()),
        _ => Err(field_err("type", "must be \"buy\" or \"sell\"")),
    }
}

fn parse_ticker(raw: &str) -> Result<String, Reject> {
    let s =
        serde_json::from_str::<String>(raw).map_err(|_| field_err("ticker", "must be a string"))?;
    if s.is_empty()
        || s.len() > MAX_TICKER_LEN
        || !s
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
    {
        return Err(field_err(
            "ticker",
            "must be 1 to 16 of A-Z, 0-9, '.' and '-'",
        ));
    }
    Ok(s)
}

fn parse_currency(raw: &str) -> Result<String, Reject> {
    let s = serde_json::from_str::<String>(raw)
        .map_err(|_| field_err("currency", "must be a string"))?;
    if s.len() != 3 || !s.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(field_err(
            "currency",
            "must be three letters A-Z (ISO 4217)",
        ));
    }
    Ok(s)
}

/// JSON number grammar (RFC 8259): what both `price` strings and numbers
/// must look like. Rules out NaN, Infinity, hex, '+', spaces and ".5".
fn is_json_number(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = 0;
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    match b.get(i) {
        Some(b'0') => i += 1,
        Some(c) if c.is_ascii_digit() => {
            while b.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
        }
        _ => return false,
    }
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == start {
            return false;
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == start {
            return false;
        }
    }
    i == b.len()
}

fn is_json_integer(raw: &str) -> bool {
    is_json_number(raw) && !raw.contains(['.', 'e', 'E'])
}

/// The decimal text of a number given as a JSON number or a JSON string.
fn decimal_text(raw: &str, field: &str) -> Result<String, Reject> {
    let text = if raw.starts_with('"') {
        serde_json::from_str::<String>(raw)
            .map_err(|_| field_err(field, "is not a valid string"))?
    } else {
        raw.to_string()
    };
    if !is_json_number(&text) {
        return Err(field_err(
            field,
            "must be a finite decimal number (no NaN, Infinity or exponent-only forms)",
        ));
    }
    Ok(text)
}

/// Exactly into Decimal128: more than 34 significant digits, or an exponent
/// out of range, is an error rather than a rounding.
pub(super) fn exact_decimal(text: &str, field: &str) -> Result<Decimal128, Reject> {
    text.parse::<Decimal128>().map_err(|e| {
        field_err(
            field,
            &format!(
                "cannot be represented exactly as Decimal128 ({e}; at most 34 significant digits)"
            ),
        )
    })
}

/// Whether the mantissa has a non-zero digit, so "-0.00" is zero, not negative.
fn mantissa_nonzero(text: &str) -> bool {
    let mantissa = text.split(['e', 'E']).next().unwrap_or("");
    mantissa.bytes().any(|b| (b'1'..=b'9').contains(&b))
}

fn parse_price(raw: &str) -> Result<Decimal128, Reject> {
    let text = decimal_text(raw, "price")?;
    if text.starts_with('-') && mantissa_nonzero(&text) {
        return Err(field_err("price", "must not be negative"));
    }
    exact_decimal(&text, "price")
}

/// `qty`: an integer is stored as Int64, a fraction as Decimal128; either
/// way exact, and strictly positive.
fn parse_qty(raw: &str) -> Result<Bson, Reject> {
    let text = decimal_text(raw, "qty")?;
    if text.starts_with('-') || !mantissa_nonzero(&text) {
        return Err(field_err("qty", "must be positive"));
    }
    if is_json_integer(&text) {
        return text
            .parse::<i64>()
            .map(Bson::Int64)
            .map_err(|_| field_err("qty", "integer is out of range"));
    }
    exact_decimal(&text, "qty").map(Bson::Decimal128)
}

/// RFC 3339 with `Z` or an offset, or epoch milliseconds. Returns UTC
/// milliseconds and, for a non-UTC offset, that offset in minutes east of
/// UTC (the manual's time-data page: keep the offset to rebuild local time).
fn parse_date(raw: &str) -> Result<(i64, Option<i32>), Reject> {
    let range_err = || {
        field_err(
            "date",
            "must be between 1970-01-01T00:00:00Z and 2286-11-20T17:46:39Z",
        )
    };
    let (ms, offset) = if raw.starts_with('"') {
        let s = serde_json::from_str::<String>(raw)
            .map_err(|_| field_err("date", "is not a valid string"))?;
        let dt: DateTime<FixedOffset> = DateTime::parse_from_rfc3339(&s).map_err(|e| {
            field_err(
                "date",
                &format!(
                    "must be RFC 3339 with Z or an offset, e.g. 2023-10-26T15:47:03.434Z ({e})"
                ),
            )
        })?;
        let offset_secs = dt.offset().local_minus_utc();
        if offset_secs % 60 != 0 {
            return Err(field_err("date", "offset must be whole minutes"));
        }
        let offset = (offset_secs != 0).then_some(offset_secs / 60);
        (dt.timestamp_millis(), offset)
    } else if is_json_integer(raw) {
        (raw.parse::<i64>().map_err(|_| range_err())?, None)
    } else {
        return Err(field_err(
            "date",
            "must be an RFC 3339 string or integer epoch milliseconds",
        ));
    };
    if !(0..=MAX_EPOCH_SECONDS * 1000 + 999).contains(&ms) {
        return Err(range_err());
    }
    Ok((ms, offset))
}
