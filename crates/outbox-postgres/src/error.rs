//! Error types, one per operation family.

use crate::InvalidIdentifier;
use outbox_core::{EventId, ValidationError};
use thiserror::Error;

/// Why an enqueue failed. Nothing was written when this is returned, but the
/// caller's transaction may be aborted (on [`EnqueueError::Database`]): roll it back.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EnqueueError {
    /// The event broke the configured [`outbox_core::EventLimits`] or naming rules.
    #[error("event {id} refused: {source}")]
    Invalid {
        /// The refused event's id.
        id: EventId,
        /// What was wrong with it.
        #[source]
        source: ValidationError,
    },
    /// The INSERT failed (e.g. a duplicate id, a missing table: run the migrations).
    #[error("enqueue failed: {0}")]
    Database(#[source] sqlx::Error),
}

/// Why applying the migrations failed. The migration transaction was rolled back.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// Talking to the database failed.
    #[error("outbox migration failed: {0}")]
    Database(#[source] sqlx::Error),
    /// One migration's SQL failed.
    #[error("outbox migration {version} ({name}) failed: {source}")]
    Failed {
        /// Its version.
        version: i32,
        /// Its name.
        name: &'static str,
        /// The database error.
        #[source]
        source: sqlx::Error,
    },
    /// The history records a version this library does not know: the schema
    /// was migrated by a newer version of `outbox-postgres`.
    #[error("the outbox schema has migration {version}, unknown to this version of outbox-postgres (was it migrated by a newer one?)")]
    UnknownVersion {
        /// The unknown version.
        version: i32,
    },
    /// An applied migration's text differs from the embedded one.
    #[error("outbox migration {version} ({name}) was applied from different SQL than this library embeds")]
    ChecksumMismatch {
        /// Its version.
        version: i32,
        /// Its name.
        name: &'static str,
    },
}

/// Why a store operation (connect, claim, complete, fail, stats, dead letters) failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A schema or table name was refused.
    #[error("invalid outbox schema or table name: {0}")]
    InvalidName(#[from] InvalidIdentifier),
    /// The connection URL could not be parsed (the message never contains the password).
    #[error("invalid PostgreSQL connection URL: {0}")]
    InvalidUrl(String),
    /// A duration does not fit PostgreSQL's interval arithmetic (over ~292,000 years).
    #[error("duration {0:?} is too large")]
    DurationTooLarge(std::time::Duration),
    /// A stored row could not be read back (e.g. headers that are not a JSON
    /// object of strings).
    #[error("outbox row {id} is corrupt: {detail}")]
    Corrupt {
        /// The row's id.
        id: EventId,
        /// What was wrong.
        detail: String,
    },
    /// Applying the migrations failed.
    #[error(transparent)]
    Migrate(#[from] MigrateError),
    /// A query failed.
    #[error("outbox store query failed: {0}")]
    Database(#[from] sqlx::Error),
}

impl StoreError {
    /// Whether trying again later may succeed (connection trouble, pool
    /// timeout, serialization failure) as opposed to a configuration or
    /// schema problem.
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Database(e) => is_transient(e),
            StoreError::Migrate(MigrateError::Database(e)) => is_transient(e),
            _ => false,
        }
    }
}

fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            // 40001 serialization_failure, 40P01 deadlock_detected,
            // 57P01 admin_shutdown, 08* connection exceptions, 53* insufficient resources
            c == "40001"
                || c == "40P01"
                || c == "57P01"
                || c.starts_with("08")
                || c.starts_with("53")
        }),
        _ => false,
    }
}
