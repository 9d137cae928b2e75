//! The trade's own fields, each parsed from its raw JSON text: ids, side,
//! ticker, currency, exact decimals (never through a binary float) and
//! dates.

use chrono::{DateTime, FixedOffset};
use mongodb::bson::{Bson, Decimal128};

use super::*;

pub(super) fn parse_trade_id(raw: &str) -> Result<(Bson, String), Reject> {
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

pub(super) fn parse_customer(raw: &str) -> Result<CustomerId, Reject> {
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
    Ok(id.canonical())
}

pub(super) fn parse_side(raw: &str) -> Result<String, Reject> {
    match serde_json::from_str::<String>(raw).as_deref() {
        Ok("buy") => Ok("buy".to_string()),
        Ok("sell") => Ok("sell".to_string()),
        _ => Err(field_err("type", "must be \"buy\" or \"sell\"")),
    }
}

pub(super) fn parse_ticker(raw: &str) -> Result<String, Reject> {
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

pub(super) fn parse_currency(raw: &str) -> Result<String, Reject> {
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
pub(super) fn is_json_number(s: &str) -> bool {
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

pub(super) fn is_json_integer(raw: &str) -> bool {
    is_json_number(raw) && !raw.contains(['.', 'e', 'E'])
}

/// The decimal text of a number given as a JSON number or a JSON string.
pub(super) fn decimal_text(raw: &str, field: &str) -> Result<String, Reject> {
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

/// `qty`: an integer is stored as Int64, a fraction as Decimal128; either
/// way exact, and strictly positive.
pub(super) fn parse_qty(raw: &str) -> Result<Bson, Reject> {
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
pub(super) fn parse_date(raw: &str) -> Result<(i64, Option<i32>), Reject> {
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
