//! Faults and their schedule.
//!
//! A plan is a comma-separated list of steps; a step is one fault or several
//! joined by `+` (run at the same time, "mixed"); `kind*N` repeats a step.
//! Steps are spread evenly over the production time, one after the other.
//! Example: `kill*2,stop,broker-outage+kill,db-flap`.

use crate::consumers::Consumers;
use crate::kafka::PrivateKafka;
use crate::nats::PrivateNats;
use crate::nats_cluster::NatsCluster;
use crate::pg_pair::PgPair;
use crate::rabbit::PrivateRabbit;
use crate::record::{now_us, FaultRecord};
use crate::relays::Relays;
use crate::slow::SlowProxy;
use anyhow::{bail, Context as _, Result};
use outbox_testkit::proxy::TcpProxy;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::postgres::PgPool;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;
use tokio::time::Instant;

/// One kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultKind {
    /// `kill -9` a relay, restart it at once.
    Kill,
    /// SIGSTOP a relay for longer than its lease, then SIGCONT.
    Stop,
    /// `pg_terminate_backend` of every relay connection.
    PgTerminate,
    /// `pg_ctlcluster <v> main restart` (opt-in).
    PgRestart,
    /// `kill -9` of one PostgreSQL backend: the postmaster ends every
    /// session and the cluster goes through crash recovery (opt-in).
    PgCrash,
    /// The broker unreachable (cut + refused) for the outage time.
    BrokerOutage,
    /// The broker connection cut and refused repeatedly.
    BrokerFlap,
    /// The broker itself stopped (SIGTERM) and started again: the run's
    /// own NATS server, RabbitMQ node or Kafka broker ([`PrivateBroker`]).
    BrokerRestart,
    /// The database unreachable from the relays for the outage time.
    DbOutage,
    /// The database connection cut and refused repeatedly.
    DbFlap,
    /// `kill -9` of an inbox consumer process (`run --inbox`), started
    /// again after a short pause.
    ConsumerKill,
    /// `pg_terminate_backend` of every connection of the inbox consumers
    /// (`run --inbox postgres`).
    ConsumerDbCut,
    /// Relay 0 alone cut from PostgreSQL (its own proxy refused), not from
    /// the broker, for the outage time (longer than the lease), while its
    /// sink is slow (the broker's acknowledgements held back longer than
    /// the lease, see slow.rs): the other relays take its shards over once
    /// the lease ran out in the database, and relay 0 must stop delivering
    /// by its own clock (DESIGN.md invariant 15).
    DbCutOne,
    /// A `pg_dump`-like session: a REPEATABLE READ transaction that reads
    /// every partition of the event log and stays open for
    /// [`READER_HOLD`], while a rotator (a store with a 1 s rotation
    /// interval, the library's own background rotation) runs (PostgreSQL
    /// event log only). Rotation must not stall the relays behind it.
    PartitionReader,
    /// `kill -9` of the inbox consumers in turn every second for the
    /// outage time, each started again at once (issue 42: a key's events
    /// stay in order however often the consumer crashes).
    ConsumerKills,
    /// SIGKILL of the NATS server leading the run's stream in the run's own
    /// three-node JetStream cluster (an R3 stream); it starts again on its
    /// store once another node leads the stream (nats_cluster.rs).
    NatsLeaderKill,
    /// The run's own PostgreSQL primary stopped (immediate) and its
    /// streaming standby promoted 2 s later (pg_pair.rs); the producer and
    /// the relays follow through their multi-host URL.
    PgFailover,
    /// A run of its own (tenants.rs): one relay process over four
    /// databases of the one server, one with a 500,000-event backlog, one
    /// whose every connection is terminated repeatedly mid-run. Alone in
    /// its plan.
    Tenants,
}

/// How long the `partition-reader` fault holds its transaction open.
pub(crate) const READER_HOLD: Duration = Duration::from_secs(12);
/// The rotator's rotation interval during `partition-reader`: rotation is
/// due (and attempted) all along the reader's transaction.
const READER_ROTATION: Duration = Duration::from_secs(1);

