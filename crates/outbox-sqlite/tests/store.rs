//! SQLite-specific store behaviour beyond the shared conformance suite.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use outbox_core::{ClaimRequest, NewEvent, RelayId, ShardSpec, Store};
use outbox_sqlite::{enqueue, SqliteStore};
use sqlx::Row;
use std::time::Duration;

#[tokio::test]
async fn debug_does_not_print_the_database_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("secret-name.db");
    let store = SqliteStore::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let text = format!("{store:?}");
    assert!(!text.contains("secret-name"), "{text}");
    assert!(text.starts_with("SqliteStore"), "{text}");
    assert!(path.exists(), "connect creates the file");
}

#[tokio::test]
async fn claim_uses_the_database_clock_and_an_index() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("o.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    enqueue(&mut tx, NewEvent::new("e", "t", vec![]).with_key("k"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let db_now: i64 = sqlx::query_scalar("SELECT CAST(unixepoch('subsec') * 1000 AS INTEGER)")
        .fetch_one(store.pool())
        .await
        .unwrap();
    let claim = store
        .claim(&ClaimRequest {
            relay_id: RelayId::new("r"),
            batch_size: 10,
            lease: Duration::from_secs(30),
            shard: ShardSpec::ALL,
        })
        .await
        .unwrap();
    assert_eq!(claim.events.len(), 1);
    let lease_ms = claim.lease_until.timestamp_millis() - db_now;
    // The lease is computed from the database clock: now + 30 s, give or take
    // the time between the two statements.
    assert!((30_000..40_000).contains(&lease_ms), "{lease_ms}");
    // The stored key_hash is outbox_core's FNV-1a of the key.
    let hash: i64 = sqlx::query_scalar("SELECT key_hash FROM outbox_events")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(hash, i64::from(outbox_core::key_hash(b"k")));

    let rows = sqlx::query(&format!("EXPLAIN QUERY PLAN {}", store.claim_sql()))
        .bind("r")
        .bind(uuid::Uuid::nil())
        .bind(1_i64)
        .bind(1_i64)
        .bind(0_i64)
        .bind(1_i64)
        .fetch_all(store.pool())
        .await
        .unwrap();
    let plan: Vec<String> = rows.iter().map(|r| r.get::<String, _>("detail")).collect();
    let plan = plan.join("\n");
    assert!(plan.contains("outbox_events_key_order"), "{plan}");
}
