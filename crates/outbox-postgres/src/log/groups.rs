//! Consumer groups as an operator sees them: their names, what each holds
//! (cursors, retry lane, dead letters), which of them holds rotation back,
//! dropping one, and what holds the database's horizon back.
//!
//! Everything here reads or deletes rows of one outbox through the store's
//! pool and names; nothing here is on the claim or settle path.

use super::options::PgLogOptions;
use super::sql::{
    BEHIND, BEHIND_PARTITION, CONTENTS, DEAD_BY_CODE, GROUP_DELETE, GROUP_NAMES,
    GROUP_OWNERS_FOR_UPDATE, INCOMPLETE, OLDEST_TRANSACTION, PREPARED, RELAYS, SLOTS,
};
use super::store::{LogStatus, PgLogStore};
use crate::error::StoreError;
use crate::group_name::GroupName;
use crate::names::log::PARTITIONS;
use sqlx::Row;
use std::collections::BTreeMap;
use std::time::Duration;

/// One consumer group's progress (see [`PgLogStore::groups`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupStatus {
    /// The group.
    pub name: String,
    /// Its cursors, retry lane and lag per shard, and the log's partitions
    /// (`status.dead` counts the group's dead letters).
    pub status: LogStatus,
    /// Its dead letters by error code.
    pub dead_by_code: BTreeMap<String, u64>,
    /// Why this group holds the next rotation back (its cursors have not
    /// passed every event of the partition rotation truncates next, or it
    /// has cursors for only some shards of a layout); `None` when it does not.
    pub holds_rotation: Option<String>,
}

impl GroupStatus {
    /// Events its cursors have not passed, over all shards.
    pub fn pending(&self) -> u64 {
        self.status.shards.iter().map(|s| s.pending).sum()
    }

    /// The largest lag of its shards.
    pub fn lag(&self) -> Option<Duration> {
        self.status.shards.iter().filter_map(|s| s.lag).max()
    }

    /// Rows of its retry lane.
    pub fn lane(&self) -> u64 {
        self.status.shards.iter().map(|s| s.lane).sum()
    }

    /// Keys with events parked behind an earlier one.
    pub fn parked_keys(&self) -> u64 {
        self.status.shards.iter().map(|s| s.parked_keys).sum()
    }
}

/// What a group holds in the database (see [`PgLogStore::group_contents`]
/// and [`PgLogStore::drop_group`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct GroupContents {
    /// Its cursors (one per shard of each layout).
    pub cursors: u64,
    /// Rows of its retry lane.
    pub lane: u64,
    /// Its dead letters.
    pub dead: u64,
    /// Its control row (a pause): 0 or 1.
    pub control: u64,
    /// Its relay rows (members of its relay group, live or not).
    pub relays: u64,
    /// Relays holding a current lease on one of its cursors.
    pub leased_by: Vec<String>,
}

impl GroupContents {
    /// Whether the group holds nothing (it does not exist).
    pub fn is_empty(&self) -> bool {
        self.cursors == 0
            && self.lane == 0
            && self.dead == 0
            && self.control == 0
            && self.relays == 0
    }
}

/// What [`PgLogStore::drop_group`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GroupDrop {
    /// The group was deleted: what it held (`leased_by`: the relays that
    /// held a current lease, only with `force`).
    Dropped(GroupContents),
    /// Nothing changed: these relays hold a current lease on the group's
    /// cursors (stop them first, or force the drop).
    Leased {
        /// The lease holders.
        by: Vec<String>,
    },
}

/// A relay, as the cursor rows show it (see [`PgLogStore::relays`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayLease {
    /// The relay id (lease owner).
    pub relay: String,
    /// The group of its cursors.
    pub group: String,
    /// The shards it holds a current lease on (`INDEX/TOTAL`).
    pub shards: Vec<String>,
}

/// The oldest open transaction that holds the horizon back.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OldTransaction {
    /// Its age (database clock).
    pub age: Duration,
    /// The backend's process id.
    pub pid: i32,
    /// Its `application_name`.
    pub application_name: String,
    /// Its `state` (`active`, `idle in transaction`, ...).
    pub state: Option<String>,
    /// Whether it has a transaction id (it wrote): its events, if any, are
    /// not readable before it commits, and rotation cannot truncate a
    /// partition it wrote to.
    pub writer: bool,
}

/// A replication slot (its `xmin` / `catalog_xmin` hold the vacuum horizon).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SlotHold {
    /// The slot's name.
    pub name: String,
    /// `physical` or `logical`.
    pub slot_type: String,
    /// Whether a client is attached.
    pub active: bool,
    /// Age of its `xmin`, in transactions (`age(xmin)`).
    pub xmin_age: Option<i64>,
    /// Age of its `catalog_xmin`, in transactions.
    pub catalog_xmin_age: Option<i64>,
}