impl FaultKind {
    /// Every kind, in the order of the tables.
    pub(crate) const ALL: [FaultKind; 18] = [
        Self::Kill,
        Self::Stop,
        Self::PgTerminate,
        Self::PgRestart,
        Self::PgCrash,
        Self::BrokerOutage,
        Self::BrokerFlap,
        Self::BrokerRestart,
        Self::DbOutage,
        Self::DbFlap,
        Self::ConsumerKill,
        Self::ConsumerDbCut,
        Self::DbCutOne,
        Self::PartitionReader,
        Self::ConsumerKills,
        Self::NatsLeaderKill,
        Self::PgFailover,
        Self::Tenants,
    ];

    /// The name used in plans and reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Kill => "kill",
            Self::Stop => "stop",
            Self::PgTerminate => "pg-terminate",
            Self::PgRestart => "pg-restart",
            Self::PgCrash => "pg-crash",
            Self::BrokerOutage => "broker-outage",
            Self::BrokerFlap => "broker-flap",
            Self::BrokerRestart => "broker-restart",
            Self::DbOutage => "db-outage",
            Self::DbFlap => "db-flap",
            Self::ConsumerKill => "consumer-kill",
            Self::ConsumerDbCut => "consumer-db-cut",
            Self::DbCutOne => "db-cut-one",
            Self::PartitionReader => "partition-reader",
            Self::ConsumerKills => "consumer-kills",
            Self::NatsLeaderKill => "nats-leader-kill",
            Self::PgFailover => "pg-failover",
            Self::Tenants => "tenants",
        }
    }

    fn parse(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .with_context(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|k| k.name()).collect();
                format!("unknown fault {s:?}; known: {}", names.join(", "))
            })
    }
}

/// A plan: steps, each one or more faults started together.
pub(crate) fn parse_plan(plan: &str) -> Result<Vec<Vec<FaultKind>>> {
    let mut steps = Vec::new();
    for part in plan.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if part == "none" {
            continue;
        }
        let (step, times) = match part.rsplit_once('*') {
            Some((s, n)) => (
                s,
                n.parse::<usize>()
                    .with_context(|| format!("bad repeat count in {part:?}"))?,
            ),
            None => (part, 1),
        };
        let kinds = step
            .split('+')
            .map(|k| FaultKind::parse(k.trim()))
            .collect::<Result<Vec<_>>>()?;
        for _ in 0..times {
            steps.push(kinds.clone());
        }
    }
    Ok(steps)
}

/// Timings of the faults.
#[derive(Debug, Clone)]
pub(crate) struct FaultTimes {
    /// SIGSTOP length (longer than the lease).
    pub(crate) stop: Duration,
    /// Broker / database outage length.
    pub(crate) outage: Duration,
    /// Flap cycles.
    pub(crate) flap_cycles: u32,
    /// Down time of one flap.
    pub(crate) flap_down: Duration,
    /// Up time between flaps.
    pub(crate) flap_up: Duration,
    /// The relays' lease: a database cut longer than this is a lease loss.
    pub(crate) lease: Duration,
    /// The least time between the end of a step and the start of the next
    /// (zero: the even spread alone decides).
    pub(crate) recovery_room: Duration,
    /// How long a killed inbox consumer stays down.
    pub(crate) consumer_pause: Duration,
    /// `db-cut-one`: how late the broker's answers reach relay 0.
    pub(crate) slow_sink: Duration,
}

