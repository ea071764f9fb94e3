//! [`BrokerMessage`]: the one mapping from an [`Event`] to what a broker
//! publisher puts on the wire, shared by every publisher crate, in either
//! [`WireFormat`].

use crate::cloudevents::{self, Binding, Source};
use crate::envelope::Envelope;
use crate::event::Event;
use crate::headers;
use crate::wire::WireFormat;
use crate::wire::{ENVELOPE_CONTENT_TYPE, ENVELOPE_MARKER};
use prost::Message as _;
use std::borrow::Cow;
use std::fmt;

/// An event as every broker publisher sends it: the same headers, the same
/// content type, the event id as the deduplication id and the event key.
/// Publishers translate it into their client's message type (NATS headers,
/// AMQP properties + header table, Kafka record headers); none of them
/// builds headers on its own.
///
/// In [`WireFormat::Headers`] (the default) the body is the payload; in
/// [`WireFormat::Envelope`] ([`BrokerMessage::with_format`]) it is the
/// protobuf [`Envelope`], the content type is
/// [`ENVELOPE_CONTENT_TYPE`] and [`headers::WIRE_FORMAT`] marks it. A
/// consumer reads both back with [`InboundMessage::decode`](crate::wire::InboundMessage::decode).
///
/// In the CloudEvents formats ([`WireFormat::CloudEvents`],
/// [`WireFormat::CloudEventsJson`]) the broker's header names and the
/// `source` attribute come from [`BrokerMessage::with_cloudevents`]; the
/// `Outbox-*` headers are not sent (the `id` attribute is the event id), the
/// broker-level dedup ids (JetStream `Nats-Msg-Id`, AMQP `message_id`) and
/// the Kafka key are the same as in the other formats. See
/// [`crate::cloudevents`] for the mapping.
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
/// assert_eq!(&*m.body(), b"{}");
///
/// // The same event as a protobuf envelope.
/// use outbox_core::{WireFormat, ENVELOPE_CONTENT_TYPE, ENVELOPE_MARKER};
/// let m = m.with_format(WireFormat::Envelope);
/// assert_eq!(m.content_type(), ENVELOPE_CONTENT_TYPE);
/// assert!(m.headers().any(|h| h == (headers::WIRE_FORMAT, ENVELOPE_MARKER)));
/// let back = outbox_core::InboundMessage::decode(m.headers(), &m.body(), "orders", None).unwrap();
/// assert_eq!(back.id, event.id);
/// assert_eq!(back.payload, b"{}");
///
/// // As a CloudEvent in binary mode, with Kafka's header names.
/// use outbox_core::cloudevents::{Binding, Source};
/// let source: Source = "/orders".parse().unwrap();
/// let ce = BrokerMessage::new(&event)
///     .with_format(WireFormat::CloudEvents)
///     .with_cloudevents(Binding::Kafka, &source);
/// let h: Vec<(&str, &str)> = ce.headers().collect();
/// assert!(h.contains(&("ce_source", "/orders")));
/// assert!(h.contains(&("ce_subject", "order-42")));
/// assert!(h.contains(&("ce_traceparent", "00-ab-cd-01")));
/// assert_eq!(&*ce.body(), b"{}");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerMessage<'a> {
    event: &'a Event,
    id: String,
    content_type: &'a str,
    format: WireFormat,
    binding: Binding,
    source: Option<&'a Source>,
    /// Every header of a CloudEvents format, laid out when the format or
    /// the binding is set (empty in the other formats).
    cloudevents: Vec<(String, String)>,
}

