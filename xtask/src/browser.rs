//! The console's browser tests need Debian's headless Chromium and its
//! WebDriver (`chromium`, `chromium-driver`). [`ensure_chromium`] finds
//! them, or installs them with `apt-get` (as root, like the machine's other
//! packages), the way [`crate::kafka`] installs Tansu.
//! [`screenshots`] (`cargo xtask screenshots`) runs the browser tests with
//! `OUTBOX_CONSOLE_SCREENSHOTS` set, so they save each page they visit as a
//! PNG under `docs/console/` (shown in the README's "Operator console").

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Debian's binaries (overridable like the tests do: `$CHROMIUM`,
/// `$CHROMEDRIVER`).
fn binaries() -> [PathBuf; 2] {
    let var = |name: &str, default: &str| {
        std::env::var_os(name).map_or_else(|| PathBuf::from(default), PathBuf::from)
    };
    [
        var("CHROMIUM", "/usr/bin/chromium"),
        var("CHROMEDRIVER", "/usr/bin/chromedriver"),
    ]
}

fn missing() -> Vec<PathBuf> {
    binaries().into_iter().filter(|p| !p.is_file()).collect()
}

/// Makes sure `chromium` and `chromedriver` exist, installing Debian's
/// `chromium` and `chromium-driver` packages when one is missing.
pub(crate) fn ensure_chromium() -> Result<()> {
    if missing().is_empty() {
        println!("chromium         present (console browser tests)");
        return Ok(());
    }
    println!(
        "xtask: {} missing; installing Debian's chromium and chromium-driver (apt-get)",
        missing()
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let install = || {
        Command::new("apt-get")
            .args([
                "install",
                "-y",
                "--no-install-recommends",
                "chromium",
                "chromium-driver",
            ])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .context("running apt-get install chromium chromium-driver")
    };
    if !install()?.success() {
        // A fresh machine may have no package lists yet.
        let update = Command::new("apt-get")
            .arg("update")
            .status()
            .context("running apt-get update")?;
        if !update.success() || !install()?.success() {
            bail!("could not install chromium and chromium-driver with apt-get (run it as root)");
        }
    }
    let still = missing();
    if !still.is_empty() {
        bail!(
            "apt-get installed chromium, but {} is still missing",
            still[0].display()
        );
    }
    Ok(())
}

/// `cargo xtask screenshots`: the browser tests, saving PNGs of the pages
/// into `docs/console/`.
pub(crate) fn screenshots(_rest: &[String]) -> Result<()> {
    ensure_chromium()?;
    let dir = crate::root().join("docs").join("console");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let args = [
        "test",
        "-p",
        "outbox-relay",
        // The feature set of `cargo xtask ci`'s test run: its build is reused.
        "--all-features",
        "--test",
        "console_browser",
    ];
    println!(
        "\n==> OUTBOX_CONSOLE_SCREENSHOTS={} cargo {}",
        dir.display(),
        args.join(" ")
    );
    let status = Command::new(&cargo)
        .args(args)
        .env("OUTBOX_CONSOLE_SCREENSHOTS", &dir)
        .current_dir(crate::root())
        .status()
        .with_context(|| format!("could not run {cargo}"))?;
    if !status.success() {
        bail!("the console's browser tests failed ({status}); no screenshots updated for sure");
    }
    list(&dir)
}

fn list(dir: &Path) -> Result<()> {
    let mut pngs: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".png"))
        .collect();
    pngs.sort();
    println!("screenshots in {}: {}", dir.display(), pngs.join(", "));
    Ok(())
}
