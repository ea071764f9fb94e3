//! [`SqliteStore`]: the `Store` and `DeadLetterStore` implementations.

use crate::enqueue::SqliteOutbox;
use crate::error::{MigrateError, StoreError};
use crate::migrate::AppliedMigration;
use crate::names::Names;
use crate::options::SqliteStoreOptions;
use crate::sql::{
    decode_event, delay_ms, millis, now_ms, placeholders, seq, value_rows, DecodeError,
    EVENT_COLUMNS, ID_CHUNK,
};
use chrono::{DateTime, Utc};
use outbox_core::{
    Claim, ClaimRequest, DeadLetter, DeadLetterFilter, DeadLetterQuery, DeadLetterStore, ErrorCode,
    Event, EventId, FencingToken, HeadState, HeldKey, HeldKeyStore, HeldKeys, LastError, Rejected,
    Resolution, SettleReport, Settlement, Stats, Store, MAX_DEAD_LETTER_AGE,
};
use sqlx::sqlite::{
    SqliteArguments, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Row, Sqlite, Transaction};
use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// "This row may be claimed now": unleased and due, or its lease expired.
macro_rules! claimable {
    ($t:literal) => {
        concat!(
            "(CASE WHEN ",
            $t,
            ".locked_until IS NULL THEN ",
            $t,
            ".next_attempt_at <= ",
            now_ms!(),
            " ELSE ",
            $t,
            ".locked_until <= ",
            now_ms!(),
            " END)"
        )
    };
}

/// Claims a batch in one statement. Binds: relay id, token, lease ms,
/// shard total, shard index, limit.
///
/// An event is claimable when it is unleased and due, or its lease expired,
/// and it is in the shard (`key_hash % total = index`), and no EARLIER event
/// (smaller `seq`: committed before it) of the same key is still in the
/// table and not claimable now (leased by someone else or waiting for a
/// retry): per-key order is commit order.
const CLAIM_SQL: &str = concat!(
    "UPDATE {{events}} SET locked_by = ?, lease_token = ?, locked_until = ",
    now_ms!(),
    " + ?, attempts = attempts + 1 \
     WHERE seq IN (\
       SELECT e.seq FROM {{events}} AS e \
       WHERE ",
    claimable!("e"),
    " AND e.key_hash % ? = ? \
         AND (e.key IS NULL OR NOT EXISTS (\
           SELECT 1 FROM {{events}} AS p \
           WHERE p.key = e.key AND p.seq < e.seq AND NOT ",
    claimable!("p"),
    ")) \
       ORDER BY e.seq LIMIT ?) \
     RETURNING seq, id, key, event_type, topic, payload, headers, created_at, attempts, \
       next_attempt_at, last_error_code, last_error_message, locked_until"
);

/// The columns copied into the dead letters (after `seq`), in order.
const DEAD_COLUMNS: &str = "seq, id, key, key_hash, event_type, topic, payload, headers, \
     created_at, attempts, next_attempt_at, last_error_code, last_error_message, dead_at";

/// On an id that is already a dead letter: the newer failure replaces it.
const DEAD_UPSERT: &str =
    " ON CONFLICT (id) DO UPDATE SET seq = excluded.seq, key = excluded.key, \
     key_hash = excluded.key_hash, event_type = excluded.event_type, topic = excluded.topic, \
     payload = excluded.payload, headers = excluded.headers, created_at = excluded.created_at, \
     attempts = excluded.attempts, next_attempt_at = excluded.next_attempt_at, \
     last_error_code = excluded.last_error_code, \
     last_error_message = excluded.last_error_message, dead_at = excluded.dead_at";

/// Statements rendered once per store for its table names.
#[derive(Debug)]
struct StoreSql {
    claim: String,
    renew: String,
    stats: String,
}

impl StoreSql {
    fn new(names: &Names) -> Self {
        Self {
            claim: names.render(CLAIM_SQL),
            renew: names.render(concat!(
                "UPDATE {{events}} SET locked_until = ",
                now_ms!(),
                " + ? WHERE lease_token = ?"
            )),
            stats: names.render(concat!(
                "SELECT (SELECT COUNT(*) FROM {{events}}) AS total, \
                   (SELECT COUNT(*) FROM {{events}} WHERE locked_until > ",
                now_ms!(),
                ") AS in_flight, \
                   (SELECT COUNT(*) FROM {{dead}}) AS dead, \
                   (SELECT MIN(created_at) FROM {{events}}) AS oldest, ",
                now_ms!(),
                " AS now"
            )),
        }
    }
}

