//! Kafka: the group consumer (manual offsets, rebalance bookkeeping) and
//! the dead-letter producer. `clients` builds every client from the
//! settings; `context` holds their callbacks (logs, rebalances, commits,
//! statistics); `queue` hands records to a producer's local queue; this
//! file, the names they share (header names, error kinds, group events).
//!
//! Offsets: `enable.auto.offset.store=false` and `enable.auto.commit=false`.
//! After a batch is durably handled, the pipeline stores the *next* offset
//! to read (last handled + 1, Kafka's convention) and commits it. The
//! rebalance callbacks run inside `recv()` on the pipeline's own task and
//! tell it what changed as [`GroupEvent`] messages, which it reads before
//! it commits: it commits only partitions it still owns.

use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

use crate::metrics::ConsumerErrorKind;
use crate::offsets::TopicPartition;

mod acked;
mod clients;
mod context;
mod dead_letter;
mod group;
pub mod headers;
mod queue;
pub mod stall;

pub use acked::AckedProducer;
pub use clients::{
    admin, bulk_producer, check_options, consumer, dead_letter_producer, end_offsets,
    end_offsets_client, partitions, producer, reader_client, GroupConsumer, SetupError,
};
pub use context::{link_failure, ConsumerCtx, Producer, ScrubbedLogs};
pub use dead_letter::{send_dead_letter, DeadLetter, OUR_HEADER_PREFIX};
pub use queue::enqueue;

/// Header names on dead-letter records.
pub const H_ERROR_KIND: &str = "tradebucket.error.kind";

pub const H_ERROR_MESSAGE: &str = "tradebucket.error.message";

pub const H_SOURCE_TOPIC: &str = "tradebucket.source.topic";

pub const H_SOURCE_PARTITION: &str = "tradebucket.source.partition";

pub const H_SOURCE_OFFSET: &str = "tradebucket.source.offset";

/// On a dead letter shortened to fit the dead-letter topic (see
/// [`DeadLetter::shortened`]): what was left out, and the original
/// payload's length and SHA-256, so it can be matched with its source.
pub const H_SHORTENED: &str = "tradebucket.shortened";

pub const H_PAYLOAD_LENGTH: &str = "tradebucket.payload.length";

pub const H_PAYLOAD_SHA256: &str = "tradebucket.payload.sha256";

/// What kind of consumer error, as the `kind` label of
/// `tradebucket_consumer_errors_total` (a bounded set).
pub fn consumer_error_kind(e: &KafkaError) -> ConsumerErrorKind {
    use ConsumerErrorKind as K;
    use RDKafkaErrorCode as C;
    if matches!(e, KafkaError::MessageConsumptionFatal(_)) {
        return K::Fatal;
    }
    match e.rdkafka_error_code() {
        Some(C::BrokerTransportFailure | C::AllBrokersDown | C::Resolve | C::RequestTimedOut) => {
            K::Transport
        }
        Some(C::AutoOffsetReset | C::OffsetOutOfRange) => K::OffsetReset,
        Some(C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition) => {
            K::UnknownTopicOrPartition
        }
        Some(
            C::TopicAuthorizationFailed
            | C::GroupAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::Authentication
            | C::SaslAuthenticationFailed,
        ) => K::Authorization,
        Some(C::Fatal) => K::Fatal,
        // librdkafka reports these for records it skips and never delivers:
        // a failed CRC (with `check.crcs`), a record format it does not know.
        Some(C::BadMessage | C::NotImplemented) => K::SkippedRecords,
        _ => K::Other,
    }
}

/// A change of this member's assignment, sent by the rebalance callbacks
/// in the order they ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupEvent {
    Assigned(Vec<TopicPartition>),
    Revoked(Vec<TopicPartition>),
}

/// Whether `e` is a time limit that expired: a request
/// (`timeouts.kafka_request`), an operation, or a dead letter's delivery
/// (`timeouts.dead_letter_delivery`).
pub fn timed_out(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::RequestTimedOut
                | RDKafkaErrorCode::OperationTimedOut
                | RDKafkaErrorCode::MessageTimedOut
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loop acts on the class alone (`pipeline::seams::ConsumerError`),
    /// so the class of each error the loop's tests stand for is pinned
    /// here.
    #[test]
    fn consumer_errors_are_classed_by_what_the_loop_does_about_them() {
        use ConsumerErrorKind as K;
        use RDKafkaErrorCode as C;
        let cases = [
            (KafkaError::MessageConsumptionFatal(C::Fatal), K::Fatal),
            (KafkaError::MessageConsumption(C::Fatal), K::Fatal),
            (
                KafkaError::MessageConsumption(C::BrokerTransportFailure),
                K::Transport,
            ),
            (
                KafkaError::MessageConsumption(C::AllBrokersDown),
                K::Transport,
            ),
            (
                KafkaError::MessageConsumption(C::BadMessage),
                K::SkippedRecords,
            ),
            (
                KafkaError::MessageConsumption(C::NotImplemented),
                K::SkippedRecords,
            ),
            (
                KafkaError::MessageConsumption(C::AutoOffsetReset),
                K::OffsetReset,
            ),
            (
                KafkaError::MessageConsumption(C::UnknownTopicOrPartition),
                K::UnknownTopicOrPartition,
            ),
            (
                KafkaError::MessageConsumption(C::TopicAuthorizationFailed),
                K::Authorization,
            ),
            (KafkaError::MessageConsumption(C::InvalidMessage), K::Other),
        ];
        for (e, kind) in cases {
            assert_eq!(consumer_error_kind(&e), kind, "{e}");
        }
    }

    #[test]
    fn only_expired_time_limits_are_timeouts() {
        let timed_out_codes = [
            RDKafkaErrorCode::RequestTimedOut,
            RDKafkaErrorCode::OperationTimedOut,
            RDKafkaErrorCode::MessageTimedOut,
        ];
        for code in timed_out_codes {
            assert!(timed_out(&KafkaError::MessageProduction(code)), "{code:?}");
        }
        let refused = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        assert!(!timed_out(&refused));
        assert!(!timed_out(&KafkaError::Canceled));
    }
}
