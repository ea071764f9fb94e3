//! Issue 11's targets for the event log (`PgLogStore`) that the older
//! scenarios measured in queue mode only:
//!
//! - `backlog`, its event-log rows ([`Ctx::log_backlog`]): the relay's drain
//!   rate at a 10k backlog (median of three drains) vs the big backlog, and
//!   the big backlog's drain vs the keyset read ceiling ([`keyset_read`]).
//! - `log-held-snapshot`: a clean drain of the big backlog vs one with a
//!   REPEATABLE READ snapshot held on another connection, then, with the
//!   snapshot still held, three rotations (every partition truncated once):
//!   `n_dead_tup` and table + index size of the event partitions before and
//!   after.
//! - `sustained`: 5,000 events/s offered through `PgOutbox::enqueue_batch`
//!   for minutes with a snapshot held through the middle of the run; per
//!   window: commit -> handler p50/p99, events, size of the log.
//!
//! Sizes and dead tuples come from the statistics collector
//! (`pg_stat_user_tables`), read after the connections that did the work
//! have been closed (which flushes their statistics) or, while the relay
//! runs, as the collector has them (up to about a second behind).

use super::event_log::PgMode;
use super::{noop_handlers, open_loop, percentile, with_usage, Ctx};
use crate::report::Row;
use crate::run::{relay_drain, relay_options, Drained};
use crate::setup::{
    admin_pool, hold_snapshot, load_pg_log, open_pg_log, pg_log_store, release_snapshot, EVENT_TYPE,
};
use anyhow::{Context, Result};
use outbox_core::{Event, ShardSpec};
use outbox_postgres::{Ident, PgLogStore};
use outbox_postgres::{Rotation, DEFAULT_ROTATION_INTERVAL};
use outbox_worker::{HandlerRegistry, Relay};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Events per second the `sustained` producers offer (issue 11).
const SUSTAINED_RATE: u64 = 5_000;
/// Events per producer transaction in `sustained` (1,000 transactions/s,
/// as the `latency` scenario offers its 10k events/s).
const SUSTAINED_PER_TX: u64 = 5;
/// The per-window p99 target of `sustained` (issue 11), ms.
const SUSTAINED_P99_MS: f64 = 25.0;
/// How much the log may grow from the first half of a `sustained` run to
/// the second and still count as bounded.
const BOUNDED_GROWTH: f64 = 1.25;
/// How long statistics may take to reach the collector after the
/// connections that made them are closed.
const STATS_FLUSH: Duration = Duration::from_millis(1_000);
/// How long a rotation that is blocked (another rotation running, a cursor
/// not yet flushed) is retried before `log-held-snapshot` gives up.
const ROTATE_CAP: Duration = Duration::from_secs(20);

const MIB: f64 = 1024.0 * 1024.0;

/// Rows per SELECT of the keyset read ceiling ([`keyset_read`]).
const KEYSET_BATCH: i64 = 1000;

/// The event log's physical read limit: every row of `schema`.`log`
/// read on one connection in keyset batches of [`KEYSET_BATCH`] in the
/// relay's (txid, seq) order, each row decoded as the store decodes an
/// event (id, key, type, topic, payload, headers, created_at). No shard
/// filter, snapshot window, cursor or settle. Measured on the second read
/// (the first sets the fresh rows' hint bits). Returns rows per second;
/// fails unless it read `expected` rows.
async fn keyset_read(pool: &PgPool, schema: &Ident, log: &Ident, expected: u64) -> Result<f64> {
    let log = format!("{}.{}", schema.quoted(), log.quoted());
    let sql = format!(
        // `e.txid` in ORDER BY: a bare `txid` would name the output column
        // (its text form) and sort 1,000 rows out of a full scan each time.
        "SELECT e.txid::text, e.seq, e.id, e.key, e.event_type, e.topic, e.payload, \
                e.headers::text, e.created_at \
         FROM {log} e WHERE (e.txid, e.seq) > ($1::text::xid8, $2) \
         ORDER BY e.txid, e.seq LIMIT $3"
    );
    let mut conn = pool.acquire().await?;
    let started = Instant::now();
    let (mut txid, mut seq, mut read) = ("0".to_owned(), 0_i64, 0_u64);
    loop {
        type LogRow = (
            String,
            i64,
            uuid::Uuid,
            Option<String>,
            String,
            String,
            Vec<u8>,
            String,
            chrono::DateTime<chrono::Utc>,
        );
        let rows: Vec<LogRow> = sqlx::query_as(&sql)
            .bind(&txid)
            .bind(seq)
            .bind(KEYSET_BATCH)
            .fetch_all(&mut *conn)
            .await
            .context("keyset read of the event log")?;
        let Some(last) = rows.last() else { break };
        (txid, seq) = (last.0.clone(), last.1);
        read += rows.len() as u64;
    }
    let secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        read == expected,
        "the keyset read found {read} rows in {log}, {expected} were loaded"
    );
    Ok(read as f64 / secs.max(1e-9))
}

