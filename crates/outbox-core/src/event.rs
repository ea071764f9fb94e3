//! Events: the one a caller enqueues ([`NewEvent`]) and the one a relay
//! claims ([`Event`]).

use crate::error::ErrorCode;
use chrono::{DateTime, Datelike, Utc};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;
use thiserror::Error;
use uuid::Uuid;

/// Globally unique, time-ordered event id (UUIDv7), made by the library when
/// the event is built, so the caller knows it before the transaction commits.
/// It is the deduplication id on every broker.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct EventId(Uuid);

impl EventId {
    /// A fresh UUIDv7 (millisecond timestamp + random bits).
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }

    /// Wraps an existing UUID (e.g. read back from storage).
    pub fn from_uuid(id: Uuid) -> Self {
        Self(id)
    }

    /// The UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl Default for EventId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EventId({})", self.0)
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::str::FromStr for EventId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(Self)
    }
}

impl From<Uuid> for EventId {
    fn from(id: Uuid) -> Self {
        Self(id)
    }
}

/// Size limits checked at enqueue, so an event a broker would refuse is
/// refused up front with a clear error instead of dead-lettered later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventLimits {
    /// Largest payload in bytes. Default 1 MiB (NATS's default `max_payload`).
    pub max_payload_bytes: usize,
    /// Largest key in bytes. Default 1024.
    pub max_key_bytes: usize,
    /// Most headers per event. Default 64.
    pub max_headers: usize,
    /// Largest header name + value in bytes. Default 8 KiB.
    pub max_header_bytes: usize,
}

impl Default for EventLimits {
    fn default() -> Self {
        Self {
            max_payload_bytes: 1024 * 1024,
            max_key_bytes: 1024,
            max_headers: 64,
            max_header_bytes: 8 * 1024,
        }
    }
}

/// Why a [`NewEvent`] was refused at enqueue.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// The event type was empty.
    #[error("event type must not be empty")]
    EmptyEventType,
    /// The event type had characters other than printable ASCII without spaces,
    /// or was longer than 255 bytes.
    #[error(
        "event type {0:?} must be 1-255 printable characters without spaces or control characters"
    )]
    InvalidEventType(String),
    /// The topic was empty.
    #[error("topic must not be empty")]
    EmptyTopic,
    /// The topic had whitespace or control characters, or was over 249 bytes.
    #[error("topic {0:?} must be 1-249 bytes without whitespace or control characters")]
    InvalidTopic(String),
    /// The payload was above [`EventLimits::max_payload_bytes`].
    #[error("payload is {size} bytes, above the maximum of {max} bytes")]
    PayloadTooLarge {
        /// Payload size.
        size: usize,
        /// Configured maximum.
        max: usize,
    },
    /// The key was empty or above [`EventLimits::max_key_bytes`].
    #[error("key must be 1-{max} bytes (got {size})")]
    InvalidKey {
        /// Key size.
        size: usize,
        /// Configured maximum.
        max: usize,
    },
    /// More headers than [`EventLimits::max_headers`].
    #[error("{count} headers, above the maximum of {max}")]
    TooManyHeaders {
        /// Header count.
        count: usize,
        /// Configured maximum.
        max: usize,
    },
    /// A header name brokers would reject (empty, non-ASCII, whitespace, `:` or control characters).
    #[error("header name {0:?} must be non-empty printable ASCII without spaces or ':'")]
    InvalidHeaderName(String),
    /// A header value with CR, LF or NUL. No longer returned: control
    /// characters are reported as [`ValidationError::ControlCharacter`].
    #[error("value of header {0:?} must not contain CR, LF or NUL")]
    InvalidHeaderValue(String),
    /// A control character (CR, LF, NUL, TAB, DEL, ... anything
    /// [`char::is_control`] accepts) in the key, event type, topic or a
    /// header: on the wire it could end a header line and inject another
    /// header (NATS and HTTP-style headers), so it is refused at enqueue.
    #[error("{field} contains control character U+{code:04X} at byte {at}; control characters could inject broker headers")]
    ControlCharacter {
        /// Where it was found.
        field: EventField,
        /// The character's code point.
        code: u32,
        /// Its byte offset in that field.
        at: usize,
    },
    /// The delay given to [`NewEvent::deliver_after`] was negative.
    #[error("deliver_after: the delay is negative ({micros} us); use zero or more (zero delivers at once)")]
    NegativeDelay {
        /// The requested delay in microseconds.
        micros: i128,
    },
    /// The delay given to [`NewEvent::deliver_after`] was above
    /// [`MAX_DELIVERY_DELAY`].
    #[error(
        "deliver_after: the delay of {secs} s is above the maximum of {max_secs} s (100 years)"
    )]
    DelayTooLong {
        /// The requested delay in whole seconds (saturating).
        secs: i128,
        /// [`MAX_DELIVERY_DELAY`] in seconds.
        max_secs: u64,
    },
    /// The time given to [`NewEvent::deliver_at`] was outside the years
    /// 1970-9999 (UTC), the range every store represents.
    #[error("deliver_at: {0} is outside the supported range 1970-01-01 to 9999-12-31 (UTC)")]
    DeliverAtOutOfRange(DateTime<Utc>),
    /// A header above [`EventLimits::max_header_bytes`].
    #[error("header {name:?} is {size} bytes, above the maximum of {max}")]
    HeaderTooLarge {
        /// Header name.
        name: String,
        /// Name + value size.
        size: usize,
        /// Configured maximum.
        max: usize,
    },
}

