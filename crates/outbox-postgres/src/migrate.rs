//! The migration runner of both PostgreSQL modes; each mode's migrations
//! in a module of its own ([`queue`], [`log`]).
//!
//! The SQL files live in this crate's `migrations/queue/` (the queue table,
//! [`queue::MIGRATIONS`]) and `migrations/log/` (the event log,
//! [`log::LOG_MIGRATIONS`]), embedded as [`Migration`]s (`outbox-core`'s
//! type, shared with `outbox-sqlite`). [`apply`] runs either set: one
//! transaction under a transaction-scoped advisory lock, the outbox's own
//! history table, and `outbox_core::migration::pending` deciding what is
//! missing.

use crate::error::MigrateError;
use crate::names::Templates;
pub(crate) use outbox_core::migration::Migration;
use outbox_core::migration::{self, HistoryError};
use sqlx::{Connection, Executor, PgConnection, Row};

pub(crate) mod log;
pub(crate) mod queue;

/// What the history's `applied_by` records: this crate's version. A relay
/// that finds a schema version it does not know names it (the version of
/// `outbox-relay` to run: the workspace releases its crates together).
pub(crate) const APPLIED_BY: &str = env!("CARGO_PKG_VERSION");

/// `migrations` rendered for `names` (either mode's, which deref to
/// [`Templates`]), as `(version, name, sql)`: what both modes'
/// `migration_sql` return.
pub(crate) fn render_all(
    migrations: &[Migration],
    names: &Templates,
) -> Vec<(i32, &'static str, String)> {
    migrations
        .iter()
        .map(|m| (m.version, m.name, names.render(m.sql)))
        .collect()
}

/// The checksum recorded in the history's `bigint` column: the bits of
/// [`Migration::checksum`].
pub(crate) fn recorded_checksum(m: &Migration) -> i64 {
    i64::from_ne_bytes(m.checksum().to_ne_bytes())
}

/// The `pg_class.relkind` of the relation `qualified` (a quoted, qualified
/// name) names, if it exists: `r` table, `v` view, ...
///
/// Migrations run rarely: their statements are never left prepared
/// (`persistent(false)`), so they need no knowledge of a pooler in
/// transaction mode; each runs inside a transaction.
pub(crate) async fn relkind(
    conn: &mut PgConnection,
    qualified: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
        .persistent(false)
        .bind(qualified)
        .fetch_optional(conn)
        .await
}

/// The migration runner shared by both modes: `migrations` applied in one
/// transaction under `pg_advisory_xact_lock(lock_namespace, hashtext(schema))`,
/// recorded with their checksums in `{{history}}`, with `names` (either
/// mode's, which deref to [`Templates`]). `what` names the set in the log
/// line. Returns the versions this call applied.
pub(crate) async fn apply(
    conn: &mut PgConnection,
    names: &Templates,
    migrations: &'static [Migration],
    lock_namespace: i32,
    what: &'static str,
) -> Result<Vec<i32>, MigrateError> {
    let mut tx = conn.begin().await.map_err(MigrateError::Database)?;
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
        .persistent(false)
        .bind(lock_namespace)
        .bind(names.schema.as_str())
        .execute(&mut *tx)
        .await
        .map_err(MigrateError::Database)?;
    // `Executor::execute` with a plain string uses the simple query protocol,
    // which runs several statements (`sqlx::raw_sql` would too, but its
    // future is not `Send`).
    let setup = names.render(
        "CREATE SCHEMA IF NOT EXISTS {{schema}};
         CREATE TABLE IF NOT EXISTS {{history}} (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             checksum   bigint      NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );
         ALTER TABLE {{history}} ADD COLUMN IF NOT EXISTS applied_by text NULL;",
    );
    tx.execute(setup.as_str())
        .await
        .map_err(MigrateError::Database)?;

    let applied = sqlx::query(&names.render("SELECT version, checksum FROM {{history}}"))
        .persistent(false)
        .fetch_all(&mut *tx)
        .await
        .map_err(MigrateError::Database)?;
    let history = applied
        .into_iter()
        .map(|row| Ok((row.try_get::<i32, _>(0)?, row.try_get::<i64, _>(1)?)))
        .collect::<Result<Vec<_>, sqlx::Error>>()
        .map_err(MigrateError::Database)?;
    // Collected first: an iterator adapter with a closure held across the
    // awaits below makes the future not `Send` (a rustc limitation).
    let pending = migration::pending(migrations, history, |m, recorded| {
        recorded_checksum(m) == *recorded
    })
    .map_err(|e| match e {
        HistoryError::UnknownVersion { version, .. } => MigrateError::UnknownVersion { version },
        HistoryError::ChecksumMismatch { migration, .. } => MigrateError::ChecksumMismatch {
            version: migration.version,
            name: migration.name,
        },
    })?;
    let mut applied_now = Vec::new();
    for m in pending {
        let sql = names.render(m.sql);
        tx.execute(sql.as_str())
            .await
            .map_err(|source| MigrateError::Failed {
                version: m.version,
                name: m.name,
                source,
            })?;
        sqlx::query(&names.render(
            "INSERT INTO {{history}} (version, name, checksum, applied_by) VALUES ($1, $2, $3, $4)",
        ))
        .persistent(false)
        .bind(m.version)
        .bind(m.name)
        .bind(recorded_checksum(m))
        .bind(APPLIED_BY)
        .execute(&mut *tx)
        .await
        .map_err(MigrateError::Database)?;
        tracing::info!(
            schema = %names.schema,
            table = %names.table,
            version = m.version,
            name = m.name,
            "applied {what} migration"
        );
        applied_now.push(m.version);
    }
    tx.commit().await.map_err(MigrateError::Database)?;
    Ok(applied_now)
}
