//! Configuration of the queue table's store ([`PgStoreOptions`]).

use crate::ident::{Ident, InvalidIdentifier};
use crate::options::{redact_url, DEFAULT_NOTIFY, DEFAULT_SCHEMA, DEFAULT_TABLE};
use outbox_core::PoolSettings;
use std::fmt;
use std::time::Duration;

/// A suggested value for [`PgStoreOptions::with_vacuum_every`] (rows removed
/// from the events table between two opportunistic `VACUUM`s). Off by default.
pub const DEFAULT_VACUUM_EVERY: u64 = 50_000;

/// Configuration of a [`PgStore`](super::PgStore). `Debug` never shows the password.
///
/// | builder | env var (`from_env`) | default |
/// |---|---|---|
/// | [`new(url)`](Self::new) | `DATABASE_URL` | required |
/// | [`with_schema`](Self::with_schema) | `OUTBOX_PG_SCHEMA` | `outbox` |
/// | [`with_table`](Self::with_table) | `OUTBOX_PG_TABLE` | `events` |
/// | [`with_notify`](Self::with_notify) | `OUTBOX_PG_NOTIFY` (`true`/`false`) | `false` |
/// | [`with_listen`](Self::with_listen) | - | `true` |
/// | [`with_retention`](Self::with_retention) | - | none: delete when delivered |
/// | [`with_max_connections`](Self::with_max_connections) | - | 10 |
/// | [`with_acquire_timeout`](Self::with_acquire_timeout) | - | 30 s |
/// | [`with_connect_timeout`](Self::with_connect_timeout) | - | 10 s |
/// | [`with_auto_migrate`](Self::with_auto_migrate) | - | `false` |
/// | [`with_vacuum_every`](Self::with_vacuum_every) | - | `None` (autovacuum only) |
/// | [`with_limits`](Self::with_limits) | - | [`EventLimits::default()`](outbox_core::EventLimits::default) |
#[derive(Clone)]
pub struct PgStoreOptions {
    pub(crate) url: Option<String>,
    pub(crate) schema: Ident,
    pub(crate) table: Ident,
    pub(crate) notify: bool,
    pub(crate) listen: bool,
    pub(crate) retention: Option<Duration>,
    pub(crate) purge_batch: u32,
    pub(crate) purge_interval: Duration,
    /// Pool size, timeouts, auto-migrate and limits (the builders every
    /// store shares, [`outbox_core::pool_builders!`]).
    pub(crate) pool: PoolSettings,
    pub(crate) vacuum_every: Option<u64>,
}

impl Default for PgStoreOptions {
    fn default() -> Self {
        Self {
            url: None,
            schema: Ident::from_static(DEFAULT_SCHEMA),
            table: Ident::from_static(DEFAULT_TABLE),
            notify: DEFAULT_NOTIFY,
            listen: true,
            retention: None,
            purge_batch: 1000,
            purge_interval: Duration::from_secs(60),
            // At least 2: one connection is held by the listener.
            pool: PoolSettings::new(10, 2),
            vacuum_every: None,
        }
    }
}

impl PgStoreOptions {
    /// Options for the database at `url` (`postgres://user:password@host:port/db`).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: Some(url.into()),
            ..Self::default()
        }
    }

    /// Options from the environment (see the table above). `None` when
    /// `DATABASE_URL` is unset.
    pub fn from_env() -> Result<Option<Self>, InvalidIdentifier> {
        let Ok(url) = std::env::var("DATABASE_URL") else {
            return Ok(None);
        };
        let mut o = Self::new(url);
        if let Ok(s) = std::env::var("OUTBOX_PG_SCHEMA") {
            o.schema = Ident::new(s)?;
        }
        if let Ok(t) = std::env::var("OUTBOX_PG_TABLE") {
            o.table = Ident::new(t)?;
        }
        if let Ok(n) = std::env::var("OUTBOX_PG_NOTIFY") {
            o.notify = !matches!(n.trim(), "0" | "false" | "no" | "off");
        }
        Ok(Some(o))
    }

    /// The schema holding the outbox tables (created by the migrations).
    pub fn with_schema(mut self, schema: Ident) -> Self {
        self.schema = schema;
        self
    }

    /// The events table; the dead letters live in `<table>_dead`, the
    /// migration history in `<table>_migrations`, so `table` may be at most
    /// 52 bytes long.
    pub fn with_table(mut self, table: Ident) -> Self {
        self.table = table;
        self
    }

    /// Whether enqueue also runs `pg_notify` so idle relays wake at once.
    /// Off: relays find new events at their next poll.
    pub fn with_notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// Whether the store LISTENs (one pooled connection) and fires
    /// [`outbox_core::Store::wakeup`]. Producers-only processes turn it off.
    pub fn with_listen(mut self, listen: bool) -> Self {
        self.listen = listen;
        self
    }

    /// Keep delivered rows (with `delivered_at`) for `retention`, then purge
    /// them in batches of `purge_batch` every `purge_interval`. `None`
    /// (the default) deletes rows when they are settled as delivered.
    pub fn with_retention(
        mut self,
        retention: Option<Duration>,
        purge_batch: u32,
        purge_interval: Duration,
    ) -> Self {
        self.retention = retention;
        self.purge_batch = purge_batch.max(1);
        self.purge_interval = purge_interval;
        self
    }

    /// After this many rows left the events table (delivered or
    /// dead-lettered) through this store, run `VACUUM (ANALYZE)` on it in the
    /// background, so claims do not walk the index entries of deleted rows
    /// until autovacuum gets there (a queue table churns faster than
    /// autovacuum's defaults assume). `None` (the default) leaves it to
    /// autovacuum, which the migration tunes for this table. Needs table
    /// ownership; without it the store logs once and stops trying.
    ///
    /// Measured on 2 cores with autovacuum off: a 1M-event drain went from
    /// 0.46 to 0.78 of the 10k-event drain rate with `Some(50_000)`, but 3 of
    /// 8 runs at 10k events/s saw claims stall for ~3 s while a VACUUM ran,
    /// hence off by default: turn it on for bulk backlogs, not for latency.
    pub fn with_vacuum_every(mut self, rows: Option<u64>) -> Self {
        self.vacuum_every = rows.filter(|n| *n > 0);
        self
    }

    /// The schema.
    pub fn schema(&self) -> &Ident {
        &self.schema
    }

    /// The events table.
    pub fn table(&self) -> &Ident {
        &self.table
    }
}

outbox_core::pool_builders!(PgStoreOptions, pool: max_connections, acquire_timeout, connect_timeout, auto_migrate, limits, pooler);

impl fmt::Debug for PgStoreOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStoreOptions")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("notify", &self.notify)
            .field("listen", &self.listen)
            .field("retention", &self.retention)
            .field("purge_batch", &self.purge_batch)
            .field("purge_interval", &self.purge_interval)
            .field("pool", &self.pool)
            .field("vacuum_every", &self.vacuum_every)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        // The URL rules themselves are tested in outbox-core.
        let o = PgStoreOptions::new("postgres://app:hunter2@db/prod");
        let d = format!("{o:?}");
        assert!(!d.contains("hunter2") && d.contains("app:***@db"), "{d}");
    }
}
