//! The relay: claims committed events from a store, delivers them to a
//! sink and settles them. See [`Relay`].
//!
//! This file is the relay's public face (building it, running it); the
//! loop and its steps are in the files below it, which never import this
//! one:
//!
//! - `state.rs`: the [`Relay`] type, and the state its loop carries;
//! - `run.rs`: the loop as named steps (wait for a turn, claim, clear for
//!   delivery, deliver, settle, rest);
//! - `claim.rs`, `deliver.rs`: the claim and deliver steps;
//! - `settle.rs`: the one route from a batch to [`Store::settle`];
//! - `renew.rs`: lease renewal beside the loop;
//! - `batch.rs`, `pacing.rs`, `report.rs`: plain data (a claimed batch and
//!   its settlement plan; the loop's pacing; what the relay reports).

mod batch;
mod claim;
mod deliver;
mod meters;
mod pacing;
mod renew;
mod report;
mod run;
mod settle;
mod state;

pub use self::report::{Progress, RelaySummary, SINK_PANICKED};
pub use self::state::Relay;

use self::state::Mode;
use crate::breaker::{Breaker, SinkHealth};
use crate::control::{PauseHandle, PauseWatch};
use crate::layer::KeyOrder;
use crate::lease::Leases;
use crate::name::StoreName;
use crate::options::{InvalidOptions, RelayOptions};
use crate::rate::TokenBucket;
use outbox_core::{ControlStore, Sink, Store};
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use tokio::time::Instant;
use tracing::{error_span, warn, Instrument, Span};

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
            name: None,
            meters: OnceLock::new(),
        })
    }

    /// Names the store this relay serves, for a process that runs relays
    /// over several stores: every metric the relay records carries the
    /// label `store="<name>"` (also the sink breaker's and the pause
    /// gauge), and its log lines are in a span `relay{store=<name>}` (at
    /// ERROR level, so a filter that keeps only warnings still shows it).
    /// Without a name the relay records its metrics without that label.
    pub fn with_store_name(mut self, name: StoreName) -> Self {
        self.name = Some(name);
        let labels = self.metric_labels();
        self.breaker.set_labels(labels.clone());
        if let Some(pause) = &mut self.pause {
            pause.set_labels(labels);
        }
        self
    }

    /// The store's name set with [`Relay::with_store_name`].
    pub fn store_name(&self) -> Option<&StoreName> {
        self.name.as_ref()
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
        let mut pause = PauseWatch::new(control, group.into());
        pause.set_labels(self.metric_labels());
        self.pause = Some(pause);
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

    /// Runs the loop and the lease renewal side by side on this task.
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
            warn!(
                late_send = ?late_send,
                lock_timeout = ?lock,
                "the sink can still send a message this long after its delivery was dropped, more than a quarter of the lock timeout: only a quarter is kept back, and a copy sent later than that could reach the broker after another relay published the key's later events; shorten the sink's send timeout (Kafka: message.timeout.ms) or lengthen the lock timeout"
            );
            late_send = lock / 4;
        }
        let leases = Leases::new(lock, late_send);
        // Registered now, with the recorder installed now.
        self.meters();
        // At ERROR level so a subscriber that keeps only errors or
        // warnings still shows which store a line is about (a span is kept
        // when its level passes the filter).
        let span = match &self.name {
            Some(name) => error_span!("relay", store = %name),
            None => Span::none(),
        };
        let work = self.main_loop(shutdown, mode, &leases);
        let renew = self.renew_leases(&leases);
        // Both run on this task: the renewal loop keeps the held leases
        // alive while the main loop awaits the sink or the store.
        async {
            tokio::select! {
                biased;
                summary = work => summary,
                never = renew => match never {},
            }
        }
        .instrument(span)
        .await
    }
}
