//! `cargo xtask package`: every crate meant for users packages, builds on
//! its own, and works from a project outside the workspace.
//!
//! 1. [`package`]: `cargo package --no-verify` of every publishable member
//!    (those without `publish = false`), each `.crate` unpacked into a
//!    directory outside the workspace. Cargo's own verify build is not
//!    used: it resolves a packaged crate's dependencies on crates.io first
//!    and only then on the other packaged members, and crates.io already
//!    has an unrelated `outbox-core 0.1.0`, so it built `outbox-broker`
//!    against that. Step 2 builds every unpacked crate instead, with
//!    `[patch.crates-io]`, which always wins.
//! 2. [`outside_project`]: a project outside the workspace that depends on
//!    every packaged library *by version* with `[patch.crates-io]`
//!    pointing at the unpacked directories, and whose `main.rs` is
//!    `xtask/quickstart/main.rs`, the README's quick start (tidy keeps the
//!    two equal); the binary crate `outbox-relay` is built from its
//!    unpacked directory with the same patches. A file a crate reads from
//!    outside its directory, or a dependency without a version, fails
//!    here. With `run`, the quick start runs against the loopback
//!    PostgreSQL (schema `quickstart`) and asserts its event was
//!    delivered, so it needs the services: `ci` runs it after
//!    `services::ensure_all()`.
//!
//! Both share the workspace's target directory, so a warm run rebuilds
//! only what changed.

use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The quick start, relative to the workspace root.
pub(crate) const QUICKSTART: &str = "xtask/quickstart/main.rs";

/// The database the outside project runs against (its own schema,
/// `quickstart`); `DATABASE_URL` overrides it.
const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// `cargo xtask package [--no-run]`: packages, then builds and (unless
/// `--no-run`) runs the outside project. Checks PostgreSQL first when it
/// runs it.
pub(crate) fn run(rest: &[String]) -> Result<()> {
    let run = !rest.iter().any(|a| a == "--no-run");
    let crates = package()?;
    let _services = if run {
        Some(crate::services::ensure_all()?)
    } else {
        None
    };
    outside_project(&crates, run)
}

/// A packaged crate: its name, version and unpacked directory.
#[derive(Debug, Clone)]
pub(crate) struct Packaged {
    name: String,
    version: String,
    dir: PathBuf,
}

/// Where the unpacked crates and the outside project live: outside the
/// workspace, so no `[workspace]` above them claims them.
fn outside_dir() -> PathBuf {
    std::env::temp_dir().join("outbox-package")
}

/// Runs `cargo package --no-verify` for every publishable member and
/// unpacks each `.crate`; returns them with their unpacked directories.
pub(crate) fn package() -> Result<Vec<Packaged>> {
    let meta = metadata()?;
    let target = target_dir(&meta)?;
    let unpacked = outside_dir().join("crates");
    let members: Vec<&Value> = meta["packages"]
        .as_array()
        .map(|p| p.iter().collect())
        .unwrap_or_default();
    let mut crates = Vec::new();
    for pkg in members {
        // `publish = false` is `[]`; absent (any registry) is `null`.
        let publishable = pkg["publish"].as_array().is_none_or(|r| !r.is_empty());
        if !publishable {
            continue;
        }
        let name = pkg["name"].as_str().unwrap_or_default().to_owned();
        let version = pkg["version"].as_str().unwrap_or_default().to_owned();
        let dir = unpacked.join(format!("{name}-{version}"));
        crates.push(Packaged { name, version, dir });
    }
    if crates.is_empty() {
        bail!("no publishable crate in the workspace");
    }
    let mut args = vec!["package", "--no-verify", "--allow-dirty"];
    for c in &crates {
        args.extend(["-p", c.name.as_str()]);
    }
    crate::cargo(&args)?;
    std::fs::create_dir_all(&unpacked)
        .with_context(|| format!("creating {}", unpacked.display()))?;
    for c in &crates {
        let file = target
            .join("package")
            .join(format!("{}-{}.crate", c.name, c.version));
        if c.dir.exists() {
            std::fs::remove_dir_all(&c.dir)
                .with_context(|| format!("removing {}", c.dir.display()))?;
        }
        let status = Command::new("tar")
            .arg("-xzf")
            .arg(&file)
            .arg("-C")
            .arg(&unpacked)
            .status()
            .context("could not run tar")?;
        if !status.success() || !c.dir.join("Cargo.toml").is_file() {
            bail!(
                "could not unpack {} into {}",
                file.display(),
                unpacked.display()
            );
        }
    }
    Ok(crates)
}

