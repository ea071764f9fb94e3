//! Reading rows into events: headers (strict for a claim, lenient for a
//! dead letter), the last error, and ids as the driver binds them. Shared
//! by both PostgreSQL stores.

use crate::StoreError;
use outbox_core::{ErrorCode, Event, EventId, LastError};
use sqlx::postgres::PgRow;
use sqlx::Row;
use std::collections::BTreeMap;
use uuid::Uuid;

/// The headers of a claimed event: a JSON object of strings, or the reason
/// the row cannot be delivered.
pub(crate) fn headers_strict(text: &str) -> Result<BTreeMap<String, String>, String> {
    if text == "{}" {
        // Most events carry no headers: no parser for them.
        return Ok(BTreeMap::new());
    }
    serde_json::from_str(text).map_err(|e| {
        format!("headers are not a JSON object of strings: {e} (headers: {text:.200})")
    })
}

/// The headers of a dead letter, as well as they can be shown: a dead
/// letter stays listable even when its headers are why it died. Non-string
/// values are shown as JSON text; headers that are not an object at all are
/// shown whole under `outbox-raw-headers`.
pub(super) fn headers_lenient(text: &str) -> BTreeMap<String, String> {
    headers_lenient_under(text, "outbox-raw-headers")
}

/// [`headers_lenient`] with the key that holds headers that are not a JSON
/// object at all (each mode keeps its own).
pub(crate) fn headers_lenient_under(text: &str, raw_key: &str) -> BTreeMap<String, String> {
    if let Ok(h) = serde_json::from_str(text) {
        return h;
    }
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        _ => BTreeMap::from([(raw_key.to_owned(), text.to_owned())]),
    }
}

/// The last error of a row from its `last_error_code` and `last_error_message` columns.
pub(crate) fn last_error(code: Option<String>, message: Option<String>) -> Option<LastError> {
    code.map(|code| LastError {
        code: ErrorCode::new(code),
        message: message.unwrap_or_default(),
    })
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

pub(super) fn uuids(ids: &[EventId]) -> Vec<Uuid> {
    ids.iter().map(EventId::as_uuid).collect()
}
