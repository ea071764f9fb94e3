//! Relay groups and consumer groups on the event log (issue 12):
//!
//! - `log-scale-out`: 1, 2 and 4 relays draining one backlog with static
//!   shards (`ShardSpec::new(i, n)`) vs as a relay group (`ShardSpec::ALL`,
//!   `with_dynamic_shards(true)`). Each relay has its own store on its own
//!   pool, as separate processes would. The dynamic drain is timed from the
//!   start, rebalancing included, and the time until every relay held its
//!   fair share is reported beside it.
//! - `rebalance`: two relays of a group under a steady producer; a third
//!   joins, is killed (task aborted: no settlement, no leave), joins again,
//!   stops gracefully. Each time: how long until the shards are shared.
//! - `fan-out`: one backlog drained by one consumer group vs two groups at
//!   once (each its own relay and cursors), and the producer's cost with one
//!   vs two groups.
//!
//! Who holds which shard comes from [`PgLogStore::relays`] on an observer
//! store with its own connections, polled every [`POLL`]: the times are
//! exact to about that (plus one small query).

use super::{noop_handlers, percentile, recording_handlers, with_usage, Ctx};
use crate::report::Row;
use crate::run::{group_drain, relay_options_id, Drained, Member, Running};
use crate::setup::{
    admin_pool, fresh_schema, load_pg_log, new_event, open_pg_log, Services, PAYLOAD_BYTES,
};
use anyhow::{Context, Result};
use outbox_core::ShardSpec;
use outbox_postgres::{Ident, PgLogStore, PgOutbox};
use outbox_postgres::{RelayInfo, DEFAULT_REBALANCE_INTERVAL};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Relay counts of the scale-out comparison.
const RELAYS: [u32; 3] = [1, 2, 4];
/// How often the observer reads who holds which shard.
const POLL: Duration = Duration::from_millis(20);
/// The longest wait for a relay group to settle or take over.
const SETTLE_CAP: Duration = Duration::from_secs(20);
/// Lease of the `rebalance` relays (claims and relay-group announcement).
const LEASE: Duration = Duration::from_secs(2);
/// Events per second the `rebalance` producer offers.
const PRODUCER_RATE: u64 = 2_000;
/// Events per producer transaction in `rebalance` (one every 10 ms).
const PRODUCER_PER_TX: u64 = 20;
/// Concurrent producers of the fan-out producer-cost measurement.
const PRODUCERS: u64 = 8;

/// The fair share of the relay of rank `rank` (by id) among `n`: as the
/// store computes it, `total / n` plus one for the first `total % n`.
fn fair_share(total: usize, n: usize, rank: usize) -> usize {
    total / n + usize::from(rank < total % n)
}

/// Every relay of `ids` is alive and holds its fair share +/- 1 (the
/// issue's criterion), and together they hold every virtual shard.
fn settled(infos: &[RelayInfo], ids: &[String]) -> bool {
    let mut sorted: Vec<&String> = ids.iter().collect();
    sorted.sort();
    let Some(total) = infos.first().map(|i| i.virtual_shards as usize) else {
        return false;
    };
    let mut sum = 0;
    for (rank, id) in sorted.iter().enumerate() {
        let Some(info) = infos.iter().find(|i| &&i.relay == id) else {
            return false;
        };
        if !info.alive
            || info
                .shards
                .len()
                .abs_diff(fair_share(total, sorted.len(), rank))
                > 1
        {
            return false;
        }
        sum += info.shards.len();
    }
    sum == total
}

/// The relays of `ids` together hold every virtual shard.
fn hold_all(infos: &[RelayInfo], ids: &[String]) -> bool {
    let Some(total) = infos.first().map(|i| i.virtual_shards as usize) else {
        return false;
    };
    let held: usize = infos
        .iter()
        .filter(|i| ids.contains(&i.relay))
        .map(|i| i.shards.len())
        .sum();
    held == total
}

