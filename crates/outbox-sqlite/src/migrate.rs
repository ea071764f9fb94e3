//! The library's own migration runner.
//!
//! The schema lives in plain SQL files in this crate's `migrations/`,
//! embedded at build time as [`Migration`]s (`outbox-core`'s type, shared
//! with `outbox-postgres`), with the table names as `{{events}}`-style
//! placeholders.
//! They are applied in version order inside one `BEGIN IMMEDIATE`
//! transaction (so two processes migrating at once serialize), and recorded
//! in the outbox's own history table ([`MIGRATIONS_TABLE`](crate::MIGRATIONS_TABLE) for the default
//! table) — not in sqlx's `_sqlx_migrations`, which belongs to the
//! application. What to apply is decided from that history by
//! `outbox_core::migration::pending`, as for PostgreSQL; the execution is
//! this crate's (a SQLite transaction, `BEGIN IMMEDIATE` instead of an
//! advisory lock, and a history that records the checksum of the *rendered*
//! SQL as hex text).

use crate::error::MigrateError;
use crate::names::Names;
use chrono::{DateTime, Utc};
use outbox_core::migration::Migration;
use outbox_core::migration::{self, HistoryError};
use sqlx::{Connection, Executor, Row, SqliteConnection};

/// The embedded migrations, oldest first.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "outbox",
        sql: include_str!("../migrations/0001_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "commit_order",
        sql: include_str!("../migrations/0002_commit_order.sql"),
    },
    Migration {
        version: 3,
        name: "control",
        sql: include_str!("../migrations/0003_control.sql"),
    },
];

/// Checksums recorded by earlier builds for SQL that is equivalent to this
/// build's for the default table: migration 1 before table names became
/// configurable (identifiers were written unquoted then).
const LEGACY_CHECKSUMS: &[(i32, &str)] = &[(1, "ebbe0c9a74357b0d")];

/// `m`'s SQL with `names` substituted.
pub(crate) fn render(m: &Migration, names: &Names) -> String {
    names.render(m.sql)
}

/// One row of the history table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedMigration {
    /// Migration version (the file's numeric prefix).
    pub version: i32,
    /// Migration name (the rest of the file name).
    pub name: String,
    /// Hex checksum of the SQL that was applied.
    pub checksum: String,
    /// When it was applied (database clock).
    pub applied_at: Option<DateTime<Utc>>,
}

/// A change-detection checksum of a migration's rendered SQL: 64-bit
/// FNV-1a ([`outbox_core::fnv1a_64`]), hex.
fn checksum(sql: &str) -> String {
    format!("{:016x}", outbox_core::fnv1a_64(sql.as_bytes()))
}

fn matches(version: i32, found: &str, expected: &str) -> bool {
    found == expected || LEGACY_CHECKSUMS.contains(&(version, found))
}

/// Applies the migrations not yet applied; returns the versions it applied.
pub(crate) async fn run(
    conn: &mut SqliteConnection,
    names: &Names,
) -> Result<Vec<i32>, MigrateError> {
    let history = names.history.quoted();
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {history} (
            version    INTEGER NOT NULL PRIMARY KEY,
            name       TEXT    NOT NULL,
            checksum   TEXT    NOT NULL,
            applied_at INTEGER NOT NULL
        )"
    ))
    .execute(&mut *tx)
    .await?;
    let rows = sqlx::query(&format!("SELECT version, name, checksum FROM {history}"))
        .fetch_all(&mut *tx)
        .await?;
    let recorded = rows
        .into_iter()
        .map(|row| {
            let version: i32 = row.try_get("version")?;
            let name: String = row.try_get("name")?;
            let found: String = row.try_get("checksum")?;
            Ok((version, (name, found)))
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    // Collected first: an iterator adapter with a closure held across the
    // awaits below makes the future not `Send` (a rustc limitation).
    let pending = migration::pending(MIGRATIONS, recorded, |m, (_, found)| {
        matches(m.version, found, &checksum(&render(m, names)))
    })
    .map_err(|e| match e {
        HistoryError::UnknownVersion {
            version,
            recorded: (name, _),
        } => MigrateError::UnknownVersion { version, name },
        HistoryError::ChecksumMismatch {
            migration: m,
            recorded: (_, found),
        } => MigrateError::ChecksumMismatch {
            version: m.version,
            name: m.name,
            applied: found,
            expected: checksum(&render(&m, names)),
        },
    })?;
    let mut newly = Vec::new();
    for m in pending {
        let sql = render(m, names);
        // `Executor::execute` with a plain string runs every statement of
        // it (`sqlx::raw_sql` would too, but its future is not `Send`).
        tx.execute(sql.as_str())
            .await
            .map_err(|source| MigrateError::Failed {
                version: m.version,
                name: m.name,
                source,
            })?;
        sqlx::query(&format!(
            "INSERT INTO {history} (version, name, checksum, applied_at) VALUES (?, ?, ?, {})",
            crate::sql::now_ms!()
        ))
        .bind(m.version)
        .bind(m.name)
        .bind(checksum(&sql))
        .execute(&mut *tx)
        .await?;
        tracing::info!(
            version = m.version,
            name = m.name,
            table = %names.table,
            "applied outbox migration"
        );
        newly.push(m.version);
    }
    tx.commit().await?;
    Ok(newly)
}

/// Reads the history table (empty when it does not exist yet).
pub(crate) async fn applied(
    conn: &mut SqliteConnection,
    names: &Names,
) -> Result<Vec<AppliedMigration>, MigrateError> {
    let exists: Option<i64> =
        sqlx::query_scalar("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?")
            .bind(names.history.as_str())
            .fetch_optional(&mut *conn)
            .await?;
    if exists.is_none() {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(&format!(
        "SELECT version, name, checksum, applied_at FROM {} ORDER BY version",
        names.history.quoted()
    ))
    .fetch_all(&mut *conn)
    .await?;
    rows.into_iter()
        .map(|row| {
            Ok(AppliedMigration {
                version: row.try_get("version")?,
                name: row.try_get("name")?,
                checksum: row.try_get("checksum")?,
                applied_at: DateTime::<Utc>::from_timestamp_millis(row.try_get("applied_at")?),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ident::Ident;

    #[test]
    fn versions_are_strictly_increasing_and_checksums_stable() {
        assert!(migration::is_well_formed(MIGRATIONS));
        assert_eq!(checksum(""), "cbf29ce484222325");
        assert_eq!(checksum("a"), "af63dc4c8601ec8c");
        assert_ne!(
            checksum("CREATE TABLE a (x)"),
            checksum("CREATE TABLE a (y)")
        );
    }

    #[test]
    fn every_placeholder_is_rendered() {
        for table in ["outbox_events", "order"] {
            let names = Names::new(Ident::new(table).unwrap()).unwrap();
            for m in MIGRATIONS {
                let sql = render(m, &names);
                assert!(!sql.contains("{{"), "{table} {}: {sql}", m.version);
            }
        }
    }
}
