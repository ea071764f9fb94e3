//! `cargo xtask`: the project's automation, in Rust so it runs anywhere cargo does.
//!
//! - `cargo xtask ci`: tidy, format check, clippy with `-D warnings`,
//!   packaging, every test against the real services (started or checked
//!   first), the quick start from a project outside the workspace, then the
//!   quick chaos suite.
//! - `cargo xtask package [--no-run]`: `cargo package` of every crate meant
//!   for users, then the outside project (`package.rs`).
//! - `cargo xtask tidy`: dependency direction, each backend feature alone,
//!   generated docs current, `deploy/` rules and dashboard valid, library
//!   seams, and the docs (paths, dates, deprecations, chaos results).
//! - `cargo xtask chaos [--quick|--medium|--full]`: the reliability suite
//!   (RELIABILITY.md).
//! - `cargo xtask services`: report (and start what the project starts itself).
//! - `cargo xtask public-api [--root DIR]`: every public path of every
//!   library crate with its kind, sorted, to diff two checkouts' APIs
//!   (`public_api.rs`).
//! - `cargo xtask screenshots`: the console's browser tests, saving each
//!   page as a PNG under `docs/console/` (installs chromium when missing).

#![allow(clippy::print_stdout, reason = "xtask is a command-line tool")]

mod bench;
mod browser;
mod chaos;
mod deploy;
mod kafka;
mod package;
mod pgbouncer;
mod public_api;
mod rust_source;
mod services;
mod tidy;
mod yaml;

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cmd, rest) = args
        .split_first()
        .map(|(c, r)| (c.as_str(), r))
        .unwrap_or(("help", &[]));
    match cmd {
        "ci" => ci(rest),
        "tidy" => tidy::run(rest),
        "package" => package::run(rest),
        "chaos" => chaos::run(rest),
        "services" => services::report_and_hold(rest),
        "bench" => bench::run(rest),
        "screenshots" => browser::screenshots(rest),
        "public-api" => public_api::run(rest),
        "help" | "--help" | "-h" => {
            print_help();
            Ok(())
        }
        other => {
            print_help();
            bail!("unknown xtask command {other:?}")
        }
    }
}

fn print_help() {
    println!(
        "cargo xtask <command>\n\n\
         ci         tidy, fmt check, clippy -D warnings, cargo package, all tests against the real\n\
         \x20          services, the quick start from an outside project, then the quick chaos suite\n\
         \x20          (`--no-chaos` skips it)\n\
         package    [--no-run]: cargo package of every user crate, then a project outside the\n\
         \x20          workspace builds them by version and runs the README quick start on PostgreSQL\n\
         tidy       dependency direction, each backend feature alone, generated docs current,\n\
         \x20          deploy/ alert rules and dashboard (metric names, shape; promtool when on PATH),\n\
         \x20          library seams, docs (paths exist, undated headings, no #[deprecated] before a\n\
         \x20          release, chaos results from the current plan)\n\
         chaos      [--quick|--medium|--full] [--only pg-nats,<run label>,...] [--keep] [--allow-pg-restart]\n\
         \x20          [--no-pg-crash] [--no-doc] [--dry-run]:\n\
         \x20          producer, relays, consumers and faults; lost / duplicated / order; a complete run\n\
         \x20          rewrites RELIABILITY.md's results section (`--no-doc` leaves it)\n\
         services   report PostgreSQL / RabbitMQ / NATS / Kafka and start the Kafka broker (Tansu) and\n\
         \x20          PgBouncer in transaction mode on 127.0.0.1:6432;\n\
         \x20          `--hold` keeps what it started running until Ctrl-C\n\
         bench      [--quick] [--scenario NAME]: throughput / latency / cost vs ceilings (BENCHMARKS.md)\n\
         public-api [--root DIR]: every public path of each library crate with its kind, sorted\n\
         \x20          (read from the sources as text; diff two checkouts' outputs)\n\
         screenshots the console's browser tests (headless chromium, installed when missing),\n\
         \x20          saving a PNG of each page under docs/console/ (README \"Operator console\")\n"
    );
}

/// The workspace root (the parent of `xtask/`).
pub(crate) fn root() -> PathBuf {
    // `cargo run` / `cargo xtask` set CARGO_MANIFEST_DIR for the process:
    // prefer it to the value baked in at compile time, which names the
    // checkout that built this binary (a shared target directory can hand
    // one checkout's xtask binary to another).
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Runs `cargo <args>` in the workspace root, failing with the command line.
pub(crate) fn cargo(args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!("\n==> cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .current_dir(root())
        .status()
        .with_context(|| format!("could not run {cargo}"))?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

fn ci(rest: &[String]) -> Result<()> {
    let started = std::time::Instant::now();
    let no_chaos = rest.iter().any(|a| a == "--no-chaos");
    let rest: Vec<String> = rest
        .iter()
        .filter(|a| *a != "--no-chaos")
        .cloned()
        .collect();
    tidy::run(&[])?;
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--all-features",
        "--",
        "-D",
        "warnings",
    ])?;
    let packaging = std::time::Instant::now();
    let packaged = package::package()?;
    let packaging = packaging.elapsed();
    // Build everything before touching services, so compile time does not
    // count against broker timeouts.
    cargo(&["test", "--workspace", "--all-features", "--no-run"])?;
    package::outside_project(&packaged, false)?;
    let _services = services::ensure_all()?;
    // The console's browser tests (in the test run below) drive Debian's
    // headless chromium through chromedriver: install them when missing.
    println!("\n==> browser for the console's tests");
    browser::ensure_chromium()?;
    let quickstart = std::time::Instant::now();
    package::outside_project(&packaged, true)?;
    println!(
        "\npackaging took {:.0?}, the outside project's quick start {:.0?}",
        packaging,
        quickstart.elapsed()
    );
    let mut test = vec!["test", "--workspace", "--all-features"];
    let extra: Vec<&str> = rest.iter().map(String::as_str).collect();
    test.extend(extra.iter().copied());
    cargo(&test)?;
    if no_chaos {
        println!("\nchaos skipped (--no-chaos)");
    } else {
        chaos::run(&["--quick".to_owned(), "--no-doc".to_owned()])?;
    }
    println!("\nci passed in {:.0?}", started.elapsed());
    Ok(())
}
