//! `cargo xtask chaos [--quick | --medium | --full]`: the reliability suite.
//!
//! Builds `outbox-relay` (every backend) and `outbox-chaos`, checks the
//! services, then runs `outbox-chaos run` once per scenario (store x broker x
//! fault plan), each in its own process group under a hard timeout, so a
//! stuck run is killed with everything it started. Each run writes
//! `report.json`; this collects them into `target/chaos/<mode>/summary.json`
//! and `summary.md` (the tables of RELIABILITY.md) and fails when a run
//! lost, reordered or invented an event, or duplicated more than one batch
//! per kill / lease loss and per cut of the broker connection.
//!
//! - `--quick` (in `cargo xtask ci`, about 6 minutes): PostgreSQL + NATS,
//!   PostgreSQL + RabbitMQ, SQLite + NATS, and PostgreSQL + Kafka when the
//!   Kafka broker answers; one mixed run each with every applicable fault.
//!   Then PostgreSQL + NATS twice more: the `contended` producer with relay
//!   kills (per-key order when every task writes every key, DESIGN.md
//!   invariant 12) and one `pg-crash` (a PostgreSQL backend killed: the
//!   cluster's crash recovery, invariant 14). `cargo xtask ci` runs the
//!   quick suite after every test, alone: the one place a CI run crashes
//!   the shared cluster.
//! - `--medium`: every store x broker, each fault kind alone and mixed,
//!   shorter than full (the size RELIABILITY.md reports); and for
//!   PostgreSQL with each broker the `contended` producer alone and with
//!   relay kills, `pg-crash` alone and with the `contended` producer.
//! - `--full`: the same with the 60 s outages and 2 s-every-5 s
//!   flaps at 2,000 events/s, >= 1M events and >= 100 faults in total
//!   (about an hour with Kafka); `--allow-pg-restart` adds PostgreSQL
//!   restarts.
//!
//! `--no-pg-crash` leaves the `pg-crash` runs out of any mode (they crash
//! the machine's PostgreSQL under every session on it).
//!
//! Relays grow their batches through a backlog up to 200 events (quick),
//! 500 (medium) or 1,000 (full, the binary's default); the duplicate
//! allowance per kill is one such batch. `--full` runs release builds of
//! the relay and the harness (`--release` asks for them in other modes).
//!
//! Other flags: `--only pg-nats,sq-amqp,pg-nats-pg-crash,...` (store-broker
//! pairs, or runs by their label: `<pair>[-contended]-<faults>`),
//! `--keep` (keep each run's schema / stream / queue / topic and records),
//! `--dry-run` (print the plan only).

use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::fmt::Write as _;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Quick,
    Medium,
    Full,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Quick => "quick",
            Self::Medium => "medium",
            Self::Full => "full",
        }
    }
}

/// One `outbox-chaos run`.
#[derive(Debug, Clone)]
struct Scenario {
    store: &'static str,
    broker: &'static str,
    faults: String,
    duration_s: u64,
    rate: u32,
    relays: u32,
    lease_ms: u64,
    outage_s: u64,
    flap_cycles: u32,
    flap_down_ms: u64,
    flap_up_ms: u64,
    stop_extra_ms: u64,
    /// Least seconds between a fault step's end and the next step.
    recovery_room_s: u64,
    allow_pg_restart: bool,
    /// Whether the plan crashes PostgreSQL (`pg-crash`).
    allow_pg_crash: bool,
    /// The producer's shape: `partitioned` or `contended` (see outbox-chaos's
    /// producer.rs).
    producer: &'static str,
    /// The relays' `--max-batch-size`.
    max_batch: u32,
}

/// The steps of a plan, `none` and empty ones left out.
fn plan_steps(faults: &str) -> impl Iterator<Item = &str> {
    faults
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty() && *s != "none")
}

impl Scenario {
    fn label(&self) -> String {
        let store = if self.store == "postgres" { "pg" } else { "sq" };
        let faults: String = self
            .faults
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let producer = if self.producer == "contended" {
            "-contended"
        } else {
            ""
        };
        format!("{store}-{}{producer}-{faults}", self.broker)
    }

