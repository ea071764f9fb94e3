//! Runtime selection of the store and the sink.
//!
//! The [`Store`] and [`Sink`] traits return `impl Future` and are generic at
//! the hot path, so they are not object safe. This binary picks its backends
//! from URLs at run time, so it uses these enums instead: one variant per
//! backend, each behind the backend's cargo feature, opened through the
//! backend's [`Backend`] descriptor. Adding a backend means adding its
//! descriptor to [`crate::backends`], a variant here and one arm per method.

// Built without any store feature, `AnyStore` has no variants and its
// methods are empty matches.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres")),
    allow(unused_variables, unreachable_code, unused_imports, dead_code)
)]

use crate::backends::{self, scheme_of};
use crate::config::{role_name, GroupScope};
use outbox_core::backend::{Backend, Descriptor, InvalidSetting, Role, Settings};
use outbox_core::cloudevents::Source as CloudEventsSource;
use outbox_core::{
    redact_url, Claim, ClaimRequest, ControlStore, DeadLetter, DeadLetterFilter, DeadLetterQuery,
    DeadLetterStore, Event, FencingToken, HeldKeyStore, HeldKeys, Outcome, PauseNote, Paused,
    RelayId, Retryable, SettleReport, Settlement, Sink, Stats, Store, WireFormat,
};
use outbox_worker::JsonLinesSink;
use std::fmt;
use std::future::Future;
use std::time::Duration;

/// Any compiled-in store, chosen at run time by [`AnyStore::connect`].
#[derive(Debug, Clone)]
pub(crate) enum AnyStore {
    /// SQLite (`sqlite://PATH`), feature `sqlite`.
    #[cfg(feature = "sqlite")]
    Sqlite(outbox_sqlite::SqliteStore),
    /// PostgreSQL queue table (`postgres://...`), feature `postgres`.
    #[cfg(feature = "postgres")]
    Postgres(outbox_postgres::PgStore),
    /// PostgreSQL event log (`postgres://...` with `--pg-mode log`), feature
    /// `postgres`.
    #[cfg(feature = "postgres")]
    PgLog(outbox_postgres::PgLogStore),
}

/// Calls `$body` with `$s` bound to the inner store, whatever the variant.
macro_rules! each_store {
    ($self:expr, $s:ident => $body:expr) => {
        match *$self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref $s) => $body,
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(ref $s) => $body,
            #[cfg(feature = "postgres")]
            AnyStore::PgLog(ref $s) => $body,
        }
    };
}

/// The error of any store, boxed, with its backend's classification.
#[derive(Debug)]
pub(crate) struct AnyStoreError {
    inner: Box<dyn std::error::Error + Send + Sync + 'static>,
    retryable: bool,
}

impl AnyStoreError {
    fn new(e: impl std::error::Error + Retryable + Send + Sync + 'static) -> Self {
        Self {
            retryable: e.is_retryable(),
            inner: Box::new(e),
        }
    }
}

impl fmt::Display for AnyStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.inner, f)
    }
}

impl std::error::Error for AnyStoreError {
    // Transparent: the backend's error is this error.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner.source()
    }
}

impl Retryable for AnyStoreError {
    fn is_retryable(&self) -> bool {
        self.retryable
    }
}

