//! [`PgInbox`]: the inbox in the consumer's PostgreSQL database.
//!
//! Tables (in the inbox's schema, created by [`InboxSchema::migrate`]):
//! - `inbox_records`, partitioned by `slot` into `inbox_records_0` ..
//!   `inbox_records_7`, unique on (consumer, event id, slot): the dedup
//!   records. Per lane batch, one statement takes a transaction-scoped
//!   advisory lock per event id (sorted), and the next decides every
//!   message's [`Verdict`] and inserts the new records; the retention pass
//!   TRUNCATEs the slot that comes next ([`crate::retention`]).
//!
//! Two copies of one event handled at once meet on the advisory lock of
//! their id, whatever slot their transactions' clocks fall in: the second
//! waits until the first commits or rolls back, and its lookup, a later
//! statement in READ COMMITTED, sees the first's record (a duplicate) or
//! nothing (it applies the event). The slot partitions' unique index alone
//! cannot do it: copies in transactions started on either side of a slot
//! boundary insert into different partitions.
//! - `inbox_pending`: held-back messages, unique on (consumer, event id);
//!   the retry loop takes due heads with `FOR UPDATE SKIP LOCKED`, so several
//!   consumer processes share one inbox.
//! - `inbox_settings`: the slot length the records were written with, so a
//!   process started with another window is refused instead of mixing slots.

use crate::common::{check_consumer, hold_parts};
use crate::handler::Failure;
use crate::retention::{may_empty_next, next_slot, Retention, SlotClock};
use crate::store::{
    Hold, InboxDeadLetterStore, InboxRetentionStore, InboxSchema, InboxStore, Pending,
    PendingCounts, PendingState, RetentionReport, StoreError, Verdict, RETENTION_SLOTS,
};
use chrono::{DateTime, Utc};
use outbox_core::{
    DeadLetterFilter, ErrorCode, EventId, InboundMessage, Pooler, WireFormat, MAX_DEAD_LETTER_AGE,
};
use sqlx::postgres::{PgArguments, PgPool, PgRow};
use sqlx::{Postgres, Row, Transaction};
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// The inbox on PostgreSQL: a pool on the consumer's database, the schema
/// of the inbox tables, the consumer name and the retention window.
#[derive(Clone)]
pub struct PgInbox {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    schema: String,
    consumer: String,
    retention: Retention,
    clock: SlotClock,
    /// Retention passes in a row that found the next slot held by another
    /// session (see [`RETENTION_TRIES`]).
    held_passes: std::sync::atomic::AtomicU32,
    /// Statements unnamed: a pooler in transaction mode is in between.
    unnamed: bool,
}

impl fmt::Debug for PgInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgInbox")
            .field("schema", &self.inner.schema)
            .field("consumer", &self.inner.consumer)
            .field("retention", &self.inner.retention.window())
            .finish_non_exhaustive()
    }
}

impl PgInbox {
    /// The inbox of `consumer` in schema `outbox_inbox`, with the default
    /// 7-day retention window.
    pub fn new(pool: PgPool, consumer: impl Into<String>) -> Result<Self, StoreError> {
        Self::build(
            pool,
            "outbox_inbox".to_owned(),
            consumer.into(),
            Retention::default(),
            SlotClock::new(),
        )
    }

    /// The same inbox in another schema (a validated identifier).
    pub fn with_schema(self, schema: impl Into<String>) -> Result<Self, StoreError> {
        let i = &self.inner;
        Self::build(
            i.pool.clone(),
            schema.into(),
            i.consumer.clone(),
            i.retention,
            i.clock.clone(),
        )
        .map(|inbox| inbox.with_unnamed(i.unnamed))
    }

    /// The same inbox with another retention window (every process of one
    /// schema must use the same; [`InboxSchema::migrate`] refuses another).
    pub fn with_retention(self, retention: Retention) -> Result<Self, StoreError> {
        let i = &self.inner;
        Self::build(
            i.pool.clone(),
            i.schema.clone(),
            i.consumer.clone(),
            retention,
            i.clock.clone(),
        )
        .map(|inbox| inbox.with_unnamed(i.unnamed))
    }

