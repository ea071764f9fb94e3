//! A reader of Rust sources as text, for tidy's import check
//! (`tidy/imports.rs`) and `cargo xtask public-api` (`public_api.rs`):
//! stable Rust has no rustdoc JSON, and xtask has no parser dependency.
//!
//! A file is tokenized (comments, strings, characters and lifetimes
//! dropped, so a doc link or an example is no path), items under
//! `#[cfg(test)]` (or `cfg(all(test, ..))`) are dropped (a
//! `#[cfg(test)] mod tests;` file is not read at all), and a crate's module
//! tree is walked from its root file through `mod` declarations (files and
//! inline `mod x { .. }` blocks). Each module records its items (name,
//! kind, visibility), its module-level `use`s and every path it names:
//! `use` paths, and paths in code that start at `crate::`, `super::`,
//! `self::` or a child module's name. Not read: `$crate::` paths (they
//! resolve where a macro is used) and the bodies of `macro_rules!`; every
//! other `#[cfg(..)]` counts as on.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Every crate root under `root/crates`: `src/lib.rs` and `src/main.rs`.
pub(crate) fn crate_roots(root: &Path) -> Vec<PathBuf> {
    let Ok(dirs) = std::fs::read_dir(root.join("crates")) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = dirs
        .flatten()
        .flat_map(|d| ["lib.rs", "main.rs"].map(|f| d.path().join("src").join(f)))
        .filter(|p| p.exists())
        .collect();
    out.sort();
    out
}
/// A token of Rust source: enough to read paths, `use` trees and items.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Tok {
    /// An identifier or keyword (`r#` dropped).
    Ident(String),
    /// `::`
    Sep,
    /// Any other punctuation character.
    Punct(char),
    /// A string, character or number literal (its text dropped).
    Lit,
}

/// A token and the line it starts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Token {
    tok: Tok,
    line: usize,
}

/// Splits `src` into tokens; comments, lifetimes and literals' text go.
pub(crate) fn tokenize(src: &str) -> Vec<Token> {
    let c: Vec<char> = src.chars().collect();
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    let mut push = |tok, line| out.push(Token { tok, line });
    while i < c.len() {
        let (ch, start) = (c[i], line);
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(c[i] == '\n');
                    i += 1;
                }
            }
        } else if let Some(hashes) = raw_string_start(&c, i) {
            // r"..", r#".."#, br".."
            i += hashes.1;
            let closing: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes.0))
                .collect();
            while i < c.len() && !c[i..].starts_with(&closing) {
                line += usize::from(c[i] == '\n');
                i += 1;
            }
            i += closing.len();
            push(Tok::Lit, start);
        } else if ch == '"' || (ch == 'b' && at(i + 1) == '"') {
            i += if ch == 'b' { 2 } else { 1 };
            while i < c.len() && c[i] != '"' {
                line += usize::from(c[i] == '\n');
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            push(Tok::Lit, start);
        } else if ch == '\'' || (ch == 'b' && at(i + 1) == '\'') {
            let q = if ch == 'b' { i + 1 } else { i };
            if at(q + 1) == '\\' {
                i = q + 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
                push(Tok::Lit, start);
            } else if at(q + 2) == '\'' {
                i = q + 3;
                push(Tok::Lit, start);
            } else {
                // A lifetime or label: dropped.
                i = q + 1;
                while is_ident_char(at(i)) {
                    i += 1;
                }
            }
        } else if ch.is_ascii_digit() {
            while is_ident_char(at(i)) || (at(i) == '.' && at(i + 1).is_ascii_digit()) {
                i += 1;
            }
            push(Tok::Lit, start);
        } else if is_ident_char(ch) {
            if ch == 'r' && at(i + 1) == '#' && is_ident_char(at(i + 2)) {
                i += 2;
            }
            let from = i;
            while is_ident_char(at(i)) {
                i += 1;
            }
            push(Tok::Ident(c[from..i].iter().collect()), start);
        } else if ch == ':' && at(i + 1) == ':' {
            i += 2;
            push(Tok::Sep, start);
        } else {
            i += 1;
            push(Tok::Punct(ch), start);
        }
    }
    out
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// At a raw string's start (`r"`, `r#"`, `br#"`): its number of `#` and the
/// length of its opening.
fn raw_string_start(c: &[char], i: usize) -> Option<(usize, usize)> {
    if i > 0 && is_ident_char(c[i - 1]) {
        return None;
    }
    let mut j = i;
    if c.get(j) == Some(&'b') {
        j += 1;
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = c[j..].iter().take_while(|&&x| x == '#').count();
    (c.get(j + hashes) == Some(&'"')).then_some((hashes, j + hashes + 1 - i))
}

fn is_punct(t: Option<&Token>, ch: char) -> bool {
    matches!(t, Some(Token { tok: Tok::Punct(p), .. }) if *p == ch)
}

fn ident(t: Option<&Token>) -> Option<&str> {
    match t {
        Some(Token {
            tok: Tok::Ident(s), ..
        }) => Some(s),
        _ => None,
    }
}

/// The index of the bracket closing the one at `open` (or the end).
fn matching(t: &[Token], open: usize) -> usize {
    let mut depth = 0usize;
    for (i, tok) in t.iter().enumerate().skip(open) {
        match tok.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    t.len()
}

/// The tokens without what `#[cfg(test)]` (or `cfg(all(test, ..))`)
/// guards; empty for a file that starts with `#![cfg(test)]`.
pub(crate) fn strip_test_only(t: Vec<Token>) -> Vec<Token> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        let Some(after) = test_attribute_end(&t, i) else {
            out.push(t[i].clone());
            i += 1;
            continue;
        };
        if is_punct(t.get(i + 1), '!') {
            if out.is_empty() {
                return Vec::new();
            }
            i = after;
            continue;
        }
        // Further attributes of the same item, then the item.
        let mut j = after;
        while is_punct(t.get(j), '#') && is_punct(t.get(j + 1), '[') {
            j = matching(&t, j + 1) + 1;
        }
        i = item_end(&t, j);
    }
    out
}

