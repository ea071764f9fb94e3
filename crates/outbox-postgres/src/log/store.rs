//! [`PgLogStore`]: snapshot-window claims over the event log, fenced cursor
//! settlements, the retry lane, dead letters, rotation.
//!
//! One file per concern, each piece handed the store's context
//! ([`Ctx`](context::Ctx)) explicitly; this file holds the store itself and
//! its trait impls, which only dispatch:
//!
//! - `cursor.rs`: what this process knows of a cursor (the one place a
//!   lease held in memory is written), the map of cursors and tokens;
//! - `lease.rs`: the cursor rows: taking, renewing, giving back and fencing
//!   a lease, and where a new cursor starts;
//! - `claim.rs`: the claim, start to end;
//! - `settle.rs`: the settle;
//! - `lane.rs`: the retry lane and the dead letters;
//! - `rotation.rs`: rotation;
//! - `status.rs`: what the store reports;
//! - `relays.rs`: relay groups (consumer groups are `log/groups.rs`);
//! - `wake.rs`: the wake-up probe; `rows.rs`: small conversions.
//!
//! The SQL of all of them is `log/sql.rs`.

use super::options::{rotation_check_every, PgLogOptions};
use super::sql::Sql;
use crate::db::Db;
use crate::enqueue::PgOutbox;
use crate::error::StoreError;
use crate::group_name::GroupName;
use crate::ident::Ident;
use crate::names::log::LogNames;
use crate::options::redact_url;
use crate::pool::{connect_pool, BackgroundTasks};
use context::Ctx;
use outbox_core::{
    Claim, ClaimRequest, DeadLetter, DeadLetterFilter, DeadLetterQuery, DeadLetterStore,
    FencingToken, HeldKeyStore, HeldKeys, RelayId, SettleReport, Settlement, ShardSpec, Stats,
    Store,
};
use relays::RelayGroups;
use sqlx::PgPool;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

mod claim;
mod context;
mod cursor;
mod fences;
mod guard;
mod lane;
mod lease;
mod relays;
mod rotation;
mod rows;
mod settle;
mod status;
mod wake;

pub use relays::{LeaseHolding, RelayInfo};
pub use rotation::{PartitionHolder, Rotation, RotationHold};
pub use status::{CursorInfo, InFlight, LogInfo, LogStatus, PartitionInfo, ShardStatus};

/// The event-log store on PostgreSQL (the design: `src/log.rs`). Cheap to
/// clone; clones share the claims in flight, so one process should use one
/// store (and its clones) per outbox. The background rotation stops when
/// the last clone is dropped. `Debug` never shows the password.
#[derive(Clone)]
pub struct PgLogStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// What the pieces share: pool, names, statements, group, options,
    /// cursor state.
    ctx: Ctx,
    log: PgLog,
    outbox: PgOutbox,
    rotation_interval: Duration,
    url: Option<String>,
    relays: RelayGroups,
    /// Held for its `Drop`: stops the background rotation with the last clone.
    _tasks: BackgroundTasks,
}

/// The names of one event-log outbox (`schema`.`<table>_log...`), shared by
/// the store's parts.
#[derive(Clone, Debug)]
pub(crate) struct PgLog {
    pub(crate) names: Arc<LogNames>,
}

impl PgLog {
    pub(crate) fn from_names(names: LogNames) -> Self {
        Self {
            names: Arc::new(names),
        }
    }

    /// The schema.
    pub(crate) fn schema(&self) -> &Ident {
        &self.names.schema
    }

    /// The outbox table name the log's objects are named after.
    pub(crate) fn table(&self) -> &Ident {
        &self.names.table
    }
}

