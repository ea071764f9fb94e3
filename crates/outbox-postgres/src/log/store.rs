//! [`PgLogStore`]: snapshot-window claims over the event log, fenced cursor
//! settlements, the retry lane, dead letters, rotation.

use super::names::{LogNames, PARTITIONS};
use super::options::{DeadHeadPolicy, GroupStart, PgLogOptions};
use super::snapshot::{Position, Snap, Xid8};
use super::sql::{Sql, PROBE};
use super::PgLog;
use crate::store::{
    bind_dead_filter, headers_lenient_under, headers_strict, last_error, BackgroundTasks,
};
use crate::{redact_url, StoreError};
use chrono::{DateTime, Utc};
use outbox_core::{
    Claim, ClaimRequest, DeadLetter, DeadLetterFilter, DeadLetterQuery, DeadLetterStore, ErrorCode,
    Event, EventId, FencingToken, LastError, Rejected, RelayId, Resolution, SettleReport,
    Settlement, ShardSpec, Stats, Store,
};
use sqlx::postgres::PgRow;
use sqlx::{Acquire, PgPool, Row};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

mod relays;

pub use relays::{LeaseHolding, RelayInfo};

/// The event-log store on PostgreSQL (see the [module docs](super)). Cheap to
/// clone; clones share the claims in flight, so one process should use one
/// store (and its clones) per outbox. The background rotation stops when
/// the last clone is dropped. `Debug` never shows the password.
#[derive(Clone)]
pub struct PgLogStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    log: PgLog,
    outbox: crate::PgOutbox,
    sql: Arc<Sql>,
    group: String,
    dead_head: DeadHeadPolicy,
    new_group_start: GroupStart,
    rotation_interval: Duration,
    idle_progress_every: Duration,
    probe_min: Duration,
    probe_max: Duration,
    durable_progress: bool,
    url: Option<String>,
    cursors: Mutex<HashMap<CursorKey, Arc<tokio::sync::Mutex<CursorState>>>>,
    tokens: Mutex<HashMap<FencingToken, CursorKey>>,
    /// Last snapshot seen by a claim or a probe (wake-ups).
    seen: Mutex<String>,
    /// Current probe delay in µs (reset to the minimum by a non-empty claim).
    probe_delay_us: AtomicU64,
    /// When a relay-group member of this store that is not settled (below
    /// its fair share, or its holding or its group just changed) wants to
    /// rebalance again: the wake-up fires then, whatever the log did, so an
    /// idle member does not wait out its idle backoff to take its share.
    recheck_at: Mutex<Option<Instant>>,
    /// Relays claiming `ShardSpec::ALL` join the group's relay group.
    dynamic: bool,
    rebalance_every: Duration,
    /// Per relay of this process: its place in the relay group.
    members: Mutex<HashMap<RelayId, Arc<tokio::sync::Mutex<relays::Membership>>>>,
    /// Per relay of this process: the shard leases it held at its last
    /// claim (read by [`PgLogStore::lease_holding`] without a query).
    holdings: Mutex<HashMap<RelayId, LeaseHolding>>,
    /// The outbox's virtual shard count, read once.
    virtual_shards: tokio::sync::OnceCell<u32>,
    /// The latest seq observation of a completed claim, with the database
    /// incarnation it was made in: a floor for every snapshot taken after
    /// it (see the CLAIM SQL). Used only under the same incarnation.
    observed: Mutex<Option<(String, i64)>>,
    /// Held for its `Drop`: stops the background rotation with the last clone.
    _tasks: BackgroundTasks,
}

impl fmt::Debug for PgLogStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgLogStore")
            .field("url", &self.inner.url.as_deref().map(redact_url))
            .field("schema", self.inner.log.schema())
            .field("table", self.inner.log.table())
            .field("group", &self.inner.group)
            .field("dead_head", &self.inner.dead_head)
            .field("rotation_interval", &self.inner.rotation_interval)
            .field("pool_size", &self.inner.pool.size())
            .finish()
    }
}

/// One cursor as this process uses it, read by one relay: a static shard
/// (`shards` = its index), or a set of a relay group's virtual shards held
/// under one epoch at one position (see [`relays`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CursorKey {
    total: u32,
    /// Sorted, never empty.
    shards: Vec<u32>,
    relay: RelayId,
    /// A relay group's set: leases are taken and given back by the group's
    /// balancing, never by a claim.
    dynamic: bool,
}

impl CursorKey {
    fn single(shard: ShardSpec, relay: RelayId) -> Self {
        Self {
            total: shard.total(),
            shards: vec![shard.index()],
            relay,
            dynamic: false,
        }
    }

    /// The shard (of a set: its first virtual shard).
    fn shard(&self) -> ShardSpec {
        ShardSpec::new(self.shards.first().copied().unwrap_or(0), self.total)
            .unwrap_or(ShardSpec::ALL)
    }

    fn indexes(&self) -> Vec<i32> {
        self.shards
            .iter()
            .map(|i| i32::try_from(*i).unwrap_or(i32::MAX))
            .collect()
    }
}

/// What this process knows of a cursor it reads.
struct CursorState {
    /// The epoch of our lease, when we hold it.
    epoch: Option<i64>,
    lease_until: DateTime<Utc>,
    lease_len: Duration,
    renewed_at: Instant,
    /// The settled position as stored.
    done: Position,
    /// Where the next claim continues (after the outstanding batches).
    read: Position,
    /// Claimed, not yet fully settled batches, in claim order.
    batches: VecDeque<Batch>,
    last_persist: Instant,
    /// Rows ahead of `done` settled under an earlier holding (the cursor's
    /// skip list when we took it), pruned as `done` passes them.
    inherited: Vec<(u64, i64)>,
    /// The skip list as stored.
    persisted_skip: Vec<(u64, i64)>,
    /// The snapshot the last claim read up to, with its seq floor (shared
    /// with the next cursors of a relay group's round).
    /// With the database incarnation it was taken in: a snapshot of an
    /// earlier incarnation is never shared (its xids may be handed out
    /// again; found by the model, `outbox-model`).
    last_cur: Option<(Snap, String)>,
    /// How far a claim behind keys in flight can expect to read before the
    /// first row of a held key (see [`KeySpread`]).
    spread: KeySpread,
    /// When the per-shard lag gauges of this set were last set (see
    /// [`CursorState::lag_due`]).
    lag_at: Option<Instant>,
    /// The database incarnation (see [`PgLogStore::incarnation`]) this
    /// state was read in: positions, windows and the lease held in memory
    /// are used only while the database is still that incarnation. `None`
    /// until a lease is taken.
    boot: Option<String>,
}

/// An estimate of how many distinct keys a stretch of the log spreads
/// over, learnt from claims that stopped at a key still in flight: a claim
/// that read `r` rows before the first of `h` held keys saw about `r * h`
/// keys' worth of rows. It bounds how many rows the next claim behind keys
/// in flight reads: with few keys (a drain of a few dozen aggregates) that
/// claim stops after a row or two, and reading (and shipping, and
/// decoding) a whole batch's worth of rows to throw away all but a few
/// was half of the database's work of a drain. A bound that turns out too
/// small costs one claim more (it says `more`), never an event.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct KeySpread {
    est: Option<f64>,
}

