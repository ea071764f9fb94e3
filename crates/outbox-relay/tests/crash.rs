//! Invariant 1 (no loss): SIGKILL `outbox-relay run` mid-stream, restart it,
//! and every committed event reaches the output at least once.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod support;

use outbox_core::{DeadLetterQuery, DeadLetterStore, EventId, NewEvent, Store};
use outbox_sqlite::{enqueue_batch, SqliteStore};
use outbox_testkit::process::ChildGuard;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};
use support::{relay, stop};

const EVENTS: usize = 3000;

fn start_relay(url: &str, out: &Path, log: &Path) -> ChildGuard {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let child = relay(&[
        "run",
        "--store",
        url,
        "--sink",
        &format!("jsonl:{}", out.display()),
        "--batch-size",
        "10",
        "--poll-interval-ms",
        "50",
        "--lock-timeout-ms",
        "1000",
    ])
    .stdout(Stdio::null())
    .stderr(log)
    .spawn()
    .expect("cannot start outbox-relay");
    ChildGuard::new(child)
}

/// Ids of the complete JSON lines in the output (a line torn by the kill is skipped).
fn delivered_ids(out: &Path) -> (Vec<EventId>, usize) {
    let text = std::fs::read_to_string(out).unwrap_or_default();
    let mut ids = Vec::new();
    let mut torn = 0;
    for line in text.lines().filter(|l| !l.is_empty()) {
        match serde_json::from_str::<serde_json::Value>(line) {
            Ok(v) => ids.push(v["id"].as_str().unwrap().parse().unwrap()),
            Err(_) => torn += 1,
        }
    }
    (ids, torn)
}

fn count_lines(out: &Path) -> usize {
    std::fs::read(out)
        .map(|b| b.iter().filter(|&&c| c == b'\n').count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_batch_then_restart_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let out = dir.path().join("out.jsonl");
    let log = dir.path().join("relay.log");

    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let mut committed: HashSet<EventId> = HashSet::new();
    for chunk in 0..(EVENTS / 100) {
        let events: Vec<NewEvent> = (0..100)
            .map(|i| {
                let n = chunk * 100 + i;
                let e = NewEvent::new("crash.test", "crash", format!("{{\"n\":{n}}}").into_bytes());
                // Most events share 40 keys (per-key order applies); some have none.
                if n % 5 == 0 {
                    e
                } else {
                    e.with_key(format!("k{}", n % 40))
                }
            })
            .collect();
        let mut tx = store.pool().begin().await.unwrap();
        committed.extend(enqueue_batch(&mut tx, events).await.unwrap());
        tx.commit().await.unwrap();
    }
    assert_eq!(committed.len(), EVENTS);

    // First relay: kill it with SIGKILL once some, but not all, events are out.
    let mut first = start_relay(&url, &out, &log);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = count_lines(&out);
        if n >= 100 {
            break;
        }
        if let Some(status) = first.child().try_wait().unwrap() {
            panic!(
                "relay exited early with {status}: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "relay wrote nothing within 60s");
        std::thread::sleep(Duration::from_millis(1));
    }
    first.kill(); // SIGKILL, then waits
    let (before, _) = delivered_ids(&out);
    assert!(
        before.len() < EVENTS,
        "the relay delivered everything before it could be killed; the test proves nothing"
    );
    let stats = store.stats().await.unwrap();
    assert!(stats.pending + stats.in_flight > 0, "{stats:?}");

    // Second relay: picks up the rest, including the killed relay's leased batch.
    let mut second = start_relay(&url, &out, &log);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stats = store.stats().await.unwrap();
        if stats.pending == 0 && stats.in_flight == 0 {
            break;
        }
        if let Some(status) = second.child().try_wait().unwrap() {
            panic!(
                "restarted relay exited with {status}: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "outbox not drained within 60s after the restart: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Graceful stop: SIGTERM, exit 0.
    stop(&mut second);

    let (ids, torn) = delivered_ids(&out);
    assert!(torn <= 1, "{torn} unparseable lines");
    let seen: HashSet<EventId> = ids.iter().copied().collect();
    let missing: Vec<&EventId> = committed.difference(&seen).collect();
    assert!(
        missing.is_empty(),
        "{} events lost, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    assert!(
        seen.is_subset(&committed),
        "output holds events that were never committed"
    );
    let mut counts: HashMap<EventId, usize> = HashMap::new();
    for id in &ids {
        *counts.entry(*id).or_default() += 1;
    }
    let duplicates = counts.values().filter(|&&c| c > 1).count();
    eprintln!(
        "killed after {} events; {} lines in total, {duplicates} events delivered twice",
        before.len(),
        ids.len()
    );
    assert!(store
        .list_dead(&DeadLetterQuery::default())
        .await
        .unwrap()
        .is_empty());
}
