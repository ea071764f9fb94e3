//! What the relay reports: each thing it does ([`Progress`], to the
//! listener), the totals of a run ([`RelaySummary`]) and the error code of a
//! sink that panicked.

use crate::breaker::SinkState;
use outbox_core::{DeliveryError, ErrorCode, EventId};
use std::time::Duration;

/// Code recorded when a sink panicked while delivering a batch (retryable:
/// every event of the batch counts the attempt, so a sink that panics on
/// one event dead-letters it after `max_attempts` instead of looping).
pub const SINK_PANICKED: ErrorCode = ErrorCode::from_static("SINK_PANICKED");

/// One thing the relay did, reported to the listener set with
/// [`Relay::with_listener`](super::Relay::with_listener) (the demo prints these as progress lines).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Progress {
    /// The event was delivered and marked done.
    Delivered {
        /// The event.
        id: EventId,
        /// Its type.
        event_type: String,
        /// Attempts including this one.
        attempts: u32,
    },
    /// The delivery failed and another attempt is scheduled.
    Retried {
        /// The event.
        id: EventId,
        /// Its type.
        event_type: String,
        /// Attempts so far (including the failed one).
        attempts: u32,
        /// Why it failed.
        error: DeliveryError,
        /// When the next attempt becomes eligible, from now (database clock).
        delay: Duration,
    },
    /// The event was moved to the dead letters.
    Dead {
        /// The event.
        id: EventId,
        /// Its type.
        event_type: String,
        /// Attempts made.
        attempts: u32,
        /// The final failure.
        error: DeliveryError,
    },
    /// The lease on these events was lost before their outcome was recorded;
    /// another relay owns them now and nothing was changed.
    LeaseLost {
        /// The events.
        ids: Vec<EventId>,
    },
    /// These events were given back unattempted (lease cleared, attempt not
    /// counted): the sink was unavailable, an earlier event of their key
    /// failed in the same batch, the delivery timed out, or the relay shut
    /// down.
    Released {
        /// The events.
        ids: Vec<EventId>,
    },
    /// The store could not record this event's resolution as asked and did
    /// what `reason` says instead.
    Rejected {
        /// The event.
        id: EventId,
        /// The store's reason.
        reason: String,
    },
    /// The sink's circuit breaker changed state (see [`SinkState`]).
    SinkStateChanged {
        /// The state it left.
        from: SinkState,
        /// The state it entered.
        to: SinkState,
    },
}

/// Totals of one [`Relay::run`](super::Relay::run) / [`Relay::run_until_idle`](super::Relay::run_until_idle).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelaySummary {
    /// Non-empty batches claimed.
    pub batches: u64,
    /// Events delivered and marked done.
    pub delivered: u64,
    /// Failures scheduled for another attempt.
    pub retried: u64,
    /// Events dead-lettered.
    pub dead: u64,
    /// Events whose outcome was not recorded because the lease was lost.
    pub lease_lost: u64,
    /// Events given back unattempted (sink unavailable, held back for
    /// per-key order, delivery timeout, shutdown).
    pub released: u64,
    /// Events the store could not settle as asked (see [`Progress::Rejected`]).
    pub rejected: u64,
    /// Deliveries cancelled after the delivery timeout.
    pub delivery_timeouts: u64,
    /// Batches whose delivery was stopped (or never started) because a
    /// lease renewal found their lease lost.
    pub deliveries_stopped: u64,
    /// Batches whose delivery was stopped (or never started) because their
    /// lease ended by the relay's own clock, no renewal having succeeded
    /// (the database did not answer).
    pub deliveries_expired: u64,
    /// Times the sink's circuit breaker opened from closed (sink outages).
    pub sink_outages: u64,
}
