//! The checker: from what the producer committed, what the consumer
//! received and which faults were injected, reports lost, duplicated,
//! unexpected, per-key order violations, commit->arrival latency and the
//! recovery time after each fault, and whether the run meets its targets.

use crate::record::{Arrival, FaultRecord, Produced, TxOutcome};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use uuid::Uuid;

/// How the run was set up (copied into the report).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Scenario {
    /// Run name (also the prefix of its schema / stream / queue / topic).
    pub(crate) name: String,
    /// `postgres` or `sqlite`.
    pub(crate) store: String,
    /// `nats`, `amqp` or `kafka`.
    pub(crate) broker: String,
    /// Relay processes.
    pub(crate) relays: u32,
    /// Offered events per second.
    pub(crate) rate: u32,
    /// Production time, seconds.
    pub(crate) duration_s: u64,
    /// The relays' `--batch-size`.
    pub(crate) batch_size: u32,
    /// The relays' `--lock-timeout-ms` (lease).
    pub(crate) lease_ms: u64,
    /// The fault plan as given.
    pub(crate) faults: String,
    /// Run start, microseconds since the epoch.
    pub(crate) start_us: i64,
}

/// Percentiles in milliseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct Latency {
    /// Median.
    pub(crate) p50: f64,
    /// 90th percentile.
    pub(crate) p90: f64,
    /// 99th percentile.
    pub(crate) p99: f64,
    /// Largest.
    pub(crate) max: f64,
}

/// One injected fault and what followed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FaultResult {
    /// Fault kind.
    pub(crate) kind: String,
    /// What it hit.
    pub(crate) target: String,
    /// Start, seconds after the run started.
    pub(crate) at_s: f64,
    /// How long the fault lasted, seconds.
    pub(crate) duration_s: f64,
    /// Seconds after the fault was over (for a stopped relay: after it was
    /// stopped) until every event committed before that moment had arrived;
    /// `None` when one of them never arrived.
    pub(crate) recovery_s: Option<f64>,
    /// The recovery target for this kind, seconds: lease + 1 s after
    /// a kill or a stop, 5 s after the broker returns; none for the others.
    pub(crate) recovery_target_s: Option<f64>,
    /// Extra copies received after this fault started and before the next.
    pub(crate) extra_copies: u64,
    /// Whether a duplicate batch is allowed after it.
    pub(crate) may_duplicate: bool,
}

/// The checker's verdict over one run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Report {
    /// The setup.
    pub(crate) scenario: Scenario,
    /// Events in committed transactions.
    pub(crate) committed: u64,
    /// Events in rolled-back transactions.
    pub(crate) rolled_back: u64,
    /// Events whose `COMMIT` failed; resolved after the run (see the two
    /// fields below), else neither required nor unexpected.
    pub(crate) unknown: u64,
    /// Of `unknown`, how many turned out committed (business row present).
    pub(crate) unknown_committed: u64,
    /// Messages received, duplicates included.
    pub(crate) messages: u64,
    /// Distinct events received.
    pub(crate) distinct: u64,
    /// Committed events never received.
    pub(crate) lost: u64,
    /// Up to 10 lost ids.
    pub(crate) lost_sample: Vec<Uuid>,
    /// Events received more than once.
    pub(crate) duplicated: u64,
    /// Copies beyond the first.
    pub(crate) extra_copies: u64,
    /// Copies of rolled-back events plus messages with no produced event.
    pub(crate) unexpected: u64,
    /// Of `unexpected`: rolled-back events received.
    pub(crate) unexpected_rolled_back: u64,
    /// Of `unexpected`: messages whose id was never produced (or unreadable).
    pub(crate) unexpected_unknown: u64,
    /// First arrivals whose sequence number is below one already received
    /// for the same key.
    pub(crate) order_violations: u64,
    /// Up to 10 violations, `key: got seq after seq`.
    pub(crate) order_sample: Vec<String>,
    /// Commit -> first arrival, over committed events that arrived.
    pub(crate) latency_ms: Latency,
    /// Each fault and the recovery after it.
    pub(crate) faults: Vec<FaultResult>,
    /// Extra copies allowed: one batch per kill or lease-losing stop, and one
    /// per cut of the broker connection.
    pub(crate) duplicate_allowance: u64,
    /// Times the relays' broker connections were cut.
    #[serde(default)]
    pub(crate) broker_cuts: u64,
    /// Seconds from the end of production until the last committed event
    /// arrived (the drain).
    pub(crate) drain_s: Option<f64>,
    /// Faults whose recovery missed its target (reported, not failed on:
    /// timings never decide a pass).
    pub(crate) recovery_misses: u64,
    /// Relay processes that exited by themselves (each restarted at once,
    /// as a supervisor would): reported, not failed on.
    #[serde(default)]
    pub(crate) relay_exits: Vec<String>,
    /// Every target met.
    pub(crate) passed: bool,
    /// The targets missed, in words.
    pub(crate) failures: Vec<String>,
}

