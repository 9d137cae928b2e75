//! Integration tests against real Kafka-protocol and MongoDB-protocol
//! servers (`testkit::env` says which). One crate so they share one build.

mod combined;
mod commands;
mod dlq;
mod kafka;
mod mapping;
mod network;
mod operator;
mod ops;
mod outage;
mod pipeline;
mod plumbing;
mod reconcile;
mod registry;
mod writer;

/// The binary under test: only the root package's tests know its path, so
/// the test kit takes it as a parameter.
fn bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_tradebucket"))
}
