//! What this process knows of the cursors it reads: their keys, their
//! state (lease, positions, batches in flight), the map of them and of the
//! tokens of their claims, and the seq floors claims observed. Nothing
//! here talks to the database; [`CursorState`] is the one place a lease
//! held in memory is written (taken, renewed, lost).

use crate::log::options::LeaseTimers;
use crate::log::snapshot::{Position, Snap};
use chrono::{DateTime, Utc};
use outbox_core::{EventId, FencingToken, RelayId, ShardSpec};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a cursor set's per-shard lag gauges are set, at most: a gauge
/// read every few seconds by a scraper needs no update per batch.
pub(super) const LAG_EVERY: Duration = Duration::from_secs(1);

/// One cursor as this process uses it, read by one relay: a static shard
/// (`shards` = its index), or a set of a relay group's virtual shards held
/// under one epoch at one position (see the relay groups, `relays.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct CursorKey {
    pub(super) total: u32,
    /// Sorted, never empty.
    pub(super) shards: Vec<u32>,
    pub(super) relay: RelayId,
    /// A relay group's set: leases are taken and given back by the group's
    /// balancing, never by a claim.
    pub(super) dynamic: bool,
}

impl CursorKey {
    pub(super) fn single(shard: ShardSpec, relay: RelayId) -> Self {
        Self {
            total: shard.total(),
            shards: vec![shard.index()],
            relay,
            dynamic: false,
        }
    }

    /// The shard (of a set: its first virtual shard).
    pub(super) fn shard(&self) -> ShardSpec {
        ShardSpec::new(self.shards.first().copied().unwrap_or(0), self.total)
            .unwrap_or(ShardSpec::ALL)
    }

    pub(super) fn indexes(&self) -> Vec<i32> {
        self.shards
            .iter()
            .map(|i| i32::try_from(*i).unwrap_or(i32::MAX))
            .collect()
    }
}

/// What this process knows of a cursor it reads. The lease fields are
/// private: only [`CursorState::take`], [`CursorState::renewed`] and
/// [`Cursors::lose`] write them.
pub(super) struct CursorState {
    /// The epoch of our lease, when we hold it.
    epoch: Option<i64>,
    lease_until: DateTime<Utc>,
    lease_len: Duration,
    renewed_at: Instant,
    /// The settled position as stored.
    pub(super) done: Position,
    /// Where the next claim continues (after the outstanding batches).
    pub(super) read: Position,
    /// Claimed, not yet fully settled batches, in claim order.
    pub(super) batches: VecDeque<Batch>,
    pub(super) last_persist: Instant,
    /// Rows ahead of `done` settled under an earlier holding (the cursor's
    /// skip list when we took it), pruned as `done` passes them.
    pub(super) inherited: Vec<(u64, i64)>,
    /// The skip list as stored.
    pub(super) persisted_skip: Vec<(u64, i64)>,
    /// The snapshot the last claim read up to, with its seq floor (shared
    /// with the next cursors of a relay group's round).
    /// With the database incarnation it was taken in: a snapshot of an
    /// earlier incarnation is never shared (its xids may be handed out
    /// again; found by the model, `outbox-model`).
    pub(super) last_cur: Option<(Snap, String)>,
    /// How far a claim behind keys in flight can expect to read before the
    /// first row of a held key (see [`KeySpread`]).
    pub(super) spread: KeySpread,
    /// When the per-shard lag gauges of this set were last set (see
    /// [`CursorState::lag_due`]).
    lag_at: Option<Instant>,
    /// The database incarnation (see `lease::incarnation`) this
    /// state was read in: positions, windows and the lease held in memory
    /// are used only while the database is still that incarnation. `None`
    /// until a lease is taken.
    pub(super) boot: Option<String>,
    /// The epoch under which the fences (`fences.rs`) last passed: a lease
    /// newly taken is checked before it is read under.
    pub(super) guarded_epoch: Option<i64>,
    /// This relay found the cursor row once: if it vanishes (the group was
    /// dropped), the relay refuses instead of creating it at the origin.
    pub(super) cursor_seen: bool,
}

/// A lease as the database granted (or renewed) it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Granted {
    /// Its end (database clock).
    pub(super) until: DateTime<Utc>,
    /// The lease length asked for.
    pub(super) len: Duration,
}

