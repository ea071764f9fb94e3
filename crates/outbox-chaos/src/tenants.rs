//! `tenants` (issue 46): one `outbox-relay run` process over four
//! databases of the one PostgreSQL server, as a team with a database per
//! tenant runs it (`--store t0=URL ... --store t3=URL`, one named relay
//! per store, one shared NATS sink).
//!
//! The run creates its own databases (`<run>_t0` .. `<run>_t3`, `CREATE
//! DATABASE` on the server of `--database-url`) and drops them at the end
//! however it ends (a failure, its time bound, SIGINT/SIGTERM: this run
//! bounds itself and listens for the signals itself, so that the drop
//! always runs). The databases' roles:
//!
//! - `t0` **backlog**: `--tenant-backlog` events (500,000) loaded with
//!   `PgOutbox::enqueue_bulk` (`COPY`, 50,000 per transaction) before the
//!   relay starts and the clock with it;
//! - `t1` **killed**: mid-run every connection to it (the relay's, the
//!   producer's) is ended with `pg_terminate_backend`, again every 100 ms
//!   for `--tenant-kill-s` (3 s);
//! - `t2`, `t3` **fresh**: nothing but their producers.
//!
//! Producers commit on all four (a quarter of `--rate` each, 2 tasks, their
//! keys prefixed `t<i>.` so that the databases' keys stay apart in the one
//! stream; the backlog's keys are `t0.b<j>`). One recorder consumes the
//! stream. Checked per database: nothing lost, no order violation, no
//! unexpected message, duplicates within one batch for the killed database
//! and none elsewhere; the p99 commit -> arrival latency of the fresh
//! databases' events must stay under `--tenant-p99-ms` (500 ms): the
//! fairness the issue asks for (a database with a big backlog, or one that
//! is down, does not delay the others' fresh events). This is the one
//! timing the suite fails a run on, and why the bound is loose: on the
//! 2-core machine shared with PostgreSQL, NATS, the relay and the harness
//! draining half a million events, the default path runs in tens of ms
//! (BENCHMARKS.md, `tenants`), and a starved database shows up in seconds.
//! Reported besides: each database's p99, the killed database's first
//! delivery after the kill ended and its recovery, the backlog's drain.

use crate::checker;
use crate::cli::{BrokerKind, RunArgs, StoreKind};
use crate::consumer::Destination;
use crate::faults::FaultKind;
use crate::producer::{self, AppDb, ProducerConfig, ProducerMode};
use crate::record::{now_us, payload, secs, FaultRecord, Ledger, Produced, TxOutcome};
use crate::relays::{RelaySpec, Relays};
use crate::run_dir::{finish, report, write_records, RunMeta};
use crate::urls::with_database;
use anyhow::{bail, Context as _, Result};
use outbox_core::{EventId, NewEvent};
use rand::Rng;
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Mutex};
use tokio::time::Instant;
use uuid::Uuid;

/// How many databases the run serves through its one relay.
const DATABASES: usize = 4;
/// Keys of the backlog (`t0.b<j>`), each with its own sequence.
const BACKLOG_KEYS: u64 = 1000;
/// Backlog events per `COPY` (one transaction each).
const BACKLOG_CHUNK: u64 = 50_000;
/// Producer tasks (connections) per database.
const TASKS_PER_DB: usize = 2;
/// Between two rounds of `pg_terminate_backend` during the kill.
const KILL_EVERY: Duration = Duration::from_millis(100);

pub(crate) mod check;
pub(crate) mod result;

use self::result::{Role, TenantDb, TenantsMeta, BACKLOG_DB, KILLED_DB, KILL_KIND};

/// Refuses what a `tenants` run cannot do, before anything is created.
pub(crate) fn validate(args: &RunArgs, steps: &[Vec<FaultKind>]) -> Result<()> {
    if steps != [vec![FaultKind::Tenants]] {
        bail!(
            "tenants is a run of its own: pass `--faults tenants` alone (got {:?})",
            args.faults
        );
    }
    if args.store != StoreKind::Postgres {
        bail!("tenants needs `--store postgres`: it creates databases on the PostgreSQL server");
    }
    if args.broker != BrokerKind::Nats {
        bail!("tenants delivers to NATS (`--broker nats`)");
    }
    if args.inbox.is_some() || args.pgbouncer {
        bail!("tenants runs with the recorder and direct connections: no --inbox, no --pgbouncer");
    }
    if args.rate < DATABASES as u32 {
        bail!("tenants needs --rate of at least {DATABASES} (a quarter per database)");
    }
    if args.duration_s < 2 * args.warmup_s.max(1) + args.tenant_kill_s {
        bail!(
            "tenants needs --duration-s of at least twice the warm-up plus --tenant-kill-s ({} s)",
            2 * args.warmup_s.max(1) + args.tenant_kill_s
        );
    }
    if args.relays != 1 {
        bail!("tenants runs one relay process over its databases: --relays 1");
    }
    with_database(&args.database_url, "x").context("--database-url")?;
    Ok(())
}

