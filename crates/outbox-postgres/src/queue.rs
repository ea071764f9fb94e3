//! The queue-table mode: [`PgStore`] claims, settles, renews leases,
//! counts, keeps dead letters and wakes relays on one table whose rows are
//! updated when claimed and deleted when delivered (the event log,
//! [`PgLogStore`](crate::log::PgLogStore), is the default mode).

use crate::db::Db;
use crate::dead_filter::bind_dead_filter;
use crate::enqueue::PgOutbox;
use crate::error::{MigrateError, StoreError};
use crate::names::queue::Names;
use crate::options::redact_url;
use crate::pool::{connect_pool, BackgroundTasks};
use crate::rows::headers_strict;
use chrono::{DateTime, Utc};
use outbox_core::{
    Claim, ClaimRequest, DeadLetter, DeadLetterFilter, DeadLetterQuery, DeadLetterStore, ErrorCode,
    Event, EventId, FencingToken, HeadState, HeldKey, HeldKeyStore, HeldKeys, LastError, Rejected,
    Resolution, SettleReport, Settlement, ShardSpec, Stats, Store,
};
use sqlx::postgres::{PgListener, PgRow};
use sqlx::{PgPool, Row};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use uuid::Uuid;

mod control;
mod options;
mod rows;
mod sql;

pub use options::{PgStoreOptions, DEFAULT_VACUUM_EVERY};
use rows::{event_from, headers_lenient};
use sql::{StoreSql, WALK_BEYOND_BATCH};

/// The outbox store on PostgreSQL. Cheap to clone (an `Arc`); background
/// tasks (the LISTEN connection, the retention purge) stop when the last
/// clone is dropped. `Debug` never shows the password.
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

struct Inner {
    db: Db,
    outbox: PgOutbox,
    sql: StoreSql,
    url: Option<String>,
    listen: bool,
    retention: Option<Duration>,
    purge_batch: u32,
    wakeup: Option<Arc<Notify>>,
    /// Held for its `Drop`: stops the LISTEN and purge tasks with the last clone.
    _tasks: BackgroundTasks,
    vacuum: Option<Vacuum>,
    held: Held,
    floor: SeqFloor,
}

/// A lower bound of the pending rows' `seq` that claims walk from, so a
/// claim does not step over the index entries of the rows deleted since the
/// last vacuum (measured: 10,000 of them cost a claim 3.5 ms; from the
/// bound, 0.2 ms).
///
/// Every [`FLOOR_REFRESH`] a claim reads the sequence's last value `v` and
/// the snapshot's `xmax` (a candidate). Once every transaction that was
/// running then has ended (a later snapshot's `xmin` >= that `xmax`), each
/// row with `seq <= v` is committed and visible, or gone, so the bound
/// becomes `min(v + 1, the smallest pending seq)`. A long transaction holds
/// the candidate back (the bound stays where it was); a pending row found
/// below the bound lowers it at the next refresh. A failed claim (the
/// database may have crashed and restarted, handing out sequence values and
/// transaction ids again) resets it to 0.
#[derive(Default)]
struct SeqFloor {
    state: Mutex<FloorState>,
}

#[derive(Default, Clone, Copy)]
struct FloorState {
    /// Claims walk from here (0: from the start).
    bound: i64,
    /// `(v, xmax)` read at the last refresh that could not settle one.
    candidate: Option<(i64, i64)>,
    /// When the last refresh ran.
    read_at: Option<Instant>,
}

/// How often claims refresh [`SeqFloor`].
const FLOOR_REFRESH: Duration = Duration::from_secs(1);

/// The events each live claim of this store holds, so [`Store::renew`]
/// (which gets only the token) updates them by primary key: an index on
/// `lease_token` would make every claim's UPDATE a non-HOT one. Entries go
/// when their events are settled, when a renewal finds the lease lost, or
/// an hour after the claim was last claimed or renewed (a claim dropped
/// without a settlement; its rows come back when the lease expires).
#[derive(Default)]
struct Held {
    claims: Mutex<HashMap<FencingToken, HeldClaim>>,
}

struct HeldClaim {
    ids: HashSet<Uuid>,
    touched: Instant,
}

/// How long an unsettled, unrenewed claim is remembered for [`Store::renew`].
const HELD_FOR: Duration = Duration::from_secs(3600);

