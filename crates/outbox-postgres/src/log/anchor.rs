//! Which database the stored positions belong to, the checks that refuse
//! to claim anywhere else (or under a schema version this library does not
//! know, or with an order sequence that breaks the seq floors), and the
//! re-anchor that moves the positions to a new database.
//!
//! Stored positions are transaction ids (the cursors' snapshots, the
//! origin, `pos_txid`) and sequence values (`pos_seq`, the seq floors) of
//! one database of one cluster. On another cluster (a logical-replication
//! switchover, a restore elsewhere, a pg_upgrade) or in another database
//! of the same cluster (`pg_dump | psql` into a new database) they mean
//! something else: an event whose new transaction id is below a stored
//! snapshot counts as delivered, an event below a stored seq floor is
//! outside the range scan. So the meta row records the identity
//! ([`Identity`]: the cluster's `system_identifier` and the database's
//! oid) and a relay compares it with what it finds before it claims
//! ([`Refusal::OtherDatabase`]);
//! [`PgLogStore::reanchor`](super::PgLogStore::reanchor) is the way out
//! (`log/reanchor.rs`).

use crate::error::{Identity, Refusal, StoreError};
use crate::migrate::log::LOG_MIGRATIONS;
use crate::names::log::LogNames;
use sqlx::{PgConnection, Row};

/// The identity the log records and the one this connection finds (see
/// [`PgLogStore::identity`](super::PgLogStore::identity)).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct IdentityCheck {
    /// What the meta row records (`None`: not recorded yet; the first
    /// relay's check records what it finds).
    pub stored: Option<Identity>,
    /// What this connection is to.
    pub found: Identity,
}

impl IdentityCheck {
    /// Whether the stored positions may be used here.
    pub fn matches(&self) -> bool {
        self.stored
            .as_ref()
            .is_none_or(|s| s.same_database(&self.found))
    }
}

/// The newest log schema version this library knows.
pub(crate) fn known_version() -> i32 {
    LOG_MIGRATIONS.last().map_or(0, |m| m.version)
}

pub(super) fn outbox_name(names: &LogNames) -> String {
    format!("{}.{}", names.schema, names.table)
}

/// The schema version fence and the order sequence's cache: what a store
/// checks before it trusts its SQL against the tables.
pub(crate) async fn check_schema(
    conn: &mut PgConnection,
    names: &LogNames,
) -> Result<(), StoreError> {
    let outbox = outbox_name(names);
    let known = known_version();
    let history = names.render("{{history}}");
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .persistent(false)
        .bind(&history)
        .fetch_one(&mut *conn)
        .await?;
    let newest: Option<(i32, Option<String>)> = if exists {
        // `applied_by` through jsonb: a history written by an older runner
        // has no such column.
        sqlx::query_as(&names.render(
            "SELECT version, to_jsonb(h) ->> 'applied_by' FROM {{history}} h \
             ORDER BY version DESC LIMIT 1",
        ))
        .persistent(false)
        .fetch_optional(&mut *conn)
        .await?
    } else {
        None
    };
    match newest {
        Some((found, applied_by)) if found > known => {
            return Err(refused(Refusal::SchemaTooNew {
                outbox,
                found,
                known,
                applied_by,
            }))
        }
        Some((found, _)) if found == known => {}
        found => {
            return Err(refused(Refusal::SchemaTooOld {
                outbox,
                found: found.map(|(v, _)| v),
                known,
            }))
        }
    }
    let order = names.render("{{order_seq}}");
    // Matched through pg_class, never by casting every sequence's name to
    // `regclass`: that cast fails with 3F000 / 42P01 while any other
    // schema's sequences are being dropped (seen with tests running side by
    // side, and so in any database where schemas come and go).
    let cache: Option<i64> = sqlx::query_scalar(
        "SELECT s.seqcache FROM pg_sequence s WHERE s.seqrelid = to_regclass($1)",
    )
    .persistent(false)
    .bind(&order)
    .fetch_optional(&mut *conn)
    .await?;
    match cache {
        Some(1) | None => Ok(()),
        Some(cache) => Err(refused(Refusal::SequenceCache {
            sequence: order,
            cache,
        })),
    }
}

fn refused(r: Refusal) -> StoreError {
    StoreError::Refused(r)
}

/// What this connection is to.
pub(super) const FOUND: &str = "\
SELECT (SELECT system_identifier FROM pg_control_system()),
       (SELECT oid::bigint FROM pg_database WHERE datname = current_database()),
       current_database()::text";

/// The identity stored in the meta row and the one found, in one statement.
pub(crate) async fn read_identity(
    conn: &mut PgConnection,
    names: &LogNames,
) -> Result<IdentityCheck, StoreError> {
    let row = sqlx::query(&names.render(&format!(
        "SELECT m.system_identifier, m.database_oid, m.database_name, f.* \
         FROM {{{{meta}}}} m, ({FOUND}) f"
    )))
    .persistent(false)
    .fetch_one(&mut *conn)
    .await?;
    let stored = match (
        row.try_get::<Option<i64>, _>(0)?,
        row.try_get::<Option<i64>, _>(1)?,
    ) {
        (Some(system_identifier), Some(database_oid)) => Some(Identity {
            system_identifier,
            database_oid,
            database_name: row.try_get::<Option<String>, _>(2)?.unwrap_or_default(),
        }),
        _ => None,
    };
    Ok(IdentityCheck {
        stored,
        found: Identity {
            system_identifier: row.try_get(3)?,
            database_oid: row.try_get(4)?,
            database_name: row.try_get(5)?,
        },
    })
}

/// The identity check a relay makes before it claims: `Ok` when the log's
/// positions belong to this database (an identity not recorded yet is
/// recorded now), [`Refusal::OtherDatabase`] otherwise.
pub(crate) async fn check_identity(
    conn: &mut PgConnection,
    names: &LogNames,
) -> Result<(), StoreError> {
    let check = read_identity(conn, names).await?;
    match check.stored {
        Some(stored) if !stored.same_database(&check.found) => {
            Err(refused(Refusal::OtherDatabase {
                outbox: outbox_name(names),
                stored,
                found: check.found,
            }))
        }
        Some(_) => Ok(()),
        None => {
            sqlx::query(&names.render(&format!(
                "UPDATE {{{{meta}}}} SET (system_identifier, database_oid, database_name, anchored_at) \
                 = (SELECT f.*, now() FROM ({FOUND}) f) WHERE system_identifier IS NULL"
            ))).persistent(false)
            .execute(&mut *conn)
            .await?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(sys: i64, oid: i64, name: &str) -> Identity {
        Identity {
            system_identifier: sys,
            database_oid: oid,
            database_name: name.into(),
        }
    }

    #[test]
    fn a_database_is_its_cluster_and_oid_not_its_name() {
        assert!(id(1, 5, "a").same_database(&id(1, 5, "renamed")));
        assert!(
            !id(1, 5, "a").same_database(&id(1, 6, "a")),
            "restored copy"
        );
        assert!(
            !id(1, 5, "a").same_database(&id(2, 5, "a")),
            "other cluster"
        );
        let unrecorded = IdentityCheck {
            stored: None,
            found: id(1, 5, "a"),
        };
        assert!(unrecorded.matches());
    }
}