/// Why a store or sink could not be opened. Its messages never hold a
/// password; each cause is printed once (the backend's error is the
/// `source`, not repeated in the message).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnectError {
    /// The URL has no `scheme:` prefix.
    #[error("{} URL {url:?} has no scheme: use e.g. {example}", role_name(*.role))]
    NoScheme {
        role: Role,
        /// Redacted.
        url: String,
        example: String,
    },
    /// No backend of this build handles the scheme.
    #[error("unknown {} {what}: use {known}", role_name(*.role))]
    Unknown {
        role: Role,
        /// `URL scheme "x"`, or the whole (redacted, quoted) sink spec.
        what: String,
        known: String,
    },
    /// The backend exists but this build does not include it.
    #[error("{} backend `{feature}` is not compiled into this build: rebuild outbox-relay with `--features {feature}`", role_name(*.role))]
    NotCompiled { role: Role, feature: &'static str },
    /// The backend refused a setting or the URL.
    #[error("invalid {} setting", role_name(.descriptor.role()))]
    Invalid {
        descriptor: &'static Descriptor,
        #[source]
        error: InvalidSetting,
    },
    /// The backend could not connect or open.
    #[error("cannot connect to the {}", role_name(*.role))]
    Connect {
        role: Role,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A consumer group was named for a store that has none.
    #[error("{origin} names consumer group {group:?}, but consumer groups need the PostgreSQL event log (`postgres://` with `--pg-mode log`, the default); the {store} store has a single consumer")]
    NoGroups {
        origin: String,
        group: String,
        store: &'static str,
    },
    /// A local sink's file could not be opened.
    #[error("cannot open sink file {path}")]
    File {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The compiled backend of `role` for `url`, or why there is none.
fn descriptor_for(role: Role, url: &str) -> Result<&'static Descriptor, ConnectError> {
    let example = backends::compiled(role)
        .map(|d| d.example())
        .next()
        .unwrap_or("sqlite://outbox.db");
    let Some(scheme) = scheme_of(url) else {
        return Err(ConnectError::NoScheme {
            role,
            url: redact_url(url),
            example: example.to_owned(),
        });
    };
    if let Some(d) = backends::compiled(role).find(|d| d.handles(url)) {
        return Ok(d);
    }
    if let Some(k) =
        backends::missing().find(|k| k.role == role && k.schemes.contains(&scheme.as_str()))
    {
        return Err(ConnectError::NotCompiled {
            role,
            feature: k.feature,
        });
    }
    Err(ConnectError::Unknown {
        role,
        what: format!("URL scheme {scheme:?}"),
        known: known(role),
    })
}

fn known(role: Role) -> String {
    let schemes = backends::schemes(role);
    match role {
        Role::Sink if schemes.is_empty() => "stdout or jsonl:PATH".to_owned(),
        Role::Sink => format!("stdout, jsonl:PATH or a broker URL ({schemes})"),
        _ => schemes,
    }
}

/// Configures and connects backend `B`.
async fn open<B: Backend>(
    d: &'static Descriptor,
    url: &str,
    settings: &Settings,
) -> Result<B::Connected, ConnectError> {
    open_with::<B, _>(d, url, settings, B::connect).await
}

/// Configures backend `B` and connects it with `connect` (its `connect`, or
/// for a sink its `connect_lazy` with the wire format applied: an
/// unreachable broker does not fail this).
async fn open_with<B: Backend, F: Future<Output = Result<B::Connected, B::Error>>>(
    d: &'static Descriptor,
    url: &str,
    settings: &Settings,
    connect: impl FnOnce(B::Config) -> F,
) -> Result<B::Connected, ConnectError> {
    let config = B::configure(url, settings).map_err(|error| ConnectError::Invalid {
        descriptor: d,
        error,
    })?;
    connect(config).await.map_err(|e| ConnectError::Connect {
        role: d.role(),
        source: Box::new(e),
    })
}

impl AnyStore {
    /// Opens the store named by `url` with the settings `settings_for`
    /// gives its backend, reading as consumer group `scope` (the event log;
    /// the other stores refuse a group other than the default). Does not
    /// migrate: call [`AnyStore::migrate`].
    pub(crate) async fn connect(
        url: &str,
        settings_for: impl Fn(&Descriptor) -> Settings,
        scope: &GroupScope,
    ) -> Result<Self, ConnectError> {
        let d = descriptor_for(Role::Store, url)?;
        let settings = settings_for(d);
        let single = |store: &'static str| match scope.named() {
            Some(group) => Err(ConnectError::NoGroups {
                origin: scope.group_origin.clone(),
                group: group.to_owned(),
                store,
            }),
            None => Ok(()),
        };
        match d.name() {
            #[cfg(feature = "sqlite")]
            "sqlite" => {
                single("SQLite")?;
                open::<outbox_sqlite::descriptor::SqliteBackend>(d, url, &settings)
                    .await
                    .map(AnyStore::Sqlite)
            }
            #[cfg(feature = "postgres")]
            "postgres" => {
                use outbox_postgres::GroupStart;
                use outbox_postgres::{PgBackend, PgLogBackend, PgMode};
                let mode =
                    PgMode::from_settings(&settings).map_err(|error| ConnectError::Invalid {
                        descriptor: d,
                        error,
                    })?;
                match mode {
                    PgMode::Log => {
                        let start = if scope.start_now {
                            GroupStart::Now
                        } else {
                            GroupStart::Oldest
                        };
                        open_with::<PgLogBackend, _>(d, url, &settings, |options| {
                            let options = match &scope.group {
                                Some(group) => options.with_group(group.as_str()),
                                None => options,
                            };
                            PgLogBackend::connect(options.with_new_group_start(start))
                        })
                        .await
                        .map(AnyStore::PgLog)
                    }
                    // The queue table; `PgBackend` refuses a mode it does not open.
                    _ => {
                        single("PostgreSQL queue-table")?;
                        open::<PgBackend>(d, url, &settings)
                            .await
                            .map(AnyStore::Postgres)
                    }
                }
            }
            _ => Err(ConnectError::NotCompiled {
                role: Role::Store,
                feature: d.name(),
            }),
        }
    }

    /// Creates or upgrades the outbox tables (idempotent).
    pub(crate) async fn migrate(&self) -> anyhow::Result<()> {
        match *self {
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(ref s) => s.migrate().await.map(drop)?,
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(ref s) => s.migrate().await.map(drop)?,
            #[cfg(feature = "postgres")]
            AnyStore::PgLog(ref s) => {
                let mut conn = s.pool().acquire().await?;
                s.outbox().migrate(&mut conn).await.map(drop)?;
            }
        }
        Ok(())
    }
}

impl Store for AnyStore {
    type Error = AnyStoreError;

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, AnyStoreError> {
        each_store!(self, s => s.claim(req).await.map_err(AnyStoreError::new))
    }

    async fn settle(
        &self,
        token: FencingToken,
        settlement: &Settlement,
    ) -> Result<SettleReport, AnyStoreError> {
        each_store!(self, s => s.settle(token, settlement).await.map_err(AnyStoreError::new))
    }

    async fn renew(&self, token: FencingToken, lease: Duration) -> Result<u64, AnyStoreError> {
        each_store!(self, s => s.renew(token, lease).await.map_err(AnyStoreError::new))
    }

    async fn stats(&self) -> Result<Stats, AnyStoreError> {
        each_store!(self, s => s.stats().await.map_err(AnyStoreError::new))
    }

    async fn wakeup(&self) {
        each_store!(self, s => s.wakeup().await)
    }

    async fn leave(&self, relay: &RelayId) -> Result<(), AnyStoreError> {
        each_store!(self, s => s.leave(relay).await.map_err(AnyStoreError::new))
    }
}

impl AnyStore {
    /// The consumer group this store's relay claims for: the event log's
    /// configured group, [`outbox_core::DEFAULT_GROUP`] for the stores with
    /// one implicit group.
    pub(crate) fn group(&self) -> &str {
        match *self {
            #[cfg(feature = "postgres")]
            AnyStore::PgLog(ref s) => s.group(),
            _ => outbox_core::DEFAULT_GROUP,
        }
    }
}

impl ControlStore for AnyStore {
    type Error = AnyStoreError;

    async fn paused(&self, group: &str) -> Result<Option<Paused>, AnyStoreError> {
        each_store!(self, s => s.paused(group).await.map_err(AnyStoreError::new))
    }

    async fn set_paused(
        &self,
        group: &str,
        paused: bool,
        note: &PauseNote,
    ) -> Result<bool, AnyStoreError> {
        each_store!(self, s => s.set_paused(group, paused, note).await.map_err(AnyStoreError::new))
    }
}

impl DeadLetterStore for AnyStore {
    type Error = AnyStoreError;

    async fn list_dead(&self, query: &DeadLetterQuery) -> Result<Vec<DeadLetter>, AnyStoreError> {
        each_store!(self, s => s.list_dead(query).await.map_err(AnyStoreError::new))
    }

    async fn count_dead(&self, filter: &DeadLetterFilter) -> Result<u64, AnyStoreError> {
        each_store!(self, s => s.count_dead(filter).await.map_err(AnyStoreError::new))
    }

    async fn retry_dead(&self, filter: &DeadLetterFilter) -> Result<u64, AnyStoreError> {
        each_store!(self, s => s.retry_dead(filter).await.map_err(AnyStoreError::new))
    }

    async fn purge_dead(&self, filter: &DeadLetterFilter) -> Result<u64, AnyStoreError> {
        each_store!(self, s => s.purge_dead(filter).await.map_err(AnyStoreError::new))
    }
}

impl HeldKeyStore for AnyStore {
    type Error = AnyStoreError;

    async fn held_keys(&self, limit: u32) -> Result<HeldKeys, AnyStoreError> {
        each_store!(self, s => s.held_keys(limit).await.map_err(AnyStoreError::new))
    }
}

/// Any sink, chosen at run time: JSON lines, or a broker publisher behind
/// its feature (boxed: publishers are large, and built once). In-process
/// handlers need code: the demo uses a `HandlerRegistry` directly.
#[derive(Debug)]
pub(crate) enum AnySink {
    /// JSON lines to stdout or a file.
    JsonLines(JsonLinesSink),
    /// NATS JetStream (`nats://`, `tls://`), feature `nats`.
    #[cfg(feature = "nats")]
    Nats(Box<outbox_nats::NatsPublisher>),
    /// RabbitMQ / AMQP 0.9.1 (`amqp://`, `amqps://`), feature `amqp`.
    #[cfg(feature = "amqp")]
    Amqp(Box<outbox_amqp::AmqpPublisher>),
    /// Kafka (`kafka://host:port[,host:port]`), feature `kafka`.
    #[cfg(feature = "kafka")]
    Kafka(Box<outbox_kafka::KafkaPublisher>),
}

impl AnySink {
    /// Opens a sink from its text form: `stdout` (JSON lines on standard
    /// output), `jsonl:PATH` (JSON lines appended to a file), or a broker URL
    /// of a compiled sink backend, configured with `settings_for` and
    /// publishing in `wire_format` (the JSON-lines sinks have their own
    /// format: [`crate::config::run_config`] refuses any other for them), and
    /// with the CloudEvents `source` when one is configured. `lock_timeout`
    /// is the relay's lease: a sink whose client keeps messages after a
    /// dropped delivery (Kafka) fits its send timeout to it; NATS checks
    /// each stream's dedup window against twice it.
    /// A broker that is unreachable does not fail this: the publisher is
    /// opened lazily (`Backend::connect_lazy`) and the relay starts with its
    /// breaker open; a configuration, credential or TLS error does.
    #[cfg_attr(
        not(any(feature = "nats", feature = "amqp", feature = "kafka")),
        allow(unused_variables)
    )]
    pub(crate) async fn connect(
        spec: &str,
        settings_for: impl Fn(&Descriptor) -> Settings,
        wire_format: WireFormat,
        cloudevents_source: Option<&CloudEventsSource>,
        lock_timeout: Duration,
    ) -> Result<Self, ConnectError> {
        let spec = spec.trim();
        if spec == "stdout" || spec == "jsonl:-" {
            return Ok(AnySink::JsonLines(JsonLinesSink::stdout()));
        }
        if let Some(path) = spec.strip_prefix("jsonl:") {
            if path.is_empty() {
                return Err(ConnectError::Unknown {
                    role: Role::Sink,
                    what: format!("{spec:?}"),
                    known: "jsonl:PATH with a file path, e.g. jsonl:events.jsonl".to_owned(),
                });
            }
            return JsonLinesSink::file(path)
                .map(AnySink::JsonLines)
                .map_err(|source| ConnectError::File {
                    path: path.to_owned(),
                    source,
                });
        }
        let d = descriptor_for(Role::Sink, spec).map_err(|e| match e {
            ConnectError::NoScheme { .. } => ConnectError::Unknown {
                role: Role::Sink,
                what: format!("{:?}", redact_url(spec)),
                known: known(Role::Sink),
            },
            e => e,
        })?;
        let settings = settings_for(d);
        match d.name() {
            #[cfg(feature = "nats")]
            "nats" => {
                use outbox_nats::descriptor::NatsBackend as B;
                open_with::<B, _>(d, spec, &settings, |c| {
                    B::connect_lazy(with_cloudevents(
                        // A copy sent again after a lost PubAck comes at
                        // most about two lock timeouts later.
                        c.with_wire_format(wire_format)
                            .with_min_dedup_window(lock_timeout * 2),
                        cloudevents_source,
                        |c, s| c.with_cloudevents_source(s),
                    ))
                })
                .await
                .map(|p| AnySink::Nats(Box::new(p)))
            }
            #[cfg(feature = "amqp")]
            "amqp" => {
                use outbox_amqp::descriptor::AmqpBackend as B;
                open_with::<B, _>(d, spec, &settings, |c| {
                    B::connect_lazy(with_cloudevents(
                        c.with_wire_format(wire_format),
                        cloudevents_source,
                        |c, s| c.with_cloudevents_source(s),
                    ))
                })
                .await
                .map(|p| AnySink::Amqp(Box::new(p)))
            }
            #[cfg(feature = "kafka")]
            "kafka" => {
                use outbox_kafka::descriptor::KafkaBackend as B;
                open_with::<B, _>(d, spec, &settings, |c| async move {
                    B::connect_lazy(with_cloudevents(
                        c.with_wire_format(wire_format).with_lease(lock_timeout)?,
                        cloudevents_source,
                        |c, s| c.with_cloudevents_source(s),
                    ))
                    .await
                })
                .await
                .map(|p| AnySink::Kafka(Box::new(p)))
            }
            _ => Err(ConnectError::NotCompiled {
                role: Role::Sink,
                feature: d.name(),
            }),
        }
    }
}