    /// Seconds the faults take when run back to back (upper bound).
    fn fault_time_s(&self) -> u64 {
        let mut total = 0;
        for step in plan_steps(&self.faults) {
            let (step, times) = step
                .rsplit_once('*')
                .map_or((step, 1), |(s, n)| (s, n.parse().unwrap_or(1)));
            let longest = step
                .split('+')
                .map(|k| match k.trim() {
                    "stop" => (self.lease_ms + self.stop_extra_ms) / 1000 + 1,
                    "broker-outage" | "db-outage" => self.outage_s,
                    "broker-flap" | "db-flap" => {
                        (u64::from(self.flap_cycles) * (self.flap_down_ms + self.flap_up_ms)) / 1000
                    }
                    "pg-restart" => 10,
                    // Crash recovery: 1-5 s here.
                    "pg-crash" => 8,
                    // A RabbitMQ node takes 5-10 s to stop and boot again.
                    "broker-restart" if self.broker == "amqp" => 12,
                    "broker-restart" => 2,
                    _ => 1,
                })
                .max()
                .unwrap_or(0);
            total += longest * times;
        }
        total
    }

    /// Steps of the plan (`a+b` is one step, `a*3` three).
    fn step_count(&self) -> u64 {
        plan_steps(&self.faults)
            .map(|step| {
                step.rsplit_once('*')
                    .map_or(1, |(_, n)| n.parse().unwrap_or(1))
            })
            .sum()
    }

    fn fault_count(&self) -> u64 {
        plan_steps(&self.faults)
            .map(|step| {
                let (step, times) = step
                    .rsplit_once('*')
                    .map_or((step, 1), |(s, n)| (s, n.parse().unwrap_or(1)));
                step.split('+').count() as u64 * times
            })
            .sum()
    }
}

/// The fault kinds of `kinds` that apply to a store: no database faults for
/// SQLite (a file). Every broker takes the broker faults (for Kafka the run
/// starts a private broker behind its proxy; a restart needs the run's own
/// broker with its data on disk: NATS and RabbitMQ).
fn faults_for(store: &str, broker: &str, kinds: &[&str]) -> Vec<String> {
    kinds
        .iter()
        .filter(|k| {
            // A broker restart runs on the run's own broker, a private
            // nats-server or RabbitMQ node (the private Kafka broker keeps
            // its log in memory: see outbox-chaos's kafka.rs).
            let db_fault = k.starts_with("db-") || k.starts_with("pg-");
            let restart_unsupported = **k == "broker-restart" && broker == "kafka";
            !(db_fault && store == "sqlite" || restart_unsupported)
        })
        .map(|k| (*k).to_owned())
        .collect()
}

/// The fault kinds every plan injects one by one (before its database
/// faults), in this order.
const SINGLE_FAULTS: &[&str] = &[
    "kill",
    "stop",
    "pg-terminate",
    "broker-outage",
    "broker-flap",
    "broker-restart",
];

/// Seconds added to a quick run per step, for the step's recovery.
const QUICK_RECOVERY_ROOM_S: u64 = 5;

