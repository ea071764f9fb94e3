//! A lease ends by the relay's own clock (DESIGN.md invariant 15), on the
//! real PostgreSQL store (feature `postgres`; `DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`, one fresh schema; skipped with
//! a message when no server answers).
//!
//! Relay A reaches PostgreSQL through a [`TcpProxy`] and delivers a key's
//! batch to a slow sink (one event, then it waits on a gate the test
//! holds). The test cuts A's database connection: A's renewals fail. Relay
//! B (direct connection) takes the shard once the lease ran out in the
//! database and delivers the key's events, the later ones included. Only
//! then is A's gate opened. A must have stopped its delivery at its own
//! lease end, before B could claim: nothing of the batch past the first
//! event is published by A, and no stale copy follows B's later events.
//! The gate, not a timer, orders the steps.
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use outbox_testkit::proxy::TcpProxy;
use outbox_worker::core::{Event, EventId, NewEvent, Outcome, RelayId, Sink};
use outbox_worker::postgres::{Ident, PgStore, PgStoreOptions};
use outbox_worker::{Relay, RelayOptions};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;

/// Every publish of both relays, in the order the "broker" received them.
type Received = Arc<Mutex<Vec<(&'static str, EventId)>>>;

/// Sets its flag when dropped: the delivery future was cancelled.
struct Cancelled(Arc<AtomicBool>);

impl Drop for Cancelled {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A sink publishing one event at a time into `received`; with a gate,
/// each event after its first one waits for a permit first (a slow
/// broker). The relay's per-key order layer hands it one event of the key
/// per call.
#[derive(Clone)]
struct GatedSink {
    relay: &'static str,
    received: Received,
    gate: Option<Arc<Semaphore>>,
    cancelled: Arc<AtomicBool>,
    published: Arc<AtomicUsize>,
}

impl Sink for GatedSink {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        let mut guard = Some(Cancelled(Arc::clone(&self.cancelled)));
        let mut outcomes = Vec::with_capacity(events.len());
        for e in events {
            let n = self.published.fetch_add(1, Ordering::SeqCst);
            if let (Some(gate), true) = (&self.gate, n > 0) {
                gate.acquire().await.unwrap().forget();
            }
            self.received.lock().unwrap().push((self.relay, e.id));
            outcomes.push(Outcome::Delivered);
        }
        // Finished, not cancelled.
        std::mem::forget(guard.take());
        outcomes
    }
}

/// Waits (polling) until `f` holds; fails after `limit` (a bound for a
/// broken run, not a timed assertion).
async fn until(what: &str, limit: Duration, f: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "gave up waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn events(range: std::ops::Range<usize>) -> Vec<NewEvent> {
    range
        .map(|i| {
            NewEvent::new("lease", "orders", format!("{{\"n\":{i}}}").into_bytes()).with_key("k")
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cut_from_its_database_stops_at_its_lease_end_and_no_stale_copy_follows() {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let schema = Ident::new(format!("outbox_lease_{}", &suffix[..12])).unwrap();
    let direct = PgStoreOptions::new(url.clone())
        .with_schema(schema.clone())
        .with_max_connections(4)
        .with_acquire_timeout(Duration::from_secs(2));
    let admin = match PgStore::connect(direct.clone()).await {
        Ok(store) => store,
        Err(err) => {
            eprintln!("SKIPPED lease clock test on PostgreSQL: cannot connect ({err})");
            return;
        }
    };
    admin.migrate().await.unwrap();
    let enqueue = |events: Vec<NewEvent>| {
        let admin = admin.clone();
        async move {
            let mut tx = admin.pool().begin().await.unwrap();
            let ids = admin.outbox().enqueue_batch(&mut tx, events).await.unwrap();
            tx.commit().await.unwrap();
            ids
        }
    };
    let mut ids = enqueue(events(0..3)).await;

    // Relay A: through the proxy, 2 s lease, a gated sink.
    let upstream: SocketAddr = "127.0.0.1:5432".parse().unwrap();
    let proxy = TcpProxy::start(upstream).await;
    let proxied = url.replacen("127.0.0.1:5432", &proxy.addr().to_string(), 1);
    assert_ne!(proxied, url, "DATABASE_URL must point at 127.0.0.1:5432");
    let lease = Duration::from_secs(2);
    let opts = |id: &str| {
        RelayOptions::default()
            .with_relay_id(RelayId::new(id))
            .with_poll_interval(Duration::from_millis(50))
            .with_lock_timeout(lease)
            .with_batch_size(3)
    };
    let received: Received = Arc::default();
    let gate = Arc::new(Semaphore::new(0));
    let a_cancelled = Arc::new(AtomicBool::new(false));
    let sink_a = GatedSink {
        relay: "a",
        received: Arc::clone(&received),
        gate: Some(Arc::clone(&gate)),
        cancelled: Arc::clone(&a_cancelled),
        published: Arc::default(),
    };
    let through_proxy = PgStoreOptions::new(proxied)
        .with_schema(schema.clone())
        .with_max_connections(4)
        .with_acquire_timeout(Duration::from_secs(2));
    let store_a = PgStore::connect(through_proxy).await.unwrap();
    let relay_a = Relay::new(store_a, sink_a, opts("relay-a")).unwrap();
    let (stop_a, stopped_a) = tokio::sync::oneshot::channel::<()>();
    let a = tokio::spawn(relay_a.run(async {
        let _ = stopped_a.await;
    }));

    // A published the batch's first event and waits at the gate: cut its
    // database connection (the broker, here the sink, still answers).
    let got = |r: &Received| r.lock().unwrap().clone();
    until("A's first publish", Duration::from_secs(30), || {
        !got(&received).is_empty()
    })
    .await;
    proxy.refuse();
    assert_eq!(got(&received), vec![("a", ids[0])]);

    // The key's later events, committed while A is cut off.
    ids.extend(enqueue(events(3..5)).await);

    // Relay B (direct) takes the shard once the lease ran out in the
    // database and delivers the key's events from the stored position.
    let sink_b = GatedSink {
        relay: "b",
        received: Arc::clone(&received),
        gate: None,
        cancelled: Arc::default(),
        published: Arc::default(),
    };
    let relay_b = Relay::new(PgStore::connect(direct.clone()).await.unwrap(), sink_b, {
        opts("relay-b")
    })
    .unwrap();
    let (stop_b, stopped_b) = tokio::sync::oneshot::channel::<()>();
    let b = tokio::spawn(relay_b.run(async {
        let _ = stopped_b.await;
    }));
    let last = ids[4];
    until(
        "B's delivery of the key's last event",
        Duration::from_secs(60),
        || got(&received).contains(&("b", last)),
    )
    .await;

    // A stopped its delivery by its own clock, before B could claim.
    assert!(
        a_cancelled.load(Ordering::SeqCst),
        "A's delivery still runs after its lease ended: {:?}",
        got(&received)
    );
    // Open A's gate: a delivery still running would publish stale copies
    // now. Then stop A (while still cut off) and B.
    gate.add_permits(100);
    tokio::task::yield_now().await;
    stop_a.send(()).unwrap();
    let summary_a = tokio::time::timeout(Duration::from_secs(60), a)
        .await
        .expect("relay A did not stop")
        .unwrap();
    stop_b.send(()).unwrap();
    let summary_b = b.await.unwrap();

    let received = got(&received);
    // Nothing of A's batch was published past its first event.
    let from_a: Vec<EventId> = received
        .iter()
        .filter(|(r, _)| *r == "a")
        .map(|(_, id)| *id)
        .collect();
    assert_eq!(
        from_a,
        vec![ids[0]],
        "A published past its lease: {received:?}"
    );
    // Per key: never an older event after a newer one was received.
    let seq: HashMap<EventId, usize> = ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let mut newest = 0;
    for (relay, id) in &received {
        let s = seq[id];
        assert!(
            s >= newest,
            "stale copy: event #{s} from relay {relay} after #{newest}: {received:?}"
        );
        newest = s;
    }
    // B delivered every event of the key, in order.
    let from_b: Vec<EventId> = received
        .iter()
        .filter(|(r, _)| *r == "b")
        .map(|(_, id)| *id)
        .collect();
    assert_eq!(from_b, ids, "B delivers the key from the stored position");
    assert_eq!(summary_a.deliveries_expired, 1, "{summary_a:?}");
    assert_eq!(summary_a.delivered, 0, "{summary_a:?}");
    assert_eq!(summary_b.delivered, 5, "{summary_b:?}");

    proxy.restore();
    outbox_worker::postgres::sqlx::raw_sql(&format!(
        "DROP SCHEMA IF EXISTS {} CASCADE",
        schema.quoted()
    ))
    .execute(admin.pool())
    .await
    .unwrap();
}