    /// The same inbox placing records in slots by `clock` (a test hook:
    /// [`SlotClock`] shifts the database's clock to put a transaction on
    /// either side of a slot boundary; production never needs it).
    pub fn with_slot_clock(self, clock: SlotClock) -> Self {
        self.with_parts(clock, self.inner.unnamed)
    }

    /// The same inbox for a pool that reaches PostgreSQL through `pooler`.
    /// With [`Pooler::Transaction`] (PgBouncer's `pool_mode = transaction`)
    /// the inbox's statements are unnamed, parsed at each execution,
    /// because a statement left prepared on a server connection is another
    /// client's next; every one of them already runs inside a transaction.
    /// The handler's own statements in the transaction it is given need the
    /// same care (`sqlx::query(..).persistent(false)`). The other modes keep
    /// statements prepared (the inbox cannot see through the pool: `auto`
    /// is `none` here).
    pub fn with_pooler(self, pooler: Pooler) -> Self {
        self.with_unnamed(pooler == Pooler::Transaction)
    }

    fn with_unnamed(self, unnamed: bool) -> Self {
        self.with_parts(self.inner.clock.clone(), unnamed)
    }

    /// The same inbox with another slot clock and statement naming.
    fn with_parts(&self, clock: SlotClock, unnamed: bool) -> Self {
        let i = &self.inner;
        Self {
            inner: Arc::new(Inner {
                pool: i.pool.clone(),
                schema: i.schema.clone(),
                consumer: i.consumer.clone(),
                retention: i.retention,
                clock,
                held_passes: std::sync::atomic::AtomicU32::new(0),
                unnamed,
            }),
        }
    }

    /// Whether statements may stay prepared on the connection.
    fn prepared(&self) -> bool {
        !self.inner.unnamed
    }