/// small costs one claim more (it says `more`), never an event.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct KeySpread {
    est: Option<f64>,
}

impl KeySpread {
    /// Rows a claim reads at least (the bound's floor).
    const FLOOR: u32 = 16;

    /// Rows to read for a claim of `limit` with `held` keys in flight.
    pub(super) fn scan_limit(self, limit: u32, held: usize) -> u32 {
        match self.est {
            Some(est) if held > 0 => {
                let expect = 2.0 * est / held as f64 + f64::from(Self::FLOOR);
                // Saturating float-to-int cast; `limit` caps it anyway.
                (expect as u32).clamp(Self::FLOOR.min(limit), limit)
            }
            _ => limit,
        }
    }

    /// A claim read `rows` log rows before the first row of one of `held`
    /// keys in flight.
    pub(super) fn stopped_after(&mut self, rows: usize, held: usize) {
        let sample = (rows as f64 + 1.0) * held as f64;
        self.est = Some(self.est.map_or(sample, |e| (e + sample) / 2.0));
    }

    /// A claim read `rows` log rows (all it asked for) with `held` keys in
    /// flight and none of them came: the keys spread wider than thought.
    pub(super) fn read_past(&mut self, rows: usize, held: usize) {
        let sample = 2.0 * rows as f64 * held as f64;
        self.est = Some(self.est.map_or(sample, |e| e.max(sample)));
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Src {
    Log {
        txid: u64,
        seq: i64,
    },
    /// `attempts`: as stored in the lane (before this claim).
    Lane {
        ord: i64,
        attempts: i32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Kind {
    /// Given to the relay.
    Deliver,
    /// Parked behind an earlier event of its key (copied into the lane at claim).
    Parked,
    /// Dead-lettered at claim.
    Undecodable,
}

#[derive(Debug, Clone)]
pub(super) struct Item {
    pub(super) id: EventId,
    pub(super) key: Option<String>,
    pub(super) src: Src,
    pub(super) kind: Kind,
    /// For log rows: the window it was read in (1: the batch's first, 2:
    /// the next); with `src`, the position just after it.
    pub(super) window: u8,
    pub(super) resolved: bool,
}

pub(super) struct Batch {
    pub(super) token: FencingToken,
    pub(super) epoch: i64,
    /// The database incarnation it was claimed in (checked by its settle
    /// and renewals).
    pub(super) boot: String,
    pub(super) start: Position,
    pub(super) end: Position,
    /// The snapshot that closes the batch's second window (`start.hi`
    /// closes the first).
    pub(super) next_hi: Snap,
    pub(super) items: Vec<Item>,
    pub(super) complete: bool,
    /// When the relay's lease on it ends (the lease it was claimed or last
    /// renewed under): a batch still holding events then was given up
    /// (e.g. its settle failed until the lease ran out) and is read again.
    pub(super) expires: Instant,
}

impl Batch {
    /// The position just after log item `item`.
    pub(super) fn after(&self, item: &Item) -> Option<Position> {
        let Src::Log { txid, seq } = item.src else {
            return None;
        };
        let (lo, hi) = if item.window == 1 {
            (&self.start.lo, &self.start.hi)
        } else {
            (&self.start.hi, &self.next_hi)
        };
        Some(Position {
            lo: lo.clone(),
            hi: hi.clone(),
            after: Some((txid, seq)),
        })
    }

    pub(super) fn held(&self) -> impl Iterator<Item = &Item> {
        self.items
            .iter()
            .filter(|i| i.kind == Kind::Deliver && !i.resolved)
    }

    /// Still holds events after its lease ended: the relay gave it up.
    pub(super) fn abandoned(&self, now: Instant) -> bool {
        self.expires <= now && self.held().next().is_some()
    }
}

impl CursorState {
    /// A cursor nobody here holds, at no position yet.
    fn new() -> Self {
        let zero = Position::at(Snap {
            xmin: 0,
            xmax: 0,
            xip: Vec::new(),
            floor: 0,
        });
        CursorState {
            epoch: None,
            lease_until: DateTime::<Utc>::MIN_UTC,
            lease_len: Duration::ZERO,
            renewed_at: Instant::now(),
            done: zero.clone(),
            read: zero,
            batches: VecDeque::new(),
            last_persist: Instant::now(),
            inherited: Vec::new(),
            persisted_skip: Vec::new(),
            last_cur: None,
            spread: KeySpread::default(),
            lag_at: None,
            boot: None,
            guarded_epoch: None,
            cursor_seen: false,
        }
    }

    /// The epoch of our lease, when we hold it.
    pub(super) fn epoch(&self) -> Option<i64> {
        self.epoch
    }

    /// The end of our lease as stored (database clock).
    pub(super) fn lease_until(&self) -> DateTime<Utc> {
        self.lease_until
    }

    /// The lease length it was last taken or renewed with.
    pub(super) fn lease_len(&self) -> Duration {
        self.lease_len
    }

    /// Whether a claim asking for a lease of `lease` must renew (or take)
    /// the lease first: none held, another length, or half of it passed
    /// ([`LeaseTimers::renew_after`]).
    pub(super) fn renew_due(&self, lease: Duration) -> bool {
        self.epoch.is_none()
            || self.lease_len != lease
            || self.renewed_at.elapsed() >= LeaseTimers::new(lease).renew_after()
    }

    /// Whether no claim renewed the lease for
    /// [`LeaseTimers::idle_renew_after`] (a relay group's idle set).
    pub(super) fn idle_renew_due(&self, lease: Duration) -> bool {
        self.renewed_at.elapsed() >= LeaseTimers::new(lease).idle_renew_after()
    }

    /// A new holding: the lease `granted` at `epoch` under incarnation
    /// `boot`, reading on from the stored position `done` with the stored
    /// skip list `skip`. The previous holding's batches must be dropped
    /// first ([`Cursors::lose`]).
    pub(super) fn take(
        &mut self,
        epoch: i64,
        boot: String,
        granted: Granted,
        done: Position,
        skip: Vec<(u64, i64)>,
    ) {
        self.boot = Some(boot);
        self.read = done.clone();
        self.done = done;
        self.inherited.clone_from(&skip);
        self.persisted_skip = skip;
        self.last_persist = Instant::now();
        self.last_cur = None;
        self.write_lease(Some(epoch), granted);
    }

    /// The lease we hold was renewed (same epoch).
    pub(super) fn renewed(&mut self, granted: Granted) {
        self.write_lease(self.epoch, granted);
    }

    /// The one place the lease held in memory is written: its epoch, its
    /// end, its length, and when it was renewed.
    fn write_lease(&mut self, epoch: Option<i64>, granted: Granted) {
        self.epoch = epoch;
        self.lease_until = granted.until;
        self.lease_len = granted.len;
        self.renewed_at = Instant::now();
    }

    /// Whether a batch was given up: neither settled nor renewed within its
    /// lease. The relay stops retrying a settle when the lease ends and
    /// counts on the events coming back; the cursor lease itself stays ours
    /// (every claim renews it), so without this check the batch would hold
    /// its keys, and every later claim would stop at them, for ever.
    pub(super) fn has_abandoned_batch(&self) -> bool {
        let now = Instant::now();
        self.batches.iter().any(|b| b.abandoned(now))
    }

    /// Whether the set's per-shard lag gauges are due again (then they
    /// count as set now). At most once per [`LAG_EVERY`]: working
    /// them out hashes every event's key and sets a gauge per shard, which
    /// cost a single relay holding all 64 virtual shards about 6% of its
    /// CPU per event when it was done for every claim.
    pub(super) fn lag_due(&mut self) -> bool {
        let due = self.lag_at.is_none_or(|t| t.elapsed() >= LAG_EVERY);
        if due {
            self.lag_at = Some(Instant::now());
        }
        due
    }
}

/// A cursor's state, locked while a claim, settle or renewal uses it.
pub(super) type Cell = Arc<tokio::sync::Mutex<CursorState>>;

/// The cursors this process reads and the tokens of their claims (shared
/// by a store's clones).
#[derive(Default)]
pub(super) struct Cursors {
    cells: Mutex<HashMap<CursorKey, Cell>>,
    tokens: Mutex<HashMap<FencingToken, CursorKey>>,
}

impl Cursors {
    /// The state of cursor `key`, if this process reads it.
    pub(super) fn cell(&self, key: &CursorKey) -> Option<Cell> {
        self.cells().get(key).cloned()
    }

    /// The state of cursor `key`, new (no lease, no position) when this
    /// process did not read it yet.
    pub(super) fn cell_or_new(&self, key: &CursorKey) -> Cell {
        let mut map = self.cells();
        Arc::clone(
            map.entry(key.clone())
                .or_insert_with(|| Arc::new(tokio::sync::Mutex::new(CursorState::new()))),
        )
    }

    /// Every cursor this process reads, at this moment.
    pub(super) fn all(&self) -> Vec<(CursorKey, Cell)> {
        self.cells()
            .iter()
            .map(|(k, v)| (k.clone(), Arc::clone(v)))
            .collect()
    }

    /// The map itself, locked (to move a cell to another key at once).
    pub(super) fn cells(&self) -> MutexGuard<'_, HashMap<CursorKey, Cell>> {
        self.cells.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cursor a claim's token was issued for.
    pub(super) fn token_key(&self, token: FencingToken) -> Option<CursorKey> {
        let map = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&token).cloned()
    }

    /// Records the token of a claim from cursor `key`.
    pub(super) fn issue(&self, token: FencingToken, key: &CursorKey) {
        self.tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, key.clone());
    }

    /// Forgets the tokens of batches that are settled or void.
    pub(super) fn forget_tokens<'a>(&self, tokens: impl IntoIterator<Item = &'a FencingToken>) {
        let mut map = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        for t in tokens {
            map.remove(t);
        }
    }

    /// We no longer hold the cursor: every outstanding batch is void (its
    /// events will be read again by the new holder).
    pub(super) fn lose(&self, st: &mut CursorState) {
        let tokens: Vec<FencingToken> = st.batches.iter().map(|b| b.token).collect();
        self.forget_tokens(&tokens);
        st.batches.clear();
        st.epoch = None;
    }
}

/// The latest seq observation of a completed claim, with the database
/// incarnation it was made in: a floor for every snapshot taken after
/// it (see the CLAIM SQL). Used only under the same incarnation.
#[derive(Default)]
pub(super) struct SeqFloors {
    observed: Mutex<Option<(String, i64)>>,
}

impl SeqFloors {
    /// A seq floor for a snapshot a claim is about to take, under
    /// incarnation `boot`: the latest observation of a completed claim of
    /// this store, or `fallback` (the floor of an earlier snapshot, always
    /// valid for a later one), whichever is higher.
    pub(super) fn floor_for_new_snapshot(&self, boot: Option<&str>, fallback: i64) -> i64 {
        let observed = self.observed.lock().unwrap_or_else(|p| p.into_inner());
        match (observed.as_ref(), boot) {
            (Some((b, s)), Some(boot)) if b == boot => (*s).max(fallback),
            _ => fallback,
        }
    }

