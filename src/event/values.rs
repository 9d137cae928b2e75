//! The trade's own fields, each parsed from its raw JSON text: ids, side,
//! ticker, currency, exact decimals (never through a binary float) and
//! dates. Every trade passes through here, so the common spellings are
//! read without a `serde_json::Value` or a `String` per field: a string
//! without escapes is borrowed from the payload, and a plain decimal is
//! encoded into Decimal128 directly; anything else takes the general path,
//! whose outcome (and message) the fast one must equal.

use std::borrow::Cow;
use std::fmt::Write;

use chrono::{DateTime, FixedOffset};
use compact_str::CompactString;
use mongodb::bson::Decimal128;

use super::*;

/// The text of the JSON string `raw`, or `None` if `raw` is not one. One
/// without escapes (no control byte, no `"` or `\` inside) is its own
/// text between the quotes, borrowed; serde_json reads the rest.
pub(super) fn json_string(raw: &str) -> Option<Cow<'_, str>> {
    if let Some(text) = raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
        if text.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
            return Some(Cow::Borrowed(text));
        }
    }
    serde_json::from_str::<String>(raw).ok().map(Cow::Owned)
}

/// A trade id as read: its key, `t:` and the id as text (built once; a
/// text id is stored as the key's text after `t:`), and for an integer id
/// the integer, which is what is stored then.
pub(super) struct TradeId {
    pub(super) key: CompactString,
    pub(super) int: Option<i64>,
}

/// A string id of 1 to 128 characters without control characters, or an
/// integer within 0..=i64::MAX.
pub(super) fn parse_trade_id(raw: &str) -> Result<TradeId, Reject> {
    if raw.starts_with('"') {
        let s = json_string(raw).ok_or_else(trade_id_type_err)?;
        return string_trade_id(&s);
    }
    // Digits alone (not `-0`, which serde_json reads as a float).
    if is_json_integer(raw) && !raw.starts_with('-') {
        if let Ok(i) = raw.parse::<i64>() {
            return Ok(int_trade_id(i));
        }
    }
    parse_trade_id_value(raw)
}

/// What is neither a string nor a plain Int64, read as serde_json reads it.
fn parse_trade_id_value(raw: &str) -> Result<TradeId, Reject> {
    match serde_json::from_str::<serde_json::Value>(raw) {
        Ok(serde_json::Value::String(s)) => string_trade_id(&s),
        Ok(serde_json::Value::Number(n)) => match n.as_i64() {
            Some(i) if i >= 0 && is_json_integer(raw) => Ok(int_trade_id(i)),
            _ => Err(trade_id_type_err()),
        },
        _ => Err(trade_id_type_err()),
    }
}

fn trade_id_type_err() -> Reject {
    field_err("tradeId", "must be a string or a non-negative integer")
}

fn string_trade_id(s: &str) -> Result<TradeId, Reject> {
    // ASCII (the usual id) has a character per byte, and its control
    // characters are Unicode's below U+0080.
    let (chars, control) = if s.is_ascii() {
        (s.len(), s.bytes().any(|b| b.is_ascii_control()))
    } else {
        (s.chars().count(), s.chars().any(char::is_control))
    };
    if s.is_empty() || chars > 128 {
        return Err(field_err("tradeId", "must have 1 to 128 characters"));
    }
    if control {
        return Err(field_err("tradeId", "must not contain control characters"));
    }
    let mut key = CompactString::with_capacity(2 + s.len());
    key.push_str("t:");
    key.push_str(s);
    Ok(TradeId { key, int: None })
}

fn int_trade_id(i: i64) -> TradeId {
    let mut key = CompactString::const_new("t:");
    // Writing to a string cannot fail; 19 digits at most, so inline.
    let _ = write!(key, "{i}");
    TradeId { key, int: Some(i) }
}

pub(super) fn parse_customer(raw: &str) -> Result<CustomerId, Reject> {
    if raw.starts_with('"') {
        let s = json_string(raw)
            .ok_or_else(|| field_err("customerId", "must be a non-negative integer or a string"))?;
        return customer_text(s);
    }
    // Digits alone (no `-0`, no fraction): an Int64 or out of range.
    if raw.bytes().all(|b| b.is_ascii_digit()) && is_json_integer(raw) {
        if let Ok(i) = raw.parse::<i64>() {
            return Ok(CustomerId::Int(i));
        }
    }
    parse_customer_value(raw)
}

/// A text customer id, checked and in its canonical form.
fn customer_text(s: Cow<'_, str>) -> Result<CustomerId, Reject> {
    validate_customer_text(&s)?;
    // One customer, one identity, in every mode: `7` and `"7"` share one
    // `_id` prefix, so they must be one key to the writer too, or one batch
    // plans two "customers" against one bucket (docs/design.md, "One
    // spelling of a customer").
    Ok(match integer_text(&s) {
        Some(i) => CustomerId::Int(i),
        None => CustomerId::Str(s.into_owned()),
    })
}

