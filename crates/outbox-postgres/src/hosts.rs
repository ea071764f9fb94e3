//! Several hosts in one connection URL, and following a primary that moves.
//!
//! libpq (and so `psql`, Patroni's documentation, every managed service's
//! failover guide) takes `postgres://user@h1:5432,h2:5432/db?target_session_attrs=read-write`:
//! try the hosts in order and keep the first whose session fits the
//! attribute. sqlx 0.8's `PgConnectOptions` holds one host and parses
//! neither the list nor the attribute, so [`PgHosts`] does: it splits the
//! URL into one single-host URL per host (credentials, database and
//! parameters unchanged) and probes the hosts (`SELECT pg_is_in_recovery(),
//! current_setting('transaction_read_only')` on a fresh connection, as
//! libpq does).
//!
//! The stores go further ([`Failover`]): their pool is pointed at the host
//! that fits ([`sqlx::Pool::set_connect_options`]: the connections the
//! pool opens from then on go there), and when a statement fails the way a
//! lost server fails (connection refused or reset, no connection within the
//! acquire timeout, the server shutting down, a read-only transaction), or
//! an operation takes longer than a second, the hosts are probed again and
//! the pool re-pointed. While no host fits (the primary stopped, the
//! standby not yet promoted), the store's operations fail at once with a
//! read-only error ("waiting for a primary", SQLSTATE 25006, retryable: a
//! relay backs off as when the database is down) and the state is said in
//! one WARN line naming every host and what it answered; the next
//! operation after a back-off probes again.

use crate::error::{StoreError, READ_ONLY_SQLSTATE};
use crate::options::scrub;
use futures::future::BoxFuture;
use sqlx::error::{DatabaseError, ErrorKind};
use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::{ConnectOptions, Connection, Row};
use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which server of a multi-host URL a session may use: libpq's
/// `target_session_attrs`, with libpq's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TargetSessionAttrs {
    /// `any`: the first host that accepts a connection (libpq's default).
    #[default]
    Any,
    /// `read-write`: a session whose `transaction_read_only` is off (a
    /// primary, unless `default_transaction_read_only` is set).
    ReadWrite,
    /// `read-only`: a session whose `transaction_read_only` is on.
    ReadOnly,
    /// `primary`: a server not in recovery.
    Primary,
    /// `standby`: a server in recovery.
    Standby,
    /// `prefer-standby`: a standby if any host is one, else any host.
    PreferStandby,
}

impl TargetSessionAttrs {
    /// Every value, in libpq's order.
    pub const ALL: [TargetSessionAttrs; 6] = [
        TargetSessionAttrs::Any,
        TargetSessionAttrs::ReadWrite,
        TargetSessionAttrs::ReadOnly,
        TargetSessionAttrs::Primary,
        TargetSessionAttrs::Standby,
        TargetSessionAttrs::PreferStandby,
    ];

    /// libpq's name (`read-write`, ...).
    pub fn name(self) -> &'static str {
        match self {
            TargetSessionAttrs::Any => "any",
            TargetSessionAttrs::ReadWrite => "read-write",
            TargetSessionAttrs::ReadOnly => "read-only",
            TargetSessionAttrs::Primary => "primary",
            TargetSessionAttrs::Standby => "standby",
            TargetSessionAttrs::PreferStandby => "prefer-standby",
        }
    }

    /// Whether a server that answered `role` fits (`prefer-standby` is
    /// decided over all hosts: here, a standby fits).
    fn fits(self, role: Role) -> bool {
        match self {
            TargetSessionAttrs::Any => true,
            TargetSessionAttrs::ReadWrite => !role.read_only,
            TargetSessionAttrs::ReadOnly => role.read_only,
            TargetSessionAttrs::Primary => !role.in_recovery,
            TargetSessionAttrs::Standby | TargetSessionAttrs::PreferStandby => role.in_recovery,
        }
    }
}

impl fmt::Display for TargetSessionAttrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TargetSessionAttrs {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|a| a.name()).collect();
                format!(
                    "target_session_attrs={s:?} is not one of {} (libpq's names)",
                    names.join(", ")
                )
            })
    }
}

