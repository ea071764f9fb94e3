//! The [`Store`] and [`Sink`] traits, and the data they exchange.

use crate::error::{ErrorCode, Outcome};
use crate::event::{Event, EventId, LastError};
use crate::shard::ShardSpec;
use chrono::{DateTime, Utc};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// Identifies one relay instance (recorded as the lease owner). Free text,
/// e.g. `hostname:pid`.
///
/// Two relays running with the same id are one lease owner to a store:
/// each may renew, settle or rebalance what the other holds. An id an
/// operator configures (`outbox-relay run --relay-id`) is therefore made
/// unique per process with [`RelayId::unique`] (`relay-a#3f09c2`), and
/// [`RelayId::configured`] gives back the configured part for display.
#[derive(Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct RelayId(String);

/// Random hex digits [`RelayId::unique`] appends.
const INSTANCE_DIGITS: usize = 6;

impl RelayId {
    /// Separates a configured id from the per-instance suffix that
    /// [`RelayId::unique`] appends.
    pub const INSTANCE_SEPARATOR: char = '#';

    /// A relay id from any text.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// `hostname-pid`-like default from the process id and a random suffix.
    pub fn generate() -> Self {
        let suffix = Uuid::new_v4().simple().to_string();
        Self(format!("relay-{}-{}", std::process::id(), &suffix[..8]))
    }

    /// `configured` followed by `#` and 6 random lowercase hex digits, e.g.
    /// `relay-a#3f09c2`: every call (so every relay process) gets its own
    /// lease owner id, while the configured part stays readable in logs,
    /// `outbox-relay status` and the store's tables. 24 random bits: two
    /// processes started with the same configured id collide with odds of
    /// one in 16.7 million.
    ///
    /// ```
    /// use outbox_core::RelayId;
    ///
    /// let (a, b) = (RelayId::unique("relay-a"), RelayId::unique("relay-a"));
    /// assert_ne!(a, b);
    /// assert!(a.as_str().starts_with("relay-a#"));
    /// assert_eq!((a.configured(), b.configured()), ("relay-a", "relay-a"));
    /// ```
    pub fn unique(configured: impl Into<String>) -> Self {
        let mut id = configured.into();
        let random = Uuid::new_v4().simple().to_string();
        id.push(Self::INSTANCE_SEPARATOR);
        // The first 12 hex digits of a v4 UUID are all random.
        id.push_str(&random[..INSTANCE_DIGITS]);
        Self(id)
    }

    /// The id without the suffix [`RelayId::unique`] appends
    /// (`relay-a#3f09c2` -> `relay-a`); an id that does not end in `#` and 6
    /// lowercase hex digits is returned whole.
    pub fn configured(&self) -> &str {
        match self.0.rsplit_once(Self::INSTANCE_SEPARATOR) {
            Some((configured, suffix))
                if suffix.len() == INSTANCE_DIGITS
                    && suffix
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
            {
                configured
            }
            _ => &self.0,
        }
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for RelayId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RelayId({})", self.0)
    }
}

impl fmt::Display for RelayId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The fencing token of one claim. Every claim gets a fresh one; completing,
/// failing or releasing an event requires it, so a relay whose lease expired
/// and was re-claimed by another cannot overwrite the newer outcome.
#[derive(Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct FencingToken(Uuid);

impl FencingToken {
    /// A fresh random token.
    pub fn new() -> Self {
        Self(Uuid::new_v4())
    }

    /// Wraps a token read from storage.
    pub fn from_uuid(id: Uuid) -> Self {
        Self(id)
    }

    /// The token.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl Default for FencingToken {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FencingToken({})", self.0)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// What a relay asks a store for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The claiming relay (lease owner).
    pub relay_id: RelayId,
    /// At most this many events.
    pub batch_size: u32,
    /// Lease length; the lease ends at the database's `now() + lease`.
    pub lease: Duration,
    /// Only events whose key hash falls in this shard.
    pub shard: ShardSpec,
}

/// A batch of claimed events, all leased under one fencing token.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The token to present when completing, failing or releasing.
    pub token: FencingToken,
    /// When the lease ends (database clock).
    pub lease_until: DateTime<Utc>,
    /// The events, oldest first. `attempts` already counts this attempt.
    pub events: Vec<Event>,
    /// The claim stopped early: more events are ready now. It reached the
    /// batch size, or it read that many rows but set some aside (parked
    /// behind a retry of their key), or it ended before an event whose key
    /// has an earlier event still in flight. A relay claims again as soon as
    /// the batch is settled instead of waiting for new events.
    pub more: bool,
}

