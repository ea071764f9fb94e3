//! The relay loop: claim, deliver, settle, wait. See [`Relay`].

use crate::breaker::{Breaker, SinkHealth, SinkState};
use crate::control::{PauseHandle, PauseWatch};
use crate::lease::{Leases, Renewed, Use};
use crate::metrics as m;
use crate::rate::TokenBucket;
use crate::{InvalidOptions, KeyOrder, RelayOptions};
use chrono::{DateTime, Utc};
use futures::FutureExt;
use outbox_core::{
    Claim, ClaimRequest, ControlStore, DeliveryError, ErrorCode, Event, EventId, FencingToken,
    Jitter, LastError, Outcome, Resolution, RetryPolicy, Retryable, SettleReport, Settlement,
    ShardSpec, Sink, Store,
};
use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, error, info, info_span, warn, Instrument};

/// Code recorded when a sink panicked while delivering a batch (retryable:
/// every event of the batch counts the attempt, so a sink that panics on
/// one event dead-letters it after `max_attempts` instead of looping).
pub const SINK_PANICKED: ErrorCode = ErrorCode::from_static("SINK_PANICKED");

/// First wait after an empty claim, and the wait after a partial batch;
/// it doubles up to the poll interval. 1 ms: at 1,000 events/s a relay
/// claims every 2-3 ms (each claim gets what committed meanwhile), and an
/// idle relay makes ten claims in its first second, then one per poll.
const IDLE_FIRST: Duration = Duration::from_millis(1);
/// Settle retries start at this delay and double up to [`SETTLE_RETRY_MAX`].
const SETTLE_RETRY_FIRST: Duration = Duration::from_millis(50);
/// Longest wait between two settle attempts.
const SETTLE_RETRY_MAX: Duration = Duration::from_secs(2);

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
///    outcome mapped to a [`Resolution`]:
///
///    | outcome | resolution |
///    |---------|------------|
///    | `Delivered` | `Delivered` |
///    | `Failed`, event-level, retryable, attempts left | `Retry` after [`RetryPolicy::next_delay`] (jittered) |
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
/// Between batches: a full batch in drain mode was already followed by an
/// overlapping claim; otherwise the relay waits a few milliseconds, and after
/// each empty claim twice as long, up to `poll_interval`; the store's
/// [`Store::wakeup`] cuts any wait short.
///
/// Reliability, in short:
/// - an event-level failure costs the event an attempt and follows the
///   [`RetryPolicy`] (exponential backoff, jitter, cap, dead letter after
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

/// Why events were released (the `reason` label of `outbox_events_released_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReleaseReason {
    SinkUnavailable,
    NotAttempted,
    DeliveryTimeout,
    Shutdown,
    MissingOutcome,
    LeaseRenewal,
    LeaseLost,
}

impl ReleaseReason {
    fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::SinkUnavailable => "sink_unavailable",
            ReleaseReason::NotAttempted => "not_attempted",
            ReleaseReason::DeliveryTimeout => "delivery_timeout",
            ReleaseReason::Shutdown => "shutdown",
            ReleaseReason::MissingOutcome => "missing_outcome",
            ReleaseReason::LeaseRenewal => "lease_renewal",
            ReleaseReason::LeaseLost => "lease_lost",
        }
    }
}

/// The level fenced ids of a settlement are logged at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FencedLog {
    /// WARN: the first news of the lost lease.
    Warn,
    /// DEBUG: the loss was logged at WARN already (a stopped delivery).
    Quiet,
}