/// What a server said it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Role {
    in_recovery: bool,
    read_only: bool,
}

/// One host of a [`PgHosts`]: its `host:port` and connect options.
#[derive(Clone)]
struct Host {
    name: String,
    options: PgConnectOptions,
}

/// A PostgreSQL URL with one or several hosts (`postgres://user:pw@h1:p1,h2:p2/db?...`)
/// and its `target_session_attrs`, parsed without the driver (which takes
/// one host). `Debug` and `Display` show the hosts and the database, never
/// the credentials.
///
/// ```
/// use outbox_postgres::{PgHosts, TargetSessionAttrs};
/// let hosts = PgHosts::parse(
///     "postgres://app:s3cret@10.0.0.1:5432,10.0.0.2:5433/orders?target_session_attrs=read-write",
/// )?;
/// assert_eq!(hosts.hosts().collect::<Vec<_>>(), ["10.0.0.1:5432", "10.0.0.2:5433"]);
/// assert_eq!(hosts.target_session_attrs(), TargetSessionAttrs::ReadWrite);
/// assert!(!hosts.to_string().contains("s3cret"));
/// # Ok::<(), outbox_postgres::StoreError>(())
/// ```
#[derive(Clone)]
pub struct PgHosts {
    hosts: Vec<Host>,
    attrs: TargetSessionAttrs,
    /// Whether the URL named `target_session_attrs`.
    attrs_given: bool,
    database: Option<String>,
}

impl fmt::Debug for PgHosts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgHosts")
            .field("hosts", &self.hosts().collect::<Vec<_>>())
            .field("database", &self.database)
            .field("target_session_attrs", &self.attrs)
            .finish()
    }
}

impl fmt::Display for PgHosts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hosts().collect::<Vec<_>>().join(","))?;
        if let Some(db) = &self.database {
            write!(f, "/{db}")?;
        }
        Ok(())
    }
}

