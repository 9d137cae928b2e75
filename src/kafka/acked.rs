//! The worker's dead-letter producer: each send is awaited until the broker
//! acknowledges it, and its delivery reports are served by a thread of its
//! own that does not spin while there is nothing to send.
//!
//! rdkafka's `FutureProducer` does the same with a thread that polls in
//! calls of 100 ms, and `BaseProducer::poll` hands librdkafka the time left
//! in whole milliseconds, rounded down: the last fraction of a millisecond
//! of every call is polled again and again with a zero timeout until the
//! call's deadline passes. That is about 1 % of a core for as long as the
//! worker runs, most of which it has no dead letter to send. Here each call
//! lasts [`POLL_CALL`], so the same rounding costs a tenth of that.
//! A delivery report is still handled as soon as it arrives: a call
//! returns only at its deadline, but serves every event before it.
//!
//! The last handle's drop stops the thread and waits for it (a call at
//! most), then destroys the client: librdkafka's threads must be gone
//! before the process exits, or they may run into its exit handlers and
//! end it by a signal instead of exit 0.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::channel::oneshot;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, ProducerContext};
use tokio::time::Instant;

use super::context::ScrubbedLogs;
use super::queue::while_queue_full;

/// How long each call of the polling thread lasts, and so how long the
/// last handle's drop may wait for it.
const POLL_CALL: Duration = Duration::from_secs(1);

/// Where a send's acknowledgement goes.
type Ack = oneshot::Sender<KafkaResult<()>>;

/// A producer whose sends complete when acknowledged; cheap to clone.
#[derive(Clone)]
pub struct AckedProducer {
    client: Arc<Client>,
}

/// The client and its polling thread, shared by the clones.
struct Client {
    producer: Arc<BaseProducer<Delivery>>,
    stop: Arc<AtomicBool>,
    polling: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Client {
    /// The thread sees the stop at the end of its current call; once it
    /// is gone, the client is destroyed here, with this last share.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(polling) = self.polling.take() {
            let _ = polling.join();
        }
    }
}

impl AckedProducer {
    /// Creates the client and starts its polling thread.
    pub fn new(config: &rdkafka::ClientConfig, logs: ScrubbedLogs) -> KafkaResult<Self> {
        let producer: Arc<BaseProducer<Delivery>> =
            Arc::new(config.create_with_context(Delivery { logs })?);
        let stop = Arc::new(AtomicBool::new(false));
        let (polled, stopped) = (Arc::clone(&producer), Arc::clone(&stop));
        let polling = std::thread::Builder::new()
            .name("dead-letter producer".to_string())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    polled.poll(POLL_CALL);
                }
            })
            .map_err(|e| KafkaError::ClientCreation(format!("polling thread: {e}")))?;
        Ok(AckedProducer {
            client: Arc::new(Client {
                producer,
                stop,
                polling: Some(polling),
            }),
        })
    }

    /// Sends one record, waiting at most `queue_timeout` for room in
    /// librdkafka's local queue, and then for the broker's verdict (which
    /// `message.timeout.ms` bounds).
    // The closure's result is rdkafka's own: a refused record comes back
    // beside its error, to be sent again.
    #[allow(clippy::result_large_err)]
    pub async fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: OwnedHeaders,
        queue_timeout: Duration,
    ) -> KafkaResult<()> {
        let (ack, acked) = oneshot::channel();
        let mut record: BaseRecord<'_, [u8], [u8], Box<Ack>> =
            BaseRecord::with_opaque_to(topic, Box::new(ack)).headers(headers);
        record.key = key;
        record.payload = payload;
        let deadline = Instant::now() + queue_timeout;
        let producer = &self.client.producer;
        while_queue_full(record, Some(deadline), |r| producer.send(r)).await?;
        // The client dropped the report: it is being destroyed.
        acked.await.unwrap_or(Err(KafkaError::Canceled))
    }
}

/// Logs through [`ScrubbedLogs`]; completes each send's acknowledgement.
struct Delivery {
    logs: ScrubbedLogs,
}

impl ClientContext for Delivery {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.logs.log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.logs.error(error, reason);
    }
}

impl ProducerContext for Delivery {
    type DeliveryOpaque = Box<Ack>;

    fn delivery(&self, result: &DeliveryResult<'_>, ack: Box<Ack>) {
        let verdict = match result {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(e.clone()),
        };
        // The sender stopped waiting (it was cancelled): nothing to tell.
        let _ = ack.send(verdict);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU time of this process's thread named `name`, from
    /// `/proc/self/task/*/schedstat` (nanoseconds on a CPU), which is exact
    /// where `stat`'s ticks are 10 ms.
    fn thread_cpu(name: &str) -> Option<Duration> {
        for task in std::fs::read_dir("/proc/self/task").ok()? {
            let dir = task.ok()?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            if comm.trim_end() == name {
                let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
                let ns = stat.split_whitespace().next()?.parse().ok()?;
                return Some(Duration::from_nanos(ns));
            }
        }
        None
    }

    /// An idle producer's polling thread sleeps. With its calls at the
    /// 100 ms of rdkafka's `FutureProducer`, this test measured 8.6 ms of
    /// the thread's CPU in the second (and failed).
    #[test]
    fn an_idle_producer_does_not_spin() {
        let mut config = rdkafka::ClientConfig::new();
        // Nothing listens there: the client only retries connecting, on
        // librdkafka's own threads.
        config.set("bootstrap.servers", "127.0.0.1:9");
        let producer = AckedProducer::new(&config, ScrubbedLogs::default()).expect("producer");
        // `comm` holds the first 15 bytes of a thread's name.
        let name = "dead-letter pro";
        std::thread::sleep(Duration::from_millis(100));
        let before = thread_cpu(name).expect("the polling thread");
        std::thread::sleep(Duration::from_secs(1));
        let used = thread_cpu(name).expect("the polling thread") - before;
        assert!(
            used < Duration::from_millis(2),
            "idle polling used {used:?} in 1 s"
        );
        drop(producer);
    }
}
