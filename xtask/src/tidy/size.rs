//! File size: no source file over [`MAX_LINES`] lines outside tests and
//! generated code, except those on an allow-list that may only shrink.
//!
//! Every `.rs` file under `crates/`, `xtask/` and `tests/` counts, except
//! files under a directory named `tests` (integration tests), files named
//! `tests.rs` or `*_tests.rs` (unit tests moved out of their module),
//! files marked `@generated` in their first lines, and anything under a
//! `target` directory. A file over the limit fails unless
//! [`ALLOW_LIST`] names it; a listed file that is no longer over the limit
//! (or no longer exists) fails too, so that its entry is removed and the
//! list only shrinks.
//!
//! Why a limit: a file that holds several concerns is where a reader gets
//! lost and where changes collide; 1,000 lines is roughly where the files
//! of this workspace stopped holding one concern. Why an allow-list and
//! not a warning: a warning is ignored, and a list that can only shrink
//! records the debt and lets nobody add to it.

use std::collections::BTreeMap;
use std::path::Path;

/// The most lines a source file may have.
pub(super) const MAX_LINES: usize = 1000;

/// The allow-list, relative to the workspace root: one path per line
/// (relative to the root, `/`-separated); `#` starts a comment.
pub(super) const ALLOW_LIST: &str = "xtask/tidy-large-files.txt";

/// The directories whose sources are measured, relative to the root.
const ROOTS: &[&str] = &["crates", "xtask", "tests"];

/// How many leading lines are searched for an `@generated` marker.
const GENERATED_MARKER_LINES: usize = 5;

/// Checks the workspace at `root`: one problem per file over the limit and
/// not listed, per listed file no longer over it, and per unreadable list.
pub(super) fn check(root: &Path) -> Vec<String> {
    let allowed = match std::fs::read_to_string(root.join(ALLOW_LIST)) {
        Ok(text) => parse_allow_list(&text),
        Err(e) => return vec![format!("{ALLOW_LIST}: cannot read it: {e}")],
    };
    let mut sizes = BTreeMap::new();
    for dir in ROOTS {
        collect(root, &root.join(dir), &mut sizes);
    }
    problems(&sizes, &allowed)
}

/// The paths an allow-list names, in its order (comments and blank lines
/// skipped).
fn parse_allow_list(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Whether the size rule applies to `rel` (a root-relative, `/`-separated
/// path of a `.rs` file).
fn measured(rel: &str) -> bool {
    let mut parts: Vec<&str> = rel.split('/').collect();
    let Some(name) = parts.pop() else {
        return false;
    };
    let test_file = name == "tests.rs" || name.ends_with("_tests.rs");
    let skipped_dir = parts.iter().any(|d| *d == "tests" || *d == "target");
    rel.ends_with(".rs") && !test_file && !skipped_dir
}

/// Whether `text` says it is generated (an `@generated` marker near the top).
fn generated(text: &str) -> bool {
    text.lines()
        .take(GENERATED_MARKER_LINES)
        .any(|l| l.contains("@generated"))
}

/// Adds the line count of every measured `.rs` file under `dir` to `sizes`,
/// keyed by its root-relative `/`-separated path.
fn collect(root: &Path, dir: &Path, sizes: &mut BTreeMap<String, usize>) {
    for path in super::rust_files(dir) {
        let rel = relative(root, &path);
        if !measured(&rel) {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if !generated(&text) {
            sizes.insert(rel, text.lines().count());
        }
    }
}

/// `path` relative to `root`, with `/` separators.
fn relative(root: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(root).unwrap_or(path);
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// The problems of measured `sizes` (path -> lines) against `allowed`.
fn problems(sizes: &BTreeMap<String, usize>, allowed: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for (path, &lines) in sizes {
        if lines > MAX_LINES && !allowed.contains(path) {
            out.push(format!(
                "{path}: {lines} lines, over {MAX_LINES}: split it by concern (each file one concern, named for it); {ALLOW_LIST} may only shrink"
            ));
        }
    }
    for path in allowed {
        match sizes.get(path) {
            Some(&lines) if lines > MAX_LINES => {}
            Some(&lines) => out.push(format!(
                "{path}: {lines} lines, no longer over {MAX_LINES}: remove it from {ALLOW_LIST} (the list only shrinks)"
            )),
            None => out.push(format!(
                "{path}: listed in {ALLOW_LIST} but not a measured source file: remove the entry"
            )),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(files: &[(&str, usize)]) -> BTreeMap<String, usize> {
        files.iter().map(|(p, n)| ((*p).to_owned(), *n)).collect()
    }

    #[test]
    fn tests_generated_code_and_target_are_not_measured() {
        assert!(measured("crates/outbox-worker/src/relay.rs"));
        assert!(measured("xtask/src/tidy/size.rs"));
        assert!(!measured("crates/outbox-postgres/tests/log_store.rs"));
        assert!(!measured("tests/support/app.rs"));
        assert!(!measured("crates/outbox-worker/src/relay_tests.rs"));
        assert!(!measured("crates/outbox-relay/src/http/tests.rs"));
        assert!(!measured("crates/outbox-core/target/debug/build/x.rs"));
        assert!(!measured("crates/outbox-core/README.md"));
        assert!(generated("// @generated by prost-build\nstruct A;"));
        assert!(!generated("//! A module.\nstruct A;"));
    }

    #[test]
    fn the_allow_list_skips_comments_and_blank_lines() {
        let text = "# may only shrink\n\ncrates/a/src/big.rs  # split pending\n xtask/src/b.rs\n";
        assert_eq!(
            parse_allow_list(text),
            vec![
                "crates/a/src/big.rs".to_owned(),
                "xtask/src/b.rs".to_owned()
            ]
        );
    }

    #[test]
    fn an_unlisted_file_over_the_limit_fails_and_a_listed_one_passes() {
        let s = sizes(&[("crates/a/src/big.rs", 1001), ("crates/a/src/ok.rs", 1000)]);
        assert!(problems(&s, &["crates/a/src/big.rs".to_owned()]).is_empty());
        let found = problems(&s, &[]);
        assert_eq!(found.len(), 1);
        assert!(found[0].starts_with("crates/a/src/big.rs: 1001 lines, over 1000"));
    }

    #[test]
    fn a_listed_file_no_longer_over_the_limit_or_gone_fails() {
        let s = sizes(&[("crates/a/src/small.rs", 1000)]);
        let found = problems(
            &s,
            &[
                "crates/a/src/small.rs".to_owned(),
                "crates/a/src/gone.rs".to_owned(),
            ],
        );
        assert_eq!(found.len(), 2);
        assert!(found[0].starts_with("crates/a/src/small.rs: 1000 lines, no longer over"));
        assert!(found[1].starts_with("crates/a/src/gone.rs: listed in"));
    }
}
