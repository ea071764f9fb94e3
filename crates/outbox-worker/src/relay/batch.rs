//! A claimed batch and what becomes of it: the claim the relay holds
//! ([`Held`]), the relay's decision for each of its events ([`Fate`]) and
//! the settlement it asks the store for ([`Plan`]). Plain data and pure
//! functions: no store, no sink, no clock read.

use outbox_core::{
    Claim, DeliveryError, Event, EventId, LastError, Outcome, Resolution, RetryPolicy,
};
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, error};

/// A claim and the relay's estimate of its lease end.
pub(super) struct Held {
    pub(super) claim: Claim,
    pub(super) until: Instant,
    /// The batch size the claim asked for (it came back full when it holds
    /// that many events).
    pub(super) asked: u32,
}

impl Held {
    /// Whether the claim came back with as many events as it asked for.
    pub(super) fn is_full(&self) -> bool {
        self.claim.events.len() >= usize::try_from(self.asked).unwrap_or(usize::MAX)
    }
}

/// Why events were released (the `reason` label of `outbox_events_released_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReleaseReason {
    SinkUnavailable,
    NotAttempted,
    DeliveryTimeout,
    Shutdown,
    MissingOutcome,
    LeaseRenewal,
    LeaseLost,
    LeaseExpired,
}

impl ReleaseReason {
    /// Every reason, in declaration order (so `reason as usize` indexes it).
    pub(super) const ALL: [ReleaseReason; 8] = [
        ReleaseReason::SinkUnavailable,
        ReleaseReason::NotAttempted,
        ReleaseReason::DeliveryTimeout,
        ReleaseReason::Shutdown,
        ReleaseReason::MissingOutcome,
        ReleaseReason::LeaseRenewal,
        ReleaseReason::LeaseLost,
        ReleaseReason::LeaseExpired,
    ];

    /// The metric label.
    pub(super) fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::SinkUnavailable => "sink_unavailable",
            ReleaseReason::NotAttempted => "not_attempted",
            ReleaseReason::DeliveryTimeout => "delivery_timeout",
            ReleaseReason::Shutdown => "shutdown",
            ReleaseReason::MissingOutcome => "missing_outcome",
            ReleaseReason::LeaseRenewal => "lease_renewal",
            ReleaseReason::LeaseLost => "lease_lost",
            ReleaseReason::LeaseExpired => "lease_expired",
        }
    }
}

/// What the relay decided for one event of a batch.
#[derive(Debug, Clone)]
pub(super) enum Fate {
    Delivered,
    Retry {
        delay: Duration,
        error: DeliveryError,
    },
    Dead {
        error: DeliveryError,
    },
    Released(ReleaseReason),
}

impl Fate {
    /// The resolution the store records for this fate.
    pub(super) fn resolution(&self) -> Resolution {
        let last = |e: &DeliveryError| LastError {
            code: e.code().clone(),
            message: e.message().to_owned(),
        };
        match self {
            Fate::Delivered => Resolution::Delivered,
            Fate::Retry { delay, error } => Resolution::Retry {
                delay: *delay,
                error: last(error),
            },
            Fate::Dead { error } => Resolution::Dead { error: last(error) },
            Fate::Released(_) => Resolution::Released,
        }
    }

    /// The fate of an event-level failure under the retry policy: another
    /// attempt after a jittered delay, or the dead letters.
    pub(super) fn of_failure(policy: &RetryPolicy, event: &Event, error: DeliveryError) -> Fate {
        if !error.is_retryable() || !policy.should_retry(event.attempts) {
            Fate::Dead { error }
        } else {
            Fate::Retry {
                delay: policy.next_delay(event.attempts, rand::random()),
                error,
            }
        }
    }

    /// The fates of a batch from the sink's outcomes, one per event in the
    /// batch's order (a missing outcome releases its event); notes the first
    /// sink-level failure in `sink_down`.
    pub(super) fn of_outcomes(
        policy: &RetryPolicy,
        events: &[Event],
        outcomes: Vec<Outcome>,
        sink_down: &mut Option<DeliveryError>,
    ) -> Vec<Fate> {
        if outcomes.len() != events.len() {
            error!(
                events = events.len(),
                outcomes = outcomes.len(),
                "sink returned the wrong number of outcomes (a sink bug); missing ones are released"
            );
        }
        let mut outcomes = outcomes.into_iter();
        events
            .iter()
            .map(|event| match outcomes.next() {
                Some(Outcome::Delivered) => Fate::Delivered,
                Some(Outcome::Failed(error)) if error.is_sink_unavailable() => {
                    debug!(event_id = %event.id, error = %error, "sink unavailable");
                    sink_down.get_or_insert(error);
                    Fate::Released(ReleaseReason::SinkUnavailable)
                }
                Some(Outcome::Failed(error)) => Fate::of_failure(policy, event, error),
                Some(_) => Fate::Released(ReleaseReason::NotAttempted),
                None => Fate::Released(ReleaseReason::MissingOutcome),
            })
            .collect()
    }
}

/// How a settlement treats fenced ids (events another relay took over).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fenced {
    /// Logged at WARN: the first news of the lost lease.
    Warn,
    /// Logged at DEBUG: the loss was logged at WARN already (a stopped
    /// delivery).
    Quiet,
    /// Every event was taken over (a stopped delivery, logged at WARN
    /// already): the store would fence the settlement in full, so it is not
    /// asked (no round trip to a store that may be struggling); every event
    /// counts as lost.
    All,
}

/// The settlement of one claimed batch, as the relay asks the store for
/// it: every batch the relay claimed ends as one plan, settled by
/// `Relay::settle` (the one route to [`Store::settle`](outbox_core::Store::settle)).
pub(super) struct Plan {
    pub(super) claim: Claim,
    /// One per event, in the claim's order.
    pub(super) fates: Vec<Fate>,
    /// The lease end known at claim time (a renewal may have moved it; the
    /// leases being renewed know the latest).
    pub(super) until: Instant,
    /// When delivery started; `None` for a batch whose events were not
    /// processed (no processing time is recorded for it).
    pub(super) started: Option<Instant>,
    /// How fenced ids are treated.
    pub(super) fenced: Fenced,
}

impl Plan {
    /// Every event of `held` given back unattempted for `reason` (lease
    /// cleared, attempt not counted): a claim never handed to the sink.
    pub(super) fn give_back(held: Held, reason: ReleaseReason) -> Plan {
        Plan {
            fates: vec![Fate::Released(reason); held.claim.events.len()],
            claim: held.claim,
            until: held.until,
            started: None,
            fenced: Fenced::Warn,
        }
    }
}

/// The ids, comma-separated (for a log line).
pub(super) fn join_ids(ids: &[EventId]) -> String {
    let mut s = String::with_capacity(ids.len() * 37);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&id.to_string());
    }
    s
}
