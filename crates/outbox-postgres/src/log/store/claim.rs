//! The claim: a reader follows one here from start to end. A claim takes
//! or keeps its cursor's lease (`lease.rs`), reads the due retry-lane rows
//! and the rest of the current snapshot window (and the next one) in one
//! statement, hands out the events, parks what must wait behind its key
//! and dead-letters what cannot be decoded (`lane.rs`), and records the
//! batch in the cursor's state (`cursor.rs`) under a new token.

use super::context::Ctx;
use super::cursor::{Batch, CursorKey, CursorState, Item, Kind, Src};
use super::fences;
use super::lane::{self, LaneOp, LaneRows};
use super::lease;
use super::rows::{empty_claim, snap};
use crate::error::StoreError;
use crate::log::options::LeaseTimers;
use crate::log::snapshot::{Position, Snap, Xid8};
use crate::rows::{headers_strict, last_error};
use chrono::Utc;
use outbox_core::{
    Claim, ClaimRequest, DeadHeadPolicy, ErrorCode, Event, EventId, FencingToken, LastError,
};
use sqlx::postgres::PgRow;
use sqlx::Row;
use std::collections::{BTreeMap, HashSet};
use std::time::Instant;
use uuid::Uuid;

/// A claim of a static shard (`i/N`, or every key for a store without
/// relay groups): its events, and the shard indexes whose lease the relay
/// holds after it (for [`LeaseHolding`](super::LeaseHolding)).
pub(super) async fn claim_static(
    ctx: &Ctx,
    req: &ClaimRequest,
) -> Result<(Claim, Vec<u32>), StoreError> {
    let key = CursorKey::single(req.shard, req.relay_id.clone());
    let cell = ctx.cursors.cell_or_new(&key);
    let mut st = cell.lock().await;
    let claim = claim_key(ctx, &key, &mut st, req, None).await?;
    let held = if st.epoch().is_some() {
        key.shards.clone()
    } else {
        Vec::new()
    };
    Ok((claim.unwrap_or_else(|| empty_claim(Utc::now())), held))
}

/// Claims from one cursor (or set). `None` when its lease is not ours;
/// `upto`: the snapshot that ends a new window (see the CLAIM SQL).
pub(super) async fn claim_key(
    ctx: &Ctx,
    key: &CursorKey,
    st: &mut CursorState,
    req: &ClaimRequest,
    upto: Option<&(Snap, String)>,
) -> Result<Option<Claim>, StoreError> {
    if st.has_abandoned_batch() {
        tracing::warn!(
            group = %ctx.group,
            shard = %key.shard(),
            relay = %key.relay,
            "a claimed batch was neither settled nor renewed within its lease: \
             its events are read again from the last settled position"
        );
        if key.dynamic {
            // The caller gives the set back and forgets it (see
            // `drop_set`); it is taken again from its stored position.
            return Ok(None);
        }
        // A new holding (new epoch) starts from the stored position.
        ctx.cursors.lose(st);
    }
    // The fences (schema version, order sequence, database identity):
    // before a lease is taken when due, and again under every new lease.
    if ctx.guard.due() {
        fences::check(ctx, st).await?;
    }
    if st.renew_due(req.lease) && !lease::hold(ctx, key, st, req.lease).await? {
        return Ok(None);
    }
    fences::check_new_lease(ctx, st).await?;
    let limit = req.batch_size.max(1);
    for _ in 0..8 {
        match claim_once(ctx, key, st, limit, upto).await? {
            Step::Events(claim) => return Ok(Some(claim)),
            Step::Again => continue,
            Step::Nothing => break,
            Step::Blocked => {
                return Ok(Some(Claim {
                    more: true,
                    ..empty_claim(st.lease_until())
                }))
            }
            Step::Relapse => {
                if !lease::hold(ctx, key, st, req.lease).await? {
                    return Ok(None);
                }
                fences::check_new_lease(ctx, st).await?;
            }
        }
    }
    Ok(Some(empty_claim(st.lease_until())))
}

