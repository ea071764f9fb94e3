//! A private PostgreSQL primary and streaming standby for `pg-failover`.
//!
//! The run makes its own two clusters (never the machine's at 5432): a
//! primary by `initdb` on a free loopback port under the run's directory
//! (run as root: under the temporary directory, linked from there),
//! and a standby by `pg_basebackup -R` from it on another port, streaming,
//! synchronous (`synchronous_standby_names = '*'`, `synchronous_commit =
//! on`: a commit returns once the standby has flushed it) or asynchronous.
//! The producer and the relays get both as one multi-host URL with
//! `target_session_attrs=read-write`, as a user's application would.
//!
//! The fault stops the primary at once (`pg_ctl stop -m immediate`: no
//! shutdown checkpoint, nothing more sent to the standby), leaves the
//! standby a standby for [`UNPROMOTED_FOR`] (the relays meet a read-only
//! server and must wait, not spin), then promotes it (`pg_ctl promote`):
//! the same system identifier on a new timeline. The old primary stays
//! down.
//!
//! PostgreSQL refuses to run as root: when the harness is root, the
//! clusters' directory is given to the `postgres` user and every server
//! binary runs through `runuser -u postgres`. The binaries are the newest
//! under `/usr/lib/postgresql/*/bin` (or `PG_BIN_DIR`). Both clusters are
//! stopped when dropped; the run removes their directory unless `--keep`.

use anyhow::{bail, Context as _, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::Command;
use tokio::time::Instant;

/// How long the standby stays a standby after the primary stopped.
pub(crate) const UNPROMOTED_FOR: Duration = Duration::from_secs(2);
/// How long a cluster has to start, or the standby to stream.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Synchronous or asynchronous streaming replication.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Replication {
    /// A commit returns once the standby flushed its WAL.
    Sync,
    /// A commit returns once the primary flushed it; the standby follows.
    Async,
}

impl Replication {
    /// `sync` or `async`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::Async => "async",
        }
    }
}

/// The two clusters.
#[derive(Debug)]
pub(crate) struct PgPair {
    bin: PathBuf,
    dir: PathBuf,
    as_postgres: bool,
    primary: PathBuf,
    standby: PathBuf,
    primary_port: u16,
    standby_port: u16,
    replication: Replication,
    /// The primary was stopped (it stays down).
    primary_down: bool,
}

/// What [`PgPair::fail_over`] did.
#[derive(Debug)]
pub(crate) struct FailedOver {
    /// When the primary was stopped.
    pub(crate) stopped_us: i64,
    /// When the standby answered as a primary.
    pub(crate) promoted_us: i64,
    /// The fault's description: the LSNs at the switch.
    pub(crate) target: String,
}

