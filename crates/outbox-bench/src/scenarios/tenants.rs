//! `tenants`: one relay process over many databases, as `outbox-relay run`
//! with several `--store NAME=URL` runs it: one relay per database (each
//! named, its own event log in its own database), all in one process and
//! delivering to ONE sink (a no-op handler shared by `Arc`).
//!
//! For 1, 4 and 16 databases (`CREATE DATABASE tenant_bench_<run>_<i>`,
//! dropped at the end, also when the scenario fails):
//!
//! 1. **drain**: a backlog split evenly over the databases, every relay
//!    started at once; total events/s until the last database is drained;
//! 2. **fairness**: database 0 holds the big backlog (with more than one
//!    database) while producers on every other database commit 100 fresh
//!    events/s each; commit -> handler p99 per database. With one database
//!    there is no other: its fresh events, without a backlog, are the
//!    baseline.

use super::{open_loop, percentile, Ctx};
use crate::report::Row;
use crate::setup::{admin_pool, load_pg_log, open_pg_log, suffix, Services, EVENT_TYPE};
use anyhow::{Context, Result};
use outbox_core::{Event, ShardSpec, Store};
use outbox_postgres::{Ident, PgLogStore};
use outbox_worker::{HandlerRegistry, Relay, RelayOptions, StoreName};
use sqlx::postgres::PgPoolOptions;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Fresh events per second each producer offers in the fairness run.
const FRESH_PER_DB: u64 = 100;
/// Connections of each database's store (16 databases: 48 in all).
const STORE_CONNECTIONS: u32 = 3;

/// When each event reached the one handler.
type Seen = Arc<Mutex<HashMap<uuid::Uuid, Instant>>>;

