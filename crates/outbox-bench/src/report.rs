//! Result rows, the markdown table and `results.json`.

use crate::probe::Machine;
use serde::Serialize;
use serde_json::{Map, Value};
use std::path::Path;

/// A reference number a result is divided by (a ceiling or a baseline).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Ceiling {
    /// What it is, e.g. `store claim+settle (postgres)`.
    pub(crate) name: String,
    /// Its value, in the row's unit.
    pub(crate) value: f64,
}

/// One measured number.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    /// Scenario name (as given to `--scenario`).
    pub(crate) scenario: String,
    /// What was measured, e.g. `postgres -> nats`.
    pub(crate) case: String,
    /// Parameters (backlog, batch size, rates, durations).
    pub(crate) parameters: Map<String, Value>,
    /// The number.
    pub(crate) result: f64,
    /// Its unit.
    pub(crate) unit: String,
    /// What it is compared with, if anything.
    pub(crate) ceiling: Option<Ceiling>,
    /// `result / ceiling` (or the scenario's own ratio, e.g. 1M vs 10k drain).
    pub(crate) ratio: Option<f64>,
    /// The product target this row is checked against.
    pub(crate) target: Option<String>,
    /// Whether the target is met.
    pub(crate) met: Option<bool>,
    /// Secondary numbers (CPU seconds, peak RSS, percentiles, ...).
    pub(crate) details: Map<String, Value>,
    /// Anything a reader must know (e.g. the run hit its time cap).
    pub(crate) note: Option<String>,
}

impl Row {
    /// A row with just a number.
    pub(crate) fn new(scenario: &str, case: impl Into<String>, result: f64, unit: &str) -> Self {
        Self {
            scenario: scenario.to_owned(),
            case: case.into(),
            parameters: Map::new(),
            result,
            unit: unit.to_owned(),
            ceiling: None,
            ratio: None,
            target: None,
            met: None,
            details: Map::new(),
            note: None,
        }
    }

    /// Adds a parameter.
    pub(crate) fn param(mut self, k: &str, v: impl Into<Value>) -> Self {
        self.parameters.insert(k.to_owned(), v.into());
        self
    }

    /// Adds a detail.
    pub(crate) fn detail(mut self, k: &str, v: impl Into<Value>) -> Self {
        self.details.insert(k.to_owned(), v.into());
        self
    }

    /// Sets the ceiling and the ratio `result / ceiling`.
    pub(crate) fn against(mut self, name: impl Into<String>, value: f64) -> Self {
        self.ratio = (value > 0.0).then(|| self.result / value);
        self.ceiling = Some(Ceiling {
            name: name.into(),
            value,
        });
        self
    }

    /// Sets the target and whether it is met.
    pub(crate) fn target(mut self, t: impl Into<String>, met: bool) -> Self {
        self.target = Some(t.into());
        self.met = Some(met);
        self
    }

    /// Sets the target, met when the ratio is at least `min`.
    pub(crate) fn target_ratio(self, t: impl Into<String>, min: f64) -> Self {
        let met = self.ratio.unwrap_or(0.0) >= min;
        self.target(t, met)
    }

    /// Sets a note.
    pub(crate) fn note(mut self, n: impl Into<String>) -> Self {
        self.note = Some(n.into());
        self
    }
}

/// A whole run.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) machine: Machine,
    pub(crate) quick: bool,
    /// A `--smoke` run (tiny sizes, numbers meaningless).
    pub(crate) smoke: bool,
    /// The `--note` given for the header.
    pub(crate) note: Option<String>,
    pub(crate) scenarios: Vec<String>,
    /// [`crate::registry::fingerprint`] of the build that ran.
    pub(crate) fingerprint: String,
    pub(crate) duration_s: f64,
    pub(crate) results: Vec<Row>,
    pub(crate) failures: Vec<String>,
}

