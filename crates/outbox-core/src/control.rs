//! Operator control of running relays: pausing and resuming a consumer
//! group ([`ControlStore`]).
//!
//! The pause is a row in the store (one per group) that running relays
//! read about once a second: a paused group's relays stop claiming (what
//! they already claimed is delivered and settled), and start again once
//! the row says so. No restart, no signal: every relay of the group, on
//! any host, sees the same row.

use crate::store::Retryable;
use chrono::{DateTime, Utc};
use std::future::Future;

/// The consumer group of stores that have a single, implicit one (the
/// PostgreSQL queue table, SQLite), and of event-log relays that name none.
pub const DEFAULT_GROUP: &str = "default";

/// Who pauses a group, and why: recorded with the pause, shown by
/// `outbox-relay status` and `/readyz`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PauseNote {
    /// Who asked (an operator, a tool), free text.
    pub by: Option<String>,
    /// Why, free text.
    pub reason: Option<String>,
}

impl PauseNote {
    /// A note without author or reason.
    pub fn new() -> Self {
        Self::default()
    }

    /// Who asked.
    pub fn with_by(mut self, by: impl Into<String>) -> Self {
        self.by = Some(by.into());
        self
    }

    /// Why.
    pub fn with_reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = Some(reason.into());
        self
    }
}

/// A paused group, as its control row records it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Paused {
    /// When it was paused (database clock).
    pub since: DateTime<Utc>,
    /// Who paused it.
    pub by: Option<String>,
    /// Why.
    pub reason: Option<String>,
}

impl Paused {
    /// A pause recorded at `since` with `note`.
    pub fn new(since: DateTime<Utc>, note: PauseNote) -> Self {
        Self {
            since,
            by: note.by,
            reason: note.reason,
        }
    }
}

/// A store's control rows: whether a consumer group is paused.
///
/// Stores with one implicit group (the PostgreSQL queue table, SQLite)
/// accept only [`DEFAULT_GROUP`] and refuse other names; the PostgreSQL
/// event log accepts any group name (a group may be paused before its first
/// relay starts).
pub trait ControlStore: Send + Sync + 'static {
    /// The store's error type.
    type Error: std::error::Error + Retryable + Send + Sync + 'static;

    /// The group's pause, or `None` while it runs (also when it was never
    /// paused). One cheap query: relays call it about once a second.
    fn paused(
        &self,
        group: &str,
    ) -> impl Future<Output = Result<Option<Paused>, Self::Error>> + Send;

    /// Pauses `group` (`paused = true`, recording `note` and the database's
    /// `now()`) or resumes it. Returns whether the state changed: pausing a
    /// paused group keeps its first pause (time, author and reason) and
    /// returns `false`, as does resuming a running one.
    fn set_paused(
        &self,
        group: &str,
        paused: bool,
        note: &PauseNote,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send;
}

impl<C: ControlStore> ControlStore for std::sync::Arc<C> {
    type Error = C::Error;

    fn paused(
        &self,
        group: &str,
    ) -> impl Future<Output = Result<Option<Paused>, Self::Error>> + Send {
        (**self).paused(group)
    }

    fn set_paused(
        &self,
        group: &str,
        paused: bool,
        note: &PauseNote,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        (**self).set_paused(group, paused, note)
    }
}
