//! The relay (`outbox-worker`) over the event-log store against a real
//! PostgreSQL: retries and dead letters keep per-key order, two relays on
//! two shards deliver everything once, the wake-up probe finds a commit
//! long before the poll interval.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "../crates/outbox-postgres/tests/log_support/mod.rs"]
#[allow(unused_imports)]
mod log_support;

use log_support::LogDb;
use outbox_core::{
    DeadLetterQuery, DeadLetterStore, EventId, HandlerError, Jitter, NewEvent, RelayId,
    RetryPolicy, ShardSpec, Store,
};
use outbox_postgres::PgLogStore;
use outbox_worker::{HandlerRegistry, Relay, RelayOptions};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn ev(key: &str, n: usize, behaviour: &str) -> NewEvent {
    NewEvent::new(
        "log.test",
        "log",
        format!("{key}/{n}/{behaviour}").into_bytes(),
    )
    .with_key(key)
}

fn quick_retries() -> RetryPolicy {
    RetryPolicy::new(
        Duration::from_millis(20),
        Duration::from_millis(100),
        4,
        Jitter::None,
    )
    .unwrap()
}

/// Successful deliveries, in order, and how often each payload was tried.
#[derive(Default)]
struct Seen {
    delivered: Vec<(EventId, String)>,
    tries: HashMap<String, u32>,
}

/// A handler that fails `flaky` payloads on their first try and always
/// fails `poison` payloads.
fn handlers(seen: Arc<Mutex<Seen>>) -> HandlerRegistry {
    HandlerRegistry::new().with_handler("log.test", move |event| {
        let seen = Arc::clone(&seen);
        async move {
            let payload = String::from_utf8(event.payload.clone()).unwrap();
            let mut s = seen.lock().unwrap();
            let tries = s.tries.entry(payload.clone()).or_default();
            *tries += 1;
            if payload.ends_with("/poison") {
                return Err(HandlerError::permanent("poison"));
            }
            if payload.ends_with("/flaky") && *tries == 1 {
                return Err(HandlerError::retryable("flaky"));
            }
            s.delivered
                .push((event.id, event.key.clone().unwrap_or_default()));
            Ok(())
        }
    })
}

fn options(relay: &str) -> RelayOptions {
    RelayOptions::default()
        .with_relay_id(RelayId::new(relay))
        .with_retry(quick_retries())
        .with_batch_size(50)
        .with_poll_interval(Duration::from_millis(200))
}

/// Retries and a poison event: every other event is delivered once, each
/// key in enqueue order; the poison event is dead-lettered and its key
/// continues (policy `continue`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_keeps_per_key_order_through_retries_and_dead_letters() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let mut want: HashMap<String, Vec<EventId>> = HashMap::new();
    let mut poison = Vec::new();
    for round in 0..10 {
        let mut events = Vec::new();
        for k in 0..8 {
            let key = format!("key-{k}");
            let behaviour = match (round + k) % 7 {
                0 => "flaky",
                3 if round == 4 => "poison",
                _ => "ok",
            };
            let e = ev(&key, round, behaviour);
            if behaviour == "poison" {
                poison.push(e.id());
            } else {
                want.entry(key).or_default().push(e.id());
            }
            events.push(e);
        }
        db.enqueue(events).await;
    }
    let seen = Arc::new(Mutex::new(Seen::default()));
    let relay = Relay::new(
        store.clone(),
        handlers(Arc::clone(&seen)),
        options("relay-a"),
    )
    .unwrap();
    tokio::time::timeout(Duration::from_secs(60), relay.run_until_idle())
        .await
        .expect("relay did not drain the outbox");

    let (got, retried) = {
        let seen = seen.lock().unwrap();
        let mut got: HashMap<String, Vec<EventId>> = HashMap::new();
        for (id, key) in &seen.delivered {
            got.entry(key.clone()).or_default().push(*id);
        }
        (got, seen.tries.values().any(|n| *n == 2))
    };
    assert_eq!(got, want, "each key delivered once, in order");
    assert!(retried, "no retry happened");
    let dead: Vec<EventId> = store
        .list_dead(&DeadLetterQuery::default())
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.event.id)
        .collect();
    let mut poison_sorted = poison.clone();
    poison_sorted.sort();
    assert_eq!(dead, poison_sorted);
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.in_flight), (0, 0));
}

/// Two relays, one per shard (each its own store, as two processes), and
/// producers still committing while they run: everything is delivered
/// exactly once, each key in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_on_two_shards_deliver_everything_once() {
    let db = LogDb::with_pool_size(10).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut relays = Vec::new();
    for shard in 0..2u32 {
        let store = db.store().await;
        let relay = Relay::new(
            store,
            handlers(Arc::clone(&seen)),
            options(&format!("relay-{shard}")).with_shard(ShardSpec::new(shard, 2).unwrap()),
        )
        .unwrap();
        let mut stop = stop_rx.clone();
        relays.push(tokio::spawn(async move {
            relay
                .run(async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await
        }));
    }
    let mut want: HashMap<String, Vec<EventId>> = HashMap::new();
    for round in 0..40 {
        let events: Vec<NewEvent> = (0..10)
            .map(|k| {
                ev(
                    &format!("key-{k}"),
                    round,
                    if round % 9 == k { "flaky" } else { "ok" },
                )
            })
            .collect();
        for e in &events {
            want.entry(e.key().unwrap().to_owned())
                .or_default()
                .push(e.id());
        }
        db.enqueue(events).await;
        if round % 5 == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let total: usize = want.values().map(Vec::len).sum();
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.lock().unwrap().delivered.len() < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_tx.send(true).unwrap();
    for r in relays {
        r.await.unwrap();
    }
    let seen = seen.lock().unwrap();
    let ids: HashSet<EventId> = seen.delivered.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids.len(), seen.delivered.len(), "duplicates");
    let mut got: HashMap<String, Vec<EventId>> = HashMap::new();
    for (id, key) in &seen.delivered {
        got.entry(key.clone()).or_default().push(*id);
    }
    assert_eq!(got, want);
}

/// With a 10 s poll interval, an event committed while the relay is idle
/// is delivered long before the next poll: the store's wake-up probe sees
/// the commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_wakes_up_on_a_commit() {
    let db = LogDb::new().await;
    let store: PgLogStore = db.store().await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let relay = Relay::new(
        store,
        handlers(Arc::clone(&seen)),
        options("relay-a").with_poll_interval(Duration::from_secs(10)),
    )
    .unwrap();
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = stop_rx.wait_for(|s| *s).await;
            })
            .await
    });
    // Let the relay go idle (its own backoff and the probe's both grow).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let id = db.enqueue(vec![ev("k", 0, "ok")]).await[0];
    let committed = Instant::now();
    let deadline = committed + Duration::from_secs(5);
    while !seen.lock().unwrap().delivered.iter().any(|(d, _)| *d == id) {
        assert!(
            Instant::now() < deadline,
            "not delivered within 5 s of the commit"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!("commit -> handler while idle: {:?}", committed.elapsed());
    stop_tx.send(true).unwrap();
    task.await.unwrap();
}