fn plan(mode: Mode, kafka: bool, allow_pg_restart: bool, pg_crash: bool) -> Vec<Scenario> {
    let base = |store: &'static str, broker: &'static str| Scenario {
        store,
        broker,
        faults: String::new(),
        duration_s: 30,
        rate: 400,
        relays: 2,
        lease_ms: 3000,
        outage_s: 4,
        flap_cycles: 2,
        flap_down_ms: 1000,
        flap_up_ms: 2000,
        stop_extra_ms: 1500,
        recovery_room_s: 0,
        allow_pg_restart: false,
        allow_pg_crash: false,
        producer: "partitioned",
        max_batch: match mode {
            Mode::Quick => 200,
            Mode::Medium => 500,
            Mode::Full => 1000,
        },
    };
    let mut out = Vec::new();
    match mode {
        Mode::Quick => {
            let mut pairs = vec![
                ("postgres", "nats"),
                ("postgres", "amqp"),
                ("sqlite", "nats"),
            ];
            if kafka {
                pairs.push(("postgres", "kafka"));
            }
            for (store, broker) in pairs {
                let kinds = faults_for(store, broker, &[SINGLE_FAULTS, &["db-flap"]].concat());
                let mut s = base(store, broker);
                // Every applicable fault once, then a kill during a flap.
                s.faults = format!("{},kill+broker-flap", kinds.join(","));
                // Room after each step for its recovery (the targets are at
                // most 5 s), so that the next fault does not start inside it.
                s.duration_s = 10 + s.fault_time_s() + QUICK_RECOVERY_ROOM_S * s.step_count();
                // And a step that outlasts its slot still leaves it.
                s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
                out.push(s);
            }
            // Per-key order with every task writing every key, through
            // relay kills; then the cluster's crash recovery. About 40 s
            // each, with the run's set-up.
            let mut s = base("postgres", "nats");
            s.producer = "contended";
            s.faults = "kill*2".to_owned();
            s.duration_s = 12 + s.fault_time_s() + QUICK_RECOVERY_ROOM_S * s.step_count();
            s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
            out.push(s);
            if pg_crash {
                let mut s = base("postgres", "nats");
                s.faults = "pg-crash".to_owned();
                s.allow_pg_crash = true;
                // The target is lease + 5 s after the database is back.
                s.duration_s = 10 + s.fault_time_s() + 2 * QUICK_RECOVERY_ROOM_S;
                s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
                out.push(s);
            }
        }
        Mode::Medium | Mode::Full => {
            let full = mode == Mode::Full;
            let mut pairs = vec![
                ("postgres", "nats"),
                ("postgres", "amqp"),
                ("sqlite", "nats"),
                ("sqlite", "amqp"),
            ];
            if kafka {
                pairs.extend([("postgres", "kafka"), ("sqlite", "kafka")]);
            }
            let mut kinds = [SINGLE_FAULTS, &["db-outage", "db-flap"]].concat();
            if allow_pg_restart {
                kinds.push("pg-restart");
            }
            for (store, broker) in pairs {
                let applicable = faults_for(store, broker, &kinds);
                for kind in &applicable {
                    let mut s = base(store, broker);
                    s.relays = 3;
                    s.lease_ms = 5000;
                    s.stop_extra_ms = 2000;
                    s.allow_pg_restart = kind == "pg-restart";
                    let times = match (kind.as_str(), full) {
                        ("broker-outage" | "db-outage", _) => 1,
                        ("pg-restart", _) => 2,
                        _ => 3,
                    };
                    if full {
                        // The outage and flap: 60 s, and 2 s every
                        // 5 s, at 2,000 events/s for the broker faults.
                        s.outage_s = 60;
                        s.flap_cycles = 6;
                        s.flap_down_ms = 2000;
                        s.flap_up_ms = 3000;
                        s.rate = if kind.starts_with("broker-") {
                            2000
                        } else {
                            1000
                        };
                    } else {
                        s.outage_s = 15;
                        s.flap_cycles = 4;
                        s.flap_down_ms = 2000;
                        s.flap_up_ms = 3000;
                        s.rate = 500;
                    }
                    s.faults = format!("{kind}*{times}");
                    s.duration_s = 10 + s.fault_time_s() + 4 * times;
                    out.push(s);
                }
                // Mixed: faults at the same time, and one after the other.
                let mut s = base(store, broker);
                s.relays = if full { 4 } else { 3 };
                s.lease_ms = 5000;
                s.rate = if full { 1000 } else { 500 };
                let pairs_of: Vec<String> = applicable
                    .iter()
                    .filter(|k| *k != "kill" && *k != "pg-restart")
                    .map(|k| format!("kill+{k}"))
                    .collect();
                let reps = if full { 2 } else { 1 };
                // (`a,b*3` would repeat only b: spell the repetition out.)
                s.faults = std::iter::repeat_n(pairs_of.join(","), reps)
                    .collect::<Vec<_>>()
                    .join(",");
                s.duration_s = 10 + s.fault_time_s() + 3 * s.fault_count();
                s.allow_pg_restart = allow_pg_restart && full;
                out.push(s);
            }
            // PostgreSQL with each broker: the contended producer alone and
            // with relay kills; pg-crash alone and with the contended
            // producer.
            let brokers: &[&'static str] = if kafka {
                &["nats", "amqp", "kafka"]
            } else {
                &["nats", "amqp"]
            };
            for broker in brokers {
                let rows: [(&str, &str); 4] = [
                    ("contended", "none"),
                    ("contended", "kill*3"),
                    ("partitioned", "pg-crash*2"),
                    ("contended", "pg-crash*2"),
                ];
                for (producer, faults) in rows {
                    let crash = faults.starts_with("pg-crash");
                    if crash && !pg_crash {
                        continue;
                    }
                    let mut s = base("postgres", broker);
                    s.producer = producer;
                    s.faults = faults.to_owned();
                    s.relays = 3;
                    s.lease_ms = 5000;
                    s.rate = if full { 1000 } else { 500 };
                    s.allow_pg_crash = crash;
                    // Room after each step for its recovery (lease + 5 s
                    // after a crash, lease + 1 s after a kill).
                    let room = if crash { 12 } else { 6 };
                    s.duration_s = (10 + s.fault_time_s() + room * s.step_count()).max(30);
                    s.recovery_room_s = 5;
                    out.push(s);
                }
            }
        }
    }
    out
}

