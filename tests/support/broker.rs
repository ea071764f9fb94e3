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

/// Implements [`Broker`] for one of the testkit's fixtures: their inherent
/// `new`, `topic`, `drain` and `cleanup` are the trait's methods; only how
/// the publisher is made (`|fixture| expression`) differs per broker.
macro_rules! fixture_broker {
    ($fixture:ident, $sink:ty, $name:literal, |$f:ident| $make_sink:expr) => {
        impl Broker for $fixture {
            type Sink = $sink;
            const NAME: &'static str = $name;

            async fn start() -> Self {
                $fixture::new().await
            }

            fn topic(&self) -> String {
                $fixture::topic(self)
            }

            async fn sink(&self) -> Self::Sink {
                let $f = self;
                $make_sink
            }

            async fn consume(&self, expected: usize) -> Vec<Received> {
                self.drain(expected).await
            }

            async fn cleanup(self) {
                $fixture::cleanup(&self).await;
            }
        }
    };
}

fixture_broker!(NatsFixture, outbox_nats::NatsPublisher, "nats", |f| {
    NatsFixture::sink(f).await
});

fixture_broker!(AmqpFixture, outbox_amqp::AmqpPublisher, "amqp", |f| {
    AmqpFixture::sink(f).await
});

// The publisher's own defaults (30 s delivery timeout), as a user runs it.
fixture_broker!(KafkaFixture, outbox_kafka::KafkaPublisher, "kafka", |f| {
    outbox_kafka::KafkaPublisher::new(outbox_kafka::KafkaConfig::new(f.brokers()))
        .expect("create the Kafka publisher")
});
