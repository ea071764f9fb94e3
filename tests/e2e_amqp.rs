//! End to end on RabbitMQ: SQLite / PostgreSQL -> relay -> `AmqpPublisher`
//! -> a topic exchange and a queue bound to the event topic, read back by
//! the shared testkit fixture (`AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`). Each test declares its own
//! exchange and queue and deletes them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_testkit::amqp::AmqpFixture;
use outbox_tests::{run_end_to_end, PostgresApp, SqliteApp};

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_to_rabbitmq() {
    run_end_to_end::<SqliteApp, AmqpFixture>().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_to_rabbitmq() {
    run_end_to_end::<PostgresApp, AmqpFixture>().await;
}
