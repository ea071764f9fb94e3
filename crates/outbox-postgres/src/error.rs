//! Error types, one per operation family.
//!
//! Every error here prints its whole cause in `Display`, once, and returns
//! `None` from [`std::error::Error::source`]: sqlx's own errors repeat their
//! cause in both (an I/O error's text is in its `Display` and is its
//! `source()`), so a runner that prints the chain would show it twice or
//! three times. The driver's error stays reachable through the variants
//! (e.g. [`StoreError::Database`]) and [`StoreError::sqlx_error`].

use crate::group_name::InvalidGroupName;
use crate::ident::InvalidIdentifier;
use outbox_core::{EventId, Retryable, ValidationError};
use std::fmt;
use std::time::Duration;

mod refusal;

pub use refusal::{Identity, Refusal};

/// Why an enqueue failed. Nothing was written when this is returned, but the
/// caller's transaction may be aborted (on [`EnqueueError::Database`]): roll it back.
#[derive(Debug)]
#[non_exhaustive]
pub enum EnqueueError {
    /// The event broke the configured [`outbox_core::EventLimits`] or naming rules.
    Invalid {
        /// The refused event's id.
        id: EventId,
        /// What was wrong with it (printed by `Display`; not returned by `source()`).
        source: ValidationError,
    },
    /// The INSERT failed (e.g. a duplicate id, a missing table: run the migrations).
    Database(sqlx::Error),
    /// `commit_with`: the connection failed after the COMMIT was sent and
    /// before its answer. The transaction may or may not have committed:
    /// look the events up by id, never assume either outcome.
    CommitUnknown {
        /// The events of the transaction, in order.
        ids: Vec<EventId>,
        /// The connection's error (printed by `Display`; not returned by `source()`).
        source: sqlx::Error,
    },
    /// `commit_with` was given a savepoint (a transaction begun inside
    /// another, at this depth): its COMMIT would end the outer transaction.
    /// Nothing was sent.
    NotTopLevel {
        /// The transaction's depth (1 is a top-level transaction).
        depth: usize,
    },
}

impl fmt::Display for EnqueueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EnqueueError::Invalid { id, source } => write!(f, "event {id} refused: {source}"),
            EnqueueError::Database(e) => write!(f, "enqueue failed: {}", Cause(e)),
            EnqueueError::CommitUnknown { ids, source } => write!(
                f,
                "the outcome of the COMMIT is unknown (the connection failed after it was sent: \
                 {}): the {} event(s) from {} may or may not be committed; look them up by id",
                Cause(source),
                ids.len(),
                ids.first()
                    .map_or_else(|| "none".to_owned(), ToString::to_string),
            ),
            EnqueueError::NotTopLevel { depth } => write!(
                f,
                "commit_with needs a top-level transaction, got a savepoint at depth {depth}: \
                 its COMMIT would end the outer transaction (use enqueue and commit the \
                 savepoint)"
            ),
        }
    }
}

impl std::error::Error for EnqueueError {}

/// Why applying the migrations failed. The migration transaction was rolled back.
#[derive(Debug)]
#[non_exhaustive]
pub enum MigrateError {
    /// Talking to the database failed.
    Database(sqlx::Error),
    /// One migration's SQL failed.
    Failed {
        /// Its version.
        version: i32,
        /// Its name.
        name: &'static str,
        /// The database error (printed by `Display`; not returned by `source()`).
        source: sqlx::Error,
    },
    /// The history records a version this library does not know: the schema
    /// was migrated by a newer version of `outbox-postgres`.
    UnknownVersion {
        /// The unknown version.
        version: i32,
    },
    /// An applied migration's text differs from the embedded one.
    ChecksumMismatch {
        /// Its version.
        version: i32,
        /// Its name.
        name: &'static str,
    },
    /// The outbox exists in the other mode: queue-mode migrations refuse an
    /// outbox that was upgraded to the event log (its name is a view), and
    /// the event log refuses a relation of the outbox's name that is not a
    /// queue-mode outbox.
    ModeConflict {
        /// `schema.table`.
        outbox: String,
        /// What was found and what to do.
        detail: &'static str,
    },
    /// Upgrading a queue-mode outbox to the event log failed (nothing was
    /// changed: the upgrade is one transaction).
    Upgrade {
        /// `schema.table`.
        outbox: String,
        /// The database error (printed by `Display`; not returned by `source()`).
        source: sqlx::Error,
    },
}

