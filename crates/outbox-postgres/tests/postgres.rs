//! PostgreSQL-specific behaviour beyond the conformance suite: commit order,
//! migrations under concurrency, names, secrets, wake-ups, retention, shards.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::{database_url, fresh_schema, pool, req, SchemaGuard, TestDb};
use outbox_core::ident::InvalidIdentifier;
use outbox_core::{
    Claim, ClaimRequest, EventId, FencingToken, NewEvent, Resolution, Settlement, ShardSpec, Stats,
    Store,
};
use outbox_postgres::{Ident, PgMode, PgOutbox, PgStore, PgStoreOptions, StoreError, MIGRATIONS};
use outbox_testkit::logs::LogCapture;
use sqlx::{Connection, PgConnection, Row};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

fn ev(n: usize) -> NewEvent {
    NewEvent::new("test.event", "pg", format!("p{n}").into_bytes())
}

fn delivered(ids: &[EventId]) -> Settlement {
    ids.iter().fold(Settlement::new(), |s, id| {
        s.with(*id, Resolution::Delivered)
    })
}

/// Enqueues `event` in the caller's transaction `tx` (left open).
async fn enqueue_in(db: &TestDb, tx: &mut PgConnection, event: NewEvent) -> EventId {
    db.outbox.enqueue(tx, event).await.unwrap()
}

/// The ids of a claim's events, in order.
fn ids(claim: &Claim) -> Vec<EventId> {
    claim.events.iter().map(|e| e.id).collect()
}

