//! Pause and resume (`ControlStore`) on SQLite: one group, `default`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use outbox_core::{ControlStore, PauseNote, DEFAULT_GROUP};
use outbox_sqlite::{SqliteStore, SqliteStoreOptions, StoreError};

#[tokio::test]
async fn pauses_and_resumes_its_one_group() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("app.db").display());
    let store = SqliteStore::connect(SqliteStoreOptions::new(&url).with_auto_migrate(true))
        .await
        .unwrap();
    let g = DEFAULT_GROUP;
    assert_eq!(store.paused(g).await.unwrap(), None);
    let note = PauseNote::new().with_by("alice").with_reason("deploy");
    assert!(store.set_paused(g, true, &note).await.unwrap());
    let first = store.paused(g).await.unwrap().expect("paused");
    assert_eq!(first.by.as_deref(), Some("alice"));
    assert_eq!(first.reason.as_deref(), Some("deploy"));
    assert!((chrono::Utc::now() - first.since).num_seconds().abs() < 60);
    // Pausing again keeps the first pause.
    assert!(!store
        .set_paused(g, true, &PauseNote::new().with_by("bob"))
        .await
        .unwrap());
    assert_eq!(store.paused(g).await.unwrap(), Some(first));
    assert!(store.set_paused(g, false, &PauseNote::new()).await.unwrap());
    assert_eq!(store.paused(g).await.unwrap(), None);
    assert!(!store.set_paused(g, false, &PauseNote::new()).await.unwrap());

    let err = store
        .set_paused("payments", true, &PauseNote::new())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::UnknownGroup(_)), "{err}");
}