/// What the faults act on.
#[derive(Debug, Clone)]
pub(crate) struct Targets {
    pub(crate) relays: Arc<Mutex<Relays>>,
    pub(crate) broker_proxy: Option<Arc<TcpProxy>>,
    pub(crate) db_proxy: Option<Arc<TcpProxy>>,
    /// A direct admin connection and the relays' `application_name`.
    pub(crate) pg_admin: Option<(PgPool, String)>,
    /// The PostgreSQL URL (direct), for `pg-crash`'s fresh connections.
    pub(crate) database_url: Option<String>,
    /// Whether `pg-restart` may run.
    pub(crate) allow_pg_restart: bool,
    /// Whether `pg-crash` may run.
    pub(crate) allow_pg_crash: bool,
    /// The run's own broker, which `broker-restart` restarts.
    pub(crate) broker_server: Option<Arc<Mutex<PrivateBroker>>>,
    /// The inbox consumer processes (`run --inbox`).
    pub(crate) consumers: Option<Arc<Mutex<Consumers>>>,
    /// An admin connection to the consumers' PostgreSQL database and their
    /// `application_name` (`run --inbox postgres`).
    pub(crate) consumer_db: Option<(PgPool, String)>,
    /// `db-cut-one`: relay 0's own database proxy and its slow broker link.
    pub(crate) first_relay: Option<(Arc<TcpProxy>, Arc<SlowProxy>)>,
    /// The run's JetStream stream (`nats-leader-kill` asks who leads it).
    pub(crate) nats_stream: Option<String>,
    /// The run's own primary and standby (`pg-failover`).
    pub(crate) pg_pair: Option<Arc<Mutex<PgPair>>>,
}

/// A broker the run started for itself, so that `broker-restart` restarts
/// it instead of the machine's shared one; killed when dropped.
#[derive(Debug)]
pub(crate) enum PrivateBroker {
    /// `nats-server` with JetStream on a file store (nats.rs).
    Nats(PrivateNats),
    /// A RabbitMQ node (rabbit.rs).
    Rabbit(PrivateRabbit),
    /// Tansu behind the broker fault proxy (kafka.rs), for the outage and
    /// the flap: it keeps its log in memory, so it is not restarted.
    Kafka(PrivateKafka),
    /// Three `nats-server` nodes with JetStream (nats_cluster.rs), for
    /// `nats-leader-kill`; not restarted as a whole.
    NatsCluster(NatsCluster),
}

impl PrivateBroker {
    /// The URL clients use.
    pub(crate) fn url(&self) -> String {
        match self {
            Self::Nats(s) => s.url(),
            Self::Rabbit(s) => s.url(),
            Self::Kafka(s) => s.brokers(),
            Self::NatsCluster(c) => c.url(),
        }
    }

    /// Where it keeps its data (`None`: in memory): removed after the run
    /// unless `--keep`.
    pub(crate) fn dir(&self) -> Option<&Path> {
        match self {
            Self::Nats(s) => Some(s.store()),
            Self::Rabbit(s) => Some(s.dir()),
            Self::Kafka(_) => None,
            Self::NatsCluster(c) => Some(c.dir()),
        }
    }

    /// Whether `broker-restart` can restart it without losing its data.
    fn restartable(&self) -> bool {
        self.dir().is_some() && !matches!(self, Self::NatsCluster(_))
    }

    /// Stops it gracefully and starts it again on the same port and store;
    /// returns when clients can connect again.
    pub(crate) async fn restart(&mut self) -> Result<()> {
        match self {
            Self::Nats(s) => s.restart().await,
            Self::Rabbit(s) => s.restart().await,
            Self::Kafka(_) => bail!("the private Kafka broker keeps its log in memory"),
            Self::NatsCluster(_) => {
                bail!("the private NATS cluster loses one node at a time (nats-leader-kill)")
            }
        }
    }

    /// The fault's target, as reported.
    fn name(&self) -> &'static str {
        match self {
            Self::Nats(_) => "nats-server",
            Self::Rabbit(_) => "rabbitmq-server",
            Self::Kafka(_) => "tansu",
            Self::NatsCluster(_) => "nats-server (stream leader)",
        }
    }
}

