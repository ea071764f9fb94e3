//! The store conformance suite of `outbox-testkit`, run against the
//! event-log store (`PgLogStore`), each case in its own fresh schema.
//!
//! The harness reads rows straight from the tables; what the log design
//! keeps only in memory (which claim holds which event) it reads from the
//! one store instance every `store()` call shares, as one process would.
//!
//! It runs the suite's `single_holder_per_shard` profile: 16 of the 24
//! cases. The other 8 test per-event leases, which this
//! design deliberately does not have (a shard is read by one lease holder
//! through a cursor; see the `outbox_postgres::log` docs):
//! - a second relay claims other events of a shard while the first holds
//!   some: `per_key_order_earlier_event_blocks_later_ones`,
//!   `per_key_order_is_commit_order_not_id_order` (after its commit-order
//!   part, which passes), `released_events_are_not_attempted` (its last
//!   claim, by another relay), `renew_extends_the_lease`,
//!   `settle_records_a_mixed_batch_at_once` (its last claim). Here the
//!   second relay is a standby and gets an empty claim.
//! - after a lease ran out, the re-claimed event has `attempts = 2`:
//!   `leased_events_are_not_reclaimed_until_the_lease_expires`,
//!   `renew_with_a_stale_token_returns_zero`,
//!   `settle_with_a_stale_token_changes_nothing`. Here the new holder
//!   re-reads from the settled position and the event comes with
//!   `attempts = 1`: the holder that lost its lease (a crash, a pause) did
//!   not record an attempt, and DESIGN.md's liveness rule 10 says a relay
//!   crash never counts as an attempt.
//!
//! Everything else these cases check (fencing of the stale token, nothing
//! changed by it, the lease renewed in the table, release undoing the
//! attempt) is checked by `tests/log_store.rs` with one relay per shard.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod log_support;

use log_support::{end_enqueue, LogDb};
use outbox_core::Pooler;
use outbox_core::{EventId, NewEvent, ValidationError};
use outbox_postgres::{PgLogStore, PgOutbox};
use outbox_testkit::store::{RowState, StoreHarness};
use sqlx::PgPool;
use sqlx::Row;

/// The suite's store and producer reach PostgreSQL through `pool` with
/// `outbox`; the harness's own reads and writes go straight to `db`.
struct LogHarness {
    db: LogDb,
    store: PgLogStore,
    pool: PgPool,
    outbox: PgOutbox,
}

impl LogHarness {
    async fn new() -> Self {
        let db = LogDb::new().await;
        let store = db.store().await;
        Self {
            pool: db.pool.clone(),
            outbox: db.log.clone(),
            db,
            store,
        }
    }

    /// The store and the producer through PgBouncer in transaction mode:
    /// the store detects it (`Pooler::Auto`), the producer is told.
    async fn through_pgbouncer() -> Self {
        let db = LogDb::new().await;
        let pool = log_support::pooler_pool(8).await;
        let store = PgLogStore::from_pool(pool.clone(), db.options())
            .await
            .unwrap();
        assert_eq!(store.pooler(), Pooler::Transaction, "PgBouncer detected");
        Self {
            pool,
            outbox: db.log.clone().with_pooler(Pooler::Transaction),
            db,
            store,
        }
    }
}

impl StoreHarness for LogHarness {
    type Store = PgLogStore;

