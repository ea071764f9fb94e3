//! The sink's circuit breaker: a sink that is down costs the events nothing.
//!
//! A sink reports its own failures (connection lost or refused, no
//! acknowledgement before the timeout, broker unavailable, producer fenced)
//! as [`FailureKind::Unavailable`](outbox_core::FailureKind::Unavailable).
//! Such a failure is nobody's attempt: the relay gives the batch back
//! (released under its fencing token, attempt not counted) and opens the
//! breaker:
//!
//! ```text
//!            unavailable                 probe delay over
//!  Closed ─────────────────▶ Open ───────────────────────▶ HalfOpen
//!    ▲                        ▲                               │
//!    │                        └──── probe batch unavailable ──┤
//!    └──────────── probe batch answered (any other outcome) ──┘
//! ```
//!
//! - **Closed**: normal operation, full batches, drain mode.
//! - **Open**: nothing is claimed; the relay waits a probe delay that starts
//!   at 100 ms and doubles up to 5 s (equal jitter, so relays that saw the
//!   same outage do not probe in step).
//! - **HalfOpen**: the relay claims ONE event and delivers it. If the sink
//!   answers it at all (delivered, or an event-level failure) the breaker
//!   closes and the relay goes back to full batches at once; if the sink is
//!   still unavailable, the event is released and the breaker opens again
//!   with the next, longer probe delay. With nothing to claim, it stays
//!   half-open (idle) until an event arrives to probe with.
//!
//! A delivery that outlives [`RelayOptions::delivery_timeout`](crate::RelayOptions::delivery_timeout)
//! counts as a sink-level failure too (no acknowledgement in time): its
//! events are released and the breaker opens.
//!
//! Event-level failures never touch the breaker: they keep the retry
//! policy's exponential backoff, jitter, cap and max attempts.
//!
//! The state is published three ways: the gauge [`SINK_STATE`](crate::metrics::SINK_STATE)
//! (0 closed, 1 half-open, 2 open) with the counter
//! [`SINK_STATE_TRANSITIONS`](crate::metrics::SINK_STATE_TRANSITIONS), an
//! INFO log line per transition, and the [`SinkHealth`] handle from
//! [`Relay::sink_health`](crate::Relay::sink_health) for health endpoints.

use crate::metrics as m;
use outbox_core::{DeliveryError, Jitter, RetryPolicy};
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};
use tokio::sync::watch;
use tracing::info;

/// First probe delay after the sink became unavailable.
pub(crate) const PROBE_MIN: Duration = Duration::from_millis(100);
/// Longest probe delay: half a second. A probe costs a one-event claim and
/// its release (two a second per relay through an outage); with the
/// publishers reconnecting every 250 ms (NATS) to 2 s, a sink that comes
/// back is probed and in use again within about 1-2.5 s (the chaos suite's
/// recovery target is 5 s; with 2 s probes NATS took up to 10.7 s when the
/// next fault followed closely, with 1 s probes and 1 s reconnects the
/// relays of a 60 s outage resumed 0.8-1.6 s after the broker's return).
pub(crate) const PROBE_MAX: Duration = Duration::from_millis(500);

/// The state of the sink's circuit breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum SinkState {
    /// The sink works: full batches.
    #[default]
    Closed,
    /// Probing: one small batch decides whether the sink is back.
    HalfOpen,
    /// The sink is unavailable: the relay does not claim and probes after a
    /// capped backoff.
    Open,
}

impl SinkState {
    /// The value of the `outbox_sink_state` gauge: 0 closed, 1 half-open, 2 open.
    pub fn gauge_value(self) -> f64 {
        match self {
            SinkState::Closed => 0.0,
            SinkState::HalfOpen => 1.0,
            SinkState::Open => 2.0,
        }
    }

    /// A short lowercase name (`closed`, `half_open`, `open`) for logs,
    /// metric labels and status output.
    pub fn as_str(self) -> &'static str {
        match self {
            SinkState::Closed => "closed",
            SinkState::HalfOpen => "half_open",
            SinkState::Open => "open",
        }
    }

    /// Whether the sink is taking events (closed).
    pub fn is_closed(self) -> bool {
        self == SinkState::Closed
    }
}

