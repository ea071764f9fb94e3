//! The relay (`outbox-worker`) on PostgreSQL: several relays on one table,
//! and a relay paused (SIGSTOP) past its lease.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    missing_docs
)]

#[path = "../crates/outbox-postgres/tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;

use common::TestDb;
use outbox_core::{Event, EventId, NewEvent, Outcome, RelayId, Sink};
use outbox_postgres::{Ident, PgStore, PgStoreOptions};
use outbox_testkit::process::ChildGuard;
use outbox_worker::{Relay, RelayOptions};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Records every delivery (per event id) and acknowledges it.
#[derive(Debug, Default, Clone)]
struct Recorder {
    seen: Arc<Mutex<HashMap<EventId, u32>>>,
    /// When set, `deliver` waits until this file exists.
    gate: Option<PathBuf>,
}

impl Sink for Recorder {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        if let Some(gate) = &self.gate {
            while !gate.exists() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let mut seen = self.seen.lock().unwrap();
        for e in events {
            *seen.entry(e.id).or_default() += 1;
        }
        vec![Outcome::Delivered; events.len()]
    }
}

fn relay_options(id: &str) -> RelayOptions {
    RelayOptions::default()
        .with_relay_id(RelayId::new(id))
        .with_batch_size(250)
        .with_poll_interval(Duration::from_millis(50))
        .with_lock_timeout(Duration::from_secs(300))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_deliver_50k_events_exactly_once() {
    const N: usize = 50_000;
    let db = TestDb::new().await;
    let mut ids = Vec::with_capacity(N);
    for chunk in 0..(N / 5000) {
        let events = (0..5000).map(|i| {
            let n = chunk * 5000 + i;
            let e = NewEvent::new("load.event", "load", n.to_string().into_bytes());
            // Half keyed (per-key order applies), half keyless.
            if n % 2 == 0 {
                e.with_key(format!("key-{}", n % 97))
            } else {
                e
            }
        });
        let mut tx = db.pool.begin().await.unwrap();
        ids.extend(db.outbox.enqueue_batch(&mut tx, events).await.unwrap());
        tx.commit().await.unwrap();
    }

    let sink = Recorder::default();
    let mut relays = Vec::new();
    for r in 0..4 {
        let store = db.store().await;
        let relay = Relay::new(store, sink.clone(), relay_options(&format!("relay-{r}"))).unwrap();
        relays.push(tokio::spawn(relay.run_until_idle()));
    }
    let mut delivered = 0;
    for r in relays {
        let summary = r.await.unwrap();
        assert_eq!(summary.lease_lost, 0);
        assert_eq!((summary.retried, summary.dead), (0, 0));
        delivered += summary.delivered;
    }
    assert_eq!(delivered, N as u64);
    {
        let seen = sink.seen.lock().unwrap();
        assert_eq!(seen.len(), N);
        for id in &ids {
            assert_eq!(
                seen.get(id),
                Some(&1),
                "event {id} not delivered exactly once"
            );
        }
    }
    let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", db.events()))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
}

const CHILD_ENV: &str = "OUTBOX_PG_PAUSED_RELAY_SCHEMA";
const GATE_ENV: &str = "OUTBOX_PG_PAUSED_RELAY_GATE";

/// Not a test on its own: the body of the child process of
/// `a_paused_relay_cannot_overwrite_the_new_owner`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by a_paused_relay_cannot_overwrite_the_new_owner"]
async fn paused_relay_child() {
    let Ok(schema) = std::env::var(CHILD_ENV) else {
        return;
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let gate = PathBuf::from(std::env::var(GATE_ENV).unwrap());
    let store = PgStore::connect(
        PgStoreOptions::new(common::database_url())
            .with_schema(Ident::new(schema).unwrap())
            .with_table(Ident::new("events").unwrap())
            .with_listen(false),
    )
    .await
    .unwrap();
    let sink = Recorder {
        gate: Some(gate),
        ..Recorder::default()
    };
    let options = relay_options("paused-relay").with_lock_timeout(Duration::from_secs(1));
    let summary = Relay::new(store, sink, options)
        .unwrap()
        .run_until_idle()
        .await;
    println!(
        "SUMMARY delivered={} lease_lost={}",
        summary.delivered, summary.lease_lost
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_relay_cannot_overwrite_the_new_owner() {
    const N: usize = 5;
    let db = TestDb::new().await;
    let mut tx = db.pool.begin().await.unwrap();
    let ids = db
        .outbox
        .enqueue_batch(
            &mut tx,
            (0..N).map(|i| NewEvent::new("e", "t", vec![i as u8])),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let gate = std::env::temp_dir().join(format!("outbox-gate-{}", db.schema));
    let _ = std::fs::remove_file(&gate);
    // Killed if this test fails before it is resumed (a stopped child would stay).
    let mut child = ChildGuard::new(
        Command::new(std::env::current_exe().unwrap())
            .args(["paused_relay_child", "--exact", "--ignored", "--nocapture"])
            .env(CHILD_ENV, db.schema.as_str())
            .env(GATE_ENV, &gate)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );

    // Wait until the child has claimed every event (its sink now waits on the gate).
    let leased_by_child = format!(
        "SELECT count(*) FROM {} WHERE locked_by = 'paused-relay'",
        db.events()
    );
    loop {
        let n: i64 = sqlx::query_scalar(&leased_by_child)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if n == N as i64 {
            break;
        }
        assert!(
            child.child().try_wait().unwrap().is_none(),
            "child relay exited early"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Pause it, open its gate (it sees it only once resumed), let the lease run out.
    child.signal("STOP");
    std::fs::write(&gate, b"go").unwrap();
    let expired = format!(
        "SELECT count(*) FROM {} WHERE locked_until <= now()",
        db.events()
    );
    loop {
        let n: i64 = sqlx::query_scalar(&expired)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if n == N as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Another relay re-claims and delivers everything.
    let sink = Recorder::default();
    let summary = Relay::new(db.store().await, sink.clone(), relay_options("new-owner"))
        .unwrap()
        .run_until_idle()
        .await;
    assert_eq!(summary.delivered, N as u64);
    {
        let seen = sink.seen.lock().unwrap();
        for id in &ids {
            assert_eq!(seen.get(id), Some(&1));
        }
    }

    // Resume the paused relay: its late complete must change nothing.
    child.signal("CONT");
    let out = child.into_inner().wait_with_output().unwrap();
    let _ = std::fs::remove_file(&gate);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("SUMMARY delivered=0 lease_lost={N}")),
        "child summary:\n{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("lease lost"),
        "child did not log the lost lease:\n{stderr}"
    );
    let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", db.events()))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "the paused relay's late write resurrected rows");
}
