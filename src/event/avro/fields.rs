//! A trade of the default schema read straight from an Avro datum, when
//! every top-level field of the writer's schema is a scalar or a union of
//! scalars (the product's own trade schema and its likes; anything else
//! goes through [`AvroSchema::to_json`]).
//!
//! Each field's value is read by its schema into the JSON text `to_json`
//! writes for it, and the default schema's field readers take it from
//! there, so the rules stay the JSON path's. What is skipped is
//! apache-avro's `Value` (a `String` per field name and per text), the
//! whole object's text scanned again, and, for `date`, RFC 3339 text
//! written and parsed back: an instant in range goes as its epoch
//! milliseconds, which the default date rule reads to the same date. The
//! errors come in `to_json`'s order (the datum first, then each field's
//! text, then the length, then the fields' rules), and the lengths are
//! counted as `to_json`'s text would be, so a record is refused for its
//! size exactly when it is there. `to_json` is the oracle (tests).
//!
//! Why a reader of our own: apache-avro reads a datum into a `Value`, or
//! through serde into a type without the field's schema (a decimal's scale
//! behind a union), and its primitive readers are private; the binary
//! encoding of scalars is a page of the specification. One departure: a
//! string or boolean cut off by the end of the datum is `invalid_format`
//! here, where apache-avro reads it as null.

use std::collections::HashMap;

use apache_avro::schema::{InnerDecimalSchema, Name, Schema};

use super::{base64, invalid_format, push_decimal, push_float, push_instant, push_json_string};
use crate::event::decode::{check_payload_len, TradeFields};
use crate::event::{Identity, Reject, RejectKind, Trade, MAX_EPOCH_SECONDS};

/// How one field's value is encoded, from its schema.
#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Null,
    Boolean,
    /// `int`, `time-millis`.
    Int,
    /// `long`, `time-micros`.
    Long,
    Float,
    Double,
    Text,
    /// `bytes`, or `fixed` of that many bytes.
    Bytes(Option<usize>),
    Enum(Vec<String>),
    /// The unscaled integer as `bytes`, or as `fixed` of that many bytes.
    Decimal {
        scale: usize,
        size: Option<usize>,
    },
    /// `timestamp-millis`/`-micros`/`-nanos`: units per second.
    Instant(i64),
    Union(Vec<Kind>),
}

/// The top-level fields of a schema this reader takes: their names, the
/// length of each name as JSON text, and their kinds, in datum order.
#[derive(Debug)]
pub(super) struct Plan {
    fields: Vec<(String, usize, Kind)>,
}

impl Plan {
    /// The plan of `root`, or `None` if one of its top-level fields is not
    /// a scalar or a union of scalars (or `root` is not a record).
    pub(super) fn of(root: &Schema, names: &HashMap<Name, Schema>) -> Option<Plan> {
        let Schema::Record(record) = root else {
            return None;
        };
        let fields = record
            .fields
            .iter()
            .map(|f| {
                let mut quoted = String::new();
                push_json_string(&mut quoted, &f.name);
                Some((f.name.clone(), quoted.len(), kind(&f.schema, names, false)?))
            })
            .collect::<Option<_>>()?;
        Some(Plan { fields })
    }

    /// Reads the datum into its fields' texts, in one pass, refusing what
    /// `to_json` refuses, in its order: first what is not a datum of the
    /// schema (read to its end whatever else is wrong), then, in field
    /// order, a value with no text (a decimal of no bytes or too many) or
    /// a text past `limit`, then the whole text's length. `len` counts
    /// `to_json`'s text: braces, names, commas, and a date's RFC 3339
    /// where a number is written.
    pub(super) fn read<'a>(&'a self, datum: &'a [u8], limit: usize) -> Result<Fields<'a>, Reject> {
        let mut cursor = Cursor(datum);
        let mut text = String::with_capacity(2 * datum.len() + self.fields.len());
        let (mut len, mut unwritten) = (1, None);
        for (i, (name, name_len, kind)) in self.fields.iter().enumerate() {
            let value = cursor.value(kind).map_err(not_a_datum)?;
            if unwritten.is_some() {
                continue;
            }
            len += usize::from(i > 0) + name_len + 1;
            if len > limit {
                unwritten = Some(Reject::new(
                    RejectKind::Oversize,
                    format!("the decoded record is over {limit} bytes"),
                ));
                continue;
            }
            match value.write(&mut text, name == "date") {
                Ok(written) => len += written,
                Err(reject) => unwritten = Some(reject),
            }
            text.push(char::from(END));
        }
        if !cursor.0.is_empty() {
            return Err(invalid_format(format!(
                "{} bytes left after the Avro datum",
                cursor.0.len()
            )));
        }
        unwritten.map_or(Ok(()), Err)?;
        check_payload_len(len + 1, limit)?;
        Ok(Fields { plan: self, text })
    }
}

