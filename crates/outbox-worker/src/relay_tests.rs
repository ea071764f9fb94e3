//! Relay loop tests against the real SQLite store.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] fns

use crate::test_support::logged;
use crate::{HandlerRegistry, Progress, Relay, RelayOptions, RelaySummary};
use outbox_core::{
    ClaimRequest, DeadLetterQuery, DeadLetterStore, ErrorCode, EventId, HandlerError, NewEvent,
    RelayId, Settlement, Sink, Store,
};
use outbox_sqlite::SqliteStore;
use outbox_testkit::logs::LogCapture;
use outbox_testkit::sink::fast_retry;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, Notify};

struct Db {
    _dir: tempfile::TempDir,
    store: SqliteStore,
}

async fn db() -> Db {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    Db { _dir: dir, store }
}

async fn enqueue(store: &SqliteStore, events: Vec<NewEvent>) -> Vec<EventId> {
    let mut tx = store.pool().begin().await.unwrap();
    let ids = outbox_sqlite::enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

fn ev(event_type: &str, key: &str) -> NewEvent {
    NewEvent::new(event_type, "orders", b"{}".to_vec()).with_key(key)
}

fn fast(max_attempts: u32) -> RelayOptions {
    RelayOptions::default()
        .with_poll_interval(Duration::from_millis(20))
        .with_lock_timeout(Duration::from_secs(5))
        .with_retry(fast_retry(max_attempts))
}

async fn run_idle<Si: Sink>(relay: Relay<SqliteStore, Si>) -> RelaySummary {
    tokio::time::timeout(Duration::from_secs(30), relay.run_until_idle())
        .await
        .expect("relay did not drain the outbox within 30s")
}

#[tokio::test]
async fn delivers_retries_and_dead_letters_with_the_right_codes() {
    let db = db().await;
    let ids = enqueue(
        &db.store,
        vec![
            ev("order.created", "o1"),
            ev("order.flaky", "o2"),
            ev("order.unknown", "o3"),
            ev("order.bad", "o4"),
        ],
    )
    .await;
    let flaky_calls = Arc::new(AtomicU32::new(0));
    let calls = Arc::clone(&flaky_calls);
    let handlers = HandlerRegistry::new()
        .with_handler("order.created", |_| async { Ok(()) })
        .with_handler("order.flaky", move |_| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    Err(HandlerError::retryable("payment service unavailable"))
                } else {
                    Ok(())
                }
            }
        })
        .with_handler("order.bad", |_| async {
            Err(HandlerError::permanent("malformed order"))
        });
    let (relay, log) = logged(Relay::new(db.store.clone(), handlers, fast(8)).unwrap());
    let summary = run_idle(relay).await;

    assert_eq!(summary.delivered, 2);
    assert_eq!(summary.retried, 1);
    assert_eq!(summary.dead, 2);
    assert_eq!(flaky_calls.load(Ordering::SeqCst), 2);

    let log = log.lock().unwrap().clone();
    assert!(log
        .iter()
        .any(|p| matches!(p, Progress::Retried { id, error, .. }
        if *id == ids[1] && *error.code() == ErrorCode::HANDLER_TEMPORARY_FAILURE)));
    assert!(log
        .iter()
        .any(|p| matches!(p, Progress::Delivered { id, attempts: 2, .. } if *id == ids[1])));

    let dead = db
        .store
        .list_dead(&DeadLetterQuery::default())
        .await
        .unwrap();
    let mut codes: Vec<(EventId, String)> = dead
        .iter()
        .map(|d| (d.event.id, d.error.code.as_str().to_owned()))
        .collect();
    codes.sort();
    assert_eq!(
        codes,
        vec![
            (ids[2], "HANDLER_NOT_REGISTERED".to_owned()),
            (ids[3], "HANDLER_PERMANENT_FAILURE".to_owned()),
        ]
    );
    let stats = db.store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.in_flight, stats.dead), (0, 0, 2));
}

