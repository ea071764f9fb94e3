//! The relay loop: claim, deliver, record outcomes, wait.

use crate::metrics as m;
use crate::{InvalidOptions, RelayOptions};
use chrono::{DateTime, Utc};
use futures::FutureExt;
use outbox_core::{
    Claim, ClaimRequest, DeliveryError, Disposition, ErrorCode, Event, EventId, Failure,
    FenceReport, FencingToken, Jitter, Outcome, RetryPolicy, Sink, Store,
};
use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tracing::{debug, error, info, info_span, warn, Instrument};

/// Code recorded when a sink returned fewer outcomes than events (a sink bug;
/// the missing events are retried).
pub const SINK_MISSING_OUTCOME: ErrorCode = ErrorCode::from_static("SINK_MISSING_OUTCOME");

/// Code a sink returns for an event it deliberately did not attempt (e.g. a
/// later event of a key whose earlier event just failed, to keep per-key
/// order). The relay releases such events (lease cleared, attempt not
/// counted) instead of failing them.
pub const NOT_ATTEMPTED: ErrorCode = ErrorCode::from_static("NOT_ATTEMPTED");

/// How many times recording a batch's outcome is tried before giving up (the
/// events then come back when their lease expires: at-least-once).
const RECORD_ATTEMPTS: u32 = 3;

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
    /// These events were given back unattempted at shutdown.
    Released {
        /// The events.
        ids: Vec<EventId>,
    },
}

/// Totals of one [`Relay::run`] / [`Relay::run_until_idle`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
    /// Events released unattempted at shutdown.
    pub released: u64,
}

type Listener = Arc<dyn Fn(&Progress) + Send + Sync>;

/// The relay: claims batches of committed events from a [`Store`], hands
/// them to a [`Sink`] and records each outcome under the claim's fencing token.
///
/// One loop iteration:
/// 1. claim up to `batch_size` events of this relay's shard, leased for
///    `lock_timeout` (database clock);
/// 2. `sink.deliver(&events)`;
/// 3. one `store.complete` for all delivered events, one `store.fail` for
///    the failures: [`Disposition::Dead`] when the error is permanent or the
///    event has used `max_attempts`, else a retry after
///    [`RetryPolicy::next_delay`] (jittered);
/// 4. if the store reports fenced-out events (lease lost), log a warning with
///    their ids and count them in `outbox_lease_lost_total`;
/// 5. after a full batch with drain mode on, claim again at once; otherwise
///    wait for the poll interval, the store's wake-up signal or shutdown.
///
/// Store errors are logged and retried with a capped exponential backoff
/// (250 ms .. 30 s); the relay never gives up and never panics.
pub struct Relay<St, Si> {
    store: St,
    sink: Si,
    options: RelayOptions,
    listener: Option<Listener>,
}

impl<St, Si> fmt::Debug for Relay<St, Si> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("options", &self.options)
            .field("listener", &self.listener.is_some())
            .finish_non_exhaustive()
    }
}

/// Whether the loop stops on shutdown only, or also once the store is drained.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    UntilShutdown,
    UntilIdle,
}

impl<St: Store, Si: Sink> Relay<St, Si> {
    /// A relay over `store` and `sink`. Fails if the options are invalid.
    pub fn new(store: St, sink: Si, options: RelayOptions) -> Result<Self, InvalidOptions> {
        options.validate()?;
        Ok(Self {
            store,
            sink,
            options,
            listener: None,
        })
    }

    /// Calls `f` for every outcome the relay records (after it is recorded).
    /// Keep it cheap: it runs on the relay's task.
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

    /// The sink.
    pub fn sink(&self) -> &Si {
        &self.sink
    }

