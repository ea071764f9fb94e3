//! [`Db`]: the stores' pool and what may be kept on its connections.
//!
//! Straight to PostgreSQL (or through a session pooler) a connection is a
//! session: statements stay prepared on it (one round trip per execution)
//! and its settings are given once at startup. Through a pooler in
//! transaction mode ([`Pooler::Transaction`]) only a transaction keeps its
//! server connection, so:
//!
//! - every statement runs inside a transaction: one run on the pool
//!   ([`Executor`] for `&Db`) is wrapped in its own `BEGIN`/`COMMIT`
//!   (sqlx parses and executes a statement in two exchanges, and the pooler
//!   may hand the second to another server between them);
//! - statements are unnamed ([`Tx`] and `&Db` clear sqlx's `persistent`
//!   flag), so no name is left on a server connection that another client
//!   gets next;
//! - the session settings (`jit = off`, and the log's generic plans) are
//!   `SET LOCAL` in the `BEGIN` that opens each transaction.
//!
//! The mode is decided once, at connect ([`detect`]).
//!
//! With several hosts (or `target_session_attrs`) in the URL, a `Db` also
//! follows the primary ([`Failover`]): every operation on it (a
//! transaction's `BEGIN`, a statement on the pool) first probes the hosts
//! when the last failure looked like a lost server, fails at once with the
//! read-only error while no host fits, has the hosts probed beside it when
//! it takes longer than [`SLOW_OPERATION`], and reports its failure (and a
//! transaction's statements theirs) to the failover state.

use crate::hosts::{Failover, SLOW_OPERATION};
use futures::future::BoxFuture;
use futures::stream::{self, BoxStream};
use futures::{StreamExt, TryStreamExt};
use outbox_core::Pooler;
use sqlx::postgres::{PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Describe, Either, Execute, Executor, PgConnection, PgPool, Postgres, Transaction};
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// A store's pool and whether it is reached through a pooler in
/// transaction mode. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Db {
    pool: PgPool,
    /// Nothing is kept across transactions.
    pooled: bool,
    /// The statement that opens a transaction: `BEGIN`, or in pooled mode
    /// `BEGIN` followed by the session settings as `SET LOCAL`.
    begin: Arc<str>,
    /// The hosts followed (a multi-host URL, or `target_session_attrs`).
    failover: Option<Arc<Failover>>,
}

impl fmt::Debug for Db {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Db")
            .field("pool_size", &self.pool.size())
            .field("pooled", &self.pooled)
            .field("failover", &self.failover)
            .finish()
    }
}

impl Db {
    /// `pool` as a store uses it: `pooled` when a pooler in transaction
    /// mode is in between, in which case each transaction starts with
    /// `settings` as `SET LOCAL` (direct connections got them at startup).
    pub(crate) fn new(pool: PgPool, pooled: bool, settings: &[(&str, &str)]) -> Self {
        let mut begin = String::from("BEGIN");
        if pooled {
            for (name, value) in settings {
                begin.push_str(&format!("; SET LOCAL {name} = '{value}'"));
            }
        }
        Db {
            pool,
            pooled,
            begin: begin.into(),
            failover: None,
        }
    }

    /// This `Db` following `failover`'s hosts (its pool points at the
    /// host `failover` says is current).
    pub(crate) fn with_failover(mut self, failover: Arc<Failover>) -> Self {
        self.failover = Some(failover);
        self
    }

    /// The pool.
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether a pooler in transaction mode is in between.
    pub(crate) fn pooled(&self) -> bool {
        self.pooled
    }

    /// The mode the store runs in: [`Pooler::Transaction`] or
    /// [`Pooler::None`] (a session pooler is a session).
    pub(crate) fn mode(&self) -> Pooler {
        if self.pooled {
            Pooler::Transaction
        } else {
            Pooler::None
        }
    }

