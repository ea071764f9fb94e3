//! `cargo xtask bench [--quick] [--scenario NAME]... [--note TEXT]`: checks
//! the services, makes sure the Kafka-protocol broker (Tansu) runs, then
//! runs the `outbox-bench` binary as a release build, forwarding the
//! arguments. `cargo xtask bench --write-doc` only does the last step
//! below, from the results already in `target/bench`. `cargo xtask bench
//! --profile SCENARIO [--quick]` runs one scenario under `perf` and writes
//! its flame graph (see [`profile`]).
//!
//! The binary does the measuring and writes `target/bench/results.json` and
//! `target/bench/results.md`. After a quick or full run of every scenario
//! (no `--scenario`), even one where a scenario failed, this command
//! rewrites the results section of BENCHMARKS.md (between [`BEGIN`] and
//! [`END`]) from them, stamped with the fingerprint of the scenario
//! registry (`crates/outbox-bench/src/registry.rs`) the binary was built
//! from. [`check_doc`], run by `cargo xtask tidy`, recomputes that
//! fingerprint from the registry in the tree: when the scenario set or a
//! size changes, the written numbers no longer count until the bench runs
//! again.

mod profile;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// The start of the generated section's first line; the line goes on with
/// `fingerprint=<hex> -->`.
pub(crate) const BEGIN: &str = "<!-- bench-results:begin";
/// The generated section's last line.
pub(crate) const END: &str = "<!-- bench-results:end -->";
/// The document with the results section.
const DOC: &str = "BENCHMARKS.md";
/// The scenario registry whose text is fingerprinted.
const REGISTRY: &str = "crates/outbox-bench/src/registry.rs";
/// What the bench writes, relative to the workspace root.
const RESULTS_JSON: &str = "target/bench/results.json";
const RESULTS_MD: &str = "target/bench/results.md";

/// Runs the benchmark. `args` are forwarded to `outbox-bench` (`--quick`,
/// `--scenario NAME` (repeatable or comma-separated), `--batch N`,
/// `--note TEXT`, `--list`), except `--write-doc`, which is this command's.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let root = crate::root();
    if args.iter().any(|a| a == "--write-doc") {
        return write_doc(&root);
    }
    if let Some(i) = args.iter().position(|a| a == "--profile") {
        let Some(scenario) = args.get(i + 1) else {
            bail!("--profile needs a scenario name (cargo xtask bench --list names them)");
        };
        let mut rest = args.to_vec();
        rest.drain(i..=i + 1);
        return profile::run(scenario, &rest);
    }
    if args
        .iter()
        .any(|a| a == "--help" || a == "-h" || a == "--list")
    {
        return run_bench(args);
    }
    let _services = crate::services::ensure_all()?;
    // Kept alive until the benchmark ends; stops Tansu only if started here.
    let _tansu = crate::kafka::start_tansu()?;
    let outcome = run_bench(args);
    let partial = args
        .iter()
        .any(|a| a.starts_with("--scenario") || a == "--smoke" || a.starts_with("--out-dir"));
    if partial {
        println!("\nxtask: not every scenario ran (or --smoke / --out-dir): {DOC} left as it is");
    } else if let Err(e) = write_doc(&root) {
        eprintln!("xtask: {DOC} not updated: {e:#}");
    }
    outcome
}

fn run_bench(args: &[String]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.args(["run", "--release", "-p", "outbox-bench", "--"])
        .args(args)
        .current_dir(crate::root());
    println!(
        "\n==> cargo run --release -p outbox-bench -- {}",
        args.join(" ")
    );
    let status = cmd
        .status()
        .with_context(|| format!("could not run {cargo}"))?;
    if !status.success() {
        bail!("the benchmark failed ({status})");
    }
    Ok(())
}

