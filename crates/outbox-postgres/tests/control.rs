//! Pause and resume (`ControlStore`) on PostgreSQL, both modes: the control
//! row a relay watches. Queue mode has one group (`default`); the event log
//! pauses each consumer group on its own. Uses `DATABASE_URL`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[path = "log_support/mod.rs"]
mod log_support;

use log_support::{database_url, pool, LogDb, SchemaGuard};
use outbox_core::{ControlStore, PauseNote, DEFAULT_GROUP};
use outbox_postgres::{Ident, PgMode, PgOutbox, PgStore, PgStoreOptions, StoreError};

/// The behaviour both modes share, on `group`.
async fn pause_and_resume(store: &impl ControlStore, group: &str) {
    assert_eq!(store.paused(group).await.unwrap(), None, "never paused");
    let note = PauseNote::new().with_by("alice").with_reason("deploy");
    assert!(store.set_paused(group, true, &note).await.unwrap());
    let first = store.paused(group).await.unwrap().expect("paused");
    assert_eq!(first.by.as_deref(), Some("alice"));
    assert_eq!(first.reason.as_deref(), Some("deploy"));
    assert!((chrono::Utc::now() - first.since).num_seconds().abs() < 60);

    // Pausing again changes nothing: the first pause is kept.
    let other = PauseNote::new().with_by("bob");
    assert!(!store.set_paused(group, true, &other).await.unwrap());
    assert_eq!(store.paused(group).await.unwrap(), Some(first));

    assert!(store
        .set_paused(group, false, &PauseNote::new())
        .await
        .unwrap());
    assert_eq!(store.paused(group).await.unwrap(), None);
    assert!(!store
        .set_paused(group, false, &PauseNote::new())
        .await
        .unwrap());

    // Paused again: a new pause, with the new note.
    assert!(store.set_paused(group, true, &other).await.unwrap());
    let again = store.paused(group).await.unwrap().expect("paused");
    assert_eq!((again.by.as_deref(), again.reason), (Some("bob"), None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_mode_pauses_its_one_group() {
    let pool = pool(4).await;
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let schema = Ident::new(format!("outbox_ctl_{}", &suffix[..12])).unwrap();
    let _guard = SchemaGuard(schema.clone());
    let table = Ident::new("events").unwrap();
    let outbox = PgOutbox::in_mode(schema.clone(), table.clone(), PgMode::Queue).unwrap();
    let mut conn = pool.acquire().await.unwrap();
    outbox.migrate(&mut conn).await.unwrap();
    drop(conn);
    let store = PgStore::from_pool(
        pool,
        PgStoreOptions::new(database_url())
            .with_schema(schema)
            .with_table(table)
            .with_listen(false),
    )
    .await
    .unwrap();
    pause_and_resume(&store, DEFAULT_GROUP).await;
    let err = store
        .set_paused("payments", true, &PauseNote::new())
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::UnknownGroup(ref g) if g == "payments"),
        "{err}"
    );
    assert!(err.to_string().contains("mode `log`"), "{err}");
    assert!(store.paused("payments").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_log_pauses_each_group_on_its_own() {
    let db = LogDb::new().await;
    let store = db.store().await;
    pause_and_resume(&store, "payments").await;
    // `payments` is paused (by bob); the default group is not.
    assert!(store.paused("payments").await.unwrap().is_some());
    assert_eq!(store.paused(DEFAULT_GROUP).await.unwrap(), None);
    pause_and_resume(&store, DEFAULT_GROUP).await;
    // A group no relay has used yet can be paused ahead of its first relay.
    assert!(store
        .set_paused("not-started", true, &PauseNote::new())
        .await
        .unwrap());
    assert!(store.paused("not-started").await.unwrap().is_some());
}
