//! One level of a JSON document at a time, for a mapping's pointers (and
//! the default schema's top level, `decode::parse_object`): an object as
//! (name, raw value) pairs in input order, an array as raw values. Values
//! stay their JSON text (`RawValue`), so a number read three objects deep
//! is still parsed exactly into Decimal128; names are borrowed from the
//! payload unless they hold escapes, so stepping into an object costs no
//! allocation per name.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// An object's members in input order.
pub(super) type Members<'a> = Vec<(Cow<'a, str>, &'a RawValue)>;

/// Up to this many members, duplicates are found by comparing with each
/// earlier name (cheaper than hashing for the objects trades are made
/// of); past it, a set keeps a payload of many names from costing their
/// square.
const LINEAR_DUPLICATE_CHECK: usize = 16;

/// Why a level could not be read.
#[derive(Debug)]
pub(super) enum LevelError {
    /// Not an object (a valid JSON value of another type).
    NotObject(String),
    /// A name twice in one object: which was meant is unknowable.
    Duplicate(String),
    /// Not JSON at all.
    Syntax(String),
}

struct Name<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Name<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Name(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Name(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Name(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

struct MembersSeed;

impl<'de> DeserializeSeed<'de> for MembersSeed {
    type Value = Members<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MembersSeed {
    type Value = Members<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        // Room for a trade's fields at once, rather than growing twice.
        let mut out: Members<'de> = Vec::with_capacity(LINEAR_DUPLICATE_CHECK);
        let mut seen: Option<HashSet<Cow<'de, str>>> = None;
        while let Some(Name(name)) = map.next_key::<Name<'de>>()? {
            let duplicate = match &mut seen {
                Some(set) => !set.insert(name.clone()),
                None => out.iter().any(|(n, _)| *n == name),
            };
            if duplicate {
                return Err(serde::de::Error::custom(DuplicateName(name.into_owned())));
            }
            out.push((name, map.next_value::<&'de RawValue>()?));
            if seen.is_none() && out.len() == LINEAR_DUPLICATE_CHECK {
                seen = Some(out.iter().map(|(n, _)| n.clone()).collect());
            }
        }
        Ok(out)
    }
}

/// The message a duplicate name is reported with, recognised below.
struct DuplicateName(String);

impl fmt::Display for DuplicateName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "duplicate field {:?}", self.0)
    }
}

/// The members of the object `text`.
pub(super) fn object(text: &str) -> Result<Members<'_>, LevelError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let members = MembersSeed.deserialize(&mut de).and_then(|m| {
        de.end()?;
        Ok(m)
    });
    members.map_err(|e| {
        let message = e.to_string();
        if e.is_data() && message.starts_with("duplicate field") {
            LevelError::Duplicate(message)
        } else if e.is_data() {
            LevelError::NotObject(message)
        } else {
            LevelError::Syntax(message)
        }
    })
}

/// The elements of the array `text`, or `None` if it is not an array.
pub(super) fn array(text: &str) -> Option<Vec<&RawValue>> {
    serde_json::from_str(text).ok()
}

/// `token` as an array index if RFC 6901 reads it as one: digits without a
/// leading zero.
pub(super) fn index_of(token: &str) -> Option<usize> {
    let canonical = !token.is_empty()
        && token.bytes().all(|b| b.is_ascii_digit())
        && (token == "0" || !token.starts_with('0'));
    canonical.then(|| token.parse().ok()).flatten()
}
