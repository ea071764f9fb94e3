//! The checks of a `tenants` run: the checker over every database
//! together, then over each database's own events (their keys start with
//! the store's name), the fresh events' latency and the kill's recovery.

use super::result::{FreshLatency, Role, TenantDb, TenantResult, TenantsMeta, KILL_KIND};
use crate::checker::{self, Report, Scenario};
use crate::record::{secs, Arrival, FaultRecord, Produced, TxOutcome};
use std::collections::{HashMap, HashSet};
use uuid::Uuid;

/// What the run recorded besides its events (run.json's fields).
#[derive(Debug)]
pub(crate) struct Recorded<'a> {
    /// The run's setup.
    pub(crate) scenario: &'a Scenario,
    /// When production stopped.
    pub(crate) produce_end_us: i64,
    /// Transactions with an unknown outcome found committed.
    pub(crate) resolved_committed: &'a [Uuid],
    /// Relay exits (each restarted).
    pub(crate) relay_exits: &'a [String],
}

/// The run's report: the checker over every database together, each
/// database's own checks in `tenants`, and the run failed when any
/// database fails.
pub(crate) fn report(
    meta: &Recorded<'_>,
    tenants: &TenantsMeta,
    produced: &[Produced],
    arrivals: &[Arrival],
    faults: &[FaultRecord],
) -> Report {
    let resolved: HashSet<Uuid> = meta.resolved_committed.iter().copied().collect();
    let none = HashSet::new();
    let mut all = checker::check(&checker::Inputs {
        scenario: meta.scenario.clone(),
        produced,
        arrivals,
        faults,
        produce_end_us: meta.produce_end_us,
        resolved_committed: &resolved,
        lost_with_primary: &none,
    });
    all.relay_exits = meta.relay_exits.to_vec();
    // Lost is the databases' sum (below).
    all.failures
        .retain(|f| !f.ends_with("committed event(s) lost"));
    let mut results = Vec::with_capacity(tenants.databases.len());
    for db in &tenants.databases {
        let r = tenant_report(meta, tenants, db, produced, arrivals, faults, &resolved);
        all.failures
            .extend(r.failures.iter().map(|f| format!("{}: {f}", db.name)));
        results.push(r);
    }
    // The backlog database's undelivered tail is not lost (see
    // `tenant_report`): the run's lost is the databases' sum.
    all.lost = results.iter().map(|t| t.lost).sum();
    if all.lost > 0 {
        all.failures
            .insert(0, format!("{} committed event(s) lost", all.lost));
    }
    all.passed = all.failures.is_empty();
    all.tenants = Some(results);
    all
}

