//! [`SqliteInbox`]: the inbox in the consumer's SQLite database.
//!
//! Tables (names start with a validated prefix, `outbox_` by default):
//! `{prefix}inbox_records_0` .. `_7` (the dedup records, one table per
//! retention slot: emptying one is a `DELETE` without `WHERE`, which SQLite
//! runs as a truncate, no per-row cost), `{prefix}inbox_pending` (held-back
//! messages) and `{prefix}inbox_settings` (the slot length). Every
//! transaction is `BEGIN IMMEDIATE`: SQLite has one writer, and taking the
//! write lock at the start means a transaction never fails half-way on
//! `SQLITE_BUSY` when another writer got there first.

use crate::common::{check_consumer, hold_parts};
use crate::handler::Failure;
use crate::retention::{may_empty_next, next_slot, Retention, SlotClock};
use crate::store::{
    Hold, InboxDeadLetterStore, InboxRetentionStore, InboxSchema, InboxStore, Pending,
    PendingCounts, PendingState, RetentionReport, StoreError, Verdict, RETENTION_SLOTS,
};
use chrono::{DateTime, Utc};
use outbox_core::{
    DeadLetterFilter, ErrorCode, EventId, InboundMessage, WireFormat, MAX_DEAD_LETTER_AGE,
};
use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::{Row, Sqlite, Transaction};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// SQLite's clock in milliseconds since the Unix epoch.
const NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";

/// The inbox on SQLite: a pool on the consumer's database, the table
/// prefix, the consumer name and the retention window.
#[derive(Clone)]
pub struct SqliteInbox {
    inner: Arc<Inner>,
}

struct Inner {
    pool: SqlitePool,
    prefix: String,
    consumer: String,
    retention: Retention,
    clock: SlotClock,
}

impl fmt::Debug for SqliteInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteInbox")
            .field("prefix", &self.inner.prefix)
            .field("consumer", &self.inner.consumer)
            .field("retention", &self.inner.retention.window())
            .finish_non_exhaustive()
    }
}

impl SqliteInbox {
    /// The inbox of `consumer` with tables prefixed `outbox_` and the
    /// default 7-day retention window.
    pub fn new(pool: SqlitePool, consumer: impl Into<String>) -> Result<Self, StoreError> {
        Self::build(
            pool,
            "outbox_".to_owned(),
            consumer.into(),
            Retention::default(),
            SlotClock::new(),
        )
    }

    /// The same inbox with another table prefix (letters, digits, `_`).
    pub fn with_prefix(self, prefix: impl Into<String>) -> Result<Self, StoreError> {
        let i = &self.inner;
        Self::build(
            i.pool.clone(),
            prefix.into(),
            i.consumer.clone(),
            i.retention,
            i.clock.clone(),
        )
    }

    /// The same inbox with another retention window.
    pub fn with_retention(self, retention: Retention) -> Result<Self, StoreError> {
        let i = &self.inner;
        Self::build(
            i.pool.clone(),
            i.prefix.clone(),
            i.consumer.clone(),
            retention,
            i.clock.clone(),
        )
    }

    /// The same inbox placing records in slots by `clock` (a test hook:
    /// [`SlotClock`] shifts the database's clock to put a transaction on
    /// either side of a slot boundary; production never needs it).
    pub fn with_slot_clock(self, clock: SlotClock) -> Self {
        let i = &self.inner;
        Self {
            inner: Arc::new(Inner {
                pool: i.pool.clone(),
                prefix: i.prefix.clone(),
                consumer: i.consumer.clone(),
                retention: i.retention,
                clock,
            }),
        }
    }

