//! Integration tests against real Kafka-protocol and MongoDB-protocol
//! servers (see `helpers` for which). One crate so they share one build.

mod helpers;

mod ops;
mod pipeline;
mod plumbing;
mod writer;
