//! Relay groups: relays of one consumer group share its virtual shards
//! through cursor leases, without configuration.
//!
//! The outbox has `S` virtual shards (`<table>_log_meta.virtual_shards`, 64
//! unless changed); a key belongs to virtual shard `key_hash % S`, and each
//! consumer group has one cursor per virtual shard. A relay of the group:
//!
//! - announces itself in `<table>_log_relays` (alive for
//!   [`LeaseTimers::alive_for`], renewed every rebalance interval) and
//!   reads who else is alive;
//! - computes its fair share: `S / n`, plus one for the first `S % n`
//!   relays in id order, so the shares add up to `S` exactly;
//! - below its share, takes the leases of free cursors (never leased, given
//!   back, or run out: a dead relay's) under one new epoch, preferring
//!   cursors at the same position (those of one former holder);
//! - above its share, gives cursors back once the batches claimed from them
//!   are settled (claims from them pause meanwhile, never mid-batch): the
//!   next holder continues exactly where the last settled batch ended;
//! - on a graceful stop ([`Store::leave`](outbox_core::Store::leave)) gives
//!   every cursor back and leaves the group at once.
//!
//! Reading 64 cursors one by one would scan the log 64 times, so a relay
//! keeps the cursors it holds at one position as ONE set: one claim reads
//! `key_hash % S = ANY(set)` from the shared position, one settle advances
//! every cursor of the set (fenced by their common epoch; one that moved
//! away fences the set). Cursors taken from different holders start as
//! separate sets; a round of claims over the sets shares one snapshot, so
//! sets that catch up end at the same position and are merged when idle.

use super::claim;
use super::context::Ctx;
use super::cursor::{CursorKey, Granted};
use super::lease;
use super::rows::{empty_claim, micros, position, row_skip_list};
use crate::error::StoreError;
use crate::log::options::{GroupStart, LeaseTimers};
use crate::log::snapshot::Snap;
use chrono::{DateTime, Utc};
use outbox_core::{Claim, ClaimRequest, RelayId};
use sqlx::Row;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Sets `outbox_virtual_shard_lag_seconds{group, shard}` for the virtual
/// shards of `key` that `events` (a claimed batch) has events of: the age of
/// the oldest at `now` (database clock); with no events (the set read
/// everything committed), 0 for every shard of the set.
fn record_shard_lag(
    group: &str,
    key: &CursorKey,
    events: &[outbox_core::Event],
    now: DateTime<Utc>,
) {
    let label = |i: u32| format!("{i}/{}", key.total);
    if events.is_empty() {
        for i in &key.shards {
            metrics::gauge!(crate::log::metric_names::SHARD_LAG, "group" => group.to_owned(), "shard" => label(*i))
                .set(0.0);
        }
        return;
    }
    let mut oldest: BTreeMap<u32, DateTime<Utc>> = BTreeMap::new();
    for e in events {
        let shard = outbox_core::key_hash(e.shard_key().as_bytes()) % key.total.max(1);
        let at = oldest.entry(shard).or_insert(e.created_at);
        *at = (*at).min(e.created_at);
    }
    for (i, at) in oldest {
        let lag = (now - at).to_std().unwrap_or_default();
        metrics::gauge!(crate::log::metric_names::SHARD_LAG, "group" => group.to_owned(), "shard" => label(i))
            .set(lag.as_secs_f64());
    }
}

/// A relay rebalances again after 1/`SHORT_RECHECK` of the rebalance
/// interval while its group is changing: when it is below its fair share,
/// or when its shards or the other relays changed at its last rebalance. A
/// join takes two rounds (the holder above its share gives cursors back at
/// its next rebalance, the relay below it takes them at its own): the
/// second no longer waits a whole interval, and relays that start together
/// (each first sees fewer members than there are) settle within a few
/// short rounds. A group that stays the same rebalances at the interval.
const SHORT_RECHECK: u32 = 8;