    fn build(
        pool: SqlitePool,
        prefix: String,
        consumer: String,
        retention: Retention,
        clock: SlotClock,
    ) -> Result<Self, StoreError> {
        let longest = format!("{prefix}inbox_settings");
        outbox_core::ident::checked(longest)
            .map_err(|e| StoreError::Config(format!("inbox table prefix: {e}")))?;
        if prefix.to_ascii_lowercase().starts_with("sqlite_") {
            return Err(StoreError::Config(format!(
                "inbox table prefix {prefix:?}: names starting with \"sqlite_\" are reserved by SQLite"
            )));
        }
        check_consumer(&consumer)?;
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                prefix,
                consumer,
                retention,
                clock,
            }),
        })
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.inner.pool
    }

    fn t(&self, table: &str) -> String {
        format!("\"{}{table}\"", self.inner.prefix)
    }

    fn records(&self, slot: i64) -> String {
        self.t(&format!("inbox_records_{slot}"))
    }

    async fn current_slot(&self, conn: &mut sqlx::SqliteConnection) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(&format!(
            "SELECT (({NOW_MS} + {off}) / {len}) % {RETENTION_SLOTS}",
            off = self.inner.clock.offset_ms(),
            len = self.inner.retention.slot_millis(),
        ))
        .fetch_one(conn)
        .await?)
    }

    /// The current slot and how far into it the clock is (milliseconds).
    async fn clock(&self, conn: &mut sqlx::SqliteConnection) -> Result<(i64, i64), StoreError> {
        let len = self.inner.retention.slot_millis();
        Ok(sqlx::query_as(&format!(
            "SELECT (ms / {len}) % {RETENTION_SLOTS}, ms % {len} FROM (SELECT {NOW_MS} + {off} AS ms)",
            off = self.inner.clock.offset_ms(),
        ))
        .fetch_one(conn)
        .await?)
    }

    /// Whether `id` has a record in any slot or is held back.
    async fn seen(&self, conn: &mut sqlx::SqliteConnection, id: &str) -> Result<bool, StoreError> {
        let mut parts: Vec<String> = (0..i64::from(RETENTION_SLOTS))
            .map(|s| {
                format!(
                    "EXISTS (SELECT 1 FROM {} WHERE consumer = ?1 AND event_id = ?2)",
                    self.records(s)
                )
            })
            .collect();
        parts.push(format!(
            "EXISTS (SELECT 1 FROM {} WHERE consumer = ?1 AND event_id = ?2)",
            self.t("inbox_pending")
        ));
        Ok(
            sqlx::query_scalar(&format!("SELECT {}", parts.join(" OR ")))
                .bind(&self.inner.consumer)
                .bind(id)
                .fetch_one(conn)
                .await?,
        )
    }

    async fn insert_record(
        &self,
        conn: &mut sqlx::SqliteConnection,
        slot: i64,
        id: &str,
    ) -> Result<bool, StoreError> {
        let n = sqlx::query(&format!(
            "INSERT OR IGNORE INTO {} (consumer, event_id, handled_at) VALUES (?1, ?2, {NOW_MS})",
            self.records(slot)
        ))
        .bind(&self.inner.consumer)
        .bind(id)
        .execute(conn)
        .await?
        .rows_affected();
        Ok(n > 0)
    }

    #[allow(clippy::too_many_arguments)]
    async fn insert_pending(
        &self,
        conn: &mut sqlx::SqliteConnection,
        m: &InboundMessage,
        state: PendingState,
        attempts: u32,
        delay_ms: i64,
        failure: Option<&Failure>,
    ) -> Result<(), StoreError> {
        let headers = serde_json::to_string(&m.headers)
            .map_err(|e| StoreError::Corrupt(format!("headers do not serialise: {e}")))?;
        sqlx::query(&format!(
            "INSERT OR IGNORE INTO {} (consumer, event_id, order_key, event_key, event_type, topic, \
             content_type, payload, headers, created_at, wire_format, state, attempts, \
             next_attempt_at, held_at, last_error_code, last_error_message) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, {NOW_MS} + ?14, {NOW_MS}, ?15, ?16)",
            self.t("inbox_pending")
        ))
        .bind(&self.inner.consumer)
        .bind(m.id.to_string())
        .bind(m.order_key())
        .bind(m.key.as_deref())
        .bind(&m.event_type)
        .bind(&m.topic)
        .bind(&m.content_type)
        .bind(&m.payload)
        .bind(headers)
        .bind(m.created_at.map(|t| t.timestamp_millis()))
        .bind(m.format.as_str())
        .bind(state.as_str())
        .bind(i64::from(attempts))
        .bind(delay_ms)
        .bind(failure.map(|f| f.code.as_str().to_owned()))
        .bind(failure.map(|f| f.message.clone()))
        .execute(conn)
        .await?;
        Ok(())
    }

    /// The dead letters of the consumer (the first `?`) that `filter`
    /// selects, with a `?` for every criterion set, bound by
    /// [`SqliteInbox::bind_dead_filter`] in the same order (as outbox-sqlite
    /// builds its dead-letter filter). A dead letter's age runs from its
    /// `next_attempt_at`, which holds the time it was dead-lettered.
    fn dead_where(filter: &DeadLetterFilter) -> String {
        let mut sql = String::from("consumer = ? AND state = 'dead'");
        for (set, cond) in [
            (
                filter.event_type.is_some(),
                " AND event_type = ?".to_owned(),
            ),
            (filter.code.is_some(), " AND last_error_code = ?".to_owned()),
            (filter.key.is_some(), " AND event_key = ?".to_owned()),
            (
                filter.older_than.is_some(),
                format!(" AND next_attempt_at <= {NOW_MS} - ?"),
            ),
            (
                filter.newer_than.is_some(),
                format!(" AND next_attempt_at > {NOW_MS} - ?"),
            ),
        ] {
            if set {
                sql.push_str(&cond);
            }
        }
        if let Some(ids) = &filter.ids {
            if ids.is_empty() {
                // An empty id list selects nothing.
                sql.push_str(" AND 0");
            } else {
                let marks = vec!["?"; ids.len()].join(", ");
                sql.push_str(&format!(" AND event_id IN ({marks})"));
            }
        }
        sql
    }

    /// Runs `statement` (an UPDATE or DELETE of `inbox_pending`) on the
    /// dead letters `filter` selects; the rows it changed.
    async fn on_dead(&self, statement: &str, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let sql = format!("{statement} WHERE {}", Self::dead_where(filter));
        Ok(self
            .bind_dead_filter(&sql, filter)
            .execute(&self.inner.pool)
            .await?
            .rows_affected())
    }

    /// `sql` with the consumer and the values of [`SqliteInbox::dead_where`]
    /// bound.
    fn bind_dead_filter<'q>(
        &'q self,
        sql: &'q str,
        filter: &'q DeadLetterFilter,
    ) -> sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments<'q>> {
        let age =
            |d: Duration| i64::try_from(d.min(MAX_DEAD_LETTER_AGE).as_millis()).unwrap_or(i64::MAX);
        let mut q = sqlx::query(sql).bind(&self.inner.consumer);
        if let Some(t) = &filter.event_type {
            q = q.bind(t.as_str());
        }
        if let Some(c) = &filter.code {
            q = q.bind(c.as_str());
        }
        if let Some(k) = &filter.key {
            q = q.bind(k.as_str());
        }
        for d in [filter.older_than, filter.newer_than].into_iter().flatten() {
            q = q.bind(age(d));
        }
        for id in filter.ids.iter().flatten() {
            q = q.bind(id.to_string());
        }
        q
    }
}

