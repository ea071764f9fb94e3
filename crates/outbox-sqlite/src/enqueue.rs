//! Enqueueing events inside the caller's transaction.

use crate::error::{EnqueueError, MigrateError};
use crate::ident::Ident;
use crate::migrate::{self, AppliedMigration};
use crate::names::Names;
use crate::options::DEFAULT_TABLE;
use crate::sql::{delay_ms, encode_headers, now_ms};
use chrono::{DateTime, Utc};
use outbox_core::ident::InvalidIdentifier;
use outbox_core::{Delivery, EventId, EventLimits, NewEvent};
use sqlx::SqliteConnection;
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// `at` in milliseconds since the epoch, rounded up (never early).
fn ceil_millis(at: DateTime<Utc>) -> i64 {
    let ms = at.timestamp_millis();
    if at.timestamp_subsec_nanos() % 1_000_000 == 0 {
        ms
    } else {
        ms.saturating_add(1)
    }
}

/// `d` rounded up to whole milliseconds.
fn ceil_ms(d: Duration) -> Duration {
    let ms = d.as_nanos().div_ceil(1_000_000);
    Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// Rows per multi-row `INSERT` (7 bound values each, far below SQLite's
/// 32766-variable limit).
const INSERT_CHUNK: usize = 500;

/// A cheap, cloneable handle to one outbox (its events table): enqueues
/// events in the caller's transaction and applies the migrations. The same
/// shape as `outbox_postgres::PgOutbox`.
///
/// ```no_run
/// # async fn demo(pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_core::NewEvent;
/// use outbox_sqlite::{Ident, SqliteOutbox};
///
/// let outbox = SqliteOutbox::new(Ident::new("orders_outbox")?)?;
/// outbox.migrate(&mut *pool.acquire().await?).await?;
/// let mut tx = pool.begin().await?;
/// // ... the business writes, on &mut *tx ...
/// let id = outbox
///     .enqueue(&mut tx, NewEvent::new("order.created", "orders", b"{}".to_vec()).with_key("order-42"))
///     .await?;
/// tx.commit().await?;
/// # let _ = id; Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteOutbox {
    pub(crate) names: Arc<Names>,
    insert_head: Arc<str>,
    limits: EventLimits,
}

impl fmt::Debug for SqliteOutbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteOutbox")
            .field("table", &self.names.table)
            .field("dead_letters", &self.names.dead)
            .field("limits", &self.limits)
            .finish()
    }
}

impl Default for SqliteOutbox {
    /// The outbox in `outbox_events`, with default limits.
    fn default() -> Self {
        default_outbox().clone()
    }
}

fn default_outbox() -> &'static SqliteOutbox {
    static DEFAULT: OnceLock<SqliteOutbox> = OnceLock::new();
    DEFAULT.get_or_init(|| {
        // The default name is a constant that fits: a failure here is a bug
        // caught by the unit tests.
        #[allow(clippy::expect_used)]
        let names =
            Names::new(Ident::from_static(DEFAULT_TABLE)).expect("default outbox names are valid");
        SqliteOutbox::from_names(names)
    })
}

impl SqliteOutbox {
    /// The outbox whose events live in `table` (with default limits). Fails
    /// when a derived name (`<table>_dead`, `<table>_migrations`, index
    /// names) would exceed 63 bytes.
    pub fn new(table: Ident) -> Result<Self, InvalidIdentifier> {
        Ok(Self::from_names(Names::new(table)?))
    }

    pub(crate) fn from_names(names: Names) -> Self {
        let insert_head = names.render(
            "INSERT INTO {{events}} \
             (id, key, key_hash, event_type, topic, payload, headers, created_at, attempts, next_attempt_at) \
             VALUES ",
        );
        Self {
            names: Arc::new(names),
            insert_head: insert_head.into(),
            limits: EventLimits::default(),
        }
    }

