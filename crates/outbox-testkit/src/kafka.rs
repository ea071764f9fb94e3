//! The Kafka fixture (feature `kafka`): a topic per test, a publisher
//! configured for it, consumers reading it back, and the admin helpers the
//! Kafka tests share.

use crate::broker::{kafka_brokers, Received};
use outbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use outbox_kafka::rdkafka::client::DefaultClientContext;
use outbox_kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use outbox_kafka::rdkafka::message::{BorrowedMessage, Headers, Message};
use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use outbox_kafka::{KafkaConfig, KafkaPublisher};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a read waits for messages that have not arrived yet.
pub const READ_BOUND: Duration = Duration::from_secs(60);

/// Partitions of a fixture's topic.
pub const PARTITIONS: i32 = 3;

/// A topic of this test alone (`<prefix>-<random>`, [`PARTITIONS`]
/// partitions) on the brokers at `KAFKA_BROKERS`.
pub struct KafkaFixture {
    brokers: String,
    topic: String,
    consumer: Mutex<Option<Arc<StreamConsumer>>>,
}

impl std::fmt::Debug for KafkaFixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaFixture")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl KafkaFixture {
    /// Creates the topic on `KAFKA_BROKERS`; panics with a clear message
    /// when no broker answers.
    pub async fn new() -> Self {
        Self::on(&kafka_brokers(), &topic_name("outbox-test")).await
    }

    /// Creates `topic` on `brokers`.
    pub async fn on(brokers: &str, topic: &str) -> Self {
        create_topic(brokers, topic, PARTITIONS).await;
        Self {
            brokers: brokers.to_owned(),
            topic: topic.to_owned(),
            consumer: Mutex::new(None),
        }
    }

    /// The broker list.
    pub fn brokers(&self) -> &str {
        &self.brokers
    }

    /// The topic.
    pub fn topic(&self) -> String {
        self.topic.clone()
    }

    /// A topic that does not exist.
    pub fn unknown_topic(&self) -> String {
        topic_name("outbox-test-missing")
    }

    /// The publisher configuration: an unknown topic is reported after 3 s
    /// instead of librdkafka's 30 s propagation allowance, and an
    /// unacknowledged send after 10 s instead of 30 s, to keep tests quick
    /// on loopback.
    pub fn config(&self) -> KafkaConfig {
        self.config_for(&self.brokers)
    }

    /// [`config`](Self::config) for other brokers (a proxy, a dedicated broker).
    pub fn config_for(&self, brokers: &str) -> KafkaConfig {
        KafkaConfig::new(brokers)
            .with_property("topic.metadata.propagation.max.ms", "3000")
            .with_delivery_timeout(Duration::from_secs(10))
    }

    /// A publisher.
    pub async fn sink(&self) -> KafkaPublisher {
        KafkaPublisher::new(self.config()).expect("create the publisher")
    }

    fn consumer(&self) -> Arc<StreamConsumer> {
        let mut guard = self.consumer.lock().expect("consumer");
        guard
            .get_or_insert_with(|| {
                Arc::new(assigned_consumer(&self.brokers, &self.topic, PARTITIONS))
            })
            .clone()
    }

    /// The next `n` messages (one consumer kept across calls, every
    /// partition from the beginning; order is per partition). Panics when
    /// they do not arrive within [`READ_BOUND`].
    pub async fn next(&self, n: usize) -> Vec<Received> {
        let consumer = self.consumer();
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let msg = tokio::time::timeout(READ_BOUND, consumer.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "only {} of {n} messages arrived on {} within {READ_BOUND:?}",
                        out.len(),
                        self.topic
                    )
                });
            match msg {
                Ok(m) => out.push(received(&m)),
                Err(e) => eprintln!("consumer error (continuing): {e}"),
            }
        }
        out
    }

    /// Everything the topic holds (at least `expected` messages if they
    /// arrive within [`READ_BOUND`]), partition by partition in offset order.
    pub async fn drain(&self, expected: usize) -> Vec<Received> {
        let stored =
            usize::try_from(message_count(&self.brokers, &self.topic, PARTITIONS)).unwrap_or(0);
        let mut got = read_back(&self.brokers, &self.topic, PARTITIONS, expected.max(stored)).await;
        got.sort_by_key(|r| (r.partition, r.offset));
        got
    }

    /// Closes the consumer and deletes the topic.
    pub async fn cleanup(&self) {
        // Close the consumer before deleting its topic: librdkafka 2.12
        // crashes (strcmp on a NULL name) when Tansu 0.6 answers its
        // by-topic-id metadata refresh for a deleted topic with a null name.
        let consumer = self.consumer.lock().expect("consumer").take();
        drop(consumer);
        delete_topic(&self.brokers, &self.topic).await;
    }
}