impl PgPair {
    /// Makes and starts both clusters under `dir/pg-failover` and waits
    /// until the standby streams (and, synchronous, is the sync standby).
    pub(crate) async fn start(dir: &Path, replication: Replication) -> Result<Self> {
        let bin = bin_dir()?;
        let as_postgres = is_root();
        let dir = clusters_dir(dir, as_postgres)?;
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir)?;
        if as_postgres {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .await
                .context("chown of the clusters' directory")?;
            if !status.success() {
                bail!("chown postgres {} failed ({status})", dir.display());
            }
        }
        let primary_port = crate::child::free_port()?.port();
        let standby_port = crate::child::free_port()?.port();
        let pair = Self {
            bin,
            primary: dir.join("primary"),
            standby: dir.join("standby"),
            dir,
            as_postgres,
            primary_port,
            standby_port,
            replication,
            primary_down: false,
        };
        pair.run(
            "initdb",
            &[
                "-D".as_ref(),
                pair.primary.as_os_str(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "--auth=trust".as_ref(),
                "-N".as_ref(),
                "-E".as_ref(),
                "UTF8".as_ref(),
            ],
        )
        .await?;
        let sync_names = match replication {
            Replication::Sync => "'*'",
            Replication::Async => "''",
        };
        append(
            &pair.primary.join("postgresql.conf"),
            &format!(
                "\n# outbox-chaos pg-failover\nport = {primary_port}\nlisten_addresses = '127.0.0.1'\n\
                 unix_socket_directories = ''\nfsync = off\nfull_page_writes = off\n\
                 shared_buffers = 32MB\nmax_connections = 60\nwal_level = replica\n\
                 max_wal_senders = 4\nsynchronous_standby_names = {sync_names}\n\
                 synchronous_commit = on\nlog_min_messages = warning\n"
            ),
        )?;
        pair.pg_ctl(&pair.primary.clone(), "primary", &["start", "-w"])
            .await?;
        pair.run(
            "pg_basebackup",
            &[
                "-h".as_ref(),
                "127.0.0.1".as_ref(),
                "-p".as_ref(),
                primary_port.to_string().as_ref(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "-D".as_ref(),
                pair.standby.as_os_str(),
                "-R".as_ref(),
                "-X".as_ref(),
                "stream".as_ref(),
                "--checkpoint=fast".as_ref(),
            ],
        )
        .await?;
        append(
            &pair.standby.join("postgresql.conf"),
            &format!(
                "\n# outbox-chaos pg-failover: the standby\nport = {standby_port}\n\
                 cluster_name = 'standby'\nhot_standby = on\n\
                 # Promoted, it has no standby of its own: its commits must not\n\
                 # wait for one (the copied setting would hang every commit).\n\
                 synchronous_standby_names = ''\n"
            ),
        )?;
        pair.pg_ctl(&pair.standby.clone(), "standby", &["start", "-w"])
            .await?;
        pair.wait_streaming().await?;
        eprintln!(
            "chaos: private PostgreSQL primary 127.0.0.1:{primary_port}, standby 127.0.0.1:{standby_port} ({} replication), under {}",
            replication.name(),
            pair.dir.display()
        );
        Ok(pair)
    }

    /// The URL the application and the relays use: both hosts, read-write.
    pub(crate) fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
            self.primary_port, self.standby_port
        )
    }

    /// The standby's own URL (the harness reads what it holds after the run).
    pub(crate) fn standby_url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.standby_port
        )
    }

    /// The primary's own URL.
    pub(crate) fn primary_url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.primary_port
        )
    }

    /// Where the clusters live.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The replication mode.
    pub(crate) fn replication(&self) -> Replication {
        self.replication
    }

    /// Stops the primary at once, leaves the standby unpromoted for
    /// [`UNPROMOTED_FOR`], promotes it and returns once it answers as a
    /// primary.
    pub(crate) async fn fail_over(&mut self) -> Result<FailedOver> {
        use sqlx::Connection as _;
        let sent = async {
            let mut c = sqlx::PgConnection::connect(&self.primary_url()).await?;
            let row: (String, Option<String>) = sqlx::query_as(
                "SELECT pg_current_wal_lsn()::text, \
                 (SELECT replay_lsn::text FROM pg_stat_replication LIMIT 1)",
            )
            .fetch_one(&mut c)
            .await?;
            let _ = c.close().await;
            Ok::<_, sqlx::Error>(row)
        }
        .await
        .ok();
        let stopped_us = crate::record::now_us();
        self.pg_ctl(
            &self.primary.clone(),
            "primary",
            &["stop", "-m", "immediate"],
        )
        .await?;
        self.primary_down = true;
        tokio::time::sleep(UNPROMOTED_FOR).await;
        let replayed: Option<String> = async {
            let mut c = sqlx::PgConnection::connect(&self.standby_url()).await?;
            let (lsn,): (Option<String>,) = sqlx::query_as("SELECT pg_last_wal_replay_lsn()::text")
                .fetch_one(&mut c)
                .await?;
            let _ = c.close().await;
            Ok::<_, sqlx::Error>(lsn)
        }
        .await
        .ok()
        .flatten();
        self.pg_ctl(&self.standby.clone(), "standby", &["promote", "-w"])
            .await?;
        let deadline = Instant::now() + READY_TIMEOUT;
        let promoted_us = loop {
            let answer = async {
                let mut c = sqlx::PgConnection::connect(&self.standby_url()).await?;
                let (rec,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()")
                    .fetch_one(&mut c)
                    .await?;
                let _ = c.close().await;
                Ok::<_, sqlx::Error>(rec)
            }
            .await;
            if matches!(answer, Ok(false)) {
                break crate::record::now_us();
            }
            if Instant::now() >= deadline {
                bail!("the standby did not answer as a primary within {READY_TIMEOUT:?} of its promotion");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let (primary_lsn, standby_seen) = sent.unwrap_or_default();
        Ok(FailedOver {
            stopped_us,
            promoted_us,
            target: format!(
                "primary stopped (immediate) at LSN {} (standby had replayed {} by the last report), \
                 standby promoted after replaying {} ({} replication)",
                if primary_lsn.is_empty() { "?" } else { &primary_lsn },
                standby_seen.as_deref().unwrap_or("?"),
                replayed.as_deref().unwrap_or("?"),
                self.replication.name()
            ),
        })
    }

    /// Waits until the primary reports the standby streaming (and, for
    /// synchronous replication, as its sync standby).
    async fn wait_streaming(&self) -> Result<()> {
        use sqlx::Connection as _;
        let deadline = Instant::now() + READY_TIMEOUT;
        let want = match self.replication {
            Replication::Sync => "sync",
            Replication::Async => "async",
        };
        loop {
            let state = async {
                let mut c = sqlx::PgConnection::connect(&self.primary_url()).await?;
                let row: Option<(String, String)> =
                    sqlx::query_as("SELECT state, sync_state FROM pg_stat_replication LIMIT 1")
                        .fetch_optional(&mut c)
                        .await?;
                let _ = c.close().await;
                Ok::<_, sqlx::Error>(row)
            }
            .await;
            let last = match state {
                Ok(Some((state, sync))) if state == "streaming" && sync == want => return Ok(()),
                Ok(other) => format!("{other:?}"),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                bail!(
                    "the standby did not stream ({want}) within {READY_TIMEOUT:?} (last: {last}); see the logs under {}",
                    self.dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `pg_ctl` on `data` (log `<name>.log` beside it).
    async fn pg_ctl(&self, data: &Path, name: &str, args: &[&str]) -> Result<()> {
        let log = self.dir.join(format!("{name}.log"));
        use std::ffi::OsStr;
        let mut all: Vec<&OsStr> = vec![OsStr::new("-D"), data.as_os_str()];
        all.extend([OsStr::new("-l"), log.as_os_str()]);
        all.extend([OsStr::new("-t"), OsStr::new("60")]);
        all.extend(args.iter().map(OsStr::new));
        self.run("pg_ctl", &all).await
    }

    /// Runs PostgreSQL binary `name` (as `postgres` when root); fails with
    /// its output.
    async fn run(&self, name: &str, args: &[&std::ffi::OsStr]) -> Result<()> {
        let bin = self.bin.join(name);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&bin);
            c
        } else {
            Command::new(&bin)
        };
        cmd.args(args).current_dir(&self.dir).kill_on_drop(true);
        let out = cmd
            .output()
            .await
            .with_context(|| format!("running {}", bin.display()))?;
        if !out.status.success() {
            bail!(
                "{name} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

impl Drop for PgPair {
    fn drop(&mut self) {
        // Synchronous: the runtime may be shutting down.
        for (data, down) in [(&self.primary, self.primary_down), (&self.standby, false)] {
            if down || !data.join("postmaster.pid").exists() {
                continue;
            }
            let bin = self.bin.join("pg_ctl");
            let mut cmd = if self.as_postgres {
                let mut c = std::process::Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(&bin);
                c
            } else {
                std::process::Command::new(&bin)
            };
            let _ = cmd
                .arg("-D")
                .arg(data)
                .args(["-m", "immediate", "-w", "-t", "20", "stop"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// Where the clusters live: `run_dir/pg-failover`, or, run as root, a
/// directory under the system's temporary directory with a link to it
/// from there. The `postgres` user the servers run as must reach it, and a
/// run directory under root's home (`~/.cache/...`, CI's target
/// directory) is closed to every other user.
fn clusters_dir(run_dir: &Path, as_postgres: bool) -> Result<PathBuf> {
    let link = run_dir.join("pg-failover");
    if !as_postgres {
        return Ok(link);
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!("outbox-chaos-pg-{}-{nanos}", std::process::id()));
    if link.symlink_metadata().is_ok() {
        if link.is_dir() && !link.is_symlink() {
            std::fs::remove_dir_all(&link)?;
        } else {
            std::fs::remove_file(&link)?;
        }
    }
    std::fs::create_dir_all(run_dir)?;
    std::os::unix::fs::symlink(&dir, &link)
        .with_context(|| format!("linking {} to {}", link.display(), dir.display()))?;
    Ok(dir)
}

/// The newest PostgreSQL server binaries: `PG_BIN_DIR`, else the highest
/// version under `/usr/lib/postgresql`.
fn bin_dir() -> Result<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .context("no /usr/lib/postgresql: set PG_BIN_DIR to PostgreSQL's bin directory")?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .context("no PostgreSQL with initdb under /usr/lib/postgresql: set PG_BIN_DIR")
}

fn is_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .ok()
        .is_some_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn append(path: &Path, text: &str) -> Result<()> {
    use std::io::Write as _;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}
