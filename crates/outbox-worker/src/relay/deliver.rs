//! Delivering one claimed batch: the sink call under the delivery timeout,
//! the shutdown grace and the lease watch, and what its end means for the
//! loop.

use super::settle::{join_ids, Deferred, Fate, ReleaseReason};
use super::{Held, Relay, RelaySummary, SINK_PANICKED};
use crate::lease::Leases;
use crate::metrics as m;
use futures::FutureExt;
use outbox_core::{panic_message, DeliveryError, ErrorCode, EventId, Outcome, Sink, Store};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use tokio::time::Instant;
use tracing::{debug, error, info, info_span, warn, Instrument};

/// How a delivery ended.
pub(super) enum Delivery {
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

/// What processing one batch means for the loop.
#[derive(Default)]
pub(super) struct Processed {
    /// Shutdown was requested during the batch.
    pub(super) stop: bool,
    /// The sink reported itself unavailable (first such error).
    pub(super) sink_down: Option<DeliveryError>,
    /// With `sink_down`: the batch's settlement, left to the loop so that a
    /// prefetched (later) batch is given back first. Settled newest first,
    /// a store that reads in order (the PostgreSQL event log) rewinds its
    /// cursor over both instead of copying the older one's events into its
    /// retry lane (which would park those keys on its slower path).
    pub(super) deferred: Option<Deferred>,
    /// The delivery was stopped because the lease was lost (a half-open
    /// probe stopped that way proves nothing about the sink).
    pub(super) lease_lost: bool,
}

impl<St: Store, Si: Sink> Relay<St, Si> {
    /// Delivers one claimed batch and settles it.
    pub(super) async fn process(
        &self,
        held: Held,
        leases: &Leases,
        mut shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
        summary: &mut RelaySummary,
    ) -> Processed {
        let started = Instant::now();
        let claim = held.claim;
        leases.delivering(claim.token);
        let ids: Vec<EventId> = claim.events.iter().map(|e| e.id).collect();
        let span = info_span!(
            "outbox_batch",
            relay_id = %self.options.relay_id(),
            token = %claim.token,
            size = ids.len(),
            event_ids = %join_ids(&ids),
        );
        // One batch serves many producers' traces: it links to each event's
        // producer span (the handlers' per-event spans are their children).
        #[cfg(feature = "otel")]
        for event in &claim.events {
            outbox_core::trace::link(&span, &event.headers);
        }
        async {
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
            let mut processed = Processed {
                stop,
                sink_down: None,
                deferred: None,
                lease_lost: false,
            };
            let fates: Vec<Fate> = match delivery {
                Delivery::Outcomes(outcomes) => {
                    self.fates(&claim.events, outcomes, &mut processed.sink_down)
                }
                Delivery::Panicked(msg) => {
                    error!(panic = %msg, "the sink panicked; the batch counts as a retryable failure");
                    let error = DeliveryError::retryable(SINK_PANICKED, format!("sink panicked: {msg}"));
                    claim
                        .events
                        .iter()
                        .map(|e| self.failed(e, error.clone()))
                        .collect()
                }
                Delivery::TimedOut => {
                    summary.delivery_timeouts += 1;
                    metrics::counter!(m::DELIVERY_TIMEOUTS).increment(1);
                    let error = DeliveryError::unavailable(
                        ErrorCode::DELIVERY_TIMEOUT,
                        format!("the sink did not finish the batch within the delivery timeout ({timeout:?})"),
                    );
                    warn!(code = %ErrorCode::DELIVERY_TIMEOUT, timeout = ?timeout, "{error}; delivery cancelled, events released");
                    // No acknowledgement in time is the sink's failure.
                    processed.sink_down = Some(error);
                    vec![Fate::Released(ReleaseReason::DeliveryTimeout); claim.events.len()]
                }
                Delivery::Abandoned => {
                    vec![Fate::Released(ReleaseReason::Shutdown); claim.events.len()]
                }
                Delivery::LeaseExpired => {
                    summary.deliveries_expired += 1;
                    metrics::counter!(m::LEASE_EXPIRED_DELIVERIES_STOPPED, "stage" => "delivering")
                        .increment(1);
                    warn!(
                        events = claim.events.len(),
                        after = ?started.elapsed(),
                        lock_timeout = ?self.options.lock_timeout(),
                        "lease ended by this relay's clock (no renewal succeeded: the database does not answer): delivery stopped, nothing more of the batch goes to the sink; its events are released"
                    );
                    vec![Fate::Released(ReleaseReason::LeaseExpired); claim.events.len()]
                }
                Delivery::LeaseLost { still_held } => {
                    // Not settled as delivered, failed or retried: another
                    // relay holds the events now.
                    processed.lease_lost = true;
                    self.stop_lost(&claim, still_held, held.until, leases, started, summary)
                        .await;
                    return processed;
                }
            };
            if processed.sink_down.is_some() {
                processed.deferred = Some(Deferred {
                    claim,
                    fates,
                    started,
                    until: held.until,
                });
            } else {
                let delivered_in = started.elapsed();
                let until = leases.remove(claim.token).unwrap_or(held.until);
                self.settle_and_report(&claim, &fates, until, Some(started), summary)
                    .await;
                debug!(
                    events = claim.events.len(),
                    deliver_ms = delivered_in.as_secs_f64() * 1e3,
                    settle_ms = (started.elapsed() - delivered_in).as_secs_f64() * 1e3,
                    "batch done"
                );
            }
            processed
        }
        .instrument(span)
        .await
    }
}
