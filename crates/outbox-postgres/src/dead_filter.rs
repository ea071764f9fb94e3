//! The dead-letter selection of a [`DeadLetterFilter`] as SQL, and its
//! parameters: what both stores' dead-letter statements (`list`, `count`,
//! `retry`, `purge`) filter with.

use outbox_core::{DeadLetterFilter, ErrorCode, EventId, MAX_DEAD_LETTER_AGE};
use sqlx::postgres::PgArguments;
use std::time::Duration;
use uuid::Uuid;

/// The dead-letter selection of a [`DeadLetterFilter`], as six parameters
/// from `$first` on (bound by [`bind_dead_filter`], in this order): ids,
/// event type, error code, key, older than (µs), newer than (µs).
pub(crate) fn dead_filter_sql(first: usize) -> String {
    let p = |i: usize| format!("${}", first + i);
    format!(
        "({ids}::uuid[] IS NULL OR id = ANY({ids})) \
         AND ({ty}::text IS NULL OR event_type = {ty}) \
         AND ({code}::text IS NULL OR last_error_code = {code}) \
         AND ({key}::text IS NULL OR key = {key}) \
         AND ({old}::bigint IS NULL OR dead_at <= now() - {old} * interval '1 microsecond') \
         AND ({new}::bigint IS NULL OR dead_at > now() - {new} * interval '1 microsecond')",
        ids = p(0),
        ty = p(1),
        code = p(2),
        key = p(3),
        old = p(4),
        new = p(5),
    )
}

/// Binds the six parameters of [`dead_filter_sql`].
pub(crate) fn bind_dead_filter<'q>(
    q: sqlx::query::Query<'q, sqlx::Postgres, PgArguments>,
    f: &'q DeadLetterFilter,
) -> sqlx::query::Query<'q, sqlx::Postgres, PgArguments> {
    let age = |d: Duration| {
        // Capped at 100 years: fits in i64 microseconds and in timestamptz.
        i64::try_from(d.min(MAX_DEAD_LETTER_AGE).as_micros()).unwrap_or(i64::MAX)
    };
    q.bind(f.ids.as_deref().map(uuids))
        .bind(f.event_type.as_deref())
        .bind(f.code.as_ref().map(ErrorCode::as_str))
        .bind(f.key.as_deref())
        .bind(f.older_than.map(age))
        .bind(f.newer_than.map(age))
}

fn uuids(ids: &[EventId]) -> Vec<Uuid> {
    ids.iter().map(EventId::as_uuid).collect()
}