/// The part of an event a [`ValidationError::ControlCharacter`] names.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventField {
    /// The key.
    Key,
    /// The event type.
    EventType,
    /// The topic.
    Topic,
    /// The name of a header (shown escaped).
    HeaderName(String),
    /// The value of the header of this name.
    HeaderValue(String),
}

impl fmt::Display for EventField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventField::Key => f.write_str("the key"),
            EventField::EventType => f.write_str("the event type"),
            EventField::Topic => f.write_str("the topic"),
            EventField::HeaderName(name) => write!(f, "header name {name:?}"),
            EventField::HeaderValue(name) => write!(f, "the value of header {name:?}"),
        }
    }
}

/// The first control character of `text`, as a [`ValidationError`].
fn refuse_control(field: impl FnOnce() -> EventField, text: &str) -> Result<(), ValidationError> {
    match text.char_indices().find(|(_, c)| c.is_control()) {
        Some((at, c)) => Err(ValidationError::ControlCharacter {
            field: field(),
            code: u32::from(c),
            at,
        }),
        None => Ok(()),
    }
}

/// The longest delay [`NewEvent::deliver_after`] accepts: 100 years (36 600
/// days). It keeps `now() + delay` inside every store's time range.
pub const MAX_DELIVERY_DELAY: Duration = Duration::from_secs(36_600 * 24 * 3600);

/// A delay for [`NewEvent::deliver_after`]: built from a
/// [`std::time::Duration`] or a [`chrono::TimeDelta`] (which may be
/// negative; a negative delay is refused at enqueue with
/// [`ValidationError::NegativeDelay`]). Kept in whole microseconds, rounded
/// up, so an event is never delivered before the delay is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeliveryDelay {
    micros: i128,
}

impl DeliveryDelay {
    /// The delay in microseconds (negative if it was built from a negative
    /// [`chrono::TimeDelta`]).
    pub fn as_micros(&self) -> i128 {
        self.micros
    }
}

impl From<Duration> for DeliveryDelay {
    fn from(d: Duration) -> Self {
        Self {
            // u128 nanoseconds of a Duration / 1000 always fit an i128.
            micros: i128::try_from(d.as_nanos().div_ceil(1000)).unwrap_or(i128::MAX),
        }
    }
}

