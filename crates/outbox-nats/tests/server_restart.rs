//! A NATS server that is not serving JetStream (yet) answers a publish with
//! "no responders", the same answer as for a subject no stream captures.
//! The publisher must not dead-letter healthy events for it: these tests
//! start their own `nats-server` (a free loopback port; `NATS_SERVER_BIN`,
//! default `/usr/sbin/nats-server` or `nats-server` on `PATH`) and check
//! that (1) without JetStream every event fails as sink unavailable, and
//! (2) through a graceful server restart every outcome is delivered or
//! unavailable (never an event failure), and the stream afterwards holds
//! every event that was reported delivered.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_core::{ErrorCode, FailureKind, Outcome, Sink};
use outbox_nats::{NatsConfig, NatsPublisher};
use outbox_testkit::process::{free_port, start_nats_server, ChildGuard};
use outbox_testkit::publisher::event;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// Starts `nats-server` on `addr`, with JetStream on a file store in
/// `store` when given; returns when it listens.
fn start(addr: SocketAddr, store: Option<&Path>) -> ChildGuard {
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    if let Some(dir) = store {
        args.extend(["-js".into(), "-sd".into(), dir.into()]);
    }
    start_nats_server(addr.port(), args)
}

fn config(addr: SocketAddr) -> NatsConfig {
    NatsConfig::from_url(&format!("nats://{addr}"))
        .unwrap()
        .with_subject_prefix("restart-test")
        .with_ignore_discovered_servers(true)
        .with_ack_timeout(Duration::from_secs(2))
        .with_reconnect_delay_max(Duration::from_millis(200))
}

#[tokio::test(flavor = "multi_thread")]
async fn without_jetstream_an_unrouted_publish_is_the_sinks_failure() {
    let addr = free_addr();
    let _server = start(addr, None);
    let sink = NatsPublisher::connect(config(addr)).await.unwrap();
    let outcomes = sink
        .deliver(&[
            event("orders", Some("k1"), b"{}".to_vec()),
            event("orders", Some("k2"), b"{}".to_vec()),
        ])
        .await;
    assert_eq!(outcomes.len(), 2);
    for o in &outcomes {
        match o {
            Outcome::Failed(e) => {
                assert_eq!(e.kind(), FailureKind::Unavailable, "{e}");
                assert_eq!(e.code(), &ErrorCode::PUBLISH_UNROUTABLE);
                assert!(e.message().contains("JetStream"), "{e}");
            }
            other => panic!("expected sink unavailable, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn through_a_server_restart_no_event_fails_and_nothing_delivered_is_lost() {
    let addr = free_addr();
    let store = tempfile::tempdir().unwrap();
    let mut server = start(addr, Some(store.path()));
    let url = format!("nats://{addr}");
    let client = async_nats::connect(&url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "RESTART_TEST".into(),
        subjects: vec!["restart-test.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let sink = NatsPublisher::connect(config(addr)).await.unwrap();

    // Publish batches of 20 for 8 s; restart the server (SIGTERM, then the
    // same port and store) after 2 s and again after 5 s.
    let mut delivered: HashSet<String> = HashSet::new();
    let mut unavailable = 0u32;
    let started = Instant::now();
    let mut restarts = 0;
    let mut n = 0u64;
    while started.elapsed() < Duration::from_secs(8) {
        if (restarts == 0 && started.elapsed() >= Duration::from_secs(2))
            || (restarts == 1 && started.elapsed() >= Duration::from_secs(5))
        {
            // SIGTERM: a graceful stop (JetStream flushes its store).
            assert!(server.terminate(Duration::from_secs(15)).is_some());
            server = start(addr, Some(store.path()));
            restarts += 1;
        }
        let batch: Vec<_> = (0..20)
            .map(|_| {
                n += 1;
                event(
                    "orders",
                    Some(&format!("k{}", n % 7)),
                    n.to_string().into_bytes(),
                )
            })
            .collect();
        let outcomes = sink.deliver(&batch).await;
        for (e, o) in batch.iter().zip(&outcomes) {
            match o {
                Outcome::Delivered => {
                    delivered.insert(String::from_utf8(e.payload.to_vec()).unwrap());
                }
                Outcome::Failed(err) if err.kind() == FailureKind::Unavailable => {
                    unavailable += 1;
                }
                other => panic!("event {} failed as the event's fault: {other:?}", e.id),
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(restarts, 2);
    assert!(!delivered.is_empty());

    // Every event reported delivered is in the stream (payloads are unique).
    let client = async_nats::connect(&url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream("RESTART_TEST").await.unwrap();
    let last = stream.cached_info().state.last_sequence;
    let mut stored = HashSet::new();
    for seq in 1..=last {
        if let Ok(m) = stream.get_raw_message(seq).await {
            stored.insert(String::from_utf8(m.payload.to_vec()).unwrap());
        }
    }
    let missing: Vec<&String> = delivered.difference(&stored).collect();
    assert!(
        missing.is_empty(),
        "{} of {} delivered events are not in the stream ({unavailable} outcomes were unavailable): {:?}",
        missing.len(),
        delivered.len(),
        &missing[..missing.len().min(5)]
    );
}
