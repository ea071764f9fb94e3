//! Runtime selection of the store and the sink, for the `outbox-relay` binary.
//!
//! The [`Store`] and [`Sink`] traits return `impl Future` and are generic at
//! the hot path, so they are not object safe. A binary that picks its backend
//! from a URL at run time uses these enums instead: one variant per backend,
//! each behind the backend's cargo feature. Adding a backend means adding a
//! variant and one arm per method; nothing else changes.

// Built without any store feature, `AnyStore` has no variants and its
// methods are empty matches.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres")),
    allow(unused_variables, unreachable_code)
)]

use outbox_worker::{HandlerRegistry, JsonLinesSink};
use outbox_core::{
    Claim, ClaimRequest, DeadLetter, DeadLetterQuery, DeadLetterStore, Event, EventId, Failure,
    FenceReport, FencingToken, Outcome, Sink, Stats, Store,
};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// Any compiled-in store, chosen at run time by [`AnyStore::connect`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyStore {
    /// SQLite (`sqlite://PATH`), feature `sqlite`.
    #[cfg(feature = "sqlite")]
    Sqlite(outbox_sqlite::SqliteStore),
    /// PostgreSQL (`postgres://...`), feature `postgres`.
    #[cfg(feature = "postgres")]
    Postgres(outbox_postgres::PgStore),
}

/// Calls `$body` with `$s` bound to the inner store, whatever the variant.
macro_rules! each_store {
    ($self:expr, $s:ident => $body:expr) => {
        match *$self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref $s) => $body,
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(ref $s) => $body,
        }
    };
}

/// Backend settings that do not belong in a URL. Each is also a flag, an
/// environment variable and a config-file key of `outbox-relay run`.
#[derive(Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BackendSettings {
    /// PostgreSQL schema of the outbox tables (default `outbox`).
    pub pg_schema: Option<String>,
    /// PostgreSQL events table (default `events`).
    pub pg_table: Option<String>,
    /// Whether `pg_notify` is sent by enqueue through this store (default off).
    pub pg_notify: Option<bool>,
    /// NATS subject prefix: topic `orders` goes to `PREFIX.orders`.
    pub nats_subject_prefix: Option<String>,
    /// AMQP exchange for topics without an explicit `exchange/key` route
    /// (default: the default exchange `""`, routing key = topic).
    pub amqp_exchange: Option<String>,
    /// Kafka topic prefix.
    pub kafka_topic_prefix: Option<String>,
    /// librdkafka properties passed through (SASL/SSL, compression, linger...).
    pub kafka_properties: BTreeMap<String, String>,
}

impl fmt::Debug for BackendSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Property values may be secrets (sasl.password): names only.
        f.debug_struct("BackendSettings")
            .field("pg_schema", &self.pg_schema)
            .field("pg_table", &self.pg_table)
            .field("pg_notify", &self.pg_notify)
            .field("nats_subject_prefix", &self.nats_subject_prefix)
            .field("amqp_exchange", &self.amqp_exchange)
            .field("kafka_topic_prefix", &self.kafka_topic_prefix)
            .field(
                "kafka_properties",
                &self.kafka_properties.keys().collect::<Vec<_>>(),
            )
            .finish()
    }
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
    /// A backend setting is invalid (e.g. a schema name).
    #[error("invalid store setting: {0}")]
    InvalidSetting(String),
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

pub use outbox_core::redact_url;

impl AnyStore {
    /// Opens the store named by `url`: `sqlite://PATH` (created if missing)
    /// or `postgres://user@host/db`. Does not migrate: call [`AnyStore::migrate`].
    pub async fn connect(url: &str) -> Result<Self, ConnectError> {
        Self::connect_with(url, &BackendSettings::default()).await
    }

    /// [`AnyStore::connect`] with backend settings (Postgres schema, table...).
    pub async fn connect_with(url: &str, settings: &BackendSettings) -> Result<Self, ConnectError> {
        let Some((scheme, _)) = url.split_once(':') else {
            return Err(ConnectError::NoScheme(redact_url(url)));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "sqlite" => Self::connect_sqlite(url).await,
            "postgres" | "postgresql" => Self::connect_postgres(url, settings).await,
            other => Err(ConnectError::UnknownScheme(other.to_owned())),
        }
    }