/// Generates the outside project beside the packaged crates, builds it and,
/// when `run`, runs the quick start (it asserts its event was delivered).
pub(crate) fn outside_project(crates: &[Packaged], run: bool) -> Result<()> {
    let meta = metadata()?;
    let target = target_dir(&meta)?;
    let dir = outside_dir().join("quickstart");
    std::fs::create_dir_all(dir.join("src"))
        .with_context(|| format!("creating {}", dir.display()))?;
    let version = |name: &str| -> Result<&str> {
        crates
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.version.as_str())
            .with_context(|| format!("{name} was not packaged"))
    };
    // Every other packaged library too (each must build from its `.crate`);
    // the binary crate is built below from its own directory.
    let libraries: Vec<String> = crates
        .iter()
        .filter(|c| c.name != "outbox-worker" && c.dir.join("src/lib.rs").is_file())
        .map(|c| format!("{} = \"={}\"\n", c.name, c.version))
        .collect();
    let sqlx = workspace_dependency_version(&meta, "sqlx")?;
    let tokio = workspace_dependency_version(&meta, "tokio")?;
    let mut manifest = format!(
        "# Generated by `cargo xtask package`: a project outside the outbox workspace\n\
         # that uses the packaged crates as a user would.\n\
         [package]\n\
         name = \"outbox-quickstart\"\n\
         version = \"0.0.0\"\n\
         edition = \"2021\"\n\
         publish = false\n\n\
         [dependencies]\n\
         outbox-worker = {{ version = \"={worker}\", default-features = false, features = [\"postgres\"] }}\n\
         {libraries}\
         sqlx = {{ version = \"{sqlx}\", default-features = false, features = [\"postgres\", \"runtime-tokio\"] }}\n\
         tokio = {{ version = \"{tokio}\", features = [\"macros\", \"rt-multi-thread\", \"time\"] }}\n\n\
         # Not a member of any workspace above this directory.\n\
         [workspace]\n\n\
         [patch.crates-io]\n",
        worker = version("outbox-worker")?,
        libraries = libraries.join(""),
    );
    for c in crates.iter().filter(|c| c.dir.join("src/lib.rs").is_file()) {
        manifest.push_str(&format!(
            "{} = {{ path = {:?} }}\n",
            c.name,
            c.dir.display().to_string()
        ));
    }
    write_if_changed(&dir.join("Cargo.toml"), &manifest)?;
    let main = std::fs::read_to_string(crate::root().join(QUICKSTART))
        .with_context(|| format!("reading {QUICKSTART}"))?;
    write_if_changed(&dir.join("src/main.rs"), &main)?;
    // The workspace's lock file as a start: the same dependency versions,
    // so the build reuses what the workspace already compiled.
    let lock = dir.join("Cargo.lock");
    if !lock.exists() {
        std::fs::copy(crate::root().join("Cargo.lock"), &lock)
            .with_context(|| format!("writing {}", lock.display()))?;
    }

    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    // Binary crates (no library to depend on) build from their unpacked
    // directory with the same patches, given on the command line.
    let patches: Vec<String> = crates
        .iter()
        .filter(|c| c.dir.join("src/lib.rs").is_file())
        .map(|c| {
            format!(
                "patch.crates-io.{}.path={:?}",
                c.name,
                c.dir.display().to_string()
            )
        })
        .collect();
    for bin in crates
        .iter()
        .filter(|c| !c.dir.join("src/lib.rs").is_file())
    {
        let mut args = vec!["build".to_owned(), "--quiet".to_owned()];
        for p in &patches {
            args.extend(["--config".to_owned(), p.clone()]);
        }
        outside_cargo(&bin.dir, &target, args, &url)?;
    }
    let verb = if run { "run" } else { "build" };
    outside_cargo(
        &dir,
        &target,
        vec![verb.to_owned(), "--quiet".to_owned()],
        &url,
    )
}

