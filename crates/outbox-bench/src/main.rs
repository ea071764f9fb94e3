//! `outbox-bench`: the benchmark behind `cargo xtask bench`.
//!
//! Runs the scenarios of [`registry::SCENARIOS`] against the real services
//! (PostgreSQL, NATS JetStream, RabbitMQ, a Kafka-protocol broker), prints a
//! markdown table and writes `target/bench/results.json` (and `results.md`,
//! which `cargo xtask bench` copies into BENCHMARKS.md after a run of every
//! scenario, with the registry's fingerprint). Every
//! throughput is reported as a ratio to ceilings measured in the same run,
//! because absolute numbers on a shared machine move from run to run.
//!
//! Each scenario works in its own Postgres schema / stream / queue / topic
//! and removes it afterwards; every loop is bounded in time.

#![allow(
    clippy::print_stdout,
    reason = "a command-line tool whose output is the report"
)]

mod probe;
mod registry;
mod report;
mod run;
mod scenarios;
mod setup;
mod trace;

use anyhow::{bail, Result};
use clap::Parser;
use registry::SCENARIOS;
use report::Report;
use std::path::PathBuf;
use std::time::Instant;

/// Command line.
#[derive(Parser)]
#[command(
    name = "outbox-bench",
    about = "Benchmarks of the outbox relay against the real services."
)]
struct Cli {
    /// Small backlogs (100k max) and short durations: under 10 minutes.
    #[arg(long)]
    quick: bool,
    /// Run only these scenarios (repeat or comma-separate); default all.
    #[arg(long = "scenario", value_delimiter = ',')]
    scenarios: Vec<String>,
    /// Tiny sizes to check that every scenario runs (numbers meaningless).
    #[arg(long, hide = true)]
    smoke: bool,
    /// Relay batch size (events per claim).
    #[arg(long, default_value_t = 1000)]
    batch: u32,
    /// Inbox options of the `inbox` scenario, for experiments (e.g.
    /// `lanes=16,lane_batch=512,recv_batch=1024,max_in_flight=4096,window=4096`);
    /// default: the product defaults.
    #[arg(long, hide = true)]
    inbox_options: Option<String>,
    /// A sentence for the results header (e.g. what else the machine ran).
    #[arg(long)]
    note: Option<String>,
    /// List the scenarios and exit.
    #[arg(long)]
    list: bool,
    /// Where results.json and results.md go.
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test",
        hide_env_values = true
    )]
    database_url: String,
    /// NATS URL.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    nats_url: String,
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true,
        hide_default_value = true
    )]
    amqp_url: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    kafka_brokers: String,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if cli.list {
        for (name, what) in SCENARIOS {
            println!("{name:<16} {what}");
        }
        return Ok(());
    }
    let selected: Vec<&'static str> = if cli.scenarios.is_empty() {
        SCENARIOS.iter().map(|(n, _)| *n).collect()
    } else {
        let mut v = Vec::new();
        for s in &cli.scenarios {
            match SCENARIOS.iter().find(|(n, _)| n == s) {
                Some((n, _)) => v.push(*n),
                None => bail!(
                    "unknown scenario {s:?}; known: {}",
                    SCENARIOS
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
        }
        // Run order is the table's order, whatever the command line said.
        SCENARIOS
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| v.contains(n))
            .collect()
    };
    {
        use tracing_subscriber::layer::SubscriberExt as _;
        use tracing_subscriber::util::SubscriberInitExt as _;
        use tracing_subscriber::Layer as _;
        let printed = tracing_subscriber::EnvFilter::try_from_env("OUTBOX_BENCH_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,sqlx::query=error"));
        tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_filter(printed),
            )
            // Counts the background rotation's outcomes (rotation-under-load).
            .with(trace::RotationLog.with_filter(trace::filter()))
            .init();
    }
    let out_dir = cli
        .out_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/bench"));
    let services = setup::Services {
        database_url: cli.database_url.clone(),
        nats_url: cli.nats_url.clone(),
        amqp_url: cli.amqp_url.clone(),
        kafka_brokers: cli.kafka_brokers.clone(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let started = Instant::now();
    let mut ctx = scenarios::Ctx::new(services, cli.quick || cli.smoke, cli.smoke, cli.batch);
    if let Some(o) = &cli.inbox_options {
        ctx.inbox_tuning = scenarios::Tuning::parse(o)?;
    }
    let machine = runtime.block_on(ctx.machine());
    for name in &selected {
        eprintln!(
            "\n== {name} ({:.0} s so far)",
            started.elapsed().as_secs_f64()
        );
        let before = ctx.rows.len();
        let t = Instant::now();
        let outcome = runtime.block_on(ctx.run(name));
        if let Err(e) = outcome {
            eprintln!("!! scenario {name} failed: {e:#}");
            ctx.failures.push(format!("{name}: {e:#}"));
        }
        runtime.block_on(ctx.cleanup());
        for r in &ctx.rows[before..] {
            eprintln!(
                "   {:<55} {:>12} {}{}",
                r.case,
                report::num(r.result),
                r.unit,
                r.ratio
                    .map(|x| format!("  (ratio {x:.2})"))
                    .unwrap_or_default()
            );
        }
        eprintln!("   ({name}: {:.0} s)", t.elapsed().as_secs_f64());
    }
    let report = Report {
        machine,
        quick: cli.quick || cli.smoke,
        smoke: cli.smoke,
        note: cli.note.clone(),
        scenarios: selected.iter().map(|s| (*s).to_owned()).collect(),
        fingerprint: registry::fingerprint(),
        duration_s: started.elapsed().as_secs_f64(),
        results: std::mem::take(&mut ctx.rows),
        failures: std::mem::take(&mut ctx.failures),
    };
    let md = report::markdown(&report);
    println!("\n{md}");
    report::write_json(&report, &out_dir.join("results.json"))?;
    std::fs::write(out_dir.join("results.md"), &md)?;
    println!(
        "wrote {} and results.md",
        out_dir.join("results.json").display()
    );
    drop(runtime);
    if !report.failures.is_empty() {
        bail!("{} scenario(s) failed", report.failures.len());
    }
    Ok(())
}
