//! Avro records (Confluent wire format) read into the JSON text the
//! default schema and the mappings read. The datum is decoded with the
//! writer's schema, the one its id names (Apache Avro's own crate does the
//! binary reading), and the value is written out as JSON with the schema
//! beside it, because only the schema knows a decimal's scale:
//!
//! - `decimal` (bytes or fixed) becomes a JSON number written from its
//!   unscaled two's-complement integer and scale, digit for digit, so
//!   `price` and `qty` reach Decimal128 exactly, never through a float;
//! - `timestamp-millis`/`-micros`/`-nanos` become RFC 3339 text in UTC at
//!   their precision, the date the default schema reads; `local-timestamp-*`
//!   the same without an offset; `date` is `YYYY-MM-DD`;
//! - a union is its branch's value, an enum its symbol, a record or map an
//!   object, `bytes`/`fixed` base64 text, a non-finite float the text
//!   `"NaN"`/`"Infinity"`/`"-Infinity"` (which no number field accepts).
//!
//! Why JSON text: every rule of the trade (ids, exact decimals, dates,
//! mappings' pointers, kept fields, sizes) is defined on it once; a second
//! reader of Avro values would be a second set of rules to keep equal.
//! A topic without a mapping whose schema's top-level fields are scalars
//! skips the whole object's text ([`fields`]): each field's text goes
//! to the same rules, as written here.

use std::collections::HashMap;
use std::fmt::Write;

use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::schema::{Name, ResolvedSchema, Schema};
use apache_avro::types::Value;

use super::{Reject, RejectKind};

mod fields;
pub use fields::Fields;
use fields::Plan;

/// Deepest nesting of records, arrays, maps and unions written out; the
/// default schema refuses deeper kept fields anyway.
const MAX_DEPTH: usize = 64;

/// Longest decimal accepted, in bytes of its unscaled integer: 64 bytes is
/// over 150 digits, far past Decimal128's 34, so nothing storable is cut.
const MAX_DECIMAL_BYTES: usize = 64;

/// A writer's schema, parsed, with the named types it and its references
/// define (a `Ref` is looked up there), and its datum reader.
pub struct AvroSchema {
    reader: Prepared,
    names: HashMap<Name, Schema>,
    /// How to read the default schema's fields straight from a datum, if
    /// every top-level field is a scalar.
    plan: Option<Box<Plan>>,
}

impl std::fmt::Debug for AvroSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AvroSchema")
            .field("root", self.root())
            .finish_non_exhaustive()
    }
}

/// The root schema and the referenced ones, in the order given.
struct Schemata {
    root: Schema,
    references: Vec<Schema>,
}

/// The datum reader of one writer's schema, built once with the schema.
/// Building it resolves every named type of the schema and its references
/// into a table; built per record, as it was, that was 2,370 of an Avro
/// trade's 26,675 instructions and 5 of its 46 allocations
/// (docs/benchmarks.md, "Hot path"). The reader borrows the schemas, so
/// both live in one self-referencing cell (ouroboros, which apache-avro
/// itself uses for its owned schemas).
#[ouroboros::self_referencing]
struct Prepared {
    schemata: Schemata,
    #[borrows(schemata)]
    #[covariant]
    reader: GenericDatumReader<'this>,
}

impl AvroSchema {
    /// Parses the registry's schema text; `references` are the texts of the
    /// schemas it references (Confluent schema references), dependencies
    /// first.
    pub fn parse(text: &str, references: &[String]) -> Result<AvroSchema, String> {
        let (root, references) = if references.is_empty() {
            (
                Schema::parse_str(text).map_err(|e| e.to_string())?,
                Vec::new(),
            )
        } else {
            Schema::parse_str_with_list(text, references).map_err(|e| e.to_string())?
        };
        let schemata = Schemata { root, references };
        let resolved = ResolvedSchema::try_from(schemata.all()).map_err(|e| e.to_string())?;
        let names = resolved
            .get_names()
            .iter()
            .map(|(n, s)| (n.clone(), (*s).clone()))
            .collect();
        let reader = PreparedTryBuilder {
            schemata,
            reader_builder: |s: &Schemata| {
                GenericDatumReader::builder(&s.root)
                    .writer_schemata(s.all())?
                    .build()
            },
        }
        .try_build()
        .map_err(|e: apache_avro::Error| e.to_string())?;
        let plan = Plan::of(&reader.borrow_schemata().root, &names).map(Box::new);
        Ok(AvroSchema {
            reader,
            names,
            plan,
        })
    }

