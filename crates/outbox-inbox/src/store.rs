//! The [`InboxStore`] seam: the consumer's own database. Implemented for
//! PostgreSQL ([`crate::pg::PgInbox`]) and SQLite
//! ([`crate::sqlite::SqliteInbox`]); both pass the same conformance suite
//! (`tests/store_conformance.rs`).
//!
//! Three tables per inbox (names from a validated prefix, in a schema on
//! PostgreSQL):
//! - `inbox_records`: (consumer, event id, slot, handled_at), one row per
//!   handled message: the deduplication record. Rows live in
//!   [`RETENTION_SLOTS`] slots by their database time; the slot that comes
//!   next is emptied in bulk (TRUNCATE of a partition on PostgreSQL,
//!   `DELETE` without `WHERE` of a table on SQLite), so retention costs
//!   nothing per row.
//! - `inbox_pending`: messages held back: to retry later (`retry`), waiting
//!   behind an earlier message of their key (`parked`), or dead (`dead`).
//!   The head of a key (its oldest row) is what the retry loop works on.

use crate::handler::Failure;
use chrono::{DateTime, Utc};
use outbox_core::{ErrorCode, EventId, InboundMessage};
use sqlx::Transaction;
use std::future::Future;
use std::time::Duration;

/// How many slots the dedup records rotate through: records live at least
/// `RETENTION_SLOTS - 1` slot lengths (the retention window) and at most
/// `RETENTION_SLOTS`.
pub const RETENTION_SLOTS: u32 = 8;

/// What [`InboxStore::admit`] decided for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// First time: recorded in this transaction; run the handler.
    New,
    /// Handled before (a redelivery or a relay duplicate): acknowledge only.
    Duplicate,
    /// Its key has messages held back: stored behind them (or already
    /// stored there); the retry loop handles it in turn.
    Parked,
}

/// The state of a held-back message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PendingState {
    /// Its handler failed retryably; due again at `next_attempt_at`.
    Retry,
    /// Waiting behind an earlier message of its key.
    Parked,
    /// Failed permanently or ran out of attempts.
    Dead,
}

impl PendingState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Parked => "parked",
            Self::Dead => "dead",
        }
    }

    /// From the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "retry" => Some(Self::Retry),
            "parked" => Some(Self::Parked),
            "dead" => Some(Self::Dead),
            _ => None,
        }
    }
}

/// A held-back message as stored.
#[derive(Debug, Clone)]
pub struct Pending {
    /// Its position (arrival order within the consumer).
    pub seq: i64,
    /// The message.
    pub message: InboundMessage,
    /// Its state.
    pub state: PendingState,
    /// Failed handler attempts so far.
    pub attempts: u32,
    /// When it is due (retry) or was received (parked).
    pub next_attempt_at: DateTime<Utc>,
    /// When it was first held back.
    pub held_at: DateTime<Utc>,
    /// The last failure's code and message.
    pub last_error: Option<(ErrorCode, String)>,
}

/// What becomes of a message whose handler failed.
#[derive(Debug, Clone)]
pub enum Hold {
    /// Retry after `delay`; `attempts` failed so far.
    Retry {
        /// Failed attempts so far.
        attempts: u32,
        /// Delay before the next attempt (the database clock adds it).
        delay: Duration,
        /// The failure.
        failure: Failure,
    },
    /// Dead letter.
    Dead {
        /// Failed attempts so far.
        attempts: u32,
        /// The failure.
        failure: Failure,
    },
}

/// Which dead letters an operation selects; every field narrows.
#[derive(Debug, Clone, Default)]
pub struct DeadFilter {
    /// Only these event ids.
    pub ids: Option<Vec<EventId>>,
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only this error code.
    pub code: Option<String>,
    /// Only this key.
    pub key: Option<String>,
    /// At most this many (listing only; default 100).
    pub limit: Option<u32>,
}

/// Why the inbox's database failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database refused or the connection failed; retried.
    #[error("inbox database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A stored row could not be read back.
    #[error("inbox row is corrupt: {0}")]
    Corrupt(String),
    /// A configuration value is invalid (a name, a window).
    #[error("invalid inbox configuration: {0}")]
    Config(String),
}

