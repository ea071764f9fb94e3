//! The suite's report: `summary.md`, and the results section of
//! RELIABILITY.md, which `cargo xtask chaos` rewrites between its markers
//! and `cargo xtask tidy` checks against the current plan.

use super::suite::{fingerprint, fnv1a64, Mode, Selection};
use anyhow::{Context as _, Result};
use serde_json::Value;
use std::fmt::Write as _;
use std::path::Path;

fn f64_of(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// The order column: first arrivals out of their key's order, plus stale
/// copies (an older event of a key arriving last) when there are any.
fn order_cell(r: &Value) -> String {
    let order = r["order_violations"].as_u64().unwrap_or(0);
    match r["stale_copies"].as_u64().unwrap_or(0) {
        0 => order.to_string(),
        stale => format!("{order} + {stale} stale"),
    }
}

/// A report's producer shape (`partitioned` in reports from before it was
/// recorded).
/// Whether the run's producers and relays reached PostgreSQL through
/// PgBouncer (`--pgbouncer`).
fn through_pgbouncer(r: &Value) -> bool {
    r["suite_run"]["args"]
        .as_array()
        .is_some_and(|a| a.iter().any(|v| v == "--pgbouncer"))
}

pub(super) fn producer_of(r: &Value) -> &str {
    r["scenario"]["producer"].as_str().unwrap_or("partitioned")
}

/// What the recovery column means, after the run's mode.
const RECOVERY_LEGEND: &str = "Recovery: seconds after the fault was over (after a SIGSTOP: after the stop) until every event committed before that moment had arrived (faults that overlap are one incident, measured from the end of the last); worst per fault kind, target in brackets; `(n interrupted)`: n recoveries the next fault began before they were over, not in the worst.";

/// `summary.md`: the run's mode and date, then its tables.
pub(super) fn markdown(summary: &Value) -> String {
    format!(
        "Mode `{}`, {} (UTC). {RECOVERY_LEGEND}\n\n{}",
        summary["mode"].as_str().unwrap_or("?"),
        summary["date"].as_str().unwrap_or("?"),
        tables(summary, "####")
    )
}

/// One table per store x broker under `heading` (`###`, `####`), a row per
/// run, then the totals.
/// The lost cell: after a failover to an asynchronous standby, also the
/// events the producer saw committed that the new primary does not hold.
fn lost_cell(r: &Value) -> String {
    match r["scenario"]["replication"].as_str() {
        Some(_) => format!(
            "{} (+{} lost with the primary)",
            r["lost"],
            r["lost_with_primary"].as_u64().unwrap_or(0)
        ),
        None => r["lost"].to_string(),
    }
}

fn tables(summary: &Value, heading: &str) -> String {
    let mut md = String::new();
    let all = summary["runs"].as_array().cloned().unwrap_or_default();
    // The independent recorder's runs; the inbox's have their own tables.
    // `tenants`: one relay over several databases, a row per database.
    let (tenants, all): (Vec<Value>, Vec<Value>) =
        all.into_iter().partition(|r| r["tenants"].is_array());
    let (inbox, runs): (Vec<Value>, Vec<Value>) = all
        .into_iter()
        .partition(|r| !r["scenario"]["inbox"].is_null());
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
        let _ = writeln!(md, "{heading} {store} + {broker}\n");
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
            let kinds = recovery_cell(&fs);
            let _ = writeln!(
                md,
                "| `{}`{} | {} | {} | {} | {} | {} (+{} / {}) | {} | {} | {} | {:.0} / {:.0} ms | {} | {} | {} |",
                r["scenario"]["faults"].as_str().unwrap_or("?"),
                match (
                    producer_of(r) == "contended",
                    through_pgbouncer(r),
                    r["scenario"]["replication"].as_str()
                ) {
                    (true, _, _) => ", contended producer",
                    (false, true, _) => ", producers and relays through PgBouncer",
                    (false, false, Some("sync")) => ", synchronous standby promoted",
                    (false, false, Some(_)) => ", asynchronous standby promoted",
                    (false, false, None) => "",
                },
                r["scenario"]["relays"],
                r["committed"],
                fs.len(),
                lost_cell(r),
                r["duplicated"],
                r["extra_copies"],
                r["duplicate_allowance"],
                r["unexpected"],
                order_cell(r),
                kinds,
                f64_of(&r["latency_ms"]["p50"]),
                f64_of(&r["latency_ms"]["p99"]),
                sink_up_cell(&r["sink_up"]),
                r["relay_exits"].as_array().map_or(0, Vec::len),
                if r["passed"] == true { "pass" } else { "**FAIL**" }
            );
        }
        md.push('\n');
    }
    let (tenant_events, tenant_faults) = tenants_tables(&mut md, &tenants, heading);
    events += tenant_events;
    faults += tenant_faults;
    let (inbox_events, inbox_faults) = inbox_tables(&mut md, &inbox, heading);
    events += inbox_events;
    faults += inbox_faults;
    let _ = writeln!(md, "Total: {events} committed events, {faults} faults.");
    md
}

