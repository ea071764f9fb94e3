//! `pooler`: the event log with the relay's store (and, for the latency,
//! the producers) connected straight to PostgreSQL vs through PgBouncer in
//! transaction mode (`PGBOUNCER_URL`, default
//! `postgres://postgres@127.0.0.1:6432/test`, started by `cargo xtask
//! services`), issue 43's targets: the drain through the pooler at least
//! 0.8 of the direct one, its p99 commit -> handler latency at 1k events/s
//! within 2 ms of the direct one.
//!
//! Through the pooler the store runs every statement in a transaction,
//! unnamed (outbox-postgres's `db.rs`): a claim pays a parse and a plan of
//! its statements, and the `BEGIN` / `COMMIT` round trips the pooler needs
//! to keep a server connection for the whole exchange. The producers
//! commit through the same path as the store: through the pooler with
//! `PgOutbox::with_pooler(Pooler::Transaction)` (unnamed INSERTs).
//!
//! A third route splits the cost: straight to PostgreSQL with the store
//! and the producers told `Pooler::Transaction` (the pooled statement
//! handling without the pooler's hop). Its rows have no target.

use super::latency::Latency;
use super::{noop_handlers, with_usage, Ctx};
use crate::report::Row;
use crate::run::{relay_drain, Drained};
use crate::setup::{fresh_schema, load_pg_log, open_pg_log};
use anyhow::{bail, Context, Result};
use outbox_core::Pooler;
use outbox_postgres::{Ident, PgLogOptions, PgLogStore};

/// Where `PGBOUNCER_URL` points when unset (`cargo xtask services`).
const DEFAULT_PGBOUNCER_URL: &str = "postgres://postgres@127.0.0.1:6432/test";

/// Target: the drain through the pooler over the direct drain.
const DRAIN_TARGET: f64 = 0.8;

/// Target: the p99 latency through the pooler at most this much above the
/// direct p99, ms.
const P99_SLACK_MS: f64 = 2.0;

/// Offered load of the latency runs, events/s (one per transaction).
const LATENCY_RATE: u64 = 1_000;

/// Connections of each store's pool (as the headline drains: 4 + 2 per
/// relay).
const CONNS: u32 = 6;

/// How the store and the producers reach PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// Straight to the server.
    Direct,
    /// Through PgBouncer in transaction mode.
    PgBouncer,
    /// Straight to the server, statements as through a pooler in
    /// transaction mode (`Pooler::Transaction` named).
    DirectPooledMode,
}

/// The routes, in the order of the rows.
const ROUTES: [Route; 3] = [Route::Direct, Route::PgBouncer, Route::DirectPooledMode];

impl Route {
    fn name(self) -> &'static str {
        match self {
            Route::Direct => "direct",
            Route::PgBouncer => "pgbouncer",
            Route::DirectPooledMode => "direct-pooled-mode",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Route::Direct => "direct to PostgreSQL",
            Route::PgBouncer => "through PgBouncer (transaction mode)",
            Route::DirectPooledMode => {
                "direct, statements as through a pooler (Pooler::Transaction; split of the cost)"
            }
        }
    }

    fn index(self) -> usize {
        match self {
            Route::Direct => 0,
            Route::PgBouncer => 1,
            Route::DirectPooledMode => 2,
        }
    }
}

/// `PGBOUNCER_URL`, or PgBouncer on the loopback.
fn pgbouncer_url() -> String {
    std::env::var("PGBOUNCER_URL").unwrap_or_else(|_| DEFAULT_PGBOUNCER_URL.to_owned())
}

impl Ctx {
    /// The drain (median of interleaved rounds) and the latency, each
    /// direct and through PgBouncer.
    pub(super) async fn pooler(&mut self) -> Result<()> {
        let url = pgbouncer_url();
        self.pooler_drains(&url).await?;
        self.pooler_latency(&url).await
    }

