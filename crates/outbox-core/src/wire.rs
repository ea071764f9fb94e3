//! The two wire formats of a broker message, and the one decoder a consumer
//! (the `outbox-inbox` crate, or any Rust service) uses to read them back.
//!
//! - [`WireFormat::Headers`] (the default): the body is the event's payload;
//!   the metadata travels in headers ([`crate::headers`]): event id, type,
//!   key, content type, and the event's own headers beside them.
//! - [`WireFormat::Envelope`]: the body is the protobuf
//!   [`crate::Envelope`] (`proto/outbox/v1/envelope.proto`, the
//!   wire contract for consumers in other languages) with content type
//!   [`ENVELOPE_CONTENT_TYPE`] and the header [`headers::WIRE_FORMAT`] set to
//!   [`ENVELOPE_MARKER`]. The id, type and key headers are still sent, so
//!   broker-side routing and deduplication work the same in both formats.
//!
//! [`InboundMessage::decode`] reads either: the marker header decides, so an
//! event whose own payload is protobuf is never mistaken for an envelope.

use crate::{headers, Envelope, EventId};
use chrono::{DateTime, Utc};
use prost::Message as _;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// The content type of a message whose body is an [`Envelope`].
pub const ENVELOPE_CONTENT_TYPE: &str = "application/x-protobuf";
/// The value of [`headers::WIRE_FORMAT`] on an envelope message: the
/// protobuf message's full name.
pub const ENVELOPE_MARKER: &str = "outbox.v1.Envelope";

/// How a publisher lays an event out on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[non_exhaustive]
pub enum WireFormat {
    /// The payload as the body, the metadata in headers (the default).
    #[default]
    Headers,
    /// The protobuf [`Envelope`] as the body (`application/x-protobuf`).
    Envelope,
}

impl WireFormat {
    /// The name used on the command line and in configuration files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Headers => "headers",
            Self::Envelope => "envelope",
        }
    }
}

impl fmt::Display for WireFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A wire format name that is neither `headers` nor `envelope`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown wire format {0:?}: expected \"headers\" or \"envelope\"")]
pub struct UnknownWireFormat(pub String);

impl FromStr for WireFormat {
    type Err = UnknownWireFormat;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "headers" => Ok(Self::Headers),
            "envelope" => Ok(Self::Envelope),
            _ => Err(UnknownWireFormat(s.to_owned())),
        }
    }
}

/// Why a received message is not an outbox event. The message is
/// dead-lettered by a consumer with code `UNDECODABLE`, never dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// A required header is absent.
    #[error("the message has no {0} header")]
    MissingHeader(&'static str),
    /// The event id is not a UUID.
    #[error("the event id {0:?} is not a UUID")]
    InvalidEventId(String),
    /// The body is marked as an envelope but does not decode as one.
    #[error("the body is not a valid outbox.v1.Envelope: {0}")]
    InvalidEnvelope(String),
}

/// An outbox event as a consumer receives it, from either wire format.
#[derive(Clone, PartialEq, Eq)]
pub struct InboundMessage {
    /// The event id: the deduplication id.
    pub id: EventId,
    /// The event key (per-key order), if the event has one.
    pub key: Option<String>,
    /// The event type.
    pub event_type: String,
    /// The event's topic: the envelope's, or else the broker destination
    /// the message came from (topic, subject or routing key).
    pub topic: String,
    /// The payload's media type (the event's `content-type`, else
    /// [`headers::DEFAULT_CONTENT_TYPE`]).
    pub content_type: String,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// The event's own headers (trace context among them), without the
    /// names the publisher reserves ([`headers::is_reserved`]).
    pub headers: BTreeMap<String, String>,
    /// When the event was created (the envelope's time, else the broker's
    /// timestamp of the message when it has one).
    pub created_at: Option<DateTime<Utc>>,
    /// The relay's delivery attempt (envelope only).
    pub attempt: Option<u32>,
    /// The format it arrived in.
    pub format: WireFormat,
}

impl fmt::Debug for InboundMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Header values and the payload may hold secrets: names and sizes only.
        f.debug_struct("InboundMessage")
            .field("id", &self.id)
            .field("key", &self.key)
            .field("event_type", &self.event_type)
            .field("topic", &self.topic)
            .field("content_type", &self.content_type)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("payload_len", &self.payload.len())
            .field("created_at", &self.created_at)
            .field("format", &self.format)
            .finish()
    }
}

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
        for (name, value) in received_headers {
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

    /// The key per-key order is kept by: the event key, or the event id for
    /// an event without one (which is then ordered against nothing).
    pub fn order_key(&self) -> String {
        self.key.clone().unwrap_or_else(|| self.id.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BrokerMessage, Event};

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
        assert!("json".parse::<WireFormat>().is_err());
    }
}