impl PgHosts {
    /// Parses `url`: `postgres://` or `postgresql://`, one host or several
    /// separated by commas in the authority (`h1:5432,h2,[::1]:5433`; a
    /// host without a port takes the driver's default), and an optional
    /// `target_session_attrs` parameter (libpq's values; `any` when absent).
    /// Every other parameter goes to each host unchanged. Errors name the
    /// problem and never hold the password.
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        let bad = |what: String| StoreError::InvalidUrl(scrub(&what, url));
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(bad(format!(
                "{:?} is not a postgres:// URL",
                crate::options::redact_url(url)
            )));
        };
        if scheme != "postgres" && scheme != "postgresql" {
            return Err(bad(format!(
                "scheme {scheme:?}: a PostgreSQL URL starts with postgres:// or postgresql://"
            )));
        }
        let (before_query, query) = match rest.split_once('?') {
            Some((b, q)) => (b, Some(q)),
            None => (rest, None),
        };
        // The userinfo ends at the last '@' before the query (a password
        // that was not percent-encoded may hold '@' or ':').
        let (userinfo, after) = match before_query.rfind('@') {
            Some(i) => (Some(&before_query[..i]), &before_query[i + 1..]),
            None => (None, before_query),
        };
        let (hostlist, path) = match after.find('/') {
            Some(i) => (&after[..i], &after[i..]),
            None => (after, ""),
        };
        let mut attrs = None;
        let mut params = Vec::new();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("target_session_attrs", value)) => {
                    if attrs.is_some() {
                        return Err(bad("target_session_attrs is given twice".to_owned()));
                    }
                    attrs = Some(value.parse::<TargetSessionAttrs>().map_err(bad)?);
                }
                Some(("host", value)) if value.contains(',') => {
                    return Err(bad(
                        "a host list in the `host` parameter is not supported: list the hosts \
                         in the URL's authority (postgres://user@h1:5432,h2:5432/db)"
                            .to_owned(),
                    ));
                }
                _ => params.push(pair),
            }
        }
        let mut hosts = Vec::new();
        for (i, host) in hostlist.split(',').enumerate() {
            if host.is_empty() && hostlist.contains(',') {
                return Err(bad(format!(
                    "host {} of the list {hostlist:?} is empty",
                    i + 1
                )));
            }
            let mut single = format!("{scheme}://");
            if let Some(u) = userinfo {
                single.push_str(u);
                single.push('@');
            }
            single.push_str(host);
            single.push_str(path);
            if !params.is_empty() {
                single.push('?');
                single.push_str(&params.join("&"));
            }
            let options: PgConnectOptions = single.parse().map_err(|e: sqlx::Error| {
                bad(format!("host {host:?}: {}", crate::error::Cause(&e)))
            })?;
            let name = match options.get_socket() {
                Some(socket) => socket.display().to_string(),
                None => format!("{}:{}", options.get_host(), options.get_port()),
            };
            hosts.push(Host { name, options });
        }
        let database = hosts
            .first()
            .and_then(|h| h.options.get_database().map(str::to_owned));
        Ok(PgHosts {
            hosts,
            attrs: attrs.unwrap_or_default(),
            attrs_given: attrs.is_some(),
            database,
        })
    }

    /// The hosts a store follows for `url`: `None` for a single host
    /// without `target_session_attrs` (the driver's own parsing, and its
    /// errors, as before), else the parsed list; a URL that names a list
    /// or the attribute and does not parse is an error.
    pub(crate) fn for_store(url: &str) -> Result<Option<Self>, StoreError> {
        let authority = url
            .split_once("://")
            .map_or("", |(_, rest)| rest.split(['?', '/']).next().unwrap_or(""));
        let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        let named = authority.contains(',') || url.contains("target_session_attrs");
        match Self::parse(url) {
            Ok(hosts) if hosts.follows() => Ok(Some(hosts)),
            Ok(_) => Ok(None),
            Err(e) if named => Err(e),
            Err(_) => Ok(None),
        }
    }

    /// The hosts as `host:port` (or a socket path), in the URL's order.
    pub fn hosts(&self) -> impl Iterator<Item = &str> + '_ {
        self.hosts.iter().map(|h| h.name.as_str())
    }

    /// The URL's `target_session_attrs` ([`TargetSessionAttrs::Any`] when absent).
    pub fn target_session_attrs(&self) -> TargetSessionAttrs {
        self.attrs
    }

    /// The connect options of host `i` (in the URL's order).
    pub fn options(&self, i: usize) -> Option<&PgConnectOptions> {
        self.hosts.get(i).map(|h| &h.options)
    }

    /// Whether the stores follow the hosts (several hosts, or a
    /// `target_session_attrs` to check): a single host without it is
    /// connected to as the driver does.
    pub(crate) fn follows(&self) -> bool {
        self.hosts.len() > 1 || self.attrs_given
    }

    /// Each host's options passed through `f` (the stores' session settings).
    pub(crate) fn map_options(mut self, f: impl Fn(PgConnectOptions) -> PgConnectOptions) -> Self {
        for h in &mut self.hosts {
            h.options = f(h.options.clone());
        }
        self
    }

    /// Probes the hosts in order, as libpq does, and returns the index and
    /// options of the first whose session fits [`Self::target_session_attrs`]
    /// (`prefer-standby`: the first standby, else the first host that
    /// answered). Each host gets `per_host` to answer. When none fits, the
    /// error is a read-only error ([`StoreError::is_read_only`]) when some
    /// host answered, else the last connection error; both name every host
    /// and what it answered.
    pub async fn find(&self, per_host: Duration) -> Result<(usize, PgConnectOptions), StoreError> {
        match self.probe(per_host).await {
            Probed::Found(i) => Ok((i, self.hosts[i].options.clone())),
            Probed::None { answers, .. } => Err(self.none_error(&answers)),
        }
    }

    fn probe(&self, per_host: Duration) -> BoxFuture<'_, Probed> {
        Box::pin(self.probe_inner(per_host))
    }

    async fn probe_inner(&self, per_host: Duration) -> Probed {
        let mut answers = Vec::with_capacity(self.hosts.len());
        let mut first_answer = None;
        for (i, host) in self.hosts.iter().enumerate() {
            let answer = probe_host(&host.options, per_host).await;
            if let Answer::Role(role) = &answer {
                if self.attrs.fits(*role) {
                    return Probed::Found(i);
                }
                first_answer.get_or_insert(i);
            }
            answers.push(answer);
        }
        if self.attrs == TargetSessionAttrs::PreferStandby {
            if let Some(i) = first_answer {
                return Probed::Found(i);
            }
        }
        Probed::None {
            answers,
            reachable: first_answer,
        }
    }

    /// What each host answered, for a log line or an error.
    fn describe(&self, answers: &[Answer]) -> String {
        self.hosts
            .iter()
            .zip(answers)
            .map(|(h, a)| format!("{}: {a}", h.name))
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn none_error(&self, answers: &[Answer]) -> StoreError {
        let listed = self.describe(answers);
        let all_down = answers.iter().all(|a| matches!(a, Answer::Failed(_)));
        if all_down {
            StoreError::Connect {
                server: self.to_string(),
                error: Some(sqlx::Error::Configuration(
                    format!("no host answered ({listed})").into(),
                )),
                waited: Duration::ZERO,
            }
        } else {
            StoreError::Database(read_only_error(self, self.attrs, &listed))
        }
    }
}

