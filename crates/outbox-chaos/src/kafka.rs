//! A private Tansu broker for a Kafka run with broker faults.
//!
//! A Kafka client uses its bootstrap address once, then connects to the
//! address the broker advertises in its metadata: a proxy in front of the
//! shared broker (which advertises itself) would be bypassed, and cutting it
//! would cut nothing. So a Kafka run whose plan has a broker fault starts
//! its own Tansu (in-memory storage) on a free loopback port P, advertising
//! the fault proxy's port Q, with the proxy forwarding Q to P: every client
//! (relays, consumer, admin) is sent to Q by the metadata and stays behind
//! the proxy. The consumer is then cut with the relays; it reconnects and
//! resumes from its position, so nothing is lost, and the arrival times it
//! records (hence the recovery times) include its own reconnection.
//!
//! It keeps its log in memory, so it cannot be restarted (`broker-restart`
//! is refused for Kafka): a restart would lose the topic, which is not what
//! a restart of a real cluster does. Tansu's file-backed engine (`--storage-engine
//! sqlite://...`, feature `libsql`) was tried for it on 2026-12-01: Tansu
//! 0.6.0 panics in its idempotent-producer check ("more or less than one
//! row", `tansu-storage` `lite.rs`) within a second of three idempotent
//! producers at 2,000 events/s, so every produce fails from then on.
//!
//! The broker is a child of the run, in the run's process group (as the
//! relays are), so `cargo xtask chaos`, which kills that group when the run
//! ends, stops it even if the run itself was killed; the guard kills it
//! when dropped, whatever way the run leaves.

use anyhow::{bail, Context as _, Result};
use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use outbox_kafka::rdkafka::ClientConfig;
use outbox_testkit::proxy::TcpProxy;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// How long the broker has to answer a metadata request through the proxy.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Start attempts (another process may take the free port first).
const ATTEMPTS: u32 = 3;

/// A Tansu broker owned by the run, behind its fault proxy; killed when
/// dropped.
#[derive(Debug)]
pub(crate) struct PrivateKafka {
    proxy: Arc<TcpProxy>,
    child: Child,
    log: PathBuf,
}

impl PrivateKafka {
    /// Starts the proxy, then the broker advertising the proxy's address,
    /// and waits (at most 30 s) until the broker answers a metadata request
    /// through the proxy and advertises it. The log is `tansu.log` in
    /// `log_dir`.
    pub(crate) async fn start(log_dir: &Path) -> Result<Self> {
        let bin = tansu_bin();
        let log = log_dir.join("tansu.log");
        let mut last_error = None;
        let mut listen = crate::child::free_port()?;
        // The proxy first: its port is the advertised one.
        let proxy = Arc::new(TcpProxy::start(listen).await);
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                listen = crate::child::free_port()?;
                proxy.set_upstream(listen);
            }
            let child = spawn(&bin, listen, proxy.addr(), &log)?;
            let mut broker = Self {
                proxy: proxy.clone(),
                child,
                log: log.clone(),
            };
            match broker.wait_ready().await {
                Ok(()) => {
                    eprintln!(
                        "chaos: private Kafka broker (tansu pid {}) on {listen}, advertised and reached through the fault proxy {}, log {}",
                        broker.child.id().unwrap_or(0),
                        proxy.addr(),
                        log.display()
                    );
                    return Ok(broker);
                }
                Err(e) => {
                    broker.stop().await;
                    last_error = Some(e);
                }
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow::anyhow!("no attempt made")))
            .with_context(|| format!("starting the private Kafka broker (see {})", log.display()))
    }

    /// The bootstrap address every client uses: the proxy's.
    pub(crate) fn brokers(&self) -> String {
        self.proxy.addr().to_string()
    }

    /// The fault proxy in front of the broker.
    pub(crate) fn proxy(&self) -> Arc<TcpProxy> {
        self.proxy.clone()
    }

    /// Kills the broker and waits for it.
    pub(crate) async fn stop(&mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let advertised = self.proxy.addr();
        let client: Arc<BaseConsumer> = Arc::new(
            ClientConfig::new()
                .set("bootstrap.servers", advertised.to_string())
                .set("reconnect.backoff.ms", "100")
                .set("reconnect.backoff.max.ms", "500")
                .create()
                .context("Kafka metadata client")?,
        );
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "tansu exited during start-up ({status}); see {}",
                    self.log.display()
                );
            }
            let c = client.clone();
            let answer = tokio::task::spawn_blocking(move || {
                c.fetch_metadata(None, Duration::from_secs(2)).map(|m| {
                    m.brokers()
                        .iter()
                        .map(|b| format!("{}:{}", b.host(), b.port()))
                        .collect::<Vec<_>>()
                })
            })
            .await
            .context("metadata task")?;
            match answer {
                Ok(brokers) => {
                    let port = advertised.port();
                    if brokers.iter().any(|b| b.ends_with(&format!(":{port}"))) {
                        return Ok(());
                    }
                    bail!("the broker advertises {brokers:?}, not the proxy {advertised}");
                }
                Err(e) if Instant::now() >= deadline => bail!(
                    "no metadata through {advertised} within {} s ({e}); see {}",
                    READY_TIMEOUT.as_secs(),
                    self.log.display()
                ),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

fn spawn(bin: &Path, listen: SocketAddr, advertised: SocketAddr, log: &Path) -> Result<Child> {
    let mut cmd = Command::new(bin);
    cmd.args([
        "broker",
        "--listener-url",
        &format!("tcp://{listen}"),
        "--advertised-listener-url",
        &format!("tcp://{advertised}"),
        "--storage-engine",
        "memory://tansu/",
    ]);
    crate::child::spawn_logged(cmd, log).with_context(|| {
        format!(
            "starting {} (set TANSU_BIN, or run through `cargo xtask chaos`, which installs it)",
            bin.display()
        )
    })
}

/// `$TANSU_BIN` (set by `cargo xtask chaos`, which finds or installs the
/// broker), else `tansu` on `PATH`.
fn tansu_bin() -> PathBuf {
    std::env::var_os("TANSU_BIN").map_or_else(|| PathBuf::from("tansu"), PathBuf::from)
}
