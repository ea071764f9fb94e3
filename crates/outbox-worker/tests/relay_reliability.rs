//! The relay's reliability behaviour on real stores: SQLite (a file
//! database, each relay with its own pool, as two processes would be) and
//! PostgreSQL (feature `postgres`; `DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`, one fresh schema per test;
//! skipped with a message when no server answers).
//!
//! - a sink slower than the lock timeout, two relays: every event delivered
//!   exactly once (leases renewed, the prefetched batch included);
//! - a sink outage: no attempt counted, nothing dead-lettered, the breaker
//!   opens, probes, closes, and everything is delivered once, in key order;
//! - a handler that panics before returning its future: HANDLER_PANICKED,
//!   dead-lettered after max attempts, the other events delivered.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use outbox_worker::core::{
    DeadLetterQuery, DeadLetterStore, DeliveryError, ErrorCode, Event, EventId, NewEvent, Outcome,
    RelayId, Sink, Store,
};
use outbox_worker::{
    HandlerRegistry, Progress, Relay, RelayOptions, RelaySummary, SinkHealth, SinkState,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

// The relay's unit tests' helpers (`logged`): the same file, so that this
// test sees the relay exactly as they do.
#[path = "../src/test_support.rs"]
mod test_support;

use outbox_testkit::sink::{fast_retry, CountingSink};
use test_support::logged;

// ---------------------------------------------------------------- fixtures

mod sqlite {
    use super::*;
    use outbox_worker::sqlite::{SqliteStore, SqliteStoreOptions};

    pub(crate) struct Db {
        _dir: tempfile::TempDir,
        url: String,
    }

    impl Db {
        pub(crate) async fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
            let db = Self { _dir: dir, url };
            db.store().await.migrate().await.unwrap();
            db
        }

        /// A store with its own pool on the same file (another process).
        pub(crate) async fn store(&self) -> SqliteStore {
            SqliteStore::connect(SqliteStoreOptions::new(self.url.clone()))
                .await
                .unwrap()
        }

        pub(crate) async fn enqueue(&self, events: Vec<NewEvent>) -> Vec<EventId> {
            let store = self.store().await;
            let mut tx = store.pool().begin().await.unwrap();
            let ids = store.outbox().enqueue_batch(&mut tx, events).await.unwrap();
            tx.commit().await.unwrap();
            ids
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use outbox_worker::postgres::{Ident, PgStore, PgStoreOptions};

    pub(crate) struct Db {
        options: PgStoreOptions,
        schema: Ident,
    }

    impl Db {
        /// A migrated outbox in a fresh schema, or `None` (with a message)
        /// when no PostgreSQL answers.
        pub(crate) async fn new(test: &str) -> Option<Self> {
            let url = std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
            let suffix = uuid::Uuid::new_v4().simple().to_string();
            let schema = Ident::new(format!("outbox_worker_{}", &suffix[..12])).unwrap();
            let options = PgStoreOptions::new(url.clone())
                .with_schema(schema.clone())
                .with_max_connections(4)
                .with_acquire_timeout(Duration::from_secs(5));
            let store = match PgStore::connect(options.clone()).await {
                Ok(store) => store,
                Err(err) => {
                    eprintln!(
                        "SKIPPED {test} on PostgreSQL: cannot connect to {} ({err})",
                        outbox_worker::core::redact_url(&url)
                    );
                    return None;
                }
            };
            store.migrate().await.unwrap();
            Some(Self { options, schema })
        }

        /// A store with its own pool on the same schema (another process).
        pub(crate) async fn store(&self) -> PgStore {
            PgStore::connect(self.options.clone()).await.unwrap()
        }

        pub(crate) async fn enqueue(&self, events: Vec<NewEvent>) -> Vec<EventId> {
            let store = self.store().await;
            let mut tx = store.pool().begin().await.unwrap();
            let ids = store.outbox().enqueue_batch(&mut tx, events).await.unwrap();
            tx.commit().await.unwrap();
            ids
        }

        pub(crate) async fn drop_schema(self) {
            let store = self.store().await;
            outbox_worker::postgres::sqlx::raw_sql(&format!(
                "DROP SCHEMA IF EXISTS {} CASCADE",
                self.schema.quoted()
            ))
            .execute(store.pool())
            .await
            .unwrap();
        }
    }
}

/// One case as two tests: `$sqlite` on a fresh SQLite file and `$postgres`
/// (feature `postgres`) in a fresh schema named after `$label`, skipped
/// when no server answers and dropped after the case. `$body` sees the
/// database as `$db` (both `Db`s have `enqueue` and `store`).
macro_rules! on_both_stores {
    (
        #[$test:meta]
        $sqlite:ident,
        $postgres:ident,
        $label:literal,
        |$db:ident| $body:block
    ) => {
        #[$test]
        async fn $sqlite() {
            let $db = sqlite::Db::new().await;
            $body
        }

        #[cfg(feature = "postgres")]
        #[$test]
        async fn $postgres() {
            let Some($db) = postgres::Db::new($label).await else {
                return;
            };
            $body
            $db.drop_schema().await;
        }
    };
}

fn events(n: usize, keys: usize, event_type: &str) -> Vec<NewEvent> {
    (0..n)
        .map(|i| {
            NewEvent::new(event_type, "orders", format!("{{\"n\":{i}}}").into_bytes())
                .with_key(format!("key-{}", i % keys))
        })
        .collect()
}

fn options(id: &str) -> RelayOptions {
    RelayOptions::default()
        .with_relay_id(RelayId::new(id))
        .with_poll_interval(Duration::from_millis(50))
        .with_retry(fast_retry(4))
}

// ------------------------------------- a sink slower than the lock timeout

/// Two relays, lock timeout 2 s, every batch takes 1.5 s (a delivery fits
/// in one lease: `delivery_timeout` is at most the lock timeout), full
/// batches so drain mode claims the next batch ahead and holds it for a
/// whole delivery: a batch is held 3 s, claim to settlement. Without lease
/// renewal the batch waiting loses its lease and is delivered twice.
async fn slower_than_the_lease<S: Store>(a: S, b: S, ids: Vec<EventId>) {
    let sink = CountingSink::default().with_delay(Duration::from_millis(1500));
    let opts = |id| {
        options(id)
            .with_batch_size(3)
            .with_lock_timeout(Duration::from_secs(2))
    };
    let one = Relay::new(a, sink.clone(), opts("relay-a")).unwrap();
    let two = Relay::new(b, sink.clone(), opts("relay-b")).unwrap();
    let (s1, s2) = tokio::time::timeout(Duration::from_secs(120), async {
        tokio::join!(one.run_until_idle(), two.run_until_idle())
    })
    .await
    .expect("relays did not drain the outbox within 120 s");

    let seen = sink.counts();
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "delivered more than once: {twice:?}");
    assert_eq!(seen.len(), ids.len(), "not every event was delivered");
    assert!(ids.iter().all(|id| seen.contains_key(id)));
    assert_eq!((s1.lease_lost, s2.lease_lost), (0, 0));
    assert_eq!(s1.delivered + s2.delivered, ids.len() as u64);
    assert!(s1.delivered > 0 && s2.delivered > 0, "{s1:?} {s2:?}");
}

on_both_stores! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    slow_sink_two_relays_deliver_every_event_exactly_once_sqlite,
    slow_sink_two_relays_deliver_every_event_exactly_once_postgres,
    "slow_sink_two_relays",
    |db| {
        let ids = db.enqueue(events(18, 18, "slow")).await;
        slower_than_the_lease(db.store().await, db.store().await, ids).await;
    }
}