/// The outcome of probing every host.
enum Probed {
    Found(usize),
    None {
        answers: Vec<Answer>,
        /// The first host that answered (a standby, say).
        reachable: Option<usize>,
    },
}

/// What one host answered.
enum Answer {
    /// Its role.
    Role(Role),
    /// No session: the error, without the password.
    Failed(String),
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answer::Role(r) if r.in_recovery => f.write_str("a standby (in recovery)"),
            Answer::Role(r) if r.read_only => {
                f.write_str("a primary with read-only transactions (default_transaction_read_only)")
            }
            Answer::Role(_) => f.write_str("a primary (read-write)"),
            Answer::Failed(e) => f.write_str(e),
        }
    }
}

/// Connects to one host and asks what it is (also for `any`: the answer
/// names a standby in the log line and the error).
fn probe_host(options: &PgConnectOptions, within: Duration) -> BoxFuture<'_, Answer> {
    // Boxed as `Send` here, where the lifetimes are concrete: the store's
    // futures that await it stay `Send` for every caller.
    Box::pin(probe_host_inner(options, within))
}

async fn probe_host_inner(options: &PgConnectOptions, within: Duration) -> Answer {
    match tokio::time::timeout(within, ask_role(options)).await {
        Ok(Ok(role)) => Answer::Role(role),
        Ok(Err(e)) => Answer::Failed(crate::error::Cause(&e).to_string()),
        Err(_) => Answer::Failed(format!("no answer within {within:?}")),
    }
}

/// Opens a connection and reads the server's role. The simple protocol:
/// nothing is prepared (a pooler in transaction mode may be in between).
async fn ask_role(options: &PgConnectOptions) -> Result<Role, sqlx::Error> {
    let mut conn = options.connect().await?;
    let role = read_role(&mut conn).await?;
    // Only the answer mattered; a failing close changes nothing.
    let _ = conn.close().await;
    Ok(role)
}

/// The role of the server `conn` is on (a connection or a pool).
async fn read_role<'c, E: sqlx::Executor<'c, Database = sqlx::Postgres>>(
    conn: E,
) -> Result<Role, sqlx::Error> {
    let row = conn
        .fetch_one("SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'")
        .await?;
    Ok(Role {
        in_recovery: row.try_get(0)?,
        read_only: row.try_get(1)?,
    })
}

/// The read-only error the stores return while no host fits: SQLSTATE
/// 25006 (`read_only_sql_transaction`), as the server's own refusal of a
/// write on a standby, so both are classified alike (retryable).
fn read_only_error(hosts: &PgHosts, attrs: TargetSessionAttrs, listed: &str) -> sqlx::Error {
    sqlx::Error::Database(Box::new(ReadOnly {
        message: format!(
            "read-only: no host of {hosts} is {attrs} ({listed}); waiting for a primary"
        ),
    }))
}

