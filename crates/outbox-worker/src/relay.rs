//! The relay loop: claim, deliver, settle, wait. See [`Relay`].

mod deliver;
mod pacing;
mod settle;

use self::pacing::{wait, BatchSizer, ClaimErrors, IdleBackoff, Waited, NO_WAKEUP};
use self::settle::ReleaseReason;
use crate::breaker::{Breaker, SinkHealth, SinkState};
use crate::control::{PauseHandle, PauseWatch};
use crate::lease::{Leases, Renewed, Use};
use crate::metrics as m;
use crate::rate::TokenBucket;
use crate::{InvalidOptions, KeyOrder, RelayOptions};
use chrono::{DateTime, Utc};
use futures::FutureExt;
use outbox_core::{
    Claim, ClaimRequest, ControlStore, DeliveryError, ErrorCode, EventId, Retryable, ShardSpec,
    Sink, Store,
};
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

/// Code recorded when a sink panicked while delivering a batch (retryable:
/// every event of the batch counts the attempt, so a sink that panics on
/// one event dead-letters it after `max_attempts` instead of looping).
pub const SINK_PANICKED: ErrorCode = ErrorCode::from_static("SINK_PANICKED");

/// One thing the relay did, reported to the listener set with
/// [`Relay::with_listener`] (the demo prints these as progress lines).
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

/// Totals of one [`Relay::run`] / [`Relay::run_until_idle`].
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

type Listener = Arc<dyn Fn(&Progress) + Send + Sync>;

/// The relay: claims batches of committed events from a [`Store`], hands
/// them to a [`Sink`] behind the per-key order layer [`KeyOrder`] and
/// settles each batch under the claim's fencing token.
///
/// One batch goes through the relay like this:
///
/// 1. **claim** up to `batch_size` events of the relay's shard, leased for
///    `lock_timeout` (database clock) under a fresh fencing token;
/// 2. **deliver** them through [`KeyOrder`] (the per-key order layer every
///    sink gets) to the sink, within `delivery_timeout`;
/// 3. **settle** the whole batch with ONE [`Store::settle`] call, each
///    outcome mapped to a [`Resolution`](outbox_core::Resolution):
///
///    | outcome | resolution |
///    |---------|------------|
///    | `Delivered` | `Delivered` |
///    | `Failed`, event-level, retryable, attempts left | `Retry` after [`RetryPolicy::next_delay`](outbox_core::RetryPolicy::next_delay) (jittered) |
///    | `Failed`, event-level, permanent or last attempt | `Dead` |
///    | `Failed`, sink unavailable | `Released` (no attempt) and the sink's circuit breaker opens |
///    | `NotAttempted`, or no outcome | `Released` |
///    | delivery timed out / shutdown grace over | `Released` for the whole batch |
///
///    Fenced ids (the lease was lost) are logged at WARN, counted in
///    `outbox_lease_lost_total` and reported as [`Progress::LeaseLost`];
///    rejected ids are logged at WARN with the store's reason.
///
/// While a claim is held, its lease is renewed every third of the lock
/// timeout (see the lease module), including the batch claimed ahead in
/// drain mode, so a slow sink does not let a lease run out and another relay
/// (or this one) deliver the batch twice.
///
/// **A lease lost during delivery** (a renewal finds that the claim holds
/// fewer events than it claimed: the relay stalled past its lease and
/// another relay took the events over) stops the delivery at once: the
/// delivery future is dropped (a broker publisher sends nothing more, a
/// handler still running is aborted), so nothing more of the batch reaches
/// the sink once the loss is known. The new holder delivers the events again
/// from the stored position; a late publish of `K#1` by the old relay could
/// otherwise reach the broker after the new holder's `K#2`. The batch is
/// not settled (every event taken over would be fenced): its events count in
/// `outbox_lease_lost_total` and [`Progress::LeaseLost`]. Only when the
/// claim still holds some of its events (a partial loss) is the batch
/// settled, all `Released`, so those come back at once instead of after the
/// lock timeout (the others are fenced). One WARN per batch;
/// `outbox_lease_lost_deliveries_stopped_total{stage="delivering"}` counts
/// it. A batch claimed ahead whose lease is lost before it goes to the sink
/// is never delivered: it is given back (`stage="claimed_ahead"`). The relay
/// then claims on as usual.
///
/// **A lease that ends by the relay's own clock** (DESIGN.md invariant 15):
/// a renewal that fails (the database is unreachable) cannot report a loss,
/// so the relay does not wait for one. Each held claim has a local lease
/// end: the send instant of its last successful claim or renewal plus
/// `lock_timeout`, less 3 % of it and 250 ms for clock rate drift (the
/// database computed its lease end later, from its own `now()`). When that
/// passes, the delivery in flight is dropped as for a lost lease (nothing
/// more of the batch reaches the sink) and the batch is settled all
/// `Released` (fenced if another relay has it by then; when the database
/// still does not answer, the events come back once the lease ends there).
/// A batch claimed ahead (or waiting for the rate limit) whose local lease
/// ended is never handed to the sink. Counted in
/// `outbox_lease_expired_deliveries_stopped_total{stage}`, one WARN per
/// batch. So a relay that reaches the broker but not the database stops
/// publishing before any other relay can take its events over, and never
/// publishes a stale copy of a key's event after the new holder's later
/// ones.
///
/// Between batches: a full batch in drain mode was already followed by an
/// overlapping claim; otherwise the relay waits a few milliseconds, and after
/// each empty claim twice as long, up to `poll_interval`; the store's
/// [`Store::wakeup`] cuts any wait short.
///
/// Reliability, in short:
/// - an event-level failure costs the event an attempt and follows the
///   [`RetryPolicy`](outbox_core::RetryPolicy) (exponential backoff, jitter, cap, dead letter after
///   `max_attempts`);
/// - a sink-level failure ([`DeliveryError::unavailable`]) costs nothing: the
///   batch is released and the sink's circuit breaker opens (see
///   [`crate::breaker`]; watch it through [`Relay::sink_health`]);
/// - leases are renewed while held; a delivery that outlives
///   [`RelayOptions::delivery_timeout`] is cancelled and released (and
///   counts as the sink's failure: no acknowledgement in time);
/// - store errors are retried while [`Retryable::is_retryable`] says so
///   (claims with a capped backoff, longer and logged at ERROR once for
///   errors retrying cannot fix; settlements until the lease would end);
///   a panicking sink or handler fails its events retryably; the relay never
///   gives up and never panics.
///
/// Operators can pause a relay's consumer group without a restart (see
/// [`Relay::with_control`] and [`crate::control`]) and cap the events per
/// second it hands to the sink ([`RelayOptions::with_max_rate`], see the
/// token bucket in the `rate` module).
pub struct Relay<St, Si> {
    store: St,
    sink: KeyOrder<Si>,
    options: RelayOptions,
    listener: Option<Listener>,
    breaker: Breaker,
    pause: Option<PauseWatch>,
    bucket: Option<Mutex<TokenBucket>>,
}