impl From<chrono::TimeDelta> for DeliveryDelay {
    fn from(d: chrono::TimeDelta) -> Self {
        let nanos = i128::from(d.num_seconds()) * 1_000_000_000 + i128::from(d.subsec_nanos());
        Self {
            // Rounded up (towards +infinity): never early.
            micros: -(-nanos).div_euclid(1000),
        }
    }
}

/// When a delayed event becomes deliverable, as a store reads it from
/// [`NewEvent::delivery`] (validated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Delivery {
    /// At this time, compared with the database clock.
    At(DateTime<Utc>),
    /// This long after the database's `now()` when the event is inserted
    /// (whole microseconds, at most [`MAX_DELIVERY_DELAY`]).
    After(Duration),
}

/// An event to enqueue inside the caller's transaction.
///
/// Its [`id`](Self::id) is a UUIDv7 created when the value is built.
#[derive(Clone, PartialEq, Eq)]
pub struct NewEvent {
    id: EventId,
    key: Option<String>,
    event_type: String,
    topic: String,
    payload: Vec<u8>,
    headers: BTreeMap<String, String>,
    schedule: Option<Schedule>,
}

/// What [`NewEvent::deliver_at`] / [`NewEvent::deliver_after`] asked for,
/// unvalidated (validated by [`NewEvent::delivery`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Schedule {
    At(DateTime<Utc>),
    After(DeliveryDelay),
}

impl fmt::Debug for NewEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewEvent")
            .field("id", &self.id)
            .field("key", &self.key)
            .field("event_type", &self.event_type)
            .field("topic", &self.topic)
            .field("payload_len", &self.payload.len())
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("schedule", &self.schedule)
            .finish()
    }
}

impl NewEvent {
    /// A new event of `event_type` for `topic`, with a fresh UUIDv7 id.
    pub fn new(
        event_type: impl Into<String>,
        topic: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Self {
            id: EventId::new(),
            key: None,
            event_type: event_type.into(),
            topic: topic.into(),
            payload: payload.into(),
            headers: BTreeMap::new(),
            schedule: None,
        }
    }

    /// Sets the partition / aggregate key: events of one key keep their order
    /// and belong to one shard.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds one header (replacing a previous value of that name).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Adds several headers.
    pub fn with_headers<K: Into<String>, V: Into<String>>(
        mut self,
        headers: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.headers
            .extend(headers.into_iter().map(|(k, v)| (k.into(), v.into())));
        self
    }

    /// Delays the event: it is not delivered before `at`, compared with the
    /// DATABASE clock (the store's `now()`), never the application's. A time
    /// in the past delivers at once. Replaces an earlier `deliver_at` /
    /// `deliver_after`.
    ///
    /// Per-key order holds: a later event of the same key is not delivered
    /// before this one, so it waits too; events of other keys are not
    /// delayed. A time outside the years 1970-9999 (UTC) is refused at
    /// enqueue with [`ValidationError::DeliverAtOutOfRange`].
    ///
    /// ```
    /// use outbox_core::NewEvent;
    /// let at = chrono::Utc::now() + chrono::TimeDelta::hours(1);
    /// let e = NewEvent::new("invoice.due", "billing", b"{}".to_vec()).deliver_at(at);
    /// # let _ = e;
    /// ```
    pub fn deliver_at(mut self, at: DateTime<Utc>) -> Self {
        self.schedule = Some(Schedule::At(at));
        self
    }

    /// Delays the event by `delay` from the database's `now()` when it is
    /// inserted (the inserting transaction's start on PostgreSQL): the
    /// application's clock plays no part. Takes a [`std::time::Duration`] or
    /// a [`chrono::TimeDelta`]; zero delivers at once. Replaces an earlier
    /// `deliver_at` / `deliver_after`.
    ///
    /// Per-key order holds: a later event of the same key waits behind this
    /// one; events of other keys are not delayed. A negative delay is
    /// refused at enqueue with [`ValidationError::NegativeDelay`], one above
    /// [`MAX_DELIVERY_DELAY`] (100 years) with
    /// [`ValidationError::DelayTooLong`]; neither panics.
    ///
    /// ```
    /// use outbox_core::NewEvent;
    /// use std::time::Duration;
    /// let e = NewEvent::new("cart.reminder", "carts", b"{}".to_vec())
    ///     .with_key("cart-7")
    ///     .deliver_after(Duration::from_secs(30 * 60));
    /// # let _ = e;
    /// ```
    pub fn deliver_after(mut self, delay: impl Into<DeliveryDelay>) -> Self {
        self.schedule = Some(Schedule::After(delay.into()));
        self
    }