/// If `t[i..]` is a test-only `#[cfg(..)]` (or `#![cfg(..)]`), the index
/// after it.
fn test_attribute_end(t: &[Token], i: usize) -> Option<usize> {
    if !is_punct(t.get(i), '#') {
        return None;
    }
    let open = if is_punct(t.get(i + 1), '!') {
        i + 2
    } else {
        i + 1
    };
    if !is_punct(t.get(open), '[')
        || ident(t.get(open + 1)) != Some("cfg")
        || !is_punct(t.get(open + 2), '(')
    {
        return None;
    }
    let close = matching(t, open + 2);
    let pred = t.get(open + 3..close)?;
    let test = |p: &[Token]| matches!(p, [Token { tok: Tok::Ident(s), .. }] if s == "test");
    let only = test(pred)
        || (ident(pred.first()) == Some("all")
            && split_commas(pred.get(2..pred.len().saturating_sub(1))?)
                .iter()
                .any(|p| test(p)));
    only.then(|| matching(t, open) + 1)
}

/// The index after the item starting at `j`: its `;` or its `{ .. }`.
fn item_end(t: &[Token], j: usize) -> usize {
    let mut depth = 0usize;
    let mut k = j;
    while k < t.len() {
        match t[k].tok {
            Tok::Punct('{') if depth == 0 => return matching(t, k) + 1,
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') if depth == 0 => return k,
            Tok::Punct(')' | ']' | '}') => depth -= 1,
            Tok::Punct(';') if depth == 0 => return k + 1,
            _ => {}
        }
        k += 1;
    }
    k
}