/// One relay's place in its relay group (in this process).
#[derive(Default)]
pub(crate) struct Membership {
    /// The sets it holds (keys of the store's cursor map).
    sets: Vec<CursorKey>,
    /// Round-robin start of the next claim.
    next: usize,
    checked: Option<Instant>,
    /// Above its share: the set whose shards go back once its batches are
    /// settled (not claimed from meanwhile).
    shrinking: Option<CursorKey>,
    /// Below its share at the last rebalance, with no free cursor to take,
    /// or its shards or the other relays changed then: it looks again
    /// sooner (see [`SHORT_RECHECK`]).
    short: bool,
    /// The other relays of the group at the last rebalance.
    others: Vec<String>,
    /// Its fair share and the virtual shard count at the last rebalance.
    quota: u32,
    total: u32,
}

impl Membership {
    /// The virtual shards of the sets it holds, sorted.
    fn held(&self) -> Vec<u32> {
        let mut held: Vec<u32> = self.sets.iter().flat_map(|k| k.shards.clone()).collect();
        held.sort_unstable();
        held
    }
}

/// The shard leases one relay of this process held at its last claim, as
/// [`PgLogStore::lease_holding`](super::PgLogStore::lease_holding) reports them: read from the process's
/// memory, so a health check costs no query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseHolding {
    /// A member of its group's relay group (the relay claims every shard,
    /// [`ShardSpec::ALL`](outbox_core::ShardSpec::ALL), of a store with
    /// [dynamic shards](crate::log::PgLogOptions::with_dynamic_shards)),
    /// or `false`: a static shard `i/N`.
    pub dynamic: bool,
    /// The shards whose lease it holds, sorted: virtual shard indexes of a
    /// relay-group member; the static shard's index (or nothing).
    pub shards: Vec<u32>,
    /// Of how many: the outbox's virtual shards, or the static `N`.
    pub total: u32,
    /// How many it should hold: its fair share of the virtual shards (0
    /// when the group has more relays than shards); 1 for a static shard.
    pub fair_share: u32,
    /// Since when it has held no shard although its fair share was at
    /// least one (`None` while it holds one, or its share is 0). A relay
    /// that joins a group holds none until the others gave some back (a
    /// rebalance interval or two), or until a killed relay's leases run
    /// out.
    pub held_none_since: Option<Instant>,
}

impl LeaseHolding {
    /// How long it has held no shard although its fair share is at least
    /// one (see [`LeaseHolding::held_none_since`]).
    pub fn held_none_for(&self) -> Option<Duration> {
        self.held_none_since.map(|t| t.elapsed())
    }
}

/// A relay of a relay group as `outbox-relay status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RelayInfo {
    /// Its id.
    pub relay: String,
    /// Whether its announcement is current.
    pub alive: bool,
    /// The virtual shards whose lease it holds.
    pub shards: Vec<u32>,
    /// Of how many.
    pub virtual_shards: u32,
}

/// The relay groups of a store (shared by its clones): the place of each
/// relay of this process in its group, and the leases each relay held at
/// its last claim.
pub(super) struct RelayGroups {
    /// Relays claiming `ShardSpec::ALL` join the group's relay group.
    pub(super) dynamic: bool,
    rebalance_every: Duration,
    /// Per relay of this process: its place in the relay group.
    members: Mutex<HashMap<RelayId, Arc<tokio::sync::Mutex<Membership>>>>,
    /// Per relay of this process: the shard leases it held at its last
    /// claim (read by [`RelayGroups::lease_holding`] without a query).
    holdings: Mutex<HashMap<RelayId, LeaseHolding>>,
    /// The outbox's virtual shard count, read once.
    virtual_shards: tokio::sync::OnceCell<u32>,
    /// When a relay-group member of this store that is not settled (below
    /// its fair share, or its holding or its group just changed) wants to
    /// rebalance again: the wake-up fires then, whatever the log did, so an
    /// idle member does not wait out its idle backoff to take its share.
    recheck_at: Mutex<Option<Instant>>,
}

