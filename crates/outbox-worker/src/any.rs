//! Runtime selection of the store and the sink, for the `outbox-relay` binary.
//!
//! The [`Store`] and [`Sink`] traits return `impl Future` and are generic at
//! the hot path, so they are not object safe. A binary that picks its backend
//! from a URL at run time uses these enums instead: one variant per backend,
//! each behind the backend's cargo feature. Adding a backend means adding a
//! variant and one arm per method; nothing else changes.

// Built without any store feature, `AnyStore` has no variants and its
// methods are empty matches.
#![cfg_attr(not(feature = "sqlite"), allow(unused_variables, unreachable_code))]

use crate::{HandlerRegistry, JsonLinesSink};
use outbox_core::{
    Claim, ClaimRequest, DeadLetter, DeadLetterQuery, DeadLetterStore, Event, EventId, Failure,
    FenceReport, FencingToken, Outcome, Sink, Stats, Store,
};
use std::fmt;
use std::sync::Arc;

/// Any compiled-in store, chosen at run time by [`AnyStore::connect`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyStore {
    /// SQLite (`sqlite://PATH`), feature `sqlite`.
    #[cfg(feature = "sqlite")]
    Sqlite(outbox_sqlite::SqliteStore),
}

/// The error of any store, boxed. Its message never contains a connection URL.
#[derive(Debug)]
pub struct AnyStoreError(Box<dyn std::error::Error + Send + Sync + 'static>);

impl AnyStoreError {
    /// Boxes a backend's error.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Box::new(e))
    }

    /// The backend's error.
    pub fn into_inner(self) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self.0
    }
}

impl fmt::Display for AnyStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for AnyStoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Why [`AnyStore::connect`] failed. URLs in messages are redacted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL has no `scheme:` prefix.
    #[error("store URL {0:?} has no scheme: use e.g. sqlite://outbox.db")]
    NoScheme(String),
    /// No backend handles this scheme.
    #[error("unknown store URL scheme {0:?}: use e.g. sqlite://outbox.db")]
    UnknownScheme(String),
    /// The backend exists but this build does not include it.
    #[error("store backend `{0}` is not compiled into this build: rebuild with `--features {0}`")]
    NotCompiled(&'static str),
    /// The backend could not open the store.
    #[error("could not open store {url}: {source}")]
    Open {
        /// The URL, redacted.
        url: String,
        /// The backend's error.
        #[source]
        source: AnyStoreError,
    },
}

/// `url` with any password (`user:password@`) replaced by `***`, fit for logs.
///
/// ```
/// assert_eq!(
///     outbox_worker::any::redact_url("postgres://app:s3cret@db:5432/app"),
///     "postgres://app:***@db:5432/app"
/// );
/// assert_eq!(outbox_worker::any::redact_url("sqlite://outbox.db"), "sqlite://outbox.db");
/// ```
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    let user = match userinfo.split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".to_owned(),
    };
    format!("{scheme}://{user}{}", &rest[at..])
}

impl AnyStore {
    /// Opens the store named by `url`: `sqlite://PATH` (created if missing).
    /// Does not migrate: call [`AnyStore::migrate`].
    pub async fn connect(url: &str) -> Result<Self, ConnectError> {
        let Some((scheme, _)) = url.split_once(':') else {
            return Err(ConnectError::NoScheme(redact_url(url)));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "sqlite" => Self::connect_sqlite(url).await,
            "postgres" | "postgresql" => Err(ConnectError::NotCompiled("postgres")),
            other => Err(ConnectError::UnknownScheme(other.to_owned())),
        }
    }

    #[cfg(feature = "sqlite")]
    async fn connect_sqlite(url: &str) -> Result<Self, ConnectError> {
        outbox_sqlite::SqliteStore::connect(url)
            .await
            .map(AnyStore::Sqlite)
            .map_err(|e| ConnectError::Open {
                url: redact_url(url),
                source: AnyStoreError::new(e),
            })
    }

    #[cfg(not(feature = "sqlite"))]
    async fn connect_sqlite(_url: &str) -> Result<Self, ConnectError> {
        Err(ConnectError::NotCompiled("sqlite"))
    }

    /// Creates or upgrades the outbox tables (idempotent).
    pub async fn migrate(&self) -> Result<(), AnyStoreError> {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref s) => s.migrate().await.map(drop).map_err(AnyStoreError::new),
        }
    }

    /// The backend's name (`sqlite`, ...).
    pub fn backend(&self) -> &'static str {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(_) => "sqlite",
        }
    }
}