impl StoreError {
    /// Whether trying again later can succeed: a connection that failed or
    /// was terminated, a pool timeout, a database shutting down or not yet
    /// accepting connections, a serialization failure or deadlock.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Database(e) => match e {
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed
                | sqlx::Error::Protocol(_) => true,
                sqlx::Error::Database(db) => db.code().is_some_and(|c| {
                    // 08: connection exception; 57: operator intervention
                    // (admin shutdown, terminated backend); 40: rollback
                    // (serialization failure, deadlock); 53: resources.
                    // SQLite: 5 busy, 6 locked.
                    ["08", "57", "40", "53"].iter().any(|p| c.starts_with(p))
                        || c == "5"
                        || c == "6"
                }),
                _ => false,
            },
            Self::Corrupt(_) | Self::Config(_) => false,
        }
    }
}

/// What a retention pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RetentionReport {
    /// The slot now receiving records.
    pub current_slot: u32,
    /// Whether the slot after it was emptied in this pass.
    pub emptied: bool,
}

/// The consumer's database. Every method that takes a transaction runs its
/// statements in it and never commits it.
pub trait InboxStore: Clone + Send + Sync + 'static {
    /// The sqlx database.
    type Db: sqlx::Database;

    /// The consumer name: the deduplication namespace (two consumers of one
    /// event each handle it once).
    fn consumer(&self) -> &str;

    /// Creates the tables (idempotent; run at start).
    fn migrate(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// A new transaction on the inbox's pool.
    fn begin(
        &self,
    ) -> impl Future<Output = Result<Transaction<'static, Self::Db>, StoreError>> + Send;

    /// Decides, in `tx`, for each message in order: [`Verdict::Parked`] when
    /// its key has held-back messages (a dead one only when `block_on_dead`),
    /// storing it behind them; else [`Verdict::New`] when its id has no record
    /// (inserting the record) or [`Verdict::Duplicate`]. All messages of one
    /// key in `messages` get the same kind of verdict unless duplicates.
    fn admit(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        messages: &[InboundMessage],
        block_on_dead: bool,
    ) -> impl Future<Output = Result<Vec<Verdict>, StoreError>> + Send;

    /// Holds `message` back after its handler failed (a retry or a dead
    /// letter). A message already held is left as it is.
    fn hold(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        message: &InboundMessage,
        hold: &Hold,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Up to `limit` heads of held-back keys that are due (retry time
    /// reached, or parked with nothing before them), oldest first, locked
    /// for `tx` where the database can (PostgreSQL `FOR UPDATE SKIP
    /// LOCKED`). A dead head blocks its key only when `block_on_dead`.
    fn due(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        limit: u32,
        block_on_dead: bool,
    ) -> impl Future<Output = Result<Vec<Pending>, StoreError>> + Send;

    /// Records a held-back message as handled (`true`) unless its id already
    /// has a record (`false`, a duplicate), and removes it from pending.
    fn complete(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        seq: i64,
        id: EventId,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Updates a held-back message after another failed attempt.
    fn fail(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        seq: i64,
        hold: &Hold,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The dead letters the filter selects, oldest first.
    fn dead_letters(
        &self,
        filter: &DeadFilter,
    ) -> impl Future<Output = Result<Vec<Pending>, StoreError>> + Send;

    /// Makes the selected dead letters due again with their attempts reset;
    /// returns how many.
    fn replay(&self, filter: &DeadFilter) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes the selected dead letters (the messages behind them become
    /// heads); returns how many.
    fn purge(&self, filter: &DeadFilter) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Held-back messages by state: (retry, parked, dead).
    fn pending_counts(&self) -> impl Future<Output = Result<(u64, u64, u64), StoreError>> + Send;

    /// One retention pass: empties the slot after the current one if it
    /// still holds records (they are older than the retention window).
    fn retain(&self) -> impl Future<Output = Result<RetentionReport, StoreError>> + Send;

    /// Whether `id` has a dedup record (tests and tools).
    fn is_recorded(&self, id: EventId) -> impl Future<Output = Result<bool, StoreError>> + Send;
}
