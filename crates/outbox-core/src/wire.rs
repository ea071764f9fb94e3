//! The two wire formats of a broker message, and the one decoder a consumer
//! (the `outbox-inbox` crate, or any Rust service) uses to read them back.
//!
//! - [`WireFormat::Headers`] (the default): the body is the event's payload;
//!   the metadata travels in headers ([`crate::headers`]): event id, type,
//!   key, content type, and the event's own headers beside them.
//! - [`WireFormat::Envelope`]: the body is the protobuf
//!   [`crate::Envelope`] (`proto/outbox/v1/envelope.proto`, the
//!   wire contract for consumers in other languages) with content type
//!   [`ENVELOPE_CONTENT_TYPE`] and the header [`headers::WIRE_FORMAT`](crate::headers::WIRE_FORMAT) set to
//!   [`ENVELOPE_MARKER`]. The id, type and key headers are still sent, so
//!   broker-side routing and deduplication work the same in both formats.
//!
//! - [`WireFormat::CloudEvents`]: CloudEvents 1.0 in binary content mode
//!   (the payload as the body, the attributes as `ce_` / `ce-` /
//!   `cloudEvents:` headers); [`WireFormat::CloudEventsJson`]: structured
//!   mode (the JSON event format as the body). See [`crate::cloudevents`].
//!
//! [`InboundMessage::decode`] (in `decode.rs`, below this module and
//! [`crate::cloudevents`]) reads all four.

use crate::event::EventId;
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// The content type of a message whose body is an [`Envelope`](crate::Envelope).
pub const ENVELOPE_CONTENT_TYPE: &str = "application/x-protobuf";
/// The value of [`headers::WIRE_FORMAT`](crate::headers::WIRE_FORMAT) on an envelope message: the
/// protobuf message's full name.
pub const ENVELOPE_MARKER: &str = "outbox.v1.Envelope";

/// How a publisher lays an event out on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[non_exhaustive]
pub enum WireFormat {
    /// The payload as the body, the metadata in headers (the default).
    #[default]
    Headers,
    /// The protobuf [`Envelope`](crate::Envelope) as the body (`application/x-protobuf`).
    Envelope,
    /// CloudEvents 1.0, binary content mode: the payload as the body, its
    /// content type as the broker's, the attributes as headers
    /// ([`crate::cloudevents`]). Needs a [`Source`](crate::cloudevents::Source).
    CloudEvents,
    /// CloudEvents 1.0, structured content mode: the JSON event format as
    /// the body, content type [`STRUCTURED_CONTENT_TYPE`](crate::cloudevents::STRUCTURED_CONTENT_TYPE).
    /// Needs a [`Source`](crate::cloudevents::Source).
    CloudEventsJson,
}

impl WireFormat {
    /// The name used on the command line and in configuration files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Headers => "headers",
            Self::Envelope => "envelope",
            Self::CloudEvents => "cloudevents",
            Self::CloudEventsJson => "cloudevents-json",
        }
    }

    /// Whether this is one of the CloudEvents formats (which need a
    /// [`Source`](crate::cloudevents::Source)).
    pub fn is_cloudevents(self) -> bool {
        matches!(self, Self::CloudEvents | Self::CloudEventsJson)
    }
}

impl fmt::Display for WireFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A wire format name that is none of `headers`, `envelope`, `cloudevents`,
/// `cloudevents-json`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown wire format {0:?}: expected \"headers\", \"envelope\", \"cloudevents\" or \"cloudevents-json\"")]
pub struct UnknownWireFormat(pub String);

impl FromStr for WireFormat {
    type Err = UnknownWireFormat;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "headers" => Ok(Self::Headers),
            "envelope" => Ok(Self::Envelope),
            "cloudevents" => Ok(Self::CloudEvents),
            "cloudevents-json" | "cloudevents_json" => Ok(Self::CloudEventsJson),
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
    /// A CloudEvent lacks a required attribute (`specversion`, `id`,
    /// `source` or `type`), named here.
    #[error("the CloudEvent has no `{0}` attribute")]
    MissingAttribute(&'static str),
    /// A CloudEvent attribute has a value it may not have.
    #[error("the CloudEvent's `{name}` attribute is invalid: {reason}")]
    InvalidAttribute {
        /// The attribute.
        name: &'static str,
        /// Why.
        reason: String,
    },
    /// A structured-mode CloudEvent whose body is not a JSON event.
    #[error("the body is not a valid CloudEvents JSON event: {0}")]
    InvalidCloudEvent(String),
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
    /// [`headers::DEFAULT_CONTENT_TYPE`](crate::headers::DEFAULT_CONTENT_TYPE)).
    pub content_type: String,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// The event's own headers (trace context among them), without the
    /// names the publisher reserves ([`headers::is_reserved`](crate::headers::is_reserved)).
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
    /// The key per-key order is kept by: the event key, or the event id for
    /// an event without one (which is then ordered against nothing).
    pub fn order_key(&self) -> String {
        self.key.clone().unwrap_or_else(|| self.id.to_string())
    }
}