impl Claim {
    /// The claim of `events` (at most `req.batch_size`) under `token`, with
    /// [`more`](Self::more) set when it reached the batch size: the rule of
    /// a store whose claim stops only at the batch size (the event log has
    /// more reasons and sets `more` itself).
    pub fn up_to_batch_size(
        req: &ClaimRequest,
        token: FencingToken,
        lease_until: DateTime<Utc>,
        events: Vec<Event>,
    ) -> Self {
        Self {
            token,
            lease_until,
            more: events.len() >= usize::try_from(req.batch_size).unwrap_or(usize::MAX),
            events,
        }
    }
}

/// What to record for one claimed event when its batch is settled.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolution {
    /// The sink took responsibility: the event is done.
    Delivered,
    /// An event-level failure worth another attempt: eligible again at the
    /// database's `now() + delay`; the claim's attempt stays counted.
    Retry {
        /// Delay from the retry policy.
        delay: Duration,
        /// Why it failed (stored as `last_error`).
        error: LastError,
    },
    /// A permanent failure or the last attempt: move it to the dead letters.
    Dead {
        /// Why it died (stored as `last_error` of the dead letter).
        error: LastError,
    },
    /// Not attempted (sink unavailable, an earlier event of its key failed,
    /// shutdown, delivery timeout): lease cleared, the claim's attempt undone,
    /// eligible again at once.
    Released,
}

impl Resolution {
    /// A short lowercase name for logs and metrics labels.
    pub fn name(&self) -> &'static str {
        match self {
            Resolution::Delivered => "delivered",
            Resolution::Retry { .. } => "retry",
            Resolution::Dead { .. } => "dead",
            Resolution::Released => "released",
        }
    }
}

/// The outcome of a whole claimed batch, recorded by [`Store::settle`] in one
/// statement (or one transaction) under the claim's fencing token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settlement {
    items: Vec<(EventId, Resolution)>,
}

impl Settlement {
    /// An empty settlement.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one event's resolution.
    pub fn push(&mut self, id: EventId, resolution: Resolution) -> &mut Self {
        self.items.push((id, resolution));
        self
    }

    /// Builder-style [`Settlement::push`].
    pub fn with(mut self, id: EventId, resolution: Resolution) -> Self {
        self.push(id, resolution);
        self
    }

    /// Every event released (shutdown, delivery cancelled).
    pub fn release_all(ids: impl IntoIterator<Item = EventId>) -> Self {
        Self {
            items: ids
                .into_iter()
                .map(|id| (id, Resolution::Released))
                .collect(),
        }
    }

    /// The entries, in the order they were added.
    pub fn items(&self) -> &[(EventId, Resolution)] {
        &self.items
    }

    /// The ids whose resolution matches `f`.
    pub fn ids_where(&self, f: impl Fn(&Resolution) -> bool) -> Vec<EventId> {
        self.items
            .iter()
            .filter(|(_, r)| f(r))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Number of events.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether there is nothing to record.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// An event a settlement could not record as asked, and what the store did
/// instead (e.g. a dead letter whose id already existed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The event.
    pub id: EventId,
    /// What went wrong and what was done about it.
    pub reason: String,
}

/// What [`Store::settle`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SettleReport {
    /// Events whose resolution was recorded.
    pub applied: u64,
    /// Events not changed because the token no longer owns them (the lease
    /// expired and another relay re-claimed them, or they are gone).
    pub fenced: Vec<EventId>,
    /// Events recorded differently from what was asked, with the reason.
    pub rejected: Vec<Rejected>,
}

impl SettleReport {
    /// Whether every event was still owned by the token.
    pub fn all_applied(&self) -> bool {
        self.fenced.is_empty()
    }
}

/// Errors a store returns say whether trying the same call again may succeed
/// (a dropped connection, a timeout, a busy database) or not (a missing
/// table, bad credentials, a constraint).
pub trait Retryable {
    /// Whether the same call may succeed if tried again.
    fn is_retryable(&self) -> bool;
}

/// Counts for `outbox-relay status` and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    /// Events waiting for delivery (not leased), including ones scheduled for a retry.
    pub pending: u64,
    /// Events currently leased by a relay.
    pub in_flight: u64,
    /// Dead letters.
    pub dead: u64,
    /// Age of the oldest pending or in-flight event (database clock).
    pub oldest_pending_age: Option<Duration>,
}

/// A dead-lettered event and why it died.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeadLetter {
    /// The event as it was last attempted.
    pub event: Event,
    /// The final failure.
    pub error: LastError,
    /// When it was dead-lettered (database clock).
    pub dead_at: DateTime<Utc>,
}