impl RelayGroups {
    /// Relay groups on (`dynamic`) or off, rebalancing every `rebalance_every`.
    pub(super) fn new(dynamic: bool, rebalance_every: Duration) -> Self {
        RelayGroups {
            dynamic,
            rebalance_every,
            members: Mutex::new(HashMap::new()),
            holdings: Mutex::new(HashMap::new()),
            virtual_shards: tokio::sync::OnceCell::new(),
            recheck_at: Mutex::new(None),
        }
    }

    /// The shard leases `relay` (a relay of this process) held at its last
    /// claim: no query, so a readiness probe may call it at any rate.
    /// `None` before its first claim and after it left
    /// ([`Store::leave`](outbox_core::Store::leave)).
    pub(super) fn lease_holding(&self, relay: &RelayId) -> Option<LeaseHolding> {
        let map = self.holdings.lock().unwrap_or_else(|p| p.into_inner());
        map.get(relay).cloned()
    }

    /// Records what `relay` holds now (see [`RelayGroups::lease_holding`]).
    pub(super) fn note_holding(
        &self,
        relay: &RelayId,
        dynamic: bool,
        shards: Vec<u32>,
        total: u32,
        fair_share: u32,
    ) {
        let mut map = self.holdings.lock().unwrap_or_else(|p| p.into_inner());
        let since = map.get(relay).and_then(|h| h.held_none_since);
        let held_none_since =
            (shards.is_empty() && fair_share > 0).then(|| since.unwrap_or_else(Instant::now));
        let holding = LeaseHolding {
            dynamic,
            shards,
            total,
            fair_share,
            held_none_since,
        };
        match map.get_mut(relay) {
            Some(h) => *h = holding,
            None => {
                map.insert(relay.clone(), holding);
            }
        }
    }

    fn membership(&self, relay: &RelayId) -> Arc<tokio::sync::Mutex<Membership>> {
        let mut map = self.members.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(map.entry(relay.clone()).or_default())
    }

    /// The outbox's virtual shard count.
    pub(super) async fn virtual_shards(&self, ctx: &Ctx) -> Result<u32, StoreError> {
        self.virtual_shards
            .get_or_try_init(|| async {
                let n: i32 = sqlx::query_scalar(&ctx.sql.virtual_shards)
                    .persistent(false)
                    .fetch_one(&ctx.db)
                    .await?;
                Ok::<u32, StoreError>(u32::try_from(n).unwrap_or(1).max(1))
            })
            .await
            .copied()
    }

    /// A claim of a relay-group member: over the sets it holds, round-robin,
    /// the first that has events.
    pub(super) async fn claim_dynamic(
        &self,
        ctx: &Ctx,
        req: &ClaimRequest,
    ) -> Result<Claim, StoreError> {
        let cell = self.membership(&req.relay_id);
        let mut m = cell.lock().await;
        let every = if m.short {
            self.rebalance_every / SHORT_RECHECK
        } else {
            self.rebalance_every
        };
        let due = m.shrinking.is_some() || m.checked.is_none_or(|t| t.elapsed() >= every);
        if due {
            self.rebalance(ctx, &mut m, req).await?;
        }
        if m.short {
            // Not settled: the wake-up brings this relay back for its next
            // rebalance even if it holds nothing to read meanwhile.
            let since = m.checked.unwrap_or_else(Instant::now);
            self.recheck_by(since + self.rebalance_every / SHORT_RECHECK);
        }
        let n = m.sets.len();
        let mut upto: Option<(Snap, String)> = None;
        let mut lost = Vec::new();
        let mut found = None;
        // A set whose next events wait behind keys in flight.
        let mut more = false;
        for k in 0..n {
            let idx = (m.next + k) % n;
            let key = m.sets[idx].clone();
            if m.shrinking.as_ref() == Some(&key) {
                continue;
            }
            let Some(st_cell) = ctx.cursors.cell(&key) else {
                lost.push(key);
                continue;
            };
            let mut st = st_cell.lock().await;
            // Only a snapshot taken by this round's claims is shared.
            st.last_cur = None;
            match claim::claim_key(ctx, &key, &mut st, req, upto.as_ref()).await? {
                None => lost.push(key),
                Some(claim) if !claim.events.is_empty() => {
                    if st.lag_due() {
                        record_shard_lag(
                            &ctx.group,
                            &key,
                            &claim.events,
                            st.lease_until() - st.lease_len(),
                        );
                    }
                    m.next = (idx + 1) % n;
                    found = Some(claim);
                    break;
                }
                Some(empty) => {
                    more |= empty.more;
                    if st.lag_due() {
                        record_shard_lag(&ctx.group, &key, &[], Utc::now());
                    }
                    if upto.is_none() {
                        upto.clone_from(&st.last_cur);
                    }
                }
            }
        }
        let changed = !lost.is_empty();
        for key in lost {
            self.drop_set(ctx, &mut m, &key).await;
        }
        if changed {
            self.note_holding(&req.relay_id, true, m.held(), m.total, m.quota);
        }
        Ok(found.unwrap_or_else(|| Claim {
            more,
            ..empty_claim(Utc::now())
        }))
    }

