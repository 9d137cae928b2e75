//! Time limits against a server whose replies stop (`testkit::FaultProxy`).

use std::time::Duration;

use mongodb::bson::doc;
use testkit::*;
use tradebucket::bucket::store::{BucketStore, StoreError};
use tradebucket::event::CustomerId;

/// An operation past `timeouts.mongodb_operation` fails as a transient
/// timeout, and its connection is abandoned: the driver closes a
/// connection dropped mid-operation, so the late reply is never read as
/// the next operation's answer (which would make one customer's key look
/// stored in another's bucket).
#[tokio::test]
async fn an_operation_past_its_time_limit_is_abandoned_and_its_late_reply_never_read() {
    let base = TestEnv::new("late-reply", 1).await;
    let upstream = base.mongo_host_port();
    let proxy = FaultProxy::start(&upstream, 0, Protocol::Mongo).await;
    let env = TestEnv {
        mongo_uri: format!("mongodb://{}/?directConnection=true", proxy.address()),
        ..base
    };
    let store = BucketStore::connect(&env.settings(&[
        ("TRADEBUCKET__TIMEOUTS__MONGODB_OPERATION", "1s"),
        ("TRADEBUCKET__TIMEOUTS__MONGODB_WRITE_CONCERN", "500ms"),
    ]))
    .await
    .unwrap();
    store
        .collection()
        .insert_many([
            doc! {"_id": "1_1700000000", "customerId": 1, "history": [{"key": "t:a"}]},
            doc! {"_id": "2_1700000000", "customerId": 2, "history": [{"key": "t:b"}]},
        ])
        .await
        .unwrap();
    let before = proxy.connections();
    proxy.delay(Duration::ZERO, Duration::from_secs(3));
    let late = store
        .find_keys(&[(CustomerId::Int(1), "t:a".to_string())])
        .await;
    assert!(
        matches!(
            late,
            Err(StoreError::TimedOut {
                operation: "find",
                ..
            })
        ),
        "{late:?}"
    );
    proxy.delay(Duration::ZERO, Duration::ZERO);
    let next = store
        .find_keys(&[(CustomerId::Int(2), "t:b".to_string())])
        .await
        .unwrap();
    assert_eq!(next, vec![("t:b".to_string(), "2_1700000000".to_string())]);
    assert!(
        proxy.connections() > before,
        "the next operation used a new connection"
    );
    // The late reply has arrived by now, on the abandoned connection.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let again = store
        .find_keys(&[(CustomerId::Int(2), "t:b".to_string())])
        .await
        .unwrap();
    assert_eq!(again, next);
    env.cleanup().await;
}

/// The reads of `page`, `audit` and `init` (its index and shard-layout
/// reads) end at `timeouts.mongodb_operation` when MongoDB stops answering
/// on a connection already open, with an error, instead of waiting for
/// ever (before, `page`, `audit` and init's shard-layout reads had no
/// bound; a new client's handshake is bounded by the driver's connect
/// timeout, so the store is connected first).
#[tokio::test]
async fn page_audit_and_init_end_at_their_time_limit_when_mongodb_stops_answering() {
    let base = TestEnv::new("cli-limits", 1).await;
    let proxy = FaultProxy::start(&base.mongo_host_port(), 0, Protocol::Mongo).await;
    let env = TestEnv {
        mongo_uri: format!("mongodb://{}/?directConnection=true", proxy.address()),
        ..base
    };
    let settings = env.settings(&[
        ("TRADEBUCKET__TIMEOUTS__MONGODB_OPERATION", "1s"),
        ("TRADEBUCKET__TIMEOUTS__MONGODB_WRITE_CONCERN", "500ms"),
    ]);
    let store = BucketStore::connect(&settings).await.unwrap();
    store.init().await.expect("indexes, while MongoDB answers");
    proxy.delay(Duration::ZERO, Duration::from_secs(60));
    let started = std::time::Instant::now();
    let page = store.page(&CustomerId::Int(1), 1).await;
    assert!(
        matches!(page, Err(StoreError::TimedOut { .. })),
        "page: {page:?}"
    );
    let audit = tradebucket::cli::audit_with(&store, &settings, None).await;
    assert!(audit.is_err(), "audit: {audit:?}");
    let init = store.init_and_shard().await;
    assert!(init.is_err(), "init: {init:?}");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(15), "three reads took {took:?}");
    proxy.delay(Duration::ZERO, Duration::ZERO);
    env.cleanup().await;
}
