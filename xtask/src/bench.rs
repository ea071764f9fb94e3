//! `cargo xtask bench [--quick] [--scenario NAME]...`: checks the services,
//! makes sure the Kafka-protocol broker (Tansu) runs, then runs the
//! `outbox-bench` binary as a release build, forwarding the arguments.
//!
//! The binary does the measuring and writes `target/bench/results.json` and
//! `target/bench/results.md`; see BENCHMARKS.md.

use anyhow::{bail, Context, Result};
use std::process::Command;

/// Runs the benchmark. `args` are forwarded to `outbox-bench` (`--quick`,
/// `--scenario NAME` (repeatable or comma-separated), `--batch N`, `--list`).
pub(crate) fn run(args: &[String]) -> Result<()> {
    if args
        .iter()
        .any(|a| a == "--help" || a == "-h" || a == "--list")
    {
        return run_bench(args);
    }
    let _services = crate::services::ensure_all()?;
    // Kept alive until the benchmark ends; stops Tansu only if started here.
    let _tansu = crate::kafka::start_tansu()?;
    run_bench(args)
}

fn run_bench(args: &[String]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.args(["run", "--release", "-p", "outbox-bench", "--"])
        .args(args)
        .current_dir(crate::root());
    println!(
        "\n==> cargo run --release -p outbox-bench -- {}",
        args.join(" ")
    );
    let status = cmd
        .status()
        .with_context(|| format!("could not run {cargo}"))?;
    if !status.success() {
        bail!("the benchmark failed ({status})");
    }
    Ok(())
}
