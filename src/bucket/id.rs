//! The bucket `_id`, and everything that depends on its form:
//! `<customer>_<10-digit UTC seconds of the first trade>`, or
//! `<customer>_<seconds>_<6-digit suffix>` when the bucket must sort after
//! a previous one that started in the same second or later (late data).
//! Zero-padded, fixed-width numbers make string order equal page order, so
//! the manual's `find({_id: /^123_/}).sort({_id: 1})` reads pages in order.
//!
//! Why a customer id can never contain `_` (the decoder refuses it, see
//! `event::validate_customer`): `_` separates the customer from the time.
//! With `_` allowed, customer `1_2`'s buckets would start with `1_`, and
//! customer `1`'s page query, prefix range and `prev` chain would take them
//! for its own. Without it, `<customer>_` is a prefix of one customer's
//! buckets and no other's, and since '`' is the byte right after `_`, the
//! range `["<customer>_", "<customer>`")` holds exactly those buckets, so
//! the newest one is one indexed lookup on `_id`.

use mongodb::bson::{doc, Document, Regex};

use crate::event::{CustomerId, MAX_EPOCH_SECONDS};

/// Separates the customer from the time, and the time from the suffix.
const SEPARATOR: char = '_';

/// The byte after [`SEPARATOR`]: the exclusive end of a customer's range.
const AFTER_SEPARATOR: char = '`';

/// Largest same-second suffix; six digits keep string order equal to
/// numeric order.
pub const MAX_SUFFIX: u32 = 999_999;

/// Where a bucket sorts among its customer's: the second of its first trade
/// and, for buckets that must sort after one of the same second or later,
/// a suffix (0: none). Ordered as the `_id`s are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub secs: i64,
    pub suffix: u32,
}

impl Position {
    /// The position of the bucket after `prev` whose first trade is at
    /// `first_secs`: its own second when that is later, otherwise the
    /// previous bucket's second with the next suffix, so `_id` order is
    /// always page order. `None` when no `_id` sorts after `prev`.
    pub fn next(prev: Option<Position>, first_secs: i64) -> Option<Position> {
        let at = |secs, suffix| Some(Position { secs, suffix });
        match prev {
            None => at(first_secs, 0),
            Some(p) if first_secs > p.secs => at(first_secs, 0),
            Some(p) if p.suffix < MAX_SUFFIX => at(p.secs, p.suffix + 1),
            Some(p) if p.secs < MAX_EPOCH_SECONDS => at(p.secs + 1, 0),
            Some(_) => None,
        }
    }
}

/// `<customer>_`: the start of every `_id` of one customer's buckets, and
/// the `prev` of its first bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prefix(String);

impl Prefix {
    pub fn of(customer: &CustomerId) -> Prefix {
        let mut text = customer.id_text();
        debug_assert!(!text.contains(SEPARATOR), "customer ids cannot hold '_'");
        text.push(SEPARATOR);
        Prefix(text)
    }

    /// The prefix of a stored `_id`: everything up to its first `_`; `None`
    /// without one. Does not check the rest (see [`Prefix::parse`]).
    pub fn of_id(id: &str) -> Option<Prefix> {
        let (customer, _) = id.split_once(SEPARATOR)?;
        Some(Prefix(format!("{customer}{SEPARATOR}")))
    }

    /// The prefix as text, `<customer>_`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The customer part, without the `_`.
    pub fn customer_text(&self) -> &str {
        &self.0[..self.0.len() - SEPARATOR.len_utf8()]
    }

    /// The `_id` of this customer's bucket at `at`.
    pub fn id(&self, at: Position) -> String {
        let Position { secs, suffix } = at;
        if suffix == 0 {
            format!("{}{secs:010}", self.0)
        } else {
            format!("{}{secs:010}{SEPARATOR}{suffix:06}", self.0)
        }
    }

    /// Inverse of [`Prefix::id`]; `None` for an `_id` of another customer
    /// or of another form.
    pub fn parse(&self, id: &str) -> Option<Position> {
        let rest = id.strip_prefix(self.as_str())?;
        let (secs, suffix) = match rest.split_once(SEPARATOR) {
            Some((s, n)) if n.len() == 6 && is_digits(n) => (s, n.parse().ok()?),
            Some(_) => return None,
            None => (rest, 0),
        };
        if secs.len() != 10 || !is_digits(secs) {
            return None;
        }
        Some(Position {
            secs: secs.parse().ok()?,
            suffix,
        })
    }

    /// Whether `id` is one of this customer's buckets (of any form: a
    /// bucket written by another tool still belongs to its customer).
    pub fn owns(&self, id: &str) -> bool {
        id.starts_with(self.as_str())
    }

    /// `{_id: {$gte: "<customer>_", $lt: "<customer>`"}}`: this customer's
    /// buckets and no other's (see the module docs). Uses the `_id` index.
    pub fn range(&self) -> Document {
        let end = format!("{}{AFTER_SEPARATOR}", self.customer_text());
        doc! {"_id": {"$gte": self.as_str(), "$lt": end}}
    }

    /// `^<customer>_`: the manual's page query,
    /// `find({_id: /^<customer>_/}).sort({_id: 1})`.
    pub fn page_regex(&self) -> Regex {
        Regex {
            pattern: format!("^{}", self.0),
            options: String::new(),
        }
    }
}