#[tokio::test]
async fn retryable_failures_dead_letter_after_max_attempts() {
    let db = db().await;
    let ids = enqueue(&db.store, vec![ev("always.fails", "k")]).await;
    let handlers = HandlerRegistry::new().with_handler("always.fails", |_| async {
        Err(HandlerError::retryable("still down"))
    });
    let summary = run_idle(Relay::new(db.store.clone(), handlers, fast(3)).unwrap()).await;
    assert_eq!(
        (summary.retried, summary.dead, summary.delivered),
        (2, 1, 0)
    );
    let dead = db
        .store
        .list_dead(&DeadLetterQuery::default())
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].event.id, ids[0]);
    assert_eq!(dead[0].event.attempts, 3);
    assert_eq!(dead[0].error.code, ErrorCode::HANDLER_TEMPORARY_FAILURE);
    assert_eq!(dead[0].error.message, "still down");
}

#[tokio::test]
async fn a_panicking_handler_is_a_retryable_failure() {
    let db = db().await;
    enqueue(&db.store, vec![ev("boom", "k")]).await;
    let handlers = HandlerRegistry::new().with_handler("boom", |_| async {
        panic!("handler bug");
    });
    let (relay, log) = logged(Relay::new(db.store.clone(), handlers, fast(2)).unwrap());
    let summary = run_idle(relay).await;
    assert_eq!((summary.retried, summary.dead), (1, 1));
    assert!(log.lock().unwrap().iter().any(|p| matches!(p, Progress::Retried { error, .. }
        if *error.code() == ErrorCode::HANDLER_PANICKED && error.message().contains("handler bug"))));
    let dead = db
        .store
        .list_dead(&DeadLetterQuery::default())
        .await
        .unwrap();
    assert_eq!(dead[0].error.code, ErrorCode::HANDLER_PANICKED);
}

#[tokio::test]
async fn later_events_of_a_failed_key_wait_for_it() {
    let db = db().await;
    let ids = enqueue(
        &db.store,
        vec![
            ev("first", "same"),
            ev("second", "same"),
            ev("second", "other"),
        ],
    )
    .await;
    let order: Arc<Mutex<Vec<EventId>>> = Arc::default();
    let failed_once = Arc::new(AtomicU32::new(0));
    let (o1, o2) = (Arc::clone(&order), Arc::clone(&order));
    let handlers = HandlerRegistry::new()
        .with_handler("first", move |e| {
            let fail = failed_once.fetch_add(1, Ordering::SeqCst) == 0;
            let o = Arc::clone(&o1);
            async move {
                if fail {
                    return Err(HandlerError::retryable("not yet"));
                }
                o.lock().unwrap().push(e.id);
                Ok(())
            }
        })
        .with_handler("second", move |e| {
            let o = Arc::clone(&o2);
            async move {
                o.lock().unwrap().push(e.id);
                Ok(())
            }
        });
    let (relay, log) = logged(Relay::new(db.store.clone(), handlers, fast(8)).unwrap());
    let summary = run_idle(relay).await;
    assert_eq!(summary.delivered, 3);
    let order = order.lock().unwrap().clone();
    let pos = |id| order.iter().position(|x| *x == id).unwrap();
    assert!(
        pos(ids[0]) < pos(ids[1]),
        "same-key events out of order: {order:?}"
    );
    // The skipped event was released, not failed: its attempt was not counted.
    let log = log.lock().unwrap().clone();
    assert!(log
        .iter()
        .any(|p| matches!(p, Progress::Released { ids: r } if r == &vec![ids[1]])));
    assert!(log
        .iter()
        .any(|p| matches!(p, Progress::Delivered { id, attempts: 1, .. } if *id == ids[1])));
    assert!(!log
        .iter()
        .any(|p| matches!(p, Progress::Retried { id, .. } if *id == ids[1])));
}

/// A sink that signals when a delivery started and then waits for `gate`.
struct Gated {
    started: Mutex<Option<oneshot::Sender<()>>>,
    gate: Arc<Notify>,
}

impl Sink for Gated {
    async fn deliver(&self, events: &[outbox_core::Event]) -> Vec<outbox_core::Outcome> {
        if let Some(tx) = self.started.lock().unwrap().take() {
            let _ = tx.send(());
        }
        self.gate.notified().await;
        vec![outbox_core::Outcome::Delivered; events.len()]
    }
}

fn gated() -> (Gated, oneshot::Receiver<()>, Arc<Notify>) {
    let (tx, rx) = oneshot::channel();
    let gate = Arc::new(Notify::new());
    (
        Gated {
            started: Mutex::new(Some(tx)),
            gate: Arc::clone(&gate),
        },
        rx,
        gate,
    )
}

