//! Liveness and readiness: state the worker loop and its MongoDB watcher
//! update, and the HTTP endpoints read. Its own module so that neither side
//! depends on the other.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What `/readyz` says for a failed write that gave no reason.
const WRITES_FAILING: &str = "MongoDB writes failing: being retried";

/// What `/healthz` and `/readyz` report.
#[derive(Debug, Default)]
pub struct Health {
    /// Subscribed to the group (assigned partitions or waiting for them).
    pub subscribed: AtomicBool,
    /// The last MongoDB write succeeded.
    pub mongodb_ok: AtomicBool,
    /// Why the last MongoDB write failed (a time limit that expired says
    /// which), while `mongodb_ok` is false.
    pub mongodb_failure: Mutex<Option<String>>,
    /// Kafka does not answer: no broker connection is up, or the group
    /// coordinator is lost, as librdkafka's statistics last said (see
    /// `kafka::link_failure`).
    pub kafka_unreachable: Mutex<Option<String>>,
    /// The consumer group has rebalanced for longer than a rebalance can
    /// take, so this member is assigned nothing (see `kafka::group`).
    pub group_unsettled: Mutex<Option<String>>,
    /// The last periodic ping succeeded (a worker with nothing to write
    /// would otherwise stay ready through a whole outage).
    pub mongodb_reachable: AtomicBool,
    /// The dead-letter topic refuses writes (other than for one record's
    /// size): the partition waits for it.
    pub dead_letters_failing: AtomicBool,
    /// The Kafka client skipped records it could not read: no offset is
    /// committed any more (see `Worker::consumer_error`).
    pub records_skipped: AtomicBool,
    /// Assigned partitions with records waiting that the consumer has not
    /// read for `timeouts.partition_stall`, described for the operator.
    pub stalled_partitions: Mutex<Vec<String>>,
    /// Shutting down: no new batches.
    pub draining: AtomicBool,
    /// Unix millis of the loop's last turn; a stale value means wedged.
    pub last_tick_ms: AtomicU64,
}

impl Health {
    pub fn tick(&self) {
        self.last_tick_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// A MongoDB write failed; `reason` is what `/readyz` says until one
    /// succeeds.
    pub fn write_failed(&self, reason: String) {
        if let Ok(mut r) = self.mongodb_failure.lock() {
            *r = Some(reason);
        }
        self.mongodb_ok.store(false, Ordering::Relaxed);
    }

    /// A MongoDB write succeeded.
    pub fn write_succeeded(&self) {
        self.mongodb_ok.store(true, Ordering::Relaxed);
    }

    /// `Err(reason)` when the worker should not receive traffic.
    pub fn readiness(&self) -> Result<(), Cow<'static, str>> {
        self.fixed_readiness().map_err(Cow::Borrowed)?;
        let mut reasons: Vec<Cow<'static, str>> = Vec::new();
        if !self.mongodb_ok.load(Ordering::Relaxed) {
            let said = self.mongodb_failure.lock().ok().and_then(|r| r.clone());
            reasons.push(said.map_or(Cow::Borrowed(WRITES_FAILING), Cow::Owned));
        }
        self.remote_reasons(&mut reasons);
        match reasons.len() {
            0 => Ok(()),
            1 => Err(reasons.remove(0)),
            _ => Err(Cow::Owned(reasons.join("; "))),
        }
    }

    /// The reasons set from outside the loop: MongoDB's ping, Kafka's
    /// statistics, the partition watcher. All of them, not the first: a
    /// broker connection that comes and goes must not hide a partition
    /// that cannot be read (the operator needs both).
    fn remote_reasons(&self, out: &mut Vec<Cow<'static, str>>) {
        if !self.mongodb_reachable.load(Ordering::Relaxed) {
            out.push(Cow::Borrowed("MongoDB unreachable"));
        }
        if let Ok(Some(why)) = self.kafka_unreachable.lock().as_deref() {
            out.push(Cow::Owned(format!("Kafka not answering: {why}")));
        }
        if let Ok(Some(why)) = self.group_unsettled.lock().as_deref() {
            out.push(Cow::Owned(why.to_string()));
        }
        if self.dead_letters_failing.load(Ordering::Relaxed) {
            out.push(Cow::Borrowed(
                "the dead-letter topic refuses writes: being retried, the partition waits",
            ));
        }
        if self.records_skipped.load(Ordering::Relaxed) {
            out.push(Cow::Borrowed("the Kafka client skipped records it could not read: offsets are no longer committed"));
        }
        if let Ok(stalled) = self.stalled_partitions.lock() {
            if !stalled.is_empty() {
                out.push(Cow::Owned(format!(
                    "Kafka partitions not being read: {}",
                    stalled.join(", ")
                )));
            }
        }
    }

