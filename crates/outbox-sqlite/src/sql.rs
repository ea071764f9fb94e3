//! SQL fragments and row decoding shared by the store and enqueue.

use crate::SqliteStoreError;
use chrono::{DateTime, Utc};
use outbox_core::{ErrorCode, Event, EventId, LastError};
use sqlx::sqlite::SqliteRow;
use sqlx::Row;
use std::collections::BTreeMap;
use std::time::Duration;
use uuid::Uuid;

/// The database clock in milliseconds since the epoch. Every time the
/// library stores is computed from this expression, never from the app clock.
/// SQLite keeps `'now'` stable within one statement step.
macro_rules! now_ms {
    () => {
        "CAST(unixepoch('subsec') * 1000 AS INTEGER)"
    };
}
pub(crate) use now_ms;

/// The columns of an event, in the order [`event_from_row`] reads them by name.
pub(crate) const EVENT_COLUMNS: &str = "id, key, event_type, topic, payload, headers, \
     created_at, attempts, next_attempt_at, last_error_code, last_error_message";

/// Most ids bound in one statement (SQLite allows 32766 variables; stay far below).
pub(crate) const ID_CHUNK: usize = 500;

/// `?, ?, ?` with `n` placeholders.
pub(crate) fn placeholders(n: usize) -> String {
    let mut s = String::with_capacity(n * 3);
    for i in 0..n {
        if i > 0 {
            s.push_str(", ");
        }
        s.push('?');
    }
    s
}

/// A duration as whole milliseconds, saturating.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

pub(crate) fn time_from_ms(
    id: EventId,
    column: &'static str,
    ms: i64,
) -> Result<DateTime<Utc>, SqliteStoreError> {
    DateTime::<Utc>::from_timestamp_millis(ms).ok_or_else(|| SqliteStoreError::Corrupt {
        id,
        column,
        reason: format!("{ms} is not a valid time in milliseconds"),
    })
}

pub(crate) fn encode_headers(headers: &BTreeMap<String, String>) -> Result<String, sqlx::Error> {
    serde_json::to_string(headers).map_err(|e| sqlx::Error::Encode(Box::new(e)))
}

/// Reads an [`Event`] from a row that has [`EVENT_COLUMNS`].
pub(crate) fn event_from_row(row: &SqliteRow) -> Result<Event, SqliteStoreError> {
    let id = EventId::from_uuid(row.try_get::<Uuid, _>("id")?);
    let headers_text: String = row.try_get("headers")?;
    let headers: BTreeMap<String, String> =
        serde_json::from_str(&headers_text).map_err(|e| SqliteStoreError::Corrupt {
            id,
            column: "headers",
            reason: e.to_string(),
        })?;
    let attempts: i64 = row.try_get("attempts")?;
    let attempts = u32::try_from(attempts).map_err(|_| SqliteStoreError::Corrupt {
        id,
        column: "attempts",
        reason: format!("{attempts} is not a valid attempt count"),
    })?;
    let code: Option<String> = row.try_get("last_error_code")?;
    let message: Option<String> = row.try_get("last_error_message")?;
    Ok(Event {
        id,
        key: row.try_get("key")?,
        event_type: row.try_get("event_type")?,
        topic: row.try_get("topic")?,
        payload: row.try_get("payload")?,
        headers,
        created_at: time_from_ms(id, "created_at", row.try_get("created_at")?)?,
        attempts,
        next_attempt_at: time_from_ms(id, "next_attempt_at", row.try_get("next_attempt_at")?)?,
        last_error: code.map(|code| LastError {
            code: ErrorCode::new(code),
            message: message.unwrap_or_default(),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_comma_separated() {
        assert_eq!(placeholders(0), "");
        assert_eq!(placeholders(1), "?");
        assert_eq!(placeholders(3), "?, ?, ?");
    }

    #[test]
    fn millis_saturates() {
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), i64::MAX);
    }
}
