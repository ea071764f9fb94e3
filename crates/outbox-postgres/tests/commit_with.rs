//! `PgOutbox::commit_with` / `commit_with_batch` (the event's INSERT and
//! the COMMIT in one round trip) and `enqueue_bulk` (COPY), against the
//! test database: what is committed, what is rolled back, a COMMIT whose
//! answer never comes (a proxy cuts the connection while the COMMIT waits
//! behind a lock: deterministic, no race), the values read back exactly,
//! and no warning left behind.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod log_support;

use log_support::{database_url, pool, pooler_pool, LogDb, TestDb};
use outbox_core::{NewEvent, Pooler, ValidationError};
use outbox_postgres::{EnqueueError, PgOutbox};
use outbox_testkit::logs::LogCapture;
use outbox_testkit::proxy::TcpProxy;
use sqlx::{Connection, PgConnection, PgPool, Row};
use std::time::Duration;

/// A business table `orders` in the test's schema.
async fn orders(pool: &PgPool, schema: &outbox_postgres::Ident) -> String {
    let orders = format!("{}.orders", schema.quoted());
    sqlx::query(&format!(
        "CREATE TABLE {orders} (id bigint PRIMARY KEY, \
         ref bigint UNIQUE DEFERRABLE INITIALLY DEFERRED)"
    ))
    .execute(pool)
    .await
    .unwrap();
    orders
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// An event whose text fields hold what a literal must escape.
fn awkward(n: u32) -> NewEvent {
    NewEvent::new(
        format!("o'k\\{n}.x"),
        "top'ic\\é",
        format!("{{\"q\":\"it's \\\\ {n} 日本 🦀\"}}").into_bytes(),
    )
    .with_key(format!("k'\\ E'x' $$ {n} ✓"))
    .with_header("x-quote", "a'b\\c\"d")
    .with_header("x-unicode", "naïve 日本 🦀")
    .with_header("x-empty", "")
}

/// The log's columns of the events with these ids, in log order, without
/// the id (so rows written by two paths compare equal).
async fn log_rows(db: &LogDb, ids: &[outbox_core::EventId]) -> Vec<String> {
    let uuids: Vec<uuid::Uuid> = ids.iter().map(|id| id.as_uuid()).collect();
    sqlx::query(&format!(
        "SELECT key, key_hash, event_type, topic, payload, headers::text AS h, \
         deliver_at FROM {} WHERE id = ANY($1) ORDER BY seq",
        db.table("")
    ))
    .bind(&uuids)
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|r| {
        let key = r.get::<Option<String>, _>("key");
        // Without a key the hash is the id's: compared only with one.
        let hash = key.as_ref().map(|_| r.get::<i64, _>("key_hash"));
        format!(
            "{key:?} {hash:?} {} {} {:?} {} {:?}",
            r.get::<String, _>("event_type"),
            r.get::<String, _>("topic"),
            r.get::<Vec<u8>, _>("payload"),
            r.get::<String, _>("h"),
            r.get::<Option<chrono::DateTime<chrono::Utc>>, _>("deliver_at"),
        )
    })
    .collect()
}

/// Whether `conn` is outside any transaction block: VACUUM refuses to run
/// inside one (25001).
async fn outside_transaction(conn: &mut PgConnection, table: &str) -> bool {
    match sqlx::raw_sql(&format!("VACUUM {table}"))
        .execute(conn)
        .await
    {
        Ok(_) => true,
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25001") => false,
        Err(e) => panic!("VACUUM failed: {e}"),
    }
}