    /// Runs until `shutdown` completes (wire it to SIGINT/SIGTERM).
    ///
    /// On shutdown the relay stops claiming; a delivery in flight may finish
    /// within the shutdown grace period and its outcomes are recorded; if it
    /// does not finish in time it is dropped and its events are released
    /// (lease cleared, attempt not counted) for the next relay.
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
        self,
        shutdown: impl Future<Output = ()> + Send,
        mode: Mode,
    ) -> RelaySummary {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut summary = RelaySummary::default();
        let wakeup = self.store.wakeup();
        let error_backoff = RetryPolicy::new(
            Duration::from_millis(250),
            Duration::from_secs(30),
            u32::MAX,
            Jitter::Equal,
        )
        .unwrap_or_default();
        let mut store_errors: u32 = 0;
        let req = ClaimRequest {
            relay_id: self.options.relay_id().clone(),
            batch_size: self.options.batch_size(),
            lease: self.options.lock_timeout(),
            shard: self.options.shard(),
        };
        info!(
            relay_id = %req.relay_id,
            shard = %req.shard,
            batch_size = req.batch_size,
            "relay started"
        );

        // A claim made while the previous batch was being delivered (drain
        // mode after a full batch): claim and delivery overlap, so the relay
        // runs near the slower of the store and the sink instead of their sum.
        let mut prefetched: Option<Claim> = None;
        loop {
            // Never poll `shutdown` again once it completed.
            if shutdown.as_mut().now_or_never().is_some() {
                break;
            }
            let claim = match prefetched.take() {
                Some(claim) => claim,
                None => match self.store.claim(&req).await {
                    Ok(claim) => {
                        store_errors = 0;
                        claim
                    }
                    Err(err) => {
                        store_errors = store_errors.saturating_add(1);
                        let delay = error_backoff.next_delay(store_errors, rand::random());
                        metrics::counter!(m::STORE_ERRORS, "op" => "claim").increment(1);
                        warn!(error = %err, retry_in = ?delay, "claim failed; backing off");
                        if wait(delay, shutdown.as_mut(), None).await {
                            break;
                        }
                        continue;
                    }
                },
            };

            let n = claim.events.len();
            if n == 0 {
                metrics::gauge!(m::LAG_SECONDS).set(0.0);
                metrics::gauge!(m::LAG_ALERT).set(0.0);
                if mode == Mode::UntilIdle && self.is_drained().await {
                    break;
                }
                if wait(
                    self.options.poll_interval(),
                    shutdown.as_mut(),
                    wakeup.as_deref(),
                )
                .await
                {
                    break;
                }
                continue;
            }

            summary.batches += 1;
            let full = n >= usize::try_from(self.options.batch_size()).unwrap_or(usize::MAX);
            let drain = self.options.drain() && full;
            let stop = if drain {
                // The events of this batch are leased, so the overlapping claim
                // cannot take them, nor (per-key order) later events of their keys.
                let (stop, next) = tokio::join!(
                    self.process(claim, shutdown.as_mut(), &mut summary),
                    self.store.claim(&req)
                );
                match next {
                    Ok(next) if !next.events.is_empty() => prefetched = Some(next),
                    Ok(_) => {}
                    Err(err) => {
                        metrics::counter!(m::STORE_ERRORS, "op" => "claim").increment(1);
                        warn!(error = %err, "overlapping claim failed; claiming again");
                    }
                }
                stop
            } else {
                self.process(claim, shutdown.as_mut(), &mut summary).await
            };
            if stop {
                break;
            }
            if !drain
                && wait(
                    self.options.poll_interval(),
                    shutdown.as_mut(),
                    wakeup.as_deref(),
                )
                .await
            {
                break;
            }
        }
        if let Some(claim) = prefetched {
            // Claimed but never handed to the sink: give it back unattempted.
            let ids: Vec<EventId> = claim.events.iter().map(|e| e.id).collect();
            self.release(claim.token, &ids, &mut summary).await;
        }
        info!(
            relay_id = %req.relay_id,
            delivered = summary.delivered,
            retried = summary.retried,
            dead = summary.dead,
            lease_lost = summary.lease_lost,
            released = summary.released,
            "relay stopped"
        );
        summary
    }

    async fn is_drained(&self) -> bool {
        match self.store.stats().await {
            Ok(stats) => stats.pending == 0 && stats.in_flight == 0,
            Err(err) => {
                warn!(error = %err, "stats failed; not treating the outbox as drained");
                false
            }
        }
    }

    /// Delivers one claimed batch and records its outcomes. Returns whether
    /// shutdown was requested meanwhile.
    async fn process(
        &self,
        claim: Claim,
        mut shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
        summary: &mut RelaySummary,
    ) -> bool {
        let started = Instant::now();
        let ids: Vec<EventId> = claim.events.iter().map(|e| e.id).collect();
        let span = info_span!(
            "outbox_batch",
            relay_id = %self.options.relay_id(),
            token = %claim.token,
            size = ids.len(),
            event_ids = %join_ids(&ids),
        );
        async {
            self.record_lag(&claim);
            debug!("delivering batch");

            let mut delivery = std::pin::pin!(self.sink.deliver(&claim.events));
            let (outcomes, stop) = tokio::select! {
                biased;
                outcomes = delivery.as_mut() => (Some(outcomes), false),
                () = shutdown.as_mut() => {
                    let grace = self.options.shutdown_grace();
                    info!(grace = ?grace, "shutdown requested; waiting for the in-flight batch");
                    match tokio::time::timeout(grace, delivery.as_mut()).await {
                        Ok(outcomes) => (Some(outcomes), true),
                        Err(_) => {
                            warn!("in-flight batch did not finish within the shutdown grace period; releasing it");
                            (None, true)
                        }
                    }
                }
            };
            match outcomes {
                Some(outcomes) => self.record(&claim, outcomes, started, summary).await,
                None => self.release(claim.token, &ids, summary).await,
            }
            stop
        }
        .instrument(span)
        .await
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
        let alert = lag > self.options.lag_alert();
        metrics::gauge!(m::LAG_ALERT).set(if alert { 1.0 } else { 0.0 });
        if alert {
            warn!(lag = ?lag, threshold = ?self.options.lag_alert(), "outbox lag above the alert threshold");
        }
    }

    /// The fate of a failed event under the retry policy.
    fn disposition(&self, event: &Event, error: &DeliveryError) -> Disposition {
        let policy = self.options.retry();
        if !error.is_retryable() || !policy.should_retry(event.attempts) {
            Disposition::Dead
        } else {
            Disposition::Retry {
                delay: policy.next_delay(event.attempts, rand::random()),
            }
        }
    }

    async fn record(
        &self,
        claim: &Claim,
        outcomes: Vec<Outcome>,
        started: Instant,
        summary: &mut RelaySummary,
    ) {
        if outcomes.len() != claim.events.len() {
            error!(
                events = claim.events.len(),
                outcomes = outcomes.len(),
                "sink returned the wrong number of outcomes; missing ones are treated as retryable failures"
            );
        }
        let mut outcomes = outcomes.into_iter();
        let mut delivered: Vec<&Event> = Vec::new();
        let mut failed: Vec<(&Event, Failure)> = Vec::new();
        let mut skipped: Vec<EventId> = Vec::new();
        for event in &claim.events {
            let outcome = outcomes.next().unwrap_or_else(|| {
                Outcome::Failed(DeliveryError::retryable(
                    SINK_MISSING_OUTCOME,
                    "the sink returned no outcome for this event",
                ))
            });
            match outcome {
                Outcome::Delivered => delivered.push(event),
                Outcome::Failed(error) if *error.code() == NOT_ATTEMPTED => skipped.push(event.id),
                Outcome::Failed(error) => {
                    let disposition = self.disposition(event, &error);
                    failed.push((
                        event,
                        Failure {
                            id: event.id,
                            error,
                            disposition,
                        },
                    ));
                }
            }
        }

        if !delivered.is_empty() {
            let ids: Vec<EventId> = delivered.iter().map(|e| e.id).collect();
            let store = &self.store;
            let token = claim.token;
            if let Some(report) = with_retries("complete", || store.complete(token, &ids)).await {
                let lost = self.lease_lost(&report, summary);
                for event in delivered.iter().filter(|e| !lost.contains(&e.id)) {
                    summary.delivered += 1;
                    metrics::counter!(m::EVENTS_DELIVERED).increment(1);
                    metrics::histogram!(m::EVENT_PROCESS_SECONDS)
                        .record(started.elapsed().as_secs_f64());
                    debug!(event_id = %event.id, attempts = event.attempts, "delivered");
                    self.notify(&Progress::Delivered {
                        id: event.id,
                        event_type: event.event_type.clone(),
                        attempts: event.attempts,
                    });
                }
            }
        }

        if !failed.is_empty() {
            let failures: Vec<Failure> = failed.iter().map(|(_, f)| f.clone()).collect();
            let store = &self.store;
            let token = claim.token;
            if let Some(report) = with_retries("fail", || store.fail(token, &failures)).await {
                let lost = self.lease_lost(&report, summary);
                for (event, failure) in failed.iter().filter(|(e, _)| !lost.contains(&e.id)) {
                    metrics::histogram!(m::EVENT_PROCESS_SECONDS)
                        .record(started.elapsed().as_secs_f64());
                    let code = failure.error.code().as_str().to_owned();
                    match failure.disposition {
                        Disposition::Dead => {
                            summary.dead += 1;
                            metrics::counter!(m::EVENTS_DEAD, "code" => code).increment(1);
                            warn!(event_id = %event.id, attempts = event.attempts, error = %failure.error, "dead-lettered");
                            self.notify(&Progress::Dead {
                                id: event.id,
                                event_type: event.event_type.clone(),
                                attempts: event.attempts,
                                error: failure.error.clone(),
                            });
                        }
                        Disposition::Retry { delay } => {
                            summary.retried += 1;
                            metrics::counter!(m::EVENTS_RETRIED, "code" => code).increment(1);
                            info!(event_id = %event.id, attempts = event.attempts, retry_in = ?delay, error = %failure.error, "delivery failed; retry scheduled");
                            self.notify(&Progress::Retried {
                                id: event.id,
                                event_type: event.event_type.clone(),
                                attempts: event.attempts,
                                error: failure.error.clone(),
                                delay,
                            });
                        }
                    }
                }
            }
        }

        if !skipped.is_empty() {
            self.release(claim.token, &skipped, summary).await;
        }
    }

    /// Logs and counts fenced-out events; returns their ids.
    fn lease_lost(&self, report: &FenceReport, summary: &mut RelaySummary) -> HashSet<EventId> {
        if report.lost.is_empty() {
            return HashSet::new();
        }
        summary.lease_lost += report.lost.len() as u64;
        metrics::counter!(m::LEASE_LOST).increment(report.lost.len() as u64);
        warn!(
            lost = %join_ids(&report.lost),
            count = report.lost.len(),
            lock_timeout = ?self.options.lock_timeout(),
            "lease lost: another relay re-claimed these events before their outcome was recorded; nothing was changed (raise lock_timeout if deliveries take this long)"
        );
        self.notify(&Progress::LeaseLost {
            ids: report.lost.clone(),
        });
        report.lost.iter().copied().collect()
    }

    async fn release(&self, token: FencingToken, ids: &[EventId], summary: &mut RelaySummary) {
        let store = &self.store;
        if let Some(report) = with_retries("release", || store.release(token, ids)).await {
            self.lease_lost(&report, summary);
            let lost: HashSet<EventId> = report.lost.iter().copied().collect();
            let released: Vec<EventId> = ids
                .iter()
                .copied()
                .filter(|id| !lost.contains(id))
                .collect();
            summary.released += released.len() as u64;
            metrics::counter!(m::EVENTS_RELEASED).increment(released.len() as u64);
            info!(released = %join_ids(&released), "released undelivered events");
            self.notify(&Progress::Released { ids: released });
        }
    }

    fn notify(&self, progress: &Progress) {
        if let Some(listener) = &self.listener {
            listener(progress);
        }
    }
}

