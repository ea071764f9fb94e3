//! The store's error type.

use outbox_core::EventId;
use thiserror::Error;

/// Why a [`crate::SqliteStore`] operation failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SqliteStoreError {
    /// The database (or the connection pool) reported an error.
    #[error("sqlite error: {0}")]
    Database(#[from] sqlx::Error),
    /// A migration that was already applied has different SQL now: the
    /// migration files were edited after release, or the database belongs to
    /// another build. Nothing was changed.
    #[error(
        "migration {version} ({name}) was applied with checksum {applied} but this build has {expected}; \
         applied migrations must never be edited"
    )]
    ChecksumMismatch {
        /// Migration version.
        version: i64,
        /// Migration name.
        name: String,
        /// Checksum recorded in `outbox_schema_migrations`.
        applied: String,
        /// Checksum of the SQL embedded in this build.
        expected: String,
    },
    /// The database has a migration this build does not know: it was migrated
    /// by a newer version of `outbox-sqlite`. Nothing was changed.
    #[error(
        "database has outbox migration {version} ({name}) that this build does not know; \
         upgrade outbox-sqlite"
    )]
    UnknownMigration {
        /// Migration version found in the database.
        version: i64,
        /// Its recorded name.
        name: String,
    },
    /// A migration's SQL failed; its transaction was rolled back.
    #[error("migration {version} ({name}) failed: {source}")]
    Migration {
        /// Migration version.
        version: i64,
        /// Migration name.
        name: String,
        /// The database error.
        #[source]
        source: sqlx::Error,
    },
    /// A stored row could not be read back (bad JSON headers, a time out of
    /// range, a negative attempt count).
    #[error("event {id} has a corrupt column {column}: {reason}")]
    Corrupt {
        /// The event.
        id: EventId,
        /// The column.
        column: &'static str,
        /// What was wrong.
        reason: String,
    },
}

impl SqliteStoreError {
    /// Whether trying the same operation again later may succeed (the
    /// database was busy or locked, the pool timed out, I/O failed).
    pub fn is_retryable(&self) -> bool {
        match self {
            SqliteStoreError::Database(e) => is_retryable_sqlx(e),
            _ => false,
        }
    }
}

pub(crate) fn is_retryable_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            // SQLITE_BUSY (5) and SQLITE_LOCKED (6), with their extended codes.
            db.code()
                .and_then(|c| c.parse::<i64>().ok())
                .is_some_and(|c| matches!(c & 0xff, 5 | 6))
        }
        _ => false,
    }
}
