//! One public path per item (ARCHITECTURE.md, "one home per item"): a
//! library crate's item is public at exactly one path. Read from the
//! sources as text, module by module from each `lib.rs`:
//!
//! - a `pub use` of a workspace crate's item (`pub use outbox_core::Event`)
//!   gives it a second path: the user imports it from its own crate;
//! - a `pub use` of an item of a module that is itself public
//!   (`pub mod source;` and `pub use source::Kafka`) gives it two paths in
//!   one crate.
//!
//! The one allowed kind: a whole crate re-exported as a module, e.g.
//! `pub use outbox_postgres as postgres` behind a feature (a single path
//! segment), listed by [`WHOLE_CRATE_REEXPORTS`] where it exists.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The whole-crate re-exports the workspace has (crate, module): the one
/// allowed kind of second path, so that one dependency line brings a
/// backend.
pub(super) const WHOLE_CRATE_REEXPORTS: &[(&str, &str)] = &[
    ("outbox-worker", "core"),
    ("outbox-worker", "postgres"),
    ("outbox-worker", "sqlite"),
    ("outbox-worker", "nats"),
    ("outbox-worker", "amqp"),
    ("outbox-worker", "kafka"),
];

/// Every item public at two paths, one line each, for the library crates
/// under `crates/` (each `crates/*/src/lib.rs`).
pub(super) fn check(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let Ok(dirs) = std::fs::read_dir(root.join("crates")) else {
        return problems;
    };
    let mut crates: Vec<PathBuf> = dirs.flatten().map(|d| d.path()).collect();
    crates.sort();
    let workspace: Vec<String> = crates
        .iter()
        .filter_map(|c| c.file_name()?.to_str().map(|n| n.replace('-', "_")))
        .collect();
    for dir in crates {
        let lib = dir.join("src/lib.rs");
        let Some(name) = dir.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if lib.exists() {
            problems.extend(crate_problems(name, &lib, &workspace));
        }
    }
    problems
}

/// A module of a crate: its path (`["source", "kafka"]`) and whether it is
/// public all the way from the crate root.
#[derive(Debug, Clone)]
struct Module {
    path: Vec<String>,
    public: bool,
}