    fn build(
        pool: PgPool,
        schema: String,
        consumer: String,
        retention: Retention,
        clock: SlotClock,
    ) -> Result<Self, StoreError> {
        let schema = outbox_core::ident::checked(schema)
            .map_err(|e| StoreError::Config(format!("inbox schema: {e}")))?;
        check_consumer(&consumer)?;
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                schema,
                consumer,
                retention,
                clock,
                held_passes: std::sync::atomic::AtomicU32::new(0),
                unnamed: false,
            }),
        })
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The schema.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    fn t(&self, table: &str) -> String {
        format!("\"{}\".\"{table}\"", self.inner.schema)
    }

    /// The slot of the database time `ts` (an SQL expression), by the
    /// inbox's [`SlotClock`].
    fn slot_at(&self, ts: &str) -> String {
        format!(
            "(((floor(extract(epoch FROM {ts}) * 1000)::bigint + {off}) / {len}) % {RETENTION_SLOTS})::smallint",
            off = self.inner.clock.offset_ms(),
            len = self.inner.retention.slot_millis(),
        )
    }

    /// The slot of the transaction's start.
    fn slot_expr(&self) -> String {
        self.slot_at("now()")
    }

    /// The clock read now (not at the transaction's start) by the inbox's
    /// [`SlotClock`], in milliseconds since the epoch: an SQL expression.
    fn clock_ms(&self) -> String {
        format!(
            "(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint + {})",
            self.inner.clock.offset_ms()
        )
    }

    /// Takes the transaction-scoped advisory lock of each event id of the
    /// batch, in the order of the lock keys (two batches sharing ids cannot
    /// deadlock on them), so that the copies of one event meet here whatever
    /// their slots. Refuses REPEATABLE READ: its snapshot, taken by this
    /// statement before it waits, would not show the record of the copy it
    /// waited for (SERIALIZABLE does not see it either, but its conflict
    /// detection aborts one of the two).
    async fn lock_ids(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        ids: &[Uuid],
    ) -> Result<(), StoreError> {
        let (isolation, _n): (String, i64) = sqlx::query_as(
            "SELECT current_setting('transaction_isolation'), count(pg_advisory_xact_lock(k)) \
             FROM (SELECT DISTINCT hashtextextended($1 || t.id::text, 0) AS k \
               FROM unnest($2::uuid[]) AS t(id) ORDER BY k) AS keys",
        )
        .persistent(self.prepared())
        .bind(format!(
            "outbox-inbox/{}/{}/",
            self.inner.schema, self.inner.consumer
        ))
        .bind(ids)
        .fetch_one(&mut **tx)
        .await?;
        if isolation == "repeatable read" {
            return Err(StoreError::Config(format!(
                "inbox transactions run at {isolation}: the inbox needs READ COMMITTED (or \
                 SERIALIZABLE) to deduplicate copies handled at once; set \
                 default_transaction_isolation for the inbox's connections"
            )));
        }
        Ok(())
    }

    async fn insert_pending(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        m: &InboundMessage,
        state: PendingState,
        attempts: u32,
        delay_ms: i64,
        failure: Option<&Failure>,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO {} (consumer, event_id, order_key, event_key, event_type, topic, \
             content_type, payload, headers, created_at, wire_format, state, attempts, \
             next_attempt_at, last_error_code, last_error_message) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, $11, $12, $13, \
             now() + make_interval(secs => $14::double precision / 1000), $15, $16) \
             ON CONFLICT (consumer, event_id) DO NOTHING",
            self.t("inbox_pending")
        );
        let headers = serde_json::to_string(&m.headers)
            .map_err(|e| StoreError::Corrupt(format!("headers do not serialise: {e}")))?;
        sqlx::query(&sql)
            .persistent(self.prepared())
            .bind(&self.inner.consumer)
            .bind(m.id.as_uuid())
            .bind(m.order_key())
            .bind(m.key.as_deref())
            .bind(&m.event_type)
            .bind(&m.topic)
            .bind(&m.content_type)
            .bind(&m.payload)
            .bind(headers)
            .bind(m.created_at)
            .bind(m.format.as_str())
            .bind(state.as_str())
            .bind(i32::try_from(attempts).unwrap_or(i32::MAX))
            .bind(delay_ms)
            .bind(failure.map(|f| f.code.as_str().to_owned()))
            .bind(failure.map(|f| f.message.clone()))
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// Runs `sql` (a replay or purge of the dead letters `filter` selects,
    /// by [`DEAD_WHERE`]) in a transaction of its own (through a pooler in
    /// transaction mode a statement outside one may be parsed and run on two
    /// connections); returns the rows it changed.
    async fn change_dead(&self, sql: &str, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let q = bind_dead_filter(
            sqlx::query(sql)
                .persistent(self.prepared())
                .bind(&self.inner.consumer),
            filter,
        );
        let mut tx = self.inner.pool.begin().await?;
        let done = q.execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok(done)
    }

    fn pending_columns() -> &'static str {
        "seq, event_id, event_key, event_type, topic, content_type, payload, headers::text AS headers, \
         created_at, wire_format, state, attempts, next_attempt_at, held_at, last_error_code, \
         last_error_message"
    }
}

/// The dead letters of the consumer `$1` that a [`DeadLetterFilter`]
/// selects, with its six parameters `$2` .. `$7` (bound by
/// [`bind_dead_filter`], in this order): ids, event type, error code, key,
/// older than (µs), newer than (µs). Every criterion is always bound (NULL
/// when unset), as outbox-postgres's dead-letter filter: one statement text
/// per operation, whatever the filter. A dead letter's age runs from its
/// `next_attempt_at`, which holds the time it was dead-lettered.
const DEAD_WHERE: &str = "consumer = $1 AND state = 'dead' \
     AND ($2::uuid[] IS NULL OR event_id = ANY($2)) \
     AND ($3::text IS NULL OR event_type = $3) \
     AND ($4::text IS NULL OR last_error_code = $4) \
     AND ($5::text IS NULL OR event_key = $5) \
     AND ($6::bigint IS NULL OR next_attempt_at <= now() - $6 * interval '1 microsecond') \
     AND ($7::bigint IS NULL OR next_attempt_at > now() - $7 * interval '1 microsecond')";

