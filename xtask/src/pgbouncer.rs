//! PgBouncer in transaction mode in front of the test database: the shape
//! most production PostgreSQL is reached through.
//!
//! - [`start`] installs Debian's `pgbouncer` with `apt-get` when missing,
//!   writes its configuration under the target directory
//!   (`<target>/pgbouncer/pgbouncer.ini`, `userlist.txt`), and starts it in
//!   the foreground on [`PGBOUNCER_ADDR`] unless something already listens
//!   there. The returned [`Guard`] stops what it started when dropped.
//! - The configuration is Debian's stock one with what a test machine
//!   needs: `pool_mode = transaction`, every database forwarded to
//!   127.0.0.1:5432, `auth_type = trust` (the test server trusts loopback),
//!   and `ignore_startup_parameters = extra_float_digits` (sqlx sends it;
//!   PgBouncer 1.18 refuses what it does not track). Nothing else: the
//!   stores must work with that (README, "Running behind a connection
//!   pooler").
//! - As root PgBouncer refuses to run; it is started with `-u postgres`,
//!   its log written by xtask (the postgres user cannot open files under
//!   root's home).
//!
//! Tests reach it through `PGBOUNCER_URL`
//! (default `postgres://postgres@127.0.0.1:6432/test`).

use anyhow::{bail, Context, Result};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where PgBouncer listens.
pub(crate) const PGBOUNCER_ADDR: &str = "127.0.0.1:6432";
/// The URL the tests read from `PGBOUNCER_URL` when it is unset.
pub(crate) const PGBOUNCER_URL: &str = "postgres://postgres@127.0.0.1:6432/test";
/// How long [`start`] waits for PgBouncer to listen.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Stops the PgBouncer [`start`] started (nothing if one was running).
#[derive(Debug)]
pub(crate) struct Guard {
    child: Option<Child>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            eprintln!("xtask: stopping pgbouncer (pid {})", child.id());
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn up() -> bool {
    PGBOUNCER_ADDR
        .parse::<SocketAddr>()
        .map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(1)).is_ok())
        .unwrap_or(false)
}

fn binary() -> PathBuf {
    std::env::var_os("PGBOUNCER_BIN").map_or_else(|| "/usr/sbin/pgbouncer".into(), PathBuf::from)
}

/// Installs Debian's `pgbouncer` package when the binary is missing.
fn ensure_installed() -> Result<PathBuf> {
    let bin = binary();
    if bin.is_file() {
        return Ok(bin);
    }
    println!(
        "xtask: {} missing; installing Debian's pgbouncer (apt-get)",
        bin.display()
    );
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends", "pgbouncer"])
            .status()
            .context("running apt-get install pgbouncer")
    };
    if !install()?.success() {
        let update = Command::new("apt-get").arg("update").status()?;
        if !update.success() || !install()?.success() {
            bail!("could not install pgbouncer with apt-get (run it as root)");
        }
    }
    // The package's own service is not what the tests use.
    let _ = Command::new("service")
        .args(["pgbouncer", "stop"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !bin.is_file() {
        bail!(
            "apt-get installed pgbouncer, but {} is still missing",
            bin.display()
        );
    }
    Ok(bin)
}

/// The configuration, with its files in `dir`.
fn config(dir: &Path) -> String {
    let (host, port) = PGBOUNCER_ADDR
        .split_once(':')
        .unwrap_or(("127.0.0.1", "6432"));
    format!(
        "; Written by cargo xtask (xtask/src/pgbouncer.rs): PgBouncer in transaction mode
; in front of the test database.
[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = {host}
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {auth}
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 20
ignore_startup_parameters = extra_float_digits
",
        auth = dir.join("userlist.txt").display()
    )
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| crate::root().join("target"), PathBuf::from)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Starts PgBouncer on [`PGBOUNCER_ADDR`] unless something listens there.
pub(crate) fn start() -> Result<Guard> {
    if up() {
        println!(
            "{:<16} up     {PGBOUNCER_ADDR} (tests read PGBOUNCER_URL, default {PGBOUNCER_URL})",
            "PgBouncer"
        );
        return Ok(Guard { child: None });
    }
    let bin = ensure_installed()?;
    let dir = target_dir().join("pgbouncer");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let ini = dir.join("pgbouncer.ini");
    std::fs::write(&ini, config(&dir)).with_context(|| format!("writing {}", ini.display()))?;
    std::fs::write(
        dir.join("userlist.txt"),
        "\"postgres\" \"\"\n\"root\" \"\"\n",
    )
    .context("writing the pgbouncer userlist")?;
    let log_path = dir.join("pgbouncer.log");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let err_log = log.try_clone()?;
    let mut cmd = Command::new(&bin);
    if is_root() {
        cmd.args(["-u", "postgres"]);
    }
    let child = cmd
        .arg(&ini)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err_log)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut guard = Guard { child: Some(child) };
    let deadline = Instant::now() + START_TIMEOUT;
    while !up() {
        if let Some(child) = &mut guard.child {
            if let Some(status) = child.try_wait()? {
                guard.child = None;
                bail!(
                    "pgbouncer exited during start-up ({status}); see {}",
                    log_path.display()
                );
            }
        }
        if Instant::now() >= deadline {
            bail!(
                "pgbouncer did not listen on {PGBOUNCER_ADDR} within {START_TIMEOUT:?}; see {}",
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "{:<16} started by xtask on {PGBOUNCER_ADDR}, pool_mode = transaction (config {}, log {})",
        "PgBouncer",
        ini.display(),
        log_path.display()
    );
    Ok(guard)
}
