//! SQLite-specific behaviour beyond the shared conformance suite: table
//! names, the enqueue handle, the upgrade to commit order, readable errors.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use outbox_core::ident::InvalidIdentifier;
use outbox_core::{
    ClaimRequest, DeadLetterFilter, DeadLetterStore, ErrorCode, EventId, LastError, NewEvent,
    RelayId, Resolution, Settlement, ShardSpec, Store,
};
use outbox_sqlite::{
    EnqueueError, Ident, SqliteOutbox, SqliteStore, SqliteStoreOptions, StoreError,
};
use std::error::Error as _;
use std::time::Duration;

fn url(dir: &tempfile::TempDir, file: &str) -> String {
    format!("sqlite://{}", dir.path().join(file).display())
}

fn req(relay: &str) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new(relay),
        batch_size: 100,
        lease: Duration::from_secs(600),
        shard: ShardSpec::ALL,
    }
}

async fn tables(store: &SqliteStore) -> Vec<String> {
    sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .fetch_all(store.pool())
        .await
        .unwrap()
}

/// Every cause of an error chain, as a reporter (`anyhow`'s `{:#}`) prints it.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}

#[tokio::test]
async fn a_missing_directory_is_one_clear_error_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir").join("app.db");
    let err = SqliteStore::connect(format!("sqlite://{}", missing.display()))
        .await
        .unwrap_err();
    let text = chain(&err);
    assert!(matches!(err, StoreError::Open { .. }), "{err:?}");
    assert_eq!(
        text,
        format!(
            "cannot open SQLite database {}: directory {} does not exist",
            missing.display(),
            missing.parent().unwrap().display()
        )
    );
    assert!(!err.is_retryable());
    assert!(err.source().is_none());
}

#[tokio::test]
async fn an_unopenable_file_names_the_path_and_the_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    // A directory where the database file should be.
    let path = dir.path().join("a-directory.db");
    std::fs::create_dir(&path).unwrap();
    let err = SqliteStore::connect(format!("sqlite://{}", path.display()))
        .await
        .unwrap_err();
    let text = chain(&err);
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert_eq!(
        text.matches("unable to open database file").count(),
        1,
        "{text}"
    );
}

#[tokio::test]
async fn hostile_table_names_are_refused() {
    for bad in ["x\"; DROP TABLE y; --", "sqlite_master", "a b", ""] {
        assert!(Ident::new(bad).is_err(), "{bad:?}");
    }
    // Derived names must fit too.
    let long = Ident::new("a".repeat(60)).unwrap();
    assert!(matches!(
        SqliteOutbox::new(long.clone()),
        Err(InvalidIdentifier::TooLong { .. })
    ));
    let dir = tempfile::tempdir().unwrap();
    let err = SqliteStore::connect(SqliteStoreOptions::new(url(&dir, "o.db")).with_table(long))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidName(_)), "{err:?}");
}

