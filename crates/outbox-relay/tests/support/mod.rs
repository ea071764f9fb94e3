//! Shared by the binary's tests: the relay command, its graceful stop and
//! drain, a free local address and a minimal HTTP GET for the metrics
//! listener.
#![allow(dead_code, unreachable_pub)]

#[cfg(feature = "postgres")]
pub mod pg;

use outbox_core::{EventId, Store};
use outbox_testkit::process::ChildGuard;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// `127.0.0.1:<port>` of a port that was free a moment ago.
pub fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("local address")
        .port();
    format!("127.0.0.1:{port}")
}

/// `GET path` on `addr`: status and body, `None` when nothing answers.
pub fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}

/// `outbox-relay <args>` with warnings logged and no configuration taken
/// from the environment (`OUTBOX_CONFIG`, `OUTBOX_STORE`).
pub fn relay(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    cmd.args(args)
        .env("RUST_LOG", "warn")
        .env_remove("OUTBOX_CONFIG")
        .env_remove("OUTBOX_STORE");
    cmd
}

/// Graceful stop: SIGTERM, then the relay must exit 0 within 30 s.
pub fn stop(relay: &mut ChildGuard) {
    let status = relay.terminate(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "relay exit after SIGTERM: {status:?} (None: ignored it, killed)"
    );
}

/// Polls `store` until nothing is pending or in flight (bounded); panics
/// when `relay` exits meanwhile.
pub async fn wait_drained<S: Store>(store: &S, relay: &mut ChildGuard, bound: Duration) {
    let deadline = Instant::now() + bound;
    loop {
        let stats = store.stats().await.expect("stats");
        if stats.pending == 0 && stats.in_flight == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the relay did not drain the outbox within {bound:?}: {stats:?}"
        );
        if let Some(status) = relay.child().try_wait().expect("try_wait") {
            panic!("relay exited early with {status}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Asserts that the `what` command exited 0, showing its stderr if not.
pub fn assert_success(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The `id` of each JSON-lines record in `text`, in order (a `jsonl:`
/// sink's file, `dead list --json`); a line that is not (yet) a whole JSON
/// document is skipped. Panics on a record without an event id.
pub fn jsonl_ids(text: &str) -> Vec<EventId> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            v["id"]
                .as_str()
                .expect("an id")
                .parse()
                .expect("an event id")
        })
        .collect()
}

/// Polls the JSON-lines `file` of a `jsonl:` sink until it holds at least
/// `expected` events or 60 s passed; returns their ids in file order.
/// Panics when `relay` exits meanwhile.
pub async fn wait_jsonl_ids(file: &Path, expected: usize, relay: &mut ChildGuard) -> Vec<EventId> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ids = jsonl_ids(&std::fs::read_to_string(file).unwrap_or_default());
        if ids.len() >= expected || Instant::now() > deadline {
            return ids;
        }
        if let Some(status) = relay.child().try_wait().expect("try_wait") {
            panic!("relay exited early with {status}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