/// FNV-1a (64 bits) of `source`'s lines, each trimmed, blank lines and
/// `//` comment lines left out, as hex: what `outbox-bench`'s
/// `registry::fingerprint` computes from its own source.
pub(crate) fn fingerprint(source: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for line in source.lines().map(str::trim) {
        if line.is_empty() || line.starts_with("//") {
            continue;
        }
        for b in line.bytes().chain(std::iter::once(b'\n')) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// The scenario names of the registry's `SCENARIOS` table, in order: the
/// first string of each `(name, what)` pair.
pub(crate) fn scenario_names(registry: &str) -> Vec<String> {
    let Some(start) = registry.find("const SCENARIOS") else {
        return Vec::new();
    };
    let body = &registry[start..];
    let body = &body[..body.find("];").unwrap_or(body.len())];
    let mut names = Vec::new();
    let mut rest = body;
    while let Some(i) = rest.find('(') {
        rest = &rest[i + 1..];
        let after = rest.trim_start();
        if let Some(s) = after.strip_prefix('"') {
            if let Some(end) = s.find('"') {
                names.push(s[..end].to_owned());
                // Skip the description, which may hold parentheses.
                rest = &s[end + 1..];
                if let Some(close) = rest.find("\",") {
                    rest = &rest[close..];
                }
                if let Some(close) = rest.find(')') {
                    rest = &rest[close..];
                }
            }
        }
    }
    names
}

/// The results section for `results` (the bench's JSON) and `table` (its
/// markdown), or why there is none.
fn section(results: &Value, table: &str, registry: &str) -> Result<String> {
    let fp = results["fingerprint"].as_str().unwrap_or_default();
    if fp.is_empty() {
        bail!("{RESULTS_JSON} has no fingerprint (written by an older outbox-bench)");
    }
    let current = fingerprint(registry);
    if fp != current {
        bail!(
            "{RESULTS_JSON} comes from a registry with fingerprint {fp}, {REGISTRY} has {current} \
             (another checkout's binary, or the registry changed since): run the bench again"
        );
    }
    if results["smoke"].as_bool().unwrap_or(false) {
        bail!("{RESULTS_JSON} is a --smoke run (its numbers mean nothing)");
    }
    let names = scenario_names(registry);
    let ran: Vec<&str> = results["scenarios"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if ran != names {
        bail!(
            "{RESULTS_JSON} ran {} of the {} scenarios: only a run of all of them is written",
            ran.len(),
            names.len()
        );
    }
    let kind = if results["quick"].as_bool().unwrap_or(false) {
        "quick"
    } else {
        "full"
    };
    Ok(format!(
        "{BEGIN} fingerprint={fp} -->\n\
         <!-- Written by `cargo xtask bench` from {RESULTS_JSON}; edits here are overwritten. -->\n\n\
         A {kind} run of all {} scenarios (registry fingerprint `{fp}`).\n\n\
         {}\n{END}",
        names.len(),
        table.trim_end(),
    ))
}

/// `doc` with its results section replaced by `new_section`.
fn splice(doc: &str, new_section: &str) -> Result<String> {
    let Some(begin) = doc.find(BEGIN) else {
        bail!("{DOC} has no `{BEGIN}` marker");
    };
    let Some(end) = doc[begin..].find(END).map(|e| begin + e + END.len()) else {
        bail!("{DOC} has no `{END}` after `{BEGIN}`");
    };
    Ok(format!("{}{new_section}{}", &doc[..begin], &doc[end..]))
}

/// Rewrites the results section of BENCHMARKS.md from `target/bench`.
fn write_doc(root: &Path) -> Result<()> {
    let read =
        |p: &str| std::fs::read_to_string(root.join(p)).with_context(|| format!("reading {p}"));
    let results: Value = serde_json::from_str(&read(RESULTS_JSON)?)
        .with_context(|| format!("parsing {RESULTS_JSON}"))?;
    let new_section = section(&results, &read(RESULTS_MD)?, &read(REGISTRY)?)?;
    let doc = splice(&read(DOC)?, &new_section)?;
    std::fs::write(root.join(DOC), doc).with_context(|| format!("writing {DOC}"))?;
    println!("xtask: wrote the results section of {DOC} from {RESULTS_JSON}");
    Ok(())
}

/// The tidy check: BENCHMARKS.md has one results section, written by
/// `cargo xtask bench` from a run of the current scenario set (its
/// fingerprint is the registry's), and a heading per scenario in its
/// "what each scenario measures" part. Returns the problems found.
pub(crate) fn check_doc(root: &Path) -> Vec<String> {
    let (doc, registry) = match (
        std::fs::read_to_string(root.join(DOC)),
        std::fs::read_to_string(root.join(REGISTRY)),
    ) {
        (Ok(d), Ok(r)) => (d, r),
        (Err(e), _) => return vec![format!("cannot read {DOC}: {e}")],
        (_, Err(e)) => return vec![format!("cannot read {REGISTRY}: {e}")],
    };
    check_doc_text(&doc, &registry)
}

fn check_doc_text(doc: &str, registry: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let rerun = "run `cargo xtask bench [--quick]` to write it";
    match doc.matches(BEGIN).count() {
        0 => problems.push(format!("{DOC} has no results section (`{BEGIN}`): {rerun}")),
        1 => {}
        n => problems.push(format!("{DOC} has {n} results sections: keep one")),
    }
    if let Some(begin) = doc.find(BEGIN) {
        let line = doc[begin..].lines().next().unwrap_or_default();
        let written = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("fingerprint="))
            .unwrap_or_default();
        let current = fingerprint(registry);
        if written != current {
            problems.push(format!(
                "{DOC}'s results come from scenario set {written:?}, {REGISTRY} is {current:?} \
                 (a scenario or a size changed since the run): {rerun}"
            ));
        }
        match doc[begin..].find(END) {
            None => problems.push(format!("{DOC}: `{END}` missing after `{BEGIN}`")),
            Some(end) if !doc[begin..begin + end].contains("\n| ") => {
                problems.push(format!("{DOC}: the results section has no table: {rerun}"));
            }
            Some(_) => {}
        }
    }
    for name in scenario_names(registry) {
        if !doc.contains(&format!("### `{name}`")) {
            problems.push(format!(
                "{DOC} does not describe scenario `{name}` (a `### `{name}`` heading)"
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    const REGISTRY_TEXT: &str = "// a comment\npub(crate) const SCENARIOS: &[(&str, &str)] = &[\n    (\n        \"drain\",\n        \"relay (no-op) vs ceiling\",\n    ),\n    (\"scale-out\", \"1, 2 (and 4) relays\"),\n];\n";

    #[test]
    fn names_are_read_from_the_registry() {
        assert_eq!(scenario_names(REGISTRY_TEXT), vec!["drain", "scale-out"]);
    }

    #[test]
    fn fingerprint_ignores_comments_and_indentation_only() {
        let a = fingerprint(REGISTRY_TEXT);
        let reindented = REGISTRY_TEXT.replace("    ", "\t") + "\n// another comment\n";
        assert_eq!(a, fingerprint(&reindented));
        assert_ne!(a, fingerprint(&REGISTRY_TEXT.replace("scale-out", "scale")));
    }

    #[test]
    fn tidy_accepts_a_current_section_and_rejects_a_stale_one() {
        let results = serde_json::json!({
            "fingerprint": fingerprint(REGISTRY_TEXT),
            "quick": true,
            "scenarios": ["drain", "scale-out"],
        });
        let table = "| Scenario | Case |\n|---|---|\n| drain | x |\n";
        let s = section(&results, table, REGISTRY_TEXT).expect("a section");
        let doc = format!(
            "# B\n### `drain`\n### `scale-out`\n{BEGIN} fingerprint=0 -->\nold\n{END}\ntail\n"
        );
        let stale = check_doc_text(&doc, REGISTRY_TEXT);
        assert_eq!(stale.len(), 2, "{stale:?}");
        let doc = splice(&doc, &s).expect("spliced");
        assert!(
            doc.ends_with("tail\n") && doc.contains("| drain | x |"),
            "{doc}"
        );
        assert_eq!(check_doc_text(&doc, REGISTRY_TEXT), Vec::<String>::new());
        let changed = REGISTRY_TEXT.replace("drain", "drains");
        assert!(!check_doc_text(&doc, &changed).is_empty());
    }

    #[test]
    fn a_partial_run_is_not_written() {
        let results = serde_json::json!({
            "fingerprint": fingerprint(REGISTRY_TEXT),
            "quick": true,
            "scenarios": ["drain"],
        });
        assert!(section(&results, "| x |", REGISTRY_TEXT).is_err());
    }
}
