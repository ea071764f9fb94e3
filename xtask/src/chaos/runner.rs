//! Running the suite's processes: the Kafka probe, the private copies of
//! the binaries, and one `outbox-chaos run` under a hard time bound.

use super::suite::Scenario;
use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Whether a Kafka broker answers on 127.0.0.1:9092.
pub(super) fn kafka_up() -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], 9092)),
        Duration::from_secs(2),
    )
    .is_ok()
}

/// The suite's private copies of the binaries; removed when dropped.
#[derive(Debug)]
pub(super) struct BinDir(PathBuf);

impl Drop for BinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds the relay (every backend) and the suite; returns private copies.
pub(super) fn build(release: bool) -> Result<(BinDir, PathBuf, PathBuf)> {
    let relay_pkg = if package_exists("outbox-relay")? {
        "outbox-relay"
    } else {
        "outbox-worker"
    };
    // `--workspace --all-features`: the feature set of the workspace test
    // build, so its artifacts are reused; only the two binaries are built.
    let mut args = vec![
        "build",
        "--workspace",
        "--all-features",
        "--bin",
        "outbox-relay",
        "--bin",
        "outbox-chaos",
    ];
    if release {
        args.push("--release");
    }
    crate::cargo(&args)?;
    let target = target_dir()?;
    // Private copies: another `cargo build` or `cargo test` in the same
    // target directory (with other features) must not swap the binary
    // under a run.
    // One directory per suite process: two suites sharing a target
    // directory (a CI clone, a developer) must not replace each other's.
    let bin_dir = target
        .join("chaos")
        .join(format!("bin-{}", std::process::id()));
    std::fs::create_dir_all(&bin_dir)?;
    let guard = BinDir(bin_dir.clone());
    let mut out = Vec::new();
    for name in ["outbox-relay", "outbox-chaos"] {
        let built = target
            .join(if release { "release" } else { "debug" })
            .join(name);
        if !built.exists() {
            bail!(
                "{} was not built (relay package {relay_pkg}): check the binary names",
                built.display()
            );
        }
        let copy = bin_dir.join(name);
        let _ = std::fs::remove_file(&copy);
        std::fs::copy(&built, &copy)
            .with_context(|| format!("copying {} to {}", built.display(), copy.display()))?;
        out.push(copy);
    }
    Ok((guard, out[0].clone(), out[1].clone()))
}

fn package_exists(name: &str) -> Result<bool> {
    let meta = cargo_metadata_no_deps()?;
    Ok(meta["packages"]
        .as_array()
        .is_some_and(|p| p.iter().any(|p| p["name"] == name)))
}

fn cargo_metadata_no_deps() -> Result<Value> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(crate::root())
        .output()
        .context("cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

pub(super) fn target_dir() -> Result<PathBuf> {
    let meta = cargo_metadata_no_deps()?;
    meta["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .context("no target_directory in cargo metadata")
}

/// Runs one scenario in its own process group; kills the group when it
/// overruns its time.
pub(super) fn run_one(
    chaos: &Path,
    relay: &Path,
    s: &Scenario,
    out: &Path,
    keep: bool,
) -> Result<Value> {
    let mut cmd = Command::new(chaos);
    if s.broker == "kafka" {
        // A Kafka run with broker faults starts its own broker.
        cmd.env("TANSU_BIN", crate::kafka::ensure_tansu_installed()?);
    }
    cmd.arg("run")
        .args(s.args())
        .arg("--relay-bin")
        .arg(relay)
        .arg("--out")
        .arg(out)
        .process_group(0);
    if keep {
        cmd.arg("--keep");
    }
    // The run bounds itself; this is the backstop.
    let bound = Duration::from_secs(s.duration_s + s.fault_time_s() + 240);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", chaos.display()))?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > bound {
            let group = format!("-{}", child.id());
            let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
            std::thread::sleep(Duration::from_secs(10));
            let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
            let _ = child.wait();
            bail!("overran {bound:?}: killed the run and its relays");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    // Whatever the outcome, nothing of the run may survive it.
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .stderr(std::process::Stdio::null())
        .status();
    let report_path = out.join("report.json");
    if !report_path.exists() {
        bail!(
            "the run failed before its report ({status}); see the output above and {}",
            out.display()
        );
    }
    let report: Value = serde_json::from_slice(&std::fs::read(&report_path)?)?;
    Ok(report)
}
