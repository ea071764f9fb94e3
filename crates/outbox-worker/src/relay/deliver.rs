//! The deliver step: one claimed batch handed to the sink under the
//! delivery timeout, the shutdown grace and the lease watch (overlapped
//! with the next claim in drain mode), and the settlement [`Plan`] its end
//! makes. A batch is settled here at once unless the sink is down; then
//! its plan goes back to the loop, which settles it after the batch claimed
//! ahead went back.

use super::batch::{join_ids, Fate, Fenced, Held, Plan, ReleaseReason};
use super::report::{RelaySummary, SINK_PANICKED};
use super::state::{Relay, Run};
use crate::lease::{Leases, Use};
use chrono::{DateTime, Utc};
use futures::FutureExt;
use outbox_core::{
    panic_message, Claim, ClaimRequest, DeliveryError, ErrorCode, EventId, Outcome, Sink, Store,
};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use tokio::time::Instant;
use tracing::{debug, error, info, info_span, warn, Instrument, Span};

/// How the sink call ended.
enum Delivery {
    Outcomes(Vec<Outcome>),
    Panicked(String),
    TimedOut,
    Abandoned,
    /// A renewal found the lease lost; the claim still held this many events.
    LeaseLost {
        still_held: u64,
    },
    /// The lease ended by the relay's own clock: no renewal succeeded in
    /// time (see the lease module).
    LeaseExpired,
}

/// What delivering one batch means for the loop.
pub(super) struct Delivered {
    /// The batch's settlement when it waits for the loop: the sink is down,
    /// and a batch claimed ahead (a later one) is given back first. Settled
    /// newest first, a store that reads in order (the PostgreSQL event log)
    /// rewinds its cursor over both instead of copying the older one's
    /// events into its retry lane (which would park those keys on its
    /// slower path). `None` once settled.
    pub(super) unsettled: Option<Plan>,
    /// Shutdown was requested during the batch.
    pub(super) stop: bool,
    /// The sink reported itself unavailable (first such error).
    pub(super) sink_down: Option<DeliveryError>,
    /// The delivery was stopped because the lease was lost (a half-open
    /// probe stopped that way proves nothing about the sink).
    pub(super) lease_lost: bool,
    /// The store stopped the claim early (a backlog behind keys in flight,
    /// rows parked): claim again at once, no wait.
    pub(super) more: bool,
}