async fn claim_once(
    ctx: &Ctx,
    key: &CursorKey,
    st: &mut CursorState,
    limit: u32,
    upto: Option<&(Snap, String)>,
) -> Result<Step, StoreError> {
    let Some(epoch) = st.epoch() else {
        return Ok(Step::Nothing);
    };
    let grp = &ctx.group;
    let read = st.read.clone();
    let held_ords: Vec<i64> = st
        .batches
        .iter()
        .flat_map(|b| b.held())
        .filter_map(|i| match i.src {
            Src::Lane { ord, .. } => Some(ord),
            Src::Log { .. } => None,
        })
        .collect();
    let held_keys: HashSet<String> = st
        .batches
        .iter()
        .flat_map(|b| b.held())
        .filter_map(|i| i.key.clone())
        .collect();
    // Rows to read: all `limit` unless keys are in flight (see KeySpread).
    let scan = st.spread.scan_limit(limit, held_keys.len());
    // A shared snapshot that is not clearly later than where this cursor
    // read to could move it back: ignore it then (a later snapshot never
    // has a lower xmax; with an equal one, only the same snapshot is safe).
    let upto = upto
        .filter(|(u, boot)| {
            st.boot.as_deref() == Some(boot.as_str()) && (u.xmax > read.hi.xmax || *u == read.hi)
        })
        .map(|(u, _)| u);
    // The seq floor of the snapshot this claim takes (a shared one
    // comes with its own).
    let cur_floor = match upto {
        Some(u) => u.floor,
        None => ctx
            .floors
            .floor_for_new_snapshot(st.boot.as_deref(), read.hi.floor),
    };
    let after_seq = read.after.map_or(0, |a| a.1);
    // Where the range part of (lo, hi) resumes (in seq order).
    let start_seq = after_seq.max(read.lo.floor);
    let sql = ctx
        .sql
        .claim(key.total, key.shards.len(), !st.inherited.is_empty());
    let rows = sqlx::query(sql)
        .bind(grp)
        .bind(i64::from(key.total))
        .bind(key.indexes())
        .bind(read.lo.to_string())
        .bind(start_seq)
        .bind(
            read.lo
                .finished_by(&read.hi)
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>(),
        )
        .bind(read.hi.to_string())
        .bind(read.lo.floor)
        .bind(after_seq)
        .bind(read.hi.xip.iter().map(u64::to_string).collect::<Vec<_>>())
        .bind(i64::from(scan))
        .bind(held_ords)
        .bind(held_keys.iter().cloned().collect::<Vec<_>>())
        .bind(
            st.inherited
                .iter()
                .map(|(t, _)| t.to_string())
                .collect::<Vec<_>>(),
        )
        .bind(st.inherited.iter().map(|(_, s)| *s).collect::<Vec<_>>())
        .bind(epoch)
        .bind(read.hi.floor)
        .bind(upto.map(Snap::to_string))
        .bind(crate::log::sql::shard_mask(key.total, &key.shards))
        .fetch_all(&ctx.db)
        .await?;
    // The snapshot row (see the claim's docs): the first with a snapshot.
    let mut first = None;
    for row in &rows {
        if let Some(cur_text) = row.try_get::<Option<String>, _>(0)? {
            first = Some((row, cur_text));
            break;
        }
    }
    let Some((first, cur_text)) = first else {
        return Ok(Step::Nothing);
    };
    // Positions, windows and the lease in memory hold only within the
    // incarnation they were read in: after a crash restart or a
    // failover, transaction ids are handed out again below the xmax of
    // our windows. Drop them and resume from the stored position.
    let boot = lease::incarnation(ctx, first.try_get(18)?).await?;
    if st.boot.as_deref() != Some(boot.as_str()) {
        tracing::warn!(
            group = %grp,
            shard = %key.shard(),
            relay = %key.relay,
            "the database is a new incarnation (crash recovery or failover): \
             positions held in memory are dropped; resuming from the stored position"
        );
        metrics::counter!(crate::log::metric_names::INCARNATION_CHANGES).increment(1);
        ctx.cursors.lose(st);
        st.boot = None;
        return Ok(Step::Relapse);
    }
    ctx.floors.observe(&boot, first.try_get(19)?);
    let cur = snap(&cur_text)?.with_floor(cur_floor);
    ctx.wake.saw(&cur_text);
    st.last_cur = Some((cur.clone(), boot.clone()));
    if !first.try_get::<bool, _>(1)? {
        return Ok(Step::Relapse);
    }

    // Branch order: lane rows by `ord`, then the log by (window, seq):
    // a window in insertion order.
    let mut order: Vec<(i32, i64, i64, u64, usize)> = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        let Some(w) = row.try_get::<Option<i32>, _>(2)? else {
            continue;
        };
        let (ord, seq, txid) = if w == 0 {
            (row.try_get::<i64, _>(5)?, 0, 0)
        } else {
            (0, row.try_get::<i64, _>(4)?, row.try_get::<Xid8, _>(3)?.0)
        };
        order.push((w, ord, seq, txid, i));
    }
    order.sort_unstable();
    let limit = limit as usize;
    let scan = scan as usize;
    let mut items: Vec<Item> = Vec::new();
    let mut events: Vec<Event> = Vec::new();
    let mut writes = ClaimWrites::default();
    let mut last: Option<(i32, u64, i64)> = None;
    let mut log_rows = 0usize;
    let mut cut = false;
    // Log rows read before the first row of a key in flight.
    let mut held_cut: Option<usize> = None;
    let mut parked_now: HashSet<String> = HashSet::new();
    let mut delivering: HashSet<String> = HashSet::new();
    for &(w, _, seq, txid, i) in &order {
        let row = &rows[i];
        let id = EventId::from_uuid(row.try_get::<Uuid, _>(6)?);
        let key_text: Option<String> = row.try_get(7)?;
        if w == 0 {
            let ord: i64 = row.try_get(5)?;
            let stored: i32 = row.try_get(13)?;
            let headers: String = row.try_get(11)?;
            let src = Src::Lane {
                ord,
                attempts: stored,
            };
            let behind_dead = key_text.as_ref().is_some_and(|k| parked_now.contains(k));
            match headers_strict(&headers) {
                // Behind a blocking dead letter written by this claim:
                // it stays in the lane until the dead letter is retried
                // or purged.
                Ok(_) if behind_dead => {}
                Ok(headers) if events.len() < limit => {
                    events.push(claimed_event(
                        row,
                        id,
                        key_text.clone(),
                        headers,
                        u32::try_from(stored).unwrap_or(0) + 1,
                        last_error(row.try_get(15)?, row.try_get(16)?),
                    )?);
                    items.push(Item {
                        id,
                        key: key_text,
                        src,
                        kind: Kind::Deliver,
                        window: 0,
                        resolved: false,
                    });
                }
                Ok(_) => {}
                Err(reason) => {
                    if ctx.dead_head == DeadHeadPolicy::Block {
                        parked_now.extend(key_text.clone());
                    }
                    writes.dead_lane.push((ord, stored, reason));
                }
            }
            continue;
        }
        log_rows += 1;
        if cut {
            continue;
        }
        if key_text.as_ref().is_some_and(|k| held_keys.contains(k)) {
            // An earlier event of this key is still in flight: the
            // batch ends before this row.
            cut = true;
            held_cut = Some(log_rows - 1);
            continue;
        }
        if events.len() >= limit {
            // The batch is full.
            cut = true;
            continue;
        }
        // Parked: its key is in the lane, or it is a delayed event not
        // due yet, or an earlier row of its key parked in this claim.
        let parked = row.try_get::<bool, _>(17)?
            || key_text.as_ref().is_some_and(|k| parked_now.contains(k));
        if parked && key_text.as_ref().is_some_and(|k| delivering.contains(k)) {
            // A delayed event behind an event of its key in this batch:
            // parked now, it would overtake that event's retry in the
            // lane. The batch ends before it (as for a held key).
            cut = true;
            continue;
        }
        last = Some((w, txid, seq));
        let headers: String = row.try_get(11)?;
        let (kind, event) = if parked {
            parked_now.extend(key_text.clone());
            writes.park.push((txid, seq));
            (Kind::Parked, None)
        } else {
            match headers_strict(&headers) {
                Ok(headers) => (
                    Kind::Deliver,
                    Some(claimed_event(row, id, key_text.clone(), headers, 1, None)?),
                ),
                Err(reason) => {
                    tracing::warn!(event_id = %id, %reason, "undecodable outbox row dead-lettered");
                    if ctx.dead_head == DeadHeadPolicy::Block {
                        // Policy `block`: the key's later events in this
                        // claim park behind the dead letter, as later
                        // claims' do.
                        parked_now.extend(key_text.clone());
                    }
                    writes.dead_log.push((txid, seq, reason));
                    (Kind::Undecodable, None)
                }
            }
        };
        if let Some(e) = event {
            delivering.extend(e.key.clone());
            events.push(e);
        }
        items.push(Item {
            id,
            key: key_text,
            src: Src::Log { txid, seq },
            kind,
            window: u8::try_from(w).unwrap_or(2),
            resolved: false,
        });
    }
    // Stopped early: at the limit (parked rows count: they were read),
    // or before a row whose key is still in flight.
    let more = cut || log_rows >= scan || events.len() >= limit;
    if !held_keys.is_empty() {
        match held_cut {
            Some(rows) => st.spread.stopped_after(rows, held_keys.len()),
            None if log_rows >= scan => st.spread.read_past(log_rows, held_keys.len()),
            None => {}
        }
    }
    let end = if !cut && log_rows < scan {
        // Everything committed up to `cur` has been read.
        Position::at(cur.clone())
    } else {
        match last {
            None => read.clone(),
            Some((1, txid, seq)) => Position {
                lo: read.lo.clone(),
                hi: read.hi.clone(),
                after: Some((txid, seq)),
            },
            Some((_, txid, seq)) => Position {
                lo: read.hi.clone(),
                hi: cur.clone(),
                after: Some((txid, seq)),
            },
        }
    };

    let consumed = !writes.is_empty();
    if events.is_empty() {
        let advance = st.batches.is_empty()
            && end != st.done
            && (consumed || st.last_persist.elapsed() >= ctx.idle_progress_every);
        if consumed || advance {
            let kept: Vec<(u64, i64)> = st
                .inherited
                .iter()
                .filter(|(t, q)| !advance || !end.passed(*t, *q))
                .copied()
                .collect();
            let skip = (kept != st.persisted_skip).then_some(kept.as_slice());
            let fenced = !write_claim(
                ctx,
                key,
                epoch,
                &boot,
                advance.then_some(&end),
                skip,
                &writes,
            )
            .await?;
            if fenced {
                ctx.cursors.lose(st);
                return Ok(Step::Nothing);
            }
            if skip.is_some() {
                st.persisted_skip.clone_from(&kept);
            }
            if advance {
                st.inherited = kept;
                st.done = end.clone();
                st.last_persist = Instant::now();
            }
        }
        st.read = end;
        return Ok(if consumed {
            Step::Again
        } else if cut {
            Step::Blocked
        } else {
            Step::Nothing
        });
    }
    if consumed && !write_claim(ctx, key, epoch, &boot, None, None, &writes).await? {
        ctx.cursors.lose(st);
        return Ok(Step::Nothing);
    }
    let token = FencingToken::new();
    st.batches.push_back(Batch {
        token,
        epoch,
        boot,
        start: read,
        end: end.clone(),
        next_hi: cur,
        items,
        complete: false,
        expires: Instant::now() + LeaseTimers::new(st.lease_len()).abandon_after(),
    });
    st.read = end;
    ctx.cursors.issue(token, key);
    ctx.wake.active();
    Ok(Step::Events(Claim {
        token,
        lease_until: st.lease_until(),
        events,
        more,
    }))
}

