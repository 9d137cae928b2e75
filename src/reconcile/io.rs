//! Reconcile over Kafka and MongoDB: the spans from the group's committed
//! offsets, each partition streamed once (never more than one lookup batch
//! held), its trades looked up in MongoDB at read concern majority
//! ([`BucketStore::find_buckets_of_keys`]: in sharded mode with the
//! customer in every filter; keys of buckets already read are answered
//! from [`KnownKeys`]), and the missing records put back on their topic if
//! asked.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;

use super::known::{KnownKeys, Slots, GENERATION};
use super::{keys_of, span, Counts, Ledger, Problem, ProblemKind, Span, Start, TradeSeen, Verdict};
use crate::bucket::store::{BucketStore, StoreError};
use crate::config::{MappingError, Settings};
use crate::dlq::io::{self as dlq_io, DlqError};
use crate::dlq::Replay;
use crate::event::{self, CustomerId, Mappings, RecordParts, Source, H_REPLAY_OF};
use crate::kafka::headers::{self, Header};
use crate::kafka::{self, ScrubbedLogs, SetupError, OUR_HEADER_PREFIX};
use crate::metrics::Metrics;
use crate::ratelimit::RateLimit;
use crate::registry::{ClientError, Decode, Formats, SchemaId, Unavailable};

/// Trades looked up in MongoDB per query (two keys each at most).
const LOOKUP_BATCH: usize = 1_000;

/// How long one poll waits for a record.
const POLL: Duration = Duration::from_millis(200);