fn crate_problems(name: &str, lib: &Path, workspace: &[String]) -> Vec<String> {
    let mut modules: BTreeMap<Vec<String>, bool> = BTreeMap::new();
    let mut reexports: Vec<(Vec<String>, Vec<String>)> = Vec::new();
    let mut alias_problems = Vec::new();
    let mut todo = vec![(
        lib.to_path_buf(),
        Module {
            path: Vec::new(),
            public: true,
        },
    )];
    modules.insert(Vec::new(), true);
    while let Some((file, module)) = todo.pop() {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let text = strip_comments(&text);
        for (child, public) in module_decls(&text) {
            let mut path = module.path.clone();
            path.push(child.clone());
            let public = public && module.public;
            modules.insert(path.clone(), public);
            if let Some(child_file) = module_file(&file, &module, &child) {
                todo.push((child_file, Module { path, public }));
            }
        }
        for used in pub_uses(&text) {
            reexports.push((module.path.clone(), used));
        }
        for (alias, of) in const_aliases(&text, workspace, name) {
            let mut at = vec![name.replace('-', "_")];
            at.extend(module.path.iter().cloned());
            alias_problems.push(format!(
                "{}::{alias} is {of} under a second name: one public path per item; use {of}",
                at.join("::")
            ));
        }
    }
    let mut problems = alias_problems;
    for (at, used) in reexports {
        let Some(first) = used.first() else { continue };
        let leaf = used.last().cloned().unwrap_or_default();
        let shown = |m: &[String]| {
            let mut p = vec![name.replace('-', "_")];
            p.extend(m.iter().cloned());
            p.join("::")
        };
        if workspace.contains(first) && first != &name.replace('-', "_") {
            if used.len() == 1 || (used.len() == 2 && used[1].starts_with("as ")) {
                let module = used.get(1).map_or(first.as_str(), |a| &a[3..]);
                if !WHOLE_CRATE_REEXPORTS.contains(&(name, module)) {
                    let mut at = at.clone();
                    at.push(module.to_owned());
                    problems.push(format!(
                        "{name} re-exports the whole crate {first} as `{}`: not in tidy's WHOLE_CRATE_REEXPORTS list",
                        shown(&at)
                    ));
                }
                continue;
            }
            problems.push(format!(
                "{}::{} is {}'s item re-exported: one public path per item; users import it from {first}",
                shown(&at),
                public_name(&used),
                used[..used.len() - 1].join("::"),
            ));
            continue;
        }
        // Within the crate: resolve the used path to a module of it.
        let mut target: Vec<String> = match first.as_str() {
            "crate" => Vec::new(),
            "self" => at.clone(),
            "super" => at[..at.len().saturating_sub(1)].to_vec(),
            _ if modules.contains_key(&[at.clone(), vec![first.clone()]].concat()) => at.clone(),
            _ => continue, // an external crate's item
        };
        let skip = usize::from(matches!(first.as_str(), "crate" | "self" | "super"));
        let rest = &used[skip..];
        let Some((_, parents)) = rest.split_last() else {
            continue;
        };
        let mut supers = 0;
        for seg in parents {
            if seg == "super" {
                target.pop();
                supers += 1;
            } else {
                target.push(seg.clone());
            }
        }
        let _ = supers;
        let leaf_is_glob = leaf == "*";
        let parent_public = modules.get(&target).copied().unwrap_or(false);
        let item_is_module = modules.contains_key(&[target.clone(), vec![leaf.clone()]].concat());
        if parent_public && !item_is_module && target != at {
            let what = if leaf_is_glob {
                format!("every item of {} (a glob)", shown(&target))
            } else {
                format!("{}::{leaf}", shown(&target))
            };
            problems.push(format!(
                "{what} is public at two paths: also {}::{} (pub use in a public module); keep one",
                shown(&at),
                public_name(&used)
            ));
        }
    }
    problems
}

/// `pub const NAME: T = other_workspace_crate::path;` lines (not
/// indented): another crate's constant under a second public name.
fn const_aliases(text: &str, workspace: &[String], own: &str) -> Vec<(String, String)> {
    let own = own.replace('-', "_");
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("pub const ")?;
            let (name, value) = rest.split_once('=')?;
            let name = name.split(':').next()?.trim().to_owned();
            let value = value.trim().trim_end_matches(';').trim();
            let first = value.split("::").next()?;
            (value.contains("::") && first != own && workspace.iter().any(|w| w == first))
                .then(|| (name, value.to_owned()))
        })
        .collect()
}

/// The name a `pub use` path makes public (its `as` name, or its leaf).
fn public_name(used: &[String]) -> String {
    match used.last() {
        Some(last) if last.starts_with("as ") => last[3..].to_owned(),
        Some(last) => last.clone(),
        None => String::new(),
    }
}

/// `text` without `//` comments and string literals' contents (so that a
/// `pub use` in a doc example is not read).
fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `mod NAME;` and `mod NAME {` declarations of one file (only the ones at
/// the start of a line, i.e. of this module), with whether each is `pub`.
fn module_decls(text: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let mut test_only = false;
    for line in text.lines() {
        let t = line.trim_start();
        // Items of this module only: no indentation.
        if line.len() != t.len() {
            continue;
        }
        // A module compiled for tests only is not part of the public API.
        if t.starts_with("#[cfg(test)]") || t.starts_with("#[cfg(all(test") {
            test_only = true;
            continue;
        }
        if std::mem::take(&mut test_only) {
            continue;
        }
        let (public, rest) = if let Some(r) = t.strip_prefix("pub mod ") {
            (true, r)
        } else if let Some(r) = t.strip_prefix("mod ") {
            (false, r)
        } else if let Some(r) = t.strip_prefix("pub(crate) mod ") {
            (false, r)
        } else {
            continue;
        };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.push((name, public));
        }
    }
    out
}

