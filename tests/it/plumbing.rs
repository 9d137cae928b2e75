//! The stack and the harness work end to end: a topic, a produced message
//! consumed in a group with a manual commit, and a document written and
//! read back through the MongoDB driver.

use std::time::Duration;

use mongodb::bson::doc;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::{Message, Offset, TopicPartitionList};

use testkit::{Produced, TestEnv};

#[tokio::test]
async fn kafka_and_mongodb_round_trip() {
    let env = TestEnv::new("plumbing", 1).await;
    let sent = env
        .produce(&[Produced {
            key: Some("k".into()),
            payload: Some(b"hello".to_vec()),
            headers: vec![("h".into(), "v".into())],
            ..Produced::default()
        }])
        .await;
    assert_eq!(sent, vec![(0, 0)]);

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &env.kafka)
        .set("group.id", &env.group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[&env.topic]).unwrap();
    let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
        .await
        .expect("a message within 30 s")
        .unwrap();
    assert_eq!(m.payload(), Some(&b"hello"[..]));
    assert_eq!(m.key(), Some(&b"k"[..]));
    let next = m.offset() + 1;
    // A borrowed message pins the consumer: librdkafka's close waits for
    // every outstanding message to be released.
    drop(m);
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&env.topic, 0, Offset::Offset(next))
        .unwrap();
    consumer.commit(&tpl, CommitMode::Sync).unwrap();
    drop(consumer);
    assert_eq!(
        env.committed().get(&0),
        Some(&1),
        "manual commit is visible to the group"
    );

    let store = env.store().await;
    store
        .collection()
        .insert_one(doc! {"_id": "x", "payload": "hello"})
        .await
        .unwrap();
    let back = store
        .collection()
        .find_one(doc! {"_id": "x"})
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back.get_str("payload").unwrap(), "hello");
    env.cleanup().await;
}