/// Binds the six parameters of [`DEAD_WHERE`].
fn bind_dead_filter<'q>(
    q: sqlx::query::Query<'q, Postgres, PgArguments>,
    f: &'q DeadLetterFilter,
) -> sqlx::query::Query<'q, Postgres, PgArguments> {
    let age = |d: Duration| {
        // Capped at 100 years: fits in i64 microseconds and in timestamptz.
        i64::try_from(d.min(MAX_DEAD_LETTER_AGE).as_micros()).unwrap_or(i64::MAX)
    };
    let ids = f
        .ids
        .as_deref()
        .map(|ids| ids.iter().map(EventId::as_uuid).collect::<Vec<Uuid>>());
    q.bind(ids)
        .bind(f.event_type.as_deref())
        .bind(f.code.as_ref().map(ErrorCode::as_str))
        .bind(f.key.as_deref())
        .bind(f.older_than.map(age))
        .bind(f.newer_than.map(age))
}

/// Reads a pending row back.
fn pending_from_row(row: &PgRow) -> Result<Pending, StoreError> {
    let headers: String = row.try_get("headers")?;
    let headers: BTreeMap<String, String> = serde_json::from_str(&headers)
        .map_err(|e| StoreError::Corrupt(format!("pending headers: {e}")))?;
    let state: String = row.try_get("state")?;
    let format: String = row.try_get("wire_format")?;
    let id: Uuid = row.try_get("event_id")?;
    let attempts: i32 = row.try_get("attempts")?;
    let code: Option<String> = row.try_get("last_error_code")?;
    let msg: Option<String> = row.try_get("last_error_message")?;
    Ok(Pending {
        seq: row.try_get("seq")?,
        message: InboundMessage {
            id: EventId::from(id),
            key: row.try_get("event_key")?,
            event_type: row.try_get("event_type")?,
            topic: row.try_get("topic")?,
            content_type: row.try_get("content_type")?,
            payload: row.try_get("payload")?,
            headers,
            created_at: row.try_get::<Option<DateTime<Utc>>, _>("created_at")?,
            attempt: None,
            format: format.parse().unwrap_or(WireFormat::Headers),
        },
        state: PendingState::parse(&state)
            .ok_or_else(|| StoreError::Corrupt(format!("pending state {state:?}")))?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        next_attempt_at: row.try_get("next_attempt_at")?,
        held_at: row.try_get("held_at")?,
        last_error: code.map(|c| (ErrorCode::new(c), msg.unwrap_or_default())),
    })
}

impl InboxStore for PgInbox {
    type Db = Postgres;
    type Error = StoreError;

    fn consumer(&self) -> &str {
        &self.inner.consumer
    }