impl KeySpread {
    /// Rows a claim reads at least (the bound's floor).
    const FLOOR: u32 = 16;

    /// Rows to read for a claim of `limit` with `held` keys in flight.
    fn scan_limit(self, limit: u32, held: usize) -> u32 {
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
    fn stopped_after(&mut self, rows: usize, held: usize) {
        let sample = (rows as f64 + 1.0) * held as f64;
        self.est = Some(self.est.map_or(sample, |e| (e + sample) / 2.0));
    }

    /// A claim read `rows` log rows (all it asked for) with `held` keys in
    /// flight and none of them came: the keys spread wider than thought.
    fn read_past(&mut self, rows: usize, held: usize) {
        let sample = 2.0 * rows as f64 * held as f64;
        self.est = Some(self.est.map_or(sample, |e| e.max(sample)));
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Src {
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
enum Kind {
    /// Given to the relay.
    Deliver,
    /// Parked behind an earlier event of its key (copied into the lane at claim).
    Parked,
    /// Dead-lettered at claim.
    Undecodable,
}

#[derive(Debug, Clone)]
struct Item {
    id: EventId,
    key: Option<String>,
    src: Src,
    kind: Kind,
    /// For log rows: the window it was read in (1: the batch's first, 2:
    /// the next); with `src`, the position just after it.
    window: u8,
    resolved: bool,
}

struct Batch {
    token: FencingToken,
    epoch: i64,
    /// The database incarnation it was claimed in (checked by its settle
    /// and renewals).
    boot: String,
    start: Position,
    end: Position,
    /// The snapshot that closes the batch's second window (`start.hi`
    /// closes the first).
    next_hi: Snap,
    items: Vec<Item>,
    complete: bool,
    /// When the relay's lease on it ends (the lease it was claimed or last
    /// renewed under): a batch still holding events then was given up
    /// (e.g. its settle failed until the lease ran out) and is read again.
    expires: Instant,
}

impl Batch {
    /// The position just after log item `item`.
    fn after(&self, item: &Item) -> Option<Position> {
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

    fn held(&self) -> impl Iterator<Item = &Item> {
        self.items
            .iter()
            .filter(|i| i.kind == Kind::Deliver && !i.resolved)
    }

    /// Still holds events after its lease ended: the relay gave it up.
    fn abandoned(&self, now: Instant) -> bool {
        self.expires <= now && self.held().next().is_some()
    }
}

impl CursorState {
    /// Whether a batch was given up: neither settled nor renewed within its
    /// lease. The relay stops retrying a settle when the lease ends and
    /// counts on the events coming back; the cursor lease itself stays ours
    /// (every claim renews it), so without this check the batch would hold
    /// its keys, and every later claim would stop at them, for ever.
    fn has_abandoned_batch(&self) -> bool {
        let now = Instant::now();
        self.batches.iter().any(|b| b.abandoned(now))
    }

    /// Whether the set's per-shard lag gauges are due again (then they
    /// count as set now). At most once per [`relays::LAG_EVERY`]: working
    /// them out hashes every event's key and sets a gauge per shard, which
    /// cost a single relay holding all 64 virtual shards about 6% of its
    /// CPU per event when it was done for every claim.
    fn lag_due(&mut self) -> bool {
        let due = self.lag_at.is_none_or(|t| t.elapsed() >= relays::LAG_EVERY);
        if due {
            self.lag_at = Some(Instant::now());
        }
        due
    }
}

/// One event held by a claim of this process (see [`PgLogStore::in_flight`]).
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

/// A cursor of the store's consumer group (see [`PgLogStore::cursors`]).
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

/// One shard's progress (see [`PgLogStore::status`]).
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

/// The consumer group's progress (see [`PgLogStore::status`]).
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
}

/// The state of the log's partitions (see [`PgLogStore::log_info`]).
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

/// What one [`PgLogStore::rotate`] call did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rotation {
    /// The oldest partition was truncated and is now current.
    Rotated {
        /// The new generation (its partition is `generation % 3`).
        generation: i64,
        /// Rotations so far.
        rotations: i64,
    },
    /// The current partition is younger than the rotation interval.
    NotDue,
    /// Not possible now; the reason says why (a cursor behind, a group with
    /// shards missing, no cursor at all, or the partition in use).
    Blocked(String),
}

/// When a batch claimed or renewed now under `lease` counts as given up:
/// after the relay's own deadline (the claim's or renewal's send time plus
/// the lease, see `outbox-worker`'s lease tracking), with a quarter of the
/// lease to spare.
fn abandon_after(lease: Duration) -> Instant {
    Instant::now() + lease + lease / 4
}

fn empty_claim(lease_until: DateTime<Utc>) -> Claim {
    Claim {
        token: FencingToken::new(),
        lease_until,
        events: Vec::new(),
        more: false,
    }
}

fn micros(d: Duration) -> Result<i64, StoreError> {
    i64::try_from(d.as_micros()).map_err(|_| StoreError::DurationTooLarge(d))
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn decode_err(what: String) -> StoreError {
    StoreError::Database(sqlx::Error::Decode(what.into()))
}

fn snap(text: &str) -> Result<Snap, StoreError> {
    Snap::parse(text).map_err(decode_err)
}

fn xid(text: &str) -> Result<u64, StoreError> {
    text.parse()
        .map_err(|_| decode_err(format!("malformed xid8 {text:?}")))
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

/// A cursor row's skip list (transactions passed out of order): the
/// `xid8[]` column `txids` zipped with the `bigint[]` column `seqs`.
fn row_skip_list(row: &PgRow, txids: usize, seqs: usize) -> Result<Vec<(u64, i64)>, StoreError> {
    let txids: Vec<String> = row.try_get(txids)?;
    let seqs: Vec<i64> = row.try_get(seqs)?;
    txids
        .iter()
        .zip(seqs)
        .map(|(t, s)| Ok((xid(t)?, s)))
        .collect()
}

/// A shard's [`ShardSpec`] from its `(shard_index, shard_total)` columns
/// (a row that does not make one reads as [`ShardSpec::ALL`]).
fn shard_spec(index: i32, total: i32) -> ShardSpec {
    ShardSpec::new(
        u32::try_from(index).unwrap_or(0),
        u32::try_from(total).unwrap_or(1),
    )
    .unwrap_or(ShardSpec::ALL)
}

/// A stored position: `(lo, hi)` with their seq floors, and the last
/// settled `(txid, seq)` of the window.
fn position(
    (lo, lo_floor): (&str, i64),
    (hi, hi_floor): (&str, i64),
    pos_txid: Option<String>,
    pos_seq: Option<i64>,
) -> Result<Position, StoreError> {
    let after = match (pos_txid, pos_seq) {
        (Some(t), Some(s)) => Some((xid(&t)?, s)),
        _ => None,
    };
    Ok(Position {
        lo: snap(lo)?.with_floor(lo_floor),
        hi: snap(hi)?.with_floor(hi_floor),
        after,
    })
}

/// The start of a new cursor of shard `index`/`total` from the existing
/// cursors `(total, index, lo)` of its group: for each shard layout whose
/// cursors together own every key of the new shard (keys with
/// `hash % total == index` fall, under a layout of `t` shards, into the
/// shards `j` with `j ≡ index (mod gcd(total, t))`), what all of those have
/// passed; the intersection over such layouts. `None` when no layout covers it.
fn covering_start(total: u32, index: u32, existing: &[(u32, u32, Snap)]) -> Option<Snap> {
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

/// Lane rows copied from the log, in order: (txid, seq, attempts, delay µs, error).
type LaneRows = Vec<(u64, i64, i32, i64, Option<LastError>)>;

impl PgLogStore {
    /// Connects a pool to `options`' URL (its sessions with `jit = off` and
    /// `plan_cache_mode = force_generic_plan`: the claim statement is planned
    /// once per connection, not at every claim), applies the migrations
    /// when asked, and starts the background rotation.
    pub async fn connect(options: PgLogOptions) -> Result<Self, StoreError> {
        // As the queue store: a refused first connection is retried until
        // the connect timeout, then its root cause is reported. Generic
        // plans: the claim statement is planned once per connection, not
        // at every claim (see `GENERIC_PLANS`).
        let pool =
            crate::store::connect_pool(options.url.as_deref(), &options.pool, &[GENERIC_PLANS])
                .await?;
        Self::from_pool(pool, options).await
    }

    /// A store on an existing pool (the options' URL and pool size are
    /// ignored). Must be called inside a Tokio runtime. The pool's session
    /// settings are left as they are; a pool opened with
    /// `plan_cache_mode=force_generic_plan` saves the claim's planning
    /// (about 1.3 ms of a 1,000-event claim), as [`PgLogStore::connect`]'s
    /// own pool does.
    pub async fn from_pool(pool: PgPool, options: PgLogOptions) -> Result<Self, StoreError> {
        super::GroupName::new(options.group.as_str())?;
        let names = LogNames::new(options.schema.clone(), options.table.clone())?;
        let outbox = crate::PgOutbox::new(options.schema.clone(), options.table.clone())?
            .with_limits(options.pool.limits);
        let log = PgLog::from_names(names);
        if options.pool.auto_migrate {
            let mut conn = pool.acquire().await?;
            outbox.migrate(&mut conn).await?;
        }
        let sql = Arc::new(Sql::new(&log.names));
        let mut tasks = BackgroundTasks::default();
        if options.rotate_in_background {
            let every = (options.rotation_interval / 4)
                .clamp(Duration::from_millis(50), Duration::from_secs(10));
            tasks.spawn(rotate_forever(
                pool.clone(),
                Arc::clone(&sql),
                options.group.clone(),
                options.rotation_interval,
                every,
            ));
        }
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                log,
                outbox,
                sql,
                group: options.group.clone(),
                dead_head: options.dead_head,
                new_group_start: options.new_group_start,
                rotation_interval: options.rotation_interval,
                idle_progress_every: options.idle_progress_every,
                probe_min: options.probe_min,
                probe_max: options.probe_max,
                durable_progress: options.durable_progress,
                url: options.url.clone(),
                cursors: Mutex::new(HashMap::new()),
                tokens: Mutex::new(HashMap::new()),
                seen: Mutex::new(String::new()),
                probe_delay_us: AtomicU64::new(
                    u64::try_from(options.probe_min.as_micros()).unwrap_or(u64::MAX),
                ),
                recheck_at: Mutex::new(None),
                dynamic: options.dynamic_shards,
                rebalance_every: options.rebalance_every,
                members: Mutex::new(HashMap::new()),
                holdings: Mutex::new(HashMap::new()),
                virtual_shards: tokio::sync::OnceCell::new(),
                observed: Mutex::new(None),
                _tasks: tasks,
            }),
        })
    }

    /// The log's names.
    pub(crate) fn log(&self) -> &PgLog {
        &self.inner.log
    }

    /// The same outbox as a [`PgOutbox`](crate::PgOutbox) (event-log mode),
    /// the handle a producer uses with either store.
    pub fn outbox(&self) -> &crate::PgOutbox {
        &self.inner.outbox
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.inner.group
    }

    fn cell(&self, key: &CursorKey) -> Option<Arc<tokio::sync::Mutex<CursorState>>> {
        let map = self.inner.cursors.lock().unwrap_or_else(|p| p.into_inner());
        map.get(key).cloned()
    }

    fn cell_or_new(&self, key: &CursorKey) -> Arc<tokio::sync::Mutex<CursorState>> {
        let mut map = self.inner.cursors.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(map.entry(key.clone()).or_insert_with(|| {
            let zero = Position::at(Snap {
                xmin: 0,
                xmax: 0,
                xip: Vec::new(),
                floor: 0,
            });
            Arc::new(tokio::sync::Mutex::new(CursorState {
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
            }))
        }))
    }

    fn token_key(&self, token: FencingToken) -> Option<CursorKey> {
        let map = self.inner.tokens.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&token).cloned()
    }

    fn forget_tokens<'a>(&self, tokens: impl IntoIterator<Item = &'a FencingToken>) {
        let mut map = self.inner.tokens.lock().unwrap_or_else(|p| p.into_inner());
        for t in tokens {
            map.remove(t);
        }
    }

