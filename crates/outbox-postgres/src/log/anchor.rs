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
//! ([`Refusal::OtherDatabase`]); [`PgLogStore::reanchor`] is the way out.

use super::migrate::{LOCK_NAMESPACE, LOG_MIGRATIONS};
use super::names::LogNames;
use super::snapshot::Snap;
use super::store::PgLogStore;
use crate::StoreError;
use sqlx::{Executor, PgConnection, Row};
use std::fmt;

/// The database a log's positions belong to: the cluster (its
/// `pg_control_system().system_identifier`) and the database (its oid;
/// the name is shown, not compared: a renamed database keeps its oid and
/// its transaction ids).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Identity {
    /// The cluster's system identifier (`pg_control_system()`): new after
    /// an `initdb` (a logical-replication target, a restore onto another
    /// cluster, a pg_upgrade), kept by a promoted physical standby.
    pub system_identifier: i64,
    /// The database's oid: new for a database created by `CREATE DATABASE`
    /// (a `pg_dump | psql` restore into it).
    pub database_oid: i64,
    /// The database's name.
    pub database_name: String,
}

impl Identity {
    /// Whether positions written under `self` hold under `other`.
    pub fn same_database(&self, other: &Identity) -> bool {
        self.system_identifier == other.system_identifier && self.database_oid == other.database_oid
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "database {:?} (oid {}) of cluster {}",
            self.database_name, self.database_oid, self.system_identifier
        )
    }
}

/// The identity the log records and the one this connection finds (see
/// [`PgLogStore::identity`]).
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

/// Where [`PgLogStore::reanchor`] restarts every consumer group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReanchorFrom {
    /// Deliver the whole retained log again (every group, from its oldest
    /// retained event, in each key's order): no event is lost, every event
    /// the relays had already delivered is delivered again (duplicates;
    /// consumers drop them by event id).
    Origin,
    /// Skip to now: every event already in the log counts as delivered.
    /// What the relays had not delivered yet is **lost** (never delivered);
    /// events committed after the re-anchor are delivered. The retry lane
    /// and the dead letters are kept.
    Now,
}

impl fmt::Display for ReanchorFrom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReanchorFrom::Origin => "origin",
            ReanchorFrom::Now => "now",
        })
    }
}

/// What [`PgLogStore::reanchor`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reanchored {
    /// The identity the log recorded before (`None`: none).
    pub previous: Option<Identity>,
    /// The identity it records now (this connection's).
    pub identity: Identity,
    /// Where the groups restart.
    pub from: ReanchorFrom,
    /// Retained events in the log: delivered again ([`ReanchorFrom::Origin`])
    /// or skipped ([`ReanchorFrom::Now`]).
    pub events: u64,
    /// Cursors reset (every group, every shard layout).
    pub cursors: u64,
    /// Retry-lane rows dropped because the log delivers them again
    /// ([`ReanchorFrom::Origin`] only).
    pub lane_dropped: u64,
}

