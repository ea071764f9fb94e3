//! `rotation-under-load` (issue 34, point 3): the event log's background
//! rotation is never starved by relays claiming back to back.
//!
//! Requirement: "with 4 relays draining a backlog back to back and
//! producers running, every rotation happens within its interval + 10 s,
//! and the log's size stays bounded."
//!
//! One event log in its own schema. A store with background rotation off
//! loads the backlog (quick 100k, full 1M) and then observes. Four relays
//! (`outbox_worker::Relay`, static shards `i/4`, no-op handler, the run's
//! batch size), each on its own `PgLogStore` and pool as four processes
//! would be, with background rotation on and a short rotation interval
//! (quick 5 s, full 20 s), start on the backlog while an open-loop producer
//! commits (quick 2k, full 5k events/s, 10 per transaction) for the whole
//! run (quick 40 s, full 3 min). What is measured is the product's own
//! background path: nothing here rotates.
//!
//! A sampler reads [`PgLogStore::log_info`] every [`SAMPLE_EVERY`]
//! (rotations, generation, the meta row's `switched_at`, rows and bytes of
//! each partition) and the events committed and delivered so far. Rotation
//! `k` is due at `switched_at(k-1) + interval` (the store's own schedule;
//! not before the relays started: the backlog's load aged the first
//! partition) and happened when it committed (the partition truncated, the
//! space given back): the first sample that saw it. That is within a
//! sample period of the commit, and closer while the rotation holds its
//! partition locked, because `log_info` (`pg_total_relation_size`) waits
//! for that lock and returns just after the commit. Lateness is the
//! difference. `switched_at(k)` itself is `now()` of the rotating
//! transaction, its *start*: the lateness of the start and how long the
//! transaction took (`took_s`, to within a sample period) are listed too.
//!
//! A rotation may legitimately wait for a cursor that has not passed the
//! partition it truncates (the backlog's): only rotations due once the
//! backlog is drained (less than half a second of production behind) are
//! judged, and each rotation's backlog when it fell due is listed. Whether
//! the cursors have passed is not asked of the store while the run goes
//! on: `group_status().holds_rotation` runs the same partition probes as
//! the rotation's own check, which (first full run) took about 10 s each
//! on the 1M partition and held it in `ACCESS SHARE` long enough to make
//! the rotation's lock time out twice. Why attempts were postponed comes
//! from the store's own debug lines, counted by [`crate::trace`]. The
//! longest time no handler ran while the producers were committing shows
//! how long the relays' claims waited behind a rotation's lock. A
//! rotation that truncated the same partition as the one before it (the
//! store's log says which it truncated) is counted apart: it read the
//! generation before the previous rotation had moved it.
//!
//! Target: every rotation due once the backlog is drained is at most
//! [`MAX_LATENESS_S`] late (one overdue at the end counts with its
//! lateness so far), and the log's rows stay under
//! `interval x rate x 3 + backlog`.

use super::{open_loop, Ctx};
use crate::report::Row;
use crate::run::{relay_options, Running};
use crate::setup::{admin_pool, fresh_schema, load_pg_log, open_pg_log, EVENT_TYPE};
use crate::trace;
use anyhow::{Context, Result};
use chrono::{DateTime, TimeDelta, Utc};
use outbox_core::{Event, ShardSpec};
use outbox_postgres::LogInfo;
use outbox_postgres::PgLogStore;
use outbox_worker::HandlerRegistry;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Relays, each reading static shard `i/RELAYS` on its own store.
const RELAYS: u32 = 4;
/// Connections of each relay's store.
const RELAY_CONNECTIONS: u32 = 4;
/// Events per producer transaction.
const PER_TX: u64 = 10;
/// How often the log's state is sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// The requirement: a rotation at most this late (s) once the backlog is drained.
const MAX_LATENESS_S: f64 = 10.0;
/// After the producers stop, how long the relays may take to deliver the rest.
const DRAIN_GRACE: Duration = Duration::from_secs(30);
/// How long statistics may take to reach the collector.
const STATS_FLUSH: Duration = Duration::from_millis(1_000);

const MIB: f64 = 1024.0 * 1024.0;