/// A [`Store`] and [`DeadLetterStore`] on SQLite.
///
/// Cheap to clone (it wraps a connection pool). `Debug` shows the table and
/// pool sizes only, never the database path or URL.
#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    outbox: SqliteOutbox,
    sql: Arc<StoreSql>,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("table", self.outbox.table())
            .field("connections", &self.pool.size())
            .field("idle", &self.pool.num_idle())
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating the file if missing) the database named by `options`:
    /// a URL (`"sqlite://outbox.db"`, `"sqlite:///var/lib/app/app.db"`) or
    /// [`SqliteStoreOptions`], with WAL journaling, `synchronous = NORMAL`,
    /// the busy timeout and foreign keys on. Migrates only with
    /// [`SqliteStoreOptions::with_auto_migrate`]; otherwise call
    /// [`Self::migrate`]. A missing directory is reported as
    /// [`StoreError::Open`] naming the path.
    pub async fn connect(options: impl Into<SqliteStoreOptions>) -> Result<Self, StoreError> {
        let options = options.into();
        let url = options.url.trim();
        if let Some((scheme, _)) = url.split_once("://") {
            if !scheme.eq_ignore_ascii_case("sqlite") {
                return Err(StoreError::InvalidUrl(format!(
                    "a {scheme}:// URL is not a SQLite database; use sqlite://PATH"
                )));
            }
        }
        let connect = SqliteConnectOptions::from_str(&options.url)
            .map_err(|e| StoreError::InvalidUrl(crate::error::Cause(&e).to_string()))?;
        Self::open(connect, options).await
    }

    /// [`Self::connect`] with sqlx connect options built by the caller (the
    /// URL of `options` is ignored); the store still turns on
    /// `create_if_missing`, WAL, the busy timeout and foreign keys.
    pub async fn connect_with(
        connect: SqliteConnectOptions,
        options: SqliteStoreOptions,
    ) -> Result<Self, StoreError> {
        Self::open(connect, options).await
    }

    async fn open(
        connect: SqliteConnectOptions,
        options: SqliteStoreOptions,
    ) -> Result<Self, StoreError> {
        let names = Names::new(options.table.clone())?;
        let path = connect.get_filename().to_path_buf();
        let in_memory = path.as_os_str() == ":memory:" || path.as_os_str().is_empty();
        if !in_memory {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                if !dir.is_dir() {
                    return Err(StoreError::Open {
                        reason: format!("directory {} does not exist", dir.display()),
                        path,
                    });
                }
            }
        }
        let connect = connect
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(options.busy_timeout)
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(options.pool.max_connections)
            .acquire_timeout(options.pool.acquire_timeout)
            .connect_with(connect)
            .await
            .map_err(|e| match e {
                e @ (sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) => StoreError::Database(e),
                e => StoreError::Open {
                    path: path.clone(),
                    reason: crate::error::Cause(&e).to_string(),
                },
            })?;
        let store = Self::with_names(pool, names, options.pool.limits);
        if options.pool.auto_migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Wraps a pool the application already has (the same one it enqueues
    /// with), for the table and limits of `options` (its URL, busy timeout
    /// and pool size are ignored: the pool's own settings are the
    /// application's); migrates when `options` asks (as
    /// [`Self::connect`]). The same shape as the PostgreSQL stores'
    /// `from_pool`.
    pub async fn from_pool(
        pool: SqlitePool,
        options: impl Into<SqliteStoreOptions>,
    ) -> Result<Self, StoreError> {
        let options = options.into();
        let names = Names::new(options.table.clone())?;
        let store = Self::with_names(pool, names, options.pool.limits);
        if options.pool.auto_migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Wraps a pool for the outbox `outbox` (its table and limits).
    pub fn with_outbox(pool: SqlitePool, outbox: SqliteOutbox) -> Self {
        let sql = Arc::new(StoreSql::new(&outbox.names));
        Self { pool, outbox, sql }
    }

    fn with_names(pool: SqlitePool, names: Names, limits: outbox_core::EventLimits) -> Self {
        Self::with_outbox(pool, SqliteOutbox::from_names(names).with_limits(limits))
    }

    /// The enqueue handle for this store's outbox (same table and limits).
    pub fn outbox(&self) -> &SqliteOutbox {
        &self.outbox
    }

    /// The connection pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The claim statement, for review and `EXPLAIN QUERY PLAN`. Binds, in
    /// order: relay id, fencing token, lease in ms, shard total, shard index,
    /// batch size.
    pub fn claim_sql(&self) -> &str {
        &self.sql.claim
    }

    /// Creates or upgrades the outbox tables (see [`SqliteOutbox::migrate`]).
    /// Idempotent; safe to call from several processes at once. Returns the
    /// versions it applied (empty when up to date). Fails with
    /// [`MigrateError::ChecksumMismatch`] when an applied migration differs
    /// from this build's.
    pub async fn migrate(&self) -> Result<Vec<i32>, MigrateError> {
        let mut conn = self.pool.acquire().await?;
        self.outbox.migrate(&mut conn).await
    }

    /// The applied outbox migrations, oldest first.
    pub async fn applied_migrations(&self) -> Result<Vec<AppliedMigration>, MigrateError> {
        let mut conn = self.pool.acquire().await?;
        self.outbox.applied_migrations(&mut conn).await
    }

    fn names(&self) -> &Names {
        &self.outbox.names
    }

    async fn now_plus(&self, ms: i64) -> Result<DateTime<Utc>, StoreError> {
        let at: i64 = sqlx::query_scalar(concat!("SELECT ", now_ms!(), " + ?"))
            .bind(ms)
            .fetch_one(&self.pool)
            .await?;
        DateTime::<Utc>::from_timestamp_millis(at).ok_or(StoreError::Clock(at))
    }

    /// Moves rows of `token` that could not be decoded to the dead letters
    /// with [`ErrorCode::UNDECODABLE`] and the reason, in one transaction.
    async fn dead_letter_undecodable(
        &self,
        token: FencingToken,
        bad: &[(i64, String)],
    ) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut moved = 0;
        for chunk in bad.chunks(ID_CHUNK / 2) {
            let sql = self.names().render(&format!(
                "WITH f(f_seq, f_message) AS (VALUES {values}) \
                 INSERT INTO {{{{dead}}}} ({DEAD_COLUMNS}) \
                 SELECT e.seq, e.id, e.key, e.key_hash, e.event_type, e.topic, e.payload, \
                   e.headers, e.created_at, e.attempts, e.next_attempt_at, ?, f.f_message, {now} \
                 FROM {{{{events}}}} AS e JOIN f ON e.seq = f.f_seq WHERE e.lease_token = ?\
                 {DEAD_UPSERT}",
                values = value_rows(chunk.len(), 2),
                now = now_ms!(),
            ));
            let mut q = sqlx::query(&sql);
            for (seq, message) in chunk {
                q = q.bind(seq).bind(message);
            }
            q.bind(ErrorCode::UNDECODABLE.as_str())
                .bind(token.as_uuid())
                .execute(&mut *tx)
                .await?;
            let sql = self.names().render(&format!(
                "DELETE FROM {{{{events}}}} WHERE lease_token = ? AND seq IN ({})",
                placeholders(chunk.len())
            ));
            let mut q = sqlx::query(&sql).bind(token.as_uuid());
            for (seq, _) in chunk {
                q = q.bind(seq);
            }
            moved += q.execute(&mut *tx).await?.rows_affected();
        }
        tx.commit().await?;
        Ok(moved)
    }
}