    /// We no longer hold the cursor: every outstanding batch is void (its
    /// events will be read again by the new holder).
    fn lose(&self, st: &mut CursorState) {
        let tokens: Vec<FencingToken> = st.batches.iter().map(|b| b.token).collect();
        self.forget_tokens(&tokens);
        st.batches.clear();
        st.epoch = None;
    }

    fn cursor_binds(&self, key: &CursorKey) -> (String, i32, Vec<i32>) {
        (
            self.inner.group.clone(),
            i32::try_from(key.total).unwrap_or(i32::MAX),
            key.indexes(),
        )
    }

    /// Where a new cursor of shard `index`/`total` starts: what the
    /// group's cursors covering all of its keys have passed (e.g. the
    /// cursors of another shard layout), or else the log's origin; for a
    /// group without cursors that starts [`GroupStart::Now`], now.
    async fn start_position(&self, total: u32, index: u32) -> Result<Snap, StoreError> {
        let existing = self.group_starts().await?;
        if let Some(common) = covering_start(total, index, &existing) {
            return Ok(common);
        }
        if existing.is_empty() && self.inner.new_group_start == GroupStart::Now {
            return self.create_group_at_now(total).await;
        }
        let origin: String = sqlx::query_scalar(&self.inner.sql.origin)
            .fetch_one(&self.inner.pool)
            .await?;
        snap(&origin)
    }