impl fmt::Display for MigrateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MigrateError::Database(e) => write!(f, "outbox migration failed: {}", Cause(e)),
            MigrateError::Failed {
                version,
                name,
                source,
            } => write!(
                f,
                "outbox migration {version} ({name}) failed: {}",
                Cause(source)
            ),
            MigrateError::UnknownVersion { version } => write!(
                f,
                "the outbox schema has migration {version}, unknown to this version of \
                 outbox-postgres (was it migrated by a newer one?)"
            ),
            MigrateError::ChecksumMismatch { version, name } => write!(
                f,
                "outbox migration {version} ({name}) was applied from different SQL than this \
                 library embeds"
            ),
            MigrateError::ModeConflict { outbox, detail } => {
                write!(f, "outbox {outbox}: {detail}")
            }
            MigrateError::Upgrade { outbox, source } => write!(
                f,
                "upgrading the queue-mode outbox {outbox} to the event log failed (nothing was \
                 changed): {}",
                Cause(source)
            ),
        }
    }
}

impl std::error::Error for MigrateError {}

/// Why a store operation (connect, claim, settle, renew, stats, dead letters) failed.
///
/// [`Retryable::is_retryable`] tells a lost connection, a pool timeout, a
/// server shutting down, a serialization failure, a deadlock or a
/// read-only server (a standby not yet promoted: try again) from a missing
/// table, bad credentials or a constraint (do not).
/// [`StoreError::is_read_only`] tells the read-only case apart.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// A schema or table name was refused.
    InvalidName(InvalidIdentifier),
    /// A consumer group name was refused (event-log mode).
    InvalidGroup(InvalidGroupName),
    /// The connection URL could not be parsed (the message never contains the password).
    InvalidUrl(String),
    /// No connection could be opened when the store connected. A refused
    /// connection (the server starting) is tried again until the connect
    /// timeout; this is the last attempt's error.
    Connect {
        /// `host:port/database`, without credentials.
        server: String,
        /// The last attempt's error, or `None` when the attempt itself did
        /// not finish within the connect timeout.
        error: Option<sqlx::Error>,
        /// How long connecting was tried.
        waited: Duration,
    },
    /// A duration does not fit PostgreSQL's interval arithmetic (over ~292,000 years).
    DurationTooLarge(Duration),
    /// A stored row could not be read back.
    Corrupt {
        /// The row's id.
        id: EventId,
        /// What was wrong.
        detail: String,
    },
    /// Applying the migrations failed.
    Migrate(MigrateError),
    /// A query failed.
    Database(sqlx::Error),
    /// A consumer group other than [`outbox_core::DEFAULT_GROUP`] was named
    /// to a queue-mode store, which has only that one.
    UnknownGroup(String),
    /// The event log refuses to claim (or to open): its positions belong
    /// to another database, its schema version is not this library's, its
    /// order sequence is cached, or the group was dropped under a running
    /// relay. The message names the way out.
    Refused(Refusal),
}

impl From<InvalidIdentifier> for StoreError {
    fn from(e: InvalidIdentifier) -> Self {
        StoreError::InvalidName(e)
    }
}

impl From<InvalidGroupName> for StoreError {
    fn from(e: InvalidGroupName) -> Self {
        StoreError::InvalidGroup(e)
    }
}

