//! The RabbitMQ fixture (feature `amqp`): a topic exchange and a queue bound
//! to it per test, a publisher configured for them, and a reader.

use crate::broker::{amqp_url, first_socket_addr, unique_suffix, Received};
use crate::publisher::PublisherHarness;
use outbox_amqp::lapin::options::{
    BasicGetOptions, ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use outbox_amqp::lapin::types::{AMQPValue, FieldTable};
use outbox_amqp::lapin::{self, Connection, ConnectionProperties};
use outbox_amqp::{AmqpConfig, AmqpPublisher};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How long a read waits for messages that have not arrived yet.
const READ_BOUND: Duration = Duration::from_secs(30);

/// The largest message the fixture's publisher config accepts.
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

/// A durable topic exchange and a durable queue of this test alone
/// (`outbox-test-<random>`), the queue bound with the routing key
/// [`AmqpFixture::topic`], on the broker at `AMQP_URL`.
#[derive(Debug)]
pub struct AmqpFixture {
    url: String,
    exchange: String,
    queue: String,
    connection: Connection,
    channel: lapin::Channel,
}

impl AmqpFixture {
    /// Connects to `AMQP_URL`, declares the exchange and the queue; panics
    /// with a clear message when the broker cannot be reached.
    pub async fn new() -> Self {
        let url = amqp_url();
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "RabbitMQ is not reachable at {} ({e}); start it (`cargo xtask services`) or set AMQP_URL",
                    outbox_core::redact_url(&url)
                )
            });
        let channel = connection.create_channel().await.expect("channel");
        let name = format!("outbox-test-{}", unique_suffix());
        let f = Self {
            url,
            exchange: name.clone(),
            queue: name,
            connection,
            channel,
        };
        let p = AmqpPublisher::connect(f.config()).await.expect("connect");
        p.declare_queue(&f.exchange, &f.queue, &f.topic())
            .await
            .expect("declare the test exchange and queue");
        p.close().await;
        f
    }

    /// The broker URI.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The exchange's name.
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// The queue's name.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The topic (= routing key) whose events reach the queue.
    pub fn topic(&self) -> String {
        "orders".to_owned()
    }

    /// A routing key no queue is bound with.
    pub fn unknown_topic(&self) -> String {
        "unbound".to_owned()
    }

    /// The publisher configuration: this exchange, messages up to
    /// [`MAX_MESSAGE_BYTES`].
    pub fn config(&self) -> AmqpConfig {
        self.config_for(&self.url)
    }

    /// [`config`](Self::config) with another URI (e.g. through a proxy).
    pub fn config_for(&self, uri: &str) -> AmqpConfig {
        AmqpConfig::from_url(uri)
            .expect("valid AMQP URI")
            .with_exchange(&self.exchange)
            .with_max_message_bytes(MAX_MESSAGE_BYTES)
    }

    /// The broker URI with its `host:port` replaced by `addr` (credentials
    /// and vhost kept).
    pub fn url_via(&self, addr: SocketAddr) -> String {
        let (scheme, rest) = self.url.split_once("://").expect("scheme");
        let end = rest.find('/').unwrap_or(rest.len());
        let (authority, path) = rest.split_at(end);
        let userinfo = authority.rfind('@').map_or("", |at| &authority[..=at]);
        format!("{scheme}://{userinfo}{addr}{path}")
    }

    /// A connected publisher.
    pub async fn sink(&self) -> AmqpPublisher {
        AmqpPublisher::connect(self.config())
            .await
            .expect("connect the publisher")
    }

    /// The broker's TCP address.
    pub fn broker_addr(&self) -> SocketAddr {
        first_socket_addr(&self.url, 5672)
    }

    /// The fixture's own channel.
    pub fn channel(&self) -> &lapin::Channel {
        &self.channel
    }

    /// The next `n` messages of `queue` (no-ack gets, in queue order).
    /// Panics when they do not arrive within 30 s.
    pub async fn next_from(&self, queue: &str, n: usize) -> Vec<lapin::message::Delivery> {
        let got = self.get(queue, n).await;
        assert_eq!(
            got.len(),
            n,
            "only {} of {n} messages arrived in queue {queue}",
            got.len()
        );
        got
    }

    /// The next `n` messages of the fixture's queue.
    pub async fn next(&self, n: usize) -> Vec<Received> {
        self.next_from(&self.queue, n)
            .await
            .iter()
            .map(received)
            .collect()
    }

    /// At least `expected` messages if they arrive within 30 s (fewer
    /// otherwise, for the caller's comparison to name), and every message
    /// left in the queue beyond them.
    pub async fn drain(&self, expected: usize) -> Vec<Received> {
        let mut out: Vec<Received> = self
            .get(&self.queue, expected)
            .await
            .iter()
            .map(received)
            .collect();
        let left = self.message_count().await;
        out.extend(
            self.get(&self.queue, left as usize)
                .await
                .iter()
                .map(received),
        );
        out
    }

    /// Messages ready in the fixture's queue.
    pub async fn message_count(&self) -> u32 {
        self.channel
            .queue_declare(
                &self.queue,
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("passive queue declare")
            .message_count()
    }

    async fn get(&self, queue: &str, n: usize) -> Vec<lapin::message::Delivery> {
        let mut out = Vec::with_capacity(n);
        let deadline = Instant::now() + READ_BOUND;
        while out.len() < n && Instant::now() < deadline {
            let got = self
                .channel
                .basic_get(queue, BasicGetOptions { no_ack: true })
                .await
                .expect("basic.get");
            match got {
                Some(m) => out.push(m.delivery),
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        out
    }

    /// Deletes the queue and the exchange.
    pub async fn cleanup(&self) {
        let _ = self
            .channel
            .queue_delete(&self.queue, QueueDeleteOptions::default())
            .await;
        let _ = self
            .channel
            .exchange_delete(&self.exchange, ExchangeDeleteOptions::default())
            .await;
        let _ = self.connection.close(200, "test done").await;
    }
}

/// The fixture is the publisher conformance suite's harness: a proxied
/// sink connects with two short attempts and waits 5 s for a confirm; an
/// unreachable one is built lazily with a 1 s connect timeout.
impl PublisherHarness for AmqpFixture {
    type Sink = AmqpPublisher;

    fn topic(&self) -> String {
        AmqpFixture::topic(self)
    }

    fn unknown_topic(&self) -> String {
        AmqpFixture::unknown_topic(self)
    }

    fn max_payload_bytes(&self) -> usize {
        MAX_MESSAGE_BYTES
    }

    fn broker_addr(&self) -> SocketAddr {
        AmqpFixture::broker_addr(self)
    }

    async fn sink(&self) -> AmqpPublisher {
        AmqpFixture::sink(self).await
    }

    async fn sink_via(&self, addr: SocketAddr) -> AmqpPublisher {
        let config = self
            .config_for(&self.url_via(addr))
            .with_connect_attempts(2)
            .with_connect_timeout(Duration::from_secs(2))
            .with_confirm_timeout(Duration::from_secs(5));
        AmqpPublisher::connect(config).await.unwrap()
    }

    async fn sink_unreachable(&self, addr: SocketAddr) -> AmqpPublisher {
        let config = self
            .config_for(&self.url_via(addr))
            .with_connect_timeout(Duration::from_secs(1));
        AmqpPublisher::lazy(config)
    }

    async fn consume(&self, n: usize) -> Vec<Received> {
        self.next(n).await
    }

    async fn cleanup(&self) {
        AmqpFixture::cleanup(self).await;
    }
}

fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// A delivered AMQP message in broker-neutral form.
pub fn received(d: &lapin::message::Delivery) -> Received {
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
            .get(outbox_core::headers::EVENT_ID)
            .and_then(|v| v.parse().ok()),
        event_type: d.properties.kind().as_ref().map(|s| s.as_str().to_owned()),
        key: headers.get(outbox_core::headers::KEY).cloned(),
        payload: d.data.clone(),
        partition: None,
        offset: None,
        content_type: d
            .properties
            .content_type()
            .as_ref()
            .map(|s| s.as_str().to_owned()),
        headers,
    }
}
