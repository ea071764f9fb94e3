//! The producer application: business transactions that write a row and
//! enqueue 1..N events through the public API (`PgOutbox::enqueue` /
//! `enqueue_batch`, `SqliteOutbox::enqueue` / `enqueue_batch`), some rolled
//! back on purpose, at a steady offered rate.
//!
//! Two shapes ([`ProducerMode`]):
//!
//! - `partitioned` (the default): each key belongs to one task, which
//!   numbers its events itself, so a key's sequence numbers follow its
//!   commit order.
//! - `contended` (PostgreSQL): every task writes every key, the way an
//!   application serializes the writers of one aggregate. A transaction
//!   inserts its business row first, THEN locks each of its keys' aggregate
//!   rows (`SELECT ... FOR UPDATE`, keys in sorted order so two transactions
//!   never deadlock) and takes the key's next sequence number from it
//!   (`UPDATE ... SET seq = seq + 1 RETURNING seq`), enqueues the events and
//!   commits. The aggregate's lock is held until the commit, so a key's
//!   sequence numbers are its commit order; but the transaction took its id
//!   at its first write, before it waited for the lock: a transaction that
//!   waited behind a younger one has the smaller id and the larger sequence
//!   number. A store that orders a window by transaction id delivers those
//!   two out of order (DESIGN.md, invariant 12); one that orders by the
//!   moment of the INSERT does not.
//!
//! Through PgBouncer in transaction mode (`run --pgbouncer`) every
//! statement the application sends with arguments is unnamed
//! (`persistent(false)`, and the outbox handle's `with_pooler`), and each
//! runs inside the business transaction: a statement left prepared on a
//! server connection is another client's next.

use crate::record::{now_us, payload, Ledger, Produced, TxOutcome};
use anyhow::{bail, Context as _, Result};
use outbox_core::{EventId, NewEvent};
use outbox_postgres::PgOutbox;
use outbox_sqlite::SqliteOutbox;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::postgres::PgPool;
use sqlx::sqlite::SqlitePool;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use uuid::Uuid;

/// How the producer's tasks share the keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ProducerMode {
    /// Each task owns its keys and numbers their events itself.
    Partitioned,
    /// Every task writes every key; the sequence number comes from the
    /// key's aggregate row, locked after the business row was written
    /// (PostgreSQL only; see the module docs).
    Contended,
}

impl ProducerMode {
    /// The name used on the command line and in reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Partitioned => "partitioned",
            Self::Contended => "contended",
        }
    }
}

/// The application's database.
#[derive(Debug, Clone)]
pub(crate) enum AppDb {
    /// PostgreSQL: the application's pool, the harness's (direct to the
    /// server: set-up and the look-up of unknown commits; the same pool
    /// when the application's is direct too), whether the application's
    /// goes through a pooler in transaction mode, the outbox handle, the
    /// business table and the aggregates table (both qualified).
    Postgres {
        pool: PgPool,
        admin: PgPool,
        pooled: bool,
        outbox: PgOutbox,
        business: String,
        aggregates: String,
    },
    /// SQLite: the default outbox table and `chaos_orders`.
    Sqlite { pool: SqlitePool },
}

impl AppDb {
    /// Creates the business table; in `contended` mode also the aggregates
    /// table with a row (sequence 0) per key.
    pub(crate) async fn prepare(&self, cfg: &ProducerConfig) -> Result<()> {
        match self {
            Self::Postgres {
                admin: pool,
                business,
                aggregates,
                ..
            } => {
                sqlx::query(&format!(
                    "CREATE TABLE IF NOT EXISTS {business} (tx uuid PRIMARY KEY, events int NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
                ))
                .execute(pool)
                .await
                .context("creating the business table")?;
                if cfg.mode == ProducerMode::Contended {
                    sqlx::query(&format!(
                        "CREATE TABLE IF NOT EXISTS {aggregates} (key text PRIMARY KEY, seq bigint NOT NULL DEFAULT 0)"
                    ))
                    .execute(pool)
                    .await
                    .context("creating the aggregates table")?;
                    sqlx::query(&format!(
                        "INSERT INTO {aggregates} (key) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING"
                    ))
                    .bind(keys(cfg, 0))
                    .execute(pool)
                    .await
                    .context("filling the aggregates table")?;
                }
            }
            Self::Sqlite { .. } if cfg.mode == ProducerMode::Contended => {
                bail!("the contended producer needs PostgreSQL (SQLite runs one writer at a time)")
            }
            Self::Sqlite { pool } => {
                sqlx::query(
                    "CREATE TABLE IF NOT EXISTS chaos_orders (tx TEXT PRIMARY KEY, events INTEGER NOT NULL)",
                )
                .execute(pool)
                .await
                .context("creating the business table")?;
            }
        }
        Ok(())
    }