    /// The datum's top-level fields for the default schema (no mapping),
    /// read without `to_json`'s text in between; `None` when the schema
    /// has a field only `to_json` reads (see [`fields`]).
    pub fn fields<'a>(
        &'a self,
        datum: &'a [u8],
        max_bytes: usize,
    ) -> Option<Result<Fields<'a>, Reject>> {
        self.plan.as_ref().map(|plan| plan.read(datum, max_bytes))
    }

    /// The writer's schema itself.
    pub fn root(&self) -> &Schema {
        &self.reader.borrow_schemata().root
    }

    /// The datum (the payload after the 5-byte header) as JSON text, at
    /// most `max_bytes` long.
    pub fn to_json(&self, datum: &[u8], max_bytes: usize) -> Result<String, Reject> {
        let mut reader = datum;
        let value = self
            .reader
            .borrow_reader()
            .read_value(&mut reader)
            .map_err(|e| invalid_format(format!("not an Avro datum of its schema ({e})")))?;
        if !reader.is_empty() {
            return Err(invalid_format(format!(
                "{} bytes left after the Avro datum",
                reader.len()
            )));
        }
        let mut out = Writer {
            names: &self.names,
            out: String::with_capacity(datum.len() * 2),
            max_bytes,
        };
        out.value(&value, Some(self.root()), 0)?;
        Ok(out.out)
    }
}

impl Schemata {
    /// The references, then the root: what names are resolved against.
    fn all(&self) -> Vec<&Schema> {
        let mut all: Vec<&Schema> = self.references.iter().collect();
        all.push(&self.root);
        all
    }
}

fn invalid_format(message: String) -> Reject {
    Reject::new(RejectKind::InvalidFormat, message)
}

struct Writer<'a> {
    names: &'a HashMap<Name, Schema>,
    out: String,
    max_bytes: usize,
}

