//! An in-process TCP proxy between the relays and a service (the broker or
//! PostgreSQL). Up, it forwards bytes both ways. Down, it cuts every open
//! connection and stops listening, so new connections are refused
//! (`ECONNREFUSED`), as when the service's host goes away; up again, it
//! listens on the same port.

use anyhow::{Context as _, Result};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinHandle};

/// A running proxy; stops (cutting everything) when dropped.
#[derive(Debug)]
pub(crate) struct Proxy {
    addr: SocketAddr,
    up: watch::Sender<bool>,
    task: JoinHandle<()>,
}

#[derive(Debug, Default)]
struct Conns(Mutex<Vec<AbortHandle>>);

impl Conns {
    fn add(&self, h: AbortHandle) {
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|h| !h.is_finished());
        v.push(h);
    }

    fn cut_all(&self) {
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for h in v.drain(..) {
            h.abort();
        }
    }
}

impl Proxy {
    /// Listens on a free loopback port, forwarding to `upstream`.
    pub(crate) async fn start(upstream: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the proxy")?;
        let addr = listener.local_addr()?;
        let (up, rx) = watch::channel(true);
        let task = tokio::spawn(serve(Some(listener), addr, upstream, rx));
        Ok(Self { addr, up, task })
    }

    /// Where the relays connect.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts every connection and refuses new ones.
    pub(crate) fn down(&self) {
        let _ = self.up.send(false);
    }

    /// Forwards again.
    pub(crate) fn up(&self) {
        let _ = self.up.send(true);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(
    mut first: Option<TcpListener>,
    addr: SocketAddr,
    upstream: SocketAddr,
    mut up: watch::Receiver<bool>,
) {
    let conns = Arc::new(Conns::default());
    loop {
        while !*up.borrow_and_update() {
            if up.changed().await.is_err() {
                return;
            }
        }
        let listener = match first.take() {
            Some(l) => l,
            None => match rebind(addr).await {
                Some(l) => l,
                None => return,
            },
        };
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    if let Ok((client, _)) = accepted {
                        let h = tokio::spawn(forward(client, upstream));
                        conns.add(h.abort_handle());
                    }
                }
                changed = up.changed() => {
                    if changed.is_err() {
                        conns.cut_all();
                        return;
                    }
                    if !*up.borrow_and_update() {
                        break;
                    }
                }
            }
        }
        drop(listener);
        conns.cut_all();
    }
}

/// Listens on `addr` again (the listener sets `SO_REUSEADDR`); retries for
/// a few seconds in case the port is briefly held.
async fn rebind(addr: SocketAddr) -> Option<TcpListener> {
    for _ in 0..100 {
        if let Ok(l) = TcpListener::bind(addr).await {
            return Some(l);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("chaos proxy: cannot listen on {addr} again");
    None
}

async fn forward(mut client: TcpStream, upstream: SocketAddr) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn forwards_cuts_refuses_and_comes_back() {
        let proxy = Proxy::start(echo_server().await).await.unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        c.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");

        proxy.down();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The open connection is cut ...
        let n = c.read(&mut buf).await.unwrap_or(0);
        assert_eq!(n, 0, "the connection must be closed");
        // ... and new ones are refused.
        let err = TcpStream::connect(proxy.addr()).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);

        proxy.up();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        c.write_all(b"pong").await.unwrap();
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"pong");
    }
}
