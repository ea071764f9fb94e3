//! The cursor rows in the database: every statement that takes, renews,
//! gives back or fences a cursor lease runs here (the lease held in memory
//! is written by [`CursorState`] alone), with where a new cursor starts and
//! the database incarnation the leases are held under.

use super::context::Ctx;
use super::cursor::{Cell, CursorKey, CursorState, Granted};
use super::rows::{decode_err, micros, position, row_skip_list, snap};
use crate::error::Refusal;
use crate::error::StoreError;
use crate::log::options::{GroupStart, LeaseTimers};
use crate::log::snapshot::{Position, Snap};
use chrono::{DateTime, Utc};
use outbox_core::{FencingToken, RelayId};
use sqlx::Row;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Where a new cursor of shard `index`/`total` starts: what the
/// group's cursors covering all of its keys have passed (e.g. the
/// cursors of another shard layout), or else the log's origin; for a
/// group without cursors that starts [`GroupStart::Now`], now.
async fn start_position(ctx: &Ctx, total: u32, index: u32) -> Result<Snap, StoreError> {
    let existing = group_starts(ctx).await?;
    if let Some(common) = covering_start(total, index, &existing) {
        return Ok(common);
    }
    if existing.is_empty() && ctx.new_group_start == GroupStart::Now {
        return create_group_at_now(ctx, total).await;
    }
    let origin: String = sqlx::query_scalar(&ctx.sql.origin)
        .fetch_one(&ctx.db)
        .await?;
    snap(&origin)
}

/// `(shard total, shard index, lo)` of every cursor of the group.
pub(super) async fn group_starts(ctx: &Ctx) -> Result<Vec<(u32, u32, Snap)>, StoreError> {
    let rows: Vec<(i32, i32, String)> = sqlx::query_as(&ctx.sql.group_starts)
        .bind(&ctx.group)
        .fetch_all(&ctx.db)
        .await?;
    rows.into_iter()
        .map(|(t, i, lo)| {
            Ok((
                u32::try_from(t).unwrap_or(1),
                u32::try_from(i).unwrap_or(0),
                snap(&lo)?,
            ))
        })
        .collect()
}

/// Takes or keeps the cursor lease. Returns the database's `now()` and
/// whether we hold it.
async fn acquire(
    ctx: &Ctx,
    key: &CursorKey,
    st: &mut CursorState,
    lease: Duration,
) -> Result<(DateTime<Utc>, bool), StoreError> {
    let (grp, total, indexes) = ctx.cursor_binds(key);
    let index = indexes.first().copied().unwrap_or(0);
    for _ in 0..2 {
        let row = sqlx::query(&ctx.sql.acquire)
            .bind(&grp)
            .bind(total)
            .bind(index)
            .bind(key.relay.as_str())
            .bind(st.epoch().unwrap_or(-1))
            .bind(micros(lease)?)
            .fetch_one(&ctx.db)
            .await?;
        let now: DateTime<Utc> = row.try_get(6)?;
        let present: bool = row.try_get(7)?;
        let epoch: Option<i64> = row.try_get(0)?;
        if present {
            st.cursor_seen = true;
        }
        match epoch {
            Some(epoch) => {
                let lease_until: DateTime<Utc> = row.try_get(1)?;
                let granted = Granted {
                    until: lease_until,
                    len: lease,
                };
                if st.epoch() != Some(epoch) {
                    // A new holding: start from the settled position.
                    ctx.cursors.lose(st);
                    let lo: String = row.try_get(2)?;
                    let hi: String = row.try_get(3)?;
                    let done = position(
                        (&lo, row.try_get(10)?),
                        (&hi, row.try_get(11)?),
                        row.try_get(4)?,
                        row.try_get(5)?,
                    )?;
                    let boot = incarnation(ctx, row.try_get(12)?).await?;
                    let skip = row_skip_list(&row, 8, 9)?;
                    st.take(epoch, boot, granted, done, skip);
                    tracing::debug!(group = %grp, shard = %key.shard(), relay = %key.relay, epoch, "took the cursor lease");
                } else {
                    st.renewed(granted);
                }
                return Ok((now, true));
            }
            None if present => {
                if st.epoch().is_some() {
                    tracing::warn!(group = %grp, shard = %key.shard(), relay = %key.relay, "cursor lease lost to another relay");
                }
                ctx.cursors.lose(st);
                return Ok((now, false));
            }
            None if st.cursor_seen => {
                // The cursor this relay was reading is gone: the group
                // was dropped (a lease that lapsed a moment before the
                // drop). Creating it again would start at the origin and
                // deliver the whole retained log again.
                ctx.cursors.lose(st);
                return Err(StoreError::Refused(Refusal::GroupDropped {
                    group: grp,
                    shard: key.shard().to_string(),
                }));
            }
            None => {
                let start = start_position(ctx, key.total, key.shard().index()).await?;
                sqlx::query(&ctx.sql.create_cursor)
                    .bind(&grp)
                    .bind(total)
                    .bind(index)
                    .bind(start.to_string())
                    .execute(&ctx.db)
                    .await?;
            }
        }
    }
    Err(decode_err(
        "the cursor row vanished while it was being created".to_owned(),
    ))
}

