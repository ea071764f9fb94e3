//! The re-anchor ([`PgLogStore::reanchor`]): moves the event log's stored
//! positions to the database this store is connected to, after a
//! switchover, a restore, a copy or a pg_upgrade; and
//! [`PgLogStore::identity`], what the log records and what it finds (the
//! checks that refuse to claim elsewhere are in `log/anchor.rs`).

use super::anchor::{check_schema, outbox_name, read_identity, IdentityCheck, FOUND};
use super::snapshot::Snap;
use super::store::PgLogStore;
use crate::error::{Identity, StoreError};
use crate::migrate::log::LOCK_NAMESPACE;
use sqlx::Executor;
use std::fmt;

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

fn decode_err(what: String) -> StoreError {
    StoreError::Database(sqlx::Error::Decode(what.into()))
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
    /// restore, a copy or a pg_upgrade: see [`Refusal::OtherDatabase`](crate::error::Refusal::OtherDatabase)),
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

    #[test]
    fn the_now_anchor_counts_its_own_transaction_as_committed() {
        let s = committed_in(Snap::parse("727:727:").unwrap(), 727);
        assert!(s.visible(727));
        assert!(!s.visible(728));
        let s = committed_in(Snap::parse("700:730:710,720").unwrap(), 725);
        assert!(s.visible(725) && !s.visible(710) && !s.visible(730));
    }
}