#[tokio::test]
async fn two_outboxes_with_their_own_tables_share_one_database() {
    let dir = tempfile::tempdir().unwrap();
    let db = url(&dir, "app.db");
    let default = SqliteStore::connect(&db).await.unwrap();
    // A keyword as a table name is fine: every name is quoted.
    let orders = SqliteStore::connect(
        SqliteStoreOptions::new(&db)
            .with_table(Ident::new("order").unwrap())
            .with_auto_migrate(true),
    )
    .await
    .unwrap();
    assert_eq!(default.migrate().await.unwrap(), vec![1, 2, 3]);
    assert!(orders.migrate().await.unwrap().is_empty(), "auto-migrated");
    let names = tables(&default).await;
    for t in [
        "order",
        "order_dead",
        "order_migrations",
        "order_control",
        "outbox_events",
        "outbox_events_control",
        "outbox_dead_letters",
        "outbox_schema_migrations",
    ] {
        assert!(names.contains(&t.to_owned()), "{t} missing from {names:?}");
    }

    // Enqueue through each handle, in one application transaction.
    let mut tx = default.pool().begin().await.unwrap();
    let a = outbox_sqlite::enqueue(&mut tx, NewEvent::new("a", "t", vec![1]))
        .await
        .unwrap();
    let b = orders
        .outbox()
        .enqueue(&mut tx, NewEvent::new("b", "t", vec![2]).with_key("k"))
        .await
        .unwrap();
    let batch = orders
        .outbox()
        .enqueue_batch(&mut tx, vec![NewEvent::new("c", "t", vec![3])])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let c1 = default.claim(&req("r")).await.unwrap();
    assert_eq!(c1.events.iter().map(|e| e.id).collect::<Vec<_>>(), vec![a]);
    let c2 = orders.claim(&req("r")).await.unwrap();
    let mut want = vec![b];
    want.extend(batch);
    assert_eq!(c2.events.iter().map(|e| e.id).collect::<Vec<_>>(), want);

    let dead = Settlement::new().with(
        b,
        Resolution::Dead {
            error: LastError {
                code: ErrorCode::HANDLER_PERMANENT_FAILURE,
                message: "no".into(),
            },
        },
    );
    let report = orders.settle(c2.token, &dead).await.unwrap();
    assert_eq!(report.applied, 1);
    assert_eq!(orders.stats().await.unwrap().dead, 1);
    assert_eq!(default.stats().await.unwrap().dead, 0);
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM \"order_dead\"")
        .fetch_one(default.pool())
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(
        orders.list_dead(&Default::default()).await.unwrap().len(),
        1
    );
}

#[tokio::test]
async fn enqueue_errors_name_the_event_and_are_classified() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::connect(url(&dir, "o.db")).await.unwrap();
    store.migrate().await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let bad = NewEvent::new("e", "", vec![]);
    let err = outbox_sqlite::enqueue(&mut tx, bad.clone())
        .await
        .unwrap_err();
    assert!(matches!(&err, EnqueueError::Invalid { id, .. } if *id == bad.id()));
    assert!(err.to_string().contains(&bad.id().to_string()), "{err}");
    let good = NewEvent::new("e", "t", vec![]);
    outbox_sqlite::enqueue(&mut tx, good.clone()).await.unwrap();
    let err = outbox_sqlite::enqueue(&mut tx, good).await.unwrap_err();
    assert!(matches!(err, EnqueueError::Database(_)), "{err:?}");
    assert!(chain(&err).contains("UNIQUE constraint failed"), "{err}");
    assert_eq!(chain(&err).matches("UNIQUE").count(), 1, "{err}");
}