/// The database incarnation: the token in the unlogged `{{boot}}` table
/// as a statement read it (`read`), or, when crash recovery or a
/// promotion emptied the table, a new token written now (the first
/// writer wins; every store reads the winner's).
pub(super) async fn incarnation(ctx: &Ctx, read: Option<String>) -> Result<String, StoreError> {
    if let Some(token) = read {
        return Ok(token);
    }
    // Two stores racing to write the first token: the loser's INSERT
    // waits for the winner's and does nothing, and its statement's
    // snapshot predates the winner's row: the next statement sees it.
    for _ in 0..3 {
        let token: Option<String> = sqlx::query_scalar(&ctx.sql.boot)
            .bind(Uuid::new_v4())
            .fetch_optional(&ctx.db)
            .await?;
        if let Some(token) = token {
            tracing::info!(group = %ctx.group, incarnation = %token, "database incarnation recorded");
            return Ok(token);
        }
    }
    Err(decode_err(
        "the database incarnation token could not be read".to_owned(),
    ))
}

/// Takes or keeps the lease of `key`'s cursor(s): a static shard's by
/// [`acquire`], a relay group's set by renewing it.
pub(super) async fn hold(
    ctx: &Ctx,
    key: &CursorKey,
    st: &mut CursorState,
    lease: Duration,
) -> Result<bool, StoreError> {
    if key.dynamic {
        renew_set(ctx, key, st, lease).await
    } else {
        Ok(acquire(ctx, key, st, lease).await?.1)
    }
}

/// The fence (and optional position move) of every write: our `epoch`
/// under incarnation `boot`.
pub(super) async fn advance(
    ctx: &Ctx,
    conn: impl sqlx::Executor<'_, Database = sqlx::Postgres>,
    key: &CursorKey,
    (epoch, boot): (i64, &str),
    to: Option<&Position>,
    skip: Option<&[(u64, i64)]>,
) -> Result<bool, StoreError> {
    let (grp, total, indexes) = ctx.cursor_binds(key);
    let (lo, hi, txid, seq) = match to {
        Some(p) => (
            Some(p.lo.to_string()),
            Some(p.hi.to_string()),
            p.after.map(|a| a.0.to_string()),
            p.after.map(|a| a.1),
        ),
        None => (None, None, None, None),
    };
    let boot = Uuid::parse_str(boot).unwrap_or_default();
    let row = sqlx::query(&ctx.sql.advance)
        .bind(&grp)
        .bind(total)
        .bind(indexes)
        .bind(epoch)
        .bind(lo)
        .bind(hi)
        .bind(txid)
        .bind(seq)
        .bind(skip.map(|s| s.iter().map(|(t, _)| t.to_string()).collect::<Vec<_>>()))
        .bind(skip.map(|s| s.iter().map(|(_, q)| *q).collect::<Vec<_>>()))
        .bind((!ctx.durable_progress).then_some("off"))
        .bind(to.map_or(0, |p| p.lo.floor))
        .bind(to.map_or(0, |p| p.hi.floor))
        .bind(boot)
        .fetch_all(conn)
        .await?;
    Ok(row.len() == key.shards.len())
}

