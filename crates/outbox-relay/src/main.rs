//! `outbox-relay`: runs the outbox relay, its demo, and store administration.
//!
//! Commands: `demo`, `run`, `migrate`, `status`, `pause`, `resume`,
//! `dead list|show|retry|purge`, `group list|drop`, `reanchor`, `console` (feature
//! `console`: the operator's web console).
//! Logs go to stderr (`RUST_LOG` filters them); command output goes to stdout.
//! Errors are printed as one line, each cause once, root cause last, with
//! every password the user passed replaced by `***`.
// A command-line tool's output is its stdout.
#![allow(clippy::print_stdout)]
// Built with a broker feature and no store feature (`cargo xtask tidy` builds
// each backend alone), `AnyStore` has no variant: every command that opens a
// store stops there, and what follows is unreachable, not unused by mistake.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres")),
    allow(unused_variables)
)]

mod any;
mod backends;
mod config;
#[cfg(feature = "console")]
mod console;
mod control;
mod dead;
#[cfg(feature = "sqlite")]
mod demo;
mod exporter;
mod groups;
mod http;
mod multi;
mod open;
mod reanchor;
mod report;
mod shutdown;
mod status;
mod table;

use any::{AnySink, AnyStore};
use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use config::{Resolved, RunArgs, StoreArgs};
use exporter::bind_metrics;
use outbox_core::redact_url;
use outbox_worker::Relay;
use std::path::PathBuf;
use std::process::ExitCode;
use tracing::info;

/// The transactional outbox relay.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the embedded default end to end (SQLite + in-process handlers), no services needed.
    #[cfg(feature = "sqlite")]
    Demo(demo::DemoArgs),
    /// Run the relay until SIGINT/SIGTERM.
    Run(Box<RunArgs>),
    /// Create or upgrade the outbox tables.
    Migrate(StoreArgs),
    /// Show pending, in-flight and dead counts; for the PostgreSQL event
    /// log every consumer group per shard (pending, lag, retry lane, parked
    /// keys, owner), dead letters by code, what holds rotation and the
    /// database horizon back; and the sink state of running relays
    /// (`--relay ADDR`, their `--metrics-addr`).
    Status(status::StatusArgs),
    /// Pause a consumer group: its running relays stop claiming within
    /// about a second (what they claimed is delivered and settled).
    Pause(control::PauseArgs),
    /// Resume a paused consumer group: its relays claim again within about
    /// a second.
    Resume(control::PauseArgs),
    /// Inspect, replay or purge dead letters (of `--group`).
    Dead {
        #[command(subcommand)]
        command: dead::DeadCommand,
    },
    /// List or drop consumer groups (PostgreSQL event log).
    Group {
        #[command(subcommand)]
        command: groups::GroupCommand,
    },
    /// Anchor the PostgreSQL event log's positions to this database after
    /// a switchover, a restore or an upgrade moved it (relays refuse to
    /// claim until then): `--from origin` delivers the retained log again,
    /// `--from now` skips it (undelivered events are lost).
    Reanchor(reanchor::ReanchorArgs),
    /// Serve the operator console: a web page of the groups, shards,
    /// relays and dead letters, with replay, purge and pause/resume for an
    /// operator holding the admin token (read-only without one).
    #[cfg(feature = "console")]
    Console(Box<console::ConsoleArgs>),
    /// Print the README's configuration table (generated from the settings
    /// and the backends' descriptors), or check or update a file's copy.
    #[command(hide = true)]
    ConfigTable(TableArgs),
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("mode").args(["check", "write"])))]
struct TableArgs {
    /// Fail when the table between the markers of FILE is stale.
    #[arg(long, value_name = "FILE")]
    check: Option<PathBuf>,
    /// Rewrite the table between the markers of FILE.
    #[arg(long, value_name = "FILE")]
    write: Option<PathBuf>,
}

fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Every URL on the command line or in the environment may carry a
    // password; the resolved configuration adds those of the config file.
    let mut secrets: Vec<String> = std::env::args()
        .chain(
            std::env::vars()
                .filter(|(k, _)| k.starts_with(outbox_core::backend::ENV_PREFIX))
                .map(|(_, v)| v),
        )
        .filter(|a| a.contains('@'))
        .flat_map(|a| report::url_secrets(&a))
        .collect();
    match runtime.block_on(dispatch(cli.command, &mut secrets)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", report::render(&e, &secrets));
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command, secrets: &mut Vec<String>) -> anyhow::Result<()> {
    match command {
        #[cfg(feature = "sqlite")]
        Command::Demo(args) => {
            // The demo prints its own progress lines.
            init_logging("error");
            demo::run(args).await
        }
        Command::Run(args) => {
            init_logging("info");
            let resolved = args.resolve()?;
            secrets.extend(resolved.secrets());
            match config::stores::plan(&resolved)? {
                None => run(&resolved, secrets).await,
                Some(stores) => {
                    for store in &stores {
                        secrets.extend(store.resolved.secrets());
                    }
                    multi::run(&resolved, stores, secrets).await
                }
            }
        }
        Command::Migrate(args) => {
            init_logging("warn");
            let (store, url) = open::store(&args, secrets).await?;
            store.migrate().await.context("migration failed")?;
            println!("migrated {}", redact_url(&url));
            Ok(())
        }
        Command::Status(args) => {
            init_logging("warn");
            status::run(args, secrets).await
        }
        Command::Pause(args) => {
            init_logging("warn");
            control::run(args, true, secrets).await
        }
        Command::Resume(args) => {
            init_logging("warn");
            control::run(args, false, secrets).await
        }
        Command::Dead { command } => {
            init_logging("warn");
            dead::run(command, secrets).await
        }
        Command::Group { command } => {
            init_logging("warn");
            groups::run(command, secrets).await
        }
        Command::Reanchor(args) => {
            init_logging("warn");
            reanchor::run(args, secrets).await
        }
        #[cfg(feature = "console")]
        Command::Console(args) => {
            // The audit lines (who changed what) are INFO.
            init_logging("info");
            console::run(*args, secrets).await
        }
        Command::ConfigTable(args) => match (args.check, args.write) {
            (Some(path), _) => table::check(&path),
            (None, Some(path)) => table::write(&path),
            (None, None) => {
                print!("{}", table::markdown());
                Ok(())
            }
        },
    }
}

