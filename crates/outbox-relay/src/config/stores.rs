//! Several stores for one `run` (or `status`, or `console`): `--store NAME=URL` (repeated) and the
//! `--stores FILE` list, turned into one [`Resolved`] per store (the
//! command's settings with that store's own on top) under a validated,
//! unique [`StoreName`].
//!
//! A plain `--store URL` (or `OUTBOX_STORE`, or `store =` in outbox.toml)
//! with no list is the one unnamed store of every other command, exactly
//! as before: [`plan`] says so with `None`.
//!
//! The list file:
//!
//! ```toml
//! [[store]]
//! name = "tenant-a"
//! url = "postgres://relay@db-a/app"
//! postgres_schema = "outbox"   # any key of outbox.toml but the sink's,
//! group = "billing"            # the HTTP endpoints' and the console's
//!
//! [[store]]
//! name = "tenant-b"
//! url = "postgres://relay@db-b/app"
//! ```

use super::{
    file_layer, Entry, Layer, Resolved, Source, CLOUDEVENTS_SOURCE_KEY, CONFIG_KEY,
    CONSOLE_ADDR_KEY, SINK_KEY, STORES_KEY, STORE_KEY, WIRE_FORMAT_KEY,
};
use anyhow::{anyhow, bail, Context as _};
use outbox_core::backend::SettingValue;
use outbox_worker::StoreName;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// One store of a `run` over several.
#[derive(Debug)]
pub(crate) struct StoreSpec {
    /// Its name: the `store` label of its metrics, its log span, its
    /// section of `/readyz`.
    pub(crate) name: StoreName,
    /// The command's settings with this store's on top (its URL as
    /// `store`).
    pub(crate) resolved: Resolved,
}

/// Settings a store in the list cannot set: they are the process's (one
/// sink, one HTTP listener, one console), or name other stores.
fn process_wide(key: &str) -> bool {
    [
        SINK_KEY,
        WIRE_FORMAT_KEY,
        CLOUDEVENTS_SOURCE_KEY,
        "metrics_addr",
        CONSOLE_ADDR_KEY,
        CONFIG_KEY,
        STORES_KEY,
        STORE_KEY,
    ]
    .contains(&key)
        || key.starts_with("console_")
}

/// `NAME=URL` split into its name and URL; `None` for a plain URL. The
/// text before the first `=` is a name only when it could be one (no `:`,
/// `/`, `?`, `.`): `postgres://h/db?sslmode=require` is a plain URL.
pub(crate) fn split_named(text: &str) -> Option<(&str, &str)> {
    let (name, url) = text.split_once('=')?;
    let could_be_name = !name.is_empty()
        && !name
            .chars()
            .any(|c| matches!(c, ':' | '/' | '?' | '.' | '@' | '\\'));
    could_be_name.then_some((name.trim(), url.trim()))
}

impl Resolved {
    /// Whether the settings name several stores, or a named one, or a
    /// list: only `run`, `status` and `console` take those.
    pub(crate) fn names_several_stores(&self) -> bool {
        self.store_flags.len() > 1
            || self.layer.text(STORES_KEY).is_some()
            || self
                .layer
                .text(STORE_KEY)
                .is_some_and(|s| split_named(s).is_some())
    }

    /// This settings' store with `url` and `extra` on top, and no list.
    fn for_store(&self, url: String, source: Source, extra: &Layer) -> Resolved {
        let mut layer = self.layer.clone().overlaid(extra);
        layer.entries.remove(STORES_KEY);
        layer.entries.insert(
            STORE_KEY.to_owned(),
            Entry {
                value: SettingValue::Text(url),
                source,
            },
        );
        Resolved {
            layer,
            file: self.file.clone(),
            store_flags: Vec::new(),
        }
    }
}