impl<'a> Writer<'a> {
    /// `schema` with references followed.
    fn resolve(&self, schema: Option<&'a Schema>) -> Option<&'a Schema> {
        match schema {
            Some(Schema::Ref { name }) => self.names.get(name),
            other => other,
        }
    }

    fn value(
        &mut self,
        value: &Value,
        schema: Option<&'a Schema>,
        depth: usize,
    ) -> Result<(), Reject> {
        if depth > MAX_DEPTH {
            return Err(invalid_format(format!(
                "the record nests deeper than {MAX_DEPTH} levels"
            )));
        }
        if self.out.len() > self.max_bytes {
            return Err(Reject::new(
                RejectKind::Oversize,
                format!("the decoded record is over {} bytes", self.max_bytes),
            ));
        }
        let schema = self.resolve(schema);
        if self.scalar(value, schema)? {
            return Ok(());
        }
        self.composite(value, schema, depth)
    }

    /// A union's branch, an array, a map or a record (`value` handled the
    /// scalars).
    fn composite(
        &mut self,
        value: &Value,
        schema: Option<&'a Schema>,
        depth: usize,
    ) -> Result<(), Reject> {
        match value {
            Value::Union(i, inner) => {
                let branch = match schema {
                    Some(Schema::Union(u)) => u.variants().get(*i as usize),
                    _ => None,
                };
                self.value(inner, branch, depth + 1)
            }
            Value::Array(items) => {
                let item = match schema {
                    Some(Schema::Array(a)) => Some(&*a.items),
                    _ => None,
                };
                self.array(items, item, depth)
            }
            Value::Map(entries) => {
                let item = match schema {
                    Some(Schema::Map(m)) => Some(&*m.types),
                    _ => None,
                };
                // Sorted, so one record always gives one text.
                let mut sorted: Vec<_> = entries.iter().collect();
                sorted.sort_by(|a, b| a.0.cmp(b.0));
                self.object(
                    sorted.into_iter().map(|(k, v)| (k.as_str(), v, item)),
                    depth,
                )
            }
            Value::Record(fields) => {
                let of = |name: &str| match schema {
                    Some(Schema::Record(r)) => r
                        .lookup
                        .get(name)
                        .and_then(|&i| r.fields.get(i))
                        .map(|f| &f.schema),
                    _ => None,
                };
                self.object(fields.iter().map(|(k, v)| (k.as_str(), v, of(k))), depth)
            }
            other => Err(invalid_format(format!(
                "an Avro value of no known kind ({other:?})"
            ))),
        }
    }

    fn array(
        &mut self,
        items: &[Value],
        item: Option<&'a Schema>,
        depth: usize,
    ) -> Result<(), Reject> {
        self.out.push('[');
        for (i, v) in items.iter().enumerate() {
            if i > 0 {
                self.out.push(',');
            }
            self.value(v, item, depth + 1)?;
        }
        self.out.push(']');
        Ok(())
    }

    fn object<'v>(
        &mut self,
        members: impl Iterator<Item = (&'v str, &'v Value, Option<&'a Schema>)>,
        depth: usize,
    ) -> Result<(), Reject> {
        self.out.push('{');
        for (i, (name, v, s)) in members.enumerate() {
            if i > 0 {
                self.out.push(',');
            }
            push_json_string(&mut self.out, name);
            self.out.push(':');
            self.value(v, s, depth + 1)?;
        }
        self.out.push('}');
        Ok(())
    }

    /// Writes a value that holds no other; `false` for a container.
    fn scalar(&mut self, value: &Value, schema: Option<&Schema>) -> Result<bool, Reject> {
        let out = &mut self.out;
        match value {
            Value::Null => out.push_str("null"),
            Value::Boolean(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Int(i) | Value::TimeMillis(i) => out.push_str(itoa::Buffer::new().format(*i)),
            Value::Long(i) | Value::TimeMicros(i) => out.push_str(itoa::Buffer::new().format(*i)),
            Value::Float(f) => push_float(out, f64::from(*f), || serde_json::to_string(f)),
            Value::Double(f) => push_float(out, *f, || serde_json::to_string(f)),
            Value::Bytes(b) | Value::Fixed(_, b) => {
                out.push('"');
                base64(out, b);
                out.push('"');
            }
            Value::String(s) | Value::Enum(_, s) => push_json_string(out, s),
            Value::Uuid(u) => push_json_string(out, &u.to_string()),
            Value::Decimal(d) => {
                let scale = match schema {
                    Some(Schema::Decimal(d)) => d.scale,
                    _ => return Err(invalid_format("a decimal without its scale".into())),
                };
                let bytes = <Vec<u8>>::try_from(d)
                    .map_err(|e| invalid_format(format!("unreadable decimal ({e})")))?;
                push_decimal(out, &bytes, scale)?;
            }
            Value::BigDecimal(d) => out.push_str(&d.to_string()),
            Value::Date(days) => push_date(out, *days),
            Value::TimestampMillis(t) => push_instant(out, *t, 1_000, true),
            Value::TimestampMicros(t) => push_instant(out, *t, 1_000_000, true),
            Value::TimestampNanos(t) => push_instant(out, *t, 1_000_000_000, true),
            Value::LocalTimestampMillis(t) => push_instant(out, *t, 1_000, false),
            Value::LocalTimestampMicros(t) => push_instant(out, *t, 1_000_000, false),
            Value::LocalTimestampNanos(t) => push_instant(out, *t, 1_000_000_000, false),
            Value::Duration(d) => {
                let _ = write!(
                    out,
                    r#"{{"months":{},"days":{},"millis":{}}}"#,
                    u32::from(d.months()),
                    u32::from(d.days()),
                    u32::from(d.millis())
                );
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

fn push_json_string(out: &mut String, s: &str) {
    // Most text (names, ids, tickers) needs no escape: written as it is,
    // without serde_json's String per call, which was a third of the
    // writer's instructions. JSON escapes only these; serde_json writes
    // the rest as it is too, so the text is the same either way.
    if !s.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20) {
        out.push('"');
        out.push_str(s);
        out.push('"');
        return;
    }
    // Serialising a str cannot fail.
    out.push_str(&serde_json::to_string(s).unwrap_or_default());
}

/// A finite float as its shortest round-trip text (what a JSON upstream
/// writes); a non-finite one as text no number field accepts.
fn push_float(out: &mut String, f: f64, shortest: impl FnOnce() -> serde_json::Result<String>) {
    if f.is_nan() {
        out.push_str("\"NaN\"");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 {
            "\"Infinity\""
        } else {
            "\"-Infinity\""
        });
    } else {
        out.push_str(&shortest().unwrap_or_else(|_| "null".into()));
    }
}

fn push_date(out: &mut String, days: i32) {
    match chrono::NaiveDate::from_ymd_opt(1970, 1, 1)
        .and_then(|d| d.checked_add_signed(chrono::TimeDelta::try_days(i64::from(days))?))
    {
        Some(d) => {
            let _ = write!(out, "\"{}\"", d.format("%Y-%m-%d"));
        }
        None => {
            let _ = write!(out, "{days}");
        }
    }
}

/// An instant `t` in units of 1/`per_second` s since the epoch, as RFC 3339
/// at that precision; `utc`: with `Z` (else a local date-time, no offset).
/// Out of chrono's range it stays the integer (no date field accepts it).
fn push_instant(out: &mut String, t: i64, per_second: i64, utc: bool) {
    use chrono::SecondsFormat;
    let secs = t.div_euclid(per_second);
    let nanos = t.rem_euclid(per_second) * (1_000_000_000 / per_second);
    let Some(dt) = chrono::DateTime::from_timestamp(secs, nanos as u32) else {
        let _ = write!(out, "{t}");
        return;
    };
    let format = match per_second {
        1_000 => SecondsFormat::Millis,
        1_000_000 => SecondsFormat::Micros,
        _ => SecondsFormat::Nanos,
    };
    let text = dt.to_rfc3339_opts(format, true);
    out.push('"');
    out.push_str(if utc {
        &text
    } else {
        text.strip_suffix('Z').unwrap_or(&text)
    });
    out.push('"');
}

/// Standard base64 with padding, as the proto3 JSON mapping writes bytes.
pub(crate) fn base64(out: &mut String, bytes: &[u8]) {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
}

/// An Avro decimal as JSON number text: `bytes` is the unscaled value,
/// big-endian two's complement; `scale` digits go after the point. Exact:
/// the digits are those of the integer, the point placed by text.
pub fn decimal_text(bytes: &[u8], scale: usize) -> Result<String, Reject> {
    let mut text = String::new();
    push_decimal(&mut text, bytes, scale)?;
    Ok(text)
}

/// [`decimal_text`], appended to `out`.
pub(crate) fn push_decimal(out: &mut String, bytes: &[u8], scale: usize) -> Result<(), Reject> {
    if bytes.len() > MAX_DECIMAL_BYTES {
        return Err(Reject::new(
            RejectKind::InvalidField,
            format!("a decimal of {} bytes is beyond Decimal128", bytes.len()),
        ));
    }
    let negative = bytes.first().is_some_and(|b| b & 0x80 != 0);
    let mut buffer = itoa::Buffer::new();
    let long;
    // Up to 16 bytes (38 digits, past Decimal128's 34) the integer is an
    // i128; the schoolbook division below is for the rest.
    let digits: &str = if bytes.len() <= 16 {
        let mut wide = [if negative { 0xff } else { 0 }; 16];
        wide[16 - bytes.len()..].copy_from_slice(bytes);
        buffer.format(i128::from_be_bytes(wide).unsigned_abs())
    } else {
        long = magnitude_digits(magnitude(bytes, negative));
        &long
    };
    if negative {
        out.push('-');
    }
    match digits.len().checked_sub(scale) {
        Some(int) if int > 0 => {
            out.push_str(&digits[..int]);
            if scale > 0 {
                out.push('.');
                out.push_str(&digits[int..]);
            }
        }
        _ => {
            out.push('0');
            if scale > 0 {
                out.push('.');
                out.extend(std::iter::repeat_n('0', scale - digits.len()));
                out.push_str(digits);
            }
        }
    }
    Ok(())
}

/// The absolute value of a big-endian two's-complement integer.
fn magnitude(bytes: &[u8], negative: bool) -> Vec<u8> {
    let mut magnitude = bytes.to_vec();
    if negative {
        // Two's complement: invert and add one.
        magnitude.iter_mut().for_each(|b| *b = !*b);
        for b in magnitude.iter_mut().rev() {
            let (sum, carry) = b.overflowing_add(1);
            *b = sum;
            if !carry {
                break;
            }
        }
    }
    magnitude
}

/// The decimal digits of a big-endian unsigned integer (schoolbook
/// division by ten; the input is at most [`MAX_DECIMAL_BYTES`]).
fn magnitude_digits(mut n: Vec<u8>) -> String {
    let mut digits = Vec::new();
    while n.iter().any(|&b| b != 0) {
        let mut rem = 0u32;
        for b in n.iter_mut() {
            let cur = (rem << 8) | u32::from(*b);
            *b = (cur / 10) as u8;
            rem = cur % 10;
        }
        digits.push(b'0' + rem as u8);
    }
    if digits.is_empty() {
        digits.push(b'0');
    }
    digits.reverse();
    String::from_utf8(digits).unwrap_or_default()
}

#[cfg(test)]
mod tests;
