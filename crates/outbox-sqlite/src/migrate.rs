//! The library's own migration runner.
//!
//! The schema lives in plain SQL files under `migrations/sqlite/`, embedded
//! at build time. They are applied in version order inside one
//! `BEGIN IMMEDIATE` transaction (so two processes migrating at once
//! serialize), and recorded in [`MIGRATIONS_TABLE`] — not in sqlx's
//! `_sqlx_migrations`, which belongs to the application.

use crate::SqliteStoreError;
use chrono::{DateTime, Utc};
use sqlx::{Row, SqlitePool};

/// The table that records applied outbox migrations:
/// `outbox_schema_migrations(version, name, checksum, applied_at)`.
pub const MIGRATIONS_TABLE: &str = "outbox_schema_migrations";

struct Migration {
    version: i64,
    name: &'static str,
    sql: &'static str,
}

const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "outbox",
    sql: include_str!("../../../migrations/sqlite/0001_outbox.sql"),
}];

/// One row of [`MIGRATIONS_TABLE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedMigration {
    /// Migration version (the file's numeric prefix).
    pub version: i64,
    /// Migration name (the rest of the file name).
    pub name: String,
    /// Hex checksum of the SQL that was applied.
    pub checksum: String,
    /// When it was applied (database clock).
    pub applied_at: Option<DateTime<Utc>>,
}

/// A change-detection checksum of a migration's SQL: 64-bit FNV-1a, hex.
/// (It detects edits, it is not meant to resist forgery.)
fn checksum(sql: &str) -> String {
    let hash = sql.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{hash:016x}")
}

const CREATE_HISTORY: &str = "CREATE TABLE IF NOT EXISTS outbox_schema_migrations (
    version    INTEGER NOT NULL PRIMARY KEY,
    name       TEXT    NOT NULL,
    checksum   TEXT    NOT NULL,
    applied_at INTEGER NOT NULL
)";

/// Applies the migrations not yet applied; returns the versions it applied.
pub(crate) async fn run(pool: &SqlitePool) -> Result<Vec<i64>, SqliteStoreError> {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    sqlx::query(CREATE_HISTORY).execute(&mut *tx).await?;
    let rows = sqlx::query("SELECT version, name, checksum FROM outbox_schema_migrations")
        .fetch_all(&mut *tx)
        .await?;
    let mut applied = Vec::with_capacity(rows.len());
    for row in rows {
        let version: i64 = row.try_get("version")?;
        let name: String = row.try_get("name")?;
        let found: String = row.try_get("checksum")?;
        let Some(known) = MIGRATIONS.iter().find(|m| m.version == version) else {
            return Err(SqliteStoreError::UnknownMigration { version, name });
        };
        let expected = checksum(known.sql);
        if found != expected {
            return Err(SqliteStoreError::ChecksumMismatch {
                version,
                name,
                applied: found,
                expected,
            });
        }
        applied.push(version);
    }
    let mut newly = Vec::new();
    for m in MIGRATIONS.iter().filter(|m| !applied.contains(&m.version)) {
        sqlx::raw_sql(m.sql)
            .execute(&mut *tx)
            .await
            .map_err(|source| SqliteStoreError::Migration {
                version: m.version,
                name: m.name.to_owned(),
                source,
            })?;
        sqlx::query(concat!(
            "INSERT INTO outbox_schema_migrations (version, name, checksum, applied_at) VALUES (?, ?, ?, ",
            crate::sql::now_ms!(),
            ")"
        ))
        .bind(m.version)
        .bind(m.name)
        .bind(checksum(m.sql))
        .execute(&mut *tx)
        .await?;
        tracing::info!(
            version = m.version,
            name = m.name,
            "applied outbox migration"
        );
        newly.push(m.version);
    }
    tx.commit().await?;
    Ok(newly)
}

/// Reads [`MIGRATIONS_TABLE`] (empty when it does not exist yet).
pub(crate) async fn applied(pool: &SqlitePool) -> Result<Vec<AppliedMigration>, SqliteStoreError> {
    let exists: Option<i64> = sqlx::query_scalar(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'outbox_schema_migrations'",
    )
    .fetch_optional(pool)
    .await?;
    if exists.is_none() {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(
        "SELECT version, name, checksum, applied_at FROM outbox_schema_migrations ORDER BY version",
    )
    .fetch_all(pool)
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

    #[test]
    fn versions_are_strictly_increasing_and_checksums_stable() {
        assert!(MIGRATIONS.windows(2).all(|w| w[0].version < w[1].version));
        assert_eq!(checksum(""), "cbf29ce484222325");
        assert_eq!(checksum("a"), "af63dc4c8601ec8c");
        assert_ne!(
            checksum("CREATE TABLE a (x)"),
            checksum("CREATE TABLE a (y)")
        );
    }
}