    /// Asks the wake-up to fire by `at` (the earliest of the requests).
    fn recheck_by(&self, at: Instant) {
        let mut due = self.recheck_at.lock().unwrap_or_else(|p| p.into_inner());
        *due = Some(due.map_or(at, |d| d.min(at)));
    }

    /// The time left until a requested recheck, when it comes within
    /// `window`; the request is then taken (it fires once).
    pub(super) fn recheck_within(&self, window: Duration) -> Option<Duration> {
        let mut due = self.recheck_at.lock().unwrap_or_else(|p| p.into_inner());
        let left = due.map(|d| d.saturating_duration_since(Instant::now()))?;
        if left > window {
            return None;
        }
        *due = None;
        Some(left)
    }

    /// Forgets a set this relay no longer holds (its batches are void), and
    /// frees what it may still hold of it so the group can take it again.
    async fn drop_set(&self, ctx: &Ctx, m: &mut Membership, key: &CursorKey) {
        m.sets.retain(|k| k != key);
        if m.shrinking.as_ref() == Some(key) {
            m.shrinking = None;
        }
        m.checked = None;
        let cell = {
            let mut map = ctx.cursors.cells();
            map.remove(key)
        };
        if let Some(cell) = cell {
            let mut st = cell.lock().await;
            if let Some(epoch) = st.epoch() {
                if let Err(e) = lease::release(ctx, key, &key.shards, epoch).await {
                    tracing::debug!(error = %e, "giving back a lost cursor set failed");
                }
            }
            ctx.cursors.lose(&mut st);
        }
    }

