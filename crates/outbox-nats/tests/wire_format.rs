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

/// The next `n` messages of `consumer`'s stream, as the raw
/// `async_nats::Message`s a JetStream consumer receives (headers and body
/// as stored). Panics when they do not arrive within 10 s.
async fn raw_messages(
    consumer: &outbox_nats::async_nats::jetstream::consumer::PullConsumer,
    n: usize,
) -> Vec<outbox_nats::async_nats::Message> {
    use futures::StreamExt as _;
    let batch = consumer
        .batch()
        .max_messages(n)
        .expires(std::time::Duration::from_secs(10))
        .messages()
        .await
        .unwrap();
    let got: Vec<_> = batch.map(|m| m.unwrap().message).collect().await;
    assert_eq!(got.len(), n, "only {} of {n} messages arrived", got.len());
    got
}

/// The CloudEvents Rust SDK (`cloudevents-sdk` 0.9, feature `nats`, on the
/// workspace's async-nats 0.42) reads the structured mode
/// (`WireFormat::CloudEventsJson`) the real `NatsPublisher` sends: the raw
/// JetStream messages through `cloudevents::binding::nats::MessageExt::to_event`,
/// checked with the SDK's own `Event` accessors. Every attribute of the
/// outbox's mapping, both extensions and no others, and the data: a JSON
/// payload as JSON data (`data`), a JSON payload the format cannot embed
/// byte for byte (`data_base64`) as the JSON value the SDK decodes it to,
/// and a binary payload as binary data.
///
/// The SDK's NATS binding reads the structured mode only: `to_event`
/// parses the body as the JSON event format and ignores the headers, so
/// binary mode (`WireFormat::CloudEvents`, `ce-` headers) is not something
/// it reads; the case checks that it refuses such a message rather than
/// misreads it (should a later SDK read binary mode, extend this case).
/// That mode, and Kafka's CloudEvents in both modes, are read by the
/// testkit's spec-written reader (`cloudevents_formats_are_read_by_a_spec_reader`):
/// the SDK's `rdkafka` binding needs rdkafka 0.38, the workspace has 0.37.
#[tokio::test(flavor = "multi_thread")]
async fn cloudevents_json_is_read_by_the_cloudevents_sdk() {
    use cloudevents::binding::nats::MessageExt as _;
    use cloudevents::event::{ExtensionValue, SpecVersion};
    use cloudevents::{AttributesReader as _, Data};
    use outbox_nats::async_nats::jetstream::consumer::{
        pull, AckPolicy, DeliverPolicy, PullConsumer,
    };
    use outbox_testkit::publisher::wire::CE_SOURCE;
    with_fixture(|h| async move {
        let stream = h.jetstream().get_stream(h.stream()).await.unwrap();
        let consumer: PullConsumer = stream
            .create_consumer(pull::Config {
                deliver_policy: DeliverPolicy::All,
                ack_policy: AckPolicy::None,
                ..Default::default()
            })
            .await
            .unwrap();

        // Structured mode: a JSON payload the format embeds as `data`, one
        // it cannot embed byte for byte (surrounding whitespace:
        // `data_base64`), and a binary payload (`data_base64`).
        let json = traced_event(&h.topic());
        let mut spaced = traced_event(&h.topic());
        spaced.payload = b" {\"total\": 42}\n".to_vec();
        let mut binary = traced_event(&h.topic());
        binary.payload = vec![0x00, 0x9f, 0x92, 0x96, 0xff, b'{', b'"'];
        binary.headers.insert(
            "content-type".to_owned(),
            "application/octet-stream".to_owned(),
        );
        let events = [json, spaced, binary];
        let structured = NatsPublisher::connect(
            h.config()
                .with_wire_format(WireFormat::CloudEventsJson)
                .with_cloudevents_source(ce_source()),
        )
        .await
        .unwrap();
        assert_eq!(
            structured.deliver(&events).await,
            vec![Outcome::Delivered; events.len()]
        );
        let got = raw_messages(&consumer, events.len()).await;
        for m in &got {
            let ce = m.to_event().expect("the SDK reads the structured event");
            let e = events
                .iter()
                .find(|e| e.id.to_string() == ce.id())
                .unwrap_or_else(|| panic!("no event of id {}", ce.id()));
            assert_eq!(ce.specversion(), SpecVersion::V10);
            assert_eq!(ce.source(), CE_SOURCE);
            assert_eq!(ce.ty(), "order.created");
            assert_eq!(ce.subject(), Some("order-7"));
            assert_eq!(ce.subject(), e.key.as_deref());
            assert_eq!(ce.time(), Some(&e.created_at));
            assert_eq!(ce.dataschema(), None);
            assert_eq!(
                ce.datacontenttype(),
                e.headers.get("content-type").map(String::as_str)
            );
            assert_eq!(
                ce.extension("partitionkey"),
                Some(&ExtensionValue::String("order-7".to_owned()))
            );
            assert_eq!(
                ce.extension("traceparent"),
                Some(&ExtensionValue::String(e.headers["traceparent"].clone()))
            );
            let mut extensions: Vec<&str> = ce.iter_extensions().map(|(n, _)| n).collect();
            extensions.sort_unstable();
            assert_eq!(extensions, ["partitionkey", "traceparent"]);
            let body = std::str::from_utf8(&m.payload).unwrap();
            match ce.data() {
                // `data`: the payload's JSON (compact, so its text is the
                // value's serialisation).
                Some(Data::Json(v)) if e.id == events[0].id => {
                    assert!(body.contains(",\"data\":{"), "{body}");
                    assert_eq!(v.to_string().as_bytes(), e.payload.as_slice());
                }
                // `data_base64` of a JSON content type: the SDK decodes
                // the bytes and keeps the JSON value, not the bytes.
                Some(Data::Json(v)) if e.id == events[1].id => {
                    assert!(body.contains(",\"data_base64\":"), "{body}");
                    assert_eq!(v.to_string(), "{\"total\":42}");
                }
                Some(Data::Binary(b)) if e.id == events[2].id => {
                    assert!(body.contains(",\"data_base64\":"), "{body}");
                    assert_eq!(b, &e.payload);
                }
                other => panic!("event {}: data {other:?}", ce.id()),
            }
        }

        // Binary mode: the SDK reads the body as a JSON event, and the
        // body is the payload, so it refuses the message.
        let e = traced_event(&h.topic());
        let binary_mode = NatsPublisher::connect(
            h.config()
                .with_wire_format(WireFormat::CloudEvents)
                .with_cloudevents_source(ce_source()),
        )
        .await
        .unwrap();
        assert_eq!(
            binary_mode.deliver(std::slice::from_ref(&e)).await,
            vec![Outcome::Delivered]
        );
        let m = &raw_messages(&consumer, 1).await[0];
        let id = e.id.to_string();
        assert_eq!(
            m.headers
                .as_ref()
                .and_then(|h| h.get("ce-id"))
                .map(|v| v.as_str()),
            Some(id.as_str()),
            "a binary-mode message"
        );
        match m.to_event() {
            Err(err) => assert!(err.to_string().contains("specversion"), "{err}"),
            Ok(ce) => panic!("the SDK's NATS binding now reads binary mode, check it here: {ce}"),
        }
    })
    .await;
}
