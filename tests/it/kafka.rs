//! What only a real Kafka broker shows: records of aborted transactions
//! and transaction markers, a compacted topic's gaps, a topic deleted and
//! recreated under the same name. Each is stored or committed past as
//! docs/operations.md promises.

use std::time::Duration;

use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::ClientConfig;

use testkit::*;

use crate::pipeline::{expected_histories, stream};

const T: Duration = Duration::from_secs(60);

fn transactional(env: &TestEnv) -> FutureProducer {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &env.kafka)
        .set("transactional.id", unique("txn"))
        .create()
        .expect("transactional producer");
    producer
        .init_transactions(Duration::from_secs(30))
        .expect("init transactions");
    producer
}

/// Sends `ids` (customer 1) to partition 0 inside one transaction, and
/// commits or aborts it.
async fn in_transaction(producer: &FutureProducer, topic: &str, ids: &[&str], commit: bool) {
    producer.begin_transaction().expect("begin");
    for id in ids {
        let payload = trade(*id).customer(1).payload();
        producer
            .send(
                FutureRecord::<[u8], [u8]>::to(topic)
                    .partition(0)
                    .payload(&payload),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("sent in the transaction");
    }
    let t = Duration::from_secs(30);
    if commit {
        producer.commit_transaction(t).expect("commit");
    } else {
        producer.abort_transaction(t).expect("abort");
    }
}

/// A transactional upstream: two committed transactions around an aborted
/// one. The worker reads committed records only (librdkafka's default
/// `isolation.level`, which the product does not change): the aborted
/// trades are never stored, nothing is dead-lettered, and the commit moves
/// past the aborted records and every marker between the records it
/// stored. The last marker is never delivered, so the commit stops on it
/// (a restart re-reads one marker and nothing else).
#[tokio::test]
async fn aborted_transactions_are_skipped_and_markers_committed_past() {
    let env = TestEnv::new("txn", 1).await;
    let producer = transactional(&env);
    in_transaction(&producer, &env.topic, &["c0", "c1"], true).await;
    in_transaction(&producer, &env.topic, &["a0", "a1", "a2"], false).await;
    in_transaction(&producer, &env.topic, &["c2"], true).await;
    // c0 c1 marker a0 a1 a2 marker c2 marker: the end offset is 9.
    let end = env.end_offsets()[&0];
    assert_eq!(end, 9, "the layout this test reasons about");
    let worker = Worker::spawn(env.settings(&[]));
    eventually("committed to the last marker", T, || async {
        env.committed().get(&0).copied() == Some(end - 1)
    })
    .await;
    let metrics = worker.stop().await;
    assert_eq!(metrics.events_written.get(), 3);
    let stored = env.histories().await;
    assert_eq!(
        stored.get("1").cloned().unwrap_or_default(),
        vec!["t:c0", "t:c1", "t:c2"]
    );
    assert!(
        env.dead_letters_to_end().is_empty(),
        "nothing dead-lettered"
    );
    audit_clean(&env, 10).await;
    env.cleanup().await;
}

/// A compacted topic: of each key only the newest record survives the
/// cleaner, so the partition's offsets have gaps, inside batches and
/// between them. The worker stores what survived, each once, and commits
/// to the end across the gaps.
#[tokio::test]
async fn a_compacted_topics_gaps_are_committed_past() {
    let env = TestEnv::new("compacted", 1).await;
    let topic = format!("{}.compacted", env.topic);
    create_compacted(&env.kafka, &topic).await;
    let env = TestEnv {
        topic: topic.clone(),
        ..env
    };
    // Ten keys, each sent three times with a new trade each time; the
    // cleaner keeps the last of each key.
    let rounds: Vec<Produced> = (0..3)
        .flat_map(|round| {
            (0..10).map(move |k| Produced {
                key: Some(format!("k{k}")),
                payload: Some(trade(format!("r{round}-k{k}")).customer(k).payload()),
                partition: Some(0),
                ..Produced::default()
            })
        })
        .collect();
    env.produce(&rounds).await;
    let held = wait_compacted(&env, 10).await;
    let end = env.end_offsets()[&0];
    let worker = Worker::spawn(env.settings(&[]));
    env.wait_committed_to_end(T).await;
    let metrics = worker.stop().await;
    let stored: Vec<String> = env.histories().await.into_values().flatten().collect();
    for k in 0..10 {
        assert!(
            stored.contains(&format!("t:r2-k{k}")),
            "the newest trade of key k{k} is stored: {stored:?}"
        );
    }
    // The cleaner may go on removing records while the worker reads, so
    // the number it reads is only bounded: at most what was held when the
    // wait ended, and fewer than the offsets it committed past.
    let distinct: std::collections::BTreeSet<&String> = stored.iter().collect();
    assert_eq!(distinct.len(), stored.len(), "each record once: {stored:?}");
    assert_eq!(metrics.events_written.get(), stored.len() as u64);
    assert!(
        stored.len() <= held && (stored.len() as i64) < end,
        "{} stored, {held} held, end offset {end}",
        stored.len()
    );
    audit_clean(&env, 10).await;
    admin(&env.kafka)
        .delete_topics(&[&topic], &AdminOptions::new())
        .await
        .expect("delete the compacted topic");
    env.cleanup().await;
}

/// Compaction as fast as the broker allows: segments roll every 100 ms and
/// any dirty share is cleaned. (The broker's cleaner looks every
/// `log.cleaner.backoff.ms`, 15 s by default.)
async fn create_compacted(brokers: &str, topic: &str) {
    let new = NewTopic::new(topic, 1, TopicReplication::Fixed(1))
        .set("cleanup.policy", "compact")
        .set("segment.ms", "100")
        .set("min.cleanable.dirty.ratio", "0.001")
        .set("min.compaction.lag.ms", "0")
        .set("delete.retention.ms", "0");
    let results = admin(brokers)
        .create_topics([&new], &AdminOptions::new())
        .await
        .expect("create the compacted topic");
    for r in results {
        r.expect("compacted topic created");
    }
}

/// Rolls the active segment (a record after `segment.ms`, whose own key
/// is new, so it adds a trade) until the cleaner has removed records,
/// and returns how many records the partition still holds. The roll
/// record is a trade of its own (customer 99) and is counted.
async fn wait_compacted(env: &TestEnv, keys: usize) -> usize {
    let reader = env.group_client();
    let mut rolls = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let roll = Produced {
            key: Some(format!("roll{rolls}")),
            payload: Some(trade(format!("roll{rolls}")).customer(99).payload()),
            partition: Some(0),
            ..Produced::default()
        };
        env.produce(&[roll]).await;
        rolls += 1;
        let held = count_records(&reader, &env.topic);
        if held < 3 * keys + rolls {
            return held;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cleaner compacted nothing in 120 s"
        );
    }
}