    /// Announces the relay, creates the group's cursors if needed, and moves
    /// toward its fair share: gives back above it, takes free cursors below
    /// it, merges idle sets at one position, renews idle sets' leases.
    async fn rebalance(
        &self,
        ctx: &Ctx,
        m: &mut Membership,
        req: &ClaimRequest,
    ) -> Result<(), StoreError> {
        let total = self.virtual_shards(ctx).await?;
        let total_i = i32::try_from(total).unwrap_or(i32::MAX);
        let alive = LeaseTimers::new(req.lease).alive_for(self.rebalance_every);
        let row = sqlx::query(&ctx.sql.heartbeat)
            .persistent(false)
            .bind(&ctx.group)
            .bind(req.relay_id.as_str())
            .bind(micros(alive)?)
            .bind(total_i)
            .fetch_one(&ctx.db)
            .await?;
        let others: Vec<String> = row.try_get(0)?;
        let present: i64 = row.try_get(1)?;
        if present < i64::from(total) {
            if let Err(e) = self
                .create_virtual_cursors(ctx, total, m.checked.is_some())
                .await
            {
                if matches!(e, StoreError::Refused(_)) {
                    // The group was dropped under this relay: its relay
                    // row goes too (the heartbeat above wrote it again).
                    sqlx::query(&ctx.sql.leave)
                        .persistent(false)
                        .bind(&ctx.group)
                        .bind(req.relay_id.as_str())
                        .execute(&ctx.db)
                        .await?;
                    for key in m.sets.clone() {
                        self.drop_set(ctx, m, &key).await;
                    }
                    m.checked = None;
                    tracing::error!(group = %ctx.group, error = %e, "refusing to claim");
                }
                return Err(e);
            }
        }
        let me = req.relay_id.as_str();
        let n = others.len() + 1;
        let rank = others.iter().filter(|o| o.as_str() < me).count();
        let quota = total as usize / n + usize::from(rank < total as usize % n);
        metrics::gauge!(crate::log::metric_names::SHARDS_QUOTA, "group" => ctx.group.clone())
            .set(quota as f64);

        // Before the renewals: a lease lost while renewing is a change too.
        let before = m.held();
        self.renew_idle_sets(ctx, m, req.lease).await?;
        let held: usize = m.sets.iter().map(|k| k.shards.len()).sum();
        if held > quota {
            self.shrink(ctx, m, held - quota).await?;
        } else {
            m.shrinking = None;
            if held < quota {
                self.grow(ctx, m, req, total, quota - held).await?;
            }
        }
        self.merge_idle_sets(ctx, m, req.lease).await?;
        let held = m.held();
        m.short = held.len() < quota || held != before || others != m.others;
        m.others = others;
        metrics::gauge!(crate::log::metric_names::SHARDS_HELD, "group" => ctx.group.clone())
            .set(held.len() as f64);
        m.quota = u32::try_from(quota).unwrap_or(total);
        m.total = total;
        self.note_holding(&req.relay_id, true, held, total, m.quota);
        m.checked = Some(Instant::now());
        Ok(())
    }

    /// Creates the group's missing cursors of `total` virtual shards.
    /// `member`: this relay has rebalanced in this group before; if the
    /// group then has no cursor at all it was dropped under the relay,
    /// which refuses instead of starting it again at the log's origin.
    async fn create_virtual_cursors(
        &self,
        ctx: &Ctx,
        total: u32,
        member: bool,
    ) -> Result<(), StoreError> {
        let existing = lease::group_starts(ctx).await?;
        if existing.is_empty() && member {
            return Err(StoreError::Refused(crate::error::Refusal::GroupDropped {
                group: ctx.group.clone(),
                shard: format!("0..{total}/{total} (relay group)"),
            }));
        }
        if existing.is_empty() && ctx.new_group_start == GroupStart::Now {
            lease::create_group_at_now(ctx, total).await?;
            return Ok(());
        }
        let origin: String = sqlx::query_scalar(&ctx.sql.origin)
            .persistent(false)
            .fetch_one(&ctx.db)
            .await?;
        let mut indexes = Vec::new();
        let mut starts = Vec::new();
        for i in 0..total {
            if existing.iter().any(|(t, j, _)| *t == total && *j == i) {
                continue;
            }
            let start = lease::covering_start(total, i, &existing)
                .map_or_else(|| origin.clone(), |s| s.to_string());
            indexes.push(i32::try_from(i).unwrap_or(i32::MAX));
            starts.push(start);
        }
        sqlx::query(&ctx.sql.create_set)
            .persistent(false)
            .bind(&ctx.group)
            .bind(i32::try_from(total).unwrap_or(i32::MAX))
            .bind(indexes)
            .bind(starts)
            .execute(&ctx.db)
            .await?;
        Ok(())
    }

    /// Keeps the leases of sets no claim visited lately.
    async fn renew_idle_sets(
        &self,
        ctx: &Ctx,
        m: &mut Membership,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let mut lost = Vec::new();
        for key in m.sets.clone() {
            let Some(cell) = ctx.cursors.cell(&key) else {
                lost.push(key);
                continue;
            };
            let mut st = cell.lock().await;
            if st.idle_renew_due(lease) && !lease::renew_set(ctx, &key, &mut st, lease).await? {
                lost.push(key);
            }
        }
        for key in lost {
            self.drop_set(ctx, m, &key).await;
        }
        Ok(())
    }