    /// When the event may be delivered, validated: `None` for an event that
    /// is not delayed (deliverable as soon as it commits). Store crates read
    /// this at enqueue.
    pub fn delivery(&self) -> Result<Option<Delivery>, ValidationError> {
        match self.schedule {
            None => Ok(None),
            Some(Schedule::At(at)) => {
                if (1970..=9999).contains(&at.year()) {
                    Ok(Some(Delivery::At(at)))
                } else {
                    Err(ValidationError::DeliverAtOutOfRange(at))
                }
            }
            Some(Schedule::After(delay)) => {
                let micros = delay.as_micros();
                if micros < 0 {
                    return Err(ValidationError::NegativeDelay { micros });
                }
                let max = i128::try_from(MAX_DELIVERY_DELAY.as_micros()).unwrap_or(i128::MAX);
                match u64::try_from(micros) {
                    Ok(us) if micros <= max => Ok(Some(Delivery::After(Duration::from_micros(us)))),
                    _ => Err(ValidationError::DelayTooLong {
                        secs: micros / 1_000_000,
                        max_secs: MAX_DELIVERY_DELAY.as_secs(),
                    }),
                }
            }
        }
    }

    /// Overrides the generated id (e.g. to make a retried request idempotent).
    pub fn with_id(mut self, id: EventId) -> Self {
        self.id = id;
        self
    }

    /// The id, known before commit.
    pub fn id(&self) -> EventId {
        self.id
    }

    /// The key, if any.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The key used for sharding: the key, or the id's text when there is none.
    pub fn shard_key(&self) -> String {
        shard_key(self.id, self.key.as_deref())
    }

    /// [`crate::key_hash`] of [`Self::shard_key`], as stored in the `key_hash` column.
    pub fn key_hash(&self) -> u32 {
        crate::shard::key_hash(self.shard_key().as_bytes())
    }

    /// The event type.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// The destination topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The headers.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// With feature `otel`: adds the current `tracing` span's W3C trace
    /// context as the `traceparent` / `tracestate` headers, unless the caller
    /// set a trace header (it wins) or there is no valid span context (then
    /// nothing is added); a header that would exceed `limits` is left out
    /// rather than failing the enqueue. See [`crate::trace`]. Without the
    /// feature it does nothing.
    ///
    /// Store crates call this at enqueue, before [`NewEvent::validate`], while
    /// the caller's span is current; an application does not need to.
    pub fn capture_trace_context(&mut self, limits: &EventLimits) {
        #[cfg(feature = "otel")]
        crate::trace::capture_current(
            &mut self.headers,
            limits.max_headers,
            limits.max_header_bytes,
        );
        #[cfg(not(feature = "otel"))]
        let _ = limits;
    }

    /// What every store's enqueue does with an event before binding it:
    /// [`capture_trace_context`](Self::capture_trace_context) (while the
    /// caller's span is current), then [`validate`](Self::validate).
    pub fn prepare(&mut self, limits: &EventLimits) -> Result<(), ValidationError> {
        self.capture_trace_context(limits);
        self.validate(limits)
    }

    /// [`prepare`](Self::prepare) for each of `events`, collected in the
    /// given order; the first refused event's id and why it was refused (a
    /// store enqueues a batch only when every event passes).
    pub fn prepare_all(
        events: impl IntoIterator<Item = NewEvent>,
        limits: &EventLimits,
    ) -> Result<Vec<NewEvent>, (EventId, ValidationError)> {
        let mut events: Vec<NewEvent> = events.into_iter().collect();
        for e in &mut events {
            e.prepare(limits).map_err(|source| (e.id(), source))?;
        }
        Ok(events)
    }

