//! A mapped `date`, read by the format its mapping states. Every format
//! ends where the default rule ends: UTC milliseconds within the ten-digit
//! seconds range, and a non-UTC offset kept in minutes east of UTC
//! (`offsetMinutes`), so one instant is stored alike whoever sent it.

use std::sync::LazyLock;

use chrono::format::{Item, Parsed, StrftimeItems};
use chrono::{DateTime, FixedOffset, NaiveDateTime, TimeZone};

use super::values::{is_json_integer, parse_date};
use super::*;
use crate::config::mapping::DateRule;

/// UTC milliseconds and the offset to keep, or why not.
pub(super) fn parse_date_by(raw: &str, rule: &DateRule) -> Result<(i64, Option<i32>), Reject> {
    let (ms, offset) = match rule {
        DateRule::Default => return parse_date(raw),
        DateRule::Rfc3339 => {
            let dt = DateTime::parse_from_rfc3339(&text(raw)?)
                .map_err(|e| field_err("date", &format!("must be RFC 3339 ({e})")))?;
            with_offset(&dt)?
        }
        DateRule::Epoch(per_second) => (epoch_millis(raw, *per_second)?, None),
        DateRule::Fix => {
            let dt = fix_timestamp(&text(raw)?).map_err(|e| {
                field_err(
                    "date",
                    &format!("must be a FIX UTCTimestamp, YYYYMMDD-HH:MM:SS[.sss] ({e})"),
                )
            })?;
            (dt.and_utc().timestamp_millis(), None)
        }
        DateRule::PatternWithOffset(p) => {
            let dt = DateTime::parse_from_str(&text(raw)?, p).map_err(|e| {
                field_err("date", &format!("does not match the pattern {p:?} ({e})"))
            })?;
            with_offset(&dt)?
        }
        DateRule::PatternAt(p, at) => {
            let local = NaiveDateTime::parse_from_str(&text(raw)?, p).map_err(|e| {
                field_err("date", &format!("does not match the pattern {p:?} ({e})"))
            })?;
            // A fixed offset maps every local time to exactly one instant.
            let dt = at
                .from_local_datetime(&local)
                .single()
                .ok_or_else(|| field_err("date", "is not a time at the stated offset"))?;
            with_offset(&dt)?
        }
    };
    if !(0..=MAX_EPOCH_SECONDS * 1000 + 999).contains(&ms) {
        return Err(field_err(
            "date",
            "must be between 1970-01-01T00:00:00Z and 2286-11-20T17:46:39Z",
        ));
    }
    Ok((ms, offset))
}

/// A FIX `UTCTimestamp` (`%Y%m%d-%H:%M:%S%.f`), as
/// `NaiveDateTime::parse_from_str` reads it, with the format's items
/// parsed once rather than for every event (a third of the parse).
fn fix_timestamp(s: &str) -> chrono::ParseResult<NaiveDateTime> {
    static ITEMS: LazyLock<Vec<Item<'static>>> =
        LazyLock::new(|| StrftimeItems::new("%Y%m%d-%H:%M:%S%.f").collect());
    let mut parsed = Parsed::new();
    chrono::format::parse(&mut parsed, s, ITEMS.iter())?;
    parsed.to_naive_datetime_with_offset(0)
}

/// The string a text format reads, borrowed from the payload unless it
/// has escapes.
fn text(raw: &str) -> Result<std::borrow::Cow<'_, str>, Reject> {
    super::values::json_string(raw).ok_or_else(|| field_err("date", "must be a string"))
}

/// The instant, and its offset as the default rule keeps it: only when
/// not UTC, and only in whole minutes.
fn with_offset(dt: &DateTime<FixedOffset>) -> Result<(i64, Option<i32>), Reject> {
    let offset_secs = dt.offset().local_minus_utc();
    if offset_secs % 60 != 0 {
        return Err(field_err("date", "offset must be whole minutes"));
    }
    Ok((
        dt.timestamp_millis(),
        (offset_secs != 0).then_some(offset_secs / 60),
    ))
}

/// An integer count of `1/per_second` seconds, as a JSON integer or a
/// string of one, in milliseconds (finer units are cut to the millisecond
/// the default rule stores, towards the past).
fn epoch_millis(raw: &str, per_second: i64) -> Result<i64, Reject> {
    let digits = if raw.starts_with('"') {
        text(raw)?
    } else {
        std::borrow::Cow::Borrowed(raw)
    };
    let unit = match per_second {
        1 => "seconds",
        1_000 => "milliseconds",
        1_000_000 => "microseconds",
        _ => "nanoseconds",
    };
    if !is_json_integer(&digits) {
        return Err(field_err(
            "date",
            &format!("must be an integer count of epoch {unit}"),
        ));
    }
    let n: i64 = digits.parse().map_err(|_| {
        field_err(
            "date",
            "must be between 1970-01-01T00:00:00Z and 2286-11-20T17:46:39Z",
        )
    })?;
    Ok(match per_second {
        1 => n.saturating_mul(1000),
        _ => n.div_euclid(per_second / 1000),
    })
}