/// What is neither a string nor a plain Int64: read as serde_json reads
/// it, for its message (negative, out of range, not an integer).
fn parse_customer_value(raw: &str) -> Result<CustomerId, Reject> {
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
    Ok(id.canonical())
}

pub(super) fn parse_side(raw: &str) -> Result<&'static str, Reject> {
    match json_string(raw).as_deref() {
        Some("buy") => Ok("buy"),
        Some("sell") => Ok("sell"),
        _ => Err(field_err("type", "must be \"buy\" or \"sell\"")),
    }
}

pub(super) fn parse_ticker(raw: &str) -> Result<CompactString, Reject> {
    let s = json_string(raw).ok_or_else(|| field_err("ticker", "must be a string"))?;
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
    // At most 16 bytes: inline.
    Ok(CompactString::from(&*s))
}

/// An ISO 4217 code, three ASCII capitals, held without an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Currency([u8; 3]);

impl Currency {
    pub(super) fn as_str(&self) -> &str {
        // Three ASCII capitals, checked when read: always UTF-8.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

pub(super) fn parse_currency(raw: &str) -> Result<Currency, Reject> {
    let s = json_string(raw).ok_or_else(|| field_err("currency", "must be a string"))?;
    match <[u8; 3]>::try_from(s.as_bytes()) {
        Ok(code) if code.iter().all(u8::is_ascii_uppercase) => Ok(Currency(code)),
        _ => Err(field_err(
            "currency",
            "must be three letters A-Z (ISO 4217)",
        )),
    }
}

/// JSON number grammar (RFC 8259): what both `price` strings and numbers
/// must look like. Rules out NaN, Infinity, hex, '+', spaces and ".5".
pub(super) fn is_json_number(s: &str) -> bool {
    // The usual number first, in one pass: a plain integer (`customerId`,
    // `qty`, a `date` in milliseconds).
    is_plain_integer(s.as_bytes()) || follows_number_grammar(s.as_bytes())
}

/// An optional '-', then digits not led by a zero: a JSON number.
fn is_plain_integer(b: &[u8]) -> bool {
    match b.strip_prefix(b"-").unwrap_or(b) {
        [b'1'..=b'9', rest @ ..] => rest.iter().all(u8::is_ascii_digit),
        _ => false,
    }
}

/// RFC 8259's number grammar, step by step.
fn follows_number_grammar(b: &[u8]) -> bool {
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
        match digits_from(b, i + 1) {
            Some(end) => i = end,
            None => return false,
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        match digits_from(b, i) {
            Some(end) => i = end,
            None => return false,
        }
    }
    i == b.len()
}

/// The end of the run of digits at `start`; `None` if there is none.
fn digits_from(b: &[u8], start: usize) -> Option<usize> {
    let len = b
        .get(start..)?
        .iter()
        .take_while(|c| c.is_ascii_digit())
        .count();
    (len > 0).then_some(start + len)
}

pub(super) fn is_json_integer(raw: &str) -> bool {
    is_json_number(raw) && !raw.contains(['.', 'e', 'E'])
}

/// The decimal text of a number given as a JSON number or a JSON string.
pub(super) fn decimal_text<'a>(raw: &'a str, field: &str) -> Result<Cow<'a, str>, Reject> {
    let text = if raw.starts_with('"') {
        json_string(raw).ok_or_else(|| field_err(field, "is not a valid string"))?
    } else {
        Cow::Borrowed(raw)
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
    if let Some(d) = plain_decimal128(text) {
        return Ok(d);
    }
    text.parse::<Decimal128>().map_err(|e| {
        field_err(
            field,
            &format!(
                "cannot be represented exactly as Decimal128 ({e}; at most 34 significant digits)"
            ),
        )
    })
}

/// Decimal128's largest coefficient has 34 digits; its exponents run from
/// -6176 to 6111, stored biased by 6176.
const DECIMAL128_DIGITS: usize = 34;
const DECIMAL128_EXPONENTS: std::ops::RangeInclusive<i32> = -6176..=6111;
const DECIMAL128_BIAS: i32 = 6176;

/// `text` (a JSON number) as the Decimal128 bson's parser makes of it, for
/// the numbers that need neither rounding nor clamping: at most 34
/// significant digits, an exponent in range (written with at most four
/// digits). `None` leaves the rest, errors included, to that parser.
///
/// bson's parser goes through strings and bit vectors (a tenth of a
/// trade's decode); this is the same value, packed directly: the sign in
/// the top bit, the biased exponent in the next 14, the coefficient (below
/// 2^113, so the short form) in the low 113, little-endian.
pub(super) fn plain_decimal128(text: &str) -> Option<Decimal128> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        Some((m, e)) => (m, small_exponent(e)?),
        None => (unsigned, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if int.is_empty() || frac.len() > DECIMAL128_BIAS as usize {
        return None;
    }
    let mut coefficient: u128 = 0;
    let mut digits = 0;
    for b in int.bytes().chain(frac.bytes()) {
        if !b.is_ascii_digit() {
            return None;
        }
        // Leading zeros are not significant.
        if coefficient == 0 && b == b'0' {
            continue;
        }
        digits += 1;
        if digits > DECIMAL128_DIGITS {
            return None;
        }
        coefficient = coefficient * 10 + u128::from(b - b'0');
    }
    let exponent = exponent - frac.len() as i32;
    if !DECIMAL128_EXPONENTS.contains(&exponent) {
        return None;
    }
    let biased = (exponent + DECIMAL128_BIAS) as u128;
    let bits = (u128::from(negative) << 127) | (biased << 113) | coefficient;
    Some(Decimal128::from_bytes(bits.to_le_bytes()))
}

/// An exponent of one to four digits, with an optional sign.
fn small_exponent(text: &str) -> Option<i32> {
    let digits = text.strip_prefix(['+', '-']).unwrap_or(text);
    if digits.is_empty() || digits.len() > 4 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let value: i32 = digits.parse().ok()?;
    Some(if text.starts_with('-') { -value } else { value })
}

/// Whether the mantissa has a non-zero digit, so "-0.00" is zero, not negative.
pub(super) fn mantissa_nonzero(text: &str) -> bool {
    let mantissa = text.split(['e', 'E']).next().unwrap_or("");
    mantissa.bytes().any(|b| (b'1'..=b'9').contains(&b))
}

pub(super) fn parse_price(raw: &str) -> Result<Decimal128, Reject> {
    let text = decimal_text(raw, "price")?;
    if text.starts_with('-') && mantissa_nonzero(&text) {
        return Err(field_err("price", "must not be negative"));
    }
    exact_decimal(&text, "price")
}

/// A quantity as stored: an integer as Int64, a fraction as Decimal128.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Qty {
    Int(i64),
    Decimal(Decimal128),
}

