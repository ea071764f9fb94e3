//! The broker side: topology, a publisher (the relay's [`Sink`]) and a real
//! consumer. Each broker's is the shared fixture of `outbox-testkit` (the
//! same one its publisher conformance suite uses); this file only adapts
//! the three fixtures to [`Broker`].

use outbox_core::Sink;
use outbox_testkit::amqp::AmqpFixture;
use outbox_testkit::kafka::KafkaFixture;
use outbox_testkit::nats::NatsFixture;
use std::future::Future;

pub use outbox_testkit::broker::Received;

/// A real broker for one test: its own stream / queue / topic.
/// [`Broker::start`] fails the test with a clear message when the broker
/// cannot be reached.
pub trait Broker: Sized + Send + Sync + 'static {
    /// The publisher the relay delivers through.
    type Sink: Sink;

    /// Broker name for messages (`nats`, `amqp`, `kafka`).
    const NAME: &'static str;

    /// Creates this test's destination (stream, exchange + queue, topic).
    fn start() -> impl Future<Output = Self> + Send;

    /// The topic the application writes in its events; the publisher maps it
    /// to this test's destination.
    fn topic(&self) -> String;

    /// A connected publisher.
    fn sink(&self) -> impl Future<Output = Self::Sink> + Send;

    /// Consumes with a real consumer until `expected` messages arrived
    /// (bounded; a shortfall is reported by the caller's comparison), then
    /// makes sure nothing else is waiting in the destination (an extra
    /// message is returned too). Order: delivery order of the stream /
    /// queue; for Kafka, partition by partition in offset order.
    fn consume(&self, expected: usize) -> impl Future<Output = Vec<Received>> + Send;

    /// Deletes what [`Broker::start`] created.
    fn cleanup(self) -> impl Future<Output = ()> + Send;
}

impl Broker for NatsFixture {
    type Sink = outbox_nats::NatsPublisher;
    const NAME: &'static str = "nats";

    async fn start() -> Self {
        NatsFixture::new().await
    }

    fn topic(&self) -> String {
        NatsFixture::topic(self)
    }

    async fn sink(&self) -> Self::Sink {
        NatsFixture::sink(self).await
    }

    async fn consume(&self, expected: usize) -> Vec<Received> {
        self.drain(expected).await
    }

    async fn cleanup(self) {
        NatsFixture::cleanup(&self).await;
    }
}

impl Broker for AmqpFixture {
    type Sink = outbox_amqp::AmqpPublisher;
    const NAME: &'static str = "amqp";

    async fn start() -> Self {
        AmqpFixture::new().await
    }

    fn topic(&self) -> String {
        AmqpFixture::topic(self)
    }

    async fn sink(&self) -> Self::Sink {
        AmqpFixture::sink(self).await
    }

    async fn consume(&self, expected: usize) -> Vec<Received> {
        self.drain(expected).await
    }

    async fn cleanup(self) {
        AmqpFixture::cleanup(&self).await;
    }
}

impl Broker for KafkaFixture {
    type Sink = outbox_kafka::KafkaPublisher;
    const NAME: &'static str = "kafka";

    async fn start() -> Self {
        KafkaFixture::new().await
    }

    fn topic(&self) -> String {
        KafkaFixture::topic(self)
    }

    async fn sink(&self) -> Self::Sink {
        // The publisher's own defaults (30 s delivery timeout), as a user runs it.
        outbox_kafka::KafkaPublisher::new(outbox_kafka::KafkaConfig::new(self.brokers()))
            .expect("create the Kafka publisher")
    }

    async fn consume(&self, expected: usize) -> Vec<Received> {
        self.drain(expected).await
    }

    async fn cleanup(self) {
        KafkaFixture::cleanup(&self).await;
    }
}
