//! What the store reports: the cursors of its group, its statistics,
//! per-shard progress, the partitions, and the events held by claims of
//! this process.

use super::context::Ctx;
use super::cursor::{Kind, Src};
use super::rows::{count, shard_spec};
use crate::error::StoreError;
use crate::names::log::PARTITIONS;
use chrono::{DateTime, Utc};
use outbox_core::{EventId, FencingToken, RelayId, ShardSpec, Stats};
use sqlx::Row;
use std::time::Duration;

/// One event held by a claim of this process (see [`PgLogStore::in_flight`](super::PgLogStore::in_flight)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFlight {
    /// The event.
    pub id: EventId,
    /// The claim's token.
    pub token: FencingToken,
    /// The claiming relay.
    pub relay: RelayId,
    /// Its shard.
    pub shard: ShardSpec,
    /// Attempts including the claimed one.
    pub attempts: u32,
}

/// A cursor of the store's consumer group (see [`PgLogStore::cursors`](super::PgLogStore::cursors)).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CursorInfo {
    /// The shard it reads.
    pub shard: ShardSpec,
    /// The lease holder, if any.
    pub owner: Option<String>,
    /// Its lease (database clock).
    pub lease_until: Option<DateTime<Utc>>,
    /// Whether the lease is current.
    pub leased: bool,
    /// The fencing epoch (+1 at each change of holder).
    pub epoch: i64,
    /// When its position last moved (database clock).
    pub updated_at: DateTime<Utc>,
}

/// One shard's progress (see [`PgLogStore::status`](super::PgLogStore::status)).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ShardStatus {
    /// The cursor.
    pub cursor: CursorInfo,
    /// Committed events of the shard its cursor has not passed (including
    /// events of claims not settled yet).
    pub pending: u64,
    /// Age of the oldest of them, or of the oldest retry-lane row (database
    /// clock): the shard's lag.
    pub lag: Option<Duration>,
    /// Rows of the shard in the retry lane (retries, released, parked).
    pub lane: u64,
    /// Keys of the shard with events parked behind an earlier one.
    pub parked_keys: u64,
}

/// The consumer group's progress (see [`PgLogStore::status`](super::PgLogStore::status)).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LogStatus {
    /// One entry per cursor.
    pub shards: Vec<ShardStatus>,
    /// Dead letters of the group.
    pub dead: u64,
    /// Age of the oldest open transaction that has a transaction id: its
    /// events (if it wrote any) wait for its commit, and a partition it
    /// wrote to cannot be rotated out.
    pub oldest_writer: Option<Duration>,
    /// Partitions and rotations.
    pub log: LogInfo,
    /// The database the log's positions belong to and the one this
    /// connection is to (`None`: a schema older than migration 6). When
    /// they differ relays refuse to claim: `outbox-relay reanchor`.
    pub identity: Option<crate::log::anchor::IdentityCheck>,
}

/// The state of the log's partitions (see [`PgLogStore::log_info`](super::PgLogStore::log_info)).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LogInfo {
    /// The current generation: new events go to partition `generation % 3`.
    pub generation: i64,
    /// Rotations so far.
    pub rotations: i64,
    /// When the current partition became current (database clock).
    pub switched_at: DateTime<Utc>,
    /// The partitions, in slot order.
    pub partitions: Vec<PartitionInfo>,
}

/// One partition of the log.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PartitionInfo {
    /// Its slot (0..3).
    pub slot: usize,
    /// Whether new events go to it.
    pub current: bool,
    /// Live rows (statistics collector estimate).
    pub live_tuples: i64,
    /// Dead rows (statistics collector): only rolled-back enqueues make any.
    pub dead_tuples: i64,
    /// Table + index + TOAST size in bytes.
    pub bytes: i64,
}

/// The events held by claims of this process that are not settled yet.
pub(super) async fn in_flight(ctx: &Ctx) -> Vec<InFlight> {
    let cells = ctx.cursors.all();
    let mut out = Vec::new();
    for (key, cell) in cells {
        let st = cell.lock().await;
        if st.epoch().is_none() {
            continue;
        }
        for b in &st.batches {
            for item in b.held() {
                out.push(InFlight {
                    id: item.id,
                    token: b.token,
                    relay: key.relay.clone(),
                    shard: key.shard(),
                    attempts: match item.src {
                        Src::Log { .. } => 1,
                        Src::Lane { attempts, .. } => u32::try_from(attempts).unwrap_or(0) + 1,
                    },
                });
            }
        }
    }
    out
}

/// The cursors of this store's consumer group.
pub(super) async fn cursors(ctx: &Ctx) -> Result<Vec<CursorInfo>, StoreError> {
    let rows = sqlx::query(&ctx.sql.cursors)
        .persistent(false)
        .bind(&ctx.group)
        .fetch_all(&ctx.db)
        .await?;
    rows.iter()
        .map(|r| {
            let total: i32 = r.try_get(0)?;
            let index: i32 = r.try_get(1)?;
            Ok(CursorInfo {
                shard: shard_spec(index, total),
                epoch: r.try_get(2)?,
                owner: r.try_get(3)?,
                lease_until: r.try_get(4)?,
                leased: r.try_get::<Option<bool>, _>(5)?.unwrap_or(false),
                updated_at: r.try_get(10)?,
            })
        })
        .collect()
}