/// `qty`: an integer is stored as Int64, a fraction as Decimal128; either
/// way exact, and strictly positive.
pub(super) fn parse_qty(raw: &str) -> Result<Qty, Reject> {
    let text = decimal_text(raw, "qty")?;
    if text.starts_with('-') || !mantissa_nonzero(&text) {
        return Err(field_err("qty", "must be positive"));
    }
    if is_json_integer(&text) {
        return text
            .parse::<i64>()
            .map(Qty::Int)
            .map_err(|_| field_err("qty", "integer is out of range"));
    }
    exact_decimal(&text, "qty").map(Qty::Decimal)
}

/// RFC 3339 with `Z` or an offset, or epoch milliseconds. Returns UTC
/// milliseconds and, for a non-UTC offset, that offset in minutes east of
/// UTC (the manual's time-data page: keep the offset to rebuild local time).
pub(super) fn parse_date(raw: &str) -> Result<(i64, Option<i32>), Reject> {
    let range_err = || {
        field_err(
            "date",
            "must be between 1970-01-01T00:00:00Z and 2286-11-20T17:46:39Z",
        )
    };
    let (ms, offset) = if raw.starts_with('"') {
        let s = json_string(raw).ok_or_else(|| field_err("date", "is not a valid string"))?;
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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// The shortcut says yes only to what the grammar says yes to, and
        /// to every plain integer the grammar takes.
        #[test]
        fn a_plain_integer_follows_the_number_grammar(s in "-?[0-9]{0,4}[0-9+.eE-]{0,4}") {
            let b = s.as_bytes();
            if is_plain_integer(b) {
                prop_assert!(follows_number_grammar(b), "{}", s);
            }
            let digits = b.strip_prefix(b"-").unwrap_or(b);
            let integer = !digits.is_empty() && digits.iter().all(u8::is_ascii_digit);
            if integer && !digits.starts_with(b"0") {
                prop_assert!(is_plain_integer(b), "{}", s);
            }
        }
    }

    #[test]
    fn leading_zeros_and_lone_signs_are_left_to_the_grammar() {
        for (text, number) in [
            ("0", true),
            ("-0", true),
            ("01", false),
            ("-", false),
            ("", false),
            ("-12", true),
            ("1.5", true),
            ("1e", false),
        ] {
            assert!(!is_plain_integer(text.as_bytes()) || number, "{text}");
            assert_eq!(is_json_number(text), number, "{text}");
        }
    }
}