/// Runs the suite.
pub(crate) fn run(rest: &[String]) -> Result<()> {
    let mode = if rest.iter().any(|a| a == "--full") {
        Mode::Full
    } else if rest.iter().any(|a| a == "--medium") {
        Mode::Medium
    } else {
        Mode::Quick
    };
    let keep = rest.iter().any(|a| a == "--keep");
    let allow_pg_restart = rest.iter().any(|a| a == "--allow-pg-restart");
    let pg_crash = !rest.iter().any(|a| a == "--no-pg-crash");
    if allow_pg_restart && mode != Mode::Full {
        bail!("--allow-pg-restart is for --full only (it restarts the machine's PostgreSQL)");
    }
    let only: Option<Vec<String>> = rest
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| rest.get(i + 1))
        .map(|v| v.split(',').map(str::to_owned).collect());

    let dry_run = rest.iter().any(|a| a == "--dry-run");
    let _services = if dry_run {
        None
    } else {
        Some(crate::services::ensure_all()?)
    };
    let kafka = kafka_up();
    let mut scenarios = plan(mode, kafka, allow_pg_restart, pg_crash);
    if let Some(only) = &only {
        scenarios.retain(|s| {
            let store = if s.store == "postgres" { "pg" } else { "sq" };
            let pair = format!("{store}-{}", s.broker);
            only.iter().any(|o| *o == pair || *o == s.label())
        });
        if scenarios.is_empty() {
            let labels: Vec<String> = plan(mode, kafka, allow_pg_restart, pg_crash)
                .iter()
                .map(Scenario::label)
                .collect();
            bail!(
                "--only matches no run of this mode; its runs: {}",
                labels.join(", ")
            );
        }
    }
    let events: u64 = scenarios
        .iter()
        .map(|s| u64::from(s.rate) * s.duration_s)
        .sum();
    let faults: u64 = scenarios.iter().map(Scenario::fault_count).sum();
    let secs: u64 = scenarios.iter().map(|s| s.duration_s + 15).sum();
    println!(
        "\n==> chaos {}: {} runs, ~{events} events, {faults} faults, ~{} min{}",
        mode.name(),
        scenarios.len(),
        secs.div_ceil(60),
        if kafka {
            ""
        } else {
            " (Kafka not reachable on 127.0.0.1:9092: Kafka runs skipped)"
        }
    );

    if dry_run {
        for s in &scenarios {
            println!(
                "  {} + {}: {} ({} producer, {} ev/s for {} s, {} relays)  [{}]",
                s.store,
                s.broker,
                s.faults,
                s.producer,
                s.rate,
                s.duration_s,
                s.relays,
                s.label()
            );
        }
        return Ok(());
    }
    // The full run measures recovery at 2,000 events/s as a user's
    // deployment would run it: optimised relays.
    let release = mode == Mode::Full || rest.iter().any(|a| a == "--release");
    let (_bins, relay, chaos) = build(release)?;
    let out_root = target_dir()?.join("chaos").join(mode.name());
    std::fs::create_dir_all(&out_root)?;
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    let mut tansu = None;
    for (i, s) in scenarios.iter().enumerate() {
        if s.broker == "kafka" && !kafka_up() {
            // Whoever ran the broker stopped it: run our own until the end.
            match crate::kafka::start_tansu() {
                Ok(g) => tansu = Some(g),
                Err(e) => {
                    failures.push(format!(
                        "{}: Kafka is down and could not be started: {e:#}",
                        s.label()
                    ));
                    continue;
                }
            }
        }
        let out = out_root.join(s.label());
        let _ = std::fs::remove_dir_all(&out);
        println!(
            "\n==> chaos [{}/{}] {} + {}: faults {}, {} producer, {} ev/s for {} s, {} relays ({})",
            i + 1,
            scenarios.len(),
            s.store,
            s.broker,
            s.faults,
            s.producer,
            s.rate,
            s.duration_s,
            s.relays,
            s.label()
        );
        match run_one(&chaos, &relay, s, &out, keep) {
            Ok(report) => {
                if report["passed"] != true {
                    let why: Vec<&str> = report["failures"]
                        .as_array()
                        .map(|f| f.iter().filter_map(Value::as_str).collect())
                        .unwrap_or_default();
                    failures.push(format!("{}: {}", s.label(), why.join("; ")));
                }
                reports.push(report);
            }
            Err(e) => failures.push(format!("{}: {e:#}", s.label())),
        }
    }

    drop(tansu);
    let summary_path = out_root.join("summary.json");
    if only.is_some() {
        // A subset re-run replaces its runs in the last summary of this mode.
        let key = |r: &Value| {
            (
                r["scenario"]["store"].clone(),
                r["scenario"]["broker"].clone(),
                r["scenario"]["faults"].clone(),
                producer_of(r).to_owned(),
            )
        };
        if let Ok(old) = std::fs::read(&summary_path) {
            let old: Value = serde_json::from_slice(&old).unwrap_or(Value::Null);
            let mut merged: Vec<Value> = old["runs"].as_array().cloned().unwrap_or_default();
            merged.retain(|r| !reports.iter().any(|n| key(n) == key(r)));
            merged.extend(reports);
            reports = merged;
        }
    }
    let summary = serde_json::json!({
        "mode": mode.name(),
        "date": today(),
        "runs": reports,
    });
    std::fs::write(&summary_path, serde_json::to_vec_pretty(&summary)?)?;
    let md = markdown(&summary);
    std::fs::write(out_root.join("summary.md"), &md)?;
    println!("\n{md}");
    println!(
        "chaos {}: records and reports in {}",
        mode.name(),
        out_root.display()
    );
    if !failures.is_empty() {
        for f in &failures {
            eprintln!("  FAILED {f}");
        }
        bail!("chaos {}: {} run(s) failed", mode.name(), failures.len());
    }
    println!("chaos {} passed", mode.name());
    Ok(())
}

