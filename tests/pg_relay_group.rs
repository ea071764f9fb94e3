//! Relay groups on the event log against a real PostgreSQL: relays started
//! without a shard share the outbox's virtual shards through cursor leases,
//! take over a killed relay's shards, give shards to joining relays and
//! hand theirs over at once when they stop; per-key order and exactly-once
//! (but for the batch a kill interrupts) hold throughout.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "../crates/outbox-postgres/tests/log_support/mod.rs"]
#[allow(unused_imports)]
mod log_support;

use log_support::{eventually, LogDb};
use outbox_core::{
    ClaimRequest, EventId, NewEvent, RelayId, Resolution, Settlement, ShardSpec, Store,
};
use outbox_postgres::PgLogStore;
use outbox_postgres::RelayInfo;
use outbox_worker::{HandlerRegistry, Relay, RelayOptions};
use sqlx::Row;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

const LEASE: Duration = Duration::from_secs(2);
const BATCH: u32 = 50;

/// Deliveries in arrival order: (event id, key, per-key sequence).
type Log = Arc<Mutex<Vec<(EventId, String, u64)>>>;

fn recorder(log: Log) -> HandlerRegistry {
    HandlerRegistry::new().with_handler("group.test", move |event| {
        let log = Arc::clone(&log);
        async move {
            let seq: u64 = String::from_utf8(event.payload.clone())
                .unwrap()
                .parse()
                .unwrap();
            log.lock()
                .unwrap()
                .push((event.id, event.key.clone().unwrap_or_default(), seq));
            Ok(())
        }
    })
}

async fn group_store(db: &LogDb) -> PgLogStore {
    db.store_with(
        db.options()
            .with_dynamic_shards(true)
            .with_rebalance_interval(Duration::from_millis(200)),
    )
    .await
}

struct Running {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

async fn start(db: &LogDb, name: &str, log: &Log) -> Running {
    let store = group_store(db).await;
    let relay = Relay::new(
        store,
        recorder(Arc::clone(log)),
        RelayOptions::default()
            .with_relay_id(RelayId::new(name))
            .with_batch_size(BATCH)
            .with_lock_timeout(LEASE)
            .with_poll_interval(Duration::from_millis(200)),
    )
    .unwrap();
    let (stop, mut rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await;
    });
    Running { stop, task }
}

/// The live relays' shard counts, by relay.
async fn shares(store: &PgLogStore) -> HashMap<String, usize> {
    store
        .relay_group()
        .await
        .unwrap()
        .into_iter()
        .filter(|r: &RelayInfo| r.alive)
        .map(|r| (r.relay, r.shards.len()))
        .collect()
}

/// Every live relay holds its fair share of the 64 shards, +/- 1, and
/// every shard is held.
fn fair(shares: &HashMap<String, usize>, relays: &[&str]) -> bool {
    let n = relays.len();
    relays.iter().all(|r| {
        shares
            .get(*r)
            .is_some_and(|&s| s + 1 >= 64 / n && s <= 64 / n + 2)
    }) && shares.len() == n
        && shares.values().sum::<usize>() == 64
}

/// 3 relays; one killed, two joining, one stopping gracefully, all while a
/// producer commits: every event is delivered, per-key order holds,
/// duplicates stay within the batch the kill interrupted, and the
/// survivors end with a fair share each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_share_the_shards_through_kills_joins_and_leaves() {
    let db = LogDb::with_pool_size(16).await;
    let probe = group_store(&db).await;
    let log: Log = Arc::default();

    // The producer: 40 keys, each with its own sequence, until told to stop.
    let (stop_producer, mut producing) = watch::channel(false);
    let producer = {
        let pool = db.pool.clone();
        let outbox = db.log.clone();
        tokio::spawn(async move {
            let mut seqs: HashMap<String, u64> = HashMap::new();
            let mut committed = Vec::new();
            let mut round = 0u64;
            while !*producing.borrow_and_update() {
                let mut tx = pool.begin().await.unwrap();
                let events: Vec<NewEvent> = (0..20)
                    .map(|i| {
                        let key = format!("key-{}", (round * 7 + i) % 40);
                        let seq = seqs.entry(key.clone()).or_default();
                        *seq += 1;
                        NewEvent::new("group.test", "group", seq.to_string().into_bytes())
                            .with_key(key)
                    })
                    .collect();
                let ids = outbox.enqueue_batch(&mut tx, events).await.unwrap();
                tx.commit().await.unwrap();
                committed.extend(ids);
                round += 1;
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
            committed
        })
    };

    let mut relays: HashMap<&str, Running> = HashMap::new();
    for name in ["r0", "r1", "r2"] {
        relays.insert(name, start(&db, name, &log).await);
    }
    assert!(
        eventually(Duration::from_secs(20), || async {
            fair(&shares(&probe).await, &["r0", "r1", "r2"])
        })
        .await,
        "3 relays never settled on a fair share: {:?}",
        shares(&probe).await
    );

    // Kill r0 (no graceful leave: its leases run out), start r3 and r4,
    // stop r1 gracefully.
    relays.remove("r0").unwrap().task.abort();
    relays.insert("r3", start(&db, "r3", &log).await);
    relays.insert("r4", start(&db, "r4", &log).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r1 = relays.remove("r1").unwrap();
    r1.stop.send(true).unwrap();
    r1.task.await.unwrap();
    assert!(
        eventually(Duration::from_secs(30), || async {
            fair(&shares(&probe).await, &["r2", "r3", "r4"])
        })
        .await,
        "the survivors never settled on a fair share: {:?}",
        shares(&probe).await
    );

    stop_producer.send(true).unwrap();
    let committed = producer.await.unwrap();
    let want: HashSet<EventId> = committed.iter().copied().collect();
    assert!(
        want.len() >= 500,
        "the producer committed only {} events",
        want.len()
    );
    assert!(
        eventually(Duration::from_secs(60), || async {
            let got: HashSet<EventId> = log.lock().unwrap().iter().map(|d| d.0).collect();
            want.is_subset(&got)
        })
        .await,
        "not every committed event was delivered"
    );
    for (_, r) in relays {
        r.stop.send(true).unwrap();
        r.task.await.unwrap();
    }

    let deliveries = log.lock().unwrap().clone();
    let mut seen: HashSet<EventId> = HashSet::new();
    let mut last: HashMap<String, u64> = HashMap::new();
    let mut duplicates = 0usize;
    let mut violations = Vec::new();
    for (id, key, seq) in &deliveries {
        if !seen.insert(*id) {
            duplicates += 1;
            continue;
        }
        let prev = last.insert(key.clone(), *seq).unwrap_or(0);
        if *seq != prev + 1 {
            violations.push((key.clone(), prev, *seq));
        }
    }
    assert!(seen.is_subset(&want), "unexpected events delivered");
    assert!(
        violations.is_empty(),
        "per-key order violations: {violations:?}"
    );
    assert!(
        duplicates <= BATCH as usize,
        "{duplicates} duplicates: more than the one batch the kill interrupted"
    );
    // Graceful leaves took the relays out of the group.
    assert!(shares(&probe).await.is_empty());
}

fn claim_req(relay: &str) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new(relay),
        batch_size: 100,
        lease: LEASE,
        shard: ShardSpec::ALL,
    }
}