impl Held {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<FencingToken, HeldClaim>> {
        // A panic while holding this lock cannot leave the map inconsistent.
        self.claims
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn claimed(&self, token: FencingToken, ids: impl IntoIterator<Item = Uuid>) {
        let now = Instant::now();
        let mut claims = self.lock();
        claims.retain(|_, c| now.duration_since(c.touched) < HELD_FOR);
        let ids: HashSet<Uuid> = ids.into_iter().collect();
        if !ids.is_empty() {
            claims.insert(token, HeldClaim { ids, touched: now });
        }
    }

    fn settled(&self, token: FencingToken, ids: impl IntoIterator<Item = Uuid>) {
        let mut claims = self.lock();
        if let Some(c) = claims.get_mut(&token) {
            for id in ids {
                c.ids.remove(&id);
            }
            if c.ids.is_empty() {
                claims.remove(&token);
            }
        }
    }

    fn ids(&self, token: FencingToken) -> Option<Vec<Uuid>> {
        self.lock()
            .get(&token)
            .map(|c| c.ids.iter().copied().collect())
    }

    fn renewed(&self, token: FencingToken, held: u64) {
        let mut claims = self.lock();
        if held == 0 {
            claims.remove(&token);
        } else if let Some(c) = claims.get_mut(&token) {
            c.touched = Instant::now();
        }
    }
}

/// The opportunistic `VACUUM` of the events table (see
/// [`PgStoreOptions::with_vacuum_every`]).
struct Vacuum {
    every: u64,
    sql: String,
    removed: AtomicU64,
    /// A VACUUM is running, or vacuuming was turned off after an error.
    busy: Arc<AtomicBool>,
}

impl Vacuum {
    /// Counts `n` removed rows; starts a background VACUUM when the count
    /// crosses a multiple of `every` and none is running.
    fn removed(&self, pool: &PgPool, n: u64) {
        if n == 0 {
            return;
        }
        let before = self.removed.fetch_add(n, Ordering::Relaxed);
        if (before + n) / self.every == before / self.every {
            return;
        }
        if self
            .busy
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let (pool, sql, busy) = (pool.clone(), self.sql.clone(), Arc::clone(&self.busy));
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            match sqlx::raw_sql(&sql).execute(&pool).await {
                Ok(_) => {
                    tracing::debug!(elapsed = ?started.elapsed(), "vacuumed the outbox table");
                    busy.store(false, Ordering::Release);
                }
                // Left `busy`: no further attempts from this store.
                Err(e) => tracing::warn!(
                    error = %e,
                    "VACUUM of the outbox table failed; not trying again (leave it to autovacuum, or grant ownership)"
                ),
            }
        });
    }
}

/// Applies `set` to the stats of the shard each row names (column 0: the
/// shard index; rows outside `out` are ignored).
fn fill_shards(
    out: &mut [ShardStats],
    rows: &[PgRow],
    set: impl Fn(&mut Stats, &PgRow) -> Result<(), sqlx::Error>,
) -> Result<(), StoreError> {
    for row in rows {
        let shard: i64 = row.try_get(0)?;
        if let Some(s) = usize::try_from(shard).ok().and_then(|i| out.get_mut(i)) {
            set(&mut s.stats, row)?;
        }
    }
    Ok(())
}
impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore")
            .field("url", &self.inner.url.as_deref().map(redact_url))
            .field("schema", &self.inner.outbox.schema())
            .field("table", &self.inner.outbox.table())
            .field("notify", &self.inner.outbox.notifies())
            .field("listen", &self.inner.listen)
            .field("retention", &self.inner.retention)
            .field("pool_size", &self.inner.db.pool().size())
            .finish()
    }
}
/// Counts of one shard (see [`PgStore::stats_by_shard`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ShardStats {
    /// The shard.
    pub shard: ShardSpec,
    /// Its counts.
    pub stats: Stats,
}

fn micros(d: Duration) -> Result<i64, StoreError> {
    i64::try_from(d.as_micros()).map_err(|_| StoreError::DurationTooLarge(d))
}

fn age(us: Option<i64>) -> Option<Duration> {
    us.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)))
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

impl PgStore {
    fn note_removed(&self, rows: u64) {
        if let Some(v) = &self.inner.vacuum {
            v.removed(self.inner.db.pool(), rows);
        }
    }