/// The whole run: databases created, the run under its time bound and the
/// signals, databases dropped.
/// `relay_bin`: the `outbox-relay` binary (`--relay-bin`, or the one next
/// to this binary).
pub(crate) async fn run(
    args: RunArgs,
    steps: &[Vec<FaultKind>],
    relay_bin: impl FnOnce() -> Result<std::path::PathBuf>,
) -> Result<bool> {
    validate(&args, steps)?;
    let name = format!(
        "chaos_tenants_{:06x}",
        rand::rng().random_range(0..0xff_ffffu32)
    );
    let relay_bin = match &args.relay_bin {
        Some(b) => b.clone(),
        None => relay_bin()?,
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let out = std::fs::canonicalize(&args.out)?;
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&args.database_url)
        .await
        .with_context(|| {
            format!(
                "cannot connect to PostgreSQL at {}",
                outbox_core::redact_url(&args.database_url)
            )
        })?;
    let dbs: Vec<TenantDb> = (0..DATABASES)
        .map(|i| TenantDb {
            name: format!("t{i}"),
            database: format!("{name}_t{i}"),
            role: Role::of(i),
        })
        .collect();
    eprintln!(
        "chaos {name}: one relay over {DATABASES} databases ({}), backlog {} in t0, t1's connections killed for {} s, {} ev/s for {} s, out {}",
        dbs.iter().map(|d| d.database.as_str()).collect::<Vec<_>>().join(", "),
        args.tenant_backlog,
        args.tenant_kill_s,
        args.rate,
        args.duration_s,
        out.display()
    );
    let mut created = Vec::new();
    let mut result = Ok(false);
    for db in &dbs {
        match sqlx::query(&format!("CREATE DATABASE \"{}\"", db.database))
            .execute(&admin)
            .await
        {
            Ok(_) => created.push(db.database.clone()),
            Err(e) => {
                result = Err(anyhow::Error::new(e).context(format!(
                    "CREATE DATABASE {} (the run's user needs CREATEDB)",
                    db.database
                )));
                break;
            }
        }
    }
    if result.is_ok() {
        let bound = Duration::from_secs(
            args.timeout_s
                .unwrap_or(args.duration_s + args.tenant_kill_s + args.drain_timeout_s + 180),
        );
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("listening for SIGTERM")?;
        result = tokio::select! {
            r = tokio::time::timeout(bound, run_created(&args, &name, &dbs, &admin, &relay_bin, &out)) => match r {
                Ok(r) => r,
                Err(_) => Err(anyhow::anyhow!("the run did not finish within {bound:?}: stopped")),
            },
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
            _ = term.recv() => Err(anyhow::anyhow!("terminated")),
        };
    }
    // Whatever happened: the databases go (their relay is dead by now: a
    // dropped run kills it), unless kept.
    if args.keep {
        eprintln!("chaos {name}: kept databases {}", created.join(", "));
    } else {
        for db in created {
            if let Err(e) = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{db}\" WITH (FORCE)"))
                .execute(&admin)
                .await
            {
                eprintln!("chaos {name}: could not drop database {db}: {e}");
            }
        }
    }
    admin.close().await;
    result
}

/// One database's application side: its pool and outbox handle.
#[derive(Debug)]
struct Tenant {
    db: TenantDb,
    app: AppDb,
    pool: PgPool,
}