    async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        Ok(self.inner.pool.begin().await?)
    }

    async fn admit(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        messages: &[InboundMessage],
        block_on_dead: bool,
    ) -> Result<Vec<Verdict>, StoreError> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Uuid> = messages.iter().map(|m| m.id.as_uuid()).collect();
        let keys: Vec<String> = messages.iter().map(InboundMessage::order_key).collect();
        // First the ids' locks, then (a new statement, a new snapshot) the
        // lookup: a copy being handled elsewhere is waited for and seen.
        self.lock_ids(tx, &ids).await?;
        // `seen` probes the (consumer, event id) indexes once per message
        // (a LATERAL ... LIMIT 1 cannot be turned into a join): written as
        // `event_id IN (SELECT id FROM cand)`, the planner hashed the batch
        // and read every record of the consumer, a cost that grew with the
        // table (49 ms per 64-message batch at 50k records; 0.7 ms probed).
        let sql = format!(
            "WITH held AS (SELECT DISTINCT order_key FROM {pending} \
               WHERE consumer = $1 AND order_key = ANY($3) AND ($4 OR state <> 'dead')), \
             cand AS (SELECT DISTINCT t.id FROM unnest($2::uuid[], $3::text[]) AS t(id, k) \
               WHERE t.k NOT IN (SELECT order_key FROM held)), \
             seen AS (SELECT c.id AS event_id FROM cand c CROSS JOIN LATERAL (SELECT 1 FROM {records} r \
                 WHERE r.consumer = $1 AND r.event_id = c.id LIMIT 1) hit \
               UNION ALL SELECT c.id FROM cand c CROSS JOIN LATERAL (SELECT 1 FROM {pending} p \
                 WHERE p.consumer = $1 AND p.event_id = c.id LIMIT 1) hit), \
             ins AS (INSERT INTO {records} (consumer, event_id, slot) \
               SELECT $1, c.id, {slot} FROM cand c WHERE c.id NOT IN (SELECT event_id FROM seen) \
               ON CONFLICT DO NOTHING RETURNING event_id) \
             SELECT 0 AS kind, event_id::text AS v FROM ins \
             UNION ALL SELECT 1 AS kind, order_key AS v FROM held",
            pending = self.t("inbox_pending"),
            records = self.t("inbox_records"),
            slot = self.slot_expr(),
        );
        let rows = sqlx::query(&sql)
            .persistent(self.prepared())
            .bind(&self.inner.consumer)
            .bind(&ids)
            .bind(&keys)
            .bind(block_on_dead)
            .fetch_all(&mut **tx)
            .await?;
        let mut inserted = HashSet::new();
        let mut held = HashSet::new();
        for r in &rows {
            let kind: i32 = r.try_get("kind")?;
            let v: String = r.try_get("v")?;
            if kind == 0 {
                inserted.insert(v);
            } else {
                held.insert(v);
            }
        }
        let mut verdicts = Vec::with_capacity(messages.len());
        for (m, key) in messages.iter().zip(&keys) {
            if held.contains(key) {
                self.insert_pending(tx, m, PendingState::Parked, 0, 0, None)
                    .await?;
                verdicts.push(Verdict::Parked);
            } else if inserted.remove(&m.id.to_string()) {
                verdicts.push(Verdict::New);
            } else {
                verdicts.push(Verdict::Duplicate);
            }
        }
        Ok(verdicts)
    }

    async fn hold(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        message: &InboundMessage,
        hold: &Hold,
    ) -> Result<(), StoreError> {
        let (state, attempts, delay_ms, failure) = hold_parts(hold);
        self.insert_pending(tx, message, state, attempts, delay_ms, Some(failure))
            .await
    }

    async fn due(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        limit: u32,
        block_on_dead: bool,
    ) -> Result<Vec<Pending>, StoreError> {
        let sql = format!(
            "SELECT {cols} FROM {p} AS h WHERE h.consumer = $1 AND h.state <> 'dead' \
             AND h.next_attempt_at <= now() AND NOT EXISTS (SELECT 1 FROM {p} AS b \
               WHERE b.consumer = h.consumer AND b.order_key = h.order_key AND b.seq < h.seq \
               AND ($3 OR b.state <> 'dead')) \
             ORDER BY h.seq LIMIT $2 FOR UPDATE SKIP LOCKED",
            cols = Self::pending_columns(),
            p = self.t("inbox_pending"),
        );
        let rows = sqlx::query(&sql)
            .persistent(self.prepared())
            .bind(&self.inner.consumer)
            .bind(i64::from(limit))
            .bind(block_on_dead)
            .fetch_all(&mut **tx)
            .await?;
        rows.iter().map(pending_from_row).collect()
    }

    async fn complete(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        seq: i64,
        id: EventId,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "WITH gone AS (DELETE FROM {p} WHERE consumer = $1 AND seq = $2), \
             ins AS (INSERT INTO {r} (consumer, event_id, slot) SELECT $1, $3, {slot} \
               WHERE NOT EXISTS (SELECT 1 FROM {r} WHERE consumer = $1 AND event_id = $3) \
               ON CONFLICT DO NOTHING RETURNING 1) \
             SELECT count(*) FROM ins",
            p = self.t("inbox_pending"),
            r = self.t("inbox_records"),
            slot = self.slot_expr(),
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .persistent(self.prepared())
            .bind(&self.inner.consumer)
            .bind(seq)
            .bind(id.as_uuid())
            .fetch_one(&mut **tx)
            .await?;
        Ok(n > 0)
    }

    async fn fail(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        seq: i64,
        hold: &Hold,
    ) -> Result<(), StoreError> {
        let (state, attempts, delay_ms, failure) = hold_parts(hold);
        let sql = format!(
            "UPDATE {} SET state = $3, attempts = $4, \
             next_attempt_at = now() + make_interval(secs => $5::double precision / 1000), \
             last_error_code = $6, last_error_message = $7 WHERE consumer = $1 AND seq = $2",
            self.t("inbox_pending")
        );
        sqlx::query(&sql)
            .persistent(self.prepared())
            .bind(&self.inner.consumer)
            .bind(seq)
            .bind(state.as_str())
            .bind(i32::try_from(attempts).unwrap_or(i32::MAX))
            .bind(delay_ms)
            .bind(failure.code.as_str())
            .bind(&failure.message)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

impl InboxSchema for PgInbox {
    type Error = StoreError;

    async fn migrate(&self) -> Result<(), StoreError> {
        let s = &self.inner.schema;
        let mut tx = self.inner.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .persistent(self.prepared())
            .bind(format!("outbox-inbox:{s}"))
            .execute(&mut *tx)
            .await?;
        let mut ddl = vec![
            format!("CREATE SCHEMA IF NOT EXISTS \"{s}\""),
            format!(
                "CREATE TABLE IF NOT EXISTS {} (slot_seconds bigint NOT NULL)",
                self.t("inbox_settings")
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {} (consumer text NOT NULL, event_id uuid NOT NULL, \
                 slot smallint NOT NULL, handled_at timestamptz NOT NULL DEFAULT now()) \
                 PARTITION BY LIST (slot)",
                self.t("inbox_records")
            ),
        ];
        for i in 0..RETENTION_SLOTS {
            ddl.push(format!(
                "CREATE TABLE IF NOT EXISTS {} PARTITION OF {} FOR VALUES IN ({i})",
                self.t(&format!("inbox_records_{i}")),
                self.t("inbox_records")
            ));
        }
        ddl.push(format!(
            "CREATE UNIQUE INDEX IF NOT EXISTS inbox_records_id ON {} (consumer, event_id, slot)",
            self.t("inbox_records")
        ));
        ddl.push(format!(
            "CREATE TABLE IF NOT EXISTS {} (consumer text NOT NULL, seq bigint GENERATED ALWAYS AS IDENTITY, \
             event_id uuid NOT NULL, order_key text NOT NULL, event_key text, event_type text NOT NULL, \
             topic text NOT NULL, content_type text NOT NULL, payload bytea NOT NULL, \
             headers jsonb NOT NULL, created_at timestamptz, wire_format text NOT NULL, \
             state text NOT NULL CHECK (state IN ('retry', 'parked', 'dead')), \
             attempts integer NOT NULL DEFAULT 0, next_attempt_at timestamptz NOT NULL DEFAULT now(), \
             held_at timestamptz NOT NULL DEFAULT now(), last_error_code text, last_error_message text, \
             PRIMARY KEY (consumer, seq), UNIQUE (consumer, event_id))",
            self.t("inbox_pending")
        ));
        ddl.push(format!(
            "CREATE INDEX IF NOT EXISTS inbox_pending_key ON {} (consumer, order_key, seq)",
            self.t("inbox_pending")
        ));
        for stmt in ddl {
            sqlx::query(&stmt)
                .persistent(self.prepared())
                .execute(&mut *tx)
                .await?;
        }
        let stored: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT slot_seconds FROM {}",
            self.t("inbox_settings")
        ))
        .persistent(self.prepared())
        .fetch_optional(&mut *tx)
        .await?;
        let wanted = self.inner.retention.slot_seconds();
        match stored {
            None => {
                sqlx::query(&format!(
                    "INSERT INTO {} (slot_seconds) VALUES ($1)",
                    self.t("inbox_settings")
                ))
                .persistent(self.prepared())
                .bind(wanted)
                .execute(&mut *tx)
                .await?;
            }
            Some(have) if have != wanted => {
                return Err(StoreError::Config(format!(
                    "schema {s} keeps inbox records in slots of {have} s, this process was configured \
                     for {wanted} s (another retention window): use the same window everywhere"
                )));
            }
            Some(_) => {}
        }
        tx.commit().await?;
        Ok(())
    }
}

