//! One test's private slice of the servers: its own topic, dead-letter
//! topic, consumer group and database, producing to it and reading back
//! what the worker did.
//!
//! Servers: `TRADEBUCKET_TEST_KAFKA` (bootstrap servers) and
//! `TRADEBUCKET_TEST_MONGODB` (URI) if set, so the same suite runs against
//! Apache Kafka and MongoDB; otherwise the local stack (`scripts/stack`,
//! on `TRADEBUCKET_KAFKA_PORT` / `TRADEBUCKET_MONGO_PORT`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures::TryStreamExt;
use mongodb::bson::{doc, Document};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::{Header, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};

use tradebucket::bucket::store::BucketStore;
use tradebucket::cli::AuditReport;
use tradebucket::config::Settings;

use crate::poll::poll_until;
use crate::settings;

static COUNTER: AtomicU32 = AtomicU32::new(0);

pub fn kafka_brokers() -> String {
    std::env::var("TRADEBUCKET_TEST_KAFKA").unwrap_or_else(|_| {
        let port = std::env::var("TRADEBUCKET_KAFKA_PORT").unwrap_or_else(|_| "19092".into());
        format!("127.0.0.1:{port}")
    })
}

pub fn mongodb_uri() -> String {
    std::env::var("TRADEBUCKET_TEST_MONGODB").unwrap_or_else(|_| {
        let port = std::env::var("TRADEBUCKET_MONGO_PORT").unwrap_or_else(|_| "27117".into());
        format!("mongodb://127.0.0.1:{port}/?directConnection=true")
    })
}

/// A name no other test (or earlier run) uses.
pub fn unique(name: &str) -> String {
    format!(
        "tb-{name}-{}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        rand::random::<u16>()
    )
}

pub fn admin(brokers: &str) -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client")
}

/// Creates `name`, one replica a partition.
pub async fn create_topic(brokers: &str, name: &str, partitions: i32) {
    create_replicated_topic(brokers, name, partitions, 1).await;
}

/// Creates `name` with `replicas` replicas a partition, and, with more
/// than one, `min.insync.replicas=2`: a write is acknowledged once two
/// replicas have it, so one broker can die without losing it. On a loaded
/// machine an admin request can time out while the broker is busy: it is
/// tried three times, and a topic that an earlier, timed-out attempt did
/// create counts as created.
pub async fn create_replicated_topic(brokers: &str, name: &str, partitions: i32, replicas: i32) {
    let mut topic = NewTopic::new(name, partitions, TopicReplication::Fixed(replicas));
    if replicas > 1 {
        topic = topic.set("min.insync.replicas", "2");
    }
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for attempt in 1..=3 {
        let results = match admin(brokers).create_topics([&topic], &options).await {
            Ok(results) => results,
            Err(e) if attempt < 3 => {
                eprintln!("create topic {name}: {e}; trying again");
                continue;
            }
            Err(e) => {
                panic!("cannot reach Kafka at {brokers} ({e}); start it with scripts/stack start")
            }
        };
        for r in results {
            match r {
                Ok(_) => {}
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) if attempt > 1 => {}
                Err((t, e)) => panic!("create topic {t}: {e}"),
            }
        }
        return;
    }
}

/// A message to produce.
#[derive(Debug, Clone, Default)]
pub struct Produced {
    pub key: Option<String>,
    pub payload: Option<Vec<u8>>,
    pub partition: Option<i32>,
    pub headers: Vec<(String, String)>,
    /// Headers whose names and values are any bytes (a Go or C producer can
    /// send them), added after `headers`; `None`: a null value.
    pub raw_headers: Vec<(Vec<u8>, Option<Vec<u8>>)>,
}

impl Produced {
    /// The record to send to `topic`, borrowing from `self`.
    fn record<'a>(&'a self, topic: &'a str) -> FutureRecord<'a, [u8], [u8]> {
        let mut headers = OwnedHeaders::new();
        for (k, v) in &self.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        for (k, v) in &self.raw_headers {
            tradebucket::kafka::headers::add(&mut headers, k, v.as_deref());
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(headers);
        if let Some(k) = &self.key {
            record = record.key(k.as_bytes());
        }
        if let Some(p) = &self.payload {
            record = record.payload(p.as_slice());
        }
        if let Some(p) = self.partition {
            record = record.partition(p);
        }
        record
    }
}

/// Produces `messages` in order, fast: every send is queued before any is
/// awaited, and the idempotent producer keeps the order within a
/// partition. Returns each message's (partition, offset). For large event
/// sets; [`TestEnv::produce`] sends one at a time.
pub async fn produce_fast<'a>(
    brokers: &str,
    topic: &str,
    messages: impl IntoIterator<Item = &'a Produced>,
) -> Vec<(i32, i64)> {
    produce_fast_with(brokers, topic, messages, &[]).await
}