    /// Checks the event against `limits`; store crates call this at enqueue.
    ///
    /// A control character anywhere in the key, event type, topic, a header
    /// name or a header value is refused first, with
    /// [`ValidationError::ControlCharacter`] naming the field: no event can
    /// carry a line break (or NUL) into a broker header.
    pub fn validate(&self, limits: &EventLimits) -> Result<(), ValidationError> {
        if let Some(key) = &self.key {
            refuse_control(|| EventField::Key, key)?;
        }
        refuse_control(|| EventField::EventType, &self.event_type)?;
        refuse_control(|| EventField::Topic, &self.topic)?;
        for (name, value) in &self.headers {
            refuse_control(
                || EventField::HeaderName(name.escape_debug().to_string()),
                name,
            )?;
            refuse_control(|| EventField::HeaderValue(name.clone()), value)?;
        }
        if self.event_type.is_empty() {
            return Err(ValidationError::EmptyEventType);
        }
        if self.event_type.len() > 255 || !self.event_type.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ValidationError::InvalidEventType(self.event_type.clone()));
        }
        if self.topic.is_empty() {
            return Err(ValidationError::EmptyTopic);
        }
        if self.topic.len() > 249
            || self
                .topic
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(ValidationError::InvalidTopic(self.topic.clone()));
        }
        if self.payload.len() > limits.max_payload_bytes {
            return Err(ValidationError::PayloadTooLarge {
                size: self.payload.len(),
                max: limits.max_payload_bytes,
            });
        }
        if let Some(key) = &self.key {
            if key.is_empty() || key.len() > limits.max_key_bytes {
                return Err(ValidationError::InvalidKey {
                    size: key.len(),
                    max: limits.max_key_bytes,
                });
            }
        }
        if self.headers.len() > limits.max_headers {
            return Err(ValidationError::TooManyHeaders {
                count: self.headers.len(),
                max: limits.max_headers,
            });
        }
        for (name, value) in &self.headers {
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
                return Err(ValidationError::InvalidHeaderName(name.clone()));
            }
            let size = name.len() + value.len();
            if size > limits.max_header_bytes {
                return Err(ValidationError::HeaderTooLarge {
                    name: name.clone(),
                    size,
                    max: limits.max_header_bytes,
                });
            }
        }
        self.delivery()?;
        Ok(())
    }

    /// Splits the event into its parts (for store crates; read
    /// [`delivery`](Self::delivery) first).
    pub fn into_parts(self) -> EventParts {
        EventParts {
            id: self.id,
            key: self.key,
            event_type: self.event_type,
            topic: self.topic,
            payload: self.payload,
            headers: self.headers,
        }
    }
}

/// A [`NewEvent`]'s parts, as a store writes them
/// ([`NewEvent::into_parts`]; the delivery time is read with
/// [`NewEvent::delivery`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventParts {
    /// The event id (UUIDv7).
    pub id: EventId,
    /// The ordering key, if any.
    pub key: Option<String>,
    /// The event type.
    pub event_type: String,
    /// The topic.
    pub topic: String,
    /// The payload.
    pub payload: Vec<u8>,
    /// The headers.
    pub headers: BTreeMap<String, String>,
}

pub(crate) fn shard_key(id: EventId, key: Option<&str>) -> String {
    match key {
        Some(k) => k.to_owned(),
        None => id.to_string(),
    }
}

/// The last failure recorded on an event.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LastError {
    /// Stable code, e.g. `HANDLER_TEMPORARY_FAILURE`.
    pub code: ErrorCode,
    /// Human-readable detail.
    pub message: String,
}

