//! End to end on Kafka (Tansu, a Kafka-protocol broker, on `KAFKA_BROKERS`,
//! default `127.0.0.1:9092`; `cargo xtask services` starts it): SQLite /
//! PostgreSQL -> relay -> `KafkaPublisher` -> an rdkafka consumer reading
//! every partition from the beginning. Each test creates its own topic with
//! three partitions and deletes it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use outbox_kafka::rdkafka::client::DefaultClientContext;
use outbox_kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use outbox_kafka::rdkafka::message::{Headers, Message};
use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use outbox_kafka::{KafkaConfig, KafkaPublisher};
use outbox_tests::{run_end_to_end, Broker, PostgresApp, Received, SqliteApp};
use std::collections::BTreeMap;
use std::time::Duration;

const PARTITIONS: i32 = 3;

struct Kafka {
    brokers: String,
    topic: String,
}

impl Kafka {
    fn admin(&self) -> AdminClient<DefaultClientContext> {
        ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .create()
            .unwrap_or_else(|e| panic!("Kafka admin client for {}: {e}", self.brokers))
    }

    fn consumer(&self) -> StreamConsumer {
        ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set(
                "group.id",
                format!("outbox-e2e-{}", outbox_tests::unique_suffix()),
            )
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap()
    }

    /// Messages in the topic: the sum over partitions of high minus low watermark.
    fn stored(&self, consumer: &StreamConsumer) -> usize {
        (0..PARTITIONS)
            .map(|p| {
                let (lo, hi) = consumer
                    .fetch_watermarks(&self.topic, p, Duration::from_secs(10))
                    .unwrap();
                (hi - lo) as usize
            })
            .sum()
    }
}

/// A message with where it was read, for sorting into partition order.
struct Read {
    partition: i32,
    offset: i64,
    received: Received,
}

impl Broker for Kafka {
    type Sink = KafkaPublisher;
    const NAME: &'static str = "kafka";

    async fn start() -> Self {
        let kafka = Self {
            brokers: outbox_tests::kafka_brokers(),
            topic: format!("outbox-e2e-{}", outbox_tests::unique_suffix()),
        };
        let results = kafka
            .admin()
            .create_topics(
                &[NewTopic::new(&kafka.topic, PARTITIONS, TopicReplication::Fixed(1))],
                &AdminOptions::new()
                    .request_timeout(Some(Duration::from_secs(20)))
                    .operation_timeout(Some(Duration::from_secs(20))),
            )
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "Kafka is not reachable at {} ({e}); start it (`cargo xtask services`) or set KAFKA_BROKERS",
                    kafka.brokers
                )
            });
        for result in results {
            if let Err((topic, code)) = result {
                panic!(
                    "creating Kafka topic {topic} on {} failed: {code}",
                    kafka.brokers
                );
            }
        }
        kafka
    }

    fn topic(&self) -> String {
        self.topic.clone()
    }

    async fn sink(&self) -> KafkaPublisher {
        KafkaPublisher::new(KafkaConfig::new(&self.brokers)).unwrap()
    }

    async fn consume(&self, expected: usize) -> Vec<Received> {
        let consumer = self.consumer();
        let mut partitions = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            partitions
                .add_partition_offset(&self.topic, p, Offset::Beginning)
                .unwrap();
        }
        consumer.assign(&partitions).unwrap();
        // Every send had its delivery report before this ran, so the
        // watermarks are final: read all of it, extras included.
        let stored = self.stored(&consumer);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut read = Vec::with_capacity(expected);
        while read.len() < expected.max(stored) {
            let msg = match tokio::time::timeout_at(deadline, consumer.recv()).await {
                Err(_) => break,
                Ok(Err(e)) => {
                    eprintln!("Kafka consumer error (continuing): {e}");
                    continue;
                }
                Ok(Ok(m)) => m,
            };
            let mut headers = BTreeMap::new();
            for h in msg.headers().iter().flat_map(|h| h.iter()) {
                let value = h.value.map(String::from_utf8_lossy).unwrap_or_default();
                headers.insert(h.key.to_owned(), value.into_owned());
            }
            let id = headers
                .get(outbox_kafka::HEADER_EVENT_ID)
                .and_then(|v| v.parse().ok());
            read.push(Read {
                partition: msg.partition(),
                offset: msg.offset(),
                received: Received {
                    // Kafka has no message id: the event-id header is the dedup id.
                    message_id: id,
                    event_id_header: id,
                    event_type: headers.get(outbox_kafka::HEADER_EVENT_TYPE).cloned(),
                    key: msg.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                    payload: msg.payload().unwrap_or_default().to_vec(),
                    partition: Some(msg.partition()),
                    headers,
                },
            });
        }
        read.sort_by_key(|r| (r.partition, r.offset));
        read.into_iter().map(|r| r.received).collect()
    }

    async fn cleanup(self) {
        let _ = self
            .admin()
            .delete_topics(&[&self.topic], &AdminOptions::new())
            .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_to_kafka() {
    run_end_to_end::<SqliteApp, Kafka>().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_to_kafka() {
    run_end_to_end::<PostgresApp, Kafka>().await;
}
