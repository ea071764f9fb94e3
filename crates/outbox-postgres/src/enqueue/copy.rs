//! [`PgOutbox::enqueue_bulk`]: many events with `COPY ... FROM STDIN` in
//! PostgreSQL's binary format, for backfills.
//!
//! The copy names the same columns as the INSERT; the rest take their
//! defaults, evaluated row by row in the order the rows arrive: the log's
//! `txid`, `slot` (the current partition) and `seq` (the global insertion
//! order the relays read a window in), the queue table's `seq`. So the
//! events keep the given order exactly as [`PgOutbox::enqueue_batch`]'s
//! `ORDER BY n` keeps it. Values travel in binary (no text escaping, no
//! parsing on the server). Everything is validated before the COPY starts;
//! the rows are streamed in chunks of about [`CHUNK_BYTES`].
//!
//! [`PgOutbox::enqueue_bulk`]: crate::PgOutbox::enqueue_bulk
//! [`PgOutbox::enqueue_batch`]: crate::PgOutbox::enqueue_batch

use super::{due_params, headers_json, EnqueueSql};
use crate::error::EnqueueError;
use chrono::{DateTime, TimeZone as _, Utc};
use outbox_core::{EventId, NewEvent};
use sqlx::PgConnection;

/// How many bytes of rows are buffered before they are sent.
const CHUNK_BYTES: usize = 1 << 20;

/// The binary COPY signature, flags and header extension length.
const HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";

impl EnqueueSql {
    /// COPYs the validated `events` into the target in the given order, on
    /// `conn` (in the caller's transaction, or as one statement of its own),
    /// then notifies `channel` when given. Returns the ids in order.
    pub(crate) async fn copy_in(
        &self,
        conn: &mut PgConnection,
        events: Vec<NewEvent>,
        channel: Option<&str>,
    ) -> Result<Vec<EventId>, EnqueueError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let delayed = events.iter().any(super::is_delayed);
        // A delay counts from the database's clock: `now()` of this
        // transaction (what the INSERT's `now()` reads), read once.
        let now: Option<DateTime<Utc>> = if delayed {
            Some(
                sqlx::query_scalar("SELECT now()")
                    .persistent(false)
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(EnqueueError::Database)?,
            )
        } else {
            None
        };
        // Every due time is computed before anything is sent.
        let mut rows = Vec::with_capacity(events.len());
        for event in events {
            let due = match (due_params(&event)?, now) {
                (Some((Some(at), _)), _) => Some(at),
                (Some((None, after_us)), Some(now)) => {
                    Some(now + chrono::TimeDelta::microseconds(after_us.unwrap_or(0)))
                }
                // An undelayed event of a batch with delayed ones: the
                // log's NULL, the queue's `now()` (its column's default).
                (_, now) => now.filter(|_| self.undelayed_now),
            };
            rows.push((event, due));
        }
        let statement = format!(
            "COPY {} ({}{}{}) FROM STDIN (FORMAT binary)",
            self.target,
            super::COLUMNS,
            if delayed { ", " } else { "" },
            if delayed { self.due_column } else { "" },
        );
        let mut copy = conn
            .copy_in_raw(&statement)
            .await
            .map_err(EnqueueError::Database)?;
        let mut ids = Vec::with_capacity(rows.len());
        let mut buf = Vec::with_capacity(CHUNK_BYTES + (64 << 10));
        buf.extend_from_slice(HEADER);
        for (event, due) in rows {
            ids.push(event.id());
            encode_row(&mut buf, event, delayed.then_some(due));
            if buf.len() >= CHUNK_BYTES {
                if let Err(e) = copy.send(std::mem::take(&mut buf)).await {
                    let _ = copy.abort("outbox: sending the rows failed").await;
                    return Err(EnqueueError::Database(e));
                }
                buf.reserve(CHUNK_BYTES + (64 << 10));
            }
        }
        buf.extend_from_slice(&(-1i16).to_be_bytes());
        if let Err(e) = copy.send(buf).await {
            let _ = copy.abort("outbox: sending the rows failed").await;
            return Err(EnqueueError::Database(e));
        }
        copy.finish().await.map_err(EnqueueError::Database)?;
        if let Some(channel) = channel {
            sqlx::query("SELECT pg_notify($1, '')")
                .persistent(false)
                .bind(channel)
                .execute(&mut *conn)
                .await
                .map_err(EnqueueError::Database)?;
        }
        Ok(ids)
    }
}

