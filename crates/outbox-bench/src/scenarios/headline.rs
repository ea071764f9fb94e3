//! The headline scenarios: `drain`, `brokers`, `naive`, `repeatable-read`
//! and `scale-out`. Each measures the event log (`PgLogStore`, the default
//! of the relay, of `PgOutbox::new` and of `migrate`) and then, as a
//! comparison row, the queue table (`PgStore`) on the same sizes, each
//! against a ceiling measured in the same run.

use super::event_log::{Loop, ModeDrain, PgMode};
use super::{noop_handlers, with_usage, Ctx};
use crate::report::Row;
use crate::run::{naive, relay_drain, sink_ceiling, store_ceiling, Drained};
use crate::setup::{
    broker, load_pg, load_sqlite, pg_store, sqlite_store, Broker, BrokerSink, PAYLOAD_BYTES,
};
use anyhow::{bail, Result};
use std::sync::Arc;

/// Both PostgreSQL stores, the default first.
const MODES: [PgMode; 2] = [PgMode::Log, PgMode::Queue];

/// The target of a relay to a broker: at least this share of the slower of
/// the store's and the broker's ceilings.
const BROKER_TARGET: f64 = 0.8;

/// The rate of a relay that claimed, delivered and settled strictly in
/// turn: the serial composition of the store's and the broker's ceilings.
/// A relay that overlaps claim and delivery runs above it when the machine
/// has CPU to spare, near it when the store, the broker and the relay
/// compete for the same saturated cores.
fn serial(store: f64, broker: f64) -> f64 {
    if store <= 0.0 || broker <= 0.0 {
        return f64::NAN;
    }
    1.0 / (1.0 / store + 1.0 / broker)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// How a row names its store: the default, or the comparison.
fn store_label(mode: PgMode) -> String {
    match mode {
        PgMode::Log => format!("{} (default)", mode.label()),
        PgMode::Queue => format!("{} (comparison)", mode.label()),
    }
}

impl Ctx {
    /// The claim+settle ceiling of `mode`'s store on a fresh `n` backlog
    /// (no sink), measured once per run and size: the row goes to
    /// `scenario`, the scenario that needed it first.
    async fn mode_ceiling(&mut self, mode: PgMode, n: u64, scenario: &str) -> Result<f64> {
        let key = format!("ceiling-{}-{n}", mode.name());
        if let Some(v) = self.cache.get(&key) {
            return Ok(*v);
        }
        let m = self
            .pg_mode_drain(mode, Loop::Ceiling, false, n, "bench", noop_handlers(), 1)
            .await?;
        let row = Row::new(
            scenario,
            format!("CEILING store claim+settle, {} (no sink)", mode.label()),
            m.drained.rate(),
            "events/s",
        )
        .param("store", mode.name());
        let row = with_usage(self.common(row, n), &m.drained).detail("load_s", m.load_s);
        self.rows.push(row);
        self.cache.insert(key, m.drained.rate());
        self.cleanup().await;
        Ok(m.drained.rate())
    }

    /// One relay draining a fresh `n` backlog of `mode` to the no-op
    /// handler; the rate is remembered for later scenarios.
    async fn mode_noop_drain(&mut self, mode: PgMode, n: u64) -> Result<ModeDrain> {
        let m = self
            .pg_mode_drain(mode, Loop::Relay, false, n, "bench", noop_handlers(), 1)
            .await?;
        if !m.drained.capped {
            self.cache
                .insert(format!("noop-{}-{n}", mode.name()), m.drained.rate());
        }
        self.cleanup().await;
        Ok(m)
    }

    /// The relay's rate of `mode` to the no-op handler on `n` events from
    /// earlier in the run, or measured now.
    pub(super) async fn mode_noop_rate(&mut self, mode: PgMode, n: u64) -> Result<f64> {
        if let Some(v) = self.cache.get(&format!("noop-{}-{n}", mode.name())) {
            return Ok(*v);
        }
        Ok(self.mode_noop_drain(mode, n).await?.drained.rate())
    }

    /// `drain`: the relay to the no-op handler against the store's own
    /// claim+settle ceiling, event log then queue table, then SQLite.
    pub(super) async fn drain(&mut self) -> Result<()> {
        let n = self.sizes.backlog;
        for mode in MODES {
            let ceiling = self.mode_ceiling(mode, n, "drain").await?;
            let m = self.mode_noop_drain(mode, n).await?;
            let row = Row::new(
                "drain",
                format!("relay {} -> no-op handler", store_label(mode)),
                m.drained.rate(),
                "events/s",
            )
            .param("store", mode.name());
            let row = with_usage(self.common(row, n), &m.drained)
                .detail("load_s", m.load_s)
                .against(format!("{} ceiling", mode.name()), ceiling);
            self.rows
                .push(row.target_ratio(">= 50% of store ceiling", 0.5));
        }

        // SQLite: ceiling and relay on two fresh files.
        let store = sqlite_store(&mut self.res, "ceiling").await?;
        let load = load_sqlite(&store, "bench", n).await?;
        let c = store_ceiling(&store, self.batch, n, self.sizes.cap).await?;
        store.pool().close().await;
        let row = Row::new(
            "drain",
            "CEILING store claim+settle, sqlite (no sink)",
            c.rate(),
            "events/s",
        );
        self.rows
            .push(with_usage(self.common(row, n), &c).detail("load_s", load.as_secs_f64()));
        let store = sqlite_store(&mut self.res, "noop").await?;
        let load = load_sqlite(&store, "bench", n).await?;
        let d = relay_drain(
            store.clone(),
            noop_handlers(),
            self.batch,
            1,
            n,
            self.sizes.cap,
        )
        .await?;
        store.pool().close().await;
        let row = Row::new(
            "drain",
            "relay sqlite -> no-op handler",
            d.rate(),
            "events/s",
        );
        let row = with_usage(self.common(row, n), &d)
            .detail("load_s", load.as_secs_f64())
            .against("store ceiling", c.rate());
        self.rows
            .push(row.target_ratio(">= 50% of store ceiling", 0.5));
        Ok(())
    }

    /// `brokers`: each broker's publish-with-ack ceiling (no database),
    /// then the relay from a fresh backlog of each store to it, against
    /// the slower of the two ceilings.
    pub(super) async fn brokers(&mut self) -> Result<()> {
        let n = self.sizes.backlog;
        let mut ceilings = Vec::new();
        for mode in MODES {
            ceilings.push((mode, self.mode_ceiling(mode, n, "brokers").await?));
        }
        let mut errors = Vec::new();
        for b in Broker::ALL {
            if let Err(e) = self.one_broker(b, n, &ceilings).await {
                eprintln!("!! broker {}: {e:#}", b.name());
                errors.push(format!("{}: {e:#}", b.name()));
            }
            self.cleanup().await;
        }
        if !errors.is_empty() {
            bail!("{}", errors.join("; "));
        }
        Ok(())
    }

    /// `b`'s ceiling, then one relay per store mode to a fresh destination.
    async fn one_broker(&mut self, b: Broker, n: u64, ceilings: &[(PgMode, f64)]) -> Result<()> {
        let (sink, topic) = broker(&self.services, &mut self.res, b, "ceiling").await?;
        let total = self.sizes.ceiling_events;
        let c = sink_ceiling(&sink, &topic, self.batch, total, self.sizes.cap).await?;
        drop(sink);
        let row = Row::new(
            "brokers",
            format!(
                "CEILING {} publish-with-ack, publisher.deliver, no database",
                b.name()
            ),
            c.rate(),
            "events/s",
        );
        let row = row
            .param("events", total)
            .param("events_per_deliver_call", self.batch)
            .param("payload_bytes", PAYLOAD_BYTES as u64);
        self.rows.push(with_usage(row, &c));
        if c.delivered == 0 {
            bail!(
                "{} ceiling delivered nothing: {}",
                b.name(),
                c.error.unwrap_or_default()
            );
        }
        // The ceiling's destination goes before the drains (RabbitMQ keeps
        // every message in memory).
        self.cleanup().await;
        for &(mode, store_ceiling) in ceilings {
            let d = self.broker_drain(mode, b, n).await?;
            let (name, slower) = if c.rate() < store_ceiling {
                (format!("min(ceilings) = {}", b.name()), c.rate())
            } else {
                (
                    format!("min(ceilings) = {} store", mode.name()),
                    store_ceiling,
                )
            };
            let row = Row::new(
                "brokers",
                format!("relay {} -> {}", store_label(mode), b.name()),
                d.drained.rate(),
                "events/s",
            )
            .param("store", mode.name());
            let row = with_usage(self.common(row, n), &d.drained)
                .detail("load_s", d.load_s)
                .detail("broker_ceiling", c.rate().round())
                .detail("store_ceiling", store_ceiling.round())
                .detail(
                    "ratio_to_serial",
                    round2(d.drained.rate() / serial(store_ceiling, c.rate())),
                )
                .against(name, slower);
            let row = match mode {
                PgMode::Log => row.target_ratio(
                    format!(">= {:.0}% of the slower ceiling", BROKER_TARGET * 100.0),
                    BROKER_TARGET,
                ),
                PgMode::Queue => row,
            };
            self.rows.push(row);
            self.cleanup().await;
        }
        Ok(())
    }

    /// One relay draining a fresh `n` backlog of `mode` to a fresh
    /// destination on `b`; the rate is remembered for `naive`.
    async fn broker_drain(&mut self, mode: PgMode, b: Broker, n: u64) -> Result<ModeDrain> {
        let (sink, topic) = broker(&self.services, &mut self.res, b, mode.name()).await?;
        let sink: Arc<BrokerSink> = Arc::new(sink);
        let m = self
            .pg_mode_drain(mode, Loop::Relay, false, n, &topic, sink, 1)
            .await?;
        if !m.drained.capped {
            self.cache.insert(
                format!("{}-{}-{n}", mode.name(), b.name()),
                m.drained.rate(),
            );
        }
        Ok(m)
    }

    /// `naive`: the naive baseline (one event per transaction, on a table
    /// of the queue table's shape), to the no-op handler and to NATS,
    /// against the relay on each store.
    pub(super) async fn naive(&mut self) -> Result<()> {
        let n = self.sizes.naive_backlog;
        let secs = self.sizes.naive;
        // To the no-op handler.
        let store = pg_store(&self.services, &mut self.res, "naive", false, false, 2).await?;
        load_pg(&store, "bench", n).await?;
        let d = naive(&store, noop_handlers().as_ref(), secs).await?;
        store.pool().close().await;
        self.push_naive(
            "NAIVE BASELINE postgres -> no-op (claim 1, deliver, delete, commit)",
            &d,
        );

        // To NATS JetStream: publish, await the PubAck, then delete.
        let (sink, subject) = broker(&self.services, &mut self.res, Broker::Nats, "naive").await?;
        let store = pg_store(&self.services, &mut self.res, "naive_nats", false, false, 2).await?;
        load_pg(&store, &subject, n).await?;
        let dn = naive(&store, &sink, secs).await?;
        store.pool().close().await;
        drop(sink);
        self.push_naive(
            "NAIVE BASELINE postgres -> nats-jetstream (claim 1, publish, await ack, delete, commit)",
            &dn,
        );
        self.cleanup().await;

        let big = self.sizes.backlog;
        for mode in MODES {
            let relay = self.mode_noop_rate(mode, big).await?;
            self.push_relay_vs_naive(mode, "no-op", relay, &d);
        }
        for mode in MODES {
            let key = format!("{}-{}-{big}", mode.name(), Broker::Nats.name());
            let relay = match self.cache.get(&key) {
                Some(v) => *v,
                None => {
                    let r = self.broker_drain(mode, Broker::Nats, big).await?;
                    self.cleanup().await;
                    r.drained.rate()
                }
            };
            self.push_relay_vs_naive(mode, Broker::Nats.name(), relay, &dn);
        }
        Ok(())
    }

    /// The row of one naive-baseline run `d`.
    fn push_naive(&mut self, case: &str, d: &Drained) {
        let row = Row::new("naive", case, d.rate(), "events/s")
            .param("backlog", self.sizes.naive_backlog)
            .param("duration_s", self.sizes.naive.as_secs());
        self.rows.push(with_usage(row, d));
    }

    /// The row of the relay's rate on `mode` to `to` against the naive
    /// baseline `naive` (target for the default: 30 times faster).
    fn push_relay_vs_naive(&mut self, mode: PgMode, to: &str, relay: f64, naive: &Drained) {
        let row = Row::new(
            "naive",
            format!("relay {} / naive, -> {to}", store_label(mode)),
            relay,
            "events/s",
        )
        .param("store", mode.name())
        .param("relay_backlog", self.sizes.backlog)
        .against("naive", naive.rate());
        let row = match mode {
            PgMode::Log => row.target_ratio(">= 30x naive", 30.0),
            PgMode::Queue => row,
        };
        self.rows.push(row);
    }

    /// `repeatable-read`: a drain with another connection holding a
    /// REPEATABLE READ snapshot open against a clean drain, per store.
    pub(super) async fn repeatable_read(&mut self) -> Result<()> {
        let n = self.sizes.side_backlog;
        for mode in MODES {
            let mut clean = 0.0;
            for held in [false, true] {
                let m = self
                    .pg_mode_drain(mode, Loop::Relay, held, n, "bench", noop_handlers(), 1)
                    .await?;
                self.cleanup().await;
                let case = format!(
                    "relay {} -> no-op, {}",
                    store_label(mode),
                    if held {
                        "REPEATABLE READ tx held open"
                    } else {
                        "clean (no long transaction)"
                    }
                );
                let row = Row::new("repeatable-read", case, m.drained.rate(), "events/s")
                    .param("store", mode.name())
                    .param("snapshot_held", held);
                let mut row = with_usage(self.common(row, n), &m.drained)
                    .detail("n_dead_tup_after_drain", m.dead.0)
                    .detail("n_dead_tup_after_vacuum", m.dead.1);
                if held {
                    row = row.against("clean drain", clean);
                } else {
                    clean = m.drained.rate();
                }
                self.rows.push(row);
            }
        }
        Ok(())
    }

    /// `scale-out`: 1, 2 and 4 relays with static shards i/n. On the event
    /// log each relay has its own store and pool, as separate processes
    /// would; on the queue table they share one store.
    pub(super) async fn scale_out(&mut self) -> Result<()> {
        let n = self.sizes.side_backlog;
        for mode in MODES {
            let mut one = 0.0;
            for relays in [1u32, 2, 4] {
                let (drained, load_s) = match mode {
                    PgMode::Log => {
                        let g = self.log_group_drain(relays, false, n).await?;
                        (g.drained, g.load_s)
                    }
                    PgMode::Queue => {
                        let m = self
                            .pg_mode_drain(
                                mode,
                                Loop::Relay,
                                false,
                                n,
                                "bench",
                                noop_handlers(),
                                relays,
                            )
                            .await?;
                        (m.drained, m.load_s)
                    }
                };
                self.cleanup().await;
                let row = Row::new(
                    "scale-out",
                    format!(
                        "{relays} relay(s), shards i/{relays}, {} -> no-op",
                        store_label(mode)
                    ),
                    drained.rate(),
                    "events/s",
                )
                .param("store", mode.name())
                .param("relays", relays);
                let mut row = with_usage(self.common(row, n), &drained).detail("load_s", load_s);
                if relays == 1 {
                    one = drained.rate();
                } else {
                    row = row.against("1 relay, same store", one);
                }
                self.rows.push(row);
            }
        }
        Ok(())
    }
}
