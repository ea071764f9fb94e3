//! End-to-end tests of the `outbox` workspace, across crates and against
//! real services: an application transaction on a real store (SQLite in a
//! temporary file, PostgreSQL in a fresh schema) -> the real relay
//! (`outbox-worker`) -> a real broker (NATS JetStream, RabbitMQ, Kafka) -> a
//! real consumer.
//!
//! This library is the scaffolding the test files share, generic over the
//! store ([`App`]) and the broker ([`Broker`], implemented by the
//! `outbox-testkit` fixture of each broker: topology, publisher, consumer);
//! each `e2e_<broker>.rs` calls [`run_end_to_end`] once per store.
//!
//! | env var | default |
//! |---|---|
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/test` |
//! | `NATS_URL` | `nats://127.0.0.1:4222` |
//! | `AMQP_URL` | `amqp://guest:guest@127.0.0.1:5672/%2f` |
//! | `KAFKA_BROKERS` | `127.0.0.1:9092` |
//!
//! A service that cannot be reached fails the test with a message naming it
//! (tests never skip). This is test support: it panics on failures by design.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/app.rs"]
mod app;
#[path = "support/broker.rs"]
mod broker;
#[path = "support/scenario.rs"]
mod scenario;

pub use app::{App, Order, OutboxRows, PostgresApp, SqliteApp, TxEnd};
pub use broker::{Broker, Received};
pub use outbox_testkit::broker::{amqp_url, kafka_brokers, nats_url, unique_suffix};
pub use scenario::{check_delivery, run_end_to_end, Scenario, RELAY_BOUND};

/// `DATABASE_URL`, or the local default.
pub fn database_url() -> String {
    env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}