    /// Which of `txs` committed (their business row exists).
    pub(crate) async fn committed_among(&self, txs: &[Uuid]) -> Result<HashSet<Uuid>> {
        if txs.is_empty() {
            return Ok(HashSet::new());
        }
        match self {
            Self::Postgres {
                admin: pool,
                business,
                ..
            } => {
                let rows: Vec<(Uuid,)> =
                    sqlx::query_as(&format!("SELECT tx FROM {business} WHERE tx = ANY($1)"))
                        .bind(txs)
                        .fetch_all(pool)
                        .await?;
                Ok(rows.into_iter().map(|r| r.0).collect())
            }
            Self::Sqlite { pool } => {
                let mut found = HashSet::new();
                for tx in txs {
                    let row: Option<(String,)> =
                        sqlx::query_as("SELECT tx FROM chaos_orders WHERE tx = ?")
                            .bind(tx.to_string())
                            .fetch_optional(pool)
                            .await?;
                    if row.is_some() {
                        found.insert(*tx);
                    }
                }
                Ok(found)
            }
        }
    }
}

/// How the producer behaves.
#[derive(Debug, Clone)]
pub(crate) struct ProducerConfig {
    /// Offered events per second (all tasks together).
    pub(crate) rate: u32,
    /// How long to produce.
    pub(crate) duration: Duration,
    /// Concurrent application tasks (connections).
    pub(crate) tasks: usize,
    /// How the tasks share the keys.
    pub(crate) mode: ProducerMode,
    /// Keys per task (`partitioned`), or in all (`contended`).
    pub(crate) keys: usize,
    /// Most events per transaction.
    pub(crate) max_events_per_tx: usize,
    /// One transaction in this many is rolled back.
    pub(crate) rollback_one_in: u32,
    /// Payload padding bytes.
    pub(crate) pad: usize,
    /// The events' topic.
    pub(crate) topic: String,
    /// Random seed.
    pub(crate) seed: u64,
    /// Put before every key (`tenants`: `t1.`, so that the keys of the
    /// databases sharing one stream stay apart); empty otherwise.
    pub(crate) key_prefix: String,
}

/// Runs the producer tasks to the end of `duration`; returns every event
/// written with its transaction's outcome.
pub(crate) async fn run(
    db: AppDb,
    cfg: ProducerConfig,
    ledger: Arc<Ledger>,
) -> Result<Vec<Produced>> {
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    for t in 0..cfg.tasks {
        let (db, cfg, ledger) = (db.clone(), cfg.clone(), ledger.clone());
        tasks.spawn(async move { task(t, db, cfg, ledger, started).await });
    }
    let mut all = Vec::new();
    while let Some(r) = tasks.join_next().await {
        all.extend(r.context("producer task panicked")?);
    }
    Ok(all)
}

/// The keys task `t` writes: its own (`partitioned`), or every task's
/// shared ones (`contended`).
fn keys(cfg: &ProducerConfig, t: usize) -> Vec<String> {
    match cfg.mode {
        ProducerMode::Partitioned => (0..cfg.keys)
            .map(|i| format!("{}k{t}-{i}", cfg.key_prefix))
            .collect(),
        ProducerMode::Contended => (0..cfg.keys)
            .map(|i| format!("{}k{i}", cfg.key_prefix))
            .collect(),
    }
}

