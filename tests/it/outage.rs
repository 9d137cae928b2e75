//! A MongoDB outage longer than `max.poll.interval.ms`: the pipelined loop
//! keeps polling the consumer (its partitions paused) while the write is
//! retried, so the member keeps its partitions and nothing is read twice.

use std::time::Duration;

use testkit::*;

use crate::pipeline::stream;

const T: Duration = Duration::from_secs(60);

#[tokio::test]
async fn an_outage_longer_than_the_poll_interval_costs_no_rebalance_or_redelivery() {
    let mut mongo = PrivateMongo::start().await;
    let env = TestEnv {
        mongo_uri: mongo.uri(),
        ..TestEnv::new("longoutage", 2).await
    };
    let events = stream(81, 2000, 40);
    env.produce_json(&events[..1000]).await;
    // librdkafka requires max.poll.interval.ms >= session.timeout.ms (the
    // kit's 10 s); 10 s here, and the outage lasts 25 s.
    let worker = Worker::spawn(env.settings(&[
        ("TRADEBUCKET__BUCKETS__CAPACITY", "7"),
        ("TRADEBUCKET__KAFKA__MAX_POLL_INTERVAL", "10s"),
    ]));
    env.wait_committed_to_end(T).await;
    let rebalances = |kind: &str| worker.metrics.rebalances.with_label_values(&[kind]).get();
    let assigned_before = rebalances("assigned");
    assert_eq!(rebalances("revoked"), 0);
    mongo.stop();
    let before = env.committed();
    env.produce_json(&events[1000..]).await;
    tokio::time::sleep(Duration::from_secs(25)).await;
    assert_eq!(env.committed(), before, "no commits while MongoDB is down");
    mongo.restart().await;
    env.wait_committed_to_end(T).await;
    assert_eq!(
        rebalances("revoked"),
        0,
        "the member never lost its partitions"
    );
    assert_eq!(
        rebalances("assigned"),
        assigned_before,
        "and was never re-assigned"
    );
    let m = &worker.metrics;
    assert_eq!(m.events_consumed.get(), 2000, "no record read twice");
    assert_eq!(
        m.events_skipped
            .with_label_values(&["already_applied"])
            .get(),
        0,
        "no redelivery"
    );
    assert!(
        m.retries.with_label_values(&["mongodb"]).get() > 0,
        "the outage was met"
    );
    worker.stop().await;
    let report = audit_clean(&env, 7).await;
    assert_eq!(report.trades, 2000);
    env.cleanup().await;
}
