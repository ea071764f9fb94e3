//! `producer`: what the outbox adds to a business transaction, 8 writers
//! in parallel: no outbox, the queue table's insert (NOTIFY off / on), the
//! event log's insert, the event log's `commit_with` (the INSERT and the
//! COMMIT in one round trip), and a `SELECT 1` (the extra round trip alone).
//!
//! The cases are interleaved in short slices, each slice starting at the
//! next case, so a machine whose speed drifts (other processes, the
//! checkpointer) moves every case alike; the spread of each case's ratio to
//! "no outbox" over the slices is reported beside the mean.

use super::Ctx;
use crate::report::Row;
use crate::setup::{new_event, pg_log_store, pg_store};
use anyhow::{Context, Result};
use sqlx::postgres::PgPoolOptions;
use std::sync::Arc;
use std::time::Instant;

/// What the `producer` scenario adds to the business transaction.
#[derive(Clone)]
enum Extra {
    /// The outbox's enqueue.
    Outbox(outbox_postgres::PgOutbox),
    /// A `SELECT 1`: the cost of one more statement, nothing written.
    RoundTrip,
    /// The outbox's `commit_with`: the INSERT and the COMMIT sent together.
    CommitWith(outbox_postgres::PgOutbox),
}

/// Slices each round is cut into, the cases interleaved in each.
const SLICES: u32 = 5;