#[tokio::test]
async fn shutdown_releases_a_batch_that_outlives_the_grace_period() {
    let db = db().await;
    let ids = enqueue(&db.store, vec![ev("a", "1"), ev("a", "2"), ev("a", "3")]).await;
    let (sink, started, _gate) = gated();
    let options = fast(8).with_shutdown_grace(Duration::from_millis(50));
    let (relay, log) = logged(Relay::new(db.store.clone(), sink, options).unwrap());
    let summary = tokio::time::timeout(
        Duration::from_secs(30),
        relay.run(async {
            let _ = started.await;
        }),
    )
    .await
    .unwrap();
    assert_eq!(summary.released, 3);
    assert_eq!(summary.delivered, 0);
    assert!(log
        .lock()
        .unwrap()
        .iter()
        .any(|p| matches!(p, Progress::Released { ids: r } if r == &ids)));

    let stats = db.store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.in_flight), (3, 0));
    // Released unattempted: the next claim is their first attempt.
    let claim = db
        .store
        .claim(&ClaimRequest {
            relay_id: RelayId::new("next"),
            batch_size: 10,
            lease: Duration::from_secs(5),
            shard: outbox_core::ShardSpec::ALL,
        })
        .await
        .unwrap();
    assert_eq!(claim.events.iter().map(|e| e.id).collect::<Vec<_>>(), ids);
    assert!(claim.events.iter().all(|e| e.attempts == 1));
}

#[tokio::test]
async fn shutdown_lets_the_in_flight_batch_finish_and_records_it() {
    let db = db().await;
    enqueue(&db.store, vec![ev("a", "1"), ev("a", "2")]).await;
    let (sink, started, gate) = gated();
    let relay = Relay::new(db.store.clone(), sink, fast(8)).unwrap();
    let shutdown = async move {
        let _ = started.await;
        // Shutdown is requested while the batch is in flight; then it finishes.
        gate.notify_one();
    };
    let summary = tokio::time::timeout(Duration::from_secs(30), relay.run(shutdown))
        .await
        .unwrap();
    assert_eq!((summary.delivered, summary.released), (2, 0));
    let stats = db.store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.in_flight), (0, 0));
}

#[tokio::test(flavor = "current_thread")]
async fn lost_lease_changes_nothing_and_is_logged_and_counted() {
    let (captured, _guard) = LogCapture::start(tracing::Level::WARN);

    let db = db().await;
    let ids = enqueue(&db.store, vec![ev("a", "1"), ev("a", "2")]).await;
    let (sink, started, gate) = gated();
    let (relay, log) = logged(Relay::new(db.store.clone(), sink, fast(8)).unwrap());
    let store = db.store.clone();
    let expected = ids.clone();
    let thief = async move {
        let _ = started.await;
        // The relay renews its lease while it delivers; end it by hand, as
        // a relay stalled past its lease (SIGSTOP) would see it.
        outbox_sqlite::sqlx::query("UPDATE outbox_events SET locked_until = 0")
            .execute(store.pool())
            .await
            .unwrap();
        let req = ClaimRequest {
            relay_id: RelayId::new("thief"),
            batch_size: 10,
            lease: Duration::from_secs(60),
            shard: outbox_core::ShardSpec::ALL,
        };
        let claim = loop {
            let c = store.claim(&req).await.unwrap();
            if !c.events.is_empty() {
                break c;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(
            claim.events.iter().map(|e| e.id).collect::<Vec<_>>(),
            expected
        );
        let settlement = expected.iter().fold(Settlement::new(), |s, id| {
            s.with(*id, outbox_core::Resolution::Delivered)
        });
        assert_eq!(
            store
                .settle(claim.token, &settlement)
                .await
                .unwrap()
                .applied,
            2
        );
        gate.notify_one();
    };
    let relay_done = async {
        tokio::time::timeout(Duration::from_secs(30), relay.run_until_idle())
            .await
            .unwrap()
    };
    let (summary, ()) = tokio::join!(relay_done, thief);

    assert_eq!(summary.lease_lost, 2);
    assert_eq!(summary.delivered, 0);
    assert!(log
        .lock()
        .unwrap()
        .iter()
        .any(|p| matches!(p, Progress::LeaseLost { ids: lost } if lost.len() == 2)));
    let text = captured.text();
    assert!(
        text.contains("WARN") && text.contains("lease lost"),
        "{text}"
    );
    assert!(
        text.contains(&ids[0].to_string()) && text.contains(&ids[1].to_string()),
        "{text}"
    );
    let stats = db.store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.in_flight, stats.dead), (0, 0, 0));
}

