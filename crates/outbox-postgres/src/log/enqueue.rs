//! Enqueue into the event log inside the caller's transaction.

use super::names::LogNames;
use crate::enqueue::EnqueueSql;
use crate::{EnqueueError, Ident, InvalidIdentifier, MigrateError};
use outbox_core::{EventId, EventLimits, NewEvent};
use sqlx::PgConnection;
use std::fmt;
use std::sync::Arc;

/// A cheap, cloneable handle to one event-log outbox: enqueues events in the
/// caller's transaction (one INSERT, same signatures as
/// [`PgOutbox`](crate::PgOutbox)) and applies the migrations.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_core::NewEvent;
/// use outbox_postgres::{Ident, PgLog};
///
/// let log = PgLog::new(Ident::new("app")?, Ident::new("outbox")?)?;
/// let mut tx = pool.begin().await?;
/// // ... the business writes, on &mut *tx ...
/// log.enqueue(&mut *tx, NewEvent::new("order.created", "orders", b"{}".to_vec()).with_key("order-42"))
///     .await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgLog {
    pub(crate) names: Arc<LogNames>,
    sql: Arc<EnqueueSql>,
    limits: EventLimits,
}

impl fmt::Debug for PgLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgLog")
            .field("schema", &self.names.schema)
            .field("table", &self.names.table)
            .field("limits", &self.limits)
            .finish()
    }
}

impl PgLog {
    /// The event-log outbox named `schema`.`table` (objects `<table>_log...`).
    pub fn new(schema: Ident, table: Ident) -> Result<Self, InvalidIdentifier> {
        Ok(Self::from_names(LogNames::new(schema, table)?))
    }

    pub(crate) fn from_names(names: LogNames) -> Self {
        Self {
            // txid, seq, slot and created_at come from column defaults: the
            // transaction id, the insertion order and the current partition
            // are all decided inside this one statement. `deliver_at` is
            // set for a delayed event only (NULL otherwise: migration 3).
            sql: Arc::new(EnqueueSql::new(
                &names.render("{{log}}"),
                "deliver_at",
                "NULL",
            )),
            names: Arc::new(names),
            limits: EventLimits::default(),
        }
    }

    /// The limits checked at enqueue.
    pub fn with_limits(mut self, limits: EventLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The schema.
    pub fn schema(&self) -> &Ident {
        &self.names.schema
    }

    /// The outbox table name the log's objects are named after.
    pub fn table(&self) -> &Ident {
        &self.names.table
    }

    /// Adds one INSERT to the caller's transaction (`&mut *tx`). The event
    /// is visible to relays once the transaction commits, in commit order.
    pub async fn enqueue(
        &self,
        conn: &mut PgConnection,
        event: NewEvent,
    ) -> Result<EventId, EnqueueError> {
        self.sql.enqueue(conn, event, &self.limits, None).await
    }

    /// Adds many events with ONE INSERT to the caller's transaction, in the
    /// given order. All are validated first; nothing is written if one is
    /// refused. Returns the ids in the given order.
    pub async fn enqueue_batch(
        &self,
        conn: &mut PgConnection,
        events: impl IntoIterator<Item = NewEvent>,
    ) -> Result<Vec<EventId>, EnqueueError> {
        self.sql
            .enqueue_batch(conn, events, &self.limits, None)
            .await
    }

    /// Applies the missing event-log migrations (creating the schema if
    /// needed), serialized by an advisory lock. Returns the versions applied.
    pub async fn migrate(&self, conn: &mut PgConnection) -> Result<Vec<i32>, MigrateError> {
        super::migrate::run(conn, &self.names).await
    }

    /// The migration SQL with this outbox's names substituted, for teams that
    /// apply migrations with their own tool: `(version, name, sql)`.
    pub fn migration_sql(&self) -> Vec<(i32, &'static str, String)> {
        crate::migrate::render_all(super::LOG_MIGRATIONS, &self.names)
    }
}