fn is_digits(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn prefix(c: i64) -> Prefix {
        Prefix::of(&CustomerId::Int(c))
    }

    fn at(secs: i64, suffix: u32) -> Position {
        Position { secs, suffix }
    }

    #[test]
    fn ids_are_ten_digit_seconds_and_parse_back() {
        assert_eq!(prefix(123).id(at(1_698_335_223, 0)), "123_1698335223");
        assert_eq!(prefix(7).id(at(5, 0)), "7_0000000005");
        assert_eq!(prefix(7).id(at(5, 3)), "7_0000000005_000003");
        assert_eq!(prefix(7).parse("7_0000000005_000003"), Some(at(5, 3)));
        assert_eq!(
            prefix(123).parse("123_1698335223"),
            Some(at(1_698_335_223, 0))
        );
        let text = Prefix::of(&CustomerId::Str("c-1".into()));
        assert_eq!(text.id(at(9, 0)), "c-1_0000000009");
        assert_eq!(text.parse("c-1_0000000009"), Some(at(9, 0)));
    }

    #[test]
    fn ids_of_other_forms_are_rejected() {
        let p = prefix(123);
        for other in [
            "123_99",                  // seconds not ten digits
            "123_16983352230",         // eleven
            "123_169833522x",          // not digits
            "1234_1698335223",         // another customer
            "12_1698335223",           // another customer
            "123_1698335223_1",        // suffix not six digits
            "123_1698335223_00000a",   // suffix not digits
            "123_1698335223_000001_1", // one part too many
            "123_",                    // no time
            "123_legacy",              // another tool's id
        ] {
            assert_eq!(p.parse(other), None, "{other}");
        }
    }

    #[test]
    fn a_stored_id_gives_its_prefix() {
        let p = Prefix::of_id("123_1698335223_000001").unwrap();
        assert_eq!(p, prefix(123));
        assert_eq!(p.customer_text(), "123");
        assert_eq!(Prefix::of_id("legacy"), None);
        assert_eq!(prefix(5).as_str(), "5_");
        assert!(prefix(5).owns("5_legacy"));
        assert!(!prefix(5).owns("50_0000000001"));
    }

    #[test]
    fn next_position_always_sorts_after_the_previous_bucket() {
        assert_eq!(Position::next(None, 10), Some(at(10, 0)));
        assert_eq!(Position::next(Some(at(10, 0)), 11), Some(at(11, 0)));
        assert_eq!(Position::next(Some(at(10, 0)), 10), Some(at(10, 1)));
        assert_eq!(
            Position::next(Some(at(10, 4)), 3),
            Some(at(10, 5)),
            "late data"
        );
        assert_eq!(Position::next(Some(at(10, MAX_SUFFIX)), 3), Some(at(11, 0)));
        assert_eq!(
            Position::next(Some(at(MAX_EPOCH_SECONDS, MAX_SUFFIX)), 3),
            None
        );
    }

    #[test]
    fn the_prefix_range_covers_exactly_one_customer() {
        let r = prefix(12).range();
        let range = r.get_document("_id").unwrap();
        let (lo, hi) = (
            range.get_str("$gte").unwrap(),
            range.get_str("$lt").unwrap(),
        );
        assert_eq!((lo, hi), ("12_", "12`"));
        for inside in ["12_0000000001", "12_9999999999_999999", "12_legacy"] {
            assert!(lo <= inside && inside < hi, "{inside}");
        }
        for outside in [
            "1_0000000001",
            "120_0000000001",
            "12-3_0000000001",
            "12a_0000000001",
            "12A_0000000001",
            "13_0000000001",
            "12",
        ] {
            assert!(!(lo <= outside && outside < hi), "{outside}");
        }
    }

    #[test]
    fn the_page_regex_is_the_manuals() {
        let r = prefix(123).page_regex();
        assert_eq!((r.pattern.as_str(), r.options.as_str()), ("^123_", ""));
        let text = Prefix::of(&CustomerId::Str("AB-9".into())).page_regex();
        assert_eq!(text.pattern, "^AB-9_");
    }

    proptest! {
        #[test]
        fn id_string_order_is_position_order(
            a in (0i64..=MAX_EPOCH_SECONDS, 0u32..=MAX_SUFFIX),
            b in (0i64..=MAX_EPOCH_SECONDS, 0u32..=MAX_SUFFIX),
        ) {
            let p = Prefix::of(&CustomerId::Str("c-1".into()));
            let (a, b) = (at(a.0, a.1), at(b.0, b.1));
            prop_assert_eq!(p.id(a).cmp(&p.id(b)), a.cmp(&b));
            prop_assert_eq!(p.parse(&p.id(a)), Some(a));
        }

        /// Any customer's ids fall in its own range and no other's (the
        /// decoder's alphabet: digits, letters and '-').
        #[test]
        fn ranges_hold_their_own_customers_ids_only(
            a in "[A-Za-z0-9-]{1,8}",
            b in "[A-Za-z0-9-]{1,8}",
            secs in 0i64..=MAX_EPOCH_SECONDS,
            suffix in 0u32..=MAX_SUFFIX,
        ) {
            let (pa, pb) = (
                Prefix::of(&CustomerId::Str(a.clone())),
                Prefix::of(&CustomerId::Str(b.clone())),
            );
            let id = pb.id(at(secs, suffix));
            let range = pa.range();
            let range = range.get_document("_id").unwrap();
            let inside = range.get_str("$gte").unwrap() <= id.as_str()
                && id.as_str() < range.get_str("$lt").unwrap();
            prop_assert_eq!(inside, a == b);
            prop_assert_eq!(pa.owns(&id), a == b);
            prop_assert_eq!(pa.parse(&id).is_some(), a == b);
        }
    }
}