const PENDING_COLUMNS: &str =
    "seq, event_id, event_key, event_type, topic, content_type, payload, \
     headers, created_at, wire_format, state, attempts, next_attempt_at, held_at, last_error_code, \
     last_error_message";

fn ms(t: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(t).unwrap_or_default()
}

fn pending_from_row(row: &SqliteRow) -> Result<Pending, StoreError> {
    let headers: String = row.try_get("headers")?;
    let headers: BTreeMap<String, String> = serde_json::from_str(&headers)
        .map_err(|e| StoreError::Corrupt(format!("pending headers: {e}")))?;
    let state: String = row.try_get("state")?;
    let format: String = row.try_get("wire_format")?;
    let id: String = row.try_get("event_id")?;
    let attempts: i64 = row.try_get("attempts")?;
    let code: Option<String> = row.try_get("last_error_code")?;
    let msg: Option<String> = row.try_get("last_error_message")?;
    Ok(Pending {
        seq: row.try_get("seq")?,
        message: InboundMessage {
            id: id
                .parse()
                .map_err(|_| StoreError::Corrupt(format!("pending event id {id:?}")))?,
            key: row.try_get("event_key")?,
            event_type: row.try_get("event_type")?,
            topic: row.try_get("topic")?,
            content_type: row.try_get("content_type")?,
            payload: row.try_get("payload")?,
            headers,
            created_at: row.try_get::<Option<i64>, _>("created_at")?.map(ms),
            attempt: None,
            format: format.parse().unwrap_or(WireFormat::Headers),
        },
        state: PendingState::parse(&state)
            .ok_or_else(|| StoreError::Corrupt(format!("pending state {state:?}")))?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        next_attempt_at: ms(row.try_get("next_attempt_at")?),
        held_at: ms(row.try_get("held_at")?),
        last_error: code.map(|c| (ErrorCode::new(c), msg.unwrap_or_default())),
    })
}