/// `cargo <args> --manifest-path <dir>/Cargo.toml --target-dir <target>`
/// in `dir`, with `DATABASE_URL`; fails naming the project.
fn outside_cargo(dir: &Path, target: &Path, mut args: Vec<String>, url: &str) -> Result<()> {
    args.extend([
        "--manifest-path".to_owned(),
        dir.join("Cargo.toml").display().to_string(),
        "--target-dir".to_owned(),
        target.display().to_string(),
    ]);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!("\n==> outside the workspace: cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(&args)
        .current_dir(dir)
        .env("DATABASE_URL", url)
        .status()
        .with_context(|| format!("could not run {cargo}"))?;
    if !status.success() {
        bail!(
            "`cargo {}` failed ({status}): a packaged crate or the quick start is broken",
            args.first().map(String::as_str).unwrap_or("")
        );
    }
    Ok(())
}

/// The version requirement of `name` in `[workspace.dependencies]`.
fn workspace_dependency_version(meta: &Value, name: &str) -> Result<String> {
    let root = meta["workspace_root"]
        .as_str()
        .context("cargo metadata has no workspace_root")?;
    let text = std::fs::read_to_string(Path::new(root).join("Cargo.toml"))?;
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name} = ")))
        .with_context(|| format!("no {name} in [workspace.dependencies]"))?;
    let rest = line.split_once('=').map(|(_, r)| r.trim()).unwrap_or("");
    let quoted = if rest.starts_with('{') {
        rest.split_once("version")
            .and_then(|(_, r)| r.split_once('"'))
            .map(|(_, r)| r)
            .unwrap_or("")
    } else {
        rest.trim_start_matches('"')
    };
    let version = quoted.split('"').next().unwrap_or("");
    if version.is_empty() {
        bail!("no version for {name} in [workspace.dependencies]: {line}");
    }
    Ok(version.to_owned())
}

fn metadata() -> Result<Value> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(crate::root())
        .output()
        .with_context(|| format!("could not run {cargo} metadata"))?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn target_dir(meta: &Value) -> Result<PathBuf> {
    meta["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .context("cargo metadata has no target_directory")
}

/// Writes `text` unless the file already holds it (keeps cargo's
/// fingerprints, so a warm run does not rebuild the outside project).
fn write_if_changed(path: &Path, text: &str) -> Result<()> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// The README's quick start opens with this marker line, then a fenced
/// `rust` block that must equal [`QUICKSTART`], then [`README_END`].
const README_BEGIN: &str =
    "<!-- quickstart: xtask/quickstart/main.rs (cargo xtask tidy checks they are equal) -->";
/// The line after the quick start's code block.
const README_END: &str = "<!-- /quickstart -->";

/// Tidy: the README's quick start is the file the outside project runs,
/// character for character. Returns the problems found.
pub(crate) fn check_readme_quickstart(root: &Path) -> Vec<String> {
    let (readme, file) = match (
        std::fs::read_to_string(root.join("README.md")),
        std::fs::read_to_string(root.join(QUICKSTART)),
    ) {
        (Ok(r), Ok(f)) => (r, f),
        (Err(e), _) => return vec![format!("README.md: {e}")],
        (_, Err(e)) => return vec![format!("{QUICKSTART}: {e}")],
    };
    match readme_block(&readme) {
        None => vec![format!(
            "README.md has no quick start between `{README_BEGIN}` and `{README_END}` \
             around a ```rust block"
        )],
        Some(block) if block != file => vec![format!(
            "README.md's quick start differs from {QUICKSTART}: copy the file into the block \
             (the outside project of `cargo xtask package` runs the file)"
        )],
        Some(_) => Vec::new(),
    }
}

/// The code between the markers' fences: the lines after the opening
/// ```` ```rust... ```` line up to the closing ```` ``` ````, each ending in `\n`.
fn readme_block(readme: &str) -> Option<String> {
    let (_, after) = readme.split_once(README_BEGIN)?;
    let (inside, _) = after.split_once(README_END)?;
    let inside = inside.trim_matches('\n');
    let (open, body) = inside.split_once('\n')?;
    if !open.starts_with("```rust") {
        return None;
    }
    let body = body.strip_suffix("```")?;
    Some(body.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_between_the_markers_is_found() {
        let readme = format!(
            "# x\n\n{README_BEGIN}\n```rust,ignore\nfn main() {{}}\n```\n{README_END}\nmore\n"
        );
        assert_eq!(readme_block(&readme).as_deref(), Some("fn main() {}\n"));
        assert_eq!(readme_block("no markers"), None);
        let unfenced = format!("{README_BEGIN}\nfn main() {{}}\n{README_END}\n");
        assert_eq!(readme_block(&unfenced), None);
    }

    #[test]
    fn the_readme_holds_the_quick_start() {
        let problems = check_readme_quickstart(&crate::root());
        assert!(problems.is_empty(), "{problems:?}");
    }
}
