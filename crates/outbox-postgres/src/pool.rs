//! The connection pool of both PostgreSQL stores and their background
//! tasks.

use crate::db::Db;
use crate::error::StoreError;
use crate::hosts::{Failover, PgHosts};
use crate::options::scrub;
use outbox_core::{PoolSettings, Pooler};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// A store's background tasks (LISTEN, retention purge, log rotation):
/// aborted when the store's last clone drops them.
#[derive(Default)]
pub(crate) struct BackgroundTasks(Vec<JoinHandle<()>>);

impl BackgroundTasks {
    /// Runs `task` on the Tokio runtime until the store is dropped.
    pub(crate) fn spawn(&mut self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.0.push(tokio::spawn(task));
    }
}

impl Drop for BackgroundTasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// `host:port/database` (or the socket path), never the credentials.
fn server_name(o: &PgConnectOptions) -> String {
    let place = match o.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", o.get_host(), o.get_port()),
    };
    match o.get_database() {
        Some(db) => format!("{place}/{db}"),
        None => place,
    }
}

/// The pool of both PostgreSQL stores: `url` parsed (errors without the
/// password), `jit = off` (JIT compilation costs tens of milliseconds per
/// claim and buys nothing for these small, index-driven statements), a
/// first connection tried until `connect_timeout` ([`first_connection`]),
/// then a lazy pool of `max_connections` (both from `settings`). `session`:
/// more settings of the pool's sessions.
///
/// The settings go in the startup packet ([`Pooler::None`], and
/// [`Pooler::Auto`] unless the server refuses them), are `SET` once per new
/// connection ([`Pooler::Session`]: PgBouncer in session mode refuses the
/// startup setting too), or, with a pooler in transaction mode
/// ([`Pooler::Transaction`], or `auto` and the server refused the startup
/// setting as PgBouncer does, or [`crate::db::detect`] found a forwarder),
/// are set by each transaction ([`Db`]).
///
/// A URL with several hosts, or with `target_session_attrs` ([`PgHosts`]),
/// is a connection setting like the pooler's: the first host that fits
/// (probed in the URL's order, again until `connect_timeout` while none
/// does) is connected to as above, and the store follows the hosts from
/// then on ([`Failover`]).
pub(crate) async fn connect_pool(
    url: Option<&str>,
    settings: &PoolSettings,
    session: &[(&str, &str)],
) -> Result<Db, StoreError> {
    let url =
        url.ok_or_else(|| StoreError::InvalidUrl("no URL given (set DATABASE_URL)".to_owned()))?;
    let hosts = PgHosts::for_store(url)?;
    let (bare, current): (PgConnectOptions, usize) = match &hosts {
        Some(hosts) => first_fitting_host(hosts, settings.connect_timeout).await?,
        None => (
            url.parse()
                .map_err(|e: sqlx::Error| StoreError::InvalidUrl(scrub(&e.to_string(), url)))?,
            0,
        ),
    };
    let mut settings_all = vec![("jit", "off")];
    settings_all.extend_from_slice(session);
    let mut pooled = settings.pooler == Pooler::Transaction;
    let session_mode = settings.pooler == Pooler::Session;
    let mut connect = bare.clone();
    let mut startup_settings = false;
    if !pooled && !session_mode {
        let with_settings = bare.clone().options(settings_all.iter().copied());
        match first_connection(&with_settings, settings.connect_timeout, url).await {
            Ok(()) => {
                connect = with_settings;
                startup_settings = true;
            }
            Err(e) if settings.pooler == Pooler::Auto && refused_startup_setting(&e) => {
                tracing::warn!(
                    server = %server_name(&bare),
                    "the server refused the startup setting `options`, as PgBouncer does: the store \
                     keeps nothing across transactions (pooler mode `transaction`); set the pooler \
                     to `transaction` (outbox-relay: --pg-pooler transaction) to say so"
                );
                pooled = true;
            }
            Err(e) => return Err(e),
        }
    }
    if pooled || session_mode {
        first_connection(&connect, settings.connect_timeout, url).await?;
    }
    let mut pool = PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout);
    if session_mode {
        let set: Arc<str> = settings_all
            .iter()
            .map(|(name, value)| format!("SET {name} = '{value}'"))
            .collect::<Vec<_>>()
            .join("; ")
            .into();
        pool = pool.after_connect(move |conn, _| {
            let set = Arc::clone(&set);
            Box::pin(async move {
                // The simple protocol: nothing is prepared.
                sqlx::Executor::execute(conn, &*set).await.map(|_| ())
            })
        });
    }
    let pool = pool.connect_lazy_with(connect);
    if !pooled {
        pooled = crate::db::detect(&pool, settings.pooler).await?;
    }
    let db = Db::new(pool, pooled, &settings_all);
    Ok(match hosts {
        None => db,
        Some(hosts) => {
            // Every host gets what the chosen one got.
            let startup: Vec<(String, String)> = settings_all
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            let hosts = hosts.map_options(|o| {
                if startup_settings {
                    o.options(startup.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                } else {
                    o
                }
            });
            db.with_failover(Failover::new(hosts, current))
        }
    })
}