impl InboxStore for SqliteInbox {
    type Db = Sqlite;
    type Error = StoreError;

    fn consumer(&self) -> &str {
        &self.inner.consumer
    }

    async fn begin(&self) -> Result<Transaction<'static, Sqlite>, StoreError> {
        Ok(self.inner.pool.begin_with("BEGIN IMMEDIATE").await?)
    }

    async fn admit(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        messages: &[InboundMessage],
        block_on_dead: bool,
    ) -> Result<Vec<Verdict>, StoreError> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let slot = self.current_slot(tx).await?;
        let held_sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE consumer = ?1 AND order_key = ?2 AND (?3 OR state <> 'dead'))",
            self.t("inbox_pending")
        );
        let mut held: HashMap<String, bool> = HashMap::new();
        let mut verdicts = Vec::with_capacity(messages.len());
        for m in messages {
            let key = m.order_key();
            let is_held = match held.get(&key) {
                Some(h) => *h,
                None => {
                    let h: bool = sqlx::query_scalar(&held_sql)
                        .bind(&self.inner.consumer)
                        .bind(&key)
                        .bind(block_on_dead)
                        .fetch_one(&mut **tx)
                        .await?;
                    held.insert(key, h);
                    h
                }
            };
            if is_held {
                self.insert_pending(tx, m, PendingState::Parked, 0, 0, None)
                    .await?;
                verdicts.push(Verdict::Parked);
                continue;
            }
            let id = m.id.to_string();
            if self.seen(tx, &id).await? {
                verdicts.push(Verdict::Duplicate);
            } else if self.insert_record(tx, slot, &id).await? {
                verdicts.push(Verdict::New);
            } else {
                verdicts.push(Verdict::Duplicate);
            }
        }
        Ok(verdicts)
    }

    async fn hold(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        message: &InboundMessage,
        hold: &Hold,
    ) -> Result<(), StoreError> {
        let (state, attempts, delay_ms, failure) = hold_parts(hold);
        self.insert_pending(tx, message, state, attempts, delay_ms, Some(failure))
            .await
    }

    async fn due(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        limit: u32,
        block_on_dead: bool,
    ) -> Result<Vec<Pending>, StoreError> {
        let sql = format!(
            "SELECT {PENDING_COLUMNS} FROM {p} AS h WHERE h.consumer = ?1 AND h.state <> 'dead' \
             AND h.next_attempt_at <= {NOW_MS} AND NOT EXISTS (SELECT 1 FROM {p} AS b \
               WHERE b.consumer = h.consumer AND b.order_key = h.order_key AND b.seq < h.seq \
               AND (?3 OR b.state <> 'dead')) \
             ORDER BY h.seq LIMIT ?2",
            p = self.t("inbox_pending"),
        );
        let rows = sqlx::query(&sql)
            .bind(&self.inner.consumer)
            .bind(i64::from(limit))
            .bind(block_on_dead)
            .fetch_all(&mut **tx)
            .await?;
        rows.iter().map(pending_from_row).collect()
    }

    async fn complete(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        seq: i64,
        id: EventId,
    ) -> Result<bool, StoreError> {
        sqlx::query(&format!(
            "DELETE FROM {} WHERE consumer = ?1 AND seq = ?2",
            self.t("inbox_pending")
        ))
        .bind(&self.inner.consumer)
        .bind(seq)
        .execute(&mut **tx)
        .await?;
        let id = id.to_string();
        if self.seen(tx, &id).await? {
            return Ok(false);
        }
        let slot = self.current_slot(tx).await?;
        self.insert_record(tx, slot, &id).await
    }

    async fn fail(
        &self,
        tx: &mut Transaction<'static, Sqlite>,
        seq: i64,
        hold: &Hold,
    ) -> Result<(), StoreError> {
        let (state, attempts, delay_ms, failure) = hold_parts(hold);
        sqlx::query(&format!(
            "UPDATE {} SET state = ?3, attempts = ?4, next_attempt_at = {NOW_MS} + ?5, \
             last_error_code = ?6, last_error_message = ?7 WHERE consumer = ?1 AND seq = ?2",
            self.t("inbox_pending")
        ))
        .bind(&self.inner.consumer)
        .bind(seq)
        .bind(state.as_str())
        .bind(i64::from(attempts))
        .bind(delay_ms)
        .bind(failure.code.as_str())
        .bind(&failure.message)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

impl InboxSchema for SqliteInbox {
    type Error = StoreError;

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut ddl = vec![format!(
            "CREATE TABLE IF NOT EXISTS {} (slot_seconds INTEGER NOT NULL)",
            self.t("inbox_settings")
        )];
        for s in 0..i64::from(RETENTION_SLOTS) {
            ddl.push(format!(
                "CREATE TABLE IF NOT EXISTS {} (consumer TEXT NOT NULL, event_id TEXT NOT NULL, \
                 handled_at INTEGER NOT NULL, PRIMARY KEY (consumer, event_id)) WITHOUT ROWID",
                self.records(s)
            ));
        }
        ddl.push(format!(
            "CREATE TABLE IF NOT EXISTS {} (seq INTEGER PRIMARY KEY AUTOINCREMENT, consumer TEXT NOT NULL, \
             event_id TEXT NOT NULL, order_key TEXT NOT NULL, event_key TEXT, event_type TEXT NOT NULL, \
             topic TEXT NOT NULL, content_type TEXT NOT NULL, payload BLOB NOT NULL, headers TEXT NOT NULL, \
             created_at INTEGER, wire_format TEXT NOT NULL, \
             state TEXT NOT NULL CHECK (state IN ('retry', 'parked', 'dead')), \
             attempts INTEGER NOT NULL DEFAULT 0, next_attempt_at INTEGER NOT NULL, held_at INTEGER NOT NULL, \
             last_error_code TEXT, last_error_message TEXT, UNIQUE (consumer, event_id))",
            self.t("inbox_pending")
        ));
        ddl.push(format!(
            "CREATE INDEX IF NOT EXISTS \"{}inbox_pending_key\" ON {} (consumer, order_key, seq)",
            self.inner.prefix,
            self.t("inbox_pending")
        ));
        for stmt in ddl {
            sqlx::query(&stmt).execute(&mut *tx).await?;
        }
        let stored: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT slot_seconds FROM {}",
            self.t("inbox_settings")
        ))
        .fetch_optional(&mut *tx)
        .await?;
        let wanted = self.inner.retention.slot_seconds();
        match stored {
            None => {
                sqlx::query(&format!(
                    "INSERT INTO {} (slot_seconds) VALUES (?)",
                    self.t("inbox_settings")
                ))
                .bind(wanted)
                .execute(&mut *tx)
                .await?;
            }
            Some(have) if have != wanted => {
                return Err(StoreError::Config(format!(
                    "the inbox tables {}* keep records in slots of {have} s, this process was configured \
                     for {wanted} s (another retention window): use the same window everywhere",
                    self.inner.prefix
                )));
            }
            Some(_) => {}
        }
        tx.commit().await?;
        Ok(())
    }
}

