//! [`SqliteStore`]: the `Store` and `DeadLetterStore` implementations.

use crate::migrate::{self, AppliedMigration};
use crate::sql::{
    event_from_row, millis, now_ms, placeholders, time_from_ms, EVENT_COLUMNS, ID_CHUNK,
};
use crate::SqliteStoreError;
use chrono::{DateTime, Utc};
use outbox_core::{
    Claim, ClaimRequest, DeadLetter, DeadLetterQuery, DeadLetterStore, Disposition, EventId,
    Failure, FenceReport, FencingToken, Stats, Store,
};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Row, Sqlite, Transaction};
use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;
use uuid::Uuid;

/// How long a connection waits for another writer before `SQLITE_BUSY`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

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
/// of the same key is still in the table and not claimable now (leased by
/// someone else or waiting for a retry): per-key order.
const CLAIM_SQL: &str = concat!(
    "UPDATE outbox_events SET locked_by = ?, lease_token = ?, locked_until = ",
    now_ms!(),
    " + ?, attempts = attempts + 1 \
     WHERE id IN (\
       SELECT e.id FROM outbox_events AS e \
       WHERE ",
    claimable!("e"),
    " AND e.key_hash % ? = ? \
         AND (e.key IS NULL OR NOT EXISTS (\
           SELECT 1 FROM outbox_events AS p \
           WHERE p.key = e.key AND p.id < e.id AND NOT ",
    claimable!("p"),
    ")) \
       ORDER BY e.id LIMIT ?) \
     RETURNING id, key, event_type, topic, payload, headers, created_at, attempts, \
       next_attempt_at, last_error_code, last_error_message, locked_until"
);

/// A [`Store`] and [`DeadLetterStore`] on SQLite.
///
/// Cheap to clone (it wraps a connection pool). `Debug` shows pool sizes
/// only, never the database path or URL.
#[derive(Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("connections", &self.pool.size())
            .field("idle", &self.pool.num_idle())
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// The claim statement, for review and `EXPLAIN QUERY PLAN`. Binds, in
    /// order: relay id, fencing token, lease in ms, shard total, shard index,
    /// batch size.
    pub const CLAIM_SQL: &'static str = CLAIM_SQL;

    /// Opens (creating the file if missing) the database at `url`, e.g.
    /// `sqlite://outbox.db` or `sqlite:///var/lib/app/app.db`, with WAL
    /// journaling, `synchronous = NORMAL`, a busy timeout and foreign keys on.
    /// Does not migrate: call [`Self::migrate`].
    pub async fn connect(url: &str) -> Result<Self, SqliteStoreError> {
        let options = SqliteConnectOptions::from_str(url)?;
        Self::connect_with(options).await
    }

    /// [`Self::connect`] with options built by the caller; the store still
    /// turns on `create_if_missing`, WAL, the busy timeout and foreign keys.
    pub async fn connect_with(options: SqliteConnectOptions) -> Result<Self, SqliteStoreError> {
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await?;
        Ok(Self { pool })
    }

    /// Wraps a pool the application already has (the same one it enqueues with).
    pub fn from_pool(pool: SqlitePool) -> Self {
        Self { pool }
    }

    /// The connection pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Creates or upgrades the outbox tables. Idempotent; safe to call from
    /// several processes at once. Returns the versions it applied (empty when
    /// up to date). Fails with [`SqliteStoreError::ChecksumMismatch`] when an
    /// applied migration differs from this build's.
    pub async fn migrate(&self) -> Result<Vec<i64>, SqliteStoreError> {
        migrate::run(&self.pool).await
    }

    /// The applied outbox migrations, oldest first.
    pub async fn applied_migrations(&self) -> Result<Vec<AppliedMigration>, SqliteStoreError> {
        migrate::applied(&self.pool).await
    }

    async fn now_plus(&self, ms: i64) -> Result<DateTime<Utc>, SqliteStoreError> {
        let at: i64 = sqlx::query_scalar(concat!("SELECT ", now_ms!(), " + ?"))
            .bind(ms)
            .fetch_one(&self.pool)
            .await?;
        DateTime::<Utc>::from_timestamp_millis(at).ok_or_else(|| SqliteStoreError::Corrupt {
            id: EventId::from_uuid(Uuid::nil()),
            column: "now",
            reason: format!("database clock returned {at}"),
        })
    }

    /// Runs `UPDATE/DELETE ... WHERE lease_token = ? AND id IN (...) RETURNING id`
    /// over chunks of `ids` and reports which ids it did not touch.
    async fn fenced_by_ids(
        &self,
        head: &str,
        token: FencingToken,
        ids: &[EventId],
    ) -> Result<FenceReport, SqliteStoreError> {
        let mut done = HashSet::with_capacity(ids.len());
        for chunk in ids.chunks(ID_CHUNK) {
            let sql = format!(
                "{head} WHERE lease_token = ? AND id IN ({}) RETURNING id",
                placeholders(chunk.len())
            );
            let mut q = sqlx::query_scalar::<_, Uuid>(&sql).bind(token.as_uuid());
            for id in chunk {
                q = q.bind(id.as_uuid());
            }
            done.extend(q.fetch_all(&self.pool).await?);
        }
        Ok(report(ids, &done))
    }
}