    #[cfg(feature = "postgres")]
    async fn connect_postgres(url: &str, settings: &BackendSettings) -> Result<Self, ConnectError> {
        use outbox_postgres::{Ident, PgStoreOptions};
        let ident =
            |name: &str| Ident::new(name).map_err(|e| ConnectError::InvalidSetting(e.to_string()));
        let mut options = PgStoreOptions::new(url);
        if let Some(schema) = &settings.pg_schema {
            options = options.with_schema(ident(schema)?);
        }
        if let Some(table) = &settings.pg_table {
            options = options.with_table(ident(table)?);
        }
        if let Some(notify) = settings.pg_notify {
            options = options.with_notify(notify);
        }
        outbox_postgres::PgStore::connect(options)
            .await
            .map(AnyStore::Postgres)
            .map_err(|e| ConnectError::Open {
                url: redact_url(url),
                source: AnyStoreError::new(e),
            })
    }

    #[cfg(not(feature = "postgres"))]
    async fn connect_postgres(_url: &str, _: &BackendSettings) -> Result<Self, ConnectError> {
        Err(ConnectError::NotCompiled("postgres"))
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
        each_store!(self, s => s.migrate().await.map(drop).map_err(AnyStoreError::new))
    }

    /// The backend's name (`sqlite`, ...).
    pub fn backend(&self) -> &'static str {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(_) => "sqlite",
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(_) => "postgres",
        }
    }
}

impl Store for AnyStore {
    type Error = AnyStoreError;

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, AnyStoreError> {
        each_store!(self, s => s.claim(req).await.map_err(AnyStoreError::new))
    }

    async fn complete(
        &self,
        token: FencingToken,
        ids: &[EventId],
    ) -> Result<FenceReport, AnyStoreError> {
        each_store!(self, s => s.complete(token, ids).await.map_err(AnyStoreError::new))
    }

    async fn fail(
        &self,
        token: FencingToken,
        failures: &[Failure],
    ) -> Result<FenceReport, AnyStoreError> {
        each_store!(self, s => s.fail(token, failures).await.map_err(AnyStoreError::new))
    }

    async fn release(
        &self,
        token: FencingToken,
        ids: &[EventId],
    ) -> Result<FenceReport, AnyStoreError> {
        each_store!(self, s => s.release(token, ids).await.map_err(AnyStoreError::new))
    }

    async fn stats(&self) -> Result<Stats, AnyStoreError> {
        each_store!(self, s => s.stats().await.map_err(AnyStoreError::new))
    }

    fn wakeup(&self) -> Option<Arc<tokio::sync::Notify>> {
        each_store!(self, s => s.wakeup())
    }
}

impl DeadLetterStore for AnyStore {
    type Error = AnyStoreError;

    async fn list_dead(&self, query: &DeadLetterQuery) -> Result<Vec<DeadLetter>, AnyStoreError> {
        each_store!(self, s => s.list_dead(query).await.map_err(AnyStoreError::new))
    }

    async fn retry_dead(&self, ids: Option<&[EventId]>) -> Result<u64, AnyStoreError> {
        each_store!(self, s => s.retry_dead(ids).await.map_err(AnyStoreError::new))
    }

    async fn purge_dead(&self, ids: Option<&[EventId]>) -> Result<u64, AnyStoreError> {
        each_store!(self, s => s.purge_dead(ids).await.map_err(AnyStoreError::new))
    }
}

/// Any sink, chosen at run time: in-process handlers, JSON lines, or a
/// broker publisher behind its feature.
#[derive(Debug)]
#[non_exhaustive]
pub enum AnySink {
    /// In-process handlers.
    Handlers(HandlerRegistry),
    /// JSON lines to stdout or a file.
    JsonLines(JsonLinesSink),
    /// NATS JetStream (`nats://`, `tls://`), feature `nats`.
    #[cfg(feature = "nats")]
    Nats(outbox_nats::NatsPublisher),
    /// RabbitMQ / AMQP 0.9.1 (`amqp://`, `amqps://`), feature `amqp`.
    #[cfg(feature = "amqp")]
    Amqp(outbox_amqp::AmqpPublisher),
    /// Kafka (`kafka://host:port[,host:port]`), feature `kafka`.
    #[cfg(feature = "kafka")]
    Kafka(outbox_kafka::KafkaPublisher),
}