/// A read-only refusal made by the store (see [`read_only_error`]).
#[derive(Debug)]
pub(crate) struct ReadOnly {
    message: String,
}

impl fmt::Display for ReadOnly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ReadOnly {}

impl DatabaseError for ReadOnly {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(READ_ONLY_SQLSTATE))
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> ErrorKind {
        ErrorKind::Other
    }
}

/// How long one host gets to answer a probe after the store connected.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// An operation slower than this has the hosts probed beside it (its
/// connection may be waiting on a host that is gone: the pool retries a
/// refused connection until its acquire timeout).
pub(crate) const SLOW_OPERATION: Duration = Duration::from_secs(1);
/// The least time between two probes.
const PROBE_EVERY: Duration = Duration::from_millis(250);

/// A store's view of its hosts: which one the pool points at, whether none
/// fits (waiting), and whether the last failures look like a lost server.
/// Shared by every clone of the store's [`crate::db::Db`].
pub(crate) struct Failover {
    hosts: PgHosts,
    current: AtomicUsize,
    /// No host fits: operations fail at once with the read-only error.
    waiting: AtomicBool,
    /// A failure looked like a lost server: probe before the next operation.
    suspect: AtomicBool,
    state: tokio::sync::Mutex<ProbeState>,
    /// When the pool was last pointed at another host: a connection opened
    /// before then is still on the old one.
    repointed_at: std::sync::Mutex<Option<Instant>>,
}

struct ProbeState {
    last: Option<Instant>,
    /// The read-only error of the last probe that found no host.
    waiting_error: Option<String>,
}

impl fmt::Debug for Failover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Failover")
            .field("hosts", &self.hosts)
            .field("current", &self.current.load(Ordering::Relaxed))
            .field("waiting", &self.waiting.load(Ordering::Relaxed))
            .finish()
    }
}

impl Failover {
    /// `hosts`, the pool pointing at host `current`.
    pub(crate) fn new(hosts: PgHosts, current: usize) -> Arc<Self> {
        Arc::new(Failover {
            hosts,
            current: AtomicUsize::new(current),
            waiting: AtomicBool::new(false),
            suspect: AtomicBool::new(false),
            state: tokio::sync::Mutex::new(ProbeState {
                last: None,
                waiting_error: None,
            }),
            repointed_at: std::sync::Mutex::new(None),
        })
    }

    /// Whether a connection `age` old was opened before the pool was last
    /// pointed at another host (so it may be on a server that no longer
    /// fits).
    pub(crate) fn opened_before_repoint(&self, age: Duration) -> bool {
        let at = *self
            .repointed_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        at.is_some_and(|t| age > t.elapsed())
    }

    /// Points `pool` at host `i` and notes when.
    fn point(&self, pool: &PgPool, i: usize) {
        pool.set_connect_options(self.hosts.hosts[i].options.clone());
        self.current.store(i, Ordering::Relaxed);
        *self
            .repointed_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
    }

    /// Notes `e`: a failure the way a lost or demoted server fails makes
    /// the next operation probe the hosts first. Returns whether it did.
    pub(crate) fn observe(&self, e: &sqlx::Error) -> bool {
        let lost = match e {
            sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => true,
            sqlx::Error::Database(db) => db.code().is_some_and(|c| {
                c == READ_ONLY_SQLSTATE
                    || c.starts_with("08")
                    || matches!(&*c, "57P01" | "57P02" | "57P03")
            }),
            _ => false,
        };
        if lost {
            self.suspect.store(true, Ordering::Relaxed);
        }
        lost
    }