impl DeadLetter {
    /// A dead letter whose final error is the event's `last_error` (stores
    /// record it when they dead-letter), or `MANUAL` when none was recorded.
    pub fn new(event: Event, dead_at: DateTime<Utc>) -> Self {
        let error = event.last_error.clone().unwrap_or(LastError {
            code: ErrorCode::MANUAL,
            message: String::new(),
        });
        Self {
            event,
            error,
            dead_at,
        }
    }
}

/// Which dead letters a list, count, retry or purge selects. Every criterion
/// that is set must hold (they are ANDed); the default selects every dead
/// letter. Stores bind each criterion as a query parameter.
///
/// Ages are measured from the dead letter's `dead_at` (when it was
/// dead-lettered) to the database's `now()`; stores cap them at 100 years.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterFilter {
    /// Only these ids (none match an empty list).
    pub ids: Option<Vec<EventId>>,
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only this final error code.
    pub code: Option<ErrorCode>,
    /// Only this key (events without a key never match).
    pub key: Option<String>,
    /// Only dead letters dead for at least this long (`dead_at <= now() - d`).
    pub older_than: Option<Duration>,
    /// Only dead letters dead for less than this long (`dead_at > now() - d`).
    pub newer_than: Option<Duration>,
}

impl DeadLetterFilter {
    /// Every dead letter.
    pub fn all() -> Self {
        Self::default()
    }

    /// The dead letters with these ids.
    pub fn ids(ids: impl IntoIterator<Item = EventId>) -> Self {
        Self::default().with_ids(ids)
    }

    /// Only these ids.
    pub fn with_ids(mut self, ids: impl IntoIterator<Item = EventId>) -> Self {
        self.ids = Some(ids.into_iter().collect());
        self
    }

    /// Only this event type.
    pub fn with_event_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = Some(event_type.into());
        self
    }

    /// Only this error code.
    pub fn with_code(mut self, code: ErrorCode) -> Self {
        self.code = Some(code);
        self
    }

    /// Only this key.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Only dead letters dead for at least `age`.
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }

    /// Only dead letters dead for less than `age`.
    pub fn newer_than(mut self, age: Duration) -> Self {
        self.newer_than = Some(age);
        self
    }

    /// Whether no criterion is set (it selects every dead letter).
    pub fn is_all(&self) -> bool {
        self == &Self::default()
    }
}

/// The longest age a [`DeadLetterFilter`] is applied with (100 years):
/// longer ones are capped, so `now() - age` stays in every store's range.
pub const MAX_DEAD_LETTER_AGE: Duration = Duration::from_secs(100 * 366 * 24 * 3600);

/// Which dead letters to list, and which page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterQuery {
    /// Which dead letters.
    pub filter: DeadLetterFilter,
    /// Most rows to return.
    pub limit: u32,
    /// Keyset pagination: only ids after this one.
    pub after: Option<EventId>,
}

impl DeadLetterQuery {
    /// The first page (100 rows) of the dead letters `filter` selects.
    pub fn new(filter: DeadLetterFilter) -> Self {
        Self {
            filter,
            ..Self::default()
        }
    }
}

impl Default for DeadLetterQuery {
    fn default() -> Self {
        Self {
            filter: DeadLetterFilter::default(),
            limit: 100,
            after: None,
        }
    }
}

/// Where events live: claims, fenced settlements, lease renewal, stats.
///
/// Enqueue is not here: it takes the backend's own transaction type, so each
/// store crate offers it as a function.
pub trait Store: Send + Sync + 'static {
    /// The store's error type.
    type Error: std::error::Error + Retryable + Send + Sync + 'static;

    /// Claims up to `req.batch_size` eligible events of `req.shard` in one
    /// round trip: pending with `next_attempt_at <= now()`, or leased with an
    /// expired lease. Sets a fresh fencing token, the lease and `attempts + 1`.
    /// A row that cannot be decoded is dead-lettered with
    /// [`ErrorCode::UNDECODABLE`](crate::ErrorCode::UNDECODABLE) and left out
    /// of the claim, never left leased.
    fn claim(&self, req: &ClaimRequest) -> impl Future<Output = Result<Claim, Self::Error>> + Send;

    /// Records the outcome of a claimed batch in ONE statement or
    /// transaction, for the events `token` still owns; reports the others as
    /// fenced. Idempotent for a given token: settling twice changes nothing
    /// the second time (those ids come back fenced).
    fn settle(
        &self,
        token: FencingToken,
        settlement: &Settlement,
    ) -> impl Future<Output = Result<SettleReport, Self::Error>> + Send;

    /// Extends the lease of every event `token` still holds to the database's
    /// `now() + lease`. Returns how many events it still holds (0: the lease
    /// was lost or the events were settled).
    fn renew(
        &self,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Current counts.
    fn stats(&self) -> impl Future<Output = Result<Stats, Self::Error>> + Send;

    /// Resolves when new events may be ready (e.g. a Postgres NOTIFY arrived
    /// since the last call). The relay races it against its poll timer; the
    /// default never resolves (poll only). A signal that arrives while nobody
    /// waits must be kept for the next call.
    fn wakeup(&self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }

    /// Relay `relay` stops for good (a graceful shutdown, after its last
    /// settlement): a store that shares the work among relays gives its
    /// share to the others now rather than when its leases run out. The
    /// default does nothing.
    fn leave(&self, relay: &RelayId) -> impl Future<Output = Result<(), Self::Error>> + Send {
        let _ = relay;
        std::future::ready(Ok(()))
    }
}

