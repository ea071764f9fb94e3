//! What holds delivery back: the heads of the retry lane and the events of
//! their keys waiting behind them ([`HeldKeyStore`]).
//!
//! Per-key order means one failing event holds its key: until it is
//! delivered (or, under the dead-head policy `move-on`, dead-lettered),
//! every later event of the key waits. An operator in an incident asks
//! "which key waits behind which event, and why": this is the store's
//! answer, read-only, for one consumer group.

use crate::event::{Event, EventId, LastError};
use crate::store::Retryable;
use chrono::{DateTime, Utc};
use std::future::Future;

/// Why a head holds its key.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum HeadState {
    /// Waiting for its next attempt, at `next_attempt_at` (in the past:
    /// due, the next claim takes it).
    Retrying {
        /// When it becomes eligible again (database clock).
        next_attempt_at: DateTime<Utc>,
    },
    /// Leased by a relay right now: an attempt is under way.
    InFlight {
        /// When the lease runs out (database clock).
        lease_until: DateTime<Utc>,
    },
    /// Dead-lettered under the dead-head policy `block`: its key stays
    /// held until the dead letter is replayed or purged.
    Dead {
        /// When it was dead-lettered (database clock).
        dead_at: DateTime<Utc>,
    },
}

/// One head of the retry lane and what waits behind it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HeldKey {
    /// The event that must go first. Its `key` is the held key; a keyless
    /// event waiting for its retry holds nothing else (`waiting` is 0).
    pub head: Event,
    /// Why it holds its key.
    pub state: HeadState,
    /// Events of the key waiting behind the head.
    pub waiting: u64,
    /// The id of the oldest event waiting behind the head.
    pub first_waiting: Option<EventId>,
}

impl HeldKey {
    /// The head's last failure, if it failed.
    pub fn last_error(&self) -> Option<&LastError> {
        self.head.last_error.as_ref()
    }
}

/// A page of [`HeldKey`]s: the keys with the most events waiting first.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct HeldKeys {
    /// At most the limit asked for.
    pub heads: Vec<HeldKey>,
    /// How many heads there are in all.
    pub total: u64,
}

/// The retry lane of a consumer group, read-only: each head (an event
/// that failed and waits for its retry or is being retried, or a blocking
/// dead letter) with how many events of its key wait behind it.
///
/// Stores answer for the consumer group they were opened for. What counts
/// as a head:
///
/// - an event that failed at least once and is not delivered yet, and is
///   the first undelivered event of its key (or has no key);
/// - a dead letter that blocks its key (dead-head policy `block`).
///
/// An event attempted for the first time holds its key for a moment only
/// and is not listed.
pub trait HeldKeyStore: Send + Sync + 'static {
    /// The store's error type.
    type Error: std::error::Error + Retryable + Send + Sync + 'static;

    /// Up to `limit` heads, the most events waiting first (then the oldest
    /// head first), and how many there are in all.
    fn held_keys(&self, limit: u32) -> impl Future<Output = Result<HeldKeys, Self::Error>> + Send;
}