fn report(ids: &[EventId], done: &HashSet<Uuid>) -> FenceReport {
    let mut seen = HashSet::with_capacity(ids.len());
    let lost = ids
        .iter()
        .filter(|id| !done.contains(&id.as_uuid()) && seen.insert(**id))
        .copied()
        .collect();
    FenceReport {
        applied: done.len() as u64,
        lost,
    }
}

/// Schedules retries: one `UPDATE ... FROM (VALUES ...)` per chunk.
async fn fail_retry(
    tx: &mut Transaction<'static, Sqlite>,
    token: FencingToken,
    retries: &[(&Failure, Duration)],
    done: &mut HashSet<Uuid>,
) -> Result<(), SqliteStoreError> {
    for chunk in retries.chunks(ID_CHUNK / 4) {
        let values = vec!["(?, ?, ?, ?)"; chunk.len()].join(", ");
        let sql = format!(
            "WITH f(f_id, f_delay, f_code, f_message) AS (VALUES {values}) \
             UPDATE outbox_events SET locked_by = NULL, locked_until = NULL, lease_token = NULL, \
               next_attempt_at = {now} + f.f_delay, last_error_code = f.f_code, \
               last_error_message = f.f_message \
             FROM f WHERE outbox_events.id = f.f_id AND outbox_events.lease_token = ? \
             RETURNING id",
            now = now_ms!()
        );
        let mut q = sqlx::query_scalar::<_, Uuid>(&sql);
        for (failure, delay) in chunk {
            q = q
                .bind(failure.id.as_uuid())
                .bind(millis(*delay))
                .bind(failure.error.code().as_str().to_owned())
                .bind(failure.error.message().to_owned());
        }
        done.extend(q.bind(token.as_uuid()).fetch_all(&mut **tx).await?);
    }
    Ok(())
}