impl Targets {
    /// Fails when `kind` cannot be injected in this run.
    pub(crate) fn check(&self, kind: FaultKind) -> Result<()> {
        match kind {
            FaultKind::Kill | FaultKind::Stop => Ok(()),
            FaultKind::PgTerminate if self.pg_admin.is_none() => {
                bail!("pg-terminate needs the PostgreSQL store")
            }
            FaultKind::PgRestart if !self.allow_pg_restart || self.pg_admin.is_none() => {
                bail!("pg-restart needs the PostgreSQL store and --allow-pg-restart")
            }
            FaultKind::PgCrash
                if !self.allow_pg_crash
                    || self.pg_admin.is_none()
                    || self.database_url.is_none() =>
            {
                bail!(
                    "pg-crash needs the PostgreSQL store and --allow-pg-crash (or \
                     --allow-pg-restart): it crashes the machine's cluster under every session"
                )
            }
            FaultKind::BrokerOutage | FaultKind::BrokerFlap if self.broker_proxy.is_none() => {
                bail!(
                    "{} needs a broker proxy (for Kafka: the run's private broker)",
                    kind.name()
                )
            }
            FaultKind::BrokerRestart
                if !self
                    .broker_server
                    .as_ref()
                    .is_some_and(|b| b.try_lock().is_ok_and(|b| b.restartable())) =>
            {
                bail!(
                    "broker-restart needs the run's own broker with its data on disk: NATS or \
                     RabbitMQ (the run starts one); not Kafka (the private Tansu keeps its log \
                     in memory, see kafka.rs)"
                )
            }
            FaultKind::DbOutage | FaultKind::DbFlap if self.db_proxy.is_none() => {
                bail!(
                    "{} needs the PostgreSQL store (SQLite is a file)",
                    kind.name()
                )
            }
            FaultKind::DbCutOne if self.first_relay.is_none() => {
                bail!("db-cut-one needs the PostgreSQL store and a NATS or RabbitMQ broker")
            }
            FaultKind::ConsumerKill | FaultKind::ConsumerKills if self.consumers.is_none() => {
                bail!(
                    "{} needs the inbox consumers (`run --inbox ...`)",
                    kind.name()
                )
            }
            FaultKind::PartitionReader
                if self.pg_admin.is_none() || self.database_url.is_none() =>
            {
                bail!("partition-reader needs the PostgreSQL store (event-log mode)")
            }
            FaultKind::NatsLeaderKill
                if self.nats_stream.is_none()
                    || !self.broker_server.as_ref().is_some_and(|b| {
                        b.try_lock()
                            .is_ok_and(|b| matches!(*b, PrivateBroker::NatsCluster(_)))
                    }) =>
            {
                bail!("nats-leader-kill needs NATS and the run's own NATS cluster (the run starts one)")
            }
            FaultKind::PgFailover if self.pg_pair.is_none() => {
                bail!("pg-failover needs the PostgreSQL store and the run's own primary and standby (the run makes them)")
            }
            FaultKind::Tenants => {
                bail!("tenants is a run of its own: `--faults tenants` alone (tenants.rs)")
            }
            FaultKind::ConsumerDbCut if self.consumer_db.is_none() => {
                bail!("consumer-db-cut needs the inbox on PostgreSQL (`run --inbox postgres`)")
            }
            _ => Ok(()),
        }
    }
}

/// Runs the plan: step `i` starts at `start + warmup + i * spacing`, or
/// `times.recovery_room` after the previous step is over if that is later.
/// Returns every fault as injected.
pub(crate) async fn run_plan(
    steps: Vec<Vec<FaultKind>>,
    targets: Targets,
    times: FaultTimes,
    start: Instant,
    warmup: Duration,
    spacing: Duration,
    seed: u64,
) -> Result<Vec<FaultRecord>> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut records = Vec::new();
    let mut not_before = start;
    for (i, step) in steps.into_iter().enumerate() {
        let planned = start + warmup + spacing * u32::try_from(i).unwrap_or(u32::MAX);
        tokio::time::sleep_until(planned.max(not_before)).await;
        let n = targets.relays.lock().await.len();
        let consumers = match &targets.consumers {
            Some(c) => c.lock().await.len(),
            None => 1,
        };
        let mut set = tokio::task::JoinSet::new();
        // Distinct relays for the relay faults of one step (and consumers
        // for the consumer faults).
        let first = rng.random_range(0..n.max(1));
        let first_consumer = rng.random_range(0..consumers.max(1));
        for (j, kind) in step.into_iter().enumerate() {
            let relay = if matches!(kind, FaultKind::ConsumerKill | FaultKind::ConsumerKills) {
                (first_consumer + j) % consumers.max(1)
            } else {
                (first + j) % n.max(1)
            };
            let (targets, times) = (targets.clone(), times.clone());
            set.spawn(async move { inject(kind, relay, &targets, &times).await });
        }
        while let Some(r) = set.join_next().await {
            records.push(r.context("fault task panicked")??);
        }
        not_before = Instant::now() + times.recovery_room;
    }
    Ok(records)
}

