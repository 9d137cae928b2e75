//! The loop's timing and ordering rules on a paused clock, with in-memory
//! stand-ins for the consumer, the bucket writer and the dead-letter
//! producer (see `seams`). Time only moves when every task waits, and then
//! straight to the next timer, so the times asserted here are exact.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::seams::{BucketSink, Commit, ConsumerError, DeadLetterSink, Intake, Record, SendError};
use super::{PipelineError, Worker};
use crate::bucket::plan::Room;
use crate::bucket::store::StoreError;
use crate::bucket::writer::{Events, Outcome, WriteStats};
use crate::config::Settings;
use crate::health::Health;
use crate::kafka::{DeadLetter, GroupEvent};
use crate::metrics::{ConsumerErrorKind, DelayStage, Metrics};
use crate::offsets::TopicPartition;

const LINGER: Duration = Duration::from_millis(50);
const DRAIN: Duration = Duration::from_secs(5);

/// What the stand-ins saw, with the paused clock's time of each call.
#[derive(Default)]
struct Seen {
    /// Each write attempt: when, and the offsets of its events.
    writes: Vec<(Duration, Vec<i64>)>,
    /// Each commit that named offsets (or was `Sync`): when, what, how.
    commits: Vec<Committed>,
    /// Each dead-letter send attempt: when, and the source offset.
    dead_letters: Vec<(Duration, i64)>,
    /// Each pause (`true`) and resume: when, which partitions.
    pauses: Vec<(Duration, Vec<TopicPartition>, bool)>,
    /// Calls of `recv`: the consumer being polled.
    polls: usize,
    /// Calls of `recv` while paused (what keeps a held member in its group).
    polls_paused: usize,
    left: bool,
    /// Each write attempt's `hold`.
    holds: Vec<Option<usize>>,
    /// Offsets the bucket writer holds, each the first time a write lets
    /// it (as often as it is listed).
    to_hold: Vec<i64>,
    /// What the bucket writer says a held trade's bucket takes (by
    /// default nothing: the stage then holds no trade unplanned).
    room: Room,
}

type Shared = Arc<Mutex<Seen>>;

/// When a commit was made, the offsets it named, and how.
type Committed = (Duration, Vec<(TopicPartition, i64)>, Commit);

/// A consumer error of this class.
fn consumer_error(kind: ConsumerErrorKind) -> ConsumerError {
    ConsumerError {
        kind,
        message: format!("a {} error", kind.as_str()),
    }
}

struct FakeIntake {
    records: UnboundedReceiver<Result<Record, ConsumerError>>,
    /// Records of a partition assigned but not yet paused: delivered even
    /// while the consumer is paused.
    strays: UnboundedReceiver<Result<Record, ConsumerError>>,
    events: Arc<Mutex<Vec<GroupEvent>>>,
    seen: Shared,
    start: Instant,
    paused: bool,
}

impl Intake for FakeIntake {
    async fn recv(&mut self) -> Result<Record, ConsumerError> {
        {
            let mut seen = self.seen.lock().unwrap();
            seen.polls += 1;
            seen.polls_paused += usize::from(self.paused);
        }
        if self.paused {
            // librdkafka delivers nothing of a paused partition (it drops
            // what it had queued and fetches it again on resume); only a
            // partition not paused yet can.
            return match self.strays.recv().await {
                Some(r) => r,
                None => std::future::pending().await,
            };
        }
        match self.records.recv().await {
            Some(r) => r,
            None => std::future::pending().await,
        }
    }

    fn group_events(&mut self) -> Vec<GroupEvent> {
        std::mem::take(&mut *self.events.lock().unwrap())
    }

    fn commit(&mut self, offsets: &[(TopicPartition, i64)], mode: Commit) {
        if !offsets.is_empty() || mode == Commit::Sync {
            let at = self.start.elapsed();
            let mut seen = self.seen.lock().unwrap();
            seen.commits.push((at, offsets.to_vec(), mode));
        }
    }

    fn pause(&mut self, tps: &[TopicPartition]) {
        self.paused = true;
        let at = self.start.elapsed();
        self.seen
            .lock()
            .unwrap()
            .pauses
            .push((at, tps.to_vec(), true));
    }

    fn resume(&mut self, tps: &[TopicPartition]) {
        self.paused = false;
        let at = self.start.elapsed();
        self.seen
            .lock()
            .unwrap()
            .pauses
            .push((at, tps.to_vec(), false));
    }

    fn leave(&mut self) {
        self.seen.lock().unwrap().left = true;
    }
}

/// Fails its first `failures` writes, and takes `delay` for each.
struct FakeBuckets {
    failures: usize,
    delay: Duration,
    seen: Shared,
    start: Instant,
}

impl BucketSink for FakeBuckets {
    async fn write(
        &mut self,
        events: Events<'_>,
        outcomes: &mut [Outcome],
        hold: Option<usize>,
    ) -> Result<WriteStats, StoreError> {
        // What it is asked to write: not what the stage holds unplanned.
        let offsets = events
            .iter()
            .zip(outcomes.iter())
            .filter(|(_, o)| !o.is_final())
            .map(|((_, s), _)| s.offset)
            .collect();
        let at = self.start.elapsed();
        {
            let mut seen = self.seen.lock().unwrap();
            seen.writes.push((at, offsets));
            seen.holds.push(hold);
        }
        tokio::time::sleep(self.delay).await;
        if self.failures > 0 {
            self.failures -= 1;
            return Err(StoreError::Failed("down".into()));
        }
        let mut seen = self.seen.lock().unwrap();
        let seen = &mut *seen;
        let (to_hold, room) = (&mut seen.to_hold, seen.room);
        let pending = outcomes.iter_mut().zip(events.iter()).enumerate();
        for (j, (o, (_, source))) in pending.filter(|(_, (o, _))| !o.is_final()) {
            let at = to_hold.iter().position(|&o| o == source.offset);
            let held = hold.is_some_and(|from| j >= from) && at.is_some();
            if let (true, Some(at)) = (held, at) {
                to_hold.remove(at);
            }
            *o = if held {
                Outcome::Held(room)
            } else {
                Outcome::Written
            };
        }
        Ok(WriteStats::default())
    }

