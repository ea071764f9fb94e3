//! A private RabbitMQ node for a run whose plan restarts the broker.
//!
//! The machine's RabbitMQ is shared (other tests, other runs): a run must
//! not restart it. A RabbitMQ run whose plan has `broker-restart` starts its
//! own node: `rabbitmq-server` (the script Debian's `/usr/sbin` wrapper
//! runs as the `rabbitmq` user; this one runs as the run's user) with
//! everything in `rabbitmq/` in the run's directory (`HOME`, hence the
//! Erlang cookie; the Mnesia and message store; the logs), no plugins, an
//! Erlang node name of its own (`chaos<port>@localhost`), and two free
//! loopback ports (AMQP and Erlang distribution; the name is registered with
//! the machine's `epmd`). The relays reach it through the run's broker fault
//! proxy as usual, the consumer directly, both as `guest` (allowed on
//! loopback). The fault stops the node gracefully (SIGTERM to the Erlang
//! VM: the durable queue and its persistent messages are flushed, as in a
//! rolling restart), waits for it to exit and starts it again on the same
//! ports and store: the queue and every message it confirmed are still
//! there, and every client has to reconnect.
//!
//! Starting a node takes 10-25 s on a busy 2-core machine (the Erlang VM
//! boots, then RabbitMQ recovers its store): a restart's outage is that
//! long, and readiness means an AMQP connection opens, not only that the
//! port accepts.
//!
//! The script does not `exec` the VM: it forks it (`beam.smp`, in the same
//! process group) and forwards signals. Both are in the run's process group
//! (as the relays are), so `cargo xtask chaos`, which kills that group when
//! the run ends, stops them even if the run itself was killed; the guard
//! kills the VM and the script when dropped, whatever way the run leaves.

use anyhow::{bail, Context as _, Result};
use outbox_amqp::lapin::{Connection, ConnectionProperties};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// How long the node has to open an AMQP connection after a start.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a graceful stop may take before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// A RabbitMQ node owned by the run; killed when dropped.
#[derive(Debug)]
pub(crate) struct PrivateRabbit {
    node: Node,
    /// The `rabbitmq-server` script.
    child: Child,
    /// The Erlang VM the script forked, once seen.
    beam: Option<u32>,
}

/// How to start the node, the same every time.
#[derive(Debug)]
struct Node {
    bin: PathBuf,
    /// Everything of the node: `HOME`, `mnesia/`, `log/`.
    dir: PathBuf,
    name: String,
    addr: SocketAddr,
    dist_port: u16,
    /// The script's output (the node's own logs are in `log/`).
    log: PathBuf,
}

impl PrivateRabbit {
    /// Starts a node on free loopback ports with its data under
    /// `dir/rabbitmq`, and waits until it opens an AMQP connection.
    pub(crate) async fn start(dir: &Path) -> Result<Self> {
        let bin = rabbitmq_server_bin();
        let dir = dir.join("rabbitmq");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // An empty environment file (not the machine's), no plugins.
        std::fs::write(dir.join("env.conf"), "")?;
        std::fs::write(dir.join("enabled_plugins"), "[].\n")?;
        let addr = crate::child::free_port()?;
        let node = Node {
            bin,
            name: format!("chaos{}@localhost", addr.port()),
            log: dir.join("rabbitmq-server.log"),
            dist_port: crate::child::free_port()?.port(),
            dir,
            addr,
        };
        let mut server = Self {
            child: node.spawn()?,
            node,
            beam: None,
        };
        let started = Instant::now();
        server.wait_ready().await?;
        eprintln!(
            "chaos: private RabbitMQ node {} (beam.smp pid {}) on {addr}, ready in {:.1} s, data {}",
            server.node.name,
            server.beam.unwrap_or(0),
            started.elapsed().as_secs_f64(),
            server.node.dir.display()
        );
        Ok(server)
    }

