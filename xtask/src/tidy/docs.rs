//! The docs say what is true now: every repository path they name exists,
//! ARCHITECTURE.md has no dated headings, nothing is `#[deprecated]` before
//! a first release, and RELIABILITY.md's results come from a run of the
//! current chaos plan.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The top-level docs whose paths are checked (those that exist), besides
/// every `crates/*/README.md`.
const ROOT_DOCS: &[&str] = &[
    "README.md",
    "ARCHITECTURE.md",
    "BENCHMARKS.md",
    "RELIABILITY.md",
    "CHANGELOG.md",
];

/// Endings that make a candidate a file path even without a known first
/// component.
const FILE_ENDINGS: &[&str] = &[".rs", ".md", ".sql", ".toml", ".proto"];

/// Characters that make a candidate a placeholder, a glob, a command or an
/// expression rather than a path.
const NOT_IN_PATHS: &[char] = &[
    ' ', '\t', '<', '>', '*', '?', '{', '}', '$', '%', '|', '=', ',', '(', ')', '[', ']', '"', '\'',
];

/// Whether a path component is a placeholder written in capitals, such as
/// `NNNN_name.sql`: two or more capital letters, then `_`.
fn is_placeholder(component: &str) -> bool {
    let caps = component
        .chars()
        .take_while(char::is_ascii_uppercase)
        .count();
    caps >= 2 && component[caps..].starts_with('_')
}

/// Prefixes of candidates that are not repository paths: absolute and URL
/// paths (`/readyz`), the user's directory (`./outbox.toml`, `~/.cargo`),
/// flags, and build output (`target/chaos/...`).
const NOT_REPO_PREFIXES: &[&str] = &["/", "./", "~", "-", "target/"];

/// Names a doc uses for files the user writes, not files of the repository.
const USER_FILES: &[&str] = &[
    // The relay's configuration file (`outbox-relay --config`).
    "outbox.toml",
];

/// Every check of this module, each problem one line.
pub(super) fn check(root: &Path) -> Vec<String> {
    let mut problems = doc_paths(root);
    problems.extend(dated_headings(root));
    problems.extend(deprecated_before_release(root));
    problems.extend(chaos_results(root));
    problems.extend(cited_guards(root));
    problems
}

/// Every test ARCHITECTURE.md cites as an invariant's guard (a backticked
/// `snake_case` name with at least three words after "Guarded by") is a
/// function of the repository: an invariant guarded by a test that was
/// renamed or removed is guarded by nothing.
fn cited_guards(root: &Path) -> Vec<String> {
    let Ok(doc) = std::fs::read_to_string(root.join("ARCHITECTURE.md")) else {
        return Vec::new();
    };
    let mut cited = std::collections::BTreeSet::new();
    for paragraph in doc.split("\n\n") {
        let Some((_, guards)) = paragraph.split_once("Guarded by") else {
            continue;
        };
        for (i, part) in guards.split('`').enumerate() {
            let is_test_name = i % 2 == 1
                && part.matches('_').count() >= 2
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if is_test_name {
                cited.insert(part.to_owned());
            }
        }
    }
    let mut defined = std::collections::BTreeSet::new();
    for dir in ["crates", "xtask", "examples", "tests"] {
        for file in super::rust_files(&root.join(dir)) {
            let Ok(text) = std::fs::read_to_string(&file) else {
                continue;
            };
            for line in text.lines() {
                let Some(rest) = line.trim_start().split("fn ").nth(1) else {
                    continue;
                };
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                defined.insert(name);
            }
        }
    }
    cited
        .difference(&defined)
        .map(|name| {
            format!("ARCHITECTURE.md cites `{name}` as a guard, and no function of the repository has that name")
        })
        .collect()
}

