//! The scenarios, one module per scenario or family (the registry of names
//! and sizes is [`crate::registry`]): the headline drains ([`headline`]:
//! `drain`, `brokers`, `naive`, `repeatable-read`, `scale-out`), `latency`,
//! `producer`, `backlog` and the event log's own targets ([`log_targets`]),
//! `event-log` ([`event_log`]), relay and consumer groups ([`groups`]),
//! rotation under load ([`rotation`]), the queue table's blocked keys
//! ([`blocked_keys`]), the consumer half ([`inbox`]) and the event log
//! through PgBouncer ([`pooler`]). What is shared lives here: the run's
//! [`Ctx`], the handlers, the open-loop producer.

mod blocked_keys;
mod event_log;
mod groups;
mod headline;
mod inbox;
mod inbox_tuning;
pub(crate) use inbox_tuning::Tuning;
mod latency;
mod log_targets;
mod pooler;
mod producer;
mod rotation;
mod tenants;

use crate::probe::Machine;
use crate::registry::Sizes;
use crate::report::Row;
use crate::run::Drained;
use crate::setup::{admin_pool, new_event, Resources, Services, EVENT_TYPE, KEYS, PAYLOAD_BYTES};
use anyhow::{bail, Result};
use outbox_core::{Event, NewEvent};
use outbox_worker::HandlerRegistry;
use sqlx::Row as _;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// State shared by the scenarios of one run.
#[derive(Debug)]
pub(crate) struct Ctx {
    services: Services,
    quick: bool,
    batch: u32,
    sizes: Sizes,
    /// Rates measured earlier in the run, reused by later scenarios.
    cache: HashMap<String, f64>,
    res: Resources,
    pub(crate) rows: Vec<Row>,
    pub(crate) failures: Vec<String>,
    /// The inbox options of the `inbox` scenario (the product defaults
    /// unless `--inbox-options` changed them).
    pub(crate) inbox_tuning: Tuning,
}

fn noop_handlers() -> Arc<HandlerRegistry> {
    Arc::new(HandlerRegistry::new().with_handler(EVENT_TYPE, |_event: Event| async { Ok(()) }))
}

/// A no-op registry that records the id of every event its handler ran
/// for (what reached a handler, whether or not its settlement was reported).
fn recording_handlers(
    seen: Arc<Mutex<std::collections::HashSet<outbox_core::EventId>>>,
) -> Arc<HandlerRegistry> {
    Arc::new(
        HandlerRegistry::new().with_handler(EVENT_TYPE, move |event: Event| {
            seen.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(event.id);
            async { Ok(()) }
        }),
    )
}