/// One settlement, split by resolution kind (first resolution of an id wins).
#[derive(Default)]
struct Plan<'a> {
    delivered: Vec<EventId>,
    released: Vec<EventId>,
    retry: Vec<(EventId, i64, &'a LastError)>,
    dead: Vec<(EventId, &'a LastError)>,
    /// Ids given more than once, and resolutions this store does not know.
    rejected: Vec<Rejected>,
    /// Every distinct id, in the order given.
    order: Vec<EventId>,
}

impl<'a> Plan<'a> {
    fn new(settlement: &'a Settlement) -> Self {
        let mut plan = Plan::default();
        let mut seen = HashSet::with_capacity(settlement.len());
        for (id, resolution) in settlement.items() {
            if !seen.insert(*id) {
                plan.rejected.push(Rejected {
                    id: *id,
                    reason: format!(
                        "given more than once in one settlement; the first resolution was \
                         recorded, this `{}` was ignored",
                        resolution.name()
                    ),
                });
                continue;
            }
            plan.order.push(*id);
            match resolution {
                Resolution::Delivered => plan.delivered.push(*id),
                Resolution::Released => plan.released.push(*id),
                Resolution::Retry { delay, error } => {
                    plan.retry.push((*id, delay_ms(*delay), error));
                }
                Resolution::Dead { error } => plan.dead.push((*id, error)),
                other => {
                    plan.rejected.push(Rejected {
                        id: *id,
                        reason: format!(
                            "resolution `{}` is not supported by this version of outbox-sqlite; \
                             the event was released instead",
                            other.name()
                        ),
                    });
                    plan.released.push(*id);
                }
            }
        }
        plan
    }
}

/// `head WHERE lease_token = ? AND id IN (...) RETURNING id`, per chunk.
async fn by_ids(
    tx: &mut Transaction<'static, Sqlite>,
    head: &str,
    token: FencingToken,
    ids: &[EventId],
    done: &mut HashSet<Uuid>,
) -> Result<(), StoreError> {
    for chunk in ids.chunks(ID_CHUNK) {
        let sql = format!(
            "{head} WHERE lease_token = ? AND id IN ({}) RETURNING id",
            placeholders(chunk.len())
        );
        let mut q = sqlx::query_scalar::<_, Uuid>(&sql).bind(token.as_uuid());
        for id in chunk {
            q = q.bind(id.as_uuid());
        }
        done.extend(q.fetch_all(&mut **tx).await?);
    }
    Ok(())
}

impl SqliteStore {
    /// Retries: one `UPDATE ... FROM (VALUES ...)` per chunk.
    async fn settle_retry(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        token: FencingToken,
        retries: &[(EventId, i64, &LastError)],
        done: &mut HashSet<Uuid>,
    ) -> Result<(), StoreError> {
        for chunk in retries.chunks(ID_CHUNK / 4) {
            let sql = self.names().render(&format!(
                "WITH f(f_id, f_delay, f_code, f_message) AS (VALUES {values}) \
                 UPDATE {{{{events}}}} SET locked_by = NULL, locked_until = NULL, \
                   lease_token = NULL, next_attempt_at = {now} + f.f_delay, \
                   last_error_code = f.f_code, last_error_message = f.f_message \
                 FROM f WHERE {{{{events}}}}.id = f.f_id AND {{{{events}}}}.lease_token = ? \
                 RETURNING id",
                values = value_rows(chunk.len(), 4),
                now = now_ms!()
            ));
            let mut q = sqlx::query_scalar::<_, Uuid>(&sql);
            for (id, delay, error) in chunk {
                q = q
                    .bind(id.as_uuid())
                    .bind(*delay)
                    .bind(error.code.as_str())
                    .bind(error.message.as_str());
            }
            done.extend(q.bind(token.as_uuid()).fetch_all(&mut **tx).await?);
        }
        Ok(())
    }

    /// Dead letters: `INSERT ... SELECT ... ON CONFLICT DO UPDATE` then
    /// `DELETE`, per chunk. An id that already was a dead letter is replaced
    /// by the newer failure and reported in `rejected`.
    async fn settle_dead(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        token: FencingToken,
        dead: &[(EventId, &LastError)],
        done: &mut HashSet<Uuid>,
        rejected: &mut Vec<Rejected>,
    ) -> Result<(), StoreError> {
        for chunk in dead.chunks(ID_CHUNK / 3) {
            let sql = self.names().render(&format!(
                "SELECT d.id, d.last_error_code, d.last_error_message FROM {{{{dead}}}} AS d \
                 JOIN {{{{events}}}} AS e ON e.id = d.id \
                 WHERE e.lease_token = ? AND d.id IN ({})",
                placeholders(chunk.len())
            ));
            let mut q = sqlx::query(&sql).bind(token.as_uuid());
            for (id, _) in chunk {
                q = q.bind(id.as_uuid());
            }
            for row in q.fetch_all(&mut **tx).await? {
                let id = EventId::from_uuid(row.try_get("id")?);
                let code: String = row.try_get("last_error_code")?;
                let message: String = row.try_get("last_error_message")?;
                rejected.push(Rejected {
                    id,
                    reason: format!(
                        "a dead letter with this id already existed ({code}: {message}); \
                         it was replaced by this failure"
                    ),
                });
            }

            let sql = self.names().render(&format!(
                "WITH f(f_id, f_code, f_message) AS (VALUES {values}) \
                 INSERT INTO {{{{dead}}}} ({DEAD_COLUMNS}) \
                 SELECT e.seq, e.id, e.key, e.key_hash, e.event_type, e.topic, e.payload, \
                   e.headers, e.created_at, e.attempts, e.next_attempt_at, f.f_code, \
                   f.f_message, {now} \
                 FROM {{{{events}}}} AS e JOIN f ON e.id = f.f_id WHERE e.lease_token = ?\
                 {DEAD_UPSERT}",
                values = value_rows(chunk.len(), 3),
                now = now_ms!()
            ));
            let mut q = sqlx::query(&sql);
            for (id, error) in chunk {
                q = q
                    .bind(id.as_uuid())
                    .bind(error.code.as_str())
                    .bind(error.message.as_str());
            }
            q.bind(token.as_uuid()).execute(&mut **tx).await?;

            let ids: Vec<EventId> = chunk.iter().map(|(id, _)| *id).collect();
            let head = self.names().render("DELETE FROM {{events}}");
            by_ids(tx, &head, token, &ids, done).await?;
        }
        Ok(())
    }
}

impl Store for SqliteStore {
    type Error = StoreError;

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let token = FencingToken::new();
        let lease_ms = millis(req.lease);
        let rows = sqlx::query(&self.sql.claim)
            .bind(req.relay_id.as_str())
            .bind(token.as_uuid())
            .bind(lease_ms)
            .bind(i64::from(req.shard.total()))
            .bind(i64::from(req.shard.index()))
            .bind(i64::from(req.batch_size))
            .fetch_all(&self.pool)
            .await?;
        let mut lease_until = None;
        let mut events: Vec<(i64, Event)> = Vec::with_capacity(rows.len());
        let mut bad: Vec<(i64, String)> = Vec::new();
        for row in &rows {
            let seq = match seq(row) {
                Ok(seq) => seq,
                // `seq` is the INTEGER PRIMARY KEY: it always decodes.
                Err(e) => return Err(StoreError::Database(sqlx::Error::Protocol(e.to_string()))),
            };
            if lease_until.is_none() {
                if let Ok(ms) = row.try_get::<i64, _>("locked_until") {
                    lease_until = DateTime::<Utc>::from_timestamp_millis(ms);
                }
            }
            match decode_event(row, false) {
                Ok(event) => events.push((seq, event)),
                Err(DecodeError { column, reason }) => {
                    let id = crate::sql::id(row)
                        .map(|id| id.to_string())
                        .unwrap_or_else(|_| format!("at seq {seq}"));
                    tracing::warn!(event = %id, column, %reason, "undecodable outbox row: dead-lettering it");
                    bad.push((seq, format!("event {id}: column {column}: {reason}")));
                }
            }
        }
        if !bad.is_empty() {
            // Never fail the claim for this: the good events are leased now
            // and must be delivered. If it fails, the bad rows come back when
            // their lease expires and are tried again.
            match self.dead_letter_undecodable(token, &bad).await {
                Ok(n) => tracing::warn!(count = n, "dead-lettered undecodable outbox rows"),
                Err(e) => tracing::error!(
                    error = %e,
                    "could not dead-letter undecodable outbox rows; they will be retried after their lease"
                ),
            }
        }
        // RETURNING order is unspecified: restore commit order.
        events.sort_by_key(|(seq, _)| *seq);
        let events: Vec<Event> = events.into_iter().map(|(_, e)| e).collect();
        let lease_until = match lease_until {
            Some(t) => t,
            None => self.now_plus(lease_ms).await?,
        };
        tracing::debug!(relay = %req.relay_id, shard = %req.shard, claimed = events.len(), %token, "claimed outbox events");
        Ok(Claim::up_to_batch_size(req, token, lease_until, events))
    }

    async fn settle(
        &self,
        token: FencingToken,
        settlement: &Settlement,
    ) -> Result<SettleReport, StoreError> {
        if settlement.is_empty() {
            return Ok(SettleReport::default());
        }
        let mut plan = Plan::new(settlement);
        let mut done = HashSet::with_capacity(plan.order.len());
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let names = self.names();
        if !plan.delivered.is_empty() {
            let head = names.render("DELETE FROM {{events}}");
            by_ids(&mut tx, &head, token, &plan.delivered, &mut done).await?;
        }
        if !plan.released.is_empty() {
            let head = names.render(
                "UPDATE {{events}} SET locked_by = NULL, locked_until = NULL, \
                 lease_token = NULL, attempts = MAX(attempts - 1, 0)",
            );
            by_ids(&mut tx, &head, token, &plan.released, &mut done).await?;
        }
        if !plan.retry.is_empty() {
            self.settle_retry(&mut tx, token, &plan.retry, &mut done)
                .await?;
        }
        if !plan.dead.is_empty() {
            self.settle_dead(&mut tx, token, &plan.dead, &mut done, &mut plan.rejected)
                .await?;
        }
        tx.commit().await?;
        let fenced: Vec<EventId> = plan
            .order
            .iter()
            .filter(|id| !done.contains(&id.as_uuid()))
            .copied()
            .collect();
        if !fenced.is_empty() {
            tracing::warn!(%token, fenced = fenced.len(), "settle: events no longer held by this token were left unchanged");
        }
        tracing::debug!(%token, applied = done.len(), "settled outbox events");
        Ok(SettleReport {
            applied: done.len() as u64,
            fenced,
            rejected: plan.rejected,
        })
    }

    async fn renew(&self, token: FencingToken, lease: Duration) -> Result<u64, StoreError> {
        let held = sqlx::query(&self.sql.renew)
            .bind(millis(lease))
            .bind(token.as_uuid())
            .execute(&self.pool)
            .await?
            .rows_affected();
        tracing::trace!(%token, held, "renewed lease");
        Ok(held)
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let row = sqlx::query(&self.sql.stats).fetch_one(&self.pool).await?;
        let total: i64 = row.try_get("total")?;
        let in_flight: i64 = row.try_get("in_flight")?;
        let dead: i64 = row.try_get("dead")?;
        let oldest: Option<i64> = row.try_get("oldest")?;
        let now: i64 = row.try_get("now")?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        Ok(Stats {
            pending: count(total - in_flight),
            in_flight: count(in_flight),
            dead: count(dead),
            oldest_pending_age: oldest
                .map(|t| Duration::from_millis(u64::try_from(now - t).unwrap_or(0))),
        })
    }
}