#[test]
fn metrics_count_outcomes_by_code() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use metrics_util::MetricKind;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let summary = metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let db = db().await;
            enqueue(
                &db.store,
                vec![
                    ev("ok", "1"),
                    ev("ok", "2"),
                    ev("flaky", "3"),
                    ev("nobody", "4"),
                ],
            )
            .await;
            let calls = Arc::new(AtomicU32::new(0));
            let handlers = HandlerRegistry::new()
                .with_handler("ok", |_| async { Ok(()) })
                .with_handler("flaky", move |_| {
                    let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
                    async move {
                        if first {
                            Err(HandlerError::retryable("blip"))
                        } else {
                            Ok(())
                        }
                    }
                });
            run_idle(Relay::new(db.store.clone(), handlers, fast(8)).unwrap()).await
        })
    });
    assert_eq!(
        (summary.delivered, summary.retried, summary.dead),
        (3, 1, 1)
    );

    let snapshot = snapshotter.snapshot().into_vec();
    let counter = |name: &str, label: Option<(&str, &str)>| -> u64 {
        snapshot
            .iter()
            .filter(|(key, _, _, _)| {
                key.kind() == MetricKind::Counter
                    && key.key().name() == name
                    && label.is_none_or(|(k, v)| {
                        key.key().labels().any(|l| l.key() == k && l.value() == v)
                    })
            })
            .map(|(_, _, _, value)| match value {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    };
    assert_eq!(counter(crate::metrics::EVENTS_DELIVERED, None), 3);
    assert_eq!(
        counter(
            crate::metrics::EVENTS_RETRIED,
            Some(("code", "HANDLER_TEMPORARY_FAILURE"))
        ),
        1
    );
    assert_eq!(
        counter(
            crate::metrics::EVENTS_DEAD,
            Some(("code", "HANDLER_NOT_REGISTERED"))
        ),
        1
    );
    assert_eq!(counter(crate::metrics::LEASE_LOST, None), 0);
    let histogram_samples: usize = snapshot
        .iter()
        .filter(|(key, _, _, _)| key.key().name() == crate::metrics::EVENT_PROCESS_SECONDS)
        .map(|(_, _, _, value)| match value {
            DebugValue::Histogram(v) => v.len(),
            _ => 0,
        })
        .sum();
    // One sample per recorded outcome: 3 delivered + 1 retried + 1 dead.
    assert_eq!(histogram_samples, 5);
    assert!(snapshot
        .iter()
        .any(|(key, _, _, _)| key.key().name() == crate::metrics::LAG_SECONDS));
}

#[tokio::test]
async fn invalid_options_are_refused() {
    let db = db().await;
    let err = Relay::new(
        db.store.clone(),
        HandlerRegistry::new(),
        RelayOptions::default().with_batch_size(0),
    )
    .unwrap_err();
    assert_eq!(err, crate::InvalidOptions::ZeroBatchSize);
}

/// A pause noticed mid-batch: the batch being delivered finishes and is
/// settled (delivered, not released), nothing more is claimed while the
/// group is paused, and after resume the rest is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_group_finishes_its_batch_then_claims_nothing_until_resumed() {
    use outbox_core::{ControlStore, PauseNote, DEFAULT_GROUP};
    let db = db().await;
    let ids = enqueue(
        &db.store,
        (0..40)
            .map(|i| ev("order.created", &format!("k{i}")))
            .collect(),
    )
    .await;
    let delivered = Arc::new(AtomicU32::new(0));
    let (store, count) = (db.store.clone(), Arc::clone(&delivered));
    let handlers = HandlerRegistry::new().with_handler("order.created", move |_| {
        let (store, count) = (store.clone(), Arc::clone(&count));
        async move {
            // The first event pauses the group while its batch is in flight.
            if count.fetch_add(1, Ordering::SeqCst) == 0 {
                store
                    .set_paused(DEFAULT_GROUP, true, &PauseNote::new().with_reason("test"))
                    .await
                    .unwrap();
                // Let the relay's cached read go stale before the batch ends.
                tokio::time::sleep(Duration::from_millis(1100)).await;
            }
            Ok::<(), HandlerError>(())
        }
    });
    let relay = Relay::new(db.store.clone(), handlers, fast(3).with_batch_size(10))
        .unwrap()
        .with_control(db.store.clone(), DEFAULT_GROUP);
    let pause = relay.pause_handle().unwrap();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async {
        let _ = stop_rx.await;
    }));

    // The in-flight batch (10 events, and at most one batch claimed ahead
    // in drain mode) is delivered and settled; then nothing moves.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(pause.is_paused(), "{:?}", pause.status());
    let while_paused = delivered.load(Ordering::SeqCst);
    assert!(
        (10..=20).contains(&while_paused),
        "delivered while pausing: {while_paused}"
    );
    let stats = db.store.stats().await.unwrap();
    assert_eq!(stats.in_flight, 0, "the batch was settled: {stats:?}");
    assert_eq!(stats.pending, 40 - u64::from(while_paused), "{stats:?}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(delivered.load(Ordering::SeqCst), while_paused);

    db.store
        .set_paused(DEFAULT_GROUP, false, &PauseNote::new())
        .await
        .unwrap();
    // Until every event is settled: none pending and none claimed (a batch
    // claimed but not yet settled is not pending, and stopping the relay
    // then would give it back).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let stats = db.store.stats().await.unwrap();
        if stats.pending == 0 && stats.in_flight == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not resumed: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!pause.is_paused());
    stop_tx.send(()).unwrap();
    let summary = run.await.unwrap();
    assert_eq!(summary.delivered, ids.len() as u64);
    assert_eq!(summary.released, 0, "nothing released by the pause");
}

