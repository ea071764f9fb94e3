//! End to end on NATS JetStream: SQLite / PostgreSQL -> relay ->
//! `NatsPublisher` -> the stream, read back by the shared testkit fixture
//! (`NATS_URL`, default `nats://127.0.0.1:4222`). Each test has its own
//! stream and subject prefix.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_testkit::nats::NatsFixture;
use outbox_tests::{run_end_to_end, PostgresApp, SqliteApp};

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_to_nats() {
    run_end_to_end::<SqliteApp, NatsFixture>().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_to_nats() {
    run_end_to_end::<PostgresApp, NatsFixture>().await;
}
