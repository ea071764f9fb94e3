//! The store conformance suite (outbox-testkit) run against SQLite: each case
//! gets a fresh database file in its own temporary directory.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use outbox_core::{ErrorCode, EventId, FencingToken, NewEvent, ValidationError};
use outbox_sqlite::{EnqueueError, SqliteStore};
use outbox_testkit::store::{RowState, StoreHarness};
use sqlx::Row;
use uuid::Uuid;

const NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

struct SqliteHarness {
    store: SqliteStore,
    _dir: tempfile::TempDir,
}

impl SqliteHarness {
    async fn new() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
        let store = SqliteStore::connect(&url).await.expect("open sqlite");
        store.migrate().await.expect("migrate");
        Self { store, _dir: dir }
    }
}

impl StoreHarness for SqliteHarness {
    type Store = SqliteStore;

    async fn store(&self) -> SqliteStore {
        self.store.clone()
    }

    async fn enqueue(
        &self,
        events: Vec<NewEvent>,
        commit: bool,
    ) -> Result<Vec<EventId>, ValidationError> {
        let mut tx = self.store.pool().begin().await.expect("begin");
        let ids = match self.store.outbox().enqueue_batch(&mut tx, events).await {
            Ok(ids) => ids,
            Err(EnqueueError::Invalid { source, .. }) => return Err(source),
            Err(e) => panic!("enqueue failed: {e}"),
        };
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
        Ok(ids)
    }

    async fn snapshot(&self, id: EventId) -> RowState {
        let pool = self.store.pool();
        let sql = format!(
            "SELECT attempts, next_attempt_at > {NOW_MS} AS future, last_error_code, locked_by, \
             lease_token, locked_until <= {NOW_MS} AS expired, locked_until \
             FROM outbox_events WHERE id = ?"
        );
        if let Some(row) = sqlx::query(&sql)
            .bind(id.as_uuid())
            .fetch_optional(pool)
            .await
            .unwrap()
        {
            let attempts = u32::try_from(row.get::<i64, _>("attempts")).unwrap();
            let code: Option<String> = row.get("last_error_code");
            let locked_until: Option<i64> = row.get("locked_until");
            return match locked_until {
                None => RowState::Pending {
                    attempts,
                    next_attempt_in_future: row.get("future"),
                    last_error_code: code.map(ErrorCode::new),
                },
                Some(_) => RowState::Leased {
                    attempts,
                    token: FencingToken::from_uuid(row.get::<Uuid, _>("lease_token")),
                    locked_by: row.get("locked_by"),
                    lease_expired: row.get("expired"),
                },
            };
        }
        let dead =
            sqlx::query("SELECT last_error_code, attempts FROM outbox_dead_letters WHERE id = ?")
                .bind(id.as_uuid())
                .fetch_optional(pool)
                .await
                .unwrap();
        match dead {
            Some(row) => RowState::Dead {
                code: ErrorCode::new(row.get::<String, _>("last_error_code")),
                attempts: u32::try_from(row.get::<i64, _>("attempts")).unwrap(),
            },
            None => RowState::Missing,
        }
    }

    async fn expire_lease(&self, id: EventId) {
        let sql = format!("UPDATE outbox_events SET locked_until = {NOW_MS} - 1000 WHERE id = ?");
        let done = sqlx::query(&sql)
            .bind(id.as_uuid())
            .execute(self.store.pool())
            .await
            .unwrap();
        assert_eq!(done.rows_affected(), 1, "no leased row {id}");
    }

    /// A row whose headers are a JSON array, not an object of strings.
    async fn insert_undecodable(&self) -> EventId {
        let id = EventId::new();
        let sql = format!(
            "INSERT INTO outbox_events (id, key, key_hash, event_type, topic, payload, headers, \
             created_at, attempts, next_attempt_at) \
             VALUES (?, NULL, ?, 'test.event', 'conformance', X'00', '[\"not\", \"a\", \"map\"]', \
             {NOW_MS}, 0, {NOW_MS})"
        );
        sqlx::query(&sql)
            .bind(id.as_uuid())
            .bind(i64::from(outbox_core::key_hash(id.to_string().as_bytes())))
            .execute(self.store.pool())
            .await
            .unwrap();
        id
    }

    async fn backdate_dead(&self, id: EventId, by: std::time::Duration) {
        let done = sqlx::query("UPDATE outbox_dead_letters SET dead_at = dead_at - ? WHERE id = ?")
            .bind(i64::try_from(by.as_millis()).unwrap())
            .bind(id.as_uuid())
            .execute(self.store.pool())
            .await
            .unwrap();
        assert_eq!(done.rows_affected(), 1, "{id} is not a dead letter");
    }
}

outbox_testkit::store_conformance_tests!(SqliteHarness::new().await);
