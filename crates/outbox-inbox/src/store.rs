//! The inbox's store seams: the consumer's own database, as small traits by
//! capability, each with its own error type (as `outbox_core`'s `Store`,
//! `DeadLetterStore` and `ControlStore`):
//!
//! - [`InboxStore`]: the consumer's record / apply path (admit, hold, the
//!   retry loop's due heads);
//! - [`InboxSchema`]: creating the tables;
//! - [`InboxRetentionStore`]: the dedup records' retention;
//! - [`InboxDeadLetterStore`]: the held-back messages for operators (dead
//!   letters selected by an [`outbox_core::DeadLetterFilter`], counts).
//!
//! [`crate::Inbox`] requires only the first three. Implemented for
//! PostgreSQL ([`crate::pg::PgInbox`]) and SQLite
//! ([`crate::sqlite::SqliteInbox`]); both pass the same conformance suite
//! (`tests/inbox.rs`).
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
use outbox_core::{DeadLetterFilter, ErrorCode, EventId, InboundMessage, Retryable};
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
    /// When it is due (retry), was received (parked) or was dead-lettered
    /// (dead: a [`DeadLetterFilter`]'s ages are measured from it).
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
    pub fn is_retryable(&self) -> bool {
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

impl Retryable for StoreError {
    fn is_retryable(&self) -> bool {
        StoreError::is_retryable(self)
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

/// How many messages are held back, by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PendingCounts {
    /// Messages whose handler failed retryably, waiting for their next
    /// attempt ([`PendingState::Retry`]).
    pub retry: u64,
    /// Messages waiting behind an earlier message of their key
    /// ([`PendingState::Parked`]).
    pub parked: u64,
    /// Dead letters ([`PendingState::Dead`]).
    pub dead: u64,
}

/// The consumer's record / apply path: what [`crate::Inbox`] runs per lane
/// batch and per retry. Every method that takes a transaction runs its
/// statements in it and never commits it.
pub trait InboxStore: Clone + Send + Sync + 'static {
    /// The sqlx database.
    type Db: sqlx::Database;

    /// The store's error type. The consumer commits and rolls back the
    /// store's transactions itself, so a failed commit is one of them
    /// (`From<sqlx::Error>`).
    type Error: std::error::Error + Retryable + From<sqlx::Error> + Send + Sync + 'static;

    /// The consumer name: the deduplication namespace (two consumers of one
    /// event each handle it once).
    fn consumer(&self) -> &str;

    /// A new transaction on the inbox's pool.
    fn begin(
        &self,
    ) -> impl Future<Output = Result<Transaction<'static, Self::Db>, Self::Error>> + Send;

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
    ) -> impl Future<Output = Result<Vec<Verdict>, Self::Error>> + Send;

    /// Holds `message` back after its handler failed (a retry or a dead
    /// letter). A message already held is left as it is.
    fn hold(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        message: &InboundMessage,
        hold: &Hold,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Up to `limit` heads of held-back keys that are due (retry time
    /// reached, or parked with nothing before them), oldest first, locked
    /// for `tx` where the database can (PostgreSQL `FOR UPDATE SKIP
    /// LOCKED`). A dead head blocks its key only when `block_on_dead`.
    fn due(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        limit: u32,
        block_on_dead: bool,
    ) -> impl Future<Output = Result<Vec<Pending>, Self::Error>> + Send;

    /// Records a held-back message as handled (`true`) unless its id already
    /// has a record (`false`, a duplicate), and removes it from pending.
    fn complete(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        seq: i64,
        id: EventId,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send;

    /// Updates a held-back message after another failed attempt.
    fn fail(
        &self,
        tx: &mut Transaction<'static, Self::Db>,
        seq: i64,
        hold: &Hold,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// The inbox's tables.
pub trait InboxSchema: Send + Sync + 'static {
    /// The store's error type.
    type Error: std::error::Error + Retryable + Send + Sync + 'static;

    /// Creates the tables (idempotent; [`crate::Inbox`] runs it at start and
    /// waits while it fails retryably).
    fn migrate(&self) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// The dedup records' lifetime: the retention pass, and whether an id
/// still has its record.
pub trait InboxRetentionStore: Send + Sync + 'static {
    /// The store's error type.
    type Error: std::error::Error + Retryable + Send + Sync + 'static;

    /// One retention pass: empties the slot after the current one if it
    /// still holds records (they are older than the retention window).
    fn retain(&self) -> impl Future<Output = Result<RetentionReport, Self::Error>> + Send;

    /// Whether `id` has a dedup record (tests and tools).
    fn is_recorded(&self, id: EventId) -> impl Future<Output = Result<bool, Self::Error>> + Send;
}

/// The held-back messages for operators: the dead letters a
/// [`DeadLetterFilter`] selects (the outbox's filter: ids, event type,
/// final error code, key, and ages measured from when the message was
/// dead-lettered), and counts by state.
pub trait InboxDeadLetterStore: Send + Sync + 'static {
    /// The store's error type.
    type Error: std::error::Error + Retryable + Send + Sync + 'static;

    /// Up to `limit` of the dead letters `filter` selects, in arrival order
    /// (their `seq`). A limit rather than the outbox's
    /// [`DeadLetterQuery`](outbox_core::DeadLetterQuery): its keyset cursor
    /// is an event id, which does not page an arrival order.
    fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<Pending>, Self::Error>> + Send;

    /// Makes the selected dead letters due again with their attempts reset;
    /// returns how many.
    fn replay(
        &self,
        filter: &DeadLetterFilter,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Deletes the selected dead letters (the messages behind them become
    /// heads); returns how many.
    fn purge(
        &self,
        filter: &DeadLetterFilter,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Held-back messages by state.
    fn pending_counts(&self) -> impl Future<Output = Result<PendingCounts, Self::Error>> + Send;
}