    fn fixed_readiness(&self) -> Result<(), &'static str> {
        if self.draining.load(Ordering::Relaxed) {
            Err("draining: shutting down")
        } else if !self.subscribed.load(Ordering::Relaxed) {
            Err("starting: not yet subscribed to the consumer group")
        } else {
            Ok(())
        }
    }

    /// `Err(reason)` when the loop has not turned for `stall`.
    pub fn liveness(&self, stall: Duration) -> Result<(), String> {
        let last = self.last_tick_ms.load(Ordering::Relaxed);
        let age = now_ms().saturating_sub(last);
        if last != 0 && age > stall.as_millis() as u64 {
            Err(format!("the worker loop has not turned for {age} ms"))
        } else {
            Ok(())
        }
    }
}

/// Wall-clock Unix millis (Kafka timestamps are wall-clock too).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_follows_each_state() {
        let h = Health::default();
        assert_eq!(
            h.readiness().unwrap_err(),
            "starting: not yet subscribed to the consumer group"
        );
        h.subscribed.store(true, Ordering::Relaxed);
        h.mongodb_reachable.store(true, Ordering::Relaxed);
        assert_eq!(
            h.readiness().unwrap_err(),
            "MongoDB writes failing: being retried"
        );
        h.mongodb_ok.store(true, Ordering::Relaxed);
        assert_eq!(h.readiness(), Ok(()));
        *h.stalled_partitions.lock().unwrap() = vec!["t/0 (3 records waiting unread)".into()];
        assert_eq!(
            h.readiness().unwrap_err(),
            "Kafka partitions not being read: t/0 (3 records waiting unread)"
        );
        h.draining.store(true, Ordering::Relaxed);
        assert_eq!(h.readiness().unwrap_err(), "draining: shutting down");
    }

    #[test]
    fn readiness_says_why_writes_fail_and_that_kafka_is_silent() {
        let h = Health::default();
        h.subscribed.store(true, Ordering::Relaxed);
        h.mongodb_reachable.store(true, Ordering::Relaxed);
        h.write_failed("MongoDB writes failing: an update exceeded its 30s time limit".into());
        assert_eq!(
            h.readiness().unwrap_err(),
            "MongoDB writes failing: an update exceeded its 30s time limit"
        );
        h.write_succeeded();
        assert_eq!(h.readiness(), Ok(()));
        *h.kafka_unreachable.lock().unwrap() = Some("no broker connection is up".into());
        assert_eq!(
            h.readiness().unwrap_err(),
            "Kafka not answering: no broker connection is up"
        );
        *h.kafka_unreachable.lock().unwrap() = None;
        assert_eq!(h.readiness(), Ok(()));
    }

    /// A broker connection that comes and goes must not hide a partition
    /// that cannot be read: every reason is said.
    #[test]
    fn readiness_says_every_reason_at_once() {
        let h = Health::default();
        h.subscribed.store(true, Ordering::Relaxed);
        h.mongodb_reachable.store(true, Ordering::Relaxed);
        h.mongodb_ok.store(true, Ordering::Relaxed);
        *h.kafka_unreachable.lock().unwrap() = Some("no broker connection is up".into());
        *h.stalled_partitions.lock().unwrap() = vec!["t/0 (3 records waiting unread)".into()];
        *h.group_unsettled.lock().unwrap() = Some("the consumer group has not settled".into());
        assert_eq!(
            h.readiness().unwrap_err(),
            "Kafka not answering: no broker connection is up; \
             the consumer group has not settled; \
             Kafka partitions not being read: t/0 (3 records waiting unread)"
        );
    }

    #[test]
    fn liveness_fails_only_after_the_stall() {
        let h = Health::default();
        assert!(
            h.liveness(Duration::from_secs(1)).is_ok(),
            "never ticked yet"
        );
        h.last_tick_ms.store(now_ms() - 5_000, Ordering::Relaxed);
        assert!(h.liveness(Duration::from_secs(60)).is_ok());
        assert!(h.liveness(Duration::from_secs(1)).is_err());
    }
}