/// A stored event, as claimed by a relay.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Event {
    /// UUIDv7 id; the broker deduplication id.
    pub id: EventId,
    /// Partition / aggregate key.
    pub key: Option<String>,
    /// Event type, e.g. `order.created`.
    pub event_type: String,
    /// Destination topic.
    pub topic: String,
    /// Payload bytes.
    pub payload: Vec<u8>,
    /// Headers (trace context lives here).
    pub headers: BTreeMap<String, String>,
    /// When the event was enqueued (database clock).
    pub created_at: DateTime<Utc>,
    /// Delivery attempts so far, including the one this claim started.
    pub attempts: u32,
    /// When the event became (or becomes) eligible for delivery.
    pub next_attempt_at: DateTime<Utc>,
    /// The previous attempt's failure, if any.
    pub last_error: Option<LastError>,
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("id", &self.id)
            .field("key", &self.key)
            .field("event_type", &self.event_type)
            .field("topic", &self.topic)
            .field("payload_len", &self.payload.len())
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("created_at", &self.created_at)
            .field("attempts", &self.attempts)
            .field("next_attempt_at", &self.next_attempt_at)
            .field("last_error", &self.last_error)
            .finish()
    }
}

impl Event {
    /// The key used for sharding: the key, or the id's text when there is none.
    pub fn shard_key(&self) -> String {
        shard_key(self.id, self.key.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> NewEvent {
        NewEvent::new("order.created", "orders", b"{}".to_vec())
    }

    #[test]
    fn ids_are_time_ordered_and_known_before_commit() {
        let a = ok();
        let b = ok();
        assert!(a.id() < b.id());
        assert_eq!(a.id().as_uuid().get_version_num(), 7);
    }

    #[test]
    fn validation_names_the_problem() {
        let l = EventLimits::default();
        assert_eq!(ok().validate(&l), Ok(()));
        assert_eq!(
            NewEvent::new("", "t", vec![]).validate(&l),
            Err(ValidationError::EmptyEventType)
        );
        assert_eq!(
            NewEvent::new("e", "", vec![]).validate(&l),
            Err(ValidationError::EmptyTopic)
        );
        assert!(matches!(
            NewEvent::new("e", "a b", vec![]).validate(&l),
            Err(ValidationError::InvalidTopic(_))
        ));
        let small = EventLimits {
            max_payload_bytes: 3,
            ..l
        };
        assert_eq!(
            NewEvent::new("e", "t", vec![0; 4]).validate(&small),
            Err(ValidationError::PayloadTooLarge { size: 4, max: 3 })
        );
        assert!(matches!(
            ok().with_header("bad name", "v").validate(&l),
            Err(ValidationError::InvalidHeaderName(_))
        ));
        assert!(matches!(
            ok().with_header("a:b", "v").validate(&l),
            Err(ValidationError::InvalidHeaderName(_))
        ));
        assert_eq!(
            ok().with_header("x", "a\r\nb").validate(&l),
            Err(ValidationError::ControlCharacter {
                field: EventField::HeaderValue("x".into()),
                code: 0x0D,
                at: 1
            })
        );
        assert!(matches!(
            ok().with_key("").validate(&l),
            Err(ValidationError::InvalidKey { .. })
        ));
        let e = NewEvent::new("e", "t", vec![0; 4])
            .validate(&small)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "payload is 4 bytes, above the maximum of 3 bytes"
        );
    }

    #[test]
    fn control_characters_are_refused_in_every_field_that_reaches_a_header() {
        let l = EventLimits::default();
        let refused = |e: NewEvent| match e.validate(&l) {
            Err(ValidationError::ControlCharacter { field, code, at }) => (field, code, at),
            other => panic!("expected ControlCharacter, got {other:?}"),
        };
        for (c, code) in [
            ('\r', 0x0D),
            ('\n', 0x0A),
            ('\0', 0),
            ('\t', 9),
            ('\u{7f}', 0x7F),
            ('\u{85}', 0x85),
        ] {
            let key = format!("order-{c}Outbox-Event-Type: evil");
            assert_eq!(
                refused(ok().with_key(key)),
                (EventField::Key, code, 6),
                "{c:?} in the key"
            );
        }
        assert_eq!(
            refused(NewEvent::new("order\r\n.created", "t", vec![])),
            (EventField::EventType, 0x0D, 5)
        );
        assert_eq!(
            refused(NewEvent::new("e", "orders\n", vec![])),
            (EventField::Topic, 0x0A, 6)
        );
        assert_eq!(
            refused(ok().with_header("x\r\ny", "v")),
            (EventField::HeaderName("x\\r\\ny".into()), 0x0D, 1)
        );
        assert_eq!(
            refused(ok().with_header("x-tenant", "a\0b")),
            (EventField::HeaderValue("x-tenant".into()), 0, 1)
        );
        // Printable text, spaces and non-ASCII letters in a key are fine.
        assert_eq!(ok().with_key("customer 42 / Zoë").validate(&l), Ok(()));
        let msg = ok()
            .with_key("a\r\nb")
            .validate(&l)
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "the key contains control character U+000D at byte 1; control characters could inject broker headers"
        );
    }

