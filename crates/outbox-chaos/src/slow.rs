//! A slow sink for `db-cut-one`: a TCP proxy between one relay and the
//! broker that forwards the relay's bytes at once but holds every byte the
//! broker sends back (its acknowledgements) for a settable delay. The
//! relay's publishes reach the broker when it sends them (nothing it sent
//! arrives late); only the answers are late, so its deliveries take as
//! long as the delay: a slow broker, as the relay sees it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The proxy; its accept loop stops when it is dropped.
#[derive(Debug)]
pub(crate) struct SlowProxy {
    addr: SocketAddr,
    /// The delay of the broker's answers, in ms.
    delay_ms: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl Drop for SlowProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl SlowProxy {
    /// Listens on a loopback port and forwards to `upstream`, no delay yet.
    pub(crate) async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let delay_ms = Arc::new(AtomicU64::new(0));
        let delay = Arc::clone(&delay_ms);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let delay = Arc::clone(&delay);
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        pipe(client, server, delay).await;
                    }
                });
            }
        });
        Ok(Self {
            addr,
            delay_ms,
            accept,
        })
    }

    /// Where the relay connects.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Holds the broker's answers this long from now on (zero: none).
    pub(crate) fn set_delay(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.delay_ms.store(ms, Ordering::SeqCst);
    }
}

/// Client to server at once; server to client, each chunk released at its
/// arrival plus the delay then in force (in order).
async fn pipe(client: TcpStream, server: TcpStream, delay_ms: Arc<AtomicU64>) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let up = async {
        let _ = tokio::io::copy(&mut client_rx, &mut server_tx).await;
        let _ = server_tx.shutdown().await;
    };
    let (chunks_tx, mut chunks_rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let due =
                        Instant::now() + Duration::from_millis(delay_ms.load(Ordering::SeqCst));
                    if chunks_tx.send((due, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    };
    let write = async move {
        while let Some((due, chunk)) = chunks_rx.recv().await {
            tokio::time::sleep_until(due).await;
            if client_tx.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = client_tx.shutdown().await;
    };
    tokio::join!(up, async { tokio::join!(read, write) });
}