impl<St: Store, Si: Sink> Relay<St, Si> {
    /// The deliver step: delivers `held` and settles it (see
    /// [`deliver_and_settle`](Self::deliver_and_settle)). In drain mode (a
    /// full batch, not a half-open probe, the group not paused) the next
    /// batch is claimed meanwhile and kept in `run.prefetched`: the events
    /// of this batch are leased, so that claim cannot take them, nor (per-key
    /// order) later events of their keys. Counts the batch.
    pub(super) async fn deliver_batch(
        &self,
        held: Held,
        probing: bool,
        run: &mut Run,
        leases: &Leases,
        shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Delivered {
        run.summary.batches += 1;
        let more = held.claim.more && !probing;
        // A paused group claims nothing more, not even ahead.
        let drain = self.options.drain() && held.is_full() && !probing && !self.paused().await;
        if !drain {
            let mut delivered = self
                .deliver_and_settle(held, leases, shutdown, &mut run.summary)
                .await;
            delivered.more = more;
            return delivered;
        }
        let ahead = ClaimRequest {
            batch_size: run.sizer.next(),
            ..run.req.clone()
        };
        let (mut delivered, next) = tokio::join!(
            self.deliver_and_settle(held, leases, shutdown, &mut run.summary),
            self.claim(&ahead, leases, Use::Prefetched)
        );
        delivered.more = more;
        match next {
            Ok(next) => {
                run.sizer
                    .observe(next.asked, next.claim.events.len(), next.claim.more);
                delivered.more = next.claim.more;
                if !next.claim.events.is_empty() {
                    run.prefetched = Some(next);
                }
            }
            Err(err) => {
                self.meters().claim_errors.increment(1);
                warn!(error = %err, "overlapping claim failed; claiming again");
            }
        }
        delivered
    }

    /// Delivers one batch and, unless the sink is down, settles it at once
    /// (both in the batch's span). With the sink down the plan is left in
    /// [`Delivered::unsettled`] for the loop.
    async fn deliver_and_settle(
        &self,
        held: Held,
        leases: &Leases,
        shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
        summary: &mut RelaySummary,
    ) -> Delivered {
        let span = self.batch_span(&held.claim);
        async {
            let mut delivered = self.deliver(held, leases, shutdown, summary).await;
            if delivered.sink_down.is_some() {
                return delivered;
            }
            if let Some(plan) = delivered.unsettled.take() {
                let events = plan.claim.events.len();
                // A stopped delivery's plan has no start: no timings.
                let timed = plan.started.map(|started| (started, started.elapsed()));
                self.settle(plan, leases, summary).await;
                if let Some((started, delivered_in)) = timed {
                    debug!(
                        events,
                        deliver_ms = delivered_in.as_secs_f64() * 1e3,
                        settle_ms = (started.elapsed() - delivered_in).as_secs_f64() * 1e3,
                        "batch done"
                    );
                }
            }
            delivered
        }
        .instrument(span)
        .await
    }

    /// The `outbox_batch` span of one batch. One batch serves many
    /// producers' traces: it links to each event's producer span (the
    /// handlers' per-event spans are their children).
    fn batch_span(&self, claim: &Claim) -> Span {
        let ids: Vec<EventId> = claim.events.iter().map(|e| e.id).collect();
        let span = info_span!(
            "outbox_batch",
            relay_id = %self.options.relay_id(),
            token = %claim.token,
            size = ids.len(),
            event_ids = %join_ids(&ids),
        );
        #[cfg(feature = "otel")]
        for event in &claim.events {
            outbox_core::trace::link(&span, &event.headers);
        }
        span
    }

    /// Hands the batch to the sink and turns the end of that into the
    /// batch's settlement plan; settles nothing. The delivery stops at
    /// once (its future dropped: a broker publisher sends nothing more, a
    /// handler still running is aborted) when a renewal finds the lease
    /// lost or the lease ends by the relay's clock; on shutdown it may
    /// finish within the grace period, else it is abandoned and released.
    async fn deliver(
        &self,
        held: Held,
        leases: &Leases,
        mut shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
        summary: &mut RelaySummary,
    ) -> Delivered {
        let started = Instant::now();
        let claim = held.claim;
        leases.delivering(claim.token);
        self.record_lag(&claim);
        debug!("delivering batch");

        let timeout = self.options.delivery_timeout();
        let deadline = tokio::time::Instant::now() + timeout;
        let delivery = AssertUnwindSafe(self.sink.deliver(&claim.events)).catch_unwind();
        let delivery = tokio::time::timeout_at(deadline, delivery);
        // The lease renewal (on this task) may find the lease lost
        // meanwhile. Looked at first at every poll: once the loss is
        // known the delivery is never polled again, and dropping it
        // stops the sink (no further send, handler tasks aborted).
        let lost = leases.lost(claim.token);
        // And the lease may end by this relay's clock, no renewal having
        // succeeded (the database does not answer): from then on another
        // relay may hold the events, so nothing more of them is sent.
        let expired = leases.expired(claim.token);
        // In a block of its own: the delivery future is dropped (a
        // stopped or abandoned one cancelled, its handler tasks aborted)
        // before the batch is settled.
        let (delivery, stop) = {
            let mut delivery = std::pin::pin!(async {
                tokio::select! {
                    biased;
                    still_held = lost => Delivery::LeaseLost { still_held },
                    () = expired => Delivery::LeaseExpired,
                    r = delivery => match r {
                        Ok(Ok(outcomes)) => Delivery::Outcomes(outcomes),
                        Ok(Err(panic)) => Delivery::Panicked(panic_message(panic.as_ref())),
                        Err(_) => Delivery::TimedOut,
                    },
                }
            });
            tokio::select! {
                biased;
                d = delivery.as_mut() => (d, false),
                () = shutdown.as_mut() => {
                    let grace = self.options.shutdown_grace();
                    info!(grace = ?grace, "shutdown requested; waiting for the in-flight batch");
                    let until = deadline.min(tokio::time::Instant::now() + grace);
                    match tokio::time::timeout_at(until, delivery.as_mut()).await {
                        Ok(d) => (d, true),
                        Err(_) => {
                            warn!("in-flight batch did not finish within the shutdown grace period; releasing it");
                            (Delivery::Abandoned, true)
                        }
                    }
                }
            }
        };
        let mut delivered = Delivered {
            unsettled: None,
            stop,
            sink_down: None,
            lease_lost: false,
            more: false,
        };
        let events = claim.events.len();
        let fates: Vec<Fate> = match delivery {
            Delivery::Outcomes(outcomes) => Fate::of_outcomes(
                self.options.retry(),
                &claim.events,
                outcomes,
                &mut delivered.sink_down,
            ),
            Delivery::Panicked(msg) => {
                error!(panic = %msg, "the sink panicked; the batch counts as a retryable failure");
                let error =
                    DeliveryError::retryable(SINK_PANICKED, format!("sink panicked: {msg}"));
                claim
                    .events
                    .iter()
                    .map(|e| Fate::of_failure(self.options.retry(), e, error.clone()))
                    .collect()
            }
            Delivery::TimedOut => {
                summary.delivery_timeouts += 1;
                self.meters().delivery_timeouts.increment(1);
                let error = DeliveryError::unavailable(
                    ErrorCode::DELIVERY_TIMEOUT,
                    format!("the sink did not finish the batch within the delivery timeout ({timeout:?})"),
                );
                warn!(code = %ErrorCode::DELIVERY_TIMEOUT, timeout = ?timeout, "{error}; delivery cancelled, events released");
                // No acknowledgement in time is the sink's failure.
                delivered.sink_down = Some(error);
                vec![Fate::Released(ReleaseReason::DeliveryTimeout); events]
            }
            Delivery::Abandoned => vec![Fate::Released(ReleaseReason::Shutdown); events],
            Delivery::LeaseExpired => {
                summary.deliveries_expired += 1;
                self.meters().expired_stopped.delivering.increment(1);
                warn!(
                    events,
                    after = ?started.elapsed(),
                    lock_timeout = ?self.options.lock_timeout(),
                    "lease ended by this relay's clock (no renewal succeeded: the database does not answer): delivery stopped, nothing more of the batch goes to the sink; its events are released"
                );
                vec![Fate::Released(ReleaseReason::LeaseExpired); events]
            }
            Delivery::LeaseLost { still_held } => {
                // Not settled as delivered, failed or retried: another
                // relay holds the events now.
                delivered.lease_lost = true;
                delivered.unsettled =
                    Some(self.stopped_lost(claim, still_held, held.until, started, summary));
                return delivered;
            }
        };
        delivered.unsettled = Some(Plan {
            claim,
            fates,
            until: held.until,
            started: Some(started),
            fenced: Fenced::Warn,
        });
        delivered
    }

    /// The delivery of `claim` was stopped because a renewal found its
    /// lease lost with `still_held` of its events: logs it (the one WARN
    /// of the batch), counts it, and plans its settlement: the events
    /// taken over count as lost and nothing is asked of the store, unless
    /// the claim still holds events: those are released so they come back
    /// at once, not after the lock timeout.
    fn stopped_lost(
        &self,
        claim: Claim,
        still_held: u64,
        until: Instant,
        started: Instant,
        summary: &mut RelaySummary,
    ) -> Plan {
        let events = claim.events.len();
        summary.deliveries_stopped += 1;
        self.meters().lost_stopped.delivering.increment(1);
        warn!(
            token = %claim.token,
            events,
            still_held,
            after = ?started.elapsed(),
            lock_timeout = ?self.options.lock_timeout(),
            "lease lost while the batch was being delivered: delivery stopped, nothing more of it goes to the sink; the relay that holds it now delivers it again"
        );
        Plan {
            claim,
            fates: vec![Fate::Released(ReleaseReason::LeaseLost); events],
            until,
            started: None,
            // Every event was taken over: a settlement would be fenced in
            // full (and cost a round trip to a store that may be struggling).
            fenced: if still_held == 0 {
                Fenced::All
            } else {
                Fenced::Quiet
            },
        }
    }

    /// Records the lag of the batch's oldest event (the database's clock
    /// at claim time) and warns above the alert threshold.
    fn record_lag(&self, claim: &Claim) {
        // The database's clock at claim time: the lease ends at its now() + lease.
        let db_now = claim.lease_until
            - chrono::Duration::from_std(self.options.lock_timeout()).unwrap_or_default();
        let oldest: Option<DateTime<Utc>> = claim.events.iter().map(|e| e.created_at).min();
        let lag = oldest
            .and_then(|o| (db_now - o).to_std().ok())
            .unwrap_or_default();
        let alert = lag > self.options.lag_alert();
        self.meters().set_lag(lag.as_secs_f64(), alert);
        if alert {
            warn!(lag = ?lag, threshold = ?self.options.lag_alert(), "outbox lag above the alert threshold");
        }
    }
}