/// [`produce_fast`] with librdkafka producer `options` on top of its own
/// (`compression.type`, a larger `message.max.bytes`...).
pub async fn produce_fast_with<'a>(
    brokers: &str,
    topic: &str,
    messages: impl IntoIterator<Item = &'a Produced>,
    options: &[(&str, &str)],
) -> Vec<(i32, i64)> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "100000")
        .set("message.timeout.ms", "120000");
    for (k, v) in options {
        config.set(*k, *v);
    }
    let producer: FutureProducer = config.create().expect("producer");
    let mut pending = Vec::new();
    for m in messages {
        let delivery = tradebucket::kafka::enqueue(&producer, m.record(topic))
            .await
            .unwrap_or_else(|e| panic!("produce: {e}"));
        pending.push(delivery);
    }
    let mut out = Vec::with_capacity(pending.len());
    for f in pending {
        let delivery = f
            .await
            .expect("delivery not cancelled")
            .map_err(|(e, _)| e)
            .expect("delivered");
        out.push((delivery.partition, delivery.offset));
    }
    out
}

/// A header's value as text, if the message has it.
pub fn header(m: &OwnedMessage, name: &str) -> Option<String> {
    headers_of(m)
        .into_iter()
        .find(|(k, _)| k == name.as_bytes())
        .and_then(|(_, v)| v)
        .map(|v| String::from_utf8_lossy(&v).to_string())
}

/// Every header of a message as bytes. (rdkafka's own `Headers::iter`
/// panics on a name that is not UTF-8.)
pub fn headers_of(m: &OwnedMessage) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
    tradebucket::kafka::headers::read(m.headers().map(|h| h.as_borrowed()))
}

/// One test's private slice of the servers.
#[derive(Debug, Clone)]
pub struct TestEnv {
    pub kafka: String,
    pub mongo_uri: String,
    pub db: String,
    pub topic: String,
    pub dlq: String,
    pub group: String,
    pub partitions: i32,
}

impl TestEnv {
    /// The MongoDB server's `host:port`, for a proxy put in front of it.
    pub fn mongo_host_port(&self) -> String {
        let rest = self.mongo_uri.trim_start_matches("mongodb://");
        rest.split('/').next().unwrap_or(rest).to_string()
    }

    /// On the shared servers (see the module header).
    pub async fn new(name: &str, partitions: i32) -> TestEnv {
        TestEnv::on(kafka_brokers(), mongodb_uri(), name, partitions).await
    }

    /// The same, on the given servers (private ones, for fault tests).
    pub async fn on(kafka: String, mongo_uri: String, name: &str, partitions: i32) -> TestEnv {
        TestEnv::on_replicated(kafka, mongo_uri, name, partitions, 1).await
    }

    /// The same on a cluster: both topics with `replicas` replicas a
    /// partition (and `min.insync.replicas=2` with more than one).
    pub async fn on_replicated(
        kafka: String,
        mongo_uri: String,
        name: &str,
        partitions: i32,
        replicas: i32,
    ) -> TestEnv {
        let base = unique(name);
        let env = TestEnv {
            kafka,
            mongo_uri,
            db: base.replace('-', "_"),
            topic: format!("{base}.trades"),
            dlq: format!("{base}.trades.dlq"),
            group: format!("{base}-group"),
            partitions,
        };
        create_replicated_topic(&env.kafka, &env.topic, partitions, replicas).await;
        create_replicated_topic(&env.kafka, &env.dlq, 1, replicas).await;
        env
    }

    /// The same topics and database, read by another consumer group.
    pub fn with_group(&self, group: &str) -> TestEnv {
        TestEnv {
            group: group.to_string(),
            ..self.clone()
        }
    }

    /// The worker's environment: TRADEBUCKET__* variables, for the binary
    /// and (through `settings`) for in-process workers alike; `extra`
    /// overrides the defaults.
    pub fn vars(&self, extra: &[(&str, &str)]) -> BTreeMap<String, String> {
        let mut v = settings::test_worker(
            &self.kafka,
            &self.topic,
            &self.group,
            &self.dlq,
            &self.mongo_uri,
            &self.db,
        );
        v.extend(settings::vars(extra.iter().copied()));
        v
    }

    pub fn settings(&self, extra: &[(&str, &str)]) -> Settings {
        settings::load(&self.vars(extra))
    }

    pub async fn store(&self) -> BucketStore {
        BucketStore::connect(&self.settings(&[]))
            .await
            .expect("MongoDB client")
    }