/// `tradebucket reconcile`'s flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Start at the first record at or after this time: RFC 3339 or an age (24h).
    #[arg(long, value_parser = crate::dlq::parse_time, conflicts_with = "from")]
    pub since: Option<DateTime<Utc>>,
    /// Start at these offsets, as PARTITION:OFFSET (comma-separated or
    /// repeated), in every source topic; only these partitions are checked.
    #[arg(long, value_delimiter = ',', value_parser = crate::dlq::parse_at)]
    pub from: Vec<(i32, i64)>,
    /// Check up to the end of each partition, not only what the group
    /// has committed past (records not yet handled are reported missing).
    #[arg(long)]
    pub to_end: bool,
    /// Put the missing records back on their topic with the replay
    /// identity `dlq replay` gives, so the running worker stores each once.
    #[arg(long)]
    pub replay_missing: bool,
    /// Records read per second at most (0: no limit), to spare the brokers
    /// and MongoDB; also the rate of replays.
    #[arg(long, default_value_t = 20_000)]
    pub rate: u64,
    /// Fail if the dead-letter topics are not read to their end within
    /// this long, or if the Schema Registry stays unavailable this long
    /// while an Avro or Protobuf record waits for its schema.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Print the report as JSON (same exit code).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("Kafka: {0}")]
    Kafka(#[from] KafkaError),
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error("MongoDB: {0}")]
    Store(#[from] StoreError),
    #[error("dead-letter topic: {0}")]
    Dlq(#[from] DlqError),
    #[error("topic {0} does not exist")]
    NoTopic(String),
    /// The collection cannot hold buckets as the guarantees need (a
    /// collation, for one, lets a key lookup find a different key and
    /// call a lost trade stored).
    #[error("{0}")]
    Collection(String),
    #[error(transparent)]
    Mapping(#[from] MappingError),
    #[error("Schema Registry client: {0}")]
    RegistryClient(#[from] ClientError),
    /// A record's schema could not be had: reconcile cannot tell whether
    /// it is a trade, so it stops rather than call it bad.
    #[error(transparent)]
    Registry(#[from] Unavailable),
    #[error("{topic} partition {partition}: no record arrived for {limit:?} at offset {at} (reading up to {to})")]
    Stalled {
        topic: String,
        partition: i32,
        at: i64,
        to: i64,
        limit: Duration,
    },
}

/// One partition's counts.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionReport {
    #[serde(flatten)]
    pub span: Span,
    #[serde(flatten)]
    pub counts: Counts,
}

/// What reconcile found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub group: String,
    pub dead_letter_topics: Vec<String>,
    pub partitions: Vec<PartitionReport>,
    pub total: Counts,
    pub problems_by_kind: BTreeMap<ProblemKind, u64>,
    /// The first [`super::LISTED_PROBLEMS`] problems.
    pub problems: Vec<Problem>,
    /// Missing records put back on their topic (`--replay-missing`).
    pub replayed: u64,
    /// The database work the trades' lookups took.
    pub lookups: Lookups,
}

/// How the trades' keys were looked up: what the database was asked and
/// read, and what memory answered ([`KnownKeys`]).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Lookups {
    /// Queries sent (one per lookup batch that needed the database).
    pub queries: u64,
    /// Keys asked of the database.
    pub keys_asked: u64,
    /// Buckets the queries read.
    pub buckets_read: u64,
    /// Keys answered by a bucket read before.
    pub keys_from_memory: u64,
}

impl Lookups {
    fn count(&mut self, asked: usize, entries: &[(String, String)]) {
        self.queries += 1;
        self.keys_asked += asked as u64;
        let buckets: HashSet<&str> = entries.iter().map(|(_, b)| b.as_str()).collect();
        self.buckets_read += buckets.len() as u64;
    }
}

impl Report {
    /// Every record accounted for.
    pub fn clean(&self) -> bool {
        self.total.problems == 0
    }
}

/// Reconciles every partition of the source topics; `progress` shows on a
/// terminal.
pub async fn run(
    settings: &Settings,
    opts: &Options,
    progress: bool,
) -> Result<Report, ReconcileError> {
    let store = BucketStore::connect(settings).await?;
    let closing = store.closing();
    let report = run_with(settings, opts, store, progress).await;
    closing.close().await;
    report
}

/// [`run`] over a store already connected (tests watch its commands).
pub async fn run_with(
    settings: &Settings,
    opts: &Options,
    store: BucketStore,
    progress: bool,
) -> Result<Report, ReconcileError> {
    // The worker's own group: its committed offsets are read, never
    // written; the client joins nothing. Read before the dead letters: a
    // worker commits past a bad record only once its dead letter is
    // acknowledged, so every record below these offsets has its dead
    // letter in what is read next. Read after them, a bad record whose
    // dead letter came in between (a worker catching up as reconcile
    // starts) was reported missing.
    let client = kafka::reader_client(settings, &settings.kafka.group_id)?;
    let spans = spans(&client, settings, opts)?;
    let dead_letter_topics = dlq_io::default_topics(settings);
    let mut ledger = Ledger::new(dead_letter_sources(settings, &dead_letter_topics, opts)?)
        .sharded(settings.mongodb.sharded);
    let total: i64 = spans.iter().map(|s| s.to - s.from).sum();
    if let Some(why) = store.collection_conflict().await? {
        return Err(ReconcileError::Collection(why));
    }
    let trusted = store.trade_keys_are_unique().await?;
    if !trusted {
        tracing::warn!(
            "the collection lacks the unique index on trade keys that init creates: \
             every key is looked up on its own (slower), and a key stored twice is \
             found only in what is read"
        );
    }
    let mut check = Check {
        settings,
        mappings: Mappings::from_settings(settings)?,
        formats: Formats::from_settings(settings, Metrics::new())?,
        patience: opts.timeout,
        store,
        known: trusted.then(|| KnownKeys::new(GENERATION)),
        lookups: Lookups::default(),
        slots: Slots {
            sharded: settings.mongodb.sharded,
        },
        ledger: &mut ledger,
        limit: RateLimit::new(opts.rate),
        replay: opts.replay_missing,
        rate: opts.rate,
        replayed: 0,
        bar: crate::cli::progress_bar(progress, total.max(0) as u64, "records"),
    };
    for span in &spans {
        check.span(&client, span).await?;
    }
    check.bar.finish_and_clear();
    let (replayed, lookups) = (check.replayed, check.lookups);
    Ok(report(
        settings,
        dead_letter_topics,
        spans,
        ledger,
        replayed,
        lookups,
    ))
}

fn report(
    settings: &Settings,
    dead_letter_topics: Vec<String>,
    spans: Vec<Span>,
    ledger: Ledger,
    replayed: u64,
    lookups: Lookups,
) -> Report {
    let partitions = spans
        .into_iter()
        .map(|span| {
            let key = (span.topic.clone(), span.partition);
            let counts = ledger.counts.get(&key).cloned().unwrap_or_default();
            PartitionReport { span, counts }
        })
        .collect();
    Report {
        group: settings.kafka.group_id.clone(),
        dead_letter_topics,
        partitions,
        total: ledger.total(),
        problems_by_kind: ledger.by_kind.clone(),
        problems: ledger.problems,
        replayed,
        lookups,
    }
}

/// Where every dead letter's record was read, and the position a replay
/// of it would carry (so a bad record put back and dead-lettered again
/// still answers for its first position). A dead-letter topic that does
/// not exist holds none.
fn dead_letter_sources(
    settings: &Settings,
    topics: &[String],
    opts: &Options,
) -> Result<Vec<Source>, ReconcileError> {
    let mut sources = Vec::new();
    for topic in topics {
        let read = dlq_io::read_topic(settings, topic, opts.timeout, |letter| {
            if letter.identity != letter.source {
                sources.extend(letter.identity);
            }
            sources.extend(letter.source);
        });
        match read {
            Ok(()) | Err(DlqError::NoTopic(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(sources)
}

/// The span of every partition of the source topics (with `--from`, of
/// the partitions it names).
fn spans(
    client: &BaseConsumer<ScrubbedLogs>,
    settings: &Settings,
    opts: &Options,
) -> Result<Vec<Span>, ReconcileError> {
    let limit = settings.timeouts.kafka_request;
    let mut out = Vec::new();
    for topic in &settings.kafka.topics {
        let partitions = partitions_of(client, topic, limit)?;
        let starts = starts(client, topic, &partitions, opts, limit)?;
        let committed = committed(client, topic, &partitions, limit)?;
        for (p, start) in starts {
            let watermarks = client.fetch_watermarks(topic, p, limit)?;
            let c = committed.get(&p).copied();
            out.push(span((topic, p), watermarks, c, start, opts.to_end));
        }
    }
    Ok(out)
}

fn partitions_of(
    client: &BaseConsumer<ScrubbedLogs>,
    topic: &str,
    limit: Duration,
) -> Result<Vec<i32>, ReconcileError> {
    let partitions = kafka::partitions(client, topic, limit)?;
    if partitions.is_empty() {
        return Err(ReconcileError::NoTopic(topic.to_string()));
    }
    Ok(partitions)
}

/// Where each partition's check starts, as the flags ask.
fn starts(
    client: &BaseConsumer<ScrubbedLogs>,
    topic: &str,
    partitions: &[i32],
    opts: &Options,
    limit: Duration,
) -> Result<Vec<(i32, Start)>, ReconcileError> {
    if !opts.from.is_empty() {
        return Ok(opts
            .from
            .iter()
            .filter(|(p, _)| partitions.contains(p))
            .map(|&(p, o)| (p, Start::At(o)))
            .collect());
    }
    let Some(since) = opts.since else {
        return Ok(partitions.iter().map(|&p| (p, Start::Earliest)).collect());
    };
    let mut query = TopicPartitionList::new();
    for &p in partitions {
        query.add_partition_offset(topic, p, Offset::Offset(since.timestamp_millis()))?;
    }
    let answer = client.offsets_for_times(query, limit)?;
    let mut out = Vec::new();
    for e in answer.elements() {
        let start = match e.offset() {
            Offset::Offset(o) => Start::At(o),
            // No record at or after `since`: from the end, nothing.
            _ => Start::At(client.fetch_watermarks(topic, e.partition(), limit)?.1),
        };
        out.push((e.partition(), start));
    }
    Ok(out)
}

/// The group's committed offset of each partition that has one.
fn committed(
    client: &BaseConsumer<ScrubbedLogs>,
    topic: &str,
    partitions: &[i32],
    limit: Duration,
) -> Result<HashMap<i32, i64>, ReconcileError> {
    let mut tpl = TopicPartitionList::new();
    for &p in partitions {
        tpl.add_partition(topic, p);
    }
    let answer = client.committed_offsets(tpl, limit)?;
    Ok(answer
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) => Some((e.partition(), o)),
            _ => None,
        })
        .collect())
}

/// One record read, kept until its lookup batch is judged.
struct Read {
    at: Source,
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    headers: Vec<Header>,
    /// Its customer and key, if it is a trade.
    trade: Option<(CustomerId, String)>,
    /// The schema an Avro or Protobuf record waits for (`trade` is `None`
    /// until it is fetched).
    pending: Option<SchemaId>,
}

/// The state of one reconcile run.
struct Check<'a> {
    settings: &'a Settings,
    /// The topics' input mappings: a record is decoded as the worker
    /// decodes it, or a trade id read from a header would not be found.
    mappings: Mappings,
    /// The topics' formats: an Avro or Protobuf record is read through
    /// its writer's schema, as the worker reads it.
    formats: Formats,
    /// How long a record may wait for the Schema Registry.
    patience: Duration,
    store: BucketStore,
    /// The keys of buckets read whose records are still to come; `None`
    /// while keys are not unique.
    known: Option<KnownKeys>,
    lookups: Lookups,
    slots: Slots,
    ledger: &'a mut Ledger,
    limit: RateLimit,
    replay: bool,
    rate: u64,
    replayed: u64,
    bar: indicatif::ProgressBar,
}

impl Check<'_> {
    /// Streams `span`, one lookup batch at a time.
    async fn span(
        &mut self,
        client: &BaseConsumer<ScrubbedLogs>,
        span: &Span,
    ) -> Result<(), ReconcileError> {
        if span.from >= span.to {
            return Ok(());
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&span.topic, span.partition, Offset::Offset(span.from))?;
        client.assign(&tpl)?;
        let mut reader = SpanReader::new(span, self.settings.timeouts.kafka_request);
        let mut batch = Vec::with_capacity(LOOKUP_BATCH);
        while let Some(m) = reader.next(client)? {
            batch.push(self.read(m));
            if batch.len() == LOOKUP_BATCH {
                self.judge(std::mem::take(&mut batch)).await?;
            }
        }
        self.judge(batch).await?;
        self.ledger.gaps(&span.topic, span.partition, reader.gaps);
        self.bar.inc(reader.gaps);
        Ok(())
    }

    /// The record, decoded by its topic's format and mapping as the
    /// worker decodes it; one whose schema is not in memory is left
    /// pending ([`Check::resolve`]).
    fn read(&self, m: BorrowedMessage<'_>) -> Read {
        let mut r = Read {
            at: Source {
                topic: m.topic().into(),
                partition: m.partition(),
                offset: m.offset(),
            },
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers: headers::read(m.headers()),
            trade: None,
            pending: None,
        };
        let max = self.settings.kafka.max_message_bytes;
        let mapping = self.mappings.get(&r.at.topic).map(AsRef::as_ref);
        match self.formats.decode(r.parts(), mapping, &r.at, max, None) {
            Decode::Done(trade) => r.trade = trade.ok().map(|t| (t.customer, t.key.into())),
            Decode::Missing(id) => r.pending = Some(id),
        }
        r
    }

    /// The batch's pending records decoded, their schemas fetched (each
    /// once: the fetched ones are cached).
    async fn resolve(&self, batch: &mut [Read]) -> Result<(), ReconcileError> {
        let max = self.settings.kafka.max_message_bytes;
        for r in batch.iter_mut().filter(|r| r.pending.is_some()) {
            let mapping = self.mappings.get(&r.at.topic).map(AsRef::as_ref);
            let wait = (&self.settings.retry, self.patience);
            let trade = self
                .formats
                .decode_now(r.parts(), mapping, &r.at, max, wait)
                .await?;
            r.trade = trade.ok().map(|t| (t.customer, t.key.into()));
            r.pending = None;
        }
        Ok(())
    }

    /// Looks the batch's trades up, gives each record its verdict, and
    /// replays the missing ones if asked.
    async fn judge(&mut self, mut batch: Vec<Read>) -> Result<(), ReconcileError> {
        if batch.is_empty() {
            return Ok(());
        }
        self.resolve(&mut batch).await?;
        tokio::time::sleep(self.limit.reserve(batch.len(), tokio::time::Instant::now())).await;
        let keys: Vec<Vec<String>> = batch
            .iter()
            .map(|r| r.trade.as_ref().map_or_else(Vec::new, |(_, k)| keys_of(k)))
            .collect();
        let found = self.lookup(&batch, &keys).await?;
        let mut missing = Vec::new();
        for (r, keys) in batch.iter().zip(&keys) {
            // A malformed replay header is the record's own rejection,
            // judged below as it decoded.
            if let Ok(Some(origin)) = event::replay_origin(&r.headers) {
                self.ledger.replay_of(origin);
            }
            let verdict = match &r.trade {
                None => self.ledger.bad(&r.at),
                Some((customer, _)) => {
                    let buckets: Vec<String> = keys
                        .iter()
                        .map(|k| self.slots.slot(customer, k))
                        .flat_map(|s| found.get(&s).into_iter().flatten().map(|b| b.to_string()))
                        .collect();
                    self.ledger.trade(&TradeSeen {
                        at: &r.at,
                        customer,
                        keys,
                        buckets: &buckets,
                    })
                }
            };
            if verdict == Verdict::Problem(ProblemKind::Missing) {
                missing.push(replay_of(r));
            }
        }
        self.bar.inc(batch.len() as u64);
        if self.replay && !missing.is_empty() {
            let hidden = indicatif::ProgressBar::hidden();
            self.replayed += dlq_io::replay(self.settings, &missing, self.rate, &hidden).await?;
        }
        Ok(())
    }

    /// Every bucket holding each key the batch's trades may be stored
    /// under, by slot ([`Slots::slot`]): from buckets read before
    /// where keys are unique, the rest in one query.
    async fn lookup(
        &mut self,
        batch: &[Read],
        keys: &[Vec<String>],
    ) -> Result<HashMap<String, Vec<Arc<str>>>, ReconcileError> {
        let mut found: HashMap<String, Vec<Arc<str>>> = HashMap::new();
        let mut wanted: Vec<(CustomerId, String)> = Vec::new();
        let mut asked: HashSet<String> = HashSet::new();
        for (r, keys) in batch.iter().zip(keys) {
            let Some((customer, _)) = &r.trade else {
                continue;
            };
            for k in keys {
                let slot = self.slots.slot(customer, k);
                if found.contains_key(&slot) {
                    continue;
                }
                match self.known.as_mut().and_then(|known| known.take(&slot)) {
                    Some(bucket) => {
                        self.lookups.keys_from_memory += 1;
                        found.insert(slot, vec![bucket])
                    }
                    None => {
                        wanted.push((customer.clone(), k.clone()));
                        asked.insert(slot.clone());
                        found.insert(slot, Vec::new())
                    }
                };
            }
        }
        if wanted.is_empty() {
            return Ok(found);
        }
        let entries = match self.known {
            Some(_) => self.store.find_buckets_of_keys(&wanted).await?,
            None => self.store.find_keys(&wanted).await?,
        };
        self.lookups.count(wanted.len(), &entries);
        let read = self.slots.group(entries);
        if let Some(known) = self.known.as_mut() {
            known.remember(&read);
        }
        // A slot answered from memory is whole already; only the asked
        // ones take what this query read.
        for (slot, buckets) in read {
            if asked.contains(&slot) {
                found.insert(slot, buckets);
            }
        }
        Ok(found)
    }
}