    /// Connects a pool to `options`' URL, applies the migrations when
    /// [`PgStoreOptions::with_auto_migrate`] is set, and starts the LISTEN
    /// task (unless turned off) and the retention purge (when configured).
    ///
    /// A server that refuses connections (e.g. still starting) is tried
    /// again until the connect timeout
    /// ([`PgStoreOptions::with_connect_timeout`]); the error then names the
    /// last attempt's cause ("connection refused", an authentication failure,
    /// a missing database...), never the password.
    pub async fn connect(options: PgStoreOptions) -> Result<Self, StoreError> {
        let db = connect_pool(options.url.as_deref(), &options.pool, &[]).await?;
        Self::on(db, options).await
    }

    /// A store on an existing pool (the options' URL and pool size are
    /// ignored; its pooler setting is used, see
    /// [`PgStoreOptions::with_pooler`]). Must be called inside a Tokio
    /// runtime.
    pub async fn from_pool(pool: PgPool, options: PgStoreOptions) -> Result<Self, StoreError> {
        let pooled = crate::db::detect(&pool, options.pool.pooler).await?;
        Self::on(Db::new(pool, pooled, &[("jit", "off")]), options).await
    }

    async fn on(db: Db, options: PgStoreOptions) -> Result<Self, StoreError> {
        let pool = db.pool().clone();
        let names = Names::new(options.schema.clone(), options.table.clone())?;
        let outbox = PgOutbox::from_names(names)
            .with_notify(options.notify)
            .with_limits(options.pool.limits)
            .with_unnamed_statements(db.pooled());
        if options.pool.auto_migrate {
            let mut conn = pool.acquire().await?;
            outbox.migrate(&mut conn).await?;
        }
        let sql = StoreSql::new(&outbox.names, options.retention.is_some());
        let mut tasks = BackgroundTasks::default();
        let listening = options.listen && !db.pooled();
        if options.listen && db.pooled() {
            tracing::warn!(
                channel = outbox.channel(),
                "the queue table's LISTEN wake-ups need a session, which a pooler in transaction \
                 mode does not keep: the relay finds new events with its probe instead (connect \
                 the relay straight to PostgreSQL, or through a session-mode pool, for LISTEN)"
            );
        }
        let wakeup = if listening {
            let notify = Arc::new(Notify::new());
            tasks.spawn(listen(
                pool.clone(),
                outbox.channel().to_owned(),
                Arc::clone(&notify),
            ));
            Some(notify)
        } else {
            None
        };
        if let Some(retention) = options.retention {
            let retention_us = micros(retention)?;
            tasks.spawn(purge_loop(
                db.clone(),
                sql.purge_delivered.clone(),
                retention_us,
                options.purge_batch,
                options.purge_interval,
            ));
        }
        let vacuum = options.vacuum_every.map(|every| Vacuum {
            every,
            sql: outbox.names.render("VACUUM (TRUNCATE false) {{events}}"),
            removed: AtomicU64::new(0),
            busy: Arc::new(AtomicBool::new(false)),
        });
        Ok(Self {
            inner: Arc::new(Inner {
                vacuum,
                db,
                outbox,
                sql,
                url: options.url,
                listen: listening,
                retention: options.retention,
                purge_batch: options.purge_batch,
                wakeup,
                _tasks: tasks,
                held: Held::default(),
                floor: SeqFloor::default(),
            }),
        })
    }

    /// The enqueue handle for this store's outbox (same schema, table,
    /// limits and notify setting).
    pub fn outbox(&self) -> &PgOutbox {
        &self.inner.outbox
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        self.inner.db.pool()
    }

    /// What this store found between itself and PostgreSQL at connect:
    /// [`Pooler::Transaction`](outbox_core::Pooler::Transaction) (a pooler in transaction mode, named by the
    /// pooler setting or detected) or [`Pooler::None`](outbox_core::Pooler::None).
    pub fn pooler(&self) -> outbox_core::Pooler {
        self.inner.db.mode()
    }

    /// The pool as the store uses it (see [`Db`]).
    pub(crate) fn db(&self) -> &Db {
        &self.inner.db
    }

