//! [`BrokerMessage`]: the one mapping from an [`Event`] to what a broker
//! publisher puts on the wire, shared by every publisher crate.

use crate::{headers, Event};
use std::fmt;

/// An event as every broker publisher sends it: the same headers, the same
/// content type, the event id as the deduplication id and the event key.
/// Publishers translate it into their client's message type (NATS headers,
/// AMQP properties + header table, Kafka record headers); none of them
/// builds headers on its own.
///
/// ```
/// use outbox_core::{headers, BrokerMessage, Event, EventId};
/// # let now = chrono::Utc::now();
/// let event = Event {
///     id: EventId::new(),
///     key: Some("order-42".into()),
///     event_type: "order.created".into(),
///     topic: "orders".into(),
///     payload: b"{}".to_vec(),
///     headers: [("traceparent".to_owned(), "00-ab-cd-01".to_owned())].into(),
///     created_at: now,
///     attempts: 1,
///     next_attempt_at: now,
///     last_error: None,
/// };
/// let m = BrokerMessage::new(&event);
/// assert_eq!(m.dedup_id(), event.id.to_string());
/// assert_eq!(m.partition_key(), "order-42");
/// assert_eq!(m.content_type(), headers::DEFAULT_CONTENT_TYPE);
/// let h: Vec<(&str, &str)> = m.headers().collect();
/// assert_eq!(h[0], ("traceparent", "00-ab-cd-01"));
/// assert!(h.contains(&(headers::EVENT_TYPE, "order.created")));
/// assert!(h.contains(&(headers::KEY, "order-42")));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerMessage<'a> {
    event: &'a Event,
    id: String,
    content_type: &'a str,
}

impl fmt::Debug for BrokerMessage<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Header values and the payload may hold secrets: names and sizes only.
        f.debug_struct("BrokerMessage")
            .field("dedup_id", &self.id)
            .field("key", &self.event.key)
            .field("event_type", &self.event.event_type)
            .field("content_type", &self.content_type)
            .field(
                "headers",
                &self.headers().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .field("payload_len", &self.event.payload.len())
            .finish()
    }
}

impl<'a> BrokerMessage<'a> {
    /// The message for `event`; an event without a `content-type` header is
    /// sent as [`headers::DEFAULT_CONTENT_TYPE`].
    pub fn new(event: &'a Event) -> Self {
        Self::with_default_content_type(event, headers::DEFAULT_CONTENT_TYPE)
    }

    /// The message for `event`, with `default` as the content type of an
    /// event that names none.
    pub fn with_default_content_type(event: &'a Event, default: &'a str) -> Self {
        let content_type = event
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(headers::CONTENT_TYPE))
            .map_or(default, |(_, v)| v.as_str());
        Self {
            event,
            id: event.id.to_string(),
            content_type,
        }
    }

    /// The event.
    pub fn event(&self) -> &'a Event {
        self.event
    }

    /// The deduplication id: the event id's text (JetStream `Nats-Msg-Id`,
    /// AMQP `message_id`, the [`headers::EVENT_ID`] header everywhere).
    pub fn dedup_id(&self) -> &str {
        &self.id
    }

    /// The event key, if it has one.
    pub fn key(&self) -> Option<&'a str> {
        self.event.key.as_deref()
    }

    /// The key a partitioned broker (Kafka) routes by: the event key, or the
    /// event id when it has none (spreading keyless events, as
    /// [`Event::shard_key`] does for relays).
    pub fn partition_key(&self) -> &str {
        self.event.key.as_deref().unwrap_or(&self.id)
    }

    /// The event type.
    pub fn event_type(&self) -> &'a str {
        &self.event.event_type
    }

    /// The event's destination topic (before any per-broker mapping).
    pub fn topic(&self) -> &'a str {
        &self.event.topic
    }

    /// The content type: the event's `content-type` header (any letter
    /// case), else the default.
    pub fn content_type(&self) -> &'a str {
        self.content_type
    }

    /// The payload bytes.
    pub fn payload(&self) -> &'a [u8] {
        &self.event.payload
    }

    /// Every header to send, in order: the event's own headers except the
    /// reserved names ([`headers::is_reserved`]), then
    /// [`headers::CONTENT_TYPE`], [`headers::EVENT_TYPE`],
    /// [`headers::EVENT_ID`] and, when the event has a key, [`headers::KEY`].
    /// No name appears twice.
    pub fn headers(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        let own = self
            .event
            .headers
            .iter()
            .filter(|(k, _)| !headers::is_reserved(k))
            .map(|(k, v)| (k.as_str(), v.as_str()));
        let ours = [
            Some((headers::CONTENT_TYPE, self.content_type)),
            Some((headers::EVENT_TYPE, self.event.event_type.as_str())),
            Some((headers::EVENT_ID, self.id.as_str())),
            self.event.key.as_deref().map(|k| (headers::KEY, k)),
        ];
        own.chain(ours.into_iter().flatten())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EventId;
    use chrono::Utc;

    fn event() -> Event {
        let now = Utc::now();
        Event {
            id: EventId::new(),
            key: Some("k1".into()),
            event_type: "order.created".into(),
            topic: "orders".into(),
            payload: b"{}".to_vec(),
            headers: [
                ("Content-Type".to_owned(), "application/json".to_owned()),
                ("traceparent".to_owned(), "00-abc-def-01".to_owned()),
                ("outbox-event-id".to_owned(), "forged".to_owned()),
                ("Outbox-Key".to_owned(), "forged".to_owned()),
            ]
            .into(),
            created_at: now,
            attempts: 1,
            next_attempt_at: now,
            last_error: None,
        }
    }

    #[test]
    fn headers_are_ours_plus_the_events_own_without_forgeries() {
        let e = event();
        let m = BrokerMessage::new(&e);
        let id = e.id.to_string();
        let h: Vec<(&str, &str)> = m.headers().collect();
        assert_eq!(
            h,
            vec![
                ("traceparent", "00-abc-def-01"),
                ("content-type", "application/json"),
                ("Outbox-Event-Type", "order.created"),
                ("Outbox-Event-Id", id.as_str()),
                ("Outbox-Key", "k1"),
            ]
        );
        assert_eq!(m.content_type(), "application/json");
        assert_eq!(m.dedup_id(), id);
        assert_eq!(m.partition_key(), "k1");
        assert_eq!(m.payload(), b"{}");
    }

    #[test]
    fn keyless_event_has_no_key_header_and_partitions_by_id() {
        let mut e = event();
        e.key = None;
        e.headers.clear();
        let m = BrokerMessage::with_default_content_type(&e, "text/plain");
        assert_eq!(m.content_type(), "text/plain");
        assert_eq!(m.partition_key(), e.id.to_string());
        assert!(m.headers().all(|(k, _)| k != headers::KEY));
        assert_eq!(
            BrokerMessage::new(&e).content_type(),
            "application/octet-stream"
        );
    }

    #[test]
    fn debug_shows_no_header_values_or_payload() {
        let mut e = event();
        e.headers
            .insert("authorization".into(), "Bearer s3cret".into());
        let s = format!("{:?}", BrokerMessage::new(&e));
        assert!(!s.contains("s3cret"), "{s}");
        assert!(s.contains("authorization"), "{s}");
    }
}