async fn deliver(store: &PgStore, token: FencingToken, ids: &[EventId]) -> u64 {
    let report = store.settle(token, &delivered(ids)).await.unwrap();
    assert!(report.rejected.is_empty(), "{report:?}");
    report.applied
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_enqueue_is_never_claimed() {
    let db = TestDb::new().await;
    let store = db.store().await;
    let mut tx = db.pool.begin().await.unwrap();
    let gone = enqueue_in(&db, &mut tx, ev(0)).await;
    let gone_batch = db
        .outbox
        .enqueue_batch(&mut tx, vec![ev(1), ev(2)])
        .await
        .unwrap();
    // Not visible to a claim while uncommitted ...
    assert!(store.claim(&req("r", 10)).await.unwrap().events.is_empty());
    tx.rollback().await.unwrap();
    // ... nor after the rollback.
    assert!(store.claim(&req("r", 10)).await.unwrap().events.is_empty());
    let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", db.events()))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        n, 0,
        "rolled back rows {gone} {gone_batch:?} are in the table"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_committed_after_a_later_one_is_still_claimed() {
    let db = TestDb::new().await;
    let store = db.store().await;
    // tx1 enqueues first (smaller, time-ordered id) but commits last.
    let mut tx1 = db.pool.begin().await.unwrap();
    let early = enqueue_in(&db, &mut tx1, ev(0).with_key("k1")).await;
    let mut tx2 = db.pool.begin().await.unwrap();
    let late = enqueue_in(&db, &mut tx2, ev(1).with_key("k2")).await;
    assert!(early < late);
    tx2.commit().await.unwrap();

    let c = store.claim(&req("r", 10)).await.unwrap();
    assert_eq!(ids(&c), vec![late]);
    assert_eq!(deliver(&store, c.token, &[late]).await, 1);

    tx1.commit().await.unwrap();
    let c = store.claim(&req("r", 10)).await.unwrap();
    assert_eq!(ids(&c), vec![early]);
    assert_eq!(deliver(&store, c.token, &[early]).await, 1);
}

/// Claims walk from a lower bound of the pending rows' `seq` that moves up
/// while events are delivered. An event inserted early by a transaction
/// that stays open across several bound refreshes is still claimed once it
/// commits (within about two refreshes), and nothing else is held back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_of_a_long_transaction_is_claimed_once_it_commits() {
    let db = TestDb::new().await;
    let store = db.store().await;
    let mut long = db.pool.begin().await.unwrap();
    let early = enqueue_in(&db, &mut long, ev(0).with_key("k1")).await;
    // Later events commit and are delivered over 3 s of claims.
    for i in 1..=6 {
        let mut tx = db.pool.begin().await.unwrap();
        let id = enqueue_in(&db, &mut tx, ev(i).with_key("k2")).await;
        tx.commit().await.unwrap();
        let c = store.claim(&req("r", 10)).await.unwrap();
        assert_eq!(ids(&c), vec![id]);
        assert_eq!(deliver(&store, c.token, &[id]).await, 1);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    long.commit().await.unwrap();
    let committed = Instant::now();
    loop {
        let c = store.claim(&req("r", 10)).await.unwrap();
        if !c.events.is_empty() {
            assert_eq!(ids(&c), vec![early]);
            assert_eq!(deliver(&store, c.token, &[early]).await, 1);
            break;
        }
        assert!(
            committed.elapsed() < Duration::from_secs(5),
            "the long transaction's event was not claimed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_apply_once() {
    let schema = fresh_schema();
    let _guard = SchemaGuard(schema.clone());
    let outbox =
        PgOutbox::in_mode(schema.clone(), Ident::new("events").unwrap(), PgMode::Queue).unwrap();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let outbox = outbox.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = PgConnection::connect(&database_url()).await.unwrap();
            outbox.migrate(&mut conn).await
        }));
    }
    let mut applied = Vec::new();
    for t in tasks {
        applied.push(t.await.unwrap().expect("every concurrent migrate succeeds"));
    }
    let all_versions: Vec<i32> = MIGRATIONS.iter().map(|m| m.version).collect();
    assert_eq!(
        applied.iter().filter(|a| **a == all_versions).count(),
        1,
        "exactly one task applies the migrations: {applied:?}"
    );
    assert_eq!(applied.iter().filter(|a| a.is_empty()).count(), 7);

    let pool = pool(2).await;
    let history: Vec<i32> = sqlx::query_scalar(&format!(
        "SELECT version FROM {}.\"events_migrations\" ORDER BY version",
        schema.quoted()
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(history, all_versions);
    // The application's own sqlx history table is untouched.
    let sqlx_table: Option<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = $1 AND table_name = '_sqlx_migrations'",
    )
    .bind(schema.as_str())
    .fetch_optional(&pool)
    .await
    .unwrap();
    assert_eq!(sqlx_table, None);
    // Migrating again is a no-op.
    let mut conn = pool.acquire().await.unwrap();
    assert!(outbox.migrate(&mut conn).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_names_are_rejected_and_nothing_is_dropped() {
    let db = TestDb::new().await;
    // A table the hostile name tries to drop.
    sqlx::query(&format!("CREATE TABLE {}.y (n int)", db.schema.quoted()))
        .execute(&db.pool)
        .await
        .unwrap();
    let hostile = format!("x\"; DROP TABLE {}.y; --", db.schema);
    let err = Ident::new(hostile.clone()).unwrap_err();
    assert_eq!(err, InvalidIdentifier::InvalidCharacters(hostile));
    assert!(err
        .to_string()
        .contains("use only ASCII letters, digits and '_'"));
    for bad in ["", "1st", "a b", "Robert'); DROP TABLE students;--"] {
        assert!(Ident::new(bad).is_err(), "{bad:?} accepted");
    }
    // Derived names must fit too: a 60-byte table has no room for "_migrations".
    let long = Ident::new("t".repeat(60)).unwrap();
    assert!(matches!(
        PgOutbox::new(db.schema.clone(), long.clone()),
        Err(InvalidIdentifier::TooLong { .. })
    ));
    let opts = db.options().with_table(long);
    assert!(matches!(
        PgStore::from_pool(db.pool.clone(), opts).await,
        Err(StoreError::InvalidName(InvalidIdentifier::TooLong { .. }))
    ));
    let y: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}.y", db.schema.quoted()))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(y, 0, "table y still exists");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_never_appears_in_debug_errors_or_logs() {
    const PASSWORD: &str = "hunter2-Sup3rSecret";
    let (captured, _default) = LogCapture::start(tracing::Level::TRACE);

    let db = TestDb::new().await;
    // The local server trusts loopback, so any password is accepted.
    let url = database_url().replacen("://postgres@", &format!("://postgres:{PASSWORD}@"), 1);
    assert!(
        url.contains(PASSWORD),
        "DATABASE_URL must look like postgres://postgres@host/db"
    );
    let options = db.options();
    let options = PgStoreOptions::new(url.clone())
        .with_schema(options.schema().clone())
        .with_table(options.table().clone());
    let shown = format!("{options:?}");
    assert!(!shown.contains(PASSWORD), "{shown}");
    assert!(shown.contains("postgres:***@"), "{shown}");

    let store = PgStore::connect(options.clone().with_auto_migrate(true))
        .await
        .unwrap();
    let shown = format!("{store:?} {:?}", store.outbox());
    assert!(!shown.contains(PASSWORD), "{shown}");
    let mut tx = store.pool().begin().await.unwrap();
    store.outbox().enqueue(&mut tx, ev(0)).await.unwrap();
    tx.commit().await.unwrap();
    let c = store.claim(&req("r", 10)).await.unwrap();
    assert_eq!(c.events.len(), 1);

    // A bad URL: the error names the problem, never the password.
    let bad = url.replace(":5432", ":notaport");
    let err = PgStore::connect(PgStoreOptions::new(bad))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidUrl(_)), "{err:?}");
    assert!(!err.to_string().contains(PASSWORD), "{err}");
    // A server that is not there: the error does not carry the URL either.
    let down = url.replace(":5432", ":1");
    let err =
        PgStore::connect(PgStoreOptions::new(down).with_connect_timeout(Duration::from_secs(1)))
            .await
            .unwrap_err();
    assert!(!format!("{err} {err:?}").contains(PASSWORD), "{err:?}");
    drop(store);

    let logs = captured.text();
    assert!(!logs.contains(PASSWORD), "password in logs:\n{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_wakes_a_listening_store_and_can_be_turned_off() {
    let db = TestDb::new().await;
    let store = PgStore::from_pool(db.pool.clone(), db.options())
        .await
        .unwrap();
    // The listener fires once when it starts listening; wait for that first,
    // so the next wake-up can only come from our NOTIFY.
    tokio::time::timeout(Duration::from_secs(30), store.wakeup())
        .await
        .expect("listener never started");

    let quiet = db.outbox.clone().with_notify(false);
    let mut tx = db.pool.begin().await.unwrap();
    quiet.enqueue(&mut tx, ev(0)).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let loud = db.outbox.clone().with_notify(true);
    let id = loud.enqueue(&mut tx, ev(1)).await.unwrap();
    tx.commit().await.unwrap();
    // The notification may arrive before anyone waits: it is kept.
    tokio::time::sleep(Duration::from_millis(200)).await;
    tokio::time::timeout(Duration::from_secs(30), store.wakeup())
        .await
        .expect("no wake-up after a notifying enqueue");
    let c = store.claim(&req("r", 10)).await.unwrap();
    assert_eq!(c.events.len(), 2);
    assert!(c.events.iter().any(|e| e.id == id));

    // A store with listen off never wakes up (poll only).
    let polling = db.store().await;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), polling.wakeup())
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_keeps_delivered_rows_out_of_claims_until_purged() {
    let db = TestDb::new().await;
    let store = PgStore::from_pool(
        db.pool.clone(),
        db.options()
            .with_listen(false)
            // A long interval: this test drives the purge by hand.
            .with_retention(Some(Duration::ZERO), 2, Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let ids = db
        .outbox
        .enqueue_batch(&mut tx, (0..5).map(ev))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let c = store.claim(&req("r", 10)).await.unwrap();
    assert_eq!(deliver(&store, c.token, &ids).await, 5);
    let kept: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE delivered_at IS NOT NULL AND lease_token IS NULL",
        db.events()
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    // The background purge may already have taken its first batch.
    assert!((3..=5).contains(&kept), "{kept} delivered rows kept");
    assert!(store.claim(&req("r", 10)).await.unwrap().events.is_empty());
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.in_flight, s.dead), (0, 0, 0));
    // Settling again reports the ids as fenced (already delivered).
    let again = store.settle(c.token, &delivered(&ids)).await.unwrap();
    assert_eq!((again.applied, again.fenced), (0, ids.clone()));
    // Bounded batches of 2 until empty.
    let mut purged = 0;
    loop {
        let n = store.purge_delivered(2).await.unwrap();
        assert!(n <= 2);
        if n == 0 {
            break;
        }
        purged += n;
    }
    assert_eq!(purged, u64::try_from(kept).unwrap());
    let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", db.events()))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_by_shard_and_stored_key_hash() {
    let db = TestDb::new().await;
    let store = db.store().await;
    let events: Vec<NewEvent> = (0..40)
        .map(|i| ev(i).with_key(format!("key-{i}")))
        .collect();
    let expected_hash: Vec<(uuid::Uuid, i64)> = events
        .iter()
        .map(|e| (e.id().as_uuid(), i64::from(e.key_hash())))
        .collect();
    let mut expected = [0u64; 4];
    for e in &events {
        expected[(e.key_hash() % 4) as usize] += 1;
    }
    let mut tx = db.pool.begin().await.unwrap();
    db.outbox.enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();

    for (id, hash) in expected_hash {
        let row = sqlx::query(&format!(
            "SELECT key_hash FROM {} WHERE id = $1",
            db.events()
        ))
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(row.get::<i64, _>(0), hash);
    }
    let shard1 = ClaimRequest {
        shard: ShardSpec::new(1, 4).unwrap(),
        ..req("r1", 100)
    };
    let c = store.claim(&shard1).await.unwrap();
    assert_eq!(c.events.len() as u64, expected[1]);
    let by_shard = store.stats_by_shard(4).await.unwrap();
    assert_eq!(by_shard.len(), 4);
    for s in &by_shard {
        let i = s.shard.index() as usize;
        assert_eq!(s.shard.total(), 4);
        if i == 1 {
            assert_eq!((s.stats.pending, s.stats.in_flight), (0, expected[1]));
        } else {
            assert_eq!((s.stats.pending, s.stats.in_flight), (expected[i], 0));
        }
    }
    let total: u64 = by_shard
        .iter()
        .map(|s| s.stats.pending + s.stats.in_flight)
        .sum();
    assert_eq!(total, 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_uses_the_database_clock_and_is_recorded() {
    let db = TestDb::new().await;
    let store = db.store().await;
    let mut tx = db.pool.begin().await.unwrap();
    let id = enqueue_in(&db, &mut tx, ev(0)).await;
    tx.commit().await.unwrap();
    let c = store.claim(&req("relay-x", 1)).await.unwrap();
    let row = sqlx::query(&format!(
        "SELECT locked_until, next_attempt_at, locked_by, lease_token, \
                locked_until - now() > interval '590 seconds' \
         FROM {} WHERE id = $1",
        db.events()
    ))
    .bind(id.as_uuid())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let locked_until: chrono::DateTime<chrono::Utc> = row.get(0);
    assert_eq!(locked_until, c.lease_until);
    assert_eq!(
        row.get::<chrono::DateTime<chrono::Utc>, _>(1),
        c.lease_until
    );
    assert_eq!(row.get::<String, _>(2), "relay-x");
    assert_eq!(row.get::<uuid::Uuid, _>(3), c.token.as_uuid());
    assert!(
        row.get::<bool, _>(4),
        "lease is now() + 600 s on the database clock"
    );
}

/// The free functions write to the default `outbox.events`; all of it runs
/// inside one transaction that is rolled back, so nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_functions_use_the_default_outbox() {
    let pool = pool(2).await;
    let mut tx = pool.begin().await.unwrap();
    PgOutbox::default().migrate(&mut tx).await.unwrap();
    let one = outbox_postgres::enqueue(&mut tx, ev(0)).await.unwrap();
    let more = outbox_postgres::enqueue_batch(&mut tx, vec![ev(1), ev(2)])
        .await
        .unwrap();
    let ids: BTreeSet<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM outbox.events")
        .fetch_all(&mut *tx)
        .await
        .unwrap()
        .into_iter()
        .collect();
    for id in std::iter::once(one).chain(more) {
        assert!(ids.contains(&id.as_uuid()));
    }
    tx.rollback().await.unwrap();
}

/// `sslmode=require` connects over TLS (rustls): the server's `pg_stat_ssl`
/// shows the store's own connection as encrypted. The local PostgreSQL has
/// TLS on (Debian's default snakeoil certificate); `require` does not verify it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_connects_over_tls() {
    let schema = fresh_schema();
    let _guard = SchemaGuard(schema.clone());
    let url = database_url();
    let sep = if url.contains('?') { '&' } else { '?' };
    let store = PgStore::connect(
        PgStoreOptions::new(format!("{url}{sep}sslmode=require")).with_schema(schema.clone()),
    )
    .await
    .expect("TLS connection with sslmode=require");
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(ssl, "the store's connection is not encrypted");
    store.migrate().await.unwrap();
    assert_eq!(store.stats().await.unwrap(), Stats::default());
}

