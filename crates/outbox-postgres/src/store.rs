//! [`PgStore`]: claims, fenced outcomes, stats, dead letters, wake-ups.

use crate::names::Names;
use crate::options::{redact_url, scrub};
use crate::{MigrateError, PgOutbox, PgStoreOptions, StoreError};
use chrono::{DateTime, Utc};
use outbox_core::{
    Claim, ClaimRequest, DeadLetter, DeadLetterQuery, DeadLetterStore, Disposition, ErrorCode,
    Event, EventId, Failure, FenceReport, FencingToken, LastError, ShardSpec, Stats, Store,
};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions, PgRow};
use sqlx::{PgPool, Row};
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use uuid::Uuid;

/// The outbox store on PostgreSQL. Cheap to clone (an `Arc`); background
/// tasks (the LISTEN connection, the retention purge) stop when the last
/// clone is dropped. `Debug` never shows the password.
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    outbox: PgOutbox,
    sql: StoreSql,
    url: Option<String>,
    listen: bool,
    retention: Option<Duration>,
    purge_batch: u32,
    wakeup: Option<Arc<Notify>>,
    tasks: Vec<JoinHandle<()>>,
    vacuum: Option<Vacuum>,
}

/// The opportunistic `VACUUM` of the events table (see
/// [`PgStoreOptions::with_vacuum_every`]).
struct Vacuum {
    every: u64,
    sql: String,
    removed: AtomicU64,
    /// A VACUUM is running, or vacuuming was turned off after an error.
    busy: Arc<AtomicBool>,
}

impl Vacuum {
    /// Counts `n` removed rows; starts a background VACUUM when the count
    /// crosses a multiple of `every` and none is running.
    fn removed(&self, pool: &PgPool, n: u64) {
        if n == 0 {
            return;
        }
        let before = self.removed.fetch_add(n, Ordering::Relaxed);
        if (before + n) / self.every == before / self.every {
            return;
        }
        if self
            .busy
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let (pool, sql, busy) = (pool.clone(), self.sql.clone(), Arc::clone(&self.busy));
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            match sqlx::raw_sql(&sql).execute(&pool).await {
                Ok(_) => {
                    tracing::debug!(elapsed = ?started.elapsed(), "vacuumed the outbox table");
                    busy.store(false, Ordering::Release);
                }
                // Left `busy`: no further attempts from this store.
                Err(e) => tracing::warn!(
                    error = %e,
                    "VACUUM of the outbox table failed; not trying again (leave it to autovacuum, or grant ownership)"
                ),
            }
        });
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore")
            .field("url", &self.inner.url.as_deref().map(redact_url))
            .field("schema", &self.inner.outbox.schema())
            .field("table", &self.inner.outbox.table())
            .field("notify", &self.inner.outbox.notifies())
            .field("listen", &self.inner.listen)
            .field("retention", &self.inner.retention)
            .field("pool_size", &self.inner.pool.size())
            .finish()
    }
}

/// The claim. One statement: pick eligible rows in id order, skipping rows
/// other claims hold, then lease them. See the crate docs for the rules.
const CLAIM_SQL: &str = "\
WITH candidates AS (
    SELECT e.id, e.key, e.next_attempt_at
    FROM {{events}} e
    WHERE e.delivered_at IS NULL
      AND e.next_attempt_at <= now()
      {{shard_filter}}
      AND (e.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {{events}} p
            WHERE p.key = e.key AND p.id < e.id
              AND p.delivered_at IS NULL
              AND p.next_attempt_at > now()))
    ORDER BY e.id
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)
UPDATE {{events}} e
SET locked_by = $4,
    locked_until = now() + $5 * interval '1 microsecond',
    next_attempt_at = now() + $5 * interval '1 microsecond',
    lease_token = $6,
    attempts = e.attempts + 1
FROM candidates c
WHERE e.id = c.id
  AND (c.key IS NULL OR NOT EXISTS (
        SELECT 1 FROM {{events}} p
        WHERE p.key = c.key AND p.id < c.id
          AND p.delivered_at IS NULL
          AND NOT EXISTS (SELECT 1 FROM candidates c2 WHERE c2.id = p.id)))
RETURNING e.id, e.key, e.event_type, e.topic, e.payload, e.headers::text, e.created_at,
          e.attempts, c.next_attempt_at, e.locked_until, e.last_error_code, e.last_error_message";

