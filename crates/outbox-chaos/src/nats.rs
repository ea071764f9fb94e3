//! A private NATS server for a run whose plan restarts the broker.
//!
//! The machine's NATS server is shared (other tests, other runs): a run
//! must not restart it. A NATS run whose plan has `broker-restart` starts
//! its own `nats-server` with JetStream on a file store in the run's
//! directory, on a free loopback port; the relays reach it through the
//! run's broker fault proxy as usual, the consumer directly. The fault
//! stops the server gracefully (SIGTERM: JetStream flushes its store, as in
//! a rolling restart), waits for it to exit and starts it again on the same
//! port and store: the stream and every message it acknowledged are still
//! there, and every client has to reconnect.
//!
//! The server is a child of the run, in the run's process group (as the
//! relays are), and is killed when dropped.

use anyhow::{bail, Context as _, Result};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::AsyncReadExt as _;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// How long the server has to accept connections after a start.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a graceful stop may take before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// A `nats-server` owned by the run; killed when dropped.
#[derive(Debug)]
pub(crate) struct PrivateNats {
    bin: PathBuf,
    addr: SocketAddr,
    store: PathBuf,
    log: PathBuf,
    child: Child,
}

impl PrivateNats {
    /// Starts the server on a free loopback port with JetStream on a file
    /// store under `dir`, and waits until it greets a client.
    pub(crate) async fn start(dir: &Path) -> Result<Self> {
        let bin = outbox_testkit::process::nats_server_bin();
        let store = dir.join("nats-store");
        let log = dir.join("nats-server.log");
        let addr = crate::child::free_port()?;
        let child = spawn(&bin, addr, &store, &log)?;
        let mut server = Self {
            bin,
            addr,
            store,
            log,
            child,
        };
        server.wait_ready().await?;
        eprintln!(
            "chaos: private NATS server (pid {}) on {addr}, store {}, log {}",
            server.child.id().unwrap_or(0),
            server.store.display(),
            server.log.display()
        );
        Ok(server)
    }

    /// The URL clients use.
    pub(crate) fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// The JetStream store directory.
    pub(crate) fn store(&self) -> &Path {
        &self.store
    }

    /// Stops the server gracefully and starts it again on the same port and
    /// store. Returns when it greets clients again.
    pub(crate) async fn restart(&mut self) -> Result<()> {
        crate::child::terminate(&mut self.child, "nats-server", STOP_TIMEOUT).await?;
        self.child = spawn(&self.bin, self.addr, &self.store, &self.log)?;
        self.wait_ready().await
    }

    /// Waits until a TCP client gets the server's `INFO` greeting.
    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "nats-server exited at start ({status}); see {}",
                    self.log.display()
                );
            }
            if greets(self.addr).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "nats-server on {} did not answer within {READY_TIMEOUT:?}; see {}",
                    self.addr,
                    self.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Whether the server at `addr` sends its `INFO` line.
pub(crate) async fn greets(addr: SocketAddr) -> bool {
    let Ok(Ok(mut s)) =
        tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(addr)).await
    else {
        return false;
    };
    let mut buf = [0u8; 4];
    matches!(
        tokio::time::timeout(Duration::from_secs(1), s.read_exact(&mut buf)).await,
        Ok(Ok(_)) if &buf == b"INFO"
    )
}

fn spawn(bin: &Path, addr: SocketAddr, store: &Path, log: &Path) -> Result<Child> {
    let mut cmd = Command::new(bin);
    cmd.args(["-a", &addr.ip().to_string(), "-p", &addr.port().to_string()])
        .arg("-js")
        .arg("-sd")
        .arg(store);
    crate::child::spawn_logged(cmd, log).with_context(|| {
        format!(
            "starting {} (set NATS_SERVER_BIN, or install Debian's nats-server)",
            bin.display()
        )
    })
}
