//! A SQLite store waiting on a locked database (a long application write)
//! backs off and succeeds: a busy timeout is a retryable error, never a lost
//! outcome or an unbounded redelivery loop.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use outbox_core::{
    ClaimRequest, EventId, NewEvent, RelayId, Resolution, Settlement, ShardSpec, Store,
};
use outbox_sqlite::{SqliteStore, SqliteStoreOptions, StoreError};
use sqlx::{Connection, SqliteConnection};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const BUSY: Duration = Duration::from_millis(100);
const LEASE: Duration = Duration::from_secs(60);

fn req(relay: &str, batch_size: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new(relay),
        batch_size,
        lease: LEASE,
        shard: ShardSpec::ALL,
    }
}

async fn setup(events: usize) -> (SqliteStore, String, Vec<EventId>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("app.db").display());
    let store = SqliteStore::connect(
        SqliteStoreOptions::new(&url)
            .with_busy_timeout(BUSY)
            .with_auto_migrate(true),
    )
    .await
    .unwrap();
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, note TEXT)")
        .execute(store.pool())
        .await
        .unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let ids = store
        .outbox()
        .enqueue_batch(
            &mut tx,
            (0..events).map(|i| {
                NewEvent::new("order.created", "orders", vec![]).with_key(format!("k{}", i % 7))
            }),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    (store, url, ids, dir)
}

/// An application connection holding the write lock, as a long business
/// transaction does, until `COMMIT`.
async fn lock(url: &str) -> SqliteConnection {
    let mut app = SqliteConnection::connect(url).await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE; INSERT INTO orders (note) VALUES ('long write');")
        .execute(&mut app)
        .await
        .unwrap();
    app
}

async fn unlock(mut app: SqliteConnection) {
    sqlx::raw_sql("COMMIT").execute(&mut app).await.unwrap();
    app.close().await.unwrap();
}

fn assert_busy(err: &StoreError) {
    assert!(err.is_retryable(), "not retryable: {err}");
    assert!(outbox_core::Retryable::is_retryable(err));
    assert!(err.to_string().contains("locked"), "{err}");
}

/// While the lock is held longer than the busy timeout, claim, settle and
/// renew fail with a retryable error and change nothing; once it is gone
/// the same settle succeeds. A lock shorter than the busy timeout is just
/// waited for.
#[tokio::test(flavor = "multi_thread")]
async fn a_lock_beyond_the_busy_timeout_is_retryable_and_changes_nothing() {
    let (store, url, ids, _dir) = setup(5).await;

    let app = lock(&url).await;
    assert_busy(&store.claim(&req("relay-a", 10)).await.unwrap_err());
    // Reads still work under WAL: nothing was claimed.
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.in_flight), (5, 0));
    unlock(app).await;

    let c = store.claim(&req("relay-a", 10)).await.unwrap();
    assert_eq!(c.events.iter().map(|e| e.id).collect::<Vec<_>>(), ids);

    let app = lock(&url).await;
    let all = Settlement::new();
    let all = ids
        .iter()
        .fold(all, |s, id| s.with(*id, Resolution::Delivered));
    assert_busy(&store.settle(c.token, &all).await.unwrap_err());
    assert_busy(&store.renew(c.token, LEASE).await.unwrap_err());
    let s = store.stats().await.unwrap();
    assert_eq!(
        (s.pending, s.in_flight),
        (0, 5),
        "a failed settle changed rows"
    );
    unlock(app).await;

    let report = store.settle(c.token, &all).await.unwrap();
    assert_eq!((report.applied, report.fenced.len()), (5, 0));
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.in_flight, s.dead), (0, 0, 0));

    // A lock released before the busy timeout is waited for, not an error.
    let (store, url, _, _dir) = setup(3).await;
    let app = lock(&url).await;
    let release = async move {
        tokio::time::sleep(BUSY / 4).await;
        unlock(app).await;
    };
    let r = req("relay-a", 10);
    let (c, ()) = tokio::join!(store.claim(&r), release);
    assert_eq!(c.unwrap().events.len(), 3);
}

/// Two relay loops (claim, deliver, settle; back off and retry the same
/// call on a retryable error) run while the application keeps taking the
/// write lock for longer than the busy timeout. Every event is delivered
/// exactly once, every outcome is recorded, nothing is dead-lettered and
/// no attempt is wasted.
#[tokio::test(flavor = "multi_thread")]
async fn relays_ride_out_long_application_writes_and_deliver_each_event_once() {
    const N: usize = 300;
    let (store, url, ids, _dir) = setup(N).await;
    let delivered: Arc<Mutex<HashMap<EventId, u32>>> = Arc::default();
    let busy_errors = Arc::new(Mutex::new(0_u32));
    let locking = Arc::new(AtomicBool::new(true));

    let mut relays = Vec::new();
    for relay in ["relay-a", "relay-b"] {
        let store = store.clone();
        let delivered = Arc::clone(&delivered);
        let busy_errors = Arc::clone(&busy_errors);
        let locking = Arc::clone(&locking);
        relays.push(tokio::spawn(async move {
            let mut backoff = Duration::from_millis(10);
            loop {
                let claim = match store.claim(&req(relay, 20)).await {
                    Ok(c) => c,
                    Err(e) => {
                        assert_busy(&e);
                        *busy_errors.lock().unwrap() += 1;
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_millis(200));
                        continue;
                    }
                };
                backoff = Duration::from_millis(10);
                if claim.events.is_empty() {
                    if !locking.load(Ordering::SeqCst) {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                let mut settlement = Settlement::new();
                for e in &claim.events {
                    assert_eq!(e.attempts, 1, "{} attempted twice", e.id);
                    *delivered.lock().unwrap().entry(e.id).or_default() += 1;
                    settlement.push(e.id, Resolution::Delivered);
                }
                // Retry the same settle until it is recorded (bounded: the
                // application's writes end).
                let mut tries = 0;
                let report = loop {
                    match store.settle(claim.token, &settlement).await {
                        Ok(r) => break r,
                        Err(e) => {
                            assert_busy(&e);
                            *busy_errors.lock().unwrap() += 1;
                            tries += 1;
                            assert!(tries < 200, "settle never succeeded");
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                };
                assert!(report.all_applied(), "{relay}: fenced {:?}", report.fenced);
                assert_eq!(report.applied, claim.events.len() as u64);
            }
        }));
    }
    // The application (on this task, while the relays run): 12 long writes
    // of 3x the busy timeout, with short gaps.
    for _ in 0..12 {
        let app = lock(&url).await;
        tokio::time::sleep(BUSY * 3).await;
        unlock(app).await;
        tokio::time::sleep(BUSY / 2).await;
    }
    locking.store(false, Ordering::SeqCst);
    for r in relays {
        r.await.unwrap();
    }

    let delivered = delivered.lock().unwrap().clone();
    assert_eq!(delivered.len(), N, "events lost");
    for id in &ids {
        assert_eq!(
            delivered.get(id),
            Some(&1),
            "{id} delivered {:?} times",
            delivered.get(id)
        );
    }
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.in_flight, s.dead), (0, 0, 0));
    // The locks did get in the way (otherwise this test proves nothing).
    assert!(*busy_errors.lock().unwrap() > 0, "no busy error was seen");
}
