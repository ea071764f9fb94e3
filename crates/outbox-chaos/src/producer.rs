//! The producer application: business transactions that write a row and
//! enqueue 1..N events through the public API (`PgOutbox::enqueue` /
//! `enqueue_batch`, `SqliteOutbox::enqueue` / `enqueue_batch`), some rolled
//! back on purpose, at a steady offered rate. Each key belongs to one task,
//! so a key's sequence numbers follow its commit order.

use crate::record::{now_us, payload, Ledger, Produced, TxOutcome};
use anyhow::{Context as _, Result};
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

/// The application's database.
#[derive(Debug, Clone)]
pub(crate) enum AppDb {
    /// PostgreSQL: the outbox handle and the business table (qualified).
    Postgres {
        pool: PgPool,
        outbox: PgOutbox,
        business: String,
    },
    /// SQLite: the default outbox table and `chaos_orders`.
    Sqlite { pool: SqlitePool },
}

impl AppDb {
    /// Creates the business table.
    pub(crate) async fn prepare(&self) -> Result<()> {
        match self {
            Self::Postgres { pool, business, .. } => {
                sqlx::query(&format!(
                    "CREATE TABLE IF NOT EXISTS {business} (tx uuid PRIMARY KEY, events int NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
                ))
                .execute(pool)
                .await
                .context("creating the business table")?;
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
            Self::Postgres { pool, business, .. } => {
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
    /// Keys per task.
    pub(crate) keys_per_task: usize,
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

async fn task(
    t: usize,
    db: AppDb,
    cfg: ProducerConfig,
    ledger: Arc<Ledger>,
    started: Instant,
) -> Vec<Produced> {
    let mut rng = StdRng::seed_from_u64(cfg.seed.wrapping_add(t as u64 * 7919));
    let keys: Vec<String> = (0..cfg.keys_per_task)
        .map(|i| format!("k{t}-{i}"))
        .collect();
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
        let mut events = Vec::with_capacity(n);
        let mut meta = Vec::with_capacity(n);
        for _ in 0..n {
            let k = rng.random_range(0..keys.len());
            let seq = next_seq[k];
            next_seq[k] += 1;
            let id = EventId::new();
            let body = payload(id.as_uuid(), &keys[k], seq, cfg.pad);
            events.push(
                NewEvent::new("chaos.order", cfg.topic.clone(), body)
                    .with_key(keys[k].clone())
                    .with_id(id),
            );
            meta.push((id.as_uuid(), k, seq));
        }
        let rollback = rng.random_ratio(1, cfg.rollback_one_in.max(1));
        let batch = rng.random_bool(0.5);
        let outcome = match &db {
            AppDb::Postgres {
                pool,
                outbox,
                business,
            } => pg_tx(pool, outbox, business, tx, events, rollback, batch).await,
            AppDb::Sqlite { pool } => sqlite_tx(pool, tx, events, rollback, batch).await,
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
        for (id, k, seq) in meta {
            if outcome == TxOutcome::Committed {
                ledger.committed(id);
            }
            out.push(Produced {
                id,
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

async fn pg_tx(
    pool: &PgPool,
    outbox: &PgOutbox,
    business: &str,
    tx_id: Uuid,
    events: Vec<NewEvent>,
    rollback: bool,
    batch: bool,
) -> Result<TxOutcome, TxError> {
    let mut tx = pool.begin().await.map_err(|_| TxError::Before)?;
    sqlx::query(&format!(
        "INSERT INTO {business} (tx, events) VALUES ($1, $2)"
    ))
    .bind(tx_id)
    .bind(i32::try_from(events.len()).unwrap_or(i32::MAX))
    .execute(&mut *tx)
    .await
    .map_err(|_| TxError::Before)?;
    enqueue_all!(outbox, tx, events, batch);
    finish(tx, rollback).await
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