/// Ends each value's text in [`Fields::text`]: JSON text never holds a
/// NUL (a string's control characters are escaped), so the texts need no
/// list of where each is.
const END: u8 = 0;

/// A datum of a [`Plan`] read into its fields' texts, before the trade's
/// rules.
pub struct Fields<'a> {
    plan: &'a Plan,
    text: String,
}

impl Fields<'_> {
    /// The trade, by the default schema's rules, as `decode_as` reads it.
    pub fn into_trade(self, identity: Identity<'_>) -> Result<Trade, Reject> {
        let mut trade = TradeFields::default();
        let mut rest = self.text.as_str();
        for (name, _, _) in &self.plan.fields {
            // A field's text is a few bytes: a plain loop finds its end in
            // a fifth of the instructions `str::split` takes.
            let end = rest.bytes().position(|b| b == END).unwrap_or(rest.len());
            let (raw, after) = rest.split_at(end);
            trade.read(name, raw)?;
            rest = after.get(1..).unwrap_or_default();
        }
        trade.into_trade(identity)
    }
}

fn not_a_datum(why: String) -> Reject {
    invalid_format(format!("not an Avro datum of its schema ({why})"))
}

/// The kind of a field's schema; `None` for one [`Plan`] leaves to
/// `to_json` (records, arrays, maps, dates, local times, durations, UUIDs
/// and big decimals, which `to_json` rewrites, and a union in a union).
fn kind(schema: &Schema, names: &HashMap<Name, Schema>, in_union: bool) -> Option<Kind> {
    Some(match schema {
        Schema::Null => Kind::Null,
        Schema::Boolean => Kind::Boolean,
        Schema::Int | Schema::TimeMillis => Kind::Int,
        Schema::Long | Schema::TimeMicros => Kind::Long,
        Schema::Float => Kind::Float,
        Schema::Double => Kind::Double,
        Schema::String => Kind::Text,
        Schema::Bytes => Kind::Bytes(None),
        Schema::Fixed(f) => Kind::Bytes(Some(f.size)),
        Schema::Enum(e) => Kind::Enum(e.symbols.clone()),
        Schema::Decimal(d) => Kind::Decimal {
            scale: d.scale,
            size: match &d.inner {
                InnerDecimalSchema::Bytes => None,
                InnerDecimalSchema::Fixed(f) => Some(f.size),
            },
        },
        Schema::TimestampMillis => Kind::Instant(1_000),
        Schema::TimestampMicros => Kind::Instant(1_000_000),
        Schema::TimestampNanos => Kind::Instant(1_000_000_000),
        Schema::Union(u) if !in_union => Kind::Union(
            u.variants()
                .iter()
                .map(|v| kind(v, names, true))
                .collect::<Option<_>>()?,
        ),
        Schema::Ref { name } => kind(names.get(name)?, names, in_union)?,
        _ => return None,
    })
}

