//! The settings every SQL store's options share (pool size, timeouts,
//! auto-migrate, enqueue limits): [`PoolSettings`], plain data with its
//! defaults in one place, and [`pool_builders!`](crate::pool_builders), which
//! gives a store's options type the matching `with_*` builders. Each store
//! keeps its own options type (`PgStoreOptions`, `PgLogOptions`,
//! `SqliteStoreOptions`) with one `PoolSettings` field; no I/O here, the
//! store crates open the pools.

use crate::event::EventLimits;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// What sits between a PostgreSQL store and the server: the answer decides
/// whether the store may keep session state (prepared statements, session
/// settings, `LISTEN`) on its connections.
///
/// A pooler in transaction mode (PgBouncer's `pool_mode = transaction`, most
/// managed poolers) hands each *transaction* to whichever server connection
/// is free, so a statement prepared in one transaction is missing, or is
/// another client's, in the next. In [`Pooler::Transaction`] the stores run
/// every statement inside a transaction, as an unnamed statement, with their
/// settings `SET LOCAL` in it, and the queue table's wake-ups use the probe
/// instead of `LISTEN`.
///
/// Parsed from `auto`, `none`, `session` or `transaction`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Pooler {
    /// Decide at connect: when the server's `port` setting differs from
    /// the port the store connected to (something forwards the
    /// connection), or the server refuses a startup setting as PgBouncer
    /// does, the store runs as [`Pooler::Transaction`] and says so in one
    /// log line; otherwise as [`Pooler::None`].
    #[default]
    Auto,
    /// Connected straight to PostgreSQL: prepared statements kept per
    /// connection, settings per session, `LISTEN`.
    None,
    /// A pooler in session mode (or a plain TCP proxy): a client
    /// connection keeps one server connection, so this runs as
    /// [`Pooler::None`] does.
    Session,
    /// A pooler in transaction mode: nothing is kept across transactions.
    Transaction,
}

impl Pooler {
    /// The names [`FromStr`] accepts.
    pub const NAMES: [&'static str; 4] = ["auto", "none", "session", "transaction"];

    /// This mode's name, as [`FromStr`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            Pooler::Auto => "auto",
            Pooler::None => "none",
            Pooler::Session => "session",
            Pooler::Transaction => "transaction",
        }
    }
}

