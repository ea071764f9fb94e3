//! The relay loop, as a loop of named steps: wait for a turn, claim, clear
//! for delivery, deliver, settle, rest. Each step is a method with what it
//! does and guarantees in its doc; the claim and deliver steps live in
//! their own files, settlement in `settle.rs` (the one route to the store).

use super::batch::{Plan, ReleaseReason};
use super::deliver::Delivered;
use super::pacing::{wait, Waited, NO_WAKEUP};
use super::report::{Progress, RelaySummary};
use super::state::{Mode, Relay, Run, Step};
use crate::breaker::SinkState;
use crate::control::PauseWatch;
use crate::lease::Leases;
use futures::FutureExt;
use outbox_core::{Sink, Store};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tracing::{info, warn};

/// Takes a step's [`Step::Go`] value; [`Step::Again`] starts the next turn
/// and [`Step::Stop`] leaves the loop.
macro_rules! step {
    ($step:expr) => {
        match $step.await {
            Step::Go(value) => value,
            Step::Again => continue,
            Step::Stop => break,
        }
    };
}

impl<St: Store, Si: Sink> Relay<St, Si> {
    /// The loop, one batch a turn, until shutdown (or, in
    /// [`Mode::UntilIdle`], until the store is drained):
    ///
    /// 1. take a turn: shutdown, a paused group, an open breaker's wait;
    /// 2. claim: the batch claimed ahead, or a new claim (an empty one
    ///    waits for events);
    /// 3. clear it for delivery: the rate limit, the lease still ours;
    /// 4. deliver it (in drain mode claiming the next one meanwhile); it is
    ///    settled at once unless the sink is down;
    /// 5. judge the sink (its breaker) and settle what delivery left: with
    ///    the sink down, the batch claimed ahead goes back first;
    /// 6. rest after a partial batch.
    ///
    /// Then what is still held is given back and the relay leaves its
    /// group. Every batch reaches the store through `settle` (settle.rs).
    pub(super) async fn main_loop(
        &self,
        shutdown: impl Future<Output = ()> + Send,
        mode: Mode,
        leases: &Leases,
    ) -> RelaySummary {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut run = self.start(mode);
        loop {
            let probing = step!(self.take_turn(&mut run, shutdown.as_mut()));
            let held = step!(self.claim_batch(probing, &mut run, leases, shutdown.as_mut()));
            let held = step!(self.clear_for_delivery(held, &mut run, leases, shutdown.as_mut()));
            let mut delivered = self
                .deliver_batch(held, probing, &mut run, leases, shutdown.as_mut())
                .await;
            self.judge_sink(&delivered, probing, &mut run);
            self.settle_left(&mut delivered, &mut run, leases).await;
            if delivered.stop {
                break;
            }
            step!(self.rest(&delivered, &mut run, shutdown.as_mut()));
        }
        self.wind_down(run, leases).await
    }

    /// The loop's state at the start; publishes the sink's state and logs
    /// the start.
    fn start(&self, mode: Mode) -> Run {
        let run = Run::new(&self.options, mode, self.bucket.is_some());
        self.breaker.publish();
        info!(
            relay_id = %run.req.relay_id,
            shard = %run.req.shard,
            batch_size = run.req.batch_size,
            lock_timeout = ?run.req.lease,
            "relay started"
        );
        run
    }