/// What the relay decided for one event of a batch.
#[derive(Debug, Clone)]
enum Fate {
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
    fn resolution(&self) -> Resolution {
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

/// How a delivery ended.
enum Delivery {
    Outcomes(Vec<Outcome>),
    Panicked(String),
    TimedOut,
    Abandoned,
    /// A renewal found the lease lost; the claim still held this many events.
    LeaseLost {
        still_held: u64,
    },
}

/// What processing one batch means for the loop.
#[derive(Default)]
struct Processed {
    /// Shutdown was requested during the batch.
    stop: bool,
    /// The sink reported itself unavailable (first such error).
    sink_down: Option<DeliveryError>,
    /// With `sink_down`: the batch's settlement, left to the loop so that a
    /// prefetched (later) batch is given back first. Settled newest first,
    /// a store that reads in order (the PostgreSQL event log) rewinds its
    /// cursor over both instead of copying the older one's events into its
    /// retry lane (which would park those keys on its slower path).
    deferred: Option<Deferred>,
    /// The delivery was stopped because the lease was lost (a half-open
    /// probe stopped that way proves nothing about the sink).
    lease_lost: bool,
}

/// A processed batch whose settlement waits for the loop.
struct Deferred {
    claim: Claim,
    fates: Vec<Fate>,
    started: Instant,
    /// The lease end known at claim time (a renewal may have moved it).
    until: Instant,
}

/// What ended a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waited {
    Shutdown,
    Timer,
    Woken,
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

/// The size of the next claim: `batch_size` while the relay keeps up,
/// doubling after each full claim up to `max_batch_size` while it catches
/// up, back to `batch_size` at the first short claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BatchSizer {
    base: u32,
    max: u32,
    next: u32,
}

impl BatchSizer {
    fn new(base: u32, max: u32) -> Self {
        Self {
            base,
            max: max.max(base),
            next: base,
        }
    }

    fn next(&self) -> u32 {
        self.next
    }

    /// After a claim of `asked` events came back with `got`; `more`: the
    /// store said more events were ready (it stopped early).
    fn observe(&mut self, asked: u32, got: usize, more: bool) {
        let full = got >= usize::try_from(asked).unwrap_or(usize::MAX);
        if full {
            self.next = asked.max(self.next).saturating_mul(2).min(self.max);
        } else if !more {
            self.next = self.base;
        }
    }
}

/// The wait after an empty claim: a few ms, doubling up to the poll interval.
struct IdleBackoff {
    next: Duration,
    cap: Duration,
}

impl IdleBackoff {
    fn new(cap: Duration) -> Self {
        Self {
            next: IDLE_FIRST.min(cap),
            cap,
        }
    }

    fn reset(&mut self) {
        self.next = IDLE_FIRST.min(self.cap);
    }

    fn first(&self) -> Duration {
        IDLE_FIRST.min(self.cap)
    }

    fn next(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(self.cap);
        d
    }
}

/// Claim errors: a capped backoff, longer for errors retrying cannot fix.
struct ClaimErrors {
    retryable: RetryPolicy,
    fatal: RetryPolicy,
    streak: u32,
    fatal_logged: bool,
}

impl ClaimErrors {
    fn new() -> Self {
        let policy =
            |base, cap| RetryPolicy::new(base, cap, u32::MAX, Jitter::Equal).unwrap_or_default();
        Self {
            retryable: policy(Duration::from_millis(250), Duration::from_secs(30)),
            fatal: policy(Duration::from_secs(5), Duration::from_secs(5 * 60)),
            streak: 0,
            fatal_logged: false,
        }
    }

    fn failed(&mut self, err: &(impl std::error::Error + Retryable)) -> Duration {
        self.streak = self.streak.saturating_add(1);
        metrics::counter!(m::STORE_ERRORS, "op" => "claim").increment(1);
        if err.is_retryable() {
            let delay = self.retryable.next_delay(self.streak, rand::random());
            warn!(error = %err, retry_in = ?delay, "claim failed; backing off");
            delay
        } else {
            let delay = self.fatal.next_delay(self.streak, rand::random());
            if self.fatal_logged {
                warn!(error = %err, retry_in = ?delay, "claim still failing (not retryable)");
            } else {
                self.fatal_logged = true;
                error!(
                    error = %err,
                    retry_in = ?delay,
                    "claim failed with an error retrying will not fix (schema, permissions?); backing off longer"
                );
            }
            delay
        }
    }

