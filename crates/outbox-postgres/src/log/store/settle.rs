//! The settle: which of a batch's events were delivered, retried, dead or
//! released, written in one transaction whose first statement is the
//! cursor's fenced UPDATE (`lease::advance`); the rest goes to the retry
//! lane and the dead letters (`lane.rs`). A batch that is fully settled
//! moves the settled position, in claim order.

use super::context::Ctx;
use super::cursor::{CursorState, Kind, Src};
use super::lane::{self, LaneOp, LaneRows};
use super::lease;
use crate::error::StoreError;
use crate::log::snapshot::Position;
use outbox_core::{
    EventId, FencingToken, LastError, Rejected, Resolution, SettleReport, Settlement,
};
use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// Settles the events of the batch of `token` as `settlement` says.
pub(super) async fn settle(
    ctx: &Ctx,
    token: FencingToken,
    settlement: &Settlement,
) -> Result<SettleReport, StoreError> {
    let all_fenced = || SettleReport {
        applied: 0,
        fenced: settlement.items().iter().map(|(id, _)| *id).collect(),
        rejected: Vec::new(),
    };
    let Some(key) = ctx.cursors.token_key(token) else {
        return Ok(all_fenced());
    };
    let Some(cell) = ctx.cursors.cell(&key) else {
        return Ok(all_fenced());
    };
    let mut st = cell.lock().await;
    let Some(bi) = st.batches.iter().position(|b| b.token == token) else {
        return Ok(all_fenced());
    };
    let epoch = st.batches[bi].epoch;
    let boot = st.batches[bi].boot.clone();
    if st.epoch() != Some(epoch) || st.boot.as_deref() != Some(boot.as_str()) {
        return Ok(all_fenced());
    }
    let plan = plan_settle(&st, bi, settlement);
    if plan.assigned.is_empty() {
        return Ok(SettleReport {
            applied: 0,
            fenced: plan.fenced,
            rejected: Vec::new(),
        });
    }

    // The settled position after this settle: the end of every leading
    // complete batch.
    let mut advance_to: Option<Position> = None;
    let mut pops = 0;
    if plan.completes {
        for (i, b) in st.batches.iter().enumerate() {
            let complete = b.complete || i == bi;
            if !complete {
                break;
            }
            pops += 1;
            advance_to = Some(if i == bi {
                plan.end.clone().unwrap_or_else(|| b.end.clone())
            } else {
                b.end.clone()
            });
        }
    }

    let skip = skip_list(&st, bi, &plan, pops, advance_to.as_ref());
    let skip_arg = (skip != st.persisted_skip).then_some(skip.as_slice());

    let simple = plan.to_lane.is_empty() && plan.to_dead.is_empty() && plan.lane_ops.is_empty();
    let mut replaced_ids = Vec::new();
    if simple {
        if !lease::advance(
            ctx,
            &ctx.db,
            &key,
            (epoch, &boot),
            advance_to.as_ref(),
            skip_arg,
        )
        .await?
        {
            ctx.cursors.lose(&mut st);
            return Ok(all_fenced());
        }
    } else {
        let mut tx = ctx.db.begin().await?;
        if !lease::advance(
            ctx,
            &mut tx,
            &key,
            (epoch, &boot),
            advance_to.as_ref(),
            skip_arg,
        )
        .await?
        {
            drop(tx);
            ctx.cursors.lose(&mut st);
            return Ok(all_fenced());
        }
        // Dead letters first: a key's failed event precedes the events
        // released behind it, and `ord` (its place in the key's order,
        // kept for a replay) is taken in statement order.
        if !plan.to_dead.is_empty() {
            replaced_ids.extend(lane::log_to_dead(ctx, &mut tx, &plan.to_dead).await?);
        }
        if !plan.to_lane.is_empty() {
            lane::log_to_lane(ctx, &mut tx, &plan.to_lane).await?;
        }
        if !plan.lane_ops.is_empty() {
            replaced_ids.extend(lane::lane_settle(ctx, &mut tx, &plan.lane_ops).await?);
        }
        tx.commit().await?;
    }

    // Committed: record it.
    let batch = &mut st.batches[bi];
    for i in &plan.assigned {
        batch.items[*i].resolved = true;
    }
    if let Some(end) = &plan.end {
        batch.end = end.clone();
    }
    if plan.completes {
        batch.complete = true;
    }
    if let Some(end) = plan.end.clone().filter(|_| plan.rewound) {
        st.read = end;
    }
    if skip_arg.is_some() {
        st.persisted_skip = skip;
    }
    if let Some(to) = advance_to {
        st.inherited.retain(|(t, q)| !to.passed(*t, *q));
        st.done = to;
        st.last_persist = Instant::now();
        let popped: Vec<FencingToken> = st.batches.drain(..pops).map(|b| b.token).collect();
        ctx.cursors.forget_tokens(&popped);
    }
    let rejected = replaced_ids
        .into_iter()
        .map(|id| Rejected {
            id,
            reason: "a dead letter with this id already existed; it was replaced by this failure"
                .to_owned(),
        })
        .collect();
    Ok(SettleReport {
        applied: plan.applied,
        fenced: plan.fenced,
        rejected,
    })
}