async fn inject(
    kind: FaultKind,
    relay: usize,
    t: &Targets,
    times: &FaultTimes,
) -> Result<FaultRecord> {
    let mut start_us = now_us();
    let mut target = String::new();
    let mut may_duplicate = false;
    let mut recovery_from_us = None;
    let mut broker_cuts = 0;
    let mut sink_down = Vec::new();
    let mut db_ready_us = None;
    match kind {
        FaultKind::Kill => {
            t.relays.lock().await.kill_and_restart(relay).await?;
            target = format!("relay-{relay}");
            may_duplicate = true;
        }
        FaultKind::Stop => {
            t.relays.lock().await.stop(relay).await?;
            recovery_from_us = Some(now_us());
            tokio::time::sleep(times.stop).await;
            t.relays.lock().await.resume(relay).await?;
            target = format!("relay-{relay}");
            may_duplicate = true;
        }
        FaultKind::PgTerminate => {
            if let Some((pool, app)) = &t.pg_admin {
                let (n,): (i64,) = sqlx::query_as(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()",
                )
                .bind(app)
                .fetch_one(pool)
                .await
                .context("pg_terminate_backend")?;
                target = format!("{n} relay connection(s)");
            }
        }
        FaultKind::ConsumerKill => {
            let consumers = t
                .consumers
                .as_ref()
                .context("consumer-kill without inbox consumers")?;
            // `relay` is the consumer's index here.
            consumers.lock().await.kill(relay).await?;
            // Recovery from the restart (the fault's end), as after a
            // relay's kill: the pause is the fault's length.
            tokio::time::sleep(times.consumer_pause).await;
            consumers.lock().await.restart(relay)?;
            target = format!("consumer-{relay}");
        }
        FaultKind::ConsumerKills => {
            let consumers = t
                .consumers
                .as_ref()
                .context("consumer-kills without inbox consumers")?;
            let n = consumers.lock().await.len().max(1);
            let until = Instant::now() + times.outage;
            let mut kills = 0usize;
            // `relay` is the first consumer's index here; then each in turn.
            while Instant::now() < until {
                let i = (relay + kills) % n;
                let tick = Instant::now() + Duration::from_secs(1);
                consumers.lock().await.kill(i).await?;
                tokio::time::sleep(Duration::from_millis(50)).await;
                consumers.lock().await.restart(i)?;
                kills += 1;
                tokio::time::sleep_until(tick).await;
            }
            target = format!("{kills} kill(s) of {n} consumer(s), 1 s apart");
        }
        FaultKind::ConsumerDbCut => {
            if let Some((pool, app)) = &t.consumer_db {
                let (n,): (i64,) = sqlx::query_as(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()",
                )
                .bind(app)
                .fetch_one(pool)
                .await
                .context("pg_terminate_backend")?;
                target = format!("{n} consumer connection(s)");
            }
        }
        FaultKind::PartitionReader => {
            let url = t
                .database_url
                .as_deref()
                .context("partition-reader without a database URL")?;
            let schema = t.pg_admin.as_ref().map_or("", |(_, name)| name.as_str());
            let held = partition_reader(url, schema).await?;
            start_us = held.start_us;
            target = held.target;
        }
        FaultKind::PgRestart => {
            pg_restart().await?;
            target = "postgresql".to_owned();
        }
        FaultKind::PgCrash => {
            let url = t
                .database_url
                .as_deref()
                .context("pg-crash without a database URL")?;
            let app = t.pg_admin.as_ref().map_or("", |(_, app)| app.as_str());
            let crash = pg_crash(url, app).await?;
            start_us = crash.killed_us;
            db_ready_us = Some(crash.ready_us);
            target = crash.target;
            // Every relay's session ends at once: each may have delivered a
            // batch it could not record (the checker allows one per relay).
            may_duplicate = true;
        }
        FaultKind::BrokerOutage | FaultKind::DbOutage => {
            let (proxy, what) = proxy_of(kind, t)?;
            let down = now_us();
            proxy.refuse();
            tokio::time::sleep(times.outage).await;
            proxy.restore();
            target = what.to_owned();
            if kind == FaultKind::BrokerOutage {
                broker_cuts = 1;
                sink_down.push((down, now_us()));
            } else {
                // The database gone for longer than the lease: a relay that
                // delivered a batch cannot record it before its lease runs
                // out, and the batch is delivered again (a lease loss).
                may_duplicate = times.outage >= times.lease;
            }
        }
        FaultKind::DbCutOne => {
            let (db, broker) = t
                .first_relay
                .as_ref()
                .context("db-cut-one without relay 0's own connections")?;
            // The sink slow first, so that a batch is in flight (waiting
            // for its acknowledgements) when the database goes.
            broker.set_delay(times.slow_sink);
            tokio::time::sleep(Duration::from_millis(500)).await;
            start_us = now_us();
            db.refuse();
            tokio::time::sleep(times.outage).await;
            db.restore();
            broker.set_delay(Duration::ZERO);
            target = "relay-0 (database cut, sink slow)".to_owned();
            // Its batch in flight, delivered or not, was not settled: the
            // relay that took the shard over delivers it again.
            may_duplicate = true;
        }
        FaultKind::BrokerRestart => {
            let server = t
                .broker_server
                .as_ref()
                .context("broker-restart without the run's own broker")?;
            let mut server = server.lock().await;
            let down = now_us();
            server.restart().await?;
            target = server.name().to_owned();
            broker_cuts = 1;
            sink_down.push((down, now_us()));
        }
        FaultKind::NatsLeaderKill => {
            let server = t
                .broker_server
                .as_ref()
                .context("nats-leader-kill without the run's own NATS cluster")?;
            let stream = t
                .nats_stream
                .as_deref()
                .context("nats-leader-kill without a NATS stream")?;
            let mut server = server.lock().await;
            let PrivateBroker::NatsCluster(cluster) = &mut *server else {
                bail!("nats-leader-kill without the run's own NATS cluster");
            };
            let down = now_us();
            let (killed, elected) = cluster.kill_leader(stream).await?;
            target = format!("nats-server {killed} (leader of {stream})");
            // Publishes in flight to the killed leader may have been stored
            // and not acknowledged: sent again (the stream's dedup window
            // drops the copies).
            broker_cuts = 1;
            sink_down.push((down, elected));
        }
        FaultKind::PgFailover => {
            let pair = t
                .pg_pair
                .as_ref()
                .context("pg-failover without the run's own primary and standby")?;
            let done = pair.lock().await.fail_over().await?;
            start_us = done.stopped_us;
            db_ready_us = Some(done.promoted_us);
            target = done.target;
            // Every relay's session ends with the primary: each may have
            // delivered a batch it could not record, and progress settled
            // asynchronously may not have reached the standby.
            may_duplicate = true;
        }
        FaultKind::Tenants => {
            bail!("tenants is a run of its own: `--faults tenants` alone (tenants.rs)")
        }
        FaultKind::BrokerFlap | FaultKind::DbFlap => {
            let (proxy, what) = proxy_of(kind, t)?;
            for c in 0..times.flap_cycles {
                if c > 0 {
                    tokio::time::sleep(times.flap_up).await;
                }
                let down = now_us();
                proxy.refuse();
                tokio::time::sleep(times.flap_down).await;
                proxy.restore();
                if kind == FaultKind::BrokerFlap {
                    sink_down.push((down, now_us()));
                }
            }
            target = what.to_owned();
            if kind == FaultKind::BrokerFlap {
                broker_cuts = times.flap_cycles;
            }
        }
    }
    Ok(FaultRecord {
        kind: kind.name().to_owned(),
        target,
        start_us,
        end_us: db_ready_us.unwrap_or_else(now_us),
        recovery_from_us,
        may_duplicate,
        broker_cuts,
        sink_down,
        db_ready_us,
    })
}