impl InboxRetentionStore for SqliteInbox {
    type Error = StoreError;

    async fn retain(&self) -> Result<RetentionReport, StoreError> {
        // One writer: the clock is read inside the write transaction, so no
        // transaction writes into the slot after it meanwhile, and one that
        // started after a boundary has ended before the clock is read.
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        let (current, into) = self.clock(&mut tx).await?;
        let table = self.records(next_slot(current));
        let report = |emptied| RetentionReport {
            current_slot: u32::try_from(current).unwrap_or(0),
            emptied,
        };
        if !may_empty_next(&self.inner.retention, into) {
            // The slot after this one is about to be current: the next pass
            // empties the one after it.
            tx.rollback().await?;
            return Ok(report(false));
        }
        let any: bool = sqlx::query_scalar(&format!("SELECT EXISTS (SELECT 1 FROM {table})"))
            .fetch_one(&mut *tx)
            .await?;
        if !any {
            tx.rollback().await?;
            return Ok(report(false));
        }
        let window_ms = self.inner.retention.window_seconds().saturating_mul(1000);
        let young: bool = sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM {table} WHERE handled_at > {NOW_MS} - ?)"
        ))
        .bind(window_ms)
        .fetch_one(&mut *tx)
        .await?;
        if young {
            sqlx::query(&format!(
                "DELETE FROM {table} WHERE handled_at <= {NOW_MS} - ?"
            ))
            .bind(window_ms)
            .execute(&mut *tx)
            .await?;
        } else {
            // No WHERE: SQLite's truncate optimisation, no per-row cost.
            sqlx::query(&format!("DELETE FROM {table}"))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(report(true))
    }

    async fn is_recorded(&self, id: EventId) -> Result<bool, StoreError> {
        let id = id.to_string();
        let mut conn = self.inner.pool.acquire().await?;
        let parts: Vec<String> = (0..i64::from(RETENTION_SLOTS))
            .map(|s| {
                format!(
                    "EXISTS (SELECT 1 FROM {} WHERE consumer = ?1 AND event_id = ?2)",
                    self.records(s)
                )
            })
            .collect();
        Ok(
            sqlx::query_scalar(&format!("SELECT {}", parts.join(" OR ")))
                .bind(&self.inner.consumer)
                .bind(id)
                .fetch_one(&mut *conn)
                .await?,
        )
    }
}

