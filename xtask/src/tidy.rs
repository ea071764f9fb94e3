//! `cargo xtask tidy`: the workspace's shape, checked (run first by `ci`).
//!
//! 1. Dependency direction, from `cargo metadata`:
//!    - `outbox-core` has no I/O and no runtime: its normal dependencies are
//!      an allow-list (plus the optional OpenTelemetry API crates of its
//!      feature `otel`), nothing in its normal dependency tree is a runtime,
//!      a database or broker client, or a socket library, and its sources
//!      use no `std::net` / `std::fs` / `std::thread::sleep`.
//!    - Store crates depend on `outbox-core` only among ours; publisher
//!      crates on `outbox-core` and the publisher kit `outbox-broker`; the kit
//!      on core; the relay library `outbox-worker` on core, kit, stores and
//!      publishers; the test kit never on the relay.
//!    - Nothing depends (in any way, dev-dependencies included) on the relay
//!      binary crate `outbox-relay` or on `outbox-worker` except the
//!      binary, the benchmark, the chaos suite and the end-to-end tests.
//! 2. Each backend feature builds alone:
//!    `cargo check -p outbox-relay --no-default-features --features X`.
//! 3. Generated docs are current:
//!    `cargo run -q -p outbox-relay --all-features -- config-table --check README.md`.
//! 4. BENCHMARKS.md's results section was written by `cargo xtask bench`
//!    from a run of the current scenario set, and every scenario has its
//!    heading (see `bench.rs`).
//! 5. `deploy/`: the Prometheus rules and the Grafana dashboard parse, every
//!    rule has its fields, every metric they name is emitted by the code, and
//!    promtool agrees when it is installed (see `deploy.rs`).
//! 6. Seams (`tidy/seams.rs`): the libraries a user depends on take no
//!    application crate (clap, anyhow, toml, a subscriber, an exporter), and
//!    `outbox-worker` calls on a store only the `Store` trait's methods.
//! 7. Docs (`tidy/docs.rs`): every repository path a doc names exists, no
//!    heading of ARCHITECTURE.md carries a date, no `#[deprecated]` before
//!    the first release tag, and RELIABILITY.md's results section comes
//!    from a run of the current chaos plan.
//! 8. File size: no source file over 1,000 lines outside tests and
//!    generated code, except those in `xtask/tidy-large-files.txt`, a list
//!    that may only shrink (see `tidy/size.rs`).
//! 9. README.md's quick start is `xtask/quickstart/main.rs`, the program the
//!    outside project of `cargo xtask package` builds and runs (see
//!    `package.rs`).
//! 10. One public path per item (`tidy/paths.rs`): no library crate
//!     re-exports another workspace crate's item (a whole crate as a module
//!     excepted, listed), nor an item of one of its own public modules, nor
//!     aliases another crate's constant; ARCHITECTURE.md's "Guarded by" tests
//!     exist (`tidy/docs.rs`).
//! 11. Imports (`tidy/imports.rs`): in each crate no file imports the crate
//!     root (an import that runs back up) and no files import each other in
//!     a circle (issue 44).

mod docs;
mod imports;
mod paths;
mod seams;
mod size;

use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

/// `outbox-core`'s allowed normal dependencies. Adding one is a design
/// decision: it must do no I/O and need no runtime.
const CORE_ALLOWED: &[&str] = &[
    "base64",
    "bytes",
    "chrono",
    "prost",
    "serde",
    "serde_json",
    "thiserror",
    "uuid",
];

/// `outbox-core`'s optional dependencies behind its feature `otel` (W3C
/// trace context): the OpenTelemetry API and the `tracing` bridge, no SDK,
/// no exporter. They must stay optional.
const CORE_OTEL_ALLOWED: &[&str] = &["opentelemetry", "tracing", "tracing-opentelemetry"];

/// A forbidden crate that is accepted below core only on a path through the
/// named crate: `tracing-opentelemetry` needs `tracing-subscriber`'s span
/// registry as a type bound (features `registry` + `std`; it installs no
/// subscriber and does no I/O).
const CORE_FORBIDDEN_EXCEPT_VIA: &[(&str, &str)] =
    &[("tracing-subscriber", "tracing-opentelemetry")];

