//! Shared test support: a fresh schema per test, dropped afterwards.
#![allow(dead_code, unreachable_pub)]

use outbox_core::{ClaimRequest, EventId, RelayId, ShardSpec, ValidationError};
use outbox_postgres::{EnqueueError, Ident, PgMode, PgOutbox, PgStore, PgStoreOptions, MIGRATIONS};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};
use std::time::Duration;

/// `DATABASE_URL`, or the local default.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// `PGBOUNCER_URL`, or the local default: PgBouncer in transaction mode
/// in front of the test database (`cargo xtask services` starts it).
pub fn pgbouncer_url() -> String {
    std::env::var("PGBOUNCER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432/test".to_owned())
}

/// A pool through PgBouncer in transaction mode; fails with a clear message
/// when it is not running.
pub async fn pooler_pool(max: u32) -> PgPool {
    connect(
        &pgbouncer_url(),
        max,
        "PgBouncer",
        "start it with `cargo xtask services` or set PGBOUNCER_URL",
    )
    .await
}

/// A pool of `max` on `url`; panics naming `what` and `how` to fix it.
async fn connect(url: &str, max: u32, what: &str, how: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .connect(url)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot connect to {what} at {} ({e}); {how}",
                outbox_core::redact_url(url)
            )
        })
}

/// A fresh schema name `outbox_test_<random>`.
pub fn fresh_schema() -> Ident {
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    Ident::new(format!("outbox_test_{}", &suffix[..12])).unwrap()
}

/// A pool on the test database; fails with a clear message when PostgreSQL is down.
pub async fn pool(max: u32) -> PgPool {
    connect(
        &database_url(),
        max,
        "PostgreSQL",
        "start it or set DATABASE_URL",
    )
    .await
}

/// Drops its schema (CASCADE) when dropped, even when the test panicked.
#[derive(Debug)]
pub struct SchemaGuard(pub Ident);

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        let schema = self.0.clone();
        // A separate thread and runtime: Drop cannot await, and the test's
        // runtime may be shutting down.
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                if let Ok(mut conn) = PgConnection::connect(&database_url()).await {
                    // Bounded: a store task of the test's runtime that still
                    // holds a transaction (its runtime is blocked in this
                    // drop, so it is never dropped) must not hang the test
                    // forever; the schema is then left behind.
                    let _ = sqlx::raw_sql(&format!(
                        "SET lock_timeout = '10s'; DROP SCHEMA IF EXISTS {} CASCADE",
                        schema.quoted()
                    ))
                    .execute(&mut conn)
                    .await;
                }
            });
        });
        let _ = handle.join();
    }
}

/// A migrated outbox in a fresh schema.
#[derive(Debug)]
pub struct TestDb {
    pub pool: PgPool,
    pub schema: Ident,
    pub outbox: PgOutbox,
    pub guard: SchemaGuard,
}

impl TestDb {
    pub async fn new() -> Self {
        let pool = pool(6).await;
        let schema = fresh_schema();
        let guard = SchemaGuard(schema.clone());
        let outbox =
            PgOutbox::in_mode(schema.clone(), Ident::new("events").unwrap(), PgMode::Queue)
                .unwrap();
        let mut conn = pool.acquire().await.unwrap();
        let all: Vec<i32> = MIGRATIONS.iter().map(|m| m.version).collect();
        assert_eq!(outbox.migrate(&mut conn).await.unwrap(), all);
        drop(conn);
        Self {
            pool,
            schema,
            outbox,
            guard,
        }
    }

    pub fn options(&self) -> PgStoreOptions {
        PgStoreOptions::new(database_url())
            .with_schema(self.schema.clone())
            .with_table(Ident::new("events").unwrap())
    }

    /// A store on this schema's pool, without the LISTEN task.
    pub async fn store(&self) -> PgStore {
        PgStore::from_pool(self.pool.clone(), self.options().with_listen(false))
            .await
            .unwrap()
    }

    /// `"schema"."events"`.
    pub fn events(&self) -> String {
        format!("{}.\"events\"", self.schema.quoted())
    }
}

/// Ends a conformance harness's enqueue in `tx`: a validation error is the
/// suite's answer (the transaction is dropped), any other error fails the
/// test; otherwise commits (`commit`) or rolls back.
pub async fn end_enqueue(
    tx: Transaction<'_, Postgres>,
    result: Result<Vec<EventId>, EnqueueError>,
    commit: bool,
) -> Result<Vec<EventId>, ValidationError> {
    let ids = match result {
        Ok(ids) => ids,
        Err(EnqueueError::Invalid { source, .. }) => return Err(source),
        Err(e) => panic!("enqueue failed: {e}"),
    };
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    Ok(ids)
}

/// A claim of up to `n` events by `relay`, all shards, a 10-minute lease.
pub fn req(relay: &str, n: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new(relay),
        batch_size: n,
        lease: Duration::from_secs(600),
        shard: ShardSpec::ALL,
    }
}