fn proxy_of(kind: FaultKind, t: &Targets) -> Result<(&TcpProxy, &'static str)> {
    let found = match kind {
        FaultKind::BrokerOutage | FaultKind::BrokerFlap => {
            t.broker_proxy.as_deref().map(|p| (p, "broker proxy"))
        }
        _ => t.db_proxy.as_deref().map(|p| (p, "database proxy")),
    };
    found.with_context(|| format!("{} has no proxy in this run", kind.name()))
}

/// What [`partition_reader`] did.
#[derive(Debug)]
struct Held {
    /// The reader and the rotations, as reported.
    target: String,
    /// When the reader had read every partition.
    start_us: i64,
}

/// The `partition-reader` fault: a rotator (a store on the run's log with
/// a 1 s rotation interval and the library's background rotation) runs
/// from 2 s before a `pg_dump`-like reader starts until 3 s after it
/// ended; the reader (its own session, `application_name`
/// `<run>-reader`) reads every partition of the log in a REPEATABLE READ
/// transaction and keeps it open for [`READER_HOLD`]. Returns once the
/// reader committed; the rotator is stopped 3 s later in the background.
async fn partition_reader(url: &str, schema: &str) -> Result<Held> {
    use outbox_postgres::{Ident, PgLogOptions, PgLogStore};
    use sqlx::Connection as _;
    let ident = Ident::new(schema).context("partition-reader: the run's schema name")?;
    let rotator = PgLogStore::connect(
        PgLogOptions::new(url)
            .with_schema(ident.clone())
            .with_table(Ident::new("events")?)
            .with_rotation_interval(READER_ROTATION)
            .with_background_rotation(true),
    )
    .await
    .context("partition-reader: the rotator cannot open the log")?;
    let before = rotator.log_info().await?.rotations;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let opts = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .context("parsing the PostgreSQL URL")?
        .application_name(&format!("{schema}-reader"));
    let mut reader = sqlx::PgConnection::connect_with(&opts)
        .await
        .context("partition-reader: connecting")?;
    let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut reader)
        .await?;
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .execute(&mut reader)
        .await?;
    let mut rows = 0i64;
    for slot in 0..3 {
        let (n,): (i64,) = sqlx::query_as(&format!(
            "SELECT count(*) FROM {}.\"events_log_{slot}\"",
            ident.quoted()
        ))
        .fetch_one(&mut reader)
        .await
        .context("partition-reader: reading the log")?;
        rows += n;
    }
    let start_us = now_us();
    let at_start = rotator.log_info().await?.rotations;
    tokio::time::sleep(READER_HOLD).await;
    let hold = rotator.rotation_hold().await?;
    let while_held = rotator.log_info().await?.rotations - at_start;
    sqlx::query("COMMIT").execute(&mut reader).await?;
    let _ = reader.close().await;
    let named = hold.held_by.as_ref().is_some_and(|h| h.pid == Some(pid));
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        drop(rotator);
    });
    Ok(Held {
        target: format!(
            "reader pid {pid} read {rows} row(s) and held every log partition {:.0} s; \
             rotations before it {}, while it held {while_held}, status named it: {named}",
            READER_HOLD.as_secs_f64(),
            at_start - before,
        ),
        start_us,
    })
}

