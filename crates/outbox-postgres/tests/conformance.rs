//! The store conformance suite of `outbox-testkit`, run unchanged against
//! PostgreSQL, each case in its own fresh schema.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use common::{end_enqueue, TestDb};
use outbox_core::Pooler;
use outbox_core::{EventId, FencingToken, NewEvent, ValidationError};
use outbox_postgres::{PgOutbox, PgStore};
use outbox_testkit::store::{RowState, StoreHarness};
use sqlx::PgPool;
use sqlx::Row;

/// The suite's store and producer reach PostgreSQL through `pool` with
/// `outbox`; the harness's own reads and writes go straight to `db`.
struct PgHarness {
    db: TestDb,
    pool: PgPool,
    outbox: PgOutbox,
}

impl PgHarness {
    async fn new() -> Self {
        let db = TestDb::new().await;
        Self {
            pool: db.pool.clone(),
            outbox: db.outbox.clone(),
            db,
        }
    }

    /// The store and the producer through PgBouncer in transaction mode:
    /// the store detects it (`Pooler::Auto`), the producer is told.
    async fn through_pgbouncer() -> Self {
        let db = TestDb::new().await;
        Self {
            pool: common::pooler_pool(6).await,
            outbox: db.outbox.clone().with_pooler(Pooler::Transaction),
            db,
        }
    }
}

impl StoreHarness for PgHarness {
    type Store = PgStore;

    async fn store(&self) -> PgStore {
        PgStore::from_pool(self.pool.clone(), self.db.options().with_listen(false))
            .await
            .unwrap()
    }

    async fn enqueue(
        &self,
        events: Vec<NewEvent>,
        commit: bool,
    ) -> Result<Vec<EventId>, ValidationError> {
        let mut tx = self.pool.begin().await.unwrap();
        let result = if events.len() == 1 {
            let event = events.into_iter().next().unwrap();
            self.outbox.enqueue(&mut tx, event).await.map(|id| vec![id])
        } else {
            self.outbox.enqueue_batch(&mut tx, events).await
        };
        end_enqueue(tx, result, commit).await
    }

    async fn snapshot(&self, id: EventId) -> RowState {
        let row = sqlx::query(&format!(
            "SELECT attempts, next_attempt_at > now(), last_error_code, lease_token, locked_by, \
                    locked_until <= now() \
             FROM {} WHERE id = $1",
            self.db.events()
        ))
        .bind(id.as_uuid())
        .fetch_optional(&self.db.pool)
        .await
        .unwrap();
        if let Some(row) = row {
            let attempts = u32::try_from(row.get::<i32, _>(0)).unwrap();
            let token: Option<uuid::Uuid> = row.get(3);
            return match token {
                None => RowState::Pending {
                    attempts,
                    next_attempt_in_future: row.get(1),
                    last_error_code: row
                        .get::<Option<String>, _>(2)
                        .map(outbox_core::ErrorCode::new),
                },
                Some(token) => RowState::Leased {
                    attempts,
                    token: FencingToken::from_uuid(token),
                    locked_by: row.get(4),
                    lease_expired: row.get(5),
                },
            };
        }
        let row = sqlx::query(&format!(
            "SELECT last_error_code, attempts FROM {}.\"events_dead\" WHERE id = $1",
            self.db.schema.quoted()
        ))
        .bind(id.as_uuid())
        .fetch_optional(&self.db.pool)
        .await
        .unwrap();
        match row {
            Some(row) => RowState::Dead {
                code: outbox_core::ErrorCode::new(row.get::<String, _>(0)),
                attempts: u32::try_from(row.get::<i32, _>(1)).unwrap(),
            },
            None => RowState::Missing,
        }
    }

    async fn expire_lease(&self, id: EventId) {
        // While leased, next_attempt_at mirrors locked_until (see the crate docs).
        let done = sqlx::query(&format!(
            "UPDATE {} SET locked_until = now() - interval '1 second', \
                           next_attempt_at = now() - interval '1 second' \
             WHERE id = $1 AND lease_token IS NOT NULL",
            self.db.events()
        ))
        .bind(id.as_uuid())
        .execute(&self.db.pool)
        .await
        .unwrap();
        assert_eq!(done.rows_affected(), 1, "event {id} was not leased");
    }

    async fn insert_undecodable(&self) -> EventId {
        // Valid JSON, but not an object of strings.
        let e = NewEvent::new("undecodable", "pg", b"x".to_vec());
        sqlx::query(&format!(
            "INSERT INTO {} (id, key, key_hash, event_type, topic, payload, headers) \
             VALUES ($1, NULL, $2, 'undecodable', 'pg', '\\x78', '[\"not\", \"a\", \"map\"]'::jsonb)",
            self.db.events()
        ))
        .bind(e.id().as_uuid())
        .bind(i64::from(e.key_hash()))
        .execute(&self.db.pool)
        .await
        .unwrap();
        e.id()
    }

    async fn backdate_dead(&self, id: EventId, by: std::time::Duration) {
        let done = sqlx::query(&format!(
            "UPDATE {}.\"events_dead\" SET dead_at = dead_at - $2 * interval '1 microsecond' \
             WHERE id = $1",
            self.db.schema.quoted()
        ))
        .bind(id.as_uuid())
        .bind(i64::try_from(by.as_micros()).unwrap())
        .execute(&self.db.pool)
        .await
        .unwrap();
        assert_eq!(done.rows_affected(), 1, "{id} is not a dead letter");
    }
}

outbox_testkit::store_conformance_tests!(PgHarness::new().await);

/// The same suite with the store and the producer behind PgBouncer in
/// transaction mode (`cargo xtask services` starts it on 127.0.0.1:6432).
mod through_pgbouncer {
    use super::*;

    outbox_testkit::store_conformance_tests!(PgHarness::through_pgbouncer().await);
}