impl InboxRetentionStore for PgInbox {
    type Error = StoreError;

    async fn retain(&self) -> Result<RetentionReport, StoreError> {
        let slots = i64::from(RETENTION_SLOTS);
        let len = self.inner.retention.slot_millis();
        let mut conn = self.inner.pool.begin().await?;
        // Empty slots are the usual case: one cheap probe per pass, no lock.
        let current: i64 =
            sqlx::query_scalar(&format!("SELECT ({} / {len}) % {slots}", self.clock_ms()))
                .persistent(self.prepared())
                .fetch_one(&mut *conn)
                .await?;
        let next = next_slot(current);
        let part = self.t(&format!("inbox_records_{next}"));
        let report = |current: i64, emptied| RetentionReport {
            current_slot: u32::try_from(current).unwrap_or(0),
            emptied,
        };
        let any: bool = sqlx::query_scalar(&format!("SELECT EXISTS (SELECT 1 FROM {part})"))
            .persistent(self.prepared())
            .fetch_one(&mut *conn)
            .await?;
        conn.commit().await?;
        if !any {
            return Ok(report(current, false));
        }
        // The check and the emptying in one transaction, under the
        // partition's lock, with the clock read once the lock is held: no
        // transaction writes into the partition meanwhile, and one that
        // started after the boundary (writing into it) ended before the
        // clock is read, so the clock shows the boundary passed.
        let held = &self.inner.held_passes;
        let overdue = held.load(Ordering::Relaxed) >= RETENTION_PATIENCE;
        let Some(mut tx) =
            lock_partition(&self.inner.pool, &part, overdue, self.prepared()).await?
        else {
            let passes = held.fetch_add(1, Ordering::Relaxed) + 1;
            tracing::warn!(
                consumer = %self.inner.consumer,
                slot = next,
                passes,
                "inbox retention: another session holds the next slot's partition (a long \
                 transaction, a dump, a session idle in a transaction); trying again next pass"
            );
            return Ok(report(current, false));
        };
        held.store(0, Ordering::Relaxed);
        let window = self.inner.retention.window_seconds();
        let (now_slot, into, young): (i64, i64, bool) = sqlx::query_as(&format!(
            "SELECT (c.ms / {len}) % {slots}, c.ms % {len}, EXISTS (SELECT 1 FROM {part} \
               WHERE handled_at > clock_timestamp() - make_interval(secs => $1::double precision)) \
             FROM (SELECT {} AS ms) AS c",
            self.clock_ms()
        ))
        .persistent(self.prepared())
        .bind(window)
        .fetch_one(&mut *tx)
        .await?;
        if now_slot != current || !may_empty_next(&self.inner.retention, into) {
            // The slot is current, or about to be: the next pass empties
            // the slot after the new one.
            tx.rollback().await?;
            tracing::debug!(
                consumer = %self.inner.consumer,
                slot = next,
                "inbox retention skipped a slot at the boundary"
            );
            return Ok(report(now_slot, false));
        }
        // Once per slot length: TRUNCATE when every record is older than the
        // window (the normal case); a slot that also holds younger records
        // (no pass ran for a whole slot length) loses only its old rows.
        if young {
            sqlx::query(&format!(
                "DELETE FROM {part} WHERE handled_at <= clock_timestamp() - make_interval(secs => $1::double precision)"
            )).persistent(self.prepared())
            .bind(window)
            .execute(&mut *tx)
            .await?;
        } else {
            sqlx::query(&format!("TRUNCATE {part}"))
                .persistent(self.prepared())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(report(current, true))
    }

    async fn is_recorded(&self, id: EventId) -> Result<bool, StoreError> {
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE consumer = $1 AND event_id = $2)",
            self.t("inbox_records")
        );
        let mut tx = self.inner.pool.begin().await?;
        let recorded = sqlx::query_scalar(&sql)
            .persistent(self.prepared())
            .bind(&self.inner.consumer)
            .bind(id.as_uuid())
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(recorded)
    }
}

