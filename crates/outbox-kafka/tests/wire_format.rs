//! `KafkaConfig::with_wire_format`: the envelope format against a real
//! Kafka-protocol broker (Tansu) on `KAFKA_BROKERS` (default
//! `127.0.0.1:9092`), each test on its own topic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_core::{Outcome, Sink, WireFormat};
use outbox_kafka::KafkaPublisher;
use outbox_testkit::kafka::KafkaFixture;
use outbox_testkit::publisher::wire::{assert_envelope, assert_headers_format, traced_event};
use std::sync::Arc;

/// Runs `case` on a fresh topic, deleted afterwards (also after a panic).
async fn with_fixture<F, Fut>(case: F)
where
    F: FnOnce(Arc<KafkaFixture>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let h = Arc::new(KafkaFixture::new().await);
    let result = tokio::spawn(case(h.clone())).await;
    h.cleanup().await;
    if let Err(e) = result {
        std::panic::resume_unwind(e.into_panic());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn envelope_format_publishes_the_protobuf_envelope() {
    with_fixture(|h| async move {
        let config = h.config().with_wire_format(WireFormat::Envelope);
        assert_eq!(config.wire_format(), WireFormat::Envelope);
        let sink = KafkaPublisher::new(config).unwrap();
        let e = traced_event(&h.topic());
        assert_eq!(
            sink.deliver(std::slice::from_ref(&e)).await,
            vec![Outcome::Delivered]
        );
        let got = &h.next(1).await[0];
        assert_envelope(got, &e, "ignored");
        // The id header is unchanged (the record key: in assert_envelope).
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

fn ce_source() -> outbox_core::cloudevents::Source {
    outbox_testkit::publisher::wire::CE_SOURCE.parse().unwrap()
}

/// Both CloudEvents modes, read back by the spec-written reader (`ce_`
/// headers, `content-type` the data's) and by the one decoder; the record
/// key is still the event key.
#[tokio::test(flavor = "multi_thread")]
async fn cloudevents_formats_are_read_by_a_spec_reader() {
    use outbox_testkit::publisher::wire::assert_cloudevents_format;
    with_fixture(|h| async move {
        for format in [WireFormat::CloudEvents, WireFormat::CloudEventsJson] {
            let config = h
                .config()
                .with_wire_format(format)
                .with_cloudevents_source(ce_source());
            let sink = KafkaPublisher::new(config).unwrap();
            let e = traced_event(&h.topic());
            assert_eq!(
                sink.deliver(std::slice::from_ref(&e)).await,
                vec![Outcome::Delivered]
            );
            let got = &h.next(1).await[0];
            let read = assert_cloudevents_format(got, &e, format, "ce_");
            if format == WireFormat::CloudEvents {
                assert_eq!(
                    got.headers.get("content-type").map(String::as_str),
                    Some("application/json")
                );
                assert!(read.attributes.contains_key("traceparent"));
            }
            assert_eq!(got.key.as_deref(), Some("order-7"), "the record key");
        }
    })
    .await;
}

#[test]
fn cloudevents_without_a_source_is_refused() {
    let config = outbox_kafka::KafkaConfig::new("127.0.0.1:9092")
        .with_wire_format(WireFormat::CloudEventsJson);
    let err = KafkaPublisher::new(config).unwrap_err();
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("CloudEvents source"), "{err}");
}