    /// Gives back `excess` shards, from the smallest sets first, only from
    /// sets without a batch in flight.
    async fn shrink(
        &self,
        ctx: &Ctx,
        m: &mut Membership,
        mut excess: usize,
    ) -> Result<(), StoreError> {
        let mut order = m.sets.clone();
        order.sort_by_key(|k| (k.shards.len(), k.shards.clone()));
        m.shrinking = None;
        for key in order {
            if excess == 0 {
                break;
            }
            let Some(cell) = ctx.cursors.cell(&key) else {
                continue;
            };
            let mut st = cell.lock().await;
            if st.has_abandoned_batch() {
                // Given up by the relay: give the whole set back now; its
                // events are read again from its stored position.
                drop(st);
                self.drop_set(ctx, m, &key).await;
                return Ok(());
            }
            if !st.batches.is_empty() {
                // After the batches in flight: no claim from it meanwhile.
                m.shrinking = Some(key);
                return Ok(());
            }
            let Some(epoch) = st.epoch() else {
                continue;
            };
            let give = excess.min(key.shards.len());
            let keep_n = key.shards.len() - give;
            let (kept, gone) = key.shards.split_at(keep_n);
            lease::release(ctx, &key, gone, epoch).await?;
            tracing::info!(group = %ctx.group, relay = %key.relay, shards = ?gone, "gave shards back to the relay group");
            excess -= give;
            let mut map = ctx.cursors.cells();
            let cell = map.remove(&key);
            m.sets.retain(|k| k != &key);
            if !kept.is_empty() {
                let new_key = CursorKey {
                    shards: kept.to_vec(),
                    ..key.clone()
                };
                if let Some(cell) = cell {
                    map.insert(new_key.clone(), cell);
                    m.sets.push(new_key);
                }
            } else {
                drop(map);
                ctx.cursors.lose(&mut st);
            }
        }
        Ok(())
    }

    /// Takes up to `want` free cursors, whole positions first.
    async fn grow(
        &self,
        ctx: &Ctx,
        m: &mut Membership,
        req: &ClaimRequest,
        total: u32,
        want: usize,
    ) -> Result<(), StoreError> {
        let mine: Vec<i32> = m.sets.iter().flat_map(|k| k.indexes()).collect::<Vec<_>>();
        let rows: Vec<(i32, String)> = sqlx::query_as(&ctx.sql.free_shards)
            .persistent(false)
            .bind(&ctx.group)
            .bind(i32::try_from(total).unwrap_or(i32::MAX))
            .bind(req.relay_id.as_str())
            .bind(mine)
            .fetch_all(&ctx.db)
            .await?;
        if rows.is_empty() {
            return Ok(());
        }
        let mut by_position: BTreeMap<String, Vec<i32>> = BTreeMap::new();
        for (i, sig) in rows {
            by_position.entry(sig).or_default().push(i);
        }
        let mut groups: Vec<Vec<i32>> = by_position.into_values().collect();
        groups.sort_by_key(|g| (std::cmp::Reverse(g.len()), g.first().copied()));
        let picked: Vec<i32> = groups.into_iter().flatten().take(want).collect();
        let rows = sqlx::query(&ctx.sql.acquire_set)
            .persistent(false)
            .bind(&ctx.group)
            .bind(i32::try_from(total).unwrap_or(i32::MAX))
            .bind(&picked)
            .bind(req.relay_id.as_str())
            .bind(micros(req.lease)?)
            .fetch_all(&ctx.db)
            .await?;
        // One set per position taken.
        let mut sets: HashMap<String, (Vec<u32>, sqlx::postgres::PgRow)> = HashMap::new();
        for r in rows {
            let index: i32 = r.try_get(0)?;
            let lo: String = r.try_get(3)?;
            let hi: String = r.try_get(4)?;
            let pos_txid: Option<String> = r.try_get(5)?;
            let pos_seq: Option<i64> = r.try_get(6)?;
            let skip_txid: Vec<String> = r.try_get(7)?;
            let skip_seq: Vec<i64> = r.try_get(8)?;
            let sig = format!("{lo}|{hi}|{pos_txid:?}|{pos_seq:?}|{skip_txid:?}|{skip_seq:?}");
            let entry = sets.entry(sig).or_insert_with(|| (Vec::new(), r));
            entry.0.push(u32::try_from(index).unwrap_or(0));
        }
        for (_, (mut shards, r)) in sets {
            shards.sort_unstable();
            let epoch: i64 = r.try_get(1)?;
            let lease_until: DateTime<Utc> = r.try_get(2)?;
            let done = position(
                (&r.try_get::<String, _>(3)?, r.try_get(10)?),
                (&r.try_get::<String, _>(4)?, r.try_get(11)?),
                r.try_get(5)?,
                r.try_get(6)?,
            )?;
            let boot = lease::incarnation(ctx, r.try_get(12)?).await?;
            let skip = row_skip_list(&r, 7, 8)?;
            let key = CursorKey {
                total,
                shards,
                relay: req.relay_id.clone(),
                dynamic: true,
            };
            tracing::info!(group = %ctx.group, relay = %key.relay, shards = ?key.shards, epoch, "took shards of the relay group");
            let cell = ctx.cursors.cell_or_new(&key);
            let mut st = cell.lock().await;
            ctx.cursors.lose(&mut st);
            let granted = Granted {
                until: lease_until,
                len: req.lease,
            };
            st.take(epoch, boot, granted, done, skip);
            m.sets.push(key);
        }
        Ok(())
    }

