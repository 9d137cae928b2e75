//! What a run works on (the local stack's variables with this run's
//! topic, group and database) and reading it: the topic's records, its end
//! offsets, the group's committed offsets.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use testkit::{Log, WorkerProcess};
use tradebucket::config::Settings;
use tradebucket::event::{self, Source, Trade};

use crate::bin;

/// What a run works on: the local stack's `TRADEBUCKET__*` variables (from
/// `scripts/stack env`) with this run's topic, group, database and listen
/// address. In-process settings are loaded from these variables by the
/// test kit, and the worker binary gets the same ones as its only
/// environment, so both see one configuration.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) vars: BTreeMap<String, String>,
    pub(crate) topic: String,
    pub(crate) db: String,
    pub(crate) group: String,
}

impl Target {
    pub(crate) fn new(
        base: &BTreeMap<String, String>,
        topic: &str,
        db: &str,
        group: &str,
        http_port: u16,
    ) -> Target {
        let mut t = Target {
            vars: base.clone(),
            topic: topic.to_string(),
            db: db.to_string(),
            group: group.to_string(),
        };
        t.vars.extend(testkit::settings::vars([
            ("TRADEBUCKET__KAFKA__TOPICS", topic),
            ("TRADEBUCKET__KAFKA__GROUP_ID", group),
            ("TRADEBUCKET__MONGODB__DATABASE", db),
        ]));
        t.with_var(
            "TRADEBUCKET__HTTP__LISTEN",
            &format!("127.0.0.1:{http_port}"),
        )
    }

    pub(crate) fn with_var(mut self, name: &str, value: &str) -> Target {
        self.vars.insert(name.to_string(), value.to_string());
        self
    }

    pub(crate) fn settings(&self) -> Settings {
        testkit::settings::load(&self.vars)
    }

    /// The worker binary on these variables alone, logging to our stderr.
    pub(crate) fn spawn_worker(&self) -> WorkerProcess {
        WorkerProcess::start_clean(bin(), &self.vars, Log::Inherit)
    }
}

/// SIGTERM, and the worker must exit 0 (drained and committed).
pub(crate) fn stop(worker: WorkerProcess) -> anyhow::Result<()> {
    let code = worker.sigterm(Duration::from_secs(120));
    anyhow::ensure!(code == Some(0), "worker exited with {code:?}");
    Ok(())
}

pub(crate) fn kafka_consumer(settings: &Settings, group: &str) -> anyhow::Result<BaseConsumer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", &settings.kafka.brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()?)
}

/// A received message, detached.
pub(crate) struct Msg {
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    pub(crate) payload: Vec<u8>,
}

/// Reads `expected` records of `topic` with the worker's client defaults
/// and no processing, from each partition's start (the Kafka read
/// ceiling) or from the offsets in `from` (the second set).
pub(crate) fn read_topic(
    settings: &Settings,
    topic: &str,
    partitions: i32,
    expected: u64,
    from: Option<&BTreeMap<i32, i64>>,
) -> anyhow::Result<(f64, Vec<Msg>)> {
    let consumer = kafka_consumer(settings, "bench-reader")?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        let start = from
            .and_then(|f| f.get(&p))
            .map_or(Offset::Beginning, |o| Offset::Offset(*o));
        tpl.add_partition_offset(topic, p, start)?;
    }
    consumer.assign(&tpl)?;
    let mut out = Vec::with_capacity(expected as usize);
    let started = Instant::now();
    while (out.len() as u64) < expected {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "read only {} of {expected}",
            out.len()
        );
        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
            let m = m?;
            out.push(Msg {
                partition: m.partition(),
                offset: m.offset(),
                payload: m.payload().unwrap_or_default().to_vec(),
            });
        }
    }
    Ok((started.elapsed().as_secs_f64(), out))
}

pub(crate) fn decode_all(
    topic: &str,
    messages: &[Msg],
) -> anyhow::Result<(Vec<Trade>, Vec<Source>)> {
    let mut trades = Vec::with_capacity(messages.len());
    let mut sources = Vec::with_capacity(messages.len());
    for m in messages {
        let source = Source {
            topic: topic.into(),
            partition: m.partition,
            offset: m.offset,
        };
        let trade = event::decode(Some(&m.payload), &source, usize::MAX)
            .map_err(|r| anyhow::anyhow!("generated event rejected: {}", r.message))?;
        trades.push(trade);
        sources.push(source);
    }
    Ok((trades, sources))
}

pub(crate) fn end_offsets(s: &Settings, topic: &str) -> anyhow::Result<BTreeMap<i32, i64>> {
    let consumer = kafka_consumer(s, "bench-watermarks")?;
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let mut out = BTreeMap::new();
    for p in metadata.topics()[0].partitions() {
        let (_, high) = consumer.fetch_watermarks(topic, p.id(), Duration::from_secs(10))?;
        out.insert(p.id(), high);
    }
    Ok(out)
}

pub(crate) fn committed_reached(
    checker: &BaseConsumer,
    topic: &str,
    ends: &BTreeMap<i32, i64>,
) -> anyhow::Result<bool> {
    let mut tpl = TopicPartitionList::new();
    for p in ends.keys() {
        tpl.add_partition(topic, *p);
    }
    let committed = checker.committed_offsets(tpl, Duration::from_secs(10))?;
    Ok(committed.elements().iter().all(|e| match e.offset() {
        Offset::Offset(o) => o >= ends[&e.partition()],
        _ => ends[&e.partition()] == 0,
    }))
}
