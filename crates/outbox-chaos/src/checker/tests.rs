//! The checker's tests: synthetic runs with known losses, copies,
//! order violations, faults and recoveries.
#![allow(clippy::unwrap_used)]

use super::*;
use std::collections::HashSet;

fn scenario() -> Scenario {
    Scenario {
        name: "t".into(),
        store: "postgres".into(),
        broker: "nats".into(),
        relays: 2,
        rate: 1,
        duration_s: 1,
        max_batch_size: 2,
        lease_ms: 1000,
        faults: String::new(),
        producer: partitioned(),
        start_us: 0,
        inbox: None,
        consumers: 0,
        replication: None,
    }
}

fn p(key: &str, seq: u64, outcome: TxOutcome, at: i64) -> Produced {
    Produced {
        id: Uuid::now_v7(),
        key: key.into(),
        seq,
        tx: Uuid::now_v7(),
        outcome,
        at_us: at,
    }
}

fn a(p: &Produced, at: i64) -> Arrival {
    Arrival {
        id: p.id,
        key: p.key.clone(),
        seq: p.seq,
        at_us: at,
    }
}

#[test]
fn counts_lost_duplicates_unexpected_and_order() {
    let e1 = p("a", 1, TxOutcome::Committed, 100);
    let e2 = p("a", 2, TxOutcome::Committed, 200);
    let e3 = p("b", 1, TxOutcome::Committed, 300);
    let rb = p("b", 2, TxOutcome::RolledBack, 400);
    let lost = p("c", 1, TxOutcome::Committed, 500);
    let unk = p("d", 1, TxOutcome::Unknown, 600);
    let produced = vec![
        e1.clone(),
        e2.clone(),
        e3.clone(),
        rb.clone(),
        lost.clone(),
        unk,
    ];
    let arrivals = vec![
        a(&e2, 1_000),
        a(&e1, 2_000), // a:1 after a:2
        a(&e2, 3_000), // duplicate
        a(&e3, 4_000),
        a(&rb, 5_000), // rolled back
    ];
    let faults = vec![FaultRecord {
        may_duplicate: true,
        ..fault("kill", 2_500, 2_600, Vec::new())
    }];
    let r = run(&produced, &arrivals, &faults, 700);
    assert_eq!((r.committed, r.rolled_back, r.unknown), (4, 1, 1));
    assert_eq!(r.lost, 1);
    assert_eq!(r.lost_sample, vec![lost.id]);
    assert_eq!((r.duplicated, r.extra_copies), (1, 1));
    assert_eq!((r.unexpected, r.unexpected_rolled_back), (1, 1));
    assert_eq!(r.order_violations, 1);
    assert_eq!(r.faults[0].extra_copies, 1);
    assert_eq!(r.faults[0].recovery_s, None, "the lost event poisons it");
    assert_eq!(r.duplicate_allowance, 2);
    assert!(!r.passed);
    assert_eq!(r.failures.len(), 3, "{:?}", r.failures);
    assert!(r.sink_up.is_none(), "no sink fault, no sink-up figures");
}

#[test]
fn recovery_is_the_wait_for_events_committed_before_the_fault_ended() {
    let e1 = p("a", 1, TxOutcome::Committed, 1_000_000);
    let e2 = p("b", 1, TxOutcome::Committed, 2_000_000);
    let e3 = p("a", 2, TxOutcome::Committed, 9_000_000);
    let produced = vec![e1.clone(), e2.clone(), e3.clone()];
    let arrivals = vec![a(&e1, 1_001_000), a(&e2, 6_500_000), a(&e3, 9_002_000)];
    let faults = vec![FaultRecord {
        may_duplicate: true,
        ..fault("kill", 2_500_000, 2_500_000, Vec::new())
    }];
    let r = run(&produced, &arrivals, &faults, 9_000_000);
    assert!(r.passed, "{:?}", r.failures);
    assert_eq!(r.faults[0].recovery_s, Some(4.0));
    assert_eq!(r.latency_ms.max, 4_500.0);
    assert_eq!(r.drain_s, Some(0.002));
}

