//! The README's configuration table, generated from the same sections the
//! command line is built from: the relay's own settings and each backend's
//! descriptor.
//!
//! `outbox-relay config-table` prints it; `--check README.md` fails when the
//! README's copy (between the markers) differs; `--write README.md` updates
//! it. The README shows every backend, so checking and writing need a build
//! with all of them (`--all-features`).

use crate::backends;
use crate::config::{self, REQUIRED};
use anyhow::{bail, Context as _};
use outbox_core::backend::SettingKind;
use std::path::Path;

/// The line before the table.
pub(crate) const START: &str = "<!-- config-table:start -->";
/// The line after the table.
pub(crate) const END: &str = "<!-- config-table:end -->";
/// The command that regenerates it, told when it is stale.
pub(crate) const FIX: &str =
    "cargo run -p outbox-relay --all-features -- config-table --write README.md";

/// The table in Markdown, one row per setting of this build.
pub(crate) fn markdown() -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "<!-- generated from the settings and the backends' descriptors: {FIX} -->\n"
    ));
    out.push_str("| flag | env | `outbox.toml` key | default | |\n");
    out.push_str("| --- | --- | --- | --- | --- |\n");
    for section in config::all_sections() {
        for s in section.settings {
            let key = section.key(s);
            let flag = format!("`--{} {}`", section.flag(s), s.value_name());
            let env = section
                .env(s)
                .map_or_else(|| "-".to_owned(), |e| format!("`{e}`"));
            let file_key = match s.kind() {
                _ if key == "config" => "-".to_owned(),
                SettingKind::Map { .. } => format!("`[{key}]` table"),
                _ => format!("`{key}`"),
            };
            let default = match s.default() {
                Some(d) => format!("`{}`", config::shown_default(d)),
                None if REQUIRED.contains(&key.as_str()) => "required".to_owned(),
                None => "none".to_owned(),
            };
            let mut help = s.help().to_owned();
            if let Some(note) = config::build_note(&section, s) {
                help = format!("{help} {note}");
            }
            if let Some(d) = section.backend {
                help = format!("{help} (feature `{}`)", d.name());
            }
            out.push_str(&format!(
                "| {flag} | {env} | {file_key} | {default} | {} |\n",
                help.replace('|', "\\|")
            ));
        }
    }
    out
}

/// The text between the markers of `readme`.
fn current(readme: &str) -> Option<(usize, usize)> {
    let start = readme.find(START)? + START.len();
    let end = start + readme[start..].find(END)?;
    Some((start, end))
}

fn needs_every_backend() -> anyhow::Result<()> {
    let missing: Vec<&str> = backends::missing().map(|k| k.feature).collect();
    if !missing.is_empty() {
        bail!(
            "the README's table lists every backend: rebuild with --all-features (missing: {})",
            missing.join(", ")
        );
    }
    Ok(())
}

/// The README with its table regenerated.
pub(crate) fn updated(readme: &str) -> anyhow::Result<String> {
    let Some((start, end)) = current(readme) else {
        bail!("no `{START}` ... `{END}` markers");
    };
    Ok(format!(
        "{}\n{}{}",
        &readme[..start],
        markdown(),
        &readme[end..]
    ))
}

/// Fails when the table in `path` is not what this build generates.
pub(crate) fn check(path: &Path) -> anyhow::Result<()> {
    needs_every_backend()?;
    let readme =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let updated = updated(&readme).with_context(|| format!("in {}", path.display()))?;
    if updated != readme {
        bail!(
            "the configuration table in {} is stale: run `{FIX}`",
            path.display()
        );
    }
    Ok(())
}

/// Rewrites the table in `path`.
pub(crate) fn write(path: &Path) -> anyhow::Result<()> {
    needs_every_backend()?;
    let readme =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let updated = updated(&readme).with_context(|| format!("in {}", path.display()))?;
    if updated != readme {
        std::fs::write(path, updated)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_one_row_per_setting() {
        let table = markdown();
        let rows = config::all_sections()
            .iter()
            .map(|s| s.settings.len())
            .sum::<usize>();
        assert_eq!(
            table.lines().filter(|l| l.starts_with("| `--")).count(),
            rows
        );
        assert!(table.contains("| `--store URL` | `OUTBOX_STORE` | `store` | required |"));
        assert!(table.contains("| `--batch-size N` | `OUTBOX_BATCH_SIZE` | `batch_size` | `20` |"));
    }

    #[test]
    fn update_replaces_only_between_the_markers() {
        let readme = format!("before\n{START}\nold\n{END}\nafter\n");
        let new = updated(&readme).unwrap();
        assert!(new.starts_with(&format!("before\n{START}\n<!-- generated")));
        assert!(new.ends_with(&format!("|\n{END}\nafter\n")));
        assert_eq!(updated(&new).unwrap(), new);
    }

    /// The README at the workspace root is current (CI runs the tests with
    /// every feature; `cargo xtask tidy` runs `config-table --check`).
    #[cfg(all(
        feature = "sqlite",
        feature = "postgres",
        feature = "nats",
        feature = "amqp",
        feature = "kafka"
    ))]
    #[test]
    fn readme_table_is_current() {
        let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
        if let Err(e) = check(&readme) {
            panic!("{e:#}");
        }
    }
}