/// Reads `topic`'s partition 0 from the start to its end offset and
/// counts the records (a compacted log has fewer than its end offset).
fn count_records(reader: &rdkafka::consumer::BaseConsumer, topic: &str) -> usize {
    use rdkafka::consumer::Consumer;
    use rdkafka::{Offset, TopicPartitionList};
    let (_, high) = reader
        .fetch_watermarks(topic, 0, Duration::from_secs(10))
        .expect("watermarks");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .expect("offset");
    reader.assign(&tpl).expect("assign");
    let mut n = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        match reader.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                n += 1;
                if rdkafka::Message::offset(&m) + 1 >= high {
                    break;
                }
            }
            Some(Err(e)) => panic!("read {topic}: {e}"),
            None => {}
        }
    }
    reader.unassign().expect("unassign");
    n
}

/// A topic deleted and recreated under the same name while no worker
/// runs: the group's committed offsets lie past the new topic's end, the
/// worker starts over from the new topic's first record (Kafka says the
/// offset is out of range; `kafka.auto_offset_reset`, earliest), and its
/// trades, at offsets the old topic also used, are stored: trades with a
/// `tradeId` are never taken for the old topic's (docs/operations.md, "A
/// topic deleted and recreated under the same name").
#[tokio::test]
async fn a_topic_deleted_and_recreated_is_read_again_from_its_start() {
    let env = TestEnv::new("recreated", 1).await;
    let old: Vec<_> = (0..20)
        .map(|i| trade(format!("old{i}")).customer(i % 4).json())
        .collect();
    env.produce_json(&old).await;
    let worker = Worker::spawn(env.settings(&[]));
    env.wait_committed_to_end(T).await;
    worker.stop().await;

    admin(&env.kafka)
        .delete_topics(&[&env.topic], &AdminOptions::new())
        .await
        .expect("delete");
    eventually("the topic is recreated", T, || async {
        try_create(&env.kafka, &env.topic).await
    })
    .await;
    let new: Vec<_> = (0..8)
        .map(|i| trade(format!("new{i}")).customer(i % 4).json())
        .collect();
    env.produce_json(&new).await;
    let worker = Worker::spawn(env.settings(&[]));
    env.wait_committed_to_end(T).await;
    let metrics = worker.stop().await;
    assert_eq!(metrics.events_written.get(), new.len() as u64);
    let all: Vec<_> = old.iter().chain(&new).cloned().collect();
    assert_eq!(env.histories().await, expected_histories(&all));
    audit_clean(&env, 10).await;
    env.cleanup().await;
}