fn kafka_up() -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], 9092)),
        Duration::from_secs(2),
    )
    .is_ok()
}

/// The suite's private copies of the binaries; removed when dropped.
#[derive(Debug)]
struct BinDir(PathBuf);

impl Drop for BinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds the relay (every backend) and the suite; returns private copies.
fn build(release: bool) -> Result<(BinDir, PathBuf, PathBuf)> {
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

fn target_dir() -> Result<PathBuf> {
    let meta = cargo_metadata_no_deps()?;
    meta["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .context("no target_directory in cargo metadata")
}

/// Runs one scenario in its own process group; kills the group when it
/// overruns its time.
fn run_one(chaos: &Path, relay: &Path, s: &Scenario, out: &Path, keep: bool) -> Result<Value> {
    let mut cmd = Command::new(chaos);
    if s.broker == "kafka" {
        // A Kafka run with broker faults starts its own broker.
        cmd.env("TANSU_BIN", crate::kafka::ensure_tansu_installed()?);
    }
    cmd.arg("run")
        .args(["--store", s.store, "--broker", s.broker])
        .arg("--relay-bin")
        .arg(relay)
        .arg("--out")
        .arg(out)
        .args(["--faults", &s.faults])
        .args(["--duration-s", &s.duration_s.to_string()])
        .args(["--rate", &s.rate.to_string()])
        .args(["--relays", &s.relays.to_string()])
        .args(["--lease-ms", &s.lease_ms.to_string()])
        .args(["--outage-s", &s.outage_s.to_string()])
        .args(["--flap-cycles", &s.flap_cycles.to_string()])
        .args(["--flap-down-ms", &s.flap_down_ms.to_string()])
        .args(["--flap-up-ms", &s.flap_up_ms.to_string()])
        .args(["--stop-extra-ms", &s.stop_extra_ms.to_string()])
        .args(["--recovery-room-s", &s.recovery_room_s.to_string()])
        .args(["--max-batch-size", &s.max_batch.to_string()])
        .args(["--producer", s.producer])
        .process_group(0);
    if keep {
        cmd.arg("--keep");
    }
    if s.allow_pg_restart {
        cmd.arg("--allow-pg-restart");
    }
    if s.allow_pg_crash {
        cmd.arg("--allow-pg-crash");
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

fn f64_of(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// A report's producer shape (`partitioned` in reports from before it was
/// recorded).
fn producer_of(r: &Value) -> &str {
    r["scenario"]["producer"].as_str().unwrap_or("partitioned")
}

/// The RELIABILITY.md tables: one per store x broker, a row per run.
fn markdown(summary: &Value) -> String {
    let mut md = String::new();
    let runs = summary["runs"].as_array().cloned().unwrap_or_default();
    let _ = writeln!(
        md,
        "Mode `{}`, {} (UTC). Recovery: seconds after the fault was over (after a SIGSTOP: after the stop) until every event committed before that moment had arrived (faults that overlap are one incident, measured from the end of the last); worst per fault kind, target in brackets; `(n interrupted)`: n recoveries the next fault began before they were over, not in the worst.\n",
        summary["mode"].as_str().unwrap_or("?"),
        summary["date"].as_str().unwrap_or("?")
    );
    let mut pairs: Vec<(String, String)> = runs
        .iter()
        .map(|r| {
            (
                r["scenario"]["store"].as_str().unwrap_or("?").to_owned(),
                r["scenario"]["broker"].as_str().unwrap_or("?").to_owned(),
            )
        })
        .collect();
    let rank = |(st, br): &(String, String)| {
        let b = ["nats", "amqp", "kafka"]
            .iter()
            .position(|x| x == br)
            .unwrap_or(9);
        (st != "postgres", b)
    };
    pairs.sort_by_key(rank);
    pairs.dedup();
    let (mut events, mut faults) = (0u64, 0u64);
    for (store, broker) in pairs {
        let _ = writeln!(md, "#### {store} + {broker}\n");
        md.push_str("| faults | relays | events | faults injected | lost | duplicated (+copies / allowed) | unexpected | order violations | recovery per fault kind, worst | p50 / p99 latency | sink-up rate, worst | relay exits | result |\n");
        md.push_str(
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        );
        for r in runs.iter().filter(|r| {
            r["scenario"]["store"] == store.as_str() && r["scenario"]["broker"] == broker.as_str()
        }) {
            let fs = r["faults"].as_array().cloned().unwrap_or_default();
            events += r["committed"].as_u64().unwrap_or(0);
            faults += fs.len() as u64;
            let mut kinds: Vec<String> = Vec::new();
            let mut seen = Vec::new();
            for f in &fs {
                let k = f["kind"].as_str().unwrap_or("?").to_owned();
                if seen.contains(&k) {
                    continue;
                }
                seen.push(k.clone());
                let of_kind: Vec<&Value> = fs.iter().filter(|g| g["kind"] == k.as_str()).collect();
                // A recovery the next fault interrupted is not this fault's
                // alone: shown apart, not in the worst.
                let (clean, interrupted): (Vec<&Value>, Vec<&Value>) = of_kind
                    .iter()
                    .partition(|g| g["interrupted_after_s"].is_null());
                let never = clean.iter().any(|g| g["recovery_s"].is_null());
                let worst = clean
                    .iter()
                    .map(|g| f64_of(&g["recovery_s"]))
                    .fold(0.0, f64::max);
                let target = of_kind
                    .first()
                    .and_then(|g| g["recovery_target_s"].as_f64())
                    .map_or(String::new(), |t| format!(" [{t:.0}]"));
                let mut shown = if never {
                    "never".to_owned()
                } else if clean.is_empty() {
                    "-".to_owned()
                } else {
                    format!("{worst:.1} s")
                };
                if !interrupted.is_empty() {
                    let _ = write!(shown, " ({} interrupted)", interrupted.len());
                }
                if k == "pg-crash" {
                    // From the database accepting connections again: the
                    // last event committed before delivered (above), and the
                    // relays caught up (lag < 1 s).
                    let down = of_kind
                        .iter()
                        .map(|g| f64_of(&g["db_down_s"]))
                        .fold(0.0, f64::max);
                    let caught = if of_kind.iter().any(|g| g["caught_up_s"].is_null()) {
                        "never".to_owned()
                    } else {
                        let c = of_kind
                            .iter()
                            .map(|g| f64_of(&g["caught_up_s"]))
                            .fold(0.0, f64::max);
                        format!("{c:.1} s")
                    };
                    let _ = write!(
                        shown,
                        " after the database was back (down {down:.1} s), caught up {caught}"
                    );
                }
                kinds.push(format!("{k} {shown}{target}"));
            }
            let _ = writeln!(
                md,
                "| `{}`{} | {} | {} | {} | {} | {} (+{} / {}) | {} | {} | {} | {:.0} / {:.0} ms | {} | {} | {} |",
                r["scenario"]["faults"].as_str().unwrap_or("?"),
                if producer_of(r) == "contended" {
                    ", contended producer"
                } else {
                    ""
                },
                r["scenario"]["relays"],
                r["committed"],
                fs.len(),
                r["lost"],
                r["duplicated"],
                r["extra_copies"],
                r["duplicate_allowance"],
                r["unexpected"],
                r["order_violations"],
                if kinds.is_empty() {
                    "-".to_owned()
                } else {
                    kinds.join(", ")
                },
                f64_of(&r["latency_ms"]["p50"]),
                f64_of(&r["latency_ms"]["p99"]),
                sink_up_cell(&r["sink_up"]),
                r["relay_exits"].as_array().map_or(0, Vec::len),
                if r["passed"] == true { "pass" } else { "**FAIL**" }
            );
        }
        md.push('\n');
    }
    let _ = writeln!(md, "Total: {events} committed events, {faults} faults.");
    md
}

/// The worst delivered rate while the sink was up with a backlog, as a
/// share of the warm-up's steady rate (the checker's `sink_up`): `-`
/// without a broker fault, `n/a` when no span could be measured.
fn sink_up_cell(up: &Value) -> String {
    if up.is_null() {
        return "-".to_owned();
    }
    let steady = up["steady_rate"]
        .as_f64()
        .map_or("no steady rate".to_owned(), |s| format!("{s:.0} ev/s"));
    match up["worst_ratio"].as_f64() {
        Some(w) => format!("{:.0}% of {steady}", w * 100.0),
        None => format!("n/a ({steady})"),
    }
}

/// Today's date (UTC), `YYYY-MM-DD`.
fn today() -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The runs of a plan that are not the issue-34 rows (the contended
    /// producer, a database crash).
    fn mixed(p: &[Scenario]) -> Vec<&Scenario> {
        p.iter()
            .filter(|s| s.producer == "partitioned" && !s.faults.contains("pg-crash"))
            .collect()
    }

    #[test]
    fn quick_covers_the_required_pairs_within_budget() {
        let p = plan(Mode::Quick, false, false, true);
        let m = mixed(&p);
        let pairs: Vec<(&str, &str)> = m.iter().map(|s| (s.store, s.broker)).collect();
        assert_eq!(
            pairs,
            vec![
                ("postgres", "nats"),
                ("postgres", "amqp"),
                ("sqlite", "nats")
            ]
        );
        let secs: u64 = m.iter().map(|s| s.duration_s + 15).sum();
        assert!(secs <= 300, "quick mode takes {secs} s");
        assert!(!m[2].faults.contains("pg-") && !m[2].faults.contains("db-"));
        let with_kafka = plan(Mode::Quick, true, false, true);
        let kafka = mixed(&with_kafka).last().copied().unwrap();
        assert_eq!((kafka.store, kafka.broker), ("postgres", "kafka"));
        assert!(
            kafka.faults.contains("broker-outage") && kafka.faults.contains("kill+broker-flap"),
            "{}",
            kafka.faults
        );
    }

    #[test]
    fn quick_adds_one_contended_and_one_crash_run_within_three_minutes() {
        let p = plan(Mode::Quick, true, false, true);
        let added: Vec<&Scenario> = p
            .iter()
            .filter(|s| s.producer == "contended" || s.faults.contains("pg-crash"))
            .collect();
        let labels: Vec<String> = added.iter().map(|s| s.label()).collect();
        assert_eq!(
            labels,
            vec!["pg-nats-contended-kill_2", "pg-nats-pg-crash"],
            "{labels:?}"
        );
        assert!(added[1].allow_pg_crash && !added[0].allow_pg_crash);
        let secs: u64 = added.iter().map(|s| s.duration_s + 15).sum();
        assert!(secs <= 180, "the added quick runs take {secs} s");
        // `--no-pg-crash` leaves the crash out.
        assert!(!plan(Mode::Quick, true, false, false)
            .iter()
            .any(|s| s.faults.contains("pg-crash")));
    }

    #[test]
    fn medium_has_the_contended_and_crash_rows_for_each_postgres_pair() {
        let p = plan(Mode::Medium, true, false, true);
        for broker in ["nats", "amqp", "kafka"] {
            let labels: Vec<String> = p
                .iter()
                .filter(|s| s.store == "postgres" && s.broker == broker)
                .map(Scenario::label)
                .collect();
            for want in [
                format!("pg-{broker}-contended-none"),
                format!("pg-{broker}-contended-kill_3"),
                format!("pg-{broker}-pg-crash_2"),
                format!("pg-{broker}-contended-pg-crash_2"),
            ] {
                assert!(labels.contains(&want), "{want} not in {labels:?}");
            }
        }
        let none = p.iter().find(|s| s.faults == "none").unwrap();
        assert_eq!((none.fault_count(), none.step_count()), (0, 0));
        assert_eq!(none.fault_time_s(), 0);
    }

    #[test]
    fn full_is_at_least_a_million_events_and_a_hundred_faults() {
        let p = plan(Mode::Full, true, false, true);
        let events: u64 = p.iter().map(|s| u64::from(s.rate) * s.duration_s).sum();
        let faults: u64 = p.iter().map(Scenario::fault_count).sum();
        assert!(events >= 1_000_000, "{events} events");
        assert!(faults >= 100, "{faults} faults");
        for kind in ["broker-outage", "broker-flap", "kill+broker-flap"] {
            assert!(
                p.iter()
                    .any(|s| s.broker == "kafka" && s.store == "sqlite" && s.faults.contains(kind)),
                "no sqlite + kafka run with {kind}"
            );
        }
    }

    #[test]
    fn sink_up_cells() {
        assert_eq!(sink_up_cell(&Value::Null), "-");
        let up = serde_json::json!({"steady_rate": 398.7, "worst_ratio": 1.5});
        assert_eq!(sink_up_cell(&up), "150% of 399 ev/s");
        let up = serde_json::json!({"steady_rate": null, "worst_ratio": null});
        assert_eq!(sink_up_cell(&up), "n/a (no steady rate)");
    }

    #[test]
    fn dates() {
        assert_eq!(today().len(), 10);
    }
}
