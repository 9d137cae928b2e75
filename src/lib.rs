//! tradebucket: trade events from Kafka into per-customer, count-capped
//! MongoDB bucket documents, exactly once in effect.
//!
//! - [`config`]: layered, typed settings, their validation, and the secret
//!   values that never print.
//! - [`event`]: decoding one Kafka payload into a [`event::Trade`] (pure).
//! - [`bucket`]: planning appends (pure), the MongoDB store, and the writer
//!   that executes plans and resolves conflicts.
//! - [`offsets`]: the contiguous committable prefix per partition (pure).
//! - [`kafka`]: the group consumer and the dead-letter producer.
//! - [`pipeline`]: the worker loop, and its seams to Kafka and MongoDB.
//! - [`health`]: liveness and readiness, set by the loop, read by [`http`].
//! - [`retry`]: the one backoff policy every retry loop waits through.
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`.
//! - [`metrics`]: every metric, defined once.
//! - [`throttle`]: rate limit for log lines on hot paths.
//! - [`ratelimit`]: the write-rate limit (events per second), pure.
//! - [`dlq`]: `tradebucket dlq list|show|replay`: reading and replaying
//!   the dead-letter topic.
//! - [`reconcile`]: `tradebucket reconcile`: every record the group
//!   committed past, checked against MongoDB and the dead letters.
//! - [`cli`]: the operator commands besides `run` (init, page, audit,
//!   produce, check-config).
//! - [`registry`]: Avro and Protobuf payloads read through a Schema
//!   Registry, and each topic's payload format.
//! - [`errors`]: an error and its causes told in one line.
//! - [`allocator`]: the settings of mimalloc, the binary's allocator.
//! - [`prefetch`]: a cache hint for the hot path's scattered reads.
//!
//! `docs/design.md` explains why the guarantees hold.

pub mod allocator;
pub mod bucket;
pub mod cli;
pub mod config;
pub mod dlq;
pub mod errors;
pub mod event;
pub mod health;
pub mod http;
pub mod kafka;
pub mod metrics;
pub mod offsets;
pub mod pipeline;
pub mod prefetch;
pub mod ratelimit;
pub mod reconcile;
pub mod registry;
pub mod retry;
pub mod throttle;