    /// Applies the missing migrations (see [`PgOutbox::migrate`]).
    pub async fn migrate(&self) -> Result<Vec<i32>, MigrateError> {
        let mut conn = self
            .inner
            .db
            .pool()
            .acquire()
            .await
            .map_err(MigrateError::Database)?;
        self.inner.outbox.migrate(&mut conn).await
    }

    /// Counts per shard for `total` shards (shard `i` owns `key_hash % total == i`),
    /// one entry per shard, empty shards included. `total` of 0 is treated as 1.
    pub async fn stats_by_shard(&self, total: u32) -> Result<Vec<ShardStats>, StoreError> {
        let total = total.max(1);
        let mut out: Vec<ShardStats> = (0..total)
            .filter_map(|i| ShardSpec::new(i, total).ok())
            .map(|shard| ShardStats {
                shard,
                stats: Stats::default(),
            })
            .collect();
        let rows = sqlx::query(&self.inner.sql.shard_stats)
            .bind(i64::from(total))
            .fetch_all(&self.inner.db)
            .await?;
        fill_shards(&mut out, &rows, |stats, row| {
            stats.pending = count(row.try_get(1)?);
            stats.in_flight = count(row.try_get(2)?);
            stats.oldest_pending_age = age(row.try_get(3)?);
            Ok(())
        })?;
        let rows = sqlx::query(&self.inner.sql.shard_dead)
            .bind(i64::from(total))
            .fetch_all(&self.inner.db)
            .await?;
        fill_shards(&mut out, &rows, |stats, row| {
            stats.dead = count(row.try_get(1)?);
            Ok(())
        })?;
        Ok(out)
    }

    /// Deletes up to `limit` delivered rows older than the retention (only
    /// meaningful with [`PgStoreOptions::with_retention`]; the background task
    /// calls this). Returns how many were deleted.
    pub async fn purge_delivered(&self, limit: u32) -> Result<u64, StoreError> {
        let retention = micros(self.inner.retention.unwrap_or_default())?;
        let done = sqlx::query(&self.inner.sql.purge_delivered)
            .bind(retention)
            .bind(i64::from(limit))
            .execute(&self.inner.db)
            .await?;
        Ok(done.rows_affected())
    }

    /// The retention purge batch size.
    pub fn purge_batch(&self) -> u32 {
        self.inner.purge_batch
    }