/// Waits for `delay`, the wake-up signal, or shutdown. Returns whether
/// shutdown completed.
async fn wait(
    delay: Duration,
    shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
    wakeup: Option<&Notify>,
) -> bool {
    let woken = async {
        match wakeup {
            Some(notify) => notify.notified().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = shutdown => true,
        () = tokio::time::sleep(delay) => false,
        () = woken => false,
    }
}

/// Runs a store write up to [`RECORD_ATTEMPTS`] times with a short backoff.
/// `None` when every attempt failed: the events stay leased and come back
/// after the lease expires (at-least-once).
async fn with_retries<T, E: fmt::Display, F: Future<Output = Result<T, E>>>(
    op: &'static str,
    mut call: impl FnMut() -> F,
) -> Option<T> {
    let mut delay = Duration::from_millis(100);
    for attempt in 1..=RECORD_ATTEMPTS {
        match call().await {
            Ok(v) => return Some(v),
            Err(err) => {
                metrics::counter!(m::STORE_ERRORS, "op" => op).increment(1);
                if attempt == RECORD_ATTEMPTS {
                    error!(error = %err, op, "could not record outcomes; the events come back when their lease expires");
                } else {
                    warn!(error = %err, op, attempt, "store write failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay *= 4;
                }
            }
        }
    }
    None
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