/// The run once its databases exist.
async fn run_created(
    args: &RunArgs,
    name: &str,
    dbs: &[TenantDb],
    admin: &PgPool,
    relay_bin: &Path,
    out: &Path,
) -> Result<bool> {
    let seed = args.seed.unwrap_or_else(|| rand::rng().random());
    let dest = Destination::Nats {
        url: args.nats_url.clone(),
        stream: name.to_uppercase(),
        prefix: name.to_owned(),
        replicas: 1,
    };
    dest.create().await?;
    let result = run_with_stream(args, name, dbs, admin, relay_bin, out, &dest, seed).await;
    if !args.keep {
        dest.delete().await;
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn run_with_stream(
    args: &RunArgs,
    name: &str,
    dbs: &[TenantDb],
    admin: &PgPool,
    relay_bin: &Path,
    out: &Path,
    dest: &Destination,
    seed: u64,
) -> Result<bool> {
    let topic = "orders".to_owned();
    // Each database: migrated by the relay binary, as a user would; the
    // application's pool and business table.
    let mut tenants = Vec::with_capacity(dbs.len());
    let mut store_args = Vec::new();
    for db in dbs {
        let url = with_database(&args.database_url, &db.database)?;
        let common = [
            "--pg-schema".to_owned(),
            name.to_owned(),
            "--pg-mode".to_owned(),
            args.pg_mode.to_string(),
        ];
        let status = tokio::process::Command::new(relay_bin)
            .arg("migrate")
            .args(["--store", &url])
            .args(&common)
            .stdout(std::process::Stdio::null())
            .status()
            .await
            .with_context(|| format!("running {} migrate", relay_bin.display()))?;
        if !status.success() {
            bail!(
                "`outbox-relay migrate` of database {} failed ({status})",
                db.database
            );
        }
        let sep = if url.contains('?') { '&' } else { '?' };
        store_args.extend([
            "--store".to_owned(),
            format!("{}={url}{sep}application_name={name}-relay", db.name),
        ]);
        let opts = url
            .parse::<sqlx::postgres::PgConnectOptions>()
            .context("parsing the PostgreSQL URL")?
            .application_name(&format!("{name}-app-{}", db.name));
        let pool = PgPoolOptions::new()
            .max_connections(u32::try_from(TASKS_PER_DB).unwrap_or(2) + 1)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(opts)
            .await
            .with_context(|| {
                format!("the application cannot connect to database {}", db.database)
            })?;
        let outbox = outbox_postgres::PgOutbox::in_mode(
            outbox_postgres::Ident::new(name)?,
            outbox_postgres::Ident::new("events")?,
            args.pg_mode,
        )?;
        let app = AppDb::Postgres {
            pool: pool.clone(),
            admin: pool.clone(),
            pooled: false,
            outbox,
            business: format!("\"{name}\".chaos_orders"),
            aggregates: format!("\"{name}\".chaos_aggregates"),
        };
        tenants.push(Tenant {
            db: db.clone(),
            app,
            pool,
        });
    }
    let per_db_rate = args.rate / DATABASES as u32;
    let cfg_of = |i: usize| ProducerConfig {
        rate: per_db_rate,
        duration: Duration::from_secs(args.duration_s),
        tasks: TASKS_PER_DB,
        mode: ProducerMode::Partitioned,
        keys: args.keys,
        max_events_per_tx: args.max_per_tx,
        rollback_one_in: args.rollback_one_in,
        pad: args.pad,
        topic: topic.clone(),
        seed: seed.wrapping_add(i as u64 * 104_729),
        key_prefix: format!("t{i}."),
    };
    for (i, t) in tenants.iter().enumerate() {
        t.app.prepare(&cfg_of(i)).await?;
    }

    let ledger = Arc::new(Ledger::default());
    // The backlog, before the relay and the clock start.
    let loading = Instant::now();
    // The backlog database's events are not waited for: its backlog takes
    // longer to drain than a quick run lasts (debug builds). They go to a
    // ledger of their own; the check requires each key's delivered events
    // to be a prefix of its sequence (check.rs), and counts the rest as
    // left in the log.
    let unwaited = Arc::new(Ledger::default());
    let backlog =
        load_backlog(&tenants[BACKLOG_DB], &topic, args.tenant_backlog, &unwaited).await?;
    eprintln!(
        "chaos {name}: {} backlog events loaded into t0 in {:.1} s",
        backlog.len(),
        loading.elapsed().as_secs_f64()
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let consumer = {
        let (dest, ledger) = (dest.clone(), ledger.clone());
        tokio::spawn(async move { dest.consume(ledger, stop_rx).await })
    };
    let Destination::Nats { url: nats_url, .. } = dest else {
        bail!("tenants delivers to NATS");
    };
    let mut relay_args = store_args;
    relay_args.extend([
        "--pg-schema".to_owned(),
        name.to_owned(),
        "--pg-mode".to_owned(),
        args.pg_mode.to_string(),
        "--pg-pooler".to_owned(),
        "session".to_owned(),
        "--sink".to_owned(),
        nats_url.clone(),
        "--nats-subject-prefix".to_owned(),
        name.to_owned(),
        "--batch-size".to_owned(),
        args.batch_size.to_string(),
        "--max-batch-size".to_owned(),
        args.max_batch_size.max(args.batch_size).to_string(),
        "--poll-interval-ms".to_owned(),
        args.poll_ms.to_string(),
        "--lock-timeout-ms".to_owned(),
        args.lease_ms.to_string(),
    ]);
    let spec = RelaySpec {
        bin: relay_bin.to_owned(),
        first_args: None,
        args: relay_args,
        log_dir: out.to_owned(),
        name: name.to_owned(),
    };
    let relays = Arc::new(Mutex::new(Relays::start(spec, 1)?));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut relay_exits = relays.lock().await.reap_and_restart()?;
    if !relay_exits.is_empty() {
        bail!("the relay exited at start:\n{}", relay_exits.join("\n"));
    }

    let start_us = now_us();
    let start = Instant::now();
    let mut producers = tokio::task::JoinSet::new();
    for (i, t) in tenants.iter().enumerate() {
        let ledger = if i == BACKLOG_DB {
            unwaited.clone()
        } else {
            ledger.clone()
        };
        let (app, cfg) = (t.app.clone(), cfg_of(i));
        producers.spawn(async move { (i, producer::run(app, cfg, ledger).await) });
    }
    // The kill: a third into the production, after the warm-up.
    let kill_at = start + Duration::from_secs(args.warmup_s.max(args.duration_s / 3));
    let killed = &tenants[KILLED_DB].db;
    let kill = {
        let (admin, database, store) =
            (admin.clone(), killed.database.clone(), killed.name.clone());
        let length = Duration::from_secs(args.tenant_kill_s);
        tokio::spawn(async move {
            tokio::time::sleep_until(kill_at).await;
            kill_database(&admin, &store, &database, length).await
        })
    };

    let mut produced: Vec<Produced> = backlog;
    let mut last_print = Instant::now();
    let mut done = 0;
    while done < tenants.len() {
        tokio::select! {
            r = producers.join_next() => match r {
                Some(r) => {
                    let (_, events) = r.context("producer panicked")?;
                    produced.extend(events?);
                    done += 1;
                }
                None => break,
            },
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        relay_exits.extend(relays.lock().await.reap_and_restart()?);
        if last_print.elapsed() >= Duration::from_secs(5) {
            last_print = Instant::now();
            eprintln!(
                "chaos {name}: {:>4.0} s  committed {:>8}  received {:>8}  outstanding {:>7}",
                start.elapsed().as_secs_f64(),
                ledger.committed_count(),
                ledger.arrival_count(),
                ledger.outstanding()
            );
        }
    }
    let produce_end_us = now_us();
    let kill_record = kill.await.context("the kill task panicked")??;

    // Unknown outcomes: each database's business rows tell.
    let mut resolved_committed = HashSet::new();
    for t in &tenants {
        let prefix = format!("{}.", t.db.name);
        let unknown: Vec<Uuid> = produced
            .iter()
            .filter(|p| p.outcome == TxOutcome::Unknown && p.key.starts_with(&prefix))
            .map(|p| p.tx)
            .collect();
        let found = t
            .app
            .committed_among(&unknown)
            .await
            .with_context(|| format!("resolving unknown commits of {}", t.db.name))?;
        resolved_committed.extend(found);
    }
    for p in &produced {
        if p.outcome == TxOutcome::Unknown && resolved_committed.contains(&p.tx) {
            ledger.committed(p.id);
        }
    }

    let drain_deadline = Instant::now() + Duration::from_secs(args.drain_timeout_s);
    while ledger.outstanding() > 0 && Instant::now() < drain_deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        relay_exits.extend(relays.lock().await.reap_and_restart()?);
    }
    eprintln!(
        "chaos {name}: drained, outstanding {} after {:.1} s",
        ledger.outstanding(),
        secs(now_us() - produce_end_us)
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    relays.lock().await.shutdown(Duration::from_secs(10)).await;
    let _ = stop_tx.send(true);
    let arrivals = tokio::time::timeout(Duration::from_secs(10), consumer)
        .await
        .context("the consumer did not stop")?
        .context("consumer panicked")??;
    for t in &tenants {
        t.pool.close().await;
    }

    let meta = RunMeta {
        scenario: checker::Scenario {
            name: name.to_owned(),
            store: "postgres".to_owned(),
            broker: "nats".to_owned(),
            relays: 1,
            rate: args.rate,
            duration_s: args.duration_s,
            max_batch_size: args.max_batch_size.max(args.batch_size),
            lease_ms: args.lease_ms,
            faults: args.faults.clone(),
            producer: ProducerMode::Partitioned.name().to_owned(),
            start_us,
            inbox: None,
            consumers: 0,
            replication: None,
        },
        produce_end_us,
        resolved_committed: resolved_committed.into_iter().collect(),
        relay_exits,
        inbox: None,
        lost_with_primary: Vec::new(),
        tenants: Some(TenantsMeta {
            databases: dbs.to_vec(),
            backlog: args.tenant_backlog,
            p99_target_ms: args.tenant_p99_ms as f64,
        }),
    };
    let faults = vec![kill_record];
    write_records(out, &meta, &produced, &arrivals, &faults)?;
    let report = report(&meta, &produced, &arrivals, &faults);
    finish(out, &report)
}

/// Loads `n` events into the backlog database, `BACKLOG_CHUNK` per `COPY`
/// in a transaction of its own, keys `t0.b<j>` with their own sequences;
/// each is recorded committed (in the ledger too) at its chunk's commit.
async fn load_backlog(
    tenant: &Tenant,
    topic: &str,
    n: u64,
    ledger: &Ledger,
) -> Result<Vec<Produced>> {
    let AppDb::Postgres {
        outbox, business, ..
    } = &tenant.app
    else {
        bail!("the backlog needs PostgreSQL");
    };
    let prefix = format!("{}.", tenant.db.name);
    let mut out = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
    let mut next_seq = vec![1u64; usize::try_from(BACKLOG_KEYS).unwrap_or(1)];
    let mut loaded = 0u64;
    while loaded < n {
        let size = BACKLOG_CHUNK.min(n - loaded);
        let tx_id = Uuid::now_v7();
        let mut events = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
        let mut made = Vec::with_capacity(events.capacity());
        for i in 0..size {
            let k = (loaded + i) % BACKLOG_KEYS;
            let slot = &mut next_seq[usize::try_from(k).unwrap_or(0)];
            let seq = *slot;
            *slot += 1;
            let key = format!("{prefix}b{k}");
            let id = EventId::new();
            events.push(
                NewEvent::new(
                    "chaos.backlog",
                    topic.to_owned(),
                    payload(id.as_uuid(), &key, seq, 0),
                )
                .with_key(key.clone())
                .with_id(id),
            );
            made.push((id.as_uuid(), key, seq));
        }
        let mut tx = tenant.pool.begin().await.context("backlog: BEGIN")?;
        sqlx::query(&format!(
            "INSERT INTO {business} (tx, events) VALUES ($1, $2)"
        ))
        .bind(tx_id)
        .bind(i32::try_from(size).unwrap_or(i32::MAX))
        .execute(&mut *tx)
        .await
        .context("backlog: the business row")?;
        outbox
            .enqueue_bulk(&mut tx, events)
            .await
            .context("backlog: enqueue_bulk")?;
        tx.commit().await.context("backlog: COMMIT")?;
        let at_us = now_us();
        for (id, key, seq) in made {
            ledger.committed(id);
            out.push(Produced {
                id,
                key,
                seq,
                tx: tx_id,
                outcome: TxOutcome::Committed,
                at_us,
            });
        }
        loaded += size;
    }
    Ok(out)
}

/// Ends every connection to `database` (`pg_terminate_backend`), again
/// every [`KILL_EVERY`] for `length`, from the admin connection (another
/// database). The record's target starts with the store's name.
async fn kill_database(
    admin: &PgPool,
    store: &str,
    database: &str,
    length: Duration,
) -> Result<FaultRecord> {
    let start_us = now_us();
    let until = Instant::now() + length;
    let (mut rounds, mut ended) = (0u64, 0i64);
    while Instant::now() < until {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(database)
        .fetch_one(admin)
        .await
        .context("pg_terminate_backend")?;
        ended += n;
        rounds += 1;
        tokio::time::sleep(KILL_EVERY).await;
    }
    let end_us = now_us();
    Ok(FaultRecord {
        kind: KILL_KIND.to_owned(),
        target: format!(
            "{store}: {ended} connection(s) to {database} terminated in {rounds} rounds over {:.1} s",
            length.as_secs_f64()
        ),
        start_us,
        end_us,
        recovery_from_us: None,
        // The relay may have published a batch whose settle the kill cut:
        // delivered again (one batch).
        may_duplicate: true,
        broker_cuts: 0,
        sink_down: Vec::new(),
        // From here the first delivery and the catch-up are measured.
        db_ready_us: Some(end_us),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
