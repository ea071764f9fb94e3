//! `cargo xtask public-api [--root DIR]`: every public path of every
//! library crate (`crates/*/src/lib.rs`), one per line, sorted, each with
//! its kind (`fn`, `struct`, `enum`, `union`, `trait`, `const`, `static`,
//! `type`, `mod`, `macro`), for diffing the API of two checkouts (issue 44:
//! "every removed path has its one remaining home"). Stable Rust has no
//! rustdoc JSON, so the sources are read as text, with xtask's reader
//! (`rust_source.rs`: tokens, `#[cfg(test)]` dropped, the module tree from
//! `mod` declarations).
//!
//! A path is listed when it is reachable from the crate root through
//! `pub mod` chains and `pub use` re-exports (globs expanded, `use` chains
//! followed, into other workspace crates too, for the kind). Limits:
//!
//! - items only: no methods, fields, enum variants or trait items;
//! - every `#[cfg(..)]` is taken as on (all features), except `test`;
//! - a re-exported module of another workspace crate is one line
//!   `... mod (= its path)`, not expanded (its items are listed under
//!   their own crate); a re-export of a crate outside the workspace is
//!   `... use (= its path)`, its kind unknown;
//! - items made by macros (other than `macro_rules!` itself) or by
//!   `include!` are not seen, except when re-exported: kind `item`;
//!   `#[macro_export]` macros are listed at the crate root;
//! - `#[doc(hidden)]` items are listed, marked `#[doc(hidden)]`.
//!
//! `--root DIR` lists another checkout (e.g. a `git worktree` of an older
//! commit).

use crate::rust_source::{self as source, Crate, UsePath};
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Prints the list for the workspace (or `--root DIR`).
pub(crate) fn run(rest: &[String]) -> Result<()> {
    let root = match rest {
        [] => crate::root(),
        [flag, dir] if flag == "--root" => PathBuf::from(dir),
        _ => bail!("usage: cargo xtask public-api [--root DIR]"),
    };
    if !root.join("crates").is_dir() {
        bail!("{}: no crates/ folder here", root.display());
    }
    for line in list(&root) {
        println!("{line}");
    }
    Ok(())
}

/// What a public name is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// An item of this kind; `true` when `#[doc(hidden)]`.
    Item(&'static str, bool),
    /// A module: its crate's name and index.
    Module(String, usize),
    /// A path outside the workspace (kind unknown).
    External(String),
}

/// Every public path of the library crates under `root/crates`, sorted.
pub(crate) fn list(root: &Path) -> Vec<String> {
    let crates: BTreeMap<String, Crate> = source::crate_roots(root)
        .into_iter()
        .filter(|f| f.ends_with("src/lib.rs"))
        .filter_map(|f| {
            let dir = f.parent()?.parent()?;
            let name = dir.file_name()?.to_str()?.replace('-', "_");
            Some((name, source::load_crate(&f)))
        })
        .collect();
    let mut out = Vec::new();
    for name in crates.keys() {
        emit(&crates, name, 0, name, &mut out, 0);
    }
    out.sort();
    out.dedup();
    out
}

/// How deep `use` chains and module re-exports are followed.
const MAX_DEPTH: usize = 16;

/// Lists module `m` of crate `c` under the path `at`.
fn emit(
    crates: &BTreeMap<String, Crate>,
    c: &str,
    m: usize,
    at: &str,
    out: &mut Vec<String>,
    depth: usize,
) {
    if depth > MAX_DEPTH {
        return;
    }
    for (name, target) in names(crates, c, m, depth) {
        let path = format!("{at}::{name}");
        match target {
            Target::Item(kind, hidden) => {
                let mark = if hidden { " #[doc(hidden)]" } else { "" };
                out.push(format!("{path} {kind}{mark}"));
            }
            Target::Module(tc, tm) if tc == c => {
                out.push(format!("{path} mod"));
                emit(crates, c, tm, &path, out, depth + 1);
            }
            Target::Module(tc, tm) => {
                let of = crates[&tc].modules[tm].path.join("::");
                let of = if of.is_empty() {
                    tc
                } else {
                    format!("{tc}::{of}")
                };
                out.push(format!("{path} mod (= {of})"));
            }
            Target::External(of) => out.push(format!("{path} use (= {of})")),
        }
    }
}

/// The public names of module `m` of crate `c`: its `pub mod`s, `pub`
/// items and `pub use`s (and, at the root, the exported macros).
fn names(
    crates: &BTreeMap<String, Crate>,
    c: &str,
    m: usize,
    depth: usize,
) -> Vec<(String, Target)> {
    let Some(krate) = crates.get(c) else {
        return Vec::new();
    };
    let module = &krate.modules[m];
    let mut out = Vec::new();
    for (name, &child) in &module.children {
        if krate.modules[child].public {
            out.push((name.clone(), Target::Module(c.to_owned(), child)));
        }
    }
    for (name, kind, public, hidden) in &module.items {
        if *public && *kind != "macro" {
            out.push((name.clone(), Target::Item(kind, *hidden)));
        }
    }
    if m == 0 {
        for module in &krate.modules {
            for (name, kind, exported, hidden) in &module.items {
                if *kind == "macro" && *exported {
                    out.push((name.clone(), Target::Item("macro", *hidden)));
                }
            }
        }
    }
    for (used, public) in &module.uses {
        if *public && depth <= MAX_DEPTH {
            out.extend(follow(crates, c, m, used, depth + 1));
        }
    }
    out
}

