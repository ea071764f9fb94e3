//! `event-log`: the event log (the default) against the queue table on the
//! same backlog, claim+settle loop and relay, clean and with a REPEATABLE
//! READ snapshot held; and the per-mode drain ([`Ctx::pg_mode_drain`]) the
//! headline scenarios use for their event-log rows and queue-table
//! comparison rows.

use super::{noop_handlers, with_usage, Ctx};
use crate::report::Row;
use crate::run::{relay_drain, store_ceiling, Drained};
use crate::setup::{
    admin_pool, hold_snapshot, load_pg, load_pg_log, pg_log_store, pg_store, release_snapshot,
    Services,
};
use anyhow::Result;
use outbox_core::{Sink, Store};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

impl Ctx {
    /// The event log ([`outbox_postgres::PgLogStore`], the default) against the
    /// queue table ([`outbox_postgres::PgStore`]) on the same backlog: each
    /// store's claim+settle loop (no sink) and the real relay to the no-op
    /// handler, first clean, then with another connection holding a
    /// REPEATABLE READ snapshot through the drain (ratio vs clean). Every
    /// measurement has its own fresh schema; queue and log alternate so
    /// that machine noise hits both, and the median of a few rounds is
    /// reported (one drain of the log takes under a second at 100k).
    /// The store and loop helpers below serve the headline scenarios too.
    pub(super) async fn event_log(&mut self) -> Result<()> {
        let n = self.sizes.backlog;
        let rounds = self.sizes.log_rounds.max(1);
        let mut runs: HashMap<(bool, Loop, PgMode), Vec<ModeDrain>> = HashMap::new();
        for round in 0..rounds {
            // Alternate which store goes first, so neither always runs on
            // the warmer (or busier) moment.
            let modes = if round % 2 == 0 {
                [PgMode::Queue, PgMode::Log]
            } else {
                [PgMode::Log, PgMode::Queue]
            };
            for held in [false, true] {
                for lp in [Loop::Ceiling, Loop::Relay] {
                    for mode in modes {
                        let m = self
                            .pg_mode_drain(mode, lp, held, n, "bench", noop_handlers(), 1)
                            .await?;
                        // Each backlog's schema goes at once (disk).
                        self.cleanup().await;
                        runs.entry((held, lp, mode)).or_default().push(m);
                    }
                }
            }
        }
        // The median round of each case (by rate); min and max in details.
        let mut median: HashMap<(bool, Loop, PgMode), f64> = HashMap::new();
        for held in [false, true] {
            for lp in [Loop::Ceiling, Loop::Relay] {
                for mode in [PgMode::Queue, PgMode::Log] {
                    let mut ms = runs.remove(&(held, lp, mode)).unwrap_or_default();
                    ms.sort_by(|a, b| a.drained.rate().total_cmp(&b.drained.rate()));
                    let Some(m) = ms.get(ms.len() / 2) else {
                        continue;
                    };
                    let snapshot = if held {
                        "REPEATABLE READ snapshot held"
                    } else {
                        "clean"
                    };
                    let case = format!("{}, {}, {snapshot}", lp.label(), mode.label());
                    let row = Row::new("event-log", case, m.drained.rate(), "events/s")
                        .param("store", mode.name())
                        .param("snapshot_held", held)
                        .param("rounds", rounds);
                    let mut row = with_usage(self.common(row, n), &m.drained)
                        .detail("load_s", m.load_s)
                        .detail("n_dead_tup_after_drain", m.dead.0)
                        .detail("n_dead_tup_after_vacuum", m.dead.1);
                    if ms.len() > 1 {
                        let first = ms.first().map_or(0.0, |m| m.drained.rate());
                        let last = ms.last().map_or(0.0, |m| m.drained.rate());
                        row = row
                            .detail("rate_min", first.round())
                            .detail("rate_max", last.round());
                    }
                    if ms.iter().any(|m| m.drained.capped) {
                        row = row.note("a round hit the time cap");
                    }
                    if held {
                        let base = median.get(&(false, lp, mode)).copied().unwrap_or(0.0);
                        row = row.against(format!("{} clean (median)", mode.name()), base);
                    } else if mode == PgMode::Log {
                        let base = median
                            .get(&(false, lp, PgMode::Queue))
                            .copied()
                            .unwrap_or(0.0);
                        row = row.against("queue table, same loop (median)", base);
                    }
                    median.insert((held, lp, mode), m.drained.rate());
                    self.rows.push(row);
                }
            }
        }
        Ok(())
    }