/// One statement's share of a dead-letter selection: the conditions of a
/// [`DeadLetterFilter`] (with the database's `now` read once, so every
/// statement of an operation selects the same rows) and at most
/// [`ID_CHUNK`] of its ids.
struct DeadPart<'f> {
    filter: &'f DeadLetterFilter,
    now: i64,
    ids: Option<&'f [EventId]>,
}

impl<'f> DeadPart<'f> {
    /// The parts `filter` splits into: one, or one per chunk of its ids
    /// (none for an empty id list: it selects nothing).
    fn split(filter: &'f DeadLetterFilter, now: i64) -> Vec<Self> {
        match filter.ids.as_deref() {
            None => vec![Self {
                filter,
                now,
                ids: None,
            }],
            Some(ids) => ids
                .chunks(ID_CHUNK)
                .map(|chunk| Self {
                    filter,
                    now,
                    ids: Some(chunk),
                })
                .collect(),
        }
    }

    /// ` WHERE ...` over the dead letters' columns (unqualified), with a
    /// `?` for every value, bound by [`DeadPart::bind`] in the same order.
    fn where_sql(&self) -> String {
        let f = self.filter;
        let mut sql = String::from(" WHERE 1 = 1");
        for (set, cond) in [
            (f.event_type.is_some(), " AND event_type = ?"),
            (f.code.is_some(), " AND last_error_code = ?"),
            (f.key.is_some(), " AND key = ?"),
            (f.older_than.is_some(), " AND dead_at <= ? - ?"),
            (f.newer_than.is_some(), " AND dead_at > ? - ?"),
        ] {
            if set {
                sql.push_str(cond);
            }
        }
        if let Some(ids) = self.ids {
            sql.push_str(&format!(" AND id IN ({})", placeholders(ids.len())));
        }
        sql
    }