/// Polls `observer` until `done` holds (the time since `since`), or `cap`
/// passed since `since` (`None`).
async fn wait_until(
    observer: &PgLogStore,
    since: Instant,
    done: impl Fn(&[RelayInfo]) -> bool,
) -> Result<Option<Duration>> {
    loop {
        let infos = observer.relay_group().await.context("relay_group()")?;
        if done(&infos) {
            return Ok(Some(since.elapsed()));
        }
        if since.elapsed() > SETTLE_CAP {
            return Ok(None);
        }
        tokio::time::sleep(POLL).await;
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One measured drain of the `log-scale-out` scenario.
#[derive(Debug)]
pub(super) struct GroupDrain {
    pub(super) drained: Drained,
    /// Dynamic runs: from the start until every relay held its fair share.
    pub(super) settle: Option<Duration>,
    pub(super) load_s: f64,
}

/// Offers [`PRODUCER_RATE`] events/s through `outbox` ([`PRODUCER_PER_TX`]
/// per transaction) until `stop`; counts the committed events in `produced`.
async fn produce(
    pool: PgPool,
    outbox: PgOutbox,
    produced: Arc<AtomicU64>,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(
        PRODUCER_PER_TX as f64 / PRODUCER_RATE as f64,
    ));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut i = 0u64;
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return Ok(()),
            _ = tick.tick() => {}
        }
        let events = (i..i + PRODUCER_PER_TX).map(|j| new_event("bench", j));
        i += PRODUCER_PER_TX;
        let mut tx = pool.begin().await?;
        outbox.enqueue_batch(&mut tx, events).await?;
        tx.commit().await?;
        produced.fetch_add(PRODUCER_PER_TX, Ordering::Relaxed);
    }
}

/// Rows one enqueue transaction (one event) writes, in any table: the
/// transaction's own statistics (`pg_stat_xact_user_tables`), read before
/// it commits, so exact and independent of when statistics are flushed.
async fn writes_per_enqueue(services: &Services, outbox: &PgOutbox) -> Result<i64> {
    let pool = admin_pool(services).await?;
    let mut tx = pool.begin().await?;
    outbox
        .enqueue(&mut tx, new_event("bench", 2_000_000_000))
        .await?;
    let n: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint \
         FROM pg_stat_xact_user_tables",
    )
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    pool.close().await;
    Ok(n)
}