/// Moves events to the dead letters: `INSERT ... SELECT` then `DELETE`, per chunk.
async fn fail_dead(
    tx: &mut Transaction<'static, Sqlite>,
    token: FencingToken,
    dead: &[&Failure],
    done: &mut HashSet<Uuid>,
) -> Result<(), SqliteStoreError> {
    for chunk in dead.chunks(ID_CHUNK / 3) {
        let values = vec!["(?, ?, ?)"; chunk.len()].join(", ");
        let sql = format!(
            "WITH f(f_id, f_code, f_message) AS (VALUES {values}) \
             INSERT INTO outbox_dead_letters (id, key, key_hash, event_type, topic, payload, \
               headers, created_at, attempts, next_attempt_at, last_error_code, \
               last_error_message, dead_at) \
             SELECT e.id, e.key, e.key_hash, e.event_type, e.topic, e.payload, e.headers, \
               e.created_at, e.attempts, e.next_attempt_at, f.f_code, f.f_message, {now} \
             FROM outbox_events AS e JOIN f ON e.id = f.f_id WHERE e.lease_token = ?",
            now = now_ms!()
        );
        let mut q = sqlx::query(&sql);
        for failure in chunk {
            q = q
                .bind(failure.id.as_uuid())
                .bind(failure.error.code().as_str().to_owned())
                .bind(failure.error.message().to_owned());
        }
        q.bind(token.as_uuid()).execute(&mut **tx).await?;

        let sql = format!(
            "DELETE FROM outbox_events WHERE lease_token = ? AND id IN ({}) RETURNING id",
            placeholders(chunk.len())
        );
        let mut q = sqlx::query_scalar::<_, Uuid>(&sql).bind(token.as_uuid());
        for failure in chunk {
            q = q.bind(failure.id.as_uuid());
        }
        done.extend(q.fetch_all(&mut **tx).await?);
    }
    Ok(())
}

impl Store for SqliteStore {
    type Error = SqliteStoreError;

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, SqliteStoreError> {
        let token = FencingToken::new();
        let lease_ms = millis(req.lease);
        let rows = sqlx::query(CLAIM_SQL)
            .bind(req.relay_id.as_str())
            .bind(token.as_uuid())
            .bind(lease_ms)
            .bind(i64::from(req.shard.total()))
            .bind(i64::from(req.shard.index()))
            .bind(i64::from(req.batch_size))
            .fetch_all(&self.pool)
            .await?;
        let mut lease_until = None;
        let mut events = Vec::with_capacity(rows.len());
        for row in &rows {
            let event = event_from_row(row)?;
            if lease_until.is_none() {
                lease_until = Some(time_from_ms(
                    event.id,
                    "locked_until",
                    row.try_get("locked_until")?,
                )?);
            }
            events.push(event);
        }
        // RETURNING order is unspecified: restore oldest first.
        events.sort_by_key(|e| e.id);
        let lease_until = match lease_until {
            Some(t) => t,
            None => self.now_plus(lease_ms).await?,
        };
        tracing::debug!(relay = %req.relay_id, shard = %req.shard, claimed = events.len(), %token, "claimed outbox events");
        Ok(Claim {
            token,
            lease_until,
            events,
        })
    }

    async fn complete(
        &self,
        token: FencingToken,
        ids: &[EventId],
    ) -> Result<FenceReport, SqliteStoreError> {
        self.fenced_by_ids("DELETE FROM outbox_events", token, ids)
            .await
    }

    async fn fail(
        &self,
        token: FencingToken,
        failures: &[Failure],
    ) -> Result<FenceReport, SqliteStoreError> {
        if failures.is_empty() {
            return Ok(FenceReport::default());
        }
        // One disposition per id: the first one given wins.
        let mut seen = HashSet::with_capacity(failures.len());
        let mut retries = Vec::new();
        let mut dead = Vec::new();
        for failure in failures {
            if !seen.insert(failure.id) {
                continue;
            }
            match &failure.disposition {
                Disposition::Retry { delay } => retries.push((failure, *delay)),
                Disposition::Dead => dead.push(failure),
            }
        }
        let mut done = HashSet::with_capacity(failures.len());
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        fail_retry(&mut tx, token, &retries, &mut done).await?;
        fail_dead(&mut tx, token, &dead, &mut done).await?;
        tx.commit().await?;
        let ids: Vec<EventId> = failures.iter().map(|f| f.id).collect();
        Ok(report(&ids, &done))
    }

    async fn release(
        &self,
        token: FencingToken,
        ids: &[EventId],
    ) -> Result<FenceReport, SqliteStoreError> {
        self.fenced_by_ids(
            "UPDATE outbox_events SET locked_by = NULL, locked_until = NULL, lease_token = NULL, \
             attempts = MAX(attempts - 1, 0)",
            token,
            ids,
        )
        .await
    }