/// Crates that must never be in `outbox-core`'s normal dependency tree.
const CORE_FORBIDDEN: &[&str] = &[
    "tokio",
    "async-std",
    "smol",
    "mio",
    "socket2",
    "futures-executor",
    "sqlx",
    "sqlx-core",
    "rdkafka",
    "rdkafka-sys",
    "lapin",
    "async-nats",
    "hyper",
    "reqwest",
    "tracing-subscriber",
];

/// Source patterns `outbox-core` must not use (I/O, blocking).
const CORE_FORBIDDEN_SOURCE: &[&str] = &["std::net", "std::fs", "thread::sleep", "tokio::"];

const CORE: &str = "outbox-core";
const BROKER: &str = "outbox-broker";
const WORKER: &str = "outbox-worker";
const RELAY: &str = "outbox-relay";
/// `cargo` arguments that run the relay's (hidden) `config-table`
/// subcommand; its own arguments follow.
const RUN_CONFIG_TABLE: &[&str] = &[
    "run",
    "-q",
    "-p",
    RELAY,
    "--all-features",
    "--",
    "config-table",
];
const STORES: &[&str] = &["outbox-sqlite", "outbox-postgres"];
const PUBLISHERS: &[&str] = &["outbox-nats", "outbox-amqp", "outbox-kafka"];
/// The only crates that may depend on the relay library or binary.
const MAY_USE_RELAY: &[&str] = &[
    RELAY,
    "outbox-bench",
    "outbox-chaos",
    "outbox-tests",
    "outbox-example-orders",
];
/// The backend features that must each build alone.
const BACKEND_FEATURES: &[&str] = &["sqlite", "postgres", "nats", "amqp", "kafka"];

/// Runs every tidy check; fails listing every problem found.
pub(crate) fn run(_rest: &[String]) -> Result<()> {
    let meta = metadata()?;
    let mut problems = Vec::new();
    println!("\n==> tidy: dependency direction");
    problems.extend(dependency_direction(&meta));
    problems.extend(core_sources(&crate::root()));
    problems.extend(seams::check(&meta, &crate::root()));
    problems.extend(paths::check(&crate::root()));
    problems.extend(imports::check(&crate::root()));
    problems.extend(crate::package::check_readme_quickstart(&crate::root()));
    if !problems.is_empty() {
        // The cheap checks first: no point compiling a misshaped workspace.
        report(&problems)?;
    }
    println!("    ok");
    println!("\n==> tidy: BENCHMARKS.md results from the current scenario set");
    problems.extend(crate::bench::check_doc(&crate::root()));
    println!("\n==> tidy: docs (paths, dated headings, deprecated items, chaos results)");
    problems.extend(docs::check(&crate::root()));
    println!("\n==> tidy: file size (at most {} lines)", size::MAX_LINES);
    problems.extend(size::check(&crate::root()));
    if !problems.is_empty() {
        report(&problems)?;
    }
    println!("    ok");
    println!("\n==> tidy: deploy/ alert rules and dashboard");
    problems.extend(crate::deploy::check(&crate::root()));
    if !problems.is_empty() {
        report(&problems)?;
    }
    println!("    ok");

    let relay = package_named(&meta, RELAY).or_else(|| package_named(&meta, WORKER));
    let Some(relay) = relay else {
        bail!("tidy: neither {RELAY} nor {WORKER} is in the workspace");
    };
    let relay_name = relay["name"].as_str().unwrap_or(RELAY).to_owned();
    println!("\n==> tidy: each backend feature of {relay_name} builds alone");
    let features: BTreeSet<&str> = relay["features"]
        .as_object()
        .map(|f| f.keys().map(String::as_str).collect())
        .unwrap_or_default();
    for f in BACKEND_FEATURES {
        if !features.contains(f) {
            problems.push(format!(
                "{relay_name} has no feature `{f}` (one per backend)"
            ));
            continue;
        }
        let args = [
            "check",
            "-p",
            relay_name.as_str(),
            "--no-default-features",
            "--features",
            f,
        ];
        if let Err(e) = crate::cargo(&args) {
            problems.push(format!(
                "backend feature `{f}` does not build alone: {e} (each backend must compile without the others)"
            ));
        }
    }

    println!("\n==> tidy: generated docs are current");
    if relay_name == RELAY {
        match has_config_table()? {
            true => {
                if let Err(e) =
                    crate::cargo(&[RUN_CONFIG_TABLE, &["--check", "README.md"]].concat())
                {
                    problems.push(format!(
                        "README.md's configuration table is stale ({e}); regenerate it: cargo run -p outbox-relay --all-features -- config-table --write README.md"
                    ));
                }
            }
            false => println!("    skipped: `outbox-relay config-table` does not exist yet"),
        }
    } else {
        println!("    skipped: no {RELAY} crate yet");
    }
    if !problems.is_empty() {
        report(&problems)?;
    }
    println!("\ntidy passed");
    Ok(())
}

