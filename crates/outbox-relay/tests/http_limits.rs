//! `outbox-relay run --metrics-addr`: the listener bounds what clients can
//! hold. Connections beyond the cap (64) are closed at once while the
//! endpoint keeps serving once idle connections time out; a connection
//! that sends nothing is closed by the server after its read timeout (5 s).
//! Bounds are generous (30 s): no test depends on how fast the machine is.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod support;

use outbox_testkit::process::ChildGuard;
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::process::Stdio;
use std::time::{Duration, Instant};
use support::{free_addr, get, relay, stop};

/// The binary's connection cap (`http::MAX_CONNECTIONS`).
const CAP: usize = 64;

/// `outbox-relay run` on a fresh SQLite outbox, serving health on `addr`.
fn spawn_relay(dir: &tempfile::TempDir, addr: &str) -> ChildGuard {
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    ChildGuard::new(
        relay(&["run", "--store", &url, "--migrate", "--sink", "stdout"])
            .args(["--metrics-addr", addr])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Polls `/healthz` until it answers 200 (at most `bound`).
fn healthz_within(addr: &str, bound: Duration) -> bool {
    let deadline = Instant::now() + bound;
    while Instant::now() < deadline {
        if get(addr, "/healthz").is_some_and(|(s, body)| s == 200 && body == "ok\n") {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// Whether the server closed `s` (end of stream or reset); `s` must be
/// non-blocking. Idle connections are never sent anything.
fn is_closed(s: &TcpStream) -> bool {
    let mut buf = [0u8; 64];
    match (&*s).read(&mut buf) {
        // End of stream; an idle connection is never sent any data, so
        // data would be a bug the assertions on `closed` show.
        Ok(0) => true,
        Ok(_) => panic!("an idle connection was answered"),
        Err(e) => e.kind() != ErrorKind::WouldBlock,
    }
}

#[test]
fn connections_beyond_the_cap_are_closed_and_the_endpoint_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let mut child = spawn_relay(&dir, &addr);
    assert!(
        healthz_within(&addr, Duration::from_secs(30)),
        "no /healthz"
    );

    // The cap and 8 more idle connections, sending nothing.
    let extra = 8;
    let idle: Vec<TcpStream> = (0..CAP + extra)
        .map(|_| {
            let s = TcpStream::connect(&addr).unwrap();
            s.set_nonblocking(true).unwrap();
            s
        })
        .collect();

    // Those beyond the cap are closed at once, while the others are still
    // open (they last until the 5 s read timeout).
    let deadline = Instant::now() + Duration::from_secs(30);
    let (closed, open) = loop {
        let closed = idle.iter().filter(|s| is_closed(s)).count();
        if closed >= extra || Instant::now() > deadline {
            break (closed, idle.len() - closed);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(closed >= extra, "only {closed} connections were closed");
    // One slot may still have been held by the /healthz probe above.
    assert!(
        open >= CAP - extra,
        "{closed} closed at once, {open} open: the cap did not keep them out"
    );

    // The endpoint answers again once the idle connections time out...
    assert!(
        healthz_within(&addr, Duration::from_secs(30)),
        "/healthz did not answer again"
    );
    // ... and every idle connection is closed by the server.
    let deadline = Instant::now() + Duration::from_secs(30);
    while idle.iter().any(|s| !is_closed(s)) {
        assert!(
            Instant::now() < deadline,
            "idle connections still open after 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        child.child().try_wait().unwrap().is_none(),
        "the relay exited"
    );
    stop(&mut child);
}

#[test]
fn a_silent_connection_is_closed_by_the_server_after_its_read_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let mut child = spawn_relay(&dir, &addr);
    assert!(
        healthz_within(&addr, Duration::from_secs(30)),
        "no /healthz"
    );

    let mut silent = TcpStream::connect(&addr).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let opened = Instant::now();
    let mut buf = [0u8; 64];
    let n = silent
        .read(&mut buf)
        .expect("the server did not close a silent connection within 30 s");
    assert_eq!(n, 0, "closed unanswered");
    // Closed by the read timeout (5 s from its accept), not at once.
    assert!(
        opened.elapsed() >= Duration::from_secs(1),
        "closed after {:?}",
        opened.elapsed()
    );
    // The endpoint still serves.
    assert_eq!(get(&addr, "/healthz").unwrap().0, 200);
    stop(&mut child);
}