async fn log_ids(db: &LogDb) -> Vec<uuid::Uuid> {
    sqlx::query_scalar(&format!("SELECT id FROM {} ORDER BY seq", db.table("")))
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn commit_with_commits_the_business_write_and_the_event() {
    let db = LogDb::new().await;
    let orders = orders(&db.pool, &db.schema).await;
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query(&format!("INSERT INTO {orders} (id) VALUES (1)"))
        .execute(&mut *tx)
        .await
        .unwrap();
    let event = NewEvent::new("order.created", "orders", b"{}".to_vec()).with_key("order-1");
    let expected = event.id();
    let id = db.log.commit_with(tx, event).await.unwrap();
    assert_eq!(id, expected);
    assert_eq!(count(&db.pool, &orders).await, 1);
    assert_eq!(log_ids(&db).await, vec![id.as_uuid()]);
}

/// Every value written as a literal reads back exactly as `enqueue`'s bound
/// parameters write it, with `standard_conforming_strings` on and off.
#[tokio::test]
async fn literals_read_back_exactly_as_enqueue_writes_them() {
    let db = LogDb::new().await;
    let at = chrono::DateTime::parse_from_rfc3339("2031-02-03T04:05:06.789012Z")
        .unwrap()
        .with_timezone(&chrono::Utc);
    let events = || {
        vec![
            awkward(1),
            NewEvent::new("t", "t", Vec::new()),
            NewEvent::new("t", "t", (0..=255u8).collect::<Vec<u8>>()).with_key(""),
            awkward(2).deliver_at(at),
        ]
    };
    // The empty key is refused by validation: keep the valid ones.
    let events = move || {
        events()
            .into_iter()
            .filter(|e| e.validate(&outbox_core::EventLimits::default()).is_ok())
            .collect::<Vec<_>>()
    };
    assert_eq!(events().len(), 3);
    let mut tx = db.pool.begin().await.unwrap();
    let bound = db.log.enqueue_batch(&mut tx, events()).await.unwrap();
    tx.commit().await.unwrap();
    for conforming in ["on", "off"] {
        let mut conn = PgConnection::connect(&database_url()).await.unwrap();
        sqlx::query(&format!("SET standard_conforming_strings = {conforming}"))
            .execute(&mut conn)
            .await
            .unwrap();
        let tx = conn.begin().await.unwrap();
        let literal = db.log.commit_with_batch(tx, events()).await.unwrap();
        assert_eq!(
            log_rows(&db, &literal).await,
            log_rows(&db, &bound).await,
            "standard_conforming_strings = {conforming}"
        );
        conn.close().await.unwrap();
    }
    let rows = log_rows(&db, &bound).await;
    assert!(rows[0].contains("o'k\\1.x"), "{}", rows[0]);
    assert!(
        rows[2].contains("2031-02-03T04:05:06.789012Z"),
        "{}",
        rows[2]
    );
}

/// A batch keeps its order, delayed events get their due time, and an
/// empty batch commits the business write alone.
#[tokio::test]
async fn commit_with_batch_keeps_order_and_delays() {
    let db = LogDb::new().await;
    let orders = orders(&db.pool, &db.schema).await;
    let events: Vec<NewEvent> = (0..50)
        .map(|i| {
            let e = NewEvent::new("n", "t", vec![i]).with_key(format!("k{}", i % 3));
            if i == 7 {
                e.deliver_after(Duration::from_secs(3600))
            } else {
                e
            }
        })
        .collect();
    let tx = db.pool.begin().await.unwrap();
    let ids = db.log.commit_with_batch(tx, events).await.unwrap();
    let uuids: Vec<uuid::Uuid> = ids.iter().map(|id| id.as_uuid()).collect();
    assert_eq!(log_ids(&db).await, uuids);
    let delayed: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE deliver_at BETWEEN now() + interval '59 minutes' \
         AND now() + interval '61 minutes'",
        db.table("")
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(delayed, 1);

    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query(&format!("INSERT INTO {orders} (id) VALUES (9)"))
        .execute(&mut *tx)
        .await
        .unwrap();
    let none = db.log.commit_with_batch(tx, Vec::new()).await.unwrap();
    assert!(none.is_empty());
    assert_eq!(count(&db.pool, &orders).await, 1);
}

/// A refused INSERT (a duplicate id in the queue table) never reaches the
/// COMMIT: the business write is rolled back too, the error is enqueue's,
/// and the pooled connection is clean for its next user.
#[tokio::test]
async fn a_refused_insert_rolls_the_transaction_back() {
    let db = TestDb::new().await;
    let orders = orders(&db.pool, &db.schema).await;
    let first = NewEvent::new("a", "t", vec![1]);
    let dup = first.clone();
    let tx = db.pool.begin().await.unwrap();
    db.outbox.commit_with(tx, first).await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query(&format!("INSERT INTO {orders} (id) VALUES (1)"))
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = db.outbox.commit_with(tx, dup.clone()).await.unwrap_err();
    let EnqueueError::Database(sqlx::Error::Database(e)) = &err else {
        panic!("{err:?}");
    };
    assert_eq!(e.code().as_deref(), Some("23505"), "{err}");
    assert!(err.to_string().starts_with("enqueue failed:"), "{err}");
    // enqueue reports the same duplicate the same way.
    let mut tx = db.pool.begin().await.unwrap();
    let enq = db.outbox.enqueue(&mut tx, dup).await.unwrap_err();
    assert!(matches!(enq, EnqueueError::Database(_)), "{enq:?}");
    tx.rollback().await.unwrap();

    assert_eq!(count(&db.pool, &orders).await, 0);
    assert_eq!(count(&db.pool, &db.events()).await, 1);
    // Every connection of the pool is outside any transaction.
    for _ in 0..6 {
        let mut conn = db.pool.acquire().await.unwrap();
        assert!(
            outside_transaction(&mut conn, &orders).await,
            "a pooled connection was left in a transaction"
        );
        assert!(!conn.is_in_transaction());
    }
}

/// A COMMIT the server refuses (a deferred unique constraint) is a
/// rollback: the error says so, nothing of the transaction is kept, and
/// no WARNING is left (the transaction sqlx still counted open is ended
/// cleanly).
#[tokio::test]
async fn a_refused_commit_is_a_rollback_and_leaves_no_warning() {
    let db = LogDb::new().await;
    let orders = orders(&db.pool, &db.schema).await;
    sqlx::query(&format!("INSERT INTO {orders} (id, ref) VALUES (1, 7)"))
        .execute(&db.pool)
        .await
        .unwrap();
    let (logs, _guard) = LogCapture::start(tracing::Level::WARN);
    let mut conn = PgConnection::connect(&database_url()).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    // Violates the deferred constraint: checked at COMMIT.
    sqlx::query(&format!("INSERT INTO {orders} (id, ref) VALUES (2, 7)"))
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = db
        .log
        .commit_with(tx, NewEvent::new("a", "t", vec![1]))
        .await
        .unwrap_err();
    let EnqueueError::Database(sqlx::Error::Database(e)) = &err else {
        panic!("{err:?}");
    };
    assert_eq!(e.code().as_deref(), Some("23505"), "{err}");
    assert_eq!(count(&db.pool, &orders).await, 1);
    assert!(log_ids(&db).await.is_empty());
    // The connection is usable and outside any transaction.
    assert!(outside_transaction(&mut conn, &orders).await);
    assert!(!conn.is_in_transaction());
    conn.close().await.unwrap();
    assert_eq!(logs.lines("WARN", "transaction"), 0, "{}", logs.text());
}

/// A committed `commit_with` leaves no WARNING 25P01 (a ROLLBACK without a
/// transaction), nor a transaction open on the connection once its next
/// statement ran; a plain `INSERT; COMMIT` through sqlx would (the reason
/// for `COMMIT AND CHAIN`, shown here so a sqlx upgrade that changes it is
/// noticed).
#[tokio::test]
async fn no_warning_after_a_commit() {
    let db = LogDb::new().await;
    let (logs, _guard) = LogCapture::start(tracing::Level::WARN);
    let mut conn = PgConnection::connect(&database_url()).await.unwrap();
    for i in 0..3u8 {
        let tx = conn.begin().await.unwrap();
        db.log
            .commit_with(tx, NewEvent::new("a", "t", vec![i]))
            .await
            .unwrap();
    }
    assert!(
        outside_transaction(&mut conn, &db.table("_meta")).await,
        "the chained transaction was not ended"
    );
    assert_eq!(log_ids(&db).await.len(), 3);
    assert_eq!(logs.lines("WARN", "no transaction"), 0, "{}", logs.text());

    // What a plain COMMIT sent by a raw query leaves behind.
    let mut tx = conn.begin().await.unwrap();
    sqlx::raw_sql("SELECT 1; COMMIT")
        .execute(&mut *tx)
        .await
        .unwrap();
    drop(tx);
    sqlx::query("SELECT 1").execute(&mut conn).await.unwrap();
    assert_eq!(
        logs.lines("WARN", "there is no transaction in progress"),
        1,
        "{}",
        logs.text()
    );
    conn.close().await.unwrap();
}

/// Bad input is refused with `enqueue`'s error, nothing is written, and
/// the caller's transaction is rolled back.
#[tokio::test]
async fn bad_input_is_refused_with_nothing_written() {
    let db = LogDb::new().await;
    let orders = orders(&db.pool, &db.schema).await;
    let bad = || NewEvent::new("a", "t", vec![1]).with_key("line\0break");
    let mut tx = db.pool.begin().await.unwrap();
    let enq = db.log.enqueue(&mut tx, bad()).await.unwrap_err();
    tx.rollback().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query(&format!("INSERT INTO {orders} (id) VALUES (1)"))
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = db.log.commit_with(tx, bad()).await.unwrap_err();
    let EnqueueError::Invalid { source, .. } = &err else {
        panic!("{err:?}");
    };
    assert!(
        matches!(source, ValidationError::ControlCharacter { code: 0, .. }),
        "{err}"
    );
    // The same message as enqueue's, but for the event id.
    let strip = |e: &EnqueueError| e.to_string().split_once(':').unwrap().1.to_owned();
    assert_eq!(strip(&err), strip(&enq));

    // One bad event refuses the whole batch.
    let tx = db.pool.begin().await.unwrap();
    let batch = vec![
        NewEvent::new("a", "t", vec![1]),
        NewEvent::new("a", "", vec![1]),
    ];
    let err = db
        .log
        .commit_with_batch(tx, batch.clone())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            EnqueueError::Invalid {
                source: ValidationError::EmptyTopic,
                ..
            }
        ),
        "{err:?}"
    );
    let mut conn = db.pool.acquire().await.unwrap();
    let err = db.log.enqueue_bulk(&mut conn, batch).await.unwrap_err();
    assert!(matches!(err, EnqueueError::Invalid { .. }), "{err:?}");

    assert_eq!(count(&db.pool, &orders).await, 0);
    assert!(log_ids(&db).await.is_empty());
}