impl fmt::Display for SinkState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A snapshot of the breaker, as [`SinkHealth`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SinkStatus {
    /// The current state.
    pub state: SinkState,
    /// When it entered that state (the relay's wall clock).
    pub since: SystemTime,
    /// The sink failure that last opened the breaker (kept after it closed).
    pub last_error: Option<DeliveryError>,
    /// Times the breaker opened since the relay started.
    pub outages: u64,
}

impl Default for SinkStatus {
    fn default() -> Self {
        Self {
            state: SinkState::Closed,
            since: SystemTime::now(),
            last_error: None,
            outages: 0,
        }
    }
}

/// A clonable, read-only view of a relay's sink state, for health and
/// status endpoints. Get it from [`Relay::sink_health`](crate::Relay::sink_health)
/// before starting the relay; it keeps showing the last state after the
/// relay stopped.
///
/// ```
/// # use outbox_worker::{HandlerRegistry, Relay, RelayOptions, SinkState};
/// # async fn demo(store: impl outbox_worker::core::Store) -> Result<(), Box<dyn std::error::Error>> {
/// let relay = Relay::new(store, HandlerRegistry::new(), RelayOptions::default())?;
/// let health = relay.sink_health();
/// tokio::spawn(relay.run(std::future::pending()));
/// if health.state() != SinkState::Closed {
///     // report "degraded"
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SinkHealth {
    rx: watch::Receiver<SinkStatus>,
}

impl fmt::Debug for SinkHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SinkHealth")
            .field("status", &*self.rx.borrow())
            .finish()
    }
}

impl SinkHealth {
    /// The current state.
    pub fn state(&self) -> SinkState {
        self.rx.borrow().state
    }

    /// The current state with when it began and the last sink error.
    pub fn status(&self) -> SinkStatus {
        self.rx.borrow().clone()
    }

    /// Waits for the next transition and returns the new state; `None`
    /// once the relay is gone.
    pub async fn changed(&mut self) -> Option<SinkState> {
        self.rx.changed().await.ok()?;
        Some(self.rx.borrow_and_update().state)
    }

    /// Waits until the state satisfies `f` (returns at once if it already
    /// does); `None` if the relay is gone first.
    pub async fn wait_for(&mut self, mut f: impl FnMut(SinkState) -> bool) -> Option<SinkState> {
        self.rx
            .wait_for(|status| f(status.state))
            .await
            .ok()
            .map(|status| status.state)
    }
}

/// The relay's side of the breaker. Methods take `&self` (the relay's loop
/// borrows the relay); each returns the state it left when it changed one.
pub(crate) struct Breaker {
    tx: watch::Sender<SinkStatus>,
    probe: RetryPolicy,
    /// Openings since the breaker last closed (drives the probe delay).
    failures: AtomicU32,
    /// The relay's metric labels (`store="<name>"`, or none).
    labels: Vec<metrics::Label>,
}

impl Breaker {
    pub(crate) fn new() -> Self {
        Self {
            tx: watch::Sender::new(SinkStatus::default()),
            probe: RetryPolicy::new(PROBE_MIN, PROBE_MAX, u32::MAX, Jitter::Equal)
                .unwrap_or_default(),
            failures: AtomicU32::new(0),
            labels: Vec::new(),
        }
    }

    /// Puts `labels` on the breaker's metrics.
    pub(crate) fn set_labels(&mut self, labels: Vec<metrics::Label>) {
        self.labels = labels;
    }

    pub(crate) fn health(&self) -> SinkHealth {
        SinkHealth {
            rx: self.tx.subscribe(),
        }
    }

    pub(crate) fn state(&self) -> SinkState {
        self.tx.borrow().state
    }

    /// Publishes the current state as the gauge (at relay start).
    pub(crate) fn publish(&self) {
        metrics::gauge!(m::SINK_STATE, self.labels.clone()).set(self.state().gauge_value());
    }

