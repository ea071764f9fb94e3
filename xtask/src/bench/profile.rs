//! `cargo xtask bench --profile SCENARIO [--quick] [...]`: runs one
//! scenario under `perf record` and writes its flame graph.
//!
//! - The bench is built with the `profiling` cargo profile (the release
//!   profile, line tables kept) and frame pointers, in its own target
//!   directory under `target/`, so the release build of `cargo xtask bench`
//!   is not rebuilt afterwards.
//! - `perf record -a` samples the whole machine (software clock: most
//!   virtual machines have no hardware counters) with frame-pointer call
//!   graphs, so PostgreSQL's backends and the brokers are in the picture
//!   beside the relay. Debian's PostgreSQL is built without frame pointers:
//!   its stacks are short, but each sample lands in the right function.
//! - `inferno` (the Rust port of the FlameGraph tools, installed with
//!   `cargo install inferno` when missing, like Tansu; not a dependency of
//!   the workspace) folds the stacks and draws the SVG.
//!
//! Written under `target/bench/profile/`: `SCENARIO.svg` (the flame graph),
//! `SCENARIO.folded` (the folded stacks, to diff two runs) and
//! `SCENARIO.processes.txt` (the share of samples per process and per
//! binary, the split between the relay and the database at a glance).

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Where the outputs go, relative to the workspace root.
const OUT: &str = "target/bench/profile";
/// Samples per second per CPU: enough for a minute-long scenario, small
/// enough that `perf` itself stays out of the picture.
const FREQUENCY: &str = "499";

/// Runs `scenario` under `perf` with the other bench arguments `rest`.
pub(crate) fn run(scenario: &str, rest: &[String]) -> Result<()> {
    let root = crate::root();
    require_perf()?;
    let bin_dir = ensure_inferno()?;
    let bench = build_bench(&root)?;
    let out = root.join(OUT);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let data = out.join(format!("{scenario}.perf.data"));
    let _services = crate::services::ensure_all()?;
    let _tansu = crate::kafka::start_tansu()?;

    println!("\n==> perf record (whole machine) of outbox-bench --scenario {scenario}");
    let status = Command::new("perf")
        .args(["record", "-F", FREQUENCY, "-e", "cpu-clock", "-a", "-g"])
        .args(["--call-graph", "fp", "-o"])
        .arg(&data)
        .arg("--")
        .arg(&bench)
        .args(["--scenario", scenario])
        .args(rest)
        .current_dir(&root)
        .status()
        .context("could not run perf record")?;
    if !status.success() {
        bail!("the profiled benchmark failed ({status})");
    }

    let folded = out.join(format!("{scenario}.folded"));
    let svg = out.join(format!("{scenario}.svg"));
    let processes = out.join(format!("{scenario}.processes.txt"));
    pipe(
        Command::new("perf").arg("script").arg("-i").arg(&data),
        Command::new(bin_dir.join("inferno-collapse-perf")).arg("--all"),
        &folded,
    )?;
    let title = format!("outbox-bench --scenario {scenario} {}", rest.join(" "));
    to_file(
        Command::new(bin_dir.join("inferno-flamegraph"))
            .args(["--title", title.trim()])
            .arg(&folded),
        &svg,
    )?;
    to_file(
        Command::new("perf")
            .args(["report", "--stdio", "--no-children", "--sort", "comm,dso"])
            .args(["--percent-limit", "0.5", "-g", "none", "-i"])
            .arg(&data),
        &processes,
    )?;
    println!(
        "\nxtask: flame graph {}\n       folded stacks {}\n       per process {}",
        svg.display(),
        folded.display(),
        processes.display()
    );
    Ok(())
}

/// `perf` must be installed and allowed to sample the whole machine.
fn require_perf() -> Result<()> {
    let ok = Command::new("perf")
        .args(["--version"])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        bail!("`perf` is not installed (Debian: apt-get install linux-perf)");
    }
    Ok(())
}

/// The directory holding `inferno-collapse-perf` and `inferno-flamegraph`,
/// installing them with `cargo install inferno --locked` when missing.
fn ensure_inferno() -> Result<PathBuf> {
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .context("neither CARGO_HOME nor HOME is set")?;
    let bin = cargo_home.join("bin");
    if bin.join("inferno-flamegraph").exists() && bin.join("inferno-collapse-perf").exists() {
        return Ok(bin);
    }
    println!("xtask: inferno missing; cargo install inferno --locked (once)");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["install", "inferno", "--locked"])
        .status()
        .context("running cargo install inferno")?;
    if !status.success() {
        bail!("cargo install inferno failed ({status})");
    }
    Ok(bin)
}

/// Builds `outbox-bench` with the `profiling` profile and frame pointers,
/// in a target directory of its own; returns the binary's path.
fn build_bench(root: &Path) -> Result<PathBuf> {
    let target = root.join("target/profiling-build");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!("\n==> cargo build --profile profiling -p outbox-bench (frame pointers)");
    let status = Command::new(cargo)
        .args(["build", "--profile", "profiling", "-p", "outbox-bench"])
        .env("CARGO_TARGET_DIR", &target)
        .env("RUSTFLAGS", "-C force-frame-pointers=yes")
        .current_dir(root)
        .status()
        .context("could not build outbox-bench")?;
    if !status.success() {
        bail!("building outbox-bench for profiling failed ({status})");
    }
    Ok(target.join("profiling/outbox-bench"))
}

/// Runs `first | second > path`.
fn pipe(first: &mut Command, second: &mut Command, path: &Path) -> Result<()> {
    let mut producer = first
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("could not start perf script")?;
    let stdout = producer
        .stdout
        .take()
        .context("perf script has no stdout")?;
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let status = second
        .stdin(stdout)
        .stdout(file)
        .status()
        .context("could not run inferno-collapse-perf")?;
    let first_status = producer.wait()?;
    if !status.success() || !first_status.success() {
        bail!("folding the stacks failed (perf script {first_status}, collapse {status})");
    }
    Ok(())
}

/// Runs `cmd > path`.
fn to_file(cmd: &mut Command, path: &Path) -> Result<()> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let status = cmd
        .stdout(file)
        .status()
        .with_context(|| format!("could not write {}", path.display()))?;
    if !status.success() {
        bail!("writing {} failed ({status})", path.display());
    }
    Ok(())
}