/// `t` split at the commas outside brackets.
fn split_commas(t: &[Token]) -> Vec<&[Token]> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, tok) in t.iter().enumerate() {
        match tok.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => depth = depth.saturating_sub(1),
            Tok::Punct(',') if depth == 0 => {
                parts.push(&t[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&t[start..]);
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

/// One path of a `use` tree: `use a::{b, c as d, e::*}` is three.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UsePath {
    /// The segments, `self` at the end dropped.
    pub(crate) segs: Vec<String>,
    /// `as NAME`.
    pub(crate) alias: Option<String>,
    /// Ends in `::*`.
    pub(crate) glob: bool,
}

impl UsePath {
    /// The name this path binds (its alias or last segment); none for a
    /// glob or `as _`.
    pub(crate) fn bound(&self) -> Option<&str> {
        if self.glob {
            return None;
        }
        match &self.alias {
            Some(a) if a == "_" => None,
            Some(a) => Some(a),
            None => self.segs.last().map(String::as_str),
        }
    }
}

/// Expands a `use` tree (the tokens between `use` and `;`).
pub(crate) fn use_tree(t: &[Token], prefix: &[String], out: &mut Vec<UsePath>) {
    let mut segs = prefix.to_vec();
    let (mut alias, mut glob) = (None, false);
    let mut i = 0;
    while let Some(tok) = t.get(i) {
        match &tok.tok {
            Tok::Ident(s) if s == "as" => {
                alias = ident(t.get(i + 1)).map(str::to_owned);
                break;
            }
            Tok::Ident(s) => segs.push(s.clone()),
            Tok::Sep => {}
            Tok::Punct('*') => {
                glob = true;
                break;
            }
            Tok::Punct('{') => {
                let close = matching(t, i).min(t.len());
                for part in split_commas(&t[i + 1..close]) {
                    use_tree(part, &segs, out);
                }
                return;
            }
            _ => break,
        }
        i += 1;
    }
    if segs.last().is_some_and(|s| s == "self") {
        segs.pop();
    }
    if !segs.is_empty() {
        out.push(UsePath { segs, alias, glob });
    }
}

/// What a module defines, declares and uses.
#[derive(Debug, Clone, Default)]
pub(crate) struct Module {
    /// Its path from the crate root (`["log", "claim"]`).
    pub(crate) path: Vec<String>,
    /// The file it is written in (an inline module: its parent's).
    pub(crate) file: PathBuf,
    /// Declared `pub` (no restriction), this module alone.
    pub(crate) public: bool,
    /// The parent module's index (none for the root).
    pub(crate) parent: Option<usize>,
    /// Child modules by name.
    pub(crate) children: BTreeMap<String, usize>,
    /// Items defined here: (name, kind, `pub`, `#[doc(hidden)]`).
    pub(crate) items: Vec<(String, &'static str, bool, bool)>,
    /// The module-level `use`s: (path, `pub`).
    pub(crate) uses: Vec<(UsePath, bool)>,
    /// Every path read in it (`use` paths included), with its line.
    pub(crate) refs: Vec<(Vec<String>, usize)>,
    /// The folder where its `mod x;` children's files are.
    dir: PathBuf,
}

/// A crate's module tree; module 0 is the root.
#[derive(Debug, Clone, Default)]
pub(crate) struct Crate {
    pub(crate) modules: Vec<Module>,
}

/// Reads the crate whose root file is `root_file`.
pub(crate) fn load_crate(root_file: &Path) -> Crate {
    let mut krate = Crate::default();
    krate.modules.push(Module {
        file: root_file.to_path_buf(),
        public: true,
        dir: root_file
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
        ..Module::default()
    });
    let text = std::fs::read_to_string(root_file).unwrap_or_default();
    let tokens = strip_test_only(tokenize(&text));
    parse_module(&mut krate, 0, &tokens);
    krate
}

/// Item keywords and the kind each defines.
const ITEM_KINDS: &[(&str, &str)] = &[
    ("fn", "fn"),
    ("struct", "struct"),
    ("enum", "enum"),
    ("union", "union"),
    ("trait", "trait"),
    ("type", "type"),
    ("const", "const"),
    ("static", "static"),
];

/// Reads one module body (`t`, already without test-only items) into
/// `krate.modules[m]`, its child modules first.
fn parse_module(krate: &mut Crate, m: usize, t: &[Token]) {
    // Child modules first, so that a path may start at one's name.
    let mut inline = Vec::new();
    walk_depth0(t, |i| {
        if ident(t.get(i)) != Some("mod") {
            return None;
        }
        let name = ident(t.get(i + 1))?.to_owned();
        let public = visibility(t, i) == Some(true);
        let child = add_child(krate, m, &name, public);
        if is_punct(t.get(i + 2), '{') {
            let close = matching(t, i + 2);
            inline.push((child, i + 2, close));
            parse_module(krate, child, &t[i + 3..close.min(t.len())]);
            return Some(close + 1);
        }
        let dir = krate.modules[m].dir.clone();
        let file = [
            dir.join(format!("{name}.rs")),
            dir.join(&name).join("mod.rs"),
        ]
        .into_iter()
        .find(|p| p.exists());
        if let Some(file) = file {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            let own_dir = if file.ends_with("mod.rs") {
                file.parent().map(Path::to_path_buf).unwrap_or_default()
            } else {
                dir.join(&name)
            };
            krate.modules[child].file = file;
            krate.modules[child].dir = own_dir;
            parse_module(krate, child, &strip_test_only(tokenize(&text)));
        }
        Some(i + 2)
    });
    // Items, `use`s and paths.
    let (mut depth, mut i) = (0usize, 0);
    let (mut exported, mut hidden) = (false, false);
    while i < t.len() {
        if depth == 0 {
            if let Some(&(_, _, close)) = inline.iter().find(|(_, open, _)| *open == i) {
                i = close + 1;
                continue;
            }
        }
        let tok = &t[i];
        match &tok.tok {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth = depth.saturating_sub(1),
            Tok::Punct('#') if depth == 0 && is_punct(t.get(i + 1), '[') => {
                let close = matching(t, i + 1);
                let attr = &t[i + 2..close.min(t.len())];
                exported |= ident(attr.first()) == Some("macro_export");
                hidden |= ident(attr.first()) == Some("doc")
                    && attr.iter().any(|a| a.tok == Tok::Ident("hidden".into()));
                i = close + 1;
                continue;
            }
            Tok::Ident(s) if s == "use" && !is_punct(t.get(i + 1), '!') => {
                let end = (i..t.len())
                    .find(|&k| is_punct(t.get(k), ';'))
                    .unwrap_or(t.len());
                let mut paths = Vec::new();
                use_tree(&t[i + 1..end], &[], &mut paths);
                let public = visibility(t, i) == Some(true);
                let module = &mut krate.modules[m];
                for p in paths {
                    let mut segs = p.segs.clone();
                    if p.glob {
                        segs.push("*".to_owned());
                    }
                    module.refs.push((segs, tok.line));
                    if depth == 0 {
                        module.uses.push((p, public));
                    }
                }
                i = end + 1;
                continue;
            }
            Tok::Ident(s) if s == "macro_rules" && is_punct(t.get(i + 1), '!') => {
                if let (0, Some(name)) = (depth, ident(t.get(i + 2))) {
                    let item = (name.to_owned(), "macro", exported, hidden);
                    krate.modules[m].items.push(item);
                }
                let open =
                    (i..t.len()).find(|&k| is_punct(t.get(k), '{') || is_punct(t.get(k), '('));
                i = open.map_or(t.len(), |o| matching(t, o) + 1);
                (exported, hidden) = (false, false);
                continue;
            }
            Tok::Ident(s) if depth == 0 => {
                let kind = ITEM_KINDS.iter().find(|(k, _)| k == s).map(|(_, k)| *k);
                let mut n = i + 1;
                if ident(t.get(n)) == Some("mut") {
                    n += 1;
                }
                let name = ident(t.get(n))
                    .filter(|n| !["fn", "unsafe", "async", "extern", "_"].contains(n));
                if let (Some(kind), Some(name)) = (kind, name) {
                    let public = visibility(t, i) == Some(true);
                    krate.modules[m]
                        .items
                        .push((name.to_owned(), kind, public, hidden));
                    (exported, hidden) = (false, false);
                }
            }
            _ => {}
        }
        if let Some((path, next)) = path_at(krate, m, t, i) {
            krate.modules[m].refs.push((path, tok.line));
            i = next;
            continue;
        }
        i += 1;
    }
}

/// Calls `f` at each token index of `t` at brace depth 0; `f` returns
/// where to go on, or `None` to step one token.
fn walk_depth0(t: &[Token], mut f: impl FnMut(usize) -> Option<usize>) {
    let (mut depth, mut i) = (0usize, 0);
    while i < t.len() {
        if depth == 0 {
            if let Some(next) = f(i) {
                i = next;
                continue;
            }
        }
        match t[i].tok {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
}

/// The visibility of the item whose keyword is at `i`: `Some(true)` for
/// `pub`, `Some(false)` for `pub(..)`, `None` for private.
fn visibility(t: &[Token], i: usize) -> Option<bool> {
    let mut k = i;
    while k > 0 {
        k -= 1;
        match &t[k].tok {
            Tok::Ident(s)
                if ["async", "unsafe", "const", "extern", "safe", "default"]
                    .contains(&s.as_str()) => {}
            Tok::Lit => {}
            Tok::Ident(s) if s == "pub" => return Some(true),
            Tok::Punct(')') => {
                let open = (0..k).rev().find(|&o| is_punct(t.get(o), '('))?;
                return (ident(t.get(open.checked_sub(1)?)) == Some("pub")).then_some(false);
            }
            _ => return None,
        }
    }
    None
}

fn add_child(krate: &mut Crate, m: usize, name: &str, public: bool) -> usize {
    let parent = &krate.modules[m];
    let mut path = parent.path.clone();
    path.push(name.to_owned());
    let child = Module {
        path,
        file: parent.file.clone(),
        public,
        parent: Some(m),
        dir: parent.dir.join(name),
        ..Module::default()
    };
    krate.modules.push(child);
    let idx = krate.modules.len() - 1;
    krate.modules[m].children.insert(name.to_owned(), idx);
    idx
}

/// A path in code starting at `t[i]` (`crate::`, `super::`, `self::` or a
/// child module's name, then `::`, not inside another path, not
/// `$crate`): its segments and the index after it.
fn path_at(krate: &Crate, m: usize, t: &[Token], i: usize) -> Option<(Vec<String>, usize)> {
    let first = ident(t.get(i))?;
    let starts = matches!(first, "crate" | "super" | "self")
        || krate.modules[m].children.contains_key(first);
    let prev = i.checked_sub(1).and_then(|p| t.get(p));
    if !starts
        || t.get(i + 1).map(|x| &x.tok) != Some(&Tok::Sep)
        || matches!(prev.map(|p| &p.tok), Some(Tok::Sep | Tok::Punct('$' | '.')))
    {
        return None;
    }
    let mut segs = vec![first.to_owned()];
    let mut k = i + 1;
    while t.get(k).map(|x| &x.tok) == Some(&Tok::Sep) {
        let Some(s) = ident(t.get(k + 1)) else { break };
        segs.push(s.to_owned());
        k += 2;
    }
    Some((segs, k))
}

/// The module a path read in module `m` names (its deepest module), and
/// the rest of the path; `None` for a path outside the crate.
pub(crate) fn resolve<'a>(
    krate: &Crate,
    m: usize,
    segs: &'a [String],
) -> Option<(usize, &'a [String])> {
    let first = segs.first()?;
    let (mut cur, mut rest) = match first.as_str() {
        "crate" => (0, &segs[1..]),
        "self" => (m, &segs[1..]),
        "super" => (krate.modules[m].parent?, &segs[1..]),
        name if krate.modules[m].children.contains_key(name) => (m, segs),
        _ => return None,
    };
    while let Some((seg, tail)) = rest.split_first() {
        let module = &krate.modules[cur];
        cur = match seg.as_str() {
            "super" => module.parent?,
            _ => match module.children.get(seg) {
                Some(&c) => c,
                None => break,
            },
        };
        rest = tail;
    }
    Some((cur, rest))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;

    /// Writes `files` (path relative to `src/`, text) into a fresh folder
    /// and returns it.
    pub(crate) fn fixture(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tidy-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let file = dir.join("src").join(path);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(file, text).unwrap();
        }
        dir
    }

    fn uses(src: &str) -> Vec<String> {
        let t = tokenize(src);
        let mut out = Vec::new();
        use_tree(&t, &[], &mut out);
        out.iter()
            .map(|u| {
                let mut s = u.segs.join("::");
                if u.glob {
                    s.push_str("::*");
                }
                if let Some(a) = &u.alias {
                    s.push_str(&format!(" as {a}"));
                }
                s
            })
            .collect()
    }

    #[test]
    fn nested_use_trees_expand_to_one_path_per_name() {
        assert_eq!(
            uses("crate::{a::{B, c::{D as E, self}}, f, g::*, h::{self as hh}}"),
            [
                "crate::a::B",
                "crate::a::c::D as E",
                "crate::a::c",
                "crate::f",
                "crate::g::*",
                "crate::h as hh"
            ]
        );
    }

    #[test]
    fn comments_strings_and_lifetimes_are_no_tokens() {
        let src = "/// [`crate::Doc`]\n/* crate::Block /* nested */ */ fn f<'a>(x: &'a str) -> char { let _ = r#\"crate::Raw\"#; let _ = \"crate::Str\"; 'c' }";
        let idents: Vec<String> = tokenize(src)
            .into_iter()
            .filter_map(|t| match t.tok {
                Tok::Ident(s) => Some(s),
                _ => None,
            })
            .collect();
        assert_eq!(
            idents,
            ["fn", "f", "x", "str", "char", "let", "_", "let", "_"]
        );
    }

    #[test]
    fn test_only_items_are_dropped_and_others_kept() {
        let src = "use crate::a::A;\n#[cfg(test)]\nmod tests { use crate::b::B; }\n#[cfg(all(test, feature = \"x\"))]\n#[allow(dead_code)]\nuse crate::c::C;\n#[cfg(not(test))]\nuse crate::d::D;\n#[cfg(test)]\nmod more;\nfn after() {}";
        let kept = strip_test_only(tokenize(src));
        let idents: Vec<String> = kept
            .into_iter()
            .filter_map(|t| match t.tok {
                Tok::Ident(s) => Some(s),
                _ => None,
            })
            .collect();
        assert_eq!(
            idents,
            [
                "use", "crate", "a", "A", "cfg", "not", "test", "use", "crate", "d", "D", "fn",
                "after"
            ]
        );
        assert!(strip_test_only(tokenize("#![cfg(test)]\nuse crate::x;")).is_empty());
    }
}
