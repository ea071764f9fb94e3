//! Error types, one per operation family (the same names as `outbox-postgres`).
//!
//! Each error prints its cause once: the variants that wrap a `sqlx::Error`
//! print the root cause (SQLite's own message and result code) in their
//! `Display` and do not repeat it through `source()`, so a reporter that
//! walks the chain (`anyhow`'s `{:#}`) shows it exactly once.

use outbox_core::ident::InvalidIdentifier;
use outbox_core::{EventId, Retryable, ValidationError};
use std::fmt;
use std::path::PathBuf;
use thiserror::Error;

/// Why an enqueue failed. Nothing was written when this is returned; after
/// [`EnqueueError::Database`] roll the caller's transaction back.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EnqueueError {
    /// The event broke the configured [`outbox_core::EventLimits`] or naming
    /// rules; no event of the call was written.
    #[error("event {id} refused: {source}")]
    Invalid {
        /// The refused event's id.
        id: EventId,
        /// What was wrong with it.
        #[source]
        source: ValidationError,
    },
    /// The INSERT failed (e.g. a duplicate id, a missing table: run the migrations).
    #[error("enqueue failed: {}", Cause(.0))]
    Database(sqlx::Error),
}

impl EnqueueError {
    /// The validation error, when the event itself was refused.
    pub fn validation(&self) -> Option<&ValidationError> {
        match self {
            EnqueueError::Invalid { source, .. } => Some(source),
            EnqueueError::Database(_) => None,
        }
    }
}

impl Retryable for EnqueueError {
    fn is_retryable(&self) -> bool {
        matches!(self, EnqueueError::Database(e) if is_retryable_sqlx(e))
    }
}

/// Why applying the migrations failed. The migration transaction was rolled
/// back: nothing was changed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// Talking to the database failed.
    #[error("outbox migration failed: {}", Cause(.0))]
    Database(sqlx::Error),
    /// One migration's SQL failed.
    #[error("outbox migration {version} ({name}) failed: {}", Cause(.source))]
    Failed {
        /// Its version.
        version: i32,
        /// Its name.
        name: &'static str,
        /// The database error.
        source: sqlx::Error,
    },
    /// The history records a version this build does not know: the database
    /// was migrated by a newer version of `outbox-sqlite`.
    #[error(
        "the outbox has migration {version} ({name}), unknown to this version of outbox-sqlite \
         (was it migrated by a newer one?)"
    )]
    UnknownVersion {
        /// The unknown version.
        version: i32,
        /// Its recorded name.
        name: String,
    },
    /// An applied migration's SQL differs from this build's: the migration
    /// files were edited after release, or the database belongs to another
    /// build.
    #[error(
        "outbox migration {version} ({name}) was applied with checksum {applied} but this build has \
         {expected}; applied migrations must never be edited"
    )]
    ChecksumMismatch {
        /// Its version.
        version: i32,
        /// Its name.
        name: &'static str,
        /// Checksum recorded in the history table.
        applied: String,
        /// Checksum of the SQL embedded in this build.
        expected: String,
    },
}

impl MigrateError {
    /// Whether trying again later may succeed (the database was busy).
    pub fn is_retryable(&self) -> bool {
        match self {
            MigrateError::Database(e) | MigrateError::Failed { source: e, .. } => {
                is_retryable_sqlx(e)
            }
            _ => false,
        }
    }
}

impl Retryable for MigrateError {
    fn is_retryable(&self) -> bool {
        MigrateError::is_retryable(self)
    }
}

impl From<sqlx::Error> for MigrateError {
    fn from(e: sqlx::Error) -> Self {
        MigrateError::Database(e)
    }
}

/// Why a store operation (connect, claim, settle, renew, stats, dead
/// letters) failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The table name was refused.
    #[error("invalid outbox table name: {0}")]
    InvalidName(#[from] InvalidIdentifier),
    /// The connection URL could not be parsed.
    #[error("invalid SQLite URL: {0}")]
    InvalidUrl(String),
    /// The database file could not be opened or created (a missing
    /// directory, no permission, not a database).
    #[error("cannot open SQLite database {}: {reason}", path.display())]
    Open {
        /// The database file.
        path: PathBuf,
        /// Why, in one sentence.
        reason: String,
    },
    /// The database clock returned a time that is not representable.
    #[error("the database clock returned {0} ms since the epoch, which is not a valid time")]
    Clock(i64),
    /// Applying the migrations failed (with
    /// [`SqliteStoreOptions::with_auto_migrate`](crate::SqliteStoreOptions::with_auto_migrate)).
    #[error(transparent)]
    Migrate(#[from] MigrateError),
    /// A query failed.
    #[error("outbox store query failed: {}", Cause(.0))]
    Database(sqlx::Error),
    /// A consumer group other than [`outbox_core::DEFAULT_GROUP`] was named:
    /// a SQLite outbox has only that one.
    #[error("no consumer group {0:?}: a SQLite outbox has one group, {default:?}", default = outbox_core::DEFAULT_GROUP)]
    UnknownGroup(String),
}

impl StoreError {
    /// Whether trying the same operation again later may succeed: the
    /// database was busy or locked (`SQLITE_BUSY`, `SQLITE_LOCKED`, after the
    /// busy timeout), the pool timed out, I/O failed. A missing table, a
    /// constraint or a bad name is not retryable.
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Database(e) => is_retryable_sqlx(e),
            StoreError::Migrate(e) => e.is_retryable(),
            _ => false,
        }
    }
}

impl Retryable for StoreError {
    fn is_retryable(&self) -> bool {
        StoreError::is_retryable(self)
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::Database(e)
    }
}

/// SQLite primary result codes worth retrying: BUSY (5), LOCKED (6),
/// IOERR (10), PROTOCOL (15, WAL lock contention).
const RETRYABLE_CODES: [i64; 4] = [5, 6, 10, 15];

pub(crate) fn is_retryable_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i64>().ok())
            .is_some_and(|c| RETRYABLE_CODES.contains(&(c & 0xff))),
        _ => false,
    }
}

/// The root cause of a sqlx error, printed once: SQLite's own message and
/// result code, the I/O error, or sqlx's text for the rest. (sqlx's own
/// `Display` for a database error repeats the message through `source()`.)
pub(crate) struct Cause<'a>(pub(crate) &'a sqlx::Error);

impl fmt::Display for Cause<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            sqlx::Error::Database(db) => match db.code() {
                Some(code) => write!(f, "{} (SQLite code {code})", db.message()),
                None => f.write_str(db.message()),
            },
            sqlx::Error::Io(io) => write!(f, "I/O error: {io}"),
            sqlx::Error::Configuration(c) => write!(f, "configuration: {c}"),
            sqlx::Error::ColumnDecode { index, source } => {
                write!(f, "column {index} could not be decoded: {source}")
            }
            sqlx::Error::Decode(d) => write!(f, "a value could not be decoded: {d}"),
            sqlx::Error::Encode(e) => write!(f, "a value could not be encoded: {e}"),
            other => fmt::Display::fmt(other, f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn causes_print_once() {
        let e = StoreError::from(sqlx::Error::PoolTimedOut);
        assert!(e.is_retryable());
        assert!(e.source().is_none());
        assert_eq!(
            e.to_string(),
            "outbox store query failed: pool timed out while waiting for an open connection"
        );
        let io = StoreError::from(sqlx::Error::Io(std::io::Error::other("disk gone")));
        assert_eq!(
            io.to_string(),
            "outbox store query failed: I/O error: disk gone"
        );
        assert!(!StoreError::from(sqlx::Error::RowNotFound).is_retryable());
    }
}
