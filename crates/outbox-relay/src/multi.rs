//! `run` over several stores (`--store NAME=URL` repeated, `--stores
//! FILE`): one relay per store, each in its own task with its own options,
//! consumer group, shard leases and dead letters, all delivering to ONE
//! sink (shared by `Arc`).
//!
//! Each store is opened, migrated (with `--migrate`) and run on its own: a
//! store whose database is down at start, or slow to migrate, is retried
//! with a capped backoff in its task and logged by its name (never its
//! URL) while the others deliver. Once running, a relay rides out its
//! database going away as one relay does (claims back off; nothing is
//! lost). SIGINT/SIGTERM stops them all, each finishing its batch within
//! its shutdown grace. Adding or removing a store is a restart.
//!
//! With `console_addr` the console serves every store (its index at `/`,
//! each store's pages under `/stores/NAME`), through its own connections:
//! a store that cannot be opened when the console starts is shown as such
//! on the index until the next restart, while its relay keeps trying.

use crate::any::{AnySink, AnyStore};
use crate::config::stores::StoreSpec;
use crate::config::{self, Resolved};
use crate::exporter::bind_metrics;
use crate::http::{self, StoreSlot};
use crate::{open, report, shutdown};
use anyhow::Context as _;
use outbox_core::{redact_url, Jitter, RetryPolicy};
use outbox_worker::{Relay, RelayOptions, StoreName};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tracing::{info, warn};

/// First wait before opening a store again; doubles up to [`OPEN_RETRY_MAX`].
const OPEN_RETRY_FIRST: Duration = Duration::from_millis(500);
/// Longest wait between two attempts to open a store.
const OPEN_RETRY_MAX: Duration = Duration::from_secs(30);

/// One store, ready to be opened: its name, settings and relay options.
struct Planned {
    name: StoreName,
    resolved: Resolved,
    options: RelayOptions,
    migrate: bool,
}

