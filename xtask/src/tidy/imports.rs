//! No import runs back up, no circle of files (issue 44): inside each crate
//! under `crates/`, read from the sources as text,
//!
//! - no file imports the crate root (`lib.rs` / `main.rs`): a module takes
//!   an item from the module that defines it, never through the root's
//!   re-exports (the root is above every module; an import of it runs back
//!   up, and with the root's `pub use` of that module it is a circle);
//! - no files import each other in a circle (`a.rs` uses `b.rs`, which uses
//!   `a.rs`, directly or through others): what both need goes below them.
//!
//! How a file is read (tokens, test-only items dropped, the module tree from
//! `mod` declarations) is `rust_source.rs`. An import is every `use` path
//! and every path in code that starts at `crate::`, `super::`, `self::` or
//! a child module's name. It is resolved to the
//! deepest module it names, and that module's FILE is imported: an item
//! reached through a facade (the root, or a module file that re-exports it)
//! is an import of the facade. A `mod` declaration is no import. Not read:
//! `$crate::` paths (an exported macro must name the public path; they
//! resolve where the macro is used), the bodies of `macro_rules!`, and
//! names brought in by a glob or a `use` alias of a module (the `use`
//! itself is the import).
//!
//! Circles are looked for without the imports of the root (those are the
//! first kind of problem already), so one fault is reported once.
//! [`TEMPORARILY_ALLOWED`] lists the offenders being fixed; an entry that
//! no longer matches fails too, so the list only shrinks.

use crate::rust_source::{crate_roots, load_crate, resolve, Crate};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Offenders being fixed (issue 44), each a problem key as tidy prints it
/// after `[key: ...]`, with why it is accepted for now. Whoever fixes one
/// removes its entry: an entry that matches nothing fails tidy.
const TEMPORARILY_ALLOWED: &[(&str, &str)] = &[];

/// Every import problem of the crates under `root/crates`, one line each,
/// minus the [`TEMPORARILY_ALLOWED`] ones; a stale allow-list entry is one.
pub(super) fn check(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for file in crate_roots(root) {
        found.extend(crate_problems(&load_crate(&file), root));
    }
    allow(found, TEMPORARILY_ALLOWED)
}

/// The problems not on `allowed`, then one per entry of `allowed` that
/// matched none.
fn allow(found: Vec<Problem>, allowed: &[(&str, &str)]) -> Vec<String> {
    let keys: BTreeSet<&str> = found.iter().map(|p| p.key.as_str()).collect();
    let mut out: Vec<String> = found
        .iter()
        .filter(|p| !allowed.iter().any(|(k, _)| *k == p.key))
        .map(|p| format!("{} [key: {}]", p.line, p.key))
        .collect();
    for (key, _) in allowed {
        if !keys.contains(key) {
            out.push(format!(
                "`{key}` is in TEMPORARILY_ALLOWED (xtask/src/tidy/imports.rs) but no longer found: remove the entry"
            ));
        }
    }
    out
}

/// One problem: a stable key (for the allow-list) and the line to print.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Problem {
    key: String,
    line: String,
}

/// Imports between files: (from, to) -> (names taken, first line).
type Edges = BTreeMap<(PathBuf, PathBuf), (BTreeSet<String>, usize)>;

/// Every file-to-file import of a crate.
fn edges(krate: &Crate) -> Edges {
    let mut out = Edges::new();
    for (m, module) in krate.modules.iter().enumerate() {
        for (segs, line) in &module.refs {
            let Some((to, rest)) = resolve(krate, m, segs) else {
                continue;
            };
            let target = &krate.modules[to];
            if target.file == module.file || target.file.as_os_str().is_empty() {
                continue;
            }
            let name = rest
                .first()
                .or(target.path.last())
                .cloned()
                .unwrap_or_else(|| "*".into());
            let entry = out
                .entry((module.file.clone(), target.file.clone()))
                .or_insert_with(|| (BTreeSet::new(), *line));
            entry.0.insert(name);
        }
    }
    out
}

/// The back-arrows and circles of one crate (paths shown relative to
/// `root`).
fn crate_problems(krate: &Crate, root: &Path) -> Vec<Problem> {
    let show = |p: &Path| p.strip_prefix(root).unwrap_or(p).display().to_string();
    let Some(crate_root) = krate.modules.first().map(|m| m.file.clone()) else {
        return Vec::new();
    };
    let edges = edges(krate);
    let mut problems = Vec::new();
    for ((from, to), (names, line)) in &edges {
        if *to == crate_root {
            problems.push(Problem {
                key: format!("{} -> {}", show(from), show(to)),
                line: format!(
                    "{}:{line} imports the crate root {} ({}): take each from the module that defines it (an import that runs back up)",
                    show(from),
                    show(to),
                    names.iter().cloned().collect::<Vec<_>>().join(", ")
                ),
            });
        }
    }
    let below: Edges = edges
        .into_iter()
        .filter(|((_, to), _)| *to != crate_root)
        .collect();
    for circle in circles(&below) {
        let ties: Vec<String> = below
            .iter()
            .filter(|((f, t), _)| circle.contains(f) && circle.contains(t))
            .map(|((f, t), (names, _))| {
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                format!("{} -> {} ({})", show(f), show(t), names.join(", "))
            })
            .collect();
        let files: Vec<String> = circle.iter().map(|f| show(f)).collect();
        problems.push(Problem {
            key: format!("circle: {}", files.join(", ")),
            line: format!(
                "a circle of {} files: {}; move what they share below them",
                files.len(),
                ties.join("; ")
            ),
        });
    }
    problems
}

