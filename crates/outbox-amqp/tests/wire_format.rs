//! `AmqpConfig::with_wire_format`: the envelope format against the real
//! RabbitMQ at `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! each test with its own exchange and queue.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use lapin::types::ShortString;
use outbox_amqp::AmqpPublisher;
use outbox_core::ENVELOPE_CONTENT_TYPE;
use outbox_core::{BrokerMessage, ErrorCode, EventId, Outcome, Sink, WireFormat};
use outbox_testkit::amqp::{received, AmqpFixture};
use outbox_testkit::publisher::wire::{assert_envelope, assert_headers_format, traced_event};
use std::sync::Arc;

async fn with_fixture<F, Fut>(f: F)
where
    F: FnOnce(Arc<AmqpFixture>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let h = Arc::new(AmqpFixture::new().await);
    outbox_testkit::publisher::run_case(h, f).await;
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
        assert_envelope(&got, &e, h.queue());
        // message_id and the type header are unchanged.
        assert_eq!(got.message_id, Some(e.id));
        assert_eq!(got.event_type.as_deref(), Some("order.created"));
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
        assert_headers_format(&received(delivery), &e);
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

fn ce_source() -> outbox_core::cloudevents::Source {
    outbox_testkit::publisher::wire::CE_SOURCE.parse().unwrap()
}

/// Both CloudEvents modes, read back by the spec-written reader
/// (`cloudEvents:` header-table entries, the `content_type` property the
/// data's, no `content-type` header) and by the one decoder; `message_id`
/// is still the event id.
#[tokio::test(flavor = "multi_thread")]
async fn cloudevents_formats_are_read_by_a_spec_reader() {
    use outbox_testkit::publisher::wire::assert_cloudevents_format;
    with_fixture(|h| async move {
        for format in [WireFormat::CloudEvents, WireFormat::CloudEventsJson] {
            let config = h
                .config()
                .with_wire_format(format)
                .with_cloudevents_source(ce_source());
            let sink = AmqpPublisher::connect(config).await.unwrap();
            let e = traced_event(&h.topic());
            assert_eq!(
                sink.deliver(std::slice::from_ref(&e)).await,
                vec![Outcome::Delivered]
            );
            let delivery = &h.next_from(h.queue(), 1).await[0];
            let got = received(delivery);
            let read = assert_cloudevents_format(&got, &e, format, "cloudEvents:");
            assert!(
                !got.headers.contains_key("content-type"),
                "{:?}",
                got.headers
            );
            if format == WireFormat::CloudEvents {
                assert_eq!(content_type(delivery), Some("application/json"));
                assert!(read.attributes.contains_key("traceparent"));
            }
            assert_eq!(got.message_id, Some(e.id), "message_id");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cloudevents_without_a_source_is_refused_at_start() {
    with_fixture(|h| async move {
        let err = AmqpPublisher::connect(h.config().with_wire_format(WireFormat::CloudEvents))
            .await
            .unwrap_err();
        assert!(!err.is_retryable());
        assert!(err.to_string().contains("CloudEvents source"), "{err}");
    })
    .await;
}