impl<St, Si> fmt::Debug for Relay<St, Si> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("options", &self.options)
            .field("listener", &self.listener.is_some())
            .field("sink_state", &self.breaker.state())
            .field("pause", &self.pause)
            .finish_non_exhaustive()
    }
}

/// Whether the loop stops on shutdown only, or also once the store is drained.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    UntilShutdown,
    UntilIdle,
}

/// A claim and the relay's estimate of its lease end.
struct Held {
    claim: Claim,
    until: Instant,
    /// The batch size the claim asked for (it came back full when it holds
    /// that many events).
    asked: u32,
}

impl Held {
    fn is_full(&self) -> bool {
        self.claim.events.len() >= usize::try_from(self.asked).unwrap_or(usize::MAX)
    }
}

impl<St: Store, Si: Sink> Relay<St, Si> {
    /// A relay over `store` and `sink` (wrapped in [`KeyOrder`]). Fails if
    /// the options are invalid.
    pub fn new(store: St, sink: Si, options: RelayOptions) -> Result<Self, InvalidOptions> {
        options.validate()?;
        let bucket = options.max_rate().map(|rate| {
            Mutex::new(TokenBucket::new(
                f64::from(rate),
                options.batch_size(),
                Instant::now(),
            ))
        });
        Ok(Self {
            store,
            sink: KeyOrder::new(sink),
            options,
            listener: None,
            breaker: Breaker::new(),
            pause: None,
            bucket,
        })
    }