/// Appends one tuple: the seven columns, and the due time when the copy
/// has that column (`Some`; its `None` is SQL NULL).
fn encode_row(buf: &mut Vec<u8>, event: NewEvent, due: Option<Option<DateTime<Utc>>>) {
    let key_hash = i64::from(event.key_hash());
    let parts = event.into_parts();
    let fields: i16 = if due.is_some() { 8 } else { 7 };
    buf.extend_from_slice(&fields.to_be_bytes());
    field(buf, Some(parts.id.as_uuid().as_bytes()));
    field(buf, parts.key.as_deref().map(str::as_bytes));
    field(buf, Some(&key_hash.to_be_bytes()));
    field(buf, Some(parts.event_type.as_bytes()));
    field(buf, Some(parts.topic.as_bytes()));
    field(buf, Some(&parts.payload));
    // jsonb's binary form: a version byte (1), then the JSON text.
    let json = headers_json(&parts.headers);
    put_len(buf, json.len() + 1);
    buf.push(1);
    buf.extend_from_slice(json.as_bytes());
    if let Some(due) = due {
        let micros = due.map(|at| pg_micros(at).to_be_bytes());
        field(buf, micros.as_ref().map(|m| &m[..]));
    }
}

/// One field: its length (-1 for NULL) and its bytes.
fn field(buf: &mut Vec<u8>, value: Option<&[u8]>) {
    match value {
        Some(v) => {
            put_len(buf, v.len());
            buf.extend_from_slice(v);
        }
        None => buf.extend_from_slice(&(-1i32).to_be_bytes()),
    }
}

/// A field length. Validated events are far below 2 GiB (the payload
/// limit); a larger value would be refused by the server's own check.
fn put_len(buf: &mut Vec<u8>, len: usize) {
    buf.extend_from_slice(&i32::try_from(len).unwrap_or(i32::MAX).to_be_bytes());
}

/// A time as PostgreSQL's binary `timestamptz`: microseconds since
/// 2000-01-01 00:00 UTC (truncated, as the bound parameter of `enqueue` is).
fn pg_micros(at: DateTime<Utc>) -> i64 {
    let epoch = Utc.with_ymd_and_hms(2000, 1, 1, 0, 0, 0).single();
    epoch
        .and_then(|epoch| (at - epoch).num_microseconds())
        // Validated times lie in 1970-9999: far inside i64 microseconds.
        .unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuple_layout() {
        let e = NewEvent::new("t.x", "topic", vec![0xab]).with_key("k");
        let id = e.id();
        let mut buf = Vec::new();
        encode_row(&mut buf, e, None);
        assert_eq!(&buf[..2], &7i16.to_be_bytes());
        assert_eq!(&buf[2..6], &16i32.to_be_bytes());
        assert_eq!(&buf[6..22], id.as_uuid().as_bytes());
        assert_eq!(&buf[22..26], &1i32.to_be_bytes());
        assert_eq!(&buf[26..27], b"k");
        // jsonb: version 1 then `{}`.
        assert_eq!(&buf[buf.len() - 7..], &[0, 0, 0, 3, 1, b'{', b'}']);
        let mut buf = Vec::new();
        encode_row(&mut buf, NewEvent::new("t.x", "topic", vec![]), Some(None));
        assert_eq!(&buf[..2], &8i16.to_be_bytes());
        assert_eq!(&buf[buf.len() - 4..], &(-1i32).to_be_bytes());
    }

    #[test]
    fn micros_since_2000() {
        let at = Utc.with_ymd_and_hms(2000, 1, 1, 0, 0, 1).single().unwrap();
        assert_eq!(pg_micros(at), 1_000_000);
        let at = Utc.with_ymd_and_hms(1970, 1, 1, 0, 0, 0).single().unwrap();
        assert_eq!(pg_micros(at), -946_684_800_000_000);
    }
}
