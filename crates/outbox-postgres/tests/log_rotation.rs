//! Rotation of the event log against a real PostgreSQL: what blocks it,
//! that producers never wait for it, and rotation under load with
//! producers and two relays (nothing lost, nothing duplicated, partitions
//! truncated, no dead tuples).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod log_support;

use log_support::LogDb;
use outbox_core::{
    ClaimRequest, ErrorCode, EventId, LastError, NewEvent, RelayId, Resolution, Settlement,
    ShardSpec, Store,
};
use outbox_postgres::PgLogStore;
use outbox_postgres::Rotation;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a relay delivered: the id and the key.
type Delivered = (EventId, Option<String>);

fn ev(key: &str, n: usize) -> NewEvent {
    NewEvent::new("test.event", "rot", format!("{key}-{n}").into_bytes()).with_key(key)
}

fn req(relay: &str, shard: ShardSpec, n: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new(relay),
        batch_size: n,
        lease: Duration::from_secs(60),
        shard,
    }
}

/// Claims and delivers everything there is; returns the ids.
async fn drain(store: &PgLogStore, relay: &str) -> Vec<EventId> {
    let mut out = Vec::new();
    loop {
        let c = store.claim(&req(relay, ShardSpec::ALL, 100)).await.unwrap();
        if c.events.is_empty() {
            return out;
        }
        let s = c.events.iter().fold(Settlement::new(), |s, e| {
            s.with(e.id, Resolution::Delivered)
        });
        store.settle(c.token, &s).await.unwrap();
        out.extend(c.events.iter().map(|e| e.id));
    }
}

async fn slot_of(db: &LogDb, id: EventId) -> i16 {
    sqlx::query_scalar(&format!("SELECT slot FROM {} WHERE id = $1", db.table("")))
        .bind(id.as_uuid())
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

fn rotated(r: &Rotation) -> bool {
    matches!(r, Rotation::Rotated { .. })
}

/// Rotates, retrying for up to 5 s: the partition may be briefly in use
/// (rotation takes its lock with NOWAIT and never waits), or the cursor's
/// idle position not yet written (a relay writes it on a later claim, as
/// the empty claim here does); panics with the last reason otherwise.
async fn rotate(store: &PgLogStore, relay: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match store.rotate_now().await.unwrap() {
            r if rotated(&r) => return,
            Rotation::Blocked(reason) if Instant::now() < deadline => {
                eprintln!("rotation blocked ({reason}); again");
                tokio::time::sleep(Duration::from_millis(100)).await;
                assert!(drain(store, relay).await.is_empty());
            }
            other => panic!("expected a rotation, got {other:?}"),
        }
    }
}

/// Rotation truncates a partition only when every cursor has passed all of
/// its rows and no open transaction holds it; an open producer never
/// waits for a rotation; a REPEATABLE READ producer whose snapshot predates
/// the rotation still writes to the current partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_waits_for_cursors_and_writers_and_never_blocks_producers() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let e1 = db.enqueue(vec![ev("k", 1)]).await[0];
    assert_eq!(slot_of(&db, e1).await, 0);
    assert!(
        matches!(store.rotate_now().await.unwrap(), Rotation::Blocked(r) if r.contains("no cursor"))
    );

    // A cursor exists and holds e1 unsettled.
    let c = store
        .claim(&req("relay", ShardSpec::ALL, 10))
        .await
        .unwrap();
    assert_eq!(c.events.len(), 1);
    rotate(&store, "relay").await; // -> slot 1 (empty)
    let e2 = db.enqueue(vec![ev("k", 2)]).await[0];
    assert_eq!(slot_of(&db, e2).await, 1);
    rotate(&store, "relay").await; // -> slot 2 (empty)
    let blocked = store.rotate_now().await.unwrap(); // slot 0 holds e1, not passed
    assert!(
        matches!(&blocked, Rotation::Blocked(r) if r.contains("not passed")),
        "{blocked:?}"
    );
    assert_eq!(db.partition_rows().await, vec![1, 1, 0]);

    let s = Settlement::new().with(e1, Resolution::Delivered);
    store.settle(c.token, &s).await.unwrap();
    assert_eq!(drain(&store, "relay").await, vec![e2]);
    rotate(&store, "relay").await; // -> slot 0, truncated
    assert_eq!(db.partition_rows().await, vec![0, 1, 0]);

    // A producer's transaction stays open across a rotation: it does not
    // wait (lock_timeout turns a wait into an error), and the partition it
    // wrote to cannot be truncated until it ends.
    let mut open = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '2s'")
        .execute(&mut *open)
        .await
        .unwrap();
    let e3 = db.log.enqueue(&mut open, ev("k", 3)).await.unwrap();
    assert!(rotated(&store.rotate_now().await.unwrap())); // -> slot 1
    let e4 = db.log.enqueue(&mut open, ev("k", 4)).await.unwrap();
    assert!(rotated(&store.rotate_now().await.unwrap())); // -> slot 2
    let busy = store.rotate_now().await.unwrap(); // slot 0: held by `open`
    assert!(
        matches!(&busy, Rotation::Blocked(r) if r.contains("in use")),
        "{busy:?}"
    );
    open.commit().await.unwrap();
    assert_eq!(slot_of(&db, e3).await, 0);
    assert_eq!(
        slot_of(&db, e4).await,
        1,
        "routed to the partition current then"
    );
    assert_eq!(drain(&store, "relay").await, vec![e3, e4]);
    assert!(rotated(&store.rotate_now().await.unwrap())); // -> slot 0

    // REPEATABLE READ: the snapshot predates the rotation, the write does not.
    let mut rr = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *rr)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM pg_class")
        .execute(&mut *rr)
        .await
        .unwrap();
    assert!(rotated(&store.rotate_now().await.unwrap())); // -> slot 1
    let e5 = db.log.enqueue(&mut rr, ev("k", 5)).await.unwrap();
    rr.commit().await.unwrap();
    assert_eq!(slot_of(&db, e5).await, 1);
    assert_eq!(drain(&store, "relay").await, vec![e5]);
    let info = store.log_info().await.unwrap();
    assert_eq!(info.rotations, 7);
    assert_eq!(info.generation, 7);
    assert!(info.partitions[1].current);
}