impl fmt::Debug for PgLogStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgLogStore")
            .field("url", &self.inner.url.as_deref().map(redact_url))
            .field("schema", self.inner.log.schema())
            .field("table", self.inner.log.table())
            .field("group", &self.inner.ctx.group)
            .field("dead_head", &self.inner.ctx.dead_head)
            .field("rotation_interval", &self.inner.rotation_interval)
            .field("pool_size", &self.inner.ctx.db.pool().size())
            .finish()
    }
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
        let db = connect_pool(options.url.as_deref(), &options.pool, &[GENERIC_PLANS]).await?;
        Self::on(db, options).await
    }

    /// A store on an existing pool (the options' URL and pool size are
    /// ignored). Must be called inside a Tokio runtime. The pool's session
    /// settings are left as they are; a pool opened with
    /// `plan_cache_mode=force_generic_plan` saves the claim's planning
    /// (about 1.3 ms of a 1,000-event claim), as [`PgLogStore::connect`]'s
    /// own pool does. The options' pooler setting is used
    /// ([`PgLogOptions::with_pooler`]).
    pub async fn from_pool(pool: PgPool, options: PgLogOptions) -> Result<Self, StoreError> {
        let pooled = crate::db::detect(&pool, options.pool.pooler).await?;
        Self::on(Db::new(pool, pooled, &[("jit", "off")]), options).await
    }

    pub(crate) async fn on(db: Db, options: PgLogOptions) -> Result<Self, StoreError> {
        let pool = db.pool().clone();
        GroupName::new(options.group.as_str())?;
        let names = LogNames::new(options.schema.clone(), options.table.clone())?;
        let outbox = PgOutbox::new(options.schema.clone(), options.table.clone())?
            .with_limits(options.pool.limits)
            .with_unnamed_statements(db.pooled());
        let log = PgLog::from_names(names.clone());
        if options.pool.auto_migrate {
            // Migrated here, so checked here: a schema of a newer version
            // (the migration refuses it) or an order sequence someone
            // altered to a cache is refused at connect. Without
            // `auto_migrate` the same checks run at the first claim
            // (`store/fences.rs`), so that `migrate`, `status` and `reanchor` can
            // open a store on an outbox that needs them.
            let mut conn = pool.acquire().await?;
            outbox.migrate(&mut conn).await?;
            drop(conn);
            let mut tx = db.begin().await?;
            super::anchor::check_schema(tx.conn(), &names).await?;
            tx.commit().await?;
        }
        let sql = Arc::new(Sql::new(&names, db.pooled()));
        let mut tasks = BackgroundTasks::default();
        if options.rotate_in_background {
            tasks.spawn(rotation::rotate_forever(
                db.clone(),
                Arc::clone(&sql),
                options.group.clone(),
                options.rotation_interval,
                rotation_check_every(options.rotation_interval),
            ));
        }
        Ok(Self {
            inner: Arc::new(Inner {
                ctx: Ctx::new(db, names, sql, &options),
                log,
                outbox,
                rotation_interval: options.rotation_interval,
                url: options.url.clone(),
                relays: RelayGroups::new(options.dynamic_shards, options.rebalance_every),
                _tasks: tasks,
            }),
        })
    }

    /// The log's names.
    pub(crate) fn log(&self) -> &PgLog {
        &self.inner.log
    }

    /// The same outbox as a [`PgOutbox`](PgOutbox) (event-log mode),
    /// the handle a producer uses with either store.
    pub fn outbox(&self) -> &PgOutbox {
        &self.inner.outbox
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        self.inner.ctx.db.pool()
    }

    /// Applies the missing migrations (see [`PgOutbox::migrate`]), as
    /// [`PgStore::migrate`](crate::PgStore::migrate) does. Idempotent.
    pub async fn migrate(&self) -> Result<Vec<i32>, crate::error::MigrateError> {
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(crate::error::MigrateError::Database)?;
        self.inner.outbox.migrate(&mut conn).await
    }

    /// What this store found between itself and PostgreSQL at connect:
    /// [`Pooler::Transaction`](outbox_core::Pooler::Transaction) (a pooler in transaction mode, named by the
    /// pooler setting or detected) or [`Pooler::None`](outbox_core::Pooler::None).
    pub fn pooler(&self) -> outbox_core::Pooler {
        self.inner.ctx.db.mode()
    }

    /// The pool as the store uses it (see [`Db`]).
    pub(crate) fn db(&self) -> &Db {
        &self.inner.ctx.db
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.inner.ctx.group
    }

    /// The events held by claims of this process that are not settled yet.
    pub async fn in_flight(&self) -> Vec<InFlight> {
        status::in_flight(&self.inner.ctx).await
    }

    /// The cursors of this store's consumer group.
    pub async fn cursors(&self) -> Result<Vec<CursorInfo>, StoreError> {
        status::cursors(&self.inner.ctx).await
    }

    /// Rotates when due: truncates the oldest partition once every cursor
    /// has passed all of its rows and no transaction holds it, and makes it
    /// the current one. Safe to call from any number of processes at once.
    pub async fn rotate(&self) -> Result<Rotation, StoreError> {
        let ctx = &self.inner.ctx;
        rotation::rotate_once(&ctx.db, &ctx.sql, self.inner.rotation_interval).await
    }

    /// Rotates now if possible, whatever the interval (tests, operators).
    pub async fn rotate_now(&self) -> Result<Rotation, StoreError> {
        let ctx = &self.inner.ctx;
        rotation::rotate_once(&ctx.db, &ctx.sql, Duration::ZERO).await
    }

    /// What holds the next rotation back, read live: the partition it
    /// truncates, when it is due, and the sessions (and prepared
    /// transactions) holding a lock on that partition, with the one that
    /// holds rotation back (a writer, or a reader holding it beyond a
    /// statement: `pg_dump`, a session idle in a transaction). Rotation
    /// never queues its lock behind such a session; the log grows until it
    /// leaves. `outbox-relay status` shows it.
    pub async fn rotation_hold(&self) -> Result<RotationHold, StoreError> {
        rotation::hold(&self.inner.ctx, self.inner.rotation_interval).await
    }

    /// Generation, rotations and the size of each partition.
    pub async fn log_info(&self) -> Result<LogInfo, StoreError> {
        status::log_info(&self.inner.ctx).await
    }

    /// Per-shard progress, dead letters, the oldest writer and the
    /// partitions: what `outbox-relay status` and the metrics show.
    pub async fn status(&self) -> Result<LogStatus, StoreError> {
        status::status(&self.inner.ctx).await
    }

    /// The shard leases `relay` (a relay of this process) held at its last
    /// claim: no query, so a readiness probe may call it at any rate.
    /// `None` before its first claim and after it left
    /// ([`Store::leave`](outbox_core::Store::leave)).
    pub fn lease_holding(&self, relay: &RelayId) -> Option<LeaseHolding> {
        self.inner.relays.lease_holding(relay)
    }

    /// The relays of this store's consumer group and the virtual shards
    /// each holds (see [`PgLogOptions::with_dynamic_shards`](crate::log::PgLogOptions::with_dynamic_shards)).
    pub async fn relay_group(&self) -> Result<Vec<RelayInfo>, StoreError> {
        self.inner.relays.relay_group(&self.inner.ctx).await
    }

    /// A claim: a relay-group member's over the sets it holds, any other
    /// relay's from its static shard.
    async fn claim_inner(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let (ctx, relays) = (&self.inner.ctx, &self.inner.relays);
        if relays.dynamic && req.shard == ShardSpec::ALL {
            return relays.claim_dynamic(ctx, req).await;
        }
        let (claim, held) = claim::claim_static(ctx, req).await?;
        relays.note_holding(&req.relay_id, false, held, req.shard.total(), 1);
        Ok(claim)
    }

    /// A clean stop of `relay`: its static shards and its relay-group sets
    /// are given back at once.
    async fn leave_inner(&self, relay: &RelayId) -> Result<(), StoreError> {
        let (ctx, relays) = (&self.inner.ctx, &self.inner.relays);
        relays.forget(relay);
        lease::release_static(ctx, relay).await?;
        relays.leave(ctx, relay).await
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
        settle::settle(&self.inner.ctx, token, settlement)
    }

    fn renew(
        &self,
        token: FencingToken,
        lease: Duration,
    ) -> impl std::future::Future<Output = Result<u64, StoreError>> + Send {
        lease::renew_batch(&self.inner.ctx, token, lease)
    }

    fn stats(&self) -> impl std::future::Future<Output = Result<Stats, StoreError>> + Send {
        status::stats(&self.inner.ctx)
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
            let (ctx, relays) = (&store.inner.ctx, &store.inner.relays);
            loop {
                let delay = ctx.wake.delay();
                if let Some(left) = relays.recheck_within(delay) {
                    tokio::time::sleep(left).await;
                    return;
                }
                tokio::time::sleep(delay).await;
                ctx.wake.back_off(delay);
                match ctx.wake.probe(&ctx.db).await {
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
        lane::list_dead(&self.inner.ctx, query).await
    }

    async fn count_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        lane::count_dead(&self.inner.ctx, filter).await
    }

    async fn retry_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let ctx = &self.inner.ctx;
        lane::dead_statement(ctx, &ctx.sql.retry_dead, filter).await
    }

    async fn purge_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let ctx = &self.inner.ctx;
        lane::dead_statement(ctx, &ctx.sql.purge_dead, filter).await
    }
}

impl HeldKeyStore for PgLogStore {
    type Error = StoreError;

    async fn held_keys(&self, limit: u32) -> Result<HeldKeys, StoreError> {
        lane::held_keys(&self.inner.ctx, limit).await
    }
}
