//! Reading the queue table's rows into events.

use crate::error::StoreError;
use crate::rows::{headers_lenient_under, last_error};
use outbox_core::{Event, EventId};
use sqlx::postgres::PgRow;
use sqlx::Row;
use std::collections::BTreeMap;
use uuid::Uuid;

/// The headers of a dead letter, as well as they can be shown: a dead
/// letter stays listable even when its headers are why it died. Non-string
/// values are shown as JSON text; headers that are not an object at all are
/// shown whole under `outbox-raw-headers`.
pub(super) fn headers_lenient(text: &str) -> BTreeMap<String, String> {
    headers_lenient_under(text, "outbox-raw-headers")
}

/// Reads `id, key, event_type, topic, payload, headers, created_at, attempts,
/// next_attempt_at` (columns 0-8) and `last_error_code, last_error_message`
/// (columns 10-11). The outer error is the driver's (a column of the wrong
/// type: the schema is not what this library migrated); the inner one says
/// why this row's content cannot make an event.
pub(super) fn event_from(
    row: &PgRow,
    headers: impl Fn(&str) -> Result<BTreeMap<String, String>, String>,
) -> Result<Result<Event, (EventId, String)>, StoreError> {
    let id = EventId::from_uuid(row.try_get::<Uuid, _>(0)?);
    let text: String = row.try_get(5)?;
    let attempts: i32 = row.try_get(7)?;
    let headers = match headers(&text) {
        Ok(h) => h,
        Err(why) => return Ok(Err((id, why))),
    };
    Ok(Ok(Event {
        id,
        key: row.try_get(1)?,
        event_type: row.try_get(2)?,
        topic: row.try_get(3)?,
        payload: row.try_get(4)?,
        headers,
        created_at: row.try_get(6)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        next_attempt_at: row.try_get(8)?,
        last_error: last_error(row.try_get(10)?, row.try_get(11)?),
    }))
}