impl Sink for AnySink {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        match self {
            AnySink::JsonLines(j) => j.deliver(events).await,
            #[cfg(feature = "nats")]
            AnySink::Nats(p) => p.deliver(events).await,
            #[cfg(feature = "amqp")]
            AnySink::Amqp(p) => p.deliver(events).await,
            #[cfg(feature = "kafka")]
            AnySink::Kafka(p) => p.deliver(events).await,
        }
    }

    fn late_send_bound(&self) -> Duration {
        match self {
            AnySink::JsonLines(j) => j.late_send_bound(),
            #[cfg(feature = "nats")]
            AnySink::Nats(p) => p.late_send_bound(),
            #[cfg(feature = "amqp")]
            AnySink::Amqp(p) => p.late_send_bound(),
            #[cfg(feature = "kafka")]
            AnySink::Kafka(p) => p.late_send_bound(),
        }
    }
}

/// `config` with the CloudEvents source set by `set`, when there is one.
#[cfg(any(feature = "nats", feature = "amqp", feature = "kafka"))]
fn with_cloudevents<C>(
    config: C,
    source: Option<&CloudEventsSource>,
    set: impl FnOnce(C, CloudEventsSource) -> C,
) -> C {
    match source {
        Some(s) => set(config, s.clone()),
        None => config,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The relay's lease for these tests.
    const LOCK: Duration = Duration::from_secs(60);

    /// librdkafka keeps a message until `message.timeout.ms`, also after
    /// the relay dropped its delivery: unset, it is a quarter of the lease
    /// (which the relay keeps back from its lease end); set longer, the
    /// sink is refused with the property and the bound named.
    #[cfg(feature = "kafka")]
    #[tokio::test]
    async fn a_kafka_send_timeout_fits_the_lease_or_is_refused() {
        let long = |_: &Descriptor| {
            Settings::new().with_entry("properties", "message.timeout.ms", "60000")
        };
        let e = AnySink::connect("kafka://127.0.0.1:9", long, WireFormat::Headers, None, LOCK)
            .await
            .unwrap_err();
        let chain: Vec<String> =
            std::iter::successors(Some(&e as &dyn std::error::Error), |e| e.source())
                .map(ToString::to_string)
                .collect();
        let chain = chain.join(": ");
        assert!(
            chain.contains("message.timeout.ms") && chain.contains("at most 15000 ms"),
            "{chain}"
        );
        let none = |_: &Descriptor| Settings::new();
        let sink = AnySink::connect(
            "kafka://127.0.0.1:9",
            none,
            WireFormat::Headers,
            None,
            Duration::from_secs(8),
        )
        .await
        .unwrap();
        assert_eq!(sink.late_send_bound(), Duration::from_secs(2));
    }

    #[tokio::test]
    async fn sink_specs() {
        let none = |_: &Descriptor| Settings::new();
        assert!(matches!(
            AnySink::connect("stdout", none, WireFormat::Headers, None, LOCK).await,
            Ok(AnySink::JsonLines(_))
        ));
        let e = AnySink::connect("jsonl:", none, WireFormat::Headers, None, LOCK)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("jsonl:PATH"), "{e}");
        let e = AnySink::connect("smtp://u:pw@h", none, WireFormat::Headers, None, LOCK)
            .await
            .unwrap_err();
        assert!(matches!(e, ConnectError::Unknown { .. }), "{e}");
        assert!(!e.to_string().contains("pw"), "{e}");
    }

    #[tokio::test]
    async fn connect_errors_name_the_fix() {
        let none = |_: &Descriptor| Settings::new();
        let all = GroupScope::default();
        let e = AnyStore::connect("outbox.db", none, &all)
            .await
            .unwrap_err();
        assert!(matches!(e, ConnectError::NoScheme { .. }), "{e}");
        let e = AnyStore::connect("mysql://u:pw@h/db", none, &all)
            .await
            .unwrap_err();
        assert!(matches!(e, ConnectError::Unknown { .. }), "{e}");
        assert!(!e.to_string().contains("pw"));
    }
}