/// Writes what a claim consumed without giving it to the relay (parked
/// rows, undecodable rows) and, with `advance`, moves the settled
/// position, in one transaction fenced by the epoch. Returns false when
/// the epoch is no longer ours (nothing was written).
async fn write_claim(
    ctx: &Ctx,
    key: &CursorKey,
    epoch: i64,
    boot: &str,
    advance: Option<&Position>,
    skip: Option<&[(u64, i64)]>,
    writes: &ClaimWrites,
) -> Result<bool, StoreError> {
    let mut tx = ctx.db.begin().await?;
    if !lease::advance(ctx, &mut tx, key, (epoch, boot), advance, skip).await? {
        return Ok(false);
    }
    if !writes.park.is_empty() {
        let rows: LaneRows = writes
            .park
            .iter()
            .map(|(t, s)| (*t, *s, 0, 0, None))
            .collect();
        lane::log_to_lane(ctx, &mut tx, &rows).await?;
    }
    if !writes.dead_log.is_empty() {
        let rows: Vec<(u64, i64, i32, LastError)> = writes
            .dead_log
            .iter()
            .map(|(t, s, reason)| {
                (
                    *t,
                    *s,
                    0,
                    LastError {
                        code: ErrorCode::UNDECODABLE,
                        message: reason.clone(),
                    },
                )
            })
            .collect();
        lane::log_to_dead(ctx, &mut tx, &rows).await?;
    }
    if !writes.dead_lane.is_empty() {
        let ops: Vec<LaneOp> = writes
            .dead_lane
            .iter()
            .map(|(ord, attempts, reason)| LaneOp {
                ord: *ord,
                kind: 2,
                attempts: *attempts,
                delay_us: 0,
                error: Some(LastError {
                    code: ErrorCode::UNDECODABLE,
                    message: reason.clone(),
                }),
            })
            .collect();
        lane::lane_settle(ctx, &mut tx, &ops).await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// What one pass of [`claim_once`] found.
enum Step {
    Events(Claim),
    Again,
    Nothing,
    /// Nothing to hand out now, but events are ready behind keys still in
    /// flight: more once the outstanding batches settle.
    Blocked,
    /// The lease ran out (database clock) or moved: take it again.
    Relapse,
}

/// What a claim writes before it returns: parked rows into the lane and
/// undecodable rows into the dead letters.
#[derive(Default)]
struct ClaimWrites {
    park: Vec<(u64, i64)>,
    dead_log: Vec<(u64, i64, String)>,
    dead_lane: Vec<(i64, i32, String)>,
}

impl ClaimWrites {
    fn is_empty(&self) -> bool {
        self.park.is_empty() && self.dead_log.is_empty() && self.dead_lane.is_empty()
    }
}

/// The event of a claim row (lane rows and log rows share the columns:
/// 8 type, 9 topic, 10 payload, 12 `created_at`, 14 due time).
fn claimed_event(
    row: &PgRow,
    id: EventId,
    key: Option<String>,
    headers: BTreeMap<String, String>,
    attempts: u32,
    last_error: Option<LastError>,
) -> Result<Event, StoreError> {
    Ok(Event {
        id,
        key,
        event_type: row.try_get(8)?,
        topic: row.try_get(9)?,
        payload: row.try_get(10)?,
        headers,
        created_at: row.try_get(12)?,
        attempts,
        next_attempt_at: row.try_get(14)?,
        last_error,
    })
}