/// What holds the database horizon back (see [`PgLogStore::horizon`]): the
/// oldest open transaction and the replication slots. Old snapshots do not
/// slow the event log down (it never updates rows), but they hold back
/// vacuum of the retry lane and cursors, and a writer holds rotation back.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Horizon {
    /// The oldest open transaction with a snapshot or a transaction id
    /// (other than this session's).
    pub oldest_transaction: Option<OldTransaction>,
    /// Replication slots.
    pub slots: Vec<SlotHold>,
    /// Prepared (two-phase) transactions, and the oldest one's age.
    pub prepared: u64,
    /// Age of the oldest prepared transaction.
    pub oldest_prepared: Option<Duration>,
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn micros(us: Option<i64>) -> Option<Duration> {
    us.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)))
}

impl PgLogStore {
    fn render(&self, sql: &str) -> String {
        self.log().names.render(sql)
    }

    /// The same outbox as seen by consumer group `group`, on this store's
    /// pool, without background rotation: for reading another group's
    /// status or dead letters.
    pub async fn for_group(&self, group: &GroupName) -> Result<PgLogStore, StoreError> {
        let options = PgLogOptions::default()
            .with_schema(self.log().schema().clone())
            .with_table(self.log().table().clone())
            .with_group(group.as_str())
            .with_background_rotation(false);
        PgLogStore::on(self.db().clone(), options).await
    }

