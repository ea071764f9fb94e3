//! The claim step and the check before delivery: the batch the loop works
//! on next (claimed ahead, or claimed now), what an empty or failed claim
//! waits for, and the rate limit and lease a claimed batch must pass before
//! it goes to the sink.

use super::batch::{Held, Plan, ReleaseReason};
use super::pacing::{wait, Waited, NO_WAKEUP};
use super::state::{Mode, Relay, Run, Step};
use crate::lease::{Leases, Use};
use outbox_core::{ClaimRequest, Sink, Store};
use std::future::Future;
use std::pin::Pin;
use std::sync::PoisonError;
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, warn};

impl<St: Store, Si: Sink> Relay<St, Si> {
    /// The claim step: the batch claimed ahead if there is one, else a
    /// fresh claim (one event when `probing` a half-open sink, else the
    /// sizer's batch size, which the claim then adjusts). A failed claim
    /// backs off ([`Step::Again`]); an empty one waits for events, the
    /// store's wake-up cutting the wait short ([`Step::Again`]), or ends a
    /// [`Mode::UntilIdle`] run once the store is drained ([`Step::Stop`]).
    /// A non-empty batch comes back with its lease tracked (and renewed).
    pub(super) async fn claim_batch(
        &self,
        probing: bool,
        run: &mut Run,
        leases: &Leases,
        mut shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Step<Held> {
        let held = match run.prefetched.take() {
            Some(held) => held,
            None => match self
                .claim(&run.request(probing), leases, Use::Delivering)
                .await
            {
                Ok(held) => {
                    run.claim_errors.succeeded();
                    if !probing {
                        run.sizer
                            .observe(held.asked, held.claim.events.len(), held.claim.more);
                    }
                    held
                }
                Err(err) => {
                    self.meters().claim_errors.increment(1);
                    let delay = run.claim_errors.failed(&err);
                    return match wait(delay, shutdown, NO_WAKEUP).await {
                        Waited::Shutdown => Step::Stop,
                        Waited::Woken | Waited::Timer => Step::Again,
                    };
                }
            },
        };
        if !held.claim.events.is_empty() {
            run.idle.reset();
            return Step::Go(held);
        }
        self.meters().set_lag(0.0, false);
        if run.mode == Mode::UntilIdle && self.is_drained().await {
            return Step::Stop;
        }
        match self
            .wait_for_events(run.idle.next(), shutdown.as_mut())
            .await
        {
            Waited::Shutdown => Step::Stop,
            Waited::Woken => {
                run.idle.reset();
                Step::Again
            }
            Waited::Timer => Step::Again,
        }
    }

    /// The check before delivery: a claimed batch goes to the sink only
    /// once the rate limit lets its events through (their tokens taken at
    /// once, one wait for the whole batch) and while its lease is this
    /// relay's. A batch claimed ahead, or kept waiting by the rate limit or
    /// a slow claim, whose lease a renewal found lost or that ended by this
    /// relay's clock (no renewal succeeded) is never delivered: another
    /// relay may have it. It is given back ([`Step::Again`]), as it is on
    /// shutdown during the rate limit's wait ([`Step::Stop`]).
    pub(super) async fn clear_for_delivery(
        &self,
        held: Held,
        run: &mut Run,
        leases: &Leases,
        shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Step<Held> {
        let n = held.claim.events.len();
        if let Some(delay) = self.rate_limit(n) {
            // Wait for the tokens of the whole batch (max_rate), once.
            self.meters().rate_limit_wait.record(delay.as_secs_f64());
            debug!(events = n, wait = ?delay, "rate limit: waiting before delivering the batch");
            if wait(delay, shutdown, NO_WAKEUP).await == Waited::Shutdown {
                let plan = Plan::give_back(held, ReleaseReason::Shutdown);
                self.settle(plan, leases, &mut run.summary).await;
                return Step::Stop;
            }
        }
        let summary = &mut run.summary;
        if leases.is_lost(held.claim.token) {
            // Claimed ahead, and its lease could not be kept while it
            // waited: another relay may have it now. Never deliver it.
            summary.deliveries_stopped += 1;
            self.meters().lost_stopped.claimed_ahead.increment(1);
            let plan = Plan::give_back(held, ReleaseReason::LeaseRenewal);
            self.settle(plan, leases, summary).await;
            return Step::Again;
        }
        if leases.is_expired(held.claim.token) {
            // Its lease ended by this relay's clock while it waited
            // (claimed ahead, rate limit, a slow claim), no renewal
            // having succeeded: another relay may have it. Never
            // deliver it.
            summary.deliveries_expired += 1;
            self.meters().expired_stopped.claimed_ahead.increment(1);
            warn!(
                token = %held.claim.token,
                events = held.claim.events.len(),
                lock_timeout = ?self.options.lock_timeout(),
                "lease of a claimed batch ended by this relay's clock before it went to the sink (no renewal succeeded: the database does not answer); it is given back, not delivered"
            );
            let plan = Plan::give_back(held, ReleaseReason::LeaseExpired);
            self.settle(plan, leases, summary).await;
            return Step::Again;
        }
        Step::Go(held)
    }

    /// One claim; a non-empty one is tracked (and renewed) in `leases`
    /// from the instant the claim was sent (its local lease end).
    pub(super) async fn claim(
        &self,
        req: &ClaimRequest,
        leases: &Leases,
        usage: Use,
    ) -> Result<Held, St::Error> {
        let sent = Instant::now();
        let claim = self.store.claim(req).await?;
        let until = sent + self.options.lock_timeout();
        if !claim.events.is_empty() {
            leases.insert(claim.token, claim.events.len(), until, usage);
        }
        debug!(
            asked = req.batch_size,
            events = claim.events.len(),
            more = claim.more,
            ?usage,
            claim_ms = sent.elapsed().as_secs_f64() * 1e3,
            "claimed"
        );
        Ok(Held {
            claim,
            until,
            asked: req.batch_size,
        })
    }

    /// The wait before `n` claimed events may go to the sink under the
    /// rate limit (their tokens are taken now), if any.
    fn rate_limit(&self, n: usize) -> Option<Duration> {
        let bucket = self.bucket.as_ref()?;
        let delay = bucket
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(n, Instant::now());
        (!delay.is_zero()).then_some(delay)
    }

    /// Whether the store's stats show no pending event (retries scheduled
    /// however far out included) and none in flight; `false` when the
    /// stats cannot be read.
    async fn is_drained(&self) -> bool {
        match self.store.stats().await {
            Ok(stats) => stats.pending == 0 && stats.in_flight == 0,
            Err(err) => {
                self.meters().stats_errors.increment(1);
                warn!(error = %err, "stats failed; not treating the outbox as drained");
                false
            }
        }
    }
}
