//! The processes a run starts for itself besides the relays (its private
//! brokers): a free loopback port, a start with its output in a log file,
//! a graceful stop. (`outbox-testkit::process` has the blocking,
//! panicking equivalents for tests; these are async and return errors.)

use anyhow::{bail, Context as _, Result};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

/// Spawns a broker of the run with stdout and stderr appended to `log`,
/// killed when its handle drops.
pub(crate) fn spawn_logged(mut cmd: Command, log: &Path) -> Result<Child> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let err = out.try_clone()?;
    Ok(cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()?)
}

/// Stops a broker of the run gracefully: SIGTERM to `pid` (its process, or
/// the one that really serves), then waits up to `timeout` for `child` to
/// exit. Returns whether it did; the caller kills what is left when not.
pub(crate) async fn sigterm_and_wait(
    pid: Option<u32>,
    child: &mut Child,
    timeout: Duration,
) -> Result<bool> {
    if let Some(pid) = pid {
        let status = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await
            .context("running kill")?;
        if !status.success() {
            bail!("kill -TERM {pid} failed ({status})");
        }
    }
    Ok(tokio::time::timeout(timeout, child.wait()).await.is_ok())
}

/// [`sigterm_and_wait`] on `child` itself, killing it after `timeout`
/// (the private NATS server's restart).
pub(crate) async fn terminate(child: &mut Child, what: &str, timeout: Duration) -> Result<()> {
    if !sigterm_and_wait(child.id(), child, timeout).await? {
        eprintln!("chaos: {what} did not stop within {timeout:?} of SIGTERM; killing it");
        let _ = child.kill().await;
    }
    Ok(())
}

/// A loopback port nothing listens on now (the broker binds it a moment
/// later; a lost race is retried with another port).
pub(crate) fn free_port() -> Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?)
}
