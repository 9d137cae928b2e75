//! The clients' contexts: librdkafka's log lines and errors through
//! `tracing` with secrets removed (`ScrubbedLogs`), and the group
//! consumer's (`ConsumerCtx`): rebalance callbacks told to the loop as
//! [`GroupEvent`]s, the commit callback, and the statistics callback
//! (lag, stalls, readiness), which runs on librdkafka's own thread.

use std::collections::BTreeSet;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::producer::FutureProducer;
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::TopicPartitionList;

use crate::config::Settings;
use crate::health::{Change, Health};
use crate::metrics::{CommitResult, DelayStage, Metrics, RebalanceKind, TimeoutOperation};
use crate::offsets::TopicPartition;

use super::group::Settling;
use super::stall::{Observed, StallWatch};
use super::{timed_out, GroupEvent};

/// librdkafka's own log lines and client errors, through `tracing`, with
/// every secret of the settings removed: librdkafka quotes configuration
/// values in some of them (a failed `sasl.kerberos.kinit.cmd` is logged
/// whole, and that command line may carry a password).
#[derive(Clone, Default)]
pub struct ScrubbedLogs {
    scrubber: crate::config::Scrubber,
}

impl ScrubbedLogs {
    pub fn new(settings: &Settings) -> Self {
        ScrubbedLogs {
            scrubber: settings.scrubber(),
        }
    }

    fn log_line(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        let message = self.scrubber.scrub(message);
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(target: "librdkafka", facility, "{message}")
            }
            RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", facility, "{message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", facility, "{message}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", facility, "{message}"),
        }
    }

    fn client_error(&self, error: &KafkaError, reason: &str) {
        let text = self.scrubber.scrub(&format!("{error}: {reason}"));
        tracing::error!(target: "librdkafka", "{text}");
    }
}

impl ClientContext for ScrubbedLogs {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.log_line(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.client_error(&error, reason);
    }
}

/// Also the context of the clients that join no group (check-config, the
/// stall watcher's end offsets): no rebalance ever calls it.
impl ConsumerContext for ScrubbedLogs {}

/// The producer of the commands that send and exit (`dlq replay`,
/// `produce`); the worker's dead letters go through an [`AckedProducer`](super::AckedProducer).
pub type Producer = FutureProducer<ScrubbedLogs>;

pub struct ConsumerCtx {
    /// Where the rebalance callbacks report to the loop.
    events: Sender<GroupEvent>,
    /// The partitions this member owns, for the statistics callback's lag
    /// series only (it runs on librdkafka's own thread, not the loop's).
    owned: Mutex<BTreeSet<TopicPartition>>,
    /// Fetch progress of the owned partitions, for the stall watcher.
    stalls: Arc<Mutex<StallWatch>>,
    metrics: Metrics,
    logs: ScrubbedLogs,
    /// Where the statistics callback says whether Kafka answers
    /// (`Health::kafka_unreachable`, read by `/readyz`).
    health: Arc<Health>,
    /// How long the group has been rebalancing (`Health::group_unsettled`).
    settling: Mutex<Settling>,
    /// When the oldest offset commit not yet answered was asked for
    /// (`commit_asked`), for the `commit` stage of the delay metric.
    commit_asked_at: Mutex<Option<Instant>>,
}

impl ClientContext for ConsumerCtx {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.logs.log_line(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if timed_out(&error) {
            self.metrics.timeout(TimeoutOperation::KafkaRequest).inc();
        }
        self.logs.client_error(&error, reason);
    }

    fn stats(&self, stats: Statistics) {
        self.judge_link(&stats);
        self.judge_group(&stats);
        // Only partitions this member owns: a partition handed to another
        // member is reported there, and a stale series here would make a
        // group-wide sum of lag wrong.
        let assigned = match self.owned.lock() {
            Ok(owned) => owned.clone(),
            Err(_) => return,
        };
        self.metrics
            .source_partitions
            .set(source_partitions(&stats) as i64);
        for (topic, t) in &stats.topics {
            for (partition, p) in &t.partitions {
                // -1 is librdkafka's "unknown" (and the internal UA partition).
                if *partition < 0 {
                    continue;
                }
                let label = partition.to_string();
                let tp = (topic.as_str().into(), *partition);
                if assigned.contains(&tp) {
                    self.observe(&tp, p);
                    if p.consumer_lag >= 0 {
                        self.metrics
                            .consumer_lag
                            .with_label_values(&[topic.as_str(), &label])
                            .set(p.consumer_lag);
                    }
                } else {
                    self.forget_lag(topic, *partition);
                }
            }
        }
    }
}