    /// One drain of a fresh `n` backlog of `topic` in a fresh schema of
    /// `mode`: the store's claim+settle loop, or `relays` relays (static
    /// shards i/n, clones of one store) delivering to `sink`, with a
    /// REPEATABLE READ snapshot held through it if `held`.
    #[allow(
        clippy::too_many_arguments,
        reason = "the one drain every headline scenario varies"
    )]
    pub(super) async fn pg_mode_drain<Si: Sink>(
        &mut self,
        mode: PgMode,
        lp: Loop,
        held: bool,
        n: u64,
        topic: &str,
        sink: Arc<Si>,
        relays: u32,
    ) -> Result<ModeDrain> {
        let label = format!(
            "{}_{}{}{}",
            mode.name(),
            lp.name(),
            if held { "_rr" } else { "" },
            if relays > 1 {
                format!("_{relays}")
            } else {
                String::new()
            }
        );
        let conns = 4 + 2 * relays;
        let (batch, cap) = (self.batch, self.sizes.cap);
        match mode {
            PgMode::Queue => {
                let relay = lp == Loop::Relay;
                let store =
                    pg_store(&self.services, &mut self.res, &label, false, relay, conns).await?;
                let load = load_pg(&store, topic, n).await?;
                let schema = store.outbox().schema().as_str().to_owned();
                self.timed_drain(
                    store.clone(),
                    (lp, sink, relays),
                    held,
                    n,
                    (batch, cap),
                    load,
                    &schema,
                    || {
                        let pool = store.pool().clone();
                        async move { pool.close().await }
                    },
                )
                .await
            }
            PgMode::Log => {
                let store = pg_log_store(&self.services, &mut self.res, &label, conns).await?;
                let load = load_pg_log(&store, topic, n).await?;
                let schema = store.outbox().schema().as_str().to_owned();
                let pool = store.pool().clone();
                let m = self
                    .timed_drain(
                        store,
                        (lp, sink, relays),
                        held,
                        n,
                        (batch, cap),
                        load,
                        &schema,
                        || async move {
                            pool.close().await;
                        },
                    )
                    .await?;
                Ok(m)
            }
        }
    }

    /// Holds a snapshot if asked, drains `store` with `lp` (to `sink` by
    /// `relays` relays), closes the
    /// store's pool (`close`, which also flushes its table statistics),
    /// reads the schema's dead tuples, releases the snapshot.
    #[allow(
        clippy::too_many_arguments,
        reason = "one private helper of one scenario"
    )]
    async fn timed_drain<St, Si, F, Fut>(
        &self,
        store: St,
        (lp, sink, relays): (Loop, Arc<Si>, u32),
        held: bool,
        n: u64,
        (batch, cap): (u32, Duration),
        load: Duration,
        schema: &str,
        close: F,
    ) -> Result<ModeDrain>
    where
        St: Store + Clone,
        Si: Sink,
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let holder = if held {
            Some(hold_snapshot(&self.services).await?)
        } else {
            None
        };
        let drained = match lp {
            Loop::Ceiling => store_ceiling(&store, batch, n, cap).await,
            Loop::Relay => relay_drain(store.clone(), sink, batch, relays, n, cap).await,
        };
        close().await;
        drop(store);
        let dead = schema_dead_tuples(&self.services, schema).await;
        if let Some(conn) = holder {
            release_snapshot(conn).await?;
        }
        Ok(ModeDrain {
            drained: drained?,
            load_s: load.as_secs_f64(),
            dead: dead?,
        })
    }
}

/// The two PostgreSQL stores: the event log (the default) and the queue
/// table (the comparison row of every headline scenario).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum PgMode {
    /// `PgStore`: rows updated at claim, deleted at settle.
    Queue,
    /// `PgLogStore`: append-only log read in snapshot windows, a cursor per shard.
    Log,
}

impl PgMode {
    pub(super) fn name(self) -> &'static str {
        match self {
            PgMode::Queue => "queue",
            PgMode::Log => "log",
        }
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            PgMode::Queue => "queue table (PgStore)",
            PgMode::Log => "event log (PgLogStore)",
        }
    }
}

/// The two loops measured on a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Loop {
    /// The store's claim + settle(all delivered) loop, no sink.
    Ceiling,
    /// The real relay to a sink (the no-op handler or a broker).
    Relay,
}

impl Loop {
    pub(super) fn name(self) -> &'static str {
        match self {
            Loop::Ceiling => "ceil",
            Loop::Relay => "relay",
        }
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            Loop::Ceiling => "store claim+settle (no sink)",
            Loop::Relay => "relay -> no-op handler",
        }
    }
}

/// One measurement of [`Ctx::pg_mode_drain`].
#[derive(Debug)]
pub(super) struct ModeDrain {
    pub(super) drained: Drained,
    pub(super) load_s: f64,
    /// Dead tuples in the store's schema after the drain, and after a VACUUM
    /// run while the snapshot (if any) is still held.
    pub(super) dead: (i64, i64),
}

/// The sum of `n_dead_tup` over the tables of `schema` after a drain, and
/// after a VACUUM of each (which cannot remove tuples a held snapshot may
/// still see).
pub(super) async fn schema_dead_tuples(services: &Services, schema: &str) -> Result<(i64, i64)> {
    let pool = admin_pool(services).await?;
    let sum = "SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables \
               WHERE schemaname = $1";
    tokio::time::sleep(Duration::from_millis(700)).await;
    let before: i64 = sqlx::query_scalar(sum)
        .bind(schema)
        .fetch_one(&pool)
        .await?;
    let tables: Vec<String> =
        sqlx::query_scalar("SELECT relname::text FROM pg_stat_user_tables WHERE schemaname = $1")
            .bind(schema)
            .fetch_all(&pool)
            .await?;
    for t in tables {
        sqlx::query(&format!("VACUUM \"{schema}\".\"{t}\""))
            .execute(&pool)
            .await?;
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    let after: i64 = sqlx::query_scalar(sum)
        .bind(schema)
        .fetch_one(&pool)
        .await?;
    pool.close().await;
    Ok((before, after))
}