    /// Records a completed claim's seq observation under incarnation `boot`.
    pub(super) fn observe(&self, boot: &str, seq: i64) {
        let mut observed = self.observed.lock().unwrap_or_else(|p| p.into_inner());
        match observed.as_mut() {
            Some((b, s)) if b == boot => *s = (*s).max(seq),
            _ => *observed = Some((boot.to_owned(), seq)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_behind_keys_in_flight_reads_about_as_far_as_the_keys_spread() {
        let mut spread = KeySpread::default();
        // Nothing learnt yet, or no key in flight: the whole batch.
        assert_eq!(spread.scan_limit(1000, 20), 1000);
        // Stopped at the first row with 20 keys in flight: 20 keys.
        spread.stopped_after(0, 20);
        assert_eq!(spread.scan_limit(1000, 20), 18);
        assert_eq!(spread.scan_limit(1000, 0), 1000);
        assert_eq!(spread.scan_limit(5, 20), 5, "never more than the batch");
        // Read all 18 and none was held: wider than thought.
        spread.read_past(18, 20);
        assert_eq!(spread.scan_limit(1000, 20), 88);

        // 10,000 keys, a batch of 1,000 (~1,000 keys) in flight: the next
        // claim stops after ~10 rows; behind a batch of 10 keys it reads all.
        let mut wide = KeySpread::default();
        wide.stopped_after(9, 1000);
        assert_eq!(wide.scan_limit(1000, 1000), 36);
        assert_eq!(wide.scan_limit(1000, 10), 1000);
    }
}
