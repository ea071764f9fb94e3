//! The retry lane and the dead letters of a consumer group: the writes a
//! claim or a settle makes to them (rows copied from the log, lane rows
//! settled), and the dead letters as
//! [`DeadLetterStore`](outbox_core::DeadLetterStore) reads and changes them.

use super::context::Ctx;
use super::rows::count;
use crate::dead_filter::bind_dead_filter;
use crate::error::StoreError;
use crate::rows::headers_lenient_under;
use outbox_core::{
    DeadHeadPolicy, DeadLetter, DeadLetterFilter, DeadLetterQuery, ErrorCode, Event, EventId,
    HeadState, HeldKey, HeldKeys, LastError,
};
use sqlx::postgres::PgRow;
use sqlx::Row;
use uuid::Uuid;

/// Lane rows copied from the log, in order: (txid, seq, attempts, delay µs, error).
pub(super) type LaneRows = Vec<(u64, i64, i32, i64, Option<LastError>)>;

/// One statement on a lane row at a settle (or a claim).
pub(super) struct LaneOp {
    pub(super) ord: i64,
    /// 0 delivered, 1 retry, 2 dead.
    pub(super) kind: i32,
    /// Attempts after this one.
    pub(super) attempts: i32,
    pub(super) delay_us: i64,
    pub(super) error: Option<LastError>,
}

/// The ids of dead letters that replaced an older one (`(id, replaced)` rows).
fn replaced(rows: Vec<PgRow>) -> Result<Vec<EventId>, StoreError> {
    let mut out = Vec::new();
    for r in rows {
        let replaced: Option<bool> = r.try_get(1)?;
        if replaced == Some(true) {
            out.push(EventId::from_uuid(r.try_get::<Uuid, _>(0)?));
        }
    }
    Ok(out)
}

/// Copies log rows into the retry lane (retries, released events, events
/// parked behind their key).
pub(super) async fn log_to_lane(
    ctx: &Ctx,
    conn: impl sqlx::Executor<'_, Database = sqlx::Postgres>,
    rows: &LaneRows,
) -> Result<(), StoreError> {
    let mut txids = Vec::with_capacity(rows.len());
    let mut seqs = Vec::with_capacity(rows.len());
    let mut attempts = Vec::with_capacity(rows.len());
    let mut delays = Vec::with_capacity(rows.len());
    let mut codes: Vec<Option<String>> = Vec::with_capacity(rows.len());
    let mut messages: Vec<Option<String>> = Vec::with_capacity(rows.len());
    for (t, s, a, d, e) in rows {
        txids.push(t.to_string());
        seqs.push(*s);
        attempts.push(*a);
        delays.push(*d);
        codes.push(e.as_ref().map(|e| e.code.as_str().to_owned()));
        messages.push(e.as_ref().map(|e| e.message.clone()));
    }
    sqlx::query(&ctx.sql.log_to_lane)
        .bind(&ctx.group)
        .bind(txids)
        .bind(seqs)
        .bind(attempts)
        .bind(delays)
        .bind(codes)
        .bind(messages)
        .execute(conn)
        .await?;
    Ok(())
}

/// Dead-letters log rows; returns the ids whose older dead letter was
/// replaced.
pub(super) async fn log_to_dead(
    ctx: &Ctx,
    conn: impl sqlx::Executor<'_, Database = sqlx::Postgres>,
    rows: &[(u64, i64, i32, LastError)],
) -> Result<Vec<EventId>, StoreError> {
    let mut txids = Vec::with_capacity(rows.len());
    let mut seqs = Vec::with_capacity(rows.len());
    let mut attempts = Vec::with_capacity(rows.len());
    let mut codes = Vec::with_capacity(rows.len());
    let mut messages = Vec::with_capacity(rows.len());
    for (t, s, a, e) in rows {
        txids.push(t.to_string());
        seqs.push(*s);
        attempts.push(*a);
        codes.push(e.code.as_str().to_owned());
        messages.push(e.message.clone());
    }
    let out = sqlx::query(&ctx.sql.log_to_dead)
        .bind(&ctx.group)
        .bind(txids)
        .bind(seqs)
        .bind(attempts)
        .bind(codes)
        .bind(messages)
        .bind(ctx.dead_head == DeadHeadPolicy::Block)
        .fetch_all(conn)
        .await?;
    replaced(out)
}