impl InboxDeadLetterStore for PgInbox {
    type Error = StoreError;

    async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: u32,
    ) -> Result<Vec<Pending>, StoreError> {
        let sql = format!(
            "SELECT {} FROM {} WHERE {DEAD_WHERE} ORDER BY seq LIMIT $8",
            Self::pending_columns(),
            self.t("inbox_pending"),
        );
        let q = bind_dead_filter(
            sqlx::query(&sql)
                .persistent(self.prepared())
                .bind(&self.inner.consumer),
            filter,
        )
        .bind(i64::from(limit));
        // In a transaction: through a pooler in transaction mode a
        // statement outside one may be parsed and run on two connections.
        let mut tx = self.inner.pool.begin().await?;
        let rows = q.fetch_all(&mut *tx).await?;
        tx.commit().await?;
        rows.iter().map(pending_from_row).collect()
    }

    async fn replay(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let sql = format!(
            "UPDATE {} SET state = 'retry', attempts = 0, next_attempt_at = now() \
             WHERE {DEAD_WHERE}",
            self.t("inbox_pending")
        );
        self.change_dead(&sql, filter).await
    }

    async fn purge(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let sql = format!("DELETE FROM {} WHERE {DEAD_WHERE}", self.t("inbox_pending"));
        self.change_dead(&sql, filter).await
    }

    async fn pending_counts(&self) -> Result<PendingCounts, StoreError> {
        let sql = format!(
            "SELECT count(*) FILTER (WHERE state = 'retry'), count(*) FILTER (WHERE state = 'parked'), \
             count(*) FILTER (WHERE state = 'dead') FROM {} WHERE consumer = $1",
            self.t("inbox_pending")
        );
        let mut tx = self.inner.pool.begin().await?;
        let (r, p, d): (i64, i64, i64) = sqlx::query_as(&sql)
            .persistent(self.prepared())
            .bind(&self.inner.consumer)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        let u = |n: i64| u64::try_from(n).unwrap_or(0);
        Ok(PendingCounts {
            retry: u(r),
            parked: u(p),
            dead: u(d),
        })
    }
}