/// The event partitions of one log, as the statistics collector sees them.
#[derive(Debug, Clone, Copy, Default)]
struct PartStats {
    live: i64,
    dead: i64,
    /// `pg_table_size` (heap, TOAST, free space and visibility maps).
    table_bytes: i64,
    /// `pg_indexes_size`.
    index_bytes: i64,
}

impl PartStats {
    fn mib(&self) -> f64 {
        (self.table_bytes + self.index_bytes) as f64 / MIB
    }
}

/// Sums over the partitions of `schema`.`<table>_log` (found through
/// `pg_inherits`, whatever their number).
async fn partition_stats(pool: &PgPool, schema: &str, table: &str) -> Result<PartStats> {
    let row: (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(s.n_live_tup), 0)::bigint, coalesce(sum(s.n_dead_tup), 0)::bigint, \
                coalesce(sum(pg_table_size(i.inhrelid)), 0)::bigint, \
                coalesce(sum(pg_indexes_size(i.inhrelid)), 0)::bigint \
         FROM pg_inherits i LEFT JOIN pg_stat_user_tables s ON s.relid = i.inhrelid \
         WHERE i.inhparent = to_regclass(format('%I.%I', $1::text, $2::text || '_log'))",
    )
    .bind(schema)
    .bind(table)
    .fetch_one(pool)
    .await
    .context("reading the event partitions' statistics")?;
    Ok(PartStats {
        live: row.0,
        dead: row.1,
        table_bytes: row.2,
        index_bytes: row.3,
    })
}

/// Every table of `schema` (log partitions, cursors, retry lane, dead
/// letters, meta): total size with indexes, and dead tuples.
async fn schema_stats(pool: &PgPool, schema: &str) -> Result<(i64, i64)> {
    let row: (i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint, \
                coalesce(sum(s.n_dead_tup), 0)::bigint \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
         WHERE n.nspname = $1 AND c.relkind = 'r'",
    )
    .bind(schema)
    .fetch_one(pool)
    .await
    .context("reading the schema's statistics")?;
    Ok(row)
}