    /// A transaction on a connection of the pool.
    pub(crate) async fn begin(&self) -> Result<Tx<'static>, sqlx::Error> {
        let Some(f) = &self.failover else {
            return self.begin_plain().await;
        };
        f.before(&self.pool).await?;
        let mut tx = slow_guard(f, &self.pool, Box::pin(self.begin_plain())).await?;
        tx.failover = Some(Arc::clone(f));
        Ok(tx)
    }

    /// A transaction, without the failover guard.
    async fn begin_plain(&self) -> Result<Tx<'static>, sqlx::Error> {
        let tx = if self.pooled {
            self.pool.begin_with(self.begin_sql()).await?
        } else {
            self.pool.begin().await?
        };
        Ok(Tx {
            tx,
            pooled: self.pooled,
            failover: None,
        })
    }

    fn begin_sql(&self) -> Cow<'static, str> {
        Cow::Owned(self.begin.to_string())
    }
}

/// `op` with the hosts probed beside it when it takes longer than
/// [`SLOW_OPERATION`] (its connection may be waiting on a host that is
/// gone), its failure noted by `f`.
fn slow_guard<'a, T: Send + 'a>(
    f: &'a Arc<Failover>,
    pool: &'a sqlx::PgPool,
    op: BoxFuture<'a, Result<T, sqlx::Error>>,
) -> BoxFuture<'a, Result<T, sqlx::Error>> {
    Box::pin(async move {
        let watch = SlowWatch::start(f, pool);
        let r = op.await;
        drop(watch);
        if let Err(e) = &r {
            f.observe(e);
        }
        r
    })
}

/// Probes the hosts if it is not dropped within [`SLOW_OPERATION`]: held
/// by an operation while it runs.
struct SlowWatch(tokio::task::JoinHandle<()>);

impl SlowWatch {
    fn start(f: &Arc<Failover>, pool: &sqlx::PgPool) -> Self {
        let (f, pool) = (Arc::clone(f), pool.clone());
        SlowWatch(tokio::spawn(async move {
            tokio::time::sleep(SLOW_OPERATION).await;
            f.probe_beside(&pool);
        }))
    }
}

impl Drop for SlowWatch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A transaction of a [`Db`]: an [`Executor`] whose statements are unnamed
/// when the `Db` is pooled. Dropped without [`Tx::commit`], it rolls back.
pub(crate) struct Tx<'c> {
    tx: Transaction<'c, Postgres>,
    pooled: bool,
    /// Told about failed statements (see [`Db`]).
    failover: Option<Arc<Failover>>,
}

impl fmt::Debug for Tx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx").field("pooled", &self.pooled).finish()
    }
}

impl Tx<'_> {
    /// Commits.
    pub(crate) async fn commit(self) -> Result<(), sqlx::Error> {
        let r = self.tx.commit().await;
        if let (Err(e), Some(f)) = (&r, &self.failover) {
            f.observe(e);
        }
        r
    }

    /// Rolls back.
    pub(crate) async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.rollback().await
    }

    /// A savepoint in this transaction (rolled back to when dropped
    /// without [`Tx::commit`]).
    pub(crate) async fn savepoint(&mut self) -> Result<Tx<'_>, sqlx::Error> {
        let tx = sqlx::Acquire::begin(&mut *self.tx).await?;
        Ok(Tx {
            tx,
            pooled: self.pooled,
            failover: self.failover.clone(),
        })
    }

    /// The connection, for `sqlx::raw_sql` statements (the simple
    /// protocol: never prepared) and callers that set `persistent`
    /// themselves.
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

/// A query with sqlx's `persistent` flag cleared when `unnamed`.
struct Unnamed<E> {
    query: E,
    unnamed: bool,
}

impl<'q, E: Execute<'q, Postgres>> Execute<'q, Postgres> for Unnamed<E> {
    fn sql(&self) -> &'q str {
        self.query.sql()
    }

    fn statement(&self) -> Option<&PgStatement<'q>> {
        self.query.statement()
    }

    fn take_arguments(
        &mut self,
    ) -> Result<Option<sqlx::postgres::PgArguments>, sqlx::error::BoxDynError> {
        self.query.take_arguments()
    }

    fn persistent(&self) -> bool {
        !self.unnamed && self.query.persistent()
    }
}

