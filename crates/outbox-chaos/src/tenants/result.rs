//! What a `tenants` run records and reports about each database (below
//! the checker, which carries the results in its report, and the console
//! summary).

use serde::{Deserialize, Serialize};

/// The database holding the backlog.
pub(crate) const BACKLOG_DB: usize = 0;
/// The database whose connections are terminated.
pub(crate) const KILLED_DB: usize = 1;
/// The kind of the fault record of the kill.
pub(crate) const KILL_KIND: &str = "tenant-db-kill";

/// Commit -> first arrival, ms.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct FreshLatency {
    /// Median.
    pub(crate) p50: f64,
    /// 90th percentile.
    pub(crate) p90: f64,
    /// 99th percentile.
    pub(crate) p99: f64,
    /// Largest.
    pub(crate) max: f64,
}

/// What a database is for in the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Role {
    /// Preloaded with the backlog.
    Backlog,
    /// Its connections terminated mid-run.
    Killed,
    /// Producers only: its fresh events' latency is checked.
    Fresh,
}

impl Role {
    pub(crate) fn of(i: usize) -> Self {
        match i {
            BACKLOG_DB => Self::Backlog,
            KILLED_DB => Self::Killed,
            _ => Self::Fresh,
        }
    }

    /// The name in reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Backlog => "backlog",
            Self::Killed => "killed",
            Self::Fresh => "fresh",
        }
    }
}

/// One database of the run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TenantDb {
    /// The store's name for the relay (`t0`..), also its keys' prefix.
    pub(crate) name: String,
    /// The database's name on the server.
    pub(crate) database: String,
    /// What it is for.
    pub(crate) role: Role,
}

/// What `check` needs to make the per-database report again (in run.json).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TenantsMeta {
    /// The databases, in store order.
    pub(crate) databases: Vec<TenantDb>,
    /// Events preloaded into the backlog database.
    pub(crate) backlog: u64,
    /// The p99 the fresh databases' events must stay under, ms.
    pub(crate) p99_target_ms: f64,
}

/// The checks of one database.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TenantResult {
    /// The store's name (`t0`..).
    pub(crate) name: String,
    /// The database on the server.
    pub(crate) database: String,
    /// What it was for.
    pub(crate) role: Role,
    /// Committed events (the backlog included).
    pub(crate) committed: u64,
    /// Of them, the preloaded backlog.
    pub(crate) backlog: u64,
    /// Committed events never received.
    pub(crate) lost: u64,
    /// Events received more than once.
    pub(crate) duplicated: u64,
    /// Copies beyond the first.
    pub(crate) extra_copies: u64,
    /// Copies allowed (one batch per fault that may duplicate).
    pub(crate) duplicate_allowance: u64,
    /// Rolled-back events received.
    pub(crate) unexpected: u64,
    /// First arrivals below one already received for the key.
    pub(crate) order_violations: u64,
    /// Older events of a key whose last copy came after a later one's.
    pub(crate) stale_copies: u64,
    /// Commit -> first arrival of the producers' events (not the backlog's).
    pub(crate) fresh_latency_ms: FreshLatency,
    /// Fresh events the latency is over.
    pub(crate) fresh_events: u64,
    /// The p99 target (fresh databases only), ms.
    pub(crate) p99_target_ms: Option<f64>,
    /// Killed: seconds from the end of the kill until the database's first
    /// event arrived that had not arrived before.
    pub(crate) first_delivery_s: Option<f64>,
    /// Killed: seconds from the end of the kill until every event of the
    /// database committed before it had arrived.
    pub(crate) recovery_s: Option<f64>,
    /// Killed: seconds from the end of the kill until the database's lag
    /// stayed under 1 s.
    pub(crate) caught_up_s: Option<f64>,
    /// Killed: connections terminated, and in how many rounds.
    pub(crate) kill: Option<String>,
    /// Backlog database: committed events not delivered by the end, each
    /// after the last delivered event of its key (left in the log, in
    /// order; not lost).
    #[serde(default)]
    pub(crate) left: u64,
    /// Backlog: seconds from the start of the clock until the last backlog
    /// event had arrived (negative: before it).
    pub(crate) backlog_drained_s: Option<f64>,
    /// Every check met.
    pub(crate) passed: bool,
    /// The checks missed, in words.
    pub(crate) failures: Vec<String>,
}

/// The console lines of the per-database checks.
pub(crate) fn lines(results: &[TenantResult]) -> Vec<String> {
    let opt = |v: Option<f64>| v.map_or("NEVER".to_owned(), |s| format!("{s:.2} s"));
    results
        .iter()
        .map(|t| {
            let mut line = format!(
                "  {} ({}, {}): committed {} (backlog {}), lost {}, duplicated {} (+{} / {}), unexpected {}, order {}{}, fresh p50 {:.1} ms p99 {:.1} ms max {:.1} ms over {} events{}",
                t.name,
                t.role.name(),
                t.database,
                t.committed,
                t.backlog,
                t.lost,
                t.duplicated,
                t.extra_copies,
                t.duplicate_allowance,
                t.unexpected,
                t.order_violations,
                if t.stale_copies > 0 { format!(" + {} stale", t.stale_copies) } else { String::new() },
                t.fresh_latency_ms.p50,
                t.fresh_latency_ms.p99,
                t.fresh_latency_ms.max,
                t.fresh_events,
                t.p99_target_ms.map_or(String::new(), |p| format!(" (target p99 <= {p:.0} ms)")),
            );
            if let Some(kill) = &t.kill {
                line.push_str(&format!(
                    "\n    killed ({kill}); after it: first delivery {}, every earlier commit delivered {}, caught up {}",
                    opt(t.first_delivery_s),
                    opt(t.recovery_s),
                    opt(t.caught_up_s)
                ));
            }
            if t.backlog > 0 {
                line.push_str(&format!(
                    "\n    backlog of {}: drained {} after the clock started; {} event(s) left in the log at the end, each after its key's last delivered event",
                    t.backlog,
                    opt(t.backlog_drained_s),
                    t.left
                ));
            }
            line.push_str(if t.passed { "  ok" } else { "  FAILED" });
            line
        })
        .collect()
}