// ------------------------------------------------------------ sink outage

/// A broker that is down until `up` is set: while down every event is
/// reported unavailable (and the attempts it arrived with are recorded).
#[derive(Clone, Default)]
struct Flaky {
    up: Arc<AtomicBool>,
    calls_while_down: Arc<AtomicU32>,
    attempts_seen_while_down: Arc<Mutex<Vec<u32>>>,
    sizes_while_down: Arc<Mutex<Vec<usize>>>,
    delivered: Arc<Mutex<Vec<(String, EventId)>>>,
}

impl Sink for Flaky {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        if !self.up.load(Ordering::SeqCst) {
            self.calls_while_down.fetch_add(1, Ordering::SeqCst);
            self.sizes_while_down.lock().unwrap().push(events.len());
            self.attempts_seen_while_down
                .lock()
                .unwrap()
                .extend(events.iter().map(|e| e.attempts));
            let error = DeliveryError::unavailable(
                ErrorCode::PUBLISH_CONNECTION_LOST,
                "connection refused",
            );
            return vec![Outcome::Failed(error); events.len()];
        }
        self.delivered
            .lock()
            .unwrap()
            .extend(events.iter().map(|e| (e.shard_key(), e.id)));
        vec![Outcome::Delivered; events.len()]
    }
}