    /// Every group that has cursors, retry-lane rows or dead letters, by name.
    pub async fn group_names(&self) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(&self.render(GROUP_NAMES))
            .persistent(false)
            .fetch_all(self.db())
            .await?)
    }

    /// The status of every group (see [`group_names`](Self::group_names)),
    /// by name. A stored name that is not a valid [`GroupName`] (written by
    /// hand) is skipped with a warning.
    pub async fn groups(&self) -> Result<Vec<GroupStatus>, StoreError> {
        let mut out = Vec::new();
        for name in self.group_names().await? {
            match GroupName::new(name.clone()) {
                Ok(group) => out.push(self.group_status(&group).await?),
                Err(e) => tracing::warn!(group = %name, error = %e, "skipping a stored group"),
            }
        }
        Ok(out)
    }

    /// One group's status (no shards and no dead letters when the group
    /// has nothing yet).
    pub async fn group_status(&self, group: &GroupName) -> Result<GroupStatus, StoreError> {
        let status = self.for_group(group).await?.status().await?;
        let dead_by_code = sqlx::query_as::<_, (String, i64)>(&self.render(DEAD_BY_CODE))
            .persistent(false)
            .bind(group.as_str())
            .fetch_all(self.db())
            .await?
            .into_iter()
            .map(|(code, n)| (code, count(n)))
            .collect();
        let holds_rotation = self
            .holds_rotation(group.as_str(), status.log.generation)
            .await?;
        Ok(GroupStatus {
            name: group.to_string(),
            status,
            dead_by_code,
            holds_rotation,
        })
    }

    /// Why `group` holds back the rotation that follows generation
    /// `generation` (it truncates partition `(generation + 1) % 3`).
    async fn holds_rotation(
        &self,
        group: &str,
        generation: i64,
    ) -> Result<Option<String>, StoreError> {
        let incomplete: Vec<(i32, i64)> = sqlx::query_as(&self.render(INCOMPLETE))
            .persistent(false)
            .bind(group)
            .fetch_all(self.db())
            .await?;
        if let Some((total, have)) = incomplete.first() {
            return Ok(Some(format!(
                "it has cursors for {have} of its {total} shards"
            )));
        }
        let target = usize::try_from((generation + 1).rem_euclid(PARTITIONS as i64)).unwrap_or(0);
        let sql = self.render(
            &BEHIND
                .replace("{{behind}}", BEHIND_PARTITION)
                .replace("{{part}}", &self.log().names.partition(target)),
        );
        let behind: Vec<(i32, i32)> = sqlx::query_as(&sql)
            .persistent(false)
            .bind(group)
            .fetch_all(self.db())
            .await?;
        if behind.is_empty() {
            return Ok(None);
        }
        let shards: Vec<String> = behind.iter().map(|(t, i)| format!("{i}/{t}")).collect();
        Ok(Some(format!(
            "shard(s) {} have not passed every event of partition {target} (rotated out next)",
            shards.join(", ")
        )))
    }

    /// What `group` holds: cursors, retry-lane rows, dead letters, and the
    /// relays leasing its cursors now.
    pub async fn group_contents(&self, group: &str) -> Result<GroupContents, StoreError> {
        let row = sqlx::query(&self.render(CONTENTS))
            .persistent(false)
            .bind(group)
            .fetch_one(self.db())
            .await?;
        Ok(GroupContents {
            cursors: count(row.try_get(0)?),
            lane: count(row.try_get(1)?),
            dead: count(row.try_get(2)?),
            control: count(row.try_get(3)?),
            relays: count(row.try_get(4)?),
            leased_by: row.try_get(5)?,
        })
    }

    /// Deletes `group`'s cursors, retry lane, dead letters, control row
    /// (a pause) and relay rows in one fenced step: one transaction locks
    /// the group's cursor rows, reads who leases them and, unless a relay
    /// holds a current lease and `force` is false, deletes everything. A
    /// relay renewing or taking a lease meanwhile waits for that
    /// transaction and then finds no cursor: its settles are fenced, and a
    /// relay that had found the cursor before (its lease lapsed a moment
    /// before the drop, or it was forced out) refuses to claim
    /// ([`Refusal::GroupDropped`](crate::error::Refusal::GroupDropped))
    /// instead of creating the cursor again at the log's origin, which
    /// would deliver the whole retained log again. A relay started after
    /// the drop starts the group as new (see
    /// [`PgLogOptions::with_new_group_start`]).
    pub async fn drop_group(&self, group: &str, force: bool) -> Result<GroupDrop, StoreError> {
        let mut tx = self.db().begin().await?;
        let owners: Vec<(Option<String>, bool)> =
            sqlx::query_as(&self.render(GROUP_OWNERS_FOR_UPDATE))
                .persistent(false)
                .bind(group)
                .fetch_all(&mut tx)
                .await?;
        let mut leased_by: Vec<String> = owners
            .into_iter()
            .filter_map(|(owner, current)| owner.filter(|_| current))
            .collect();
        leased_by.dedup();
        if !leased_by.is_empty() && !force {
            return Ok(GroupDrop::Leased { by: leased_by });
        }
        let mut deleted = [0u64; GROUP_DELETE.len()];
        for (i, sql) in GROUP_DELETE.iter().enumerate() {
            deleted[i] = sqlx::query(&self.render(sql))
                .persistent(false)
                .bind(group)
                .execute(&mut tx)
                .await?
                .rows_affected();
        }
        tx.commit().await?;
        tracing::info!(%group, cursors = deleted[0], lane = deleted[1], dead = deleted[2],
            control = deleted[3], relays = deleted[4], "dropped consumer group");
        Ok(GroupDrop::Dropped(GroupContents {
            cursors: deleted[0],
            lane: deleted[1],
            dead: deleted[2],
            control: deleted[3],
            relays: deleted[4],
            leased_by,
        }))
    }

    /// The relays holding a current lease on a cursor, from the cursor rows
    /// (every group), with their shards.
    pub async fn relays(&self) -> Result<Vec<RelayLease>, StoreError> {
        let rows: Vec<(String, String, i32, i32)> = sqlx::query_as(&self.render(RELAYS))
            .persistent(false)
            .fetch_all(self.db())
            .await?;
        let mut out: Vec<RelayLease> = Vec::new();
        for (relay, group, total, index) in rows {
            let shard = format!("{index}/{total}");
            match out.last_mut() {
                Some(last) if last.relay == relay && last.group == group => last.shards.push(shard),
                _ => out.push(RelayLease {
                    relay,
                    group,
                    shards: vec![shard],
                }),
            }
        }
        Ok(out)
    }

    /// What holds the database horizon back: the oldest open transaction
    /// (age, pid, application name), the replication slots (age of their
    /// `xmin` / `catalog_xmin`) and prepared transactions. Reads
    /// `pg_stat_activity` (other users' sessions show only to a superuser or
    /// a member of `pg_read_all_stats`), `pg_replication_slots` and
    /// `pg_prepared_xacts`.
    pub async fn horizon(&self) -> Result<Horizon, StoreError> {
        let oldest = sqlx::query(OLDEST_TRANSACTION)
            .persistent(false)
            .fetch_optional(self.db())
            .await?
            .map(|r| -> Result<OldTransaction, sqlx::Error> {
                Ok(OldTransaction {
                    age: micros(r.try_get(0)?).unwrap_or_default(),
                    pid: r.try_get(1)?,
                    application_name: r.try_get(2)?,
                    state: r.try_get(3)?,
                    writer: r.try_get(4)?,
                })
            })
            .transpose()?;
        let slots = sqlx::query(SLOTS)
            .persistent(false)
            .fetch_all(self.db())
            .await?
            .iter()
            .map(|r| {
                Ok(SlotHold {
                    name: r.try_get(0)?,
                    slot_type: r.try_get(1)?,
                    active: r.try_get(2)?,
                    xmin_age: r.try_get(3)?,
                    catalog_xmin_age: r.try_get(4)?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        let (prepared, oldest_prepared): (i64, Option<i64>) = sqlx::query_as(PREPARED)
            .persistent(false)
            .fetch_one(self.db())
            .await?;
        Ok(Horizon {
            oldest_transaction: oldest,
            slots,
            prepared: count(prepared),
            oldest_prepared: micros(oldest_prepared),
        })
    }
}