async fn cursor_rows(db: &LogDb) -> Vec<String> {
    sqlx::query(&format!(
        "SELECT shard_index, lo::text, hi::text, pos_txid::text, pos_seq, epoch, owner
         FROM {} ORDER BY shard_index",
        db.table("_cursors")
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .iter()
    .map(|r| {
        format!(
            "{}|{}|{}|{:?}|{:?}|{}|{:?}",
            r.get::<i32, _>(0),
            r.get::<String, _>(1),
            r.get::<String, _>(2),
            r.get::<Option<String>, _>(3),
            r.get::<Option<i64>, _>(4),
            r.get::<i64, _>(5),
            r.get::<Option<String>, _>(6)
        )
    })
    .collect()
}

/// A relay paused past its lease (SIGSTOP) whose shards another relay took
/// changes nothing when it wakes: its settlement is fenced, the cursors
/// stay where the new owner left them, and it gets shards again only as the
/// new owner gives them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_owner_whose_shards_were_taken_changes_nothing() {
    let db = LogDb::new().await;
    let a = group_store(&db).await;
    let b = group_store(&db).await;
    let ids = db
        .enqueue(
            (0..10)
                .map(|i| {
                    NewEvent::new("group.test", "group", b"1".to_vec()).with_key(format!("k{i}"))
                })
                .collect(),
        )
        .await;

    let stale = a.claim(&claim_req("a")).await.unwrap();
    assert_eq!(stale.events.len(), 10, "alone, relay a holds every shard");

    // a is paused past its lease and its announcement.
    db.expire_leases().await;
    sqlx::query(&format!(
        "UPDATE {} SET seen_until = now() - interval '1 second'",
        db.table("_relays")
    ))
    .execute(&db.pool)
    .await
    .unwrap();

    let fresh = b.claim(&claim_req("b")).await.unwrap();
    let got: HashSet<EventId> = fresh.events.iter().map(|e| e.id).collect();
    assert_eq!(
        got,
        ids.iter().copied().collect(),
        "b took every shard over"
    );
    let mut done = Settlement::new();
    for e in &fresh.events {
        done.push(e.id, Resolution::Delivered);
    }
    assert_eq!(b.settle(fresh.token, &done).await.unwrap().applied, 10);
    let before = cursor_rows(&db).await;

    // a wakes up: its settlement is fenced and changes nothing.
    let mut late = Settlement::new();
    for e in &stale.events {
        late.push(e.id, Resolution::Delivered);
    }
    let report = a.settle(stale.token, &late).await.unwrap();
    assert_eq!(report.applied, 0);
    assert_eq!(report.fenced.len(), 10);
    let again = a.claim(&claim_req("a")).await.unwrap();
    assert!(again.events.is_empty(), "nothing left for a to deliver");
    assert_eq!(
        cursor_rows(&db).await,
        before,
        "the stale owner moved a cursor"
    );

    // Then the two share the shards: b gives half back, a takes it.
    assert!(
        eventually(Duration::from_secs(10), || async {
            let _ = b.claim(&claim_req("b")).await.unwrap();
            let _ = a.claim(&claim_req("a")).await.unwrap();
            fair(&shares(&b).await, &["a", "b"])
        })
        .await,
        "a and b never split the shards: {:?}",
        shares(&b).await
    );
    b.leave(&RelayId::new("b")).await.unwrap();
    a.leave(&RelayId::new("a")).await.unwrap();
    assert!(shares(&a).await.is_empty());
}
