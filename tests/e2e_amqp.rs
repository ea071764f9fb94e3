//! End to end on RabbitMQ: SQLite / PostgreSQL -> relay -> `AmqpPublisher`
//! -> a `basic.consume` consumer with manual acks (`AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`). Each test declares its own
//! topic exchange and queue (bound to the event topic) and deletes them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use futures::StreamExt;
use outbox_amqp::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, ExchangeDeleteOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use outbox_amqp::lapin::types::{AMQPValue, FieldTable};
use outbox_amqp::lapin::{Connection, ConnectionProperties};
use outbox_amqp::{AmqpConfig, AmqpPublisher};
use outbox_tests::{run_end_to_end, Broker, PostgresApp, Received, SqliteApp};
use std::collections::BTreeMap;
use std::time::Duration;

struct Rabbit {
    connection: Connection,
    exchange: String,
    queue: String,
}

impl Broker for Rabbit {
    type Sink = AmqpPublisher;
    const NAME: &'static str = "amqp";

    async fn start() -> Self {
        let url = outbox_tests::amqp_url();
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "RabbitMQ is not reachable at {} ({e}); start it (`cargo xtask services`) or set AMQP_URL",
                    outbox_amqp::redact_uri(&url)
                )
            });
        let name = format!("outbox-e2e-{}", outbox_tests::unique_suffix());
        let rabbit = Self {
            connection,
            exchange: name.clone(),
            queue: name,
        };
        let publisher = rabbit.sink().await;
        publisher
            .declare_queue(&rabbit.exchange, &rabbit.queue, &rabbit.topic())
            .await
            .unwrap();
        publisher.close().await;
        rabbit
    }

    fn topic(&self) -> String {
        "orders".to_owned()
    }

    async fn sink(&self) -> AmqpPublisher {
        let config = AmqpConfig::from_url(&outbox_tests::amqp_url())
            .unwrap()
            .with_exchange(&self.exchange);
        AmqpPublisher::connect(config).await.unwrap()
    }

    async fn consume(&self, expected: usize) -> Vec<Received> {
        let channel = self.connection.create_channel().await.unwrap();
        let mut consumer = channel
            .basic_consume(
                &self.queue,
                "outbox-e2e",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let mut out = Vec::with_capacity(expected);
        while out.len() < expected {
            let Ok(next) = tokio::time::timeout_at(deadline, consumer.next()).await else {
                break;
            };
            let delivery = next.expect("consumer cancelled").expect("consumer error");
            delivery.ack(BasicAckOptions::default()).await.unwrap();
            out.push(to_received(&delivery));
        }
        // Closing the channel returns any prefetched, unacknowledged message
        // to the queue; every publish was confirmed before this ran, so what
        // the queue still holds now is exactly what arrived beyond `expected`.
        channel.close(200, "consumed").await.unwrap();
        let channel = self.connection.create_channel().await.unwrap();
        let left = channel
            .queue_declare(
                &self.queue,
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count();
        for _ in 0..left {
            let extra = channel
                .basic_get(&self.queue, BasicGetOptions { no_ack: true })
                .await
                .unwrap();
            out.extend(extra.map(|m| to_received(&m.delivery)));
        }
        out
    }

    async fn cleanup(self) {
        if let Ok(channel) = self.connection.create_channel().await {
            let _ = channel
                .queue_delete(&self.queue, QueueDeleteOptions::default())
                .await;
            let _ = channel
                .exchange_delete(&self.exchange, ExchangeDeleteOptions::default())
                .await;
        }
        let _ = self.connection.close(200, "test done").await;
    }
}

fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

fn to_received(d: &outbox_amqp::lapin::message::Delivery) -> Received {
    let mut headers = BTreeMap::new();
    for (name, value) in d.properties.headers().iter().flat_map(|t| t.inner()) {
        if let Some(v) = text(value) {
            headers.insert(name.as_str().to_owned(), v);
        }
    }
    let message_id = d.properties.message_id().as_ref().map(|s| s.as_str());
    Received {
        message_id: message_id.and_then(|s| s.parse().ok()),
        event_id_header: headers
            .get(outbox_amqp::HEADER_EVENT_ID)
            .and_then(|v| v.parse().ok()),
        event_type: d.properties.kind().as_ref().map(|s| s.as_str().to_owned()),
        key: headers.get(outbox_amqp::HEADER_KEY).cloned(),
        payload: d.data.clone(),
        partition: None,
        headers,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_to_rabbitmq() {
    run_end_to_end::<SqliteApp, Rabbit>().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_to_rabbitmq() {
    run_end_to_end::<PostgresApp, Rabbit>().await;
}
