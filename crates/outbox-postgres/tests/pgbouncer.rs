//! Both stores through PgBouncer in transaction mode (`PGBOUNCER_URL`,
//! default `postgres://postgres@127.0.0.1:6432/test`; `cargo xtask
//! services` starts it): detected at connect, every operation of a relay
//! and of an operator run, and afterwards no statement is left prepared on
//! any of the pooler's server connections (a name left there is the next
//! client's `42P05`, or runs as its statement).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod log_support;

use log_support::{pgbouncer_url, pool, pooler_pool, LogDb, TestDb};
use outbox_core::{
    ClaimRequest, ControlStore, DeadLetterFilter, DeadLetterQuery, DeadLetterStore, ErrorCode,
    LastError, NewEvent, PauseNote, Pooler, RelayId, Resolution, Settlement, ShardSpec, Store,
};
use outbox_postgres::{PgLogOptions, PgLogStore, PgOutbox, PgStore, PgStoreOptions, StoreError};
use sqlx::{PgPool, Row};
use std::time::Duration;

fn req(relay: &str) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new(relay),
        batch_size: 100,
        lease: Duration::from_secs(30),
        shard: ShardSpec::ALL,
    }
}

async fn produce(pool: &PgPool, outbox: &PgOutbox, n: usize) {
    for i in 0..n {
        let mut tx = pool.begin().await.unwrap();
        outbox
            .enqueue(
                &mut tx,
                NewEvent::new("pooled", "t", vec![0, 1, 2]).with_key(format!("k{}", i % 5)),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
}

/// Claims everything, dead-letters the first event and delivers the rest.
async fn drain<S: Store>(store: &S) -> usize
where
    S::Error: std::fmt::Debug,
{
    let mut seen = 0;
    let mut first = true;
    for _ in 0..20 {
        let claim = store.claim(&req("pooled-relay")).await.unwrap();
        if claim.events.is_empty() {
            break;
        }
        seen += claim.events.len();
        let mut settlement = Settlement::new();
        for e in &claim.events {
            let r = if first {
                first = false;
                Resolution::Dead {
                    error: LastError {
                        code: ErrorCode::new("POOLED"),
                        message: "through the pooler".into(),
                    },
                }
            } else {
                Resolution::Delivered
            };
            settlement = settlement.with(e.id, r);
        }
        store.settle(claim.token, &settlement).await.unwrap();
    }
    seen
}

/// The database's clock now (the simple protocol: nothing prepared).
async fn server_now() -> String {
    let pool = pool(1).await;
    let row = sqlx::raw_sql("SELECT clock_timestamp()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    row.get::<String, _>(0)
}

/// One check at a time in this binary: each holds the pooler's server
/// connections.
static CHECKING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Every server connection of the pooler's pool for the test user that can
/// be had (up to PgBouncer's default_pool_size, 20, in
/// xtask/src/pgbouncer.rs; a connection another process holds for 2 s is
/// left out), held at once, each in its own transaction, asked for the
/// statements prepared on it since `since` (server connections outlive a
/// test run: an older name is not this run's), with the simple protocol
/// (nothing prepared by the asking). Returns them and how many server
/// connections were asked.
async fn statements_left_on_the_servers(since: &str) -> (Vec<String>, usize) {
    let _one = CHECKING.lock().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&pgbouncer_url())
        .await
        .unwrap();
    let mut held = Vec::new();
    let mut names = Vec::new();
    for _ in 0..20 {
        let begun = tokio::time::timeout(Duration::from_secs(2), async {
            let mut tx = pool.begin().await?;
            let rows = sqlx::raw_sql(&format!(
                "SELECT pg_backend_pid()::text || ': ' || name || ': ' || statement \
                 FROM pg_prepared_statements WHERE prepare_time >= '{since}'::timestamptz"
            ))
            .fetch_all(&mut *tx)
            .await?;
            Ok::<_, sqlx::Error>((tx, rows))
        })
        .await;
        let Ok(result) = begun else { break };
        let (tx, rows) = result.unwrap();
        names.extend(rows.iter().map(|r| r.get::<String, _>(0)));
        held.push(tx);
    }
    let asked = held.len();
    drop(held);
    pool.close().await;
    (names, asked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_runs_through_pgbouncer_and_leaves_no_statement_behind() {
    let since = server_now().await;
    let db = LogDb::new().await;
    let pool = pooler_pool(6).await;
    let store = PgLogStore::from_pool(pool.clone(), db.options())
        .await
        .unwrap();
    assert_eq!(store.pooler(), Pooler::Transaction, "detected (auto)");
    let direct = db.store().await;
    assert_eq!(direct.pooler(), Pooler::None);
    produce(&pool, &store.outbox().clone(), 30).await;
    assert_eq!(drain(&store).await, 30);
    let dead = store.list_dead(&DeadLetterQuery::default()).await.unwrap();
    assert_eq!(dead.len(), 1);
    // What an operator runs: status, groups, relays, rotation, identity,
    // pause and resume, a replay.
    let status = store.status().await.unwrap();
    assert_eq!(status.dead, 1, "{status:?}");
    assert!(!store.groups().await.unwrap().is_empty());
    store.relays().await.unwrap();
    store.horizon().await.unwrap();
    store.rotation_hold().await.unwrap();
    store.rotate_now().await.unwrap();
    assert!(store.identity().await.unwrap().matches());
    assert!(store
        .set_paused(store.group(), true, &PauseNote::new())
        .await
        .unwrap());
    assert!(store.paused(store.group()).await.unwrap().is_some());
    assert!(store
        .set_paused(store.group(), false, &PauseNote::new())
        .await
        .unwrap());
    assert_eq!(
        store
            .retry_dead(&DeadLetterFilter::default())
            .await
            .unwrap(),
        1
    );
    assert_eq!(drain(&store).await, 1, "the replayed dead letter");
    drop(store);
    let (left, asked) = statements_left_on_the_servers(&since).await;
    assert!(asked >= 4, "only {asked} server connections could be asked");
    assert!(left.is_empty(), "statements left prepared: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_table_runs_through_pgbouncer_and_leaves_no_statement_behind() {
    let since = server_now().await;
    let db = TestDb::new().await;
    let store = PgStore::connect(
        PgStoreOptions::new(pgbouncer_url())
            .with_schema(db.schema.clone())
            .with_table(outbox_postgres::Ident::new("events").unwrap()),
    )
    .await
    .unwrap();
    assert_eq!(store.pooler(), Pooler::Transaction, "detected (auto)");
    let pool = pooler_pool(4).await;
    produce(&pool, &store.outbox().clone(), 20).await;
    assert_eq!(drain(&store).await, 20);
    assert_eq!(store.stats().await.unwrap().dead, 1);
    store.stats_by_shard(4).await.unwrap();
    drop(store);
    let (left, asked) = statements_left_on_the_servers(&since).await;
    assert!(asked >= 4, "only {asked} server connections could be asked");
    assert!(left.is_empty(), "statements left prepared: {left:?}");
}

/// Told there is no pooler, the store sends its settings at startup and
/// PgBouncer refuses them: the error names the setting to change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn told_none_through_pgbouncer_the_error_names_the_setting() {
    let err = PgLogStore::connect(
        PgLogOptions::new(pgbouncer_url())
            .with_pooler(Pooler::None)
            .with_connect_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, StoreError::Connect { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("unsupported startup parameter") && text.contains("--pg-pooler transaction"),
        "{text}"
    );
}

/// `session` (PgBouncer in session mode refuses the startup `options` as
/// transaction mode does): the settings are `SET` on each new connection,
/// statements stay prepared. Shown straight against PostgreSQL, where the
/// startup route would have worked too: `jit` is off on every connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_sets_the_settings_on_each_new_connection() {
    let db = LogDb::new().await;
    let store = PgLogStore::connect(db.options().with_pooler(Pooler::Session))
        .await
        .unwrap();
    assert_eq!(store.pooler(), Pooler::None, "a session is a session");
    let mut conns = Vec::new();
    for _ in 0..3 {
        let mut conn = store.pool().acquire().await.unwrap();
        let row = sqlx::raw_sql("SHOW jit")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(row.get::<String, _>(0), "off");
        conns.push(conn);
    }
}