/// A sink that records the size of every batch it is handed.
#[derive(Clone, Default)]
struct Sizes(Arc<Mutex<Vec<usize>>>);

impl Sink for Sizes {
    async fn deliver(&self, events: &[outbox_core::Event]) -> Vec<outbox_core::Outcome> {
        self.0.lock().unwrap().push(events.len());
        vec![outbox_core::Outcome::Delivered; events.len()]
    }
}

#[tokio::test]
async fn batches_grow_through_a_backlog_and_shrink_when_it_is_gone() {
    let db = db().await;
    let events = (0..400).map(|i| ev("t", &format!("k{i}"))).collect();
    enqueue(&db.store, events).await;
    let sizes = Sizes::default();
    let opts = fast(3).with_batch_size(10).with_max_batch_size(Some(80));
    let summary =
        run_idle(Relay::new(db.store.clone(), sizes.clone(), opts.clone()).unwrap()).await;
    assert_eq!(summary.delivered, 400);
    let seen = sizes.0.lock().unwrap().clone();
    // 10, 20, 40, then 80 at a time: 10+20+40+80*4 = 390, then the rest.
    assert_eq!(seen, vec![10, 20, 40, 80, 80, 80, 80, 10], "{seen:?}");

    // The backlog is gone: a trickle goes in batches of `batch_size` again.
    enqueue(
        &db.store,
        (0..15).map(|i| ev("t", &format!("n{i}"))).collect(),
    )
    .await;
    let again = Sizes::default();
    let summary = run_idle(Relay::new(db.store.clone(), again.clone(), opts).unwrap()).await;
    assert_eq!(summary.delivered, 15);
    assert_eq!(*again.0.lock().unwrap(), vec![10, 5]);

    // Without a larger maximum the batches never grow.
    enqueue(
        &db.store,
        (0..35).map(|i| ev("t", &format!("m{i}"))).collect(),
    )
    .await;
    let flat = Sizes::default();
    let summary =
        run_idle(Relay::new(db.store.clone(), flat.clone(), fast(3).with_batch_size(10)).unwrap())
            .await;
    assert_eq!(summary.delivered, 35);
    assert_eq!(*flat.0.lock().unwrap(), vec![10, 10, 10, 5]);
}