fn tenant_report(
    meta: &Recorded<'_>,
    tenants: &TenantsMeta,
    db: &TenantDb,
    produced: &[Produced],
    arrivals: &[Arrival],
    faults: &[FaultRecord],
    resolved: &HashSet<Uuid>,
) -> TenantResult {
    let prefix = format!("{}.", db.name);
    let backlog_prefix = format!("{prefix}b");
    let mine: Vec<Produced> = produced
        .iter()
        .filter(|p| p.key.starts_with(&prefix))
        .cloned()
        .collect();
    let came: Vec<Arrival> = arrivals
        .iter()
        .filter(|a| a.key.starts_with(&prefix))
        .cloned()
        .collect();
    let hit: Vec<FaultRecord> = faults
        .iter()
        .filter(|f| f.target.starts_with(&format!("{}:", db.name)))
        .cloned()
        .collect();
    let none = HashSet::new();
    let mut scenario = meta.scenario.clone();
    scenario.name = format!("{} {}", meta.scenario.name, db.name);
    let r = checker::check(&checker::Inputs {
        scenario,
        produced: &mine,
        arrivals: &came,
        faults: &hit,
        produce_end_us: meta.produce_end_us,
        resolved_committed: resolved,
        lost_with_primary: &none,
    });
    // The fresh events: the producers', committed (or found committed).
    let mut first: HashMap<Uuid, i64> = HashMap::new();
    for a in &came {
        first.entry(a.id).or_insert(a.at_us);
    }
    let committed = |p: &Produced| {
        p.outcome == TxOutcome::Committed
            || (p.outcome == TxOutcome::Unknown && resolved.contains(&p.tx))
    };
    let mut lat: Vec<i64> = mine
        .iter()
        .filter(|p| !p.key.starts_with(&backlog_prefix) && committed(p))
        .filter_map(|p| first.get(&p.id).map(|at| (at - p.at_us).max(0)))
        .collect();
    lat.sort_unstable();
    let fresh_latency_ms = FreshLatency {
        p50: checker::percentile(&lat, 50.0),
        p90: checker::percentile(&lat, 90.0),
        p99: checker::percentile(&lat, 99.0),
        max: lat.last().map_or(0.0, |v| *v as f64 / 1000.0),
    };
    let backlog_ids: Vec<Uuid> = mine
        .iter()
        .filter(|p| p.key.starts_with(&backlog_prefix))
        .map(|p| p.id)
        .collect();
    let backlog_drained_s = (!backlog_ids.is_empty())
        .then(|| {
            backlog_ids
                .iter()
                .map(|id| first.get(id).copied())
                .collect::<Option<Vec<i64>>>()
                .and_then(|at| at.into_iter().max())
                .map(|last| secs(last - meta.scenario.start_us))
        })
        .flatten();
    // The backlog database is not drained by the end of a quick run: an
    // event is lost when a later event of its key arrived and it did not
    // (delivery is in key order); the events after a key's last arrival
    // are left in the log.
    let (lost, left) = if db.role == Role::Backlog {
        let mut top: HashMap<&str, u64> = HashMap::new();
        for a in &came {
            let t = top.entry(a.key.as_str()).or_insert(0);
            *t = (*t).max(a.seq);
        }
        let (mut lost, mut left) = (0u64, 0u64);
        for p in mine
            .iter()
            .filter(|p| committed(p) && !first.contains_key(&p.id))
        {
            if top.get(p.key.as_str()).is_some_and(|t| p.seq < *t) {
                lost += 1;
            } else {
                left += 1;
            }
        }
        (lost, left)
    } else {
        (r.lost, 0)
    };
    let fault = r.faults.iter().find(|f| f.kind == KILL_KIND);
    let p99_target_ms = (db.role == Role::Fresh).then_some(tenants.p99_target_ms);
    let mut failures: Vec<String> = r
        .failures
        .iter()
        .filter(|f| !f.ends_with("committed event(s) lost"))
        .cloned()
        .collect();
    if lost > 0 {
        failures.push(format!("{lost} committed event(s) lost"));
    }
    if let Some(target) = p99_target_ms {
        if lat.is_empty() {
            failures.push("no fresh event arrived".to_owned());
        } else if fresh_latency_ms.p99 > target {
            failures.push(format!(
                "fresh events' p99 latency {:.0} ms over the {target:.0} ms target (a backlogged or killed database delayed it)",
                fresh_latency_ms.p99
            ));
        }
    }
    if db.role == Role::Killed && fault.is_none() {
        failures.push("its connections were never killed".to_owned());
    }
    TenantResult {
        name: db.name.clone(),
        database: db.database.clone(),
        role: db.role,
        committed: r.committed,
        backlog: backlog_ids.len() as u64,
        lost,
        left,
        duplicated: r.duplicated,
        extra_copies: r.extra_copies,
        duplicate_allowance: r.duplicate_allowance,
        unexpected: r.unexpected,
        order_violations: r.order_violations,
        stale_copies: r.stale_copies,
        fresh_latency_ms,
        fresh_events: lat.len() as u64,
        p99_target_ms,
        first_delivery_s: fault.and_then(|f| f.first_delivery_s),
        recovery_s: fault.and_then(|f| f.recovery_s),
        caught_up_s: fault.and_then(|f| f.caught_up_s),
        kill: fault.map(|f| f.target.clone()),
        backlog_drained_s,
        passed: failures.is_empty(),
        failures,
    }
}
