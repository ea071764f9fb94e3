//! `deploy/`: the Prometheus alert rules and the Grafana dashboard, checked
//! by `cargo xtask tidy`:
//!
//! 1. `deploy/prometheus/outbox-rules.yml` parses (see [`crate::yaml`]) and
//!    `deploy/grafana/outbox.json` is JSON with panels;
//! 2. each rule has `alert`, `expr`, `for`, `labels.severity` (`critical`,
//!    `warning` or `info`) and `annotations.summary`;
//! 3. every metric named in a rule's `expr`, a panel target's `expr` or a
//!    template variable's query is one the code emits: the first argument of
//!    a `counter!` / `gauge!` / `histogram!` (or `describe_*!`) call in
//!    `crates/**/*.rs`, a string literal or a `const NAME: &str` resolved by
//!    its name. The relay's Prometheus exporter (metrics-exporter-prometheus,
//!    installed with no buckets) writes names as recorded (the counters'
//!    `_total` is part of the name) and a histogram as a summary: `NAME`
//!    with a `quantile` label, `NAME_sum`, `NAME_count`. Prometheus's own
//!    `up` is allowed too;
//! 4. when `promtool` is on PATH: `promtool check rules` and `promtool test
//!    rules` over `deploy/prometheus/outbox-rules.test.yml` (Debian's
//!    `prometheus` package has it; without it this step says it skipped).

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// The rules file, from the workspace root.
pub(crate) const RULES: &str = "deploy/prometheus/outbox-rules.yml";
/// promtool's unit tests of the rules.
pub(crate) const RULES_TEST: &str = "deploy/prometheus/outbox-rules.test.yml";
/// The Grafana dashboard.
pub(crate) const DASHBOARD: &str = "deploy/grafana/outbox.json";

/// Series Prometheus itself records per target.
const PROMETHEUS_OWN: &[&str] = &["up"];
/// Severities an alert may carry.
const SEVERITIES: &[&str] = &["critical", "warning", "info"];

/// What a metric was recorded as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `counter!`.
    Counter,
    /// `gauge!`.
    Gauge,
    /// `histogram!`.
    Histogram,
}

/// Runs every check; returns the problems found.
pub(crate) fn check(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let emitted = source_metrics(&root.join("crates"));
    if emitted.is_empty() {
        problems.push("no metric found in crates/**/*.rs (counter!/gauge!/histogram! calls): the deploy check cannot run".to_owned());
        return problems;
    }
    let known = series_names(&emitted);

    match std::fs::read_to_string(root.join(RULES)) {
        Err(e) => problems.push(format!("{RULES}: cannot read it: {e}")),
        Ok(text) => match crate::yaml::parse(&text) {
            Err(e) => problems.push(format!("{RULES}: {e}")),
            Ok(rules) => problems.extend(check_rules(&rules, &known)),
        },
    }
    match std::fs::read_to_string(root.join(DASHBOARD)) {
        Err(e) => problems.push(format!("{DASHBOARD}: cannot read it: {e}")),
        Ok(text) => match serde_json::from_str::<Value>(&text) {
            Err(e) => problems.push(format!("{DASHBOARD}: not JSON: {e}")),
            Ok(dash) => problems.extend(check_dashboard(&dash, &known)),
        },
    }
    if problems.is_empty() {
        problems.extend(promtool(root));
    }
    problems
}

/// Metric names recorded in the Rust sources under `dir`, with their kind.
pub(crate) fn source_metrics(dir: &Path) -> BTreeMap<String, Kind> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n != "target") {
                    stack.push(path);
                }
            } else if path.extension().is_some_and(|x| x == "rs") {
                files.push(std::fs::read_to_string(&path).unwrap_or_default());
            }
        }
    }
    let texts: Vec<&str> = files.iter().map(String::as_str).collect();
    metrics_in(&texts)
}

