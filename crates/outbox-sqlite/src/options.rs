//! Store configuration.

use crate::ident::Ident;
use outbox_core::PoolSettings;
use std::fmt;
use std::time::Duration;

/// Default events table: `outbox_events` (dead letters in
/// `outbox_dead_letters`, migration history in `outbox_schema_migrations`).
pub const DEFAULT_TABLE: &str = "outbox_events";
/// Default busy timeout: how long a statement waits for another writer
/// (a long application transaction) before it fails with `SQLITE_BUSY`.
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Configuration of a [`crate::SqliteStore`]. `Debug` never shows the URL
/// (it may name a private path).
///
/// | builder | default |
/// |---|---|
/// | [`new(url)`](Self::new) | required, e.g. `sqlite://outbox.db` |
/// | [`with_table`](Self::with_table) | `outbox_events` |
/// | [`with_busy_timeout`](Self::with_busy_timeout) | 10 s |
/// | [`with_max_connections`](Self::with_max_connections) | 8 |
/// | [`with_acquire_timeout`](Self::with_acquire_timeout) | 30 s |
/// | [`with_auto_migrate`](Self::with_auto_migrate) | `false` |
/// | [`with_limits`](Self::with_limits) | [`EventLimits::default()`](outbox_core::EventLimits::default) |
///
/// `SqliteStore::connect` also accepts a URL (`&str` or `String`), which
/// means these defaults.
#[derive(Clone)]
pub struct SqliteStoreOptions {
    pub(crate) url: String,
    pub(crate) table: Ident,
    pub(crate) busy_timeout: Duration,
    /// Pool size, acquire timeout, auto-migrate and limits (the builders
    /// every store shares, [`outbox_core::pool_builders!`]).
    pub(crate) pool: PoolSettings,
}

impl SqliteStoreOptions {
    /// Options for the database at `url`: `sqlite://outbox.db` (relative to
    /// the working directory), `sqlite:///var/lib/app/app.db`, or
    /// `sqlite::memory:`. The file is created when missing; its directory
    /// must exist.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            table: Ident::from_static(DEFAULT_TABLE),
            busy_timeout: DEFAULT_BUSY_TIMEOUT,
            pool: PoolSettings::new(8, 1),
        }
    }

    /// The events table; dead letters live in `<table>_dead` and the
    /// migration history in `<table>_migrations` (except for the default
    /// table, see [`DEFAULT_TABLE`]), so `table` may be at most 51 bytes long.
    pub fn with_table(mut self, table: Ident) -> Self {
        self.table = table;
        self
    }

    /// How long a statement waits for the write lock held by another
    /// connection before it fails with a retryable `SQLITE_BUSY` error.
    /// Default 10 s.
    pub fn with_busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// The events table.
    pub fn table(&self) -> &Ident {
        &self.table
    }

    /// The busy timeout.
    pub fn busy_timeout(&self) -> Duration {
        self.busy_timeout
    }
}

// No `connect_timeout`: opening a SQLite file does not wait for a server.
outbox_core::pool_builders!(SqliteStoreOptions, pool: max_connections, acquire_timeout, auto_migrate, limits);

impl fmt::Debug for SqliteStoreOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStoreOptions")
            .field("table", &self.table)
            .field("busy_timeout", &self.busy_timeout)
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl From<&str> for SqliteStoreOptions {
    fn from(url: &str) -> Self {
        Self::new(url)
    }
}

impl From<String> for SqliteStoreOptions {
    fn from(url: String) -> Self {
        Self::new(url)
    }
}

impl From<&String> for SqliteStoreOptions {
    fn from(url: &String) -> Self {
        Self::new(url.as_str())
    }
}