/// Creates `topic` with one partition; false while the broker still
/// deletes the old one (creation is refused until it has).
async fn try_create(brokers: &str, topic: &str) -> bool {
    let new = NewTopic::new(topic, 1, TopicReplication::Fixed(1));
    match admin(brokers)
        .create_topics([&new], &AdminOptions::new())
        .await
    {
        Ok(results) => results.into_iter().all(|r| r.is_ok()),
        Err(_) => false,
    }
}

/// A group moved from the classic protocol to the consumer protocol
/// (KIP-848) one member at a time, as a rolling upgrade of
/// `kafka.group_protocol` does: for a while a classic and a consumer
/// member share the group (Apache Kafka converts it online), then the
/// classic one leaves. Every trade is stored once throughout.
#[tokio::test]
async fn a_group_moves_from_the_classic_to_the_consumer_protocol_member_by_member() {
    let env = TestEnv::new("protocols", 4).await;
    let events = stream(848, 600, 40);
    let classic = Worker::spawn(env.settings(&[("TRADEBUCKET__KAFKA__GROUP_PROTOCOL", "classic")]));
    env.produce_json(&events[..200]).await;
    env.wait_committed_to_end(T).await;
    let consumer =
        Worker::spawn(env.settings(&[("TRADEBUCKET__KAFKA__GROUP_PROTOCOL", "consumer")]));
    eventually(
        "the consumer-protocol member owns partitions",
        T,
        || async { consumer.metrics.assigned_partitions.get() > 0 },
    )
    .await;
    // What `TradebucketPartitionsUnassigned` compares: the members'
    // assigned partitions add up to the topic's, which each member knows
    // from its client's metadata (statistics, every 5 s).
    eventually(
        "the two members own the topic's 4 partitions between them",
        T,
        || async {
            let (a, b) = (&classic.metrics, &consumer.metrics);
            a.assigned_partitions.get() + b.assigned_partitions.get() == 4
                && a.source_partitions.get() == 4
                && b.source_partitions.get() == 4
        },
    )
    .await;
    env.produce_json(&events[200..400]).await;
    env.wait_committed_to_end(T).await;
    let first = classic.stop().await;
    eventually(
        "the consumer-protocol member owns every partition",
        T,
        || async { consumer.metrics.assigned_partitions.get() == 4 },
    )
    .await;
    env.produce_json(&events[400..]).await;
    env.wait_committed_to_end(T).await;
    let second = consumer.stop().await;
    assert_eq!(
        first.events_written.get() + second.events_written.get(),
        events.len() as u64,
        "each trade written once, by one member or the other"
    );
    assert_eq!(env.histories().await, expected_histories(&events));
    audit_clean(&env, 10).await;
    env.cleanup().await;
}
