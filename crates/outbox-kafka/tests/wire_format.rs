//! `KafkaConfig::with_wire_format`: the envelope format against a real
//! Kafka-protocol broker (Tansu) on `KAFKA_BROKERS` (default
//! `127.0.0.1:9092`), each test on its own topic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_core::wire::{ENVELOPE_CONTENT_TYPE, ENVELOPE_MARKER};
use outbox_core::{headers, Envelope, Event, InboundMessage, Outcome, Sink, WireFormat};
use outbox_kafka::KafkaPublisher;
use outbox_testkit::kafka::KafkaFixture;
use outbox_testkit::publisher::event;
use prost::Message as _;
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
        assert_eq!(
            got.headers.get(headers::CONTENT_TYPE).map(String::as_str),
            Some(ENVELOPE_CONTENT_TYPE)
        );
        assert_eq!(
            got.headers.get(headers::WIRE_FORMAT).map(String::as_str),
            Some(ENVELOPE_MARKER)
        );
        // The record key (partitioning) and the id header are unchanged.
        assert_eq!(got.key.as_deref(), Some("order-7"));
        assert_eq!(got.event_id_header, Some(e.id));
        let env = Envelope::decode(got.payload.as_slice()).expect("the value is an Envelope");
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
            "ignored",
            None,
        )
        .unwrap();
        assert_eq!(inbound.format, WireFormat::Envelope);
        assert_eq!(inbound.id, e.id);
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
        let got = &h.next(1).await[0];
        assert_eq!(got.payload, e.payload);
        assert_eq!(
            got.headers.get(headers::CONTENT_TYPE).map(String::as_str),
            Some("application/json")
        );
        assert!(!got.headers.contains_key(headers::WIRE_FORMAT));
        assert_eq!(got.headers.get("traceparent"), e.headers.get("traceparent"));
    })
    .await;
}