#[test]
fn overlapping_faults_are_one_incident_measured_from_the_last_end() {
    // A kill at 2 s during a broker outage from 2 s to 6 s; an event
    // committed at 1.9 s arrives at 7 s.
    let e1 = p("a", 1, TxOutcome::Committed, 1_900_000);
    let e2 = p("b", 1, TxOutcome::Committed, 9_000_000);
    let produced = vec![e1.clone(), e2.clone()];
    let arrivals = vec![a(&e1, 7_000_000), a(&e2, 9_001_000)];
    let faults = vec![
        fault("kill", 2_000_000, 2_000_000, Vec::new()),
        fault(
            "broker-outage",
            2_000_000,
            6_000_000,
            vec![(2_000_000, 6_000_000)],
        ),
    ];
    let r = run(&produced, &arrivals, &faults, 9_000_000);
    for f in &r.faults {
        assert_eq!(f.recovery_s, Some(1.0), "{}", f.kind);
        // The group's largest target: 5 s after the broker returns
        // (lease 1 s + 1 s for the kill alone).
        assert_eq!(f.recovery_target_s, Some(5.0), "{}", f.kind);
        assert_eq!(f.interrupted_after_s, None);
    }
    assert_eq!(r.recovery_misses, 0);
}

#[test]
fn a_recovery_the_next_fault_interrupts_is_marked_and_not_a_miss() {
    // An outage from 1 s to 3 s, the next one from 4 s to 8 s; an event
    // committed at 2.9 s arrives at 9 s (6 s after the first outage).
    let e1 = p("a", 1, TxOutcome::Committed, 2_900_000);
    let produced = vec![e1.clone()];
    let arrivals = vec![a(&e1, 9_000_000)];
    let faults = vec![
        fault(
            "broker-outage",
            1_000_000,
            3_000_000,
            vec![(1_000_000, 3_000_000)],
        ),
        fault(
            "broker-outage",
            4_000_000,
            8_000_000,
            vec![(4_000_000, 8_000_000)],
        ),
    ];
    let r = run(&produced, &arrivals, &faults, 9_000_000);
    assert_eq!(r.faults[0].recovery_s, Some(6.0));
    assert_eq!(r.faults[0].interrupted_after_s, Some(1.0));
    // The second outage's recovery: the same event, 1 s after it.
    assert_eq!(r.faults[1].recovery_s, Some(1.0));
    assert_eq!(r.faults[1].interrupted_after_s, None);
    assert_eq!(r.recovery_misses, 0, "the interrupted one is not a miss");
    let k = by_kind(&r)["broker-outage"];
    assert_eq!((k.count, k.interrupted, k.worst), (2, 1, Some(1.0)));
}

const S: i64 = 1_000_000;

/// A synthetic run: one event committed every 10 ms for 20 s (100/s,
/// 10 keys), a relay delivering in commit order at `cap(t)` events/s
/// while the sink is up (outside `down`), until everything arrived.
fn timeline(cap: impl Fn(i64) -> f64, down: &[(i64, i64)]) -> (Vec<Produced>, Vec<Arrival>) {
    let tick = 10_000;
    let mut produced = Vec::new();
    let mut arrivals = Vec::new();
    let mut queue = std::collections::VecDeque::new();
    let mut budget = 0.0;
    let mut t = 0;
    while t < 20 * S || !queue.is_empty() {
        if t < 20 * S {
            let n = produced.len() as u64;
            let e = p(&format!("k{}", n % 10), n / 10, TxOutcome::Committed, t);
            queue.push_back(e.clone());
            produced.push(e);
        }
        if down.iter().all(|(a, b)| t < *a || t >= *b) {
            budget += cap(t) * 0.01;
            while budget >= 1.0 {
                let Some(e) = queue.pop_front() else { break };
                arrivals.push(a(&e, t));
                budget -= 1.0;
            }
            if queue.is_empty() {
                budget = budget.min(1.0);
            }
        }
        t += tick;
    }
    (produced, arrivals)
}

