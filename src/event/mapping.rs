//! Declarative input mapping: a topic's upstream schema read into the
//! trade the default schema would make of the same data. A mapping is
//! compiled once, at start, from its checked plan (`config::mapping`):
//! its JSON Pointers become one tree of names, walked in a single pass
//! over the payload, each nested object parsed once however many fields
//! it holds; a `type` value map becomes a small table. Per event nothing
//! is interpreted from the configuration.
//!
//! What a mapped field yields goes through the default schema's own
//! parsers and checks (`values`, `TradeFields`): money stays exact (the
//! JSON text of a number, or of a string holding one, parsed into
//! Decimal128), customer ids take their canonical form wherever they come
//! from, and the entry is built and bounded as for any trade. A value read
//! from the record key or a header is its text, read as a JSON string
//! would be: `"7"` from a key is customer `7`, as in a payload.

use std::borrow::Cow;
use std::sync::Arc;

use serde_json::value::RawValue;

use super::dates::parse_date_by;
use super::decode::{payload_text, TradeFields};
use super::pointer::{self, LevelError, Members};
use super::values::*;
use super::*;
use crate::config::mapping::{
    DateRule, Place, Plan, SideRule, TradeField, UnknownSide, RESERVED_NAMES,
};
use crate::config::{MappingError, Settings};

/// A record as the decoder sees it: payload, key and headers (names and
/// values as bytes, as `kafka::headers` reads them).
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordParts<'a> {
    pub payload: Option<&'a [u8]>,
    pub key: Option<&'a [u8]>,
    pub headers: &'a [(Vec<u8>, Option<Vec<u8>>)],
}

/// The compiled mappings of the worker's topics.
#[derive(Debug, Default)]
pub struct Mappings {
    topics: Vec<(String, Arc<Mapping>)>,
}

impl Mappings {
    /// The settings' `[[mappings]]`, checked and compiled.
    pub fn from_settings(settings: &Settings) -> Result<Mappings, MappingError> {
        Ok(Mappings::compile(&settings.mapping_plans()?))
    }

    pub fn compile(plans: &[Plan]) -> Mappings {
        Mappings {
            topics: plans
                .iter()
                .map(|p| (p.topic.clone(), Arc::new(Mapping::compile(p))))
                .collect(),
        }
    }

    /// `topic`'s mapping; `None` means the default schema.
    pub fn get(&self, topic: &str) -> Option<&Arc<Mapping>> {
        self.topics.iter().find(|(t, _)| t == topic).map(|(_, m)| m)
    }

    pub fn is_empty(&self) -> bool {
        self.topics.is_empty()
    }

    /// Each mapped topic and its mapping.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Arc<Mapping>)> {
        self.topics.iter().map(|(t, m)| (t.as_str(), m))
    }
}

/// Decodes a record by `mapping`, or by the default schema (the payload
/// alone, exactly as [`decode_as`]) without one.
pub fn decode_mapped(
    mapping: Option<&Mapping>,
    record: RecordParts<'_>,
    identity: Identity<'_>,
    max_bytes: usize,
) -> Result<Trade, Reject> {
    match mapping {
        None => decode_as(record.payload, identity, max_bytes),
        Some(m) => m.decode(record, identity, max_bytes),
    }
}

/// One topic's mapping, compiled.
#[derive(Debug)]
pub struct Mapping {
    /// The payload pointers of the trade fields and kept fields, as a tree.
    root: Node,
    /// Where each field is read, as written (for messages); `None` for the
    /// default `qty` (`/qty` or `/quantity`).
    places: [Option<Place>; 8],
    key_fields: Vec<TradeField>,
    header_fields: Vec<(Vec<u8>, TradeField)>,
    /// Spellings and the side each means (`None`: the default rule).
    side: Option<(SideTable, UnknownSide)>,
    date: DateRule,
    /// The stored names of kept fields, by [`Target::Keep`] index.
    keep_names: Vec<Box<str>>,
    /// Keep every top-level field no trade field is read from.
    keep_all: bool,
}

