//! The report of one run as the console shows it.

use crate::checker;

/// Prints a run's report: the counts, the faults with their recovery, and
/// every failure.
pub(crate) fn print(r: &checker::Report) {
    let s = &r.scenario;
    println!(
        "{} ({}+{}, {} relays, {} producer): committed {} (rolled back {}, unknown {}, of which committed {}), received {} ({} distinct)",
        s.name, s.store, s.broker, s.relays, s.producer, r.committed, r.rolled_back, r.unknown, r.unknown_committed, r.messages, r.distinct
    );
    println!(
        "  lost {}  duplicated {} (+{} copies, allowance {})  unexpected {}  order violations {}  latency p50 {:.1} ms p99 {:.1} ms max {:.1} ms  drain {}",
        r.lost,
        r.duplicated,
        r.extra_copies,
        r.duplicate_allowance,
        r.unexpected,
        r.order_violations,
        r.latency_ms.p50,
        r.latency_ms.p99,
        r.latency_ms.max,
        r.drain_s.map_or("never".to_owned(), |d| format!("{d:.1} s"))
    );
    if let Some(rep) = &s.replication {
        println!(
            "  {rep} replication: {} event(s) the producer saw committed were lost with the primary (not on the promoted standby)",
            r.lost_with_primary
        );
    }
    if !r.order_sample.is_empty() {
        println!(
            "  order violations, first ones: {}",
            r.order_sample.join("; ")
        );
    }
    if !r.stale_sample.is_empty() {
        println!(
            "  stale copies ({}), first ones: {}",
            r.stale_copies,
            r.stale_sample.join("; ")
        );
    }
    for f in &r.faults {
        println!(
            "  fault {:<14} {:<26} at {:>6.1} s for {:>5.1} s: recovery {:>7}{}  extra copies {}",
            f.kind,
            f.target,
            f.at_s,
            f.duration_s,
            f.recovery_s
                .map_or("NEVER".to_owned(), |r| format!("{r:.2} s")),
            f.interrupted_after_s.map_or(String::new(), |n| format!(
                " (interrupted: the next fault began {n:.1} s after)"
            )),
            f.extra_copies
        );
        if let Some(gap) = f.max_gap_s {
            println!(
                "    longest no-delivery gap while it held the log: {gap:.2} s (target under {} s)",
                crate::checker::READER_GAP_TARGET_S
            );
        }
        if let (Some(down), "pg-failover") = (f.db_down_s, f.kind.as_str()) {
            println!(
                "    the standby was promoted {down:.2} s after the primary stopped; from then: first delivery after {}, every event committed before it delivered after {} (target {}), caught up (lag < 1 s) after {}",
                f.first_delivery_s.map_or("NEVER".to_owned(), |r| format!("{r:.2} s")),
                f.recovery_s.map_or("NEVER".to_owned(), |r| format!("{r:.2} s")),
                f.recovery_target_s.map_or("-".to_owned(), |t| format!("{t:.0} s")),
                f.caught_up_s.map_or("NEVER".to_owned(), |c| format!("{c:.2} s")),
            );
        } else if let Some(down) = f.db_down_s {
            println!(
                "    the database accepted connections {down:.2} s after the crash; from then: every event committed before it delivered after {} (target {}), caught up (lag < 1 s) after {}",
                f.recovery_s.map_or("NEVER".to_owned(), |r| format!("{r:.2} s")),
                f.recovery_target_s.map_or("-".to_owned(), |t| format!("{t:.0} s")),
                f.caught_up_s.map_or("NEVER".to_owned(), |c| format!("{c:.2} s")),
            );
        }
    }
    for (kind, k) in checker::by_kind(r) {
        println!(
            "  {kind:<14} x{}: worst recovery {}{}, extra copies {}",
            k.count,
            k.worst.map_or("NEVER".to_owned(), |w| format!("{w:.2} s")),
            if k.interrupted > 0 {
                format!(
                    " ({} interrupted by the next fault, not counted)",
                    k.interrupted
                )
            } else {
                String::new()
            },
            k.extra
        );
    }
    for line in checker::sink_up_lines(r) {
        println!("{line}");
    }
    if let Some(i) = &r.inbox {
        let c = &i.counts;
        println!(
            "  inbox ({} x{}): effects {} ({} duplicate effects), absorbed duplicates {}{}, handled {}, parked {}, retries {}, dead {}, faults retried {}, applied out of order (inbox's count) {}, relay copies at the broker {}",
            s.inbox.as_deref().unwrap_or("?"),
            s.consumers,
            r.messages,
            r.extra_copies,
            c.duplicates,
            if c.last { "" } else { " (at least: a killed process's last 500 ms are not counted)" },
            c.handled,
            c.parked,
            c.retries,
            c.dead,
            c.faults,
            c.out_of_order,
            i.relay_copies.map_or("unknown".to_owned(), |n| n.to_string()),
        );
        for e in &i.consumer_exits {
            println!("  NOTE: {e}");
        }
    }
    if let Some(tenants) = &r.tenants {
        for line in crate::tenants::result::lines(tenants) {
            println!("{line}");
        }
    }
    for e in &r.relay_exits {
        println!("  NOTE: {e}");
    }
    if r.passed {
        println!("  PASSED");
    } else {
        for f in &r.failures {
            println!("  FAILED: {f}");
        }
    }
}