    fn succeeded(&mut self) {
        if self.streak > 0 {
            info!(failures = self.streak, "claiming works again");
        }
        self.streak = 0;
        self.fatal_logged = false;
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
        let leases = Leases::default();
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
                        metrics::counter!(m::STORE_ERRORS, "op" => "renew").increment(1);
                        if err.is_retryable() {
                            warn!(%token, error = %err, "lease renewal failed; trying again");
                        } else {
                            error!(%token, error = %err, "lease renewal failed (not retryable)");
                        }
                    }
                }
            }
        }
    }

    /// Delivers one claimed batch and settles it.
    async fn process(
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
            // In a block of its own: the delivery future is dropped (a
            // stopped or abandoned one cancelled, its handler tasks aborted)
            // before the batch is settled.
            let (delivery, stop) = {
                let mut delivery = std::pin::pin!(async {
                    tokio::select! {
                        biased;
                        still_held = lost => Delivery::LeaseLost { still_held },
                        r = delivery => match r {
                            Ok(Ok(outcomes)) => Delivery::Outcomes(outcomes),
                            Ok(Err(panic)) => Delivery::Panicked(panic_message(panic)),
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

    /// The delivery of `claim` was stopped because a renewal found its
    /// lease lost with `still_held` of its events: logs it (the one WARN
    /// of the batch), counts it, and reports the events taken over as lost.
    /// Nothing is settled unless the claim still holds events: those are
    /// released so they come back at once, not after the lock timeout.
    async fn stop_lost(
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
    async fn settle_deferred(
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
    async fn give_back(
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
    fn fates(
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
    fn failed(&self, event: &Event, error: DeliveryError) -> Fate {
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
    async fn settle_and_report(
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
    async fn settle_report(
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
    async fn settle(
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

    /// Logs and counts fenced-out events.
    fn lease_lost(&self, report: &SettleReport, log: FencedLog, summary: &mut RelaySummary) {
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

    /// Reports to the listener, if any; `progress` is only built when one
    /// listens (no per-event clone of the event type on the hot path).
    fn notify(&self, progress: impl FnOnce() -> Progress) {
        if let Some(listener) = &self.listener {
            listener(&progress());
        }
    }
}

/// A wait that the store's wake-up does not cut short.
const NO_WAKEUP: Option<std::future::Pending<()>> = None;

/// Waits for `delay`, `wakeup` (if any) or shutdown.
async fn wait(
    delay: Duration,
    shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
    wakeup: Option<impl Future<Output = ()> + Send>,
) -> Waited {
    let woken = async {
        match wakeup {
            Some(w) => w.await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = shutdown => Waited::Shutdown,
        () = tokio::time::sleep(delay) => Waited::Timer,
        () = woken => Waited::Woken,
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-text panic payload".to_owned())
}

fn join_ids(ids: &[EventId]) -> String {
    let mut s = String::with_capacity(ids.len() * 37);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&id.to_string());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::BatchSizer;

    #[test]
    fn the_batch_doubles_while_claims_come_back_full_and_resets_on_a_short_one() {
        let mut s = BatchSizer::new(20, 500);
        let mut asked = Vec::new();
        for _ in 0..7 {
            let n = s.next();
            asked.push(n);
            s.observe(n, n as usize, true);
        }
        assert_eq!(asked, vec![20, 40, 80, 160, 320, 500, 500]);
        // Short, but the store stopped early (keys in flight): keep the size.
        s.observe(500, 37, true);
        assert_eq!(s.next(), 500);
        // Short and nothing more: the backlog is gone.
        s.observe(500, 499, false);
        assert_eq!(s.next(), 20);
        // A full claim that was asked for less than the current size (the
        // one-event probe) does not shrink it.
        s.observe(20, 20, true);
        s.observe(1, 1, true);
        assert_eq!(s.next(), 80);
        // No room to grow: the size stays put.
        let mut flat = BatchSizer::new(20, 20);
        flat.observe(20, 20, true);
        assert_eq!(flat.next(), 20);
    }
}
