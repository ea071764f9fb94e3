//! Embedded migrations of the event-log mode (this crate's `migrations/log/`),
//! applied by the shared runner ([`crate::migrate::apply`]) with their own
//! history table (`<table>_log_migrations`) under an advisory lock.

use crate::error::MigrateError;
use crate::migrate::Migration;
use crate::names::log::LogNames;
use outbox_core::DEFAULT_GROUP;
use sqlx::{Connection, Executor, PgConnection};

/// Every migration of the event-log mode, in order.
pub const LOG_MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_event_log",
        sql: include_str!("../../migrations/log/0001_event_log.sql"),
    },
    Migration {
        version: 2,
        name: "0002_relay_group",
        sql: include_str!("../../migrations/log/0002_relay_group.sql"),
    },
    Migration {
        version: 3,
        name: "0003_delayed_events",
        sql: include_str!("../../migrations/log/0003_delayed_events.sql"),
    },
    Migration {
        version: 4,
        name: "0004_control",
        sql: include_str!("../../migrations/log/0004_control.sql"),
    },
    Migration {
        version: 5,
        name: "0005_insertion_order",
        sql: include_str!("../../migrations/log/0005_insertion_order.sql"),
    },
    Migration {
        version: 6,
        name: "0006_identity",
        sql: include_str!("../../migrations/log/0006_identity.sql"),
    },
];

/// First key of the advisory lock: ASCII "olog" (the queue mode uses "obox").
pub(crate) const LOCK_NAMESPACE: i32 = 0x6f6c_6f67;

/// Applies the missing migrations in one transaction, serialized with other
/// migrating processes by `pg_advisory_xact_lock`, then (in a second
/// transaction, see [`attach`]) upgrades a queue-mode outbox of the same name
/// in place and makes `<table>` the view producers insert through.
/// Returns the versions applied.
pub(crate) async fn run(
    conn: &mut PgConnection,
    names: &LogNames,
) -> Result<Vec<i32>, MigrateError> {
    let applied = crate::migrate::apply(
        conn,
        names,
        LOG_MIGRATIONS,
        LOCK_NAMESPACE,
        "outbox event-log",
    )
    .await?;
    attach(conn, names).await?;
    Ok(applied)
}

/// What [`attach`] found under the outbox's own name.
enum Found {
    /// Nothing: a new outbox.
    Nothing,
    /// A table: a queue-mode outbox (drained into the log, then replaced).
    Table,
    /// The view of an earlier `attach`: nothing to do.
    View,
    /// Something else (a relkind): refused.
    Other(String),
}