fn fault(kind: &str, from: i64, to: i64, sink_down: Vec<(i64, i64)>) -> FaultRecord {
    FaultRecord {
        kind: kind.into(),
        target: "t".into(),
        start_us: from,
        end_us: to,
        recovery_from_us: None,
        may_duplicate: false,
        broker_cuts: u32::try_from(sink_down.len()).unwrap(),
        sink_down,
        db_ready_us: None,
    }
}

/// Checks a run of `scenario()` whose production ended at `produce_end_us`
/// (no transaction of unknown outcome turned out committed).
fn run(
    produced: &[Produced],
    arrivals: &[Arrival],
    faults: &[FaultRecord],
    produce_end_us: i64,
) -> Report {
    check(&Inputs {
        scenario: scenario(),
        produced,
        arrivals,
        faults,
        produce_end_us,
        resolved_committed: &HashSet::new(),
        lost_with_primary: &HashSet::new(),
    })
}

#[test]
fn a_relay_draining_its_backlog_at_full_speed_meets_the_sink_up_rate() {
    let down = [(5 * S, 9 * S)];
    let (produced, arrivals) = timeline(|_| 150.0, &down);
    let faults = [fault("broker-outage", 5 * S, 9 * S, down.to_vec())];
    let r = run(&produced, &arrivals, &faults, 20 * S);
    assert!(r.passed, "{:?}", r.failures);
    let up = r.sink_up.unwrap();
    let steady = up.steady_rate.unwrap();
    assert!((steady - 100.0).abs() < 1.0, "{steady}");
    assert_eq!(up.steady_window_s, 5.0);
    assert_eq!(up.windows.len(), 1);
    let w = &up.windows[0];
    assert_eq!((w.at_s, w.from_s), (9.0, 9.0));
    // 401 events committed by 9 s waited, 2 of them sent at 9 s
    // itself; 150/s against 100/s of new ones: 2.67 s to drain.
    assert_eq!(w.backlog, 399);
    assert!((w.measured_s - 2.67).abs() < 0.02, "{w:?}");
    assert!((w.rate.unwrap() - 150.0).abs() < 2.0, "{w:?}");
    assert!((w.ratio.unwrap() - 1.5).abs() < 0.03, "{w:?}");
    assert_eq!(w.verdict, "ok");
    assert_eq!(up.worst_ratio, w.ratio);
}

#[test]
fn a_relay_slower_after_the_sink_returns_is_reported_slow() {
    let down = [(5 * S, 9 * S)];
    // 150/s before the outage, 70/s after it: below 80% of the 100/s
    // it sustained in the warm-up.
    let (produced, arrivals) = timeline(|t| if t < 9 * S { 150.0 } else { 70.0 }, &down);
    let faults = [fault("broker-outage", 5 * S, 9 * S, down.to_vec())];
    let r = run(&produced, &arrivals, &faults, 20 * S);
    assert_eq!(r.lost, 0);
    let w = &r.sink_up.as_ref().unwrap().windows[0];
    assert_eq!(w.verdict, "slow");
    assert!((w.ratio.unwrap() - 0.7).abs() < 0.03, "{w:?}");
    assert!((w.measured_s - 400.0 / 70.0).abs() < 0.05, "{w:?}");
    assert!(r.passed, "reported, not gating: {:?}", r.failures);
    assert!(
        sink_up_lines(&r).iter().any(|l| l.contains("slow")),
        "{:?}",
        sink_up_lines(&r)
    );
}