/// The end-to-end runs through the inbox (`inbox` set in the scenario):
/// one table per broker x consumer database, whose arrivals are the
/// consumers' effects. Returns the events and faults they add up to.
fn inbox_tables(md: &mut String, runs: &[Value], heading: &str) -> (u64, u64) {
    let key = |r: &Value| {
        (
            r["scenario"]["broker"].as_str().unwrap_or("?").to_owned(),
            r["scenario"]["inbox"].as_str().unwrap_or("?").to_owned(),
        )
    };
    let mut combos: Vec<(String, String)> = runs.iter().map(key).collect();
    combos.sort_by_key(|(br, db)| {
        let b = ["nats", "amqp", "kafka"]
            .iter()
            .position(|x| x == br)
            .unwrap_or(9);
        (b, db != "postgres")
    });
    combos.dedup();
    let (mut events, mut faults) = (0u64, 0u64);
    for (broker, db) in combos {
        let _ = writeln!(
            md,
            "{heading} end to end: postgres + {broker} -> inbox on {db}\n"
        );
        md.push_str("| faults | relays | consumers | events | faults injected | effects exactly once (lost / duplicate effects) | unexpected | order violations | duplicates absorbed by the inbox | relay copies at the broker | recovery per fault kind, worst | p50 / p99 commit to effect | exits (relay / consumer) | result |\n");
        md.push_str(
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        );
        for r in runs
            .iter()
            .filter(|r| key(r) == (broker.clone(), db.clone()))
        {
            let fs = r["faults"].as_array().cloned().unwrap_or_default();
            events += r["committed"].as_u64().unwrap_or(0);
            faults += fs.len() as u64;
            let once = r["lost"] == 0 && r["extra_copies"] == 0;
            let counts = &r["inbox"]["counts"];
            // A process killed with `kill -9` took its last 500 ms of
            // counts with it: the figure is then a lower bound.
            let absorbed = format!(
                "{}{}",
                if counts["last"] == true { "" } else { ">= " },
                counts["duplicates"].as_u64().unwrap_or(0)
            );
            let relay_copies = r["inbox"]["relay_copies"]
                .as_u64()
                .map_or("-".to_owned(), |n| n.to_string());
            let _ = writeln!(
                md,
                "| `{}` | {} | {} | {} | {} | {} ({} / {}) | {} | {} | {} | {} | {} | {:.0} / {:.0} ms | {} / {} | {} |",
                r["scenario"]["faults"].as_str().unwrap_or("?"),
                r["scenario"]["relays"],
                r["scenario"]["consumers"],
                r["committed"],
                fs.len(),
                if once { "yes" } else { "**no**" },
                r["lost"],
                r["extra_copies"],
                r["unexpected"],
                order_cell(r),
                absorbed,
                relay_copies,
                recovery_cell(&fs),
                f64_of(&r["latency_ms"]["p50"]),
                f64_of(&r["latency_ms"]["p99"]),
                r["relay_exits"].as_array().map_or(0, Vec::len),
                r["inbox"]["consumer_exits"].as_array().map_or(0, Vec::len),
                if r["passed"] == true { "pass" } else { "**FAIL**" }
            );
        }
        md.push('\n');
    }
    (events, faults)
}