/// Renews the lease of the batch of `token` (and of its cursor) for
/// `lease`: the events it still holds, or 0 when the batch is settled,
/// void, or its cursor's lease is no longer ours.
pub(super) async fn renew_batch(
    ctx: &Ctx,
    token: FencingToken,
    lease: Duration,
) -> Result<u64, StoreError> {
    let Some(key) = ctx.cursors.token_key(token) else {
        return Ok(0);
    };
    let Some(cell) = ctx.cursors.cell(&key) else {
        return Ok(0);
    };
    let mut st = cell.lock().await;
    let Some(batch) = st.batches.iter().find(|b| b.token == token) else {
        return Ok(0);
    };
    let held = batch.held().count() as u64;
    let epoch = batch.epoch;
    let boot = Uuid::parse_str(&batch.boot).unwrap_or_default();
    if held == 0 || st.epoch() != Some(epoch) || st.boot.as_deref() != Some(batch.boot.as_str()) {
        return Ok(0);
    }
    let (grp, total, indexes) = ctx.cursor_binds(&key);
    let renewed: Vec<DateTime<Utc>> = sqlx::query_scalar(&ctx.sql.renew)
        .bind(&grp)
        .bind(total)
        .bind(indexes)
        .bind(epoch)
        .bind(micros(lease)?)
        .bind(boot)
        .fetch_all(&ctx.db)
        .await?;
    let until = (renewed.len() == key.shards.len())
        .then(|| renewed.into_iter().min())
        .flatten();
    match until {
        Some(until) => {
            st.renewed(Granted { until, len: lease });
            let expires = Instant::now() + LeaseTimers::new(lease).abandon_after();
            if let Some(b) = st.batches.iter_mut().find(|b| b.token == token) {
                b.expires = expires;
            }
            Ok(held)
        }
        None => {
            ctx.cursors.lose(&mut st);
            Ok(0)
        }
    }
}

/// Renews a set's leases (the set's claim path). False: the set is lost.
pub(super) async fn renew_set(
    ctx: &Ctx,
    key: &CursorKey,
    st: &mut CursorState,
    lease: Duration,
) -> Result<bool, StoreError> {
    let Some(epoch) = st.epoch() else {
        return Ok(false);
    };
    let (grp, total, indexes) = ctx.cursor_binds(key);
    // No incarnation (dropped after a crash restart or failover): the
    // renewal fails and the set is taken again from its stored position.
    let boot = st.boot.as_deref().and_then(|b| Uuid::parse_str(b).ok());
    let rows = sqlx::query(&ctx.sql.renew_set)
        .bind(&grp)
        .bind(total)
        .bind(indexes)
        .bind(epoch)
        .bind(micros(lease)?)
        .bind(key.relay.as_str())
        .bind(boot)
        .fetch_all(&ctx.db)
        .await?;
    if rows.len() != key.shards.len() {
        tracing::warn!(group = %grp, relay = %key.relay, shards = ?key.shards, "relay-group cursor leases lost");
        ctx.cursors.lose(st);
        return Ok(false);
    }
    let mut until: Option<DateTime<Utc>> = None;
    for r in &rows {
        let u: DateTime<Utc> = r.try_get(0)?;
        until = Some(until.map_or(u, |x| x.min(u)));
    }
    st.renewed(Granted {
        until: until.unwrap_or(st.lease_until()),
        len: lease,
    });
    Ok(true)
}

/// Gives back the leases of virtual shards `shards` of set `key`, held
/// under `epoch`.
pub(super) async fn release(
    ctx: &Ctx,
    key: &CursorKey,
    shards: &[u32],
    epoch: i64,
) -> Result<(), StoreError> {
    let indexes: Vec<i32> = shards
        .iter()
        .map(|i| i32::try_from(*i).unwrap_or(i32::MAX))
        .collect();
    sqlx::query(&ctx.sql.release_set)
        .bind(&ctx.group)
        .bind(i32::try_from(key.total).unwrap_or(i32::MAX))
        .bind(indexes)
        .bind(epoch)
        .bind(key.relay.as_str())
        .execute(&ctx.db)
        .await?;
    Ok(())
}

