//! What the relay is made of ([`Relay`]: store, sink, options, breaker,
//! pause watch, rate limit) and what its loop carries from one batch to the
//! next ([`Run`]), with the few helpers every step uses. The steps live in
//! the files beside this one and import it; it imports none of them.

use super::batch::Held;
use super::meters::Meters;
use super::pacing::{wait, BatchSizer, ClaimErrors, IdleBackoff, Waited};
use super::report::{Progress, RelaySummary};
use crate::breaker::Breaker;
use crate::control::PauseWatch;
use crate::layer::KeyOrder;
use crate::name::StoreName;
use crate::options::RelayOptions;
use crate::rate::TokenBucket;
use outbox_core::{ClaimRequest, ShardSpec, Sink, Store};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

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
/// - a sink-level failure ([`DeliveryError::unavailable`](outbox_core::DeliveryError::unavailable)) costs nothing: the
///   batch is released and the sink's circuit breaker opens (see
///   [`crate::breaker`]; watch it through [`Relay::sink_health`]);
/// - leases are renewed while held; a delivery that outlives
///   [`RelayOptions::delivery_timeout`] is cancelled and released (and
///   counts as the sink's failure: no acknowledgement in time);
/// - store errors are retried while [`Retryable::is_retryable`](outbox_core::Retryable::is_retryable) says so
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
    pub(super) store: St,
    pub(super) sink: KeyOrder<Si>,
    pub(super) options: RelayOptions,
    pub(super) listener: Option<Listener>,
    pub(super) breaker: Breaker,
    pub(super) pause: Option<PauseWatch>,
    pub(super) bucket: Option<Mutex<TokenBucket>>,
    /// The store's name ([`Relay::with_store_name`](super::Relay::with_store_name)).
    pub(super) name: Option<StoreName>,
    /// The metric handles, registered when the run starts.
    pub(super) meters: OnceLock<Meters>,
}

impl<St, Si> fmt::Debug for Relay<St, Si> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("name", &self.name)
            .field("options", &self.options)
            .field("listener", &self.listener.is_some())
            .field("sink_state", &self.breaker.state())
            .field("pause", &self.pause)
            .finish_non_exhaustive()
    }
}

/// The listener set with [`Relay::with_listener`].
pub(super) type Listener = Arc<dyn Fn(&Progress) + Send + Sync>;

/// Whether the loop stops on shutdown only, or also once the store is drained.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    UntilShutdown,
    UntilIdle,
}

/// What a step of the loop tells the loop to do next.
pub(super) enum Step<T> {
    /// Go on to the next step, with this.
    Go(T),
    /// Start the next turn (the step waited, or gave its batch back).
    Again,
    /// Leave the loop: shutdown, or the outbox is drained
    /// ([`Mode::UntilIdle`]).
    Stop,
}

/// What the loop carries from one batch to the next.
pub(super) struct Run {
    /// Whether the loop stops once the store is drained.
    pub(super) mode: Mode,
    /// The claim request; each claim sets its batch size (from `sizer`, or
    /// one event for a half-open probe).
    pub(super) req: ClaimRequest,
    /// The size of the next claim.
    pub(super) sizer: BatchSizer,
    /// The wait after an empty claim.
    pub(super) idle: IdleBackoff,
    /// The backoff after failed claims.
    pub(super) claim_errors: ClaimErrors,
    /// A claim made while the previous batch was being delivered (drain
    /// mode after a full batch): claim and delivery overlap, so the relay
    /// runs near the slower of the store and the sink instead of their sum.
    pub(super) prefetched: Option<Held>,
    /// How long an open breaker waits before its half-open probe.
    pub(super) probe_in: Duration,
    /// The totals so far.
    pub(super) summary: RelaySummary,
}

impl Run {
    /// The state of a loop that has not claimed yet; `rate_limited`: a
    /// rate limit's bucket holds one `batch_size`, so batches do not grow.
    pub(super) fn new(options: &RelayOptions, mode: Mode, rate_limited: bool) -> Self {
        let req = ClaimRequest {
            relay_id: options.relay_id().clone(),
            batch_size: options.batch_size(),
            lease: options.lock_timeout(),
            shard: options.shard(),
        };
        let max_batch = if rate_limited {
            req.batch_size
        } else {
            options.max_batch_size()
        };
        Self {
            mode,
            sizer: BatchSizer::new(req.batch_size, max_batch),
            req,
            idle: IdleBackoff::new(options.poll_interval()),
            claim_errors: ClaimErrors::new(),
            prefetched: None,
            probe_in: Duration::ZERO,
            summary: RelaySummary::default(),
        }
    }

    /// The next claim's request: the sizer's batch size, or one event when
    /// `probing` (half-open: one event decides whether the sink is back).
    pub(super) fn request(&self, probing: bool) -> ClaimRequest {
        ClaimRequest {
            batch_size: if probing { 1 } else { self.sizer.next() },
            ..self.req.clone()
        }
    }
}

impl<St: Store, Si: Sink> Relay<St, Si> {
    /// Whether the group is paused (the cached read of its control row,
    /// refreshed when due); always `false` without
    /// [`Relay::with_control`](super::Relay::with_control).
    pub(super) async fn paused(&self) -> bool {
        match &self.pause {
            Some(watch) => watch.is_paused().await,
            None => false,
        }
    }

    /// Waits for `delay`, the store's wake-up or shutdown.
    pub(super) async fn wait_for_events(
        &self,
        delay: Duration,
        shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Waited {
        wait(delay, shutdown, Some(self.store.wakeup())).await
    }

    /// The metric handles: registered with the recorder installed at the
    /// first call (the start of the run), labelled with the store's name.
    pub(super) fn meters(&self) -> &Meters {
        self.meters
            .get_or_init(|| Meters::new(self.metric_labels(), self.shard_label()))
    }

    /// `store="<name>"` for a named relay, else no label.
    pub(super) fn metric_labels(&self) -> Vec<metrics::Label> {
        self.name
            .iter()
            .map(|name| metrics::Label::new("store", name.as_str().to_owned()))
            .collect()
    }

    /// The `shard` label of per-shard metrics: `index/total`, or `all`.
    pub(super) fn shard_label(&self) -> String {
        let shard = self.options.shard();
        if shard == ShardSpec::ALL {
            "all".to_owned()
        } else {
            shard.to_string()
        }
    }

    /// Reports to the listener, if any; `progress` is only built when one
    /// listens (no per-event clone of the event type on the hot path).
    pub(super) fn notify(&self, progress: impl FnOnce() -> Progress) {
        if let Some(listener) = &self.listener {
            listener(&progress());
        }
    }
}