fn report(problems: &[String]) -> Result<()> {
    eprintln!("\ntidy found {} problem(s):", problems.len());
    for p in problems {
        eprintln!("  - {p}");
    }
    bail!("tidy failed ({} problem(s), listed above)", problems.len())
}

fn metadata() -> Result<Value> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--all-features"])
        .current_dir(crate::root())
        .output()
        .with_context(|| format!("could not run {cargo} metadata"))?;
    if !out.status.success() {
        bail!(
            "`cargo metadata` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("parsing cargo metadata")
}

fn package_named<'a>(meta: &'a Value, name: &str) -> Option<&'a Value> {
    let members: BTreeSet<&str> = meta["workspace_members"]
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    meta["packages"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == name && p["id"].as_str().is_some_and(|id| members.contains(id)))
}

/// A workspace crate's dependencies on other workspace crates, by kind
/// (`normal`, `dev`, `build`).
fn internal_deps(pkg: &Value, ours: &BTreeSet<String>) -> Vec<(String, String)> {
    pkg["dependencies"]
        .as_array()
        .map(|deps| {
            deps.iter()
                .filter_map(|d| {
                    let name = d["name"].as_str()?;
                    ours.contains(name).then(|| {
                        let kind = d["kind"].as_str().unwrap_or("normal").to_owned();
                        (name.to_owned(), kind)
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Which of our crates a crate may depend on (normal dependencies), or
/// `None` for leaf crates (binaries, tests, tools) that may use any.
fn allowed_internal(name: &str) -> Option<Vec<&'static str>> {
    let with = |extra: &[&'static str]| {
        let mut v = vec![CORE];
        v.extend_from_slice(extra);
        Some(v)
    };
    match name {
        CORE => Some(Vec::new()),
        BROKER => with(&[]),
        n if STORES.contains(&n) => with(&[]),
        n if PUBLISHERS.contains(&n) => with(&[BROKER]),
        WORKER => {
            let mut v = vec![BROKER];
            v.extend_from_slice(STORES);
            v.extend_from_slice(PUBLISHERS);
            with(&v)
        }
        // The consumer half: the publishers' client conventions (broker
        // URLs, redaction), never a store crate or the relay.
        "outbox-inbox" => {
            let mut v = vec![BROKER];
            v.extend_from_slice(PUBLISHERS);
            with(&v)
        }
        "outbox-testkit" => {
            let mut v = vec![BROKER];
            v.extend_from_slice(STORES);
            v.extend_from_slice(PUBLISHERS);
            with(&v)
        }
        _ => None,
    }
}

fn dependency_direction(meta: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    let members: BTreeSet<&str> = meta["workspace_members"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let packages: Vec<&Value> = meta["packages"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|p| p["id"].as_str().is_some_and(|id| members.contains(id)))
                .collect()
        })
        .unwrap_or_default();
    let ours: BTreeSet<String> = packages
        .iter()
        .filter_map(|p| p["name"].as_str().map(str::to_owned))
        .collect();

    for pkg in &packages {
        let name = pkg["name"].as_str().unwrap_or("?");
        let published = !pkg["publish"].as_array().is_some_and(Vec::is_empty);
        let deps = internal_deps(pkg, &ours);
        // Nothing but the leaves may use the relay, in any way.
        for (dep, kind) in &deps {
            if (dep == RELAY || dep == WORKER) && !MAY_USE_RELAY.contains(&name) && name != dep {
                problems.push(format!(
                    "{name} depends on {dep} ({kind} dependency): only {} may; move the test or code that needs the relay into one of those",
                    MAY_USE_RELAY.join(", ")
                ));
            }
        }
        match allowed_internal(name) {
            Some(allowed) => {
                for (dep, kind) in &deps {
                    if kind == "normal" && !allowed.contains(&dep.as_str()) {
                        problems.push(format!(
                            "{name} depends on {dep}: among our crates it may only use [{}] (dependency direction: core <- kit <- stores/publishers <- relay)",
                            allowed.join(", ")
                        ));
                    }
                }
            }
            None if published && ![RELAY].contains(&name) => problems.push(format!(
                "{name} is a published crate tidy does not know: add it to the layer table in xtask/src/tidy.rs (allowed_internal) so its dependency direction is checked"
            )),
            None => {}
        }
    }

    // outbox-core: direct normal dependencies from the allow-list ...
    if let Some(core) = packages.iter().find(|p| p["name"] == CORE) {
        for d in core["dependencies"].as_array().into_iter().flatten() {
            let kind = d["kind"].as_str().unwrap_or("normal");
            let dep = d["name"].as_str().unwrap_or("?");
            let optional = d["optional"].as_bool().unwrap_or(false);
            if kind == "normal" && optional && CORE_OTEL_ALLOWED.contains(&dep) {
                continue;
            }
            if kind == "normal" && !CORE_ALLOWED.contains(&dep) {
                problems.push(format!(
                    "{CORE} depends on {dep}: core has no I/O and no runtime, its dependencies are an allow-list [{}] in xtask/src/tidy.rs; put I/O in a backend crate",
                    CORE_ALLOWED.join(", ")
                ));
            }
        }
        // ... and no runtime or client anywhere below them.
        if let Some(id) = core["id"].as_str() {
            for (bad, path) in forbidden_below(meta, id) {
                problems.push(format!(
                    "{CORE}'s normal dependency tree contains {bad} (via {path}): core must not pull in a runtime, a socket or a database/broker client"
                ));
            }
        }
    } else {
        problems.push(format!("{CORE} is not in the workspace"));
    }
    problems
}

/// Forbidden crates reachable from `root` through normal dependencies,
/// each with one path to it.
fn forbidden_below(meta: &Value, root: &str) -> Vec<(String, String)> {
    let nodes: HashMap<&str, &Value> = meta["resolve"]["nodes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|n| Some((n["id"].as_str()?, n)))
                .collect()
        })
        .unwrap_or_default();
    let names: HashMap<&str, &str> = meta["packages"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| Some((p["id"].as_str()?, p["name"].as_str()?)))
                .collect()
        })
        .unwrap_or_default();
    // Breadth-first, remembering how each crate was reached.
    let mut via: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([root]);
    let mut seen = BTreeSet::from([root]);
    let mut found = Vec::new();
    while let Some(id) = queue.pop_front() {
        let Some(node) = nodes.get(id) else { continue };
        for d in node["deps"].as_array().into_iter().flatten() {
            let normal = d["dep_kinds"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| k["kind"].is_null());
            let Some(pkg) = d["pkg"].as_str() else {
                continue;
            };
            if !normal || !seen.insert(pkg) {
                continue;
            }
            via.insert(pkg, id);
            let name = names.get(pkg).copied().unwrap_or("?");
            if CORE_FORBIDDEN.contains(&name) {
                let mut path = vec![name];
                let mut at = id;
                while at != root {
                    path.push(names.get(at).copied().unwrap_or("?"));
                    at = via.get(at).copied().unwrap_or(root);
                }
                path.push(CORE);
                path.reverse();
                let excepted = CORE_FORBIDDEN_EXCEPT_VIA
                    .iter()
                    .any(|(bad, via)| *bad == name && path.contains(via));
                if !excepted {
                    found.push((name.to_owned(), path.join(" -> ")));
                }
            }
            queue.push_back(pkg);
        }
    }
    found
}

/// `outbox-core`'s sources must not do I/O or block.
fn core_sources(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    for path in rust_files(&root.join("crates").join(CORE).join("src")) {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for pat in CORE_FORBIDDEN_SOURCE {
                if code.contains(pat) {
                    problems.push(format!(
                        "{}:{}: `{pat}` in {CORE} (no I/O, no blocking in core)",
                        path.strip_prefix(root).unwrap_or(&path).display(),
                        i + 1
                    ));
                }
            }
        }
    }
    problems
}

/// Every `.rs` file under `dir`, `target` directories left out.
pub(super) fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target") {
                    stack.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Whether `outbox-relay` has the (hidden) `config-table` subcommand: its
/// `--help` succeeds; clap refuses an unknown subcommand.
fn has_config_table() -> Result<bool> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!("\n==> cargo run -q -p {RELAY} --all-features -- config-table --help");
    let out = Command::new(&cargo)
        .args(RUN_CONFIG_TABLE)
        .arg("--help")
        .current_dir(crate::root())
        .output()
        .with_context(|| format!("could not run {cargo}"))?;
    if out.status.success() {
        return Ok(true);
    }
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("unrecognized subcommand") {
        return Ok(false);
    }
    bail!("`cargo run -p {RELAY} --all-features -- config-table --help` failed: {err}")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn layers() {
        assert_eq!(allowed_internal(CORE), Some(vec![]));
        assert_eq!(allowed_internal("outbox-postgres"), Some(vec![CORE]));
        assert_eq!(allowed_internal("outbox-nats"), Some(vec![CORE, BROKER]));
        assert_eq!(allowed_internal("outbox-chaos"), None);
    }

    #[test]
    fn tracing_subscriber_is_accepted_below_core_only_through_the_otel_bridge() {
        let meta = |via: &str| {
            serde_json::json!({
                "packages": [
                    {"id": "core", "name": "outbox-core"},
                    {"id": "mid", "name": via},
                    {"id": "ts", "name": "tracing-subscriber"},
                ],
                "resolve": {"nodes": [
                    {"id": "core", "deps": [{"pkg": "mid", "dep_kinds": [{"kind": null}]}]},
                    {"id": "mid", "deps": [{"pkg": "ts", "dep_kinds": [{"kind": null}]}]},
                    {"id": "ts", "deps": []},
                ]}
            })
        };
        assert!(forbidden_below(&meta("tracing-opentelemetry"), "core").is_empty());
        assert_eq!(
            forbidden_below(&meta("helper"), "core"),
            vec![(
                "tracing-subscriber".to_owned(),
                "outbox-core -> helper -> tracing-subscriber".to_owned()
            )]
        );
    }

    #[test]
    fn finds_a_forbidden_crate_below_core_with_its_path() {
        let meta = serde_json::json!({
            "packages": [
                {"id": "core", "name": "outbox-core"},
                {"id": "mid", "name": "helper"},
                {"id": "tok", "name": "tokio"},
                {"id": "pb", "name": "prost-build"},
            ],
            "resolve": {"nodes": [
                {"id": "core", "deps": [
                    {"pkg": "mid", "dep_kinds": [{"kind": null}]},
                    {"pkg": "pb", "dep_kinds": [{"kind": "build"}]},
                ]},
                {"id": "mid", "deps": [{"pkg": "tok", "dep_kinds": [{"kind": null}]}]},
                {"id": "pb", "deps": []},
                {"id": "tok", "deps": []},
            ]}
        });
        let found = forbidden_below(&meta, "core");
        assert_eq!(
            found,
            vec![(
                "tokio".to_owned(),
                "outbox-core -> helper -> tokio".to_owned()
            )]
        );
    }
}
