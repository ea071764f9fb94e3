//! The `tenants` run's argument checks and per-database report.

use super::check::{report as check_report, Recorded};
use super::result::{lines, TenantResult};
use super::*;
use crate::checker::Report;
use crate::cli::{Cli, Command};
use crate::record::Arrival;
use clap::Parser as _;

fn args_of(extra: &[&str]) -> (RunArgs, Vec<Vec<FaultKind>>) {
    // A valid tenants run; an option in `extra` replaces its default (clap
    // refuses an option given twice).
    let defaults = [
        ("--store", "postgres"),
        ("--broker", "nats"),
        ("--out", "/tmp/x"),
        ("--relays", "1"),
        ("--faults", "tenants"),
    ];
    let mut argv = vec!["outbox-chaos", "run"];
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            argv.extend([flag, value]);
        }
    }
    argv.extend(extra);
    let Command::Run(args) = Cli::try_parse_from(argv).unwrap().command else {
        panic!("not a run");
    };
    let steps = crate::faults::parse_plan(&args.faults).unwrap();
    (*args, steps)
}

fn refused(extra: &[&str]) -> String {
    let (args, steps) = args_of(extra);
    validate(&args, &steps).unwrap_err().to_string()
}

#[test]
fn a_tenants_run_is_alone_on_postgres_and_nats() {
    let (args, steps) = args_of(&[]);
    validate(&args, &steps).unwrap();
    assert!(refused(&["--faults", "tenants,kill"]).contains("alone"));
    assert!(refused(&["--faults", "tenants*2"]).contains("alone"));
    assert!(refused(&["--store", "sqlite"]).contains("--store postgres"));
    assert!(refused(&["--broker", "amqp"]).contains("NATS"));
    assert!(refused(&["--relays", "2"]).contains("--relays 1"));
    assert!(refused(&["--pgbouncer"]).contains("--pgbouncer"));
    assert!(refused(&["--duration-s", "4"]).contains("--duration-s"));
    // A URL that is not one: said, without its password.
    let e = refused(&["--database-url", "postgres:secret@h/test"]);
    assert!(e.contains("--database-url") && !e.contains("secret"), "{e}");
}

const START: i64 = 1_000_000_000;

/// The checks over `meta`'s records, as `check DIR` makes them.
fn report(
    meta: &RunMeta,
    tenants: &TenantsMeta,
    produced: &[Produced],
    arrivals: &[Arrival],
    faults: &[FaultRecord],
) -> Report {
    let recorded = Recorded {
        scenario: &meta.scenario,
        produce_end_us: meta.produce_end_us,
        resolved_committed: &meta.resolved_committed,
        relay_exits: &meta.relay_exits,
    };
    check_report(&recorded, tenants, produced, arrivals, faults)
}

fn meta() -> (RunMeta, TenantsMeta) {
    let tenants = TenantsMeta {
        databases: (0..DATABASES)
            .map(|i| TenantDb {
                name: format!("t{i}"),
                database: format!("run_t{i}"),
                role: Role::of(i),
            })
            .collect(),
        backlog: 3,
        p99_target_ms: 500.0,
    };
    let meta = RunMeta {
        scenario: checker::Scenario {
            name: "run".to_owned(),
            store: "postgres".to_owned(),
            broker: "nats".to_owned(),
            relays: 1,
            rate: 400,
            duration_s: 10,
            max_batch_size: 200,
            lease_ms: 3000,
            faults: "tenants".to_owned(),
            producer: "partitioned".to_owned(),
            start_us: START,
            inbox: None,
            consumers: 0,
            replication: None,
        },
        produce_end_us: START + 10_000_000,
        resolved_committed: Vec::new(),
        relay_exits: Vec::new(),
        inbox: None,
        lost_with_primary: Vec::new(),
        tenants: Some(tenants.clone()),
    };
    (meta, tenants)
}

/// Per database: 3 backlog events in t0 (committed before the start), and
/// 10 fresh events each, committed 100 ms apart from 1 s on, arriving
/// 20 ms after their commit.
fn records() -> (Vec<Produced>, Vec<Arrival>) {
    let (mut produced, mut arrivals) = (Vec::new(), Vec::new());
    let tx = Uuid::now_v7();
    for seq in 1..=3 {
        let p = Produced {
            id: Uuid::now_v7(),
            key: "t0.b0".to_owned(),
            seq,
            tx,
            outcome: TxOutcome::Committed,
            at_us: START - 5_000_000,
        };
        arrivals.push(Arrival {
            id: p.id,
            key: p.key.clone(),
            seq,
            at_us: START + 500_000,
        });
        produced.push(p);
    }
    for db in 0..DATABASES {
        for seq in 1..=10u64 {
            let at_us = START + 1_000_000 + i64::try_from(seq).unwrap() * 100_000;
            let p = Produced {
                id: Uuid::now_v7(),
                key: format!("t{db}.k0-0"),
                seq,
                tx: Uuid::now_v7(),
                outcome: TxOutcome::Committed,
                at_us,
            };
            arrivals.push(Arrival {
                id: p.id,
                key: p.key.clone(),
                seq,
                at_us: at_us + 20_000,
            });
            produced.push(p);
        }
    }
    arrivals.sort_by_key(|a| a.at_us);
    (produced, arrivals)
}