/// Adds the usage of a drain to a row.
fn with_usage(row: Row, d: &Drained) -> Row {
    let per_event_us = if d.delivered > 0 {
        d.usage.cpu_s * 1e6 / d.delivered as f64
    } else {
        0.0
    };
    let row = row
        .detail("events", d.delivered)
        .detail("wall_s", d.usage.wall_s)
        .detail("cpu_s", d.usage.cpu_s)
        .detail("cpu_us_per_event", per_event_us)
        .detail("peak_rss_mib", d.usage.peak_rss_mib);
    match d.note() {
        Some(n) => row.note(n),
        None => row,
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

impl Ctx {
    pub(crate) fn new(services: Services, quick: bool, smoke: bool, batch: u32) -> Self {
        Self {
            services,
            quick,
            batch,
            sizes: Sizes::new(quick, smoke),
            cache: HashMap::new(),
            res: Resources::default(),
            rows: Vec::new(),
            failures: Vec::new(),
            inbox_tuning: Tuning::default(),
        }
    }

    /// The machine description, with the Postgres version and settings.
    pub(crate) async fn machine(&self) -> Machine {
        let mut m = Machine::describe();
        if let Ok(pool) = admin_pool(&self.services).await {
            let q = "SELECT current_setting('server_version'), \
                     'synchronous_commit=' || current_setting('synchronous_commit') || \
                     ', fsync=' || current_setting('fsync') || \
                     ', shared_buffers=' || current_setting('shared_buffers') || \
                     ', autovacuum=' || current_setting('autovacuum')";
            if let Ok(row) = sqlx::query(q).fetch_one(&pool).await {
                m.postgres = format!(
                    "PostgreSQL {}",
                    row.try_get::<String, _>(0).unwrap_or_default()
                );
                m.postgres_settings = row.try_get::<String, _>(1).unwrap_or_default();
            }
            pool.close().await;
        }
        m
    }

    /// Removes what the last scenario created.
    pub(crate) async fn cleanup(&mut self) {
        self.res.cleanup(&self.services).await;
    }

    /// Runs one scenario, appending its rows.
    pub(crate) async fn run(&mut self, name: &str) -> Result<()> {
        match name {
            "drain" => self.drain().await,
            "brokers" => self.brokers().await,
            "naive" => self.naive().await,
            "latency" => self.latency().await,
            "producer" => self.producer().await,
            "backlog" => self.backlog().await,
            "repeatable-read" => self.repeatable_read().await,
            "scale-out" => self.scale_out().await,
            "event-log" => self.event_log().await,
            "log-held-snapshot" => self.log_held_snapshot().await,
            "sustained" => self.sustained().await,
            "rotation-under-load" => self.rotation_under_load().await,
            "log-scale-out" => self.log_scale_out().await,
            "rebalance" => self.rebalance().await,
            "fan-out" => self.fan_out().await,
            "blocked-keys" => self.blocked_keys().await,
            "inbox" => self.inbox().await,
            "pooler" => self.pooler().await,
            "tenants" => self.tenants().await,
            other => bail!("unknown scenario {other}"),
        }
    }

    fn common(&self, row: Row, backlog: u64) -> Row {
        row.param("backlog", backlog)
            .param("batch", self.batch)
            .param("payload_bytes", PAYLOAD_BYTES as u64)
            .param("keys", KEYS)
    }
}

/// An open-loop producer: from `started` for `duration`, one transaction
/// of `per_tx` events (`enqueue_batch`) every `1 / tx_per_s` s whether or
/// not the last one finished, at most 64 in flight (a tick that finds none
/// free is skipped: `on_skip(now)`). Each commit calls `on_commit(ids,
/// committed_at)`. Returns the first error once every transaction ended.
pub(super) async fn open_loop(
    producers: &sqlx::PgPool,
    outbox: &outbox_postgres::PgOutbox,
    (per_tx, tx_per_s): (u64, u64),
    (started, duration): (Instant, Duration),
    on_commit: impl Fn(&[outbox_core::EventId], Instant) + Clone + Send + 'static,
    mut on_skip: impl FnMut(Instant),
) -> Option<String> {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / tx_per_s.max(1) as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let slots = Arc::new(Semaphore::new(64));
    let error: Arc<Mutex<Option<String>>> = Arc::default();
    let mut tasks = tokio::task::JoinSet::new();
    let mut i = 0u64;
    while started.elapsed() < duration {
        tick.tick().await;
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            on_skip(Instant::now());
            continue;
        };
        let events: Vec<NewEvent> = (i..i + per_tx).map(|j| new_event("bench", j)).collect();
        i += per_tx;
        let (pool, outbox, on_commit, error) = (
            producers.clone(),
            outbox.clone(),
            on_commit.clone(),
            Arc::clone(&error),
        );
        tasks.spawn(async move {
            let result = async {
                let mut tx = pool.begin().await?;
                let ids = outbox.enqueue_batch(&mut tx, events).await?;
                tx.commit().await?;
                anyhow::Ok(ids)
            }
            .await;
            match result {
                Ok(ids) => on_commit(&ids, Instant::now()),
                Err(e) => {
                    if let Ok(mut slot) = error.lock() {
                        slot.get_or_insert_with(|| format!("{e:#}"));
                    }
                }
            }
            drop(permit);
        });
        // Reap finished producer tasks as we go (a long run).
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let first = error.lock().ok().and_then(|mut e| e.take());
    first
}