    /// The claim's `seq` lower bound (see [`SeqFloor`]).
    async fn seq_floor(&self) -> Result<i64, StoreError> {
        let lock = || {
            self.inner
                .floor
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        let known = *lock();
        if known.read_at.is_some_and(|at| at.elapsed() < FLOOR_REFRESH) {
            return Ok(known.bound);
        }
        lock().read_at = Some(Instant::now());
        let (settled, min_pending, last, xmax): (bool, Option<i64>, i64, i64) =
            sqlx::query_as(&self.inner.sql.seq_floor)
                .bind(known.candidate.map(|(_, xmax)| xmax))
                .fetch_one(&self.inner.db)
                .await?;
        let mut state = lock();
        match (settled, known.candidate) {
            (true, Some((v, _))) => {
                state.bound = min_pending.map_or(v + 1, |m| m.min(v + 1));
                state.candidate = Some((last, xmax));
            }
            _ => {
                if let Some(m) = min_pending {
                    state.bound = state.bound.min(m);
                }
                state.candidate = state.candidate.or(Some((last, xmax)));
            }
        }
        Ok(state.bound)
    }

    fn claim_sql(&self, req: &ClaimRequest) -> &str {
        if req.shard.total() > 1 {
            &self.inner.sql.claim_shard
        } else {
            &self.inner.sql.claim
        }
    }

    /// Records the undecodable rows of a claim as dead letters (fenced by
    /// the claim's token, like any settlement).
    async fn bury_undecodable(
        &self,
        token: FencingToken,
        bad: Vec<(EventId, String)>,
    ) -> Result<(), StoreError> {
        let mut s = Settlement::new();
        for (id, why) in &bad {
            tracing::error!(event_id = %id, reason = %why, "outbox row cannot be decoded; dead-lettered");
            s.push(
                *id,
                Resolution::Dead {
                    error: LastError {
                        code: ErrorCode::UNDECODABLE,
                        message: why.clone(),
                    },
                },
            );
        }
        let report = self.settle(token, &s).await?;
        if !report.fenced.is_empty() {
            tracing::warn!(
                fenced = report.fenced.len(),
                "undecodable outbox rows were re-claimed before they could be dead-lettered"
            );
        }
        Ok(())
    }
}

fn walk_limit(batch_size: u32) -> i64 {
    i64::from(batch_size) + WALK_BEYOND_BATCH
}

/// The settlement as the arrays [`SETTLE_SQL`](sql::SETTLE_SQL) takes. An id listed twice
/// keeps its first resolution; the later ones are reported as rejected.
struct SettleArgs {
    ids: Vec<Uuid>,
    kinds: Vec<&'static str>,
    delays: Vec<i64>,
    codes: Vec<Option<String>>,
    messages: Vec<Option<String>>,
    /// The distinct ids, in the order given.
    order: Vec<EventId>,
    duplicates: Vec<Rejected>,
    /// Rows a settlement removes from the events table (for the vacuum count).
    removing: bool,
}

impl SettleArgs {
    fn new(settlement: &Settlement, retain: bool) -> Result<Self, StoreError> {
        let n = settlement.len();
        let mut a = SettleArgs {
            ids: Vec::with_capacity(n),
            kinds: Vec::with_capacity(n),
            delays: Vec::with_capacity(n),
            codes: Vec::with_capacity(n),
            messages: Vec::with_capacity(n),
            order: Vec::with_capacity(n),
            duplicates: Vec::new(),
            removing: false,
        };
        let mut seen = HashSet::with_capacity(n);
        for (id, resolution) in settlement.items() {
            if !seen.insert(*id) {
                a.duplicates.push(Rejected {
                    id: *id,
                    reason: "listed more than once in the settlement: only its first resolution \
                             was recorded"
                        .to_owned(),
                });
                continue;
            }
            let (kind, delay, error) = match resolution {
                Resolution::Delivered => ("delivered", 0, None),
                Resolution::Retry { delay, error } => ("retry", micros(*delay)?, Some(error)),
                Resolution::Dead { error } => ("dead", 0, Some(error)),
                Resolution::Released => ("released", 0, None),
                // A resolution added to core after this store was written:
                // record nothing for it rather than guess.
                _ => {
                    a.duplicates.push(Rejected {
                        id: *id,
                        reason: format!(
                            "resolution `{}` is not supported by this version of outbox-postgres; \
                             the event stays leased until its lease expires",
                            resolution.name()
                        ),
                    });
                    continue;
                }
            };
            a.removing |= kind == "dead" || (kind == "delivered" && !retain);
            a.ids.push(id.as_uuid());
            a.kinds.push(kind);
            a.delays.push(delay);
            a.codes.push(error.map(|e| e.code.as_str().to_owned()));
            a.messages.push(error.map(|e| e.message.clone()));
            a.order.push(*id);
        }
        Ok(a)
    }
}

async fn listen(pool: PgPool, channel: String, notify: Arc<Notify>) {
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(sqlx::Error::PoolClosed) => return,
            Err(e) => {
                tracing::warn!(error = %crate::error::Cause(&e), "outbox LISTEN connection failed; retrying in 1s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if let Err(e) = listener.listen(&channel).await {
            tracing::warn!(error = %crate::error::Cause(&e), channel, "outbox LISTEN failed; retrying in 1s");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        tracing::debug!(channel, "outbox listening for notifications");
        // Anything committed while we were not listening is found by a poll.
        notify.notify_one();
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => notify.notify_one(),
                // Connection lost and re-established: notifications may be lost.
                Ok(None) => notify.notify_one(),
                Err(sqlx::Error::PoolClosed) => return,
                Err(e) => {
                    tracing::warn!(error = %crate::error::Cause(&e), channel, "outbox LISTEN connection broke; reconnecting in 1s");
                    notify.notify_one();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
            }
        }
    }
}

async fn purge_loop(db: Db, sql: String, retention_us: i64, batch: u32, every: Duration) {
    loop {
        loop {
            match sqlx::query(&sql)
                .bind(retention_us)
                .bind(i64::from(batch))
                .execute(&db)
                .await
            {
                Ok(done) if done.rows_affected() >= u64::from(batch) => continue,
                Ok(done) => {
                    if done.rows_affected() > 0 {
                        tracing::debug!(
                            purged = done.rows_affected(),
                            "purged delivered outbox rows"
                        );
                    }
                    break;
                }
                Err(sqlx::Error::PoolClosed) => return,
                Err(e) => {
                    tracing::warn!(error = %crate::error::Cause(&e), "purging delivered outbox rows failed");
                    break;
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

impl Store for PgStore {
    type Error = StoreError;

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let token = FencingToken::new();
        let lease_us = micros(req.lease)?;
        if req.batch_size == 0 {
            return Ok(Claim {
                token,
                lease_until: Utc::now(),
                events: Vec::new(),
                more: false,
            });
        }
        let floor = self.seq_floor().await?;
        let rows = sqlx::query(self.claim_sql(req))
            .bind(i64::from(req.shard.total()))
            .bind(i64::from(req.shard.index()))
            .bind(i64::from(req.batch_size))
            .bind(req.relay_id.as_str())
            .bind(lease_us)
            .bind(token.as_uuid())
            .bind(walk_limit(req.batch_size))
            .bind(floor)
            .fetch_all(&self.inner.db)
            .await
            .inspect_err(|_| {
                // The floor is the only state this store keeps across
                // statements. A failed claim may mean a database crash
                // restart, after which sequence values and transaction ids
                // are handed out again below it: walk from the start until
                // the next refresh has a bound read in this incarnation.
                *self
                    .inner
                    .floor
                    .state
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = FloorState::default();
            })?;
        let mut lease_until: Option<DateTime<Utc>> = None;
        let mut ordered = Vec::with_capacity(rows.len());
        let mut bad = Vec::new();
        for row in &rows {
            lease_until = Some(row.try_get(9)?);
            let seq: i64 = row.try_get(12)?;
            match event_from(row, headers_strict)? {
                Ok(e) => ordered.push((seq, e)),
                Err(undecodable) => bad.push(undecodable),
            }
        }
        // Insertion order (the database sequence), which is per-key order.
        ordered.sort_by_key(|(seq, _)| *seq);
        let events: Vec<Event> = ordered.into_iter().map(|(_, e)| e).collect();
        self.inner
            .held
            .claimed(token, events.iter().map(|e| e.id.as_uuid()));
        if !bad.is_empty() {
            self.bury_undecodable(token, bad).await?;
        }
        if !events.is_empty() {
            tracing::debug!(
                relay = %req.relay_id,
                shard = %req.shard,
                count = events.len(),
                token = %token,
                "claimed outbox events"
            );
        }
        Ok(Claim::up_to_batch_size(
            req,
            token,
            // No rows: nothing is leased, so the time is only informative.
            lease_until.unwrap_or_else(Utc::now),
            events,
        ))
    }

    async fn settle(
        &self,
        token: FencingToken,
        settlement: &Settlement,
    ) -> Result<SettleReport, StoreError> {
        let args = SettleArgs::new(settlement, self.inner.retention.is_some())?;
        let mut report = SettleReport {
            rejected: args.duplicates,
            ..SettleReport::default()
        };
        if args.ids.is_empty() {
            return Ok(report);
        }
        let rows: Vec<(Uuid, bool)> = sqlx::query_as(&self.inner.sql.settle)
            .bind(token.as_uuid())
            .bind(&args.ids)
            .bind(&args.kinds)
            .bind(&args.delays)
            .bind(&args.codes)
            .bind(&args.messages)
            .fetch_all(&self.inner.db)
            .await?;
        let applied: HashSet<Uuid> = rows.iter().map(|(id, _)| *id).collect();
        report.applied = applied.len() as u64;
        report.fenced = args
            .order
            .iter()
            .filter(|id| !applied.contains(&id.as_uuid()))
            .copied()
            .collect();
        for (id, replaced) in rows {
            if replaced {
                report.rejected.push(Rejected {
                    id: EventId::from_uuid(id),
                    reason: "a dead letter with this id already existed (the same id was \
                             enqueued again after it died); it was replaced by this newer failure"
                        .to_owned(),
                });
            }
        }
        self.inner.held.settled(token, args.ids.iter().copied());
        if args.removing {
            let removed = args
                .order
                .iter()
                .zip(&args.kinds)
                .filter(|(id, kind)| {
                    applied.contains(&id.as_uuid())
                        && (**kind == "dead"
                            || (**kind == "delivered" && self.inner.retention.is_none()))
                })
                .count();
            self.note_removed(removed as u64);
        }
        if !report.fenced.is_empty() {
            tracing::debug!(
                token = %token,
                fenced = report.fenced.len(),
                "settlement fenced out: the lease was lost"
            );
        }
        Ok(report)
    }

    async fn renew(&self, token: FencingToken, lease: Duration) -> Result<u64, StoreError> {
        let lease_us = micros(lease)?;
        let Some(ids) = self.inner.held.ids(token) else {
            return Ok(0);
        };
        let held = sqlx::query(&self.inner.sql.renew)
            .bind(ids)
            .bind(token.as_uuid())
            .bind(lease_us)
            .execute(&self.inner.db)
            .await?
            .rows_affected();
        self.inner.held.renewed(token, held);
        Ok(held)
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let row = sqlx::query(&self.inner.sql.stats)
            .fetch_one(&self.inner.db)
            .await?;
        Ok(Stats {
            pending: count(row.try_get(0)?),
            in_flight: count(row.try_get(1)?),
            oldest_pending_age: age(row.try_get(2)?),
            dead: count(row.try_get(3)?),
        })
    }

    fn wakeup(&self) -> impl std::future::Future<Output = ()> + Send {
        let notify = self.inner.wakeup.clone();
        async move {
            match notify {
                // `notify_one` keeps a permit when nobody waits, so a
                // notification between two calls is not lost.
                Some(n) => n.notified().await,
                None => std::future::pending().await,
            }
        }
    }
}

impl DeadLetterStore for PgStore {
    type Error = StoreError;

    async fn list_dead(&self, query: &DeadLetterQuery) -> Result<Vec<DeadLetter>, StoreError> {
        let rows = bind_dead_filter(sqlx::query(&self.inner.sql.list_dead), &query.filter)
            .bind(query.after.map(|id| id.as_uuid()))
            .bind(i64::from(query.limit))
            .fetch_all(&self.inner.db)
            .await?;
        rows.iter()
            .map(|row| {
                let event = match event_from(row, |h| Ok(headers_lenient(h)))? {
                    Ok(event) => event,
                    Err((id, detail)) => return Err(StoreError::Corrupt { id, detail }),
                };
                let dead_at: DateTime<Utc> = row.try_get(8)?;
                Ok(DeadLetter::new(event, dead_at))
            })
            .collect()
    }

    async fn count_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let n: i64 = bind_dead_filter(sqlx::query(&self.inner.sql.count_dead), filter)
            .fetch_one(&self.inner.db)
            .await?
            .try_get(0)?;
        Ok(count(n))
    }

    async fn retry_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let moved = bind_dead_filter(sqlx::query(&self.inner.sql.retry_dead), filter)
            .execute(&self.inner.db)
            .await?
            .rows_affected();
        if moved > 0 {
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(self.inner.outbox.channel())
                .execute(&self.inner.db)
                .await?;
        }
        Ok(moved)
    }

    async fn purge_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        Ok(
            bind_dead_filter(sqlx::query(&self.inner.sql.purge_dead), filter)
                .execute(&self.inner.db)
                .await?
                .rows_affected(),
        )
    }
}

impl HeldKeyStore for PgStore {
    type Error = StoreError;

    async fn held_keys(&self, limit: u32) -> Result<HeldKeys, StoreError> {
        let rows = sqlx::query(&self.inner.sql.held_keys)
            .bind(i64::from(limit))
            .fetch_all(&self.inner.db)
            .await?;
        let mut out = HeldKeys::default();
        for row in &rows {
            let head = match event_from(row, |h| Ok(headers_lenient(h)))? {
                Ok(event) => event,
                Err((id, detail)) => return Err(StoreError::Corrupt { id, detail }),
            };
            let state = match row.try_get::<Option<DateTime<Utc>>, _>(12)? {
                Some(lease_until) => HeadState::InFlight { lease_until },
                None => HeadState::Retrying {
                    next_attempt_at: head.next_attempt_at,
                },
            };
            out.total = count(row.try_get(15)?);
            out.heads.push(HeldKey {
                head,
                state,
                waiting: count(row.try_get(13)?),
                first_waiting: row.try_get::<Option<Uuid>, _>(14)?.map(EventId::from_uuid),
            });
        }
        Ok(out)
    }
}