fn kill() -> FaultRecord {
    FaultRecord {
        kind: KILL_KIND.to_owned(),
        target: "t1: 6 connection(s) to run_t1 terminated in 30 rounds over 3.0 s".to_owned(),
        start_us: START + 1_150_000,
        end_us: START + 1_250_000,
        recovery_from_us: None,
        may_duplicate: true,
        broker_cuts: 0,
        sink_down: Vec::new(),
        db_ready_us: Some(START + 1_250_000),
    }
}

#[test]
fn each_database_is_checked_on_its_own() {
    let (meta, tenants) = meta();
    let (produced, arrivals) = records();
    let r = report(&meta, &tenants, &produced, &arrivals, &[kill()]);
    assert!(r.passed, "{:?}", r.failures);
    let t: Vec<TenantResult> = r.tenants.unwrap();
    let roles: Vec<Role> = t.iter().map(|t| t.role).collect();
    assert_eq!(
        roles,
        vec![Role::Backlog, Role::Killed, Role::Fresh, Role::Fresh]
    );
    assert_eq!(
        (t[0].committed, t[0].backlog, t[0].fresh_events),
        (13, 3, 10)
    );
    assert_eq!(t[0].backlog_drained_s, Some(0.5));
    // The backlog's own wait is not the fresh events' latency.
    assert!((t[0].fresh_latency_ms.p99 - 20.0).abs() < 0.01);
    // The kill is t1's alone: one batch allowed there, none elsewhere.
    assert_eq!(t[1].duplicate_allowance, 200);
    assert_eq!(t[2].duplicate_allowance, 0);
    // First arrival after the kill ended (1.25 s): the event committed at
    // 1.3 s, arrived at 1.32 s.
    let first = t[1].first_delivery_s.unwrap();
    assert!((first - 0.07).abs() < 0.001, "{first}");
    assert!(t[1].kill.as_deref().unwrap().starts_with("t1:"));
    assert_eq!(t[2].p99_target_ms, Some(500.0));
    assert_eq!(t[1].p99_target_ms, None);
    assert_eq!(lines(&t).len(), DATABASES);
}

#[test]
fn a_slow_fresh_database_or_a_loss_fails_the_run() {
    let (meta, tenants) = meta();
    let (produced, mut arrivals) = records();
    // t2's events arrive 2 s late; one of t3's never arrives.
    for a in arrivals.iter_mut().filter(|a| a.key.starts_with("t2.")) {
        a.at_us += 2_000_000;
    }
    let gone = produced
        .iter()
        .find(|p| p.key.starts_with("t3."))
        .unwrap()
        .id;
    arrivals.retain(|a| a.id != gone);
    arrivals.sort_by_key(|a| a.at_us);
    let r = report(&meta, &tenants, &produced, &arrivals, &[kill()]);
    assert!(!r.passed);
    let t = r.tenants.as_ref().unwrap();
    assert!(
        !t[2].passed && t[2].failures[0].contains("p99"),
        "{:?}",
        t[2].failures
    );
    assert_eq!((t[3].lost, t[3].passed), (1, false));
    assert!(t[0].passed && t[1].passed);
    assert!(
        r.failures.iter().any(|f| f.starts_with("t2: ")),
        "{:?}",
        r.failures
    );
    // Late events of the backlog or killed database fail nothing.
    let (produced, mut arrivals) = records();
    for a in arrivals.iter_mut().filter(|a| a.key.starts_with("t1.k")) {
        a.at_us += 5_000_000;
    }
    arrivals.sort_by_key(|a| a.at_us);
    let r = report(&meta, &tenants, &produced, &arrivals, &[kill()]);
    assert!(r.passed, "{:?}", r.failures);
    // No kill recorded: t1 says so.
    let r = report(&meta, &tenants, &produced, &arrivals, &[]);
    assert!(
        r.failures.iter().any(|f| f.contains("never killed")),
        "{:?}",
        r.failures
    );
}