/// After `vacuum_every` rows were completed, the store vacuums its table in
/// the background (so claims stop walking dead index entries even where
/// autovacuum is slow or, as on this machine, off); `None` never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completed_rows_trigger_an_opportunistic_vacuum() {
    let db = TestDb::new().await;
    let vacuums = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'events'",
        )
        .bind(db.schema.as_str())
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    for (every, expect_vacuum) in [(None, false), (Some(100), true)] {
        let store = PgStore::from_pool(
            db.pool.clone(),
            db.options().with_listen(false).with_vacuum_every(every),
        )
        .await
        .unwrap();
        let mut tx = db.pool.begin().await.unwrap();
        db.outbox
            .enqueue_batch(&mut tx, (0..150).map(ev).collect::<Vec<_>>())
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let before = vacuums().await;
        let claim = store.claim(&req("r", 200)).await.unwrap();
        assert_eq!(claim.events.len(), 150);
        let ids: Vec<_> = claim.events.iter().map(|e| e.id).collect();
        assert_eq!(deliver(&store, claim.token, &ids).await, 150);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut after = vacuums().await;
        while expect_vacuum && after == before && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            after = vacuums().await;
        }
        if !expect_vacuum {
            tokio::time::sleep(Duration::from_millis(500)).await;
            after = vacuums().await;
        }
        assert_eq!(after > before, expect_vacuum, "vacuum_every = {every:?}");
    }
}

