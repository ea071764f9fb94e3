//! Header names every publisher sets on a broker message, the same on every
//! broker so one consumer library can read them all. The event's own headers
//! (trace context `traceparent` / `tracestate` among them) travel beside them.
//! [`crate::BrokerMessage`] puts them together.

/// The event id (UUIDv7 text): the consumer's deduplication id.
pub const EVENT_ID: &str = "Outbox-Event-Id";
/// The event type, e.g. `order.created`.
pub const EVENT_TYPE: &str = "Outbox-Event-Type";
/// The event key, when the event has one.
pub const KEY: &str = "Outbox-Key";
/// The payload's media type, in this one spelling on every broker (AMQP
/// also sets its `content_type` property). The event's own header of that
/// name, in any letter case, is the value; else [`DEFAULT_CONTENT_TYPE`].
pub const CONTENT_TYPE: &str = "content-type";
/// The content type of an event that names none.
pub const DEFAULT_CONTENT_TYPE: &str = "application/octet-stream";

/// Set to [`crate::wire::ENVELOPE_MARKER`] on a message whose body is the
/// protobuf [`crate::Envelope`] ([`crate::WireFormat::Envelope`]); absent in
/// the default format.
pub const WIRE_FORMAT: &str = "Outbox-Wire-Format";

/// The W3C Trace Context `traceparent` header
/// (`version-traceid-parentid-flags`, 55 characters in version `00`). With
/// feature `otel`, enqueue sets it from the current `tracing` span unless the
/// caller set it (see [`crate::trace`]); it travels to the broker like any
/// event header.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C Trace Context `tracestate` header (vendor entries), carried with
/// [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// Whether `name` is one of the headers the publisher sets itself (compared
/// without regard to letter case): an event header of that name is not
/// copied, the publisher's value wins.
pub fn is_reserved(name: &str) -> bool {
    [EVENT_ID, EVENT_TYPE, KEY, CONTENT_TYPE, WIRE_FORMAT]
        .iter()
        .any(|r| r.eq_ignore_ascii_case(name))
}