/// Every repository path a doc names exists.
///
/// The docs: README.md, ARCHITECTURE.md, BENCHMARKS.md, RELIABILITY.md and
/// CHANGELOG.md at the root (those present) and every `crates/*/README.md`.
/// The candidates: inline code spans and link targets (`[text](target)`,
/// its `#anchor` dropped), outside fenced code blocks (those hold commands
/// and examples). A candidate names a repository path when
/// - it has no whitespace, no `://` and none of `< > * ? { } $ % | = , ( ) [ ]`
///   or quotes (placeholders, globs, commands), and does not start with
///   `/`, `./`, `~`, `-` or `target/` (HTTP paths, the user's files, flags,
///   build output), nor is it a user's file such as `outbox.toml`, nor has
///   it a placeholder component in capitals (`NNNN_name.sql`); and
/// - it ends in `.rs`, `.md`, `.sql`, `.toml` or `.proto`, or its first
///   component is an entry of its base directory: `crates/outbox-core/` is
///   checked, while `exchange/key`, `i/N` or `application/json` are not
///   paths at all.
///
/// The base is the repository root; for a crate README the crate's
/// directory first, then the repository root. A path passes when it exists
/// under a base (a trailing `/` and a `:line` suffix are ignored).
fn doc_paths(root: &Path) -> Vec<String> {
    let mut docs: Vec<(PathBuf, Vec<PathBuf>)> = ROOT_DOCS
        .iter()
        .map(|d| (root.join(d), vec![root.to_path_buf()]))
        .collect();
    if let Ok(entries) = std::fs::read_dir(root.join("crates")) {
        let mut crates: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        crates.sort();
        for dir in crates {
            docs.push((dir.join("README.md"), vec![dir.clone(), root.to_path_buf()]));
        }
    }
    let mut problems = Vec::new();
    for (doc, bases) in docs {
        let Ok(text) = std::fs::read_to_string(&doc) else {
            continue;
        };
        let shown = doc.strip_prefix(root).unwrap_or(&doc).display().to_string();
        for (line, candidate) in candidates(&text) {
            let Some(path) = as_repo_path(&candidate, &bases) else {
                continue;
            };
            if !bases.iter().any(|b| b.join(path).exists()) {
                problems.push(format!(
                    "{shown}:{line}: names `{candidate}`, which does not exist{}: fix the path or write what is true now",
                    if bases.len() > 1 {
                        " in the crate or the repository"
                    } else {
                        " in the repository"
                    }
                ));
            }
        }
    }
    problems
}

/// Inline code spans and link targets outside fenced code blocks, with
/// their 1-based line numbers.
fn candidates(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Code spans: text between single backticks.
        let mut parts = line.split('`');
        parts.next();
        while let (Some(code), Some(_)) = (parts.next(), parts.next()) {
            out.push((i + 1, code.to_owned()));
        }
        // Link targets: `](target)`.
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            if let Some(end) = rest.find(')') {
                let target = rest[..end].split('#').next().unwrap_or("");
                if !target.is_empty() {
                    out.push((i + 1, target.to_owned()));
                }
                rest = &rest[end..];
            }
        }
    }
    out
}

/// The repository path a candidate names (see [`doc_paths`]), or `None`
/// when it names none.
fn as_repo_path<'a>(candidate: &'a str, bases: &[PathBuf]) -> Option<&'a str> {
    if candidate.is_empty()
        || candidate.contains("://")
        || candidate.contains(NOT_IN_PATHS)
        || NOT_REPO_PREFIXES.iter().any(|p| candidate.starts_with(p))
        || USER_FILES.contains(&candidate)
    {
        return None;
    }
    // `path:12` names a line of `path`.
    let path = match candidate.rsplit_once(':') {
        Some((p, line)) if line.chars().all(|c| c.is_ascii_digit()) => p,
        _ => candidate,
    };
    // `a::b` is a Rust path, not a file.
    if path.contains(':') {
        return None;
    }
    let path = path.trim_end_matches('/');
    if path.split('/').any(is_placeholder) {
        return None;
    }
    let file_like = FILE_ENDINGS.iter().any(|e| path.ends_with(e));
    let first = path.split('/').next().unwrap_or("");
    let known_first =
        path.contains('/') && !first.is_empty() && bases.iter().any(|b| b.join(first).exists());
    (file_like || known_first).then_some(path)
}

