//! `outbox-relay run --metrics-addr`: `/healthz` and `/readyz` on the
//! metrics listener follow a real sink outage. The relay publishes to NATS
//! JetStream through a TCP proxy; while events keep being committed the
//! proxy refuses connections, `/readyz` turns 503 naming the open sink and
//! its error (`/healthz` stays 200, `outbox_sink_state` shows it), and once
//! the proxy forwards again `/readyz` is 200 and the stream holds every
//! committed event.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod support;

use outbox_core::{DeadLetterQuery, DeadLetterStore, EventId, NewEvent, Store};
use outbox_sqlite::{enqueue_batch, SqliteStore};
use outbox_testkit::nats::NatsFixture;
use outbox_testkit::process::ChildGuard;
use outbox_testkit::proxy::TcpProxy;
use std::collections::HashSet;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{free_addr, get, relay};

/// Polls `path` until it answers `status` (bounded); returns the body.
async fn wait_for(addr: &str, path: &str, status: u16, bound: Duration) -> String {
    let deadline = Instant::now() + bound;
    let mut last = None;
    loop {
        if let Some((s, body)) = get(addr, path) {
            if s == status {
                return body;
            }
            last = Some((s, body));
        }
        assert!(
            Instant::now() < deadline,
            "{path} did not answer {status} within {bound:?}; last answer: {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `/readyz` once it answers 503 *because of the sink* (breaker open or
/// half-open); a 503 of a relay still starting up (store `starting`, sink
/// not tried yet) is waited out.
async fn wait_for_sink_down(addr: &str, bound: Duration) -> serde_json::Value {
    let deadline = Instant::now() + bound;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let body: serde_json::Value =
            serde_json::from_str(&wait_for(addr, "/readyz", 503, left).await).unwrap();
        if ["open", "half_open"].contains(&body["sink"]["state"].as_str().unwrap_or("")) {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz did not name the sink down within {bound:?}; last answer: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Commits events `from..from + n` of `topic` in one transaction.
async fn commit(
    store: &SqliteStore,
    topic: &str,
    committed: &Mutex<HashSet<EventId>>,
    from: usize,
    n: usize,
) {
    let events: Vec<NewEvent> = (from..from + n)
        .map(|i| {
            NewEvent::new("health.test", topic, format!("{{\"n\":{i}}}").into_bytes())
                .with_key(format!("k{}", i % 4))
        })
        .collect();
    let mut tx = store.pool().begin().await.unwrap();
    let ids = enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    committed.lock().unwrap().extend(ids);
}

fn gauge(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A migrated SQLite outbox in a temporary directory: (dir, URL, store).
async fn sqlite_outbox() -> (tempfile::TempDir, String, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    (dir, url, store)
}

/// `outbox-relay run` from the SQLite outbox at `url` to NATS through
/// `proxy`, serving health and metrics on `addr`.
fn spawn_relay(
    url: &str,
    addr: &str,
    proxy: &TcpProxy,
    nats: &NatsFixture,
    topic: &str,
) -> ChildGuard {
    let subject = nats.subject(topic);
    let prefix = subject.strip_suffix(&format!(".{topic}")).unwrap();
    ChildGuard::new(
        relay(&["run", "--store", url, "--poll-interval-ms", "50"])
            .args(["--metrics-addr", addr])
            .args(["--sink", &format!("nats://{}", proxy.addr())])
            .args(["--nats-subject-prefix", prefix])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Waits (bounded) until the relay has nothing pending or in flight, then
/// asserts the stream holds every committed event and nothing is dead.
async fn assert_all_delivered(
    store: &SqliteStore,
    nats: &NatsFixture,
    committed: &Mutex<HashSet<EventId>>,
    bound: Duration,
) {
    let deadline = Instant::now() + bound;
    loop {
        let stats = store.stats().await.unwrap();
        if stats.pending == 0 && stats.in_flight == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the relay did not drain: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let committed = committed.lock().unwrap().clone();
    let received = nats.drain(committed.len()).await;
    let ids: HashSet<EventId> = received.iter().filter_map(|m| m.event_id()).collect();
    assert_eq!(ids, committed, "the stream holds every committed event");
    let dead = store.list_dead(&DeadLetterQuery::default()).await.unwrap();
    assert!(dead.is_empty(), "dead letters: {dead:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_a_sink_outage() {
    let nats = NatsFixture::new().await;
    let proxy = TcpProxy::start(nats.broker_addr()).await;
    let topic = nats.topic();
    let (_dir, url, store) = sqlite_outbox().await;
    let committed: Arc<Mutex<HashSet<EventId>>> = Arc::default();
    commit(&store, &topic, &committed, 0, 20).await;

    let addr = free_addr();
    let mut relay = spawn_relay(&url, &addr, &proxy, &nats, &topic);

    let bound = Duration::from_secs(30);
    assert_eq!(wait_for(&addr, "/healthz", 200, bound).await, "ok\n");
    let ready: serde_json::Value =
        serde_json::from_str(&wait_for(&addr, "/readyz", 200, bound).await).unwrap();
    assert_eq!(ready["sink"]["state"], "closed", "{ready}");
    assert_eq!(ready["store"]["state"], "ok", "{ready}");

    // Events keep being committed through the outage (bounded: 20 ms apart,
    // at most 2,000 batches).
    let stop = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn({
        let (stop, store, topic, committed) = (
            stop.clone(),
            store.clone(),
            topic.clone(),
            committed.clone(),
        );
        async move {
            let mut n = 20;
            for _ in 0..2_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                commit(&store, &topic, &committed, n, 5).await;
                n += 5;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });

    // The broker goes out of reach twice (connections refused, then
    // accepted and closed at once): each time the breaker opens and
    // /readyz says so, and closes again once the broker is back.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (i, cut) in [false, true].into_iter().enumerate() {
        if cut {
            proxy.cut();
        } else {
            proxy.refuse();
        }
        let down = wait_for_sink_down(&addr, Duration::from_secs(15)).await;
        eprintln!("/readyz during the outage: {down}");
        assert!(down["sink"]["last_error"]["code"].is_string(), "{down}");
        assert!(
            down["sink"]["outages"].as_u64().unwrap() > i as u64,
            "{down}"
        );
        assert_eq!(down["store"]["state"], "ok", "{down}");
        assert_eq!(get(&addr, "/healthz").unwrap().0, 200);
        let (_, metrics) = get(&addr, "/metrics").unwrap();
        assert!(
            gauge(&metrics, "outbox_sink_state").unwrap() > 0.0,
            "{metrics}"
        );

        // Ride out a short outage, then bring the broker back.
        tokio::time::sleep(Duration::from_secs(2)).await;
        proxy.restore();
        let up: serde_json::Value =
            serde_json::from_str(&wait_for(&addr, "/readyz", 200, bound).await).unwrap();
        assert_eq!(up["sink"]["state"], "closed", "{up}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stop.store(true, Ordering::Relaxed);
    producer.await.unwrap();

    // Everything committed reaches the stream, nothing is dead-lettered.
    assert_all_delivered(&store, &nats, &committed, Duration::from_secs(60)).await;

    support::stop(&mut relay);
    nats.cleanup().await;
}

/// A relay started while the broker refuses connections does not exit: it
/// starts with its breaker open (`/readyz` 503 naming the sink, `/healthz`
/// 200), and once the broker is reachable it delivers everything committed
/// meanwhile, with no attempt counted and nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_started_during_a_broker_outage_waits_for_it() {
    let nats = NatsFixture::new().await;
    let proxy = TcpProxy::start(nats.broker_addr()).await;
    proxy.refuse();
    let topic = nats.topic();
    let (_dir, url, store) = sqlite_outbox().await;
    let committed: Arc<Mutex<HashSet<EventId>>> = Arc::default();
    commit(&store, &topic, &committed, 0, 50).await;

    let addr = free_addr();
    let mut relay = spawn_relay(&url, &addr, &proxy, &nats, &topic);
    let bound = Duration::from_secs(30);
    assert_eq!(wait_for(&addr, "/healthz", 200, bound).await, "ok\n");
    wait_for_sink_down(&addr, bound).await;
    // Still running a few probes later, and nothing was attempted.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        relay.child().try_wait().unwrap().is_none(),
        "the relay exited while the broker was down"
    );
    // `status --relay` shows the running relay's sink state.
    let status = |expect: &[&str]| {
        let out = support::relay(&["status", "--store", &url, "--relay", &addr])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{stdout}");
        let line = stdout
            .lines()
            .find(|l| l.starts_with("relay "))
            .unwrap_or("");
        assert!(
            expect.iter().all(|e| line.contains(e)),
            "expected {expect:?} in: {stdout}"
        );
    };
    // Open, or half-open while a probe is out.
    status(&[": not ready; sink: ", "open, ", "outage(s)", "store: ok"]);
    commit(&store, &topic, &committed, 50, 50).await;

    proxy.restore();
    let up: serde_json::Value =
        serde_json::from_str(&wait_for(&addr, "/readyz", 200, bound).await).unwrap();
    assert_eq!(up["sink"]["state"], "closed", "{up}");
    status(&[": ready; sink: closed; store: ok"]);
    assert_all_delivered(&store, &nats, &committed, Duration::from_secs(30)).await;

    support::stop(&mut relay);
    nats.cleanup().await;
}

/// The store's side: the relay reads PostgreSQL through a TCP proxy; when
/// the proxy refuses connections the relay's claims fail (or wait for a
/// connection) and `/readyz` turns 503 naming the store, with no password
/// in the body; once the proxy forwards again `/readyz` is 200 and events
/// committed during the outage are delivered.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_a_store_outage() {
    use outbox_postgres::{sqlx, Ident, PgOutbox};
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = sqlx::PgPool::connect(&url).await.unwrap_or_else(|e| {
        panic!("PostgreSQL is not reachable ({e}); start it or set DATABASE_URL")
    });
    let schema = format!(
        "outbox_ready_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let proxy = TcpProxy::start(outbox_testkit::broker::first_socket_addr(&url, 5432)).await;
    // The same URL with the proxy's address as host:port.
    let (scheme, rest) = url.split_once("://").unwrap();
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let user = authority
        .rsplit_once('@')
        .map_or(String::new(), |(u, _)| format!("{u}@"));
    let proxied = format!("{scheme}://{user}{}/{path}", proxy.addr());

    let relay_cmd = |args: &[&str]| {
        let mut cmd = relay(args);
        cmd.args(["--store", &proxied, "--pg-schema", &schema]);
        cmd
    };
    let out = relay_cmd(&["migrate"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let outbox = PgOutbox::new(
        Ident::new(schema.clone()).unwrap(),
        Ident::new("events").unwrap(),
    )
    .unwrap();
    let commit = |i: usize| {
        let (pool, outbox) = (pool.clone(), outbox.clone());
        async move {
            let mut tx = pool.begin().await.unwrap();
            let id = outbox
                .enqueue(
                    &mut tx,
                    NewEvent::new("ready.test", "t", format!("{i}").into_bytes()),
                )
                .await
                .unwrap();
            tx.commit().await.unwrap();
            id
        }
    };
    let mut committed = HashSet::new();
    for i in 0..10 {
        committed.insert(commit(i).await);
    }

    let addr = free_addr();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    let mut relay = ChildGuard::new(
        relay_cmd(&["run", "--poll-interval-ms", "100", "--metrics-addr", &addr])
            .args(["--sink", &format!("jsonl:{}", file.display())])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let ready: serde_json::Value =
        serde_json::from_str(&wait_for(&addr, "/readyz", 200, Duration::from_secs(30)).await)
            .unwrap();
    assert_eq!(ready["store"]["state"], "ok", "{ready}");

    proxy.refuse();
    for i in 10..20 {
        committed.insert(commit(i).await);
    }
    let down: serde_json::Value =
        serde_json::from_str(&wait_for(&addr, "/readyz", 503, Duration::from_secs(40)).await)
            .unwrap();
    eprintln!("/readyz during the store outage: {down}");
    assert!(
        ["error", "no_answer"].contains(&down["store"]["state"].as_str().unwrap()),
        "{down}"
    );
    assert_eq!(down["sink"]["state"], "closed", "{down}");
    assert_eq!(get(&addr, "/healthz").unwrap().0, 200);

    proxy.restore();
    wait_for(&addr, "/readyz", 200, Duration::from_secs(60)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let delivered: HashSet<EventId> = loop {
        let ids: HashSet<EventId> = std::fs::read_to_string(&file)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|v| v["id"].as_str().unwrap().parse().unwrap())
            .collect();
        if ids.len() >= committed.len() || Instant::now() > deadline {
            break ids;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(delivered, committed);
    support::stop(&mut relay);
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}
