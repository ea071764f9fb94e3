//! The suite's tests: the runs each mode plans, their faults and
//! parameters, and the fingerprint.
#![allow(clippy::unwrap_used)]

use super::*;

/// The runs of a plan that are neither the contended producer's nor a
/// database crash.
fn mixed(p: &[Scenario]) -> Vec<&Scenario> {
    p.iter()
        .filter(|s| {
            s.producer == "partitioned"
                && !s.faults.contains("pg-crash")
                && !s.faults.contains("db-cut-one")
                && !s.faults.contains("partition-reader")
                && !s.faults.contains("nats-leader-kill")
                && s.replication.is_none()
                && s.inbox.is_none()
                && !s.pgbouncer
        })
        .collect()
}

#[test]
fn quick_fails_over_to_a_synchronous_and_an_asynchronous_standby() {
    let p = plan(Mode::Quick, false, false, false);
    let labels: Vec<String> = p
        .iter()
        .filter(|s| s.replication.is_some())
        .map(Scenario::label)
        .collect();
    assert_eq!(
        labels,
        vec!["pg-nats-pg-failover-sync", "pg-nats-pg-failover-async"]
    );
    for s in p.iter().filter(|s| s.replication.is_some()) {
        let args = s.args();
        let at = args.iter().position(|a| a == "--pg-replication").unwrap();
        assert_eq!(Some(args[at + 1].as_str()), s.replication);
        assert!(!s.allow_pg_crash && s.duration_s <= 30, "{}", s.label());
    }
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
fn quick_runs_producer_and_relays_through_pgbouncer_once_within_a_minute() {
    for kafka in [false, true] {
        let p = plan(Mode::Quick, kafka, false, true);
        let pooled: Vec<&Scenario> = p.iter().filter(|s| s.pgbouncer).collect();
        let labels: Vec<String> = pooled.iter().map(|s| s.label()).collect();
        assert_eq!(labels, vec!["pg-nats-pgbouncer-kill_2"]);
        let s = pooled[0];
        assert_eq!(
            (s.store, s.broker, s.producer),
            ("postgres", "nats", "partitioned")
        );
        assert_eq!(s.fault_count(), 2);
        assert!(s.duration_s + 15 <= 60, "{} s", s.duration_s);
        let args = s.args();
        assert!(args.contains(&"--pgbouncer".to_owned()), "{args:?}");
        assert_eq!(args.iter().filter(|a| a.starts_with("--")).count(), 16);
    }
    // Only that row: every other run's arguments are as before.
    for s in plan(Mode::Quick, true, false, true)
        .iter()
        .filter(|s| !s.pgbouncer)
    {
        assert!(
            !s.args().contains(&"--pgbouncer".to_owned()),
            "{}",
            s.label()
        );
    }
}

#[test]
fn every_mode_cuts_one_relay_from_postgres_past_its_lease() {
    for mode in [Mode::Quick, Mode::Medium, Mode::Full] {
        let p = plan(mode, true, false, true);
        let cut: Vec<&Scenario> = p
            .iter()
            .filter(|s| s.faults.contains("db-cut-one"))
            .collect();
        assert!(!cut.is_empty(), "{mode:?}");
        for s in cut {
            assert_eq!(s.store, "postgres");
            assert_ne!(s.broker, "kafka");
            assert!(s.outage_s * 1000 > s.lease_ms, "{}", s.label());
            assert!(s.relays >= 2, "another relay takes the shards over");
        }
    }
    let quick = plan(Mode::Quick, false, false, true);
    let row = quick
        .iter()
        .find(|s| s.faults.contains("db-cut-one"))
        .unwrap();
    assert_eq!(row.label(), "pg-nats-db-cut-one_2");
    assert!(row.duration_s + 15 <= 60, "{} s", row.duration_s);
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
fn the_fingerprint_changes_with_a_runs_parameters_but_not_with_the_order() {
    let sel = Selection {
        mode: Mode::Quick,
        kafka: true,
        allow_pg_restart: false,
        pg_crash: true,
    };
    let runs = sel.plan();
    let of = |rs: &[Scenario]| fingerprint(rs.iter().map(|s| (s.label(), s.args())));
    assert_eq!(of(&runs), sel.fingerprint());
    assert_eq!(sel.fingerprint().len(), 16);
    let mut reversed = runs.clone();
    reversed.reverse();
    assert_eq!(of(&reversed), of(&runs));
    let mut changed = runs.clone();
    changed[0].rate += 1;
    assert_ne!(of(&changed), of(&runs));
    assert_ne!(of(&runs[1..]), of(&runs));
    let without_kafka = Selection {
        kafka: false,
        ..sel
    };
    assert_ne!(without_kafka.fingerprint(), sel.fingerprint());
}

#[test]
fn args_carry_every_parameter_and_the_opt_in_flags() {
    let crash = plan(Mode::Quick, false, false, true)
        .into_iter()
        .find(|s| s.allow_pg_crash)
        .unwrap();
    let args = crash.args();
    assert!(args.contains(&"--allow-pg-crash".to_owned()), "{args:?}");
    assert!(!args.contains(&"--allow-pg-restart".to_owned()), "{args:?}");
    assert_eq!(args.iter().filter(|a| a.starts_with("--")).count(), 16);
    assert_eq!(Mode::from_name("medium"), Some(Mode::Medium));
    assert_eq!(Mode::from_name("slow"), None);
}

/// The inbox runs of issue 36 (not issue 42's order runs).
fn is_issue36_inbox_run(s: &Scenario) -> bool {
    s.inbox.is_some() && !s.faults.contains("consumer-kills")
}

#[test]
fn every_mode_has_an_order_run_per_broker_and_a_short_window_run() {
    for mode in [Mode::Quick, Mode::Medium, Mode::Full] {
        let p = plan(mode, true, false, true);
        let order: Vec<&Scenario> = p.iter().filter(|s| s.faults == "consumer-kills").collect();
        let brokers: Vec<(&str, u32, Option<u64>)> = order
            .iter()
            .map(|s| (s.broker, s.consumers, s.inbox_retention_s))
            .collect();
        let mut want = vec![("nats", 1, None), ("amqp", 1, None)];
        if mode != Mode::Quick {
            want.push(("kafka", 1, None));
        }
        want.push(("nats", 2, Some(30)));
        assert_eq!(brokers, want);
        for s in &order {
            assert_eq!(s.inbox, Some("postgres"));
            assert!(s.duration_s > s.outage_s + 10, "{}", s.duration_s);
        }
        let short = order[order.len() - 1];
        assert_eq!(
            short.label(),
            "pg-nats-inbox-pg-x2-window30s-consumer-kills"
        );
        let args = short.args();
        assert!(args
            .windows(2)
            .any(|w| w[0] == "--consumers" && w[1] == "2"));
        assert!(args
            .windows(2)
            .any(|w| w[0] == "--inbox-retention-s" && w[1] == "30"));
        assert!(!order[0].args().contains(&"--consumers".to_owned()));
    }
}

#[test]
fn quick_has_one_inbox_run_per_broker_alternating_the_database_within_six_minutes() {
    let p = plan(Mode::Quick, true, false, true);
    let inbox: Vec<&Scenario> = p.iter().filter(|s| is_issue36_inbox_run(s)).collect();
    let combos: Vec<(&str, Option<&str>)> = inbox.iter().map(|s| (s.broker, s.inbox)).collect();
    assert_eq!(
        combos,
        vec![
            ("nats", Some("postgres")),
            ("amqp", Some("sqlite")),
            ("kafka", Some("postgres"))
        ]
    );
    for s in &inbox {
        assert!(
            s.faults.contains("consumer-kill") && s.faults.contains("kill,"),
            "{}",
            s.faults
        );
        assert_eq!(
            s.faults.contains("consumer-db-cut"),
            s.inbox == Some("postgres"),
            "{}",
            s.faults
        );
        assert!((30..=60).contains(&s.duration_s), "{} s", s.duration_s);
        assert!(s
            .args()
            .windows(2)
            .any(|w| w[0] == "--inbox" && Some(w[1].as_str()) == s.inbox));
    }
    assert_eq!(
        inbox[0].label(),
        "pg-nats-inbox-pg-consumer-kill_kill_consumer-db-cut_consumer-kill_kill"
    );
    // Each run's production, its set-up and its drain (about 20 s).
    let secs: u64 = inbox.iter().map(|s| s.duration_s + 20).sum();
    assert!(secs <= 360, "the inbox runs add {secs} s to quick mode");
    assert_eq!(
        plan(Mode::Quick, false, false, true)
            .iter()
            .filter(|s| is_issue36_inbox_run(s))
            .count(),
        2
    );
}

#[test]
fn medium_and_full_have_every_broker_with_each_inbox_database() {
    for mode in [Mode::Medium, Mode::Full] {
        let p = plan(mode, true, false, true);
        let mut combos: Vec<(&str, &str)> = p
            .iter()
            .filter(|s| is_issue36_inbox_run(s))
            .filter_map(|s| s.inbox.map(|db| (s.broker, db)))
            .collect();
        combos.sort_unstable();
        assert_eq!(
            combos,
            vec![
                ("amqp", "postgres"),
                ("amqp", "sqlite"),
                ("kafka", "postgres"),
                ("kafka", "sqlite"),
                ("nats", "postgres"),
                ("nats", "sqlite")
            ]
        );
        for s in p.iter().filter(|s| is_issue36_inbox_run(s)) {
            assert!(s.faults.contains("broker-flap") && s.faults.contains("consumer-kill+kill"));
            assert!(!(s.inbox == Some("sqlite") && s.faults.contains("consumer-db-cut")));
        }
    }
}