/// The metric names `sources` record: the first argument of each metrics
/// macro, a string literal or a `const` of type `&str` named in any source.
pub(crate) fn metrics_in(sources: &[&str]) -> BTreeMap<String, Kind> {
    let code: Vec<String> = sources
        .iter()
        .map(|s| {
            s.lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect();
    let mut consts: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for text in &code {
        for line in text.lines() {
            if let Some((name, value)) = str_const(line) {
                consts.entry(name).or_default().push(value);
            }
        }
    }
    let mut out = BTreeMap::new();
    for text in &code {
        for (macro_name, kind) in [
            ("counter!(", Kind::Counter),
            ("gauge!(", Kind::Gauge),
            ("histogram!(", Kind::Histogram),
        ] {
            for (at, _) in text.match_indices(macro_name) {
                // `counter!(` but not `my_counter!(`; `describe_counter!(` names the same metrics.
                let before = &text[..at];
                let prev = before.chars().next_back();
                let ok = prev.is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
                    || before.ends_with("describe_");
                if !ok {
                    continue;
                }
                let arg = text[at + macro_name.len()..].trim_start();
                if let Some(lit) = arg.strip_prefix('"') {
                    if let Some(end) = lit.find('"') {
                        out.insert(lit[..end].to_owned(), kind);
                    }
                    continue;
                }
                let path: String = arg
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                let name = path.rsplit("::").next().unwrap_or("");
                for value in consts.get(name).into_iter().flatten() {
                    out.insert(value.clone(), kind);
                }
            }
        }
    }
    out
}

/// `[pub[(..)]] const NAME: &str = "value";` on one line.
fn str_const(line: &str) -> Option<(String, String)> {
    let at = line.find("const ")?;
    let rest = &line[at + "const ".len()..];
    let (name, rest) = rest.split_once(':')?;
    let rest = rest.trim_start().strip_prefix("&")?;
    let rest = rest.trim_start();
    let rest = rest.strip_prefix("'static").unwrap_or(rest).trim_start();
    let rest = rest.strip_prefix("str")?.trim_start().strip_prefix('=')?;
    let lit = rest.trim_start().strip_prefix('"')?;
    let end = lit.find('"')?;
    Some((name.trim().to_owned(), lit[..end].to_owned()))
}

/// The series names the exporter writes for `emitted`, plus Prometheus's own.
pub(crate) fn series_names(emitted: &BTreeMap<String, Kind>) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = PROMETHEUS_OWN.iter().map(|s| (*s).to_owned()).collect();
    for (name, kind) in emitted {
        out.insert(name.clone());
        if *kind == Kind::Histogram {
            out.insert(format!("{name}_sum"));
            out.insert(format!("{name}_count"));
        }
    }
    out
}

/// Shape and metric names of the rule file.
pub(crate) fn check_rules(rules: &Value, known: &BTreeSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    let Some(groups) = rules["groups"].as_array().filter(|g| !g.is_empty()) else {
        return vec![format!("{RULES}: no `groups` list")];
    };
    let mut alerts = 0;
    for (gi, group) in groups.iter().enumerate() {
        let gname = group["name"].as_str().unwrap_or("");
        if gname.is_empty() {
            problems.push(format!("{RULES}: group {} has no `name`", gi + 1));
        }
        let Some(list) = group["rules"].as_array() else {
            problems.push(format!("{RULES}: group {gname:?} has no `rules` list"));
            continue;
        };
        for (ri, rule) in list.iter().enumerate() {
            let what = rule["alert"].as_str().map_or_else(
                || format!("rule {} of group {gname:?}", ri + 1),
                |a| format!("alert {a}"),
            );
            let text = |v: &Value| v.as_str().is_some_and(|s| !s.trim().is_empty());
            for (field, value) in [
                ("alert", &rule["alert"]),
                ("expr", &rule["expr"]),
                ("for", &rule["for"]),
                ("labels.severity", &rule["labels"]["severity"]),
                ("annotations.summary", &rule["annotations"]["summary"]),
            ] {
                if !text(value) {
                    problems.push(format!("{RULES}: {what} has no `{field}`"));
                }
            }
            if let Some(sev) = rule["labels"]["severity"].as_str() {
                if !SEVERITIES.contains(&sev) {
                    problems.push(format!(
                        "{RULES}: {what}: severity {sev:?} is not one of {}",
                        SEVERITIES.join(", ")
                    ));
                }
            }
            if let Some(f) = rule["for"].as_str() {
                if !is_duration(f) {
                    problems.push(format!(
                        "{RULES}: {what}: `for: {f}` is not a duration like 5m"
                    ));
                }
            }
            if let Some(expr) = rule["expr"].as_str() {
                problems.extend(unknown_metrics(expr, known).into_iter().map(|m| {
                    format!(
                        "{RULES}: {what}: metric `{m}` is not emitted by the code (crates/**/*.rs)"
                    )
                }));
            }
            alerts += 1;
        }
    }
    if alerts == 0 {
        problems.push(format!("{RULES}: no rule"));
    }
    problems
}

/// A Prometheus duration: one or more `<digits><unit>`.
fn is_duration(s: &str) -> bool {
    let mut rest = s;
    if rest.is_empty() {
        return false;
    }
    while !rest.is_empty() {
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        if digits == 0 {
            return false;
        }
        rest = &rest[digits..];
        let Some(unit) = ["ms", "s", "m", "h", "d", "w", "y"]
            .into_iter()
            .find(|u| rest.starts_with(u))
        else {
            return false;
        };
        rest = &rest[unit.len()..];
    }
    true
}

/// Panels (rows' nested panels too), their targets and the template
/// variables' queries.
pub(crate) fn check_dashboard(dash: &Value, known: &BTreeSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    if dash["title"].as_str().is_none_or(str::is_empty) {
        problems.push(format!("{DASHBOARD}: no `title`"));
    }
    let mut panels: Vec<&Value> = Vec::new();
    let mut stack: Vec<&Value> = dash["panels"].as_array().into_iter().flatten().collect();
    while let Some(p) = stack.pop() {
        stack.extend(p["panels"].as_array().into_iter().flatten());
        panels.push(p);
    }
    let mut exprs = 0;
    for p in &panels {
        let title = p["title"].as_str().unwrap_or("?");
        for t in p["targets"].as_array().into_iter().flatten() {
            let Some(expr) = t["expr"].as_str() else {
                problems.push(format!(
                    "{DASHBOARD}: panel {title:?}: a target has no `expr`"
                ));
                continue;
            };
            exprs += 1;
            problems.extend(unknown_metrics(expr, known).into_iter().map(|m| {
                format!("{DASHBOARD}: panel {title:?}: metric `{m}` is not emitted by the code (crates/**/*.rs)")
            }));
        }
    }
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        let query = v["query"]["query"].as_str().or_else(|| v["query"].as_str());
        if v["type"] != "query" {
            continue;
        }
        let name = v["name"].as_str().unwrap_or("?");
        let Some(q) = query else {
            problems.push(format!("{DASHBOARD}: variable {name:?} has no query"));
            continue;
        };
        problems.extend(unknown_metrics(&variable_promql(q), known).into_iter().map(|m| {
            format!("{DASHBOARD}: variable {name:?}: metric `{m}` is not emitted by the code (crates/**/*.rs)")
        }));
    }
    if exprs == 0 {
        problems.push(format!("{DASHBOARD}: no panel with a Prometheus target"));
    }
    problems
}