    /// The URL clients use.
    pub(crate) fn url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.node.addr)
    }

    /// The node's directory (removed after the run unless `--keep`).
    pub(crate) fn dir(&self) -> &Path {
        &self.node.dir
    }

    /// Stops the node gracefully and starts it again on the same ports and
    /// store. Returns when it opens AMQP connections again.
    pub(crate) async fn restart(&mut self) -> Result<()> {
        let down = Instant::now();
        self.stop_gracefully().await?;
        let stopped = down.elapsed();
        self.child = self.node.spawn()?;
        self.wait_ready().await?;
        eprintln!(
            "chaos: private RabbitMQ node restarted: stopped in {:.1} s, ready {:.1} s after the stop began",
            stopped.as_secs_f64(),
            down.elapsed().as_secs_f64()
        );
        Ok(())
    }

    async fn stop_gracefully(&mut self) -> Result<()> {
        // The script forwards SIGTERM to the VM, but only once its `wait`
        // is interrupted: the VM itself is signalled when it is known.
        // The script exits when the VM has.
        let pid = self.beam_pid().or(self.child.id());
        if !crate::child::sigterm_and_wait(pid, &mut self.child, STOP_TIMEOUT).await? {
            eprintln!(
                "chaos: the RabbitMQ node did not stop within {STOP_TIMEOUT:?} of SIGTERM; killing it"
            );
            self.kill_beam();
            let _ = self.child.kill().await;
        }
        self.beam = None;
        Ok(())
    }

    /// Waits until an AMQP connection (guest/guest) opens.
    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let url = self.url();
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "rabbitmq-server exited at start ({status}); see {} and {}",
                    self.node.log.display(),
                    self.node.dir.join("log").display()
                );
            }
            // Known before it is ready, so that a failed start is killed.
            let _ = self.beam_pid();
            if opens(&url).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "the RabbitMQ node {} on {} did not open an AMQP connection within {READY_TIMEOUT:?}; see {} and {}",
                    self.node.name,
                    self.node.addr,
                    self.node.log.display(),
                    self.node.dir.join("log").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The `beam.smp` the script forked (remembered once found).
    fn beam_pid(&mut self) -> Option<u32> {
        if self.beam.is_none() {
            let script = self.child.id()?;
            let children =
                std::fs::read_to_string(format!("/proc/{script}/task/{script}/children")).ok()?;
            self.beam = children
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .find(|&pid| self.node.is_beam(pid));
        }
        self.beam
    }

    /// SIGKILL to the VM, if it is still this node's, then a short wait
    /// for the script, which reaps it and exits (no zombie is left to the
    /// machine's init; the node's files can be removed).
    fn kill_beam(&mut self) {
        if let Some(pid) = self.beam.take() {
            if self.node.is_beam(pid) {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while matches!(self.child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Node {
    /// Whether `pid` is this node's VM (not a process that reused its pid):
    /// a `beam.smp` whose `-home` is this node's directory.
    fn is_beam(&self, pid: u32) -> bool {
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            return false;
        };
        let mut args = cmdline.split(|&b| b == 0);
        let is_beam = args
            .next()
            .is_some_and(|exe| exe.ends_with(b"/beam.smp") || exe == b"beam.smp");
        let home = self.dir.as_os_str().as_encoded_bytes();
        is_beam && args.skip_while(|&a| a != b"-home").nth(1) == Some(home)
    }

    fn spawn(&self) -> Result<Child> {
        let dir = &self.dir;
        let mut cmd = Command::new(&self.bin);
        cmd.current_dir(dir)
            .env("HOME", dir)
            .env("RABBITMQ_CONF_ENV_FILE", dir.join("env.conf"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_NODE_IP_ADDRESS", self.addr.ip().to_string())
            .env("RABBITMQ_NODE_PORT", self.addr.port().to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .env("ERL_FLAGS", "-kernel inet_dist_use_interface {127,0,0,1}")
            // The script execs the VM in these cases, without its signal
            // forwarding: keep the one mode `stop_gracefully` expects.
            .env_remove("RABBITMQ_ALLOW_INPUT")
            .env_remove("NOTIFY_SOCKET");
        crate::child::spawn_logged(cmd, &self.log).with_context(|| {
            format!(
                "starting {} (set RABBITMQ_SERVER_BIN, or install Debian's rabbitmq-server)",
                self.bin.display()
            )
        })
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        // The script would be killed on drop (`kill_on_drop`), not the VM
        // it forked.
        let _ = self.beam_pid();
        self.kill_beam();
    }
}

/// Whether an AMQP connection to `url` opens (then closes it).
async fn opens(url: &str) -> bool {
    let connect = Connection::connect(url, ConnectionProperties::default());
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(conn)) => {
            let _ = conn.close(200, "ready").await;
            true
        }
        _ => false,
    }
}

/// `$RABBITMQ_SERVER_BIN`, else Debian's script behind the `/usr/sbin`
/// wrapper (which switches to the `rabbitmq` user and its shared node).
fn rabbitmq_server_bin() -> PathBuf {
    std::env::var_os("RABBITMQ_SERVER_BIN").map_or_else(
        || PathBuf::from("/usr/lib/rabbitmq/bin/rabbitmq-server"),
        PathBuf::from,
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use outbox_amqp::lapin::options::QueueDeclareOptions;
    use outbox_amqp::lapin::types::FieldTable;

    /// Declares the durable queue `kept` (`passive`: fails unless it exists).
    async fn declare(url: &str, passive: bool) -> Result<()> {
        let conn = Connection::connect(url, ConnectionProperties::default()).await?;
        let ch = conn.create_channel().await?;
        let declared = ch
            .queue_declare(
                "kept",
                QueueDeclareOptions {
                    durable: true,
                    passive,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await;
        let _ = conn.close(200, "bye").await;
        declared?;
        Ok(())
    }

    #[tokio::test]
    #[ignore = "starts a RabbitMQ node twice (10-25 s each): cargo test -p outbox-chaos -- --ignored"]
    async fn a_private_node_restarts_with_its_queue_and_dies_when_dropped() {
        let dir = std::env::temp_dir().join(format!("chaos-rabbit-test-{}", std::process::id()));
        let mut node = PrivateRabbit::start(&dir).await.unwrap();
        declare(&node.url(), false).await.unwrap();
        let beam = node.beam.unwrap();
        node.restart().await.unwrap();
        assert!(!node.node.is_beam(beam), "the first VM is gone");
        assert_ne!(node.beam, Some(beam), "a new VM");
        declare(&node.url(), true).await.unwrap();
        let beam = node.beam.unwrap();
        drop(node);
        // Gone, or a zombie (no command line) until the script's reaper runs.
        let cmdline = std::fs::read(format!("/proc/{beam}/cmdline")).unwrap_or_default();
        assert!(cmdline.is_empty(), "killed when dropped");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