/// One value as read, borrowing the datum and the plan.
#[derive(Debug, Clone, Copy)]
enum Scalar<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Float(f32),
    Double(f64),
    Text(&'a str),
    Bytes(&'a [u8]),
    Decimal(&'a [u8], usize),
    Instant(i64, i64),
}

impl Scalar<'_> {
    /// Writes the value's JSON text; returns the length of `to_json`'s
    /// text for it, which differs only for a `date` written as a number.
    fn write(self, out: &mut String, date: bool) -> Result<usize, Reject> {
        let start = out.len();
        match self {
            Scalar::Null => out.push_str("null"),
            Scalar::Bool(b) => out.push_str(if b { "true" } else { "false" }),
            Scalar::Int(i) => out.push_str(itoa::Buffer::new().format(i)),
            Scalar::Float(f) => push_float(out, f64::from(f), || serde_json::to_string(&f)),
            Scalar::Double(f) => push_float(out, f, || serde_json::to_string(&f)),
            Scalar::Text(s) => push_json_string(out, s),
            Scalar::Bytes(b) => {
                out.push('"');
                base64(out, b);
                out.push('"');
            }
            // apache-avro cannot give back a decimal of no bytes.
            Scalar::Decimal([], _) => {
                return Err(invalid_format("unreadable decimal (no bytes)".into()));
            }
            Scalar::Decimal(b, scale) => push_decimal(out, b, scale)?,
            Scalar::Instant(t, per_second) => {
                if let Some(len) = date.then(|| date_millis(out, t, per_second)).flatten() {
                    return Ok(len);
                }
                push_instant(out, t, per_second, true);
            }
        }
        Ok(out.len() - start)
    }
}

/// A `date` within the default rule's range, written as its epoch
/// milliseconds (what RFC 3339 text of it parses to); returns the length
/// of that RFC 3339 text, quoted. `None` out of range: the text is then
/// written as `to_json` writes it, and refused alike.
fn date_millis(out: &mut String, t: i64, per_second: i64) -> Option<usize> {
    let ms = t.div_euclid(per_second / 1_000);
    if !(0..=MAX_EPOCH_SECONDS * 1000 + 999).contains(&ms) {
        return None;
    }
    out.push_str(itoa::Buffer::new().format(ms));
    // "YYYY-MM-DDTHH:MM:SS" (19), the point, the digits, "Z", the quotes:
    // the year has four digits throughout the range.
    let digits = match per_second {
        1_000 => 3,
        1_000_000 => 6,
        _ => 9,
    };
    Some(19 + 1 + digits + 1 + 2)
}

/// The bytes of a datum not yet read.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn value(&mut self, kind: &'a Kind) -> Result<Scalar<'a>, String> {
        Ok(match kind {
            Kind::Null => Scalar::Null,
            Kind::Boolean => match self.take(1)? {
                [0] => Scalar::Bool(false),
                [1] => Scalar::Bool(true),
                [b] => return Err(format!("{b} is not a boolean")),
                _ => unreachable!("take(1) is one byte"),
            },
            Kind::Int => Scalar::Int(i64::from(self.int()?)),
            Kind::Long => Scalar::Int(self.long()?),
            Kind::Float => Scalar::Float(f32::from_le_bytes(self.array()?)),
            Kind::Double => Scalar::Double(f64::from_le_bytes(self.array()?)),
            Kind::Text => Scalar::Text(self.text()?),
            Kind::Bytes(size) => Scalar::Bytes(self.bytes(*size)?),
            Kind::Enum(symbols) => {
                let index = self.int()?;
                let symbol = usize::try_from(index).ok().and_then(|i| symbols.get(i));
                Scalar::Text(symbol.ok_or_else(|| format!("no enum symbol {index}"))?)
            }
            Kind::Decimal { scale, size } => Scalar::Decimal(self.bytes(*size)?, *scale),
            Kind::Instant(per_second) => Scalar::Instant(self.long()?, *per_second),
            Kind::Union(branches) => {
                let index = self.long()?;
                let branch = usize::try_from(index).ok().and_then(|i| branches.get(i));
                self.value(branch.ok_or_else(|| format!("no union branch {index}"))?)?
            }
        })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.0.len() {
            return Err(format!("{n} bytes wanted, {} left", self.0.len()));
        }
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// A zig-zag varint of at most ten bytes, as apache-avro reads one
    /// (bits past the 64th dropped).
    fn long(&mut self) -> Result<i64, String> {
        let mut z = 0u64;
        for (i, &b) in self.0.iter().take(10).enumerate() {
            z |= u64::from(b & 0x7f) << (i * 7);
            if b & 0x80 == 0 {
                self.0 = &self.0[i + 1..];
                return Ok((z >> 1) as i64 ^ -((z & 1) as i64));
            }
        }
        Err(if self.0.len() < 10 {
            "the datum ends inside a varint".into()
        } else {
            "a varint longer than ten bytes".into()
        })
    }

    fn int(&mut self) -> Result<i32, String> {
        let n = self.long()?;
        i32::try_from(n).map_err(|_| format!("{n} is not an int"))
    }

    /// `fixed` of `size` bytes, or length-prefixed `bytes`.
    fn bytes(&mut self, size: Option<usize>) -> Result<&'a [u8], String> {
        let n = match size {
            Some(n) => n,
            None => {
                let n = self.long()?;
                usize::try_from(n).map_err(|_| format!("a length of {n}"))?
            }
        };
        self.take(n)
    }

    fn text(&mut self) -> Result<&'a str, String> {
        std::str::from_utf8(self.bytes(None)?).map_err(|e| format!("a string not UTF-8 ({e})"))
    }
}

#[cfg(test)]
mod tests;