async fn outage_costs_nothing<S: Store + DeadLetterStore>(store: S, ids: Vec<EventId>) {
    let sink = Flaky::default();
    let relay = Relay::new(
        store,
        sink.clone(),
        options("relay-outage").with_batch_size(8),
    )
    .unwrap();
    let mut health: SinkHealth = relay.sink_health();
    let (relay, log) = logged(relay);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(relay.run(async {
        let _ = stop_rx.await;
    }));

    // Down: the breaker opens and keeps probing.
    tokio::time::timeout(Duration::from_secs(30), async {
        health.wait_for(|s| s == SinkState::Open).await;
        while sink.calls_while_down.load(Ordering::SeqCst) < 5 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the breaker did not open and probe");
    let seen = sink.attempts_seen_while_down.lock().unwrap().clone();
    assert!(
        seen.iter().all(|a| *a == 1),
        "an outage must not count attempts: {seen:?}"
    );
    // After the first batch, half-open probes carry one event each.
    let sizes = sink.sizes_while_down.lock().unwrap().clone();
    assert!(sizes[1..].iter().all(|n| *n == 1), "probe sizes {sizes:?}");

    // Up again: everything is delivered.
    sink.up.store(true, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(30), async {
        while sink.delivered.lock().unwrap().len() < ids.len() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("not everything was delivered after the sink came back");
    stop_tx.send(()).unwrap();
    let summary: RelaySummary = running.await.unwrap();

    assert_eq!(health.state(), SinkState::Closed);
    assert_eq!(health.status().outages, 1);
    assert_eq!(summary.sink_outages, 1);
    assert_eq!((summary.retried, summary.dead), (0, 0));
    assert_eq!(summary.delivered, ids.len() as u64);
    let log = log.lock().unwrap().clone();
    let attempts: HashMap<EventId, u32> = log
        .iter()
        .filter_map(|p| match p {
            Progress::Delivered { id, attempts, .. } => Some((*id, *attempts)),
            _ => None,
        })
        .collect();
    assert_eq!(attempts.len(), ids.len());
    assert!(
        attempts.values().all(|a| *a == 1),
        "a delivered event's attempts must be 1 after an outage: {attempts:?}"
    );
    let transitions: Vec<(SinkState, SinkState)> = log
        .iter()
        .filter_map(|p| match p {
            Progress::SinkStateChanged { from, to } => Some((*from, *to)),
            _ => None,
        })
        .collect();
    assert_eq!(transitions[0], (SinkState::Closed, SinkState::Open));
    assert!(transitions.contains(&(SinkState::Open, SinkState::HalfOpen)));
    assert_eq!(
        transitions.last(),
        Some(&(SinkState::HalfOpen, SinkState::Closed))
    );

    // Each delivered once, and in commit order per key.
    let delivered = sink.delivered.lock().unwrap().clone();
    let mut per_key: HashMap<String, Vec<EventId>> = HashMap::new();
    for (key, id) in &delivered {
        per_key.entry(key.clone()).or_default().push(*id);
    }
    for (key, got) in &per_key {
        let mut sorted = got.clone();
        sorted.sort();
        assert_eq!(got, &sorted, "key {key} out of order");
    }
    assert_eq!(delivered.len(), ids.len());
    // Nothing was dead-lettered.
    let dead = running_dead(&log);
    assert_eq!(dead, 0);
}

/// Nothing pending, in flight or dead in `store`, and no dead letter listed.
async fn assert_empty_without_dead_letters<S: Store + DeadLetterStore>(store: &S) {
    assert!(store
        .list_dead(&DeadLetterQuery::default())
        .await
        .unwrap()
        .is_empty());
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.in_flight, stats.dead), (0, 0, 0));
}

fn running_dead(log: &[Progress]) -> usize {
    log.iter()
        .filter(|p| matches!(p, Progress::Dead { .. }))
        .count()
}

on_both_stores! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    sink_outage_counts_no_attempt_and_delivers_everything_after_sqlite,
    sink_outage_counts_no_attempt_and_delivers_everything_after_postgres,
    "sink_outage",
    |db| {
        let ids = db.enqueue(events(40, 5, "order.created")).await;
        let store = db.store().await;
        outage_costs_nothing(store.clone(), ids).await;
        assert_empty_without_dead_letters(&store).await;
    }
}

// ------------------------------------------- a synchronous handler panic

async fn synchronous_panic<S: Store + DeadLetterStore + Clone>(store: S, ids: Vec<EventId>) {
    // ids[0] is "boom", the others "ok".
    #[allow(unreachable_code, clippy::diverging_sub_expression)]
    let handlers = HandlerRegistry::new()
        .with_handler("boom", |_| {
            panic!("panicked before returning a future");
            async { Ok(()) }
        })
        .with_handler("ok", |_| async { Ok(()) });
    let relay = Relay::new(store.clone(), handlers, options("relay-panic")).unwrap();
    let (relay, log) = logged(relay);
    let summary = tokio::time::timeout(Duration::from_secs(60), relay.run_until_idle())
        .await
        .expect("the relay did not drain the outbox");

    assert_eq!(summary.delivered, ids.len() as u64 - 1);
    assert_eq!((summary.retried, summary.dead), (3, 1));
    let dead = store.list_dead(&DeadLetterQuery::default()).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].event.id, ids[0]);
    assert_eq!(dead[0].event.attempts, 4);
    assert_eq!(dead[0].error.code, ErrorCode::HANDLER_PANICKED);
    assert!(
        dead[0]
            .error
            .message
            .contains("panicked before returning a future"),
        "{:?}",
        dead[0].error
    );
    let log = log.lock().unwrap().clone();
    assert!(log.iter().all(|p| match p {
        Progress::Retried { id, error, .. } =>
            *id == ids[0] && *error.code() == ErrorCode::HANDLER_PANICKED,
        _ => true,
    }));
}

fn panic_events() -> Vec<NewEvent> {
    let mut all = vec![NewEvent::new("boom", "orders", b"{}".to_vec()).with_key("poison")];
    all.extend(events(5, 5, "ok"));
    all
}

on_both_stores! {
    #[tokio::test]
    a_synchronous_handler_panic_is_retried_then_dead_lettered_sqlite,
    a_synchronous_handler_panic_is_retried_then_dead_lettered_postgres,
    "synchronous_panic",
    |db| {
        let ids = db.enqueue(panic_events()).await;
        synchronous_panic(db.store().await, ids).await;
    }
}
