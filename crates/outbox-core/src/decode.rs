//! [`InboundMessage::decode`]: the one decoder of every wire format.
//!
//! The envelope marker header decides first, so an event whose own payload
//! is protobuf is never mistaken for an envelope; then an `Outbox-Event-Id`
//! header means the headers format; then a `content-type` of
//! `application/cloudevents…` means structured mode, and an attribute
//! header binary mode. It sits above both the vocabulary ([`crate::wire`])
//! and the CloudEvents mapping ([`crate::cloudevents`]), which use neither
//! it nor each other's decoding.

use crate::cloudevents::{self, Attributes};
use crate::envelope::Envelope;
use crate::event::EventId;
use crate::headers;
use crate::wire::{DecodeError, InboundMessage, WireFormat, ENVELOPE_MARKER};
use chrono::{DateTime, Utc};
use prost::Message as _;
use std::collections::BTreeMap;

/// The media type prefix of every CloudEvents event format.
const CLOUDEVENTS_MEDIA: &str = "application/cloudevents";

impl InboundMessage {
    /// Decodes a received message: its headers (any letter case), its body,
    /// the destination it came from and the broker's timestamp, if any.
    pub fn decode<'h>(
        received_headers: impl IntoIterator<Item = (&'h str, &'h str)>,
        body: &[u8],
        destination: &str,
        broker_time: Option<DateTime<Utc>>,
    ) -> Result<Self, DecodeError> {
        let mut id = None;
        let mut event_type = None;
        let mut key = None;
        let mut content_type = None;
        let mut envelope = false;
        let mut own = BTreeMap::new();
        let mut attributes = Attributes::default();
        let mut attribute_names = Vec::new();
        for (name, value) in received_headers {
            if let Some(attribute) = cloudevents::attribute_of_header(name) {
                attributes.set(&attribute, value.to_owned());
                attribute_names.push(name);
            }
            if name.eq_ignore_ascii_case(headers::EVENT_ID) {
                id = Some(value);
            } else if name.eq_ignore_ascii_case(headers::EVENT_TYPE) {
                event_type = Some(value);
            } else if name.eq_ignore_ascii_case(headers::KEY) {
                key = Some(value);
            } else if name.eq_ignore_ascii_case(headers::CONTENT_TYPE) {
                content_type = Some(value);
            } else if name.eq_ignore_ascii_case(headers::WIRE_FORMAT) {
                envelope = value.trim() == ENVELOPE_MARKER;
            } else {
                own.insert(name.to_owned(), value.to_owned());
            }
        }
        if envelope {
            return Self::from_envelope(body, broker_time);
        }
        if id.is_none() {
            // No outbox id header: a CloudEvent, if anything. Its plain
            // headers are the others (the attribute headers are read).
            for name in &attribute_names {
                own.remove(*name);
            }
            // The bindings' rule: a content type of the CloudEvents media
            // type means structured mode.
            let media = content_type
                .map(|ct| ct.split(';').next().unwrap_or("").trim())
                .filter(|m| {
                    m.get(..CLOUDEVENTS_MEDIA.len())
                        .is_some_and(|p| p.eq_ignore_ascii_case(CLOUDEVENTS_MEDIA))
                });
            if let Some(media) = media {
                if !media.eq_ignore_ascii_case(cloudevents::JSON_FORMAT) {
                    return Err(DecodeError::InvalidCloudEvent(format!(
                        "event format {media:?} is not supported (only {})",
                        cloudevents::JSON_FORMAT
                    )));
                }
                return cloudevents::decode_structured(body, destination, broker_time, own);
            }
            if !attribute_names.is_empty() {
                return attributes.into_inbound(
                    body.to_vec(),
                    content_type.map(str::to_owned),
                    destination,
                    broker_time,
                    own,
                    WireFormat::CloudEvents,
                );
            }
        }
        let id_text = id.ok_or(DecodeError::MissingHeader(headers::EVENT_ID))?;
        let id = id_text
            .trim()
            .parse::<EventId>()
            .map_err(|_| DecodeError::InvalidEventId(id_text.to_owned()))?;
        let event_type = event_type.ok_or(DecodeError::MissingHeader(headers::EVENT_TYPE))?;
        Ok(Self {
            id,
            key: key.map(str::to_owned),
            event_type: event_type.to_owned(),
            topic: destination.to_owned(),
            content_type: content_type
                .unwrap_or(headers::DEFAULT_CONTENT_TYPE)
                .to_owned(),
            payload: body.to_vec(),
            headers: own,
            created_at: broker_time,
            attempt: None,
            format: WireFormat::Headers,
        })
    }

    fn from_envelope(body: &[u8], broker_time: Option<DateTime<Utc>>) -> Result<Self, DecodeError> {
        let env =
            Envelope::decode(body).map_err(|e| DecodeError::InvalidEnvelope(e.to_string()))?;
        let id = env
            .event_id()
            .ok_or_else(|| DecodeError::InvalidEventId(env.id.clone()))?;
        let mut own = env.headers;
        let content_type = own
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(headers::CONTENT_TYPE))
            .map_or(headers::DEFAULT_CONTENT_TYPE.to_owned(), |(_, v)| v.clone());
        own.retain(|k, _| !headers::is_reserved(k));
        Ok(Self {
            id,
            key: (!env.key.is_empty()).then_some(env.key),
            event_type: env.event_type,
            topic: env.topic,
            content_type,
            payload: env.payload,
            headers: own.into_iter().collect(),
            created_at: DateTime::from_timestamp_millis(env.created_at_unix_ms)
                .filter(|_| env.created_at_unix_ms > 0)
                .or(broker_time),
            attempt: Some(env.attempt),
            format: WireFormat::Envelope,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloudevents::{Binding, Source};
    use crate::event::Event;
    use crate::message::BrokerMessage;
    use crate::wire::ENVELOPE_CONTENT_TYPE;

    fn event() -> Event {
        let now = DateTime::from_timestamp_millis(1_700_000_000_123).unwrap();
        Event {
            id: EventId::new(),
            key: Some("k1".into()),
            event_type: "order.created".into(),
            topic: "orders".into(),
            payload: b"{\"n\":1}".to_vec(),
            headers: [
                ("content-type".to_owned(), "application/json".to_owned()),
                ("traceparent".to_owned(), "00-abc-def-01".to_owned()),
            ]
            .into(),
            created_at: now,
            attempts: 1,
            next_attempt_at: now,
            last_error: None,
        }
    }

    #[test]
    fn headers_mapping_round_trips() {
        let e = event();
        let m = BrokerMessage::new(&e);
        let got = InboundMessage::decode(m.headers(), m.payload(), "orders.x", None).unwrap();
        assert_eq!(got.id, e.id);
        assert_eq!(got.key.as_deref(), Some("k1"));
        assert_eq!(got.event_type, "order.created");
        assert_eq!(got.topic, "orders.x");
        assert_eq!(got.content_type, "application/json");
        assert_eq!(got.payload, e.payload);
        assert_eq!(
            got.headers.get("traceparent").map(String::as_str),
            Some("00-abc-def-01")
        );
        assert_eq!(got.headers.len(), 1);
        assert_eq!(got.format, WireFormat::Headers);
        assert_eq!(got.order_key(), "k1");
    }

    #[test]
    fn envelope_round_trips_and_wins_over_headers() {
        let e = event();
        let body = Envelope::from(&e).encode_to_vec();
        let id = e.id.to_string();
        let hdrs = [
            (headers::WIRE_FORMAT, ENVELOPE_MARKER),
            (headers::CONTENT_TYPE, ENVELOPE_CONTENT_TYPE),
            (headers::EVENT_ID, id.as_str()),
        ];
        let got = InboundMessage::decode(hdrs, &body, "ignored", None).unwrap();
        assert_eq!(got.id, e.id);
        assert_eq!(got.topic, "orders");
        assert_eq!(got.content_type, "application/json");
        assert_eq!(got.payload, e.payload);
        assert_eq!(got.created_at, Some(e.created_at));
        assert_eq!(got.attempt, Some(1));
        assert_eq!(got.format, WireFormat::Envelope);
        assert!(got.headers.contains_key("traceparent"));
        assert!(!got.headers.contains_key("content-type"));
    }

    #[test]
    fn protobuf_payload_without_marker_is_a_payload() {
        let e = event();
        let body = Envelope::from(&e).encode_to_vec();
        let id = e.id.to_string();
        let hdrs = [
            (headers::CONTENT_TYPE, ENVELOPE_CONTENT_TYPE),
            (headers::EVENT_ID, id.as_str()),
            (headers::EVENT_TYPE, "x"),
        ];
        let got = InboundMessage::decode(hdrs, &body, "t", None).unwrap();
        assert_eq!(got.payload, body);
        assert_eq!(got.format, WireFormat::Headers);
    }

    /// `event()` with an extension-named header and a plain one.
    fn ce_event() -> Event {
        let mut e = event();
        e.headers.insert("tenant".into(), "acme".into());
        e.headers.insert("X-Plain".into(), "p".into());
        e.headers.insert("tracestate".into(), "v=1".into());
        e
    }

    /// The headers a consumer of `binding` receives for `m` (AMQP's
    /// content type property read as a `content-type` header, as the inbox's
    /// AMQP source does).
    fn received(m: &BrokerMessage<'_>, binding: Binding) -> Vec<(String, String)> {
        let mut h: Vec<(String, String)> = m
            .headers()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        if binding == Binding::Amqp {
            assert!(h.iter().all(|(k, _)| k != "content-type"), "{h:?}");
            h.push(("content-type".into(), m.content_type().into()));
        }
        h
    }

    fn decode_as(
        m: &BrokerMessage<'_>,
        binding: Binding,
        broker_time: Option<DateTime<Utc>>,
    ) -> Result<InboundMessage, DecodeError> {
        let h = received(m, binding);
        InboundMessage::decode(
            h.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            &m.body(),
            "dest",
            broker_time,
        )
    }

    #[test]
    fn cloudevents_round_trip_in_both_modes_on_every_binding() {
        let source: Source = "https://example.com/orders".parse().unwrap();
        let mut binary = ce_event();
        binary
            .headers
            .insert("content-type".into(), "image/png".into());
        binary.payload = vec![0, 159, 146, 150, 255];
        let mut keyless = ce_event();
        keyless.key = None;
        let mut not_json = ce_event();
        not_json.payload = b"{oops".to_vec();
        for e in [ce_event(), binary, keyless, not_json] {
            for binding in [Binding::Kafka, Binding::Nats, Binding::Amqp] {
                for format in [WireFormat::CloudEvents, WireFormat::CloudEventsJson] {
                    let m = BrokerMessage::new(&e)
                        .with_format(format)
                        .with_cloudevents(binding, &source);
                    let got = decode_as(&m, binding, None)
                        .unwrap_or_else(|err| panic!("{binding:?} {format}: {err}"));
                    let what = format!("{binding:?} {format}");
                    assert_eq!(got.format, format, "{what}");
                    assert_eq!(got.id, e.id, "{what}");
                    assert_eq!(got.key, e.key, "{what}");
                    assert_eq!(got.event_type, e.event_type, "{what}");
                    assert_eq!(got.topic, "dest", "{what}");
                    assert_eq!(&got.content_type, &e.headers["content-type"], "{what}");
                    assert_eq!(got.payload, e.payload, "{what}");
                    assert_eq!(got.created_at, Some(e.created_at), "{what}");
                    assert_eq!(got.attempt, None);
                    // Extensions and plain headers come back as headers.
                    let want: BTreeMap<String, String> = [
                        ("X-Plain", "p"),
                        ("tenant", "acme"),
                        ("traceparent", "00-abc-def-01"),
                        ("tracestate", "v=1"),
                    ]
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect();
                    assert_eq!(got.headers, want, "{what}");
                }
            }
        }
    }

    #[test]
    fn structured_json_data_is_the_payload_text() {
        let source = Source::new("/orders").unwrap();
        let e = ce_event();
        let m = BrokerMessage::new(&e)
            .with_format(WireFormat::CloudEventsJson)
            .with_cloudevents(Binding::Nats, &source);
        let v: serde_json::Value = serde_json::from_slice(&m.body()).unwrap();
        assert_eq!(v["data"], serde_json::json!({"n": 1}));
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["source"], "/orders");
        assert_eq!(v["partitionkey"], "k1");
        assert_eq!(v["time"], "2023-11-14T22:13:20.123Z");
        assert!(v.get("X-Plain").is_none() && v.get("data_base64").is_none());
        // A foreign producer's text data, its integer extension, no time.
        let id = EventId::new();
        let body = format!(
            r#"{{"specversion":"1.0","id":"{id}","source":"s","type":"t","datacontenttype":"text/plain","data":"h\u00e9","n":42,"dataschema":"https://x/s"}}"#
        );
        let t = DateTime::from_timestamp(1, 0);
        let ct = [("content-type", "application/cloudevents+json")];
        let got = InboundMessage::decode(ct, body.as_bytes(), "d", t).unwrap();
        assert_eq!(got.payload, "h\u{e9}".as_bytes());
        assert_eq!(got.content_type, "text/plain");
        assert_eq!(got.key, None);
        assert_eq!(got.created_at, t);
        assert_eq!(got.headers["n"], "42");
        assert_eq!(got.headers["dataschema"], "https://x/s");
    }

    #[test]
    fn malformed_cloudevents_name_what_is_wrong() {
        let id = EventId::new().to_string();
        let full = [
            ("ce_specversion", "1.0"),
            ("ce_id", id.as_str()),
            ("ce_source", "/s"),
            ("ce_type", "t"),
        ];
        for (i, name) in ["specversion", "id", "source", "type"]
            .into_iter()
            .enumerate()
        {
            let mut h = full.to_vec();
            h.remove(i);
            assert_eq!(
                InboundMessage::decode(h.clone(), b"x", "d", None),
                Err(DecodeError::MissingAttribute(name))
            );
            let err = InboundMessage::decode(h, b"x", "d", None).unwrap_err();
            assert!(err.to_string().contains(&format!("`{name}`")), "{err}");
            // The same in structured mode.
            let mut members: BTreeMap<&str, &str> = full
                .iter()
                .map(|(k, v)| (k.strip_prefix("ce_").unwrap(), *v))
                .collect();
            members.remove(name);
            let body = serde_json::to_vec(&members).unwrap();
            let ct = [(
                "content-type",
                "application/cloudevents+json; charset=UTF-8",
            )];
            assert_eq!(
                InboundMessage::decode(ct, &body, "d", None),
                Err(DecodeError::MissingAttribute(name))
            );
        }
        let with = |extra: (&'static str, &'static str)| {
            let mut h = full.to_vec();
            h.retain(|(k, _)| *k != extra.0);
            h.push(extra);
            InboundMessage::decode(h, b"x", "d", None)
        };
        assert!(matches!(
            with(("ce_specversion", "0.3")),
            Err(DecodeError::InvalidAttribute {
                name: "specversion",
                ..
            })
        ));
        assert!(matches!(
            with(("ce_time", "yesterday")),
            Err(DecodeError::InvalidAttribute { name: "time", .. })
        ));
        assert_eq!(
            with(("ce_id", "1234")),
            Err(DecodeError::InvalidEventId("1234".into()))
        );
        let structured = |ct: &'static str, body: &str| {
            InboundMessage::decode([("Content-Type", ct)], body.as_bytes(), "d", None)
        };
        for (ct, body, want) in [
            (
                "application/cloudevents+json",
                "{not json",
                "not a JSON event",
            ),
            ("application/cloudevents+json", "[1]", "not a JSON event"),
            ("application/cloudevents+avro", "{}", "not supported"),
            (
                "application/cloudevents+json",
                r#"{"type":{"a":1}}"#,
                "not a string",
            ),
            (
                "application/cloudevents+json",
                r#"{"data":1,"data_base64":"AA=="}"#,
                "both",
            ),
            (
                "application/cloudevents+json",
                r#"{"data_base64":"%%%"}"#,
                "not base64",
            ),
        ] {
            match structured(ct, body) {
                Err(DecodeError::InvalidCloudEvent(m)) => assert!(m.contains(want), "{m}"),
                other => panic!("{ct} {body}: {other:?}"),
            }
        }
        // Neither outbox headers nor CloudEvents: as before.
        assert_eq!(
            InboundMessage::decode([("content-type", "text/plain")], b"x", "d", None),
            Err(DecodeError::MissingHeader(headers::EVENT_ID))
        );
    }

    #[test]
    fn outbox_headers_win_over_lookalike_cloudevents_headers() {
        // A headers-format event whose own headers look like attributes,
        // and whose payload is itself a structured CloudEvent.
        let mut e = event();
        e.headers.insert("ce_specversion".into(), "1.0".into());
        e.headers
            .insert("content-type".into(), "application/cloudevents+json".into());
        let m = BrokerMessage::new(&e);
        let got = InboundMessage::decode(m.headers(), m.payload(), "t", None).unwrap();
        assert_eq!(got.format, WireFormat::Headers);
        assert_eq!(got.id, e.id);
        assert_eq!(got.headers["ce_specversion"], "1.0");
        assert_eq!(got.content_type, "application/cloudevents+json");
    }

    #[test]
    fn bad_messages_are_named() {
        let none: [(&str, &str); 0] = [];
        assert_eq!(
            InboundMessage::decode(none, b"x", "t", None),
            Err(DecodeError::MissingHeader(headers::EVENT_ID))
        );
        let bad = [(headers::EVENT_ID, "nope"), (headers::EVENT_TYPE, "t")];
        assert_eq!(
            InboundMessage::decode(bad, b"x", "t", None),
            Err(DecodeError::InvalidEventId("nope".into()))
        );
        let env = [(headers::WIRE_FORMAT, ENVELOPE_MARKER)];
        assert!(matches!(
            InboundMessage::decode(env, b"\xff\xff\xff", "t", None),
            Err(DecodeError::InvalidEnvelope(_))
        ));
        assert_eq!("Envelope".parse::<WireFormat>(), Ok(WireFormat::Envelope));
        for f in [WireFormat::CloudEvents, WireFormat::CloudEventsJson] {
            assert_eq!(f.as_str().parse::<WireFormat>(), Ok(f));
            assert!(f.is_cloudevents());
        }
        assert!("json".parse::<WireFormat>().is_err());
    }
}