/// Settles lane rows (delivered: deleted; retry: due later; dead: moved to
/// the dead letters); returns the ids whose older dead letter was replaced.
pub(super) async fn lane_settle(
    ctx: &Ctx,
    conn: impl sqlx::Executor<'_, Database = sqlx::Postgres>,
    ops: &[LaneOp],
) -> Result<Vec<EventId>, StoreError> {
    let out = sqlx::query(&ctx.sql.lane_settle)
        .bind(&ctx.group)
        .bind(ops.iter().map(|o| o.ord).collect::<Vec<_>>())
        .bind(ops.iter().map(|o| o.kind).collect::<Vec<_>>())
        .bind(ops.iter().map(|o| o.attempts).collect::<Vec<_>>())
        .bind(ops.iter().map(|o| o.delay_us).collect::<Vec<_>>())
        .bind(
            ops.iter()
                .map(|o| o.error.as_ref().map(|e| e.code.as_str().to_owned()))
                .collect::<Vec<_>>(),
        )
        .bind(
            ops.iter()
                .map(|o| o.error.as_ref().map(|e| e.message.clone()))
                .collect::<Vec<_>>(),
        )
        .bind(ctx.dead_head == DeadHeadPolicy::Block)
        .fetch_all(conn)
        .await?;
    replaced(out)
}

/// Runs `sql` (`$1` the group, then the dead-letter filter) over this
/// group's dead letters selected by `filter`; the rows it changed.
pub(super) async fn dead_statement(
    ctx: &Ctx,
    sql: &str,
    filter: &DeadLetterFilter,
) -> Result<u64, StoreError> {
    let done = bind_dead_filter(sqlx::query(sql).bind(&ctx.group), filter)
        .execute(&ctx.db)
        .await?;
    Ok(done.rows_affected())
}

/// One page of this group's dead letters ([`DeadLetterStore::list_dead`](outbox_core::DeadLetterStore::list_dead)).
pub(super) async fn list_dead(
    ctx: &Ctx,
    query: &DeadLetterQuery,
) -> Result<Vec<DeadLetter>, StoreError> {
    let rows = bind_dead_filter(
        sqlx::query(&ctx.sql.list_dead).bind(&ctx.group),
        &query.filter,
    )
    .bind(query.after.map(|id| id.as_uuid()))
    .bind(i64::from(query.limit))
    .fetch_all(&ctx.db)
    .await?;
    rows.iter()
        .map(|r| {
            let event = event_of(r)?;
            let error = event.last_error.clone().unwrap_or(LastError {
                code: ErrorCode::MANUAL,
                message: String::new(),
            });
            Ok(DeadLetter {
                dead_at: event.next_attempt_at,
                event,
                error,
            })
        })
        .collect()
}

/// An event from the columns `list_dead` and `held_keys` share: id, key,
/// type, topic, payload, headers (text), created_at, attempts, then the
/// time it waits for (dead_at or next_attempt_at) and its last error
/// (code, message). Headers that are not a JSON object of strings are
/// kept under `x-outbox-undecodable-headers` (it stays listable).
fn event_of(r: &PgRow) -> Result<Event, StoreError> {
    let headers: String = r.try_get(5)?;
    let attempts: i32 = r.try_get(7)?;
    let last_error = match r.try_get::<Option<String>, _>(9)? {
        Some(code) => Some(LastError {
            code: ErrorCode::new(code),
            message: r.try_get::<Option<String>, _>(10)?.unwrap_or_default(),
        }),
        None => None,
    };
    Ok(Event {
        id: EventId::from_uuid(r.try_get::<Uuid, _>(0)?),
        key: r.try_get(1)?,
        event_type: r.try_get(2)?,
        topic: r.try_get(3)?,
        payload: r.try_get(4)?,
        headers: headers_lenient_under(&headers, "x-outbox-undecodable-headers"),
        created_at: r.try_get(6)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        next_attempt_at: r.try_get(8)?,
        last_error,
    })
}

/// The heads of this group's retry lane and the events waiting behind
/// them ([`HeldKeyStore`](outbox_core::HeldKeyStore)).
pub(super) async fn held_keys(ctx: &Ctx, limit: u32) -> Result<HeldKeys, StoreError> {
    let rows = sqlx::query(&ctx.sql.held_keys)
        .bind(&ctx.group)
        .bind(i64::from(limit))
        .fetch_all(&ctx.db)
        .await?;
    let mut out = HeldKeys::default();
    for r in &rows {
        let head = event_of(r)?;
        let at = head.next_attempt_at;
        let state = if r.try_get::<bool, _>(11)? {
            HeadState::Dead { dead_at: at }
        } else {
            HeadState::Retrying {
                next_attempt_at: at,
            }
        };
        out.total = count(r.try_get(14)?);
        out.heads.push(HeldKey {
            head,
            state,
            waiting: count(r.try_get(12)?),
            first_waiting: r.try_get::<Option<Uuid>, _>(13)?.map(EventId::from_uuid),
        });
    }
    Ok(out)
}

/// How many of this group's dead letters `filter` selects.
pub(super) async fn count_dead(ctx: &Ctx, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
    let n: i64 = bind_dead_filter(sqlx::query(&ctx.sql.count_dead).bind(&ctx.group), filter)
        .fetch_one(&ctx.db)
        .await?
        .try_get(0)?;
    Ok(count(n))
}
