//! Input mappings (`[[mappings]]`): for a source topic, where each trade
//! field is read (a JSON Pointer into the payload, the record key or a
//! header) and how (a value map for `type`, a date format), and which other
//! fields are kept. This module owns what a *valid* mapping is: every rule
//! is checked here, once, at start and by `check-config`, and
//! [`MappingSettings::plan`] hands `event::mapping` a parsed form it
//! compiles without further checks. A topic without a mapping is read by
//! the default schema, exactly as before mappings existed.

use std::collections::BTreeMap;
use std::fmt;

use chrono::FixedOffset;
use serde::{Deserialize, Serialize};

/// One topic's mapping, as written in the configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MappingSettings {
    /// The source topic it reads (one of `kafka.topics`).
    pub topic: String,
    /// Where and how each trade field is read; a field not named here is
    /// read where the default schema reads it (`/<its name>`).
    #[serde(default)]
    pub fields: FieldMap,
    /// Which other payload fields are stored with the trade.
    #[serde(default)]
    pub keep: Keep,
}

/// The trade fields a mapping can place, by their stored names.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldMap {
    #[serde(rename = "customerId", skip_serializing_if = "Option::is_none")]
    pub customer_id: Option<FieldSettings>,
    #[serde(rename = "tradeId", skip_serializing_if = "Option::is_none")]
    pub trade_id: Option<FieldSettings>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub side: Option<FieldSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ticker: Option<FieldSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qty: Option<FieldSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub price: Option<FieldSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<FieldSettings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub date: Option<FieldSettings>,
}

/// Where one trade field is read, and the rules only some fields take.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldSettings {
    /// `"/a/b"` (a JSON Pointer, RFC 6901, into the payload), `"key"` (the
    /// record key, as text) or `"header:NAME"` (that header, as text).
    pub from: String,
    /// `type` only: the spellings of each side, e.g.
    /// `{ buy = ["1", "B"], sell = ["2", "S"] }`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub values: Option<SideValues>,
    /// `type` only, required with `values`: what a value not in the map
    /// becomes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unknown: Option<UnknownSide>,
    /// `date` only: how the value is written; absent, the default rule
    /// (RFC 3339 or integer epoch milliseconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<DateFormat>,
    /// `date` with `format = "pattern"`: a chrono strftime pattern.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// `date` with a pattern that has no offset in it: the offset its
    /// local times are at, `"Z"` or `"+HH:MM"` / `"-HH:MM"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<String>,
}

/// The spellings of each side in a `type` value map.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SideValues {
    #[serde(default)]
    pub buy: Vec<String>,
    #[serde(default)]
    pub sell: Vec<String>,
}

/// What a `type` value not in the map becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnknownSide {
    /// Dead-lettered (`invalid_field`), naming the value.
    Reject,
    Buy,
    Sell,
}

/// How a date is written upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DateFormat {
    /// `2023-10-26T15:47:03.434Z`, or with an offset.
    Rfc3339,
    EpochSeconds,
    EpochMillis,
    EpochMicros,
    EpochNanos,
    /// FIX `UTCTimestamp`: `YYYYMMDD-HH:MM:SS[.sss]`, UTC.
    Fix,
    /// `pattern`, at the offset it holds or at `offset`.
    Pattern,
}

/// Which payload fields, besides the trade's, are stored with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Keep {
    /// `"all"` or `"none"`.
    Mode(KeepMode),
    /// `{ storedName = "/pointer", ... }`: these, under these names.
    Fields(BTreeMap<String, String>),
}

impl<'de> Deserialize<'de> for Keep {
    /// Untagged, with a message that says what is allowed (serde's own
    /// says only "did not match any variant").
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Fields(BTreeMap<String, String>),
        }
        let bad = || {
            serde::de::Error::custom(
                "keep must be \"all\", \"none\" or a table of stored name = \"/pointer\"",
            )
        };
        match Raw::deserialize(d).map_err(|_| bad())? {
            Raw::Text(t) if t == "all" => Ok(Keep::Mode(KeepMode::All)),
            Raw::Text(t) if t == "none" => Ok(Keep::Mode(KeepMode::None)),
            Raw::Text(_) => Err(bad()),
            Raw::Fields(f) => Ok(Keep::Fields(f)),
        }
    }
}

