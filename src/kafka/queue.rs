//! Handing records to librdkafka's local queue: a send that finds it full
//! waits for the producer's own thread to empty it, rather than failing.
//! The commands' producers send through [`enqueue`] (`produce`, `dlq
//! replay`), the worker's dead-letter producer through [`while_queue_full`]
//! (`AckedProducer`).

use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::ToBytes;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;

/// Hands `record` to librdkafka now, waiting while its local queue is full
/// (the producer's own thread empties it as the broker acknowledges). The
/// async `FutureProducer::send` would only enqueue when first polled, so a
/// caller that gathers its futures would send nothing until it awaits them.
// The closure's result is rdkafka's own: a refused record comes back
// beside its error, to be sent again.
#[allow(clippy::result_large_err)]
pub async fn enqueue<K, P, C>(
    producer: &FutureProducer<C>,
    record: FutureRecord<'_, K, P>,
) -> KafkaResult<DeliveryFuture>
where
    K: ToBytes + ?Sized,
    P: ToBytes + ?Sized,
    C: ClientContext + 'static,
{
    while_queue_full(record, None, |r| producer.send_result(r)).await
}

/// How often a send is tried again while librdkafka's local queue is full.
const QUEUE_FULL_RETRY: Duration = Duration::from_millis(5);

/// Hands `record` to librdkafka through `send`, trying again while its
/// local queue is full, until `deadline` if there is one; any other
/// refusal is returned at once.
pub(super) async fn while_queue_full<R, T>(
    mut record: R,
    deadline: Option<tokio::time::Instant>,
    send: impl Fn(R) -> Result<T, (KafkaError, R)>,
) -> KafkaResult<T> {
    loop {
        match send(record) {
            Ok(sent) => return Ok(sent),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                if deadline.is_none_or(|d| tokio::time::Instant::now() < d) =>
            {
                record = back;
                tokio::time::sleep(QUEUE_FULL_RETRY).await;
            }
            Err((e, _)) => return Err(e),
        }
    }
}