/// Why a sink spec could not be opened. Messages never contain a password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkSpecError {
    /// The spec names no known sink.
    #[error("unknown sink {0:?}: use stdout, jsonl:PATH, nats://HOST:PORT, amqp://USER:PASS@HOST:PORT/VHOST or kafka://HOST:PORT")]
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
    /// The broker exists but this build does not include it.
    #[error("sink `{0}` is not compiled into this build: rebuild with `--features {0}`")]
    NotCompiled(&'static str),
    /// The broker publisher could not be created or connected.
    #[error("could not open sink {sink}: {source}")]
    Connect {
        /// The sink spec, redacted.
        sink: String,
        /// The publisher's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

impl AnySink {
    /// Opens a local sink from its text form: `stdout` (JSON lines on standard
    /// output) or `jsonl:PATH` (JSON lines appended to a file). Broker sinks
    /// need [`AnySink::connect`].
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

    /// Opens any sink: the local ones of [`AnySink::open`], or a broker
    /// publisher (`nats://`, `tls://`, `amqp://`, `amqps://`, `kafka://`)
    /// configured with `settings`.
    pub async fn connect(spec: &str, settings: &BackendSettings) -> Result<Self, SinkSpecError> {
        let spec = spec.trim();
        let scheme = spec.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
        match scheme.as_deref() {
            Some("nats" | "tls") => Self::connect_nats(spec, settings).await,
            Some("amqp" | "amqps") => Self::connect_amqp(spec, settings).await,
            Some("kafka") => Self::connect_kafka(spec, settings),
            _ => Self::open(spec),
        }
    }

    #[cfg(feature = "nats")]
    async fn connect_nats(spec: &str, settings: &BackendSettings) -> Result<Self, SinkSpecError> {
        let connect = async {
            let mut config = outbox_nats::NatsConfig::from_url(spec)?;
            if let Some(prefix) = &settings.nats_subject_prefix {
                config = config.with_subject_prefix(prefix.clone());
            }
            outbox_nats::NatsPublisher::connect(config).await
        };
        connect
            .await
            .map(AnySink::Nats)
            .map_err(|e| connect_error(spec, e))
    }

    #[cfg(not(feature = "nats"))]
    async fn connect_nats(_: &str, _: &BackendSettings) -> Result<Self, SinkSpecError> {
        Err(SinkSpecError::NotCompiled("nats"))
    }

    #[cfg(feature = "amqp")]
    async fn connect_amqp(spec: &str, settings: &BackendSettings) -> Result<Self, SinkSpecError> {
        let connect = async {
            let mut config = outbox_amqp::AmqpConfig::from_url(spec)?;
            if let Some(exchange) = &settings.amqp_exchange {
                config = config.with_exchange(exchange.clone());
            }
            outbox_amqp::AmqpPublisher::connect(config).await
        };
        connect
            .await
            .map(AnySink::Amqp)
            .map_err(|e| connect_error(spec, e))
    }

    #[cfg(not(feature = "amqp"))]
    async fn connect_amqp(_: &str, _: &BackendSettings) -> Result<Self, SinkSpecError> {
        Err(SinkSpecError::NotCompiled("amqp"))
    }

    #[cfg(feature = "kafka")]
    fn connect_kafka(spec: &str, settings: &BackendSettings) -> Result<Self, SinkSpecError> {
        let mut config =
            outbox_kafka::KafkaConfig::from_url(spec).map_err(|e| connect_error(spec, e))?;
        if let Some(prefix) = &settings.kafka_topic_prefix {
            config = config.with_topic_prefix(prefix.clone());
        }
        for (name, value) in &settings.kafka_properties {
            config = config.with_property(name.clone(), value.clone());
        }
        outbox_kafka::KafkaPublisher::new(config)
            .map(AnySink::Kafka)
            .map_err(|e| connect_error(spec, e))
    }

    #[cfg(not(feature = "kafka"))]
    fn connect_kafka(_: &str, _: &BackendSettings) -> Result<Self, SinkSpecError> {
        Err(SinkSpecError::NotCompiled("kafka"))
    }
}

#[cfg(any(feature = "nats", feature = "amqp", feature = "kafka"))]
fn connect_error(spec: &str, e: impl std::error::Error + Send + Sync + 'static) -> SinkSpecError {
    SinkSpecError::Connect {
        sink: redact_url(spec),
        source: Box::new(e),
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
            #[cfg(feature = "nats")]
            AnySink::Nats(p) => p.deliver(events).await,
            #[cfg(feature = "amqp")]
            AnySink::Amqp(p) => p.deliver(events).await,
            #[cfg(feature = "kafka")]
            AnySink::Kafka(p) => p.deliver(events).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
