//! `latency`: commit -> handler latency under an offered load (an
//! open-loop producer), on the event log (the default: NOTIFY off,
//! adaptive polling) and on the queue table (LISTEN/NOTIFY).

use super::event_log::PgMode;
use super::{open_loop, percentile, Ctx};
use crate::report::Row;
use crate::setup::{pg_log_store, pg_store, EVENT_TYPE};
use anyhow::{Context, Result};
use outbox_core::{Event, Store};
use outbox_worker::HandlerRegistry;
use sqlx::postgres::PgPoolOptions;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Latency of one offered-load run.
#[derive(Debug)]
pub(super) struct Latency {
    pub(super) per_tx: u64,
    pub(super) p50: f64,
    pub(super) p99: f64,
    pub(super) max: f64,
    /// p50 / p99 / max of the events committed after the first second
    /// (the relay was idle before production began: the first events wait
    /// for its adaptive wake-up probe, see `PgLogOptions::with_probe_delays`).
    pub(super) steady: (f64, f64, f64),
    /// The largest latency of the first second's events.
    pub(super) first_max: f64,
    pub(super) mean: f64,
    pub(super) achieved: f64,
    pub(super) events: u64,
    pub(super) missing: u64,
    pub(super) skipped: u64,
    pub(super) cpu_s: f64,
    pub(super) error: Option<String>,
}

impl Ctx {
    /// Scenario 4: offered load 1k and 10k events/s.
    pub(super) async fn latency(&mut self) -> Result<()> {
        // The event log (the default mode: NOTIFY off, adaptive polling),
        // then the queue table (LISTEN/NOTIFY), on the same rates. Targets:
        // issue 11's for the log, issue 9's for the queue table.
        let runs: [(PgMode, u64, Option<f64>, f64); 4] = [
            (PgMode::Log, 1_000, Some(3.0), 15.0),
            (PgMode::Log, 10_000, None, 25.0),
            (PgMode::Queue, 1_000, Some(3.0), 10.0),
            (PgMode::Queue, 10_000, None, 25.0),
        ];
        for (mode, rate, target_p50, target_p99) in runs {
            let l = match mode {
                PgMode::Queue => {
                    let store =
                        pg_store(&self.services, &mut self.res, "latency", true, true, 6).await?;
                    let outbox = store.outbox().clone();
                    let pool = store.pool().clone();
                    let url = self.services.database_url.clone();
                    self.latency_run(store, (outbox, &url), pool, rate).await?
                }
                PgMode::Log => {
                    let store =
                        pg_log_store(&self.services, &mut self.res, "latency_log", 6).await?;
                    let outbox = store.outbox().clone();
                    let pool = store.pool().clone();
                    let url = self.services.database_url.clone();
                    self.latency_run(store, (outbox, &url), pool, rate).await?
                }
            };
            let mut target = format!("p99 <= {target_p99} ms");
            let mut met = l.p99 <= target_p99;
            if let Some(p50) = target_p50 {
                target = format!("p50 <= {p50} ms, {target}");
                met &= l.p50 <= p50;
            }
            let mut row = Row::new(
                "latency",
                format!(
                    "commit -> no-op handler, {rate} events/s offered, {}{}",
                    mode.label(),
                    match mode {
                        PgMode::Log => ", NOTIFY off (default)",
                        PgMode::Queue => ", LISTEN/NOTIFY",
                    }
                ),
                l.p99,
                "ms p99",
            )
            .param("store", mode.name())
            .param("offered_events_per_s", rate)
            .param("events_per_tx", l.per_tx)
            .param("duration_s", self.sizes.latency.as_secs())
            .param("batch", self.batch)
            .detail("p50_ms", l.p50)
            .detail("p99_ms", l.p99)
            .detail("max_ms", l.max)
            .detail("after_first_s_p50_ms", l.steady.0)
            .detail("after_first_s_p99_ms", l.steady.1)
            .detail("after_first_s_max_ms", l.steady.2)
            .detail("first_s_max_ms", l.first_max)
            .detail("mean_ms", l.mean)
            .detail("achieved_events_per_s", l.achieved)
            .detail("events", l.events)
            .detail("cpu_s", l.cpu_s);
            let mut notes = Vec::new();
            if l.missing > 0 {
                notes.push(format!("{} events not seen by the handler", l.missing));
            }
            if l.skipped > 0 {
                notes.push(format!(
                    "{} producer ticks skipped (producers saturated)",
                    l.skipped
                ));
            }
            if let Some(e) = l.error {
                notes.push(format!("producer error: {e}"));
            }
            if !notes.is_empty() {
                row = row.note(notes.join("; "));
            }
            self.rows.push(row.target(target, met));
        }
        Ok(())
    }