/// A savepoint is refused (its COMMIT would end the outer transaction);
/// the outer transaction goes on.
#[tokio::test]
async fn a_savepoint_is_refused() {
    let db = LogDb::new().await;
    let orders = orders(&db.pool, &db.schema).await;
    let mut outer = db.pool.begin().await.unwrap();
    sqlx::query(&format!("INSERT INTO {orders} (id) VALUES (1)"))
        .execute(&mut *outer)
        .await
        .unwrap();
    let inner = outer.begin().await.unwrap();
    let err = db
        .log
        .commit_with(inner, NewEvent::new("a", "t", vec![1]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, EnqueueError::NotTopLevel { depth: 2 }),
        "{err:?}"
    );
    assert_eq!(
        count(&db.pool, &orders).await,
        0,
        "the outer tx was committed"
    );
    outer.commit().await.unwrap();
    assert_eq!(count(&db.pool, &orders).await, 1);
    assert!(log_ids(&db).await.is_empty());
}

/// The connection is cut while the INSERT and COMMIT wait behind another
/// session's lock: sent, not answered. The outcome is reported as unknown
/// (never Ok, never a plain failure), and indeed the server commits the
/// event once the lock is released (it notices the lost client only when
/// it answers).
#[tokio::test]
async fn a_lost_commit_answer_is_an_unknown_outcome() {
    let db = LogDb::new().await;
    let upstream: std::net::SocketAddr = "127.0.0.1:5432".parse().unwrap();
    let proxy = TcpProxy::start(upstream).await;
    let url = database_url().replace("127.0.0.1:5432", &proxy.addr().to_string());
    assert_ne!(url, database_url(), "DATABASE_URL must name 127.0.0.1:5432");
    let mut conn = PgConnection::connect(&url).await.unwrap();

    // Another session blocks every INSERT into the log.
    let mut locker = db.pool.begin().await.unwrap();
    sqlx::query(&format!("LOCK TABLE {} IN SHARE MODE", db.table("")))
        .execute(&mut *locker)
        .await
        .unwrap();

    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let event = NewEvent::new("a", "t", vec![1]);
    let id = event.id();
    let outbox = db.log.clone();
    let call = tokio::spawn(async move {
        let tx = conn.begin().await.unwrap();
        outbox.commit_with(tx, event).await
    });
    // Wait until the statement is waiting for the lock: sent, not answered.
    let waiting = log_support::eventually(Duration::from_secs(10), || {
        let pool = db.pool.clone();
        async move {
            let q: Option<String> = sqlx::query_scalar(
                "SELECT query FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'",
            )
            .bind(pid)
            .fetch_optional(&pool)
            .await
            .unwrap();
            q.is_some_and(|q| q.contains("COMMIT AND CHAIN"))
        }
    })
    .await;
    assert!(waiting, "the INSERT never waited for the lock");
    proxy.cut();
    let err = call.await.unwrap().unwrap_err();
    match &err {
        EnqueueError::CommitUnknown { ids, .. } => assert_eq!(ids, &vec![id]),
        other => panic!("expected CommitUnknown, got {other:?}"),
    }
    assert!(err.to_string().contains("unknown"), "{err}");

    locker.rollback().await.unwrap();
    // The server ran the INSERT and the COMMIT after all.
    let committed = log_support::eventually(Duration::from_secs(10), || {
        let db = &db;
        async move { log_ids(db).await == vec![id.as_uuid()] }
    })
    .await;
    assert!(
        committed,
        "the event should have been committed by the server"
    );
}