    fn bind<'q>(
        &self,
        mut q: sqlx::query::Query<'q, Sqlite, SqliteArguments<'q>>,
    ) -> sqlx::query::Query<'q, Sqlite, SqliteArguments<'q>>
    where
        'f: 'q,
    {
        let f = self.filter;
        let age = |d: Duration| millis(d.min(MAX_DEAD_LETTER_AGE));
        if let Some(t) = &f.event_type {
            q = q.bind(t.as_str());
        }
        if let Some(c) = &f.code {
            q = q.bind(c.as_str());
        }
        if let Some(k) = &f.key {
            q = q.bind(k.as_str());
        }
        for d in [f.older_than, f.newer_than].into_iter().flatten() {
            q = q.bind(self.now).bind(age(d));
        }
        for id in self.ids.unwrap_or_default() {
            q = q.bind(id.as_uuid());
        }
        q
    }
}

impl SqliteStore {
    /// The database clock, in milliseconds.
    async fn now_ms<'e, E: sqlx::SqliteExecutor<'e>>(e: E) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(concat!("SELECT ", now_ms!()))
            .fetch_one(e)
            .await?)
    }
}

impl DeadLetterStore for SqliteStore {
    type Error = StoreError;

    async fn list_dead(&self, query: &DeadLetterQuery) -> Result<Vec<DeadLetter>, StoreError> {
        let now = Self::now_ms(&self.pool).await?;
        let select = self.names().render(&format!(
            "SELECT {EVENT_COLUMNS}, dead_at FROM {{{{dead}}}}"
        ));
        let mut out = Vec::new();
        for part in DeadPart::split(&query.filter, now) {
            let mut sql = format!("{select}{}", part.where_sql());
            if query.after.is_some() {
                sql.push_str(" AND id > ?");
            }
            sql.push_str(" ORDER BY id LIMIT ?");
            let mut q = part.bind(sqlx::query(&sql));
            if let Some(after) = query.after {
                q = q.bind(after.as_uuid());
            }
            let rows = q.bind(i64::from(query.limit)).fetch_all(&self.pool).await?;
            for row in &rows {
                // Dead letters stay listable even when a column is corrupt (an
                // UNDECODABLE dead letter): only an id that is not a UUID hides one.
                match decode_event(row, true) {
                    Ok(event) => {
                        let dead_at = row
                            .try_get::<i64, _>("dead_at")
                            .ok()
                            .and_then(DateTime::<Utc>::from_timestamp_millis)
                            .unwrap_or(DateTime::<Utc>::UNIX_EPOCH);
                        out.push(DeadLetter::new(event, dead_at));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "skipping a dead letter whose id is not a UUID")
                    }
                }
            }
        }
        // Several id chunks: merge their pages into one.
        out.sort_by_key(|d| d.event.id);
        out.truncate(usize::try_from(query.limit).unwrap_or(usize::MAX));
        Ok(out)
    }

    async fn count_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let now = Self::now_ms(&self.pool).await?;
        let count = self.names().render("SELECT COUNT(*) FROM {{dead}}");
        let mut n = 0;
        for part in DeadPart::split(filter, now) {
            let sql = format!("{count}{}", part.where_sql());
            let c: i64 = part
                .bind(sqlx::query(&sql))
                .fetch_one(&self.pool)
                .await?
                .try_get(0)?;
            n += u64::try_from(c).unwrap_or(0);
        }
        Ok(n)
    }

    async fn retry_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        // A dead letter goes back to its place in commit order (its `seq`)
        // unless its key has a later event still in the table: then it takes
        // a new `seq` and goes behind the key's events (it never overtakes
        // one, so it can never run beside one that is leased). Letters dead
        // before migration 2 have no `seq` and get a new one.
        let insert = self.names().render(concat!(
            "INSERT INTO {{events}} (seq, id, key, key_hash, event_type, topic, payload, headers, \
               created_at, attempts, next_attempt_at, last_error_code, last_error_message) \
             SELECT CASE WHEN d.seq IS NULL OR EXISTS (\
                      SELECT 1 FROM {{events}} AS p WHERE p.key = d.key AND p.seq > d.seq) \
                    THEN NULL ELSE d.seq END, \
                    d.id, d.key, d.key_hash, d.event_type, d.topic, d.payload, d.headers, \
                    d.created_at, 0, ",
            now_ms!(),
            ", d.last_error_code, d.last_error_message FROM {{dead}} AS d"
        ));
        let delete = self.names().render("DELETE FROM {{dead}}");
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        // Read once: the INSERT and the DELETE select the same rows.
        let now = Self::now_ms(&mut *tx).await?;
        let mut moved = 0;
        for part in DeadPart::split(filter, now) {
            let filter_sql = part.where_sql();
            let sql = format!("{insert}{filter_sql} ORDER BY d.seq IS NULL, d.seq, d.id");
            moved += part
                .bind(sqlx::query(&sql))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            let sql = format!("{delete}{filter_sql}");
            part.bind(sqlx::query(&sql)).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        tracing::info!(moved, "retried dead letters");
        Ok(moved)
    }

    async fn purge_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let delete = self.names().render("DELETE FROM {{dead}}");
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let now = Self::now_ms(&mut *tx).await?;
        let mut purged = 0;
        for part in DeadPart::split(filter, now) {
            let sql = format!("{delete}{}", part.where_sql());
            purged += part
                .bind(sqlx::query(&sql))
                .execute(&mut *tx)
                .await?
                .rows_affected();
        }
        tx.commit().await?;
        tracing::info!(purged, "purged dead letters");
        Ok(purged)
    }
}