#[test]
fn short_spans_spans_without_backlog_and_a_short_warm_up_are_not_measured() {
    // A flap (down 5-6 s and 8-9 s) and a relay stopped 4-6.5 s (its
    // keys blocked for the 1 s lease after): the first span is measured
    // from 7.5 s, when nothing waits any more; the second drains its
    // backlog in 0.1 s.
    let down = [(5 * S, 6 * S), (8 * S, 9 * S)];
    let (produced, arrivals) = timeline(|_| 1000.0, &down);
    let faults = [
        fault("stop", 4 * S, 6 * S + S / 2, Vec::new()),
        fault("broker-flap", 5 * S, 9 * S, down.to_vec()),
    ];
    let r = run(&produced, &arrivals, &faults, 20 * S);
    assert!(r.passed, "{:?}", r.failures);
    let up = r.sink_up.unwrap();
    let w: Vec<(f64, f64, u64, &str)> = up
        .windows
        .iter()
        .map(|w| (w.at_s, w.from_s, w.backlog, w.verdict.as_str()))
        .collect();
    assert_eq!(w[0], (6.0, 7.5, 0, "n/a: no backlog"));
    // 101 committed by 9 s, 11 of them sent at 9 s itself.
    assert_eq!((w[1].0, w[1].2), (9.0, 90));
    assert!(w[1].3.starts_with("n/a: measurable for 0."), "{w:?}");
    assert!(up.windows[1].measured_s < 0.2, "{:?}", up.windows[1]);
    assert_eq!(up.worst_ratio, None);

    // The first fault 1 s in: no steady rate to compare with.
    let down = [(S, 5 * S)];
    let (produced, arrivals) = timeline(|_| 150.0, &down);
    let faults = [fault("broker-outage", S, 5 * S, Vec::new())];
    let r = run(&produced, &arrivals, &faults, 20 * S);
    assert!(r.passed, "{:?}", r.failures);
    let up = r.sink_up.unwrap();
    assert_eq!(up.steady_rate, None);
    assert!(up.windows[0].rate.is_some());
    assert_eq!(up.windows[0].verdict, "n/a: no steady rate (warm-up < 2 s)");
}

#[test]
fn a_database_crash_is_measured_from_the_database_back_and_allows_a_batch_per_relay() {
    // Crash at 2 s, the database back at 3 s; one event a second before
    // the crash, delivered at 5 s; new events every 100 ms after 3 s
    // (each its own key), each delivered 2.5 s after its commit until
    // 4.5 s, then after 50 ms.
    let mut produced = vec![p("a", 1, TxOutcome::Committed, S)];
    let mut arrivals = vec![a(&produced[0], 5 * S)];
    for i in 0..60 {
        let at = 3 * S + (i + 1) * S / 10;
        let e = p(&format!("b{i}"), 1, TxOutcome::Committed, at);
        let lag = if at < 4 * S + S / 2 {
            5 * S / 2
        } else {
            S / 20
        };
        arrivals.push(a(&e, at + lag));
        produced.push(e);
    }
    arrivals.sort_by_key(|a| a.at_us);
    // Two relays (scenario()): 2 batches of 2 copies allowed.
    for e in &produced[1..5] {
        arrivals.push(a(e, 9 * S));
    }
    let faults = vec![FaultRecord {
        may_duplicate: true,
        db_ready_us: Some(3 * S),
        ..fault("pg-crash", 2 * S, 3 * S, Vec::new())
    }];
    let r = run(&produced, &arrivals, &faults, 9 * S);
    assert!(r.passed, "{:?}", r.failures);
    let f = &r.faults[0];
    assert_eq!(f.db_down_s, Some(1.0));
    assert_eq!(f.recovery_s, Some(2.0), "the pre-crash event, 2 s after");
    // lease 1 s + 5 s.
    assert_eq!(f.recovery_target_s, Some(6.0));
    // Events committed before 4.5 s arrive 2.5 s late (the last at
    // 6.9 s); from there every event older than 1 s has arrived:
    // 6.9 s = 3.9 s after the database was back.
    let c = f.caught_up_s.unwrap();
    assert!((c - 3.9).abs() < 0.011, "{c}");
    assert_eq!((r.extra_copies, r.duplicate_allowance), (4, 4));
}