impl Ctx {
    /// Scenario 5: producer overhead, queue table (NOTIFY off and on) and
    /// event log, interleaved in each round.
    pub(super) async fn producer(&mut self) -> Result<()> {
        let store = pg_store(&self.services, &mut self.res, "producer", false, false, 2).await?;
        let log = pg_log_store(&self.services, &mut self.res, "producer_log", 2).await?;
        let schema = store.outbox().schema().as_str().to_owned();
        let orders = format!("\"{schema}\".orders");
        sqlx::query(&format!(
            "CREATE TABLE {orders} (id uuid PRIMARY KEY, customer text NOT NULL, \
             total bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
        ))
        .execute(store.pool())
        .await?;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(&self.services.database_url)
            .await?;
        let insert = Arc::new(format!(
            "INSERT INTO {orders} (id, customer, total) VALUES ($1, $2, $3)"
        ));
        // The extra statement alone: a `SELECT 1` where the outbox's INSERT
        // would be, the floor of any outbox that adds a statement to the
        // caller's transaction (a fourth round trip on this connection).
        let variants = [
            ("no outbox", None),
            (
                "outbox insert, NOTIFY off",
                Some(Extra::Outbox(store.outbox().clone().with_notify(false))),
            ),
            (
                "outbox insert, NOTIFY on",
                Some(Extra::Outbox(store.outbox().clone().with_notify(true))),
            ),
            (
                "outbox insert, event log (PgLogStore)",
                Some(Extra::Outbox(log.outbox().clone())),
            ),
            (
                "outbox commit_with (INSERT + COMMIT in one round trip), event log",
                Some(Extra::CommitWith(log.outbox().clone())),
            ),
            (
                "SELECT 1 (the extra round trip alone, no outbox)",
                Some(Extra::RoundTrip),
            ),
        ];
        let n = variants.len();
        let mut totals = vec![(0u64, 0.0f64); n];
        // Per slice, each case's rate: the ratio to "no outbox" of the same
        // slice shows how far the machine drifted.
        let mut slices: Vec<Vec<f64>> = Vec::new();
        let slice = self.sizes.producer / SLICES;
        for s in 0..self.sizes.producer_rounds * SLICES {
            let mut rates = vec![0.0; n];
            for k in 0..n {
                let v = (k + usize::try_from(s).unwrap_or(0)) % n;
                let outbox = &variants[v].1;
                let deadline = Instant::now() + slice;
                let mut workers = tokio::task::JoinSet::new();
                for w in 0..8u64 {
                    let (pool, outbox, insert) =
                        (pool.clone(), outbox.clone(), Arc::clone(&insert));
                    let base = (u64::from(s) * 8 + w) * 100_000_000;
                    workers.spawn(async move {
                        let mut n = 0u64;
                        while Instant::now() < deadline {
                            let mut tx = pool.begin().await?;
                            sqlx::query(&insert)
                                .bind(uuid::Uuid::now_v7())
                                .bind(format!("customer-{w}"))
                                .bind(i64::try_from(n).unwrap_or(0))
                                .execute(&mut *tx)
                                .await?;
                            match &outbox {
                                Some(Extra::Outbox(o)) => {
                                    o.enqueue(&mut tx, new_event("bench", base + n)).await?;
                                    tx.commit().await?;
                                }
                                Some(Extra::CommitWith(o)) => {
                                    o.commit_with(tx, new_event("bench", base + n)).await?;
                                }
                                Some(Extra::RoundTrip) => {
                                    sqlx::query("SELECT 1").execute(&mut *tx).await?;
                                    tx.commit().await?;
                                }
                                None => tx.commit().await?,
                            }
                            n += 1;
                        }
                        anyhow::Ok(n)
                    });
                }
                let started = Instant::now();
                let mut done = 0u64;
                while let Some(r) = workers.join_next().await {
                    done += r.context("producer task")??;
                }
                let secs = started.elapsed().as_secs_f64();
                totals[v].0 += done;
                totals[v].1 += secs;
                rates[v] = done as f64 / secs.max(1e-9);
            }
            slices.push(rates);
        }
        pool.close().await;
        store.pool().close().await;
        log.pool().close().await;
        let rate = |i: usize| totals[i].0 as f64 / totals[i].1.max(1e-9);
        let base = rate(0);
        let floor = variants
            .iter()
            .position(|(_, x)| matches!(x, Some(Extra::RoundTrip)))
            .map_or(base, rate);
        let params = |row: Row| {
            row.param("concurrency", 8u64)
                .param("duration_s", self.sizes.producer.as_secs())
                .param("rounds", self.sizes.producer_rounds)
                .param("slices_per_round", SLICES)
        };
        // The lowest and highest ratio of case `i` to "no outbox" over the
        // slices (each slice ran every case once, back to back).
        let spread = |i: usize| {
            let ratios = slices
                .iter()
                .map(|r| r[i] / r[0].max(1e-9))
                .collect::<Vec<_>>();
            let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            let max = ratios.iter().copied().fold(0.0, f64::max);
            (min, max)
        };
        self.rows.push(params(Row::new(
            "producer",
            "business tx (1 INSERT), no outbox",
            base,
            "tx/s",
        )));
        for (i, (name, outbox)) in variants.iter().enumerate().skip(1) {
            let row = params(Row::new(
                "producer",
                format!("business tx + {name}"),
                rate(i),
                "tx/s",
            ))
            .against("no outbox", base);
            let overhead = 1.0 - row.ratio.unwrap_or(0.0);
            let (lo, hi) = spread(i);
            let row = row
                .detail("overhead_pct", overhead * 100.0)
                .detail("slice_ratio_min", lo)
                .detail("slice_ratio_max", hi);
            let (outbox, one_trip) = match outbox {
                Some(Extra::Outbox(o)) => (o, false),
                Some(Extra::CommitWith(o)) => (o, true),
                _ => {
                    // The floor: reported, no target.
                    self.rows.push(row.param("store", "none"));
                    continue;
                }
            };
            // Beyond the floor: what the INSERT itself costs (commit_with
            // has no extra round trip to subtract).
            let row = if one_trip {
                row
            } else {
                row.detail(
                    "overhead_beyond_round_trip_pct",
                    (1.0 - rate(i) / floor.max(1e-9)) * 100.0,
                )
            };
            // Targets: issue 6's for the queue table, issue 11's for the
            // log's enqueue, issue 45's for the path without the extra
            // round trip.
            let (store, max) = match outbox.mode() {
                _ if one_trip => ("log", 0.05),
                outbox_postgres::PgMode::Log => ("log", 0.10),
                _ => ("queue", 0.05),
            };
            let row = row
                .param("store", store)
                .param("path", if one_trip { "commit_with" } else { "enqueue" });
            self.rows
                .push(row.target(format!("overhead <= {:.0}%", max * 100.0), overhead <= max));
        }
        Ok(())
    }
}
