//! What tradebucket's integration tests (`tests/it`), chaos suite
//! (`tests/chaos`) and benchmark (`benches/pipeline/`) share, so each
//! exists once:
//!
//! - [`event`]: the one builder of valid trade events;
//! - [`poll`]: the one polling helper (`eventually`, `poll_until`);
//! - [`settings`]: the only place the kit turns worker variables into
//!   `tradebucket::config::Settings`;
//! - [`env`]: a test's own topic, dead-letter topic, group and database on
//!   the shared or a private stack, producing and reading back;
//! - [`worker`]: the worker in this process, stopped through its token;
//! - [`process`]: the real `tradebucket` binary as a child process (kill
//!   -9, SIGTERM, exit codes, log files) and `audit --json`;
//! - [`proxy`]: a MongoDB wire proxy that rewrites replies (statement
//!   errors the local server never sends);
//! - [`netfault`]: a TCP proxy that black-holes, delays, resets, and
//!   drops MongoDB write replies after the server applied them;
//! - [`registry`]: a small Confluent Schema Registry, and confluent-kafka's
//!   own Avro serializer (Python) producing through it;
//! - [`servers`]: private MongoDB-protocol servers, Apache Kafka nodes
//!   and clusters, and Prometheus; free ports, HTTP probes.
//!
//! The binary's path is always a parameter: `CARGO_BIN_EXE_tradebucket`
//! exists only in the root package's tests and benches, not here.

pub mod env;
pub mod event;
pub mod netfault;
pub mod poll;
pub mod process;
pub mod proxy;
pub mod registry;
pub mod servers;
pub mod settings;
pub mod worker;

pub use env::{
    admin, audit_clean, create_replicated_topic, create_topic, header, headers_of, kafka_brokers,
    mongodb_uri, produce_fast, produce_fast_with, unique, Produced, TestEnv,
};
pub use event::{decoded, trade, TradeEvent};
pub use netfault::{FaultProxy, Protocol};
pub use poll::{eventually, poll_until};
pub use process::{audit_json, Fleet, Log, WorkerProcess, SIGINT, SIGTERM};
pub use proxy::MongoProxy;
pub use registry::{produce_avro, produce_avro_placed, produce_protobuf, SchemaRegistry};
pub use servers::{free_port, http_get, PrivateKafka, PrivateMongo, Prometheus};
pub use worker::Worker;