const COMPLETE_DELETE_SQL: &str =
    "DELETE FROM {{events}} WHERE id = ANY($1) AND lease_token = $2 RETURNING id";

const COMPLETE_RETAIN_SQL: &str = "\
UPDATE {{events}}
SET delivered_at = now(), locked_by = NULL, locked_until = NULL, lease_token = NULL
WHERE id = ANY($1) AND lease_token = $2 AND delivered_at IS NULL
RETURNING id";

const FAIL_SQL: &str = "\
WITH f AS (
    SELECT * FROM UNNEST($2::uuid[], $3::bigint[], $4::bool[], $5::text[], $6::text[])
        AS f(id, delay_us, dead, code, message)
),
retried AS (
    UPDATE {{events}} e
    SET next_attempt_at = now() + f.delay_us * interval '1 microsecond',
        locked_by = NULL, locked_until = NULL, lease_token = NULL,
        last_error_code = f.code, last_error_message = f.message
    FROM f
    WHERE e.id = f.id AND NOT f.dead AND e.lease_token = $1 AND e.delivered_at IS NULL
    RETURNING e.id
),
killed AS (
    DELETE FROM {{events}} e
    USING f
    WHERE e.id = f.id AND f.dead AND e.lease_token = $1 AND e.delivered_at IS NULL
    RETURNING e.id, e.key, e.key_hash, e.event_type, e.topic, e.payload, e.headers,
              e.created_at, e.attempts, f.code, f.message
),
buried AS (
    INSERT INTO {{dead}} (id, key, key_hash, event_type, topic, payload, headers,
                          created_at, attempts, last_error_code, last_error_message)
    SELECT id, key, key_hash, event_type, topic, payload, headers,
           created_at, attempts, code, message
    FROM killed
    RETURNING id
)
SELECT id FROM retried UNION ALL SELECT id FROM buried";

const RELEASE_SQL: &str = "\
UPDATE {{events}}
SET locked_by = NULL, locked_until = NULL, lease_token = NULL,
    next_attempt_at = now(), attempts = greatest(attempts - 1, 0)
WHERE id = ANY($1) AND lease_token = $2 AND delivered_at IS NULL
RETURNING id";

const STATS_SQL: &str = "\
SELECT count(*) FILTER (WHERE locked_until IS NULL OR locked_until <= now()),
       count(*) FILTER (WHERE locked_until > now()),
       (extract(epoch FROM (now() - min(created_at))) * 1000000)::bigint,
       (SELECT count(*) FROM {{dead}})
FROM {{events}}
WHERE delivered_at IS NULL";

const SHARD_STATS_SQL: &str = "\
SELECT key_hash % $1,
       count(*) FILTER (WHERE locked_until IS NULL OR locked_until <= now()),
       count(*) FILTER (WHERE locked_until > now()),
       (extract(epoch FROM (now() - min(created_at))) * 1000000)::bigint
FROM {{events}}
WHERE delivered_at IS NULL
GROUP BY 1";

const SHARD_DEAD_SQL: &str = "SELECT key_hash % $1, count(*) FROM {{dead}} GROUP BY 1";

const PURGE_DELIVERED_SQL: &str = "\
DELETE FROM {{events}}
WHERE id IN (
    SELECT id FROM {{events}}
    WHERE delivered_at IS NOT NULL AND delivered_at < now() - $1 * interval '1 microsecond'
    ORDER BY delivered_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED)";

const LIST_DEAD_SQL: &str = "\
SELECT id, key, event_type, topic, payload, headers::text, created_at, attempts, dead_at,
       dead_at, last_error_code, last_error_message
FROM {{dead}}
WHERE ($1::text IS NULL OR last_error_code = $1)
  AND ($2::uuid IS NULL OR id > $2)
ORDER BY id
LIMIT $3";

const RETRY_DEAD_SQL: &str = "\
WITH moved AS (
    DELETE FROM {{dead}} WHERE ($1::uuid[] IS NULL OR id = ANY($1)) RETURNING *
)
INSERT INTO {{events}} (id, key, key_hash, event_type, topic, payload, headers, created_at,
                        attempts, next_attempt_at, last_error_code, last_error_message)