/// The PromQL inside a Grafana variable query: `label_values(SELECTOR,
/// label)` -> SELECTOR, `label_values(label)` -> nothing,
/// `query_result(EXPR)` -> EXPR, anything else as is.
fn variable_promql(q: &str) -> String {
    let q = q.trim();
    let inner = |prefix: &str| {
        q.strip_prefix(prefix)
            .and_then(|r| r.trim_start().strip_prefix('('))
            .and_then(|r| r.strip_suffix(')'))
    };
    if let Some(args) = inner("label_values") {
        return args
            .rsplit_once(',')
            .map_or(String::new(), |(sel, _)| sel.to_owned());
    }
    if let Some(expr) = inner("query_result") {
        return expr.to_owned();
    }
    if q.starts_with("label_names") || q.starts_with("metrics") {
        return String::new();
    }
    q.to_owned()
}

/// Metric names in `expr` missing from `known`.
pub(crate) fn unknown_metrics(expr: &str, known: &BTreeSet<String>) -> Vec<String> {
    promql_metrics(expr)
        .into_iter()
        .filter(|m| !known.contains(m))
        .collect()
}

/// PromQL keywords, aggregations and functions that are not metric names.
const PROMQL_WORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "atan2",
];

/// Metric names a PromQL expression reads: identifiers outside strings,
/// label matchers `{..}`, ranges `[..]` and grouping lists, that are not
/// keywords, aggregations or function calls. Grafana's `$variables` are
/// skipped.
pub(crate) fn promql_metrics(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = BTreeSet::new();
    let mut i = 0;
    let skip_to = |from: usize, close: char| -> usize {
        let mut j = from + 1;
        while j < chars.len() && chars[j] != close {
            if matches!(chars[j], '"' | '\'' | '`') {
                let q = chars[j];
                j += 1;
                while j < chars.len() && chars[j] != q {
                    j += if chars[j] == '\\' { 2 } else { 1 };
                }
            }
            j += 1;
        }
        j + 1
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                let mut j = i + 1;
                while j < chars.len() && chars[j] != c {
                    j += if chars[j] == '\\' { 2 } else { 1 };
                }
                i = j + 1;
            }
            '{' => i = skip_to(i, '}'),
            '[' => i = skip_to(i, ']'),
            '#' => break,
            '$' => {
                i += 1;
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
            }
            c if c.is_ascii_digit() || c == '.' => {
                while i < chars.len()
                    && (chars[i].is_alphanumeric() || chars[i] == '.' || chars[i] == '_')
                {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                let call = chars.get(j) == Some(&'(');
                let lower = word.to_ascii_lowercase();
                if matches!(
                    lower.as_str(),
                    "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
                ) {
                    if call {
                        i = skip_to(j, ')');
                    }
                } else if lower == "offset" {
                    // The duration after it.
                    while j < chars.len() && !chars[j].is_whitespace() && chars[j] != ')' {
                        j += 1;
                    }
                    i = j;
                } else if !call && !PROMQL_WORDS.contains(&lower.as_str()) {
                    out.insert(word);
                }
            }
            _ => i += 1,
        }
    }
    out
}

