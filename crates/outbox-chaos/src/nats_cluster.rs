//! A private three-node NATS JetStream cluster for `nats-leader-kill`.
//!
//! Three `nats-server` processes on free loopback ports, routed to each
//! other (cluster `outbox-chaos`, servers `n0` to `n2`), each with its own
//! JetStream file store under the run's directory. The run's stream is
//! created with three replicas; the relays and the consumer get every
//! node's URL and follow the cluster as any client would.
//!
//! The fault asks the stream who leads it, kills that server with SIGKILL
//! (no goodbye, no flush: a node lost), waits until another node leads the
//! stream, keeps the killed one down a little longer, and starts it again on
//! the same ports and store: it catches up from the new leader.
//!
//! The servers are children of the run (its process group) and are killed
//! when dropped.

use anyhow::{bail, Context as _, Result};
use outbox_nats::async_nats;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// Nodes of the cluster.
const NODES: usize = 3;
/// The cluster's name.
const CLUSTER: &str = "outbox-chaos";
/// How long a node has to accept connections after a start, and the
/// cluster to elect a stream leader.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a killed node stays down once another leads the stream.
const DOWN_FOR: Duration = Duration::from_secs(2);

/// One node: its ports, store and process.
#[derive(Debug)]
struct Node {
    name: String,
    client: SocketAddr,
    route: SocketAddr,
    store: PathBuf,
    log: PathBuf,
    child: Child,
}

/// The three nodes; killed when dropped.
#[derive(Debug)]
pub(crate) struct NatsCluster {
    bin: PathBuf,
    dir: PathBuf,
    nodes: Vec<Node>,
}

impl NatsCluster {
    /// Starts the three nodes under `dir` and waits until each greets a
    /// client and the cluster has a JetStream meta leader.
    pub(crate) async fn start(dir: &Path) -> Result<Self> {
        let bin = outbox_testkit::process::nats_server_bin();
        let dir = dir.join("nats-cluster");
        std::fs::create_dir_all(&dir)?;
        let mut ports = Vec::new();
        for _ in 0..NODES {
            ports.push((crate::child::free_port()?, crate::child::free_port()?));
        }
        let routes: Vec<SocketAddr> = ports.iter().map(|(_, r)| *r).collect();
        let mut nodes = Vec::new();
        for (i, (client, route)) in ports.into_iter().enumerate() {
            let name = format!("n{i}");
            let store = dir.join(format!("{name}-store"));
            let log = dir.join(format!("{name}.log"));
            let child = spawn(&bin, &name, client, route, &routes, &store, &log)?;
            nodes.push(Node {
                name,
                client,
                route,
                store,
                log,
                child,
            });
        }
        let mut cluster = Self { bin, dir, nodes };
        for i in 0..NODES {
            cluster.wait_greets(i).await?;
        }
        cluster.wait_meta_leader().await?;
        eprintln!(
            "chaos: private NATS cluster {CLUSTER} ({}), stores under {}",
            cluster.url(),
            cluster.dir.display()
        );
        Ok(cluster)
    }

    /// Every node's URL, comma-separated (as NATS clients take them).
    pub(crate) fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("nats://{}", n.client))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Where the nodes keep their stores and logs.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The server leading `stream` now, if one does.
    async fn leader(&self, js: &async_nats::jetstream::Context, stream: &str) -> Option<String> {
        let mut s = js.get_stream(stream).await.ok()?;
        let info = s.info().await.ok()?;
        info.cluster.as_ref()?.leader.clone()
    }

    /// Kills the server leading `stream` (SIGKILL), waits until another
    /// node leads it, keeps the killed one down for [`DOWN_FOR`] more and
    /// starts it again on its ports and store. Returns the killed node's
    /// name and when the new leader was seen (microseconds since the epoch).
    pub(crate) async fn kill_leader(&mut self, stream: &str) -> Result<(String, i64)> {
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .connect(servers(&self.url())?)
            .await
            .context("connecting to the private NATS cluster")?;
        let js = async_nats::jetstream::new(client);
        let leader = self
            .leader(&js, stream)
            .await
            .with_context(|| format!("stream {stream} has no leader to kill"))?;
        let i = self
            .nodes
            .iter()
            .position(|n| n.name == leader)
            .with_context(|| format!("stream leader {leader:?} is not a node of the run"))?;
        self.nodes[i].child.start_kill()?;
        let _ = self.nodes[i].child.wait().await;
        let deadline = Instant::now() + READY_TIMEOUT;
        let elected = loop {
            match self.leader(&js, stream).await {
                Some(l) if l != leader => break crate::record::now_us(),
                _ if Instant::now() >= deadline => {
                    bail!("no other node led stream {stream} within {READY_TIMEOUT:?} after {leader} was killed")
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        tokio::time::sleep(DOWN_FOR).await;
        let routes: Vec<SocketAddr> = self.nodes.iter().map(|n| n.route).collect();
        let n = &self.nodes[i];
        let child = spawn(
            &self.bin, &n.name, n.client, n.route, &routes, &n.store, &n.log,
        )?;
        self.nodes[i].child = child;
        self.wait_greets(i).await?;
        Ok((leader, elected))
    }

    /// Waits until node `i` sends its `INFO` greeting.
    async fn wait_greets(&mut self, i: usize) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let node = &mut self.nodes[i];
            if let Some(status) = node.child.try_wait()? {
                bail!(
                    "nats-server {} exited at start ({status}); see {}",
                    node.name,
                    node.log.display()
                );
            }
            if crate::nats::greets(node.client).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "nats-server {} on {} did not answer within {READY_TIMEOUT:?}; see {}",
                    node.name,
                    node.client,
                    node.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until JetStream answers a stream lookup (the cluster elected
    /// its meta leader): "stream not found" is an answer.
    async fn wait_meta_leader(&self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let client = async_nats::connect(servers(&self.url())?).await?;
        let js = async_nats::jetstream::new(client);
        loop {
            let last = match js.get_stream("OUTBOX_CHAOS_READY").await {
                Ok(_) => return Ok(()),
                Err(e) if e.to_string().contains("not found") => return Ok(()),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                bail!(
                    "the NATS cluster's JetStream did not answer within {READY_TIMEOUT:?} (last: {last}); see the logs under {}",
                    self.dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The servers of a comma-separated URL list (async-nats parses one URL
/// per string).
pub(crate) fn servers(urls: &str) -> Result<Vec<async_nats::ServerAddr>> {
    urls.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| {
            u.parse::<async_nats::ServerAddr>()
                .with_context(|| format!("bad NATS URL {u:?}"))
        })
        .collect()
}

fn spawn(
    bin: &Path,
    name: &str,
    client: SocketAddr,
    route: SocketAddr,
    routes: &[SocketAddr],
    store: &Path,
    log: &Path,
) -> Result<Child> {
    let others: Vec<String> = routes
        .iter()
        .filter(|r| **r != route)
        .map(|r| format!("nats://{r}"))
        .collect();
    let mut cmd = Command::new(bin);
    cmd.args([
        "-a",
        &client.ip().to_string(),
        "-p",
        &client.port().to_string(),
    ])
    .args(["-js", "--server_name", name, "--cluster_name", CLUSTER])
    .args(["--cluster", &format!("nats://{route}")])
    .args(["--routes", &others.join(",")])
    .arg("-sd")
    .arg(store);
    crate::child::spawn_logged(cmd, log).with_context(|| {
        format!(
            "starting {} (set NATS_SERVER_BIN, or install Debian's nats-server)",
            bin.display()
        )
    })
}