async fn task(
    t: usize,
    db: AppDb,
    cfg: ProducerConfig,
    ledger: Arc<Ledger>,
    started: Instant,
) -> Vec<Produced> {
    let mut rng = StdRng::seed_from_u64(cfg.seed.wrapping_add(t as u64 * 7919));
    let keys = keys(&cfg, t);
    let mut next_seq = vec![1u64; keys.len()];
    let per_task = f64::from(cfg.rate.max(1)) / cfg.tasks.max(1) as f64;
    let mut sent = 0u64;
    let mut out = Vec::new();
    let end = started + cfg.duration;
    loop {
        let due = started + Duration::from_secs_f64(sent as f64 / per_task);
        if due >= end {
            break;
        }
        tokio::time::sleep_until(due).await;
        let n = rng.random_range(1..=cfg.max_events_per_tx.max(1));
        let tx = Uuid::now_v7();
        let mut picks: Vec<usize> = (0..n).map(|_| rng.random_range(0..keys.len())).collect();
        let rollback = rng.random_ratio(1, cfg.rollback_one_in.max(1));
        let batch = rng.random_bool(0.5);
        // The events written: key index, id, sequence number. A contended
        // transaction makes each event once it holds the key's lock (as an
        // application builds it then), so it lists only those it reached.
        let mut made: Vec<(usize, EventId, u64)> = Vec::with_capacity(n);
        let outcome = match (&db, cfg.mode) {
            (
                AppDb::Postgres {
                    pool,
                    pooled,
                    outbox,
                    business,
                    aggregates,
                    ..
                },
                ProducerMode::Contended,
            ) => {
                // Locks in key order: two transactions never deadlock.
                picks.sort_unstable();
                let c = Contended {
                    pool,
                    persistent: !*pooled,
                    outbox,
                    business,
                    aggregates,
                    keys: &keys,
                    cfg: &cfg,
                };
                c.tx(tx, &picks, &mut made, rollback, batch).await
            }
            (db, _) => {
                let mut events = Vec::with_capacity(n);
                for k in &picks {
                    let seq = next_seq[*k];
                    next_seq[*k] += 1;
                    let id = EventId::new();
                    made.push((*k, id, seq));
                    events.push(event(&cfg, id, &keys[*k], seq));
                }
                match db {
                    AppDb::Postgres {
                        pool,
                        pooled,
                        outbox,
                        business,
                        ..
                    } => {
                        let pg = PgApp {
                            pool,
                            persistent: !*pooled,
                            outbox,
                            business,
                        };
                        pg.tx(tx, events, rollback, batch).await
                    }
                    AppDb::Sqlite { pool } => sqlite_tx(pool, tx, events, rollback, batch).await,
                }
            }
        };
        let at = now_us();
        let outcome = match outcome {
            Ok(o) => o,
            Err(TxError::Before) => {
                // Nothing committed; the database is away (a fault): pause.
                tokio::time::sleep(Duration::from_millis(50)).await;
                TxOutcome::RolledBack
            }
            Err(TxError::AtCommit) => TxOutcome::Unknown,
        };
        for (k, id, seq) in made {
            if outcome == TxOutcome::Committed {
                ledger.committed(id.as_uuid());
            }
            out.push(Produced {
                id: id.as_uuid(),
                key: keys[k].clone(),
                seq,
                tx,
                outcome,
                at_us: at,
            });
        }
        sent += n as u64;
    }
    out
}

/// The event the producer writes: its id, key and sequence number in the
/// payload ([`payload`]).
fn event(cfg: &ProducerConfig, id: EventId, key: &str, seq: u64) -> NewEvent {
    NewEvent::new(
        "chaos.order",
        cfg.topic.clone(),
        payload(id.as_uuid(), key, seq, cfg.pad),
    )
    .with_key(key.to_owned())
    .with_id(id)
}

enum TxError {
    /// Failed before `COMMIT` was sent: not committed.
    Before,
    /// `COMMIT` itself failed: outcome unknown.
    AtCommit,
}

/// Enqueues `$events` in the transaction `$tx` through `$outbox`: with one
/// `enqueue_batch` call when `$batch`, else one `enqueue` each. A macro, not a
/// function: `PgOutbox` and `SqliteOutbox` have the same calls but no common
/// trait. Any error is a [`TxError::Before`].
macro_rules! enqueue_all {
    ($outbox:expr, $tx:ident, $events:expr, $batch:expr) => {
        if $batch {
            $outbox
                .enqueue_batch(&mut $tx, $events)
                .await
                .map_err(|_| TxError::Before)?;
        } else {
            for e in $events {
                $outbox
                    .enqueue(&mut $tx, e)
                    .await
                    .map_err(|_| TxError::Before)?;
            }
        }
    };
}

/// Rolls `tx` back when `rollback` (a failed ROLLBACK still never commits),
/// else commits it.
async fn finish<DB: sqlx::Database>(
    tx: sqlx::Transaction<'_, DB>,
    rollback: bool,
) -> Result<TxOutcome, TxError> {
    if rollback {
        let _ = tx.rollback().await;
        return Ok(TxOutcome::RolledBack);
    }
    tx.commit().await.map_err(|_| TxError::AtCommit)?;
    Ok(TxOutcome::Committed)
}