    /// `log_rounds` rounds of one relay draining a fresh backlog to the
    /// no-op handler on each route, the order rotating per round; the
    /// medians are reported, the others against the direct one.
    async fn pooler_drains(&mut self, url: &str) -> Result<()> {
        let n = self.sizes.backlog;
        let rounds = self.sizes.log_rounds.max(2);
        let mut runs: [Vec<(Drained, f64)>; 3] = Default::default();
        for round in 0..rounds {
            // Rotate which route goes first, so that none always runs on
            // the warmer (or busier) moment.
            let mut order = ROUTES;
            order.rotate_left(round as usize % ROUTES.len());
            for route in order {
                let m = self.pooler_drain(route, n, url).await;
                // Each backlog's schema goes at once (disk).
                self.cleanup().await;
                let (d, load_s) = m?;
                eprintln!(
                    "   round {}: {:<40} {:>10.0} events/s",
                    round + 1,
                    route.label(),
                    d.rate()
                );
                runs[route.index()].push((d, load_s));
            }
        }
        let mut direct_rate = 0.0;
        for (route, mut ms) in ROUTES.into_iter().zip(runs) {
            ms.sort_by(|a, b| a.0.rate().total_cmp(&b.0.rate()));
            let Some((m, load_s)) = ms.get(ms.len() / 2) else {
                continue;
            };
            let case = format!("relay -> no-op handler, event log, {}", route.label());
            let row = Row::new("pooler", case, m.rate(), "events/s")
                .param("store", "log")
                .param("route", route.name())
                .param("relays", 1)
                .param("rounds", rounds);
            let mut row = with_usage(self.common(row, n), m)
                .detail("load_s", *load_s)
                .detail("rate_min", ms.first().map_or(0.0, |m| m.0.rate().round()))
                .detail("rate_max", ms.last().map_or(0.0, |m| m.0.rate().round()));
            if ms.iter().any(|m| m.0.capped) {
                row = row.note("a round hit the time cap");
            }
            match route {
                Route::Direct => direct_rate = m.rate(),
                Route::PgBouncer => {
                    row = row
                        .against("direct, same rounds (median)", direct_rate)
                        .target_ratio(format!(">= {DRAIN_TARGET} of direct"), DRAIN_TARGET);
                }
                Route::DirectPooledMode => {
                    row = row.against("direct, same rounds (median)", direct_rate);
                }
            }
            self.rows.push(row);
        }
        Ok(())
    }

    /// One drain of a fresh `n` backlog by one relay whose store reaches
    /// PostgreSQL by `route`. The backlog is loaded by a direct store that
    /// is closed before the measured store opens (either route: a fresh
    /// pool each). Returns the drain and the load time, s.
    async fn pooler_drain(&mut self, route: Route, n: u64, url: &str) -> Result<(Drained, f64)> {
        let schema = fresh_schema(
            &mut self.res,
            &format!("pooler_{}", route.name().replace('-', "_")),
        )?;
        let loader = open_pg_log(&self.services, &schema, CONNS, |o| o).await?;
        let load = load_pg_log(&loader, "bench", n).await?;
        loader.pool().close().await;
        drop(loader);
        let store = self.route_store(route, &schema, url).await?;
        let pool = store.pool().clone();
        let drained = relay_drain(store, noop_handlers(), self.batch, 1, n, self.sizes.cap).await;
        pool.close().await;
        Ok((drained?, load.as_secs_f64()))
    }