/// `promtool check rules` and `promtool test rules`, when promtool exists.
fn promtool(root: &Path) -> Vec<String> {
    let present = Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !present {
        println!("    promtool not on PATH: `promtool check rules` skipped (Debian: the prometheus package)");
        return Vec::new();
    }
    let mut problems = Vec::new();
    for (args, file) in [(["check", "rules"], RULES), (["test", "rules"], RULES_TEST)] {
        if !root.join(file).exists() {
            continue;
        }
        println!("    promtool {} {file}", args.join(" "));
        match Command::new("promtool")
            .args(args)
            .arg(file)
            .current_dir(root)
            .output()
        {
            Ok(o) if o.status.success() => {}
            Ok(o) => problems.push(format!(
                "`promtool {} {file}` failed:\n{}{}",
                args.join(" "),
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )),
            Err(e) => problems.push(format!("could not run promtool: {e}")),
        }
    }
    problems
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    const SOURCE: &str = r#"
//! counter!("outbox_in_a_comment_total") is not a metric.
pub const DELIVERED: &str = "outbox_events_delivered_total";
pub(crate) const LAG: &'static str = "outbox_lag_seconds";
const PROCESS: &str = "outbox_event_process_seconds";
const TABLE: &str = "outbox_events";
fn f() {
    metrics::counter!(m::DELIVERED).increment(1);
    metrics::gauge!(crate::metrics::LAG).set(1.0);
    metrics::histogram!(
        PROCESS
    )
    .record(0.1);
    metrics::counter!("outbox_store_errors_total", "op" => "claim").increment(1);
    my_counter!(TABLE);
}
"#;

    fn known() -> BTreeSet<String> {
        series_names(&metrics_in(&[SOURCE]))
    }

    #[test]
    fn finds_the_recorded_metric_names_and_their_series() {
        let found = metrics_in(&[SOURCE]);
        assert_eq!(
            found.into_iter().collect::<Vec<_>>(),
            vec![
                ("outbox_event_process_seconds".to_owned(), Kind::Histogram),
                ("outbox_events_delivered_total".to_owned(), Kind::Counter),
                ("outbox_lag_seconds".to_owned(), Kind::Gauge),
                ("outbox_store_errors_total".to_owned(), Kind::Counter),
            ]
        );
        let k = known();
        assert!(k.contains("outbox_event_process_seconds_count"));
        assert!(k.contains("up"));
        assert!(!k.contains("outbox_events"), "a const no macro records");
        assert!(!k.contains("outbox_lag_seconds_sum"), "a gauge has no _sum");
    }

    #[test]
    fn reads_metric_names_out_of_promql() {
        let names = |e: &str| promql_metrics(e).into_iter().collect::<Vec<_>>();
        assert_eq!(
            names(
                r#"sum by (job, code) (increase(outbox_events_dead_total{code!="x", instance=~"$instance"}[$__rate_interval])) > 0"#
            ),
            vec!["outbox_events_dead_total"]
        );
        assert_eq!(
            names("rate(a_sum[5m] offset 1h) / on (instance) group_left (x) rate(b_count[5m]) > bool 0.8e1"),
            vec!["a_sum", "b_count"]
        );
        assert_eq!(
            names(r#"absent(up{job="outbox-relay"}) or vector(0)"#),
            vec!["up"]
        );
        assert_eq!(
            names(&variable_promql(
                r#"label_values(outbox_sink_state{job=~"$job"}, instance)"#
            )),
            vec!["outbox_sink_state"]
        );
        assert!(names(&variable_promql("label_values(job)")).is_empty());
    }

    #[test]
    fn a_rule_or_panel_naming_an_unknown_metric_fails() {
        let rules = crate::yaml::parse(
            r#"
groups:
  - name: g
    rules:
      - alert: Good
        expr: outbox_lag_seconds > 300
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: lag
      - alert: Typo
        expr: rate(outbox_events_delivered[5m]) == 0
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: stalled
      - alert: Incomplete
        expr: outbox_lag_seconds > 1
        for: soon
        labels:
          severity: urgent
"#,
        )
        .unwrap();
        let problems = check_rules(&rules, &known());
        assert_eq!(problems.len(), 4, "{problems:#?}");
        assert!(problems[0].contains("alert Typo: metric `outbox_events_delivered` is not emitted"));
        assert!(problems[1].contains("alert Incomplete has no `annotations.summary`"));
        assert!(problems[2].contains("severity \"urgent\""));
        assert!(problems[3].contains("`for: soon`"));

        let dash = json!({
            "title": "d",
            "panels": [{"type": "row", "title": "r", "panels": [
                {"title": "p", "targets": [
                    {"expr": "rate(outbox_event_process_seconds_sum[5m]) / rate(outbox_event_process_seconds_count[5m])"},
                    {"expr": "outbox_event_process_seconds_bucket"}
                ]}
            ]}],
            "templating": {"list": [
                {"name": "i", "type": "query", "query": {"query": "label_values(outbox_sink_state, instance)"}}
            ]}
        });
        let problems = check_dashboard(&dash, &known());
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(problems[0].contains("panel \"p\": metric `outbox_event_process_seconds_bucket`"));
        assert!(problems[1].contains("variable \"i\": metric `outbox_sink_state`"));
    }

    #[test]
    fn the_deploy_files_name_only_emitted_metrics() {
        let root = crate::root();
        let emitted = source_metrics(&root.join("crates"));
        assert!(
            emitted.contains_key("outbox_events_delivered_total"),
            "{emitted:?}"
        );
        assert_eq!(emitted.get("outbox_sink_state"), Some(&Kind::Gauge));
        let known = series_names(&emitted);
        let rules =
            crate::yaml::parse(&std::fs::read_to_string(root.join(RULES)).unwrap()).unwrap();
        assert_eq!(check_rules(&rules, &known), Vec::<String>::new());
        let dash: Value =
            serde_json::from_str(&std::fs::read_to_string(root.join(DASHBOARD)).unwrap()).unwrap();
        assert_eq!(check_dashboard(&dash, &known), Vec::<String>::new());
        // The whole check, promtool included when it is on PATH.
        assert_eq!(check(&root), Vec::<String>::new());
    }

    #[test]
    fn durations() {
        assert!(
            is_duration("5m") && is_duration("0m") && is_duration("1h30m") && is_duration("250ms")
        );
        assert!(!is_duration("") && !is_duration("5") && !is_duration("m") && !is_duration("5 m"));
    }
}