/// Nothing listens on the port: the error says "connection refused" once
/// (Display and the whole `source()` chain together), names the server,
/// never the password, and is retryable. A database that does not exist is
/// reported at once (no waiting) and is not retryable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_errors_name_the_root_cause_once() {
    fn chain(e: &dyn std::error::Error) -> String {
        let mut out = e.to_string();
        let mut next = e.source();
        while let Some(s) = next {
            out.push_str(": ");
            out.push_str(&s.to_string());
            next = s.source();
        }
        out
    }
    const PASSWORD: &str = "s3cret-Pa55word";
    let url = format!("postgres://app:{PASSWORD}@127.0.0.1:5999/test");
    let started = std::time::Instant::now();
    let err =
        PgStore::connect(PgStoreOptions::new(url).with_connect_timeout(Duration::from_secs(1)))
            .await
            .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    let shown = chain(&err);
    assert_eq!(
        shown.to_lowercase().matches("connection refused").count(),
        1,
        "{shown}"
    );
    assert!(shown.contains("127.0.0.1:5999/test"), "{shown}");
    assert!(!format!("{shown} {err:?}").contains(PASSWORD), "{err:?}");
    assert!(err.is_retryable(), "{err:?}");
    assert!(matches!(err, StoreError::Connect { .. }), "{err:?}");

    let missing = database_url().replace("/test", "/no_such_database_x9");
    let started = std::time::Instant::now();
    let err = PgStore::connect(PgStoreOptions::new(missing))
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a missing database is not worth waiting for"
    );
    let shown = chain(&err);
    assert_eq!(shown.matches("does not exist").count(), 1, "{shown}");
    assert!(shown.contains("3D000"), "{shown}");
    assert!(!err.is_retryable(), "{err:?}");
}

