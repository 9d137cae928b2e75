//! The worker: fetch -> batch -> decode -> write buckets -> dead-letter
//! -> commit, pipelined. The loop ([`worker`]) and its batches
//! ([`batches`]), the write stage ([`stage`]), the seams it talks to Kafka
//! and MongoDB through ([`seams`], unit-tested on a paused clock in
//! `tests.rs`) and their production side ([`adapters`]); this file starts
//! it all. Why it is shaped so: docs/design.md, "Shape", "The pipelined
//! loop" and "Offsets: commit after write".

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

mod adapters;
mod batches;
mod seams;
mod stage;
#[cfg(test)]
mod tests;
mod worker;

use adapters::{watch_mongodb, watch_partitions, KafkaDeadLetters, KafkaIntake};
pub use seams::{Record, RecordKey};
// For benches/hotpath/, which measures decoding a batch without servers.
#[doc(hidden)]
pub use stage::{decode_batch, Decoded};
use worker::Worker;

use crate::bucket::store::{BucketStore, InitError, StoreError};
use crate::bucket::writer::{BucketWriter, InsertSplit};
use crate::config::{MappingError, OffsetReset, Settings};
use crate::errors::error_chain;
use crate::event::Mappings;
use crate::health::Health;
use crate::kafka;
use crate::metrics::Metrics;
use crate::registry::Formats;
use crate::retry::Backoff;

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("Kafka client setup failed: {0}")]
    Kafka(#[from] kafka::SetupError),
    #[error("MongoDB setup failed: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Mapping(#[from] MappingError),
    #[error(transparent)]
    Registry(#[from] crate::registry::ClientError),
    /// librdkafka says the consumer cannot go on (for example a static
    /// member fenced by another with its `group.instance.id`).
    #[error("fatal Kafka consumer error: {0}")]
    FatalConsumer(String),
}

/// The worker, connected to Kafka and MongoDB.
pub struct Pipeline(Worker<KafkaIntake, BucketWriter, KafkaDeadLetters>);

impl Pipeline {
    /// Connects to MongoDB (creating the indexes) and Kafka. MongoDB being
    /// down at start-up is retried until `shutdown` (then `Ok(None)`).
    pub async fn build(
        settings: Settings,
        metrics: Metrics,
        health: Arc<Health>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Pipeline>, PipelineError> {
        if settings.kafka.auto_offset_reset == OffsetReset::Latest {
            tracing::warn!(
                "kafka.auto_offset_reset = \"latest\": a group without a committed offset \
                 starts at the end of each partition, and never reads the events before it"
            );
        }
        // Checked when the settings were loaded; compiled once, here.
        let mappings = Mappings::from_settings(&settings)?;
        let formats = Arc::new(Formats::from_settings(&settings, metrics.clone())?);
        let store = BucketStore::connect(&settings).await?;
        if !create_indexes(&store, &settings, shutdown).await? {
            return Ok(None);
        }
        health.write_succeeded();
        health.mongodb_reachable(true);
        tokio::spawn(watch_mongodb(
            store.clone(),
            health.clone(),
            metrics.clone(),
            settings.timeouts.clone(),
            shutdown.clone(),
        ));
        let writer = BucketWriter::new(
            store,
            settings.buckets.capacity,
            settings.buckets.cache_customers,
            metrics.clone(),
        )
        .with_insert_split(InsertSplit::new(settings.mongodb.insert_concurrency));
        let dead_letters =
            KafkaDeadLetters::new(kafka::dead_letter_producer(&settings)?, settings.clone());
        let group = kafka::consumer(&settings, metrics.clone(), health.clone())?;
        tokio::spawn(watch_partitions(
            group.stalls.clone(),
            kafka::end_offsets_client(&settings)?,
            settings.timeouts.kafka_request,
            health.clone(),
            metrics.clone(),
            shutdown.clone(),
        ));
        let intake = KafkaIntake::new(group, metrics.clone());
        health.subscribed();
        health.tick();
        let worker = Worker::new(
            settings,
            (mappings, formats),
            intake,
            writer,
            dead_letters,
            metrics,
            health,
        );
        Ok(Some(Pipeline(worker)))
    }

    /// Runs until `shutdown` is cancelled, then drains and leaves the
    /// group. `Err` only when the consumer cannot go on.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), PipelineError> {
        self.0.run(shutdown).await
    }
}

/// Creates the indexes, retrying until it works; `false` if `shutdown`
/// came first. A collection laid out for the other mode (or sharded on
/// another key) is refused at once: waiting would not change it.
async fn create_indexes(
    store: &BucketStore,
    settings: &Settings,
    shutdown: &CancellationToken,
) -> Result<bool, StoreError> {
    let mut backoff = Backoff::new(&settings.retry);
    loop {
        let e = match store.init().await {
            Ok(_) => return Ok(true),
            Err(InitError::Layout(why)) => return Err(StoreError::Failed(why)),
            Err(InitError::Store(e)) => e,
        };
        let wait = backoff.next_wait();
        tracing::warn!(error = %error_chain(&e), retry_in = ?wait, "cannot create indexes; retrying");
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(false),
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Runs the worker with its HTTP endpoints until `shutdown`.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    let health = Arc::new(Health::default());
    let listener = tokio::net::TcpListener::bind(settings.http.listen).await?;
    tracing::info!(listen = %listener.local_addr()?, "HTTP endpoints up");
    let http = tokio::spawn(crate::http::serve(
        listener,
        metrics.clone(),
        health.clone(),
        settings.timeouts.liveness_stall,
        shutdown.clone(),
    ));
    let result = on_own_thread(settings, metrics, health, shutdown.clone()).await;
    shutdown.cancel();
    let _ = http.await;
    result
}

/// Builds and runs the pipeline on a thread of its own with a
/// single-threaded runtime, and waits for it (why: docs/design.md,
/// "Shape"). The HTTP endpoints stay on the caller's runtime.
async fn on_own_thread(
    settings: Settings,
    metrics: Metrics,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let thread = std::thread::Builder::new()
        .name("pipeline".into())
        .spawn(move || {
            let result = runtime.block_on(async {
                match Pipeline::build(settings, metrics, health, &shutdown).await? {
                    Some(p) => p.run(shutdown).await,
                    None => Ok(()),
                }
            });
            // The runtime's tasks still hold Kafka and MongoDB clients (the
            // watchers'): destroyed here, on this thread, before it ends.
            drop(runtime);
            result
        })?;
    // Joined, not just heard from: the process must not exit while this
    // thread still destroys a client, whose threads would run into the
    // exit handlers and corrupt the heap.
    match tokio::task::spawn_blocking(move || thread.join()).await? {
        Ok(result) => result.map_err(Into::into),
        Err(_) => anyhow::bail!("the pipeline thread panicked (see the log)"),
    }
}