    /// Creates the bucket collection with a validator that refuses any
    /// bucket holding a trade with `ticker`: a stand-in for any refusal of
    /// a document's data.
    pub async fn refuse_ticker(&self, ticker: &str) {
        self.store()
            .await
            .client()
            .database(&self.db)
            .run_command(
                doc! {"create": "trades", "validator": {"history.ticker": {"$ne": ticker}}},
            )
            .await
            .expect("create the collection with a validator");
    }

    /// Produces messages one at a time, in order, and returns each one's
    /// (partition, offset).
    pub async fn produce(&self, messages: &[Produced]) -> Vec<(i32, i64)> {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &self.kafka)
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .create()
            .expect("producer");
        let mut out = Vec::with_capacity(messages.len());
        // Sequential sends keep the order within a partition exact.
        for m in messages {
            let delivery = producer
                .send(m.record(&self.topic), Duration::from_secs(10))
                .await
                .map_err(|(e, _)| e)
                .expect("produce");
            out.push((delivery.partition, delivery.offset));
        }
        out
    }

    /// Produces JSON events keyed by their customer.
    pub async fn produce_json(&self, events: &[serde_json::Value]) -> Vec<(i32, i64)> {
        let messages: Vec<Produced> = events
            .iter()
            .map(|e| Produced {
                key: e
                    .get("customerId")
                    .map(|c| c.to_string().trim_matches('"').to_string()),
                payload: Some(e.to_string().into_bytes()),
                ..Produced::default()
            })
            .collect();
        self.produce(&messages).await
    }

    /// A client of this group that never commits (to read its offsets).
    pub fn group_client(&self) -> BaseConsumer {
        ClientConfig::new()
            .set("bootstrap.servers", &self.kafka)
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("consumer")
    }

    /// The group's committed offsets (next to read) per partition. A
    /// coordinator that is moving or still loading its offsets after a
    /// restart answers with an error for a while: asked again for up to
    /// 60 s.
    pub fn committed(&self) -> BTreeMap<i32, i64> {
        let client = self.group_client();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            match self.committed_via(&client) {
                Ok(committed) => return committed,
                Err(e) if std::time::Instant::now() < deadline => {
                    eprintln!("committed offsets: {e}; asking again");
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => panic!("committed offsets: {e}"),
            }
        }
    }

    /// The same through `consumer` (any client of this group), or the
    /// broker's error, for callers that poll through a slow broker.
    pub fn committed_via(&self, consumer: &BaseConsumer) -> KafkaResult<BTreeMap<i32, i64>> {
        let mut tpl = TopicPartitionList::new();
        for p in 0..self.partitions {
            tpl.add_partition(&self.topic, p);
        }
        let committed = consumer.committed_offsets(tpl, Duration::from_secs(10))?;
        Ok(committed
            .elements()
            .iter()
            .map(|e| {
                (
                    e.partition(),
                    match e.offset() {
                        Offset::Offset(o) => o,
                        _ => 0,
                    },
                )
            })
            .collect())
    }

    /// The end of each partition.
    pub fn end_offsets(&self) -> BTreeMap<i32, i64> {
        let consumer = self.group_client();
        (0..self.partitions)
            .map(|p| {
                let (_, high) = consumer
                    .fetch_watermarks(&self.topic, p, Duration::from_secs(10))
                    .expect("watermarks");
                (p, high)
            })
            .collect()
    }

    /// Waits until the group has committed every partition to its end.
    pub async fn wait_committed_to_end(&self, timeout: Duration) {
        let end = self.end_offsets();
        let reached = poll_until(timeout, Duration::from_millis(200), || async {
            self.committed() == end
        })
        .await;
        assert!(
            reached,
            "committed {:?} did not reach the end {end:?} within {timeout:?}",
            self.committed()
        );
    }

    /// Every bucket, in `_id` order.
    pub async fn buckets(&self) -> Vec<Document> {
        self.store()
            .await
            .collection()
            .find(doc! {})
            .sort(doc! {"_id": 1})
            .await
            .expect("find")
            .try_collect()
            .await
            .expect("read buckets")
    }

    /// Trade keys per customer prefix, concatenated in page order.
    pub async fn histories(&self) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for b in self.buckets().await {
            let id = b.get_str("_id").unwrap();
            let customer = id.split('_').next().unwrap().to_string();
            for h in b.get_array("history").unwrap() {
                let key = h.as_document().unwrap().get_str("key").unwrap().to_string();
                out.entry(customer.clone()).or_default().push(key);
            }
        }
        out
    }

    /// Reads the dead-letter topic in a new group until `expected` records
    /// arrived or `timeout` passed.
    pub async fn dead_letters(&self, expected: usize, timeout: Duration) -> Vec<OwnedMessage> {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.kafka)
            .set("group.id", unique("dlq-reader"))
            .set("auto.offset.reset", "earliest")
            .create()
            .expect("consumer");
        consumer.subscribe(&[&self.dlq]).expect("subscribe");
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + timeout;
        while out.len() < expected {
            match tokio::time::timeout_at(deadline, consumer.recv()).await {
                Ok(Ok(m)) => out.push(m.detach()),
                Ok(Err(e)) => panic!("reading the dead-letter topic: {e}"),
                Err(_) => break,
            }
        }
        out
    }

    /// Every record of the dead-letter topic, from its start to the end it
    /// had when asked (assigned, not subscribed: no group round trips on a
    /// loaded broker).
    pub fn dead_letters_to_end(&self) -> Vec<OwnedMessage> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.kafka)
            .set("group.id", unique("dlq-audit"))
            .set("enable.auto.commit", "false")
            .create()
            .expect("consumer");
        let (_, high) = consumer
            .fetch_watermarks(&self.dlq, 0, Duration::from_secs(10))
            .expect("dead-letter watermarks");
        let mut out = Vec::new();
        if high <= 0 {
            return out;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.dlq, 0, Offset::Beginning)
            .unwrap();
        consumer.assign(&tpl).expect("assign");
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while std::time::Instant::now() < deadline {
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    let last = m.offset() + 1 >= high;
                    out.push(m.detach());
                    if last {
                        break;
                    }
                }
                Some(Err(e)) => panic!("reading the dead-letter topic: {e}"),
                None => {}
            }
        }
        out
    }

    /// Every record of the source topic, each partition from its start to
    /// the end it had when asked (assigned, not subscribed), in partition
    /// order: what the test produced and whatever the product's tools put
    /// back (replays).
    pub fn records_to_end(&self) -> Vec<OwnedMessage> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.kafka)
            .set("group.id", unique("source-audit"))
            .set("enable.auto.commit", "false")
            .create()
            .expect("consumer");
        let mut out = Vec::new();
        for p in 0..self.partitions {
            let (low, high) = consumer
                .fetch_watermarks(&self.topic, p, Duration::from_secs(10))
                .expect("source watermarks");
            if high <= low {
                continue;
            }
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(&self.topic, p, Offset::Offset(low))
                .unwrap();
            consumer.assign(&tpl).expect("assign");
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            let mut reached = false;
            while !reached {
                assert!(
                    std::time::Instant::now() < deadline,
                    "partition {p} of the source topic not read to {high} in 120 s"
                );
                match consumer.poll(Duration::from_millis(200)) {
                    Some(Ok(m)) => {
                        reached = m.offset() + 1 >= high;
                        out.push(m.detach());
                    }
                    Some(Err(e)) => panic!("reading the source topic: {e}"),
                    None => {}
                }
            }
        }
        out
    }

    /// `tradebucket audit`'s checks over this test's database, run in this
    /// process with the given bucket capacity.
    pub async fn audit(&self, capacity: u32) -> AuditReport {
        let (name, value) = settings::capacity(capacity);
        // The audit reads no Kafka record; a message size that the
        // capacity allows keeps large capacities valid settings.
        let message_bytes = (8 << 20) / capacity.max(1);
        let message_bytes = message_bytes.to_string();
        let vars = [
            (name, value.as_str()),
            ("TRADEBUCKET__KAFKA__MAX_MESSAGE_BYTES", &message_bytes),
        ];
        tradebucket::cli::audit(&self.settings(&vars), None)
            .await
            .expect("audit")
    }

    /// Drops the database and deletes the topics.
    ///
    /// Bounded: a server that stopped answering must fail the suite's
    /// later tests, not hang it in a cleanup nobody checks.
    pub async fn cleanup(self) {
        let bound = Duration::from_secs(30);
        let drop_db = async {
            if let Ok(store) = BucketStore::connect(&self.settings(&[])).await {
                let _ = store.client().database(&self.db).drop().await;
            }
        };
        if tokio::time::timeout(bound, drop_db).await.is_err() {
            eprintln!("cleanup: dropping database {} timed out", self.db);
        }
        let delete =
            admin(&self.kafka).delete_topics(&[&self.topic, &self.dlq], &AdminOptions::new());
        if tokio::time::timeout(bound, delete).await.is_err() {
            eprintln!("cleanup: deleting topic {} timed out", self.topic);
        }
    }
}

/// [`TestEnv::audit`], asserting that it found no violation.
pub async fn audit_clean(env: &TestEnv, capacity: u32) -> AuditReport {
    let report = env.audit(capacity).await;
    assert!(
        report.violations.is_empty(),
        "audit violations: {:#?}",
        report.violations
    );
    report
}