    /// The sink failed with `error`: open (again). Returns the probe delay
    /// and, if the state changed, the state it left.
    pub(crate) fn open(&self, error: &DeliveryError) -> (Duration, Option<SinkState>) {
        let failures = self
            .failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        let delay = self.probe.next_delay(failures, rand::random());
        let from = self.state();
        let changed = self.transition(SinkState::Open, |s| {
            s.last_error = Some(error.clone());
            s.outages += u64::from(from.is_closed());
        });
        info!(
            from = %from,
            error = %error,
            probe_in = ?delay,
            "sink unavailable: batch given back unattempted; claiming paused until a probe gets through"
        );
        (delay, changed)
    }

    /// The probe delay is over: let one small batch through.
    pub(crate) fn half_open(&self) -> Option<SinkState> {
        let changed = self.transition(SinkState::HalfOpen, |_| {});
        if changed.is_some() {
            info!("sink half-open: probing with one event");
        }
        changed
    }

    /// The sink answered: back to full speed.
    pub(crate) fn close(&self) -> Option<SinkState> {
        self.failures.store(0, Ordering::Relaxed);
        let changed = self.transition(SinkState::Closed, |_| {});
        if let Some(from) = changed {
            info!(from = %from, "sink available again: closed, delivering at full speed");
        }
        changed
    }

    /// Moves to `to` (also applying `update`) in one publication, so a
    /// watcher never sees half a transition.
    fn transition(&self, to: SinkState, update: impl FnOnce(&mut SinkStatus)) -> Option<SinkState> {
        let from = self.state();
        if from == to {
            return None;
        }
        self.tx.send_modify(|s| {
            update(s);
            s.state = to;
            s.since = SystemTime::now();
        });
        metrics::gauge!(m::SINK_STATE, self.labels.clone()).set(to.gauge_value());
        let mut labels = self.labels.clone();
        labels.push(metrics::Label::new("to", to.as_str()));
        metrics::counter!(m::SINK_STATE_TRANSITIONS, labels).increment(1);
        Some(from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::ErrorCode;

    fn down() -> DeliveryError {
        DeliveryError::unavailable(ErrorCode::PUBLISH_CONNECTION_LOST, "refused")
    }

    #[tokio::test]
    async fn transitions_are_published_and_probe_delays_are_capped() {
        let breaker = Breaker::new();
        let mut health = breaker.health();
        assert_eq!(health.state(), SinkState::Closed);

        let mut delays = Vec::new();
        for i in 0..12 {
            let (delay, from) = breaker.open(&down());
            let expected = if i == 0 {
                SinkState::Closed
            } else {
                SinkState::HalfOpen
            };
            assert_eq!(from, Some(expected));
            delays.push(delay);
            assert_eq!(breaker.half_open(), Some(SinkState::Open));
        }
        assert!(delays[0] >= PROBE_MIN / 2 && delays[0] <= PROBE_MIN);
        assert!(delays.iter().all(|d| *d <= PROBE_MAX));
        assert!(delays[11] >= PROBE_MAX / 2);
        let status = health.status();
        assert_eq!(status.state, SinkState::HalfOpen);
        assert_eq!(
            status.outages, 1,
            "re-opening from half-open is the same outage"
        );
        assert_eq!(status.last_error, Some(down()));

        assert_eq!(breaker.close(), Some(SinkState::HalfOpen));
        assert_eq!(breaker.close(), None);
        assert_eq!(
            health.wait_for(SinkState::is_closed).await,
            Some(SinkState::Closed)
        );
        // Closed resets the probe backoff.
        let (d, _) = breaker.open(&down());
        assert!(d <= PROBE_MIN);
        assert_eq!(health.changed().await, Some(SinkState::Open));
        assert_eq!(health.status().outages, 2);
        drop(breaker);
        assert_eq!(health.changed().await, None);
    }

    #[test]
    fn gauge_values_and_names() {
        assert_eq!(SinkState::Closed.gauge_value(), 0.0);
        assert_eq!(SinkState::HalfOpen.gauge_value(), 1.0);
        assert_eq!(SinkState::Open.gauge_value(), 2.0);
        assert_eq!(SinkState::HalfOpen.to_string(), "half_open");
    }
}
