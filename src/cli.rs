//! Operator commands other than `run`: `init`, `page`, `audit`, `produce`,
//! `map`.
//! Each takes settings and returns a typed result; `main` prints and picks
//! the exit code.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use mongodb::bson::{doc, Bson, Document, RawDocumentBuf};
use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::types::RDKafkaErrorCode;

use crate::bucket::id::Prefix;
use crate::bucket::plan::BucketHead;
use crate::bucket::store::{
    head_from_document, in_time, stored_number, BucketStore, InitError, ShardState, StoreError,
};
use crate::config::Settings;
use crate::event::CustomerId;

mod produce;
pub use produce::{produce, synthetic_event, ProduceOptions};

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("Kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// A Kafka client could not be created (the message is scrubbed of
    /// secrets).
    #[error("Kafka client setup failed: {0}")]
    KafkaSetup(#[from] crate::kafka::SetupError),
    #[error("{0}")]
    Usage(String),
    /// The collection is laid out for the other mode, or sharded on
    /// another key: the message says what to do.
    #[error("{0}")]
    Layout(String),
    #[error(transparent)]
    Mapping(#[from] crate::config::MappingError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("Schema Registry client: {0}")]
    RegistryClient(#[from] crate::registry::ClientError),
    #[error(transparent)]
    Registry(#[from] crate::registry::Unavailable),
}

impl From<InitError> for CliError {
    fn from(e: InitError) -> Self {
        match e {
            InitError::Store(e) => CliError::Store(e),
            InitError::Layout(m) => CliError::Layout(m),
        }
    }
}

impl From<mongodb::error::Error> for CliError {
    fn from(e: mongodb::error::Error) -> Self {
        CliError::Store(StoreError::Transient(e))
    }
}

/// What `init` did.
#[derive(Debug)]
pub struct InitOutcome {
    /// Topics created.
    pub topics: Vec<String>,
    /// The collection's layout, in words.
    pub layout: String,
}

/// Creates the indexes, and in sharded mode through mongos shards the
/// collection; with `partitions`, also the source and dead-letter topics
/// that do not exist yet.
pub async fn init(settings: &Settings, partitions: Option<i32>) -> Result<InitOutcome, CliError> {
    let store = BucketStore::connect(settings).await?;
    let closing = store.closing();
    let state = store.init_and_shard().await;
    closing.close().await;
    let layout = describe_layout(store.sharded(), &state?);
    let mut created = Vec::new();
    if let Some(partitions) = partitions {
        let admin = crate::kafka::admin(settings)?;
        let mut names: BTreeSet<String> = settings.kafka.topics.iter().cloned().collect();
        for t in &settings.kafka.topics {
            names.insert(settings.dlq_topic_for(t));
        }
        let topics: Vec<NewTopic<'_>> = names
            .iter()
            .map(|n| NewTopic::new(n, partitions, TopicReplication::Fixed(-1)))
            .collect();
        let limit = settings.timeouts.kafka_request;
        let options = AdminOptions::new().operation_timeout(Some(limit));
        for result in admin.create_topics(&topics, &options).await? {
            match result {
                Ok(name) => created.push(name),
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => {
                    return Err(CliError::Usage(format!(
                        "cannot create topic {name}: {code}"
                    )))
                }
            }
        }
    }
    Ok(InitOutcome {
        topics: created,
        layout,
    })
}

/// One line on the collection's layout for `init` to print.
fn describe_layout(sharded: bool, state: &ShardState) -> String {
    match (sharded, state) {
        (false, _) => "unsharded layout: trade ids unique across customers".into(),
        (true, ShardState::Sharded) => {
            "sharded layout: sharded on {customerId: 1}, trade ids unique per customer".into()
        }
        (true, ShardState::NoMongos) => "sharded layout: customer-scoped indexes ready; \
             not connected to mongos, so the collection was not sharded"
            .into(),
        (true, ShardState::NotSharded) => {
            "sharded layout: customer-scoped indexes ready; the collection is not sharded".into()
        }
        (true, ShardState::Unknown(why)) => format!(
            "sharded layout: customer-scoped indexes ready; whether the collection is sharded \
             is unknown ({why})"
        ),
    }
}

/// Page `n` of a customer's history, as relaxed extended JSON.
pub async fn page(
    settings: &Settings,
    customer: &CustomerId,
    n: u64,
) -> Result<Option<serde_json::Value>, CliError> {
    if n == 0 {
        return Err(CliError::Usage("pages are numbered from 1".into()));
    }
    let store = BucketStore::connect(settings).await?;
    let page = store.page(customer, n).await;
    store.closing().close().await;
    Ok(page?.map(|d| Bson::Document(d).into_relaxed_extjson()))
}

/// What `audit` found; `audit --json` prints it, harnesses parse it back.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct AuditReport {
    pub customers: u64,
    pub buckets: u64,
    pub trades: u64,
    /// Customers whose buckets store `customerId` as text of digits
    /// (`"123"`), which this version stores as the number: written by an
    /// earlier version in unsharded mode. Not a violation; converting them
    /// is in docs/operations.md ("Customer ids stored as text").
    #[serde(default)]
    pub text_digit_customers: u64,
    pub violations: Vec<String>,
}

/// Checks the bucket invariants over the collection (or one customer):
/// `_id` form and order, `prev` chain, `count == len(history) <= cap`,
/// `bytes` at least the bucket's BSON size, every bucket but the newest
/// full by its own `cap` and `capBytes` (the rule the writers use), each
/// trade key stored once (in sharded mode: once per customer, and
/// `customerId` in its canonical form), `tickers` equal to the distinct
/// tickers of `history`. `buckets.capacity` is the cap only of legacy
/// buckets, stored without one. The customer filter is the `_id` range
/// alone, also in sharded mode, so a bucket whose `customerId` is wrong is
/// still read.
pub async fn audit(
    settings: &Settings,
    customer: Option<&CustomerId>,
) -> Result<AuditReport, CliError> {
    let store = BucketStore::connect(settings).await?;
    let report = audit_with(&store, settings, customer).await;
    store.closing().close().await;
    report
}

/// [`audit`] over a store already connected.
pub async fn audit_with(
    store: &BucketStore,
    settings: &Settings,
    customer: Option<&CustomerId>,
) -> Result<AuditReport, CliError> {
    let filter = customer.map(|c| Prefix::of(c).range()).unwrap_or_default();
    // Whole documents, as stored: their length is the BSON size `bytes`
    // must bound.
    let raw = store.collection().clone_with_type::<RawDocumentBuf>();
    let find = raw.find(filter).sort(doc! {"_id": 1});
    let limit = settings.timeouts.mongodb_operation;
    let mut cursor = in_time("find", limit, find).await??;
    let mut audit = Audit {
        capacity: settings.buckets.capacity,
        sharded: settings.mongodb.sharded,
        report: AuditReport::default(),
        keys: HashSet::new(),
        current: None,
    };
    while let Some(raw) = store.next_of(&mut cursor).await? {
        match raw.to_document() {
            Ok(d) => audit.bucket(&d, raw.as_bytes().len() as u64),
            Err(e) => audit.violation(format!("a bucket that does not parse: {e}")),
        }
    }
    Ok(audit.report)
}

/// The audit's state while it reads the buckets in `_id` order.
struct Audit {
    /// `buckets.capacity`: the cap of a legacy bucket.
    capacity: u32,
    /// Sharded mode: trade keys are unique per customer.
    sharded: bool,
    report: AuditReport,
    /// Every trade key seen so far (sharded: of the current customer):
    /// each must be stored once.
    keys: HashSet<String>,
    /// The current customer's last bucket.
    current: Option<Last>,
}

/// What the audit keeps of a customer's last bucket read.
struct Last {
    prefix: Prefix,
    id: String,
    /// Why it is not full by its own limits; `None`: full.
    not_full: Option<String>,
    wm: BTreeMap<String, i64>,
    customer: Option<Spelling>,
}

/// A stored `customerId`, by value: `7` (any integer type) or `"7"`.
#[derive(Debug, PartialEq)]
enum Spelling {
    Number(i64),
    Text(String),
    Other(String),
}

fn spelling(v: &Bson) -> Spelling {
    match v {
        Bson::Int64(i) => Spelling::Number(*i),
        Bson::Int32(i) => Spelling::Number(i64::from(*i)),
        Bson::String(s) => Spelling::Text(s.clone()),
        other => Spelling::Other(format!("{other:?}")),
    }
}

impl Audit {
    const MAX_LISTED: usize = 100;

    fn violation(&mut self, v: String) {
        let violations = &mut self.report.violations;
        if violations.len() < Self::MAX_LISTED {
            violations.push(v);
        } else if violations.len() == Self::MAX_LISTED {
            violations.push("... (further violations not listed)".into());
        }
    }

    /// Checks one bucket of `size` BSON bytes, read after every bucket of
    /// lower `_id`.
    fn bucket(&mut self, d: &Document, size: u64) {
        self.report.buckets += 1;
        let id = match d.get("_id") {
            Some(Bson::String(s)) => s.clone(),
            other => {
                self.violation(format!("bucket with non-string _id {other:?}"));
                return;
            }
        };
        let Some(prefix) = Prefix::of_id(&id) else {
            self.violation(format!("{id}: _id is not <customer>_<seconds>"));
            return;
        };
        if prefix.parse(&id).is_none() {
            self.violation(format!(
                "{id}: _id is not <customer>_<10-digit seconds>[_<6-digit suffix>]"
            ));
        }
        let customer_text = match d.get("customerId") {
            Some(Bson::Int64(i)) => i.to_string(),
            Some(Bson::Int32(i)) => i.to_string(),
            Some(Bson::String(s)) => s.clone(),
            other => format!("{other:?}"),
        };
        if customer_text != prefix.customer_text() {
            self.violation(format!(
                "{id}: customerId {customer_text} does not match the _id"
            ));
        }
        if self.sharded {
            if let Some(Bson::String(s)) = d.get("customerId") {
                let text = CustomerId::Str(s.clone());
                if text.canonical() != text {
                    self.violation(format!(
                        "{id}: customerId \"{s}\" is text; sharded mode stores it as a number"
                    ));
                }
            }
            let same_customer = self.current.as_ref().is_some_and(|l| l.prefix == prefix);
            if !same_customer {
                self.keys.clear();
            }
        }
        let head = head_from_document(d).ok();
        self.history(&id, d, head.as_ref());
        self.limits(&id, head.as_ref(), size);
        self.chain(&id, prefix, d, head.as_ref());
    }

    /// `bytes` must bound the bucket's size, or the size rule could let it
    /// outgrow MongoDB's limit.
    fn limits(&mut self, id: &str, head: Option<&BucketHead>, size: u64) {
        let Some(h) = head else { return };
        if h.cap == Some(0) {
            self.violation(format!("{id}: cap is 0"));
        }
        if let Some(s) = h.size.filter(|s| s.bytes < size) {
            self.violation(format!(
                "{id}: bytes is {}, below its BSON size {size}",
                s.bytes
            ));
        }
    }

    /// Why `head` is not full by its own limits; `None` if it is.
    fn not_full(&self, head: Option<&BucketHead>) -> Option<String> {
        let h = head?;
        if h.is_full(self.capacity) {
            return None;
        }
        let cap = match h.cap {
            Some(cap) => format!("cap {cap}"),
            None => format!("no cap stored, capacity {}", self.capacity),
        };
        let size = match h.size {
            Some(s) => format!("{} of {} bytes", s.bytes, s.cap_bytes),
            None => "no size stored".to_string(),
        };
        Some(format!("holds {} trades ({cap}; {size})", h.count))
    }

    /// `count`, its cap, keys stored once, `tickers`.
    fn history(&mut self, id: &str, d: &Document, head: Option<&BucketHead>) {
        let history: Vec<&Document> = d
            .get_array("history")
            .map(|a| a.iter().filter_map(Bson::as_document).collect())
            .unwrap_or_default();
        let len = history.len() as u64;
        let count = stored_number(d, "count").unwrap_or(u64::MAX);
        if count != len {
            self.violation(format!("{id}: count {count} but {len} trades in history"));
        }
        let cap = head.and_then(|h| h.cap).unwrap_or(self.capacity);
        if history.is_empty() || len > u64::from(cap) {
            self.violation(format!("{id}: {len} trades, its cap is {cap}"));
        }
        self.report.trades += len;
        let mut tickers = BTreeSet::new();
        for h in &history {
            match h.get_str("key") {
                Ok(k) => {
                    if !self.keys.insert(k.to_string()) {
                        self.violation(format!("{id}: trade {k} is stored more than once"));
                    }
                }
                Err(_) => self.violation(format!("{id}: a trade has no key")),
            }
            if let Ok(t) = h.get_str("ticker") {
                tickers.insert(t.to_string());
            }
        }
        let stored: BTreeSet<String> = d
            .get_array("tickers")
            .map(|a| {
                a.iter()
                    .filter_map(|t| t.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        if stored != tickers {
            self.violation(format!(
                "{id}: tickers {stored:?} but history has {tickers:?}"
            ));
        }
    }

    /// The `prev` chain: a customer's first bucket names its prefix, every
    /// later one its predecessor, which must be full by its own limits, hold
    /// the customer's id in the same spelling, and have taken no trade after
    /// its successor was opened.
    fn chain(&mut self, id: &str, prefix: Prefix, d: &Document, head: Option<&BucketHead>) {
        let prev = d.get_str("prev").unwrap_or("<missing>").to_string();
        let last = Last {
            prefix,
            id: id.to_string(),
            not_full: self.not_full(head),
            wm: head.map(|h| h.wm.clone()).unwrap_or_default(),
            customer: d.get("customerId").map(spelling),
        };
        match self.current.take() {
            Some(before) if before.prefix == last.prefix => self.successor(&before, &last, &prev),
            _ => {
                self.report.customers += 1;
                if prev != last.prefix.as_str() {
                    self.violation(format!(
                        "{id}: first bucket of its customer but prev is {prev}"
                    ));
                }
                let text_digits = matches!(&last.customer, Some(Spelling::Text(t))
                    if CustomerId::Str(t.clone()).canonical() != CustomerId::Str(t.clone()));
                self.report.text_digit_customers += u64::from(text_digits);
            }
        }
        self.current = Some(last);
    }

    /// `last` follows `before`, of the same customer, and names `prev`.
    fn successor(&mut self, before: &Last, last: &Last, prev: &str) {
        let id = &last.id;
        if let Some(why) = &before.not_full {
            self.violation(format!("{}: {why} but is not the newest bucket", before.id));
        }
        if prev != before.id {
            self.violation(format!("{id}: prev is {prev}, expected {}", before.id));
        }
        if before.customer != last.customer {
            self.violation(format!(
                "{id}: customerId {:?} but {} holds {:?}: one customer under two spellings",
                last.customer, before.id, before.customer
            ));
        }
        // A successor starts with its predecessor's whole watermark, and
        // watermarks only grow: a predecessor past it took a trade after.
        for (partition, &offset) in &before.wm {
            if last.wm.get(partition).is_none_or(|&o| o < offset) {
                self.violation(format!(
                    "{}: holds offset {offset} of {partition}, past its successor {id}'s \
                     watermark: appended after its successor was opened",
                    before.id
                ));
            }
        }
    }
}

/// A progress bar of `len` `things` on stderr, or a hidden one when
/// `visible` is false (not a terminal): `produce` and `dlq replay`.
pub fn progress_bar(visible: bool, len: u64, things: &str) -> indicatif::ProgressBar {
    if !visible {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    let template =
        format!("{{spinner}} {{bar:40}} {{pos}}/{{len}} {things}  {{per_sec}}  eta {{eta}}");
    bar.set_style(indicatif::ProgressStyle::with_template(&template).expect("a valid template"));
    bar
}

/// `tradebucket map`'s flags.
#[derive(Debug, Clone, clap::Args)]
pub struct MapOptions {
    /// Sample payloads, one JSON object per line (blank lines are
    /// skipped). For an Avro or Protobuf topic: one record in the
    /// Confluent wire format, the file its bytes as consumed (`kcat -C -t
    /// T -o O -c 1 -f '%s' > record.bin`), or one record per line in
    /// base64; its schema is fetched from `[schema_registry]` by the id in
    /// its header.
    #[arg(long)]
    pub sample: std::path::PathBuf,
    /// The topic whose mapping reads them; may be left out when
    /// kafka.topics has one topic.
    #[arg(long)]
    pub topic: Option<String>,
    /// The record key every sample is read with (for a mapping that reads
    /// the key).
    #[arg(long)]
    pub key: Option<String>,
    /// A header every sample is read with, NAME=VALUE (repeatable).
    #[arg(long = "header", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// How long to wait for the Schema Registry (Avro and Protobuf
    /// topics) before giving up.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout: std::time::Duration,
}

fn parse_header(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .ok_or_else(|| format!("{text:?} is not NAME=VALUE"))
}

/// `tradebucket map --sample`: for each sample, one JSON line with the
/// trade as it would be stored or the dead letter it would be, read by the
/// topic's format and mapping exactly as the worker reads it (at
/// partition 0, the sample's index as offset). Returns how many would be
/// dead-lettered.
pub async fn map_samples(
    settings: &Settings,
    opts: &MapOptions,
    out: &mut impl std::io::Write,
) -> Result<u64, CliError> {
    let topic = map_topic(settings, opts)?;
    let mappings = crate::event::Mappings::from_settings(settings)?;
    let mapping = mappings.get(&topic).map(|m| m.as_ref());
    let formats =
        crate::registry::Formats::from_settings(settings, crate::metrics::Metrics::new())?;
    let binary = formats.format_of(&topic).uses_registry();
    let headers: Vec<(Vec<u8>, Option<Vec<u8>>)> = (opts.headers.iter())
        .map(|(n, v)| (n.clone().into_bytes(), Some(v.clone().into_bytes())))
        .collect();
    let max = settings.kafka.max_message_bytes;
    let mut dead = 0;
    for (i, payload) in samples(&std::fs::read(&opts.sample)?, binary)? {
        let parts = crate::event::RecordParts {
            payload: Some(&payload),
            key: opts.key.as_deref().map(str::as_bytes),
            headers: &headers,
        };
        let source = crate::event::Source {
            topic: topic.as_str().into(),
            partition: 0,
            offset: i as i64,
        };
        let mut shown = if binary {
            let wait = (&settings.retry, opts.timeout);
            let decoded = formats.decode_now(parts, mapping, &source, max, wait);
            crate::event::sample_of(decoded.await?)
        } else {
            crate::event::sample(mapping, parts, &source, max)
        };
        dead += u64::from(shown.get("deadLetter").is_some());
        shown["line"] = (i + 1).into();
        writeln!(out, "{shown}")?;
    }
    Ok(dead)
}

/// The topic `map` reads its samples as.
fn map_topic(settings: &Settings, opts: &MapOptions) -> Result<String, CliError> {
    match (&opts.topic, settings.kafka.topics.as_slice()) {
        (Some(t), topics) if topics.contains(t) => Ok(t.clone()),
        (Some(t), _) => Err(CliError::Usage(format!(
            "topic {t:?} is not in kafka.topics"
        ))),
        (None, [only]) => Ok(only.clone()),
        (None, _) => Err(CliError::Usage(
            "kafka.topics has several topics: name one with --topic".into(),
        )),
    }
}

/// The sample file's payloads, each with its index (its line's, less
/// one): JSON, one per non-blank line; binary (`binary`), the whole file
/// if it starts with the wire format's magic byte 0, else one base64
/// record per non-blank line. Base64 text never starts with byte 0, so
/// the two shapes cannot be mistaken for each other.
fn samples(file: &[u8], binary: bool) -> Result<Vec<(usize, Vec<u8>)>, CliError> {
    if binary && file.first() == Some(&0) {
        return Ok(vec![(0, file.to_vec())]);
    }
    let text = std::str::from_utf8(file).map_err(|e| {
        let what = if binary {
            "neither a Confluent wire-format record (first byte 0) nor base64 lines"
        } else {
            "not UTF-8 text (JSON samples, one per line)"
        };
        CliError::Usage(format!("the sample file is {what}: {e}"))
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let payload = if binary {
            crate::event::protobuf::base64_decode(line.trim())
                .ok_or_else(|| CliError::Usage(format!("sample line {}: not base64", i + 1)))?
        } else {
            line.as_bytes().to_vec()
        };
        out.push((i, payload));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_files_of_either_shape_are_split_into_payloads() {
        // JSON: a payload per non-blank line (CRLF or LF), its index kept.
        let json = samples(b"{\"a\":1}\n\n {\"b\":2}\r\n", false).unwrap();
        assert_eq!(
            json,
            [(0, b"{\"a\":1}".to_vec()), (2, b" {\"b\":2}".to_vec())]
        );
        // Binary: a whole wire-format record, or base64 lines.
        let record = [0, 0, 0, 0, 1, 0xff, b'\n', 0x80];
        assert_eq!(samples(&record, true).unwrap(), [(0, record.to_vec())]);
        let lines = samples(b"AAAAAAH/CoA=\n\nAAAAAAI=\n", true).unwrap();
        assert_eq!(lines, [(0, record.to_vec()), (2, vec![0, 0, 0, 0, 2])]);
        // Neither: refused with what was expected, not a panic.
        let e = samples(&[0xff, 0xfe], true).unwrap_err().to_string();
        assert!(e.contains("first byte 0") && e.contains("base64"), "{e}");
        let e = samples(b"not base64!\n", true).unwrap_err().to_string();
        assert!(e.contains("line 1: not base64"), "{e}");
        assert!(samples(&[0xff], false).is_err());
    }
}