/// The stores of a `run`: `None` for the one unnamed store (a plain URL,
/// no list), else every store named by `--store NAME=URL` (or the one
/// `store` setting's `NAME=URL`) and by the `--stores` file, each with its
/// settings. Refused: a store without a name among several, a name that is
/// not one ([`StoreName`]), two stores with one name, a list file that does
/// not parse or sets a key it cannot.
pub(crate) fn plan(resolved: &Resolved) -> anyhow::Result<Option<Vec<StoreSpec>>> {
    if !resolved.names_several_stores() {
        return Ok(None);
    }
    let given: Vec<(String, Source)> = if resolved.store_flags.is_empty() {
        resolved
            .layer
            .entries
            .get(STORE_KEY)
            .and_then(|e| match &e.value {
                SettingValue::Text(t) if !t.trim().is_empty() => {
                    Some((t.trim().to_owned(), e.source.clone()))
                }
                _ => None,
            })
            .into_iter()
            .collect()
    } else {
        resolved
            .store_flags
            .iter()
            .map(|s| (s.trim().to_owned(), Source::Flag(STORE_KEY.to_owned())))
            .collect()
    };
    let mut specs = Vec::new();
    for (i, (text, source)) in given.iter().enumerate() {
        let Some((name, url)) = split_named(text) else {
            bail!(
                "store {} of {} ({source}) has no name: with several stores, or a store list, every store is named: --store NAME=URL (NAME: lowercase letters, digits, '_', '-')",
                i + 1,
                given.len()
            );
        };
        let name = StoreName::new(name).with_context(|| format!("in {source}"))?;
        if url.is_empty() {
            bail!("store {name} ({source}) has no URL: --store {name}=URL");
        }
        specs.push(StoreSpec {
            name,
            resolved: resolved.for_store(url.to_owned(), source.clone(), &Layer::default()),
        });
    }
    if let Some(path) = resolved.layer.text(STORES_KEY) {
        let path = PathBuf::from(path.trim());
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read the store list {}", path.display()))?;
        specs.extend(list(resolved, &text, &path)?);
    }
    let mut seen = BTreeSet::new();
    for spec in &specs {
        if !seen.insert(spec.name.clone()) {
            bail!(
                "two stores are named {:?}: each store's name must be unique (it labels its metrics, logs and /readyz section)",
                spec.name.as_str()
            );
        }
    }
    if specs.is_empty() {
        bail!("the store list names no store: add a [[store]] table with name and url");
    }
    Ok(Some(specs))
}

