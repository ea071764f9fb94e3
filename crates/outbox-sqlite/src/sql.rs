//! SQL fragments and row decoding shared by the store and enqueue.

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

/// The columns of an event, in the order [`decode_event`] reads them by name.
pub(crate) const EVENT_COLUMNS: &str = "seq, id, key, event_type, topic, payload, headers, \
     created_at, attempts, next_attempt_at, last_error_code, last_error_message";

/// Most ids bound in one statement (SQLite allows 32766 variables; stay far below).
pub(crate) const ID_CHUNK: usize = 500;

/// The longest retry delay stored (100 years): keeps `now + delay` inside
/// SQLite's 64-bit integers and chrono's range.
pub(crate) const MAX_DELAY_MS: i64 = 100 * 366 * 24 * 3600 * 1000;

/// `?, ?, ?` with `n` placeholders.
pub(crate) fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// `(?, ?), (?, ?)`: `rows` tuples of `width` placeholders.
pub(crate) fn value_rows(rows: usize, width: usize) -> String {
    let row = format!("({})", placeholders(width));
    vec![row; rows].join(", ")
}

/// A duration as whole milliseconds, saturating.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A retry delay in milliseconds, capped at [`MAX_DELAY_MS`].
pub(crate) fn delay_ms(d: Duration) -> i64 {
    millis(d).min(MAX_DELAY_MS)
}

pub(crate) fn encode_headers(headers: &BTreeMap<String, String>) -> String {
    // A map of strings always serializes; the fallback is never used.
    serde_json::to_string(headers).unwrap_or_else(|_| "{}".to_owned())
}

/// Why a stored row is not a valid event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError {
    pub(crate) column: &'static str,
    pub(crate) reason: String,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "column {}: {}", self.column, self.reason)
    }
}

fn column<'r, T>(row: &'r SqliteRow, column: &'static str) -> Result<T, DecodeError>
where
    T: sqlx::Decode<'r, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite>,
{
    row.try_get::<T, _>(column).map_err(|e| DecodeError {
        column,
        reason: match e {
            sqlx::Error::ColumnDecode { source, .. } => source.to_string(),
            other => other.to_string(),
        },
    })
}

fn time(row: &SqliteRow, name: &'static str) -> Result<DateTime<Utc>, DecodeError> {
    let ms: i64 = column(row, name)?;
    DateTime::<Utc>::from_timestamp_millis(ms).ok_or_else(|| DecodeError {
        column: name,
        reason: format!("{ms} is not a valid time in milliseconds"),
    })
}

/// The row's `seq` (its place in commit order).
pub(crate) fn seq(row: &SqliteRow) -> Result<i64, DecodeError> {
    column(row, "seq")
}

/// The row's id, if it is a UUID.
pub(crate) fn id(row: &SqliteRow) -> Result<EventId, DecodeError> {
    column::<Uuid>(row, "id").map(EventId::from_uuid)
}

fn or_default<T: Default>(lenient: bool, r: Result<T, DecodeError>) -> Result<T, DecodeError> {
    match r {
        Err(_) if lenient => Ok(T::default()),
        r => r,
    }
}

/// Reads an [`Event`] from a row that has [`EVENT_COLUMNS`]. `lenient`
/// (for dead letters, which must stay listable) replaces a bad headers
/// column with no headers, and bad times and attempt counts with zero;
/// the id must decode either way.
pub(crate) fn decode_event(row: &SqliteRow, lenient: bool) -> Result<Event, DecodeError> {
    let id = id(row)?;
    let headers_text: String = or_default(lenient, column(row, "headers"))?;
    let headers: BTreeMap<String, String> = or_default(
        lenient,
        serde_json::from_str(&headers_text).map_err(|e| DecodeError {
            column: "headers",
            reason: format!("not a JSON object of strings: {e}"),
        }),
    )?;
    let attempts: i64 = column(row, "attempts")?;
    let attempts = or_default(
        lenient,
        u32::try_from(attempts).map_err(|_| DecodeError {
            column: "attempts",
            reason: format!("{attempts} is not a valid attempt count"),
        }),
    )?;
    let time_or_epoch = |name| match time(row, name) {
        Err(_) if lenient => Ok(DateTime::<Utc>::UNIX_EPOCH),
        r => r,
    };
    let code: Option<String> = column(row, "last_error_code")?;
    let message: Option<String> = column(row, "last_error_message")?;
    Ok(Event {
        id,
        key: column(row, "key")?,
        event_type: column(row, "event_type")?,
        topic: column(row, "topic")?,
        payload: column(row, "payload")?,
        headers,
        created_at: time_or_epoch("created_at")?,
        attempts,
        next_attempt_at: time_or_epoch("next_attempt_at")?,
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
        assert_eq!(value_rows(2, 2), "(?, ?), (?, ?)");
    }

    #[test]
    fn millis_saturate_and_delays_are_capped() {
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), i64::MAX);
        assert_eq!(delay_ms(Duration::MAX), MAX_DELAY_MS);
        assert!(DateTime::<Utc>::from_timestamp_millis(MAX_DELAY_MS * 2).is_some());
    }
}