/// A value map's spellings and the side each means.
type SideTable = Vec<(Box<str>, &'static str)>;

#[derive(Debug, Default)]
struct Node {
    children: Vec<Child>,
}

/// One name (or array index) below a node.
#[derive(Debug)]
struct Child {
    name: Box<str>,
    index: Option<usize>,
    /// The pointer to here, for messages.
    path: Box<str>,
    /// What the value here is read as.
    targets: Vec<Target>,
    /// Names below, if any pointer goes deeper.
    inner: Node,
}

#[derive(Debug, Clone, Copy)]
enum Target {
    Field(TradeField),
    Keep(usize),
}

impl Node {
    fn insert(&mut self, tokens: &[String], target: Target) {
        let mut node = self;
        let mut path = String::new();
        for (depth, token) in tokens.iter().enumerate() {
            path.push('/');
            path.push_str(&token.replace('~', "~0").replace('/', "~1"));
            let at = match node.children.iter().position(|c| *c.name == **token) {
                Some(i) => i,
                None => {
                    node.children.push(Child {
                        name: token.as_str().into(),
                        index: pointer::index_of(token),
                        path: path.as_str().into(),
                        targets: Vec::new(),
                        inner: Node::default(),
                    });
                    node.children.len() - 1
                }
            };
            let child = &mut node.children[at];
            if depth + 1 == tokens.len() {
                child.targets.push(target);
                return;
            }
            node = &mut child.inner;
        }
    }
}

/// What one payload yields, before parsing: each trade field's JSON text
/// and the fields to keep.
struct Read<'a> {
    raw: [Option<Cow<'a, str>>; 8],
    extras: Members<'a>,
}

impl Mapping {
    /// Compiles a checked plan; cannot fail (the checks are the plan's).
    pub fn compile(plan: &Plan) -> Mapping {
        let mut m = Mapping {
            root: Node::default(),
            places: plan.places.clone(),
            key_fields: Vec::new(),
            header_fields: Vec::new(),
            side: match &plan.side {
                SideRule::Default => None,
                SideRule::Map { spellings, unknown } => Some((
                    spellings
                        .iter()
                        .map(|(s, buy)| (s.as_str().into(), if *buy { "buy" } else { "sell" }))
                        .collect(),
                    *unknown,
                )),
            },
            date: plan.date.clone(),
            keep_names: Vec::new(),
            keep_all: plan.keep.is_none(),
        };
        for field in TradeField::ALL {
            match &plan.places[field.index()] {
                Some(Place::Pointer(tokens)) => m.root.insert(tokens, Target::Field(field)),
                Some(Place::Key) => m.key_fields.push(field),
                Some(Place::Header(h)) => m.header_fields.push((h.as_bytes().to_vec(), field)),
                // The default qty, with its alias (a payload with both is
                // refused, as by the default schema).
                None => {
                    for name in ["qty", "quantity"] {
                        m.root.insert(&[name.to_string()], Target::Field(field));
                    }
                }
            }
        }
        for (name, tokens) in plan.keep.iter().flatten() {
            m.root.insert(tokens, Target::Keep(m.keep_names.len()));
            m.keep_names.push(name.as_str().into());
        }
        m
    }

    /// Decodes one record by this mapping.
    pub fn decode(
        &self,
        record: RecordParts<'_>,
        identity: Identity<'_>,
        max_bytes: usize,
    ) -> Result<Trade, Reject> {
        let text = payload_text(record.payload, max_bytes)?;
        let members = pointer::object(text).map_err(|e| level_reject(e, None))?;
        let mut read = Read {
            raw: Default::default(),
            extras: Vec::new(),
        };
        self.walk(&self.root, members, &mut read, true)?;
        self.read_key_and_headers(&record, &mut read)?;
        self.trade_fields(read)?.into_trade(identity)
    }

    /// One object's members: the ones a pointer names are read, the rest
    /// kept (top level, `keep = "all"`) or left.
    fn walk<'a>(
        &'a self,
        node: &'a Node,
        members: Members<'a>,
        read: &mut Read<'a>,
        top: bool,
    ) -> Result<(), Reject> {
        for (name, raw) in members {
            match node.children.iter().find(|c| *c.name == *name) {
                Some(child) => self.enter(child, raw, read)?,
                None if top && self.keep_all => self.keep_other(name, raw, read)?,
                None => {}
            }
        }
        Ok(())
    }

    fn enter<'a>(
        &'a self,
        child: &'a Child,
        raw: &'a RawValue,
        read: &mut Read<'a>,
    ) -> Result<(), Reject> {
        for target in &child.targets {
            match *target {
                Target::Field(f) => self.set(read, f, Cow::Borrowed(raw.get()))?,
                Target::Keep(i) => read.extras.push((Cow::Borrowed(&self.keep_names[i]), raw)),
            }
        }
        if child.inner.children.is_empty() {
            return Ok(());
        }
        let text = raw.get();
        match text.as_bytes().first() {
            Some(b'{') => {
                let members =
                    pointer::object(text).map_err(|e| level_reject(e, Some(&child.path)))?;
                self.walk(&child.inner, members, read, false)
            }
            Some(b'[') => {
                let items = pointer::array(text).unwrap_or_default();
                for c in &child.inner.children {
                    if let Some(item) = c.index.and_then(|i| items.get(i)) {
                        self.enter(c, item, read)?;
                    }
                }
                Ok(())
            }
            // Not a container: nothing below it exists, and a required
            // field below is reported missing, naming its pointer.
            _ => Ok(()),
        }
    }

    /// A top-level field no trade field is read from, under `keep = "all"`.
    /// One with a trade field's name is refused: the mapping reads that
    /// field elsewhere, and which of the two was meant is unknowable.
    fn keep_other<'a>(
        &self,
        name: Cow<'a, str>,
        raw: &'a RawValue,
        read: &mut Read<'a>,
    ) -> Result<(), Reject> {
        if let Some(field) = TradeField::ALL.into_iter().find(|f| f.as_str() == name) {
            let place = self.place_text(field);
            return Err(field_err(
                &name,
                &format!(
                    "the payload has /{name}, but this topic's mapping reads {field} from {place}: \
                     drop it with `keep`, or read {field} from /{name}"
                ),
            ));
        }
        if RESERVED_NAMES.contains(&name.as_ref()) && name != "key" && name != "offsetMinutes" {
            return Err(field_err(
                &name,
                "is the default schema's name of qty, which this mapping reads elsewhere: drop it with `keep`",
            ));
        }
        read.extras.push((name, raw));
        Ok(())
    }

    fn set<'a>(&self, read: &mut Read<'a>, f: TradeField, raw: Cow<'a, str>) -> Result<(), Reject> {
        let slot = &mut read.raw[f.index()];
        if slot.is_some() {
            // Only the default qty reads two places.
            return Err(Reject::new(
                RejectKind::DuplicateField,
                "both qty and quantity are present",
            ));
        }
        *slot = Some(raw);
        Ok(())
    }

    fn read_key_and_headers<'a>(
        &self,
        record: &RecordParts<'a>,
        read: &mut Read<'a>,
    ) -> Result<(), Reject> {
        for &f in &self.key_fields {
            if let Some(bytes) = record.key {
                self.set(read, f, Cow::Owned(self.as_json_text(f, bytes)?))?;
            }
        }
        for (name, f) in &self.header_fields {
            let mut found = record.headers.iter().filter(|(n, _)| n == name);
            match (found.next(), found.next()) {
                (Some(_), Some(_)) => {
                    return Err(self.annotate(
                        field_err(f.as_str(), "the header appears more than once"),
                        *f,
                    ))
                }
                (Some((_, Some(bytes))), None) => {
                    let text = self.as_json_text(*f, bytes)?;
                    self.set(read, *f, Cow::Owned(text))?;
                }
                // Absent or null: the field is absent.
                _ => {}
            }
        }
        Ok(())
    }

    /// A key's or header's bytes as the JSON string they are read as.
    fn as_json_text(&self, f: TradeField, bytes: &[u8]) -> Result<String, Reject> {
        let text = std::str::from_utf8(bytes)
            .map_err(|_| self.annotate(field_err(f.as_str(), "is not UTF-8"), f))?;
        serde_json::to_string(text)
            .map_err(|e| self.annotate(field_err(f.as_str(), &e.to_string()), f))
    }

    /// Each field parsed by the default schema's rules, errors naming
    /// where it was read.
    fn trade_fields(&self, read: Read<'_>) -> Result<TradeFields, Reject> {
        use TradeField as F;
        for f in [F::CustomerId, F::Type, F::Ticker, F::Qty, F::Date] {
            if read.raw[f.index()].is_none() {
                let message = match &self.places[f.index()] {
                    Some(place) => format!("{f} is required: nothing at {place}"),
                    None => format!("{f} is required"),
                };
                return Err(Reject::new(RejectKind::MissingField, message));
            }
        }
        let at = |f: F| move |e: Reject| self.annotate(e, f);
        let raw = |f: F| read.raw[f.index()].as_deref().filter(|r| *r != "null");
        let mut t = TradeFields::default();
        if let Some(r) = read.raw[F::TradeId.index()].as_deref() {
            t.trade_id = Some(parse_trade_id(r).map_err(at(F::TradeId))?);
        }
        let required = |f: F| read.raw[f.index()].as_deref().unwrap_or("null");
        t.customer = Some(parse_customer(required(F::CustomerId)).map_err(at(F::CustomerId))?);
        t.side = Some(self.side(required(F::Type)).map_err(at(F::Type))?);
        t.ticker = Some(parse_ticker(required(F::Ticker)).map_err(at(F::Ticker))?);
        t.qty = Some(parse_qty(required(F::Qty)).map_err(at(F::Qty))?);
        t.price = raw(F::Price)
            .map(parse_price)
            .transpose()
            .map_err(at(F::Price))?;
        t.currency = raw(F::Currency)
            .map(parse_currency)
            .transpose()
            .map_err(at(F::Currency))?;
        t.date = Some(parse_date_by(required(F::Date), &self.date).map_err(at(F::Date))?);
        for (name, value) in &read.extras {
            t.read_extra(name, value.get())?;
        }
        Ok(t)
    }

    /// `type` by the value map, or the default rule without one.
    fn side(&self, raw: &str) -> Result<&'static str, Reject> {
        let Some((spellings, unknown)) = &self.side else {
            return parse_side(raw);
        };
        let text: Cow<'_, str> = if raw.starts_with('"') {
            match serde_json::from_str::<&str>(raw) {
                Ok(s) => Cow::Borrowed(s),
                Err(_) => Cow::Owned(
                    serde_json::from_str::<String>(raw)
                        .map_err(|_| field_err("type", "is not a valid string"))?,
                ),
            }
        } else if is_json_number(raw) {
            Cow::Borrowed(raw)
        } else {
            return Err(field_err("type", "must be a string or a number"));
        };
        if let Some((_, side)) = spellings.iter().find(|(s, _)| **s == *text) {
            return Ok(*side);
        }
        match unknown {
            UnknownSide::Buy => Ok("buy"),
            UnknownSide::Sell => Ok("sell"),
            UnknownSide::Reject => {
                let shown: String = text.chars().take(64).collect();
                Err(field_err(
                    "type",
                    &format!("{shown:?} is not in the value map, and unknown values are rejected"),
                ))
            }
        }
    }

    fn place_text(&self, f: TradeField) -> String {
        match &self.places[f.index()] {
            Some(p) => p.to_string(),
            None => "/qty or /quantity".to_string(),
        }
    }

    /// `f`'s message, naming where `f` was read: `type (from /Side): ...`.
    fn annotate(&self, mut e: Reject, f: TradeField) -> Reject {
        let place = self.place_text(f);
        let prefix = format!("{f}: ");
        e.message = match e.message.strip_prefix(&prefix) {
            Some(rest) => format!("{f} (from {place}): {rest}"),
            None => format!("{} (from {place})", e.message),
        };
        e
    }
}

/// A level that could not be read, as the default schema reports the top
/// one; a nested one names its pointer.
fn level_reject(e: LevelError, path: Option<&str>) -> Reject {
    let at = path.map(|p| format!(" (at {p})")).unwrap_or_default();
    match e {
        LevelError::Duplicate(m) => Reject::new(RejectKind::DuplicateField, format!("{m}{at}")),
        LevelError::NotObject(m) => Reject::new(
            RejectKind::NotObject,
            format!("payload must be a JSON object ({m})"),
        ),
        LevelError::Syntax(m) => Reject::new(RejectKind::NotJson, format!("{m}{at}")),
    }
}

#[cfg(test)]
mod tests;