/// The heads of the table ([`HeldKeyStore`]): a key's first event when it
/// failed or waits for a later time (a keyless one only when it failed),
/// with the key's events behind it. A leased row is not a head unless it
/// failed before (its retry is in flight).
const HELD_KEYS_SQL: &str = concat!(
    "WITH heads AS (
    SELECT e.* FROM {{events}} e
    WHERE (e.last_error_code IS NOT NULL
           OR (e.key IS NOT NULL AND e.locked_until IS NULL AND e.next_attempt_at > ",
    now_ms!(),
    "))
      AND (e.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {{events}} p WHERE p.key = e.key AND p.seq < e.seq))
)
SELECT h.seq, h.id, h.key, h.event_type, h.topic, h.payload, h.headers, h.created_at, h.attempts,
       h.next_attempt_at, h.last_error_code, h.last_error_message,
       CASE WHEN h.locked_until > ",
    now_ms!(),
    " THEN h.locked_until END AS lease_until,
       (SELECT count(*) FROM {{events}} x
         WHERE h.key IS NOT NULL AND x.key = h.key AND x.seq > h.seq) AS waiting,
       (SELECT x.id FROM {{events}} x
         WHERE h.key IS NOT NULL AND x.key = h.key AND x.seq > h.seq
         ORDER BY x.seq LIMIT 1) AS first_waiting,
       count(*) OVER () AS total
FROM heads h
ORDER BY waiting DESC, h.created_at, h.id
LIMIT ?"
);