impl fmt::Debug for BrokerMessage<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Header values and the payload may hold secrets: names and sizes only.
        f.debug_struct("BrokerMessage")
            .field("dedup_id", &self.id)
            .field("key", &self.event.key)
            .field("event_type", &self.event.event_type)
            .field("format", &self.format)
            .field("content_type", &self.content_type())
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
            format: WireFormat::Headers,
            binding: Binding::default(),
            source: None,
            cloudevents: Vec::new(),
        }
    }

    /// The same message laid out in `format` (default
    /// [`WireFormat::Headers`]).
    pub fn with_format(mut self, format: WireFormat) -> Self {
        self.format = format;
        self.lay_out_cloudevents();
        self
    }

    /// The broker whose header names the CloudEvents formats use, and the
    /// `source` attribute. Without it a CloudEvents message has Kafka's
    /// header names and no `source` (not a valid CloudEvent: the publishers
    /// refuse a CloudEvents format without a source when they are built,
    /// [`cloudevents::require_source`]).
    pub fn with_cloudevents(mut self, binding: Binding, source: &'a Source) -> Self {
        self.binding = binding;
        self.source = Some(source);
        self.lay_out_cloudevents();
        self
    }

    /// The CloudEvents source, if set.
    pub fn source(&self) -> Option<&'a Source> {
        self.source
    }

    fn lay_out_cloudevents(&mut self) {
        self.cloudevents.clear();
        if !self.format.is_cloudevents() {
            return;
        }
        let plain =
            cloudevents::plain_headers(self.event).map(|(k, v)| (k.to_owned(), v.to_owned()));
        self.cloudevents.extend(plain);
        if self.binding.content_type_header() {
            self.cloudevents.push((
                headers::CONTENT_TYPE.to_owned(),
                self.content_type().to_owned(),
            ));
        }
        if self.format == WireFormat::CloudEvents {
            let time = cloudevents::time_text(self.event.created_at);
            let prefix = self.binding.prefix();
            let attributes = cloudevents::attributes(&self.id, self.source, self.event, &time);
            let named = attributes
                .into_iter()
                .map(|(name, value)| (format!("{prefix}{name}"), value.to_owned()))
                .collect::<Vec<_>>();
            self.cloudevents.extend(named);
        }
    }

    /// The wire format.
    pub fn format(&self) -> WireFormat {
        self.format
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

    /// The content type of the body: in [`WireFormat::Headers`] and
    /// [`WireFormat::CloudEvents`] the payload's
    /// ([`Self::payload_content_type`], the `datacontenttype`); in
    /// [`WireFormat::Envelope`] [`ENVELOPE_CONTENT_TYPE`]; in
    /// [`WireFormat::CloudEventsJson`]
    /// [`cloudevents::STRUCTURED_CONTENT_TYPE`].
    pub fn content_type(&self) -> &'a str {
        match self.format {
            WireFormat::Envelope => ENVELOPE_CONTENT_TYPE,
            WireFormat::CloudEventsJson => cloudevents::STRUCTURED_CONTENT_TYPE,
            WireFormat::Headers | WireFormat::CloudEvents => self.content_type,
        }
    }

    /// The payload's content type, whatever the format: the event's
    /// `content-type` header (any letter case), else the default.
    pub fn payload_content_type(&self) -> &'a str {
        self.content_type
    }

    /// The payload bytes (in the envelope format, inside the body).
    pub fn payload(&self) -> &'a [u8] {
        &self.event.payload
    }

    /// The bytes to send as the message body: the payload itself
    /// ([`WireFormat::Headers`], borrowed), or the protobuf-encoded
    /// [`Envelope`] ([`WireFormat::Envelope`]). The envelope's headers are
    /// the event's own headers without the reserved names
    /// ([`headers::is_reserved`]), plus [`headers::CONTENT_TYPE`] set to
    /// [`Self::payload_content_type`]: the envelope alone tells a consumer
    /// how to read its payload.
    pub fn body(&self) -> Cow<'a, [u8]> {
        match self.format {
            WireFormat::Envelope => Cow::Owned(self.envelope().encode_to_vec()),
            WireFormat::CloudEventsJson => {
                let time = cloudevents::time_text(self.event.created_at);
                let attributes = cloudevents::attributes(&self.id, self.source, self.event, &time);
                Cow::Owned(cloudevents::structured_body(
                    &attributes,
                    self.content_type,
                    &self.event.payload,
                ))
            }
            WireFormat::Headers | WireFormat::CloudEvents => Cow::Borrowed(&self.event.payload),
        }
    }

    /// The [`Envelope`] sent as the body in [`WireFormat::Envelope`].
    pub fn envelope(&self) -> Envelope {
        let mut envelope = Envelope::from(self.event);
        envelope.headers.retain(|k, _| !headers::is_reserved(k));
        envelope.headers.insert(
            headers::CONTENT_TYPE.to_owned(),
            self.content_type.to_owned(),
        );
        envelope
    }

    /// Every header to send, in order: the event's own headers except the
    /// reserved names ([`headers::is_reserved`]), then
    /// [`headers::CONTENT_TYPE`] ([`Self::content_type`]),
    /// [`headers::EVENT_TYPE`], [`headers::EVENT_ID`], when the event has a
    /// key [`headers::KEY`], and in [`WireFormat::Envelope`]
    /// [`headers::WIRE_FORMAT`] = [`ENVELOPE_MARKER`]. No name appears twice.
    ///
    /// In the CloudEvents formats: the event's own headers that are not
    /// extension attributes ([`cloudevents::is_extension`]), then (Kafka,
    /// NATS) `content-type` ([`Self::content_type`]), then in binary mode
    /// every attribute under the binding's prefix (`ce_id`, `ce-id`,
    /// `cloudEvents:id`, ...).
    pub fn headers(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        let classic = !self.format.is_cloudevents();
        let own = self
            .event
            .headers
            .iter()
            .filter(|(k, _)| !headers::is_reserved(k))
            .map(|(k, v)| (k.as_str(), v.as_str()));
        let ours = [
            Some((headers::CONTENT_TYPE, self.content_type())),
            Some((headers::EVENT_TYPE, self.event.event_type.as_str())),
            Some((headers::EVENT_ID, self.id.as_str())),
            self.event.key.as_deref().map(|k| (headers::KEY, k)),
            (self.format == WireFormat::Envelope)
                .then_some((headers::WIRE_FORMAT, ENVELOPE_MARKER)),
        ];
        let classic = classic
            .then(|| own.chain(ours.into_iter().flatten()))
            .into_iter()
            .flatten();
        let cloudevents = self
            .cloudevents
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()));
        classic.chain(cloudevents)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::EventId;
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
    fn envelope_format_marks_the_message_and_keeps_the_routing_headers() {
        let e = event();
        let m = BrokerMessage::new(&e).with_format(WireFormat::Envelope);
        let id = e.id.to_string();
        let h: Vec<(&str, &str)> = m.headers().collect();
        assert_eq!(
            h,
            vec![
                ("traceparent", "00-abc-def-01"),
                ("content-type", ENVELOPE_CONTENT_TYPE),
                ("Outbox-Event-Type", "order.created"),
                ("Outbox-Event-Id", id.as_str()),
                ("Outbox-Key", "k1"),
                ("Outbox-Wire-Format", ENVELOPE_MARKER),
            ]
        );
        assert_eq!(m.content_type(), ENVELOPE_CONTENT_TYPE);
        assert_eq!(m.payload_content_type(), "application/json");
        assert_eq!(m.format(), WireFormat::Envelope);
        let env = Envelope::decode(&*m.body()).unwrap();
        assert_eq!(env.id, id);
        assert_eq!(env.key, "k1");
        assert_eq!(env.event_type, "order.created");
        assert_eq!(env.topic, "orders");
        assert_eq!(env.payload, b"{}");
        assert_eq!(env.created_at_unix_ms, e.created_at.timestamp_millis());
        assert_eq!(env.attempt, 1);
        // The event's own headers, its content type under the one spelling,
        // no forged reserved names.
        assert_eq!(
            env.headers.into_iter().collect::<Vec<_>>(),
            vec![
                ("content-type".to_owned(), "application/json".to_owned()),
                ("traceparent".to_owned(), "00-abc-def-01".to_owned()),
            ]
        );
        // The default format has no marker and sends the payload as is.
        let plain = BrokerMessage::new(&e);
        assert!(plain.headers().all(|(k, _)| k != headers::WIRE_FORMAT));
        assert!(matches!(plain.body(), Cow::Borrowed(b"{}")));
    }

    #[test]
    fn both_formats_decode_to_the_same_event() {
        use crate::wire::InboundMessage;
        let mut keyless = event();
        keyless.key = None;
        keyless.headers.clear();
        let mut binary = event();
        binary.payload = vec![0, 159, 146, 150, 255];
        binary.created_at = chrono::DateTime::from_timestamp_millis(1_700_000_000_123).unwrap();
        for e in [event(), keyless, binary] {
            let decoded: Vec<InboundMessage> = [WireFormat::Headers, WireFormat::Envelope]
                .into_iter()
                .map(|format| {
                    let m = BrokerMessage::with_default_content_type(&e, "text/plain")
                        .with_format(format);
                    let body = m.body();
                    // The broker's own timestamp, where the headers format
                    // takes its time from, is the creation time here.
                    let got =
                        InboundMessage::decode(m.headers(), &body, &e.topic, Some(e.created_at))
                            .unwrap();
                    assert_eq!(got.format, format);
                    got
                })
                .collect();
            let (h, env) = (&decoded[0], &decoded[1]);
            assert_eq!(h.id, e.id);
            assert_eq!(env.id, e.id);
            assert_eq!(h.key, e.key);
            assert_eq!(env.key, e.key);
            assert_eq!(
                (&h.event_type, &env.event_type),
                (&e.event_type, &e.event_type)
            );
            assert_eq!((&h.topic, &env.topic), (&e.topic, &e.topic));
            assert_eq!(h.payload, e.payload);
            assert_eq!(env.payload, e.payload);
            assert_eq!(h.content_type, env.content_type);
            assert_eq!(h.headers, env.headers);
            assert_eq!(
                env.created_at.map(|t| t.timestamp_millis()),
                Some(e.created_at.timestamp_millis())
            );
            assert_eq!(
                h.created_at.map(|t| t.timestamp_millis()),
                Some(e.created_at.timestamp_millis())
            );
        }
    }

    #[test]
    fn debug_shows_no_header_values_or_payload() {
        let mut e = event();
        e.headers
            .insert("authorization".into(), "Bearer s3cret".into());
        let s = format!("{:?}", BrokerMessage::new(&e));
        assert!(!s.contains("s3cret"), "{s}");
        let s = format!(
            "{:?}",
            BrokerMessage::new(&e).with_format(WireFormat::Envelope)
        );
        assert!(!s.contains("s3cret") && s.contains("Envelope"), "{s}");
        assert!(s.contains("authorization"), "{s}");
    }
}
