//! Embedded migrations of the event-log mode, applied with their own
//! history table (`<table>_log_migrations`) under an advisory lock.

use super::names::LogNames;
use crate::{MigrateError, Migration};
use sqlx::{Connection, Executor, PgConnection, Row};

/// Every migration of the event-log mode, in order.
pub const LOG_MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "0001_event_log",
    template: include_str!("../../../../migrations/postgres-log/0001_event_log.sql"),
}];

/// First key of the advisory lock: ASCII "olog" (the queue mode uses "obox").
const LOCK_NAMESPACE: i32 = 0x6f6c_6f67;

/// Applies the missing migrations in one transaction, serialized with other
/// migrating processes by `pg_advisory_xact_lock`. Returns the versions applied.
pub(crate) async fn run(
    conn: &mut PgConnection,
    names: &LogNames,
) -> Result<Vec<i32>, MigrateError> {
    let mut tx = conn.begin().await.map_err(MigrateError::Database)?;
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
        .bind(LOCK_NAMESPACE)
        .bind(names.schema.as_str())
        .execute(&mut *tx)
        .await
        .map_err(MigrateError::Database)?;
    let setup = names.render(
        "CREATE SCHEMA IF NOT EXISTS {{schema}};
         CREATE TABLE IF NOT EXISTS {{history}} (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             checksum   bigint      NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );",
    );
    tx.execute(setup.as_str())
        .await
        .map_err(MigrateError::Database)?;
    let applied = sqlx::query(&names.render("SELECT version, checksum FROM {{history}}"))
        .fetch_all(&mut *tx)
        .await
        .map_err(MigrateError::Database)?;
    let mut done = Vec::with_capacity(applied.len());
    for row in applied {
        let version: i32 = row.try_get(0).map_err(MigrateError::Database)?;
        let checksum: i64 = row.try_get(1).map_err(MigrateError::Database)?;
        match LOG_MIGRATIONS.iter().find(|m| m.version == version) {
            None => return Err(MigrateError::UnknownVersion { version }),
            Some(m) if m.checksum() != checksum => {
                return Err(MigrateError::ChecksumMismatch {
                    version,
                    name: m.name,
                })
            }
            Some(_) => done.push(version),
        }
    }
    let pending: Vec<&'static Migration> = LOG_MIGRATIONS
        .iter()
        .filter(|m| !done.contains(&m.version))
        .collect();
    let mut applied_now = Vec::new();
    for m in pending {
        let sql = names.render(m.template);
        tx.execute(sql.as_str())
            .await
            .map_err(|source| MigrateError::Failed {
                version: m.version,
                name: m.name,
                source,
            })?;
        sqlx::query(
            &names.render("INSERT INTO {{history}} (version, name, checksum) VALUES ($1, $2, $3)"),
        )
        .bind(m.version)
        .bind(m.name)
        .bind(m.checksum())
        .execute(&mut *tx)
        .await
        .map_err(MigrateError::Database)?;
        tracing::info!(
            schema = %names.schema,
            table = %names.table,
            version = m.version,
            name = m.name,
            "applied outbox event-log migration"
        );
        applied_now.push(m.version);
    }
    tx.commit().await.map_err(MigrateError::Database)?;
    Ok(applied_now)
}
