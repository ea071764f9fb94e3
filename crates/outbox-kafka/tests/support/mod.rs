//! Helpers shared by the Kafka integration tests: events, a consumer that
//! reads a topic back from the beginning, topic creation.
#![allow(dead_code, unreachable_pub)]

use chrono::Utc;
use outbox_core::{Event, EventId};
use outbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use outbox_kafka::rdkafka::client::DefaultClientContext;
use outbox_kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use outbox_kafka::rdkafka::message::{Headers, Message};
use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::time::Duration;

/// How long a read-back waits for messages before giving up and returning
/// what it has (the test then fails on the comparison, naming what is missing).
pub const READ_BOUND: Duration = Duration::from_secs(60);

/// A unique topic name for one test.
pub fn topic_name(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// An event as a relay would have claimed it.
pub fn event(topic: &str, key: Option<&str>, n: usize) -> Event {
    let now = Utc::now();
    Event {
        id: EventId::new(),
        key: key.map(str::to_owned),
        event_type: "test.event".to_owned(),
        topic: topic.to_owned(),
        payload: format!("payload-{n}").into_bytes(),
        headers: BTreeMap::from([
            (
                "traceparent".to_owned(),
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
            ),
            ("tracestate".to_owned(), "vendor=value".to_owned()),
            ("x-n".to_owned(), n.to_string()),
        ]),
        created_at: now,
        attempts: 1,
        next_attempt_at: now,
        last_error: None,
    }
}

/// One message read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    pub key: Option<String>,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
    pub partition: i32,
    pub offset: i64,
}

impl Received {
    pub fn event_id(&self) -> &str {
        self.headers
            .get(outbox_kafka::HEADER_EVENT_ID)
            .map(String::as_str)
            .unwrap_or("")
    }
}

/// Creates `topic` with the admin client (for real brokers).
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap_or_else(|e| panic!("admin client for {brokers}: {e}"));
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .unwrap_or_else(|e| {
            panic!("creating topic {topic} on {brokers} failed: {e} (is the Kafka broker running? `cargo xtask services`)")
        });
    for r in results {
        if let Err((t, code)) = r {
            panic!("creating topic {t} failed: {code}");
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
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    consumer
}

/// Reads `topic` (partitions `0..partitions`) from the beginning until
/// `expected` messages arrived or [`READ_BOUND`] passed.
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
        let msg = match tokio::time::timeout_at(deadline, consumer.recv()).await {
            Err(_) => break,
            Ok(Err(e)) => {
                eprintln!("consumer error (continuing): {e}");
                continue;
            }
            Ok(Ok(m)) => m,
        };
        let mut headers = BTreeMap::new();
        if let Some(h) = msg.headers() {
            for header in h.iter() {
                let value = header
                    .value
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default();
                headers.insert(header.key.to_owned(), value);
            }
        }
        out.push(Received {
            key: msg.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            payload: msg.payload().unwrap_or_default().to_vec(),
            headers,
            partition: msg.partition(),
            offset: msg.offset(),
        });
    }
    out
}

/// Total messages in `topic` (sum of high watermarks minus low watermarks):
/// proves there are no duplicates without waiting for "nothing more".
pub fn message_count(brokers: &str, topic: &str, partitions: i32) -> i64 {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("outbox-test-{}", uuid::Uuid::new_v4()))
        .create()
        .unwrap();
    (0..partitions)
        .map(|p| {
            let (lo, hi) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap();
            hi - lo
        })
        .sum()
}
