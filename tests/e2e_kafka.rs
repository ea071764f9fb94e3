//! End to end on Kafka (Tansu, a Kafka-protocol broker, on `KAFKA_BROKERS`,
//! default `127.0.0.1:9092`; `cargo xtask services` starts it): SQLite /
//! PostgreSQL -> relay -> `KafkaPublisher` -> a topic with three partitions,
//! read back by the shared testkit fixture (an rdkafka consumer on every
//! partition from the beginning). Each test creates its own topic and
//! deletes it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_testkit::kafka::KafkaFixture;
use outbox_tests::{run_end_to_end, PostgresApp, SqliteApp};

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_to_kafka() {
    run_end_to_end::<SqliteApp, KafkaFixture>().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_to_kafka() {
    run_end_to_end::<PostgresApp, KafkaFixture>().await;
}