/// The `tenants` runs (a `tenants` array in the report): one relay process
/// over several databases of one server, a table per run with a row per
/// database. Returns the events and faults they add up to.
fn tenants_tables(md: &mut String, runs: &[Value], heading: &str) -> (u64, u64) {
    let (mut events, mut faults) = (0u64, 0u64);
    for r in runs {
        let dbs = r["tenants"].as_array().cloned().unwrap_or_default();
        let fs = r["faults"].as_array().map_or(0, Vec::len) as u64;
        events += r["committed"].as_u64().unwrap_or(0);
        faults += fs;
        let _ = writeln!(
            md,
            "{heading} one relay over {} databases: {} + {}\n",
            dbs.len(),
            r["scenario"]["store"].as_str().unwrap_or("?"),
            r["scenario"]["broker"].as_str().unwrap_or("?"),
        );
        let _ = writeln!(
            md,
            "`{}`: {} relay process, {} committed events in all, {} fault(s), relay exits {}, result {}.\n",
            r["scenario"]["faults"].as_str().unwrap_or("?"),
            r["scenario"]["relays"],
            r["committed"],
            fs,
            r["relay_exits"].as_array().map_or(0, Vec::len),
            if r["passed"] == true { "pass" } else { "**FAIL**" }
        );
        md.push_str("| database | role | events (backlog) | lost | duplicated (+copies / allowed) | unexpected | order violations | fresh events' p50 / p99 latency | recovery | result |\n");
        md.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
        for t in &dbs {
            let target = t["p99_target_ms"]
                .as_f64()
                .map_or(String::new(), |p| format!(" [<= {p:.0}]"));
            let _ = writeln!(
                md,
                "| {} | {} | {} ({}) | {} | {} (+{} / {}) | {} | {} | {:.0} / {:.0} ms{target} | {} | {} |",
                t["name"].as_str().unwrap_or("?"),
                t["role"].as_str().unwrap_or("?"),
                t["committed"],
                t["backlog"],
                t["lost"],
                t["duplicated"],
                t["extra_copies"],
                t["duplicate_allowance"],
                t["unexpected"],
                order_cell(t),
                f64_of(&t["fresh_latency_ms"]["p50"]),
                f64_of(&t["fresh_latency_ms"]["p99"]),
                tenant_recovery_cell(t),
                if t["passed"] == true { "pass" } else { "**FAIL**" }
            );
        }
        md.push('\n');
    }
    (events, faults)
}

/// What a database of a `tenants` run recovered from: the killed one's
/// first delivery, every earlier commit delivered and catch-up after the
/// kill; the backlog's drain; `-` for the others.
fn tenant_recovery_cell(t: &Value) -> String {
    let secs = |field: &str| {
        t[field]
            .as_f64()
            .map_or("never".to_owned(), |s| format!("{s:.1} s"))
    };
    if t["kill"].is_string() {
        format!(
            "after the kill: first delivery {}, all earlier {}, caught up {}",
            secs("first_delivery_s"),
            secs("recovery_s"),
            secs("caught_up_s")
        )
    } else if t["backlog"].as_u64().unwrap_or(0) > 0 {
        format!(
            "backlog drained {} after the start, {} left in the log in key order",
            secs("backlog_drained_s"),
            t["left"].as_u64().unwrap_or(0)
        )
    } else {
        "-".to_owned()
    }
}

