//! The listener: the accept loop within the connection cap (the module
//! docs' "Limits"), each connection served by hyper's HTTP/1 connection in
//! its own task, dropped unanswered when its request head is late and
//! dropped when its response is.

use axum::Router;
use hyper::service::Service as _;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tracing::{debug, warn};

/// Longest request head read (request line and headers); hyper answers a
/// longer one `431`.
const MAX_HEAD: usize = 8 * 1024;
/// Connections served at once; more are closed at once (module docs).
pub(crate) const MAX_CONNECTIONS: usize = 64;
/// How long a client may take to send its whole request head.
pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long writing one response (and closing the connection) may take.
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Least time between two WARN lines about refused connections.
const REFUSED_LOG_EVERY: Duration = Duration::from_secs(60);

/// The listener's limits (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limits {
    pub(super) max_connections: usize,
    pub(super) read_timeout: Duration,
    pub(super) write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            read_timeout: READ_TIMEOUT,
            write_timeout: WRITE_TIMEOUT,
        }
    }
}

/// The accept loop: every connection within `limits` gets its own task,
/// answered by `router`; one beyond the connection cap is closed at once.
pub(super) fn serve_on(
    listener: TcpListener,
    limits: Limits,
    router: Router,
) -> tokio::task::JoinHandle<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    tokio::spawn(async move {
        let mut refused: u64 = 0;
        let mut last_warned: Option<Instant> = None;
        loop {
            match listener.accept().await {
                Ok((stream, peer)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        // Dropped: closed at once, unanswered.
                        refused += 1;
                        debug!(%peer, "HTTP connection limit reached; connection closed");
                        if last_warned.is_none_or(|t| t.elapsed() >= REFUSED_LOG_EVERY) {
                            warn!(
                                limit = limits.max_connections,
                                refused,
                                "HTTP endpoint: connection limit reached; new connections are closed until open ones finish or time out"
                            );
                            last_warned = Some(Instant::now());
                            refused = 0;
                        }
                        continue;
                    };
                    let router = router.clone();
                    tokio::spawn(async move {
                        if let Err(e) = serve(stream, limits, router).await {
                            debug!(%peer, error = %e, "HTTP connection ended with an error");
                        }
                        drop(slot);
                    });
                }
                // E.g. too many open files: wait instead of spinning.
                Err(e) => {
                    debug!(error = %e, "cannot accept an HTTP connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    })
}

/// One request and its response on `stream`: hyper reads the head and
/// writes the answer; the connection is dropped (closed, unanswered) when
/// the whole head has not arrived within the read timeout, and dropped
/// when the answer is not out within the write timeout from then. The
/// deadlines are tokio timers around the connection, not hyper's
/// `header_read_timeout`, so what a late client gets (nothing) does not
/// hang on how hyper reports its own timeout.
async fn serve(stream: TcpStream, limits: Limits, router: Router) -> Result<(), String> {
    let head_read = Arc::new(Notify::new());
    let service = {
        let (head_read, router) = (head_read.clone(), TowerToHyperService::new(router));
        hyper::service::service_fn(move |request| {
            head_read.notify_one();
            router.call(request)
        })
    };
    let mut conn = std::pin::pin!(hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .header_read_timeout(None)
        .max_buf_size(MAX_HEAD)
        .serve_connection(TokioIo::new(stream), service));
    tokio::select! {
        done = conn.as_mut() => return done.map_err(|e| e.to_string()),
        () = head_read.notified() => {}
        () = tokio::time::sleep(limits.read_timeout) => {
            return Err("no whole request head within the read timeout".into());
        }
    }
    tokio::time::timeout(limits.write_timeout, conn)
        .await
        .map_err(|_| "the response was not written within the write timeout".to_owned())?
        .map_err(|e| e.to_string())
}