impl Read {
    fn parts(&self) -> RecordParts<'_> {
        RecordParts {
            payload: self.payload.as_deref(),
            key: self.key.as_deref(),
            headers: &self.headers,
        }
    }
}

/// The record as `dlq replay` would send it: its key, payload and headers
/// (ours left out), and `tradebucket.replay.of` naming the position it was
/// first read at (its own replay identity if it was a replay already).
fn replay_of(r: &Read) -> Replay {
    let identity = event::replay_origin(&r.headers)
        .ok()
        .flatten()
        .unwrap_or_else(|| r.at.clone());
    let mut headers: Vec<Header> = r
        .headers
        .iter()
        .filter(|(n, _)| !n.starts_with(OUR_HEADER_PREFIX))
        .cloned()
        .collect();
    let position = event::position_text(&identity);
    headers.push((H_REPLAY_OF.as_bytes().to_vec(), Some(position.into_bytes())));
    Replay {
        topic: r.at.topic.to_string(),
        key: r.key.clone(),
        payload: r.payload.clone(),
        headers,
        identity,
    }
}

/// Reads one assigned partition from `span.from` up to `span.to`,
/// counting the offsets without a record.
struct SpanReader<'s> {
    span: &'s Span,
    next: i64,
    gaps: u64,
    limit: Duration,
    progress_at: Instant,
}