/// `events` enqueued through `outbox`, one per transaction, by
/// [`PRODUCERS`] concurrent workers on a pool of their own (closed at the
/// end, which flushes its statistics). Returns the wall time.
async fn produce_fixed(services: &Services, outbox: &PgOutbox, events: u64) -> Result<Duration> {
    let pool = PgPoolOptions::new()
        .max_connections(u32::try_from(PRODUCERS).unwrap_or(8))
        .connect(&services.database_url)
        .await?;
    // Connections up before the clock starts.
    let mut warm = Vec::new();
    for _ in 0..PRODUCERS {
        warm.push(pool.acquire().await?);
    }
    drop(warm);
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..PRODUCERS {
        let (pool, outbox) = (pool.clone(), outbox.clone());
        workers.spawn(async move {
            let mut i = w;
            while i < events {
                let mut tx = pool.begin().await?;
                outbox
                    .enqueue(&mut tx, new_event("bench", 1_000_000_000 + i))
                    .await?;
                tx.commit().await?;
                i += PRODUCERS;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = workers.join_next().await {
        r.context("producer task")??;
    }
    let took = started.elapsed();
    pool.close().await;
    Ok(took)
}

impl Ctx {
    /// `log-scale-out`: static shards vs a relay group at 1, 2 and 4 relays
    /// (median of the rounds; static and dynamic alternate first).
    pub(super) async fn log_scale_out(&mut self) -> Result<()> {
        let n = self.sizes.group_backlog;
        let rounds = self.sizes.group_rounds.max(1);
        let mut runs: HashMap<(u32, bool), Vec<GroupDrain>> = HashMap::new();
        for round in 0..rounds {
            for relays in RELAYS {
                let order = if round % 2 == 0 {
                    [false, true]
                } else {
                    [true, false]
                };
                for dynamic in order {
                    let m = self.log_group_drain(relays, dynamic, n).await?;
                    // Each backlog's schema goes at once (disk).
                    self.cleanup().await;
                    runs.entry((relays, dynamic)).or_default().push(m);
                }
            }
        }
        let mut one_static = 0.0;
        for relays in RELAYS {
            let mut static_rate = 0.0;
            for dynamic in [false, true] {
                let mut ms_ = runs.remove(&(relays, dynamic)).unwrap_or_default();
                ms_.sort_by(|a, b| a.drained.rate().total_cmp(&b.drained.rate()));
                let Some(m) = ms_.get(ms_.len() / 2) else {
                    continue;
                };
                let case = if dynamic {
                    format!("event log, {relays} relay(s), relay group (ShardSpec::ALL, dynamic shards) -> no-op")
                } else {
                    format!("event log, {relays} relay(s), static shards i/{relays} -> no-op")
                };
                let row = Row::new("log-scale-out", case, m.drained.rate(), "events/s")
                    .param("relays", relays)
                    .param("shards", if dynamic { "dynamic" } else { "static" })
                    .param("rounds", rounds)
                    .param("store_per_relay", true);
                let mut row =
                    with_usage(self.common(row, n), &m.drained).detail("load_s", m.load_s);
                if ms_.len() > 1 {
                    let first = ms_.first().map_or(0.0, |m| m.drained.rate());
                    let last = ms_.last().map_or(0.0, |m| m.drained.rate());
                    row = row
                        .detail("rate_min", first.round())
                        .detail("rate_max", last.round());
                }
                if dynamic {
                    row = row.param(
                        "rebalance_interval_ms",
                        DEFAULT_REBALANCE_INTERVAL.as_millis() as u64,
                    );
                    row = match m.settle {
                        Some(s) => row.detail("fair_share_after_ms", ms(s).round()),
                        None => row.note(format!(
                            "the group did not reach its fair shares within {} s",
                            SETTLE_CAP.as_secs()
                        )),
                    };
                    row = row
                        .against(format!("static, {relays} relay(s)"), static_rate)
                        .target_ratio(">= 0.95 of static (reported, not asserted)", 0.95);
                } else {
                    static_rate = m.drained.rate();
                    if relays == 1 {
                        one_static = static_rate;
                    } else {
                        row = row.against("1 relay, static", one_static);
                    }
                }
                self.rows.push(row);
            }
        }
        Ok(())
    }

    /// One drain of a fresh `n` backlog by `relays` relays, each with its own
    /// store: static shards, or a relay group (timed from the start; the
    /// relays keep running after the last delivery until the group has
    /// settled, so that time is known even when the drain was shorter).
    pub(super) async fn log_group_drain(
        &mut self,
        relays: u32,
        dynamic: bool,
        n: u64,
    ) -> Result<GroupDrain> {
        let label = format!("lscale{relays}{}", if dynamic { "d" } else { "s" });
        let schema = fresh_schema(&mut self.res, &label)?;
        let observer = open_pg_log(&self.services, &schema, 2, |o| o).await?;
        let load = load_pg_log(&observer, "bench", n).await?;
        let mut members = Vec::new();
        let mut pools = vec![observer.pool().clone()];
        let mut ids = Vec::new();
        for i in 0..relays {
            let store = open_pg_log(&self.services, &schema, 4, |o| {
                o.with_dynamic_shards(dynamic)
            })
            .await?;
            pools.push(store.pool().clone());
            let shard = if dynamic {
                ShardSpec::ALL
            } else {
                ShardSpec::new(i, relays).context("shard spec")?
            };
            let id = format!("bench-lscale-{i}");
            ids.push(id.clone());
            members.push(Member { store, shard, id });
        }
        let since = Instant::now();
        let poller = dynamic.then(|| {
            let observer = observer.clone();
            tokio::spawn(async move { wait_until(&observer, since, |i| settled(i, &ids)).await })
        });
        let linger = async move {
            match poller {
                Some(p) => p.await.context("settle poller")?,
                None => Ok(None),
            }
        };
        let (drained, settle) = group_drain(
            members,
            noop_handlers(),
            self.batch,
            n,
            self.sizes.cap,
            linger,
        )
        .await?;
        drop(observer);
        for p in pools {
            p.close().await;
        }
        Ok(GroupDrain {
            drained,
            settle: settle?,
            load_s: load.as_secs_f64(),
        })
    }

    /// `rebalance`: a relay group of two under a steady producer; per
    /// repetition a third relay joins, is killed, another joins and stops
    /// gracefully.
    pub(super) async fn rebalance(&mut self) -> Result<()> {
        let schema = fresh_schema(&mut self.res, "rebalance")?;
        let observer = open_pg_log(&self.services, &schema, 2, |o| o).await?;
        let producer_pool = PgPoolOptions::new()
            .max_connections(2)
            .connect(&self.services.database_url)
            .await?;
        let produced = Arc::new(AtomicU64::new(0));
        let delivered = Arc::new(AtomicU64::new(0));
        // Distinct events a handler ran for: the reports above miss a batch
        // whose relay was killed after its settlement reached the database
        // but before the relay read the reply (settled, never reported).
        let handled = Arc::new(Mutex::new(HashSet::new()));
        let (stop_tx, stop_rx) = watch::channel(false);
        let producer = tokio::spawn(produce(
            producer_pool.clone(),
            observer.outbox().clone(),
            Arc::clone(&produced),
            stop_rx,
        ));
        let started = Instant::now();
        let outcome = self
            .rebalance_runs(&schema, &observer, &delivered, &handled)
            .await;
        let _ = stop_tx.send(true);
        let produced_result = producer.await.context("producer task")?;
        let produced_for = started.elapsed().as_secs_f64();
        producer_pool.close().await;
        let (samples, survivors) = outcome?;
        produced_result?;
        // Let the two relays catch up, to count what was delivered.
        let total = produced.load(Ordering::Relaxed);
        let handled_n = || {
            handled
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .len() as u64
        };
        let wait_until_t = Instant::now() + Duration::from_secs(15);
        while handled_n() < total && Instant::now() < wait_until_t {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for r in survivors {
            r.stop().await?;
        }
        observer.pool().close().await;
        let got = delivered.load(Ordering::Relaxed);
        let reached = handled_n();

        let reps = self.sizes.rebalance_reps;
        let cases: [(&str, &[Option<Duration>]); 4] = [
            (
                "relay group 0 -> 2 (start): until both hold their fair share +/- 1",
                &samples.start,
            ),
            (
                "relay group 2 -> 3 (join): until all three hold their fair share +/- 1",
                &samples.join,
            ),
            (
                "relay group 3 -> 2 (kill, no leave): until the survivors hold all shards",
                &samples.kill,
            ),
            (
                "relay group 3 -> 2 (graceful stop, leave): until the others hold all shards",
                &samples.leave,
            ),
        ];
        for (i, (case, xs)) in cases.iter().enumerate() {
            let mut done: Vec<f64> = xs.iter().flatten().map(|d| ms(*d)).collect();
            done.sort_by(f64::total_cmp);
            let missed = xs.len() - done.len();
            let mut row = Row::new("rebalance", *case, percentile(&done, 0.5), "ms")
                .param("repetitions", reps)
                .param("lease_ms", ms(LEASE) as u64)
                .param(
                    "rebalance_interval_ms",
                    DEFAULT_REBALANCE_INTERVAL.as_millis() as u64,
                )
                .param("offered_events_per_s", PRODUCER_RATE)
                .param("batch", self.batch)
                .detail("p50_ms", percentile(&done, 0.5).round())
                .detail("max_ms", done.last().copied().unwrap_or(f64::NAN).round())
                .detail("samples", xs.len() as u64);
            if i == 0 {
                row = row
                    .detail(
                        "producer_events_per_s",
                        (total as f64 / produced_for).round(),
                    )
                    .detail("events_produced", total)
                    .detail("deliveries_reported", got)
                    .detail("events_handled", reached);
                if reached < total {
                    row = row.note(format!(
                        "{} produced events never reached a handler within 15 s after the producer stopped",
                        total - reached
                    ));
                }
            }
            if missed > 0 {
                row = row.note(format!(
                    "{missed} of {} did not get there within {} s",
                    xs.len(),
                    SETTLE_CAP.as_secs()
                ));
            }
            self.rows.push(row);
        }
        Ok(())
    }

    /// The measured steps of [`Ctx::rebalance`]. Returns the samples and the
    /// two relays still running.
    async fn rebalance_runs(
        &self,
        schema: &Ident,
        observer: &PgLogStore,
        delivered: &Arc<AtomicU64>,
        handled: &Arc<Mutex<HashSet<outbox_core::EventId>>>,
    ) -> Result<(Samples, Vec<Running>)> {
        let start = |id: String| {
            let delivered = Arc::clone(delivered);
            let handlers = recording_handlers(Arc::clone(handled));
            async move {
                // Opened (connected, migration checked) before the clock
                // starts: a process start is not part of the rebalance.
                let store =
                    open_pg_log(&self.services, schema, 3, |o| o.with_dynamic_shards(true)).await?;
                let options =
                    relay_options_id(self.batch, ShardSpec::ALL, &id).with_lock_timeout(LEASE);
                anyhow::Ok(move || Running::start(store, handlers, options, delivered))
            }
        };
        let mut samples = Samples::default();
        let pair = vec!["bench-rebal-a".to_owned(), "bench-rebal-b".to_owned()];
        let (sa, sb) = (start(pair[0].clone()).await?, start(pair[1].clone()).await?);
        let t0 = Instant::now();
        let survivors = vec![sa()?, sb()?];
        samples
            .start
            .push(wait_until(observer, t0, |i| settled(i, &pair)).await?);
        for rep in 0..self.sizes.rebalance_reps {
            // (a) A third relay joins.
            let c_id = format!("bench-rebal-c{rep}");
            let c = start(c_id.clone()).await?;
            let three = [pair.clone(), vec![c_id]].concat();
            let t0 = Instant::now();
            let c = c()?;
            samples
                .join
                .push(wait_until(observer, t0, |i| settled(i, &three)).await?);
            // (b) It is killed: its leases and announcement run out.
            let t0 = Instant::now();
            c.kill().await;
            samples
                .kill
                .push(wait_until(observer, t0, |i| hold_all(i, &pair)).await?);
            // (c) Another joins (a second join sample), then stops gracefully.
            let d_id = format!("bench-rebal-d{rep}");
            let d = start(d_id.clone()).await?;
            let three = [pair.clone(), vec![d_id]].concat();
            let t0 = Instant::now();
            let d = d()?;
            samples
                .join
                .push(wait_until(observer, t0, |i| settled(i, &three)).await?);
            let t0 = Instant::now();
            d.signal_stop();
            samples
                .leave
                .push(wait_until(observer, t0, |i| hold_all(i, &pair)).await?);
            d.join().await?;
        }
        Ok((samples, survivors))
    }

    /// `fan-out`: one consumer group vs two groups at once on the same
    /// backlog size (fresh schemas), then the producer's cost on the
    /// outboxes with one and with two groups.
    pub(super) async fn fan_out(&mut self) -> Result<()> {
        let n = self.sizes.group_backlog;
        // One group.
        let one = fresh_schema(&mut self.res, "fan1")?;
        let loader = open_pg_log(&self.services, &one, 2, |o| o).await?;
        let load1 = load_pg_log(&loader, "bench", n).await?;
        let solo = self.group_member(&one, "a").await?;
        let solo_pool = solo.store.pool().clone();
        let (d1, ()) = group_drain(
            vec![solo],
            noop_handlers(),
            self.batch,
            n,
            self.sizes.cap,
            async {},
        )
        .await?;
        solo_pool.close().await;
        // Two groups at once.
        let two = fresh_schema(&mut self.res, "fan2")?;
        let loader2 = open_pg_log(&self.services, &two, 2, |o| o).await?;
        let load2 = load_pg_log(&loader2, "bench", n).await?;
        let (a, b) = (
            self.group_member(&two, "a").await?,
            self.group_member(&two, "b").await?,
        );
        let pools = [a.store.pool().clone(), b.store.pool().clone()];
        let (cap, batch) = (self.sizes.cap, self.batch);
        let (da, db) = tokio::join!(
            group_drain(vec![a], noop_handlers(), batch, n, cap, async {}),
            group_drain(vec![b], noop_handlers(), batch, n, cap, async {}),
        );
        let ((da, ()), (db, ())) = (da?, db?);
        for p in pools {
            p.close().await;
        }

        let single = d1.rate();
        let row = Row::new(
            "fan-out",
            "event log, 1 consumer group -> no-op",
            single,
            "events/s",
        )
        .param("groups", 1u64);
        self.rows
            .push(with_usage(self.common(row, n), &d1).detail("load_s", load1.as_secs_f64()));
        for (g, d) in [("a", &da), ("b", &db)] {
            let row = Row::new(
                "fan-out",
                format!("event log, 2 consumer groups at once: group {g} -> no-op"),
                d.rate(),
                "events/s",
            )
            .param("groups", 2u64);
            let row = with_usage(self.common(row, n), d)
                .detail("load_s", load2.as_secs_f64())
                .against("1 group", single)
                .target_ratio(">= 0.9 of 1 group (reported, not asserted)", 0.9);
            self.rows.push(row.note(
                "both groups' relays run in this process: cpu_s and RSS are the process's, shared",
            ));
        }
        let wall = da.usage.wall_s.max(db.usage.wall_s);
        let both = if wall > 0.0 {
            (da.delivered + db.delivered) as f64 / wall
        } else {
            0.0
        };
        let row = Row::new(
            "fan-out",
            "event log, 2 consumer groups at once: deliveries/s of both",
            both,
            "events/s",
        )
        .param("groups", 2u64)
        .detail("wall_s", wall)
        .against("1 group", single);
        self.rows.push(self.common(row, n));

        // The producer with 1 and with 2 groups (relays stopped; rounds
        // alternate which outbox goes first).
        let m = self.sizes.fanout_producer_events;
        let outboxes = [
            (1u64, loader.outbox().clone()),
            (2u64, loader2.outbox().clone()),
        ];
        let mut took = [Duration::ZERO; 2];
        for round in 0..2 {
            for k in 0..2 {
                let k = if round % 2 == 0 { k } else { 1 - k };
                took[k] += produce_fixed(&self.services, &outboxes[k].1, m).await?;
            }
        }
        let mut writes = [0i64; 2];
        for (k, (_, outbox)) in outboxes.iter().enumerate() {
            writes[k] = writes_per_enqueue(&self.services, outbox).await?;
        }
        loader.pool().close().await;
        loader2.pool().close().await;
        let rate = |k: usize| (2 * m) as f64 / took[k].as_secs_f64().max(1e-9);
        for (k, (groups, _)) in outboxes.iter().enumerate() {
            let mut row = Row::new(
                "fan-out",
                format!(
                    "producer, 1 event per transaction, outbox with {groups} consumer group(s)"
                ),
                rate(k),
                "tx/s",
            )
            .param("groups", *groups)
            .param("events", 2 * m)
            .param("concurrency", PRODUCERS)
            .param("payload_bytes", PAYLOAD_BYTES as u64)
            .detail("rows_written_per_enqueue", writes[k]);
            if k == 1 {
                row = row
                    .against("1 group", rate(0))
                    .note("relays stopped; rows written by one enqueue transaction of one event, from its own pg_stat_xact_user_tables");
            }
            self.rows.push(row);
        }
        Ok(())
    }

    /// A relay of consumer group `group` on the event log in `schema`, with
    /// its own store and pool, reading every shard (one cursor).
    async fn group_member(&self, schema: &Ident, group: &str) -> Result<Member<PgLogStore>> {
        let store = open_pg_log(&self.services, schema, 4, |o| o.with_group(group)).await?;
        Ok(Member {
            store,
            shard: ShardSpec::ALL,
            id: format!("bench-fan-{group}"),
        })
    }
}

/// Times of the `rebalance` steps (`None`: not within [`SETTLE_CAP`]).
#[derive(Debug, Default)]
struct Samples {
    start: Vec<Option<Duration>>,
    join: Vec<Option<Duration>>,
    kill: Vec<Option<Duration>>,
    leave: Vec<Option<Duration>>,
}