impl Default for Keep {
    fn default() -> Self {
        Keep::Mode(KeepMode::All)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KeepMode {
    /// Every top-level field not read as a trade field, under its name
    /// (what the default schema does).
    All,
    None,
}

/// A trade field, by its stored name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TradeField {
    CustomerId,
    TradeId,
    Type,
    Ticker,
    Qty,
    Price,
    Currency,
    Date,
}

impl TradeField {
    pub const ALL: [TradeField; 8] = [
        TradeField::CustomerId,
        TradeField::TradeId,
        TradeField::Type,
        TradeField::Ticker,
        TradeField::Qty,
        TradeField::Price,
        TradeField::Currency,
        TradeField::Date,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TradeField::CustomerId => "customerId",
            TradeField::TradeId => "tradeId",
            TradeField::Type => "type",
            TradeField::Ticker => "ticker",
            TradeField::Qty => "qty",
            TradeField::Price => "price",
            TradeField::Currency => "currency",
            TradeField::Date => "date",
        }
    }

    /// Its index in [`TradeField::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for TradeField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Names a kept field may not take: the trade's stored fields, the
/// customer (stored on the bucket), and the decoder's derived ones.
pub const RESERVED_NAMES: [&str; 11] = [
    "customerId",
    "tradeId",
    "type",
    "ticker",
    "qty",
    "price",
    "currency",
    "date",
    "key",
    "offsetMinutes",
    "quantity",
];

/// Header names the product writes and strips on replay: a mapping that
/// read one would read our bookkeeping, and lose it on a replay.
pub const OUR_HEADER_PREFIX: &str = "tradebucket.";

/// A mapping rule broken, naming the topic, the field and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mapping of topic {topic:?}, {field}: {message}")]
pub struct MappingError {
    pub topic: String,
    /// The trade field, `keep.<name>`, `keep` or `topic`.
    pub field: String,
    pub message: String,
}

/// Where a value is read.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Place {
    /// The unescaped reference tokens of a JSON Pointer.
    Pointer(Vec<String>),
    Key,
    Header(String),
}

impl Place {
    /// Where the default schema reads `field`.
    pub fn default_for(field: TradeField) -> Place {
        Place::Pointer(vec![field.as_str().to_string()])
    }
}

impl fmt::Display for Place {
    /// As written in `from`, so a dead letter's message names it the way
    /// the operator wrote it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Place::Key => f.write_str("key"),
            Place::Header(h) => write!(f, "header:{h}"),
            Place::Pointer(tokens) => tokens
                .iter()
                .try_for_each(|t| write!(f, "/{}", t.replace('~', "~0").replace('/', "~1"))),
        }
    }
}

/// How a `type` value is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SideRule {
    /// `"buy"` or `"sell"` as written.
    Default,
    /// Spellings and the side each means, then the rule for the rest.
    Map {
        spellings: Vec<(String, bool)>,
        unknown: UnknownSide,
    },
}

/// How a `date` value is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DateRule {
    /// RFC 3339 or integer epoch milliseconds, as the default schema.
    Default,
    Rfc3339,
    /// Integer epoch time in units per second (1, 1000, 10^6, 10^9).
    Epoch(i64),
    Fix,
    /// A pattern holding its offset (`%z` and kin).
    PatternWithOffset(String),
    /// A pattern of local times at a stated offset.
    PatternAt(String, FixedOffset),
}

/// Kept fields: each stored name and the pointer tokens it is read from.
pub type KeptFields = Vec<(String, Vec<String>)>;

/// A mapping, parsed and checked: what `event::mapping` compiles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub topic: String,
    /// For each field of [`TradeField::ALL`], where it is read; `None` for
    /// `qty` left to the default (`/qty`, or its alias `/quantity`).
    pub places: [Option<Place>; 8],
    pub side: SideRule,
    pub date: DateRule,
    /// `None`: keep every other top-level field; else these, by name.
    pub keep: Option<KeptFields>,
}

impl MappingSettings {
    fn err(&self, field: impl fmt::Display, message: impl Into<String>) -> MappingError {
        MappingError {
            topic: self.topic.clone(),
            field: field.to_string(),
            message: message.into(),
        }
    }