/// The recovery cell of a run: per fault kind, the worst recovery of the
/// faults the next one did not interrupt, with its target.
fn recovery_cell(fs: &[Value]) -> String {
    let mut kinds: Vec<String> = Vec::new();
    let mut seen = Vec::new();
    for f in fs {
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
        if k == "pg-failover" {
            // From the promotion: the first delivery, the last event
            // committed before delivered (above), caught up (lag < 1 s).
            let worst = |field: &str| {
                if of_kind.iter().any(|g| g[field].is_null()) {
                    "never".to_owned()
                } else {
                    let w = of_kind
                        .iter()
                        .map(|g| f64_of(&g[field]))
                        .fold(0.0, f64::max);
                    format!("{w:.1} s")
                }
            };
            let down = of_kind
                .iter()
                .map(|g| f64_of(&g["db_down_s"]))
                .fold(0.0, f64::max);
            let _ = write!(
                shown,
                " after the promotion (primary stopped {down:.1} s before it), first delivery {}, caught up {}",
                worst("first_delivery_s"),
                worst("caught_up_s")
            );
        }
        if k == "partition-reader" {
            // The longest no-delivery gap while the reader held the log
            // (target under 1 s: rotation never stalls the relays).
            let gap = of_kind
                .iter()
                .map(|g| f64_of(&g["max_gap_s"]))
                .fold(0.0, f64::max);
            let _ = write!(shown, ", longest gap {gap:.2} s [< 1]");
        }
        kinds.push(format!("{k} {shown}{target}"));
    }
    if kinds.is_empty() {
        "-".to_owned()
    } else {
        kinds.join(", ")
    }
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
pub(super) fn today() -> String {
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

/// The line that opens RELIABILITY.md's results section (its attributes
/// follow on the same line).
pub(crate) const BEGIN: &str = "<!-- chaos-results:begin";
/// The line that closes it.
pub(crate) const END: &str = "<!-- chaos-results:end -->";

/// The file the results section lives in, relative to the workspace root.
pub(crate) const DOC: &str = "RELIABILITY.md";

/// The fingerprint of the runs in a summary: each report's `suite_run`
/// (label and arguments, recorded by the suite when it ran it).
pub(super) fn summary_fingerprint(summary: &Value) -> String {
    let runs = summary["runs"].as_array().cloned().unwrap_or_default();
    fingerprint(runs.iter().map(|r| {
        let run = &r["suite_run"];
        let label = run["label"].as_str().unwrap_or("?").to_owned();
        let args = run["args"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|v| v.as_str().unwrap_or("?").to_owned())
                    .collect()
            })
            .unwrap_or_default();
        (label, args)
    }))
}

