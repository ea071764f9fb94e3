//! The wire-format cases every publisher runs against its real broker:
//! the event they publish, and what a message must hold in each format.

use super::{event, Received};
use base64::Engine as _;
use outbox_core::{headers, Envelope, Event, InboundMessage, WireFormat};
use outbox_core::{ENVELOPE_CONTENT_TYPE, ENVELOPE_MARKER};
use prost::Message as _;
use std::collections::BTreeMap;

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

/// The CloudEvents `source` the CloudEvents cases configure.
pub const CE_SOURCE: &str = "https://example.com/outbox/orders";

/// A CloudEvent as a consumer built from the CloudEvents specifications
/// reads it, independently of `outbox_core`'s decoder: the attributes by
/// name, the data's content type and the data bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecReading {
    /// Every context and extension attribute, as text.
    pub attributes: BTreeMap<String, String>,
    /// `datacontenttype`.
    pub datacontenttype: Option<String>,
    /// The event data: binary mode, the body; structured mode, `data`'s
    /// JSON text or `data_base64` decoded.
    pub data: Vec<u8>,
    /// Whether structured mode carried the data as JSON (`data`).
    pub data_is_json: bool,
}

/// Reads `got` as a CloudEvent, per the protocol bindings (Kafka 1.0,
/// AMQP 1.0, NATS's binary mode) and the JSON event format 1.0: a
/// content type starting `application/cloudevents` means structured mode,
/// the body being the JSON event; otherwise binary mode, every header
/// named `prefix` + attribute being that attribute and the broker's content
/// type being `datacontenttype`.
pub fn read_cloudevent(got: &Received, prefix: &str) -> SpecReading {
    let content_type = got.content_type.clone();
    let structured = content_type.as_deref().is_some_and(|ct| {
        ct.to_ascii_lowercase()
            .starts_with("application/cloudevents")
    });
    if !structured {
        let attributes = got
            .headers
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(prefix)?.to_owned(), v.clone())))
            .collect();
        return SpecReading {
            attributes,
            datacontenttype: content_type,
            data: got.payload.clone(),
            data_is_json: false,
        };
    }
    let object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&got.payload).expect("a structured body is a JSON object");
    let mut attributes = BTreeMap::new();
    let mut data = Vec::new();
    let mut data_is_json = false;
    for (name, value) in object {
        match (name.as_str(), value) {
            ("data", v) => {
                data = serde_json::to_vec(&v).unwrap();
                data_is_json = true;
            }
            ("data_base64", serde_json::Value::String(b)) => {
                data = base64::engine::general_purpose::STANDARD
                    .decode(b)
                    .expect("data_base64 is base64");
            }
            (_, serde_json::Value::String(s)) => {
                attributes.insert(name, s);
            }
            (_, other) => panic!("attribute {name} is not a string: {other}"),
        }
    }
    let datacontenttype = attributes.remove("datacontenttype");
    SpecReading {
        attributes,
        datacontenttype,
        data,
        data_is_json,
    }
}

/// `read` is [`traced_event`] `e` under the outbox's CloudEvents mapping:
/// every required attribute (`specversion` 1.0, `id` the event id,
/// `source` [`CE_SOURCE`], `type`), `time` the creation time, `subject` and
/// `partitionkey` the key, `traceparent` the trace context,
/// `datacontenttype` the payload's, and the payload's bytes as the data.
pub fn assert_cloudevent(read: &SpecReading, e: &Event) {
    let a = |name: &str| read.attributes.get(name).map(String::as_str);
    assert_eq!(a("specversion"), Some("1.0"), "{read:?}");
    let id = e.id.to_string();
    assert_eq!(a("id"), Some(id.as_str()));
    assert_eq!(a("source"), Some(CE_SOURCE));
    assert_eq!(a("type"), Some("order.created"));
    let time = chrono::DateTime::parse_from_rfc3339(a("time").expect("a time attribute"))
        .expect("time is RFC 3339");
    assert_eq!(time, e.created_at);
    assert_eq!(a("subject"), Some("order-7"));
    assert_eq!(a("partitionkey"), Some("order-7"));
    assert_eq!(
        a("traceparent"),
        e.headers.get("traceparent").map(String::as_str)
    );
    assert_eq!(read.datacontenttype.as_deref(), Some("application/json"));
    if read.data_is_json {
        // JSON data: the same JSON value (the JSON format may re-space it).
        let want: serde_json::Value = serde_json::from_slice(&e.payload).unwrap();
        let got: serde_json::Value = serde_json::from_slice(&read.data).unwrap();
        assert_eq!(got, want);
    } else {
        assert_eq!(read.data, e.payload);
    }
    // Attribute names are valid: lower-case letters and digits.
    for name in read.attributes.keys() {
        assert!(
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()),
            "attribute name {name:?}"
        );
    }
}

/// `got` carries [`traced_event`] `e` as a CloudEvent in `format`, read by
/// the spec reader with the binding's `prefix` and by the one decoder;
/// the `Outbox-*` headers are not sent. Returns the spec reading.
pub fn assert_cloudevents_format(
    got: &Received,
    e: &Event,
    format: WireFormat,
    prefix: &str,
) -> SpecReading {
    let read = read_cloudevent(got, prefix);
    assert_cloudevent(&read, e);
    match format {
        WireFormat::CloudEvents => {
            assert_eq!(got.payload, e.payload, "binary mode: the body untouched");
            assert!(!read.data_is_json);
        }
        _ => {
            assert_eq!(
                got.content_type.as_deref(),
                Some("application/cloudevents+json; charset=UTF-8")
            );
            assert!(read.data_is_json, "JSON data is embedded as JSON");
            // The structured body holds the payload's own bytes.
            let body = String::from_utf8(got.payload.clone()).unwrap();
            assert!(
                body.contains(std::str::from_utf8(&e.payload).unwrap()),
                "{body}"
            );
        }
    }
    assert!(got.headers.keys().all(|k| !k.starts_with("Outbox-")));
    let mut headers: Vec<(&str, &str)> = got
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    if let (false, Some(ct)) = (got.headers.contains_key("content-type"), &got.content_type) {
        headers.push(("content-type", ct));
    }
    let inbound = InboundMessage::decode(headers, &got.payload, &e.topic, None)
        .expect("the CloudEvent decodes");
    assert_eq!(inbound.format, format);
    assert_eq!(inbound.id, e.id);
    assert_eq!(inbound.key.as_deref(), Some("order-7"));
    assert_eq!(inbound.event_type, "order.created");
    assert_eq!(inbound.content_type, "application/json");
    assert_eq!(inbound.payload, e.payload);
    assert_eq!(
        inbound.headers.get("traceparent"),
        e.headers.get("traceparent")
    );
    read
}