#[test]
fn each_broker_cut_allows_one_batch_of_copies() {
    let e = p("a", 1, TxOutcome::Committed, 100);
    let produced = vec![e.clone()];
    // Batch size 2, one flap of 2 cuts: 4 extra copies allowed.
    let flap = |n: usize| {
        let arrivals: Vec<Arrival> = (0..=n).map(|i| a(&e, 200 + i as i64)).collect();
        let faults = vec![FaultRecord {
            broker_cuts: 2,
            ..fault("broker-flap", 150, 160, Vec::new())
        }];
        run(&produced, &arrivals, &faults, 100)
    };
    let ok = flap(4);
    assert_eq!(
        (ok.extra_copies, ok.duplicate_allowance, ok.broker_cuts),
        (4, 4, 2)
    );
    assert!(ok.passed, "{:?}", ok.failures);
    assert!(!flap(5).passed);
}

/// Checks `scenario()` end to end through the inbox (the arrivals are
/// the effects).
fn run_inbox(produced: &[Produced], effects: &[Arrival], faults: &[FaultRecord]) -> Report {
    run_inbox_with(2, produced, effects, faults)
}

fn run_inbox_with(
    consumers: u32,
    produced: &[Produced],
    effects: &[Arrival],
    faults: &[FaultRecord],
) -> Report {
    check(&Inputs {
        scenario: Scenario {
            inbox: Some("postgres".into()),
            consumers,
            ..scenario()
        },
        produced,
        arrivals: effects,
        faults,
        produce_end_us: 1_000,
        resolved_committed: &HashSet::new(),
        lost_with_primary: &HashSet::new(),
    })
}

#[test]
fn inbox_mode_fails_on_one_duplicate_effect_even_after_a_kill() {
    let e1 = p("a", 1, TxOutcome::Committed, 100);
    let e2 = p("a", 2, TxOutcome::Committed, 200);
    let produced = vec![e1.clone(), e2.clone()];
    let kill = FaultRecord {
        may_duplicate: true,
        ..fault("kill", 150, 160, Vec::new())
    };
    let consumer_kill = fault("consumer-kill", 170, 180, Vec::new());
    let faults = [kill, consumer_kill];
    let once = run_inbox(&produced, &[a(&e1, 300), a(&e2, 400)], &faults);
    assert!(once.passed, "{:?}", once.failures);
    assert_eq!(once.duplicate_allowance, 0);
    let twice = run_inbox(&produced, &[a(&e1, 300), a(&e2, 400), a(&e2, 500)], &faults);
    assert!(!twice.passed);
    assert_eq!((twice.duplicated, twice.extra_copies), (1, 1));
    assert_eq!(twice.failures.len(), 1, "{:?}", twice.failures);
    assert!(
        twice.failures[0].contains("duplicate effect"),
        "{:?}",
        twice.failures
    );
    // The same arrivals from the independent recorder are within the
    // kill's allowance.
    assert!(
        run(
            &produced,
            &[a(&e1, 300), a(&e2, 400), a(&e2, 500)],
            &faults,
            1_000
        )
        .passed
    );
}

#[test]
fn inbox_mode_fails_on_a_missing_or_rolled_back_effect() {
    let e1 = p("a", 1, TxOutcome::Committed, 100);
    let e2 = p("b", 1, TxOutcome::Committed, 200);
    let rb = p("b", 2, TxOutcome::RolledBack, 300);
    let produced = vec![e1.clone(), e2.clone(), rb.clone()];
    let missing = run_inbox(&produced, &[a(&e1, 400)], &[]);
    assert!(!missing.passed);
    assert_eq!(
        (missing.lost, missing.lost_sample.clone()),
        (1, vec![e2.id])
    );
    assert_eq!(missing.faults.len(), 0);
    let rolled_back = run_inbox(&produced, &[a(&e1, 400), a(&e2, 500), a(&rb, 600)], &[]);
    assert!(!rolled_back.passed);
    assert_eq!(rolled_back.unexpected_rolled_back, 1);
    assert_eq!(rolled_back.lost, 0);
}