/// Restarts the local PostgreSQL cluster and waits until it accepts
/// connections again.
async fn pg_restart() -> Result<()> {
    let version = std::fs::read_dir("/etc/postgresql")
        .context("no /etc/postgresql: cannot restart PostgreSQL here")?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .max()
        .context("no PostgreSQL cluster under /etc/postgresql")?;
    let status = tokio::process::Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, "main", "restart"])
        .status()
        .await
        .context("running pg_ctlcluster")?;
    if !status.success() {
        bail!("pg_ctlcluster {version} main restart failed ({status})");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while tokio::net::TcpStream::connect("127.0.0.1:5432")
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            bail!("PostgreSQL did not come back within 60 s of its restart");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// What [`pg_crash`] did.
#[derive(Debug)]
struct Crash {
    /// The backend killed, as reported.
    target: String,
    /// When `kill -9` was sent.
    killed_us: i64,
    /// When a fresh connection answered again.
    ready_us: i64,
}

/// `kill -9` of one PostgreSQL client backend (preferably one of the run's:
/// `application_name` starting with `app`, else one of the database's):
/// the postmaster then ends every session of the cluster and runs crash
/// recovery, which hands out again the transaction ids whose WAL never
/// reached disk. Returns when a fresh connection answers again.
///
/// Refused unless `restart_after_crash` is on (else the cluster would stay
/// down) and the backend is a process of this machine.
async fn pg_crash(url: &str, app: &str) -> Result<Crash> {
    use sqlx::Connection as _;
    let mut conn = sqlx::PgConnection::connect(url)
        .await
        .context("pg-crash: connecting to PostgreSQL")?;
    let (restart,): (String,) = sqlx::query_as("SELECT current_setting('restart_after_crash')")
        .fetch_one(&mut conn)
        .await?;
    if restart != "on" {
        let _ = conn.close().await;
        bail!("pg-crash refused: restart_after_crash is {restart:?}, the cluster would stay down");
    }
    // A backend can end between the look-up and the kill: try a few.
    let mut killed = None;
    for _ in 0..5 {
        let row: Option<(i32, String)> = sqlx::query_as(
            "SELECT pid, application_name FROM pg_stat_activity \
             WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() \
             ORDER BY ($1 <> '' AND left(application_name, length($1)) = $1) DESC, \
                      (datname = current_database()) DESC, random() \
             LIMIT 1",
        )
        .bind(app)
        .fetch_optional(&mut conn)
        .await?;
        let Some((pid, name)) = row else {
            bail!("pg-crash: no other client backend to kill");
        };
        let proc_dir = format!("/proc/{pid}");
        let cmdline = std::fs::read(format!("{proc_dir}/cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains("postgres") {
            // Not on this machine (or gone already).
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let killed_us = now_us();
        let status = tokio::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .await
            .context("running kill")?;
        if status.success() {
            killed = Some((pid, name, killed_us, proc_dir));
            break;
        }
    }
    // The session is gone with the cluster's others: no close handshake.
    drop(conn);
    let Some((pid, name, killed_us, proc_dir)) = killed else {
        bail!("pg-crash: no PostgreSQL backend of this machine could be killed (is the database local?)");
    };
    // Until the postmaster reaped it (and so began ending every session),
    // a new connection could still reach the old incarnation.
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&proc_dir).exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let ready_us = loop {
        let attempt = tokio::time::timeout(Duration::from_secs(2), async {
            let mut c = sqlx::PgConnection::connect(url).await?;
            sqlx::query("SELECT 1").execute(&mut c).await?;
            let _ = c.close().await;
            Ok::<_, sqlx::Error>(())
        })
        .await;
        if matches!(attempt, Ok(Ok(()))) {
            break now_us();
        }
        if Instant::now() > deadline {
            bail!("PostgreSQL did not accept connections within 120 s of the crash");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let whose = if !app.is_empty() && name.starts_with(app) {
        format!("the run's {name}")
    } else if name.is_empty() {
        "another session".to_owned()
    } else {
        format!("another session's {name}")
    };
    Ok(Crash {
        target: format!("backend {pid} ({whose})"),
        killed_us,
        ready_us,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse() {
        let p = parse_plan("kill*2, stop+broker-flap,none").unwrap();
        assert_eq!(
            p,
            vec![
                vec![FaultKind::Kill],
                vec![FaultKind::Kill],
                vec![FaultKind::Stop, FaultKind::BrokerFlap]
            ]
        );
        assert!(parse_plan("explode").is_err());
        assert!(parse_plan("").unwrap().is_empty());
    }
}