/// What one settle call writes.
#[derive(Default)]
struct Plan {
    /// Item indexes resolved by this call.
    assigned: Vec<usize>,
    applied: u64,
    fenced: Vec<EventId>,
    to_lane: LaneRows,
    to_dead: Vec<(u64, i64, i32, LastError)>,
    lane_ops: Vec<LaneOp>,
    /// Every deliverable item of the batch is resolved after this call.
    completes: bool,
    /// The batch's new end (a released tail given back to the log).
    end: Option<Position>,
    rewound: bool,
    /// With `rewound`: the first item given back to the log.
    cut_at: Option<usize>,
}

fn plan_settle(st: &CursorState, bi: usize, settlement: &Settlement) -> Plan {
    let batch = &st.batches[bi];
    let mut plan = Plan::default();
    let mut by_id: HashMap<EventId, Vec<usize>> = HashMap::new();
    for (i, item) in batch.items.iter().enumerate() {
        if item.kind == Kind::Deliver && !item.resolved {
            by_id.entry(item.id).or_default().push(i);
        }
    }
    let mut res: Vec<Option<&Resolution>> = vec![None; batch.items.len()];
    for (id, r) in settlement.items() {
        match by_id.get_mut(id).filter(|v| !v.is_empty()) {
            Some(idxs) => {
                // Every copy of a duplicated id gets the same outcome.
                for i in idxs.drain(..) {
                    res[i] = Some(r);
                    plan.assigned.push(i);
                }
                plan.applied += 1;
            }
            None => plan.fenced.push(*id),
        }
    }
    plan.assigned.sort_unstable();
    let fresh = batch.items.iter().all(|i| !i.resolved);
    plan.completes = batch
        .items
        .iter()
        .enumerate()
        .all(|(i, it)| it.kind != Kind::Deliver || it.resolved || res[i].is_some());

    // A released tail of the log rows is given back to the log instead of
    // being copied into the lane: the cursor stops before it. Only for the
    // newest batch settled in one go, when nothing after the first released
    // row was delivered or failed.
    let mut cut_at: Option<usize> = None;
    if plan.completes && fresh && bi + 1 == st.batches.len() {
        let log_idx: Vec<usize> = (0..batch.items.len())
            .filter(|i| matches!(batch.items[*i].src, Src::Log { .. }))
            .collect();
        let mut first_released = None;
        for (n, i) in log_idx.iter().enumerate().rev() {
            let item = &batch.items[*i];
            match (&item.kind, res[*i]) {
                (Kind::Deliver, Some(Resolution::Released)) => first_released = Some(n),
                (Kind::Deliver, _) => break,
                // Parked / undecodable rows were written at claim; re-reading
                // them is harmless (the lane and dead letters dedupe by id).
                _ => {}
            }
        }
        if let Some(n) = first_released {
            let r = log_idx[n];
            let end = log_idx[..n]
                .iter()
                .rev()
                .find_map(|i| batch.after(&batch.items[*i]))
                .unwrap_or_else(|| batch.start.clone());
            cut_at = Some(r);
            plan.cut_at = Some(r);
            plan.end = Some(end);
            plan.rewound = true;
        }
    }

    for i in plan.assigned.clone() {
        let item = &batch.items[i];
        let Some(r) = res[i] else { continue };
        match item.src {
            Src::Log { txid, seq } => match r {
                Resolution::Delivered => {}
                Resolution::Retry { delay, error } => plan.to_lane.push((
                    txid,
                    seq,
                    1,
                    i64::try_from(delay.as_micros()).unwrap_or(i64::MAX),
                    Some(error.clone()),
                )),
                Resolution::Dead { error } => plan.to_dead.push((txid, seq, 1, error.clone())),
                Resolution::Released => {
                    if cut_at.is_none_or(|c| i < c) {
                        plan.to_lane.push((txid, seq, 0, 0, None));
                    }
                }
                // A resolution this store does not know: treat as released.
                _ => plan.to_lane.push((txid, seq, 0, 0, None)),
            },
            Src::Lane { ord, attempts } => {
                let next = attempts.saturating_add(1);
                match r {
                    Resolution::Delivered => plan.lane_ops.push(LaneOp {
                        ord,
                        kind: 0,
                        attempts: next,
                        delay_us: 0,
                        error: None,
                    }),
                    Resolution::Retry { delay, error } => plan.lane_ops.push(LaneOp {
                        ord,
                        kind: 1,
                        attempts: next,
                        delay_us: i64::try_from(delay.as_micros()).unwrap_or(i64::MAX),
                        error: Some(error.clone()),
                    }),
                    Resolution::Dead { error } => plan.lane_ops.push(LaneOp {
                        ord,
                        kind: 2,
                        attempts: next,
                        delay_us: 0,
                        error: Some(error.clone()),
                    }),
                    // Released: the row stays in the lane as it was
                    // (attempts as stored, due, last error kept).
                    _ => {}
                }
            }
        }
    }
    // Dead letters of one statement must have distinct ids (ON CONFLICT
    // cannot touch a row twice): keep the last of duplicated ids.
    let mut seen = HashSet::new();
    let mut dead = Vec::with_capacity(plan.to_dead.len());
    for d in plan.to_dead.drain(..).rev() {
        let id = batch
            .items
            .iter()
            .find(|it| {
                it.src
                    == (Src::Log {
                        txid: d.0,
                        seq: d.1,
                    })
            })
            .map(|it| it.id);
        if id.is_none_or(|id| seen.insert(id)) {
            dead.push(d);
        }
    }
    dead.reverse();
    plan.to_dead = dead;
    plan
}

/// The cursor's skip list after a settle: log rows settled ahead of the
/// settled position (a batch settled in parts, or out of claim order), so
/// that a new holder re-reading from the position does not deliver them
/// again; plus what was inherited and is still ahead.
fn skip_list(
    st: &CursorState,
    bi: usize,
    plan: &Plan,
    pops: usize,
    advance_to: Option<&Position>,
) -> Vec<(u64, i64)> {
    let done = advance_to.unwrap_or(&st.done);
    let mut skip: Vec<(u64, i64)> = st
        .inherited
        .iter()
        .filter(|(t, q)| !done.passed(*t, *q))
        .copied()
        .collect();
    for (j, b) in st.batches.iter().enumerate().skip(pops) {
        for (i, it) in b.items.iter().enumerate() {
            let now = j == bi && plan.assigned.binary_search(&i).is_ok();
            let given_back = j == bi && plan.cut_at.is_some_and(|c| i >= c);
            if it.kind == Kind::Deliver && (it.resolved || now) && !given_back {
                if let Src::Log { txid, seq } = it.src {
                    skip.push((txid, seq));
                }
            }
        }
    }
    skip.sort_unstable();
    skip.dedup();
    skip
}
