//! Claims when keys are blocked (a head in retry backoff, or leased): the
//! rows behind a blocked key are parked, claims still find the due events
//! of other keys, and per-key order holds when the key is unblocked, under
//! concurrent claimers with retries, releases and dead letters.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::{req, TestDb};
use outbox_core::{
    ErrorCode, Event, EventId, FencingToken, LastError, NewEvent, Resolution, Settlement, Store,
};
use outbox_postgres::PgStore;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn keyed(key: &str, n: usize) -> NewEvent {
    NewEvent::new("test.event", "pg", n.to_string().into_bytes()).with_key(key)
}

fn error(message: &str) -> LastError {
    LastError {
        code: ErrorCode::HANDLER_TEMPORARY_FAILURE,
        message: message.to_owned(),
    }
}

fn ids(events: &[Event]) -> Vec<EventId> {
    events.iter().map(|e| e.id).collect()
}

async fn enqueue(db: &TestDb, events: Vec<NewEvent>) -> Vec<EventId> {
    let mut tx = db.pool.begin().await.unwrap();
    let ids = db.outbox.enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

async fn parked(db: &TestDb) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE parked",
        db.events()
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

async fn settle(store: &PgStore, token: FencingToken, s: Settlement) {
    let report = store.settle(token, &s).await.unwrap();
    assert!(
        report.fenced.is_empty() && report.rejected.is_empty(),
        "{report:?}"
    );
}

/// Settles every event of `ids` as delivered, none fenced or rejected.
async fn deliver_all(store: &PgStore, token: FencingToken, ids: &[EventId]) {
    settle(
        store,
        token,
        Settlement::new().with_all(ids, Resolution::Delivered),
    )
    .await;
}

/// A fresh database holding `keys * per_key` keyed events (keys `k0`.. in
/// turn) and a store on it; returns them with the events' ids in order.
async fn keyed_backlog(keys: usize, per_key: usize) -> (TestDb, PgStore, Vec<EventId>) {
    let db = TestDb::new().await;
    let store = db.store().await;
    let all = enqueue(
        &db,
        (0..keys * per_key)
            .map(|i| keyed(&format!("k{}", i % keys), i))
            .collect(),
    )
    .await;
    (db, store, all)
}

/// `events` holds, for each key, its events in id order.
fn assert_key_order(claimed: &[Event]) {
    let mut last: HashMap<&str, EventId> = HashMap::new();
    for e in claimed {
        if let Some(k) = e.key.as_deref() {
            if let Some(prev) = last.insert(k, e.id) {
                assert!(prev < e.id, "key {k} out of order");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_head_parks_its_key_and_claims_still_find_due_events() {
    const KEYS: usize = 20;
    const PER_KEY: usize = 30;
    let (db, store, all) = keyed_backlog(KEYS, PER_KEY).await;

    // The heads fail and go into a long backoff: the retry parks the rest.
    let heads = store.claim(&req("r", KEYS as u32)).await.unwrap();
    assert_eq!(ids(&heads.events), all[..KEYS]);
    let retry = heads.events.iter().fold(Settlement::new(), |s, e| {
        s.with(
            e.id,
            Resolution::Retry {
                delay: Duration::from_secs(3600),
                error: error("down"),
            },
        )
    });
    settle(&store, heads.token, retry).await;
    assert_eq!(parked(&db).await, (KEYS * (PER_KEY - 1)) as i64);

    // Due events behind the blocked backlog are claimed, nothing blocked is.
    let fresh = enqueue(
        &db,
        (0..10)
            .map(|i| {
                let e = NewEvent::new("fresh", "pg", vec![]);
                if i % 2 == 0 {
                    e
                } else {
                    e.with_key(format!("fresh-{i}"))
                }
            })
            .collect(),
    )
    .await;
    let c = store.claim(&req("r", 50)).await.unwrap();
    assert_eq!(ids(&c.events), fresh);
    deliver_all(&store, c.token, &fresh).await;

    // A new event of a blocked key is blocked too (and parked by the claim
    // that walked past it).
    let late = enqueue(&db, vec![keyed("k0", 9999)]).await[0];
    assert!(store.claim(&req("r", 50)).await.unwrap().events.is_empty());
    assert_eq!(parked(&db).await, (KEYS * (PER_KEY - 1) + 1) as i64);

    // The backoff ends: every key's events come, each key in order.
    sqlx::query(&format!(
        "UPDATE {} SET next_attempt_at = now() WHERE lease_token IS NULL AND NOT parked",
        db.events()
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let c = store.claim(&req("r", 1000)).await.unwrap();
    let mut want: Vec<EventId> = all.clone();
    want.push(late);
    assert_eq!(ids(&c.events), want);
    assert_eq!(c.events[0].attempts, 2, "the head's retry counted");
    assert_key_order(&c.events);
    deliver_all(&store, c.token, &want).await;
    assert_eq!(parked(&db).await, 0);
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.in_flight, s.dead), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_behind_leased_heads_are_parked_when_they_fill_the_walk() {
    const KEYS: usize = 10;
    const PER_KEY: usize = 100;
    let (db, store, all) = keyed_backlog(KEYS, PER_KEY).await;
    let a = store.claim(&req("a", KEYS as u32)).await.unwrap();
    assert_eq!(ids(&a.events), all[..KEYS]);

    // Another relay finds only blocked rows: it gets nothing. Its walk
    // (batch 5 + 512 rows) reached its bound, so the rows may hide due ones
    // beyond it: it parks what it walked.
    const WALK: i64 = 5 + 512;
    let b = store.claim(&req("b", 5)).await.unwrap();
    assert!(b.events.is_empty(), "{:?}", b.events);
    assert_eq!(parked(&db).await, WALK);
    // The next walk sees every remaining row (fewer than its bound): nothing
    // is hidden, so rows behind heads that are only in flight are skipped,
    // not parked.
    let b = store.claim(&req("b", 5)).await.unwrap();
    assert!(b.events.is_empty(), "{:?}", b.events);
    assert_eq!(parked(&db).await, WALK);
    let loose = enqueue(&db, vec![NewEvent::new("loose", "pg", vec![])]).await;
    let b = store.claim(&req("b", 5)).await.unwrap();
    assert_eq!(ids(&b.events), loose);
    deliver_all(&store, b.token, &loose).await;

    // The heads are delivered: the parked rows come through their keys, an
    // equal share of the batch per key, each key a prefix in order.
    deliver_all(&store, a.token, &ids(&a.events)).await;
    let mut seen = Vec::new();
    loop {
        let c = store.claim(&req("c", 200)).await.unwrap();
        if c.events.is_empty() {
            break;
        }
        assert!(c.events.len() <= 200);
        assert_key_order(&c.events);
        let got = ids(&c.events);
        deliver_all(&store, c.token, &got).await;
        seen.extend(got);
    }
    seen.sort();
    assert_eq!(seen, all[KEYS..]);
    assert_eq!(parked(&db).await, 0);
}

/// Tiny deterministic PRNG (xorshift64*), so a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Default)]
struct Model {
    /// Delivered or dead-lettered (recorded before the settlement is sent,
    /// so a claim that sees the row gone finds it here).
    resolved: HashSet<EventId>,
    in_flight: HashSet<EventId>,
    deliveries: HashMap<EventId, u32>,
}

/// Three relays claim concurrently from a keyed backlog, with random
/// batch sizes, retries (short backoff), releases and dead letters, the
/// rest of a key released after its first failure in a batch (as the
/// relay's per-key layer does). Every claim is checked: no event is handed
/// out while an earlier event of its key is unresolved and not earlier in
/// the same claim, and no event is handed out twice at once. In the end
/// every event was delivered exactly once or dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_holds_under_concurrent_claims_retries_and_releases() {
    const KEYS: usize = 15;
    const EVENTS: usize = 1500;
    let db = TestDb::new().await;
    let mut events: Vec<NewEvent> = (0..EVENTS)
        .map(|i| keyed(&format!("k{}", i % KEYS), i))
        .collect();
    events.extend((0..100).map(|i| NewEvent::new("loose", "pg", i.to_string().into_bytes())));
    let mut by_key: BTreeMap<String, Vec<EventId>> = BTreeMap::new();
    for e in &events {
        if let Some(k) = e.key() {
            by_key.entry(k.to_owned()).or_default().push(e.id());
        }
    }
    let total = events.len();
    let all = enqueue(&db, events).await;
    let by_key = Arc::new(by_key);
    let model = Arc::new(Mutex::new(Model::default()));

    let mut relays = Vec::new();
    for r in 0..3u64 {
        let store = db.store().await;
        let (model, by_key) = (Arc::clone(&model), Arc::clone(&by_key));
        relays.push(tokio::spawn(async move {
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (r + 1));
            let relay = format!("relay-{r}");
            let deadline = std::time::Instant::now() + Duration::from_secs(90);
            loop {
                assert!(std::time::Instant::now() < deadline, "no progress");
                if model.lock().unwrap().resolved.len() == total {
                    return;
                }
                let n = 5 + rng.below(56) as u32;
                let c = store.claim(&req(&relay, n)).await.unwrap();
                if c.events.is_empty() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                let mut s = Settlement::new();
                {
                    let mut m = model.lock().unwrap();
                    let mut earlier: HashSet<EventId> = HashSet::new();
                    for e in &c.events {
                        assert!(m.in_flight.insert(e.id), "{} handed out twice", e.id);
                        if let Some(k) = &e.key {
                            for before in by_key[k].iter().take_while(|id| **id < e.id) {
                                assert!(
                                    m.resolved.contains(before) || earlier.contains(before),
                                    "{} of key {k} claimed while {before} is unresolved",
                                    e.id
                                );
                            }
                        }
                        earlier.insert(e.id);
                    }
                    let mut failed_keys: HashSet<String> = HashSet::new();
                    for e in &c.events {
                        let key = e.key.clone().unwrap_or_default();
                        let blocked = e.key.is_some() && failed_keys.contains(&key);
                        let resolution = if blocked {
                            Resolution::Released
                        } else {
                            match rng.below(100) {
                                0..=74 => Resolution::Delivered,
                                75..=86 => Resolution::Retry {
                                    delay: Duration::from_millis(rng.below(30)),
                                    error: error("flaky"),
                                },
                                87..=95 => Resolution::Released,
                                _ => Resolution::Dead {
                                    error: error("gave up"),
                                },
                            }
                        };
                        match &resolution {
                            Resolution::Delivered => {
                                m.resolved.insert(e.id);
                                *m.deliveries.entry(e.id).or_default() += 1;
                            }
                            Resolution::Dead { .. } => {
                                m.resolved.insert(e.id);
                            }
                            _ => {
                                if e.key.is_some() {
                                    failed_keys.insert(key);
                                }
                            }
                        }
                        m.in_flight.remove(&e.id);
                        s.push(e.id, resolution);
                    }
                }
                let report = store.settle(c.token, &s).await.unwrap();
                assert!(report.fenced.is_empty(), "{report:?}");
            }
        }));
    }
    for r in relays {
        r.await.unwrap();
    }
    {
        let m = model.lock().unwrap();
        assert_eq!(m.resolved.len(), total);
        for id in &all {
            assert!(m.deliveries.get(id).copied().unwrap_or(0) <= 1, "{id}");
        }
    }
    let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", db.events()))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
}

trait WithAll {
    fn with_all(self, ids: &[EventId], r: Resolution) -> Self;
}

impl WithAll for Settlement {
    fn with_all(self, ids: &[EventId], r: Resolution) -> Self {
        ids.iter().fold(self, |s, id| s.with(*id, r.clone()))
    }
}