    /// Waits for a turn: stops once shutdown completed (never polling it
    /// again); while the group is paused (and no batch was claimed ahead)
    /// claims nothing, looking at the control row again when its next read
    /// is due ([`Step::Again`]); while the sink's breaker is open waits out
    /// its delay and moves it to half-open. Goes on with whether this turn
    /// probes a half-open sink (one event decides whether it is back).
    async fn take_turn(
        &self,
        run: &mut Run,
        mut shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Step<bool> {
        if shutdown.as_mut().now_or_never().is_some() {
            return Step::Stop;
        }
        if run.prefetched.is_none() && self.paused().await {
            let recheck = self
                .pause
                .as_ref()
                .map_or(Duration::ZERO, PauseWatch::next_read_in)
                .max(Duration::from_millis(10));
            return match wait(recheck, shutdown, NO_WAKEUP).await {
                Waited::Shutdown => Step::Stop,
                Waited::Woken | Waited::Timer => Step::Again,
            };
        }
        if self.breaker.state() == SinkState::Open {
            if wait(run.probe_in, shutdown, NO_WAKEUP).await == Waited::Shutdown {
                return Step::Stop;
            }
            if let Some(from) = self.breaker.half_open() {
                self.notify(|| Progress::SinkStateChanged {
                    from,
                    to: SinkState::HalfOpen,
                });
            }
        }
        Step::Go(self.breaker.state() == SinkState::HalfOpen)
    }

    /// The sink's verdict on the breaker from one delivered batch: a sink
    /// that reported itself down (or did not answer in time) opens it (and
    /// sets the wait before the next probe); a half-open probe that
    /// delivered closes it, unless it was stopped for a lost lease (that
    /// proves nothing about the sink).
    fn judge_sink(&self, delivered: &Delivered, probing: bool, run: &mut Run) {
        match &delivered.sink_down {
            Some(error) => {
                let (delay, from) = self.breaker.open(error);
                run.probe_in = delay;
                if from == Some(SinkState::Closed) {
                    run.summary.sink_outages += 1;
                }
                if let Some(from) = from {
                    self.notify(|| Progress::SinkStateChanged {
                        from,
                        to: SinkState::Open,
                    });
                }
            }
            None => {
                if probing && !delivered.lease_lost {
                    if let Some(from) = self.breaker.close() {
                        self.notify(|| Progress::SinkStateChanged {
                            from,
                            to: SinkState::Closed,
                        });
                    }
                }
            }
        }
    }

    /// The settle step for a batch delivery left unsettled (the sink is
    /// down; every other batch was settled as soon as it was delivered):
    /// the batch claimed ahead is not handed to a sink that is down, so it
    /// is given back first rather than held through the outage, then the
    /// delivered one is settled: newest first (see
    /// [`Delivered::unsettled`]).
    async fn settle_left(&self, delivered: &mut Delivered, run: &mut Run, leases: &Leases) {
        if delivered.sink_down.is_some() {
            if let Some(next) = run.prefetched.take() {
                let plan = Plan::give_back(next, ReleaseReason::SinkUnavailable);
                self.settle(plan, leases, &mut run.summary).await;
            }
        }
        if let Some(plan) = delivered.unsettled.take() {
            self.settle(plan, leases, &mut run.summary).await;
        }
    }

    /// Rests after a partial batch (the outbox is, nearly, drained): looks
    /// again shortly, or at the store's wake-up; an empty claim then backs
    /// off. No rest when the next batch is ready (claimed ahead, or the
    /// store stopped the claim early) or the sink is down (the breaker's
    /// wait comes next).
    async fn rest(
        &self,
        delivered: &Delivered,
        run: &mut Run,
        shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Step<()> {
        if run.prefetched.is_some() || delivered.sink_down.is_some() || delivered.more {
            return Step::Go(());
        }
        match self.wait_for_events(run.idle.first(), shutdown).await {
            Waited::Shutdown => Step::Stop,
            Waited::Woken | Waited::Timer => Step::Go(()),
        }
    }

    /// Ends a run: gives back the batch claimed ahead (never handed to the
    /// sink), hands the relay's share of the work to the others now (a
    /// store that shares it among relays) rather than when its leases run
    /// out, and logs the totals.
    async fn wind_down(&self, mut run: Run, leases: &Leases) -> RelaySummary {
        if let Some(held) = run.prefetched.take() {
            let plan = Plan::give_back(held, ReleaseReason::Shutdown);
            self.settle(plan, leases, &mut run.summary).await;
        }
        if let Err(e) = self.store.leave(&run.req.relay_id).await {
            warn!(error = %e, "could not leave the relay group; its shards move once their leases run out");
        }
        let summary = run.summary;
        info!(
            relay_id = %run.req.relay_id,
            delivered = summary.delivered,
            retried = summary.retried,
            dead = summary.dead,
            lease_lost = summary.lease_lost,
            released = summary.released,
            rejected = summary.rejected,
            delivery_timeouts = summary.delivery_timeouts,
            deliveries_stopped = summary.deliveries_stopped,
            deliveries_expired = summary.deliveries_expired,
            sink_outages = summary.sink_outages,
            "relay stopped"
        );
        summary
    }
}
