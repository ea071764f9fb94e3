//! What a run leaves in its directory (run.json, faults.json,
//! produced.jsonl, arrivals.jsonl, report.json) and how `check` reads it
//! back: the checker's report is made from these files alone.

use crate::checker;
use crate::record::{Arrival, FaultRecord, Produced};
use crate::summary;
use anyhow::{Context as _, Result};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufWriter, Write};
use std::path::Path;

/// What `check` needs besides the records (written as run.json).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RunMeta {
    pub(crate) scenario: checker::Scenario,
    pub(crate) produce_end_us: i64,
    pub(crate) resolved_committed: Vec<uuid::Uuid>,
    pub(crate) relay_exits: Vec<String>,
    /// End to end through the inbox: the consumers' counts.
    #[serde(default)]
    pub(crate) inbox: Option<checker::InboxReport>,
    /// `pg-failover`: transactions whose `COMMIT` succeeded on the old
    /// primary and that the promoted standby does not hold (asynchronous
    /// replication: lost with the primary, for the producer too).
    #[serde(default)]
    pub(crate) lost_with_primary: Vec<uuid::Uuid>,
    /// `tenants`: the run's databases and their roles (tenants.rs).
    #[serde(default)]
    pub(crate) tenants: Option<crate::tenants::result::TenantsMeta>,
}

pub(crate) fn write_records(
    out: &Path,
    meta: &RunMeta,
    produced: &[Produced],
    arrivals: &[Arrival],
    faults: &[FaultRecord],
) -> Result<()> {
    std::fs::write(out.join("run.json"), serde_json::to_vec_pretty(meta)?)?;
    std::fs::write(out.join("faults.json"), serde_json::to_vec_pretty(faults)?)?;
    write_jsonl(&out.join("produced.jsonl"), produced)?;
    write_jsonl(&out.join("arrivals.jsonl"), arrivals)?;
    Ok(())
}

fn write_jsonl<T: Serialize>(path: &Path, items: &[T]) -> Result<()> {
    let mut w = BufWriter::new(std::fs::File::create(path)?);
    for i in items {
        serde_json::to_writer(&mut w, i)?;
        w.write_all(b"\n")?;
    }
    w.flush()?;
    Ok(())
}

fn read_jsonl<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<T>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut out = Vec::new();
    for line in std::io::BufReader::new(f).lines() {
        let line = line?;
        if !line.trim().is_empty() {
            out.push(serde_json::from_str(&line)?);
        }
    }
    Ok(out)
}

pub(crate) fn report(
    meta: &RunMeta,
    produced: &[Produced],
    arrivals: &[Arrival],
    faults: &[FaultRecord],
) -> checker::Report {
    if let Some(tenants) = &meta.tenants {
        let recorded = crate::tenants::check::Recorded {
            scenario: &meta.scenario,
            produce_end_us: meta.produce_end_us,
            resolved_committed: &meta.resolved_committed,
            relay_exits: &meta.relay_exits,
        };
        return crate::tenants::check::report(&recorded, tenants, produced, arrivals, faults);
    }
    let resolved = meta.resolved_committed.iter().copied().collect();
    let lost_with_primary = meta.lost_with_primary.iter().copied().collect();
    let mut report = checker::check(&checker::Inputs {
        lost_with_primary: &lost_with_primary,
        scenario: meta.scenario.clone(),
        produced,
        arrivals,
        faults,
        produce_end_us: meta.produce_end_us,
        resolved_committed: &resolved,
    });
    // A relay that exits is restarted, as a supervisor would: what counts
    // is what the consumer received. The exits are reported beside it.
    report.relay_exits.clone_from(&meta.relay_exits);
    report.inbox.clone_from(&meta.inbox);
    report
}

pub(crate) fn finish(out: &Path, report: &checker::Report) -> Result<bool> {
    std::fs::write(out.join("report.json"), serde_json::to_vec_pretty(report)?)?;
    summary::print(report);
    Ok(report.passed)
}

pub(crate) fn check_dir(dir: &Path) -> Result<bool> {
    let meta: RunMeta = serde_json::from_slice(&std::fs::read(dir.join("run.json"))?)?;
    let faults: Vec<FaultRecord> =
        serde_json::from_slice(&std::fs::read(dir.join("faults.json"))?)?;
    let produced: Vec<Produced> = read_jsonl(&dir.join("produced.jsonl"))?;
    let arrivals: Vec<Arrival> = read_jsonl(&dir.join("arrivals.jsonl"))?;
    let report = report(&meta, &produced, &arrivals, &faults);
    finish(dir, &report)
}