    /// The limits checked at enqueue.
    pub fn with_limits(mut self, limits: EventLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The events table.
    pub fn table(&self) -> &Ident {
        &self.names.table
    }

    /// The dead-letter table.
    pub fn dead_letter_table(&self) -> &Ident {
        &self.names.dead
    }

    /// The migration history table.
    pub fn migrations_table(&self) -> &Ident {
        &self.names.history
    }

    /// The limits checked at enqueue.
    pub fn limits(&self) -> &EventLimits {
        &self.limits
    }

    /// Adds one `INSERT` to the caller's transaction (pass `&mut tx` or
    /// `&mut *tx`). Returns the event's id. The event is visible to relays
    /// only once the transaction commits.
    pub async fn enqueue(
        &self,
        conn: &mut SqliteConnection,
        event: NewEvent,
    ) -> Result<EventId, EnqueueError> {
        let ids = self.enqueue_batch(conn, [event]).await?;
        ids.into_iter()
            .next()
            .ok_or(EnqueueError::Database(sqlx::Error::RowNotFound))
    }

    /// Adds many events to the caller's transaction with one multi-row
    /// `INSERT` per 500 events. All are validated first; nothing is written
    /// if one is refused. Returns the ids in the given order (which is also
    /// their delivery order within a key).
    pub async fn enqueue_batch(
        &self,
        conn: &mut SqliteConnection,
        events: impl IntoIterator<Item = NewEvent>,
    ) -> Result<Vec<EventId>, EnqueueError> {
        // Feature `otel`: the caller's span becomes the trace headers.
        let events = NewEvent::prepare_all(events, &self.limits)
            .map_err(|(id, source)| EnqueueError::Invalid { id, source })?;
        let mut ids = Vec::with_capacity(events.len());
        let mut events = events.into_iter().peekable();
        let row = concat!("(?, ?, ?, ?, ?, ?, ?, ", now_ms!(), ", 0, ", now_ms!(), ")");
        // A delayed event's row: due at an absolute time, or after a delay
        // from the database clock (milliseconds, rounded up: never early).
        let row_at = concat!("(?, ?, ?, ?, ?, ?, ?, ", now_ms!(), ", 0, ?)");
        let row_after = concat!(
            "(?, ?, ?, ?, ?, ?, ?, ",
            now_ms!(),
            ", 0, ",
            now_ms!(),
            " + ?)"
        );
        while events.peek().is_some() {
            let chunk: Vec<(NewEvent, Option<Delivery>)> = events
                .by_ref()
                .take(INSERT_CHUNK)
                .map(|e| {
                    let due = e
                        .delivery()
                        .map_err(|source| EnqueueError::Invalid { id: e.id(), source })?;
                    Ok((e, due))
                })
                .collect::<Result<_, EnqueueError>>()?;
            let mut sql = String::with_capacity(self.insert_head.len() + chunk.len() * 120);
            sql.push_str(&self.insert_head);
            for (i, (_, due)) in chunk.iter().enumerate() {
                if i > 0 {
                    sql.push_str(", ");
                }
                sql.push_str(match due {
                    None => row,
                    Some(Delivery::At(_)) => row_at,
                    Some(Delivery::After(_)) => row_after,
                });
            }
            let mut query = sqlx::query(&sql);
            for (event, due) in chunk {
                let key_hash = i64::from(event.key_hash());
                let outbox_core::EventParts {
                    id,
                    key,
                    event_type,
                    topic,
                    payload,
                    headers,
                } = event.into_parts();
                ids.push(id);
                query = query
                    .bind(id.as_uuid())
                    .bind(key)
                    .bind(key_hash)
                    .bind(event_type)
                    .bind(topic)
                    .bind(payload)
                    .bind(encode_headers(&headers));
                query = match due {
                    None => query,
                    Some(Delivery::At(at)) => query.bind(ceil_millis(at)),
                    Some(Delivery::After(d)) => query.bind(delay_ms(ceil_ms(d))),
                };
            }
            query
                .execute(&mut *conn)
                .await
                .map_err(EnqueueError::Database)?;
        }
        tracing::trace!(count = ids.len(), table = %self.names.table, "enqueued outbox events");
        Ok(ids)
    }

    /// Applies the missing migrations to this outbox's tables in one
    /// `BEGIN IMMEDIATE` transaction (pass a connection that is not inside a
    /// transaction). Returns the versions applied by this call (empty when
    /// already up to date).
    pub async fn migrate(&self, conn: &mut SqliteConnection) -> Result<Vec<i32>, MigrateError> {
        migrate::run(conn, &self.names).await
    }

    /// The applied migrations of this outbox, oldest first.
    pub async fn applied_migrations(
        &self,
        conn: &mut SqliteConnection,
    ) -> Result<Vec<AppliedMigration>, MigrateError> {
        migrate::applied(conn, &self.names).await
    }

    /// The migration SQL with this outbox's names substituted, for teams that
    /// apply migrations with their own tool: `(version, name, sql)`.
    pub fn migration_sql(&self) -> Vec<(i32, &'static str, String)> {
        crate::migrate::MIGRATIONS
            .iter()
            .map(|m| (m.version, m.name, self.names.render(m.sql)))
            .collect()
    }
}

/// Enqueues one event into the default outbox (`outbox_events`) in the
/// caller's transaction (`&mut tx`), validated with
/// [`EventLimits::default`]. See [`SqliteOutbox::enqueue`].
pub async fn enqueue(
    conn: &mut SqliteConnection,
    event: NewEvent,
) -> Result<EventId, EnqueueError> {
    default_outbox().enqueue(conn, event).await
}

/// Enqueues many events into the default outbox with one multi-row `INSERT`
/// per 500 events. See [`SqliteOutbox::enqueue_batch`].
pub async fn enqueue_batch(
    conn: &mut SqliteConnection,
    events: impl IntoIterator<Item = NewEvent>,
) -> Result<Vec<EventId>, EnqueueError> {
    default_outbox().enqueue_batch(conn, events).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_outbox_names() {
        let o = SqliteOutbox::default();
        assert_eq!(o.table().as_str(), "outbox_events");
        assert_eq!(o.dead_letter_table().as_str(), "outbox_dead_letters");
        assert_eq!(
            o.migrations_table().as_str(),
            crate::names::MIGRATIONS_TABLE
        );
        let sql = &o.migration_sql()[0].2;
        assert!(sql.contains("CREATE TABLE \"outbox_events\" ("), "{sql}");
        assert!(!sql.contains("{{"), "{sql}");
    }
}
