//! Embedded SQL migrations, applied into the configured schema with the
//! library's own history table and a transaction-scoped advisory lock.

use crate::names::{Names, Templates};
use crate::MigrateError;
use sqlx::{Connection, Executor, PgConnection, Row};

/// One embedded migration (a file of `migrations/postgres/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// Version, increasing from 1.
    pub version: i32,
    /// File name without `.sql`.
    pub name: &'static str,
    /// The SQL with `{{placeholder}}`s for the identifiers.
    pub template: &'static str,
}

/// Every migration of this crate version, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_create_outbox",
        template: include_str!("../migrations/queue/0001_create_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "0002_order_and_parking",
        template: include_str!("../migrations/queue/0002_order_and_parking.sql"),
    },
    Migration {
        version: 3,
        name: "0003_control",
        template: include_str!("../migrations/queue/0003_control.sql"),
    },
];

/// First key of the two-key advisory lock taken while migrating: ASCII "obox".
const LOCK_NAMESPACE: i32 = 0x6f62_6f78;

impl Migration {
    /// The SQL for `schema`.`table` (either mode's names): each placeholder
    /// replaced by a validated, double-quoted identifier.
    pub(crate) fn render(&self, names: &Templates) -> String {
        names.render(self.template)
    }

    /// `migrations` rendered for `names`, as `(version, name, sql)`: what
    /// both modes' `migration_sql` return.
    pub(crate) fn render_all(
        migrations: &[Migration],
        names: &Templates,
    ) -> Vec<(i32, &'static str, String)> {
        migrations
            .iter()
            .map(|m| (m.version, m.name, m.render(names)))
            .collect()
    }

    /// A stable checksum of the template (64-bit FNV-1a,
    /// [`outbox_core::fnv1a_64`]), recorded in the history so an edited
    /// migration is noticed.
    pub fn checksum(&self) -> i64 {
        let h = outbox_core::fnv1a_64(self.template.as_bytes());
        i64::from_ne_bytes(h.to_ne_bytes())
    }
}

/// Applies the missing migrations in one transaction. Several processes may
/// call this at once: a `pg_advisory_xact_lock` keyed on the schema
/// serializes them, and the later ones find nothing left to do.
/// Returns the versions this call applied.
pub(crate) async fn run(conn: &mut PgConnection, names: &Names) -> Result<Vec<i32>, MigrateError> {
    let kind = relkind(conn, &names.render("{{events}}"))
        .await
        .map_err(MigrateError::Database)?;
    if kind.as_deref() == Some("v") {
        return Err(MigrateError::ModeConflict {
            outbox: format!("{}.{}", names.schema, names.table),
            detail: "it was upgraded to the event log (mode `log`, the default); queue-mode \
                     migrations refuse it: open it in mode `log`",
        });
    }
    apply(conn, names, MIGRATIONS, LOCK_NAMESPACE, "outbox").await
}

/// The `pg_class.relkind` of the relation `qualified` (a quoted, qualified
/// name) names, if it exists: `r` table, `v` view, ...
pub(crate) async fn relkind(
    conn: &mut PgConnection,
    qualified: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
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
        match migrations.iter().find(|m| m.version == version) {
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

    // Collected first: an iterator adapter with a closure held across the
    // awaits below makes the future not `Send` (a rustc limitation).
    let pending: Vec<&'static Migration> = migrations
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
            "applied {what} migration"
        );
        applied_now.push(m.version);
    }
    tx.commit().await.map_err(MigrateError::Database)?;
    Ok(applied_now)
}