SELECT id, key, key_hash, event_type, topic, payload, headers, created_at,
       0, now(), last_error_code, last_error_message
FROM moved";

const PURGE_DEAD_SQL: &str = "DELETE FROM {{dead}} WHERE ($1::uuid[] IS NULL OR id = ANY($1))";

struct StoreSql {
    /// Claim with the shard filter (`key_hash % $1 = $2`).
    claim_shard: String,
    /// Claim for `ShardSpec::ALL`: no filter, so the planner's row estimate
    /// is not skewed by the modulo (whose generic selectivity guess of 0.5%
    /// inflates the plan cost enough to trigger JIT compilation).
    claim: String,
    complete: String,
    fail: String,
    release: String,
    stats: String,
    shard_stats: String,
    shard_dead: String,
    purge_delivered: String,
    list_dead: String,
    retry_dead: String,
    purge_dead: String,
}

impl StoreSql {
    fn new(names: &Names, retain: bool) -> Self {
        Self {
            claim_shard: names
                .render(&CLAIM_SQL.replace("{{shard_filter}}", "AND e.key_hash % $1 = $2")),
            claim: names.render(&CLAIM_SQL.replace(
                "{{shard_filter}}",
                "AND $1::bigint IS NOT NULL AND $2::bigint IS NOT NULL",
            )),
            complete: names.render(if retain {
                COMPLETE_RETAIN_SQL
            } else {
                COMPLETE_DELETE_SQL
            }),
            fail: names.render(FAIL_SQL),
            release: names.render(RELEASE_SQL),
            stats: names.render(STATS_SQL),
            shard_stats: names.render(SHARD_STATS_SQL),
            shard_dead: names.render(SHARD_DEAD_SQL),
            purge_delivered: names.render(PURGE_DELIVERED_SQL),
            list_dead: names.render(LIST_DEAD_SQL),
            retry_dead: names.render(RETRY_DEAD_SQL),
            purge_dead: names.render(PURGE_DEAD_SQL),
        }
    }
}

/// Counts of one shard (see [`PgStore::stats_by_shard`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ShardStats {
    /// The shard.
    pub shard: ShardSpec,
    /// Its counts.
    pub stats: Stats,
}

fn micros(d: Duration) -> Result<i64, StoreError> {
    i64::try_from(d.as_micros()).map_err(|_| StoreError::DurationTooLarge(d))
}

fn age(us: Option<i64>) -> Option<Duration> {
    us.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)))
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn headers_from(id: EventId, text: &str) -> Result<BTreeMap<String, String>, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt {
        id,
        detail: format!("headers are not a JSON object of strings: {e}"),
    })
}

fn last_error(code: Option<String>, message: Option<String>) -> Option<LastError> {
    code.map(|code| LastError {
        code: ErrorCode::new(code),
        message: message.unwrap_or_default(),
    })
}

/// Reads `id, key, event_type, topic, payload, headers, created_at, attempts,
/// next_attempt_at` (columns 0-8) and `last_error_code, last_error_message`
/// (columns 10-11).
fn event_from(row: &PgRow) -> Result<Event, StoreError> {
    let id = EventId::from_uuid(row.try_get::<Uuid, _>(0)?);
    let headers: String = row.try_get(5)?;
    let attempts: i32 = row.try_get(7)?;
    Ok(Event {
        id,
        key: row.try_get(1)?,
        event_type: row.try_get(2)?,
        topic: row.try_get(3)?,
        payload: row.try_get(4)?,
        headers: headers_from(id, &headers)?,
        created_at: row.try_get(6)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        next_attempt_at: row.try_get(8)?,
        last_error: last_error(row.try_get(10)?, row.try_get(11)?),
    })
}

fn fence_report(ids: &[EventId], applied: Vec<Uuid>) -> FenceReport {
    let applied: HashSet<Uuid> = applied.into_iter().collect();
    let lost = ids
        .iter()
        .filter(|id| !applied.contains(&id.as_uuid()))
        .copied()
        .collect();
    FenceReport {
        applied: applied.len() as u64,
        lost,
    }
}

fn uuids(ids: &[EventId]) -> Vec<Uuid> {
    ids.iter().map(EventId::as_uuid).collect()
}