    /// An event-log store on `schema` (already migrated) reached by
    /// `route`; through the pooler, one that found it (the product
    /// default, `Pooler::Auto`).
    async fn route_store(&self, route: Route, schema: &Ident, url: &str) -> Result<PgLogStore> {
        match route {
            Route::Direct => open_pg_log(&self.services, schema, CONNS, |o| o).await,
            Route::DirectPooledMode => {
                open_pg_log(&self.services, schema, CONNS, |o| {
                    o.with_pooler(Pooler::Transaction)
                })
                .await
            }
            Route::PgBouncer => {
                let options = PgLogOptions::new(url.to_owned())
                    .with_schema(schema.clone())
                    .with_max_connections(CONNS);
                let store = PgLogStore::connect(options).await.with_context(|| {
                    format!(
                        "cannot open the event log through PgBouncer at {} (PGBOUNCER_URL; \
                         `cargo xtask services` starts it)",
                        outbox_core::redact_url(url)
                    )
                })?;
                if store.pooler() != Pooler::Transaction {
                    bail!(
                        "the store at {} did not find a pooler in transaction mode (found {}): \
                         PGBOUNCER_URL must point at PgBouncer",
                        outbox_core::redact_url(url),
                        store.pooler()
                    );
                }
                Ok(store)
            }
        }
    }

    /// The commit -> handler latency at [`LATENCY_RATE`] offered on each
    /// route (store and producers alike), each on a fresh schema; the
    /// others' p99 against the direct one.
    async fn pooler_latency(&mut self, url: &str) -> Result<()> {
        let mut direct: Option<Latency> = None;
        for route in ROUTES {
            let schema = fresh_schema(
                &mut self.res,
                &format!("pooler_lat_{}", route.name().replace('-', "_")),
            )?;
            // Migrated by a direct store, as for the drains.
            let loader = open_pg_log(&self.services, &schema, 2, |o| o).await?;
            loader.pool().close().await;
            drop(loader);
            let store = self.route_store(route, &schema, url).await?;
            let pool = store.pool().clone();
            let (outbox, producers_url) = match route {
                Route::Direct => (store.outbox().clone(), self.services.database_url.clone()),
                Route::PgBouncer => (
                    store.outbox().clone().with_pooler(Pooler::Transaction),
                    url.to_owned(),
                ),
                Route::DirectPooledMode => (
                    store.outbox().clone().with_pooler(Pooler::Transaction),
                    self.services.database_url.clone(),
                ),
            };
            let l = self
                .latency_run(store, (outbox, &producers_url), pool, LATENCY_RATE)
                .await?;
            self.cleanup().await;
            let mut row = Row::new(
                "pooler",
                format!(
                    "commit -> no-op handler, {LATENCY_RATE} events/s offered, event log, {}",
                    route.label()
                ),
                l.p99,
                "ms p99",
            )
            .param("store", "log")
            .param("route", route.name())
            .param("offered_events_per_s", LATENCY_RATE)
            .param("events_per_tx", l.per_tx)
            .param("duration_s", self.sizes.latency.as_secs())
            .param("batch", self.batch)
            .detail("p50_ms", l.p50)
            .detail("p99_ms", l.p99)
            .detail("max_ms", l.max)
            .detail("after_first_s_p50_ms", l.steady.0)
            .detail("after_first_s_p99_ms", l.steady.1)
            .detail("mean_ms", l.mean)
            .detail("achieved_events_per_s", l.achieved)
            .detail("events", l.events)
            .detail("cpu_s", l.cpu_s);
            if let Some(d) = &direct {
                let diff = l.p99 - d.p99;
                row = row
                    .against("direct p99", d.p99)
                    .detail("p99_minus_direct_ms", diff)
                    .detail("p50_minus_direct_ms", l.p50 - d.p50);
                if route == Route::PgBouncer {
                    row = row.target(
                        format!("p99 <= direct p99 + {P99_SLACK_MS} ms"),
                        diff <= P99_SLACK_MS && l.missing == 0,
                    );
                }
            }
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
            if let Some(e) = &l.error {
                notes.push(format!("producer error: {e}"));
            }
            if !notes.is_empty() {
                row = row.note(notes.join("; "));
            }
            self.rows.push(row);
            if route == Route::Direct {
                direct = Some(l);
            }
        }
        Ok(())
    }
}