    /// Watches consumer group `group`'s control row in `control` (usually a
    /// clone of the store): while the group is paused (`outbox-relay
    /// pause`, [`ControlStore::set_paused`]) the relay claims nothing, and
    /// it claims again once the group is resumed. The row is re-read about
    /// once a second ([`crate::control::CONTROL_REFRESH`]); see
    /// [`crate::control`]. Without this the relay never pauses.
    ///
    /// [`Relay::run_until_idle`] on a paused group waits until it is resumed.
    pub fn with_control(mut self, control: impl ControlStore, group: impl Into<String>) -> Self {
        self.pause = Some(PauseWatch::new(control, group.into()));
        self
    }

    /// A handle on the pause state of the group set with
    /// [`Relay::with_control`] (`None` without it), for health endpoints.
    /// Take it before [`Relay::run`] consumes the relay.
    pub fn pause_handle(&self) -> Option<PauseHandle> {
        self.pause.as_ref().map(PauseWatch::handle)
    }

    /// Calls `f` for every outcome the relay records (after it is recorded)
    /// and every sink state change. Keep it cheap: it runs on the relay's task.
    pub fn with_listener(mut self, f: impl Fn(&Progress) + Send + Sync + 'static) -> Self {
        self.listener = Some(Arc::new(f));
        self
    }

    /// The options.
    pub fn options(&self) -> &RelayOptions {
        &self.options
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }

    /// The sink (without the [`KeyOrder`] layer the relay put around it).
    pub fn sink(&self) -> &Si {
        self.sink.inner()
    }

    /// A handle on the sink's circuit breaker state, for health and status
    /// endpoints. Take it before [`Relay::run`] consumes the relay; it keeps
    /// working (showing the last state) after the relay stopped.
    pub fn sink_health(&self) -> SinkHealth {
        self.breaker.health()
    }

