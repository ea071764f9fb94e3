//! The [`Store`] and [`Sink`] traits, and the data they exchange.

use crate::{DeliveryError, ErrorCode, Event, EventId, LastError, Outcome, ShardSpec};
use chrono::{DateTime, Utc};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// Identifies one relay instance (recorded as the lease owner). Free text,
/// e.g. `hostname:pid`.
#[derive(Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct RelayId(String);

impl RelayId {
    /// A relay id from any text.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// `hostname-pid`-like default from the process id and a random suffix.
    pub fn generate() -> Self {
        let suffix = Uuid::new_v4().simple().to_string();
        Self(format!("relay-{}-{}", std::process::id(), &suffix[..8]))
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
}

/// What to do with an event that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Make it eligible again at the database's `now() + delay`.
    Retry {
        /// Delay from the retry policy.
        delay: Duration,
    },
    /// Move it to the dead letters.
    Dead,
}

/// A failed event and its fate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The event.
    pub id: EventId,
    /// Why it failed.
    pub error: DeliveryError,
    /// Retry later, or dead-letter.
    pub disposition: Disposition,
}

/// What a fenced write changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FenceReport {
    /// Events the write applied to.
    pub applied: u64,
    /// Events it did not apply to because the token no longer owns them
    /// (the lease expired and another relay re-claimed them, or they are gone).
    pub lost: Vec<EventId>,
}

impl FenceReport {
    /// Whether every event was still owned by the token.
    pub fn all_applied(&self) -> bool {
        self.lost.is_empty()
    }
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

/// Which dead letters to list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterQuery {
    /// Only these error codes (all when `None`).
    pub code: Option<ErrorCode>,
    /// Most rows to return.
    pub limit: u32,
    /// Keyset pagination: only ids after this one.
    pub after: Option<EventId>,
}

impl Default for DeadLetterQuery {
    fn default() -> Self {
        Self {
            code: None,
            limit: 100,
            after: None,
        }
    }
}

/// Where events live: claims, fenced outcomes, stats.
///
/// Enqueue is not here: it takes the backend's own transaction type, so each
/// store crate offers it as a function.
pub trait Store: Send + Sync + 'static {
    /// The store's error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Claims up to `req.batch_size` eligible events of `req.shard` in one
    /// round trip: pending with `next_attempt_at <= now()`, or leased with an
    /// expired lease. Sets a fresh fencing token, the lease and `attempts + 1`.
    fn claim(&self, req: &ClaimRequest) -> impl Future<Output = Result<Claim, Self::Error>> + Send;

    /// Marks events delivered (one statement), if `token` still owns them.
    fn complete(
        &self,
        token: FencingToken,
        ids: &[EventId],
    ) -> impl Future<Output = Result<FenceReport, Self::Error>> + Send;

    /// Records failures: schedules retries at `now() + delay` or moves events
    /// to the dead letters, if `token` still owns them.
    fn fail(
        &self,
        token: FencingToken,
        failures: &[Failure],
    ) -> impl Future<Output = Result<FenceReport, Self::Error>> + Send;

    /// Gives events back unattempted (shutdown): clears the lease and undoes
    /// the claim's attempt count, if `token` still owns them.
    fn release(
        &self,
        token: FencingToken,
        ids: &[EventId],
    ) -> impl Future<Output = Result<FenceReport, Self::Error>> + Send;

    /// Current counts.
    fn stats(&self) -> impl Future<Output = Result<Stats, Self::Error>> + Send;

    /// A signal the store fires when new events may be ready (e.g. Postgres
    /// LISTEN/NOTIFY). The relay waits on it between polls; `None` means
    /// poll only.
    fn wakeup(&self) -> Option<Arc<tokio::sync::Notify>> {
        None
    }
}

/// Dead-letter administration.
pub trait DeadLetterStore: Send + Sync + 'static {
    /// The store's error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Lists dead letters, oldest id first.
    fn list_dead(
        &self,
        query: &DeadLetterQuery,
    ) -> impl Future<Output = Result<Vec<DeadLetter>, Self::Error>> + Send;

    /// Moves dead letters back to pending (attempts reset to 0, eligible now).
    /// `None` means all of them. Returns how many moved.
    fn retry_dead(
        &self,
        ids: Option<&[EventId]>,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Deletes dead letters for good. `None` means all of them. Returns how many.
    fn purge_dead(
        &self,
        ids: Option<&[EventId]>,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;
}

/// Where events go: a broker publisher or in-process handlers.
pub trait Sink: Send + Sync + 'static {
    /// Delivers a batch and returns exactly one [`Outcome`] per event, in the
    /// same order. `Delivered` only once the destination took responsibility
    /// (broker acknowledgement, handler success). Whole-batch problems (no
    /// connection) are reported as a retryable failure for every event.
    fn deliver(&self, events: &[Event]) -> impl Future<Output = Vec<Outcome>> + Send;
}

impl<S: Sink> Sink for Arc<S> {
    fn deliver(&self, events: &[Event]) -> impl Future<Output = Vec<Outcome>> + Send {
        (**self).deliver(events)
    }
}