    #[test]
    fn debug_does_not_print_payload() {
        let e = ok().with_header("authorization", "secret-token");
        let s = format!("{e:?}");
        assert!(!s.contains("secret-token"));
        assert!(s.contains("payload_len"));
    }

    #[test]
    fn delays_are_validated_without_panicking() {
        let l = EventLimits::default();
        assert_eq!(ok().delivery(), Ok(None));
        assert_eq!(
            ok().deliver_after(Duration::ZERO).delivery(),
            Ok(Some(Delivery::After(Duration::ZERO)))
        );
        // Rounded up to whole microseconds: never early.
        assert_eq!(
            ok().deliver_after(Duration::from_nanos(1_500)).delivery(),
            Ok(Some(Delivery::After(Duration::from_micros(2))))
        );
        assert_eq!(
            ok().deliver_after(chrono::TimeDelta::seconds(2)).delivery(),
            Ok(Some(Delivery::After(Duration::from_secs(2))))
        );
        assert_eq!(ok().deliver_after(MAX_DELIVERY_DELAY).validate(&l), Ok(()));
        let negative = ok()
            .deliver_after(chrono::TimeDelta::seconds(-5))
            .validate(&l)
            .unwrap_err();
        assert_eq!(
            negative,
            ValidationError::NegativeDelay { micros: -5_000_000 }
        );
        assert!(negative.to_string().contains("negative"), "{negative}");
        for huge in [
            ok().deliver_after(Duration::MAX),
            ok().deliver_after(MAX_DELIVERY_DELAY + Duration::from_micros(1)),
            ok().deliver_after(chrono::TimeDelta::MAX),
        ] {
            let e = huge.validate(&l).unwrap_err();
            assert!(
                matches!(e, ValidationError::DelayTooLong { max_secs, .. } if max_secs == MAX_DELIVERY_DELAY.as_secs()),
                "{e:?}"
            );
            assert!(e.to_string().contains("above the maximum"), "{e}");
        }
        let at = DateTime::<Utc>::from_timestamp(1_700_000_000, 0).unwrap();
        assert_eq!(ok().deliver_at(at).delivery(), Ok(Some(Delivery::At(at))));
        for far in [DateTime::<Utc>::MAX_UTC, DateTime::<Utc>::MIN_UTC] {
            assert_eq!(
                ok().deliver_at(far).validate(&l),
                Err(ValidationError::DeliverAtOutOfRange(far))
            );
        }
        // The last call wins.
        assert_eq!(
            ok().deliver_at(at)
                .deliver_after(Duration::from_secs(1))
                .delivery(),
            Ok(Some(Delivery::After(Duration::from_secs(1))))
        );
    }

    #[test]
    fn shard_key_falls_back_to_id() {
        let e = ok();
        assert_eq!(e.shard_key(), e.id().to_string());
        assert_eq!(ok().with_key("k").shard_key(), "k");
    }
}