impl Store for AnyStore {
    type Error = AnyStoreError;

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, AnyStoreError> {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref s) => s.claim(req).await.map_err(AnyStoreError::new),
        }
    }

    async fn complete(
        &self,
        token: FencingToken,
        ids: &[EventId],
    ) -> Result<FenceReport, AnyStoreError> {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref s) => s.complete(token, ids).await.map_err(AnyStoreError::new),
        }
    }

    async fn fail(
        &self,
        token: FencingToken,
        failures: &[Failure],
    ) -> Result<FenceReport, AnyStoreError> {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref s) => s.fail(token, failures).await.map_err(AnyStoreError::new),
        }
    }

    async fn release(
        &self,
        token: FencingToken,
        ids: &[EventId],
    ) -> Result<FenceReport, AnyStoreError> {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref s) => s.release(token, ids).await.map_err(AnyStoreError::new),
        }
    }

    async fn stats(&self) -> Result<Stats, AnyStoreError> {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref s) => s.stats().await.map_err(AnyStoreError::new),
        }
    }

    fn wakeup(&self) -> Option<Arc<tokio::sync::Notify>> {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref s) => s.wakeup(),
        }
    }
}

impl DeadLetterStore for AnyStore {
    type Error = AnyStoreError;

    async fn list_dead(&self, query: &DeadLetterQuery) -> Result<Vec<DeadLetter>, AnyStoreError> {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref s) => s.list_dead(query).await.map_err(AnyStoreError::new),
        }
    }

    async fn retry_dead(&self, ids: Option<&[EventId]>) -> Result<u64, AnyStoreError> {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref s) => s.retry_dead(ids).await.map_err(AnyStoreError::new),
        }
    }

    async fn purge_dead(&self, ids: Option<&[EventId]>) -> Result<u64, AnyStoreError> {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref s) => s.purge_dead(ids).await.map_err(AnyStoreError::new),
        }
    }
}

/// Any sink, chosen at run time: in-process handlers or JSON lines (brokers
/// are added behind their features).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnySink {
    /// In-process handlers.
    Handlers(HandlerRegistry),
    /// JSON lines to stdout or a file.
    JsonLines(JsonLinesSink),
}

/// Why a sink spec could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkSpecError {
    /// The spec names no known sink.
    #[error("unknown sink {0:?}: use `stdout` or `jsonl:PATH`")]
    Unknown(String),
    /// `jsonl:` without a path.
    #[error("sink `jsonl:` needs a file path, e.g. jsonl:events.jsonl")]
    MissingPath,
    /// The output file could not be opened.
    #[error("could not open sink file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl AnySink {
    /// Opens a sink from its text form: `stdout` (JSON lines on standard
    /// output) or `jsonl:PATH` (JSON lines appended to a file).
    pub fn open(spec: &str) -> Result<Self, SinkSpecError> {
        let spec = spec.trim();
        if spec == "stdout" || spec == "jsonl:-" {
            return Ok(AnySink::JsonLines(JsonLinesSink::stdout()));
        }
        if let Some(path) = spec.strip_prefix("jsonl:") {
            if path.is_empty() {
                return Err(SinkSpecError::MissingPath);
            }
            return JsonLinesSink::file(path)
                .map(AnySink::JsonLines)
                .map_err(|source| SinkSpecError::Io {
                    path: path.to_owned(),
                    source,
                });
        }
        Err(SinkSpecError::Unknown(redact_url(spec)))
    }
}

impl From<HandlerRegistry> for AnySink {
    fn from(h: HandlerRegistry) -> Self {
        AnySink::Handlers(h)
    }
}

impl From<JsonLinesSink> for AnySink {
    fn from(s: JsonLinesSink) -> Self {
        AnySink::JsonLines(s)
    }
}

impl Sink for AnySink {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        match self {
            AnySink::Handlers(h) => h.deliver(events).await,
            AnySink::JsonLines(j) => j.deliver(events).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_only() {
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("postgres://token@db/x?sslmode=require"),
            "postgres://***@db/x?sslmode=require"
        );
        assert_eq!(redact_url("sqlite:///tmp/a@b.db"), "sqlite:///tmp/a@b.db");
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
    }

    #[test]
    fn sink_specs() {
        assert!(matches!(AnySink::open("stdout"), Ok(AnySink::JsonLines(_))));
        assert!(matches!(
            AnySink::open("jsonl:"),
            Err(SinkSpecError::MissingPath)
        ));
        assert!(matches!(
            AnySink::open("kafka://x"),
            Err(SinkSpecError::Unknown(_))
        ));
    }

    #[tokio::test]
    async fn connect_errors_name_the_fix() {
        let e = AnyStore::connect("outbox.db").await.unwrap_err();
        assert!(e.to_string().contains("sqlite://"), "{e}");
        let e = AnyStore::connect("mysql://u:pw@h/db").await.unwrap_err();
        assert!(matches!(e, ConnectError::UnknownScheme(_)), "{e}");
        assert!(!e.to_string().contains("pw"));
    }
}