    /// Offers `rate` events/s through `outbox` for the latency duration,
    /// the producers connected to `producers_url`, while a relay on `store`
    /// runs a no-op handler; closes `pool` (the store's) at the end.
    pub(super) async fn latency_run<St: Store + Clone>(
        &mut self,
        store: St,
        (outbox, producers_url): (outbox_postgres::PgOutbox, &str),
        pool: sqlx::PgPool,
        rate: u64,
    ) -> Result<Latency> {
        let producers = PgPoolOptions::new()
            .max_connections(16)
            .connect(producers_url)
            .await?;
        let committed: Arc<Mutex<Vec<(uuid::Uuid, Instant)>>> = Arc::default();
        let handled: Arc<Mutex<HashMap<uuid::Uuid, Instant>>> = Arc::default();
        let seen = Arc::clone(&handled);
        let handlers = HandlerRegistry::new().with_handler(EVENT_TYPE, move |event: Event| {
            let seen = Arc::clone(&seen);
            async move {
                let now = Instant::now();
                if let Ok(mut s) = seen.lock() {
                    s.insert(event.id.as_uuid(), now);
                }
                Ok(())
            }
        });
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let relay = outbox_worker::Relay::new(
            store.clone(),
            handlers,
            crate::run::relay_options(self.batch, outbox_core::ShardSpec::ALL, "latency"),
        )?;
        let cpu0 = crate::probe::cpu_seconds();
        let relay = tokio::spawn(relay.run(async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        }));
        // Let the LISTEN connection come up before producing.
        tokio::time::sleep(Duration::from_millis(300)).await;

        let per_tx = (rate / 1000).max(1);
        let tx_per_s = rate / per_tx;
        let started = Instant::now();
        let mut skipped = 0u64;
        let on_commit = {
            let committed = Arc::clone(&committed);
            move |ids: &[outbox_core::EventId], at: Instant| {
                if let Ok(mut c) = committed.lock() {
                    c.extend(ids.iter().map(|id| (id.as_uuid(), at)));
                }
            }
        };
        let error = open_loop(
            &producers,
            &outbox,
            (per_tx, tx_per_s),
            (started, self.sizes.latency),
            on_commit,
            |_| skipped += 1,
        )
        .await;
        let produced_for = started.elapsed().as_secs_f64();
        let expected = committed.lock().map(|c| c.len()).unwrap_or(0);
        let wait_until = Instant::now() + Duration::from_secs(15);
        while Instant::now() < wait_until {
            let n = handled.lock().map(|h| h.len()).unwrap_or(0);
            if n >= expected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = stop_tx.send(true);
        relay.await.context("relay task")?;
        let cpu_s = crate::probe::cpu_seconds() - cpu0;
        producers.close().await;
        pool.close().await;

        let committed = committed.lock().map(|c| c.clone()).unwrap_or_default();
        let handled = handled.lock().map(|h| h.clone()).unwrap_or_default();
        let mut lat: Vec<f64> = Vec::with_capacity(committed.len());
        let mut steady: Vec<f64> = Vec::with_capacity(committed.len());
        let mut first_max = f64::NAN;
        let warm_until = started + Duration::from_secs(1);
        let mut missing = 0u64;
        for (id, at) in &committed {
            match handled.get(id) {
                Some(h) => {
                    let ms = h.saturating_duration_since(*at).as_secs_f64() * 1000.0;
                    lat.push(ms);
                    if *at >= warm_until {
                        steady.push(ms);
                    } else {
                        first_max = first_max.max(ms);
                    }
                }
                None => missing += 1,
            }
        }
        lat.sort_by(f64::total_cmp);
        steady.sort_by(f64::total_cmp);
        let mean = if lat.is_empty() {
            f64::NAN
        } else {
            lat.iter().sum::<f64>() / lat.len() as f64
        };
        Ok(Latency {
            per_tx,
            p50: percentile(&lat, 0.50),
            p99: percentile(&lat, 0.99),
            max: lat.last().copied().unwrap_or(f64::NAN),
            steady: (
                percentile(&steady, 0.50),
                percentile(&steady, 0.99),
                steady.last().copied().unwrap_or(f64::NAN),
            ),
            first_max,
            mean,
            achieved: committed.len() as f64 / produced_for,
            events: committed.len() as u64,
            missing,
            skipped,
            cpu_s,
            error,
        })
    }
}