impl<'t> Executor<'t> for &'t mut Tx<'_> {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        't: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let unnamed = self.pooled;
        let failover = self.failover.clone();
        let rows = (&mut *self.tx).fetch_many(Unnamed { query, unnamed });
        match failover {
            None => rows,
            Some(f) => rows
                .inspect_err(move |e| {
                    f.observe(e);
                })
                .boxed(),
        }
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        't: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let unnamed = self.pooled;
        let failover = self.failover.clone();
        let row = (&mut *self.tx).fetch_optional(Unnamed { query, unnamed });
        match failover {
            None => row,
            Some(f) => Box::pin(async move {
                let r = row.await;
                if let Err(e) = &r {
                    f.observe(e);
                }
                r
            }),
        }
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        't: 'e,
    {
        (&mut *self.tx).prepare_with(sql, parameters)
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        't: 'e,
    {
        (&mut *self.tx).describe(sql)
    }
}

/// One statement on the pool: as on a [`PgPool`] when direct; pooled, in a
/// transaction of its own, unnamed (committed when the statement succeeded).
impl<'d> Executor<'d> for &'d Db {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'd: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let rows = if self.pooled {
            stream::once(async move {
                let mut tx = self.begin_plain().await?;
                let items: Vec<_> = (&mut tx).fetch_many(query).collect().await;
                if items.iter().all(Result::is_ok) {
                    tx.commit().await?;
                }
                Ok::<_, sqlx::Error>(stream::iter(items))
            })
            .try_flatten()
            .boxed()
        } else {
            self.pool.fetch_many(query)
        };
        let Some(f) = &self.failover else {
            return rows;
        };
        stream::once(async move { f.before(&self.pool).await.map(|()| rows) })
            .try_flatten()
            .inspect_err(move |e| {
                f.observe(e);
            })
            // Watched while the stream lives (dropped with it).
            .map({
                let watch = SlowWatch::start(f, &self.pool);
                move |item| {
                    let _ = &watch;
                    item
                }
            })
            .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'd: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let row = if self.pooled {
            Box::pin(async move {
                let mut tx = self.begin_plain().await?;
                let row = (&mut tx).fetch_optional(query).await?;
                tx.commit().await?;
                Ok(row)
            })
        } else {
            self.pool.fetch_optional(query)
        };
        let Some(f) = &self.failover else {
            return row;
        };
        Box::pin(async move {
            f.before(&self.pool).await?;
            slow_guard(f, &self.pool, row).await
        })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'd: 'e,
    {
        self.pool.prepare_with(sql, parameters)
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'd: 'e,
    {
        self.pool.describe(sql)
    }
}

/// Whether `pool`'s server sits behind a pooler in transaction mode, for
/// `mode`: [`Pooler::Transaction`] yes; [`Pooler::None`] and
/// [`Pooler::Session`] no; [`Pooler::Auto`] when the server's `port`
/// setting differs from the port the pool connects to (something forwards
/// the connection), said in one log line naming the setting.
pub(crate) async fn detect(pool: &PgPool, mode: Pooler) -> Result<bool, sqlx::Error> {
    match mode {
        Pooler::Transaction => return Ok(true),
        Pooler::Auto => {}
        _ => return Ok(false),
    }
    let options = pool.connect_options();
    if options.get_socket().is_some() {
        // A Unix socket names the server's port in its file name.
        return Ok(false);
    }
    let dialed = options.get_port();
    // The simple protocol: nothing is prepared before the mode is known.
    let row = sqlx::raw_sql("SHOW port").fetch_one(pool).await?;
    let port: String = sqlx::Row::try_get(&row, 0)?;
    let forwarded = port.trim() != dialed.to_string();
    if forwarded {
        tracing::warn!(
            dialed,
            server_port = port.trim(),
            "PostgreSQL answers as port {} while the store dialled port {dialed}: a pooler or proxy \
             forwards the connection, so the store keeps nothing across transactions (pooler mode \
             `transaction`: unnamed statements, settings per transaction, no LISTEN); if it keeps \
             one server connection per client, set the pooler to `session` (outbox-relay: \
             --pg-pooler session)",
            port.trim()
        );
    }
    Ok(forwarded)
}