const MONTHS: &[&str] = &[
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// No heading of ARCHITECTURE.md carries a date: an ISO date
/// (`2026-12-01`) or a month, written out or in its three-letter form, with
/// a year within the next two words (`December 2026`, `Dec 1, 2026`).
/// ARCHITECTURE.md says what is true now; when it became true is in git.
fn dated_headings(root: &Path) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string(root.join("ARCHITECTURE.md")) else {
        return Vec::new();
    };
    let mut fenced = false;
    let mut problems = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced && line.starts_with('#') && has_date(line) {
            problems.push(format!(
                "ARCHITECTURE.md:{}: the heading `{line}` carries a date: say what is true now (the history is in git)",
                i + 1
            ));
        }
    }
    problems
}

/// Whether `text` holds an ISO date or a month with a year (see
/// [`dated_headings`]).
fn has_date(text: &str) -> bool {
    let b = text.as_bytes();
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    let iso = (0..b.len()).any(|i| {
        (i == 0 || !digit(i - 1))
            && (i..i + 4).all(digit)
            && b.get(i + 4) == Some(&b'-')
            && (i + 5..i + 7).all(digit)
            && b.get(i + 7) == Some(&b'-')
            && (i + 8..i + 10).all(digit)
            && !digit(i + 10)
    });
    if iso {
        return true;
    }
    let words: Vec<&str> = text
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    let is_year = |w: &str| w.len() == 4 && (w.starts_with("19") || w.starts_with("20"));
    words.iter().enumerate().any(|(i, w)| {
        let month = MONTHS
            .iter()
            .any(|m| *w == *m || (w.len() == 3 && m.starts_with(*w)));
        month && words.iter().skip(i + 1).take(2).any(|n| is_year(n))
    })
}

/// No `#[deprecated]` under `crates/` before the first release: while
/// `git tag` lists no release tag (one holding a version `N.N.N`, such as
/// `v0.1.0` or `outbox-core-v0.1.0`), nothing has users to migrate, so an
/// old name is removed rather than deprecated.
fn deprecated_before_release(root: &Path) -> Vec<String> {
    let tags = Command::new("git")
        .args(["tag", "--list"])
        .current_dir(root)
        .output();
    let tags = match tags {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
        // Not a git checkout (a packaged source): nothing to compare with.
        _ => return Vec::new(),
    };
    if tags.lines().any(is_release_tag) {
        return Vec::new();
    }
    let mut problems = Vec::new();
    for file in super::rust_files(&root.join("crates")) {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if code.contains("#[deprecated") || code.contains("#![deprecated") {
                problems.push(format!(
                    "{}:{}: `#[deprecated]` before the first release (no release tag): remove the old item instead",
                    file.strip_prefix(root).unwrap_or(&file).display(),
                    i + 1
                ));
            }
        }
    }
    problems
}

/// Whether a tag names a release: it holds `N.N.N`.
fn is_release_tag(tag: &str) -> bool {
    let b = tag.as_bytes();
    let digits_from = |mut i: usize| {
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        (i > start).then_some(i)
    };
    (0..b.len()).any(|i| {
        (i == 0 || !b[i - 1].is_ascii_digit())
            && digits_from(i)
                .filter(|&j| b.get(j) == Some(&b'.'))
                .and_then(|j| digits_from(j + 1))
                .filter(|&k| b.get(k) == Some(&b'.'))
                .and_then(|k| digits_from(k + 1))
                .is_some()
    })
}

