//! `outbox-chaos`: the reliability suite behind `cargo xtask chaos`.
//!
//! `outbox-chaos run` is one black-box run, as a user would set it up: a
//! producer application commits events with per-key sequence numbers
//! through the public enqueue API (some transactions rolled back), 2-4
//! `outbox-relay run` processes (the built binary) relay them to a real
//! broker, an independent consumer records every message, faults are
//! injected on a schedule, and the checker reports lost, duplicated,
//! unexpected, per-key order violations, latency and recovery times.
//! Everything it creates is named after the run and removed at the end; its
//! relays are killed whatever way it exits.
//!
//! The broker is the machine's, except where a fault needs the run's own:
//! `broker-restart` on NATS or RabbitMQ starts a private `nats-server`
//! (nats.rs) or RabbitMQ node (rabbit.rs) in the run's directory, and a
//! broker fault on Kafka a private Tansu behind the fault proxy (kafka.rs).
//!
//! `outbox-chaos run --inbox postgres|sqlite` is the end-to-end run: inbox
//! consumer processes (`outbox-chaos inbox-consumer`, inbox.rs, supervised
//! by consumers.rs) replace the recorder and apply every event to a
//! business table; the checker reads that table and fails on a single
//! duplicate effect.
//!
//! `outbox-chaos check DIR` runs the checker again over a kept run.

#![allow(clippy::print_stdout, reason = "a command-line tool")]

mod checker;
mod child;
mod cli;
mod consumer;
mod consumers;
mod e2e;
mod faults;
mod inbox;
mod kafka;
mod nats;
mod nats_cluster;
mod pg_pair;
mod producer;
mod rabbit;
mod record;
mod relays;
mod run_dir;
mod slow;
mod summary;
mod tenants;
mod urls;