/// Dead-letter administration.
pub trait DeadLetterStore: Send + Sync + 'static {
    /// The store's error type.
    type Error: std::error::Error + Retryable + Send + Sync + 'static;

    /// Lists the dead letters `query.filter` selects, oldest id first.
    fn list_dead(
        &self,
        query: &DeadLetterQuery,
    ) -> impl Future<Output = Result<Vec<DeadLetter>, Self::Error>> + Send;

    /// How many dead letters `filter` selects (a dry run of retry or purge).
    fn count_dead(
        &self,
        filter: &DeadLetterFilter,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Replays the dead letters `filter` selects: back to pending with
    /// attempts reset to 0, eligible now, last error kept. Where a replayed
    /// event goes in its key's order is the store's documented rule (it
    /// never runs beside another event of its key). Returns how many moved.
    fn retry_dead(
        &self,
        filter: &DeadLetterFilter,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Deletes the dead letters `filter` selects, for good. Returns how many.
    fn purge_dead(
        &self,
        filter: &DeadLetterFilter,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;
}

/// Where events go: a broker publisher or in-process handlers.
pub trait Sink: Send + Sync + 'static {
    /// Delivers a batch and returns exactly one [`Outcome`] per event, in the
    /// same order. `Delivered` only once the destination took responsibility
    /// (broker acknowledgement, handler success). The sink's own problems (no
    /// connection, no acknowledgement in time) are reported as
    /// [`DeliveryError::unavailable`](crate::DeliveryError::unavailable) for
    /// every event they touched: they cost the events no attempt.
    ///
    /// A sink may deliver events of different keys in any order or
    /// concurrently; the relay wraps every sink in a per-key order layer, so
    /// a sink only ever sees at most one event of a key per call.
    fn deliver(&self, events: &[Event]) -> impl Future<Output = Vec<Outcome>> + Send;

    /// How long a message this sink was handed can still reach the
    /// destination after the [`Sink::deliver`] call that handed it over was
    /// dropped, or while the whole process was paused: a client library's
    /// own queue and retries (librdkafka holds a message for up to its
    /// `message.timeout.ms`). The relay stops handing over a batch, and
    /// drops a delivery, this much earlier than its lease end by its own
    /// clock, so that no copy reaches the broker after another relay may
    /// have taken the events over and published a key's later events.
    /// Zero (the default) for a sink that sends nothing once its call is
    /// dropped, or that the broker deduplicates (JetStream's message ids).
    fn late_send_bound(&self) -> Duration {
        Duration::ZERO
    }
}

impl<S: Sink> Sink for Arc<S> {
    fn deliver(&self, events: &[Event]) -> impl Future<Output = Vec<Outcome>> + Send {
        (**self).deliver(events)
    }

    fn late_send_bound(&self) -> Duration {
        (**self).late_send_bound()
    }
}

#[cfg(test)]
mod tests {
    use super::RelayId;

    #[test]
    fn a_unique_relay_id_keeps_the_configured_part_and_differs_per_call() {
        let a = RelayId::unique("relay-a");
        let b = RelayId::unique("relay-a");
        assert_ne!(a, b, "two processes of one configured id: two owners");
        for id in [&a, &b] {
            let (configured, suffix) = id.as_str().split_once('#').unwrap();
            assert_eq!(configured, "relay-a");
            assert_eq!(suffix.len(), 6);
            assert!(suffix
                .bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
            assert_eq!(id.configured(), "relay-a");
            assert_eq!(id.to_string(), id.as_str());
        }
        // A configured id with a `#` of its own keeps it.
        assert_eq!(RelayId::unique("a#b").configured(), "a#b");
        assert_eq!(RelayId::unique("x#abcdef").configured(), "x#abcdef");
        // Ids not made by `unique` are their own configured part.
        for plain in ["relay-a", "a#b", "a#ABCDEF", "a#abcdefa", "", "#"] {
            assert_eq!(RelayId::new(plain).configured(), plain);
        }
        assert_eq!(RelayId::new("a#012abc").configured(), "a");
    }
}