#[test]
fn inbox_mode_detects_effects_out_of_the_keys_commit_order() {
    let e1 = p("a", 1, TxOutcome::Committed, 100);
    let e2 = p("a", 2, TxOutcome::Committed, 200);
    let e3 = p("b", 1, TxOutcome::Committed, 300);
    let produced = vec![e1.clone(), e2.clone(), e3.clone()];
    // The effects in insertion order: a:2 before a:1 (b between them
    // is another key: no violation).
    let effects = [a(&e2, 400), a(&e3, 450), a(&e1, 500)];
    let r = run_inbox_with(1, &produced, &effects, &[]);
    assert!(!r.passed);
    assert_eq!(r.order_violations, 1);
    assert_eq!(r.order_sample, vec!["a: got 1 after 2".to_owned()]);
    assert_eq!((r.lost, r.extra_copies), (0, 0));
    // Competing consumers of one durable share a key's messages out: the
    // same effects are reported there, not failed.
    let competing = run_inbox_with(2, &produced, &effects, &[]);
    assert!(competing.passed, "{:?}", competing.failures);
    assert_eq!(competing.order_violations, 1);
    let ok = run_inbox_with(1, &produced, &[a(&e3, 400), a(&e1, 450), a(&e2, 500)], &[]);
    assert!(ok.passed, "{:?}", ok.failures);
}

#[test]
fn a_stale_copy_arriving_last_fails_and_a_full_replay_does_not() {
    let e1 = p("a", 1, TxOutcome::Committed, 100);
    let e2 = p("a", 2, TxOutcome::Committed, 200);
    let produced = vec![e1.clone(), e2.clone()];
    // A relay past its lease: a:1 again after the new holder's a:2. The
    // first arrivals are in order, so only the last-copy check sees it.
    let stale = run(
        &produced,
        &[a(&e1, 300), a(&e2, 400), a(&e1, 500)],
        &[],
        700,
    );
    assert_eq!(stale.order_violations, 0);
    assert_eq!(stale.stale_copies, 1);
    assert_eq!(stale.stale_sample, vec!["a: 1 last after 2".to_owned()]);
    assert!(!stale.passed, "{:?}", stale.failures);
    // A replay after a crash delivers a:2 again after a:1: the key ends on
    // its newest event.
    let replay = run(
        &produced,
        &[a(&e1, 300), a(&e2, 400), a(&e1, 500), a(&e2, 600)],
        &[],
        700,
    );
    assert_eq!(replay.stale_copies, 0);
    assert_eq!(replay.extra_copies, 2);
}

#[test]
fn commits_lost_with_the_primary_fail_only_a_synchronous_run() {
    let kept = p("a", 1, TxOutcome::Committed, 100);
    let gone = p("a", 2, TxOutcome::Committed, 200);
    let lost: HashSet<Uuid> = [gone.tx].into_iter().collect();
    let produced = [kept.clone(), gone.clone()];
    let arrivals = [a(&kept, 300)];
    for (replication, passes) in [("async", true), ("sync", false)] {
        let r = check(&Inputs {
            scenario: Scenario {
                replication: Some(replication.to_owned()),
                ..scenario()
            },
            produced: &produced,
            arrivals: &arrivals,
            faults: &[],
            produce_end_us: 400,
            resolved_committed: &HashSet::new(),
            lost_with_primary: &lost,
        });
        assert_eq!((r.lost, r.lost_with_primary), (0, 1), "{replication}");
        assert_eq!(r.passed, passes, "{replication}: {:?}", r.failures);
    }
}