impl ConsumerCtx {
    /// The context of the group consumer: tells `events` of rebalances and
    /// `stalls` of fetch progress.
    pub fn new(
        settings: &Settings,
        events: Sender<GroupEvent>,
        stalls: Arc<Mutex<StallWatch>>,
        metrics: Metrics,
        health: Arc<Health>,
    ) -> Self {
        let limit = Settling::limit(
            settings.kafka.max_poll_interval,
            settings.kafka.session_timeout,
        );
        ConsumerCtx {
            events,
            owned: Mutex::new(BTreeSet::new()),
            stalls,
            metrics,
            logs: ScrubbedLogs::new(settings),
            health,
            settling: Mutex::new(Settling::new(limit)),
            commit_asked_at: Mutex::new(None),
        }
    }

    /// An asynchronous offset commit was asked for. Commits go out one
    /// after another and each supersedes the last, so the delay that
    /// matters is from the oldest unanswered one to the next answer: that
    /// is how far the committed offsets trail the handled ones. (One
    /// instant rather than a queue of them: a commit answered without
    /// having been counted here, such as the revoke callback's, cannot
    /// shift every later measurement.)
    pub fn commit_asked(&self) {
        if let Ok(mut at) = self.commit_asked_at.lock() {
            at.get_or_insert_with(Instant::now);
        }
    }

    /// The coordinator answered a commit: the `commit` stage's delay.
    fn commit_answered(&self) {
        let asked = self
            .commit_asked_at
            .lock()
            .ok()
            .and_then(|mut at| at.take());
        if let Some(asked) = asked {
            self.metrics
                .stage_delay(DelayStage::Commit)
                .observe(asked.elapsed().as_secs_f64());
        }
    }

    /// Sets `Health::kafka_unreachable` from one statistics report, and
    /// logs when that changes.
    fn judge_link(&self, stats: &Statistics) {
        let brokers = stats
            .brokers
            .values()
            .map(|b| (b.name.as_str(), b.source.as_str(), b.state.as_str()));
        let failure = link_failure(brokers, stats.cgrp.as_ref().map(|g| g.state.as_str()));
        let said = ("Kafka not answering: not ready", "Kafka answering again");
        show(
            self.health.kafka_unreachable(failure.clone()),
            failure,
            said,
        );
    }

    /// Sets `Health::group_unsettled` from one statistics report, and logs
    /// when that changes.
    fn judge_group(&self, stats: &Statistics) {
        let Some(cgrp) = stats.cgrp.as_ref() else {
            return;
        };
        let Ok(mut settling) = self.settling.lock() else {
            return;
        };
        let failure = settling.observe(&cgrp.join_state, Instant::now());
        let said = (
            "consumer group stuck: not ready",
            "consumer group settled again",
        );
        show(self.health.group_unsettled(failure.clone()), failure, said);
    }

    fn observe(&self, tp: &TopicPartition, p: &rdkafka::statistics::Partition) {
        let seen = Observed {
            next: p.next_offset,
            queued: p.fetchq_cnt,
        };
        if let Ok(mut stalls) = self.stalls.lock() {
            stalls.observe(tp, seen, Instant::now());
        }
    }

    /// Records an assignment change for the lag series, the gauge and the
    /// stall watcher, and tells the loop.
    fn changed(&self, event: GroupEvent) {
        if let Ok(mut owned) = self.owned.lock() {
            match &event {
                GroupEvent::Assigned(tps) => owned.extend(tps.iter().cloned()),
                GroupEvent::Revoked(tps) => tps.iter().for_each(|tp| {
                    owned.remove(tp);
                }),
            }
            self.metrics.assigned_partitions.set(owned.len() as i64);
            if let Ok(mut stalls) = self.stalls.lock() {
                stalls.retain(|tp| owned.contains(tp));
            }
        }
        // The receiver is gone only when the loop has ended.
        let _ = self.events.send(event);
    }

    fn forget_lag(&self, topic: &str, partition: i32) {
        // Err only means the series did not exist.
        let _ = self
            .metrics
            .consumer_lag
            .remove_label_values(&[topic, &partition.to_string()]);
    }
}

/// The partitions of the topics the statistics list (the consumer's
/// source topics), `-1` (librdkafka's unknown and internal partition)
/// left out.
fn source_partitions(stats: &Statistics) -> usize {
    stats
        .topics
        .values()
        .map(|t| t.partitions.keys().filter(|&&p| p >= 0).count())
        .sum()
}

/// Logs a readiness reason set by the statistics when it appears
/// (`said.0`, with the reason) and when it goes (`said.1`).
fn show(change: Change, failure: Option<String>, said: (&str, &str)) {
    match (change, failure) {
        (Change::Appeared, Some(why)) => tracing::warn!(reason = %why, "{}", said.0),
        (Change::Cleared, _) => tracing::info!("{}", said.1),
        _ => {}
    }
}