impl InboxDeadLetterStore for SqliteInbox {
    type Error = StoreError;

    async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: u32,
    ) -> Result<Vec<Pending>, StoreError> {
        let sql = format!(
            "SELECT {PENDING_COLUMNS} FROM {} WHERE {} ORDER BY seq LIMIT ?",
            self.t("inbox_pending"),
            Self::dead_where(filter),
        );
        let rows = self
            .bind_dead_filter(&sql, filter)
            .bind(i64::from(limit))
            .fetch_all(&self.inner.pool)
            .await?;
        rows.iter().map(pending_from_row).collect()
    }

    async fn replay(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let update = format!(
            "UPDATE {} SET state = 'retry', attempts = 0, next_attempt_at = {NOW_MS}",
            self.t("inbox_pending"),
        );
        self.on_dead(&update, filter).await
    }

    async fn purge(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let delete = format!("DELETE FROM {}", self.t("inbox_pending"));
        self.on_dead(&delete, filter).await
    }

    async fn pending_counts(&self) -> Result<PendingCounts, StoreError> {
        let (r, p, d): (i64, i64, i64) = sqlx::query_as(&format!(
            "SELECT COALESCE(SUM(state = 'retry'), 0), COALESCE(SUM(state = 'parked'), 0), \
             COALESCE(SUM(state = 'dead'), 0) FROM {} WHERE consumer = ?",
            self.t("inbox_pending")
        ))
        .bind(&self.inner.consumer)
        .fetch_one(&self.inner.pool)
        .await?;
        let u = |n: i64| u64::try_from(n).unwrap_or(0);
        Ok(PendingCounts {
            retry: u(r),
            parked: u(p),
            dead: u(d),
        })
    }
}