/// The log as the sampler saw it.
#[derive(Debug, Clone)]
struct Sample {
    /// When the read returned, database clock.
    now: DateTime<Utc>,
    generation: i64,
    rotations: i64,
    switched_at: DateTime<Utc>,
    /// Live rows of the partitions (statistics collector) and their bytes
    /// (table + index + TOAST).
    rows: i64,
    bytes: i64,
    /// Events committed so far (the backlog included), and delivered.
    committed: u64,
    delivered: u64,
}

impl Sample {
    fn new(info: &LogInfo, now: DateTime<Utc>, committed: u64, delivered: u64) -> Self {
        Self {
            now,
            generation: info.generation,
            rotations: info.rotations,
            switched_at: info.switched_at,
            rows: info.partitions.iter().map(|p| p.live_tuples).sum(),
            bytes: info.partitions.iter().map(|p| p.bytes).sum(),
            committed,
            delivered,
        }
    }

    /// Committed and not delivered yet.
    fn backlog(&self) -> u64 {
        self.committed.saturating_sub(self.delivered)
    }
}

/// One rotation seen by the sampler, times in seconds from the start.
#[derive(Debug, Clone, Copy)]
struct Rotated {
    due: f64,
    /// `switched_at`: when the rotating transaction began.
    at: f64,
    /// When the sampler first saw it: its commit, to within a sample period.
    seen: f64,
    /// Committed and not delivered when it fell due.
    backlog_at_due: u64,
}

impl Rotated {
    /// From when it was due to its commit.
    fn lateness(&self) -> f64 {
        self.seen - self.due
    }

    /// From when it was due to the start of the transaction that did it.
    fn start_lateness(&self) -> f64 {
        self.at - self.due
    }

    /// How long the rotating transaction took (plus up to a sample period).
    fn took(&self) -> f64 {
        self.seen - self.at
    }
}

/// The database clock minus this process's clock (same host: about 0).
async fn clock_offset(pool: &PgPool) -> Result<TimeDelta> {
    let before = Utc::now();
    let db: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await?;
    let after = Utc::now();
    Ok(db - (before + (after - before) / 2))
}

