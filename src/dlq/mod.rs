//! `tradebucket dlq`: the dead-letter topic read and replayed by the
//! product, not by third-party consumers.
//!
//! This module is the pure part: a dead letter's headers read back
//! ([`Letter`]), the operator's selection ([`Filter`]), the summary by
//! kind, and what a replay sends ([`Letter::replay`]). [`io`] reads a
//! dead-letter topic to its end offsets and produces the replays.
//!
//! Replay identity: a replayed record carries `tradebucket.replay.of`, the
//! position it was first read at (its dead letter's source, or, for a
//! replayed event dead-lettered again, the identity it already had), and
//! the worker stores a trade without `tradeId` under `r:<that position>`:
//! replaying the same dead letter twice stores it once
//! (`docs/design.md`, "Replayed dead letters").

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::event::{position_text, replay_origin, Source, H_REPLAY_OF};
use crate::kafka::headers::Header;
use crate::kafka::{
    H_ERROR_KIND, H_ERROR_MESSAGE, H_SHORTENED, H_SOURCE_OFFSET, H_SOURCE_PARTITION,
    H_SOURCE_TOPIC, OUR_HEADER_PREFIX,
};

pub mod command;
pub mod io;
#[cfg(test)]
mod tests;

/// One record of a dead-letter topic, with what its headers say.
#[derive(Debug, Clone, PartialEq)]
pub struct Letter {
    /// Where the dead letter itself is: dead-letter topic, partition, offset.
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// When it was dead-lettered (the record's timestamp), epoch ms.
    pub timestamp_ms: Option<i64>,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    /// Every header, the original record's first, then ours.
    pub headers: Vec<Header>,
    /// `tradebucket.error.kind`.
    pub kind: Option<String>,
    /// `tradebucket.error.message`.
    pub message: Option<String>,
    /// Where the bad record was read, from the `tradebucket.source.*` headers.
    pub source: Option<Source>,
    /// The identity a replay gives it: its `tradebucket.replay.of` (it was
    /// a replay already), else its source.
    pub identity: Option<Source>,
    /// A shortened dead letter: its payload and key are cut.
    pub shortened: bool,
}

/// The last value of header `name`, as text (ours are written once, and the
/// original record's `tradebucket.*` headers are never copied).
fn text_header(headers: &[Header], name: &str) -> Option<String> {
    headers
        .iter()
        .rev()
        .find(|(n, _)| n == name.as_bytes())
        .and_then(|(_, v)| v.as_deref())
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

impl Letter {
    /// Reads what the headers of a dead letter say.
    pub fn new(
        (topic, partition, offset): (String, i32, i64),
        timestamp_ms: Option<i64>,
        key: Option<Vec<u8>>,
        payload: Option<Vec<u8>>,
        headers: Vec<Header>,
    ) -> Letter {
        let h = |name| text_header(&headers, name);
        let source = match (h(H_SOURCE_TOPIC), h(H_SOURCE_PARTITION), h(H_SOURCE_OFFSET)) {
            (Some(topic), Some(p), Some(o)) => match (p.parse(), o.parse()) {
                (Ok(partition), Ok(offset)) => Some(Source {
                    topic: topic.into(),
                    partition,
                    offset,
                }),
                _ => None,
            },
            _ => None,
        };
        let identity = replay_origin(&headers).ok().flatten().or(source.clone());
        Letter {
            topic,
            partition,
            offset,
            timestamp_ms,
            key,
            payload,
            kind: h(H_ERROR_KIND),
            message: h(H_ERROR_MESSAGE),
            shortened: h(H_SHORTENED).is_some(),
            source,
            identity,
            headers,
        }
    }

    /// What a replay sends to the source topic: the original key, payload
    /// and headers, and `tradebucket.replay.of`; or why it cannot be
    /// replayed as it is.
    pub fn replay(&self) -> Result<Replay, String> {
        let at = format!("{}:{}", self.partition, self.offset);
        if self.shortened {
            return Err(format!(
                "{at} is a shortened dead letter (its payload and key are cut, its headers left out): it cannot be replayed as it is"
            ));
        }
        let (Some(source), Some(identity)) = (&self.source, &self.identity) else {
            return Err(format!(
                "{at} has no tradebucket.source.* headers: not a tradebucket dead letter"
            ));
        };
        let mut headers: Vec<Header> = self
            .headers
            .iter()
            .filter(|(n, _)| !n.starts_with(OUR_HEADER_PREFIX))
            .cloned()
            .collect();
        let position = position_text(identity);
        headers.push((H_REPLAY_OF.as_bytes().to_vec(), Some(position.into_bytes())));
        Ok(Replay {
            topic: source.topic.to_string(),
            key: self.key.clone(),
            payload: self.payload.clone(),
            headers,
            identity: identity.clone(),
        })
    }
}

/// One record to put back on its source topic.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    pub topic: String,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    pub headers: Vec<Header>,
    /// The position a trade without `tradeId` is stored as (`r:` key).
    pub identity: Source,
}