    /// Each field's settings, in [`TradeField::ALL`] order.
    fn settings(&self) -> [Option<&FieldSettings>; 8] {
        let f = &self.fields;
        [
            f.customer_id.as_ref(),
            f.trade_id.as_ref(),
            f.side.as_ref(),
            f.ticker.as_ref(),
            f.qty.as_ref(),
            f.price.as_ref(),
            f.currency.as_ref(),
            f.date.as_ref(),
        ]
    }

    /// Checks every rule and returns the parsed form.
    pub fn plan(&self) -> Result<Plan, MappingError> {
        let settings = self.settings();
        let mut places: [Option<Place>; 8] = Default::default();
        for field in TradeField::ALL {
            places[field.index()] = match settings[field.index()] {
                Some(s) => {
                    self.check_options(field, s)?;
                    Some(self.place(field, &s.from)?)
                }
                None if field == TradeField::Qty => None,
                None => Some(Place::default_for(field)),
            };
        }
        self.check_places(&places)?;
        Ok(Plan {
            topic: self.topic.clone(),
            side: self.side_rule(settings[TradeField::Type.index()])?,
            date: self.date_rule(settings[TradeField::Date.index()])?,
            keep: self.keep_plan()?,
            places,
        })
    }

    /// Options that only some fields take, given to another.
    fn check_options(&self, field: TradeField, s: &FieldSettings) -> Result<(), MappingError> {
        let side_only = s.values.is_some() || s.unknown.is_some();
        let date_only = s.format.is_some() || s.pattern.is_some() || s.offset.is_some();
        if side_only && field != TradeField::Type {
            return Err(self.err(field, "`values` and `unknown` apply to `type` only"));
        }
        if date_only && field != TradeField::Date {
            return Err(self.err(
                field,
                "`format`, `pattern` and `offset` apply to `date` only",
            ));
        }
        Ok(())
    }

    /// `from` parsed: a pointer, `key` or `header:NAME`.
    fn place(&self, field: impl fmt::Display + Copy, from: &str) -> Result<Place, MappingError> {
        if from == "key" {
            return Ok(Place::Key);
        }
        if let Some(name) = from.strip_prefix("header:") {
            if name.is_empty() {
                return Err(self.err(field, "`header:` needs a header name"));
            }
            if name.starts_with(OUR_HEADER_PREFIX) {
                return Err(self.err(
                    field,
                    format!(
                        "headers named {OUR_HEADER_PREFIX}* are tradebucket's own (dropped on replay)"
                    ),
                ));
            }
            return Ok(Place::Header(name.to_string()));
        }
        parse_pointer(from)
            .map(Place::Pointer)
            .map_err(|why| self.err(field, format!("from = {from:?}: {why}")))
    }

    /// No two fields from one place, and no field inside another's value
    /// (one would need a scalar where the other needs an object).
    fn check_places(&self, places: &[Option<Place>; 8]) -> Result<(), MappingError> {
        let mut placed: Vec<(TradeField, Place)> = TradeField::ALL
            .into_iter()
            .filter_map(|f| places[f.index()].clone().map(|p| (f, p)))
            .collect();
        // The default qty reads `/qty` and `/quantity`.
        if places[TradeField::Qty.index()].is_none() {
            for name in ["qty", "quantity"] {
                placed.push((TradeField::Qty, Place::Pointer(vec![name.to_string()])));
            }
        }
        for (i, (a, pa)) in placed.iter().enumerate() {
            for (b, pb) in &placed[i + 1..] {
                let overlap = match (pa, pb) {
                    (Place::Pointer(x), Place::Pointer(y)) => x.starts_with(y) || y.starts_with(x),
                    _ => pa == pb,
                };
                if a != b && overlap {
                    return Err(self.clash((*a, pa), (*b, pb)));
                }
            }
        }
        Ok(())
    }

    /// Two fields read from one place, or one inside the other: named at
    /// the field the mapping placed (a field it does not name is where the
    /// default schema reads it, which the operator may not have in mind).
    fn clash(&self, a: (TradeField, &Place), b: (TradeField, &Place)) -> MappingError {
        let named = |f: TradeField| self.settings()[f.index()].is_some();
        let ((f, pf), (g, pg)) = if named(b.0) || !named(a.0) {
            (b, a)
        } else {
            (a, b)
        };
        let default = if named(g) {
            String::new()
        } else {
            format!(" ({g} is not named here, so it is read where the default schema reads it)")
        };
        let what = if pf == pg {
            "two fields from one place"
        } else {
            "one field's value would have to hold the other's"
        };
        self.err(f, format!("{pf} overlaps {g}'s {pg}{default}: {what}"))
    }