/// Gives back the static shards `relay` holds (a clean stop): the next
/// relay of a shard takes it at once instead of after the lock timeout.
/// A shard with a batch still unsettled keeps its lease (it runs out).
pub(super) async fn release_static(ctx: &Ctx, relay: &RelayId) -> Result<(), StoreError> {
    let cells: Vec<(CursorKey, Cell)> = ctx
        .cursors
        .all()
        .into_iter()
        .filter(|(k, _)| !k.dynamic && &k.relay == relay)
        .collect();
    for (key, cell) in cells {
        let mut st = cell.lock().await;
        let Some(epoch) = st.epoch() else { continue };
        if st.batches.iter().any(|b| b.held().next().is_some()) {
            continue;
        }
        let (grp, total, indexes) = ctx.cursor_binds(&key);
        sqlx::query(&ctx.sql.release_set)
            .bind(&grp)
            .bind(total)
            .bind(indexes)
            .bind(epoch)
            .bind(relay.as_str())
            .execute(&ctx.db)
            .await?;
        ctx.cursors.lose(&mut st);
        tracing::info!(group = %grp, shard = %key.shard(), %relay, "released the shard's lease (clean stop)");
    }
    Ok(())
}

/// Creates every cursor of a new group's shard layout (`total` shards)
/// at the current snapshot ([`GroupStart::Now`]), keeping those another
/// relay created meanwhile; returns the snapshot. All shards at once: a
/// relay of another shard that starts a moment later finds its cursor
/// instead of starting from the log's origin.
pub(super) async fn create_group_at_now(ctx: &Ctx, total: u32) -> Result<Snap, StoreError> {
    let (text, created): (String, i64) = sqlx::query_as(&ctx.sql.create_at_now)
        .bind(&ctx.group)
        .bind(i32::try_from(total).unwrap_or(i32::MAX))
        .fetch_one(&ctx.db)
        .await?;
    tracing::info!(group = %ctx.group, shards = total, created, "new consumer group starts now");
    snap(&text)
}

/// cursors `(total, index, lo)` of its group: for each shard layout whose
/// cursors together own every key of the new shard (keys with
/// `hash % total == index` fall, under a layout of `t` shards, into the
/// shards `j` with `j ≡ index (mod gcd(total, t))`), what all of those have
/// passed; the intersection over such layouts. `None` when no layout covers it.
pub(super) fn covering_start(
    total: u32,
    index: u32,
    existing: &[(u32, u32, Snap)],
) -> Option<Snap> {
    fn gcd(a: u32, b: u32) -> u32 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    let mut totals: Vec<u32> = existing.iter().map(|(t, _, _)| *t).collect();
    totals.sort_unstable();
    totals.dedup();
    let mut starts = Vec::new();
    for t in totals {
        let g = gcd(total, t).max(1);
        let needed: Vec<u32> = (0..t).filter(|j| j % g == index % g).collect();
        let have: Vec<&Snap> = needed
            .iter()
            .filter_map(|j| {
                existing
                    .iter()
                    .find(|(et, ei, _)| *et == t && ei == j)
                    .map(|(_, _, s)| s)
            })
            .collect();
        if have.len() == needed.len() {
            starts.extend(Snap::intersection(have));
        }
    }
    Snap::intersection(&starts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: u64) -> Snap {
        Snap {
            xmin: x,
            xmax: x,
            xip: Vec::new(),
            floor: 0,
        }
    }

    #[test]
    fn a_new_cursor_starts_only_from_cursors_owning_its_keys() {
        // Same layout, other index: owns none of our keys.
        assert_eq!(covering_start(2, 1, &[(2, 0, s(50))]), None);
        // 2 -> 4: shard 1/4 is inside 1/2.
        assert_eq!(
            covering_start(4, 1, &[(2, 0, s(50)), (2, 1, s(40))]),
            Some(s(40))
        );
        // 4 -> 2: shard 0/2 needs 0/4 and 2/4.
        let four = [(4, 0, s(30)), (4, 1, s(90)), (4, 2, s(60)), (4, 3, s(99))];
        assert_eq!(covering_start(2, 0, &four), Some(s(30)));
        assert_eq!(covering_start(2, 0, &four[1..]), None, "0/4 missing");
        // 2 -> 3 (coprime): every shard of the old layout is needed.
        assert_eq!(
            covering_start(3, 2, &[(2, 0, s(70)), (2, 1, s(20))]),
            Some(s(20))
        );
        assert_eq!(covering_start(3, 2, &[(2, 0, s(70))]), None);
        // One shard (1/1) covers everything.
        assert_eq!(covering_start(8, 5, &[(1, 0, s(10))]), Some(s(10)));
    }
}
