//! The loop's three collaborators, each behind a small trait: where records
//! come from (and offsets go), where trades are written, and where bad
//! events go. Production uses Kafka and MongoDB (see `adapters`); the loop's
//! own unit tests use in-memory stand-ins on a paused clock, so batching,
//! linger, drain, retry and commit order are tested without servers. The
//! real-server suites test the adapters and the whole.
//!
//! The traits are crate-private and used with concrete types only, so their
//! `async fn`s need no `Send` bound of their own. They speak the product's
//! types, not librdkafka's: the adapters classify a client error once, where
//! it is read, and the loop decides on the class.

use std::fmt;

use crate::bucket::store::StoreError;
use crate::bucket::writer::{Events, Outcome, WriteStats};
use crate::event::Source;
use crate::kafka::headers::Header;
use crate::kafka::{DeadLetter, GroupEvent};
use crate::metrics::ConsumerErrorKind;
use crate::offsets::TopicPartition;

/// A consumer error: its class (what the loop does about it, and the
/// metric label) and the client's words (for the log).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ConsumerError {
    pub kind: ConsumerErrorKind,
    pub message: String,
}

impl fmt::Display for ConsumerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// How a commit waits: `Sync` (the last one, at shutdown) until the group
/// coordinator answers, `Async` (every other) not at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Commit {
    Sync,
    Async,
}

/// Why a dead letter was not acknowledged.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum SendError {
    /// The dead-letter topic refused it for its size: it would never fit,
    /// so it is sent again at once, shortened.
    #[error("too large for the dead-letter topic: {0}")]
    TooLarge(String),
    /// Not acknowledged within `timeouts.dead_letter_delivery`.
    #[error("not acknowledged in time: {0}")]
    TimedOut(String),
    /// Any other refusal or failure: retried.
    #[error("{0}")]
    Failed(String),
}

/// A record's key: up to 16 bytes (a customer id, the usual key) inline,
/// so it costs no allocation of its own.
pub type RecordKey = smallvec::SmallVec<[u8; 16]>;

/// A consumed record, detached from the consumer's buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub tp: TopicPartition,
    pub offset: i64,
    pub key: Option<RecordKey>,
    pub payload: Option<Vec<u8>>,
    /// Names and values as bytes: Kafka allows any (see `kafka::headers`).
    pub headers: Vec<Header>,
    /// Kafka's timestamp (producer or broker time), for the delay metric.
    pub timestamp_ms: Option<i64>,
}

impl Record {
    /// Bytes this record holds in memory: payload, key and headers. The
    /// batch bound counts all of them, so records with small payloads and
    /// large headers cannot grow a batch past it.
    pub fn size(&self) -> usize {
        let len = |b: &Option<Vec<u8>>| b.as_ref().map_or(0, Vec::len);
        let headers: usize = self.headers.iter().map(|(n, v)| n.len() + len(v)).sum();
        len(&self.payload) + self.key.as_ref().map_or(0, |k| k.len()) + headers
    }

    /// Where it was read: the trade's fallback identity, a dead letter's
    /// provenance.
    pub fn source(&self) -> Source {
        Source {
            topic: self.tp.0.clone(),
            partition: self.tp.1,
            offset: self.offset,
        }
    }
}

/// The consumer side: records in, offsets out.
pub(crate) trait Intake {
    /// The next record, or a consumer error to report. Must be cancel-safe:
    /// the loop races it against its writes and timers, and polls it once
    /// without waiting to learn whether anything is queued.
    async fn recv(&mut self) -> Result<Record, ConsumerError>;

    /// Assignment changes since the last call, in order.
    fn group_events(&mut self) -> Vec<GroupEvent>;

    /// Stores `offsets` (per partition, the next offset to read) and
    /// commits. With nothing to store, a `Sync` commit still commits what
    /// was stored before (the last one, at shutdown); an `Async` one does
    /// nothing.
    fn commit(&mut self, offsets: &[(TopicPartition, i64)], mode: Commit);

    /// Stops fetching these partitions; the consumer must still be polled
    /// (`recv`), which keeps the member in its group. Records delivered
    /// before are the caller's; librdkafka fetches again from after the
    /// last delivered one on `resume`.
    fn pause(&mut self, tps: &[TopicPartition]);

    /// Fetches the paused partitions again.
    fn resume(&mut self, tps: &[TopicPartition]);

    /// Leaves the consumer group, so the partitions move on at once.
    fn leave(&mut self);
}

/// Where trades go: the bucket writer.
pub(crate) trait BucketSink {
    /// Writes `events` (in stream order). `outcomes` has one slot per event
    /// and survives a failed call: a retry keeps what is already known.
    /// `hold`: see `BucketWriter::write`.
    async fn write(
        &mut self,
        events: Events<'_>,
        outcomes: &mut [Outcome],
        hold: Option<usize>,
    ) -> Result<WriteStats, StoreError>;

    /// Forgets cached buckets: after a rebalance another instance may have
    /// written our former customers.
    fn forget_all(&mut self);
}

/// Where bad events go: the dead-letter topic.
pub(crate) trait DeadLetterSink {
    /// Sends one dead letter and waits for its acknowledgement.
    async fn send(&self, dead: &DeadLetter) -> Result<(), SendError>;
}
