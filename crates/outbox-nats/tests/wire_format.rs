//! `NatsConfig::with_wire_format`: the envelope format against the real
//! NATS JetStream server at `NATS_URL` (default `nats://127.0.0.1:4222`),
//! each test in its own stream.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_core::{BrokerMessage, Outcome, Sink, WireFormat};
use outbox_nats::NatsPublisher;
use outbox_testkit::nats::NatsFixture;
use outbox_testkit::publisher::wire::{assert_envelope, assert_headers_format, traced_event};
use std::sync::Arc;

async fn with_fixture<F, Fut>(f: F)
where
    F: FnOnce(Arc<NatsFixture>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let h = Arc::new(NatsFixture::new().await);
    outbox_testkit::publisher::run_case(h, f).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn envelope_format_publishes_the_protobuf_envelope() {
    with_fixture(|h| async move {
        let config = h.config().with_wire_format(WireFormat::Envelope);
        assert_eq!(config.wire_format(), WireFormat::Envelope);
        let sink = NatsPublisher::connect(config).await.unwrap();
        let e = traced_event(&h.topic());
        assert_eq!(
            sink.deliver(std::slice::from_ref(&e)).await,
            vec![Outcome::Delivered]
        );
        let got = &h.next(1).await[0];
        assert_envelope(got, &e, "ignored");
        // Broker-side dedup and the id header are unchanged.
        assert_eq!(got.message_id, Some(e.id));
        assert_eq!(got.event_id_header, Some(e.id));
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
        assert_headers_format(&h.next(1).await[0], &e);
    })
    .await;
}

/// Bytes of the NATS header block the publisher sends for `m`
/// (`NATS/1.0`, one line per header, `Nats-Msg-Id`).
fn header_block(m: &BrokerMessage<'_>) -> usize {
    12 + m
        .headers()
        .map(|(k, v)| k.len() + v.len() + 4)
        .sum::<usize>()
        + 11
        + 4
        + 36
}

#[tokio::test(flavor = "multi_thread")]
async fn max_payload_applies_to_the_envelope() {
    with_fixture(|h| async move {
        let max = h.max_payload();
        // A payload that fits as the body, with a little room to spare...
        let mut e = traced_event(&h.topic());
        let room = header_block(&BrokerMessage::new(&e)) + 16;
        e.payload = vec![b'x'; max - room];
        let wrapped = BrokerMessage::new(&e).with_format(WireFormat::Envelope);
        // ...but not once wrapped in the envelope.
        assert!(wrapped.body().len() + header_block(&wrapped) > max);
        let plain = h.sink().await;
        assert_eq!(
            plain.deliver(std::slice::from_ref(&e)).await,
            vec![Outcome::Delivered]
        );
        let envelope = NatsPublisher::connect(h.config().with_wire_format(WireFormat::Envelope))
            .await
            .unwrap();
        let mut again = e.clone();
        again.id = outbox_core::EventId::new();
        match &envelope.deliver(std::slice::from_ref(&again)).await[0] {
            Outcome::Failed(err) => {
                assert_eq!(err.code(), &outbox_core::ErrorCode::PUBLISH_TOO_LARGE);
                assert!(!err.is_retryable());
                assert!(err.message().contains("envelope"), "{err}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(h.stored().await, 1);
    })
    .await;
}

fn ce_source() -> outbox_core::cloudevents::Source {
    outbox_testkit::publisher::wire::CE_SOURCE.parse().unwrap()
}

/// Both CloudEvents modes, read back by the spec-written reader (`ce-`
/// headers, `content-type` the data's) and by the one decoder; JetStream's
/// dedup id is still the event id.
#[tokio::test(flavor = "multi_thread")]
async fn cloudevents_formats_are_read_by_a_spec_reader() {
    use outbox_testkit::publisher::wire::assert_cloudevents_format;
    with_fixture(|h| async move {
        for format in [WireFormat::CloudEvents, WireFormat::CloudEventsJson] {
            let config = h
                .config()
                .with_wire_format(format)
                .with_cloudevents_source(ce_source());
            let sink = NatsPublisher::connect(config).await.unwrap();
            let e = traced_event(&h.topic());
            assert_eq!(
                sink.deliver(std::slice::from_ref(&e)).await,
                vec![Outcome::Delivered]
            );
            let got = &h.next(1).await[0];
            let read = assert_cloudevents_format(got, &e, format, "ce-");
            if format == WireFormat::CloudEvents {
                assert_eq!(
                    got.headers.get("content-type").map(String::as_str),
                    Some("application/json")
                );
                assert!(read.attributes.contains_key("traceparent"));
            }
            assert_eq!(got.message_id, Some(e.id), "Nats-Msg-Id");
            assert_eq!(got.event_id_header, None, "no Outbox-Event-Id");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cloudevents_without_a_source_is_refused_at_start() {
    with_fixture(|h| async move {
        for format in [WireFormat::CloudEvents, WireFormat::CloudEventsJson] {
            let err = NatsPublisher::connect(h.config().with_wire_format(format))
                .await
                .unwrap_err();
            assert!(!err.is_retryable());
            assert!(err.to_string().contains("CloudEvents source"), "{err}");
        }
    })
    .await;
}
