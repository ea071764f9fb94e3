#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod breaker;
mod control;
mod handlers;
mod jsonl;
mod layer;
mod lease;
pub mod metrics;
mod name;
mod options;
mod rate;
mod relay;
#[cfg(test)]
mod relay_fault_tests;
#[cfg(all(test, feature = "sqlite"))]
mod relay_tests;
#[cfg(test)]
mod test_support;

pub use breaker::{SinkHealth, SinkState, SinkStatus};
pub use control::{PauseHandle, PauseStatus, CONTROL_REFRESH};
pub use handlers::HandlerRegistry;
pub use jsonl::{JsonLinesSink, SINK_WRITE_FAILED};
pub use layer::{KeyOrder, KeyOrderLayer};
pub use name::{InvalidStoreName, StoreName, STORE_NAME_MAX};
pub use options::{InvalidOptions, RelayOptions};
pub use relay::{Progress, Relay, RelaySummary, SINK_PANICKED};

/// The shared vocabulary (events, retry policy, traits).
pub use outbox_core as core;

/// The RabbitMQ / AMQP 0.9.1 publisher (feature `amqp`).
#[cfg(feature = "amqp")]
pub use outbox_amqp as amqp;
/// The Kafka publisher (feature `kafka`).
#[cfg(feature = "kafka")]
pub use outbox_kafka as kafka;
/// The NATS JetStream publisher (feature `nats`).
#[cfg(feature = "nats")]
pub use outbox_nats as nats;
/// The PostgreSQL store (feature `postgres`).
#[cfg(feature = "postgres")]
pub use outbox_postgres as postgres;
/// The SQLite store (feature `sqlite`, on by default).
#[cfg(feature = "sqlite")]
pub use outbox_sqlite as sqlite;