/// Lock attempts per retention pass, each waiting at most
/// [`RETENTION_TRY_TIMEOUT`]: a pass never queues its ACCESS EXCLUSIVE
/// request behind a reader of the partition (every admit would queue
/// behind the request), it looks for a gap between lane transactions.
const RETENTION_TRIES: u32 = 20;
/// How long one lock attempt may wait.
const RETENTION_TRY_TIMEOUT: &str = "5ms";
/// Passes in a row without a gap after which a pass waits for the lock
/// (at most [`RETENTION_OVERDUE_TIMEOUT`]): a consumer whose lanes are never
/// all idle still empties its slots, at the cost of one short wait.
const RETENTION_PATIENCE: u32 = 10;
/// The longest wait of an overdue pass.
const RETENTION_OVERDUE_TIMEOUT: &str = "1s";

/// The transaction holding `part` exclusively, or `None` when another
/// session kept it for every attempt (`overdue`: one longer attempt).
async fn lock_partition(
    pool: &PgPool,
    part: &str,
    overdue: bool,
    prepared: bool,
) -> Result<Option<sqlx::Transaction<'static, sqlx::Postgres>>, StoreError> {
    let (tries, timeout) = if overdue {
        (1, RETENTION_OVERDUE_TIMEOUT)
    } else {
        (RETENTION_TRIES, RETENTION_TRY_TIMEOUT)
    };
    for attempt in 0..tries {
        if attempt > 0 {
            let pause = 1 + u64::from(attempt % 10);
            tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
        }
        let mut tx = pool.begin().await?;
        sqlx::query(&format!("SET LOCAL lock_timeout = '{timeout}'"))
            .persistent(prepared)
            .execute(&mut *tx)
            .await?;
        match sqlx::query(&format!("LOCK TABLE {part} IN ACCESS EXCLUSIVE MODE"))
            .persistent(prepared)
            .execute(&mut *tx)
            .await
        {
            Ok(_) => return Ok(Some(tx)),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
                tx.rollback().await?;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(None)
}