/// Everything the checker reads.
#[derive(Debug)]
pub(crate) struct Inputs<'a> {
    pub(crate) scenario: Scenario,
    pub(crate) produced: &'a [Produced],
    pub(crate) arrivals: &'a [Arrival],
    pub(crate) faults: &'a [FaultRecord],
    /// When production stopped.
    pub(crate) produce_end_us: i64,
    /// Transactions with `Unknown` outcome found committed after the run.
    pub(crate) resolved_committed: &'a std::collections::HashSet<Uuid>,
}

fn secs(us: i64) -> f64 {
    us as f64 / 1e6
}

fn percentile(sorted: &[i64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[rank.min(sorted.len() - 1)] as f64 / 1000.0
}

/// Runs every check.
pub(crate) fn check(input: &Inputs<'_>) -> Report {
    // What must arrive, what may, what must not.
    let mut must: HashMap<Uuid, &Produced> = HashMap::new();
    let mut may: HashMap<Uuid, &Produced> = HashMap::new();
    let mut must_not: HashMap<Uuid, &Produced> = HashMap::new();
    let (mut committed, mut rolled_back, mut unknown, mut unknown_committed) = (0, 0, 0, 0);
    for p in input.produced {
        match p.outcome {
            TxOutcome::Committed => {
                committed += 1;
                must.insert(p.id, p);
            }
            TxOutcome::RolledBack => {
                rolled_back += 1;
                must_not.insert(p.id, p);
            }
            TxOutcome::Unknown => {
                unknown += 1;
                if input.resolved_committed.contains(&p.tx) {
                    unknown_committed += 1;
                    must.insert(p.id, p);
                } else {
                    may.insert(p.id, p);
                }
            }
        }
    }

    // First arrival per id, copies, unexpected, order.
    let mut first: HashMap<Uuid, i64> = HashMap::new();
    let mut copies: HashMap<Uuid, u64> = HashMap::new();
    let mut extra_at: Vec<i64> = Vec::new();
    let (mut unexpected_rolled_back, mut unexpected_unknown) = (0u64, 0u64);
    let mut max_seq: HashMap<&str, u64> = HashMap::new();
    let mut order_violations = 0u64;
    let mut order_sample = Vec::new();
    for a in input.arrivals {
        let n = copies.entry(a.id).or_insert(0);
        *n += 1;
        if *n > 1 {
            extra_at.push(a.at_us);
            continue;
        }
        first.insert(a.id, a.at_us);
        let produced = must.get(&a.id).or_else(|| may.get(&a.id));
        let Some(p) = produced else {
            if must_not.contains_key(&a.id) {
                unexpected_rolled_back += 1;
            } else {
                unexpected_unknown += 1;
            }
            continue;
        };
        // The producer's record is the truth; the payload must agree.
        if p.key != a.key || p.seq != a.seq {
            unexpected_unknown += 1;
            continue;
        }
        let top = max_seq.entry(p.key.as_str()).or_insert(0);
        if p.seq < *top {
            order_violations += 1;
            if order_sample.len() < 10 {
                order_sample.push(format!("{}: got {} after {}", p.key, p.seq, *top));
            }
        } else {
            *top = p.seq;
        }
    }
    // Copies of a rolled-back event beyond its first count as unexpected too.
    for (id, n) in &copies {
        if *n > 1 && must_not.contains_key(id) {
            unexpected_rolled_back += n - 1;
        }
    }

    let mut lost_ids: Vec<Uuid> = must
        .keys()
        .filter(|id| !first.contains_key(id))
        .copied()
        .collect();
    lost_ids.sort();
    let duplicated = copies.values().filter(|n| **n > 1).count() as u64;
    let extra_copies: u64 = copies.values().map(|n| n.saturating_sub(1)).sum();

    // Latency over committed events that arrived.
    let mut lat: Vec<i64> = must
        .values()
        .filter_map(|p| first.get(&p.id).map(|at| (at - p.at_us).max(0)))
        .collect();
    lat.sort_unstable();
    let latency_ms = Latency {
        p50: percentile(&lat, 50.0),
        p90: percentile(&lat, 90.0),
        p99: percentile(&lat, 99.0),
        max: lat.last().map_or(0.0, |v| *v as f64 / 1000.0),
    };

    // Recovery: for a moment T, the last first-arrival among events
    // committed at or before T, minus T. A prefix maximum over events sorted
    // by commit time answers it for every fault; a lost event poisons its
    // prefix (i64::MAX).
    let mut by_commit: Vec<(i64, i64)> = must
        .values()
        .map(|p| (p.at_us, first.get(&p.id).copied().unwrap_or(i64::MAX)))
        .collect();
    by_commit.sort_unstable();
    let mut prefix_max = Vec::with_capacity(by_commit.len());
    let mut m = i64::MIN;
    for (_, arr) in &by_commit {
        m = m.max(*arr);
        prefix_max.push(m);
    }
    let recovery_after = |t: i64| -> Option<f64> {
        let n = by_commit.partition_point(|(c, _)| *c <= t);
        if n == 0 {
            return Some(0.0);
        }
        let last = prefix_max[n - 1];
        (last != i64::MAX).then(|| secs((last - t).max(0)))
    };

    let mut faults_sorted: Vec<&FaultRecord> = input.faults.iter().collect();
    faults_sorted.sort_by_key(|f| f.start_us);
    extra_at.sort_unstable();
    let start = input.scenario.start_us;
    let faults: Vec<FaultResult> = faults_sorted
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let next = faults_sorted.get(i + 1).map_or(i64::MAX, |n| n.start_us);
            let extra = extra_at
                .iter()
                .filter(|t| **t >= f.start_us && **t < next)
                .count() as u64;
            FaultResult {
                kind: f.kind.clone(),
                target: f.target.clone(),
                at_s: secs(f.start_us - start),
                duration_s: secs(f.end_us - f.start_us),
                recovery_s: recovery_after(f.recovery_from_us.unwrap_or(f.end_us)),
                recovery_target_s: recovery_target(&f.kind, input.scenario.lease_ms),
                extra_copies: extra,
                may_duplicate: f.may_duplicate,
            }
        })
        .collect();
    let dup_faults = input.faults.iter().filter(|f| f.may_duplicate).count() as u64;
    let broker_cuts: u64 = input.faults.iter().map(|f| u64::from(f.broker_cuts)).sum();
    let duplicate_allowance = (dup_faults + broker_cuts) * u64::from(input.scenario.batch_size);
    let drain_s = match prefix_max.last() {
        None => Some(0.0),
        Some(&i64::MAX) => None,
        Some(last) => Some(secs((last - input.produce_end_us).max(0))),
    };

    let recovery_misses = faults
        .iter()
        .filter(|f| match (f.recovery_s, f.recovery_target_s) {
            (Some(r), Some(t)) => r > t,
            (None, Some(_)) => true,
            _ => false,
        })
        .count() as u64;
    let lost = lost_ids.len() as u64;
    let unexpected = unexpected_rolled_back + unexpected_unknown;
    let mut failures = Vec::new();
    if lost > 0 {
        failures.push(format!("{lost} committed event(s) lost"));
    }
    if unexpected > 0 {
        failures.push(format!(
            "{unexpected} unexpected message(s) ({unexpected_rolled_back} rolled back, {unexpected_unknown} unknown)"
        ));
    }
    if order_violations > 0 {
        failures.push(format!("{order_violations} per-key order violation(s)"));
    }
    if extra_copies > duplicate_allowance {
        failures.push(format!(
            "{extra_copies} extra copies, more than one batch ({}) per kill / lease loss ({dup_faults}) and per broker connection cut ({broker_cuts}): allowance {duplicate_allowance}",
            input.scenario.batch_size
        ));
    }
    if committed == 0 {
        failures.push("no event was committed: the producer did not run".to_owned());
    }
    Report {
        scenario: input.scenario.clone(),
        committed,
        rolled_back,
        unknown,
        unknown_committed,
        messages: input.arrivals.len() as u64,
        distinct: first.len() as u64,
        lost,
        lost_sample: lost_ids.into_iter().take(10).collect(),
        duplicated,
        extra_copies,
        unexpected,
        unexpected_rolled_back,
        unexpected_unknown,
        order_violations,
        order_sample,
        latency_ms,
        faults,
        duplicate_allowance,
        broker_cuts,
        drain_s,
        recovery_misses,
        relay_exits: Vec::new(),
        passed: failures.is_empty(),
        failures,
    }
}