/// RELIABILITY.md's results section is what `cargo xtask chaos` wrote from
/// a run of the current plan (see `chaos::check_section`).
fn chaos_results(root: &Path) -> Vec<String> {
    match std::fs::read_to_string(root.join(crate::chaos::DOC)) {
        Ok(text) => crate::chaos::check_section(&text),
        Err(e) => vec![format!("{}: cannot be read: {e}", crate::chaos::DOC)],
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn candidates_are_code_spans_and_link_targets_outside_fences() {
        let text = "See `crates/a/src/lib.rs` and [the doc](docs/x.md#part).\n```sh\ncat `not/this.rs`\n```\n`b.rs`, `c`\n";
        let c = candidates(text);
        assert_eq!(
            c,
            vec![
                (1, "crates/a/src/lib.rs".to_owned()),
                (1, "docs/x.md".to_owned()),
                (5, "b.rs".to_owned()),
                (5, "c".to_owned()),
            ]
        );
    }

    #[test]
    fn what_counts_as_a_repository_path() {
        let root = crate::root();
        let bases = [root.clone()];
        for (candidate, want) in [
            (
                "crates/outbox-core/src/lib.rs",
                Some("crates/outbox-core/src/lib.rs"),
            ),
            ("crates/outbox-core/", Some("crates/outbox-core")),
            ("crates/nope", Some("crates/nope")),
            ("xtask/src/tidy.rs:12", Some("xtask/src/tidy.rs")),
            ("store.rs", Some("store.rs")),
            ("exchange/key", None),
            ("i/N", None),
            ("/readyz", None),
            ("./outbox.toml", None),
            ("outbox.toml", None),
            ("target/chaos/quick/summary.md", None),
            ("target/chaos/<mode>/summary.json", None),
            ("outbox/v1/*.proto", None),
            ("migrations/sqlite/NNNN_name.sql", None),
            (
                "crates/outbox-core/README.md",
                Some("crates/outbox-core/README.md"),
            ),
            ("postgres://u@h/db", None),
            ("log_store::a_test", None),
            ("--shard i/N", None),
        ] {
            assert_eq!(as_repo_path(candidate, &bases), want, "{candidate}");
        }
    }

    #[test]
    fn a_missing_path_is_reported_with_its_doc_and_line() {
        let dir = std::env::temp_dir().join(format!("tidy-docs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("crates/x/src")).unwrap();
        std::fs::write(dir.join("crates/x/src/lib.rs"), "").unwrap();
        std::fs::write(
            dir.join("README.md"),
            "`crates/x/src/lib.rs`\n`crates/x/src/gone.rs`\n",
        )
        .unwrap();
        std::fs::write(dir.join("crates/x/README.md"), "`src/lib.rs` `src/no.rs`\n").unwrap();
        let problems = doc_paths(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].starts_with("README.md:2: names `crates/x/src/gone.rs`"));
        assert!(problems[1].starts_with("crates/x/README.md:1: names `src/no.rs`"));
    }

    #[test]
    fn dates_in_headings() {
        for dated in [
            "## Results (2026-12-01)",
            "### Latest run, December 2026",
            "#### Full run of Dec 1, 2026",
            "## 2026-11-30",
        ] {
            assert!(has_date(dated), "{dated}");
        }
        for plain in [
            "## Decisions",
            "### The claim, 1,000 rows",
            "## May the relay stop",
            "### Version 0.1.0",
            "### Port 2026",
        ] {
            assert!(!has_date(plain), "{plain}");
        }
    }

    #[test]
    fn release_tags() {
        for tag in ["v0.1.0", "0.1.0", "outbox-core-v1.2.3", "v10.20.30-rc1"] {
            assert!(is_release_tag(tag), "{tag}");
        }
        for tag in ["v1", "v0.1", "safety-review", "2026-12-01"] {
            assert!(!is_release_tag(tag), "{tag}");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod cited_guard_tests {
    /// A cited guard that no function defines is a problem; one that
    /// exists is not.
    #[test]
    fn a_guard_cited_but_never_defined_is_named() {
        let root = std::env::temp_dir().join(format!("tidy-guards-{}", std::process::id()));
        std::fs::create_dir_all(root.join("crates/x/src")).unwrap();
        std::fs::write(
            root.join("ARCHITECTURE.md"),
            "Architecture Invariant: it holds. Guarded by `a_test_that_exists`,\n`a_test_that_was_renamed` and `cargo xtask tidy`.\n",
        )
        .unwrap();
        std::fs::write(
            root.join("crates/x/src/lib.rs"),
            "#[test]\nfn a_test_that_exists() {}\n",
        )
        .unwrap();
        let problems = super::cited_guards(&root);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("`a_test_that_was_renamed`"),
            "{problems:?}"
        );
    }
}
