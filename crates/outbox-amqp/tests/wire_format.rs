//! `AmqpConfig::with_wire_format`: the envelope format against the real
//! RabbitMQ at `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! each test with its own exchange and queue.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use lapin::types::ShortString;
use outbox_amqp::AmqpPublisher;
use outbox_core::wire::{ENVELOPE_CONTENT_TYPE, ENVELOPE_MARKER};
use outbox_core::{
    headers, BrokerMessage, Envelope, ErrorCode, Event, EventId, InboundMessage, Outcome, Sink,
    WireFormat,
};
use outbox_testkit::amqp::{received, AmqpFixture};
use outbox_testkit::publisher::event;
use prost::Message as _;
use std::sync::Arc;

async fn with_fixture<F, Fut>(f: F)
where
    F: FnOnce(Arc<AmqpFixture>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let h = Arc::new(AmqpFixture::new().await);
    outbox_testkit::publisher::run_case(h, f).await;
}

fn traced_event(topic: &str) -> Event {
    let mut e = event(topic, Some("order-7"), b"{\"total\":42}".to_vec());
    e.event_type = "order.created".into();
    e.headers = [
        ("content-type".to_owned(), "application/json".to_owned()),
        (
            "traceparent".to_owned(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
        ),
    ]
    .into();
    e
}

fn content_type(d: &lapin::message::Delivery) -> Option<&str> {
    d.properties
        .content_type()
        .as_ref()
        .map(ShortString::as_str)
}

#[tokio::test(flavor = "multi_thread")]
async fn envelope_format_publishes_the_protobuf_envelope() {
    with_fixture(|h| async move {
        let config = h.config().with_wire_format(WireFormat::Envelope);
        assert_eq!(config.wire_format(), WireFormat::Envelope);
        let sink = AmqpPublisher::connect(config).await.unwrap();
        let e = traced_event(&h.topic());
        assert_eq!(
            sink.deliver(std::slice::from_ref(&e)).await,
            vec![Outcome::Delivered]
        );
        let delivery = &h.next_from(h.queue(), 1).await[0];
        // The AMQP property and the header both say protobuf.
        assert_eq!(content_type(delivery), Some(ENVELOPE_CONTENT_TYPE));
        let got = received(delivery);
        assert_eq!(
            got.headers.get(headers::CONTENT_TYPE).map(String::as_str),
            Some(ENVELOPE_CONTENT_TYPE)
        );
        assert_eq!(
            got.headers.get(headers::WIRE_FORMAT).map(String::as_str),
            Some(ENVELOPE_MARKER)
        );
        // message_id, type and key are unchanged.
        assert_eq!(got.message_id, Some(e.id));
        assert_eq!(got.event_type.as_deref(), Some("order.created"));
        assert_eq!(got.key.as_deref(), Some("order-7"));
        let env = Envelope::decode(got.payload.as_slice()).expect("the body is an Envelope");
        assert_eq!(env.id, e.id.to_string());
        assert_eq!(env.key, "order-7");
        assert_eq!(env.event_type, "order.created");
        assert_eq!(env.topic, e.topic);
        assert_eq!(env.payload, e.payload);
        assert_eq!(env.headers, e.headers);
        assert_eq!(env.created_at_unix_ms, e.created_at.timestamp_millis());
        assert_eq!(env.attempt, 1);
        let inbound = InboundMessage::decode(
            got.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            &got.payload,
            h.queue(),
            None,
        )
        .unwrap();
        assert_eq!(inbound.format, WireFormat::Envelope);
        assert_eq!(inbound.id, e.id);
        assert_eq!(inbound.topic, e.topic);
        assert_eq!(inbound.content_type, "application/json");
        assert_eq!(inbound.payload, e.payload);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn default_format_is_unchanged() {
    with_fixture(|h| async move {
        assert_eq!(h.config().wire_format(), WireFormat::Headers);
        let sink = h.sink().await;
        let e = traced_event(&h.topic());
        assert_eq!(
            sink.deliver(std::slice::from_ref(&e)).await,
            vec![Outcome::Delivered]
        );
        let delivery = &h.next_from(h.queue(), 1).await[0];
        assert_eq!(content_type(delivery), Some("application/json"));
        let got = received(delivery);
        assert_eq!(got.payload, e.payload);
        assert!(!got.headers.contains_key(headers::WIRE_FORMAT));
        assert_eq!(got.headers.get("traceparent"), e.headers.get("traceparent"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn max_message_bytes_applies_to_the_envelope() {
    with_fixture(|h| async move {
        let mut e = traced_event(&h.topic());
        e.payload = vec![b'x'; 1000];
        // Exactly at the limit as a bare payload; over it once wrapped.
        let plain = AmqpPublisher::connect(h.config().with_max_message_bytes(1000))
            .await
            .unwrap();
        assert_eq!(
            plain.deliver(std::slice::from_ref(&e)).await,
            vec![Outcome::Delivered]
        );
        let wrapped = AmqpPublisher::connect(
            h.config()
                .with_max_message_bytes(1000)
                .with_wire_format(WireFormat::Envelope),
        )
        .await
        .unwrap();
        let mut again = e.clone();
        again.id = EventId::new();
        let size = BrokerMessage::new(&again)
            .with_format(WireFormat::Envelope)
            .body()
            .len();
        match &wrapped.deliver(std::slice::from_ref(&again)).await[0] {
            Outcome::Failed(err) => {
                assert_eq!(err.code(), &ErrorCode::PUBLISH_TOO_LARGE);
                assert!(!err.is_retryable());
                assert!(err.message().contains(&format!("{size} bytes")), "{err}");
            }
            other => panic!("{other:?}"),
        }
        let got = h.next_from(h.queue(), 1).await;
        assert_eq!(got[0].data, e.payload);
        assert_eq!(h.message_count().await, 0);
    })
    .await;
}