/// The recovery target for a fault kind, seconds.
fn recovery_target(kind: &str, lease_ms: u64) -> Option<f64> {
    match kind {
        "kill" | "stop" => Some(lease_ms as f64 / 1000.0 + 1.0),
        "broker-outage" | "broker-flap" => Some(5.0),
        _ => None,
    }
}

/// One line per fault kind: how many, worst recovery, extra copies.
pub(crate) fn by_kind(report: &Report) -> BTreeMap<String, (u64, Option<f64>, u64)> {
    let mut out: BTreeMap<String, (u64, Option<f64>, u64)> = BTreeMap::new();
    for f in &report.faults {
        let e = out.entry(f.kind.clone()).or_insert((0, Some(0.0), 0));
        e.0 += 1;
        e.1 = match (e.1, f.recovery_s) {
            (Some(a), Some(b)) => Some(a.max(b)),
            _ => None,
        };
        e.2 += f.extra_copies;
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
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
            batch_size: 2,
            lease_ms: 1000,
            faults: String::new(),
            start_us: 0,
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
            kind: "kill".into(),
            target: "relay-0".into(),
            start_us: 2_500,
            end_us: 2_600,
            recovery_from_us: None,
            may_duplicate: true,
            broker_cuts: 0,
        }];
        let r = check(&Inputs {
            scenario: scenario(),
            produced: &produced,
            arrivals: &arrivals,
            faults: &faults,
            produce_end_us: 700,
            resolved_committed: &HashSet::new(),
        });
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
    }

    #[test]
    fn recovery_is_the_wait_for_events_committed_before_the_fault_ended() {
        let e1 = p("a", 1, TxOutcome::Committed, 1_000_000);
        let e2 = p("b", 1, TxOutcome::Committed, 2_000_000);
        let e3 = p("a", 2, TxOutcome::Committed, 9_000_000);
        let produced = vec![e1.clone(), e2.clone(), e3.clone()];
        let arrivals = vec![a(&e1, 1_001_000), a(&e2, 6_500_000), a(&e3, 9_002_000)];
        let faults = vec![FaultRecord {
            kind: "kill".into(),
            target: "relay-1".into(),
            start_us: 2_500_000,
            end_us: 2_500_000,
            recovery_from_us: None,
            may_duplicate: true,
            broker_cuts: 0,
        }];
        let r = check(&Inputs {
            scenario: scenario(),
            produced: &produced,
            arrivals: &arrivals,
            faults: &faults,
            produce_end_us: 9_000_000,
            resolved_committed: &HashSet::new(),
        });
        assert!(r.passed, "{:?}", r.failures);
        assert_eq!(r.faults[0].recovery_s, Some(4.0));
        assert_eq!(r.latency_ms.max, 4_500.0);
        assert_eq!(r.drain_s, Some(0.002));
    }

    #[test]
    fn each_broker_cut_allows_one_batch_of_copies() {
        let e = p("a", 1, TxOutcome::Committed, 100);
        let produced = vec![e.clone()];
        // Batch size 2, one flap of 2 cuts: 4 extra copies allowed.
        let flap = |n: usize| {
            let arrivals: Vec<Arrival> = (0..=n).map(|i| a(&e, 200 + i as i64)).collect();
            let faults = vec![FaultRecord {
                kind: "broker-flap".into(),
                target: "broker proxy".into(),
                start_us: 150,
                end_us: 160,
                recovery_from_us: None,
                may_duplicate: false,
                broker_cuts: 2,
            }];
            check(&Inputs {
                scenario: scenario(),
                produced: &produced,
                arrivals: &arrivals,
                faults: &faults,
                produce_end_us: 100,
                resolved_committed: &HashSet::new(),
            })
        };
        let ok = flap(4);
        assert_eq!(
            (ok.extra_copies, ok.duplicate_allowance, ok.broker_cuts),
            (4, 4, 2)
        );
        assert!(ok.passed, "{:?}", ok.failures);
        assert!(!flap(5).passed);
    }
}