    fn forget_all(&mut self) {}
}

/// Fails the first `failures` sends, and refuses for its size any dead
/// letter with a payload over `max_payload` bytes.
struct FakeDeadLetters {
    failures: Mutex<usize>,
    max_payload: usize,
    seen: Shared,
    start: Instant,
}

impl DeadLetterSink for FakeDeadLetters {
    async fn send(&self, dead: &DeadLetter) -> Result<(), SendError> {
        let at = self.start.elapsed();
        self.seen
            .lock()
            .unwrap()
            .dead_letters
            .push((at, dead.source.offset));
        if dead.payload.as_ref().map_or(0, Vec::len) > self.max_payload {
            return Err(SendError::TooLarge("Broker: Message size too large".into()));
        }
        let mut failures = self.failures.lock().unwrap();
        if *failures > 0 {
            *failures -= 1;
            return Err(SendError::Failed("Operation canceled".into()));
        }
        Ok(())
    }
}

/// A worker over the stand-ins, running on its own task.
struct Harness {
    records: UnboundedSender<Result<Record, ConsumerError>>,
    strays: UnboundedSender<Result<Record, ConsumerError>>,
    events: Arc<Mutex<Vec<GroupEvent>>>,
    seen: Shared,
    health: Arc<Health>,
    shutdown: CancellationToken,
    handle: tokio::task::JoinHandle<Result<(), PipelineError>>,
    start: Instant,
    metrics: Metrics,
}

#[derive(Default)]
struct Options {
    write_failures: usize,
    write_delay: Duration,
    dead_letter_failures: usize,
    max_events: Option<usize>,
    max_bytes: Option<usize>,
    max_in_flight: Option<usize>,
    dead_letter_max_payload: Option<usize>,
    /// `rate_limit.events_per_second`.
    rate_limit: Option<u64>,
    /// `kafka.max_poll_interval` (the hold's grace is a quarter of it at
    /// most).
    max_poll_interval: Option<Duration>,
    /// `batch.hold_trades` and `batch.hold_max_age`.
    hold_trades: Option<usize>,
    hold_max_age: Option<Duration>,
}

fn settings(max_events: Option<usize>, max_bytes: Option<usize>) -> Settings {
    let mut s = Settings::load_from(None, Some(BTreeMap::new())).unwrap();
    s.batch.linger = LINGER;
    s.shutdown.drain_timeout = DRAIN;
    s.retry.initial_interval = Duration::from_millis(100);
    s.retry.max_interval = Duration::from_secs(1);
    s.retry.multiplier = 2.0;
    s.retry.randomization_factor = 0.0;
    if let Some(n) = max_events {
        s.batch.max_events = n;
    }
    if let Some(n) = max_bytes {
        s.batch.max_bytes = n;
    }
    s
}

impl Harness {
    fn start(o: Options, assigned: &[i32]) -> Harness {
        let start = Instant::now();
        let seen = Shared::default();
        let (records, rx) = unbounded_channel();
        let (strays, strays_rx) = unbounded_channel();
        let tps = assigned.iter().map(|&p| tp(p)).collect();
        let events = Arc::new(Mutex::new(vec![GroupEvent::Assigned(tps)]));
        let intake = FakeIntake {
            records: rx,
            strays: strays_rx,
            events: events.clone(),
            seen: seen.clone(),
            start,
            paused: false,
        };
        let buckets = FakeBuckets {
            failures: o.write_failures,
            delay: o.write_delay,
            seen: seen.clone(),
            start,
        };
        let dead_letters = FakeDeadLetters {
            failures: Mutex::new(o.dead_letter_failures),
            max_payload: o.dead_letter_max_payload.unwrap_or(usize::MAX),
            seen: seen.clone(),
            start,
        };
        let health = Arc::new(Health::default());
        health.subscribed();
        health.mongodb_reachable(true);
        let mut settings = settings(o.max_events, o.max_bytes);
        if let Some(n) = o.max_in_flight {
            settings.batch.max_in_flight = n;
        }
        if let Some(n) = o.rate_limit {
            settings.rate_limit.events_per_second = n;
        }
        if let Some(d) = o.max_poll_interval {
            settings.kafka.max_poll_interval = d;
        }
        if let Some(n) = o.hold_trades {
            settings.batch.hold_trades = n;
        }
        if let Some(d) = o.hold_max_age {
            settings.batch.hold_max_age = d;
        }
        let metrics = Metrics::new();
        let worker = Worker::new(
            settings,
            (crate::event::Mappings::default(), Default::default()),
            intake,
            buckets,
            dead_letters,
            metrics.clone(),
            health.clone(),
        );
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(worker.run(shutdown.clone()));
        Harness {
            records,
            strays,
            events,
            seen,
            health,
            shutdown,
            handle,
            start,
            metrics,
        }
    }

    fn send(&self, partition: i32, offsets: impl IntoIterator<Item = i64>, valid: bool) {
        for offset in offsets {
            self.records
                .send(Ok(record(partition, offset, valid)))
                .unwrap();
        }
    }

