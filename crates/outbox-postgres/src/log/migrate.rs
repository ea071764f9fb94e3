//! Embedded migrations of the event-log mode, applied with their own
//! history table (`<table>_log_migrations`) under an advisory lock.

use super::names::LogNames;
use crate::{MigrateError, Migration};
use sqlx::PgConnection;

/// Every migration of the event-log mode, in order.
pub const LOG_MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "0001_event_log",
    template: include_str!("../../../../migrations/postgres-log/0001_event_log.sql"),
}];

/// First key of the advisory lock: ASCII "olog" (the queue mode uses "obox").
const LOCK_NAMESPACE: i32 = 0x6f6c_6f67;

impl crate::migrate::MigrationNames for LogNames {
    fn schema(&self) -> &crate::Ident {
        &self.schema
    }
    fn table(&self) -> &crate::Ident {
        &self.table
    }
    fn render(&self, template: &str) -> String {
        LogNames::render(self, template)
    }
}

/// Applies the missing migrations in one transaction, serialized with other
/// migrating processes by `pg_advisory_xact_lock`. Returns the versions applied.
pub(crate) async fn run(
    conn: &mut PgConnection,
    names: &LogNames,
) -> Result<Vec<i32>, MigrateError> {
    crate::migrate::apply(
        conn,
        names,
        LOG_MIGRATIONS,
        LOCK_NAMESPACE,
        "outbox event-log",
    )
    .await
}