/// Which dead letters a command applies to; every criterion given must hold.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Filter {
    /// Error kind (`tradebucket.error.kind`), e.g. not_json; repeatable.
    #[arg(long = "kind")]
    pub kinds: Vec<String>,
    /// The topic the bad record was read from.
    #[arg(long)]
    pub source_topic: Option<String>,
    /// The partition the bad record was read from.
    #[arg(long)]
    pub source_partition: Option<i32>,
    /// Dead-lettered at or after: RFC 3339 (2026-11-23T14:00:00Z) or an age (2h, 30m).
    #[arg(long, value_parser = parse_time)]
    pub since: Option<DateTime<Utc>>,
    /// Dead-lettered before: RFC 3339 or an age.
    #[arg(long, value_parser = parse_time)]
    pub until: Option<DateTime<Utc>>,
    /// Only these dead letters, as PARTITION:OFFSET of the dead-letter topic; repeatable.
    #[arg(long = "at", value_parser = parse_at)]
    pub at: Vec<(i32, i64)>,
}

/// An RFC 3339 time, or an age (`2h`: two hours ago).
pub fn parse_time(text: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    let age = humantime::parse_duration(text)
        .map_err(|_| format!("{text:?} is neither an RFC 3339 time nor an age like 2h"))?;
    let age = chrono::Duration::from_std(age).map_err(|e| e.to_string())?;
    Ok(Utc::now() - age)
}

/// `PARTITION:OFFSET`.
pub fn parse_at(text: &str) -> Result<(i32, i64), String> {
    let bad = || format!("{text:?} is not PARTITION:OFFSET");
    let (p, o) = text.split_once(':').ok_or_else(bad)?;
    Ok((p.parse().map_err(|_| bad())?, o.parse().map_err(|_| bad())?))
}

impl Filter {
    /// Whether no criterion is given (everything matches).
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
            && self.source_topic.is_none()
            && self.source_partition.is_none()
            && self.since.is_none()
            && self.until.is_none()
            && self.at.is_empty()
    }

    pub fn matches(&self, l: &Letter) -> bool {
        let kind_ok =
            self.kinds.is_empty() || l.kind.as_ref().is_some_and(|k| self.kinds.contains(k));
        let source = l.source.as_ref();
        let topic_ok = self
            .source_topic
            .as_ref()
            .is_none_or(|t| source.is_some_and(|s| *s.topic == **t));
        let partition_ok = self
            .source_partition
            .is_none_or(|p| source.is_some_and(|s| s.partition == p));
        let time = l.timestamp_ms;
        let since_ok = self
            .since
            .is_none_or(|t| time.is_some_and(|ms| ms >= t.timestamp_millis()));
        let until_ok = self
            .until
            .is_none_or(|t| time.is_some_and(|ms| ms < t.timestamp_millis()));
        let at_ok = self.at.is_empty() || self.at.contains(&(l.partition, l.offset));
        kind_ok && topic_ok && partition_ok && since_ok && until_ok && at_ok
    }
}

