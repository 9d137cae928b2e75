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
/// `NaiveDateTime::parse_from_str` reads it: the canonical shape by
/// position, anything else by chrono.
fn fix_timestamp(s: &str) -> chrono::ParseResult<NaiveDateTime> {
    match fix_canonical(s) {
        Some(t) => Ok(t),
        None => fix_by_chrono(s),
    }
}

/// chrono's parse, the format's items parsed once rather than for every
/// event (a third of that parse).
fn fix_by_chrono(s: &str) -> chrono::ParseResult<NaiveDateTime> {
    static ITEMS: LazyLock<Vec<Item<'static>>> =
        LazyLock::new(|| StrftimeItems::new("%Y%m%d-%H:%M:%S%.f").collect());
    let mut parsed = Parsed::new();
    chrono::format::parse(&mut parsed, s, ITEMS.iter())?;
    parsed.to_naive_datetime_with_offset(0)
}

/// `YYYYMMDD-HH:MM:SS` and none or 1 to 9 fraction digits, read by
/// position: what every FIX engine sends, at about a tenth of chrono's
/// instructions (a tenth of a mapped decode's). `None` for any other
/// shape or a value out of range (a leap second too), which chrono then
/// reads or words the error for; `dates::tests` hold the two equal.
fn fix_canonical(s: &str) -> Option<NaiveDateTime> {
    let b = s.as_bytes();
    if b.len() < 17 || b[8] != b'-' || b[11] != b':' || b[14] != b':' {
        return None;
    }
    let num = |at: std::ops::Range<usize>| {
        b[at].iter().try_fold(0u32, |n, &c| {
            c.is_ascii_digit().then(|| n * 10 + u32::from(c - b'0'))
        })
    };
    let nanos = match &b[17..] {
        [] => 0,
        [b'.', digits @ ..] if (1..=9).contains(&digits.len()) => {
            num(18..b.len())? * 10u32.pow(9 - digits.len() as u32)
        }
        _ => return None,
    };
    let date = chrono::NaiveDate::from_ymd_opt(num(0..4)? as i32, num(4..6)?, num(6..8)?)?;
    date.and_hms_nano_opt(num(9..11)?, num(12..14)?, num(15..17)?, nanos)
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

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Timelike;
    use proptest::prelude::*;

    #[test]
    fn a_canonical_fix_stamp_is_read_by_position() {
        let t = fix_canonical("20261126-04:38:09.123").unwrap();
        assert_eq!(t.and_utc().timestamp_millis(), 1_795_667_889_123);
        assert_eq!(
            fix_canonical("20261126-04:38:09"),
            Some(t.with_nanosecond(0).unwrap())
        );
        // Left to chrono: a leap second, a 10th fraction digit, a sign.
        assert_eq!(fix_canonical("20261231-23:59:60"), None);
        assert_eq!(fix_canonical("20261126-04:38:09.1234567890"), None);
        assert_eq!(fix_canonical("+2026112-04:38:09"), None);
    }

    proptest! {
        #[test]
        fn the_canonical_reading_is_chronos(
            s in "[0-9]{8}-[0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{0,10})?|[0-9+ .:-]{0,24}",
        ) {
            if let Some(t) = fix_canonical(&s) {
                prop_assert_eq!(Some(t), fix_by_chrono(&s).ok());
            }
        }

        #[test]
        fn every_valid_canonical_stamp_takes_the_fast_path(
            (y, m, d) in (1970i32..2287, 1u32..13, 1u32..29),
            (h, mi, sec) in (0u32..24, 0u32..60, 0u32..60),
            fraction in "(\\.[0-9]{1,9})?",
        ) {
            let s = format!("{y:04}{m:02}{d:02}-{h:02}:{mi:02}:{sec:02}{fraction}");
            prop_assert!(fix_canonical(&s).is_some());
            prop_assert_eq!(fix_canonical(&s), fix_by_chrono(&s).ok());
        }
    }
}