/// The names a `use` in module `m` of crate `c` binds, and what each is.
fn follow(
    crates: &BTreeMap<String, Crate>,
    c: &str,
    m: usize,
    used: &UsePath,
    depth: usize,
) -> Vec<(String, Target)> {
    let external = || Target::External(used.segs.join("::"));
    let krate = &crates[c];
    let (tc, tm, rest) = match source::resolve(krate, m, &used.segs) {
        Some((tm, rest)) => (c.to_owned(), tm, rest.to_vec()),
        None => {
            let Some((first, tail)) = used.segs.split_first() else {
                return Vec::new();
            };
            let Some(other) = crates.get(first) else {
                return used
                    .bound()
                    .map(|b| vec![(b.to_owned(), external())])
                    .unwrap_or_default();
            };
            let segs: Vec<String> = std::iter::once("crate".to_owned())
                .chain(tail.iter().cloned())
                .collect();
            match source::resolve(other, 0, &segs) {
                Some((tm, rest)) => (first.clone(), tm, rest.to_vec()),
                None => return Vec::new(),
            }
        }
    };
    if used.glob {
        return match rest.as_slice() {
            [] => names(crates, &tc, tm, depth + 1),
            _ => Vec::new(),
        };
    }
    let Some(bound) = used.bound() else {
        return Vec::new();
    };
    let targets = match rest.as_slice() {
        [] => vec![Target::Module(tc, tm)],
        [name] => lookup(crates, &tc, tm, name, depth + 1),
        _ => vec![Target::Item("item", false)],
    };
    // Found in the workspace, but not defined by an item the reader sees
    // (made by a macro or an `include!`): its kind is unknown.
    let targets = if targets.is_empty() {
        vec![Target::Item("item", false)]
    } else {
        targets
    };
    targets.into_iter().map(|t| (bound.to_owned(), t)).collect()
}

/// What `name` is in module `m` of crate `c` (public or not): the items of
/// that name, else what a `use` there binds to it.
fn lookup(
    crates: &BTreeMap<String, Crate>,
    c: &str,
    m: usize,
    name: &str,
    depth: usize,
) -> Vec<Target> {
    if depth > MAX_DEPTH {
        return Vec::new();
    }
    let krate = &crates[c];
    let module = &krate.modules[m];
    let macros = krate
        .modules
        .iter()
        .filter(|_| m == 0)
        .flat_map(|x| &x.items);
    let items: Vec<Target> = module
        .items
        .iter()
        .chain(macros.filter(|i| i.1 == "macro" && i.2))
        .filter(|i| i.0 == name)
        .map(|i| Target::Item(i.1, i.3))
        .collect();
    if !items.is_empty() {
        return items;
    }
    if let Some(&child) = module.children.get(name) {
        return vec![Target::Module(c.to_owned(), child)];
    }
    module
        .uses
        .iter()
        .filter(|(u, _)| u.bound() == Some(name))
        .flat_map(|(u, _)| follow(crates, c, m, u, depth + 1))
        .map(|(_, t)| t)
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn lists_pub_mod_chains_reexports_globs_and_macros_with_kinds() {
        let dir = std::env::temp_dir().join(format!("public-api-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let files = [
            (
                "outbox-a/src/lib.rs",
                "pub mod open;\nmod hidden;\npub use hidden::{Thing, make as build, Inner};\npub use hidden::deep::*;\npub use outbox_b::Other;\npub use outbox_b as b;\npub use serde::Serialize;\npub(crate) fn private() {}\n#[cfg(test)]\nmod tests { pub fn not_listed() {} }\n",
            ),
            (
                "outbox-a/src/open.rs",
                "pub const LIMIT: u32 = 1;\npub(crate) struct NotPublic;\npub trait Seen {}\nimpl Seen for u8 { fn not_an_item() {} }\n",
            ),
            (
                "outbox-a/src/hidden.rs",
                "pub mod deep;\npub struct Thing;\npub fn make() {}\npub use self::inner::Inner;\nmod inner { pub enum Inner {} }\n#[macro_export]\n#[doc(hidden)]\nmacro_rules! helper { () => {} }\n",
            ),
            ("outbox-a/src/hidden/deep.rs", "pub static GLOBBED: u8 = 0;\npub type Alias = u8;\n"),
            ("outbox-b/src/lib.rs", "mod x;\npub use x::Other;\n"),
            ("outbox-b/src/x.rs", "pub union Other { a: u8 }\n"),
        ];
        for (path, text) in files {
            let file = dir.join("crates").join(path);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(file, text).unwrap();
        }
        let got = list(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            got,
            [
                "outbox_a::Alias type",
                "outbox_a::GLOBBED static",
                "outbox_a::Inner enum",
                "outbox_a::Other union",
                "outbox_a::Serialize use (= serde::Serialize)",
                "outbox_a::Thing struct",
                "outbox_a::b mod (= outbox_b)",
                "outbox_a::build fn",
                "outbox_a::helper macro #[doc(hidden)]",
                "outbox_a::open mod",
                "outbox_a::open::LIMIT const",
                "outbox_a::open::Seen trait",
                "outbox_b::Other union",
            ]
        );
    }
}