    /// Before an operation: while waiting for a fitting host, or after a
    /// failure that looked like a lost server, probe the hosts (at most
    /// every [`PROBE_EVERY`]); while still waiting, the read-only error.
    pub(crate) async fn before(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        if !self.waiting.load(Ordering::Relaxed) && !self.suspect.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.probe(pool).await;
        match self.waiting_error().await {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    async fn waiting_error(&self) -> Option<sqlx::Error> {
        if !self.waiting.load(Ordering::Relaxed) {
            return None;
        }
        let state = self.state.lock().await;
        let message = state.waiting_error.clone().unwrap_or_else(|| {
            format!(
                "read-only: no host of {} is {}; waiting for a primary",
                self.hosts, self.hosts.attrs
            )
        });
        Some(sqlx::Error::Database(Box::new(ReadOnly { message })))
    }

    /// A followed pool's periodic check (`PgHosts::connect_pool`): asks the
    /// server the pool is on for its role, within `within`; when it does
    /// not answer, or no longer fits, or no host fitted at the last probe,
    /// probes the hosts (re-pointing the pool). `prefer-standby` probes
    /// only when the server does not answer (a primary fits it when no
    /// standby is up, and a probe would only say so again).
    pub(crate) async fn check(&self, pool: &PgPool, within: Duration) {
        let answer = tokio::time::timeout(within, read_role(pool)).await;
        let fits = match answer {
            Ok(Ok(role)) => {
                self.hosts.attrs == TargetSessionAttrs::PreferStandby || self.hosts.attrs.fits(role)
            }
            Ok(Err(_)) | Err(_) => false,
        };
        if !fits || self.waiting.load(Ordering::Relaxed) {
            self.probe(pool).await;
        }
    }

    /// Probes the hosts in the background (an operation is slow: it may be
    /// waiting on a host that is gone).
    pub(crate) fn probe_beside(self: &Arc<Self>, pool: &PgPool) {
        let (me, pool) = (Arc::clone(self), pool.clone());
        tokio::spawn(async move { me.probe(&pool).await });
    }

    /// Probes every host unless another probe ran within [`PROBE_EVERY`]
    /// (then its outcome stands), points the pool at the host that fits
    /// and says so once; when none fits, enters the waiting state (one
    /// WARN line naming each host and its answer) and points the pool at
    /// a host that answered, so that a connection the pool is opening
    /// meanwhile fails fast with the server's read-only error.
    fn probe<'a>(&'a self, pool: &'a PgPool) -> BoxFuture<'a, ()> {
        Box::pin(self.probe_inner(pool))
    }

    async fn probe_inner(&self, pool: &PgPool) {
        let mut state = self.state.lock().await;
        if state.last.is_some_and(|t| t.elapsed() < PROBE_EVERY) {
            return;
        }
        self.suspect.store(false, Ordering::Relaxed);
        let probed = self.hosts.probe(PROBE_TIMEOUT).await;
        state.last = Some(Instant::now());
        let before = self.current.load(Ordering::Relaxed);
        match probed {
            Probed::Found(i) => {
                if i != before {
                    self.point(pool, i);
                }
                if self.waiting.swap(false, Ordering::Relaxed) || i != before {
                    tracing::warn!(
                        host = %self.hosts.hosts[i].name,
                        hosts = %self.hosts,
                        target_session_attrs = %self.hosts.attrs,
                        "PostgreSQL: the store now connects to {} (the first {} host of {})",
                        self.hosts.hosts[i].name,
                        self.hosts.attrs,
                        self.hosts,
                    );
                }
                state.waiting_error = None;
            }
            Probed::None { answers, reachable } => {
                let listed = self.hosts.describe(&answers);
                if let Some(i) = reachable.filter(|i| *i != before) {
                    self.point(pool, i);
                }
                if !self.waiting.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        hosts = %self.hosts,
                        target_session_attrs = %self.hosts.attrs,
                        "PostgreSQL: no host is {} ({listed}): the store waits for a primary \
                         (its operations fail as read-only, retryable, until one answers)",
                        self.hosts.attrs,
                    );
                }
                if let sqlx::Error::Database(db) =
                    read_only_error(&self.hosts, self.hosts.attrs, &listed)
                {
                    state.waiting_error = Some(db.message().to_owned());
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn several_hosts_and_the_attribute_are_parsed() {
        let h = PgHosts::parse(
            "postgresql://app:pw@db1:5433,db2,[::1]:6000/orders?sslmode=disable&target_session_attrs=read-write&application_name=x",
        )
        .unwrap();
        assert_eq!(
            h.hosts().collect::<Vec<_>>(),
            ["db1:5433", "db2:5432", "[::1]:6000"]
        );
        assert_eq!(h.target_session_attrs(), TargetSessionAttrs::ReadWrite);
        assert!(h.follows());
        let o = h.options(1).unwrap();
        assert_eq!(o.get_database(), Some("orders"));
        assert_eq!(o.get_username(), "app");
        assert_eq!(h.to_string(), "db1:5433,db2:5432,[::1]:6000/orders");
    }

    #[test]
    fn one_host_without_the_attribute_is_not_followed() {
        let h = PgHosts::parse("postgres://postgres@127.0.0.1:5432/test").unwrap();
        assert!(!h.follows());
        assert_eq!(h.target_session_attrs(), TargetSessionAttrs::Any);
        let h = PgHosts::parse("postgres://postgres@127.0.0.1/test?target_session_attrs=primary")
            .unwrap();
        assert!(h.follows());
    }

    #[test]
    fn every_libpq_value_parses_and_others_are_refused_by_name() {
        for a in TargetSessionAttrs::ALL {
            let h =
                PgHosts::parse(&format!("postgres://h1,h2/db?target_session_attrs={a}")).unwrap();
            assert_eq!(h.target_session_attrs(), a);
        }
        let e = PgHosts::parse("postgres://u:hunter2@h1,h2/db?target_session_attrs=readwrite")
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"readwrite\""), "{e}");
        assert!(e.contains("read-write"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[test]
    fn bad_input_is_named_without_the_password() {
        for (url, says) in [
            ("mysql://u:hunter2@h/db", "scheme"),
            ("postgres://u:hunter2@h1,,h2/db", "empty"),
            ("postgres://u:hunter2@h1:x,h2/db", "h1:x"),
            ("postgres://u:hunter2@h1/db?host=a,b", "authority"),
            (
                "postgres://u:hunter2@h1/db?target_session_attrs=any&target_session_attrs=any",
                "twice",
            ),
            ("h1:5432", "postgres://"),
        ] {
            let e = PgHosts::parse(url).unwrap_err().to_string();
            assert!(e.contains(says), "{url}: {e}");
            assert!(!e.contains("hunter2"), "{url}: {e}");
        }
    }

    #[test]
    fn debug_and_display_hide_credentials() {
        let h = PgHosts::parse("postgres://app:hunter2@h1:1,h2:2/db").unwrap();
        assert!(!format!("{h:?}").contains("hunter2"));
        assert!(!h.to_string().contains("hunter2"));
        assert!(!h.to_string().contains("app"));
    }

    #[test]
    fn the_attribute_decides_which_role_fits() {
        let primary = Role {
            in_recovery: false,
            read_only: false,
        };
        let standby = Role {
            in_recovery: true,
            read_only: true,
        };
        let ro_primary = Role {
            in_recovery: false,
            read_only: true,
        };
        use TargetSessionAttrs as T;
        assert!(T::ReadWrite.fits(primary) && !T::ReadWrite.fits(standby));
        assert!(!T::ReadWrite.fits(ro_primary) && T::Primary.fits(ro_primary));
        assert!(T::Standby.fits(standby) && !T::Standby.fits(primary));
        assert!(T::ReadOnly.fits(ro_primary) && T::ReadOnly.fits(standby));
        assert!(T::Any.fits(standby) && T::Any.fits(primary));
    }

    #[test]
    fn the_read_only_error_is_retryable_and_says_it_waits() {
        let h = PgHosts::parse("postgres://u:hunter2@h1:1,h2:2/db?target_session_attrs=read-write")
            .unwrap();
        let e = StoreError::Database(read_only_error(
            &h,
            h.target_session_attrs(),
            "h1:1: connection refused; h2:2: a standby (in recovery)",
        ));
        assert!(e.is_retryable());
        assert!(e.is_read_only());
        let shown = e.to_string();
        assert!(shown.contains("waiting for a primary"), "{shown}");
        assert!(shown.contains("h2:2: a standby"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