/// The file of module `child` declared in `file` (module `parent`):
/// `dir/child.rs` or `dir/child/mod.rs`, where `dir` is the folder of
/// `file` for a crate root or a `mod.rs`, else `file`'s own folder.
fn module_file(file: &Path, parent: &Module, child: &str) -> Option<PathBuf> {
    let dir = file.parent()?;
    let stem = file.file_stem()?.to_str()?;
    let base = if parent.path.is_empty() || stem == "mod" {
        dir.to_path_buf()
    } else {
        dir.join(stem)
    };
    [
        base.join(format!("{child}.rs")),
        base.join(child).join("mod.rs"),
    ]
    .into_iter()
    .find(|p| p.exists())
}

/// Every `pub use` of a module's own items (not indented), expanded: one
/// path per imported name, `as` kept as a last segment `as NAME`.
fn pub_uses(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("pub use ") {
        let at_line_start = i == 0 || rest[..i].ends_with('\n');
        let after = &rest[i + "pub use ".len()..];
        let Some(end) = after.find(';') else { break };
        if at_line_start {
            let tree: String = after[..end]
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            expand(&tree, &mut Vec::new(), &mut out);
        }
        rest = &after[end..];
    }
    out
}

/// Expands a use tree (`a::{b, c::{d as e}}`) into paths.
fn expand(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let head: Vec<String> = tree[..open]
            .split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        let inner = tree[open + 1..].trim_end().trim_end_matches('}');
        let depth = prefix.len();
        prefix.extend(head);
        for part in split_top(inner) {
            expand(part, prefix, out);
        }
        prefix.truncate(depth);
        return;
    }
    if tree.is_empty() {
        return;
    }
    let (path, alias) = match tree.split_once(" as ") {
        Some((p, a)) => (p, Some(a.trim())),
        None => (tree, None),
    };
    let mut full = prefix.clone();
    full.extend(path.split("::").map(|s| s.trim().to_owned()));
    if full.last().is_some_and(|l| l == "self") {
        full.pop();
    }
    if let Some(a) = alias {
        full.push(format!("as {a}"));
    }
    out.push(full);
}

/// Splits `a, b::{c, d}, e` at the commas outside braces.
fn split_top(s: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts.into_iter().filter(|p| !p.trim().is_empty()).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn use_trees_expand_to_one_path_per_name() {
        let mut out = Vec::new();
        expand(
            "crate::a::{B, c::{D as E, self}}",
            &mut Vec::new(),
            &mut out,
        );
        let got: Vec<String> = out.iter().map(|p| p.join("::")).collect();
        assert_eq!(got, ["crate::a::B", "crate::a::c::D::as E", "crate::a::c"]);
    }

    #[test]
    fn an_item_of_a_public_module_reexported_at_the_root_has_two_paths() {
        let dir = std::env::temp_dir().join(format!("tidy-paths-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::write(
            dir.join("src/lib.rs"),
            "pub mod source;\nmod inner;\npub use source::Kafka;\npub use inner::Nats;\npub use outbox_core::Event;\npub use outbox_core as core;\npub const KEY: &str = outbox_core::headers::KEY;\npub const OWN: &str = \"Own\";\n",
        )
        .unwrap();
        std::fs::write(dir.join("src/source.rs"), "pub struct Kafka;\n").unwrap();
        std::fs::write(dir.join("src/inner.rs"), "pub struct Nats;\n").unwrap();
        let ws = vec!["outbox_core".to_owned(), "outbox_x".to_owned()];
        let problems = crate_problems("outbox-x", &dir.join("src/lib.rs"), &ws);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(problems.len(), 4, "{problems:#?}");
        assert!(
            problems[0].contains("outbox_x::KEY is outbox_core::headers::KEY under a second name")
        );
        assert!(problems[1].contains("outbox_x::source::Kafka is public at two paths"));
        assert!(problems[2].contains("outbox_x::Event is outbox_core's item"));
        assert!(problems[3].contains("whole crate outbox_core as `outbox_x::core`"));
    }
}