/// The strongly connected sets of more than one file (Tarjan), each sorted.
fn circles(edges: &Edges) -> Vec<BTreeSet<PathBuf>> {
    let mut next: BTreeMap<&PathBuf, Vec<&PathBuf>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        next.entry(from).or_default().push(to);
        next.entry(to).or_default();
    }
    struct State<'a> {
        index: BTreeMap<&'a PathBuf, (usize, usize)>,
        stack: Vec<&'a PathBuf>,
        out: Vec<BTreeSet<PathBuf>>,
    }
    fn visit<'a>(
        v: &'a PathBuf,
        next: &BTreeMap<&'a PathBuf, Vec<&'a PathBuf>>,
        s: &mut State<'a>,
    ) {
        let n = s.index.len();
        s.index.insert(v, (n, n));
        s.stack.push(v);
        for &w in next.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(w, next, s);
                let low = s.index[w].1.min(s.index[v].1);
                s.index.entry(v).and_modify(|e| e.1 = low);
            } else if s.stack.contains(&w) {
                let low = s.index[w].0.min(s.index[v].1);
                s.index.entry(v).and_modify(|e| e.1 = low);
            }
        }
        if s.index[v].0 == s.index[v].1 {
            let mut set = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                set.insert(w.clone());
                if w == v {
                    break;
                }
            }
            if set.len() > 1 {
                s.out.push(set);
            }
        }
    }
    let mut state = State {
        index: BTreeMap::new(),
        stack: Vec::new(),
        out: Vec::new(),
    };
    for &v in next.keys() {
        if !state.index.contains_key(v) {
            visit(v, &next, &mut state);
        }
    }
    state.out.sort();
    state.out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::rust_source::tests::fixture;

    #[test]
    fn super_and_child_paths_resolve_to_the_defining_file() {
        let dir = fixture(
            "resolve",
            &[
                ("lib.rs", "mod a;\nmod e;\n"),
                ("a.rs", "pub struct A;\n"),
                ("e.rs", "mod f;\npub(crate) fn g() { f::h(); }\n"),
                ("e/f.rs", "pub(crate) fn h() { super::super::a::A; }\n"),
            ],
        );
        let krate = load_crate(&dir.join("src/lib.rs"));
        let found: BTreeSet<(String, String, Vec<String>)> = edges(&krate)
            .into_iter()
            .map(|((from, to), (names, _))| {
                let rel = |p: &Path| p.strip_prefix(&dir).unwrap().display().to_string();
                (rel(&from), rel(&to), names.into_iter().collect())
            })
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            found,
            BTreeSet::from([
                ("src/e.rs".into(), "src/e/f.rs".into(), vec!["h".to_owned()]),
                ("src/e/f.rs".into(), "src/a.rs".into(), vec!["A".to_owned()]),
            ])
        );
    }

    #[test]
    fn a_circle_of_three_and_an_import_of_the_root_are_found_a_test_block_is_not() {
        let dir = fixture(
            "circle",
            &[
                ("lib.rs", "mod a;\nmod b;\nmod c;\nmod d;\npub use a::A;\n"),
                ("a.rs", "use crate::b::B;\npub struct A(B);\n"),
                (
                    "b.rs",
                    "pub struct B(super::c::C);\n#[cfg(test)]\nmod tests {\n    use crate::A;\n}\n",
                ),
                ("c.rs", "pub(crate) use crate::{a::{A}};\npub struct C;\n"),
                ("d.rs", "pub(crate) fn d() -> crate::A { todo!() }\n"),
            ],
        );
        let problems = crate_problems(&load_crate(&dir.join("src/lib.rs")), &dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert_eq!(problems[0].key, "src/d.rs -> src/lib.rs");
        assert!(problems[0]
            .line
            .starts_with("src/d.rs:1 imports the crate root src/lib.rs (A)"));
        assert_eq!(problems[1].key, "circle: src/a.rs, src/b.rs, src/c.rs");
        assert!(
            problems[1].line.contains(
                "src/a.rs -> src/b.rs (B); src/b.rs -> src/c.rs (C); src/c.rs -> src/a.rs (A)"
            ),
            "{}",
            problems[1].line
        );
    }

    #[test]
    fn an_allowed_problem_passes_and_a_stale_entry_fails() {
        let found = vec![Problem {
            key: "k1".into(),
            line: "one".into(),
        }];
        assert!(allow(found.clone(), &[("k1", "being fixed")]).is_empty());
        let out = allow(found, &[("k2", "fixed already")]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], "one [key: k1]");
        assert!(out[1].contains("`k2` is in TEMPORARILY_ALLOWED"));
    }
}