/// Producers and two relays (shards 0/2 and 1/2, separate stores) run while
/// the log rotates in the background every ~200 ms: every event is
/// delivered exactly once, per-key order holds, partitions are truncated
/// and reused, and no event partition has dead tuples.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_under_load_loses_nothing_and_duplicates_nothing() {
    const PRODUCERS: usize = 3;
    // Each producer commits at least MIN_TXS transactions, and goes on
    // (up to MAX_TXS) until three rotations happened while producing.
    const MIN_TXS: usize = 250;
    const MAX_TXS: usize = 5000;
    let db = LogDb::with_pool_size(12).await;
    let options = db
        .options()
        .with_rotation_interval(Duration::from_millis(200))
        .with_background_rotation(true);
    let rotating = db.store_with(options.clone()).await;

    let done_producing = Arc::new(AtomicBool::new(false));
    let enough = Arc::new(AtomicBool::new(false));
    let watcher = {
        let store = rotating.clone();
        let enough = Arc::clone(&enough);
        tokio::spawn(async move {
            while store.log_info().await.unwrap().rotations < 3 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            enough.store(true, Ordering::SeqCst);
        })
    };
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let pool = db.pool.clone();
        let log = db.log.clone();
        let enough = Arc::clone(&enough);
        producers.push(tokio::spawn(async move {
            let mut sent: Vec<(String, EventId)> = Vec::new();
            let mut slowest = Duration::ZERO;
            for t in 0..MAX_TXS {
                if t >= MIN_TXS && enough.load(Ordering::SeqCst) {
                    break;
                }
                let events: Vec<NewEvent> = (0..1 + t % 3)
                    .map(|i| ev(&format!("p{p}-k{}", (t + i) % 5), t * 10 + i))
                    .collect();
                let keys: Vec<String> =
                    events.iter().map(|e| e.key().unwrap().to_owned()).collect();
                let started = Instant::now();
                let mut tx = pool.begin().await.unwrap();
                // A producer that had to wait for a lock would fail here.
                sqlx::query("SET LOCAL lock_timeout = '5s'")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                let ids = log.enqueue_batch(&mut tx, events).await.unwrap();
                tx.commit().await.unwrap();
                slowest = slowest.max(started.elapsed());
                sent.extend(keys.into_iter().zip(ids));
                if t % 10 == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            (sent, slowest)
        }));
    }

    let delivered: Arc<Mutex<Vec<Delivered>>> = Arc::default();
    let mut relays = Vec::new();
    for shard in 0..2u32 {
        let store = db.store().await;
        let delivered = Arc::clone(&delivered);
        let done_producing = Arc::clone(&done_producing);
        relays.push(tokio::spawn(async move {
            let spec = ShardSpec::new(shard, 2).unwrap();
            let relay = format!("relay-{shard}");
            let mut idle_after_done = 0;
            loop {
                let c = store.claim(&req(&relay, spec, 50)).await.unwrap();
                if c.events.is_empty() {
                    if done_producing.load(Ordering::SeqCst) {
                        idle_after_done += 1;
                        if idle_after_done > 20 {
                            return;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                idle_after_done = 0;
                delivered
                    .lock()
                    .unwrap()
                    .extend(c.events.iter().map(|e| (e.id, e.key.clone())));
                let s = c.events.iter().fold(Settlement::new(), |s, e| {
                    s.with(e.id, Resolution::Delivered)
                });
                let r = store.settle(c.token, &s).await.unwrap();
                assert!(r.all_applied(), "{r:?}");
            }
        }));
    }

    let mut sent = Vec::new();
    let mut slowest = Duration::ZERO;
    for p in producers {
        let (s, slow) = p.await.unwrap();
        sent.extend(s);
        slowest = slowest.max(slow);
    }
    let rotations_while_producing = rotating.log_info().await.unwrap().rotations;
    done_producing.store(true, Ordering::SeqCst);
    watcher.abort();
    for r in relays {
        r.await.unwrap();
    }
    println!(
        "{} events, {rotations_while_producing} rotations while producing, slowest producer transaction {slowest:?}",
        sent.len()
    );

    // Exactly once, and per key in commit order.
    let delivered = delivered.lock().unwrap().clone();
    let mut seen: HashMap<EventId, usize> = HashMap::new();
    for (id, _) in &delivered {
        *seen.entry(*id).or_default() += 1;
    }
    assert_eq!(seen.len(), sent.len(), "lost events");
    assert!(seen.values().all(|n| *n == 1), "duplicated events");
    let mut want: HashMap<String, Vec<EventId>> = HashMap::new();
    for (key, id) in &sent {
        want.entry(key.clone()).or_default().push(*id);
    }
    let mut got: HashMap<String, Vec<EventId>> = HashMap::new();
    for (id, key) in &delivered {
        got.entry(key.clone().unwrap()).or_default().push(*id);
    }
    assert_eq!(got, want, "per-key order");
    assert!(
        rotations_while_producing >= 3,
        "{rotations_while_producing} rotations"
    );

    // Everything delivered: a full cycle of rotations empties every partition.
    drop(rotating);
    let store = db.store().await;
    let mut cycle = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while cycle < 3 && Instant::now() < deadline {
        // Idle cursors record their progress (at most once a second).
        for shard in 0..2u32 {
            let spec = ShardSpec::new(shard, 2).unwrap();
            let c = store
                .claim(&req(&format!("relay-{shard}"), spec, 10))
                .await
                .unwrap();
            assert!(c.events.is_empty());
        }
        if rotated(&store.rotate_now().await.unwrap()) {
            cycle += 1;
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    assert_eq!(cycle, 3, "rotation stalled");
    assert_eq!(db.partition_rows().await, vec![0, 0, 0]);
    let info = store.log_info().await.unwrap();
    for p in &info.partitions {
        assert_eq!(p.dead_tuples, 0, "dead tuples in partition {}", p.slot);
    }
    let tuples = db.partition_tuples().await;
    assert!(tuples.iter().all(|(_, dead)| *dead == 0), "{tuples:?}");
}

/// The log store's metrics: the background task counts rotations and
/// publishes the retry lane's size and parked keys for its group.
/// (Current-thread runtime: the thread-local recorder sees the spawned task.)
#[tokio::test]
async fn rotation_and_retry_lane_metrics_are_published() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    let db = LogDb::new().await;
    let store = db
        .store_with(
            db.options()
                .with_background_rotation(true)
                .with_rotation_interval(Duration::from_millis(200)),
        )
        .await;
    let ids = db.enqueue(vec![ev("k", 1), ev("k", 2)]).await;
    let c = store
        .claim(&req("relay", ShardSpec::ALL, 10))
        .await
        .unwrap();
    assert_eq!(c.events.len(), 2);
    let retry = Resolution::Retry {
        delay: Duration::from_secs(3600),
        error: LastError {
            code: ErrorCode::HANDLER_TEMPORARY_FAILURE,
            message: "down".into(),
        },
    };
    let s = Settlement::new()
        .with(ids[0], retry.clone())
        .with(ids[1], retry);
    assert!(store.settle(c.token, &s).await.unwrap().all_applied());

    // Gauges and counters as the recorder holds them now.
    let read = || {
        let mut seen: HashMap<String, f64> = HashMap::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let v = match value {
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Counter(c) => c as f64,
                DebugValue::Histogram(_) => continue,
            };
            seen.insert(key.key().name().to_owned(), v);
        }
        seen
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = HashMap::new();
    while Instant::now() < deadline {
        seen.extend(read());
        if seen.get(outbox_postgres::metrics::LANE_EVENTS) == Some(&2.0)
            && seen.get(outbox_postgres::metrics::PARKED_KEYS) == Some(&1.0)
            && seen
                .get(outbox_postgres::metrics::ROTATIONS)
                .is_some_and(|n| *n >= 1.0)
        {
            // Stop the background task before the schema is dropped: on
            // this current-thread runtime an aborted task is only dropped
            // (its transaction rolled back) while the runtime runs.
            let pool = store.pool().clone();
            drop(store);
            pool.close().await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("metrics not published: {seen:?}");
}