/// A unique topic name.
pub fn topic_name(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// Creates `topic` with the admin client; panics naming the brokers when
/// they cannot be reached.
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap_or_else(|e| panic!("admin client for {brokers}: {e}"));
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new()
                .request_timeout(Some(Duration::from_secs(20)))
                .operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .unwrap_or_else(|e| {
            panic!("creating topic {topic} on {brokers} failed: {e} (is the Kafka broker running? `cargo xtask services`, or set KAFKA_BROKERS)")
        });
    for r in results {
        if let Err((t, code)) = r {
            panic!("creating topic {t} on {brokers} failed: {code}");
        }
    }
}

/// Deletes `topic` (best effort).
pub async fn delete_topic(brokers: &str, topic: &str) {
    let admin: Result<AdminClient<DefaultClientContext>, _> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create();
    if let Ok(admin) = admin {
        let _ = admin.delete_topics(&[topic], &AdminOptions::new()).await;
    }
}

/// A consumer assigned to partitions `0..partitions` of `topic`, from the
/// beginning (no group offsets are committed).
pub fn assigned_consumer(brokers: &str, topic: &str, partitions: i32) -> StreamConsumer {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("outbox-test-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("partition offset");
    }
    consumer.assign(&tpl).expect("assign");
    consumer
}

/// Reads `topic` (partitions `0..partitions`) from the beginning until
/// `expected` messages arrived or [`READ_BOUND`] passed (the caller's
/// comparison then names what is missing).
pub async fn read_back(
    brokers: &str,
    topic: &str,
    partitions: i32,
    expected: usize,
) -> Vec<Received> {
    let consumer = assigned_consumer(brokers, topic, partitions);
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + READ_BOUND;
    while out.len() < expected {
        match tokio::time::timeout_at(deadline, consumer.recv()).await {
            Err(_) => break,
            Ok(Err(e)) => eprintln!("consumer error (continuing): {e}"),
            Ok(Ok(m)) => out.push(received(&m)),
        }
    }
    out
}

/// Messages in `topic` (sum of high minus low watermarks): proves there
/// are no duplicates without waiting for "nothing more".
pub fn message_count(brokers: &str, topic: &str, partitions: i32) -> i64 {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("outbox-test-{}", uuid::Uuid::new_v4()))
        .create()
        .expect("consumer");
    (0..partitions)
        .map(|p| {
            let (lo, hi) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks");
            hi - lo
        })
        .sum()
}

/// A consumed Kafka message in broker-neutral form. Kafka has no message
/// id: the `Outbox-Event-Id` header is the dedup id. A keyless event is
/// keyed by its id, reported here as keyless.
pub fn received(msg: &BorrowedMessage<'_>) -> Received {
    let mut headers = BTreeMap::new();
    for h in msg.headers().iter().flat_map(|h| h.iter()) {
        let value = h.value.map(String::from_utf8_lossy).unwrap_or_default();
        headers.insert(h.key.to_owned(), value.into_owned());
    }
    let id = headers
        .get(outbox_core::headers::EVENT_ID)
        .and_then(|v| v.parse().ok());
    let key = msg
        .key()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .filter(|k| {
            Some(k.as_str())
                != headers
                    .get(outbox_core::headers::EVENT_ID)
                    .map(String::as_str)
        });
    Received {
        message_id: id,
        event_id_header: id,
        event_type: headers.get(outbox_core::headers::EVENT_TYPE).cloned(),
        key,
        payload: msg.payload().unwrap_or_default().to_vec(),
        partition: Some(msg.partition()),
        offset: Some(msg.offset()),
        content_type: headers.get("content-type").cloned(),
        headers,
    }
}
