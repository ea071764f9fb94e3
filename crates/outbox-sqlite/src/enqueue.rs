//! Enqueueing events inside the caller's transaction.

use crate::sql::{encode_headers, now_ms};
use outbox_core::{EventId, EventLimits, NewEvent, ValidationError};
use sqlx::{Sqlite, Transaction};
use thiserror::Error;

/// Rows per multi-row `INSERT` (10 bound values each, far below SQLite's
/// 32766-variable limit).
const INSERT_CHUNK: usize = 500;

/// Why an enqueue failed. Nothing was written when this is returned for a
/// validation problem; for a database error the caller's transaction decides.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EnqueueError {
    /// The event broke a rule or a limit; no event of the call was written.
    #[error("invalid event: {0}")]
    Validation(#[from] ValidationError),
    /// The INSERT failed.
    #[error("could not insert outbox event: {0}")]
    Database(#[from] sqlx::Error),
}

/// Adds `event` to the outbox as part of the caller's transaction `tx`: one
/// `INSERT`. The event is delivered only if `tx` commits. Validates with
/// [`EventLimits::default`]. Returns the event's id.
pub async fn enqueue(
    tx: &mut Transaction<'_, Sqlite>,
    event: NewEvent,
) -> Result<EventId, EnqueueError> {
    enqueue_with_limits(tx, event, &EventLimits::default()).await
}

/// [`enqueue`] with explicit limits.
pub async fn enqueue_with_limits(
    tx: &mut Transaction<'_, Sqlite>,
    event: NewEvent,
    limits: &EventLimits,
) -> Result<EventId, EnqueueError> {
    let ids = enqueue_batch_with_limits(tx, vec![event], limits).await?;
    ids.into_iter()
        .next()
        .ok_or(EnqueueError::Database(sqlx::Error::RowNotFound))
}

/// Adds several events in the caller's transaction with one multi-row
/// `INSERT` per 500 events. Every event is validated (with
/// [`EventLimits::default`]) before anything is written. Returns the ids in
/// the given order.
pub async fn enqueue_batch(
    tx: &mut Transaction<'_, Sqlite>,
    events: Vec<NewEvent>,
) -> Result<Vec<EventId>, EnqueueError> {
    enqueue_batch_with_limits(tx, events, &EventLimits::default()).await
}

/// [`enqueue_batch`] with explicit limits.
pub async fn enqueue_batch_with_limits(
    tx: &mut Transaction<'_, Sqlite>,
    events: Vec<NewEvent>,
    limits: &EventLimits,
) -> Result<Vec<EventId>, EnqueueError> {
    for event in &events {
        event.validate(limits)?;
    }
    let mut ids = Vec::with_capacity(events.len());
    let mut events = events.into_iter().peekable();
    while events.peek().is_some() {
        let chunk: Vec<NewEvent> = events.by_ref().take(INSERT_CHUNK).collect();
        let row = concat!("(?, ?, ?, ?, ?, ?, ?, ", now_ms!(), ", 0, ", now_ms!(), ")");
        let mut sql = String::from(
            "INSERT INTO outbox_events \
             (id, key, key_hash, event_type, topic, payload, headers, created_at, attempts, next_attempt_at) \
             VALUES ",
        );
        for i in 0..chunk.len() {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push_str(row);
        }
        let mut query = sqlx::query(&sql);
        for event in chunk {
            let key_hash = i64::from(event.key_hash());
            let (id, key, event_type, topic, payload, headers) = event.into_parts();
            ids.push(id);
            query = query
                .bind(id.as_uuid())
                .bind(key)
                .bind(key_hash)
                .bind(event_type)
                .bind(topic)
                .bind(payload)
                .bind(encode_headers(&headers)?);
        }
        query.execute(&mut **tx).await?;
    }
    tracing::trace!(count = ids.len(), "enqueued outbox events");
    Ok(ids)
}