/// A row whose headers are JSON but not an object of strings is
/// dead-lettered by the claim (UNDECODABLE, the decoding error as the
/// message) and left out of it; the rest of the batch, later events of the
/// same key included, is claimed. The dead letter stays listable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_rows_are_dead_lettered_at_claim() {
    use outbox_core::{DeadLetterQuery, DeadLetterStore, ErrorCode};
    let db = TestDb::new().await;
    let store = db.store().await;
    let bad = NewEvent::new("bad", "pg", b"x".to_vec()).with_key("k");
    sqlx::query(&format!(
        "INSERT INTO {} (id, key, key_hash, event_type, topic, payload, headers) \
         VALUES ($1, 'k', $2, 'bad', 'pg', '\\x78', '{{\"n\": 1, \"s\": \"x\"}}'::jsonb)",
        db.events()
    ))
    .bind(bad.id().as_uuid())
    .bind(i64::from(bad.key_hash()))
    .execute(&db.pool)
    .await
    .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let good = db
        .outbox
        .enqueue_batch(&mut tx, vec![ev(1).with_key("k"), ev(2)])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let c = store.claim(&req("r", 10)).await.unwrap();
    assert_eq!(ids(&c), good);
    let dead = store.list_dead(&DeadLetterQuery::default()).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].event.id, bad.id());
    assert_eq!(dead[0].error.code, ErrorCode::UNDECODABLE);
    assert!(
        dead[0]
            .error
            .message
            .contains("not a JSON object of strings"),
        "{}",
        dead[0].error.message
    );
    assert_eq!(dead[0].event.attempts, 1);
    // Shown as well as possible: non-string values as JSON text.
    assert_eq!(
        dead[0].event.headers.get("n").map(String::as_str),
        Some("1")
    );
    assert_eq!(deliver(&store, c.token, &good).await, 2);
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.in_flight, s.dead), (0, 0, 1));
}