impl fmt::Display for Pooler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A pooler mode that is not one of [`Pooler::NAMES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown pooler mode {0:?}: expected one of auto, none, session, transaction")]
pub struct UnknownPooler(pub String);

impl FromStr for Pooler {
    type Err = UnknownPooler;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Pooler::Auto),
            "none" => Ok(Pooler::None),
            "session" => Ok(Pooler::Session),
            "transaction" => Ok(Pooler::Transaction),
            _ => Err(UnknownPooler(s.to_owned())),
        }
    }
}

/// Pool and startup settings of a SQL store.
///
/// | setting | default |
/// |---|---|
/// | `max_connections` | given by the store (PostgreSQL 10, SQLite 8) |
/// | `min_connections` | given by the store (the smallest pool it works with) |
/// | `acquire_timeout` | [`DEFAULT_ACQUIRE_TIMEOUT`](Self::DEFAULT_ACQUIRE_TIMEOUT), 30 s |
/// | `connect_timeout` | [`DEFAULT_CONNECT_TIMEOUT`](Self::DEFAULT_CONNECT_TIMEOUT), 10 s |
/// | `auto_migrate` | `false` |
/// | `pooler` | [`Pooler::Auto`] (PostgreSQL only) |
/// | `limits` | [`EventLimits::default()`] |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolSettings {
    /// Pool size, never below `min_connections`.
    pub max_connections: u32,
    /// The smallest pool size the store accepts; a smaller `max_connections`
    /// is raised to it (PostgreSQL's queue store holds one connection for
    /// LISTEN, so it needs 2).
    pub min_connections: u32,
    /// How long taking a pooled connection (opening one if needed) may take
    /// before a query fails.
    pub acquire_timeout: Duration,
    /// How long a store that retries its first connection (PostgreSQL) keeps
    /// trying while the server refuses connections or is starting up.
    pub connect_timeout: Duration,
    /// Whether the store applies its migrations when it connects.
    pub auto_migrate: bool,
    /// The limits checked at enqueue.
    pub limits: EventLimits,
    /// What sits between the store and PostgreSQL (ignored by SQLite).
    pub pooler: Pooler,
}

impl PoolSettings {
    /// Default [`acquire_timeout`](Self::acquire_timeout): 30 s.
    pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);
    /// Default [`connect_timeout`](Self::connect_timeout): 10 s.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

    /// The defaults with a pool of `max_connections`, at least
    /// `min_connections` (itself at least 1).
    pub fn new(max_connections: u32, min_connections: u32) -> Self {
        let min_connections = min_connections.max(1);
        Self {
            max_connections: max_connections.max(min_connections),
            min_connections,
            acquire_timeout: Self::DEFAULT_ACQUIRE_TIMEOUT,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            auto_migrate: false,
            limits: EventLimits::default(),
            pooler: Pooler::Auto,
        }
    }

    /// `max_connections` set to `n`, raised to `min_connections`.
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(self.min_connections);
        self
    }
}

/// Adds the `with_*` builders of [`PoolSettings`] to a store's options type
/// `$ty` whose field `$field` is a `PoolSettings`, one per setting named:
/// `max_connections`, `acquire_timeout`, `connect_timeout`, `auto_migrate`,
/// `limits`, `pooler` (a store names only the settings it uses). The builders have the
/// same names and signatures in every store, so code written against one
/// store's options reads the same against another's.
///
/// ```
/// use outbox_core::PoolSettings;
/// use std::time::Duration;
///
/// /// Options of a store.
/// #[derive(Debug)]
/// pub struct MyOptions {
///     pool: PoolSettings,
/// }
/// outbox_core::pool_builders!(MyOptions, pool: max_connections, acquire_timeout, auto_migrate);
///
/// let o = MyOptions { pool: PoolSettings::new(8, 2) }
///     .with_max_connections(1)
///     .with_acquire_timeout(Duration::from_secs(5))
///     .with_auto_migrate(true);
/// assert_eq!(o.pool.max_connections, 2);
/// assert!(o.pool.auto_migrate);
/// ```
#[macro_export]
macro_rules! pool_builders {
    ($ty:ty, $field:ident: $($setting:ident),+ $(,)?) => {
        impl $ty {
            $( $crate::pool_builders!(@builder $field $setting); )+
        }
    };
    (@builder $field:ident max_connections) => {
        /// Pool size, raised to the store's smallest working pool (PostgreSQL
        /// queue store: 2, one connection is held by the listener; otherwise 1).
        pub fn with_max_connections(mut self, n: u32) -> Self {
            self.$field = self.$field.with_max_connections(n);
            self
        }
    };
    (@builder $field:ident acquire_timeout) => {
        /// How long taking a pooled connection (opening one if needed) may
        /// take before a query fails. Default 30 s.
        pub fn with_acquire_timeout(mut self, timeout: ::std::time::Duration) -> Self {
            self.$field.acquire_timeout = timeout;
            self
        }
    };
    (@builder $field:ident connect_timeout) => {
        /// How long the store's `connect` keeps trying while the server
        /// refuses connections or is starting up, before it fails with the
        /// last attempt's cause ("Connection refused", ...). Errors that
        /// waiting cannot fix (authentication, a missing database, TLS) fail
        /// at once. Default 10 s.
        pub fn with_connect_timeout(mut self, timeout: ::std::time::Duration) -> Self {
            self.$field.connect_timeout = timeout;
            self
        }
    };
    (@builder $field:ident auto_migrate) => {
        /// Applies the migrations when the store connects.
        pub fn with_auto_migrate(mut self, yes: bool) -> Self {
            self.$field.auto_migrate = yes;
            self
        }
    };
    (@builder $field:ident pooler) => {
        /// What sits between the store and PostgreSQL (default
        /// [`Pooler::Auto`]($crate::Pooler::Auto)): with a pooler in
        /// transaction mode, nothing is kept across transactions.
        pub fn with_pooler(mut self, pooler: $crate::Pooler) -> Self {
            self.$field.pooler = pooler;
            self
        }
    };
    (@builder $field:ident limits) => {
        /// Limits checked at enqueue (by the store's enqueue handle).
        pub fn with_limits(mut self, limits: $crate::EventLimits) -> Self {
            self.$field.limits = limits;
            self
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_size_never_below_the_minimum() {
        let p = PoolSettings::new(10, 2);
        assert_eq!((p.max_connections, p.min_connections), (10, 2));
        assert_eq!(p.with_max_connections(1).max_connections, 2);
        assert_eq!(p.with_max_connections(0).max_connections, 2);
        assert_eq!(PoolSettings::new(0, 0).max_connections, 1);
        assert_eq!(p.acquire_timeout, Duration::from_secs(30));
        assert_eq!(p.connect_timeout, Duration::from_secs(10));
        assert!(!p.auto_migrate);
        assert_eq!(p.limits, EventLimits::default());
        assert_eq!(p.pooler, Pooler::Auto);
    }

    #[test]
    fn pooler_modes_parse_and_print_their_names() {
        for name in Pooler::NAMES {
            let mode: Pooler = name.parse().unwrap();
            assert_eq!(mode.to_string(), name);
        }
        assert_eq!(" Transaction ".parse(), Ok(Pooler::Transaction));
        let err = "statement".parse::<Pooler>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown pooler mode \"statement\": expected one of auto, none, session, transaction"
        );
    }
}