    /// Merges sets that are idle (no batch in flight, nothing read past the
    /// settled position, no skip list) at the same position.
    async fn merge_idle_sets(
        &self,
        ctx: &Ctx,
        m: &mut Membership,
        lease: Duration,
    ) -> Result<(), StoreError> {
        if m.sets.len() < 2 {
            return Ok(());
        }
        // (position text, key, epoch) of each idle set.
        let mut idle: Vec<(String, CursorKey, i64)> = Vec::new();
        for key in &m.sets {
            let Some(cell) = ctx.cursors.cell(key) else {
                continue;
            };
            let st = cell.lock().await;
            let Some(epoch) = st.epoch() else { continue };
            if !st.batches.is_empty() || !st.inherited.is_empty() || !st.persisted_skip.is_empty() {
                continue;
            }
            idle.push((format!("{:?}", st.read), key.clone(), epoch));
        }
        idle.sort_by(|a, b| a.0.cmp(&b.0));
        let mut i = 0;
        while i < idle.len() {
            let j = idle[i..]
                .iter()
                .position(|x| x.0 != idle[i].0)
                .map_or(idle.len(), |p| i + p);
            if j - i >= 2 {
                self.merge(ctx, m, &idle[i..j], lease).await?;
            }
            i = j;
        }
        Ok(())
    }

