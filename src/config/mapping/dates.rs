//! The `date` rule of a mapping: its format, and for a pattern, that it can
//! read back a date it writes and says its offset exactly once.

use chrono::format::{Fixed, Item, StrftimeItems};
use chrono::{DateTime, FixedOffset, NaiveDate, NaiveDateTime, TimeZone};

use super::*;

impl MappingSettings {
    pub(super) fn date_rule(&self, s: Option<&FieldSettings>) -> Result<DateRule, MappingError> {
        let Some(s) = s else {
            return Ok(DateRule::Default);
        };
        let field = TradeField::Date;
        if s.format != Some(DateFormat::Pattern) && (s.pattern.is_some() || s.offset.is_some()) {
            return Err(self.err(
                field,
                "`pattern` and `offset` go with format = \"pattern\" only",
            ));
        }
        Ok(match s.format {
            None => DateRule::Default,
            Some(DateFormat::Rfc3339) => DateRule::Rfc3339,
            Some(DateFormat::EpochSeconds) => DateRule::Epoch(1),
            Some(DateFormat::EpochMillis) => DateRule::Epoch(1_000),
            Some(DateFormat::EpochMicros) => DateRule::Epoch(1_000_000),
            Some(DateFormat::EpochNanos) => DateRule::Epoch(1_000_000_000),
            Some(DateFormat::Fix) => DateRule::Fix,
            Some(DateFormat::Pattern) => self.pattern_rule(s)?,
        })
    }

    /// A pattern must read back a date it writes (else it lacks a part of
    /// the date or time and can never match), and say its offset once:
    /// in the values, or in `offset`.
    fn pattern_rule(&self, s: &FieldSettings) -> Result<DateRule, MappingError> {
        let field = TradeField::Date;
        let Some(pattern) = s.pattern.clone() else {
            return Err(self.err(field, "format = \"pattern\" needs `pattern`"));
        };
        let items: Vec<Item<'_>> = StrftimeItems::new(&pattern).collect();
        if items.iter().any(|i| matches!(i, Item::Error)) {
            return Err(self.err(field, format!("pattern {pattern:?} is not a valid pattern")));
        }
        let holds_offset = items.iter().any(|i| {
            matches!(
                i,
                Item::Fixed(
                    Fixed::TimezoneOffset
                        | Fixed::TimezoneOffsetColon
                        | Fixed::TimezoneOffsetColonZ
                        | Fixed::TimezoneOffsetZ
                        | Fixed::RFC2822
                        | Fixed::RFC3339
                )
            )
        });
        let rule = match (holds_offset, &s.offset) {
            (true, Some(_)) => {
                return Err(self.err(
                    field,
                    "the pattern reads the offset from each value: `offset` would be ignored",
                ))
            }
            (true, None) => DateRule::PatternWithOffset(pattern),
            (false, None) => {
                return Err(self.err(
                    field,
                    "the pattern has no offset (%z): state the values' offset with offset = \"Z\" or \"+HH:MM\"",
                ))
            }
            (false, Some(text)) => DateRule::PatternAt(pattern, self.offset(text)?),
        };
        self.check_round_trip(&rule)?;
        Ok(rule)
    }

    fn offset(&self, text: &str) -> Result<FixedOffset, MappingError> {
        let bad = || {
            self.err(
                TradeField::Date,
                format!("offset {text:?} must be \"Z\" or \"+HH:MM\" / \"-HH:MM\""),
            )
        };
        if text == "Z" {
            return FixedOffset::east_opt(0).ok_or_else(bad);
        }
        let sign = match text.as_bytes().first() {
            Some(b'+') => 1,
            Some(b'-') => -1,
            _ => return Err(bad()),
        };
        let (h, m) = text[1..].split_once(':').ok_or_else(bad)?;
        let two_digits = |s: &str| s.len() == 2 && s.bytes().all(|b| b.is_ascii_digit());
        if !two_digits(h) || !two_digits(m) {
            return Err(bad());
        }
        let (h, m): (i32, i32) = (h.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?);
        if h > 23 || m > 59 {
            return Err(bad());
        }
        FixedOffset::east_opt(sign * (h * 3600 + m * 60)).ok_or_else(bad)
    }

    fn check_round_trip(&self, rule: &DateRule) -> Result<(), MappingError> {
        let probe =
            NaiveDate::from_ymd_opt(2023, 10, 26).and_then(|d| d.and_hms_milli_opt(15, 47, 3, 434));
        let Some(probe) = probe else {
            return Ok(());
        };
        let back = match rule {
            DateRule::PatternWithOffset(p) => {
                let at = FixedOffset::east_opt(3600).map(|o| o.from_utc_datetime(&probe));
                at.and_then(|at| {
                    DateTime::parse_from_str(&at.format(p).to_string(), p)
                        .ok()
                        .map(|d| d.naive_utc())
                })
            }
            DateRule::PatternAt(p, _) => {
                NaiveDateTime::parse_from_str(&probe.format(p).to_string(), p).ok()
            }
            _ => return Ok(()),
        };
        // Whole seconds: a pattern without `%.f` drops the milliseconds,
        // which is the operator's choice, not an error.
        match back {
            Some(b) if b.and_utc().timestamp() == probe.and_utc().timestamp() => Ok(()),
            _ => Err(self.err(
                TradeField::Date,
                "the pattern cannot read back a date it writes: it lacks the year, month, day, hour, minute or second",
            )),
        }
    }
}