impl HeldKeyStore for SqliteStore {
    type Error = StoreError;

    async fn held_keys(&self, limit: u32) -> Result<HeldKeys, StoreError> {
        let rows = sqlx::query(&self.names().render(HELD_KEYS_SQL))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        let mut out = HeldKeys::default();
        for row in &rows {
            out.total = u64::try_from(row.try_get::<i64, _>("total")?).unwrap_or(0);
            // Like a dead letter, a head stays listable with a corrupt
            // column: only an id that is not a UUID hides one.
            let head = match decode_event(row, true) {
                Ok(event) => event,
                Err(e) => {
                    tracing::warn!(error = %e, "skipping a held event whose id is not a UUID");
                    continue;
                }
            };
            let state = match row
                .try_get::<Option<i64>, _>("lease_until")?
                .and_then(DateTime::<Utc>::from_timestamp_millis)
            {
                Some(lease_until) => HeadState::InFlight { lease_until },
                None => HeadState::Retrying {
                    next_attempt_at: head.next_attempt_at,
                },
            };
            out.heads.push(HeldKey {
                head,
                state,
                waiting: u64::try_from(row.try_get::<i64, _>("waiting")?).unwrap_or(0),
                first_waiting: row
                    .try_get::<Option<Uuid>, _>("first_waiting")
                    .ok()
                    .flatten()
                    .map(EventId::from_uuid),
            });
        }
        Ok(out)
    }
}