/// The store's [`Stats`]: what the database holds for the group, less
/// what claims of this process hold or settled in part.
pub(super) async fn stats(ctx: &Ctx) -> Result<Stats, StoreError> {
    let row = sqlx::query(&ctx.sql.stats)
        .persistent(false)
        .bind(&ctx.group)
        .fetch_one(&ctx.db)
        .await?;
    let total: i64 = row.try_get(0)?;
    let oldest: Option<i64> = row.try_get(1)?;
    let dead: i64 = row.try_get(2)?;
    // What the database cannot see: batches of this process that are
    // settled in part (their resolved rows are already in the lane or
    // the dead letters, or gone) and events held under a current lease.
    let cursors = cursors_raw(ctx).await?;
    let cells = ctx.cursors.all();
    let mut resolved_log = 0u64;
    let mut in_flight = 0u64;
    for (key, cell) in cells {
        let st = cell.lock().await;
        let Some(epoch) = st.epoch() else { continue };
        let rows: Vec<(i64, bool)> = cursors
            .iter()
            .filter(|(k, _, _)| k.0 == key.total && key.shards.contains(&k.1))
            .map(|(_, e, l)| (*e, *l))
            .collect();
        if rows.len() != key.shards.len() || rows.iter().any(|(e, _)| *e != epoch) {
            continue;
        }
        let leased = rows.iter().all(|(_, l)| *l);
        for b in &st.batches {
            for item in &b.items {
                let consumed = item.resolved || item.kind != Kind::Deliver;
                if consumed && matches!(item.src, Src::Log { .. }) {
                    resolved_log += 1;
                } else if !consumed && leased {
                    in_flight += 1;
                }
            }
        }
    }
    let pending = count(total)
        .saturating_sub(resolved_log)
        .saturating_sub(in_flight);
    Ok(Stats {
        pending,
        in_flight,
        dead: count(dead),
        oldest_pending_age: oldest
            .filter(|_| pending + in_flight > 0)
            .map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0))),
    })
}

/// `((shard total, shard index), epoch, leased)` of every cursor.
async fn cursors_raw(ctx: &Ctx) -> Result<Vec<((u32, u32), i64, bool)>, StoreError> {
    Ok(cursors(ctx)
        .await?
        .into_iter()
        .map(|c| ((c.shard.total(), c.shard.index()), c.epoch, c.leased))
        .collect())
}

/// Rotates when due: truncates the oldest partition once every cursor
/// has passed all of its rows and no transaction holds it, and makes it
/// Generation, rotations and the size of each partition.
pub(super) async fn log_info(ctx: &Ctx) -> Result<LogInfo, StoreError> {
    let names = ctx.names.partition_relnames();
    let rows = sqlx::query(&ctx.sql.partitions_info)
        .persistent(false)
        .bind(ctx.names.schema.as_str())
        .bind(names)
        .fetch_all(&ctx.db)
        .await?;
    let mut info = LogInfo {
        generation: 0,
        rotations: 0,
        switched_at: DateTime::<Utc>::MIN_UTC,
        partitions: Vec::with_capacity(PARTITIONS),
    };
    for r in &rows {
        info.generation = r.try_get::<Option<i64>, _>(4)?.unwrap_or(0);
        info.rotations = r.try_get(5)?;
        info.switched_at = r.try_get(6)?;
        let slot = usize::try_from(r.try_get::<i32, _>(0)? - 1).unwrap_or(0);
        info.partitions.push(PartitionInfo {
            slot,
            current: false,
            live_tuples: r.try_get(1)?,
            dead_tuples: r.try_get(2)?,
            bytes: r.try_get(3)?,
        });
    }
    let current = usize::try_from(info.generation.rem_euclid(PARTITIONS as i64)).unwrap_or(0);
    for p in &mut info.partitions {
        p.current = p.slot == current;
    }
    Ok(info)
}

/// Per-shard progress, dead letters, the oldest writer and the
/// partitions: what `outbox-relay status` and the metrics show.
pub(super) async fn status(ctx: &Ctx) -> Result<LogStatus, StoreError> {
    let rows = sqlx::query(&ctx.sql.status)
        .persistent(false)
        .bind(&ctx.group)
        .fetch_all(&ctx.db)
        .await?;
    let micros_to =
        |us: Option<i64>| us.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)));
    let mut shards = Vec::with_capacity(rows.len());
    for r in &rows {
        let total: i32 = r.try_get(0)?;
        let index: i32 = r.try_get(1)?;
        let log_lag = micros_to(r.try_get(7)?);
        let lane_lag = micros_to(r.try_get(10)?);
        shards.push(ShardStatus {
            cursor: CursorInfo {
                shard: shard_spec(index, total),
                owner: r.try_get(2)?,
                leased: r.try_get(3)?,
                epoch: r.try_get(4)?,
                lease_until: None,
                updated_at: r.try_get(5)?,
            },
            pending: count(r.try_get(6)?),
            lag: log_lag.max(lane_lag),
            lane: count(r.try_get(8)?),
            parked_keys: count(r.try_get(9)?),
        });
    }
    let dead: i64 = sqlx::query_scalar(&ctx.sql.dead_count)
        .persistent(false)
        .bind(&ctx.group)
        .fetch_one(&ctx.db)
        .await?;
    let oldest: Option<i64> = sqlx::query_scalar(ctx.sql.oldest_writer)
        .persistent(false)
        .fetch_one(&ctx.db)
        .await?;
    Ok(LogStatus {
        shards,
        dead: count(dead),
        oldest_writer: micros_to(oldest),
        log: log_info(ctx).await?,
        identity: identity(ctx).await,
    })
}

/// The stored and found identity, or `None` when it cannot be read (a
/// schema before migration 6).
async fn identity(ctx: &Ctx) -> Option<crate::log::anchor::IdentityCheck> {
    let mut tx = ctx.db.begin().await.ok()?;
    match crate::log::anchor::read_identity(tx.conn(), &ctx.names).await {
        Ok(check) => Some(check),
        Err(e) => {
            tracing::debug!(error = %e, "the log's identity cannot be read");
            None
        }
    }
}