    /// Valid trades: each an offset and its customer's JSON.
    fn send_of<'a>(&self, partition: i32, trades: impl IntoIterator<Item = (i64, &'a str)>) {
        for (offset, customer) in trades {
            let record = trade_record(partition, offset, customer);
            self.records.send(Ok(record)).unwrap();
        }
    }

    /// Records delivered while the consumer is paused, as a partition
    /// assigned but not yet paused delivers them.
    fn send_stray(&self, partition: i32, offsets: impl IntoIterator<Item = i64>) {
        for offset in offsets {
            self.strays
                .send(Ok(record(partition, offset, true)))
                .unwrap();
        }
    }

    /// The writer holds each of these offsets the first time a write lets
    /// it.
    fn hold(&self, offsets: impl IntoIterator<Item = i64>) {
        self.seen.lock().unwrap().to_hold = offsets.into_iter().collect();
    }

    /// The writer says a held trade's bucket takes `room`.
    fn room(&self, room: Room) {
        self.seen.lock().unwrap().room = room;
    }

    fn holds(&self) -> Vec<Option<usize>> {
        self.seen.lock().unwrap().holds.clone()
    }

    fn group_event(&self, event: GroupEvent) {
        self.events.lock().unwrap().push(event);
    }

    /// Lets the worker run until `at` (since the start) on the paused clock.
    async fn until(&self, at: Duration) {
        tokio::time::sleep_until(self.start + at).await;
    }

    fn writes(&self) -> Vec<(Duration, Vec<i64>)> {
        self.seen.lock().unwrap().writes.clone()
    }

    fn commits(&self) -> Vec<Committed> {
        self.seen.lock().unwrap().commits.clone()
    }

    async fn stop(self) -> Shared {
        self.shutdown.cancel();
        self.handle.await.unwrap().expect("a clean stop");
        self.seen
    }
}

fn tp(partition: i32) -> TopicPartition {
    ("trades".into(), partition)
}

fn record(partition: i32, offset: i64, valid: bool) -> Record {
    if valid {
        return trade_record(partition, offset, "7");
    }
    Record {
        payload: Some(b"not json".to_vec()),
        ..trade_record(partition, offset, "7")
    }
}