/// `renew` extends the lease of what the token still holds (by primary
/// key, from what this store claimed), on the database clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_moves_the_lease_on_the_database_clock() {
    let db = TestDb::new().await;
    let store = db.store().await;
    let mut tx = db.pool.begin().await.unwrap();
    let ids = db
        .outbox
        .enqueue_batch(&mut tx, (0..3).map(ev))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let c = store
        .claim(&ClaimRequest {
            lease: Duration::from_secs(5),
            ..req("r", 10)
        })
        .await
        .unwrap();
    assert_eq!(c.events.len(), 3);
    let partial = store.settle(c.token, &delivered(&ids[..1])).await.unwrap();
    assert_eq!(partial.applied, 1);
    assert_eq!(
        store
            .renew(c.token, Duration::from_secs(900))
            .await
            .unwrap(),
        2
    );
    let renewed: Vec<bool> = sqlx::query_scalar(&format!(
        "SELECT locked_until > now() + interval '890 seconds' \
                AND next_attempt_at = locked_until FROM {} ORDER BY id",
        db.events()
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(renewed, vec![true, true]);
    assert_eq!(deliver(&store, c.token, &ids[1..]).await, 2);
    assert_eq!(
        store
            .renew(c.token, Duration::from_secs(900))
            .await
            .unwrap(),
        0
    );
}

/// An outbox created by migration 1 with pending events is upgraded in
/// place: the pending events keep their (id) order in the new insertion
/// sequence, and events enqueued afterwards come after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrading_from_migration_1_keeps_pending_events_in_order() {
    let schema = fresh_schema();
    let _guard = SchemaGuard(schema.clone());
    let pool = pool(4).await;
    let outbox =
        PgOutbox::in_mode(schema.clone(), Ident::new("events").unwrap(), PgMode::Queue).unwrap();
    let sql = outbox.migration_sql();
    let (version, name, v1) = &sql[0];
    let history = format!("{}.\"events_migrations\"", schema.quoted());
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA {s};
         CREATE TABLE {history} (version integer PRIMARY KEY, name text NOT NULL,
             checksum bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
         {v1}",
        s = schema.quoted()
    ))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(&format!(
        "INSERT INTO {history} (version, name, checksum) VALUES ($1, $2, $3)"
    ))
    .bind(version)
    .bind(name)
    .bind(i64::from_ne_bytes(MIGRATIONS[0].checksum().to_ne_bytes()))
    .execute(&pool)
    .await
    .unwrap();
    // Three events of one key, inserted in reverse id order under version 1.
    let events: Vec<NewEvent> = (0..3).map(|i| ev(i).with_key("k")).collect();
    let by_id: Vec<_> = events.iter().map(NewEvent::id).collect();
    for e in events.into_iter().rev() {
        let mut tx = pool.begin().await.unwrap();
        outbox.enqueue(&mut tx, e).await.unwrap();
        tx.commit().await.unwrap();
    }

    let mut conn = pool.acquire().await.unwrap();
    let applied = outbox.migrate(&mut conn).await.unwrap();
    let later: Vec<i32> = MIGRATIONS.iter().skip(1).map(|m| m.version).collect();
    assert_eq!(applied, later);
    drop(conn);
    let mut tx = pool.begin().await.unwrap();
    let newer = outbox.enqueue(&mut tx, ev(9).with_key("k")).await.unwrap();
    tx.commit().await.unwrap();

    let store = PgStore::from_pool(
        pool.clone(),
        PgStoreOptions::default()
            .with_schema(schema.clone())
            .with_listen(false),
    )
    .await
    .unwrap();
    let c = store.claim(&req("r", 10)).await.unwrap();
    let mut want = by_id.clone();
    want.push(newer);
    assert_eq!(ids(&c), want);
}
