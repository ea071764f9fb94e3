//! The migration runner: idempotent, its own history table, checksum checks.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use outbox_sqlite::{MigrateError, SqliteStore, MIGRATIONS_TABLE};

async fn fresh() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("app.db").display());
    (SqliteStore::connect(&url).await.unwrap(), dir)
}

async fn tables(store: &SqliteStore) -> Vec<String> {
    sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .fetch_all(store.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn migrate_creates_tables_and_records_history_in_its_own_table() {
    let (store, _dir) = fresh().await;
    assert!(store.applied_migrations().await.unwrap().is_empty());
    assert_eq!(store.migrate().await.unwrap(), vec![1, 2, 3]);
    let names = tables(&store).await;
    assert!(names.contains(&"outbox_events".to_owned()), "{names:?}");
    assert!(
        names.contains(&"outbox_dead_letters".to_owned()),
        "{names:?}"
    );
    assert!(names.contains(&MIGRATIONS_TABLE.to_owned()), "{names:?}");
    assert!(!names.contains(&"_sqlx_migrations".to_owned()), "{names:?}");
    let applied = store.applied_migrations().await.unwrap();
    assert_eq!(applied.len(), 3);
    assert_eq!(applied[0].version, 1);
    assert_eq!(applied[0].name, "outbox");
    assert_eq!(applied[1].name, "commit_order");
    assert_eq!(applied[2].name, "control");
    assert_eq!(applied[0].checksum.len(), 16);
    assert!(applied[0].applied_at.is_some());
}

#[tokio::test]
async fn migrate_is_idempotent_and_keeps_data() {
    let (store, _dir) = fresh().await;
    store.migrate().await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let id = outbox_sqlite::enqueue(&mut tx, outbox_core::NewEvent::new("e", "t", vec![1]))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let before = store.applied_migrations().await.unwrap();
    assert!(store.migrate().await.unwrap().is_empty());
    assert!(store.migrate().await.unwrap().is_empty());
    assert_eq!(store.applied_migrations().await.unwrap(), before);
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM outbox_events WHERE id = ?")
        .bind(id.as_uuid())
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(n, 1);
}

#[tokio::test]
async fn concurrent_migrations_apply_once() {
    let (store, _dir) = fresh().await;
    let (a, b) = tokio::join!(store.migrate(), store.migrate());
    let mut applied = a.unwrap();
    applied.extend(b.unwrap());
    applied.sort_unstable();
    assert_eq!(applied, vec![1, 2, 3]);
}

#[tokio::test]
async fn checksum_mismatch_is_a_clear_error_and_changes_nothing() {
    let (store, _dir) = fresh().await;
    store.migrate().await.unwrap();
    sqlx::query("UPDATE outbox_schema_migrations SET checksum = 'deadbeef' WHERE version = 1")
        .execute(store.pool())
        .await
        .unwrap();
    let err = store.migrate().await.unwrap_err();
    assert!(
        matches!(&err, MigrateError::ChecksumMismatch { version: 1, applied, .. } if applied == "deadbeef"),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(text.contains("migration 1 (outbox)"), "{text}");
    assert!(text.contains("must never be edited"), "{text}");
}

#[tokio::test]
async fn a_migration_from_a_newer_build_is_refused() {
    let (store, _dir) = fresh().await;
    store.migrate().await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_schema_migrations (version, name, checksum, applied_at) \
         VALUES (999, 'future', 'x', 0)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let err = store.migrate().await.unwrap_err();
    assert!(
        matches!(err, MigrateError::UnknownVersion { version: 999, .. }),
        "{err:?}"
    );
}

#[tokio::test]
async fn the_application_can_use_sqlx_style_tables_alongside() {
    // An application table named like sqlx's history table is left alone.
    let (store, _dir) = fresh().await;
    sqlx::query("CREATE TABLE _sqlx_migrations (version INTEGER PRIMARY KEY, description TEXT)")
        .execute(store.pool())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(n, 0);
}
