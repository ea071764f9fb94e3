//! The minimal HTTP/1.1 responder: the accept loop within the listener's
//! limits (the module docs' "Limits"), one task per connection, reading the
//! request head and writing the response under their timeouts.

use super::{Endpoints, Response};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

/// Longest request head read (request line and headers).
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

/// Serves `endpoints` on `listener` until the runtime stops, within the
/// default [`Limits`].
pub(crate) fn spawn(listener: TcpListener, endpoints: Endpoints) {
    let endpoints = Arc::new(endpoints);
    serve_on(listener, Limits::default(), move |method, target| {
        endpoints.respond(method, target)
    });
}

/// The accept loop: every connection within `limits` gets its own task,
/// answered by `respond(method, target)`; one beyond the connection cap is
/// closed at once.
pub(super) fn serve_on(
    listener: TcpListener,
    limits: Limits,
    respond: impl Fn(&str, &str) -> Response + Send + Sync + 'static,
) -> tokio::task::JoinHandle<()> {
    let respond = Arc::new(respond);
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
                    let respond = respond.clone();
                    tokio::spawn(async move {
                        if let Err(e) = serve(stream, limits, &*respond).await {
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

/// Reads one request head and writes one response, each within its timeout.
async fn serve(
    mut stream: TcpStream,
    limits: Limits,
    respond: &(impl Fn(&str, &str) -> Response + ?Sized),
) -> std::io::Result<()> {
    let timed_out = |what: &str| std::io::Error::new(std::io::ErrorKind::TimedOut, what.to_owned());
    let head = tokio::time::timeout(limits.read_timeout, read_head(&mut stream))
        .await
        .map_err(|_| timed_out("reading the request head"))??;
    let mut parts = head.split_ascii_whitespace();
    let (method, response) = match (parts.next(), parts.next(), parts.next()) {
        (Some(method), Some(target), Some(version)) if version.starts_with("HTTP/1.") => {
            (method, respond(method, target))
        }
        _ => ("GET", Response::text(400, "bad request\n")),
    };
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n",
        response.status,
        response.reason(),
        response.content_type,
        response.body.len()
    );
    if response.status == 405 {
        out.push_str("Allow: GET, HEAD\r\n");
    }
    out.push_str("\r\n");
    if method != "HEAD" {
        out.push_str(&response.body);
    }
    tokio::time::timeout(limits.write_timeout, async {
        stream.write_all(out.as_bytes()).await?;
        stream.shutdown().await
    })
    .await
    .map_err(|_| timed_out("writing the response"))?
}

/// The request line, once the whole head (up to the blank line) was read.
async fn read_head(stream: &mut TcpStream) -> std::io::Result<String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.len() > MAX_HEAD {
            break;
        }
    }
    let line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
    Ok(String::from_utf8_lossy(line).trim().to_owned())
}