fn partitions(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().into(), e.partition()))
        .collect()
}

impl ConsumerContext for ConsumerCtx {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            // Hand over cleanly: commit the stored (durably handled) offsets
            // now, so the next owner starts right after them.
            if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
                // "No offset stored" is the normal case after a commit.
                tracing::debug!(error = %e, "commit on revoke");
            }
            let revoked = partitions(tpl);
            tracing::info!(partitions = ?revoked, "partitions revoked");
            self.metrics.rebalance(RebalanceKind::Revoked).inc();
            for (topic, partition) in &revoked {
                self.forget_lag(topic, *partition);
            }
            self.changed(GroupEvent::Revoked(revoked));
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let assigned = partitions(tpl);
                tracing::info!(partitions = ?assigned, "partitions assigned");
                self.metrics.rebalance(RebalanceKind::Assigned).inc();
                self.changed(GroupEvent::Assigned(assigned));
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        self.commit_answered();
        match result {
            Ok(()) => self.metrics.commit(CommitResult::Ok).inc(),
            // Nothing stored was new: nothing to commit, nothing failed.
            Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                self.metrics.commit(CommitResult::Error).inc();
                tracing::warn!(error = %e, "offset commit failed; the next commit supersedes it");
            }
        }
    }
}

/// Why Kafka does not answer, from librdkafka's statistics: no connection
/// to a real broker is up (`brokers`: name, source, state; librdkafka's
/// logical and internal entries are not connections), or the consumer
/// group has no working coordinator (`group_state` other than "up").
/// `None` when both are well. A broker that stops answering keeps its
/// connection "UP" until a request exceeds `timeouts.kafka_request`;
/// librdkafka then disconnects, and its reconnection hangs the same way.
pub fn link_failure<'a>(
    brokers: impl Iterator<Item = (&'a str, &'a str, &'a str)>,
    group_state: Option<&str>,
) -> Option<String> {
    let mut real: Vec<(&str, &str)> = brokers
        .filter(|(_, source, _)| matches!(*source, "configured" | "learned"))
        .map(|(name, _, state)| (name, state))
        .collect();
    real.sort_unstable();
    if !real.is_empty() && !real.iter().any(|(_, state)| *state == "UP") {
        let states: Vec<String> = real.iter().map(|(n, s)| format!("{n}: {s}")).collect();
        return Some(format!(
            "no broker connection is up ({})",
            states.join(", ")
        ));
    }
    match group_state {
        Some(state) if state != "up" => {
            Some(format!("consumer group coordinator state \"{state}\""))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kafka::clients::tests::settings_with;

    #[test]
    fn kafka_is_unreachable_when_no_real_broker_is_up_or_the_group_has_no_coordinator() {
        let up = [
            ("127.0.0.1:9092/bootstrap", "configured", "INIT"),
            ("127.0.0.1:9092/1", "learned", "UP"),
            ("GroupCoordinator", "logical", "UP"),
        ];
        assert_eq!(link_failure(up.into_iter(), Some("up")), None);
        let hung = [
            ("127.0.0.1:9092/1", "learned", "APIVERSION_QUERY"),
            ("GroupCoordinator", "logical", "UP"),
            (":0/internal", "internal", "UP"),
        ];
        assert_eq!(
            link_failure(hung.into_iter(), Some("up")).as_deref(),
            Some("no broker connection is up (127.0.0.1:9092/1: APIVERSION_QUERY)")
        );
        let lost = [("127.0.0.1:9092/1", "learned", "UP")];
        assert_eq!(
            link_failure(lost.into_iter(), Some("wait-coord")).as_deref(),
            Some("consumer group coordinator state \"wait-coord\"")
        );
        assert_eq!(
            link_failure(lost.into_iter(), None),
            None,
            "a producer has no group"
        );
    }

    /// librdkafka logs a failed `sasl.kerberos.kinit.cmd` whole, and a
    /// command line can carry a password: its log lines reach `tracing`
    /// only scrubbed.
    #[test]
    fn librdkafka_log_lines_never_carry_a_secret() {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::DEBUG)
            .finish();
        let s = settings_with(&[("sasl.kerberos.kinit.cmd", "kinit --password=Se5cret-value")]);
        let logs = ScrubbedLogs::new(&s);
        tracing::subscriber::with_default(subscriber, || {
            logs.log(
                RDKafkaLogLevel::Warning,
                "SASLREFRESH",
                "Kerberos ticket refresh failed: kinit --password=Se5cret-value: exit 1",
            );
            logs.error(
                KafkaError::ClientCreation("kinit --password=Se5cret-value".into()),
                "refresh",
            );
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        assert!(text.contains("Kerberos ticket refresh failed"), "{text}");
        assert!(!text.contains("Se5cret-value"), "{text}");
    }
}
