//! Pause and resume: the relay watches its consumer group's control row.
//!
//! With [`Relay::with_control`](crate::Relay::with_control) the relay reads
//! the group's pause ([`ControlStore::paused`]) before a claim when its last
//! read is a second old or more (one small query a second, not one per
//! claim). While the group is paused it claims nothing: a batch it holds
//! (being delivered, or claimed ahead in drain mode) is delivered and
//! settled as usual, then the relay re-reads the row every second until
//! the group is resumed. So `outbox-relay pause` stops claims within about a
//! second, and `resume` restarts them within about a second.
//!
//! A read that fails keeps the last known state (a paused relay stays
//! paused through a database outage, a running one keeps running; claims
//! report the outage themselves) and is counted in
//! `outbox_store_errors_total{op="control"}`.
//!
//! The state is published as the gauge [`PAUSED`](crate::metrics::PAUSED)
//! (label `group`: 1 paused, 0 running), an INFO log line per change, and
//! the [`PauseHandle`] from [`Relay::pause_handle`](crate::Relay::pause_handle)
//! for health endpoints.

use crate::metrics as m;
use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::{ControlStore, Paused, Retryable};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};
use tokio::time::Instant;
use tracing::{info, warn};

/// How often a relay re-reads its group's control row.
pub const CONTROL_REFRESH: Duration = Duration::from_secs(1);

/// What a relay last read of its group's pause.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PauseStatus {
    /// The consumer group the relay watches.
    pub group: String,
    /// The pause, while the group is paused.
    pub paused: Option<Paused>,
    /// When the row was last read successfully.
    pub checked_at: Option<SystemTime>,
    /// The last read's error, when it failed (the state above is then the
    /// one read before).
    pub last_error: Option<String>,
}

impl PauseStatus {
    /// A running group never read yet.
    pub fn new(group: impl Into<String>) -> Self {
        Self {
            group: group.into(),
            paused: None,
            checked_at: None,
            last_error: None,
        }
    }
}

/// A handle on a relay's pause state, for health and status endpoints.
/// Cheap to clone; keeps showing the last state after the relay stopped.
#[derive(Clone)]
pub struct PauseHandle {
    state: Arc<Mutex<PauseStatus>>,
}

impl fmt::Debug for PauseHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PauseHandle").field(&self.status()).finish()
    }
}

impl PauseHandle {
    fn new(group: String) -> Self {
        Self {
            state: Arc::new(Mutex::new(PauseStatus::new(group))),
        }
    }

    /// The last state read.
    pub fn status(&self) -> PauseStatus {
        self.lock().clone()
    }

    /// Whether the group was paused at the last read.
    pub fn is_paused(&self) -> bool {
        self.lock().paused.is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PauseStatus> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The result of one read: the pause, or the error's text and whether it is retryable.
type Read = Result<Option<Paused>, (String, bool)>;
type Reader = Box<dyn Fn() -> BoxFuture<'static, Read> + Send + Sync>;

/// The relay's side: a cached read of the control row.
pub(crate) struct PauseWatch {
    read: Reader,
    handle: PauseHandle,
    group: String,
    /// When the row was last read (successfully or not).
    last_read: Mutex<Option<Instant>>,
    /// Whether a failed read was logged since the last good one.
    error_logged: Mutex<bool>,
    /// The relay's metric labels (`store="<name>"`, or none).
    labels: Vec<metrics::Label>,
}

impl fmt::Debug for PauseWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PauseWatch")
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl PauseWatch {
    pub(crate) fn new<C: ControlStore>(control: C, group: String) -> Self {
        let control = Arc::new(control);
        let g = group.clone();
        let read: Reader = Box::new(move || {
            let (control, group) = (Arc::clone(&control), g.clone());
            async move {
                control
                    .paused(&group)
                    .await
                    .map_err(|e| (e.to_string(), e.is_retryable()))
            }
            .boxed()
        });
        Self {
            read,
            handle: PauseHandle::new(group.clone()),
            group,
            last_read: Mutex::new(None),
            error_logged: Mutex::new(false),
            labels: Vec::new(),
        }
    }

    /// Puts `labels` on the watch's metrics (beside `group`).
    pub(crate) fn set_labels(&mut self, labels: Vec<metrics::Label>) {
        self.labels = labels;
    }

    /// The watch's labels plus `key` = `value`.
    fn labels_with(&self, key: &'static str, value: String) -> Vec<metrics::Label> {
        let mut labels = self.labels.clone();
        labels.push(metrics::Label::new(key, value));
        labels
    }

    pub(crate) fn handle(&self) -> PauseHandle {
        self.handle.clone()
    }

    /// Whether the group is paused: the cached state, re-read first when
    /// the last read is [`CONTROL_REFRESH`] old or more.
    pub(crate) async fn is_paused(&self) -> bool {
        let due = {
            let last = self
                .last_read
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            last.is_none_or(|t| t.elapsed() >= CONTROL_REFRESH)
        };
        if due {
            self.refresh().await;
        }
        self.handle.is_paused()
    }

    /// How long until the next read is due (zero when it is).
    pub(crate) fn next_read_in(&self) -> Duration {
        let last = self
            .last_read
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        last.map_or(Duration::ZERO, |t| {
            CONTROL_REFRESH.saturating_sub(t.elapsed())
        })
    }

    async fn refresh(&self) {
        let result = (self.read)().await;
        *self
            .last_read
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        match result {
            Ok(paused) => {
                *self
                    .error_logged
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = false;
                let was = {
                    let mut state = self.handle.lock();
                    state.checked_at = Some(SystemTime::now());
                    state.last_error = None;
                    std::mem::replace(&mut state.paused, paused.clone())
                };
                match (&was, &paused) {
                    (None, Some(p)) => info!(
                        group = %self.group,
                        by = p.by.as_deref().unwrap_or("-"),
                        reason = p.reason.as_deref().unwrap_or("-"),
                        since = %p.since,
                        "consumer group paused: claiming stops (what is claimed is delivered and settled)"
                    ),
                    (Some(_), None) => {
                        info!(group = %self.group, "consumer group resumed: claiming again")
                    }
                    _ => {}
                }
                let value = if paused.is_some() { 1.0 } else { 0.0 };
                metrics::gauge!(m::PAUSED, self.labels_with("group", self.group.clone()))
                    .set(value);
            }
            Err((error, retryable)) => {
                metrics::counter!(
                    m::STORE_ERRORS,
                    self.labels_with("op", "control".to_owned())
                )
                .increment(1);
                let paused = {
                    let mut state = self.handle.lock();
                    state.last_error = Some(error.clone());
                    state.paused.is_some()
                };
                let mut logged = self
                    .error_logged
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if !*logged {
                    *logged = true;
                    warn!(
                        group = %self.group,
                        error = %error,
                        retryable,
                        paused,
                        "cannot read the consumer group's control row (pause/resume); keeping the last known state"
                    );
                }
            }
        }
    }
}
