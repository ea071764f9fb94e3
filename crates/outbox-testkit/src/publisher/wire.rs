//! The wire-format cases every publisher runs against its real broker:
//! the event they publish, and what a message must hold in each format.

use super::{event, Received};
use outbox_core::wire::{ENVELOPE_CONTENT_TYPE, ENVELOPE_MARKER};
use outbox_core::{headers, Envelope, Event, InboundMessage, WireFormat};
use prost::Message as _;

/// An `order.created` event of key `order-7` on `topic`: a JSON payload
/// with its content type, and a W3C trace context header.
pub fn traced_event(topic: &str) -> Event {
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

/// `got` carries [`traced_event`] `e` in the envelope format: the headers
/// say protobuf and name the format, the key is unchanged, the body is
/// the event's `Envelope`, and the one decoder reads it back (`source`:
/// the subject, queue or topic it was read from).
pub fn assert_envelope(got: &Received, e: &Event, source: &str) {
    assert_eq!(
        got.headers.get(headers::CONTENT_TYPE).map(String::as_str),
        Some(ENVELOPE_CONTENT_TYPE)
    );
    assert_eq!(
        got.headers.get(headers::WIRE_FORMAT).map(String::as_str),
        Some(ENVELOPE_MARKER)
    );
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
        source,
        None,
    )
    .expect("the envelope decodes");
    assert_eq!(inbound.format, WireFormat::Envelope);
    assert_eq!(inbound.id, e.id);
    assert_eq!(inbound.topic, e.topic);
    assert_eq!(inbound.content_type, "application/json");
    assert_eq!(inbound.payload, e.payload);
}

/// `got` carries [`traced_event`] `e` in the default format: the payload
/// as the body, its content type and trace context as headers, no format
/// marker.
pub fn assert_headers_format(got: &Received, e: &Event) {
    assert_eq!(got.payload, e.payload);
    assert_eq!(
        got.headers.get(headers::CONTENT_TYPE).map(String::as_str),
        Some("application/json")
    );
    assert!(!got.headers.contains_key(headers::WIRE_FORMAT));
    assert_eq!(got.headers.get("traceparent"), e.headers.get("traceparent"));
}