/// The first host of `hosts` that fits its `target_session_attrs`, probed
/// again (20 ms, doubling to 1 s) until `timeout` while none does; then the
/// last probe's error, naming every host and its answer.
pub(crate) async fn first_fitting_host(
    hosts: &PgHosts,
    timeout: Duration,
) -> Result<(PgConnectOptions, usize), StoreError> {
    let started = Instant::now();
    let deadline = started + timeout;
    let mut backoff = Duration::from_millis(20);
    loop {
        let per_host = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(100), Duration::from_secs(2));
        let error = match hosts.find(per_host).await {
            Ok((i, options)) => {
                if i > 0 {
                    tracing::info!(
                        host = hosts.hosts().nth(i).unwrap_or_default(),
                        hosts = %hosts,
                        "PostgreSQL: host {} of {hosts} is the first {} one",
                        i + 1,
                        hosts.target_session_attrs()
                    );
                }
                return Ok((options, i));
            }
            Err(e) => e,
        };
        if Instant::now() + backoff >= deadline {
            return Err(match error {
                StoreError::Connect { server, error, .. } => StoreError::Connect {
                    server,
                    error,
                    waited: started.elapsed(),
                },
                StoreError::Database(e) => StoreError::Connect {
                    server: hosts.to_string(),
                    error: Some(e),
                    waited: started.elapsed(),
                },
                other => other,
            });
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Whether `e` is a pooler's refusal of the startup packet's `options`
/// (PgBouncer: "unsupported startup parameter: options", SQLSTATE 08P01).
fn refused_startup_setting(e: &StoreError) -> bool {
    match e {
        StoreError::Connect {
            error: Some(sqlx::Error::Database(db)),
            ..
        } => db.code().is_some_and(|c| c == "08P01") && db.message().contains("startup parameter"),
        _ => false,
    }
}

/// Opens (and closes) one connection, trying again while the server
/// refuses connections or is starting up, until `timeout`. Returns the last
/// attempt's error: the pool would only say it timed out.
async fn first_connection(
    options: &PgConnectOptions,
    timeout: Duration,
    url: &str,
) -> Result<(), StoreError> {
    let started = Instant::now();
    let deadline = started + timeout;
    let mut backoff = Duration::from_millis(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let error = match tokio::time::timeout(left, options.connect()).await {
            Ok(Ok(conn)) => {
                // Only the answer mattered; a failing close changes nothing.
                let _ = conn.close().await;
                return Ok(());
            }
            Ok(Err(e)) => Some(e),
            Err(_) => None,
        };
        let starting = match &error {
            Some(sqlx::Error::Io(e)) => e.kind() == std::io::ErrorKind::ConnectionRefused,
            Some(sqlx::Error::Database(db)) => db.code().is_some_and(|c| c == "57P03"),
            _ => false,
        };
        if !starting || Instant::now() + backoff >= deadline {
            let error = error.map(|e| redacted(e, url));
            return Err(StoreError::Connect {
                server: server_name(options),
                error,
                waited: started.elapsed(),
            });
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// The driver's error with any echo of the URL's password removed (the
/// error types that carry free text are rebuilt as `Configuration`).
fn redacted(e: sqlx::Error, url: &str) -> sqlx::Error {
    let text = e.to_string();
    let clean = scrub(&text, url);
    if clean == text {
        e
    } else {
        sqlx::Error::Configuration(clean.into())
    }
}