/// What the sampler needs besides the observer store.
struct Probe {
    offset: TimeDelta,
    committed: Arc<AtomicU64>,
    delivered: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

/// Samples `observer`'s log every [`SAMPLE_EVERY`] until `stop` (one last
/// sample after it).
async fn sample_until(observer: PgLogStore, p: Probe) -> Result<Vec<Sample>> {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut samples = Vec::new();
    loop {
        tick.tick().await;
        let last = p.stop.load(Ordering::Relaxed);
        let info = observer.log_info().await.context("log_info")?;
        samples.push(Sample::new(
            &info,
            Utc::now() + p.offset,
            p.committed.load(Ordering::Relaxed),
            p.delivered.load(Ordering::Relaxed),
        ));
        if last {
            return Ok(samples);
        }
    }
}

/// A no-op handler registry that records the longest time between two
/// handler calls (any relay) before `until` (µs from `t0`): how long the
/// relays delivered nothing while the producers were committing.
fn gap_handlers(t0: Instant, until: Duration, longest: Arc<AtomicU64>) -> Arc<HandlerRegistry> {
    let last = Arc::new(AtomicU64::new(0));
    let until = u64::try_from(until.as_micros()).unwrap_or(u64::MAX);
    Arc::new(
        HandlerRegistry::new().with_handler(EVENT_TYPE, move |_event: Event| {
            let now = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
            if now <= until {
                let prev = last.fetch_max(now, Ordering::Relaxed);
                longest.fetch_max(now.saturating_sub(prev), Ordering::Relaxed);
            }
            async { Ok(()) }
        }),
    )
}

/// The rotations between consecutive samples (and how many the sampler
/// missed: two in one sample period, whose due time is unknown).
fn rotations(samples: &[Sample], start: DateTime<Utc>, interval: f64) -> (Vec<Rotated>, i64) {
    let secs = |t: DateTime<Utc>| (t - start).num_microseconds().unwrap_or(0) as f64 / 1e6;
    let mut out = Vec::new();
    let mut missed = 0;
    for w in samples.windows(2) {
        let [prev, cur] = w else { continue };
        let n = cur.rotations - prev.rotations;
        if n <= 0 {
            continue;
        }
        if n > 1 {
            missed += n - 1;
            continue;
        }
        let due = (secs(prev.switched_at) + interval).max(0.0);
        let at = secs(cur.switched_at);
        let backlog_at_due = samples
            .iter()
            .find(|s| secs(s.now) >= due)
            .unwrap_or(cur)
            .backlog();
        out.push(Rotated {
            due,
            at,
            seen: secs(cur.now),
            backlog_at_due,
        });
    }
    (out, missed)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

impl Ctx {
    /// `rotation-under-load`: see the module docs.
    pub(super) async fn rotation_under_load(&mut self) -> Result<()> {
        let n = self.sizes.rotation_backlog;
        let rate = self.sizes.rotation_rate;
        let run = self.sizes.rotation_run;
        let interval = self.sizes.rotation_interval;
        let interval_s = interval.as_secs_f64();

        let schema = fresh_schema(&mut self.res, "rotload")?;
        // The loader's pool is closed after the load: that flushes its
        // statistics (an idle backend may hold them for up to 10 s), so
        // the first sample counts the backlog's rows.
        let loader = open_pg_log(&self.services, &schema, 2, |o| {
            o.with_background_rotation(false)
        })
        .await?;
        let load = load_pg_log(&loader, "bench", n).await?;
        loader.pool().close().await;
        drop(loader);
        // Observes and produces; never rotates.
        let observer = open_pg_log(&self.services, &schema, 2, |o| {
            o.with_background_rotation(false)
        })
        .await?;
        let admin = admin_pool(&self.services).await?;
        let offset = clock_offset(&admin).await?;
        tokio::time::sleep(STATS_FLUSH).await;
        let first = Sample::new(&observer.log_info().await?, Utc::now() + offset, n, 0);

        let mut stores = Vec::new();
        for _ in 0..RELAYS {
            stores.push(
                open_pg_log(&self.services, &schema, RELAY_CONNECTIONS, |o| {
                    o.with_rotation_interval(interval)
                })
                .await?,
            );
        }
        let pools: Vec<PgPool> = stores.iter().map(|s| s.pool().clone()).collect();
        let producers = PgPoolOptions::new()
            .max_connections(16)
            .connect(&self.services.database_url)
            .await?;
        let committed = Arc::new(AtomicU64::new(n));
        let delivered = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));

        // Outcomes of the background rotation from here on.
        let _ = trace::take();
        let cpu0 = crate::probe::cpu_seconds();
        let t0 = Instant::now();
        let start = Utc::now() + offset;
        let longest_gap = Arc::new(AtomicU64::new(0));
        let handlers = gap_handlers(t0, run, Arc::clone(&longest_gap));
        let mut relays = Vec::new();
        for (i, store) in (0..RELAYS).zip(stores) {
            let shard = ShardSpec::new(i, RELAYS).context("shard spec")?;
            relays.push(Running::start(
                store,
                Arc::clone(&handlers),
                relay_options(self.batch, shard, "rotload"),
                Arc::clone(&delivered),
            )?);
        }
        let sampler = tokio::spawn(sample_until(
            observer.clone(),
            Probe {
                offset,
                committed: Arc::clone(&committed),
                delivered: Arc::clone(&delivered),
                stop: Arc::clone(&stop),
            },
        ));
        let mut skipped = 0u64;
        let error = open_loop(
            &producers,
            observer.outbox(),
            (PER_TX, (rate / PER_TX).max(1)),
            (t0, run),
            {
                let committed = Arc::clone(&committed);
                move |ids: &[outbox_core::EventId], _| {
                    committed.fetch_add(ids.len() as u64, Ordering::Relaxed);
                }
            },
            |_| skipped += 1,
        )
        .await;
        let produced_s = t0.elapsed().as_secs_f64();
        let delivered_in_run = delivered.load(Ordering::Relaxed);
        let grace = Instant::now();
        while delivered.load(Ordering::Relaxed) < committed.load(Ordering::Relaxed)
            && grace.elapsed() < DRAIN_GRACE
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop.store(true, Ordering::Relaxed);
        let sampled = sampler.await.context("sampler task");
        for r in relays {
            r.stop().await?;
        }
        let cpu_s = crate::probe::cpu_seconds() - cpu0;
        let outcomes = trace::take();
        producers.close().await;
        for p in pools {
            p.close().await;
        }
        observer.pool().close().await;
        admin.close().await;
        let samples = sampled??;
        let committed = committed.load(Ordering::Relaxed);
        let delivered = delivered.load(Ordering::Relaxed);
        let left = committed.saturating_sub(delivered);

        // Rotations and their lateness.
        let secs = |t: DateTime<Utc>| (t - start).num_microseconds().unwrap_or(0) as f64 / 1e6;
        let (rotated, missed) = rotations(&samples, start, interval_s);
        let last = samples.last().unwrap_or(&first);
        // One overdue at the end counts with its lateness so far.
        let open_due = (secs(last.switched_at) + interval_s).max(0.0);
        let open = (secs(last.now) - open_due).max(0.0);
        let threshold = rate / 2;
        let drained_at = samples
            .iter()
            .find(|s| s.backlog() <= threshold)
            .map(|s| secs(s.now));
        let judged: Vec<&Rotated> = rotated
            .iter()
            .filter(|r| drained_at.is_some_and(|d| r.due >= d))
            .collect();
        let judged_max = judged.iter().map(|r| r.lateness()).fold(open, f64::max);
        let all_max = rotated.iter().map(|r| r.lateness()).fold(open, f64::max);
        let start_max = rotated
            .iter()
            .map(Rotated::start_lateness)
            .fold(0.0, f64::max);
        let took_max = rotated.iter().map(Rotated::took).fold(0.0, f64::max);
        // A rotation that truncated the partition the one before it did.
        let repeated = outcomes
            .truncated
            .windows(2)
            .filter(|w| w.first() == w.get(1))
            .count() as u64;
        let list = |f: &dyn Fn(&Rotated) -> f64| {
            format!(
                "{:?}",
                rotated.iter().map(|r| round2(f(r))).collect::<Vec<_>>()
            )
        };
        let total_s = secs(last.now);
        let mut rows = Vec::new();
        let base = |case: &str, result: f64, unit: &str| {
            self.common(Row::new("rotation-under-load", case, result, unit), n)
                .param("store", "log")
                .param("relays", RELAYS)
                .param("offered_events_per_s", rate)
                .param("events_per_tx", PER_TX)
                .param("run_s", run.as_secs())
                .param("rotation_interval_s", interval_s)
        };

        let expected = (total_s / interval_s).floor();
        let row = base(
            "rotations by the relays' background rotation",
            rotated.len() as f64 + missed as f64,
            "rotations",
        )
        .detail("expected_about", expected)
        .detail("sampled_s", round2(total_s))
        .detail("due_s", list(&|r| r.due))
        .detail("lateness_s", list(&Rotated::lateness))
        .detail("start_lateness_s", list(&Rotated::start_lateness))
        .detail("took_s", list(&Rotated::took))
        .detail("partitions_truncated", format!("{:?}", outcomes.truncated))
        .detail("same_partition_as_the_previous_rotation", repeated)
        .detail(
            "backlog_at_due",
            format!(
                "{:?}",
                rotated.iter().map(|r| r.backlog_at_due).collect::<Vec<_>>()
            ),
        )
        .detail("missed_by_sampler", missed);
        let row = if repeated > 0 {
            row.note(format!(
                "{repeated} rotation(s) truncated the same partition as the rotation before: \
                 they read the generation before the previous rotation had moved it"
            ))
        } else {
            row
        };
        rows.push(row);

        let mut row = base(
            "max rotation lateness once the backlog was drained",
            judged_max,
            "s",
        )
        .detail("rotations_judged", judged.len() as u64)
        .detail("drained_at_s", drained_at.map_or(f64::NAN, round2))
        .detail("max_lateness_whole_run_s", all_max)
        .detail("max_start_lateness_s", start_max)
        .detail("max_rotation_took_s", took_max)
        .detail("overdue_at_end_s", open)
        .detail("backlog_left_at_end", left);
        for (outcome, count) in &outcomes.counts {
            row = row.detail(&format!("attempts {outcome}"), *count);
        }
        row = match drained_at {
            Some(_) => row.target(
                format!("<= {MAX_LATENESS_S} s once the backlog is drained"),
                judged_max <= MAX_LATENESS_S,
            ),
            None => row
                .target(
                    format!("<= {MAX_LATENESS_S} s once the backlog is drained"),
                    false,
                )
                .note("the backlog was never drained"),
        };
        rows.push(row);

        let bound = interval_s * rate as f64 * 3.0 + n as f64;
        let max_rows = samples.iter().map(|s| s.rows).fold(first.rows, i64::max);
        let max_bytes = samples.iter().map(|s| s.bytes).fold(first.bytes, i64::max);
        // Once the backlog's partition was truncated (three rotations after
        // the load), what production alone keeps.
        let steady = samples
            .iter()
            .filter(|s| s.generation >= first.generation + 3)
            .map(|s| s.rows)
            .max();
        let mut row = base("event log rows, largest sample", max_rows as f64, "rows")
            .against("interval x rate x 3 + backlog", bound)
            .target("<= interval x rate x 3 + backlog", max_rows as f64 <= bound)
            .detail("rows_at_start", first.rows)
            .detail("rows_at_end", last.rows)
            .detail("mib_at_start", first.bytes as f64 / MIB)
            .detail("max_mib", max_bytes as f64 / MIB)
            .detail("mib_at_end", last.bytes as f64 / MIB)
            .detail("steady_bound_rows", interval_s * rate as f64 * 3.0);
        row = match steady {
            Some(s) => row.detail("max_rows_after_backlog_partition_truncated", s),
            None => row.note("the backlog's partition was never truncated"),
        };
        rows.push(row);

        let drain_rate = drained_at.and_then(|d| {
            let s = samples.iter().find(|s| s.backlog() <= threshold)?;
            (d > 0.0).then(|| s.delivered as f64 / d)
        });
        let mut row = base(
            "4 relays -> no-op handler, delivered per second while producing",
            delivered_in_run as f64 / produced_s.max(1e-9),
            "events/s",
        )
        .detail("events_delivered", delivered)
        .detail("events_committed", committed)
        .detail(
            "longest_no_delivery_while_producing_ms",
            longest_gap.load(Ordering::Relaxed) as f64 / 1000.0,
        )
        .detail(
            "achieved_producer_events_per_s",
            (committed - n) as f64 / produced_s.max(1e-9),
        )
        .detail("backlog_drain_events_per_s", drain_rate.unwrap_or(f64::NAN))
        .detail("load_s", load.as_secs_f64())
        .detail("cpu_s", cpu_s);
        let mut notes = Vec::new();
        if skipped > 0 {
            notes.push(format!(
                "{skipped} producer ticks skipped (producers saturated)"
            ));
        }
        if left > 0 {
            notes.push(format!(
                "{left} events not delivered {} s after the producers stopped",
                DRAIN_GRACE.as_secs()
            ));
        }
        if let Some(e) = error {
            notes.push(format!("producer error: {e}"));
        }
        if !notes.is_empty() {
            row = row.note(notes.join("; "));
        }
        rows.push(row);
        self.rows.extend(rows);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(start: DateTime<Utc>, s: f64) -> DateTime<Utc> {
        start + TimeDelta::milliseconds((s * 1000.0) as i64)
    }

    fn sample(start: DateTime<Utc>, now: f64, rotations: i64, switched: f64) -> Sample {
        Sample {
            now: at(start, now),
            generation: rotations,
            rotations,
            switched_at: at(start, switched),
            rows: 0,
            bytes: 0,
            committed: 10,
            delivered: 10,
        }
    }

    #[test]
    fn lateness_is_measured_from_the_previous_switch_not_before_the_start() {
        let start = Utc::now();
        // Switched at -30 s (the load aged it): due at the start, not before.
        let samples = vec![
            sample(start, 0.0, 0, -30.0),
            sample(start, 0.5, 1, 0.4),
            sample(start, 5.0, 1, 0.4),
            sample(start, 12.0, 2, 11.5),
            sample(start, 12.25, 4, 12.2),
        ];
        let (r, missed) = rotations(&samples, start, 5.0);
        assert_eq!(missed, 1);
        assert_eq!(r.len(), 2);
        assert!((r[0].due - 0.0).abs() < 1e-6 && (r[0].lateness() - 0.5).abs() < 1e-3);
        assert!((r[0].start_lateness() - 0.4).abs() < 1e-3);
        assert!((r[1].due - 5.4).abs() < 1e-3, "{r:?}");
        assert!((r[1].start_lateness() - 6.1).abs() < 1e-3, "{r:?}");
        assert!((r[1].lateness() - 6.6).abs() < 1e-3, "{r:?}");
        assert!((r[1].took() - 0.5).abs() < 1e-3, "{r:?}");
    }
}