    async fn stats(&self) -> Result<Stats, SqliteStoreError> {
        let row = sqlx::query(concat!(
            "SELECT (SELECT COUNT(*) FROM outbox_events) AS total, \
               (SELECT COUNT(*) FROM outbox_events WHERE locked_until > ",
            now_ms!(),
            ") AS in_flight, \
               (SELECT COUNT(*) FROM outbox_dead_letters) AS dead, \
               (SELECT MIN(created_at) FROM outbox_events) AS oldest, ",
            now_ms!(),
            " AS now"
        ))
        .fetch_one(&self.pool)
        .await?;
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

impl DeadLetterStore for SqliteStore {
    type Error = SqliteStoreError;

    async fn list_dead(
        &self,
        query: &DeadLetterQuery,
    ) -> Result<Vec<DeadLetter>, SqliteStoreError> {
        let mut sql =
            format!("SELECT {EVENT_COLUMNS}, dead_at FROM outbox_dead_letters WHERE 1 = 1");
        if query.after.is_some() {
            sql.push_str(" AND id > ?");
        }
        if query.code.is_some() {
            sql.push_str(" AND last_error_code = ?");
        }
        sql.push_str(" ORDER BY id LIMIT ?");
        let mut q = sqlx::query(&sql);
        if let Some(after) = query.after {
            q = q.bind(after.as_uuid());
        }
        if let Some(code) = &query.code {
            q = q.bind(code.as_str().to_owned());
        }
        let rows = q.bind(i64::from(query.limit)).fetch_all(&self.pool).await?;
        rows.iter()
            .map(|row| {
                let event = event_from_row(row)?;
                let dead_at = time_from_ms(event.id, "dead_at", row.try_get("dead_at")?)?;
                Ok(DeadLetter::new(event, dead_at))
            })
            .collect()
    }

    async fn retry_dead(&self, ids: Option<&[EventId]>) -> Result<u64, SqliteStoreError> {
        let insert = concat!(
            "INSERT INTO outbox_events (id, key, key_hash, event_type, topic, payload, headers, \
               created_at, attempts, next_attempt_at, last_error_code, last_error_message) \
             SELECT id, key, key_hash, event_type, topic, payload, headers, created_at, 0, ",
            now_ms!(),
            ", last_error_code, last_error_message FROM outbox_dead_letters"
        );
        let delete = "DELETE FROM outbox_dead_letters";
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut moved = 0;
        match ids {
            None => {
                moved += sqlx::query(insert).execute(&mut *tx).await?.rows_affected();
                sqlx::query(delete).execute(&mut *tx).await?;
            }
            Some(ids) => {
                for chunk in ids.chunks(ID_CHUNK) {
                    let filter = format!(" WHERE id IN ({})", placeholders(chunk.len()));
                    for (sql, count) in [(insert, true), (delete, false)] {
                        let sql = format!("{sql}{filter}");
                        let mut q = sqlx::query(&sql);
                        for id in chunk {
                            q = q.bind(id.as_uuid());
                        }
                        let n = q.execute(&mut *tx).await?.rows_affected();
                        if count {
                            moved += n;
                        }
                    }
                }
            }
        }
        tx.commit().await?;
        tracing::info!(moved, "retried dead letters");
        Ok(moved)
    }

    async fn purge_dead(&self, ids: Option<&[EventId]>) -> Result<u64, SqliteStoreError> {
        let purged = match ids {
            None => sqlx::query("DELETE FROM outbox_dead_letters")
                .execute(&self.pool)
                .await?
                .rows_affected(),
            Some(ids) => {
                let mut n = 0;
                for chunk in ids.chunks(ID_CHUNK) {
                    let sql = format!(
                        "DELETE FROM outbox_dead_letters WHERE id IN ({})",
                        placeholders(chunk.len())
                    );
                    let mut q = sqlx::query(&sql);
                    for id in chunk {
                        q = q.bind(id.as_uuid());
                    }
                    n += q.execute(&self.pool).await?.rows_affected();
                }
                n
            }
        };
        tracing::info!(purged, "purged dead letters");
        Ok(purged)
    }
}