/// Makes `schema.table` the event log's front door, in one transaction:
///
/// - a queue-mode outbox of that name (a table) is upgraded in place: under
///   an exclusive lock, its pending rows (`delivered_at IS NULL`, delivered
///   rows kept for retention are dropped) are copied into the log in their
///   queue order (`seq`), with their ids, keys, headers and `created_at`
///   (attempt counts and backoff restart; a delayed event, never attempted
///   and due later, keeps its due time as `deliver_at`), its dead letters
///   into the log's dead letters of the default group, its control rows (a
///   pause) into the log's, and the queue objects (`<table>`,
///   `<table>_dead`, `<table>_migrations`, `<table>_control`) are dropped;
/// - then `<table>` is created as a view over the log that PostgreSQL makes
///   insertable: a producer still running the queue-mode enqueue (a rolling
///   upgrade, another service) keeps working, its INSERT lands in the log.
///
/// This runs after the log's migrations have committed, so the copied rows'
/// transaction id is later than the log's origin snapshot and every cursor
/// reads them. A queue-mode relay still running during the upgrade fails
/// (its table is gone); the events it had claimed but not settled are copied
/// as pending and delivered again (at-least-once, as after a crash).
async fn attach(conn: &mut PgConnection, names: &LogNames) -> Result<(), MigrateError> {
    let outbox = format!("{}.{}", names.schema, names.table);
    let upgrade_failed = |source| MigrateError::Upgrade {
        outbox: outbox.clone(),
        source,
    };
    let mut tx = conn.begin().await.map_err(MigrateError::Database)?;
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
        .persistent(false)
        .bind(LOCK_NAMESPACE)
        .bind(names.schema.as_str())
        .execute(&mut *tx)
        .await
        .map_err(MigrateError::Database)?;
    let found = relkind(&mut tx, &names.render("{{outbox}}"))
        .await
        .map_err(MigrateError::Database)?;
    match found {
        Found::View => return Ok(()),
        Found::Other(kind) => {
            tracing::warn!(%outbox, relkind = %kind, "outbox name taken by another relation");
            return Err(MigrateError::ModeConflict {
                outbox,
                detail: "a relation of this name exists and is neither a queue-mode outbox \
                         table nor the event log's view; rename or drop it",
            });
        }
        Found::Table => {
            let dead_exists = matches!(
                relkind(&mut tx, &names.render("{{queue_dead}}"))
                    .await
                    .map_err(MigrateError::Database)?,
                Found::Table
            );
            let copy_pending = names.render(
                "LOCK TABLE {{outbox}} IN ACCESS EXCLUSIVE MODE;
                 INSERT INTO {{log}} (id, key, key_hash, event_type, topic, payload, headers, created_at,
                                      deliver_at)
                 SELECT id, key, key_hash, event_type, topic, payload, headers, created_at,
                        CASE WHEN attempts = 0 AND locked_until IS NULL AND next_attempt_at > now()
                             THEN next_attempt_at END
                 FROM {{outbox}} WHERE delivered_at IS NULL ORDER BY seq",
            );
            let pending = tx
                .execute(copy_pending.as_str())
                .await
                .map_err(upgrade_failed)?
                .rows_affected();
            let mut dead = 0;
            if dead_exists {
                dead = sqlx::query(&names.render(
                    "INSERT INTO {{dead}} (grp, id, ord, key, key_hash, event_type, topic, payload, \
                         headers, created_at, attempts, last_error_code, last_error_message, dead_at, blocking) \
                     SELECT $1, id, nextval('{{lane_ord_lit}}'), key, key_hash, event_type, topic, payload, \
                         headers, created_at, attempts, last_error_code, last_error_message, dead_at, false \
                     FROM (SELECT * FROM {{queue_dead}} ORDER BY dead_at, id) d \
                     ON CONFLICT (grp, id) DO NOTHING",
                ))
                .persistent(false)
                .bind(DEFAULT_GROUP)
                .execute(&mut *tx)
                .await
                .map_err(upgrade_failed)?
                .rows_affected();
            }
            // A pause of the queue-mode relays carries over to the log's
            // default group (the queue table had only that one).
            if matches!(
                relkind(&mut tx, &names.render("{{queue_control}}"))
                    .await
                    .map_err(MigrateError::Database)?,
                Found::Table
            ) {
                tx.execute(
                    names
                        .render(
                            "INSERT INTO {{control}} (grp, paused, paused_at, paused_by, reason, updated_at) \
                             SELECT grp, paused, paused_at, paused_by, reason, updated_at FROM {{queue_control}} \
                             ON CONFLICT (grp) DO NOTHING",
                        )
                        .as_str(),
                )
                .await
                .map_err(upgrade_failed)?;
            }
            tx.execute(
                names
                    .render(
                        "DROP TABLE {{outbox}};
                         DROP TABLE IF EXISTS {{queue_dead}};
                         DROP TABLE IF EXISTS {{queue_history}};
                         DROP TABLE IF EXISTS {{queue_control}};",
                    )
                    .as_str(),
            )
            .await
            .map_err(upgrade_failed)?;
            tracing::info!(
                %outbox,
                pending,
                dead,
                "upgraded the queue-mode outbox to the event log"
            );
        }
        Found::Nothing => {}
    }
    tx.execute(names.render(FRONT_VIEW).as_str())
        .await
        .map_err(MigrateError::Database)?;
    tx.commit().await.map_err(MigrateError::Database)?;
    Ok(())
}

/// The outbox's own name as a view over the log. A single-table view is
/// automatically insertable: an INSERT naming the seven enqueue columns
/// lands in `{{log}}` with the log's defaults (transaction id, order,
/// partition, `created_at`).
const FRONT_VIEW: &str = "\
    CREATE VIEW {{outbox}} AS \
        SELECT id, key, key_hash, event_type, topic, payload, headers, created_at FROM {{log}};
    COMMENT ON VIEW {{outbox}} IS \
        'outbox event log: INSERTs land in the log; managed by outbox-postgres';";

/// The kind of the relation `qualified` names, if any.
async fn relkind(conn: &mut PgConnection, qualified: &str) -> Result<Found, sqlx::Error> {
    Ok(
        match crate::migrate::relkind(conn, qualified).await?.as_deref() {
            None => Found::Nothing,
            Some("r") => Found::Table,
            Some("v") => Found::View,
            Some(other) => Found::Other(other.to_owned()),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migrate::recorded_checksum;
    use outbox_core::migration;

    #[test]
    fn the_embedded_set_is_well_formed_and_its_checksums_keep_every_bit() {
        assert!(migration::is_well_formed(LOG_MIGRATIONS));
        for m in LOG_MIGRATIONS {
            let recorded = recorded_checksum(m);
            assert_eq!(u64::from_ne_bytes(recorded.to_ne_bytes()), m.checksum());
        }
    }
}