/// What `dlq list` found; `--json` prints it.
#[derive(Debug, Default, Serialize, serde::Deserialize)]
pub struct Listing {
    /// Dead letters read (the whole topic, to its end offsets).
    pub scanned: u64,
    /// Dead letters the filter selected.
    pub matched: u64,
    /// Matched dead letters by error kind (`unknown` without the header).
    pub by_kind: BTreeMap<String, u64>,
    /// The first `--limit` matched dead letters.
    pub letters: Vec<LetterView>,
}

impl Listing {
    /// Counts `l` (and keeps it while under `limit`; 0 is no limit) if it
    /// matches `filter`.
    pub fn add(&mut self, l: &Letter, filter: &Filter, limit: usize) {
        self.scanned += 1;
        if !filter.matches(l) {
            return;
        }
        self.matched += 1;
        let kind = l.kind.clone().unwrap_or_else(|| "unknown".into());
        *self.by_kind.entry(kind).or_default() += 1;
        if limit == 0 || self.letters.len() < limit {
            self.letters.push(LetterView::of(l));
        }
    }
}

/// A dead letter as `dlq list` and `dlq show` print it: bytes as text when
/// they are UTF-8, escaped (`\xff`) when not.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct LetterView {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// RFC 3339.
    pub time: Option<String>,
    pub kind: Option<String>,
    pub message: Option<String>,
    /// `<topic>/<partition>/<offset>` the bad record was read at.
    pub source: Option<String>,
    /// The identity a replay of it would have (`r:` key of a trade without `tradeId`).
    pub identity: Option<String>,
    pub shortened: bool,
    pub key: Option<String>,
    pub payload: Option<String>,
    pub headers: Vec<(String, Option<String>)>,
}

/// Bytes as text: UTF-8 as it is, anything else escaped.
pub fn show_bytes(b: &[u8]) -> String {
    match std::str::from_utf8(b) {
        Ok(s) => s.to_string(),
        Err(_) => b.escape_ascii().to_string(),
    }
}

impl LetterView {
    pub fn of(l: &Letter) -> LetterView {
        let bytes = |b: &Option<Vec<u8>>| b.as_deref().map(show_bytes);
        LetterView {
            topic: l.topic.clone(),
            partition: l.partition,
            offset: l.offset,
            time: l
                .timestamp_ms
                .and_then(DateTime::<Utc>::from_timestamp_millis)
                .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)),
            kind: l.kind.clone(),
            message: l.message.clone(),
            source: l.source.as_ref().map(position_text),
            identity: l.identity.as_ref().map(position_text),
            shortened: l.shortened,
            key: bytes(&l.key),
            payload: bytes(&l.payload),
            headers: l
                .headers
                .iter()
                .map(|(n, v)| (show_bytes(n), bytes(v)))
                .collect(),
        }
    }

    /// One line of `dlq list`.
    pub fn line(&self) -> String {
        let dash = || "-".to_string();
        format!(
            "{}:{}  {}  {}  {}{}  {}",
            self.partition,
            self.offset,
            self.time.clone().unwrap_or_else(dash),
            self.kind.clone().unwrap_or_else(dash),
            self.source.clone().unwrap_or_else(dash),
            if self.shortened { " (shortened)" } else { "" },
            self.message.clone().unwrap_or_default(),
        )
    }

    /// `dlq show`'s text: every field and header on its own line.
    pub fn detail(&self) -> String {
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "(none)".into());
        let mut out = format!(
            "dead letter   {}/{}/{}\ntime          {}\nkind          {}\nmessage       {}\nsource        {}\nreplay as     {}\nshortened     {}\nkey           {}\nheaders:\n",
            self.topic, self.partition, self.offset, opt(&self.time), opt(&self.kind),
            opt(&self.message), opt(&self.source), opt(&self.identity), self.shortened, opt(&self.key),
        );
        for (n, v) in &self.headers {
            out.push_str(&format!("  {n}: {}\n", opt(v)));
        }
        out.push_str(&format!("payload:\n{}\n", opt(&self.payload)));
        out
    }
}