use anyhow::{bail, Context as _, Result};
use clap::Parser;
use cli::{BrokerKind, Cli, Command, InboxDb, RunArgs, StoreKind};
use consumer::Destination;
use e2e::{inbox_schema, inbox_sqlite, start_inbox};
use faults::{FaultKind, FaultTimes, PrivateBroker, Targets};
use kafka::PrivateKafka;
use nats::PrivateNats;
use outbox_testkit::proxy::TcpProxy;
use producer::{AppDb, ProducerConfig};
use rabbit::PrivateRabbit;
use rand::Rng;
use record::{now_us, FaultRecord, Ledger, TxOutcome};
use relays::{RelaySpec, Relays};
use run_dir::{check_dir, finish, report, write_records, RunMeta};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Mutex};
use tokio::time::Instant;
use urls::{resolve, through, via};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Run(args) => run_bounded(*args).await,
            Command::Check { dir } => check_dir(&dir),
            Command::InboxConsumer(args) => inbox::run_consumer(*args).await.map(|()| true),
        }
    });
    // Child processes are killed on drop; give the runtime a moment to
    // reap them, without waiting on stuck tasks.
    rt.shutdown_timeout(Duration::from_secs(2));
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The run under a hard time bound and SIGINT/SIGTERM: whichever comes
/// first drops the run (its guards kill the relays).
async fn run_bounded(args: RunArgs) -> Result<bool> {
    let steps = faults::parse_plan(&args.faults)?;
    if steps.iter().flatten().any(|k| *k == FaultKind::Tenants) {
        // A run of its own, which bounds itself and listens for the
        // signals itself: its databases are dropped however it ends.
        return tenants::run(args, &steps, default_relay_bin).await;
    }
    let fault_time: u64 = steps.len() as u64 * (args.outage_s + 20);
    let bound = Duration::from_secs(
        args.timeout_s
            .unwrap_or(args.duration_s + fault_time + args.drain_timeout_s + 120),
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listening for SIGTERM")?;
    tokio::select! {
        r = tokio::time::timeout(bound, run(args, steps)) => match r {
            Ok(r) => r,
            Err(_) => bail!("the run did not finish within {bound:?}: stopped"),
        },
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
        _ = term.recv() => bail!("terminated"),
    }
}

/// The application's side of a failover: every 250 ms, the first
/// read-write host of `hosts`; when it changed, `pool` opens its next
/// connections there (what an application does with
/// [`outbox_postgres::PgHosts`] and `Pool::set_connect_options`, as the
/// stores do themselves). Ends when the pool is closed.
fn follow_primary(hosts: outbox_postgres::PgHosts, pool: sqlx::PgPool, app: String) {
    tokio::spawn(async move {
        let mut current = 0;
        while !pool.is_closed() {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if let Ok((i, options)) = hosts.find(Duration::from_secs(1)).await {
                if i != current {
                    pool.set_connect_options(options.application_name(&app));
                    current = i;
                    eprintln!(
                        "chaos: the application now connects to {}",
                        hosts.hosts().nth(i).unwrap_or("?")
                    );
                }
            }
        }
    });
}

fn default_relay_bin() -> Result<PathBuf> {
    let me = std::env::current_exe()?;
    let bin = me.with_file_name("outbox-relay");
    if !bin.exists() {
        bail!(
            "{} not found: build it (`cargo build -p outbox-relay --features postgres,nats,amqp,kafka`) or pass --relay-bin",
            bin.display()
        );
    }
    Ok(bin)
}

async fn run(mut args: RunArgs, steps: Vec<Vec<FaultKind>>) -> Result<bool> {
    let seed = args.seed.unwrap_or_else(|| rand::rng().random());
    let store_short = match args.store {
        StoreKind::Postgres => "pg",
        StoreKind::Sqlite => "sq",
    };
    let broker_name = match args.broker {
        BrokerKind::Nats => "nats",
        BrokerKind::Amqp => "amqp",
        BrokerKind::Kafka => "kafka",
    };
    let name = format!(
        "chaos_{store_short}_{broker_name}_{:06x}",
        rand::rng().random_range(0..0xff_ffffu32)
    );
    let relay_bin = match &args.relay_bin {
        Some(b) => b.clone(),
        None => default_relay_bin()?,
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let out = std::fs::canonicalize(&args.out)?;
    // `pg-failover`: the run's own primary and standby (pg_pair.rs); the
    // producer and the relays use both through one multi-host URL.
    let pg_pair = if args.store == StoreKind::Postgres
        && steps.iter().flatten().any(|k| *k == FaultKind::PgFailover)
    {
        let pair = pg_pair::PgPair::start(&out, args.pg_replication).await?;
        args.database_url = pair.url();
        args.pgbouncer = false;
        Some(Arc::new(Mutex::new(pair)))
    } else {
        None
    };
    eprintln!("chaos {name}: store {store_short}{}, broker {broker_name}, {} relays, {} ev/s for {} s, faults {:?}, seed {seed}, out {}",
        if args.pgbouncer { " through PgBouncer" } else { "" },
        args.relays, args.rate, args.duration_s, args.faults, out.display());

    // A private broker where a fault needs one, killed when this returns,
    // whichever way: Kafka with a broker outage or flap (behind the fault
    // proxy, kafka.rs says why; a restart is refused for it), NATS
    // or RabbitMQ with a broker restart (nats.rs, rabbit.rs say why; the
    // relays reach it through the broker proxy when the plan has one, as
    // they would the machine's).
    let broker_fault = steps.iter().flatten().any(|k| {
        matches!(
            k,
            FaultKind::BrokerOutage | FaultKind::BrokerFlap | FaultKind::BrokerRestart
        )
    });
    let restarts = steps
        .iter()
        .flatten()
        .any(|k| *k == FaultKind::BrokerRestart);
    let leader_kills = steps
        .iter()
        .flatten()
        .any(|k| *k == FaultKind::NatsLeaderKill);
    let private_broker = match args.broker {
        BrokerKind::Nats if leader_kills => Some(PrivateBroker::NatsCluster(
            nats_cluster::NatsCluster::start(&out).await?,
        )),
        BrokerKind::Nats if restarts => Some(PrivateBroker::Nats(PrivateNats::start(&out).await?)),
        BrokerKind::Amqp if restarts => {
            Some(PrivateBroker::Rabbit(PrivateRabbit::start(&out).await?))
        }
        BrokerKind::Kafka if broker_fault => {
            Some(PrivateBroker::Kafka(PrivateKafka::start(&out).await?))
        }
        BrokerKind::Nats | BrokerKind::Amqp | BrokerKind::Kafka => None,
    };
    let private_url = private_broker.as_ref().map(PrivateBroker::url);
    let kafka_proxy = match &private_broker {
        Some(PrivateBroker::Kafka(k)) => Some(k.proxy()),
        _ => None,
    };
    let private_broker = private_broker.map(|b| Arc::new(Mutex::new(b)));

    // The broker destination (created before any relay starts).
    let dest = match args.broker {
        BrokerKind::Nats => Destination::Nats {
            url: private_url.unwrap_or_else(|| args.nats_url.clone()),
            stream: name.to_uppercase(),
            prefix: name.clone(),
            // On the run's cluster: three replicas, and the dedup window a
            // relay needs (copies sent again after a leader change are
            // dropped by the stream, see nats_cluster.rs).
            replicas: if leader_kills { 3 } else { 1 },
        },
        BrokerKind::Amqp => Destination::Amqp {
            url: private_url.unwrap_or_else(|| args.amqp_url.clone()),
            queue: name.clone(),
        },
        BrokerKind::Kafka => Destination::Kafka {
            brokers: private_url.unwrap_or_else(|| args.kafka_brokers.clone()),
            topic: name.clone(),
        },
    };
    dest.create().await?;
    let sqlite_path = out.join(format!("{name}.db"));
    let result = run_created(
        &args,
        &name,
        seed,
        &steps,
        &dest,
        kafka_proxy,
        private_broker.clone(),
        &relay_bin,
        &out,
        &sqlite_path,
        pg_pair.clone(),
    )
    .await;
    if let Some(pair) = pg_pair {
        // The last handle: both clusters stopped, their directory removed.
        let dir = pair.lock().await.dir().to_owned();
        drop(pair);
        if !args.keep {
            let _ = std::fs::remove_dir_all(dir);
        }
        return result;
    }
    if let Some(server) = private_broker {
        // Its stream / queue / topic goes with it (a Kafka topic is not
        // deleted: under a consumer still running after a failure, a delete
        // could crash it), and with its data directory.
        let mut broker = server.lock().await;
        if let PrivateBroker::Kafka(k) = &mut *broker {
            k.stop().await;
        }
        let dir = broker.dir().map(Path::to_owned);
        drop(broker);
        // Dropping the last handle kills what is left.
        drop(server);
        if let Some(dir) = dir.filter(|_| !args.keep) {
            let _ = std::fs::remove_dir_all(dir);
        }
    } else if !args.keep {
        dest.delete().await;
    }
    if !args.keep {
        match args.inbox {
            Some(InboxDb::Postgres) => {
                if let Ok(pool) = sqlx::PgPool::connect(&args.database_url).await {
                    let _ = sqlx::query(&format!(
                        "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                        inbox_schema(&name)
                    ))
                    .execute(&pool)
                    .await;
                    pool.close().await;
                }
            }
            Some(InboxDb::Sqlite) => {
                for ext in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!(
                        "{}{ext}",
                        inbox_sqlite(&out, &name).display()
                    ));
                }
            }
            None => {}
        }
        match args.store {
            StoreKind::Postgres => {
                if let Ok(pool) = sqlx::PgPool::connect(&args.database_url).await {
                    let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                        .execute(&pool)
                        .await;
                    pool.close().await;
                }
            }
            StoreKind::Sqlite => {
                for ext in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{ext}", sqlite_path.display()));
                }
            }
        }
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn run_created(
    args: &RunArgs,
    name: &str,
    seed: u64,
    steps: &[Vec<FaultKind>],
    dest: &Destination,
    kafka_proxy: Option<Arc<TcpProxy>>,
    broker_server: Option<Arc<Mutex<PrivateBroker>>>,
    relay_bin: &Path,
    out: &Path,
    sqlite_path: &Path,
    pg_pair: Option<Arc<Mutex<pg_pair::PgPair>>>,
) -> Result<bool> {
    // Proxies: the relays reach the broker and PostgreSQL through them
    // when the plan cuts that connection. Kafka's clients connect to the address the broker advertises: only a
    // private broker advertising its proxy (started when the plan has a
    // broker fault, whose address `dest` already holds) can be cut.
    // A proxy only where the plan cuts that connection: every byte through
    // it costs the harness's process (which also runs the producer and the
    // consumer) and a hop per round trip that a user's relay does not pay.
    let planned = |kinds: &[FaultKind]| steps.iter().flatten().any(|k| kinds.contains(k));
    // Where the relays and the application reach PostgreSQL: the server,
    // or PgBouncer in front of it (`--pgbouncer`; the database proxies
    // then sit between the relays and the pooler). The harness's own
    // connections use `--database-url` whatever this is.
    let app_url = if args.pgbouncer && args.store == StoreKind::Postgres {
        args.pgbouncer_url.as_str()
    } else {
        args.database_url.as_str()
    };
    let broker_proxy = match dest {
        Destination::Nats { url, .. } | Destination::Amqp { url, .. }
            if planned(&[FaultKind::BrokerOutage, FaultKind::BrokerFlap]) =>
        {
            Some(Arc::new(TcpProxy::start(resolve(url).await?).await))
        }
        Destination::Nats { .. } | Destination::Amqp { .. } => None,
        Destination::Kafka { .. } => kafka_proxy,
    };
    let db_proxy = match args.store {
        StoreKind::Postgres if planned(&[FaultKind::DbOutage, FaultKind::DbFlap]) => {
            Some(Arc::new(TcpProxy::start(resolve(app_url).await?).await))
        }
        StoreKind::Postgres | StoreKind::Sqlite => None,
    };

    // `db-cut-one`: relay 0 reaches PostgreSQL through a proxy of its own
    // and the broker through a slow one, so that it alone can be cut off
    // from the database while its sink is slow.
    let first_relay = match (args.store, dest) {
        (StoreKind::Postgres, Destination::Nats { url, .. } | Destination::Amqp { url, .. })
            if planned(&[FaultKind::DbCutOne]) =>
        {
            let db = Arc::new(TcpProxy::start(resolve(app_url).await?).await);
            let broker_addr = resolve(url).await?;
            let broker = Arc::new(slow::SlowProxy::start(broker_addr).await?);
            Some((db, broker))
        }
        _ => None,
    };

    // Store URLs: the relays' (through the proxy, tagged with the run's
    // application_name) and the application's (no proxy).
    let relay_store = match args.store {
        StoreKind::Postgres => {
            let proxied = through(app_url, db_proxy.as_ref())?;
            let sep = if proxied.contains('?') { '&' } else { '?' };
            format!("{proxied}{sep}application_name={name}")
        }
        StoreKind::Sqlite => format!("sqlite://{}", sqlite_path.display()),
    };
    let mut store_args = vec!["--store".to_owned(), relay_store.clone()];
    if args.store == StoreKind::Postgres {
        store_args.extend([
            "--pg-schema".to_owned(),
            name.to_owned(),
            "--pg-mode".to_owned(),
            args.pg_mode.to_string(),
            // The fault proxies forward TCP and keep each session: said,
            // so that `auto` does not take them for a transaction pooler
            // (they listen on another port) and the runs test the direct
            // path. Through PgBouncer the relays find the pooler
            // themselves.
            "--pg-pooler".to_owned(),
            if args.pgbouncer { "auto" } else { "session" }.to_owned(),
        ]);
    }
    let (sink, topic, mut sink_args) = match dest {
        Destination::Nats { url, .. } => (
            through(url, broker_proxy.as_ref())?,
            "orders".to_owned(),
            vec!["--nats-subject-prefix".to_owned(), name.to_owned()],
        ),
        Destination::Amqp { url, queue } => (
            through(url, broker_proxy.as_ref())?,
            queue.clone(),
            Vec::new(),
        ),
        Destination::Kafka { brokers, topic } => {
            (format!("kafka://{brokers}"), topic.clone(), Vec::new())
        }
    };
    sink_args.splice(0..0, ["--sink".to_owned(), sink]);

    // Migrate with the relay binary, as a user would.
    let status = tokio::process::Command::new(relay_bin)
        .arg("migrate")
        .args(&store_args)
        .stdout(std::process::Stdio::null())
        .status()
        .await
        .with_context(|| format!("running {} migrate", relay_bin.display()))?;
    if !status.success() {
        bail!("`outbox-relay migrate` failed ({status})");
    }

    let app_db = match args.store {
        StoreKind::Postgres => {
            // Tagged, so that `pg-crash` can pick one of the run's sessions.
            // With the run's own primary and standby, the first read-write
            // host of the multi-host URL (followed below).
            let hosts = match &pg_pair {
                Some(_) => Some(outbox_postgres::PgHosts::parse(app_url)?),
                None => None,
            };
            let opts = match &hosts {
                Some(h) => h.find(Duration::from_secs(5)).await?.1,
                None => app_url
                    .parse::<sqlx::postgres::PgConnectOptions>()
                    .context("parsing the PostgreSQL URL")?,
            }
            .application_name(&format!("{name}-app"));
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(u32::try_from(args.tasks).unwrap_or(4) + 1)
                .acquire_timeout(Duration::from_secs(10))
                .connect_with(opts)
                .await
                .with_context(|| {
                    format!(
                        "the application cannot connect to {}",
                        if args.pgbouncer {
                            "PgBouncer (--pgbouncer-url; `cargo xtask services` starts it)"
                        } else {
                            "PostgreSQL"
                        }
                    )
                })?;
            if let Some(hosts) = hosts {
                follow_primary(hosts, pool.clone(), format!("{name}-app"));
            }
            // The harness's connection (set-up, faults, resolving unknown
            // commits): direct, whatever the application goes through.
            let admin = if args.pgbouncer {
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(2)
                    .acquire_timeout(Duration::from_secs(10))
                    .connect(&args.database_url)
                    .await
                    .context("the harness cannot connect to PostgreSQL")?
            } else {
                pool.clone()
            };
            let pooler = if args.pgbouncer {
                outbox_core::Pooler::Transaction
            } else {
                outbox_core::Pooler::None
            };
            let outbox = outbox_postgres::PgOutbox::in_mode(
                outbox_postgres::Ident::new(name)?,
                outbox_postgres::Ident::new("events")?,
                args.pg_mode,
            )?
            .with_pooler(pooler);
            AppDb::Postgres {
                pool,
                admin,
                pooled: args.pgbouncer,
                outbox,
                business: format!("\"{name}\".chaos_orders"),
                aggregates: format!("\"{name}\".chaos_aggregates"),
            }
        }
        StoreKind::Sqlite => {
            use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
            let opts = SqliteConnectOptions::new()
                .filename(sqlite_path)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(10));
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(u32::try_from(args.tasks).unwrap_or(2))
                .connect_with(opts)
                .await
                .context("the application cannot open the SQLite file")?;
            AppDb::Sqlite { pool }
        }
    };
    let producer_cfg = ProducerConfig {
        rate: args.rate,
        duration: Duration::from_secs(args.duration_s),
        tasks: args.tasks,
        mode: args.producer,
        keys: args.keys,
        max_events_per_tx: args.max_per_tx,
        rollback_one_in: args.rollback_one_in,
        pad: args.pad,
        topic,
        seed,
        key_prefix: String::new(),
    };
    app_db.prepare(&producer_cfg).await?;
    let pg_admin = match &app_db {
        AppDb::Postgres { admin, .. } => Some((admin.clone(), name.to_owned())),
        AppDb::Sqlite { .. } => None,
    };

    let ledger = Arc::new(Ledger::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    // The drain reads the whole effects table on each pass.
    let drain_full = Arc::new(AtomicBool::new(false));
    let e2e = match args.inbox {
        None => None,
        Some(db) => {
            let url = match dest {
                Destination::Nats { url, .. } | Destination::Amqp { url, .. } => {
                    through(url, broker_proxy.as_ref())?
                }
                Destination::Kafka { brokers, .. } => brokers.clone(),
            };
            Some(start_inbox(args, db, name, out, dest, &url).await?)
        }
    };
    let consumer = match &e2e {
        None => {
            let (dest, ledger) = (dest.clone(), ledger.clone());
            tokio::spawn(async move { dest.consume(ledger, stop_rx).await })
        }
        Some(e) => {
            let follow = consumers::follow(
                e.effects.clone(),
                ledger.clone(),
                drain_full.clone(),
                stop_rx,
            );
            tokio::spawn(async move {
                follow.await;
                anyhow::Ok(Vec::new())
            })
        }
    };
    let mut consumer_exits: Vec<String> = Vec::new();

    let mut relay_args = store_args;
    relay_args.extend(sink_args);
    relay_args.extend([
        "--batch-size".to_owned(),
        args.batch_size.to_string(),
        "--max-batch-size".to_owned(),
        args.max_batch_size.max(args.batch_size).to_string(),
        "--poll-interval-ms".to_owned(),
        args.poll_ms.to_string(),
        "--lock-timeout-ms".to_owned(),
        args.lease_ms.to_string(),
    ]);
    // Relay 0's own store and sink URLs (`db-cut-one`).
    let first_args = match (&first_relay, dest) {
        (Some((db, broker)), Destination::Nats { url, .. } | Destination::Amqp { url, .. }) => {
            let own_store = {
                let proxied = via(app_url, db.addr())?;
                let sep = if proxied.contains('?') { '&' } else { '?' };
                format!("{proxied}{sep}application_name={name}")
            };
            let own_sink = via(url, broker.addr())?;
            let mut first = relay_args.clone();
            for (flag, value) in [("--store", own_store), ("--sink", own_sink)] {
                let at = first
                    .iter()
                    .position(|a| a == flag)
                    .with_context(|| format!("no {flag} among the relay's arguments"))?;
                first[at + 1] = value;
            }
            Some(first)
        }
        _ => None,
    };
    let spec = RelaySpec {
        bin: relay_bin.to_owned(),
        first_args,
        args: relay_args,
        log_dir: out.to_owned(),
        name: name.to_owned(),
    };
    let relays = Arc::new(Mutex::new(Relays::start(spec, args.relays)?));
    let targets = Targets {
        relays: relays.clone(),
        broker_proxy: broker_proxy.clone(),
        db_proxy: db_proxy.clone(),
        pg_admin,
        database_url: (args.store == StoreKind::Postgres).then(|| args.database_url.clone()),
        allow_pg_restart: args.allow_pg_restart,
        allow_pg_crash: args.allow_pg_crash || args.allow_pg_restart,
        broker_server,
        consumers: e2e.as_ref().map(|e| e.consumers.clone()),
        consumer_db: e2e.as_ref().and_then(|e| e.consumer_db.clone()),
        first_relay: first_relay.clone(),
        nats_stream: match dest {
            Destination::Nats { stream, .. } => Some(stream.clone()),
            _ => None,
        },
        pg_pair: pg_pair.clone(),
    };
    for k in steps.iter().flatten() {
        targets.check(*k)?;
    }
    // Let the relays connect before the load starts.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut relay_exits = relays.lock().await.reap_and_restart()?;
    if !relay_exits.is_empty() {
        bail!("a relay exited at start:\n{}", relay_exits.join("\n"));
    }

    let start_us = now_us();
    let start = Instant::now();
    let producer = tokio::spawn(producer::run(app_db.clone(), producer_cfg, ledger.clone()));
    let warmup = Duration::from_secs(args.warmup_s.min(args.duration_s / 2));
    let spacing = if steps.is_empty() {
        Duration::ZERO
    } else {
        Duration::from_secs(args.duration_s).saturating_sub(warmup)
            / u32::try_from(steps.len()).unwrap_or(1)
    };
    let mut fault_task = tokio::spawn(faults::run_plan(
        steps.to_vec(),
        targets,
        FaultTimes {
            stop: Duration::from_millis(args.lease_ms + args.stop_extra_ms),
            outage: Duration::from_secs(args.outage_s),
            flap_cycles: args.flap_cycles,
            flap_down: Duration::from_millis(args.flap_down_ms),
            flap_up: Duration::from_millis(args.flap_up_ms),
            lease: Duration::from_millis(args.lease_ms),
            // Answers held twice the lease: a delivery in flight outlives
            // the lease unless the relay stops it by its own clock.
            slow_sink: Duration::from_millis(2 * args.lease_ms),
            recovery_room: Duration::from_secs(args.recovery_room_s),
            consumer_pause: Duration::from_millis(args.consumer_pause_ms.unwrap_or(
                match args.broker {
                    BrokerKind::Nats => args.nats_ack_wait_ms + 1000,
                    BrokerKind::Amqp | BrokerKind::Kafka => 1000,
                },
            )),
        },
        start,
        warmup,
        spacing,
        seed,
    ));

    // Watch: relays that die by themselves are restarted and reported.
    let mut faults_done: Option<Vec<FaultRecord>> = None;
    let mut last_print = Instant::now();
    while faults_done.is_none() || start.elapsed() < Duration::from_secs(args.duration_s) {
        tokio::select! {
            r = &mut fault_task, if faults_done.is_none() => {
                faults_done = Some(r.context("fault task panicked")??);
            }
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        relay_exits.extend(relays.lock().await.reap_and_restart()?);
        if let Some(e) = &e2e {
            consumer_exits.extend(e.consumers.lock().await.reap_and_restart()?);
        }
        if last_print.elapsed() >= Duration::from_secs(5) {
            last_print = Instant::now();
            eprintln!(
                "chaos {name}: {:>4.0} s  committed {:>8}  received {:>8}  outstanding {:>6}",
                start.elapsed().as_secs_f64(),
                ledger.committed_count(),
                ledger.arrival_count(),
                ledger.outstanding()
            );
        }
    }
    let produced = producer.await.context("producer panicked")??;
    let produce_end_us = now_us();
    let fault_records = faults_done.unwrap_or_default();

    // Unknown outcomes (a `COMMIT` cut by a fault): the business row says
    // whether it committed. Those that did must arrive like the others:
    // the drain waits for them too.
    let unknown_txs: Vec<uuid::Uuid> = produced
        .iter()
        .filter(|p| p.outcome == TxOutcome::Unknown)
        .map(|p| p.tx)
        .collect();
    let resolved_committed = app_db
        .committed_among(&unknown_txs)
        .await
        .context("resolving unknown commits")?;
    for p in &produced {
        if p.outcome == TxOutcome::Unknown && resolved_committed.contains(&p.tx) {
            ledger.committed(p.id);
        }
    }
    // After a failover: what the producer saw committed and the new
    // primary does not hold was lost with the old primary (asynchronous
    // replication); it is not waited for, and counted apart.
    let mut lost_with_primary = Vec::new();
    if pg_pair.is_some() {
        let committed_txs: Vec<uuid::Uuid> = produced
            .iter()
            .filter(|p| p.outcome == TxOutcome::Committed)
            .map(|p| p.tx)
            .collect::<std::collections::HashSet<_>>()
            .into_iter()
            .collect();
        let held = app_db
            .committed_among(&committed_txs)
            .await
            .context("reading which commits the promoted standby holds")?;
        lost_with_primary = committed_txs
            .into_iter()
            .filter(|tx| !held.contains(tx))
            .collect();
        let lost: std::collections::HashSet<_> = lost_with_primary.iter().collect();
        for p in &produced {
            if lost.contains(&p.tx) {
                ledger.forget(p.id);
            }
        }
        if !lost_with_primary.is_empty() {
            eprintln!(
                "chaos {name}: {} committed transaction(s) lost with the primary",
                lost_with_primary.len()
            );
        }
    }

    // Drain: until every committed event arrived, or the timeout; then a
    // quiet period for late copies.
    let drain_deadline = Instant::now() + Duration::from_secs(args.drain_timeout_s);
    drain_full.store(true, Ordering::Relaxed);
    while ledger.outstanding() > 0 && Instant::now() < drain_deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        relay_exits.extend(relays.lock().await.reap_and_restart()?);
        if let Some(e) = &e2e {
            consumer_exits.extend(e.consumers.lock().await.reap_and_restart()?);
        }
    }
    eprintln!(
        "chaos {name}: drained, outstanding {} after {:.1} s",
        ledger.outstanding(),
        (now_us() - produce_end_us) as f64 / 1e6
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    relays.lock().await.shutdown(Duration::from_secs(10)).await;
    if let Some(e) = &e2e {
        e.consumers
            .lock()
            .await
            .shutdown(Duration::from_secs(10))
            .await;
    }
    let _ = stop_tx.send(true);
    let arrivals = tokio::time::timeout(Duration::from_secs(10), consumer)
        .await
        .context("the consumer did not stop")?
        .context("consumer panicked")??;
    // End to end: the arrivals are the effects, in insertion order.
    let (arrivals, inbox_report) = match &e2e {
        None => (arrivals, None),
        Some(e) => {
            let effects = e.effects.arrivals().await?;
            let distinct = effects
                .iter()
                .map(|a| a.id)
                .collect::<std::collections::HashSet<_>>()
                .len() as u64;
            let report = checker::InboxReport {
                counts: e.consumers.lock().await.counts(),
                relay_copies: dest
                    .stored_messages()
                    .await
                    .map(|m| m.saturating_sub(distinct)),
                consumer_exits: std::mem::take(&mut consumer_exits),
            };
            e.close().await;
            (effects, Some(report))
        }
    };

    if let AppDb::Postgres { pool, admin, .. } = &app_db {
        pool.close().await;
        admin.close().await;
    }

    let meta = RunMeta {
        scenario: checker::Scenario {
            name: name.to_owned(),
            store: match args.store {
                StoreKind::Postgres => "postgres",
                StoreKind::Sqlite => "sqlite",
            }
            .to_owned(),
            broker: match args.broker {
                BrokerKind::Nats => "nats",
                BrokerKind::Amqp => "amqp",
                BrokerKind::Kafka => "kafka",
            }
            .to_owned(),
            relays: u32::try_from(args.relays).unwrap_or(0),
            rate: args.rate,
            duration_s: args.duration_s,
            max_batch_size: args.max_batch_size.max(args.batch_size),
            lease_ms: args.lease_ms,
            faults: args.faults.clone(),
            producer: args.producer.name().to_owned(),
            start_us,
            inbox: args.inbox.map(|db| {
                match db {
                    InboxDb::Postgres => "postgres",
                    InboxDb::Sqlite => "sqlite",
                }
                .to_owned()
            }),
            consumers: e2e
                .as_ref()
                .map_or(0, |e| u32::try_from(e.count).unwrap_or(0)),
            replication: match &pg_pair {
                Some(p) => Some(p.lock().await.replication().name().to_owned()),
                None => None,
            },
        },
        produce_end_us,
        resolved_committed: resolved_committed.into_iter().collect(),
        relay_exits,
        inbox: inbox_report,
        lost_with_primary,
        tenants: None,
    };
    write_records(out, &meta, &produced, &arrivals, &fault_records)?;
    let report = report(&meta, &produced, &arrivals, &fault_records);
    finish(out, &report)
}
