//! Why the event log refuses to claim ([`Refusal`], carried by
//! [`StoreError::Refused`](super::StoreError::Refused)) and the database
//! identity it names ([`Identity`]).

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
                    env!("CARGO_PKG_VERSION")
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