/// Through PgBouncer in transaction mode: one event, a batch, and the bulk
/// path inside a transaction.
#[tokio::test]
async fn through_pgbouncer_in_transaction_mode() {
    let db = LogDb::new().await;
    let pooled = pooler_pool(4).await;
    let outbox = db.log.clone().with_pooler(Pooler::Transaction);
    let tx = pooled.begin().await.unwrap();
    let one = outbox.commit_with(tx, awkward(1)).await.unwrap();
    let tx = pooled.begin().await.unwrap();
    let batch = outbox
        .commit_with_batch(tx, vec![awkward(2), awkward(3)])
        .await
        .unwrap();
    let mut tx = pooled.begin().await.unwrap();
    let bulk = outbox
        .enqueue_bulk(&mut tx, (0..100).map(|i: u32| awkward(i + 10)))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut want = vec![one];
    want.extend(batch);
    want.extend(bulk);
    let want: Vec<uuid::Uuid> = want.iter().map(|id| id.as_uuid()).collect();
    assert_eq!(log_ids(&db).await, want);
    pooled.close().await;
}

/// The bulk path: 10,000 events by COPY, read back in the given order with
/// their values; into the queue table too, with a delayed event.
#[tokio::test]
async fn bulk_copies_ten_thousand_events_in_order() {
    let db = LogDb::new().await;
    let events: Vec<NewEvent> = (0..10_000u32)
        .map(|i| {
            NewEvent::new("bulk", "t", i.to_be_bytes().to_vec())
                .with_key(format!("k{}", i % 17))
                .with_header("n", i.to_string())
        })
        .collect();
    let mut conn = db.pool.acquire().await.unwrap();
    let ids = db.log.enqueue_bulk(&mut conn, events).await.unwrap();
    assert_eq!(ids.len(), 10_000);
    let rows = sqlx::query(&format!(
        "SELECT id, payload, headers->>'n' AS n, key FROM {} ORDER BY seq",
        db.table("")
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 10_000);
    for (i, (row, id)) in rows.iter().zip(&ids).enumerate() {
        let i = u32::try_from(i).unwrap();
        assert_eq!(row.get::<uuid::Uuid, _>("id"), id.as_uuid());
        assert_eq!(row.get::<Vec<u8>, _>("payload"), i.to_be_bytes().to_vec());
        assert_eq!(row.get::<String, _>("n"), i.to_string());
        assert_eq!(row.get::<String, _>("key"), format!("k{}", i % 17));
    }
    // The same values as enqueue writes, awkward text included.
    let mut tx = db.pool.begin().await.unwrap();
    let bound = db
        .log
        .enqueue_batch(&mut tx, vec![awkward(1)])
        .await
        .unwrap();
    let copied = db
        .log
        .enqueue_bulk(&mut tx, vec![awkward(1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(log_rows(&db, &copied).await, log_rows(&db, &bound).await);

    let queue = TestDb::new().await;
    let mut conn = queue.pool.acquire().await.unwrap();
    let ids = queue
        .outbox
        .enqueue_bulk(
            &mut conn,
            vec![
                NewEvent::new("a", "t", vec![1]),
                NewEvent::new("a", "t", vec![2]).deliver_after(Duration::from_secs(600)),
            ],
        )
        .await
        .unwrap();
    let rows: Vec<(uuid::Uuid, bool)> = sqlx::query_as(&format!(
        "SELECT id, next_attempt_at > now() + interval '9 minutes' FROM {} ORDER BY seq",
        queue.events()
    ))
    .fetch_all(&queue.pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![(ids[0].as_uuid(), false), (ids[1].as_uuid(), true)]
    );
}

/// `commit_with` on the queue table with NOTIFY on: a listener hears it.
#[tokio::test]
async fn queue_mode_notifies() {
    let db = TestDb::new().await;
    let outbox: PgOutbox = db.outbox.clone().with_notify(true);
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool(1).await)
        .await
        .unwrap();
    listener.listen(outbox.channel()).await.unwrap();
    let tx = db.pool.begin().await.unwrap();
    outbox
        .commit_with(tx, NewEvent::new("a", "t", vec![1]))
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("no notification")
        .unwrap();
    assert_eq!(n.channel(), outbox.channel());
    assert_eq!(count(&db.pool, &db.events()).await, 1);
}
