//! Embedded migrations of the queue-table mode (this crate's
//! `migrations/queue/`), applied by the shared runner ([`apply`]).

use crate::error::MigrateError;
use crate::migrate::{apply, relkind, Migration};
use crate::names::queue::Names;
use sqlx::{Connection, PgConnection};

/// Every queue-table migration of this crate version, in order (the files of
/// `migrations/queue/`).
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_create_outbox",
        sql: include_str!("../../migrations/queue/0001_create_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "0002_order_and_parking",
        sql: include_str!("../../migrations/queue/0002_order_and_parking.sql"),
    },
    Migration {
        version: 3,
        name: "0003_control",
        sql: include_str!("../../migrations/queue/0003_control.sql"),
    },
];

/// First key of the two-key advisory lock taken while migrating: ASCII "obox".
const LOCK_NAMESPACE: i32 = 0x6f62_6f78;

/// Applies the missing migrations in one transaction. Several processes may
/// call this at once: a `pg_advisory_xact_lock` keyed on the schema
/// serializes them, and the later ones find nothing left to do.
/// Returns the versions this call applied.
pub(crate) async fn run(conn: &mut PgConnection, names: &Names) -> Result<Vec<i32>, MigrateError> {
    // In a transaction: through a pooler in transaction mode a statement
    // outside one may be parsed on one server connection and run on another.
    let mut tx = conn.begin().await.map_err(MigrateError::Database)?;
    let kind = relkind(&mut tx, &names.render("{{events}}"))
        .await
        .map_err(MigrateError::Database)?;
    tx.commit().await.map_err(MigrateError::Database)?;
    if kind.as_deref() == Some("v") {
        return Err(MigrateError::ModeConflict {
            outbox: format!("{}.{}", names.schema, names.table),
            detail: "it was upgraded to the event log (mode `log`, the default); queue-mode \
                     migrations refuse it: open it in mode `log`",
        });
    }
    apply(conn, names, MIGRATIONS, LOCK_NAMESPACE, "outbox").await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migrate::recorded_checksum;
    use outbox_core::migration;

    #[test]
    fn the_embedded_set_is_well_formed_and_its_checksums_keep_every_bit() {
        assert!(migration::is_well_formed(MIGRATIONS));
        for m in MIGRATIONS {
            let recorded = recorded_checksum(m);
            assert_eq!(u64::from_ne_bytes(recorded.to_ne_bytes()), m.checksum());
        }
    }
}