/// A `partitioned` PostgreSQL transaction's handles: `persistent` false
/// through a pooler in transaction mode (unnamed statements).
struct PgApp<'a> {
    pool: &'a PgPool,
    persistent: bool,
    outbox: &'a PgOutbox,
    business: &'a str,
}

impl PgApp<'_> {
    /// The business row and the events in one transaction.
    async fn tx(
        &self,
        tx_id: Uuid,
        events: Vec<NewEvent>,
        rollback: bool,
        batch: bool,
    ) -> Result<TxOutcome, TxError> {
        let mut tx = self.pool.begin().await.map_err(|_| TxError::Before)?;
        sqlx::query(&format!(
            "INSERT INTO {} (tx, events) VALUES ($1, $2)",
            self.business
        ))
        .persistent(self.persistent)
        .bind(tx_id)
        .bind(i32::try_from(events.len()).unwrap_or(i32::MAX))
        .execute(&mut *tx)
        .await
        .map_err(|_| TxError::Before)?;
        enqueue_all!(self.outbox, tx, events, batch);
        finish(tx, rollback).await
    }
}

async fn sqlite_tx(
    pool: &SqlitePool,
    tx_id: Uuid,
    events: Vec<NewEvent>,
    rollback: bool,
    batch: bool,
) -> Result<TxOutcome, TxError> {
    let outbox = SqliteOutbox::default();
    let mut tx = pool.begin().await.map_err(|_| TxError::Before)?;
    sqlx::query("INSERT INTO chaos_orders (tx, events) VALUES (?, ?)")
        .bind(tx_id.to_string())
        .bind(i64::try_from(events.len()).unwrap_or(i64::MAX))
        .execute(&mut *tx)
        .await
        .map_err(|_| TxError::Before)?;
    enqueue_all!(outbox, tx, events, batch);
    finish(tx, rollback).await
}

/// A `contended` transaction's handles (see the module docs).
struct Contended<'a> {
    pool: &'a PgPool,
    /// False through a pooler in transaction mode (unnamed statements).
    persistent: bool,
    outbox: &'a PgOutbox,
    business: &'a str,
    aggregates: &'a str,
    keys: &'a [String],
    cfg: &'a ProducerConfig,
}

impl Contended<'_> {
    /// One transaction: the business row, then per key (`picks`, sorted)
    /// the aggregate row locked and one sequence number per event taken
    /// from it, the event made then (pushed to `made`), then the events
    /// enqueued, then the commit (or the rollback).
    async fn tx(
        &self,
        tx_id: Uuid,
        picks: &[usize],
        made: &mut Vec<(usize, EventId, u64)>,
        rollback: bool,
        batch: bool,
    ) -> Result<TxOutcome, TxError> {
        let mut tx = self.pool.begin().await.map_err(|_| TxError::Before)?;
        // The first write: the transaction takes its id here, before it
        // waits for any aggregate's lock.
        sqlx::query(&format!(
            "INSERT INTO {} (tx, events) VALUES ($1, $2)",
            self.business
        ))
        .persistent(self.persistent)
        .bind(tx_id)
        .bind(i32::try_from(picks.len()).unwrap_or(i32::MAX))
        .execute(&mut *tx)
        .await
        .map_err(|_| TxError::Before)?;
        let mut events = Vec::with_capacity(picks.len());
        let mut locked = None;
        for k in picks {
            let key = &self.keys[*k];
            if locked != Some(*k) {
                sqlx::query(&format!(
                    "SELECT seq FROM {} WHERE key = $1 FOR UPDATE",
                    self.aggregates
                ))
                .persistent(self.persistent)
                .bind(key)
                .execute(&mut *tx)
                .await
                .map_err(|_| TxError::Before)?;
                locked = Some(*k);
            }
            let (seq,): (i64,) = sqlx::query_as(&format!(
                "UPDATE {} SET seq = seq + 1 WHERE key = $1 RETURNING seq",
                self.aggregates
            ))
            .persistent(self.persistent)
            .bind(key)
            .fetch_one(&mut *tx)
            .await
            .map_err(|_| TxError::Before)?;
            let seq = u64::try_from(seq).unwrap_or(0);
            let id = EventId::new();
            made.push((*k, id, seq));
            events.push(event(self.cfg, id, key, seq));
        }
        enqueue_all!(self.outbox, tx, events, batch);
        finish(tx, rollback).await
    }
}