/// A valid trade of `customer` (its JSON: `7` or `"7"`).
fn trade_record(partition: i32, offset: i64, customer: &str) -> Record {
    let payload = format!(
        r#"{{"tradeId":"T-{partition}-{offset}","customerId":{customer},"type":"buy","ticker":"MDB","qty":1,"date":"2023-10-26T15:47:03.434Z"}}"#
    );
    Record {
        tp: tp(partition),
        offset,
        key: None,
        payload: Some(payload.into_bytes()),
        headers: Vec::new(),
        timestamp_ms: None,
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A light load: a batch closes as soon as the consumer has nothing more
/// queued, with no fixed wait, and what comes while it is written forms
/// the next one.
#[tokio::test(start_paused = true)]
async fn a_light_load_batch_closes_as_soon_as_nothing_is_queued() {
    let h = Harness::start(
        Options {
            write_delay: ms(30),
            ..Options::default()
        },
        &[0],
    );
    h.send(0, 0..3, true);
    h.until(ms(1)).await;
    assert_eq!(h.writes(), vec![(ms(0), vec![0, 1, 2])], "written at once");
    // Two arrive while the first batch is written: they wait for it.
    h.send(0, [3], true);
    h.until(ms(10)).await;
    h.send(0, [4], true);
    h.until(ms(100)).await;
    assert_eq!(h.writes()[1], (ms(30), vec![3, 4]));
    h.stop().await;
}

/// A backlog: batches fill to their bound while the previous one is
/// written.
#[tokio::test(start_paused = true)]
async fn under_a_backlog_batches_fill_to_their_bound() {
    let h = Harness::start(
        Options {
            max_events: Some(4),
            ..Options::default()
        },
        &[0],
    );
    h.send(0, 0..10, true);
    h.until(ms(10)).await;
    let writes: Vec<Vec<i64>> = h.writes().into_iter().map(|w| w.1).collect();
    assert_eq!(writes, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_write_is_retried_with_backoff_and_not_committed_until_it_succeeds() {
    let h = Harness::start(
        Options {
            write_failures: 3,
            ..Options::default()
        },
        &[0],
    );
    h.send(0, 0..5, true);
    h.until(ms(300)).await;
    assert!(h.commits().is_empty(), "no commit while the write fails");
    assert_eq!(
        h.health.readiness().unwrap_err(),
        "MongoDB writes failing: being retried"
    );
    h.until(ms(1000)).await;
    let attempts: Vec<Duration> = h.writes().iter().map(|w| w.0).collect();
    // At once, then after waits of 100, 200 and 400 ms (no jitter here).
    assert_eq!(attempts, vec![ms(0), ms(100), ms(300), ms(700)]);
    assert_eq!(
        h.commits(),
        vec![(ms(700), vec![(tp(0), 5)], Commit::Async)],
        "one commit, after the successful attempt, of the next offset to read"
    );
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn commits_wait_for_dead_letters_and_name_the_contiguous_prefix() {
    let h = Harness::start(
        Options {
            dead_letter_failures: 2,
            ..Options::default()
        },
        &[0, 1],
    );
    h.send(0, 0..2, true);
    h.send(0, [2], false);
    h.send(0, [3], true);
    h.send(1, 0..2, true);
    h.until(ms(300)).await;
    assert!(
        h.commits().is_empty(),
        "nothing is committed while a dead letter of the batch is unacknowledged"
    );
    assert_eq!(
        h.health.readiness().unwrap_err(),
        "the dead-letter topic refuses writes: being retried, the partition waits"
    );
    h.until(ms(1000)).await;
    let dead: Vec<(Duration, i64)> = h.seen.lock().unwrap().dead_letters.clone();
    assert_eq!(dead, vec![(ms(0), 2), (ms(100), 2), (ms(300), 2)]);
    assert_eq!(
        h.commits(),
        vec![(ms(300), vec![(tp(0), 4), (tp(1), 2)], Commit::Async)]
    );

    // A later batch moves each partition on from where it was.
    h.send(1, [2], true);
    h.until(ms(2000)).await;
    assert_eq!(h.commits()[1], (ms(1000), vec![(tp(1), 3)], Commit::Async));
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_revoked_partition_is_written_but_committed_only_by_its_owner() {
    let h = Harness::start(Options::default(), &[0, 1]);
    h.send(0, 0..2, true);
    h.send(1, 0..2, true);
    h.events
        .lock()
        .unwrap()
        .push(GroupEvent::Revoked(vec![tp(1)]));
    h.until(ms(100)).await;
    assert_eq!(h.writes(), vec![(ms(0), vec![0, 1, 0, 1])]);
    assert_eq!(h.commits(), vec![(ms(0), vec![(tp(0), 2)], Commit::Async)]);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn drain_abandons_a_stuck_batch_at_its_deadline_without_committing_it() {
    let h = Harness::start(
        Options {
            write_delay: Duration::from_secs(3600),
            ..Options::default()
        },
        &[0],
    );
    h.send(0, 0..3, true);
    h.until(ms(1000)).await;
    assert_eq!(h.writes().len(), 1, "the batch is being written");
    h.shutdown.cancel();
    let cancelled = Instant::now();
    let seen = h.stop().await;
    assert_eq!(
        cancelled.elapsed(),
        DRAIN,
        "stopped exactly at the drain deadline"
    );
    let seen = seen.lock().unwrap();
    assert!(seen.left, "left the group");
    assert_eq!(
        seen.commits,
        vec![(ms(1000) + DRAIN, vec![], Commit::Sync)],
        "only the final commit, with nothing of the abandoned batch"
    );
}

#[tokio::test(start_paused = true)]
async fn a_batch_finishing_within_the_drain_is_committed_at_shutdown() {
    let h = Harness::start(
        Options {
            write_delay: Duration::from_secs(2),
            ..Options::default()
        },
        &[0],
    );
    h.send(0, 0..3, true);
    h.until(ms(1000)).await;
    h.shutdown.cancel();
    let seen = h.stop().await;
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.commits,
        vec![
            (ms(2000), vec![(tp(0), 3)], Commit::Async),
            (ms(2000), vec![], Commit::Sync),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn the_batch_bound_counts_keys_and_headers_not_just_payloads() {
    let h = Harness::start(
        Options {
            max_bytes: Some(4096),
            ..Options::default()
        },
        &[0],
    );
    // Payloads of about 120 bytes, each record carrying 2 KiB of headers and
    // a key: two records reach the bound, and the batch closes at once.
    for offset in 0..5 {
        let mut r = record(0, offset, true);
        r.key = Some(smallvec::smallvec![b'k'; 64]);
        r.headers = vec![(b"trace".to_vec(), Some(vec![b'x'; 2048]))];
        h.records.send(Ok(r)).unwrap();
    }
    h.until(ms(10)).await;
    assert_eq!(
        h.writes(),
        vec![(ms(0), vec![0, 1]), (ms(0), vec![2, 3]), (ms(0), vec![4])],
        "full batches, then the rest"
    );
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_dead_letter_too_large_for_its_topic_goes_shortened_at_once() {
    let h = Harness::start(
        Options {
            dead_letter_max_payload: Some(2048),
            ..Options::default()
        },
        &[0],
    );
    let mut big = record(0, 0, false);
    big.payload = Some(vec![b'x'; 10_000]);
    h.records.send(Ok(big)).unwrap();
    h.send(0, [1], true);
    h.until(ms(100)).await;
    let dead = h.seen.lock().unwrap().dead_letters.clone();
    assert_eq!(
        dead,
        vec![(ms(0), 0), (ms(0), 0)],
        "refused for its size, then sent shortened without waiting"
    );
    assert_eq!(h.commits(), vec![(ms(0), vec![(tp(0), 2)], Commit::Async)]);
    assert_eq!(h.health.readiness(), Ok(()));
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_fatal_consumer_error_ends_the_loop_with_an_error_after_the_batch_in_hand() {
    let h = Harness::start(Options::default(), &[0]);
    h.send(0, 0..2, true);
    // A transient one is counted and the loop goes on.
    let transient = consumer_error(ConsumerErrorKind::Transport);
    h.records.send(Err(transient)).unwrap();
    h.until(ms(100)).await;
    assert_eq!(h.commits().len(), 1);
    h.send(0, [2], true);
    let fatal = consumer_error(ConsumerErrorKind::Fatal);
    h.records.send(Err(fatal)).unwrap();
    let result = h.handle.await.unwrap();
    assert!(
        matches!(result, Err(PipelineError::FatalConsumer(_))),
        "{result:?}"
    );
    let seen = h.seen.lock().unwrap();
    assert_eq!(seen.writes.last().map(|w| w.1.clone()), Some(vec![2]));
    assert_eq!(
        seen.commits[seen.commits.len() - 2..],
        [
            (ms(100), vec![(tp(0), 3)], Commit::Async),
            (ms(100), vec![], Commit::Sync)
        ],
        "the batch in hand is written and committed before the exit"
    );
    assert!(seen.left);
}

/// librdkafka skips a record it cannot read (a failed CRC, an unknown
/// record format) and reports it without a partition: records read before
/// the report commit, nothing read after it does, and readiness says so.
#[tokio::test(start_paused = true)]
async fn records_the_client_skipped_stop_every_commit_past_them() {
    let h = Harness::start(Options::default(), &[0, 1]);
    h.send(0, 0..3, true);
    let skipped = consumer_error(ConsumerErrorKind::SkippedRecords);
    h.records.send(Err(skipped)).unwrap();
    h.send(0, 4..6, true);
    h.send(1, 0..2, true);
    h.until(ms(500)).await;
    let written: Vec<i64> = h.writes().into_iter().flat_map(|w| w.1).collect();
    assert_eq!(written.len(), 7, "writing goes on: {written:?}");
    let committed: Vec<_> = h.commits().into_iter().flat_map(|c| c.1).collect();
    assert_eq!(
        committed,
        vec![(tp(0), 3)],
        "only what came before the report"
    );
    assert_eq!(
        h.health.readiness().unwrap_err(),
        "the Kafka client skipped records it could not read: offsets are no longer committed"
    );
    h.stop().await;
}

/// A long batch write is not a wedged loop: liveness ticks while it runs.
#[tokio::test(start_paused = true)]
async fn liveness_ticks_while_a_batch_is_written() {
    let h = Harness::start(
        Options {
            write_delay: Duration::from_secs(600),
            ..Options::default()
        },
        &[0],
    );
    h.send(0, 0..3, true);
    h.until(ms(500)).await;
    assert_eq!(h.writes().len(), 1, "the write is under way");
    // The paused clock does not move the wall clock the tick records, so
    // make the tick stale and look for a fresh one.
    let stall = Duration::from_secs(60);
    h.health.backdate_tick();
    assert!(h.health.liveness(stall).is_err());
    h.until(Duration::from_secs(5)).await;
    assert!(h.commits().is_empty(), "still writing");
    assert!(h.health.liveness(stall).is_ok(), "the loop ticked");
    h.stop().await;
}

/// Two batches in flight: the second is filled, closed (full) and decoded
/// while the first is written, and each commit names only what its own
/// batch completed, in order: a closed batch is not a handled one.
#[tokio::test(start_paused = true)]
async fn commits_follow_the_batches_in_order_with_two_in_flight() {
    let h = Harness::start(
        Options {
            write_delay: ms(100),
            max_events: Some(3),
            ..Options::default()
        },
        &[0],
    );
    h.send(0, 0..3, true);
    h.until(ms(10)).await;
    h.send(0, 3..6, true); // consumed and closed while the first is written
    h.until(ms(150)).await;
    assert_eq!(
        h.commits(),
        vec![(ms(100), vec![(tp(0), 3)], Commit::Async)],
        "the first batch commits up to its own end, not past the second's records"
    );
    h.until(ms(300)).await;
    assert_eq!(
        h.writes(),
        vec![(ms(0), vec![0, 1, 2]), (ms(100), vec![3, 4, 5])]
    );
    assert_eq!(h.commits()[1], (ms(200), vec![(tp(0), 6)], Commit::Async));
    h.stop().await;
}

/// Each stage of an event's delay is timed on its own: batching from the
/// first record taken to the batch closed, queued from closed to the
/// stage taking it, writing the stage's work; in Kafka per record, from
/// its timestamp.
#[tokio::test(start_paused = true)]
async fn the_delay_is_split_by_stage() {
    let h = Harness::start(
        Options {
            write_delay: ms(100),
            max_events: Some(3),
            ..Options::default()
        },
        &[0],
    );
    h.send(0, 0..3, true); // closed at once, written 0 to 100 ms
    h.until(ms(10)).await;
    h.send(0, 3..5, true); // taken, but the stage is busy: the batch stays open
    h.until(ms(30)).await;
    let mut late = record(0, 5, true);
    late.timestamp_ms = Some(crate::health::now_ms() as i64 - 5_000);
    h.records.send(Ok(late)).unwrap(); // fills it: closed at 30 ms
    h.until(ms(250)).await;
    let stage = |s: DelayStage| {
        let h = h.metrics.stage_delay(s);
        (h.get_sample_count(), h.get_sample_sum())
    };
    assert_eq!(stage(DelayStage::Batching), (2, 0.020), "0 and 20 ms");
    assert_eq!(stage(DelayStage::Queued), (2, 0.070), "0 and 70 ms");
    assert_eq!(stage(DelayStage::Writing), (2, 0.200), "100 ms each");
    assert_eq!(stage(DelayStage::Decode).0, 2);
    let (count, sum) = stage(DelayStage::InKafka);
    assert_eq!(count, 1, "only the record with a timestamp");
    assert!((5.0..6.0).contains(&sum), "{sum}");
    h.stop().await;
}

/// A partition revoked while its records are being written: the write
/// finishes (a delivered record is never dropped), and only the partitions
/// still ours are committed.
#[tokio::test(start_paused = true)]
async fn a_partition_revoked_during_its_write_is_written_and_not_committed() {
    let h = Harness::start(
        Options {
            write_delay: ms(100),
            ..Options::default()
        },
        &[0, 1],
    );
    h.send(0, 0..2, true);
    h.send(1, 0..2, true);
    h.until(ms(10)).await;
    assert_eq!(h.writes(), vec![(ms(0), vec![0, 1, 0, 1])], "being written");
    h.events
        .lock()
        .unwrap()
        .push(GroupEvent::Revoked(vec![tp(1)]));
    h.until(ms(200)).await;
    assert_eq!(h.writes().len(), 1, "written once, to the end");
    assert_eq!(
        h.commits(),
        vec![(ms(100), vec![(tp(0), 2)], Commit::Async)]
    );
    h.stop().await;
}

/// At the in-flight bound the loop takes no more records; once that has
/// lasted the grace it pauses the partitions and keeps polling the
/// consumer (a long outage costs no rebalance); it resumes when a batch
/// is done.
#[tokio::test(start_paused = true)]
async fn backpressure_at_the_bound_pauses_and_polls_on() {
    let h = Harness::start(
        Options {
            write_delay: Duration::from_secs(20),
            max_events: Some(2),
            max_in_flight: Some(2),
            ..Options::default()
        },
        &[0],
    );
    h.send(0, 0..10, true);
    h.until(ms(100)).await;
    assert_eq!(h.writes(), vec![(ms(0), vec![0, 1])]);
    assert_eq!(
        h.seen.lock().unwrap().polls,
        4,
        "two batches taken (one written, one waiting), nothing more"
    );
    h.until(super::worker::HOLD_GRACE - ms(1)).await;
    assert!(
        h.seen.lock().unwrap().pauses.is_empty(),
        "a short hold does not pause"
    );
    h.until(super::worker::HOLD_GRACE + ms(1)).await;
    let pauses = h.seen.lock().unwrap().pauses.clone();
    assert_eq!(pauses, vec![(super::worker::HOLD_GRACE, vec![tp(0)], true)]);
    let polls = h.seen.lock().unwrap().polls;
    h.until(Duration::from_secs(15)).await;
    assert!(
        h.seen.lock().unwrap().polls >= polls + 8,
        "the consumer is polled while paused"
    );
    h.until(Duration::from_secs(21)).await;
    {
        let seen = h.seen.lock().unwrap();
        assert_eq!(
            seen.pauses[1],
            (Duration::from_secs(20), vec![tp(0)], false),
            "resumed when the first batch is done"
        );
        assert_eq!(seen.writes[1], (Duration::from_secs(20), vec![2, 3]));
    }
    h.stop().await;
}

/// Under a rate limit a batch holds one second of it (two events at 2/s)
/// and waits queued for its turn: the loop holds at the bound meanwhile,
/// and past the grace (a quarter of `max.poll.interval.ms`) it pauses the
/// partitions and keeps polling, so a low limit costs no rebalance.
#[tokio::test(start_paused = true)]
async fn the_rate_limit_spaces_batches_with_partitions_paused_and_polled() {
    let h = Harness::start(
        Options {
            rate_limit: Some(2),
            max_poll_interval: Some(Duration::from_secs(2)),
            ..Options::default()
        },
        &[0],
    );
    h.send(0, 0..8, true);
    h.until(Duration::from_millis(3_100)).await;
    let s = |n: u64| Duration::from_secs(n);
    assert_eq!(
        h.writes(),
        vec![
            (ms(0), vec![0, 1]),
            (s(1), vec![2, 3]),
            (s(2), vec![4, 5]),
            (s(3), vec![6, 7]),
        ],
        "one second of the rate per batch, a second apart"
    );
    {
        let seen = h.seen.lock().unwrap();
        assert_eq!(
            seen.pauses[..2],
            [(ms(500), vec![tp(0)], true), (s(1), vec![tp(0)], false)],
            "paused after the grace while a batch waits for the limit, resumed when it goes"
        );
        assert!(seen.polls_paused > 0, "polled while paused");
    }
    h.stop().await;
}

/// An eager rebalance revokes everything while the loop holds at the
/// bound: the hold still pauses (nothing) and polls, so the new assignment
/// arrives and is paused in turn. A hold with nothing to pause that did not
/// poll would find its pause always due: the loop would spin at a full
/// core and not hear of the assignment until the write ended. Stepped
/// with `advance` and yields past the grace, because a spinning loop never
/// lets a paused clock move on by itself: this way that bug fails the
/// assertions instead of hanging the test.
#[tokio::test(start_paused = true)]
async fn a_hold_with_an_empty_assignment_polls_and_does_not_spin() {
    let h = Harness::start(
        Options {
            write_delay: Duration::from_secs(20),
            max_events: Some(2),
            max_in_flight: Some(2),
            ..Options::default()
        },
        &[0],
    );
    h.send(0, 0..4, true);
    h.until(ms(100)).await;
    h.group_event(GroupEvent::Revoked(vec![tp(0)]));
    h.until(super::worker::HOLD_GRACE - ms(1)).await;
    tokio::time::advance(ms(2)).await;
    settle().await;
    let (pauses, polls) = {
        let seen = h.seen.lock().unwrap();
        (seen.pauses.clone(), seen.polls_paused)
    };
    let grace = super::worker::HOLD_GRACE;
    assert_eq!(pauses, vec![(grace + ms(1), vec![], true)], "paused once");
    assert!(polls > 0, "polled while paused with nothing assigned");
    h.group_event(GroupEvent::Assigned(vec![tp(1)]));
    h.send_stray(1, [0]); // wakes the polling loop, which applies the event
    h.until(grace + ms(100)).await;
    let pauses = h.seen.lock().unwrap().pauses.clone();
    assert_eq!(
        pauses[1],
        (grace + ms(1), vec![tp(1)], true),
        "the new partition paused"
    );
    h.until(Duration::from_secs(41)).await;
    assert_eq!(
        h.writes().len(),
        3,
        "both held batches and the stray one written"
    );
    h.stop().await;
}

/// A record delivered while paused (a partition assigned but not yet
/// paused) is kept, but opens no batch beyond the bound: the hold stays
/// until a closed batch is handled. Were the stray record's open batch
/// to release the hold, it would fill on, and `max_in_flight + 1` batches
/// would be in memory.
#[tokio::test(start_paused = true)]
async fn a_record_delivered_while_paused_does_not_release_the_hold() {
    let h = Harness::start(
        Options {
            write_delay: Duration::from_secs(20),
            max_events: Some(2),
            max_in_flight: Some(2),
            ..Options::default()
        },
        &[0, 1],
    );
    h.send(0, 0..4, true);
    h.until(super::worker::HOLD_GRACE + ms(1)).await;
    h.send_stray(1, [0]);
    h.send(0, 4..6, true);
    h.until(Duration::from_secs(19)).await;
    {
        let seen = h.seen.lock().unwrap();
        assert_eq!(seen.pauses.len(), 1, "still paused: {:?}", seen.pauses);
        assert_eq!(seen.writes.len(), 1);
    }
    h.until(Duration::from_secs(61)).await;
    let resumed = h.seen.lock().unwrap().pauses[1].clone();
    assert_eq!(
        resumed.0,
        Duration::from_secs(20),
        "resumed when a batch was handled"
    );
    let writes: Vec<Vec<i64>> = h.writes().into_iter().map(|w| w.1).collect();
    assert_eq!(writes, [vec![0, 1], vec![2, 3], vec![0, 4], vec![5]]);
    h.stop().await;
}

/// Lets every ready task run without moving the paused clock.
async fn settle() {
    for _ in 0..200 {
        tokio::task::yield_now().await;
    }
}

/// The next offsets committed, in order, without times or modes.
fn committed(h: &Harness) -> Vec<Vec<(TopicPartition, i64)>> {
    h.commits().into_iter().map(|c| c.1).collect()
}

/// Under a backlog (the batch filled to its bound before the stage was
/// free), a batch may hold trades back; their offsets are committed only once a later batch has
/// written them, first among its own, and the batch that closes without a
/// backlog writes them all.
#[tokio::test(start_paused = true)]
async fn held_trades_are_committed_only_once_a_later_batch_writes_them() {
    let h = Harness::start(
        Options {
            max_events: Some(4),
            write_delay: ms(10),
            ..Options::default()
        },
        &[0],
    );
    h.hold([2, 3, 7]);
    h.send(0, 0..4, true);
    h.until(ms(15)).await;
    assert_eq!(h.holds(), vec![Some(0)]);
    assert_eq!(committed(&h), vec![vec![(tp(0), 2)]], "not past the held 2");
    h.send(0, 4..8, true);
    h.until(ms(30)).await;
    assert_eq!(h.writes()[1].1, vec![2, 3, 4, 5, 6, 7], "held ones first");
    assert_eq!(h.holds()[1], Some(0), "a fresh hold may be held again");
    assert_eq!(committed(&h)[1], vec![(tp(0), 7)]);
    // The backlog is over. The first batch that does not fill may still
    // hold, as the one before it filled (mid-backlog, one often closes
    // short while the consumer's queue is momentarily empty); the second
    // writes everything.
    h.send(0, [8], true);
    h.until(ms(50)).await;
    assert_eq!(h.writes()[2].1, vec![7, 8]);
    assert_eq!(h.holds()[2], Some(0));
    assert_eq!(committed(&h)[2], vec![(tp(0), 9)]);
    h.hold([9]);
    h.send(0, [9], true);
    h.until(ms(70)).await;
    assert_eq!(h.writes()[3].1, vec![9]);
    assert_eq!(h.holds()[3], None);
    assert_eq!(committed(&h)[3], vec![(tp(0), 10)]);
    h.stop().await;
}

/// A write that may hold takes only the held trades of its own batch's
/// customers, however a producer spells their ids (`1` and `"1"` are one
/// customer): the others wait, unplanned, for a batch that brings their
/// customer (or for the backlog's end), and their offsets stay
/// uncommitted until then.
#[tokio::test(start_paused = true)]
async fn a_batch_takes_the_held_trades_of_its_own_customers() {
    let h = Harness::start(
        Options {
            max_events: Some(4),
            write_delay: ms(10),
            ..Options::default()
        },
        &[0],
    );
    h.hold([1, 3]);
    h.send_of(0, [(0, "1"), (1, "1"), (2, "2"), (3, "2")]);
    h.until(ms(15)).await;
    assert_eq!(committed(&h), vec![vec![(tp(0), 1)]]);
    // Customer 1 again, spelt as text: one customer, so its held 1 goes
    // first, before 4.
    h.send_of(0, [(4, r#""1""#), (5, "3"), (6, "3"), (7, "3")]);
    h.until(ms(30)).await;
    assert_eq!(h.writes()[1].1, vec![1, 4, 5, 6, 7], "customer 2's 3 waits");
    assert_eq!(h.holds()[1], Some(0));
    assert_eq!(committed(&h)[1], vec![(tp(0), 3)], "not past the held 3");
    // Two short batches: the second writes everything held.
    h.send_of(0, [(8, "1")]);
    h.until(ms(50)).await;
    h.send_of(0, [(9, "1")]);
    h.until(ms(70)).await;
    assert_eq!(h.writes()[2].1, vec![8]);
    assert_eq!(h.writes()[3].1, vec![3, 9]);
    assert_eq!(h.holds()[3], None);
    assert_eq!(committed(&h).last(), Some(&vec![(tp(0), 10)]));
    h.stop().await;
}

/// A held customer whose trades in a batch all fit in its bucket (what
/// the writer said it takes) stays held, and they with it, unplanned: the
/// writer is not asked to write them, and their offsets stay uncommitted.
/// Once one does not fit, its held trades are written first, then it.
#[tokio::test(start_paused = true)]
async fn trades_that_fit_a_held_bucket_are_held_unplanned() {
    let h = Harness::start(
        Options {
            max_events: Some(4),
            write_delay: ms(10),
            ..Options::default()
        },
        &[0],
    );
    h.room(Room {
        trades: 2,
        bytes: u64::MAX,
    });
    h.hold([1]);
    h.send_of(0, [(0, "2"), (1, "1"), (2, "2"), (3, "2")]);
    h.until(ms(15)).await;
    assert_eq!(committed(&h), vec![vec![(tp(0), 1)]]);
    // Customer 1's 4 and 5 (spelt as text: the same customer) fit.
    h.send_of(0, [(4, "1"), (5, r#""1""#), (6, "3"), (7, "3")]);
    h.until(ms(30)).await;
    assert_eq!(h.writes()[1].1, vec![6, 7], "1, 4 and 5 stay held");
    assert_eq!(committed(&h).last(), Some(&vec![(tp(0), 1)]));
    // Its bucket takes no more: 8 is written after 1, 4 and 5.
    h.send_of(0, [(8, "1"), (9, "3"), (10, "3"), (11, "3")]);
    h.until(ms(50)).await;
    assert_eq!(h.writes()[2].1, vec![1, 4, 5, 8, 9, 10, 11]);
    assert_eq!(committed(&h).last(), Some(&vec![(tp(0), 12)]));
    h.stop().await;
}

/// A batch that closes before it is full (the consumer had nothing more
/// queued) holds nothing back: a light load is written and committed whole.
#[tokio::test(start_paused = true)]
async fn without_a_backlog_nothing_is_held() {
    let h = Harness::start(
        Options {
            max_events: Some(4),
            ..Options::default()
        },
        &[0],
    );
    h.hold([1]);
    h.send(0, 0..3, true);
    h.until(ms(5)).await;
    assert_eq!(h.holds(), vec![None]);
    assert_eq!(committed(&h), vec![vec![(tp(0), 3)]]);
    h.stop().await;
}

/// Held trades never wait on an idle worker: once it has had nothing to
/// write for `batch.linger` and two fetch waits (50 + 2 × 100 ms here),
/// they are written alone. A shorter gap, as a broker that holds fetches
/// leaves mid-backlog, writes nothing early.
#[tokio::test(start_paused = true)]
async fn an_idle_worker_writes_its_held_trades_after_two_fetch_waits() {
    let h = Harness::start(
        Options {
            max_events: Some(4),
            ..Options::default()
        },
        &[0],
    );
    h.hold([2, 3, 6, 7]);
    h.send(0, 0..4, true);
    h.until(ms(200)).await;
    assert_eq!(h.writes().len(), 1, "a 200 ms gap is not the end");
    h.send(0, 4..8, true);
    h.until(ms(210)).await;
    assert_eq!(h.writes()[1], (ms(200), vec![2, 3, 4, 5, 6, 7]));
    assert_eq!(h.holds()[1], Some(0));
    h.until(ms(449)).await;
    assert_eq!(h.writes().len(), 2);
    h.until(ms(460)).await;
    assert_eq!(h.writes()[2], (ms(450), vec![6, 7]));
    assert_eq!(h.holds()[2], None);
    let all = committed(&h);
    assert_eq!(
        all,
        vec![vec![(tp(0), 2)], vec![(tp(0), 6)], vec![(tp(0), 8)]]
    );
    h.stop().await;
}

/// Shutdown writes the held trades before the last commit.
#[tokio::test(start_paused = true)]
async fn shutdown_writes_the_held_trades_before_the_last_commit() {
    let h = Harness::start(
        Options {
            max_events: Some(4),
            ..Options::default()
        },
        &[0],
    );
    h.hold([3]);
    h.send(0, 0..4, true);
    h.until(ms(1)).await;
    let seen = h.stop().await;
    let seen = seen.lock().unwrap();
    assert_eq!(seen.writes[1].1, vec![3]);
    assert_eq!(seen.holds, vec![Some(0), None]);
    let last: Vec<_> = seen.commits.iter().map(|c| c.1.clone()).collect();
    assert_eq!(last, vec![vec![(tp(0), 3)], vec![(tp(0), 4)], vec![]]);
}

/// After a revocation the next batch holds nothing back: a revoked
/// partition's held trades are written at once, for its new owner.
#[tokio::test(start_paused = true)]
async fn after_a_revocation_the_next_batch_holds_nothing() {
    let h = Harness::start(
        Options {
            max_events: Some(4),
            write_delay: ms(10),
            ..Options::default()
        },
        &[0, 1],
    );
    h.hold([2, 3]);
    h.send(0, 0..4, true);
    h.until(ms(5)).await;
    h.group_event(GroupEvent::Revoked(vec![tp(0)]));
    h.send(1, 0..4, true);
    h.until(ms(40)).await;
    assert_eq!(h.writes()[1].1, vec![2, 3, 0, 1, 2, 3]);
    assert_eq!(h.holds(), vec![Some(0), None]);
    let all: Vec<_> = committed(&h).concat();
    assert_eq!(
        all,
        vec![(tp(1), 4)],
        "the revoked partition is its owner's to commit"
    );
    h.stop().await;
}

/// A trade held for `batch.hold_max_age` is written by the next batch even
/// under a backlog: the write is told to hold only after it.
#[tokio::test(start_paused = true)]
async fn a_trade_held_past_its_age_is_written_by_the_next_batch() {
    let h = Harness::start(
        Options {
            max_events: Some(4),
            write_delay: ms(300),
            hold_max_age: Some(ms(500)),
            ..Options::default()
        },
        &[0],
    );
    h.hold([3, 6, 7, 3]);
    // Written at 0, 300 and 600 ms: the backlog never leaves the stage idle.
    h.send(0, 0..12, true);
    h.until(ms(610)).await;
    let writes: Vec<Vec<i64>> = h.writes().into_iter().map(|w| w.1).collect();
    assert_eq!(writes[1], vec![3, 4, 5, 6, 7]);
    assert_eq!(writes[2], vec![3, 6, 7, 8, 9, 10, 11]);
    assert_eq!(
        h.holds(),
        vec![Some(0), Some(0), Some(3)],
        "at 600 ms, 3 (held at 0) is past its age: its customer's held trades \
         (6 and 7, held at 300) are written whole with it"
    );
    h.until(ms(910)).await;
    assert_eq!(committed(&h).last(), Some(&vec![(tp(0), 12)]));
    h.stop().await;
}

/// A batch that would take the held trades past `batch.hold_trades`
/// writes everything.
#[tokio::test(start_paused = true)]
async fn held_trades_stay_within_their_bound() {
    let h = Harness::start(
        Options {
            max_events: Some(4),
            hold_trades: Some(7),
            write_delay: ms(10),
            ..Options::default()
        },
        &[0],
    );
    h.hold([2, 3]);
    h.send(0, 0..4, true);
    h.until(ms(15)).await;
    h.hold([2, 3, 6, 7]);
    h.send(0, 4..8, true);
    h.until(ms(30)).await;
    h.send(0, 8..12, true);
    h.until(ms(45)).await;
    let writes: Vec<Vec<i64>> = h.writes().into_iter().map(|w| w.1).collect();
    assert_eq!(writes[1], vec![2, 3, 4, 5, 6, 7], "6 events: within 7");
    assert_eq!(writes[2], vec![2, 3, 6, 7, 8, 9, 10, 11], "8 would not be");
    assert_eq!(h.holds(), vec![Some(0), Some(0), None]);
    assert_eq!(committed(&h).last(), Some(&vec![(tp(0), 12)]));
    h.stop().await;
}
