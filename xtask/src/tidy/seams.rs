//! Two seams ARCHITECTURE.md states as invariants: the libraries a user
//! depends on pull in no application crate, and the relay library reaches a
//! store only through the `Store` trait's calls.

use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;

/// Crates for binaries and tools, not for libraries: argument parsing,
/// application error types, configuration files, a global subscriber, an
/// exporter, the OpenTelemetry SDK.
const APP_ONLY: &[&str] = &[
    "clap",
    "anyhow",
    "toml",
    "tracing-subscriber",
    "metrics-exporter-prometheus",
    "opentelemetry_sdk",
    "opentelemetry-otlp",
];

/// The library crates a user depends on (what tidy's layer table names,
/// the test kit and the binaries excepted).
const USER_LIBRARIES: &[&str] = &[
    "outbox-core",
    "outbox-broker",
    "outbox-sqlite",
    "outbox-postgres",
    "outbox-nats",
    "outbox-amqp",
    "outbox-kafka",
    "outbox-worker",
    "outbox-inbox",
];

/// The `Store` calls the relay library may make; every write among them
/// (`claim`, `settle`, `renew`, `leave`) is fenced or scoped by the relay's
/// own id.
const WORKER_STORE_CALLS: &[&str] = &["claim", "settle", "renew", "leave", "stats", "wakeup"];

/// Names the relay library must not use outside its tests: concrete stores,
/// the database driver, and the pause switch (only `outbox-relay pause`
/// writes it; the relay reads it with `ControlStore::paused`).
const WORKER_FORBIDDEN: &[&str] = &["PgLogStore", "PgStore", "SqliteStore", "sqlx", "set_paused"];

/// Every check of this module, each problem one line.
pub(super) fn check(meta: &Value, root: &Path) -> Vec<String> {
    let mut problems = app_only_dependencies(meta);
    problems.extend(worker_store_seam(root));
    problems
}

/// The user's libraries have no normal dependency on an [`APP_ONLY`] crate:
/// those are for `outbox-relay`, `outbox-bench`, `outbox-chaos`, the test
/// kit and xtask.
fn app_only_dependencies(meta: &Value) -> Vec<String> {
    let members: BTreeSet<&str> = meta["workspace_members"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut problems = Vec::new();
    for pkg in meta["packages"].as_array().into_iter().flatten() {
        let member = pkg["id"].as_str().is_some_and(|id| members.contains(id));
        let name = pkg["name"].as_str().unwrap_or("?");
        if !member || !USER_LIBRARIES.contains(&name) {
            continue;
        }
        for d in pkg["dependencies"].as_array().into_iter().flatten() {
            let dep = d["name"].as_str().unwrap_or("?");
            let normal = d["kind"].is_null() || d["kind"] == "normal";
            if normal && APP_ONLY.contains(&dep) {
                problems.push(format!(
                    "{name} depends on {dep}: a library a user adds to Cargo.toml takes no application crate ({}); that belongs to the binaries",
                    APP_ONLY.join(", ")
                ));
            }
        }
    }
    problems
}

/// `outbox-worker`'s sources (up to the first `#[cfg(test)]` of each file,
/// test-only files left out) call on a store only [`WORKER_STORE_CALLS`]
/// and name none of [`WORKER_FORBIDDEN`].
fn worker_store_seam(root: &Path) -> Vec<String> {
    let files: Vec<_> = super::rust_files(&root.join("crates/outbox-worker/src"))
        .into_iter()
        .filter(|p| {
            p.file_stem()
                .and_then(|s| s.to_str())
                .is_some_and(|s| !s.ends_with("_tests") && s != "test_support")
        })
        .collect();
    let mut problems = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        let shown = file
            .strip_prefix(root)
            .unwrap_or(&file)
            .display()
            .to_string();
        for (i, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("#[cfg(test)]") {
                break;
            }
            let code = line.split("//").next().unwrap_or("");
            problems.extend(seam_problems(code).into_iter().map(|p| {
                format!("{shown}:{}: {p} (the relay reaches a store only through the Store trait: ARCHITECTURE.md)", i + 1)
            }));
        }
    }
    problems
}

/// What one line of worker code breaks of the seam.
fn seam_problems(code: &str) -> Vec<String> {
    let mut problems = Vec::new();
    for name in WORKER_FORBIDDEN {
        let found = code.match_indices(name).any(|(at, _)| {
            let before = code[..at].chars().next_back();
            let after = code[at + name.len()..].chars().next();
            let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
            !ident(before) && !ident(after)
        });
        if found {
            problems.push(format!("names `{name}`"));
        }
    }
    let mut rest = code;
    while let Some(at) = rest.find("store.") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "store.".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let method: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let called = rest[method.len()..].starts_with('(');
        if called && !WORKER_STORE_CALLS.contains(&method.as_str()) {
            problems.push(format!(
                "calls `store.{method}(..)`, not one of {}",
                WORKER_STORE_CALLS.join(", ")
            ));
        }
    }
    problems
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_seam_admits_the_trait_calls_only() {
        assert!(seam_problems("let c = self.store.claim(req).await?;").is_empty());
        assert!(seam_problems("self.store.leave(&id).await").is_empty());
        assert!(seam_problems("let s = self.store.stats; // field").is_empty());
        assert!(seam_problems("restore.rewind(1)").is_empty());
        assert_eq!(
            seam_problems("self.store.rewind(pos).await"),
            vec!["calls `store.rewind(..)`, not one of claim, settle, renew, leave, stats, wakeup"]
        );
        assert_eq!(
            seam_problems("use outbox_postgres::PgLogStore;"),
            vec!["names `PgLogStore`"]
        );
        assert!(seam_problems("let PgLogStoreish = 1;").is_empty());
    }

    #[test]
    fn a_library_with_an_application_crate_is_reported() {
        let meta = serde_json::json!({
            "workspace_members": ["w", "r"],
            "packages": [
                {"id": "w", "name": "outbox-worker", "dependencies": [
                    {"name": "anyhow", "kind": null},
                    {"name": "clap", "kind": "dev"},
                ]},
                {"id": "r", "name": "outbox-relay", "dependencies": [
                    {"name": "clap", "kind": null},
                ]},
            ]
        });
        let problems = app_only_dependencies(&meta);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("outbox-worker depends on anyhow"));
    }
}
