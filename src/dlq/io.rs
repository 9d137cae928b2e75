//! The dead-letter topic over Kafka: read to its end offsets (taken once,
//! at the start, so a topic still being written ends all the same; no
//! "wait until idle"), and replays produced to the source topics.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Message, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::{Offset, TopicPartitionList};

use super::{Filter, Letter, Replay};
use crate::config::Settings;
use crate::kafka::{self, headers, ScrubbedLogs};
use crate::ratelimit::RateLimit;

#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    #[error("Kafka: {0}")]
    Kafka(#[from] KafkaError),
    #[error(transparent)]
    Setup(#[from] kafka::SetupError),
    #[error("topic {0} does not exist")]
    NoTopic(String),
    #[error("{topic} partition {partition}: not read to its end offset {end} within {timeout:?} (read up to {read})")]
    Incomplete {
        topic: String,
        partition: i32,
        end: i64,
        read: i64,
        timeout: Duration,
    },
    #[error("no dead letter at {0}")]
    NotFound(String),
    /// The selection holds dead letters that cannot be replayed; nothing
    /// was sent.
    #[error("nothing replayed: {0}")]
    Refused(String),
    #[error(transparent)]
    Mapping(#[from] crate::config::MappingError),
    #[error("Schema Registry client: {0}")]
    RegistryClient(#[from] crate::registry::ClientError),
    #[error(transparent)]
    Registry(#[from] crate::registry::Unavailable),
}

/// The dead-letter topics of the configured source topics.
pub fn default_topics(settings: &Settings) -> Vec<String> {
    let mut topics: Vec<String> = settings
        .kafka
        .topics
        .iter()
        .map(|t| settings.dlq_topic_for(t))
        .collect();
    topics.dedup();
    topics
}

/// Reads every record of `topic` up to the end offsets it has now, handing
/// each to `each`. Fails, rather than returning a partial read, if a
/// partition is not read to its end within `timeout`.
pub fn read_topic(
    settings: &Settings,
    topic: &str,
    timeout: Duration,
    mut each: impl FnMut(Letter),
) -> Result<(), DlqError> {
    let client = reader(settings)?;
    let pending = ranges(&client, topic, settings.timeouts.kafka_request)?;
    let mut assignment = TopicPartitionList::new();
    for (&p, &(low, _)) in &pending {
        assignment.add_partition_offset(topic, p, Offset::Offset(low))?;
    }
    client.assign(&assignment)?;
    let mut next: BTreeMap<i32, i64> = pending.iter().map(|(&p, &(low, _))| (p, low)).collect();
    let deadline = Instant::now() + timeout;
    while let Some((&p, &end)) = pending
        .iter()
        .map(|(p, (_, end))| (p, end))
        .find(|(p, end)| next[*p] < **end)
    {
        if Instant::now() > deadline {
            return Err(DlqError::Incomplete {
                topic: topic.into(),
                partition: p,
                end,
                read: next[&p],
                timeout,
            });
        }
        match client.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                next.insert(m.partition(), m.offset() + 1);
                each(letter(topic, &m));
            }
            Some(Err(e)) => tracing::warn!(error = %e, "reading the dead-letter topic"),
            // Offsets Kafka leaves without a record (transaction markers,
            // compaction) never arrive: the position says where we are.
            None => advance_to_positions(&client, &mut next)?,
        }
    }
    Ok(())
}

/// A client that reads assigned partitions and commits nothing; its group
/// is never joined (the worker's group plus a suffix, for the broker's
/// access rules).
fn reader(settings: &Settings) -> Result<BaseConsumer<ScrubbedLogs>, DlqError> {
    let group = format!("{}.dlq-reader", settings.kafka.group_id);
    Ok(kafka::reader_client(settings, &group)?)
}

/// Per partition of `topic` that holds records: (first offset, end offset).
/// Each request (metadata, offsets) waits at most `limit`
/// (`timeouts.kafka_request`).
fn ranges(
    client: &BaseConsumer<ScrubbedLogs>,
    topic: &str,
    limit: Duration,
) -> Result<BTreeMap<i32, (i64, i64)>, DlqError> {
    let partitions = kafka::partitions(client, topic, limit)?;
    if partitions.is_empty() {
        return Err(DlqError::NoTopic(topic.into()));
    }
    let tps: Vec<_> = partitions.iter().map(|&p| (topic.into(), p)).collect();
    let ends = kafka::end_offsets(client, &tps, limit)?;
    let mut out = BTreeMap::new();
    for ((_, p), end) in ends {
        let (low, _) = client.fetch_watermarks(topic, p, limit)?;
        if low < end {
            out.insert(p, (low, end));
        }
    }
    Ok(out)
}

fn advance_to_positions(
    client: &BaseConsumer<ScrubbedLogs>,
    next: &mut BTreeMap<i32, i64>,
) -> Result<(), DlqError> {
    for e in client.position()?.elements() {
        if let (Offset::Offset(at), Some(n)) = (e.offset(), next.get_mut(&e.partition())) {
            *n = (*n).max(at);
        }
    }
    Ok(())
}

fn letter(topic: &str, m: &rdkafka::message::BorrowedMessage<'_>) -> Letter {
    Letter::new(
        (topic.to_string(), m.partition(), m.offset()),
        m.timestamp().to_millis(),
        m.key().map(<[u8]>::to_vec),
        m.payload().map(<[u8]>::to_vec),
        headers::read(m.headers()),
    )
}

/// The dead letter at `partition`:`offset` of `topic`.
pub fn read_one(
    settings: &Settings,
    topic: &str,
    partition: i32,
    offset: i64,
    timeout: Duration,
) -> Result<Letter, DlqError> {
    let at = format!("{topic}/{partition}/{offset}");
    let client = reader(settings)?;
    let limit = settings.timeouts.kafka_request;
    let range = ranges(&client, topic, limit)?.get(&partition).copied();
    if !range.is_some_and(|(low, end)| (low..end).contains(&offset)) {
        return Err(DlqError::NotFound(at));
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(offset))?;
    client.assign(&tpl)?;
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        match client.poll(Duration::from_millis(200)) {
            Some(Ok(m)) if m.offset() == offset => return Ok(letter(topic, &m)),
            // Kafka left this offset without a record (a marker).
            Some(Ok(_)) => break,
            Some(Err(e)) => tracing::warn!(error = %e, "reading the dead-letter topic"),
            None => {}
        }
    }
    Err(DlqError::NotFound(at))
}

/// The replays of the dead letters `filter` selects in `topic`, or every
/// reason some of them cannot be replayed as they are.
pub fn select(
    settings: &Settings,
    topic: &str,
    filter: &Filter,
    timeout: Duration,
) -> Result<Vec<(Letter, Replay)>, DlqError> {
    let (mut chosen, mut refused) = (Vec::new(), Vec::new());
    read_topic(settings, topic, timeout, |l| {
        if filter.matches(&l) {
            match l.replay() {
                Ok(r) => chosen.push((l, r)),
                Err(why) => refused.push(why),
            }
        }
    })?;
    if !refused.is_empty() {
        let n = refused.len();
        refused.truncate(10);
        return Err(DlqError::Refused(format!(
            "{n} selected dead letters cannot be replayed; leave them out (--kind, --at):\n  {}",
            refused.join("\n  ")
        )));
    }
    Ok(chosen)
}

/// Sends `replays` at most `rate` per second (0: as fast as the broker
/// takes them), each acknowledged by the broker (acks=all, idempotent);
/// `progress` is told of each one handed over.
pub async fn replay(
    settings: &Settings,
    replays: &[Replay],
    rate: u64,
    progress: &indicatif::ProgressBar,
) -> Result<u64, DlqError> {
    let producer = kafka::producer(settings)?;
    let mut limit = RateLimit::new(rate);
    let mut acks = FuturesUnordered::new();
    for r in replays {
        tokio::time::sleep(limit.reserve(1, tokio::time::Instant::now())).await;
        let mut out = OwnedHeaders::new_with_capacity(r.headers.len());
        for (name, value) in &r.headers {
            headers::add(&mut out, name, value.as_deref());
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&r.topic).headers(out);
        if let Some(k) = &r.key {
            record = record.key(k.as_slice());
        }
        if let Some(p) = &r.payload {
            record = record.payload(p.as_slice());
        }
        acks.push(kafka::enqueue(&producer, record).await?);
        progress.inc(1);
    }
    let mut sent = 0;
    while let Some(ack) = acks.next().await {
        match ack {
            Ok(Ok(_)) => sent += 1,
            Ok(Err((e, _))) => return Err(e.into()),
            Err(_) => return Err(KafkaError::Canceled.into()),
        }
    }
    Ok(sent)
}