/// The `[[store]]` tables of the list file `text` (read from `path`).
fn list(resolved: &Resolved, text: &str, path: &Path) -> anyhow::Result<Vec<StoreSpec>> {
    let shown = path.display();
    let mut table: toml::Table =
        toml::from_str(text).with_context(|| format!("invalid store list {shown}"))?;
    let stores = table.remove("store");
    if let Some(key) = table.keys().next() {
        bail!("unknown key `{key}` in the store list {shown}: it holds [[store]] tables only");
    }
    let Some(toml::Value::Array(stores)) = stores else {
        bail!("the store list {shown} holds no [[store]] table: add one per store, each with name and url");
    };
    let mut specs = Vec::new();
    for (i, store) in stores.into_iter().enumerate() {
        let at = format!("[[store]] {} of {shown}", i + 1);
        let toml::Value::Table(mut store) = store else {
            bail!("{at} is not a table: write [[store]] then name = \"...\" and url = \"...\"");
        };
        let mut text_of = |key: &str| -> anyhow::Result<String> {
            match store.remove(key) {
                Some(toml::Value::String(s)) if !s.trim().is_empty() => Ok(s.trim().to_owned()),
                Some(_) => bail!("`{key}` in {at} must be a non-empty string"),
                None => bail!("{at} has no `{key}`"),
            }
        };
        let name = text_of("name")?;
        let url = text_of("url")?;
        let name = StoreName::new(name).with_context(|| format!("in {at}"))?;
        let at = format!("[[store]] {name} of {shown}");
        if let Some(key) = store.keys().find(|k| process_wide(k)) {
            bail!("`{key}` in {at} is the process's, not a store's: set it once, outside the store list");
        }
        let extra = file_layer(store, Path::new(&at)).map_err(|e| anyhow!("{e:#}"))?;
        let source = Source::File {
            key: "url".to_owned(),
            path: PathBuf::from(&at),
        };
        specs.push(StoreSpec {
            resolved: resolved.for_store(url, source, &extra),
            name,
        });
    }
    Ok(specs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base(flags: &[&str], file: &str) -> Resolved {
        let table: toml::Table = toml::from_str(file).unwrap();
        Resolved {
            layer: file_layer(table, Path::new("outbox.toml")).unwrap(),
            file: None,
            store_flags: flags.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    fn listed(text: &str) -> anyhow::Result<Vec<StoreSpec>> {
        list(&base(&[], ""), text, Path::new("stores.toml"))
    }

    #[test]
    fn a_plain_url_is_the_one_unnamed_store() {
        for flags in [&["sqlite://a.db"][..], &["postgres://h/db?sslmode=require"]] {
            assert!(plan(&base(flags, "")).unwrap().is_none(), "{flags:?}");
        }
        assert!(plan(&base(&[], "store = \"sqlite://a.db\""))
            .unwrap()
            .is_none());
        assert_eq!(
            split_named("a=postgres://h/db?x=1"),
            Some(("a", "postgres://h/db?x=1"))
        );
        assert_eq!(split_named("postgres://h/db?x=1"), None);
        assert_eq!(split_named("./a.db?mode=rwc"), None);
    }

    #[test]
    fn named_flags_make_one_store_each_with_its_url() {
        let specs = plan(&base(
            &["a=sqlite://a.db", "b=sqlite://b.db"],
            "batch_size = 7",
        ))
        .unwrap()
        .unwrap();
        let got: Vec<(String, String)> = specs
            .iter()
            .map(|s| (s.name.to_string(), s.resolved.store_url().unwrap()))
            .collect();
        assert_eq!(
            got,
            [
                ("a".to_owned(), "sqlite://a.db".to_owned()),
                ("b".to_owned(), "sqlite://b.db".to_owned())
            ]
        );
        // The command's settings apply to every store.
        assert_eq!(specs[1].resolved.text("batch_size"), Some("7"));
    }

    #[test]
    fn two_stores_with_one_name_are_refused_naming_it() {
        let err = plan(&base(&["a=sqlite://a.db", "a=sqlite://b.db"], ""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("two stores are named \"a\""), "{err}");
    }

    #[test]
    fn a_store_without_a_name_among_several_is_refused() {
        let err = plan(&base(&["a=sqlite://a.db", "sqlite://b.db"], ""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("store 2 of 2 (--store) has no name"), "{err}");
        let err = format!(
            "{:#}",
            plan(&base(&["Tenant=sqlite://a.db", "b=sqlite://b.db"], "")).unwrap_err()
        );
        assert!(err.contains("invalid store name \"Tenant\""), "{err}");
    }

    #[test]
    fn the_list_gives_each_store_its_own_settings() {
        let specs = listed(
            "[[store]]\nname = \"a\"\nurl = \"sqlite://a.db\"\ngroup = \"billing\"\nbatch_size = 50\n\n[[store]]\nname = \"b\"\nurl = \"sqlite://b.db\"\n",
        )
        .unwrap();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].resolved.text("group"), Some("billing"));
        assert_eq!(specs[0].resolved.text("batch_size"), Some("50"));
        assert_eq!(specs[1].resolved.text("group"), None);
        assert_eq!(specs[1].resolved.store_url().unwrap(), "sqlite://b.db");
    }

    #[test]
    fn a_list_that_does_not_parse_is_refused_with_the_file_named() {
        for (text, want) in [
            ("[[store]\nname = \"a\"", "invalid store list stores.toml"),
            (
                "name = \"a\"",
                "unknown key `name` in the store list stores.toml",
            ),
            ("", "holds no [[store]] table"),
            (
                "[[store]]\nurl = \"sqlite://a.db\"",
                "[[store]] 1 of stores.toml has no `name`",
            ),
            ("[[store]]\nname = \"a\"", "has no `url`"),
            (
                "[[store]]\nname = \"a\"\nurl = \"sqlite://a.db\"\nsink = \"stdout\"",
                "`sink` in [[store]] a of stores.toml is the process's",
            ),
            (
                "[[store]]\nname = \"a\"\nurl = \"sqlite://a.db\"\nbatch_sise = 5",
                "unknown key `batch_sise` in [[store]] a of stores.toml",
            ),
        ] {
            let err = format!("{:#}", listed(text).unwrap_err());
            assert!(err.contains(want), "{text:?}: {err}");
        }
    }
}
