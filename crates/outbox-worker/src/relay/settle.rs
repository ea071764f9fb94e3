//! Settling a batch: the one route from a claimed batch to the store.
//! Every batch the relay claimed ends here as a [`Plan`]: delivered,
//! failed, stopped, or given back unattempted. One [`Store::settle`] call
//! (retried while retryable and while the lease lasts), then what the
//! store's report means for the summary, the metrics, the logs and the
//! listener.

use super::batch::{join_ids, Fate, Fenced, Plan, ReleaseReason};
use super::report::{Progress, RelaySummary};
use super::state::Relay;
use crate::lease::Leases;
use crate::metrics as m;
use outbox_core::{EventId, FencingToken, Retryable, SettleReport, Settlement, Sink, Store};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

/// Settle retries start at this delay and double up to [`SETTLE_RETRY_MAX`].
const SETTLE_RETRY_FIRST: Duration = Duration::from_millis(50);
/// Longest wait between two settle attempts.
const SETTLE_RETRY_MAX: Duration = Duration::from_secs(2);

impl<St: Store, Si: Sink> Relay<St, Si> {
    /// Settles one batch as `plan` says: the one route from a claimed
    /// batch to the store. Stops the renewal of its lease (the lease end
    /// the renewals reached bounds the settle retries), asks the store
    /// with one [`Store::settle`] (none when every event was taken over),
    /// then logs, counts and reports each event the store settled; fenced
    /// ids count as lost, rejected ones are reported with the store's
    /// reason.
    pub(super) async fn settle(&self, plan: Plan, leases: &Leases, summary: &mut RelaySummary) {
        let Plan {
            claim,
            fates,
            until,
            started,
            fenced: fenced_log,
        } = plan;
        let lease_until = leases.remove(claim.token).unwrap_or(until);
        if fenced_log == Fenced::All {
            let events = claim.events.len() as u64;
            let ids: Vec<EventId> = claim.events.iter().map(|e| e.id).collect();
            summary.lease_lost += events;
            self.meters().lease_lost.increment(events);
            self.notify(|| Progress::LeaseLost { ids });
            return;
        }
        let mut settlement = Settlement::new();
        for (event, fate) in claim.events.iter().zip(&fates) {
            settlement.push(event.id, fate.resolution());
        }
        let Some(report) = self
            .settle_retrying(claim.token, &settlement, lease_until)
            .await
        else {
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
        let meters = self.meters();
        // Measured once per batch, not per event: the batch settled at once.
        let process_seconds = started.map(|s| s.elapsed().as_secs_f64());
        let mut delivered: u64 = 0;
        for (event, fate) in claim.events.iter().zip(&fates) {
            if fenced.contains(&event.id) {
                continue;
            }
            if let Some(reason) = rejected.get(&event.id) {
                summary.rejected += 1;
                meters.rejected.increment(1);
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
                if let Some(seconds) = process_seconds {
                    meters.process_seconds.record(seconds);
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
                    metrics::counter!(m::EVENTS_RETRIED, meters.labels_with("code", code))
                        .increment(1);
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
                    metrics::counter!(m::EVENTS_DEAD, meters.labels_with("code", code))
                        .increment(1);
                    warn!(event_id = %event.id, attempts = event.attempts, error = %error, "dead-lettered");
                    self.notify(|| Progress::Dead {
                        id: event.id,
                        event_type: event.event_type.clone(),
                        attempts: event.attempts,
                        error: error.clone(),
                    });
                }
                Fate::Released(reason) => {
                    meters.released(*reason).increment(1);
                    if *reason == ReleaseReason::MissingOutcome {
                        error!(event_id = %event.id, "the sink returned no outcome for this event; released");
                    }
                    released.push(event.id);
                }
            }
        }
        if delivered > 0 {
            summary.delivered += delivered;
            meters.delivered.increment(delivered);
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
    async fn settle_retrying(
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
                    self.meters().settle_errors.increment(1);
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
    fn lease_lost(&self, report: &SettleReport, log: Fenced, summary: &mut RelaySummary) {
        if report.fenced.is_empty() {
            return;
        }
        summary.lease_lost += report.fenced.len() as u64;
        self.meters()
            .lease_lost
            .increment(report.fenced.len() as u64);
        let lost = join_ids(&report.fenced);
        let count = report.fenced.len();
        const LOST: &str = "lease lost: another relay re-claimed these events before their outcome was recorded; nothing was changed";
        match log {
            Fenced::Warn | Fenced::All => {
                warn!(%lost, count, lock_timeout = ?self.options.lock_timeout(), "{LOST}");
            }
            Fenced::Quiet => debug!(%lost, count, "{LOST}"),
        }
        self.notify(|| Progress::LeaseLost {
            ids: report.fenced.clone(),
        });
    }
}
