//! Settling a batch: the fate of each event, the one retry loop for
//! settlements, and what a settlement report means for the summary, the
//! metrics, the logs and the listener.

use super::{Held, Progress, Relay, RelaySummary};
use crate::lease::Leases;
use crate::metrics as m;
use outbox_core::{
    Claim, DeliveryError, Event, EventId, FencingToken, LastError, Outcome, Resolution, Retryable,
    SettleReport, Settlement, Sink, Store,
};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

/// Settle retries start at this delay and double up to [`SETTLE_RETRY_MAX`].
pub(super) const SETTLE_RETRY_FIRST: Duration = Duration::from_millis(50);
/// Longest wait between two settle attempts.
pub(super) const SETTLE_RETRY_MAX: Duration = Duration::from_secs(2);

/// A processed batch whose settlement waits for the loop.
pub(super) struct Deferred {
    pub(super) claim: Claim,
    pub(super) fates: Vec<Fate>,
    pub(super) started: Instant,
    /// The lease end known at claim time (a renewal may have moved it).
    pub(super) until: Instant,
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

/// The level fenced ids of a settlement are logged at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FencedLog {
    /// WARN: the first news of the lost lease.
    Warn,
    /// DEBUG: the loss was logged at WARN already (a stopped delivery).
    Quiet,
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
}

impl<St: Store, Si: Sink> Relay<St, Si> {
    /// The delivery of `claim` was stopped because a renewal found its
    /// lease lost with `still_held` of its events: logs it (the one WARN
    /// of the batch), counts it, and reports the events taken over as lost.
    /// Nothing is settled unless the claim still holds events: those are
    /// released so they come back at once, not after the lock timeout.
    pub(super) async fn stop_lost(
        &self,
        claim: &Claim,
        still_held: u64,
        until: Instant,
        leases: &Leases,
        started: Instant,
        summary: &mut RelaySummary,
    ) {
        let events = claim.events.len();
        summary.deliveries_stopped += 1;
        metrics::counter!(m::LEASE_LOST_DELIVERIES_STOPPED, "stage" => "delivering").increment(1);
        warn!(
            token = %claim.token,
            events,
            still_held,
            after = ?started.elapsed(),
            lock_timeout = ?self.options.lock_timeout(),
            "lease lost while the batch was being delivered: delivery stopped, nothing more of it goes to the sink; the relay that holds it now delivers it again"
        );
        let until = leases.remove(claim.token).unwrap_or(until);
        if still_held == 0 {
            // Every event was taken over: a settlement would be fenced in
            // full (and cost a round trip to a store that may be struggling).
            let ids: Vec<EventId> = claim.events.iter().map(|e| e.id).collect();
            summary.lease_lost += events as u64;
            metrics::counter!(m::LEASE_LOST).increment(events as u64);
            self.notify(|| Progress::LeaseLost { ids });
        } else {
            let fates = vec![Fate::Released(ReleaseReason::LeaseLost); events];
            self.settle_report(claim, &fates, until, None, FencedLog::Quiet, summary)
                .await;
        }
    }

    /// Settles a batch whose settlement [`process`](Self::process) deferred.
    pub(super) async fn settle_deferred(
        &self,
        deferred: Deferred,
        leases: &Leases,
        summary: &mut RelaySummary,
    ) {
        let Deferred {
            claim,
            fates,
            started,
            until,
        } = deferred;
        let until = leases.remove(claim.token).unwrap_or(until);
        self.settle_and_report(&claim, &fates, until, Some(started), summary)
            .await;
    }

    /// Gives back a claim that was never handed to the sink.
    pub(super) async fn give_back(
        &self,
        held: Held,
        leases: &Leases,
        reason: ReleaseReason,
        summary: &mut RelaySummary,
    ) {
        let until = leases.remove(held.claim.token).unwrap_or(held.until);
        let fates = vec![Fate::Released(reason); held.claim.events.len()];
        self.settle_and_report(&held.claim, &fates, until, None, summary)
            .await;
    }

