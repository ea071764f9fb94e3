//! The `outbox-relay run` processes under test: started from the built
//! binary, killed, stopped and resumed by signal, restarted, and always
//! killed when the supervisor is dropped (`kill_on_drop`), whatever path the
//! run leaves by.

use anyhow::{bail, Context as _, Result};
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

/// How to start one relay.
#[derive(Debug, Clone)]
pub(crate) struct RelaySpec {
    /// The `outbox-relay` binary.
    pub(crate) bin: PathBuf,
    /// Arguments after `run` (store, sink, tuning), without `--relay-id`.
    pub(crate) args: Vec<String>,
    /// Relay 0's arguments instead of `args`, when it has its own
    /// connections (`db-cut-one`: its own database proxy and slow broker).
    pub(crate) first_args: Option<Vec<String>>,
    /// Where each relay's log goes (`relay-<i>.log`, appended across restarts).
    pub(crate) log_dir: PathBuf,
    /// Prefix of the relay ids.
    pub(crate) name: String,
}

#[derive(Debug)]
struct Slot {
    child: Child,
    generation: u32,
    stopped: bool,
}

/// The relay processes; killed when dropped.
#[derive(Debug)]
pub(crate) struct Relays {
    spec: RelaySpec,
    slots: Vec<Slot>,
}

impl Relays {
    /// Starts `n` relays.
    pub(crate) fn start(spec: RelaySpec, n: usize) -> Result<Self> {
        let mut slots = Vec::with_capacity(n);
        for i in 0..n {
            slots.push(Slot {
                child: spawn(&spec, i, 0)?,
                generation: 0,
                stopped: false,
            });
        }
        Ok(Self { spec, slots })
    }

    /// How many relays there are.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// `kill -9` relay `i`, then starts a new one in its place.
    pub(crate) async fn kill_and_restart(&mut self, i: usize) -> Result<()> {
        let slot = &mut self.slots[i];
        slot.child.start_kill().context("kill -9")?;
        let _ = slot.child.wait().await;
        slot.generation += 1;
        slot.stopped = false;
        slot.child = spawn(&self.spec, i, slot.generation)?;
        Ok(())
    }

    /// Sends SIGSTOP to relay `i`.
    pub(crate) async fn stop(&mut self, i: usize) -> Result<()> {
        let slot = &mut self.slots[i];
        signal(&slot.child, "STOP").await?;
        slot.stopped = true;
        Ok(())
    }

    /// Sends SIGCONT to relay `i`.
    pub(crate) async fn resume(&mut self, i: usize) -> Result<()> {
        let slot = &mut self.slots[i];
        signal(&slot.child, "CONT").await?;
        slot.stopped = false;
        Ok(())
    }

    /// Relays that exited on their own since the last call: restarts each
    /// and returns a line per exit (index, status, log tail).
    pub(crate) fn reap_and_restart(&mut self) -> Result<Vec<String>> {
        let mut exits = Vec::new();
        for i in 0..self.slots.len() {
            let slot = &mut self.slots[i];
            if let Some(status) = slot.child.try_wait()? {
                let tail = log_tail(&log_path(&self.spec.log_dir, i), 5);
                exits.push(format!(
                    "relay-{i} (generation {}) exited by itself ({status}); log tail:\n{tail}",
                    slot.generation
                ));
                slot.generation += 1;
                slot.stopped = false;
                slot.child = spawn(&self.spec, i, slot.generation)?;
            }
        }
        Ok(exits)
    }

    /// Resumes stopped relays, sends SIGTERM to all and waits up to `grace`
    /// for each, then kills what is left.
    pub(crate) async fn shutdown(&mut self, grace: Duration) {
        for slot in &mut self.slots {
            if slot.stopped {
                let _ = signal(&slot.child, "CONT").await;
                slot.stopped = false;
            }
            let _ = signal(&slot.child, "TERM").await;
        }
        for slot in &mut self.slots {
            if tokio::time::timeout(grace, slot.child.wait())
                .await
                .is_err()
            {
                let _ = slot.child.start_kill();
                let _ = slot.child.wait().await;
            }
        }
    }
}

pub(crate) fn log_path(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("relay-{i}.log"))
}

fn spawn(spec: &RelaySpec, i: usize, generation: u32) -> Result<Child> {
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path(&spec.log_dir, i))
        .context("opening the relay log")?;
    let err = log.try_clone()?;
    let id = format!("{}-r{i}g{generation}", spec.name);
    let args = match (&spec.first_args, i) {
        (Some(first), 0) => first,
        _ => &spec.args,
    };
    Command::new(&spec.bin)
        .arg("run")
        .args(args)
        .args(["--relay-id", &id])
        // `CHAOS_RELAY_LOG` (a `RUST_LOG` filter) to look inside a run.
        .env(
            "RUST_LOG",
            std::env::var("CHAOS_RELAY_LOG").unwrap_or_else(|_| "info".to_owned()),
        )
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", spec.bin.display()))
}

/// `kill -SIG pid` (the `kill` command: no unsafe code here).
async fn signal(child: &Child, sig: &str) -> Result<()> {
    let Some(pid) = child.id() else {
        bail!("the relay has already exited");
    };
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .await
        .context("running kill")?;
    if !status.success() {
        bail!("kill -{sig} {pid} failed ({status})");
    }
    Ok(())
}

/// The last `n` lines of a file.
pub(crate) fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
