//! `outbox-relay run --metrics-addr`: the binary serves the relay's metrics
//! for Prometheus, and the counters match what was delivered.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod support;

use outbox_core::{NewEvent, Store};
use outbox_sqlite::{enqueue_batch, SqliteStore};
use outbox_testkit::process::ChildGuard;
use std::process::Stdio;
use std::time::{Duration, Instant};
use support::{free_addr, get, relay, stop};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_serves_prometheus_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let events: Vec<NewEvent> = (0..20)
        .map(|i| NewEvent::new("metrics.test", "m", format!("{i}").into_bytes()))
        .collect();
    enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();

    let addr = free_addr();
    let out = dir.path().join("out.jsonl");
    let mut child = ChildGuard::new(
        relay(&[
            "run",
            "--store",
            &url,
            "--poll-interval-ms",
            "100",
            "--metrics-addr",
            &addr,
        ])
        .arg("--sink")
        .arg(format!("jsonl:{}", out.display()))
        .env("RUST_LOG", "warn")
        .env_remove("OUTBOX_CONFIG")
        .stdout(Stdio::null())
        .spawn()
        .unwrap(),
    );

    let deadline = Instant::now() + Duration::from_secs(60);
    let body = loop {
        let drained = store.stats().await.unwrap().pending == 0;
        if drained {
            if let Some(body) = get(&addr, "/metrics").map(|(_, body)| body) {
                if body
                    .lines()
                    .any(|l| l.starts_with("outbox_events_delivered_total"))
                {
                    break body;
                }
            }
        }
        assert!(Instant::now() < deadline, "no metrics served on {addr}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    stop(&mut child);

    let delivered: f64 = body
        .lines()
        .filter(|l| l.starts_with("outbox_events_delivered_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(delivered, 20.0, "{body}");
    assert!(body.contains("outbox_lag_seconds"), "{body}");
}