impl From<MigrateError> for StoreError {
    fn from(e: MigrateError) -> Self {
        StoreError::Migrate(e)
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::Database(e)
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::InvalidName(e) => write!(f, "invalid outbox schema or table name: {e}"),
            StoreError::InvalidGroup(e) => fmt::Display::fmt(e, f),
            StoreError::InvalidUrl(e) => write!(f, "invalid PostgreSQL connection URL: {e}"),
            StoreError::Connect {
                server,
                error,
                waited,
            } => {
                write!(f, "cannot connect to PostgreSQL at {server}: ")?;
                match error {
                    Some(e) => write!(f, "{}", Cause(e))?,
                    None => write!(f, "no answer")?,
                }
                if *waited >= Duration::from_millis(100) {
                    write!(f, " (gave up after {:.1}s)", waited.as_secs_f64())?;
                }
                Ok(())
            }
            StoreError::DurationTooLarge(d) => write!(f, "duration {d:?} is too large"),
            StoreError::Corrupt { id, detail } => write!(f, "outbox row {id} is corrupt: {detail}"),
            StoreError::Migrate(e) => fmt::Display::fmt(e, f),
            StoreError::Database(e) => write!(f, "outbox store query failed: {}", Cause(e)),
            StoreError::UnknownGroup(g) => write!(
                f,
                "no consumer group {g:?}: a queue-mode outbox has one group, {:?} (consumer groups need mode `log`)",
                outbox_core::DEFAULT_GROUP
            ),
            StoreError::Refused(r) => fmt::Display::fmt(r, f),
        }
    }
}

impl std::error::Error for StoreError {}

impl StoreError {
    /// Whether trying again later may succeed (see [`Retryable`]).
    pub fn is_retryable(&self) -> bool {
        Retryable::is_retryable(self)
    }

    /// Whether the server refused a write as read-only (SQLSTATE 25006: a
    /// standby not yet promoted, or `default_transaction_read_only`), or no
    /// host of a multi-host URL is the one `target_session_attrs` asks for
    /// ([`crate::PgHosts`]): the store waits for a primary. Retryable, as
    /// an unreachable database is.
    pub fn is_read_only(&self) -> bool {
        match self.sqlx_error() {
            Some(sqlx::Error::Database(db)) => db.code().is_some_and(|c| c == READ_ONLY_SQLSTATE),
            _ => false,
        }
    }

    /// The driver's error behind this one, if any.
    pub fn sqlx_error(&self) -> Option<&sqlx::Error> {
        match self {
            StoreError::Database(e)
            | StoreError::Migrate(MigrateError::Database(e))
            | StoreError::Migrate(MigrateError::Failed { source: e, .. })
            | StoreError::Connect { error: Some(e), .. } => Some(e),
            _ => None,
        }
    }
}

impl Retryable for StoreError {
    fn is_retryable(&self) -> bool {
        match self {
            StoreError::Connect { error: None, .. } => true,
            StoreError::Connect { error: Some(e), .. }
            | StoreError::Database(e)
            | StoreError::Migrate(MigrateError::Database(e)) => is_transient(e),
            _ => false,
        }
    }
}

/// `read_only_sql_transaction`: a write refused by a read-only session
/// ([`StoreError::is_read_only`]); [`crate::PgHosts`] raises it too when no
/// host is a primary.
pub(crate) const READ_ONLY_SQLSTATE: &str = "25006";

/// Connection trouble, pool timeouts, a server shutting down or starting,
/// serialization failures, deadlocks, lock and statement timeouts, a
/// read-only server (a standby) and insufficient resources are transient; everything else (a missing table,
/// bad credentials, a constraint, a syntax error, TLS configuration) is not.
pub(crate) fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| is_transient_sqlstate(&c)),
        _ => false,
    }
}

/// What a pooler in transaction mode does to a client that keeps session
/// state: a prepared statement that exists on the server connection it was
/// handed (42P05) or is missing there (26000), or PgBouncer refusing the
/// startup packet's `options` (08P01).
fn pooler_symptom(code: &str, message: &str) -> bool {
    match code {
        "42P05" | "26000" => message.contains("prepared statement"),
        "08P01" => message.contains("unsupported startup parameter"),
        _ => false,
    }
}