    /// Runs until `shutdown` completes (wire it to SIGINT/SIGTERM).
    ///
    /// On shutdown the relay stops claiming; a delivery in flight may finish
    /// within the shutdown grace period (and its delivery timeout) and its
    /// outcomes are recorded; if it does not finish in time it is dropped
    /// and its events are released (lease cleared, attempt not counted) for
    /// the next relay, as is a batch claimed ahead.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> RelaySummary {
        self.run_inner(shutdown, Mode::UntilShutdown).await
    }

    /// Runs until the outbox is drained, for tests and the demo: it stops
    /// after a claim comes back empty and the store's stats show no pending
    /// event (including ones scheduled for a retry, however far out) and none
    /// in flight. Every event has then been delivered or dead-lettered.
    ///
    /// With long retry delays this waits that long; bound it with
    /// `tokio::time::timeout` or use [`Relay::run`] with a shutdown future.
    pub async fn run_until_idle(self) -> RelaySummary {
        self.run_inner(std::future::pending::<()>(), Mode::UntilIdle)
            .await
    }

    async fn run_inner(
        &self,
        shutdown: impl Future<Output = ()> + Send,
        mode: Mode,
    ) -> RelaySummary {
        let lock = self.options.lock_timeout();
        let mut late_send = self.sink.late_send_bound();
        if late_send > lock / 4 {
            // Kept back in full, the local lease could end before the next
            // renewal (every third of it): keep a quarter back and say what
            // is not covered.
            tracing::warn!(
                late_send = ?late_send,
                lock_timeout = ?lock,
                "the sink can still send a message this long after its delivery was dropped, more than a quarter of the lock timeout: only a quarter is kept back, and a copy sent later than that could reach the broker after another relay published the key's later events; shorten the sink's send timeout (Kafka: message.timeout.ms) or lengthen the lock timeout"
            );
            late_send = lock / 4;
        }
        let leases = Leases::new(lock, late_send);
        let work = self.main_loop(shutdown, mode, &leases);
        let renew = self.renew_leases(&leases);
        // Both run on this task: the renewal loop keeps the held leases
        // alive while the main loop awaits the sink or the store.
        tokio::select! {
            biased;
            summary = work => summary,
            never = renew => match never {},
        }
    }

    async fn main_loop(
        &self,
        shutdown: impl Future<Output = ()> + Send,
        mode: Mode,
        leases: &Leases,
    ) -> RelaySummary {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut summary = RelaySummary::default();
        let mut claim_errors = ClaimErrors::new();
        let mut idle = IdleBackoff::new(self.options.poll_interval());
        let req = ClaimRequest {
            relay_id: self.options.relay_id().clone(),
            batch_size: self.options.batch_size(),
            lease: self.options.lock_timeout(),
            shard: self.options.shard(),
        };
        // Half-open: one event decides whether the sink is back.
        let probe_req = ClaimRequest {
            batch_size: 1,
            ..req.clone()
        };
        self.breaker.publish();
        info!(
            relay_id = %req.relay_id,
            shard = %req.shard,
            batch_size = req.batch_size,
            lock_timeout = ?req.lease,
            "relay started"
        );

        // A claim made while the previous batch was being delivered (drain
        // mode after a full batch): claim and delivery overlap, so the relay
        // runs near the slower of the store and the sink instead of their sum.
        let mut prefetched: Option<Held> = None;
        let mut probe_in = Duration::ZERO;
        // A rate limit's bucket holds one `batch_size`: batches do not grow.
        let max_batch = if self.bucket.is_some() {
            req.batch_size
        } else {
            self.options.max_batch_size()
        };
        let mut sizer = BatchSizer::new(req.batch_size, max_batch);
        loop {
            // Never poll `shutdown` again once it completed.
            if shutdown.as_mut().now_or_never().is_some() {
                break;
            }
            if prefetched.is_none() && self.paused().await {
                // Paused: claim nothing; look at the control row again
                // when the next read is due.
                let recheck = self
                    .pause
                    .as_ref()
                    .map_or(Duration::ZERO, PauseWatch::next_read_in)
                    .max(Duration::from_millis(10));
                if wait(recheck, shutdown.as_mut(), NO_WAKEUP).await == Waited::Shutdown {
                    break;
                }
                continue;
            }
            if self.breaker.state() == SinkState::Open {
                if wait(probe_in, shutdown.as_mut(), NO_WAKEUP).await == Waited::Shutdown {
                    break;
                }
                if let Some(from) = self.breaker.half_open() {
                    self.notify(|| Progress::SinkStateChanged {
                        from,
                        to: SinkState::HalfOpen,
                    });
                }
            }
            let probing = self.breaker.state() == SinkState::HalfOpen;

            let held = match prefetched.take() {
                Some(held) => held,
                None => {
                    let sized;
                    let req = if probing {
                        &probe_req
                    } else {
                        sized = ClaimRequest {
                            batch_size: sizer.next(),
                            ..req.clone()
                        };
                        &sized
                    };
                    match self.claim(req, leases, Use::Delivering).await {
                        Ok(held) => {
                            claim_errors.succeeded();
                            if !probing {
                                sizer.observe(held.asked, held.claim.events.len(), held.claim.more);
                            }
                            held
                        }
                        Err(err) => {
                            let delay = claim_errors.failed(&err);
                            if wait(delay, shutdown.as_mut(), NO_WAKEUP).await == Waited::Shutdown {
                                break;
                            }
                            continue;
                        }
                    }
                }
            };

            let n = held.claim.events.len();
            if n == 0 {
                metrics::gauge!(m::LAG_SECONDS).set(0.0);
                metrics::gauge!(m::SHARD_LAG_SECONDS, "shard" => self.shard_label()).set(0.0);
                metrics::gauge!(m::LAG_ALERT).set(0.0);
                if mode == Mode::UntilIdle && self.is_drained().await {
                    break;
                }
                match self.wait_for_events(idle.next(), shutdown.as_mut()).await {
                    Waited::Shutdown => break,
                    Waited::Woken => idle.reset(),
                    Waited::Timer => {}
                }
                continue;
            }
            idle.reset();

            if let Some(delay) = self.rate_limit(n) {
                // Wait for the tokens of the whole batch (max_rate), once.
                metrics::histogram!(m::RATE_LIMIT_WAIT_SECONDS).record(delay.as_secs_f64());
                debug!(events = n, wait = ?delay, "rate limit: waiting before delivering the batch");
                if wait(delay, shutdown.as_mut(), NO_WAKEUP).await == Waited::Shutdown {
                    self.give_back(held, leases, ReleaseReason::Shutdown, &mut summary)
                        .await;
                    break;
                }
            }

            if leases.is_lost(held.claim.token) {
                // Claimed ahead, and its lease could not be kept while it
                // waited: another relay may have it now. Never deliver it.
                summary.deliveries_stopped += 1;
                metrics::counter!(m::LEASE_LOST_DELIVERIES_STOPPED, "stage" => "claimed_ahead")
                    .increment(1);
                self.give_back(held, leases, ReleaseReason::LeaseRenewal, &mut summary)
                    .await;
                continue;
            }
            if leases.is_expired(held.claim.token) {
                // Its lease ended by this relay's clock while it waited
                // (claimed ahead, rate limit, a slow claim), no renewal
                // having succeeded: another relay may have it. Never
                // deliver it.
                summary.deliveries_expired += 1;
                metrics::counter!(m::LEASE_EXPIRED_DELIVERIES_STOPPED, "stage" => "claimed_ahead")
                    .increment(1);
                warn!(
                    token = %held.claim.token,
                    events = held.claim.events.len(),
                    lock_timeout = ?self.options.lock_timeout(),
                    "lease of a claimed batch ended by this relay's clock before it went to the sink (no renewal succeeded: the database does not answer); it is given back, not delivered"
                );
                self.give_back(held, leases, ReleaseReason::LeaseExpired, &mut summary)
                    .await;
                continue;
            }

            summary.batches += 1;
            let full = held.is_full();
            // The store stopped early (a backlog behind keys in flight, rows
            // parked): claim again once this batch is settled, no wait.
            let mut again = held.claim.more && !probing;
            // A paused group claims nothing more, not even ahead.
            let drain = self.options.drain() && full && !probing && !self.paused().await;
            let mut processed = if drain {
                // The events of this batch are leased, so the overlapping claim
                // cannot take them, nor (per-key order) later events of their keys.
                let ahead = ClaimRequest {
                    batch_size: sizer.next(),
                    ..req.clone()
                };
                let (processed, next) = tokio::join!(
                    self.process(held, leases, shutdown.as_mut(), &mut summary),
                    self.claim(&ahead, leases, Use::Prefetched)
                );
                if let Ok(next) = &next {
                    sizer.observe(next.asked, next.claim.events.len(), next.claim.more);
                    again = next.claim.more;
                }
                match next {
                    Ok(next) if !next.claim.events.is_empty() => prefetched = Some(next),
                    Ok(_) => {}
                    Err(err) => {
                        metrics::counter!(m::STORE_ERRORS, "op" => "claim").increment(1);
                        warn!(error = %err, "overlapping claim failed; claiming again");
                    }
                }
                processed
            } else {
                self.process(held, leases, shutdown.as_mut(), &mut summary)
                    .await
            };

            let deferred = processed.deferred.take();
            match &processed.sink_down {
                Some(error) => {
                    let (delay, from) = self.breaker.open(error);
                    probe_in = delay;
                    if from == Some(SinkState::Closed) {
                        summary.sink_outages += 1;
                    }
                    if let Some(from) = from {
                        self.notify(|| Progress::SinkStateChanged {
                            from,
                            to: SinkState::Open,
                        });
                    }
                    if let Some(next) = prefetched.take() {
                        // Not handed to a sink that is down: give it back now
                        // rather than hold it through the outage.
                        self.give_back(next, leases, ReleaseReason::SinkUnavailable, &mut summary)
                            .await;
                    }
                }
                None => {
                    if probing && !processed.lease_lost {
                        if let Some(from) = self.breaker.close() {
                            self.notify(|| Progress::SinkStateChanged {
                                from,
                                to: SinkState::Closed,
                            });
                        }
                    }
                }
            }
            if let Some(deferred) = deferred {
                // After the prefetched batch was given back: newest first.
                self.settle_deferred(deferred, leases, &mut summary).await;
            }
            if processed.stop {
                break;
            }
            if prefetched.is_none() && processed.sink_down.is_none() && !again {
                // A partial batch: the outbox is (nearly) drained. Look again
                // shortly; an empty claim then backs off.
                match self.wait_for_events(idle.first(), shutdown.as_mut()).await {
                    Waited::Shutdown => break,
                    Waited::Woken | Waited::Timer => {}
                }
            }
        }
        if let Some(held) = prefetched {
            // Claimed but never handed to the sink: give it back unattempted.
            self.give_back(held, leases, ReleaseReason::Shutdown, &mut summary)
                .await;
        }
        // Hand the relay's share to the others now (a store that shares the
        // work among relays), not when its leases run out.
        if let Err(e) = self.store.leave(&req.relay_id).await {
            warn!(error = %e, "could not leave the relay group; its shards move once their leases run out");
        }
        info!(
            relay_id = %req.relay_id,
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

    /// Whether the group is paused (the cached read of its control row,
    /// refreshed when due); always `false` without [`Relay::with_control`].
    async fn paused(&self) -> bool {
        match &self.pause {
            Some(watch) => watch.is_paused().await,
            None => false,
        }
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

    /// One claim; a non-empty one is tracked (and renewed) in `leases`.
    async fn claim(
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

    /// Waits for `delay`, the store's wake-up or shutdown.
    async fn wait_for_events(
        &self,
        delay: Duration,
        shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Waited {
        wait(delay, shutdown, Some(self.store.wakeup())).await
    }

    async fn is_drained(&self) -> bool {
        match self.store.stats().await {
            Ok(stats) => stats.pending == 0 && stats.in_flight == 0,
            Err(err) => {
                metrics::counter!(m::STORE_ERRORS, "op" => "stats").increment(1);
                warn!(error = %err, "stats failed; not treating the outbox as drained");
                false
            }
        }
    }

    /// Renews every held lease each third of the lock timeout. Never returns.
    async fn renew_leases(&self, leases: &Leases) -> Infallible {
        let lease = self.options.lock_timeout();
        let period = lease / 3;
        loop {
            tokio::time::sleep(period).await;
            for token in leases.tokens() {
                let sent = Instant::now();
                match self.store.renew(token, lease).await {
                    Ok(held) => match leases.renewed(token, held, sent + lease) {
                        Renewed::Held | Renewed::Ignored => {
                            debug!(%token, held, "lease renewed");
                        }
                        Renewed::Lost {
                            claimed,
                            held,
                            usage,
                        } => {
                            match usage {
                                // The delivery in flight stops now and
                                // logs it (once, at WARN); a batch already
                                // delivered finds out at its settlement
                                // (fenced, logged at WARN there).
                                Use::Delivering => {
                                    debug!(%token, claimed, held, "lease lost on the batch being delivered");
                                }
                                Use::Prefetched => {
                                    warn!(%token, claimed, held, lock_timeout = ?lease, "lease lost on the batch claimed ahead; it will be given back, not delivered");
                                }
                            }
                        }
                    },
                    Err(err) => {
                        // Nothing moves: the lease ends by this relay's
                        // clock unless a later renewal succeeds in time.
                        metrics::counter!(m::STORE_ERRORS, "op" => "renew").increment(1);
                        let ends_in = leases
                            .local_end(token)
                            .map(|end| end.saturating_duration_since(Instant::now()));
                        if err.is_retryable() {
                            warn!(%token, error = %err, ?ends_in, "lease renewal failed; trying again (the batch stops at its lease end by this relay's clock unless a renewal succeeds first)");
                        } else {
                            error!(%token, error = %err, ?ends_in, "lease renewal failed (not retryable); the batch stops at its lease end by this relay's clock");
                        }
                    }
                }
            }
        }
    }

    /// The `shard` label of per-shard metrics: `index/total`, or `all`.
    fn shard_label(&self) -> String {
        let shard = self.options.shard();
        if shard == ShardSpec::ALL {
            "all".to_owned()
        } else {
            shard.to_string()
        }
    }

    fn record_lag(&self, claim: &Claim) {
        // The database's clock at claim time: the lease ends at its now() + lease.
        let db_now = claim.lease_until
            - chrono::Duration::from_std(self.options.lock_timeout()).unwrap_or_default();
        let oldest: Option<DateTime<Utc>> = claim.events.iter().map(|e| e.created_at).min();
        let lag = oldest
            .and_then(|o| (db_now - o).to_std().ok())
            .unwrap_or_default();
        metrics::gauge!(m::LAG_SECONDS).set(lag.as_secs_f64());
        metrics::gauge!(m::SHARD_LAG_SECONDS, "shard" => self.shard_label()).set(lag.as_secs_f64());
        let alert = lag > self.options.lag_alert();
        metrics::gauge!(m::LAG_ALERT).set(if alert { 1.0 } else { 0.0 });
        if alert {
            warn!(lag = ?lag, threshold = ?self.options.lag_alert(), "outbox lag above the alert threshold");
        }
    }

    /// Reports to the listener, if any; `progress` is only built when one
    /// listens (no per-event clone of the event type on the hot path).
    fn notify(&self, progress: impl FnOnce() -> Progress) {
        if let Some(listener) = &self.listener {
            listener(&progress());
        }
    }
}