/// A number with about three significant digits, thousands separated.
pub(crate) fn num(v: f64) -> String {
    if !v.is_finite() {
        return "-".to_owned();
    }
    let a = v.abs();
    if a >= 1000.0 {
        let s = format!("{:.0}", v.round());
        let (sign, digits) = s.strip_prefix('-').map_or(("", s.as_str()), |d| ("-", d));
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(c);
        }
        format!("{sign}{out}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn value_text(v: &Value) -> String {
    match v {
        Value::Number(n) if n.is_u64() || n.is_i64() => {
            let v = n.as_f64().unwrap_or(0.0);
            if v.abs() >= 1000.0 {
                num(v)
            } else {
                n.to_string()
            }
        }
        Value::Number(n) => n.as_f64().map_or_else(|| n.to_string(), num),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

/// The markdown table of a run.
pub(crate) fn markdown(report: &Report) -> String {
    let m = &report.machine;
    let mut out = format!(
        "Machine: {} CPUs ({}), {} GiB RAM, Linux {}, {}; {}; commit {}; {} run, {:.0} s.\n\n",
        m.cpus,
        m.cpu_model,
        m.memory_gib,
        m.kernel,
        m.date,
        m.postgres,
        if m.git_commit.is_empty() {
            "?"
        } else {
            &m.git_commit
        },
        if report.quick { "quick" } else { "full" },
        report.duration_s,
    );
    if let Some(note) = &report.note {
        out.push_str(note.trim());
        out.push_str("\n\n");
    }
    out.push_str("| Scenario | Case | Parameters | Result | Ceiling / baseline | Ratio | Target | Met | Details |\n");
    out.push_str("|---|---|---|---|---|---|---|---|---|\n");
    for r in &report.results {
        let params = r
            .parameters
            .iter()
            .map(|(k, v)| format!("{k}={}", value_text(v)))
            .collect::<Vec<_>>()
            .join(", ");
        let ceiling = r.ceiling.as_ref().map_or_else(String::new, |c| {
            format!("{}: {} {}", c.name, num(c.value), r.unit)
        });
        let ratio = r.ratio.map_or_else(String::new, |x| {
            if x >= 10.0 {
                format!("{x:.0}x")
            } else {
                format!("{x:.2}")
            }
        });
        let met = match r.met {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "",
        };
        let mut details = r
            .details
            .iter()
            .map(|(k, v)| format!("{k}={}", value_text(v)))
            .collect::<Vec<_>>()
            .join(", ");
        if let Some(n) = &r.note {
            if !details.is_empty() {
                details.push_str("; ");
            }
            details.push_str(n);
        }
        out.push_str(&format!(
            "| {} | {} | {} | {} {} | {} | {} | {} | {} | {} |\n",
            cell(&r.scenario),
            cell(&r.case),
            cell(&params),
            num(r.result),
            r.unit,
            cell(&ceiling),
            ratio,
            cell(r.target.as_deref().unwrap_or("")),
            met,
            cell(&details),
        ));
    }
    if !report.failures.is_empty() {
        out.push_str("\nScenarios that failed:\n");
        for f in &report.failures {
            out.push_str(&format!("- {f}\n"));
        }
    }
    out
}

/// Writes the report as pretty JSON (creating the directory).
pub(crate) fn write_json(report: &Report, path: &Path) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_vec_pretty(report)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_well() {
        assert_eq!(num(1_234_567.8), "1,234,568");
        assert_eq!(num(123.4), "123");
        assert_eq!(num(12.34), "12.3");
        assert_eq!(num(1.234), "1.23");
        assert_eq!(num(0.1234), "0.123");
        assert_eq!(num(-4321.0), "-4,321");
    }

    #[test]
    fn table_has_one_line_per_row() {
        let report = Report {
            machine: Machine::describe(),
            quick: true,
            smoke: false,
            note: None,
            scenarios: vec!["drain".into()],
            fingerprint: String::new(),
            duration_s: 1.0,
            results: vec![Row::new("drain", "pg | noop", 20_000.0, "events/s")
                .param("backlog", 100_000)
                .against("store", 40_000.0)
                .target(">= 50%", true)],
            failures: vec![],
        };
        let md = markdown(&report);
        assert!(md.contains("| drain | pg \\| noop | backlog=100,000 | 20,000 events/s | store: 40,000 events/s | 0.50 | >= 50% | yes |"), "{md}");
    }
}