/// Why a relay refuses to claim (or a store to open): the stored positions
/// or the schema cannot be trusted here. Each message says what was found
/// and what to run.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The log's positions were written in another database or cluster.
    OtherDatabase {
        /// `schema.table`.
        outbox: String,
        /// What the log records.
        stored: Identity,
        /// What this connection is to.
        found: Identity,
    },
    /// The schema was migrated by a newer `outbox-postgres` / `outbox-relay`.
    SchemaTooNew {
        /// `schema.table`.
        outbox: String,
        /// The schema's version.
        found: i32,
        /// The newest version this library knows.
        known: i32,
        /// The version of `outbox-postgres` that applied it, when recorded.
        applied_by: Option<String>,
    },
    /// The schema is older than this library (or not there): run migrate.
    SchemaTooOld {
        /// `schema.table`.
        outbox: String,
        /// The schema's version (`None`: no event log there).
        found: Option<i32>,
        /// The version this library needs.
        known: i32,
    },
    /// The order sequence caches values per session: the seq floors (and
    /// the per-key order inside a window) need `CACHE 1`.
    SequenceCache {
        /// The sequence, quoted and qualified.
        sequence: String,
        /// Its cache size.
        cache: i64,
    },
    /// A cursor this relay was reading was deleted (the group was dropped)
    /// while it ran: it does not start the group again from the log's
    /// origin.
    GroupDropped {
        /// The group.
        group: String,
        /// `index/total`.
        shard: String,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::OtherDatabase {
                outbox,
                stored,
                found,
            } => {
                let what = if stored.system_identifier == found.system_identifier {
                    "another database of the same cluster: a restore or a copy"
                } else {
                    "another cluster: a switchover, a restore elsewhere or a pg_upgrade"
                };
                write!(
                    f,
                    "the outbox log {outbox} was anchored to {stored}, but this connection is to \
                     {found} ({what}); its stored positions (transaction ids, sequence values) \
                     belong to the other database, so no event is claimed. Re-anchor the \
                     positions here: `outbox-relay reanchor --from origin` delivers the retained \
                     log again (duplicates), `outbox-relay reanchor --from now` skips to now \
                     (events not yet delivered are lost)"
                )
            }
            Refusal::SchemaTooNew {
                outbox,
                found,
                known,
                applied_by,
            } => {
                write!(
                    f,
                    "the outbox log {outbox} has schema version {found}, newer than this \
                     outbox-relay (outbox-postgres {}) knows (up to {known}): ",
                    crate::migrate::APPLIED_BY
                )?;
                match applied_by {
                    Some(v) => write!(f, "run outbox-relay {v} or later"),
                    None => f.write_str("run the outbox-relay that migrated it, or a later one"),
                }
            }
            Refusal::SchemaTooOld {
                outbox,
                found: Some(found),
                known,
            } => write!(
                f,
                "the outbox log {outbox} has schema version {found}, this outbox-relay needs \
                 {known}: run `outbox-relay migrate` (stop relays of older versions first)"
            ),
            Refusal::SchemaTooOld {
                outbox,
                found: None,
                known,
            } => write!(
                f,
                "no outbox event log at {outbox} (schema version {known} needed): run \
                 `outbox-relay migrate`"
            ),
            Refusal::SequenceCache { sequence, cache } => write!(
                f,
                "the outbox order sequence {sequence} has CACHE {cache}: a cached sequence \
                 numbers INSERTs out of their order across sessions, which breaks per-key order \
                 and the claim's seq floors (events would be skipped); run \
                 `ALTER SEQUENCE {sequence} CACHE 1`"
            ),
            Refusal::GroupDropped { group, shard } => write!(
                f,
                "the cursor of group {group:?} shard {shard} was deleted while this relay was \
                 reading it (`outbox-relay group drop`?): it does not start the group again \
                 from the log's origin (that would deliver the whole retained log again). \
                 Stop this relay; restart it to start the group as new"
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// The newest log schema version this library knows.
pub(crate) fn known_version() -> i32 {
    LOG_MIGRATIONS.last().map_or(0, |m| m.version)
}

fn outbox_name(names: &LogNames) -> String {
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

fn decode_err(what: String) -> StoreError {
    StoreError::Database(sqlx::Error::Decode(what.into()))
}

fn refused(r: Refusal) -> StoreError {
    StoreError::Refused(r)
}

/// What this connection is to.
const FOUND: &str = "\
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

/// Every cursor moves to `$1` (a snapshot), settled nothing inside it, seq
/// floors 0 (a floor of another cluster is no floor here), a new epoch and
/// no lease: a relay holding one is fenced at its next settle and takes the
/// cursor again at the new position.
const RESET_CURSORS: &str = "\
UPDATE {{cursors}}
SET lo = $1::pg_snapshot, hi = $1::pg_snapshot, pos_txid = NULL, pos_seq = NULL,
    skip_txid = '{}', skip_seq = '{}', lo_floor = 0, hi_floor = 0,
    epoch = epoch + 1, owner = NULL, lease_until = NULL, updated_at = now()";

impl PgLogStore {
    /// The identity the log records and the one this store's connection
    /// finds ([`IdentityCheck::matches`]: whether relays may claim here).
    pub async fn identity(&self) -> Result<IdentityCheck, StoreError> {
        let mut tx = self.db().begin().await?;
        read_identity(tx.conn(), &self.log().names).await
    }

    /// Anchors the log's positions to this database (after a switchover, a
    /// restore, a copy or a pg_upgrade: see [`Refusal::OtherDatabase`]),
    /// in one transaction, for every consumer group:
    ///
    /// - every event in the log is given this transaction's id (their
    ///   stored ids belong to the other cluster and would count as
    ///   delivered, or as not committed yet, at random), keeping its
    ///   insertion order (`seq`); the order sequence moves above every
    ///   stored `seq` (logical replication does not copy sequences);
    /// - [`ReanchorFrom::Origin`]: the log's origin and every cursor move
    ///   to a snapshot taken before this transaction's id, so the whole
    ///   retained log is delivered again, in each key's order (retry-lane
    ///   copies of events still in the log are dropped: the log delivers
    ///   them in order); [`ReanchorFrom::Now`]: to a snapshot in which
    ///   this transaction counts as committed, so everything in the log is
    ///   skipped;
    /// - seq floors are reset to 0, every epoch is bumped and every lease
    ///   voided, the incarnation token is replaced (running relays drop
    ///   the windows and floors they hold in memory), and the identity
    ///   found is recorded.
    ///
    /// Running relays refused by the identity check resume at their next
    /// claim. Dead letters and the retry lane (but for the copies above)
    /// are kept.
    pub async fn reanchor(&self, from: ReanchorFrom) -> Result<Reanchored, StoreError> {
        let names = &self.log().names;
        let mut conn = self.db().begin().await?;
        check_schema(conn.conn(), names).await?;
        conn.commit().await?;
        let mut tx = self.db().begin().await?;
        // Serialized with migrations and other re-anchors; takes no
        // transaction id (the origin snapshot below must precede ours).
        sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))")
            .persistent(false)
            .bind(LOCK_NAMESPACE)
            .bind(names.schema.as_str())
            .execute(tx.conn())
            .await?;
        let before: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
            .persistent(false)
            .fetch_one(tx.conn())
            .await?;
        let check = read_identity(tx.conn(), names).await?;
        let own: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text")
            .persistent(false)
            .fetch_one(tx.conn())
            .await?;
        let own: u64 = own
            .parse()
            .map_err(|_| decode_err(format!("malformed xid8 {own:?}")))?;
        let events = tx
            .execute(
                names
                    .render("UPDATE {{log}} SET txid = pg_current_xact_id()")
                    .as_str(),
            )
            .await?
            .rows_affected();
        let anchor = match from {
            ReanchorFrom::Origin => Snap::parse(&before),
            ReanchorFrom::Now => {
                let after: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
                    .persistent(false)
                    .fetch_one(tx.conn())
                    .await?;
                Snap::parse(&after).map(|s| committed_in(s, own))
            }
        }
        .map_err(decode_err)?;
        let lane_dropped = match from {
            ReanchorFrom::Origin => tx
                .conn()
                .execute(
                    names
                        .render("DELETE FROM {{lane}} WHERE id IN (SELECT id FROM {{log}})")
                        .as_str(),
                )
                .await?
                .rows_affected(),
            ReanchorFrom::Now => 0,
        };
        tx.conn().execute(
            names
                .render(
                    "SELECT setval('{{order_lit}}', m) FROM (SELECT max(seq) AS m FROM {{log}}) x \
                     WHERE m > coalesce(pg_sequence_last_value('{{order_lit}}'), 0)",
                )
                .as_str(),
        )
        .await?;
        let anchor = anchor.to_string();
        sqlx::query(&names.render(&format!(
            "UPDATE {{{{meta}}}} SET origin = $1::pg_snapshot, \
             (system_identifier, database_oid, database_name, anchored_at) = \
             (SELECT f.*, now() FROM ({FOUND}) f)"
        )))
        .persistent(false)
        .bind(&anchor)
        .execute(tx.conn())
        .await?;
        let cursors = sqlx::query(&names.render(RESET_CURSORS))
            .persistent(false)
            .bind(&anchor)
            .execute(tx.conn())
            .await?
            .rows_affected();
        tx.conn()
            .execute(names.render("DELETE FROM {{boot}}").as_str())
            .await?;
        tx.commit().await?;
        tracing::warn!(
            outbox = %outbox_name(names),
            previous = ?check.stored.as_ref().map(ToString::to_string),
            identity = %check.found,
            %from,
            events,
            cursors,
            lane_dropped,
            "re-anchored the event log's positions to this database"
        );
        Ok(Reanchored {
            previous: check.stored,
            identity: check.found,
            from,
            events,
            cursors,
            lane_dropped,
        })
    }
}

/// `snap` (taken by transaction `own`, which it does not list) with `own`
/// counted as committed: a snapshot never lists its own transaction as
/// running, but has it at or above `xmax` when it is the newest.
fn committed_in(mut snap: Snap, own: u64) -> Snap {
    snap.xip.retain(|x| *x != own);
    if snap.xmax <= own {
        snap.xmax = own + 1;
    }
    snap
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

    #[test]
    fn the_now_anchor_counts_its_own_transaction_as_committed() {
        let s = committed_in(Snap::parse("727:727:").unwrap(), 727);
        assert!(s.visible(727));
        assert!(!s.visible(728));
        let s = committed_in(Snap::parse("700:730:710,720").unwrap(), 725);
        assert!(s.visible(725) && !s.visible(710) && !s.visible(730));
    }

    #[test]
    fn every_refusal_names_what_to_run() {
        let other = Refusal::OtherDatabase {
            outbox: "s.t".into(),
            stored: id(1, 5, "app"),
            found: id(1, 6, "copy"),
        }
        .to_string();
        assert!(
            other.contains("same cluster") && other.contains("outbox-relay reanchor --from origin")
        );
        let new = Refusal::SchemaTooNew {
            outbox: "s.t".into(),
            found: 9,
            known: 6,
            applied_by: Some("0.9.0".into()),
        }
        .to_string();
        assert!(
            new.contains("schema version 9") && new.contains("run outbox-relay 0.9.0 or later")
        );
        let cache = Refusal::SequenceCache {
            sequence: "\"s\".\"t_log_order\"".into(),
            cache: 20,
        }
        .to_string();
        assert!(cache.contains("ALTER SEQUENCE \"s\".\"t_log_order\" CACHE 1"));
    }
}