/// Runs one relay per store of `specs` into the sink of `resolved` until
/// SIGINT/SIGTERM.
pub(crate) async fn run(
    resolved: &Resolved,
    specs: Vec<StoreSpec>,
    secrets: &[String],
) -> anyhow::Result<()> {
    let cfg = config::run_config(resolved)?;
    // Every store's settings are checked before anything starts: a typo
    // in one store's settings fails the command, not that store's task.
    let mut planned = Vec::with_capacity(specs.len());
    for spec in specs {
        let store_cfg =
            config::run_config(&spec.resolved).with_context(|| format!("store {}", spec.name))?;
        spec.resolved
            .scope()
            .with_context(|| format!("store {}", spec.name))?;
        planned.push(Planned {
            name: spec.name,
            resolved: spec.resolved,
            options: store_cfg.options,
            migrate: store_cfg.migrate,
        });
    }
    // The sink keeps a message after a dropped delivery (Kafka) no longer
    // than the shortest lease of its relays.
    let lock_timeout = planned
        .iter()
        .map(|p| p.options.lock_timeout())
        .min()
        .unwrap_or_else(|| cfg.options.lock_timeout());
    let sink = AnySink::connect(
        &cfg.sink,
        |d| resolved.backend_settings(d),
        cfg.wire_format,
        cfg.cloudevents_source.as_ref(),
        lock_timeout,
    )
    .await
    .map_err(|e| open::connect_error(resolved, e))?;
    let sink = Arc::new(sink);
    // Bound before the relay starts, so a taken port fails the command.
    let (listener, metrics) = bind_metrics(cfg.metrics_addr).await?;
    #[cfg(feature = "console")]
    if let Some(c) = &cfg.console {
        let stores = planned
            .iter()
            .map(|p| StoreSpec {
                name: p.name.clone(),
                resolved: p.resolved.clone(),
            })
            .collect();
        spawn_console_stores(c, stores, cfg.metrics_addr, secrets).await?;
    }
    outbox_worker::metrics::describe_metrics();
    let names: Vec<&str> = planned.iter().map(|p| p.name.as_str()).collect();
    info!(
        stores = %names.join(","),
        sink = %redact_url(&cfg.sink),
        wire_format = %cfg.wire_format,
        "starting one relay per store"
    );
    let slots: Vec<Arc<StoreSlot>> = planned
        .iter()
        .map(|p| StoreSlot::new(p.name.as_str()))
        .collect();
    if let Some((addr, listener)) = listener {
        http::spawn_stores(listener, metrics, slots.clone(), secrets.to_vec());
        info!(%addr, "serving /metrics, /healthz and /readyz (one section per store)");
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    for (plan, slot) in planned.into_iter().zip(slots) {
        let sink = Arc::clone(&sink);
        let (stop, secrets) = (stop_rx.clone(), secrets.to_vec());
        tasks.spawn(serve_store(plan, sink, slot, stop, secrets));
    }
    shutdown::signal().await;
    let _ = stop_tx.send(true);
    while let Some(done) = tasks.join_next().await {
        if let Err(e) = done {
            warn!(error = %e, "a store's relay task ended abnormally");
        }
    }
    info!("every store's relay stopped");
    Ok(())
}

/// Completes once `stop` is set.
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Opens (and migrates) the store of `plan` until it works or the process
/// stops, then runs its relay into `sink` until `stop`.
async fn serve_store(
    plan: Planned,
    sink: Arc<AnySink>,
    slot: Arc<StoreSlot>,
    stop: watch::Receiver<bool>,
    secrets: Vec<String>,
) {
    let name = plan.name.clone();
    let retry = RetryPolicy::new(OPEN_RETRY_FIRST, OPEN_RETRY_MAX, u32::MAX, Jitter::Equal)
        .unwrap_or_default();
    let mut attempt: u32 = 0;
    let store = loop {
        let opened = tokio::select! {
            opened = open_store(&plan) => opened,
            () = stopped(stop.clone()) => return,
        };
        match opened {
            Ok(store) => break store,
            Err(e) => {
                attempt = attempt.saturating_add(1);
                // Jitter from the clock: stores down together are not retried in step.
                let spread = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.5, |d| f64::from(d.subsec_nanos()) / 1e9);
                let delay = retry.next_delay(attempt, spread);
                let error = report::render(&e, &secrets);
                warn!(store = %name, %error, attempt, retry_in = ?delay, "cannot open the store; the other stores go on, this one is tried again");
                slot.failed(error);
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = stopped(stop.clone()) => return,
                }
            }
        }
    };
    let options = plan.options;
    let group = store.group().to_owned();
    let leases = http::lease_source(&store, options.relay_id(), options.shard());
    let lease_grace = http::lease_grace(options.lock_timeout(), options.poll_interval());
    let control = store.clone();
    let (store, probe) = http::Watched::new(store);
    let relay = match Relay::new(store, Arc::clone(&sink), options) {
        Ok(relay) => relay.with_control(control, group.clone()),
        Err(e) => {
            // Checked at start (run_config validates the options).
            warn!(store = %name, error = %e, "invalid relay settings; this store is not relayed");
            return;
        }
    }
    .with_store_name(name.clone());
    slot.running(http::Endpoints {
        metrics: None,
        sink: relay.sink_health(),
        store: probe,
        pause: relay.pause_handle(),
        leases,
        lease_grace,
        secrets,
    });
    info!(store = %name, %group, relay_id = %relay.options().relay_id(), "store open: relaying");
    let summary = relay.run(stopped(stop)).await;
    info!(
        store = %name,
        delivered = summary.delivered,
        retried = summary.retried,
        dead = summary.dead,
        released = summary.released,
        "relay exited"
    );
}

/// The store of `plan`, connected and (with `--migrate`) migrated.
async fn open_store(plan: &Planned) -> anyhow::Result<AnyStore> {
    let (store, _url) = open::resolved_store(&plan.resolved).await?;
    if plan.migrate {
        store.migrate().await.context("migration failed")?;
    }
    Ok(store)
}

/// Serves the console of several stores beside their relays: bound (and
/// its token read) before the relays start, so a taken port or a bad token
/// fails `run`; the console opens the stores through its own connections,
/// in its own task (a store that is down does not hold the relays back).
#[cfg(feature = "console")]
async fn spawn_console_stores(
    c: &config::ConsoleConfig,
    stores: Vec<config::stores::StoreSpec>,
    metrics_addr: Option<std::net::SocketAddr>,
    secrets: &[String],
) -> anyhow::Result<()> {
    let mut secrets = secrets.to_vec();
    let mut serving = crate::console::Serving::new(c.listen);
    serving.allow_remote = c.allow_remote;
    serving.allowed_hosts = c.allowed_hosts.clone();
    serving.token = crate::console::load_token(
        c.token_file.as_deref(),
        c.token_env.as_deref(),
        &mut secrets,
    )?;
    serving.relays = metrics_addr.map(|a| a.to_string()).into_iter().collect();
    let listener = serving.bind().await?;
    tokio::spawn(async move {
        let stores = crate::console::open_stores(stores, &secrets).await;
        if let Err(e) =
            crate::console::serve_stores(listener, stores, serving, secrets.clone()).await
        {
            tracing::error!(error = %report::render(&e, &secrets), "the console stopped");
        }
    });
    Ok(())
}