impl<'s> SpanReader<'s> {
    fn new(span: &'s Span, limit: Duration) -> Self {
        SpanReader {
            span,
            next: span.from,
            gaps: 0,
            limit,
            progress_at: Instant::now(),
        }
    }

    /// The next record of the span, `None` at its end; fails when nothing
    /// moves for the time limit of a Kafka request.
    fn next<'c>(
        &mut self,
        client: &'c BaseConsumer<ScrubbedLogs>,
    ) -> Result<Option<BorrowedMessage<'c>>, ReconcileError> {
        while self.next < self.span.to {
            match client.poll(POLL) {
                Some(Ok(m)) if m.partition() == self.span.partition => {
                    self.progress_at = Instant::now();
                    let at = m.offset().min(self.span.to);
                    self.gaps += (at - self.next).max(0) as u64;
                    self.next = m.offset() + 1;
                    if m.offset() < self.span.to {
                        return Ok(Some(m));
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => tracing::warn!(error = %e, "reading the source topic"),
                // Offsets Kafka leaves without a record (transaction
                // markers, compaction) never arrive: the position says
                // where the read is.
                None => self.advance(client)?,
            }
            if self.progress_at.elapsed() > self.limit {
                return Err(ReconcileError::Stalled {
                    topic: self.span.topic.clone(),
                    partition: self.span.partition,
                    at: self.next,
                    to: self.span.to,
                    limit: self.limit,
                });
            }
        }
        Ok(None)
    }

    fn advance(&mut self, client: &BaseConsumer<ScrubbedLogs>) -> Result<(), ReconcileError> {
        for e in client.position()?.elements() {
            if let Offset::Offset(at) = e.offset() {
                let at = at.min(self.span.to);
                if e.partition() == self.span.partition && at > self.next {
                    self.gaps += (at - self.next) as u64;
                    self.next = at;
                    self.progress_at = Instant::now();
                }
            }
        }
        Ok(())
    }
}