    /// `(shard total, shard index, lo)` of every cursor of the group.
    async fn group_starts(&self) -> Result<Vec<(u32, u32, Snap)>, StoreError> {
        let rows: Vec<(i32, i32, String)> = sqlx::query_as(&self.inner.sql.group_starts)
            .bind(&self.inner.group)
            .fetch_all(&self.inner.pool)
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
        &self,
        key: &CursorKey,
        st: &mut CursorState,
        lease: Duration,
    ) -> Result<(DateTime<Utc>, bool), StoreError> {
        let (grp, total, indexes) = self.cursor_binds(key);
        let index = indexes.first().copied().unwrap_or(0);
        for _ in 0..2 {
            let row = sqlx::query(&self.inner.sql.acquire)
                .bind(&grp)
                .bind(total)
                .bind(index)
                .bind(key.relay.as_str())
                .bind(st.epoch.unwrap_or(-1))
                .bind(micros(lease)?)
                .fetch_one(&self.inner.pool)
                .await?;
            let now: DateTime<Utc> = row.try_get(6)?;
            let present: bool = row.try_get(7)?;
            let epoch: Option<i64> = row.try_get(0)?;
            match epoch {
                Some(epoch) => {
                    let lease_until: DateTime<Utc> = row.try_get(1)?;
                    if st.epoch != Some(epoch) {
                        // A new holding: start from the settled position.
                        self.lose(st);
                        let lo: String = row.try_get(2)?;
                        let hi: String = row.try_get(3)?;
                        let done = position(
                            (&lo, row.try_get(10)?),
                            (&hi, row.try_get(11)?),
                            row.try_get(4)?,
                            row.try_get(5)?,
                        )?;
                        st.boot = Some(self.incarnation(row.try_get(12)?).await?);
                        st.read = done.clone();
                        st.done = done;
                        st.epoch = Some(epoch);
                        let skip = row_skip_list(&row, 8, 9)?;
                        st.inherited.clone_from(&skip);
                        st.persisted_skip = skip;
                        st.last_persist = Instant::now();
                        tracing::debug!(group = %grp, shard = %key.shard(), relay = %key.relay, epoch, "took the cursor lease");
                    }
                    st.lease_until = lease_until;
                    st.lease_len = lease;
                    st.renewed_at = Instant::now();
                    return Ok((now, true));
                }
                None if present => {
                    if st.epoch.is_some() {
                        tracing::warn!(group = %grp, shard = %key.shard(), relay = %key.relay, "cursor lease lost to another relay");
                    }
                    self.lose(st);
                    return Ok((now, false));
                }
                None => {
                    let start = self.start_position(key.total, key.shard().index()).await?;
                    sqlx::query(&self.inner.sql.create_cursor)
                        .bind(&grp)
                        .bind(total)
                        .bind(index)
                        .bind(start.to_string())
                        .execute(&self.inner.pool)
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
    async fn incarnation(&self, read: Option<String>) -> Result<String, StoreError> {
        if let Some(token) = read {
            return Ok(token);
        }
        // Two stores racing to write the first token: the loser's INSERT
        // waits for the winner's and does nothing, and its statement's
        // snapshot predates the winner's row: the next statement sees it.
        for _ in 0..3 {
            let token: Option<String> = sqlx::query_scalar(&self.inner.sql.boot)
                .bind(Uuid::new_v4())
                .fetch_optional(&self.inner.pool)
                .await?;
            if let Some(token) = token {
                tracing::info!(group = %self.inner.group, incarnation = %token, "database incarnation recorded");
                return Ok(token);
            }
        }
        Err(decode_err(
            "the database incarnation token could not be read".to_owned(),
        ))
    }

    /// A seq floor for a snapshot a claim is about to take, under
    /// incarnation `boot`: the latest observation of a completed claim of
    /// this store, or `fallback` (the floor of an earlier snapshot, always
    /// valid for a later one), whichever is higher.
    fn floor_for_new_snapshot(&self, boot: Option<&str>, fallback: i64) -> i64 {
        let observed = self
            .inner
            .observed
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match (observed.as_ref(), boot) {
            (Some((b, s)), Some(boot)) if b == boot => (*s).max(fallback),
            _ => fallback,
        }
    }

    /// Records a completed claim's seq observation under incarnation `boot`.
    fn observe(&self, boot: &str, seq: i64) {
        let mut observed = self
            .inner
            .observed
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match observed.as_mut() {
            Some((b, s)) if b == boot => *s = (*s).max(seq),
            _ => *observed = Some((boot.to_owned(), seq)),
        }
    }

    async fn claim_inner(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        if self.inner.dynamic && req.shard == ShardSpec::ALL {
            return self.claim_dynamic(req).await;
        }
        let key = CursorKey::single(req.shard, req.relay_id.clone());
        let cell = self.cell_or_new(&key);
        let mut st = cell.lock().await;
        let claim = self.claim_key(&key, &mut st, req, None).await?;
        let held = if st.epoch.is_some() {
            key.shards.clone()
        } else {
            Vec::new()
        };
        self.note_holding(&req.relay_id, false, held, key.total, 1);
        Ok(claim.unwrap_or_else(|| empty_claim(Utc::now())))
    }

    /// Takes or keeps the lease of `key`'s cursor(s): a static shard's by
    /// [`acquire`](Self::acquire), a relay group's set by renewing it.
    async fn hold(
        &self,
        key: &CursorKey,
        st: &mut CursorState,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        if key.dynamic {
            self.renew_set(key, st, lease).await
        } else {
            Ok(self.acquire(key, st, lease).await?.1)
        }
    }

    /// Claims from one cursor (or set). `None` when its lease is not ours;
    /// `upto`: the snapshot that ends a new window (see the CLAIM SQL).
    async fn claim_key(
        &self,
        key: &CursorKey,
        st: &mut CursorState,
        req: &ClaimRequest,
        upto: Option<&(Snap, String)>,
    ) -> Result<Option<Claim>, StoreError> {
        if st.has_abandoned_batch() {
            tracing::warn!(
                group = %self.inner.group,
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
            self.lose(st);
        }
        let renew_due = st.epoch.is_none()
            || st.lease_len != req.lease
            || st.renewed_at.elapsed() >= req.lease / 2;
        if renew_due && !self.hold(key, st, req.lease).await? {
            return Ok(None);
        }
        let limit = req.batch_size.max(1);
        for _ in 0..8 {
            match self.claim_once(key, st, limit, upto).await? {
                Step::Events(claim) => return Ok(Some(claim)),
                Step::Again => continue,
                Step::Nothing => break,
                Step::Blocked => {
                    return Ok(Some(Claim {
                        more: true,
                        ..empty_claim(st.lease_until)
                    }))
                }
                Step::Relapse => {
                    if !self.hold(key, st, req.lease).await? {
                        return Ok(None);
                    }
                }
            }
        }
        Ok(Some(empty_claim(st.lease_until)))
    }

    async fn claim_once(
        &self,
        key: &CursorKey,
        st: &mut CursorState,
        limit: u32,
        upto: Option<&(Snap, String)>,
    ) -> Result<Step, StoreError> {
        let Some(epoch) = st.epoch else {
            return Ok(Step::Nothing);
        };
        let grp = &self.inner.group;
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
                st.boot.as_deref() == Some(boot.as_str())
                    && (u.xmax > read.hi.xmax || *u == read.hi)
            })
            .map(|(u, _)| u);
        // The seq floor of the snapshot this claim takes (a shared one
        // comes with its own).
        let cur_floor = match upto {
            Some(u) => u.floor,
            None => self.floor_for_new_snapshot(st.boot.as_deref(), read.hi.floor),
        };
        let after_seq = read.after.map_or(0, |a| a.1);
        // Where the range part of (lo, hi) resumes (in seq order).
        let start_seq = after_seq.max(read.lo.floor);
        let sql = self
            .inner
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
            .bind(super::sql::shard_mask(key.total, &key.shards))
            .fetch_all(&self.inner.pool)
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
        let boot = self.incarnation(first.try_get(18)?).await?;
        if st.boot.as_deref() != Some(boot.as_str()) {
            tracing::warn!(
                group = %grp,
                shard = %key.shard(),
                relay = %key.relay,
                "the database is a new incarnation (crash recovery or failover): \
                 positions held in memory are dropped; resuming from the stored position"
            );
            metrics::counter!(super::INCARNATION_CHANGES).increment(1);
            self.lose(st);
            st.boot = None;
            return Ok(Step::Relapse);
        }
        self.observe(&boot, first.try_get(19)?);
        let cur = snap(&cur_text)?.with_floor(cur_floor);
        self.saw(&cur_text);
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
                        if self.inner.dead_head == DeadHeadPolicy::Block {
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
                        if self.inner.dead_head == DeadHeadPolicy::Block {
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
                && (consumed || st.last_persist.elapsed() >= self.inner.idle_progress_every);
            if consumed || advance {
                let kept: Vec<(u64, i64)> = st
                    .inherited
                    .iter()
                    .filter(|(t, q)| !advance || !end.passed(*t, *q))
                    .copied()
                    .collect();
                let skip = (kept != st.persisted_skip).then_some(kept.as_slice());
                let fenced = !self
                    .write_claim(key, epoch, &boot, advance.then_some(&end), skip, &writes)
                    .await?;
                if fenced {
                    self.lose(st);
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
        if consumed
            && !self
                .write_claim(key, epoch, &boot, None, None, &writes)
                .await?
        {
            self.lose(st);
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
            expires: abandon_after(st.lease_len),
        });
        st.read = end;
        self.inner
            .tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, key.clone());
        self.inner.probe_delay_us.store(
            u64::try_from(self.inner.probe_min.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        if key.dynamic && st.lag_due() {
            relays::record_shard_lag(
                &self.inner.group,
                key,
                &events,
                st.lease_until - st.lease_len,
            );
        }
        Ok(Step::Events(Claim {
            token,
            lease_until: st.lease_until,
            events,
            more,
        }))
    }

    /// Writes what a claim consumed without giving it to the relay (parked
    /// rows, undecodable rows) and, with `advance`, moves the settled
    /// position, in one transaction fenced by the epoch. Returns false when
    /// the epoch is no longer ours (nothing was written).
    async fn write_claim(
        &self,
        key: &CursorKey,
        epoch: i64,
        boot: &str,
        advance: Option<&Position>,
        skip: Option<&[(u64, i64)]>,
        writes: &ClaimWrites,
    ) -> Result<bool, StoreError> {
        let mut conn = self.inner.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        if !self
            .advance(&mut tx, key, (epoch, boot), advance, skip)
            .await?
        {
            return Ok(false);
        }
        if !writes.park.is_empty() {
            let rows: LaneRows = writes
                .park
                .iter()
                .map(|(t, s)| (*t, *s, 0, 0, None))
                .collect();
            self.log_to_lane(&mut tx, &rows).await?;
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
            self.log_to_dead(&mut tx, &rows).await?;
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
            self.lane_settle(&mut tx, &ops).await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    /// The fence (and optional position move) of every write: our `epoch`
    /// under incarnation `boot`.
    async fn advance(
        &self,
        conn: &mut sqlx::PgConnection,
        key: &CursorKey,
        (epoch, boot): (i64, &str),
        to: Option<&Position>,
        skip: Option<&[(u64, i64)]>,
    ) -> Result<bool, StoreError> {
        let (grp, total, indexes) = self.cursor_binds(key);
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
        let row = sqlx::query(&self.inner.sql.advance)
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
            .bind((!self.inner.durable_progress).then_some("off"))
            .bind(to.map_or(0, |p| p.lo.floor))
            .bind(to.map_or(0, |p| p.hi.floor))
            .bind(boot)
            .fetch_all(&mut *conn)
            .await?;
        Ok(row.len() == key.shards.len())
    }

    async fn log_to_lane(
        &self,
        conn: &mut sqlx::PgConnection,
        rows: &LaneRows,
    ) -> Result<(), StoreError> {
        let mut txids = Vec::with_capacity(rows.len());
        let mut seqs = Vec::with_capacity(rows.len());
        let mut attempts = Vec::with_capacity(rows.len());
        let mut delays = Vec::with_capacity(rows.len());
        let mut codes: Vec<Option<String>> = Vec::with_capacity(rows.len());
        let mut messages: Vec<Option<String>> = Vec::with_capacity(rows.len());
        for (t, s, a, d, e) in rows {
            txids.push(t.to_string());
            seqs.push(*s);
            attempts.push(*a);
            delays.push(*d);
            codes.push(e.as_ref().map(|e| e.code.as_str().to_owned()));
            messages.push(e.as_ref().map(|e| e.message.clone()));
        }
        sqlx::query(&self.inner.sql.log_to_lane)
            .bind(&self.inner.group)
            .bind(txids)
            .bind(seqs)
            .bind(attempts)
            .bind(delays)
            .bind(codes)
            .bind(messages)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// Returns the ids whose older dead letter was replaced.
    async fn log_to_dead(
        &self,
        conn: &mut sqlx::PgConnection,
        rows: &[(u64, i64, i32, LastError)],
    ) -> Result<Vec<EventId>, StoreError> {
        let mut txids = Vec::with_capacity(rows.len());
        let mut seqs = Vec::with_capacity(rows.len());
        let mut attempts = Vec::with_capacity(rows.len());
        let mut codes = Vec::with_capacity(rows.len());
        let mut messages = Vec::with_capacity(rows.len());
        for (t, s, a, e) in rows {
            txids.push(t.to_string());
            seqs.push(*s);
            attempts.push(*a);
            codes.push(e.code.as_str().to_owned());
            messages.push(e.message.clone());
        }
        let out = sqlx::query(&self.inner.sql.log_to_dead)
            .bind(&self.inner.group)
            .bind(txids)
            .bind(seqs)
            .bind(attempts)
            .bind(codes)
            .bind(messages)
            .bind(self.inner.dead_head == DeadHeadPolicy::Block)
            .fetch_all(&mut *conn)
            .await?;
        replaced(out)
    }

    async fn lane_settle(
        &self,
        conn: &mut sqlx::PgConnection,
        ops: &[LaneOp],
    ) -> Result<Vec<EventId>, StoreError> {
        let out = sqlx::query(&self.inner.sql.lane_settle)
            .bind(&self.inner.group)
            .bind(ops.iter().map(|o| o.ord).collect::<Vec<_>>())
            .bind(ops.iter().map(|o| o.kind).collect::<Vec<_>>())
            .bind(ops.iter().map(|o| o.attempts).collect::<Vec<_>>())
            .bind(ops.iter().map(|o| o.delay_us).collect::<Vec<_>>())
            .bind(
                ops.iter()
                    .map(|o| o.error.as_ref().map(|e| e.code.as_str().to_owned()))
                    .collect::<Vec<_>>(),
            )
            .bind(
                ops.iter()
                    .map(|o| o.error.as_ref().map(|e| e.message.clone()))
                    .collect::<Vec<_>>(),
            )
            .bind(self.inner.dead_head == DeadHeadPolicy::Block)
            .fetch_all(&mut *conn)
            .await?;
        replaced(out)
    }

    fn saw(&self, snapshot: &str) {
        let mut seen = self.inner.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.as_str() != snapshot {
            snapshot.clone_into(&mut seen);
        }
    }

    async fn settle_inner(
        &self,
        token: FencingToken,
        settlement: &Settlement,
    ) -> Result<SettleReport, StoreError> {
        let all_fenced = || SettleReport {
            applied: 0,
            fenced: settlement.items().iter().map(|(id, _)| *id).collect(),
            rejected: Vec::new(),
        };
        let Some(key) = self.token_key(token) else {
            return Ok(all_fenced());
        };
        let Some(cell) = self.cell(&key) else {
            return Ok(all_fenced());
        };
        let mut st = cell.lock().await;
        let Some(bi) = st.batches.iter().position(|b| b.token == token) else {
            return Ok(all_fenced());
        };
        let epoch = st.batches[bi].epoch;
        let boot = st.batches[bi].boot.clone();
        if st.epoch != Some(epoch) || st.boot.as_deref() != Some(boot.as_str()) {
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

        let mut conn = self.inner.pool.acquire().await?;
        let simple = plan.to_lane.is_empty() && plan.to_dead.is_empty() && plan.lane_ops.is_empty();
        let mut replaced_ids = Vec::new();
        if simple {
            if !self
                .advance(
                    &mut conn,
                    &key,
                    (epoch, &boot),
                    advance_to.as_ref(),
                    skip_arg,
                )
                .await?
            {
                self.lose(&mut st);
                return Ok(all_fenced());
            }
        } else {
            let mut tx = conn.begin().await?;
            if !self
                .advance(&mut tx, &key, (epoch, &boot), advance_to.as_ref(), skip_arg)
                .await?
            {
                drop(tx);
                self.lose(&mut st);
                return Ok(all_fenced());
            }
            // Dead letters first: a key's failed event precedes the events
            // released behind it, and `ord` (its place in the key's order,
            // kept for a replay) is taken in statement order.
            if !plan.to_dead.is_empty() {
                replaced_ids.extend(self.log_to_dead(&mut tx, &plan.to_dead).await?);
            }
            if !plan.to_lane.is_empty() {
                self.log_to_lane(&mut tx, &plan.to_lane).await?;
            }
            if !plan.lane_ops.is_empty() {
                replaced_ids.extend(self.lane_settle(&mut tx, &plan.lane_ops).await?);
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
            self.forget_tokens(&popped);
        }
        let rejected = replaced_ids
            .into_iter()
            .map(|id| Rejected {
                id,
                reason:
                    "a dead letter with this id already existed; it was replaced by this failure"
                        .to_owned(),
            })
            .collect();
        Ok(SettleReport {
            applied: plan.applied,
            fenced: plan.fenced,
            rejected,
        })
    }

    async fn renew_inner(&self, token: FencingToken, lease: Duration) -> Result<u64, StoreError> {
        let Some(key) = self.token_key(token) else {
            return Ok(0);
        };
        let Some(cell) = self.cell(&key) else {
            return Ok(0);
        };
        let mut st = cell.lock().await;
        let Some(batch) = st.batches.iter().find(|b| b.token == token) else {
            return Ok(0);
        };
        let held = batch.held().count() as u64;
        let epoch = batch.epoch;
        let boot = Uuid::parse_str(&batch.boot).unwrap_or_default();
        if held == 0 || st.epoch != Some(epoch) || st.boot.as_deref() != Some(batch.boot.as_str()) {
            return Ok(0);
        }
        let (grp, total, indexes) = self.cursor_binds(&key);
        let renewed: Vec<DateTime<Utc>> = sqlx::query_scalar(&self.inner.sql.renew)
            .bind(&grp)
            .bind(total)
            .bind(indexes)
            .bind(epoch)
            .bind(micros(lease)?)
            .bind(boot)
            .fetch_all(&self.inner.pool)
            .await?;
        let until = (renewed.len() == key.shards.len())
            .then(|| renewed.into_iter().min())
            .flatten();
        match until {
            Some(until) => {
                st.lease_until = until;
                st.lease_len = lease;
                st.renewed_at = Instant::now();
                let expires = abandon_after(lease);
                if let Some(b) = st.batches.iter_mut().find(|b| b.token == token) {
                    b.expires = expires;
                }
                Ok(held)
            }
            None => {
                self.lose(&mut st);
                Ok(0)
            }
        }
    }

    /// The events held by claims of this process that are not settled yet.
    pub async fn in_flight(&self) -> Vec<InFlight> {
        let cells: Vec<(CursorKey, Arc<tokio::sync::Mutex<CursorState>>)> = {
            let map = self.inner.cursors.lock().unwrap_or_else(|p| p.into_inner());
            map.iter()
                .map(|(k, v)| (k.clone(), Arc::clone(v)))
                .collect()
        };
        let mut out = Vec::new();
        for (key, cell) in cells {
            let st = cell.lock().await;
            if st.epoch.is_none() {
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

    /// Runs `sql` (`$1` the group, then the dead-letter filter) over this
    /// group's dead letters selected by `filter`; the rows it changed.
    async fn dead_statement(
        &self,
        sql: &str,
        filter: &DeadLetterFilter,
    ) -> Result<u64, StoreError> {
        let done = bind_dead_filter(sqlx::query(sql).bind(&self.inner.group), filter)
            .execute(&self.inner.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// The cursors of this store's consumer group.
    pub async fn cursors(&self) -> Result<Vec<CursorInfo>, StoreError> {
        let rows = sqlx::query(&self.inner.sql.cursors)
            .bind(&self.inner.group)
            .fetch_all(&self.inner.pool)
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

    async fn stats_inner(&self) -> Result<Stats, StoreError> {
        let row = sqlx::query(&self.inner.sql.stats)
            .bind(&self.inner.group)
            .fetch_one(&self.inner.pool)
            .await?;
        let total: i64 = row.try_get(0)?;
        let oldest: Option<i64> = row.try_get(1)?;
        let dead: i64 = row.try_get(2)?;
        // What the database cannot see: batches of this process that are
        // settled in part (their resolved rows are already in the lane or
        // the dead letters, or gone) and events held under a current lease.
        let cursors = self.cursors_raw().await?;
        let cells: Vec<(CursorKey, Arc<tokio::sync::Mutex<CursorState>>)> = {
            let map = self.inner.cursors.lock().unwrap_or_else(|p| p.into_inner());
            map.iter()
                .map(|(k, v)| (k.clone(), Arc::clone(v)))
                .collect()
        };
        let mut resolved_log = 0u64;
        let mut in_flight = 0u64;
        for (key, cell) in cells {
            let st = cell.lock().await;
            let Some(epoch) = st.epoch else { continue };
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

    async fn cursors_raw(&self) -> Result<Vec<((u32, u32), i64, bool)>, StoreError> {
        Ok(self
            .cursors()
            .await?
            .into_iter()
            .map(|c| ((c.shard.total(), c.shard.index()), c.epoch, c.leased))
            .collect())
    }

    /// Rotates when due: truncates the oldest partition once every cursor
    /// has passed all of its rows and no transaction holds it, and makes it
    /// the current one. Safe to call from any number of processes at once.
    pub async fn rotate(&self) -> Result<Rotation, StoreError> {
        rotate_once(
            &self.inner.pool,
            &self.inner.sql,
            self.inner.rotation_interval,
        )
        .await
    }

    /// Rotates now if possible, whatever the interval (tests, operators).
    pub async fn rotate_now(&self) -> Result<Rotation, StoreError> {
        rotate_once(&self.inner.pool, &self.inner.sql, Duration::ZERO).await
    }

    /// Generation, rotations and the size of each partition.
    pub async fn log_info(&self) -> Result<LogInfo, StoreError> {
        let names = self.inner.log.names.partition_relnames();
        let rows = sqlx::query(&self.inner.sql.partitions_info)
            .bind(self.inner.log.schema().as_str())
            .bind(names)
            .fetch_all(&self.inner.pool)
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
    pub async fn status(&self) -> Result<LogStatus, StoreError> {
        let rows = sqlx::query(&self.inner.sql.status)
            .bind(&self.inner.group)
            .fetch_all(&self.inner.pool)
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
        let dead: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE grp = $1",
            self.inner.log.names.render("{{dead}}")
        ))
        .bind(&self.inner.group)
        .fetch_one(&self.inner.pool)
        .await?;
        let oldest: Option<i64> = sqlx::query_scalar(self.inner.sql.oldest_writer)
            .fetch_one(&self.inner.pool)
            .await?;
        Ok(LogStatus {
            shards,
            dead: count(dead),
            oldest_writer: micros_to(oldest),
            log: self.log_info().await?,
        })
    }

    async fn probe(&self) -> Result<bool, StoreError> {
        let now: String = sqlx::query_scalar(PROBE)
            .fetch_one(&self.inner.pool)
            .await?;
        let mut seen = self.inner.seen.lock().unwrap_or_else(|p| p.into_inner());
        if *seen == now {
            return Ok(false);
        }
        *seen = now;
        Ok(true)
    }
}

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

/// The session setting of the store's own pool ([`PgLogStore::connect`]):
/// prepared statements run with their generic plan. The claim is one
/// statement of many CTEs over three partitions; planning it for each
/// claim's parameters took about 1.3 ms of a 1,000-event claim's 5.5 ms
/// (`cargo xtask bench --quick --scenario backlog`, BENCHMARKS.md), and its
/// generic plan is the same ordered index scans under a `LIMIT` (the
/// statement is written so that no plan depends on a range estimate). A
/// pool handed to [`PgLogStore::from_pool`] keeps its own setting.
const GENERIC_PLANS: (&str, &str) = ("plan_cache_mode", "force_generic_plan");

struct LaneOp {
    ord: i64,
    /// 0 delivered, 1 retry, 2 dead.
    kind: i32,
    /// Attempts after this one.
    attempts: i32,
    delay_us: i64,
    error: Option<LastError>,
}

fn replaced(rows: Vec<PgRow>) -> Result<Vec<EventId>, StoreError> {
    let mut out = Vec::new();
    for r in rows {
        let replaced: Option<bool> = r.try_get(1)?;
        if replaced == Some(true) {
            out.push(EventId::from_uuid(r.try_get::<Uuid, _>(0)?));
        }
    }
    Ok(out)
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

/// One rotation attempt (see [`PgLogStore::rotate`]).
async fn rotate_once(pool: &PgPool, sql: &Sql, interval: Duration) -> Result<Rotation, StoreError> {
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    let due = match sqlx::query(&sql.rotate_due)
        .bind(micros(interval)?)
        .fetch_one(&mut *tx)
        .await
    {
        Ok(row) => row,
        Err(e) if lock_busy(&e) => {
            return Ok(Rotation::Blocked("another rotation is running".into()))
        }
        Err(e) => return Err(e.into()),
    };
    let is_due: bool = due.try_get(0)?;
    let generation: i64 = due.try_get(1)?;
    // The generation is the committed one (the meta row's): a rotation
    // that committed but has not bumped the sequence yet is not undone by
    // truncating its partition again.
    sqlx::query(&sql.rotate_catch_up).execute(&mut *tx).await?;
    if !is_due {
        tx.commit().await?;
        return Ok(Rotation::NotDue);
    }
    let target = usize::try_from((generation + 1).rem_euclid(PARTITIONS as i64)).unwrap_or(0);

    if let Some(reason) = rotate_check(&mut tx, sql, target).await? {
        return Ok(Rotation::Blocked(reason));
    }
    // A transaction that wrote to it and is still open: its rows may not
    // be passed yet (the check above could not see them). Not waited for.
    let writer: bool = sqlx::query_scalar(&sql.rotate_writer[target])
        .fetch_one(&mut *tx)
        .await?;
    if writer {
        return Ok(Rotation::Blocked(format!(
            "partition {target} is in use: a transaction that wrote to it is still open"
        )));
    }
    // Claims and status queries hold ACCESS SHARE on every partition for
    // a few milliseconds each; with several relays claiming back to back
    // there is rarely a moment with none, so a NOWAIT lock starved the
    // rotation. The lock is queued instead: claims that start meanwhile
    // wait behind it for at most ROTATE_LOCK_TIMEOUT (then it gives up).
    sqlx::query(ROTATE_LOCK_TIMEOUT).execute(&mut *tx).await?;
    match sqlx::query(&sql.rotate_lock[target])
        .execute(&mut *tx)
        .await
    {
        Ok(_) => {}
        Err(e) if lock_busy(&e) => {
            return Ok(Rotation::Blocked(format!("partition {target} is in use")))
        }
        Err(e) => return Err(e.into()),
    }
    if let Some(reason) = rotate_check(&mut tx, sql, target).await? {
        return Ok(Rotation::Blocked(reason));
    }
    sqlx::query(&sql.rotate_truncate[target])
        .execute(&mut *tx)
        .await?;
    let (rotations, generation): (i64, i64) =
        sqlx::query_as(&sql.rotate_done).fetch_one(&mut *tx).await?;
    tx.commit().await?;
    // After the commit: producers that see the new generation write into
    // the truncated partition without waiting for this transaction.
    sqlx::query(&sql.rotate_bump)
        .bind(generation)
        .execute(&mut *conn)
        .await?;
    tracing::debug!(
        generation,
        rotations,
        partition = target,
        "rotated the outbox event log"
    );
    metrics::counter!(super::ROTATIONS).increment(1);
    Ok(Rotation::Rotated {
        generation,
        rotations,
    })
}

/// Why partition `target` may not be truncated now, if it may not.
async fn rotate_check(
    conn: &mut sqlx::PgConnection,
    sql: &Sql,
    target: usize,
) -> Result<Option<String>, StoreError> {
    let row = sqlx::query(&sql.rotate_check[target])
        .fetch_one(&mut *conn)
        .await?;
    let cursors: i64 = row.try_get(0)?;
    let incomplete: bool = row.try_get(1)?;
    let behind: bool = row.try_get(2)?;
    Ok(if cursors == 0 {
        Some("no cursor exists yet (no relay has claimed)".to_owned())
    } else if incomplete {
        Some("a consumer group has cursors for only some of its shards".to_owned())
    } else if behind {
        Some(format!(
            "a cursor has not passed every event of partition {target}"
        ))
    } else {
        None
    })
}

/// How long a rotation's lock waits for the claims (and other readers)
/// holding the partition before it gives up: 500 ms.
const ROTATE_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '500ms'";
/// After a rotation postponed because its lock was busy, the next attempt
/// comes this soon (not a whole check interval later).
const ROTATE_RETRY_BUSY: Duration = Duration::from_secs(1);

fn lock_busy(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

async fn rotate_forever(
    pool: PgPool,
    sql: Arc<Sql>,
    group: String,
    interval: Duration,
    every: Duration,
) {
    let mut wait = every;
    loop {
        tokio::time::sleep(wait).await;
        wait = every;
        // The retry lane is small by design: counting it is cheap.
        match sqlx::query_as::<_, (i64, i64)>(&sql.lane_gauges)
            .bind(&group)
            .fetch_one(&pool)
            .await
        {
            Ok((lane, parked)) => {
                metrics::gauge!(super::LANE_EVENTS, "group" => group.clone()).set(lane as f64);
                metrics::gauge!(super::PARKED_KEYS, "group" => group.clone()).set(parked as f64);
            }
            Err(e) => tracing::debug!(error = %e, "counting the retry lane failed"),
        }
        match rotate_once(&pool, &sql, interval).await {
            Ok(Rotation::Blocked(reason)) => {
                tracing::debug!(%reason, "outbox event-log rotation postponed");
                if reason.ends_with("is in use") || reason.starts_with("another rotation") {
                    wait = every.min(ROTATE_RETRY_BUSY);
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "outbox event-log rotation failed"),
        }
    }
}

impl Store for PgLogStore {
    type Error = StoreError;

    fn claim(
        &self,
        req: &ClaimRequest,
    ) -> impl std::future::Future<Output = Result<Claim, StoreError>> + Send {
        self.claim_inner(req)
    }

    fn settle(
        &self,
        token: FencingToken,
        settlement: &Settlement,
    ) -> impl std::future::Future<Output = Result<SettleReport, StoreError>> + Send {
        self.settle_inner(token, settlement)
    }

    fn renew(
        &self,
        token: FencingToken,
        lease: Duration,
    ) -> impl std::future::Future<Output = Result<u64, StoreError>> + Send {
        self.renew_inner(token, lease)
    }

    fn stats(&self) -> impl std::future::Future<Output = Result<Stats, StoreError>> + Send {
        self.stats_inner()
    }

    fn leave(
        &self,
        relay: &RelayId,
    ) -> impl std::future::Future<Output = Result<(), StoreError>> + Send {
        self.leave_inner(relay)
    }

    /// Polls adaptively: a few milliseconds after activity, doubling up to
    /// the probe maximum while idle. Each probe reads only
    /// `pg_current_snapshot()`; it fires when the snapshot changed since the
    /// last claim or probe (some transaction ended), so a commit that
    /// happened while nobody waited is not missed.
    fn wakeup(&self) -> impl std::future::Future<Output = ()> + Send {
        let store = self.clone();
        async move {
            loop {
                let us = store.inner.probe_delay_us.load(Ordering::Relaxed);
                let delay = Duration::from_micros(us);
                if let Some(left) = store.recheck_within(delay) {
                    tokio::time::sleep(left).await;
                    return;
                }
                tokio::time::sleep(delay).await;
                let max = u64::try_from(store.inner.probe_max.as_micros()).unwrap_or(u64::MAX);
                store
                    .inner
                    .probe_delay_us
                    .store(us.saturating_mul(2).min(max), Ordering::Relaxed);
                match store.probe().await {
                    Ok(true) => return,
                    Ok(false) => {}
                    Err(e) => tracing::debug!(error = %e, "wake-up probe failed"),
                }
            }
        }
    }
}

impl DeadLetterStore for PgLogStore {
    type Error = StoreError;

    async fn list_dead(&self, query: &DeadLetterQuery) -> Result<Vec<DeadLetter>, StoreError> {
        let rows = bind_dead_filter(
            sqlx::query(&self.inner.sql.list_dead).bind(&self.inner.group),
            &query.filter,
        )
        .bind(query.after.map(|id| id.as_uuid()))
        .bind(i64::from(query.limit))
        .fetch_all(&self.inner.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let headers: String = r.try_get(5)?;
                let attempts: i32 = r.try_get(7)?;
                let dead_at: DateTime<Utc> = r.try_get(8)?;
                let error = LastError {
                    code: ErrorCode::new(r.try_get::<String, _>(9)?),
                    message: r.try_get(10)?,
                };
                Ok(DeadLetter {
                    event: Event {
                        id: EventId::from_uuid(r.try_get::<Uuid, _>(0)?),
                        key: r.try_get(1)?,
                        event_type: r.try_get(2)?,
                        topic: r.try_get(3)?,
                        payload: r.try_get(4)?,
                        headers: headers_lenient_under(&headers, "x-outbox-undecodable-headers"),
                        created_at: r.try_get(6)?,
                        attempts: u32::try_from(attempts).unwrap_or(0),
                        next_attempt_at: dead_at,
                        last_error: Some(error.clone()),
                    },
                    error,
                    dead_at,
                })
            })
            .collect()
    }

    async fn count_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let n: i64 = bind_dead_filter(
            sqlx::query(&self.inner.sql.count_dead).bind(&self.inner.group),
            filter,
        )
        .fetch_one(&self.inner.pool)
        .await?
        .try_get(0)?;
        Ok(count(n))
    }

    async fn retry_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        self.dead_statement(&self.inner.sql.retry_dead, filter)
            .await
    }

    async fn purge_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        self.dead_statement(&self.inner.sql.purge_dead, filter)
            .await
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
