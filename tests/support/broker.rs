//! The broker side: topology, a publisher (the relay's [`Sink`]) and a real
//! consumer, one implementation per broker in its test file.

use outbox_core::{EventId, Sink};
use std::collections::BTreeMap;
use std::future::Future;

/// One message as a real consumer received it, in broker-neutral terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The broker's deduplication / message id parsed as an event id
    /// (`Nats-Msg-Id`, AMQP `message_id`; for Kafka the `outbox-event-id`
    /// header, Kafka having no message id).
    pub message_id: Option<EventId>,
    /// The event id header the publisher adds (`Outbox-Event-Id`,
    /// `outbox-event-id`), parsed.
    pub event_id_header: Option<EventId>,
    /// Event type (header or AMQP `type` property).
    pub event_type: Option<String>,
    /// Event key (the Kafka message key; the `Outbox-Key` header elsewhere).
    pub key: Option<String>,
    /// Payload bytes.
    pub payload: Vec<u8>,
    /// Every header / application property as text.
    pub headers: BTreeMap<String, String>,
    /// Kafka partition (`None` on brokers with one ordered queue / stream).
    pub partition: Option<i32>,
}

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