/// The results section for a summary of every run of `selection`: the
/// markers with the selection, the run list's fingerprint and a hash of the
/// body, then the body (no date: the section is what the current plan gave
/// the last time it was run).
pub(super) fn section(summary: &Value, selection: Selection) -> String {
    let runs = summary["runs"].as_array().map_or(0, Vec::len);
    let build = if summary["release"] == true {
        "release"
    } else {
        "debug"
    };
    let mut body = format!(
        "Written by `cargo xtask chaos --{mode}` from a run of every scenario of its plan ({runs} runs, {build} builds{kafka}{crash}{restart}). {RECOVERY_LEGEND}\n\n",
        mode = selection.mode.name(),
        kafka = if selection.kafka {
            ""
        } else {
            "; Kafka was not reachable, so its runs are not in the plan"
        },
        crash = if selection.pg_crash {
            ""
        } else {
            "; without the runs that crash PostgreSQL (`--no-pg-crash`)"
        },
        restart = if selection.allow_pg_restart {
            "; with PostgreSQL restarts (`--allow-pg-restart`)"
        } else {
            ""
        },
    );
    body.push_str(&tables(summary, "###"));
    format!(
        "{BEGIN} mode={} kafka={} pg-restart={} pg-crash={} runs={runs} fingerprint={} body={:016x} -->\n{body}{END}\n",
        selection.mode.name(),
        yes_no(selection.kafka),
        yes_no(selection.allow_pg_restart),
        yes_no(selection.pg_crash),
        summary_fingerprint(summary),
        fnv1a64(body.as_bytes()),
    )
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// Replaces the results section of `text` (from the begin marker's line to
/// the end marker's line, both included) with `section`.
pub(super) fn replace_section(text: &str, section: &str) -> Result<String> {
    let (start, end) = section_bounds(text)
        .with_context(|| format!("{DOC} has no `{BEGIN} ... -->` ... `{END}` lines"))?;
    Ok(format!("{}{section}{}", &text[..start], &text[end..]))
}

/// Writes `section` into the file at `path` (see [`replace_section`]).
pub(super) fn write_section(path: &Path, section: &str) -> Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let new = replace_section(&text, section)?;
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

/// Byte range of the section: the start of the begin line to just after
/// the end line (its newline included).
fn section_bounds(text: &str) -> Option<(usize, usize)> {
    let start = text.find(BEGIN)?;
    if start > 0 && !text[..start].ends_with('\n') {
        return None;
    }
    let end_at = start + text[start..].find(END)?;
    let mut end = end_at + END.len();
    if text[end..].starts_with('\n') {
        end += 1;
    }
    Some((start, end))
}

/// Checks the results section of RELIABILITY.md's text: it is there, its
/// body is what the suite wrote (the hash matches), and its run list is the
/// current plan of the mode and flags it names (the fingerprint matches the
/// one [`Selection::fingerprint`] computes now). Returns the problems.
pub(crate) fn check_section(text: &str) -> Vec<String> {
    let Some((start, end)) = section_bounds(text) else {
        return vec![format!(
            "{DOC} has no chaos results section (`{BEGIN} ...` to `{END}`): run `cargo xtask chaos --quick` (or --medium / --full) to write it"
        )];
    };
    let section = &text[start..end];
    let (head, rest) = section.split_once('\n').unwrap_or((section, ""));
    let body = rest.strip_suffix(&format!("{END}\n")).unwrap_or(rest);
    let body = body.strip_suffix(END).unwrap_or(body);
    let attrs: Vec<(&str, &str)> = head
        .trim_start_matches(BEGIN)
        .trim_end_matches("-->")
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .collect();
    let get = |k: &str| attrs.iter().find(|(key, _)| *key == k).map(|(_, v)| *v);
    let mut problems = Vec::new();
    let selection = (|| {
        Some(Selection {
            mode: Mode::from_name(get("mode")?)?,
            kafka: get("kafka")? == "yes",
            allow_pg_restart: get("pg-restart")? == "yes",
            pg_crash: get("pg-crash")? == "yes",
        })
    })();
    let Some(selection) = selection else {
        return vec![format!(
            "{DOC}: the chaos results section's first line lacks mode=, kafka=, pg-restart= or pg-crash=: rewrite it with `cargo xtask chaos`"
        )];
    };
    if get("body") != Some(format!("{:016x}", fnv1a64(body.as_bytes())).as_str()) {
        problems.push(format!(
            "{DOC}: the chaos results section was edited by hand (its body hash does not match): regenerate it with `cargo xtask chaos --{}`",
            selection.mode.name()
        ));
    }
    if get("fingerprint") != Some(selection.fingerprint().as_str()) {
        problems.push(format!(
            "{DOC}: the chaos results come from another scenario set than the current `--{}` plan (fingerprint {} in the file, {} now): run `cargo xtask chaos --{}` to rewrite them",
            selection.mode.name(),
            get("fingerprint").unwrap_or("missing"),
            selection.fingerprint(),
            selection.mode.name()
        ));
    }
    problems
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

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

    fn summary_of(selection: Selection) -> Value {
        let runs: Vec<Value> = selection
            .plan()
            .iter()
            .map(|s| {
                serde_json::json!({
                    "scenario": {"store": s.store, "broker": s.broker, "faults": s.faults,
                                 "relays": s.relays, "producer": s.producer,
                                 "inbox": s.inbox, "consumers": u32::from(s.inbox.is_some())},
                    "inbox": s.inbox.map(|_| serde_json::json!({
                        "counts": {"duplicates": 7, "last": false}, "relay_copies": 3,
                        "consumer_exits": []})),
                    "suite_run": {"label": s.label(), "args": s.args()},
                    "committed": 100, "faults": [], "lost": 0, "duplicated": 0,
                    "extra_copies": 0, "duplicate_allowance": 20, "unexpected": 0,
                    "order_violations": 0, "latency_ms": {"p50": 5.0, "p99": 9.0},
                    "sink_up": null, "relay_exits": [], "passed": true,
                    "tenants": (s.faults == "tenants").then(|| serde_json::json!([
                        {"name": "t0", "role": "backlog", "committed": 500_100, "backlog": 500_000,
                         "lost": 0, "duplicated": 0, "extra_copies": 0, "duplicate_allowance": 0,
                         "unexpected": 0, "order_violations": 0,
                         "fresh_latency_ms": {"p50": 900.0, "p99": 2000.0},
                         "backlog_drained_s": 21.5, "left": 0, "passed": true},
                        {"name": "t1", "role": "killed", "committed": 2000, "backlog": 0,
                         "lost": 0, "duplicated": 3, "extra_copies": 3, "duplicate_allowance": 200,
                         "unexpected": 0, "order_violations": 0,
                         "fresh_latency_ms": {"p50": 20.0, "p99": 3100.0},
                         "kill": "t1: 9 connection(s)", "first_delivery_s": 0.41,
                         "recovery_s": 1.2, "caught_up_s": null, "passed": true},
                        {"name": "t2", "role": "fresh", "committed": 2000, "backlog": 0,
                         "lost": 0, "duplicated": 0, "extra_copies": 0, "duplicate_allowance": 0,
                         "unexpected": 0, "order_violations": 0, "stale_copies": 0,
                         "fresh_latency_ms": {"p50": 12.0, "p99": 87.0}, "p99_target_ms": 500.0,
                         "passed": true},
                    ])),
                })
            })
            .collect();
        serde_json::json!({"mode": selection.mode.name(), "date": "x", "release": false, "runs": runs})
    }

    const QUICK: Selection = Selection {
        mode: Mode::Quick,
        kafka: false,
        allow_pg_restart: false,
        pg_crash: true,
    };

    #[test]
    fn a_written_section_passes_the_check_and_replaces_the_old_one() {
        let doc = format!("# R\n\nintro\n\n{BEGIN} old -->\nold\n{END}\n\n## After\n");
        let section = section(&summary_of(QUICK), QUICK);
        let new = replace_section(&doc, &section).unwrap();
        assert!(new.starts_with("# R\n\nintro\n\n<!-- chaos-results:begin mode=quick"));
        assert!(new.ends_with(&format!("{END}\n\n## After\n")), "{new}");
        assert!(!new.contains("\nold\n"));
        assert!(new.contains("### postgres + nats"), "{new}");
        assert!(
            new.contains("### end to end: postgres + nats -> inbox on postgres"),
            "{new}"
        );
        assert!(new.contains("| yes (0 / 0) | 0 | 0 | >= 7 | 3 |"), "{new}");
        assert_eq!(check_section(&new), Vec::<String>::new());
        // Idempotent: writing it again changes nothing.
        assert_eq!(replace_section(&new, &section).unwrap(), new);
    }

    #[test]
    fn the_check_fails_on_a_hand_edit_another_plan_or_no_section() {
        let doc = section(&summary_of(QUICK), QUICK);
        let edited = doc.replace("| 100 |", "| 101 |");
        assert_ne!(edited, doc);
        let problems = check_section(&edited);
        assert!(
            problems.len() == 1 && problems[0].contains("by hand"),
            "{problems:?}"
        );
        // A summary of the quick plan without Kafka labelled as one with it.
        let with_kafka = Selection {
            kafka: true,
            ..QUICK
        };
        let mislabelled = section(&summary_of(QUICK), with_kafka);
        let problems = check_section(&mislabelled);
        assert!(
            problems.len() == 1 && problems[0].contains("another scenario set"),
            "{problems:?}"
        );
        assert!(check_section("# R\nno section\n")[0].contains("no chaos results section"));
    }
}