fn is_transient_sqlstate(code: &str) -> bool {
    matches!(
        code,
        // serialization_failure, deadlock_detected
        "40001" | "40P01"
        // admin_shutdown, crash_shutdown, cannot_connect_now
        | "57P01" | "57P02" | "57P03"
        // query_canceled (statement_timeout, pg_cancel_backend), lock_not_available
        | "57014" | "55P03"
        // read_only_sql_transaction: a standby not yet promoted (waiting
        // for a primary is waiting for the database)
        | "25006"
    ) || code.starts_with("08") // connection_exception
        || code.starts_with("53") // insufficient_resources
}

/// A sqlx error described once: the root cause's text, without sqlx's
/// prefix when the prefix only repeats the category.
pub(crate) struct Cause<'a>(pub(crate) &'a sqlx::Error);

impl fmt::Display for Cause<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            sqlx::Error::Io(e) => fmt::Display::fmt(e, f),
            sqlx::Error::Tls(e) => write!(f, "TLS: {e}"),
            sqlx::Error::Database(db) => {
                f.write_str(db.message())?;
                if let Some(code) = db.code() {
                    write!(f, " (SQLSTATE {code})")?;
                    if code == "42P01" {
                        f.write_str("; are the outbox migrations applied?")?;
                    }
                    if code == READ_ONLY_SQLSTATE && !db.message().contains("waiting for a primary")
                    {
                        f.write_str(
                            "; the server is read-only (a standby not yet promoted, or \
                             default_transaction_read_only): waiting for a primary",
                        )?;
                    }
                    if pooler_symptom(&code, db.message()) {
                        f.write_str(
                            "; a pooler in transaction mode (PgBouncer pool_mode = transaction) \
                             is in between: set the pooler to `transaction` (outbox-relay: \
                             --pg-pooler transaction)",
                        )?;
                    }
                }
                Ok(())
            }
            sqlx::Error::PoolTimedOut => f.write_str(
                "no pooled connection within the acquire timeout (pool exhausted, or the \
                 database unreachable)",
            ),
            sqlx::Error::PoolClosed => f.write_str("the connection pool was closed"),
            sqlx::Error::Configuration(e) => write!(f, "invalid configuration: {e}"),
            sqlx::Error::Protocol(e) => write!(f, "protocol error: {e}"),
            other => fmt::Display::fmt(other, f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_print_their_cause_once_and_are_retryable() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        let e = StoreError::Connect {
            server: "127.0.0.1:5999/test".into(),
            error: Some(sqlx::Error::Io(io)),
            waited: Duration::from_secs(1),
        };
        let shown = e.to_string();
        assert_eq!(
            shown.to_lowercase().matches("connection refused").count(),
            1
        );
        assert!(shown.contains("127.0.0.1:5999/test"), "{shown}");
        assert!(std::error::Error::source(&e).is_none());
        assert!(e.is_retryable());
        assert!(StoreError::Database(sqlx::Error::PoolTimedOut).is_retryable());
        assert!(!StoreError::InvalidUrl("x".into()).is_retryable());
    }

    #[test]
    fn sqlstates_are_classified() {
        for code in [
            "40001", "40P01", "57P01", "57P02", "57P03", "08006", "53300", "55P03", "25006",
        ] {
            assert!(is_transient_sqlstate(code), "{code}");
        }
        // undefined_table, invalid_password, unique_violation, syntax_error
        for code in ["42P01", "28P01", "23505", "42601"] {
            assert!(!is_transient_sqlstate(code), "{code}");
        }
    }

    #[test]
    fn a_poolers_symptoms_name_the_setting() {
        assert!(pooler_symptom(
            "42P05",
            "prepared statement \"sqlx_s_1\" already exists"
        ));
        assert!(pooler_symptom(
            "26000",
            "prepared statement \"sqlx_s_3\" does not exist"
        ));
        assert!(pooler_symptom(
            "08P01",
            "unsupported startup parameter: options"
        ));
        assert!(!pooler_symptom("08P01", "invalid message format"));
        assert!(!pooler_symptom("42P01", "relation does not exist"));
    }
}