async fn run(resolved: &Resolved, secrets: &[String]) -> anyhow::Result<()> {
    let cfg = config::run_config(resolved)?;
    let (store, url) = open::resolved_store(resolved).await?;
    if cfg.migrate {
        store.migrate().await.context("migration failed")?;
    }
    let sink = AnySink::connect(
        &cfg.sink,
        |d| resolved.backend_settings(d),
        cfg.wire_format,
        cfg.cloudevents_source.as_ref(),
        cfg.options.lock_timeout(),
    )
    .await
    .map_err(|e| open::connect_error(resolved, e))?;
    // Bound before the relay starts, so a taken port fails the command.
    let (listener, metrics) = bind_metrics(cfg.metrics_addr).await?;
    #[cfg(feature = "console")]
    if let Some(c) = &cfg.console {
        spawn_console(c, &store, &url, cfg.metrics_addr, secrets).await?;
    }
    outbox_worker::metrics::describe_metrics();
    info!(
        store = %redact_url(&url),
        sink = %redact_url(&cfg.sink),
        wire_format = %cfg.wire_format,
        cloudevents_source = cfg.cloudevents_source.as_ref().map(|s| s.as_str()),
        relay_id = %cfg.options.relay_id(),
        configured_relay_id = cfg.options.relay_id().configured(),
        shard = %cfg.options.shard(),
        group = %scope_name(&store),
        batch_size = cfg.options.batch_size(),
        poll_interval = ?cfg.options.poll_interval(),
        lock_timeout = ?cfg.options.lock_timeout(),
        delivery_timeout = ?cfg.options.delivery_timeout(),
        max_rate = ?cfg.options.max_rate(),
        group = store.group(),
        "starting relay"
    );
    let group = store.group().to_owned();
    // `/readyz` reads the relay's shard leases from the store's memory.
    let leases = http::lease_source(&store, cfg.options.relay_id(), cfg.options.shard());
    let lease_grace = http::lease_grace(cfg.options.lock_timeout(), cfg.options.poll_interval());
    // The relay reads its group's control row (pause/resume) through its
    // own clone of the store, outside the readiness probe's claim tracking.
    let control = store.clone();
    let (store, store_probe) = http::Watched::new(store);
    let relay = Relay::new(store, sink, cfg.options)
        .context("invalid relay settings")?
        .with_control(control, group);
    if let Some((addr, listener)) = listener {
        http::spawn(
            listener,
            http::Endpoints {
                metrics,
                sink: relay.sink_health(),
                store: store_probe,
                pause: relay.pause_handle(),
                leases,
                lease_grace,
                secrets: secrets.to_vec(),
            },
        );
        info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    let summary = relay.run(shutdown::signal()).await;
    info!(
        delivered = summary.delivered,
        retried = summary.retried,
        dead = summary.dead,
        released = summary.released,
        "relay exited"
    );
    Ok(())
}

/// Serves the console beside the relay: bound (and its token read) before
/// the relay starts, so a taken port or a bad token fails `run`. The
/// console reads the store through its own clone (the relay's pool); with
/// `--metrics-addr` its overview shows this relay's sink state.
#[cfg(feature = "console")]
async fn spawn_console(
    c: &config::ConsoleConfig,
    store: &AnyStore,
    url: &str,
    metrics_addr: Option<std::net::SocketAddr>,
    secrets: &[String],
) -> anyhow::Result<()> {
    let mut secrets = secrets.to_vec();
    let mut serving = console::Serving::new(c.listen);
    serving.allow_remote = c.allow_remote;
    serving.allowed_hosts = c.allowed_hosts.clone();
    serving.token = console::load_token(
        c.token_file.as_deref(),
        c.token_env.as_deref(),
        &mut secrets,
    )?;
    serving.relays = metrics_addr.map(|a| a.to_string()).into_iter().collect();
    let listener = serving.bind().await?;
    let (store, url) = (store.clone(), url.to_owned());
    tokio::spawn(async move {
        if let Err(e) = console::serve(listener, store, &url, serving, secrets.clone()).await {
            tracing::error!(error = %report::render(&e, &secrets), "the console stopped");
        }
    });
    Ok(())
}

/// The consumer group the relay reads (`-` for a store without groups).
fn scope_name(store: &AnyStore) -> String {
    match store {
        #[cfg(feature = "postgres")]
        AnyStore::PgLog(log) => log.group().to_owned(),
        _ => "-".to_owned(),
    }
}
