//! Header names every publisher sets on a broker message, the same on every
//! broker so one consumer library can read them all. The event's own headers
//! (trace context `traceparent` / `tracestate` among them) travel beside them.

/// The event id (UUIDv7 text): the consumer's deduplication id.
pub const EVENT_ID: &str = "Outbox-Event-Id";
/// The event type, e.g. `order.created`.
pub const EVENT_TYPE: &str = "Outbox-Event-Type";
/// The event key, when the event has one.
pub const KEY: &str = "Outbox-Key";