    async fn store(&self) -> PgLogStore {
        self.store.clone()
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
        let group = self.store.group().to_owned();
        let pool = &self.db.pool;
        // Dead letters.
        let dead = sqlx::query(&format!(
            "SELECT last_error_code, attempts FROM {} WHERE grp = $1 AND id = $2",
            self.db.table("_dead")
        ))
        .bind(&group)
        .bind(id.as_uuid())
        .fetch_optional(pool)
        .await
        .unwrap();
        if let Some(row) = dead {
            return RowState::Dead {
                code: outbox_core::ErrorCode::new(row.get::<String, _>(0)),
                attempts: u32::try_from(row.get::<i32, _>(1)).unwrap(),
            };
        }
        // Held by a claim (this process's memory + the cursor lease in the table).
        if let Some(f) = self
            .store
            .in_flight()
            .await
            .into_iter()
            .find(|f| f.id == id)
        {
            let expired: bool = sqlx::query_scalar(&format!(
                "SELECT coalesce(lease_until <= now(), true) FROM {} \
                 WHERE grp = $1 AND shard_total = $2 AND shard_index = $3",
                self.db.table("_cursors")
            ))
            .bind(&group)
            .bind(i32::try_from(f.shard.total()).unwrap())
            .bind(i32::try_from(f.shard.index()).unwrap())
            .fetch_one(pool)
            .await
            .unwrap();
            return RowState::Leased {
                attempts: f.attempts,
                token: f.token,
                locked_by: f.relay.as_str().to_owned(),
                lease_expired: expired,
            };
        }
        // The retry lane.
        let lane = sqlx::query(&format!(
            "SELECT attempts, next_attempt_at > now(), last_error_code FROM {} \
             WHERE grp = $1 AND id = $2",
            self.db.table("_lane")
        ))
        .bind(&group)
        .bind(id.as_uuid())
        .fetch_optional(pool)
        .await
        .unwrap();
        if let Some(row) = lane {
            return RowState::Pending {
                attempts: u32::try_from(row.get::<i32, _>(0)).unwrap(),
                next_attempt_in_future: row.get(1),
                last_error_code: row
                    .get::<Option<String>, _>(2)
                    .map(outbox_core::ErrorCode::new),
            };
        }
        // The log: pending until every cursor of its shard has passed it.
        let passed: Option<Option<bool>> = sqlx::query_scalar(&format!(
            "SELECT bool_and(pg_visible_in_snapshot(e.txid, c.lo) OR (
                        pg_visible_in_snapshot(e.txid, c.hi) AND c.pos_txid IS NOT NULL
                        AND (e.txid, e.seq) <= (c.pos_txid, c.pos_seq)))
             FROM {log} e
             LEFT JOIN {cursors} c
               ON c.grp = $1 AND e.key_hash % c.shard_total = c.shard_index
             WHERE e.id = $2
             GROUP BY e.txid, e.seq
             ORDER BY e.txid DESC, e.seq DESC
             LIMIT 1",
            log = self.db.table(""),
            cursors = self.db.table("_cursors"),
        ))
        .bind(&group)
        .bind(id.as_uuid())
        .fetch_optional(pool)
        .await
        .unwrap();
        match passed {
            None | Some(Some(true)) => RowState::Missing,
            Some(_) => RowState::Pending {
                attempts: 0,
                next_attempt_in_future: false,
                last_error_code: None,
            },
        }
    }

    async fn expire_lease(&self, id: EventId) {
        sqlx::query(&format!(
            "UPDATE {cursors} c SET lease_until = now() - interval '1 second'
             WHERE c.grp = $1 AND EXISTS (
                 SELECT 1 FROM (SELECT key_hash FROM {log} WHERE id = $2
                                UNION ALL SELECT key_hash FROM {lane} WHERE id = $2) e
                 WHERE e.key_hash % c.shard_total = c.shard_index)",
            cursors = self.db.table("_cursors"),
            log = self.db.table(""),
            lane = self.db.table("_lane"),
        ))
        .bind(self.store.group())
        .bind(id.as_uuid())
        .execute(&self.db.pool)
        .await
        .unwrap();
    }

    async fn insert_undecodable(&self) -> EventId {
        let id = EventId::new();
        sqlx::query(&format!(
            "INSERT INTO {} (id, key, key_hash, event_type, topic, payload, headers)
             VALUES ($1, NULL, $2, 'test.event', 'conformance', '\\x00', '[\"not\", \"a\", \"map\"]')",
            self.db.table("")
        ))
        .bind(id.as_uuid())
        .bind(i64::from(outbox_core::key_hash(id.to_string().as_bytes())))
        .execute(&self.db.pool)
        .await
        .unwrap();
        id
    }

    async fn backdate_dead(&self, id: EventId, by: std::time::Duration) {
        let done = sqlx::query(&format!(
            "UPDATE {} SET dead_at = dead_at - $3 * interval '1 microsecond' \
             WHERE grp = $1 AND id = $2",
            self.db.table("_dead")
        ))
        .bind(self.store.group())
        .bind(id.as_uuid())
        .bind(i64::try_from(by.as_micros()).unwrap())
        .execute(&self.db.pool)
        .await
        .unwrap();
        assert_eq!(done.rows_affected(), 1, "{id} is not a dead letter");
    }
}

outbox_testkit::store_conformance_tests!(LogHarness::new().await, single_holder_per_shard);

/// The same suite with the store and the producer behind PgBouncer in
/// transaction mode (`cargo xtask services` starts it on 127.0.0.1:6432).
mod through_pgbouncer {
    use super::*;

    outbox_testkit::store_conformance_tests!(
        LogHarness::through_pgbouncer().await,
        single_holder_per_shard
    );
}
