//! `cargo xtask chaos [--quick | --medium | --full]`: the reliability suite.
//!
//! Builds `outbox-relay` (every backend) and `outbox-chaos`, checks the
//! services, then runs `outbox-chaos run` once per scenario (store x broker x
//! fault plan), each in its own process group under a hard timeout, so a
//! stuck run is killed with everything it started. Each run writes
//! `report.json`; this collects them into `target/chaos/<mode>/summary.json`
//! and `summary.md` and fails when a run lost, reordered or invented an
//! event, or duplicated more than one batch per kill / lease loss and per
//! cut of the broker connection. When the summary holds a report of every
//! run of the mode's plan, it rewrites the results section of
//! RELIABILITY.md (between its `chaos-results` markers, with the run
//! list's fingerprint, which `cargo xtask tidy` checks against the plan).
//!
//! - `--quick` (in `cargo xtask ci`): PostgreSQL + NATS, PostgreSQL +
//!   RabbitMQ, SQLite + NATS, and PostgreSQL + Kafka when the Kafka broker
//!   answers; one mixed run each with every applicable fault. Then
//!   PostgreSQL + NATS twice more: the `contended` producer with relay
//!   kills (per-key order when every task writes every key) and one
//!   `pg-crash` (a PostgreSQL backend killed: the cluster's crash
//!   recovery), and once with the producers and relays through PgBouncer
//!   in transaction mode, with relay kills (`-pgbouncer`). `cargo xtask ci` runs the quick suite after every test,
//!   alone: the one place a CI run crashes the shared cluster. And one
//!   end-to-end run per broker through the inbox (`--inbox`), the
//!   consumers' database alternating: NATS -> PostgreSQL, RabbitMQ ->
//!   SQLite, Kafka -> PostgreSQL, with consumer kills, terminated consumer
//!   database connections and relay kills.
//! - `--medium`: every store x broker, each fault kind alone and mixed,
//!   shorter than full; and for PostgreSQL with each broker the
//!   `contended` producer alone and with relay kills, `pg-crash` alone and
//!   with the `contended` producer.
//!   Medium and full have the end-to-end runs of every broker with each
//!   consumer database, broker flaps among their faults.
//! - `--full`: the same with 60 s outages and 2 s-every-5 s flaps at 2,000
//!   events/s, >= 1M events and >= 100 faults in total (about an hour with
//!   Kafka); `--allow-pg-restart` adds PostgreSQL restarts.
//!
//! `--no-pg-crash` leaves the `pg-crash` runs out of any mode (they crash
//! the machine's PostgreSQL under every session on it).
//!
//! Relays grow their batches through a backlog up to 200 events (quick),
//! 500 (medium) or 1,000 (full, the binary's default); the duplicate
//! allowance per kill is one such batch. `--full` runs release builds of
//! the relay and the harness (`--release` asks for them in other modes).
//!
//! Other flags: `--only pg-nats,sq-amqp,pg-nats-pg-crash,inbox,...`
//! (store-broker pairs, `inbox` for the end-to-end runs, or runs by their
//! label: `<pair>[-contended][-inbox-<pg|sq>]-<faults>`; a subset
//! replaces its runs in the mode's last summary), `--keep` (keep each
//! run's schema / stream / queue / topic and records), `--no-doc` (leave
//! RELIABILITY.md alone), `--dry-run` (print the plan only).
//!
//! The code: `suite` defines the plans, `runner` runs the processes,
//! `report` writes the tables and the RELIABILITY.md section.

mod report;
mod runner;
mod suite;

pub(crate) use report::{check_section, DOC};

use anyhow::{bail, Result};
use report::producer_of;
use runner::{build, kafka_up, run_one, target_dir};
use serde_json::Value;
use suite::{Mode, Scenario, Selection};

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
    let no_doc = rest.iter().any(|a| a == "--no-doc");
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
    let selection = Selection {
        mode,
        kafka,
        allow_pg_restart,
        pg_crash,
    };
    let mut scenarios = selection.plan();
    if let Some(only) = &only {
        scenarios.retain(|s| {
            let store = if s.store == "postgres" { "pg" } else { "sq" };
            let pair = format!("{store}-{}", s.broker);
            only.iter()
                .any(|o| *o == pair || *o == s.label() || (o == "inbox" && s.inbox.is_some()))
        });
        if scenarios.is_empty() {
            let labels: Vec<String> = selection.plan().iter().map(Scenario::label).collect();
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
                "  {} + {}{}: {} ({} producer, {} ev/s for {} s, {} relays)  [{}]",
                s.store,
                s.broker,
                inbox_note(s),
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
            "\n==> chaos [{}/{}] {} + {}{}: faults {}, {} producer, {} ev/s for {} s, {} relays ({})",
            i + 1,
            scenarios.len(),
            s.store,
            s.broker,
            inbox_note(s),
            s.faults,
            s.producer,
            s.rate,
            s.duration_s,
            s.relays,
            s.label()
        );
        match run_one(&chaos, &relay, s, &out, keep) {
            Ok(mut report) => {
                // What the fingerprint of the written results covers.
                report["suite_run"] = serde_json::json!({"label": s.label(), "args": s.args()});
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
                r["scenario"]["inbox"].clone(),
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
        "date": report::today(),
        "release": release,
        "runs": reports,
    });
    std::fs::write(&summary_path, serde_json::to_vec_pretty(&summary)?)?;
    let md = report::markdown(&summary);
    std::fs::write(out_root.join("summary.md"), &md)?;
    println!("\n{md}");
    if no_doc {
        println!("{} not written (--no-doc)", report::DOC);
    } else if report::summary_fingerprint(&summary) == selection.fingerprint() {
        let doc = crate::root().join(report::DOC);
        report::write_section(&doc, &report::section(&summary, selection))?;
        println!("wrote the results section of {}", doc.display());
    } else {
        println!(
            "{} not written: the summary does not hold one report of every run of the current `--{}` plan (a failed run, or an --only subset)",
            report::DOC,
            mode.name()
        );
    }
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

/// ` -> inbox on <db>` for an end-to-end run, else nothing.
fn inbox_note(s: &Scenario) -> String {
    s.inbox
        .map_or(String::new(), |db| format!(" -> inbox on {db}"))
}