impl Ctx {
    /// The `tenants` scenario: 1, 4 and 16 databases through one relay
    /// process.
    pub(super) async fn tenants(&mut self) -> Result<()> {
        for n in [1usize, 4, 16] {
            let run = format!("tenant_bench_{}", suffix());
            let names: Vec<String> = (0..n).map(|i| format!("{run}_{i}")).collect();
            let admin = admin_pool(&self.services).await?;
            let mut created = Vec::new();
            let mut result = Ok(());
            for name in &names {
                match sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&admin)
                    .await
                {
                    Ok(_) => created.push(name.clone()),
                    Err(e) => {
                        result = Err(anyhow::Error::new(e).context("CREATE DATABASE"));
                        break;
                    }
                }
            }
            if result.is_ok() {
                result = self.tenants_case(&names).await;
            }
            for name in created {
                if let Err(e) = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&admin)
                    .await
                {
                    tracing::warn!(database = %name, error = %e, "could not drop a tenant database");
                }
            }
            admin.close().await;
            result?;
        }
        Ok(())
    }

    /// One case: `databases` created and empty.
    async fn tenants_case(&mut self, databases: &[String]) -> Result<()> {
        let n = databases.len();
        let mut services = Vec::with_capacity(n);
        let mut stores = Vec::with_capacity(n);
        let schema = Ident::new("outbox_bench")?;
        for db in databases {
            let s = Services {
                database_url: with_database(&self.services.database_url, db),
                ..self.services.clone()
            };
            stores.push(open_pg_log(&s, &schema, STORE_CONNECTIONS, |o| o).await?);
            services.push(s);
        }
        let backlog = self.sizes.backlog;

        // 1. Drain: the backlog split over the databases.
        let per_db = backlog / n as u64;
        for store in &stores {
            load_pg_log(store, "bench", per_db).await?;
        }
        let seen: Seen = Arc::default();
        let sink = Arc::new(recording(Arc::clone(&seen)));
        let started = Instant::now();
        let mut drains = tokio::task::JoinSet::new();
        for (i, store) in stores.iter().enumerate() {
            let relay = self.tenant_relay(store.clone(), Arc::clone(&sink), i)?;
            drains.spawn(async move {
                let summary = relay.run_until_idle().await;
                (i, summary.delivered, Instant::now())
            });
        }
        let mut finished = Vec::with_capacity(n);
        while let Some(done) = drains.join_next().await {
            finished.push(done.context("a tenant relay task")?);
        }
        let total_s = started.elapsed().as_secs_f64();
        let delivered: u64 = finished.iter().map(|(_, d, _)| d).sum();
        let slowest = finished
            .iter()
            .map(|(_, _, at)| at.duration_since(started).as_secs_f64())
            .fold(0.0, f64::max);
        let fastest = finished
            .iter()
            .map(|(_, _, at)| at.duration_since(started).as_secs_f64())
            .fold(f64::INFINITY, f64::min);
        let rate = delivered as f64 / total_s;
        self.rows.push(
            self.common(
                Row::new(
                    "tenants",
                    format!("{n} database(s), one relay process: drain of {backlog} events split evenly"),
                    rate,
                    "events/s",
                ),
                backlog,
            )
            .param("databases", n as u64)
            .param("store_connections_each", u64::from(STORE_CONNECTIONS))
            .detail("delivered", delivered)
            .detail("total_s", total_s)
            .detail("first_database_drained_s", fastest)
            .detail("last_database_drained_s", slowest),
        );

        // 2. Fairness: database 0's backlog, fresh events on the others.
        let backlogged = n > 1;
        if backlogged {
            load_pg_log(&stores[0], "bench", backlog).await?;
        }
        seen.lock().map(|mut s| s.clear()).ok();
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut relays = tokio::task::JoinSet::new();
        for (i, store) in stores.iter().enumerate() {
            let relay = self.tenant_relay(store.clone(), Arc::clone(&sink), i)?;
            let mut stop = stop_rx.clone();
            relays.spawn(async move {
                relay
                    .run(async move {
                        let _ = stop.wait_for(|s| *s).await;
                    })
                    .await
                    .delivered
            });
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let fresh: Vec<usize> = if backlogged {
            (1..n).collect()
        } else {
            vec![0]
        };
        let duration = self.sizes.latency;
        let started = Instant::now();
        let mut producers = Vec::new();
        for &i in &fresh {
            let pool = PgPoolOptions::new()
                .max_connections(2)
                .connect(&services[i].database_url)
                .await?;
            producers.push((i, pool, stores[i].outbox().clone()));
        }
        let committed: Arc<Mutex<Vec<(usize, uuid::Uuid, Instant)>>> = Arc::default();
        let runs = producers.iter().map(|(i, pool, outbox)| {
            let committed = Arc::clone(&committed);
            let i = *i;
            async move {
                open_loop(
                    pool,
                    outbox,
                    (1, FRESH_PER_DB),
                    (started, duration),
                    move |ids: &[outbox_core::EventId], at: Instant| {
                        if let Ok(mut c) = committed.lock() {
                            c.extend(ids.iter().map(|id| (i, id.as_uuid(), at)));
                        }
                    },
                    |_| {},
                )
                .await
            }
        });
        let errors: Vec<String> = futures::future::join_all(runs)
            .await
            .into_iter()
            .flatten()
            .collect();
        // Let the last fresh events arrive.
        let expected = committed.lock().map(|c| c.len()).unwrap_or(0);
        let wait_until = Instant::now() + Duration::from_secs(15);
        while Instant::now() < wait_until {
            let got = match (committed.lock(), seen.lock()) {
                (Ok(c), Ok(s)) => c.iter().filter(|(_, id, _)| s.contains_key(id)).count(),
                _ => expected,
            };
            if got >= expected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let backlog_left = if backlogged {
            stores[0].stats().await.map(|s| s.pending).unwrap_or(0)
        } else {
            0
        };
        let _ = stop_tx.send(true);
        while relays.join_next().await.is_some() {}
        for (_, pool, _) in producers {
            pool.close().await;
        }

        let committed = committed.lock().map(|c| c.clone()).unwrap_or_default();
        let seen = seen.lock().map(|s| s.clone()).unwrap_or_default();
        let mut per_db: HashMap<usize, Vec<f64>> = HashMap::new();
        let mut missing = 0u64;
        for (i, id, at) in &committed {
            match seen.get(id) {
                Some(h) => per_db
                    .entry(*i)
                    .or_default()
                    .push(h.saturating_duration_since(*at).as_secs_f64() * 1e3),
                None => missing += 1,
            }
        }
        let mut p99s: Vec<(usize, f64)> = per_db
            .iter_mut()
            .map(|(i, lat)| {
                lat.sort_by(f64::total_cmp);
                (*i, percentile(lat, 0.99))
            })
            .collect();
        p99s.sort_by_key(|(i, _)| *i);
        let mut all: Vec<f64> = per_db.values().flatten().copied().collect();
        all.sort_by(f64::total_cmp);
        let worst = p99s.iter().map(|(_, p)| *p).fold(0.0, f64::max);
        let listed = p99s
            .iter()
            .map(|(i, p)| format!("db{i}={p:.1}"))
            .collect::<Vec<_>>()
            .join(" ");
        let case = if backlogged {
            format!("{n} databases: commit -> handler p99 of fresh events ({FRESH_PER_DB}/s on each of {} databases) while database 0 drains a {backlog}-event backlog; worst database", n - 1)
        } else {
            format!("1 database: commit -> handler p99 of fresh events ({FRESH_PER_DB}/s), no backlog (baseline)")
        };
        let mut row = self
            .common(
                Row::new("tenants", case, worst, "ms p99 (worst database)"),
                backlog,
            )
            .param("databases", n as u64)
            .param("fresh_events_per_s_per_database", FRESH_PER_DB)
            .param("duration_s", duration.as_secs())
            .detail("p99_ms_by_database", listed)
            .detail("p50_ms_all", percentile(&all, 0.50))
            .detail("p99_ms_all", percentile(&all, 0.99))
            .detail("max_ms_all", all.last().copied().unwrap_or(f64::NAN))
            .detail("fresh_events", committed.len() as u64)
            .detail("backlog_left_at_end", backlog_left);
        let mut notes = Vec::new();
        if missing > 0 {
            notes.push(format!("{missing} fresh events not seen by the handler"));
        }
        if let Some(e) = errors.first() {
            notes.push(format!("producer error: {e}"));
        }
        if !notes.is_empty() {
            row = row.note(notes.join("; "));
        }
        self.rows.push(row);
        for store in stores {
            store.pool().close().await;
        }
        Ok(())
    }

    /// The relay of tenant `i` as `outbox-relay run` builds it: named
    /// `tenant-<i>`, batches growing to 1,000 while it catches up.
    fn tenant_relay(
        &self,
        store: PgLogStore,
        sink: Arc<HandlerRegistry>,
        i: usize,
    ) -> Result<Relay<PgLogStore, Arc<HandlerRegistry>>> {
        let options: RelayOptions =
            crate::run::relay_options(self.batch, ShardSpec::ALL, &format!("tenant{i}"))
                .with_max_batch_size(Some(1000));
        Ok(Relay::new(store, sink, options)?
            .with_store_name(StoreName::new(format!("tenant-{i}"))?))
    }
}

/// A no-op handler that records when each event reached it.
fn recording(seen: Seen) -> HandlerRegistry {
    HandlerRegistry::new().with_handler(EVENT_TYPE, move |event: Event| {
        if let Ok(mut s) = seen.lock() {
            s.insert(event.id.as_uuid(), Instant::now());
        }
        async { Ok(()) }
    })
}

/// `url` with its database name replaced by `db` (a query string kept).
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let head = match base.rsplit_once('/') {
        Some((head, _))
            if head.contains("://") && head.len() > head.find("://").unwrap_or(0) + 3 =>
        {
            head
        }
        _ => base,
    };
    match query {
        Some(q) => format!("{head}/{db}?{q}"),
        None => format!("{head}/{db}"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_database_name_is_replaced() {
        assert_eq!(
            super::with_database("postgres://postgres@127.0.0.1:5432/test", "t1"),
            "postgres://postgres@127.0.0.1:5432/t1"
        );
        assert_eq!(
            super::with_database("postgres://u@h/test?sslmode=disable", "t1"),
            "postgres://u@h/t1?sslmode=disable"
        );
    }
}