impl PgStore {
    /// Runs a fenced statement (`$1` ids, `$2` token, `RETURNING id`) and
    /// reports which ids the token no longer owned.
    async fn fenced(
        &self,
        sql: &str,
        token: FencingToken,
        ids: &[EventId],
    ) -> Result<FenceReport, StoreError> {
        if ids.is_empty() {
            return Ok(FenceReport::default());
        }
        let applied: Vec<Uuid> = sqlx::query_scalar(sql)
            .bind(uuids(ids))
            .bind(token.as_uuid())
            .fetch_all(&self.inner.pool)
            .await?;
        Ok(fence_report(ids, applied))
    }

    fn note_removed(&self, rows: usize) {
        if let Some(v) = &self.inner.vacuum {
            v.removed(&self.inner.pool, rows as u64);
        }
    }

    /// Connects a pool to `options`' URL, applies the migrations when
    /// [`PgStoreOptions::with_auto_migrate`] is set, and starts the LISTEN
    /// task (unless turned off) and the retention purge (when configured).
    pub async fn connect(options: PgStoreOptions) -> Result<Self, StoreError> {
        let url = options
            .url
            .clone()
            .ok_or_else(|| StoreError::InvalidUrl("no URL given (set DATABASE_URL)".to_owned()))?;
        let connect: PgConnectOptions = url
            .parse()
            .map_err(|e: sqlx::Error| StoreError::InvalidUrl(scrub(&e.to_string(), &url)))?;
        // JIT compilation costs tens of milliseconds per claim and buys
        // nothing for these small, index-driven statements.
        let connect = connect.options([("jit", "off")]);
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout)
            .connect_with(connect)
            .await?;
        Self::from_pool(pool, options).await
    }

    /// A store on an existing pool (the options' URL and pool size are
    /// ignored). Must be called inside a Tokio runtime.
    pub async fn from_pool(pool: PgPool, options: PgStoreOptions) -> Result<Self, StoreError> {
        let names = Names::new(options.schema.clone(), options.table.clone())?;
        let outbox = PgOutbox::from_names(names)
            .with_notify(options.notify)
            .with_limits(options.limits);
        if options.auto_migrate {
            let mut conn = pool.acquire().await?;
            outbox.migrate(&mut conn).await?;
        }
        let sql = StoreSql::new(&outbox.names, options.retention.is_some());
        let mut tasks = Vec::new();
        let wakeup = if options.listen {
            let notify = Arc::new(Notify::new());
            tasks.push(tokio::spawn(listen(
                pool.clone(),
                outbox.channel().to_owned(),
                Arc::clone(&notify),
            )));
            Some(notify)
        } else {
            None
        };
        if let Some(retention) = options.retention {
            let retention_us = micros(retention)?;
            tasks.push(tokio::spawn(purge_loop(
                pool.clone(),
                sql.purge_delivered.clone(),
                retention_us,
                options.purge_batch,
                options.purge_interval,
            )));
        }
        let vacuum = options.vacuum_every.map(|every| Vacuum {
            every,
            sql: outbox.names.render("VACUUM (TRUNCATE false) {{events}}"),
            removed: AtomicU64::new(0),
            busy: Arc::new(AtomicBool::new(false)),
        });
        Ok(Self {
            inner: Arc::new(Inner {
                vacuum,
                pool,
                outbox,
                sql,
                url: options.url,
                listen: options.listen,
                retention: options.retention,
                purge_batch: options.purge_batch,
                wakeup,
                tasks,
            }),
        })
    }

    /// The enqueue handle for this store's outbox (same schema, table,
    /// limits and notify setting).
    pub fn outbox(&self) -> &PgOutbox {
        &self.inner.outbox
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// Applies the missing migrations (see [`PgOutbox::migrate`]).
    pub async fn migrate(&self) -> Result<Vec<i32>, MigrateError> {
        let mut conn = self
            .inner
            .pool
            .acquire()
            .await
            .map_err(MigrateError::Database)?;
        self.inner.outbox.migrate(&mut conn).await
    }

    /// Counts per shard for `total` shards (shard `i` owns `key_hash % total == i`),
    /// one entry per shard, empty shards included. `total` of 0 is treated as 1.
    pub async fn stats_by_shard(&self, total: u32) -> Result<Vec<ShardStats>, StoreError> {
        let total = total.max(1);
        let mut out: Vec<ShardStats> = (0..total)
            .filter_map(|i| ShardSpec::new(i, total).ok())
            .map(|shard| ShardStats {
                shard,
                stats: Stats::default(),
            })
            .collect();
        let rows = sqlx::query(&self.inner.sql.shard_stats)
            .bind(i64::from(total))
            .fetch_all(&self.inner.pool)
            .await?;
        for row in rows {
            let shard: i64 = row.try_get(0)?;
            if let Some(s) = usize::try_from(shard).ok().and_then(|i| out.get_mut(i)) {
                s.stats.pending = count(row.try_get(1)?);
                s.stats.in_flight = count(row.try_get(2)?);
                s.stats.oldest_pending_age = age(row.try_get(3)?);
            }
        }
        let rows = sqlx::query(&self.inner.sql.shard_dead)
            .bind(i64::from(total))
            .fetch_all(&self.inner.pool)
            .await?;
        for row in rows {
            let shard: i64 = row.try_get(0)?;
            if let Some(s) = usize::try_from(shard).ok().and_then(|i| out.get_mut(i)) {
                s.stats.dead = count(row.try_get(1)?);
            }
        }
        Ok(out)
    }

    /// Deletes up to `limit` delivered rows older than the retention (only
    /// meaningful with [`PgStoreOptions::with_retention`]; the background task
    /// calls this). Returns how many were deleted.
    pub async fn purge_delivered(&self, limit: u32) -> Result<u64, StoreError> {
        let retention = micros(self.inner.retention.unwrap_or_default())?;
        let done = sqlx::query(&self.inner.sql.purge_delivered)
            .bind(retention)
            .bind(i64::from(limit))
            .execute(&self.inner.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// The retention purge batch size.
    pub fn purge_batch(&self) -> u32 {
        self.inner.purge_batch
    }
}

async fn listen(pool: PgPool, channel: String, notify: Arc<Notify>) {
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(sqlx::Error::PoolClosed) => return,
            Err(e) => {
                tracing::warn!(error = %e, "outbox LISTEN connection failed; retrying in 1s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if let Err(e) = listener.listen(&channel).await {
            tracing::warn!(error = %e, channel, "outbox LISTEN failed; retrying in 1s");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        tracing::debug!(channel, "outbox listening for notifications");
        // Anything committed while we were not listening is found by a poll.
        notify.notify_one();
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => notify.notify_one(),
                // Connection lost and re-established: notifications may be lost.
                Ok(None) => notify.notify_one(),
                Err(sqlx::Error::PoolClosed) => return,
                Err(e) => {
                    tracing::warn!(error = %e, channel, "outbox LISTEN connection broke; reconnecting in 1s");
                    notify.notify_one();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
            }
        }
    }
}

async fn purge_loop(pool: PgPool, sql: String, retention_us: i64, batch: u32, every: Duration) {
    loop {
        loop {
            match sqlx::query(&sql)
                .bind(retention_us)
                .bind(i64::from(batch))
                .execute(&pool)
                .await
            {
                Ok(done) if done.rows_affected() >= u64::from(batch) => continue,
                Ok(done) => {
                    if done.rows_affected() > 0 {
                        tracing::debug!(
                            purged = done.rows_affected(),
                            "purged delivered outbox rows"
                        );
                    }
                    break;
                }
                Err(sqlx::Error::PoolClosed) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "purging delivered outbox rows failed");
                    break;
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

impl Store for PgStore {
    type Error = StoreError;

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let token = FencingToken::new();
        let lease_us = micros(req.lease)?;
        if req.batch_size == 0 {
            return Ok(Claim {
                token,
                lease_until: Utc::now(),
                events: Vec::new(),
            });
        }
        let sql = if req.shard.total() > 1 {
            &self.inner.sql.claim_shard
        } else {
            &self.inner.sql.claim
        };
        let rows = sqlx::query(sql)
            .bind(i64::from(req.shard.total()))
            .bind(i64::from(req.shard.index()))
            .bind(i64::from(req.batch_size))
            .bind(req.relay_id.as_str())
            .bind(lease_us)
            .bind(token.as_uuid())
            .fetch_all(&self.inner.pool)
            .await?;
        let mut lease_until: Option<DateTime<Utc>> = None;
        let mut events = Vec::with_capacity(rows.len());
        for row in &rows {
            lease_until = Some(row.try_get(9)?);
            events.push(event_from(row)?);
        }
        events.sort_by_key(|e| e.id);
        if !events.is_empty() {
            tracing::debug!(
                relay = %req.relay_id,
                shard = %req.shard,
                count = events.len(),
                token = %token,
                "claimed outbox events"
            );
        }
        Ok(Claim {
            token,
            // No rows: nothing is leased, so the time is only informative.
            lease_until: lease_until.unwrap_or_else(Utc::now),
            events,
        })
    }

    async fn complete(
        &self,
        token: FencingToken,
        ids: &[EventId],
    ) -> Result<FenceReport, StoreError> {
        let report = self.fenced(&self.inner.sql.complete, token, ids).await?;
        self.note_removed(usize::try_from(report.applied).unwrap_or(usize::MAX));
        Ok(report)
    }

    async fn fail(
        &self,
        token: FencingToken,
        failures: &[Failure],
    ) -> Result<FenceReport, StoreError> {
        if failures.is_empty() {
            return Ok(FenceReport::default());
        }
        let n = failures.len();
        let mut ids = Vec::with_capacity(n);
        let mut delays = Vec::with_capacity(n);
        let mut dead = Vec::with_capacity(n);
        let mut codes = Vec::with_capacity(n);
        let mut messages = Vec::with_capacity(n);
        for f in failures {
            ids.push(f.id.as_uuid());
            match &f.disposition {
                Disposition::Retry { delay } => {
                    delays.push(micros(*delay)?);
                    dead.push(false);
                }
                Disposition::Dead => {
                    delays.push(0);
                    dead.push(true);
                }
            }
            codes.push(f.error.code().as_str().to_owned());
            messages.push(f.error.message().to_owned());
        }
        let applied: Vec<Uuid> = sqlx::query_scalar(&self.inner.sql.fail)
            .bind(token.as_uuid())
            .bind(ids)
            .bind(delays)
            .bind(dead)
            .bind(codes)
            .bind(messages)
            .fetch_all(&self.inner.pool)
            .await?;
        let all: Vec<EventId> = failures.iter().map(|f| f.id).collect();
        Ok(fence_report(&all, applied))
    }

    async fn release(
        &self,
        token: FencingToken,
        ids: &[EventId],
    ) -> Result<FenceReport, StoreError> {
        self.fenced(&self.inner.sql.release, token, ids).await
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let row = sqlx::query(&self.inner.sql.stats)
            .fetch_one(&self.inner.pool)
            .await?;
        Ok(Stats {
            pending: count(row.try_get(0)?),
            in_flight: count(row.try_get(1)?),
            oldest_pending_age: age(row.try_get(2)?),
            dead: count(row.try_get(3)?),
        })
    }

    fn wakeup(&self) -> Option<Arc<Notify>> {
        self.inner.wakeup.clone()
    }
}

impl DeadLetterStore for PgStore {
    type Error = StoreError;

    async fn list_dead(&self, query: &DeadLetterQuery) -> Result<Vec<DeadLetter>, StoreError> {
        let rows = sqlx::query(&self.inner.sql.list_dead)
            .bind(query.code.as_ref().map(|c| c.as_str().to_owned()))
            .bind(query.after.map(|id| id.as_uuid()))
            .bind(i64::from(query.limit))
            .fetch_all(&self.inner.pool)
            .await?;
        rows.iter()
            .map(|row| {
                let event = event_from(row)?;
                let dead_at: DateTime<Utc> = row.try_get(8)?;
                Ok(DeadLetter::new(event, dead_at))
            })
            .collect()
    }

    async fn retry_dead(&self, ids: Option<&[EventId]>) -> Result<u64, StoreError> {
        let moved = sqlx::query(&self.inner.sql.retry_dead)
            .bind(ids.map(uuids))
            .execute(&self.inner.pool)
            .await?
            .rows_affected();
        if moved > 0 {
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(self.inner.outbox.channel())
                .execute(&self.inner.pool)
                .await?;
        }
        Ok(moved)
    }

    async fn purge_dead(&self, ids: Option<&[EventId]>) -> Result<u64, StoreError> {
        Ok(sqlx::query(&self.inner.sql.purge_dead)
            .bind(ids.map(uuids))
            .execute(&self.inner.pool)
            .await?
            .rows_affected())
    }
}