/// Rotates `store`'s log until each of its partitions was truncated once
/// (so every event loaded before is gone), retrying a blocked rotation for
/// up to [`ROTATE_CAP`]. Returns the rotations done and, if it stopped
/// early, why.
async fn rotate_every_partition(store: &PgLogStore) -> Result<(u32, Option<String>)> {
    let partitions = store.log_info().await?.partitions.len().max(1);
    let started = Instant::now();
    let mut done = 0u32;
    while (done as usize) < partitions {
        match store.rotate_now().await.context("rotate_now")? {
            Rotation::Rotated { .. } => done += 1,
            other => {
                if started.elapsed() > ROTATE_CAP {
                    return Ok((done, Some(format!("rotation stopped: {other:?}"))));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    Ok((done, None))
}

/// Latency bookkeeping of `sustained`: whichever of the producer (after
/// `COMMIT` returned) and the handler sees an event second computes its
/// latency, so only events in flight are held in memory.
#[derive(Debug, Default)]
struct Tracker {
    /// Committed, not handled yet: commit time and window.
    committed: HashMap<uuid::Uuid, (Instant, usize)>,
    /// Handled before the producer recorded its commit (latency ~0).
    early: HashMap<uuid::Uuid, Instant>,
    /// Latencies (ms) by the window the event was committed in.
    lat: Vec<Vec<f64>>,
}

impl Tracker {
    fn record(&mut self, window: usize, ms: f64) {
        if self.lat.len() <= window {
            self.lat.resize_with(window + 1, Vec::new);
        }
        if let Some(w) = self.lat.get_mut(window) {
            w.push(ms);
        }
    }

    fn on_commit(&mut self, id: uuid::Uuid, at: Instant, window: usize) {
        match self.early.remove(&id) {
            Some(h) => self.record(window, ms_between(at, h)),
            None => {
                self.committed.insert(id, (at, window));
            }
        }
    }

    fn on_handled(&mut self, id: uuid::Uuid, at: Instant) {
        match self.committed.remove(&id) {
            Some((c, window)) => self.record(window, ms_between(c, at)),
            None => {
                self.early.insert(id, at);
            }
        }
    }
}

fn ms_between(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64() * 1000.0
}

/// What the sampler read at the end of one `sustained` window.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    parts: PartStats,
    schema_bytes: i64,
    schema_dead: i64,
    rotations: i64,
}

impl Ctx {
    /// A relay drain of a fresh `n` backlog in a fresh event log to the
    /// no-op handler (one relay); the store's pool is closed afterwards.
    async fn log_noop_drain(&mut self, n: u64, label: &str) -> Result<(Drained, f64)> {
        let (d, load, _) = self.log_noop_drain_with(n, label, false).await?;
        Ok((d, load))
    }

    /// [`Self::log_noop_drain`], and with `ceiling` first the keyset read
    /// ceiling on the same rows ([`keyset_read`]: events/s).
    async fn log_noop_drain_with(
        &mut self,
        n: u64,
        label: &str,
        ceiling: bool,
    ) -> Result<(Drained, f64, Option<f64>)> {
        let store = pg_log_store(&self.services, &mut self.res, label, 4).await?;
        let load = load_pg_log(&store, "bench", n).await?;
        let pool = store.pool().clone();
        let read = if ceiling {
            let log = store.outbox();
            let table = Ident::new(format!("{}_log", log.table().as_str()))?;
            // The first reader of fresh rows sets their hint bits (writes):
            // read once to pay that, as the relay's drain does not.
            keyset_read(&pool, log.schema(), &table, n).await?;
            Some(keyset_read(&pool, log.schema(), &table, n).await?)
        } else {
            None
        };
        let d = relay_drain(store, noop_handlers(), self.batch, 1, n, self.sizes.cap).await;
        pool.close().await;
        Ok((d?, load.as_secs_f64(), read))
    }

    /// `backlog`: the drain rate at a 10k backlog vs the big one, event log
    /// (the default, with its keyset read ceiling) then the queue table.
    pub(super) async fn backlog(&mut self) -> Result<()> {
        self.log_backlog().await?;
        let small = self.sizes.small_backlog;
        let big = self.sizes.backlog;
        let small_rate = self.mode_noop_rate(PgMode::Queue, small).await?;
        let row = Row::new(
            "backlog",
            format!("relay queue table (PgStore, comparison) -> no-op, {small} backlog"),
            small_rate,
            "events/s",
        )
        .param("store", "queue");
        self.rows.push(self.common(row, small));
        let big_rate = self.mode_noop_rate(PgMode::Queue, big).await?;
        let row = Row::new(
            "backlog",
            format!("relay queue table (PgStore, comparison) -> no-op, {big} backlog"),
            big_rate,
            "events/s",
        )
        .param("store", "queue")
        .param("backlog", big)
        .against(format!("{small} backlog"), small_rate);
        let mut row = row.target_ratio(">= 90% of the 10k drain", 0.9);
        if self.quick {
            row = row.note("quick run: 100k instead of 1M");
        }
        self.rows.push(row);
        Ok(())
    }

    /// The event-log rows of `backlog`: the 10k drain (median of three: it
    /// lasts well under a second) vs the big backlog's.
    async fn log_backlog(&mut self) -> Result<()> {
        let small = self.sizes.small_backlog;
        let big = self.sizes.backlog;
        let mut smalls = Vec::new();
        for _ in 0..3 {
            let (d, load) = self.log_noop_drain(small, "log_small").await?;
            self.cleanup().await;
            smalls.push((d, load));
        }
        smalls.sort_by(|a, b| a.0.rate().total_cmp(&b.0.rate()));
        let rates: Vec<f64> = smalls.iter().map(|(d, _)| d.rate().round()).collect();
        let Some((d, load)) = smalls.get(smalls.len() / 2) else {
            anyhow::bail!("no 10k drain");
        };
        let small_rate = d.rate();
        let row = Row::new(
            "backlog",
            format!("relay event log (PgLogStore) -> no-op, {small} backlog (median of 3)"),
            small_rate,
            "events/s",
        )
        .param("store", "log");
        let row = with_usage(self.common(row, small), d)
            .detail("load_s", *load)
            .detail("rates", format!("{rates:?}"));
        self.rows.push(row);

        let (d, load, ceiling) = self.log_noop_drain_with(big, "log_big", true).await?;
        self.cleanup().await;
        let ceiling = ceiling.unwrap_or(f64::NAN);
        let row = Row::new(
            "backlog",
            format!("event log keyset read ceiling: {big} rows, {KEYSET_BATCH} per SELECT, one connection"),
            ceiling,
            "events/s",
        )
        .param("store", "log")
        .note("the physical limit of the design: the same rows read in (txid, seq) order, decoded, nothing else");
        self.rows.push(self.common(row, big));
        let row = Row::new(
            "backlog",
            format!(
                "relay event log (PgLogStore) -> no-op, {big} backlog, vs the keyset read ceiling"
            ),
            d.rate(),
            "events/s",
        )
        .param("store", "log")
        .against("keyset read ceiling", ceiling)
        .target_ratio(">= 50% of the keyset read ceiling", 0.5);
        self.rows.push(self.common(row, big));
        let row = Row::new(
            "backlog",
            format!("relay event log (PgLogStore) -> no-op, {big} backlog"),
            d.rate(),
            "events/s",
        )
        .param("store", "log");
        let mut row = with_usage(self.common(row, big), &d)
            .detail("load_s", load)
            .against(format!("{small} backlog (event log)"), small_rate)
            .target_ratio(">= 95% of the 10k drain", 0.95);
        if self.quick {
            let note = row
                .note
                .take()
                .map(|n| format!("{n}; "))
                .unwrap_or_default();
            row = row.note(format!("{note}quick run: {big} instead of 1M"));
        }
        self.rows.push(row);
        Ok(())
    }

    /// `log-held-snapshot`: the big backlog drained clean, then again with
    /// a REPEATABLE READ snapshot held on another connection through the
    /// drain (target >= 0.90 of clean); then, the snapshot still held, each
    /// partition rotated out once: dead tuples and size of the event
    /// partitions before and after (target 0 dead tuples).
    pub(super) async fn log_held_snapshot(&mut self) -> Result<()> {
        let n = self.sizes.backlog;
        let (clean, clean_load) = self.log_noop_drain(n, "lhs_clean").await?;
        // The clean backlog's schema goes at once (disk).
        self.cleanup().await;
        let row = Row::new(
            "log-held-snapshot",
            "relay event log -> no-op, clean",
            clean.rate(),
            "events/s",
        );
        self.rows.push(
            with_usage(self.common(row, n), &clean)
                .param("store", "log")
                .detail("load_s", clean_load),
        );

        let store = pg_log_store(&self.services, &mut self.res, "lhs_held", 4).await?;
        let schema: Ident = store.outbox().schema().clone();
        let table = store.outbox().table().as_str().to_owned();
        let load = load_pg_log(&store, "bench", n).await?;
        let holder = hold_snapshot(&self.services).await?;
        let pool = store.pool().clone();
        let drained = relay_drain(store, noop_handlers(), self.batch, 1, n, self.sizes.cap).await;
        // Closing the relay's connections flushes their statistics.
        pool.close().await;
        let after = self.rotate_held(&schema, &table).await;
        release_snapshot(holder).await?;
        let held = drained?;
        let (before, rotated, stopped, after) = after?;

        let row = Row::new(
            "log-held-snapshot",
            "relay event log -> no-op, REPEATABLE READ snapshot held",
            held.rate(),
            "events/s",
        );
        let row = with_usage(self.common(row, n), &held)
            .param("store", "log")
            .detail("load_s", load.as_secs_f64())
            .against("clean drain", clean.rate())
            .target_ratio(">= 90% of the clean drain", 0.9);
        self.rows.push(row);

        let part_row = |case: &str, s: &PartStats| {
            Row::new("log-held-snapshot", case, s.dead as f64, "dead tuples")
                .param("backlog", n)
                .param("snapshot_held", true)
                .detail("n_live_tup", s.live)
                .detail("table_mib", s.table_bytes as f64 / MIB)
                .detail("index_mib", s.index_bytes as f64 / MIB)
                .detail("table_plus_index_mib", s.mib())
        };
        self.rows.push(part_row(
            "event partitions after the held drain, before rotation",
            &before,
        ));
        let mut row = part_row(
            "event partitions after rotating each partition out once (TRUNCATE)",
            &after,
        )
        .detail("rotations", rotated)
        .detail("table_plus_index_mib_before", before.mib())
        .target(
            "0 dead tuples after rotation",
            after.dead == 0 && stopped.is_none(),
        );
        if let Some(why) = stopped {
            row = row.note(why);
        }
        self.rows.push(row);
        Ok(())
    }

    /// The partition statistics of `schema`'s log, then every partition
    /// rotated out once by a store of its own (background rotation off),
    /// then the statistics again.
    async fn rotate_held(
        &self,
        schema: &Ident,
        table: &str,
    ) -> Result<(PartStats, u32, Option<String>, PartStats)> {
        let admin = admin_pool(&self.services).await?;
        tokio::time::sleep(STATS_FLUSH).await;
        let before = partition_stats(&admin, schema.as_str(), table).await?;
        let rotator = open_pg_log(&self.services, schema, 1, |o| {
            o.with_background_rotation(false)
        })
        .await?;
        let rotated = rotate_every_partition(&rotator).await;
        rotator.pool().close().await;
        let (rotated, stopped) = rotated?;
        tokio::time::sleep(STATS_FLUSH).await;
        let after = partition_stats(&admin, schema.as_str(), table).await?;
        admin.close().await;
        Ok((before, rotated, stopped, after))
    }

    /// `sustained`: [`SUSTAINED_RATE`] events/s offered through the log's
    /// `PgOutbox` for the run's duration while a relay (product defaults:
    /// NOTIFY off, background rotation every 60 s) runs a no-op handler;
    /// a REPEATABLE READ snapshot is held on another connection through the
    /// middle of the run. One row per window: commit -> handler p50/p99 of
    /// the events committed in it, and the log's size at its end.
    pub(super) async fn sustained(&mut self) -> Result<()> {
        let duration = self.sizes.sustained;
        let window = self.sizes.sustained_window;
        let (hold_from, hold_to) = self.sizes.sustained_hold;
        let windows = usize::try_from(duration.as_millis() / window.as_millis().max(1))
            .unwrap_or(1)
            .max(1);
        let store = pg_log_store(&self.services, &mut self.res, "sustained", 6).await?;
        let schema = store.outbox().schema().as_str().to_owned();
        let table = store.outbox().table().as_str().to_owned();
        let outbox = store.outbox().clone();
        let producers = PgPoolOptions::new()
            .max_connections(16)
            .connect(&self.services.database_url)
            .await?;
        let admin = admin_pool(&self.services).await?;

        let tracker: Arc<Mutex<Tracker>> = Arc::default();
        let seen = Arc::clone(&tracker);
        let handlers = HandlerRegistry::new().with_handler(EVENT_TYPE, move |event: Event| {
            let seen = Arc::clone(&seen);
            async move {
                let now = Instant::now();
                if let Ok(mut t) = seen.lock() {
                    t.on_handled(event.id.as_uuid(), now);
                }
                Ok(())
            }
        });
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let relay = Relay::new(
            store.clone(),
            handlers,
            relay_options(self.batch, ShardSpec::ALL, "sustained"),
        )?;
        let cpu0 = crate::probe::cpu_seconds();
        let relay = tokio::spawn(relay.run(async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        }));
        tokio::time::sleep(Duration::from_millis(300)).await;

        let started = tokio::time::Instant::now();
        // The snapshot: taken at `hold_from`, released at `hold_to`.
        let services = self.services.clone();
        let holder = tokio::spawn(async move {
            tokio::time::sleep_until(started + hold_from).await;
            let conn = hold_snapshot(&services).await?;
            tokio::time::sleep_until(started + hold_to).await;
            release_snapshot(conn).await
        });
        // The sampler: the log's size at the end of each window.
        let (sampler_store, sampler_admin, sampler_schema, sampler_table) =
            (store.clone(), admin.clone(), schema.clone(), table.clone());
        let sampler = tokio::spawn(async move {
            let mut samples = Vec::with_capacity(windows);
            for k in 1..=windows {
                tokio::time::sleep_until(started + window * u32::try_from(k).unwrap_or(1)).await;
                let parts =
                    partition_stats(&sampler_admin, &sampler_schema, &sampler_table).await?;
                let (schema_bytes, schema_dead) =
                    schema_stats(&sampler_admin, &sampler_schema).await?;
                let rotations = sampler_store.log_info().await?.rotations;
                samples.push(Sample {
                    parts,
                    schema_bytes,
                    schema_dead,
                    rotations,
                });
            }
            anyhow::Ok(samples)
        });

        let mut skipped = vec![0u64; windows];
        let committed_per_window: Arc<Mutex<Vec<u64>>> = Arc::new(Mutex::new(vec![0; windows]));
        let window_of = move |at: Instant, t0: Instant| -> usize {
            let w =
                (at.saturating_duration_since(t0).as_secs_f64() / window.as_secs_f64()) as usize;
            w.min(windows - 1)
        };
        let t0 = started.into_std();
        let on_commit = {
            let (tracker, per_window) = (Arc::clone(&tracker), Arc::clone(&committed_per_window));
            move |ids: &[outbox_core::EventId], now: Instant| {
                let w = window_of(now, t0);
                if let Ok(mut t) = tracker.lock() {
                    for id in ids {
                        t.on_commit(id.as_uuid(), now, w);
                    }
                }
                if let Ok(mut c) = per_window.lock() {
                    if let Some(c) = c.get_mut(w) {
                        *c += ids.len() as u64;
                    }
                }
            }
        };
        let error = open_loop(
            &producers,
            &outbox,
            (SUSTAINED_PER_TX, SUSTAINED_RATE / SUSTAINED_PER_TX),
            (t0, duration),
            on_commit,
            |now| {
                if let Some(s) = skipped.get_mut(window_of(now, t0)) {
                    *s += 1;
                }
            },
        )
        .await;
        let produced_for = started.elapsed().as_secs_f64();
        let wait_until = Instant::now() + Duration::from_secs(15);
        while Instant::now() < wait_until {
            let pending = tracker.lock().map(|t| t.committed.len()).unwrap_or(0);
            if pending == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let samples = sampler.await.context("sampler task")?;
        let held = holder.await.context("snapshot task")?;
        let _ = stop_tx.send(true);
        relay.await.context("relay task")?;
        let cpu_s = crate::probe::cpu_seconds() - cpu0;
        producers.close().await;
        store.pool().close().await;
        admin.close().await;
        let samples = samples?;
        held?;

        let tracker = tracker
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default();
        let committed = committed_per_window
            .lock()
            .map(|c| c.clone())
            .unwrap_or_default();
        let missing = tracker.committed.len() as u64;
        let total: u64 = committed.iter().sum();
        let win_s = window.as_secs_f64();
        let minutes = window == Duration::from_secs(60);

        let mut all: Vec<f64> = Vec::new();
        for k in 0..windows {
            let mut lat = tracker.lat.get(k).cloned().unwrap_or_default();
            lat.sort_by(f64::total_cmp);
            all.extend_from_slice(&lat);
            let from = k as f64 * win_s;
            let to = from + win_s;
            let held = from < hold_to.as_secs_f64() && to > hold_from.as_secs_f64();
            let label = if minutes {
                format!("minute {} ({from:.0}-{to:.0} s)", k + 1)
            } else {
                format!("{from:.0}-{to:.0} s")
            };
            let p99 = percentile(&lat, 0.99);
            let s = samples.get(k).copied().unwrap_or_default();
            let mut row = Row::new(
                "sustained",
                format!(
                    "commit -> no-op handler, {label}{}",
                    if held { ", snapshot held" } else { "" }
                ),
                p99,
                "ms p99",
            )
            .param("store", "log")
            .param("offered_events_per_s", SUSTAINED_RATE)
            .param("events_per_tx", SUSTAINED_PER_TX)
            .param("window_s", win_s)
            .param("snapshot_held", held)
            .detail("p50_ms", percentile(&lat, 0.50))
            .detail("max_ms", lat.last().copied().unwrap_or(f64::NAN))
            .detail("events", committed.get(k).copied().unwrap_or(0))
            .detail("handled", lat.len() as u64)
            .detail("log_mib", s.parts.mib())
            .detail("log_table_mib", s.parts.table_bytes as f64 / MIB)
            .detail("log_index_mib", s.parts.index_bytes as f64 / MIB)
            .detail("log_n_live_tup", s.parts.live)
            .detail("schema_mib", s.schema_bytes as f64 / MIB)
            .detail("schema_n_dead_tup", s.schema_dead)
            .detail("rotations", s.rotations);
            if let Some(sk) = skipped.get(k).filter(|s| **s > 0) {
                row = row.note(format!("{sk} producer ticks skipped (producers saturated)"));
            }
            self.rows.push(row.target(
                format!("p99 <= {SUSTAINED_P99_MS} ms"),
                p99 <= SUSTAINED_P99_MS,
            ));
        }

        // The whole run, and whether the log's size stayed bounded.
        all.sort_by(f64::total_cmp);
        let mut row = Row::new(
            "sustained",
            "whole run: commit -> no-op handler",
            percentile(&all, 0.99),
            "ms p99",
        )
        .param("store", "log")
        .param("offered_events_per_s", SUSTAINED_RATE)
        .param("duration_s", duration.as_secs())
        .param(
            "snapshot_held_s",
            format!("{}-{}", hold_from.as_secs(), hold_to.as_secs()),
        )
        .detail("p50_ms", percentile(&all, 0.50))
        .detail("max_ms", all.last().copied().unwrap_or(f64::NAN))
        .detail("events", total)
        .detail("achieved_events_per_s", total as f64 / produced_for)
        .detail("cpu_s", cpu_s);
        let mut notes = Vec::new();
        if missing > 0 {
            notes.push(format!("{missing} events not seen by the handler"));
        }
        if let Some(e) = error {
            notes.push(format!("producer error: {e}"));
        }
        if !notes.is_empty() {
            row = row.note(notes.join("; "));
        }
        self.rows.push(row);

        let sizes: Vec<f64> = samples.iter().map(|s| s.parts.mib()).collect();
        let half = sizes.len() / 2;
        let first = sizes.iter().take(half.max(1)).copied().fold(0.0, f64::max);
        let second = sizes.iter().skip(half).copied().fold(0.0, f64::max);
        let mut row = Row::new(
            "sustained",
            "event log table + index size, largest window end",
            sizes.iter().copied().fold(0.0, f64::max),
            "MiB",
        )
        .param("store", "log")
        .param("rotation_interval_s", DEFAULT_ROTATION_INTERVAL.as_secs())
        .detail("max_first_half_mib", first)
        .detail("max_second_half_mib", second)
        .detail("final_mib", sizes.last().copied().unwrap_or(0.0))
        .detail("rotations", samples.last().map_or(0, |s| s.rotations));
        // The log reaches its steady size after three rotations (each
        // partition filled once): judged only when the run is long enough.
        if duration >= DEFAULT_ROTATION_INTERVAL * 5 {
            row = row.against("largest in the first half", first).target(
                format!("bounded: 2nd half <= {BOUNDED_GROWTH}x 1st half"),
                second <= first * BOUNDED_GROWTH,
            );
        } else {
            row = row.note(format!(
                "not judged: the run is shorter than 5 rotation intervals ({} s)",
                DEFAULT_ROTATION_INTERVAL.as_secs() * 5
            ));
        }
        self.rows.push(row);
        Ok(())
    }
}