    async fn merge(
        &self,
        ctx: &Ctx,
        m: &mut Membership,
        parts: &[(String, CursorKey, i64)],
        lease: Duration,
    ) -> Result<(), StoreError> {
        let Some(first) = parts.first() else {
            return Ok(());
        };
        let Some(cell) = ctx.cursors.cell(&first.1) else {
            return Ok(());
        };
        let (read, boot) = {
            let st = cell.lock().await;
            (st.read.clone(), st.boot.clone())
        };
        let Some(boot) = boot else {
            return Ok(());
        };
        let mut indexes = Vec::new();
        let mut epochs = Vec::new();
        let mut shards = Vec::new();
        for (_, key, epoch) in parts {
            for i in &key.shards {
                indexes.push(i32::try_from(*i).unwrap_or(i32::MAX));
                epochs.push(*epoch);
                shards.push(*i);
            }
        }
        shards.sort_unstable();
        let rows = sqlx::query(&ctx.sql.merge_set)
            .persistent(false)
            .bind(&ctx.group)
            .bind(i32::try_from(first.1.total).unwrap_or(i32::MAX))
            .bind(&indexes)
            .bind(&epochs)
            .bind(first.1.relay.as_str())
            .bind(read.lo.to_string())
            .bind(read.hi.to_string())
            .bind(read.after.map(|a| a.0.to_string()))
            .bind(read.after.map(|a| a.1))
            .bind(micros(lease)?)
            .bind(read.lo.floor)
            .bind(read.hi.floor)
            .bind(Uuid::parse_str(&boot).unwrap_or_default())
            .fetch_all(&ctx.db)
            .await?;
        if rows.len() != indexes.len() {
            // Some moved away meanwhile: start over from the database.
            for (_, key, _) in parts {
                self.drop_set(ctx, m, key).await;
            }
            return Ok(());
        }
        let epoch: i64 = rows[0].try_get(0)?;
        let lease_until: DateTime<Utc> = rows[0].try_get(1)?;
        let mut old_cells = Vec::new();
        {
            let mut map = ctx.cursors.cells();
            for (_, key, _) in parts {
                if let Some(c) = map.remove(key) {
                    old_cells.push(c);
                }
                m.sets.retain(|k| k != key);
            }
        }
        for c in old_cells {
            let mut st = c.lock().await;
            ctx.cursors.lose(&mut st);
        }
        let key = CursorKey {
            shards,
            ..first.1.clone()
        };
        let cell = ctx.cursors.cell_or_new(&key);
        let mut st = cell.lock().await;
        ctx.cursors.lose(&mut st);
        let granted = Granted {
            until: lease_until,
            len: lease,
        };
        st.take(epoch, boot, granted, read, Vec::new());
        tracing::debug!(group = %ctx.group, relay = %key.relay, shards = ?key.shards, "merged cursor sets at one position");
        m.sets.push(key);
        Ok(())
    }

    /// `relay` stops: forgets what it held, and, in a relay group, gives
    /// every cursor set back and leaves the group at once. (Its static
    /// shards are given back by `lease::release_static`.)
    pub(super) fn forget(&self, relay: &RelayId) {
        self.holdings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(relay);
    }

    /// Gives every cursor set of `relay` back and leaves the relay group.
    pub(super) async fn leave(&self, ctx: &Ctx, relay: &RelayId) -> Result<(), StoreError> {
        if !self.dynamic {
            return Ok(());
        }
        let cell = {
            let map = self.members.lock().unwrap_or_else(|p| p.into_inner());
            map.get(relay).cloned()
        };
        let Some(cell) = cell else {
            return Ok(());
        };
        let mut m = cell.lock().await;
        for key in m.sets.clone() {
            self.drop_set(ctx, &mut m, &key).await;
        }
        sqlx::query(&ctx.sql.leave)
            .persistent(false)
            .bind(&ctx.group)
            .bind(relay.as_str())
            .execute(&ctx.db)
            .await?;
        tracing::info!(group = %ctx.group, %relay, "left the relay group");
        Ok(())
    }

    /// The relays of this store's consumer group and the virtual shards
    /// each holds (see [`PgLogOptions::with_dynamic_shards`](crate::log::PgLogOptions::with_dynamic_shards)).
    pub(super) async fn relay_group(&self, ctx: &Ctx) -> Result<Vec<RelayInfo>, StoreError> {
        let total = self.virtual_shards(ctx).await?;
        let rows: Vec<(String, bool, Vec<i32>)> = sqlx::query_as(&ctx.sql.relay_group)
            .persistent(false)
            .bind(&ctx.group)
            .bind(i32::try_from(total).unwrap_or(i32::MAX))
            .fetch_all(&ctx.db)
            .await?;
        Ok(rows
            .into_iter()
            .map(|(relay, alive, shards)| RelayInfo {
                relay,
                alive,
                shards: shards
                    .into_iter()
                    .map(|i| u32::try_from(i).unwrap_or(0))
                    .collect(),
                virtual_shards: total,
            })
            .collect())
    }
}