/// A database created by the build before table names and commit order
/// (migration 1 recorded with its old checksum, rows whose ids are not in
/// insertion order) upgrades in place: nothing pending is lost, and claims
/// follow insertion order.
#[tokio::test]
async fn migration_2_upgrades_a_version_1_outbox_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::connect(url(&dir, "old.db")).await.unwrap();
    let v1 = &SqliteOutbox::default().migration_sql()[0].2;
    sqlx::raw_sql(v1).execute(store.pool()).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE outbox_schema_migrations (version INTEGER NOT NULL PRIMARY KEY, \
         name TEXT NOT NULL, checksum TEXT NOT NULL, applied_at INTEGER NOT NULL); \
         INSERT INTO outbox_schema_migrations VALUES (1, 'outbox', 'ebbe0c9a74357b0d', 0);",
    )
    .execute(store.pool())
    .await
    .unwrap();
    // Three events of key k inserted newest id first, one leased.
    let ids: Vec<EventId> = (0..3).map(|_| EventId::new()).collect();
    for (n, id) in ids.iter().rev().enumerate() {
        sqlx::query(
            "INSERT INTO outbox_events (id, key, key_hash, event_type, topic, payload, headers, \
             created_at, attempts, next_attempt_at) VALUES (?, 'k', ?, 'e', 't', ?, '{}', 0, 0, 0)",
        )
        .bind(id.as_uuid())
        .bind(i64::from(outbox_core::key_hash(b"k")))
        .bind(vec![u8::try_from(n).unwrap()])
        .execute(store.pool())
        .await
        .unwrap();
    }

    assert_eq!(store.migrate().await.unwrap(), vec![2, 3]);
    assert!(store.migrate().await.unwrap().is_empty());
    let c = store.claim(&req("r")).await.unwrap();
    let order: Vec<EventId> = c.events.iter().map(|e| e.id).collect();
    assert_eq!(order, ids.iter().rev().copied().collect::<Vec<_>>());
    assert_eq!(c.events[0].payload, vec![0]);

    // New events go after the old ones.
    let mut tx = store.pool().begin().await.unwrap();
    let new = outbox_sqlite::enqueue(&mut tx, NewEvent::new("e", "t", vec![9]).with_key("k"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let report = store
        .settle(c.token, &Settlement::release_all(order.clone()))
        .await
        .unwrap();
    assert_eq!(report.applied, 3);
    let c = store.claim(&req("r")).await.unwrap();
    let mut want = order;
    want.push(new);
    assert_eq!(c.events.iter().map(|e| e.id).collect::<Vec<_>>(), want);
}

/// A replayed dead letter goes behind the events of its key still in the
/// table (it never overtakes one, so it never runs beside one in flight);
/// a key with none left gets it back at its old place.
#[tokio::test]
async fn a_retried_dead_letter_goes_behind_its_keys_pending_events() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::connect(url(&dir, "o.db")).await.unwrap();
    store.migrate().await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let ids = outbox_sqlite::enqueue_batch(
        &mut tx,
        (0..3).map(|i| NewEvent::new("e", "t", vec![i]).with_key("k")),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let one = ClaimRequest {
        batch_size: 1,
        ..req("r")
    };
    let c = store.claim(&one).await.unwrap();
    let dead = Resolution::Dead {
        error: LastError {
            code: ErrorCode::HANDLER_PERMANENT_FAILURE,
            message: "bad".into(),
        },
    };
    store
        .settle(c.token, &Settlement::new().with(ids[0], dead))
        .await
        .unwrap();
    let c = store.claim(&one).await.unwrap();
    assert_eq!(c.events[0].id, ids[1]);
    store
        .settle(
            c.token,
            &Settlement::new().with(ids[1], Resolution::Delivered),
        )
        .await
        .unwrap();
    assert_eq!(
        store
            .retry_dead(&DeadLetterFilter::ids([ids[0]]))
            .await
            .unwrap(),
        1
    );
    let c = store.claim(&req("r")).await.unwrap();
    assert_eq!(
        c.events.iter().map(|e| e.id).collect::<Vec<_>>(),
        vec![ids[2], ids[0]],
        "the replayed event goes behind the later event of its key still pending"
    );
    // Dead again, with no event of its key left: it keeps its place (seq).
    let seq_of = |id: EventId| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT seq FROM outbox_events WHERE id = ?")
                .bind(id.as_uuid())
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let replayed_seq = seq_of(ids[0]).await;
    assert!(replayed_seq > seq_of(ids[2]).await);
    let report = store
        .settle(
            c.token,
            &Settlement::new().with(ids[2], Resolution::Delivered).with(
                ids[0],
                Resolution::Dead {
                    error: LastError {
                        code: ErrorCode::HANDLER_PERMANENT_FAILURE,
                        message: "still bad".into(),
                    },
                },
            ),
        )
        .await
        .unwrap();
    assert_eq!(report.applied, 2);
    assert_eq!(store.retry_dead(&DeadLetterFilter::all()).await.unwrap(), 1);
    assert_eq!(seq_of(ids[0]).await, replayed_seq);
}

#[tokio::test]
async fn a_url_of_another_database_is_refused() {
    let err = SqliteStore::connect("postgres://app:secret@db/prod")
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidUrl(_)), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("sqlite://"), "{text}");
    assert!(!text.contains("secret"), "{text}");
}
