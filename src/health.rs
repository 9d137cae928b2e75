//! Liveness and readiness: state the worker's components write and the
//! HTTP endpoints read. Its own module so that neither side depends on the
//! other.
//!
//! The state is private. Each writer has its own few methods, in an `impl`
//! block of its own below (the loop's, the write stage's, the watchers'
//! and librdkafka's statistics callback's), and the endpoints read through
//! the last one.

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
    subscribed: AtomicBool,
    /// The last MongoDB write succeeded.
    mongodb_ok: AtomicBool,
    /// Why the last MongoDB write failed (a time limit that expired says
    /// which), while `mongodb_ok` is false.
    mongodb_failure: Mutex<Option<String>>,
    /// Kafka does not answer: no broker connection is up, or the group
    /// coordinator is lost, as librdkafka's statistics last said (see
    /// `kafka::link_failure`).
    kafka_unreachable: Mutex<Option<String>>,
    /// The consumer group has rebalanced for longer than a rebalance can
    /// take, so this member is assigned nothing (see `kafka::group`).
    group_unsettled: Mutex<Option<String>>,
    /// The last periodic ping succeeded (a worker with nothing to write
    /// would otherwise stay ready through a whole outage).
    mongodb_reachable: AtomicBool,
    /// The dead-letter topic refuses writes (other than for one record's
    /// size): the partition waits for it.
    dead_letters_failing: AtomicBool,
    /// The Kafka client skipped records it could not read: no offset is
    /// committed any more (see `Worker::consumer_error`).
    records_skipped: AtomicBool,
    /// Assigned partitions with records waiting that the consumer has not
    /// read for `timeouts.partition_stall`, described for the operator.
    stalled_partitions: Mutex<Vec<String>>,
    /// Why the Schema Registry could not give a schema that records wait
    /// for (the write stage retries; the partition waits).
    schema_registry_unavailable: Mutex<Option<String>>,
    /// Shutting down: no new batches.
    draining: AtomicBool,
    /// Unix millis of the loop's last turn; a stale value means wedged.
    last_tick_ms: AtomicU64,
}

/// A readiness reason set from outside the loop, compared with the one
/// shown before: the caller logs when a reason appears or goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Appeared,
    Cleared,
    Same,
}

/// The loop's.
impl Health {
    /// The loop turned (liveness).
    pub fn tick(&self) {
        self.last_tick_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Subscribed to the consumer group: ready from now on, reasons aside.
    pub fn subscribed(&self) {
        self.subscribed.store(true, Ordering::Relaxed);
    }

    /// Shutting down: not ready any more.
    pub fn draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// The Kafka client skipped records: not ready until restarted.
    pub fn records_skipped(&self) {
        self.records_skipped.store(true, Ordering::Relaxed);
    }
}

/// The write stage's.
impl Health {
    /// A MongoDB write failed; `reason` is what `/readyz` says until one
    /// succeeds.
    pub fn write_failed(&self, reason: String) {
        if let Ok(mut r) = self.mongodb_failure.lock() {
            *r = Some(reason);
        }
        self.mongodb_ok.store(false, Ordering::Relaxed);
    }

    /// A MongoDB write succeeded (also said once at start, after the
    /// indexes are created).
    pub fn write_succeeded(&self) {
        self.mongodb_ok.store(true, Ordering::Relaxed);
    }

    /// Whether the dead-letter topic refuses writes.
    pub fn dead_letters_failing(&self, failing: bool) {
        self.dead_letters_failing.store(failing, Ordering::Relaxed);
    }

    /// Why the Schema Registry does not answer, or `None` once it does.
    pub fn schema_registry_unavailable(&self, why: Option<String>) -> Change {
        replace(&self.schema_registry_unavailable, why)
    }
}

/// The watchers' and librdkafka's statistics callback's.
impl Health {
    /// The MongoDB ping's result; `true` if that changed it.
    pub fn mongodb_reachable(&self, ok: bool) -> bool {
        self.mongodb_reachable.swap(ok, Ordering::Relaxed) != ok
    }

    /// The assigned partitions not being read, described for the operator.
    pub fn stalled_partitions(&self, stalled: &[String]) {
        if let Ok(mut shown) = self.stalled_partitions.lock() {
            shown.clear();
            shown.extend_from_slice(stalled);
        }
    }

    /// Why Kafka does not answer, or `None` once it does.
    pub fn kafka_unreachable(&self, why: Option<String>) -> Change {
        replace(&self.kafka_unreachable, why)
    }

    /// Why the group is not settled, or `None` once it is.
    pub fn group_unsettled(&self, why: Option<String>) -> Change {
        replace(&self.group_unsettled, why)
    }
}

fn replace(slot: &Mutex<Option<String>>, now: Option<String>) -> Change {
    let Ok(mut shown) = slot.lock() else {
        return Change::Same;
    };
    let change = match (&*shown, &now) {
        (None, Some(_)) => Change::Appeared,
        (Some(_), None) => Change::Cleared,
        _ => Change::Same,
    };
    *shown = now;
    change
}

/// What `/readyz` and `/healthz` read.
impl Health {
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
        if let Ok(Some(why)) = self.schema_registry_unavailable.lock().as_deref() {
            out.push(Cow::Owned(format!(
                "Schema Registry unavailable: {why}; being retried, the partition waits"
            )));
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

    /// Makes the last tick ancient, so a test can see the loop tick again
    /// (a paused tokio clock does not move the wall clock ticks record).
    #[cfg(test)]
    pub(crate) fn backdate_tick(&self) {
        self.last_tick_ms.store(1, Ordering::Relaxed);
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
        h.subscribed();
        h.mongodb_reachable(true);
        assert_eq!(
            h.readiness().unwrap_err(),
            "MongoDB writes failing: being retried"
        );
        h.write_succeeded();
        assert_eq!(h.readiness(), Ok(()));
        h.stalled_partitions(&["t/0 (3 records waiting unread)".into()]);
        assert_eq!(
            h.readiness().unwrap_err(),
            "Kafka partitions not being read: t/0 (3 records waiting unread)"
        );
        h.draining();
        assert_eq!(h.readiness().unwrap_err(), "draining: shutting down");
    }

    #[test]
    fn readiness_says_why_writes_fail_and_that_kafka_is_silent() {
        let h = Health::default();
        h.subscribed();
        h.mongodb_reachable(true);
        h.write_failed("MongoDB writes failing: an update exceeded its 30s time limit".into());
        assert_eq!(
            h.readiness().unwrap_err(),
            "MongoDB writes failing: an update exceeded its 30s time limit"
        );
        h.write_succeeded();
        assert_eq!(h.readiness(), Ok(()));
        h.kafka_unreachable(Some("no broker connection is up".into()));
        assert_eq!(
            h.readiness().unwrap_err(),
            "Kafka not answering: no broker connection is up"
        );
        assert_eq!(h.kafka_unreachable(None), Change::Cleared);
        assert_eq!(h.readiness(), Ok(()));
    }

    /// A broker connection that comes and goes must not hide a partition
    /// that cannot be read: every reason is said.
    #[test]
    fn readiness_says_every_reason_at_once() {
        let h = Health::default();
        h.subscribed();
        h.mongodb_reachable(true);
        h.write_succeeded();
        h.kafka_unreachable(Some("no broker connection is up".into()));
        h.stalled_partitions(&["t/0 (3 records waiting unread)".into()]);
        h.group_unsettled(Some("the consumer group has not settled".into()));
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