    fn side_rule(&self, s: Option<&FieldSettings>) -> Result<SideRule, MappingError> {
        let Some(s) = s else {
            return Ok(SideRule::Default);
        };
        let field = TradeField::Type;
        match (&s.values, s.unknown) {
            (None, None) => Ok(SideRule::Default),
            (None, Some(_)) => Err(self.err(field, "`unknown` without `values` means nothing")),
            (Some(_), None) => Err(self.err(
                field,
                "a value map needs a rule for values not in it: unknown = \"reject\", \"buy\" or \"sell\"",
            )),
            (Some(values), Some(unknown)) => {
                let spellings: Vec<(String, bool)> = (values.buy.iter().map(|v| (v.clone(), true)))
                    .chain(values.sell.iter().map(|v| (v.clone(), false)))
                    .collect();
                if spellings.is_empty() {
                    return Err(self.err(field, "`values` lists no spelling"));
                }
                for (i, (v, _)) in spellings.iter().enumerate() {
                    if spellings[..i].iter().any(|(w, _)| w == v) {
                        return Err(self.err(field, format!("{v:?} is listed twice in `values`")));
                    }
                }
                Ok(SideRule::Map { spellings, unknown })
            }
        }
    }

    fn keep_plan(&self) -> Result<Option<KeptFields>, MappingError> {
        match &self.keep {
            Keep::Mode(KeepMode::All) => Ok(None),
            Keep::Mode(KeepMode::None) => Ok(Some(Vec::new())),
            Keep::Fields(fields) => {
                let mut out = Vec::with_capacity(fields.len());
                for (name, from) in fields {
                    let field = format!("keep.{name}");
                    if name.is_empty() || name.starts_with('$') || name.contains(['.', '\0']) {
                        return Err(self.err(
                            &field,
                            "a stored name must be non-empty, without a '$' prefix, '.' or NUL",
                        ));
                    }
                    if RESERVED_NAMES.contains(&name.as_str()) {
                        return Err(
                            self.err(&field, "is a trade field's or a derived field's name")
                        );
                    }
                    let tokens = parse_pointer(from)
                        .map_err(|why| self.err(&field, format!("{from:?}: {why}")))?;
                    out.push((name.clone(), tokens));
                }
                Ok(Some(out))
            }
        }
    }
}

/// A JSON Pointer (RFC 6901) as its unescaped tokens, refusing what can
/// never name a trade field: the whole payload (`""`, an object), and the
/// `-` token (the element after an array's last, which never exists).
pub fn parse_pointer(text: &str) -> Result<Vec<String>, String> {
    if text.is_empty() {
        return Err("\"\" is the whole payload, never one field's value".to_string());
    }
    let Some(rest) = text.strip_prefix('/') else {
        return Err(
            "must be a JSON Pointer starting with '/' (e.g. \"/Account\"), \"key\" or \"header:NAME\""
                .to_string(),
        );
    };
    rest.split('/')
        .map(|token| {
            if token == "-" {
                return Err("'-' names the element after an array's last: it never exists".into());
            }
            unescape(token).ok_or_else(|| {
                format!("{token:?}: '~' must be followed by 0 ('~') or 1 ('/') (RFC 6901)")
            })
        })
        .collect()
}

fn unescape(token: &str) -> Option<String> {
    let mut out = String::with_capacity(token.len());
    let mut chars = token.chars();
    while let Some(c) = chars.next() {
        if c != '~' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('0') => out.push('~'),
            Some('1') => out.push('/'),
            _ => return None,
        }
    }
    Some(out)
}

/// Every mapping checked against the topics the worker reads.
pub fn validate(
    topics: &[String],
    mappings: &[MappingSettings],
) -> Result<Vec<Plan>, MappingError> {
    let mut plans: Vec<Plan> = Vec::with_capacity(mappings.len());
    for m in mappings {
        if !topics.contains(&m.topic) {
            return Err(m.err(
                "topic",
                "is not in kafka.topics: the worker would never read it",
            ));
        }
        if plans.iter().any(|p| p.topic == m.topic) {
            return Err(m.err("topic", "has two mappings"));
        }
        plans.push(m.plan()?);
    }
    Ok(plans)
}

mod dates;
#[cfg(test)]
mod tests;
