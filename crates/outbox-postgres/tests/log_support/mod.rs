//! Shared support of the event-log tests: a fresh schema per test (dropped
//! afterwards), a migrated log, row-level reads straight from the tables.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use outbox_core::{
    Claim, ClaimRequest, EventId, NewEvent, RelayId, Resolution, Settlement, ShardSpec, Store,
};
use outbox_postgres::{Ident, PgLogOptions, PgLogStore, PgOutbox};
use sqlx::{PgPool, Row};
use std::time::Duration;

// The connection and schema clean-up the store tests use.
#[path = "../common/mod.rs"]
mod common;
#[allow(unused_imports)] // each test binary uses a different subset
pub use common::{
    database_url, end_enqueue, pgbouncer_url, pool, pooler_pool, SchemaGuard, TestDb,
};

/// A migrated event log in a fresh schema `outbox_log_<random>`, table `events`.
#[derive(Debug)]
pub struct LogDb {
    pub pool: PgPool,
    pub schema: Ident,
    pub log: PgOutbox,
    pub guard: SchemaGuard,
}

impl LogDb {
    pub async fn new() -> Self {
        Self::with_pool_size(8).await
    }

    pub async fn with_pool_size(n: u32) -> Self {
        let pool = pool(n).await;
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let schema = Ident::new(format!("outbox_log_{}", &suffix[..12])).unwrap();
        let guard = SchemaGuard(schema.clone());
        let log = PgOutbox::new(schema.clone(), Ident::new("events").unwrap()).unwrap();
        let mut conn = pool.acquire().await.unwrap();
        assert_eq!(log.migrate(&mut conn).await.unwrap(), all_log_versions());
        assert!(log.migrate(&mut conn).await.unwrap().is_empty());
        drop(conn);
        Self {
            pool,
            schema,
            log,
            guard,
        }
    }

    /// Options for a store on this schema (no background rotation: tests
    /// rotate explicitly).
    pub fn options(&self) -> PgLogOptions {
        PgLogOptions::new(database_url())
            .with_schema(self.schema.clone())
            .with_table(Ident::new("events").unwrap())
            .with_background_rotation(false)
    }

    pub async fn store(&self) -> PgLogStore {
        self.store_with(self.options()).await
    }

    pub async fn store_with(&self, options: PgLogOptions) -> PgLogStore {
        PgLogStore::from_pool(self.pool.clone(), options)
            .await
            .unwrap()
    }

    /// `"schema".events_log<suffix>`.
    pub fn table(&self, suffix: &str) -> String {
        format!("{}.\"events_log{suffix}\"", self.schema.quoted())
    }

    /// Enqueues and commits one transaction.
    pub async fn enqueue(&self, events: Vec<NewEvent>) -> Vec<EventId> {
        let mut tx = self.pool.begin().await.unwrap();
        let ids = self.log.enqueue_batch(&mut tx, events).await.unwrap();
        tx.commit().await.unwrap();
        ids
    }

    /// `(n_live_tup, n_dead_tup)` of each partition, after flushing this
    /// backend's statistics.
    pub async fn partition_tuples(&self) -> Vec<(i64, i64)> {
        let mut conn = self.pool.acquire().await.unwrap();
        let _ = sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&mut *conn)
            .await;
        let mut out = Vec::new();
        for i in 0..3 {
            let row = sqlx::query(
                "SELECT coalesce(n_live_tup, 0), coalesce(n_dead_tup, 0) \
                 FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = $2",
            )
            .bind(self.schema.as_str())
            .bind(format!("events_log_{i}"))
            .fetch_optional(&mut *conn)
            .await
            .unwrap();
            out.push(row.map_or((0, 0), |r| (r.get(0), r.get(1))));
        }
        out
    }

    /// Rows in each partition.
    pub async fn partition_rows(&self) -> Vec<i64> {
        let mut out = Vec::new();
        for i in 0..3 {
            let n: i64 = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM {}",
                self.table(&format!("_{i}"))
            ))
            .fetch_one(&self.pool)
            .await
            .unwrap();
            out.push(n);
        }
        out
    }

    /// Makes every cursor's lease run out (database clock).
    pub async fn expire_leases(&self) {
        sqlx::query(&format!(
            "UPDATE {} SET lease_until = now() - interval '1 second'",
            self.table("_cursors")
        ))
        .execute(&self.pool)
        .await
        .unwrap();
    }
}

/// Every event-log migration version, in order.
pub fn all_log_versions() -> Vec<i32> {
    outbox_postgres::LOG_MIGRATIONS
        .iter()
        .map(|m| m.version)
        .collect()
}

/// Waits until `f` returns true, polling every 20 ms, up to `limit`.
pub async fn eventually<F, Fut>(limit: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// The lease of the claims made by [`claim`]: long enough never to run out
/// inside a test.
pub const LEASE: Duration = Duration::from_secs(600);

/// A claim of up to `n` events of every shard by `relay`.
pub fn req(relay: &str, n: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new(relay),
        batch_size: n,
        lease: LEASE,
        shard: ShardSpec::ALL,
    }
}

/// Claims up to `n` events as `relay`.
pub async fn claim(store: &PgLogStore, relay: &str, n: u32) -> Claim {
    store.claim(&req(relay, n)).await.unwrap()
}

/// The claimed events' ids, in claim order.
pub fn ids(c: &Claim) -> Vec<EventId> {
    c.events.iter().map(|e| e.id).collect()
}

/// Settles every event of `c` as delivered (all must apply).
pub async fn deliver(store: &PgLogStore, c: &Claim) {
    let s = ids(c)
        .into_iter()
        .fold(Settlement::new(), |s, id| s.with(id, Resolution::Delivered));
    let r = store.settle(c.token, &s).await.unwrap();
    assert!(r.all_applied(), "{r:?}");
}