    /// Maps the sink's outcomes to fates; notes the first sink-level failure.
    pub(super) fn fates(
        &self,
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
                Some(Outcome::Failed(error)) => self.failed(event, error),
                Some(_) => Fate::Released(ReleaseReason::NotAttempted),
                None => Fate::Released(ReleaseReason::MissingOutcome),
            })
            .collect()
    }

    /// The fate of an event-level failure under the retry policy.
    pub(super) fn failed(&self, event: &Event, error: DeliveryError) -> Fate {
        let policy = self.options.retry();
        if !error.is_retryable() || !policy.should_retry(event.attempts) {
            Fate::Dead { error }
        } else {
            Fate::Retry {
                delay: policy.next_delay(event.attempts, rand::random()),
                error,
            }
        }
    }

    /// Settles a batch with one [`Store::settle`] (retried while retryable
    /// and the lease lasts), then logs, counts and reports each event.
    pub(super) async fn settle_and_report(
        &self,
        claim: &Claim,
        fates: &[Fate],
        lease_until: Instant,
        started: Option<Instant>,
        summary: &mut RelaySummary,
    ) {
        self.settle_report(claim, fates, lease_until, started, FencedLog::Warn, summary)
            .await;
    }

    /// [`settle_and_report`](Self::settle_and_report), with fenced ids
    /// logged at the level `fenced_log` says.
    pub(super) async fn settle_report(
        &self,
        claim: &Claim,
        fates: &[Fate],
        lease_until: Instant,
        started: Option<Instant>,
        fenced_log: FencedLog,
        summary: &mut RelaySummary,
    ) {
        let mut settlement = Settlement::new();
        for (event, fate) in claim.events.iter().zip(fates) {
            settlement.push(event.id, fate.resolution());
        }
        let Some(report) = self.settle(claim.token, &settlement, lease_until).await else {
            return;
        };
        let fenced: HashSet<EventId> = report.fenced.iter().copied().collect();
        self.lease_lost(&report, fenced_log, summary);
        let rejected: HashMap<EventId, &str> = report
            .rejected
            .iter()
            .map(|r| (r.id, r.reason.as_str()))
            .collect();
        let mut released: Vec<EventId> = Vec::new();
        // Resolved once per batch, not per event: the batch settled at once.
        let process_seconds = started.map(|s| {
            (
                metrics::histogram!(m::EVENT_PROCESS_SECONDS),
                s.elapsed().as_secs_f64(),
            )
        });
        let mut delivered: u64 = 0;
        for (event, fate) in claim.events.iter().zip(fates) {
            if fenced.contains(&event.id) {
                continue;
            }
            if let Some(reason) = rejected.get(&event.id) {
                summary.rejected += 1;
                metrics::counter!(m::EVENTS_REJECTED).increment(1);
                warn!(
                    event_id = %event.id,
                    asked = fate.resolution().name(),
                    reason = %reason,
                    "the store could not settle this event as asked"
                );
                self.notify(|| Progress::Rejected {
                    id: event.id,
                    reason: (*reason).to_owned(),
                });
                continue;
            }
            if !matches!(fate, Fate::Released(_)) {
                if let Some((histogram, seconds)) = &process_seconds {
                    histogram.record(*seconds);
                }
            }
            match fate {
                Fate::Delivered => {
                    delivered += 1;
                    debug!(event_id = %event.id, attempts = event.attempts, "delivered");
                    self.notify(|| Progress::Delivered {
                        id: event.id,
                        event_type: event.event_type.clone(),
                        attempts: event.attempts,
                    });
                }
                Fate::Retry { delay, error } => {
                    summary.retried += 1;
                    let code = error.code().as_str().to_owned();
                    metrics::counter!(m::EVENTS_RETRIED, "code" => code).increment(1);
                    info!(event_id = %event.id, attempts = event.attempts, retry_in = ?delay, error = %error, "delivery failed; retry scheduled");
                    self.notify(|| Progress::Retried {
                        id: event.id,
                        event_type: event.event_type.clone(),
                        attempts: event.attempts,
                        error: error.clone(),
                        delay: *delay,
                    });
                }
                Fate::Dead { error } => {
                    summary.dead += 1;
                    let code = error.code().as_str().to_owned();
                    metrics::counter!(m::EVENTS_DEAD, "code" => code).increment(1);
                    warn!(event_id = %event.id, attempts = event.attempts, error = %error, "dead-lettered");
                    self.notify(|| Progress::Dead {
                        id: event.id,
                        event_type: event.event_type.clone(),
                        attempts: event.attempts,
                        error: error.clone(),
                    });
                }
                Fate::Released(reason) => {
                    metrics::counter!(m::EVENTS_RELEASED, "reason" => reason.as_str()).increment(1);
                    if *reason == ReleaseReason::MissingOutcome {
                        error!(event_id = %event.id, "the sink returned no outcome for this event; released");
                    }
                    released.push(event.id);
                }
            }
        }
        if delivered > 0 {
            summary.delivered += delivered;
            metrics::counter!(m::EVENTS_DELIVERED).increment(delivered);
        }
        if !released.is_empty() {
            summary.released += released.len() as u64;
            debug!(released = %join_ids(&released), "released unattempted events");
            self.notify(|| Progress::Released { ids: released });
        }
    }

    /// The one retry loop for settlements: retried while the error is
    /// retryable, with a capped backoff, and no longer than the lease
    /// (after that the events come back to a claim anyway). `None` when it
    /// could not be recorded.
    pub(super) async fn settle(
        &self,
        token: FencingToken,
        settlement: &Settlement,
        lease_until: Instant,
    ) -> Option<SettleReport> {
        let mut delay = SETTLE_RETRY_FIRST;
        let mut attempt: u32 = 0;
        loop {
            attempt += 1;
            match self.store.settle(token, settlement).await {
                Ok(report) => return Some(report),
                Err(err) => {
                    metrics::counter!(m::STORE_ERRORS, "op" => "settle").increment(1);
                    if !err.is_retryable() {
                        error!(
                            error = %err,
                            %token,
                            events = settlement.len(),
                            "could not settle the batch (not retryable); its events come back when their lease expires"
                        );
                        return None;
                    }
                    if Instant::now() + delay >= lease_until {
                        error!(
                            error = %err,
                            %token,
                            attempts = attempt,
                            events = settlement.len(),
                            "could not settle the batch before its lease ran out; its events come back when it expires"
                        );
                        return None;
                    }
                    warn!(error = %err, %token, attempt, retry_in = ?delay, "settling the batch failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(SETTLE_RETRY_MAX);
                }
            }
        }
    }

    /// Logs and counts fenced-out events.
    pub(super) fn lease_lost(
        &self,
        report: &SettleReport,
        log: FencedLog,
        summary: &mut RelaySummary,
    ) {
        if report.fenced.is_empty() {
            return;
        }
        summary.lease_lost += report.fenced.len() as u64;
        metrics::counter!(m::LEASE_LOST).increment(report.fenced.len() as u64);
        let lost = join_ids(&report.fenced);
        let count = report.fenced.len();
        const LOST: &str = "lease lost: another relay re-claimed these events before their outcome was recorded; nothing was changed";
        match log {
            FencedLog::Warn => {
                warn!(%lost, count, lock_timeout = ?self.options.lock_timeout(), "{LOST}");
            }
            FencedLog::Quiet => debug!(%lost, count, "{LOST}"),
        }
        self.notify(|| Progress::LeaseLost {
            ids: report.fenced.clone(),
        });
    }
}

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
