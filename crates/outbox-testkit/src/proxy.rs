//! [`TcpProxy`]: a TCP forwarder a test can cut, refuse and restore, to put
//! a broker or a database out of reach without touching the shared service.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// What the proxy does with connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forward to the upstream.
    Forward,
    /// Accept, then close at once (the peer sees a reset / EOF).
    Cut,
    /// Do not listen: connecting fails with "connection refused".
    Refuse,
}

/// A TCP proxy for tests: forwards every connection on a loopback port to
/// an upstream address. [`cut`](Self::cut) closes the open connections and
/// turns new ones away (accepted, then closed at once);
/// [`refuse`](Self::refuse) closes them and stops listening, so a client
/// gets "connection refused"; [`restore`](Self::restore) forwards again on
/// the same port. The upstream can be changed while it runs.
///
/// It runs on the tokio runtime that is current when it is started.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    state: Arc<Mutex<ProxyState>>,
}

#[derive(Debug)]
struct ProxyState {
    mode: ProxyMode,
    upstream: SocketAddr,
    connections: Vec<AbortHandle>,
    accept: Option<AbortHandle>,
    /// The accept loop's listening socket (a second handle on it), to shut
    /// it down at once: the loop's own handle closes only when the aborted
    /// task is dropped, which a runtime may put off (the task can sit in
    /// the LIFO slot of the very worker that is about to block in
    /// [`TcpProxy::restore`]).
    listening: Option<socket2::Socket>,
}

/// A loopback listener on a free port BELOW the kernel's ephemeral range.
/// A port from that range (what binding port 0 gives) can be taken, while
/// [`TcpProxy::refuse`] has it closed, as the local port of any outgoing
/// connection on the machine (parallel tests open many), and then
/// [`TcpProxy::restore`] cannot listen on it again. Falls back to port 0
/// when no such port is free (or the range is unknown).
fn listen_outside_ephemeral_range() -> std::net::TcpListener {
    const LOWEST: u32 = 10_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    if ephemeral_low > LOWEST + 1_000 {
        let span = ephemeral_low - LOWEST;
        // Spread the processes and proxies over the span: a start that
        // differs per process and per call, then the next ports in turn.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let start = (std::process::id().wrapping_mul(7_919) ^ nanos) % span;
        for i in 0..256 {
            let port = LOWEST + (start + i * 97) % span;
            let Ok(port) = u16::try_from(port) else {
                continue;
            };
            if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                return l;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind proxy")
}

impl TcpProxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        Self::bind(upstream)
    }

    /// [`start`](Self::start) from synchronous code running inside a tokio
    /// runtime (the accept loop is spawned on it).
    pub fn bind(upstream: SocketAddr) -> Self {
        let listener = listen_outside_ephemeral_range();
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(Mutex::new(ProxyState {
            mode: ProxyMode::Forward,
            upstream,
            connections: Vec::new(),
            accept: None,
            listening: None,
        }));
        let proxy = Self { addr, state };
        proxy.listen(listener);
        proxy
    }

    fn listen(&self, listener: std::net::TcpListener) {
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let handle = listener
            .try_clone()
            .map(socket2::Socket::from)
            .expect("a second handle on the listener");
        let listener = TcpListener::from_std(listener).expect("tokio listener");
        let st = self.state.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut downstream, _)) = listener.accept().await else {
                    // Shut down by `refuse` (this task is being aborted),
                    // or out of descriptors: do not spin.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                let mut guard = st.lock().expect("proxy state");
                if guard.mode != ProxyMode::Forward {
                    drop(downstream);
                    continue;
                }
                let upstream = guard.upstream;
                let task = tokio::spawn(async move {
                    if let Ok(mut upstream) = TcpStream::connect(upstream).await {
                        // Forward each write at once, as a direct connection
                        // would: with Nagle's algorithm on, small request /
                        // response protocols (Kafka) stall on delayed ACKs.
                        let _ = downstream.set_nodelay(true);
                        let _ = upstream.set_nodelay(true);
                        let _ = tokio::io::copy_bidirectional(&mut downstream, &mut upstream).await;
                    }
                });
                guard.connections.retain(|c| !c.is_finished());
                guard.connections.push(task.abort_handle());
            }
        })
        .abort_handle();
        let mut guard = self.state.lock().expect("proxy state");
        guard.accept = Some(accept);
        guard.listening = Some(handle);
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The current mode.
    pub fn mode(&self) -> ProxyMode {
        self.state.lock().expect("proxy state").mode
    }

    /// Forwards new connections to `upstream` from now on.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        self.state.lock().expect("proxy state").upstream = upstream;
    }

    /// Closes every forwarded connection and closes new ones at once.
    pub fn cut(&self) {
        let mut guard = self.state.lock().expect("proxy state");
        guard.mode = ProxyMode::Cut;
        for c in guard.connections.drain(..) {
            c.abort();
        }
    }

    /// Closes every forwarded connection and stops listening: new
    /// connections are refused until [`restore`](Self::restore).
    pub fn refuse(&self) {
        let mut guard = self.state.lock().expect("proxy state");
        guard.mode = ProxyMode::Refuse;
        for c in guard.connections.drain(..) {
            c.abort();
        }
        if let Some(a) = guard.accept.take() {
            a.abort();
        }
        // Stop listening now: connections are refused from here on, and
        // the port can be bound again at once (a shut-down socket no
        // longer listens, whenever its last handle closes).
        if let Some(l) = guard.listening.take() {
            let _ = l.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Forwards new connections again (listening again on the same port
    /// after [`refuse`](Self::refuse)).
    pub fn restore(&self) {
        let relisten = {
            let mut guard = self.state.lock().expect("proxy state");
            let was = guard.mode;
            guard.mode = ProxyMode::Forward;
            was == ProxyMode::Refuse
        };
        if relisten {
            // `refuse` shut the old listener down; binding again can only
            // fail while another socket took the port meanwhile.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let listener = loop {
                match std::net::TcpListener::bind(self.addr) {
                    Ok(l) => break l,
                    Err(e) => {
                        assert!(
                            std::time::Instant::now() < deadline,
                            "cannot listen on {} again: {e}",
                            self.addr
                        );
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                }
            };
            self.listen(listener);
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        if let Ok(mut guard) = self.state.lock() {
            if let Some(a) = guard.accept.take() {
                a.abort();
            }
            if let Some(l) = guard.listening.take() {
                let _ = l.shutdown(std::net::Shutdown::Both);
            }
            for c in guard.connections.drain(..) {
                c.abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn roundtrip(s: &mut TcpStream) -> std::io::Result<[u8; 4]> {
        s.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await?;
        Ok(buf)
    }

    #[tokio::test]
    async fn proxy_forwards_cuts_refuses_and_restores() {
        let proxy = TcpProxy::start(echo_server().await).await;
        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(&roundtrip(&mut a).await.unwrap(), b"ping");

        proxy.cut();
        assert!(roundtrip(&mut a).await.is_err(), "open connection closed");
        let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(roundtrip(&mut b).await.is_err(), "new connection closed");

        proxy.restore();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(&roundtrip(&mut c).await.unwrap(), b"ping");

        proxy.refuse();
        assert!(roundtrip(&mut c).await.is_err(), "open connection closed");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let refused = TcpStream::connect(proxy.addr()).await.unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);

        proxy.restore();
        let mut d = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(&roundtrip(&mut d).await.unwrap(), b"ping");

        // A new upstream for new connections.
        proxy.set_upstream(echo_server().await);
        let mut e = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(&roundtrip(&mut e).await.unwrap(), b"ping");
    }
}
