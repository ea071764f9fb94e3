//! The in-place upgrade of a queue-mode outbox to the event log (what
//! `migrate` in the default mode does to an existing outbox), against a real
//! PostgreSQL, in its own schema: no pending event is lost, per-key order
//! holds, dead letters move, and a producer still running the queue-mode
//! enqueue keeps working through the `<table>` view.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod log_support;

use log_support::{database_url, pool, SchemaGuard};
use outbox_core::{
    ClaimRequest, ControlStore, DeadLetterQuery, DeadLetterStore, ErrorCode, EventId, LastError,
    NewEvent, PauseNote, RelayId, Resolution, Settlement, ShardSpec, Store, DEFAULT_GROUP,
};
use outbox_postgres::{
    Ident, MigrateError, PgLogOptions, PgLogStore, PgMode, PgOutbox, PgStore, PgStoreOptions,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};

fn ev(key: &str, n: usize) -> NewEvent {
    NewEvent::new("test.event", "upgrade", format!("{key}-{n}").into_bytes()).with_key(key)
}

fn req(n: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new("upgrade-test"),
        batch_size: n,
        lease: Duration::from_secs(600),
        shard: ShardSpec::ALL,
    }
}

async fn relkind(pool: &sqlx::PgPool, schema: &Ident, name: &str) -> Option<String> {
    sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
        .bind(format!("{}.\"{name}\"", schema.quoted()))
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// Claims and delivers until `want` events came back (or 20 s passed),
/// returning their ids and payloads in delivery order.
async fn drain(store: &PgLogStore, want: usize) -> Vec<(EventId, Option<String>, Vec<u8>)> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.len() < want && Instant::now() < deadline {
        let claim = store.claim(&req(100)).await.unwrap();
        if claim.events.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let mut s = Settlement::new();
        for e in &claim.events {
            got.push((e.id, e.key.clone(), e.payload.clone()));
            s = s.with(e.id, Resolution::Delivered);
        }
        assert!(store.settle(claim.token, &s).await.unwrap().all_applied());
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_upgrades_a_queue_outbox_in_place() {
    let pool = pool(8).await;
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let schema = Ident::new(format!("outbox_upg_{}", &suffix[..12])).unwrap();
    let _guard = SchemaGuard(schema.clone());
    let table = Ident::new("events").unwrap();

    // A queue-mode outbox as an earlier version ran it: pending events of
    // two keys, one delivered event kept for retention, one dead letter.
    let queue = PgOutbox::in_mode(schema.clone(), table.clone(), PgMode::Queue).unwrap();
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(queue.migrate(&mut conn).await.unwrap(), vec![1, 2, 3]);
    drop(conn);
    let queue_store = PgStore::from_pool(
        pool.clone(),
        PgStoreOptions::new(database_url())
            .with_schema(schema.clone())
            .with_table(table.clone())
            .with_listen(false),
    )
    .await
    .unwrap();
    let mut tx = pool.begin().await.unwrap();
    queue
        .enqueue_batch(&mut tx, vec![ev("poison", 0)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let claim = queue_store.claim(&req(10)).await.unwrap();
    assert_eq!(claim.events.len(), 1);
    let dead_id = claim.events[0].id;
    let poisoned = Settlement::new().with(
        dead_id,
        Resolution::Dead {
            error: LastError {
                code: ErrorCode::HANDLER_PERMANENT_FAILURE,
                message: "poison".into(),
            },
        },
    );
    assert!(queue_store
        .settle(claim.token, &poisoned)
        .await
        .unwrap()
        .all_applied());
    let mut tx = pool.begin().await.unwrap();
    let pending = queue
        .enqueue_batch(
            &mut tx,
            vec![ev("a", 1), ev("b", 1), ev("a", 2), ev("a", 3), ev("b", 2)],
        )
        .await
        .unwrap();
    let delivered = queue.enqueue(&mut tx, ev("old", 0)).await.unwrap();
    tx.commit().await.unwrap();
    sqlx::query(&format!(
        "UPDATE {}.\"events\" SET delivered_at = now() WHERE id = $1",
        schema.quoted()
    ))
    .bind(delivered.as_uuid())
    .execute(&pool)
    .await
    .unwrap();
    // The queue-mode relays were paused for the upgrade.
    let note = PauseNote::new().with_by("ops").with_reason("upgrade");
    assert!(queue_store
        .set_paused(DEFAULT_GROUP, true, &note)
        .await
        .unwrap());
    drop(queue_store);

    // A producer of the old version keeps a connection with its INSERT
    // prepared (and one notifying, as the queue mode can).
    let mut old_producer = pool.acquire().await.unwrap();
    let notifying = queue.clone().with_notify(true);
    let mut tx = sqlx::Connection::begin(&mut *old_producer).await.unwrap();
    queue.enqueue(&mut tx, ev("c", 1)).await.unwrap();
    tx.commit().await.unwrap();

    // The upgrade: `migrate` in the default mode.
    let log = PgOutbox::new(schema.clone(), table.clone()).unwrap();
    assert_eq!(log.mode(), PgMode::Log);
    let mut conn = pool.acquire().await.unwrap();
    let every: Vec<i32> = outbox_postgres::LOG_MIGRATIONS
        .iter()
        .map(|m| m.version)
        .collect();
    assert_eq!(log.migrate(&mut conn).await.unwrap(), every);
    assert!(log.migrate(&mut conn).await.unwrap().is_empty());
    assert_eq!(
        relkind(&pool, &schema, "events").await.as_deref(),
        Some("v")
    );
    assert_eq!(relkind(&pool, &schema, "events_dead").await, None);
    assert_eq!(relkind(&pool, &schema, "events_migrations").await, None);
    assert_eq!(relkind(&pool, &schema, "events_control").await, None);

    // The queue mode now refuses the outbox with a clear error.
    let err = queue.migrate(&mut conn).await.unwrap_err();
    assert!(matches!(err, MigrateError::ModeConflict { .. }), "{err}");
    assert!(err.to_string().contains("event log"), "{err}");
    drop(conn);

    // The old producer's prepared INSERTs land in the log through the view.
    let mut tx = sqlx::Connection::begin(&mut *old_producer).await.unwrap();
    queue.enqueue(&mut tx, ev("c", 2)).await.unwrap();
    notifying.enqueue(&mut tx, ev("c", 3)).await.unwrap();
    notifying
        .enqueue_batch(&mut tx, vec![ev("a", 4)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    drop(old_producer);
    // And the new handle writes straight into the log.
    let mut tx = pool.begin().await.unwrap();
    log.enqueue(&mut tx, ev("b", 3)).await.unwrap();
    tx.commit().await.unwrap();

    let store = PgLogStore::from_pool(
        pool.clone(),
        PgLogOptions::new(database_url())
            .with_schema(schema.clone())
            .with_table(table.clone())
            .with_background_rotation(false),
    )
    .await
    .unwrap();
    // The pause carried over to the log's default group; resume it.
    let paused = store
        .paused(DEFAULT_GROUP)
        .await
        .unwrap()
        .expect("still paused");
    assert_eq!(
        (paused.by.as_deref(), paused.reason.as_deref()),
        (Some("ops"), Some("upgrade"))
    );
    assert!(store
        .set_paused(DEFAULT_GROUP, false, &PauseNote::new())
        .await
        .unwrap());
    assert_eq!(store.paused(DEFAULT_GROUP).await.unwrap(), None);
    let got = drain(&store, 10).await;
    let ids: Vec<EventId> = got.iter().map(|(id, _, _)| *id).collect();
    for id in &pending {
        assert_eq!(ids.iter().filter(|x| *x == id).count(), 1, "{id} lost");
    }
    assert!(!ids.contains(&delivered), "a delivered event came back");
    assert!(!ids.contains(&dead_id), "a dead letter was replayed");
    assert_eq!(got.len(), 10, "{got:?}");
    // Per-key order: each key's payloads in enqueue order.
    let mut per_key: HashMap<String, Vec<String>> = HashMap::new();
    for (_, key, payload) in &got {
        per_key
            .entry(key.clone().unwrap())
            .or_default()
            .push(String::from_utf8(payload.clone()).unwrap());
    }
    assert_eq!(per_key["a"], ["a-1", "a-2", "a-3", "a-4"]);
    assert_eq!(per_key["b"], ["b-1", "b-2", "b-3"]);
    assert_eq!(per_key["c"], ["c-1", "c-2", "c-3"]);
    let more = store.claim(&req(100)).await.unwrap();
    assert!(more.events.is_empty(), "{:?}", more.events);

    // The dead letter moved with its error.
    let dead = store.list_dead(&DeadLetterQuery::default()).await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].event.id, dead_id);
    assert_eq!(dead[0].error.code, ErrorCode::HANDLER_PERMANENT_FAILURE);
    assert_eq!(dead[0].error.message, "poison");
}

/// A relation of the outbox's name that is not a queue-mode outbox is
/// refused with a clear error and left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_refuses_a_foreign_relation_of_the_outbox_name() {
    let pool = pool(2).await;
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let schema = Ident::new(format!("outbox_upg_{}", &suffix[..12])).unwrap();
    let _guard = SchemaGuard(schema.clone());
    let create = format!(
        "CREATE SCHEMA {s}; CREATE SEQUENCE {s}.\"events\"",
        s = schema.quoted()
    );
    sqlx::Executor::execute(&pool, create.as_str())
        .await
        .unwrap();
    let log = PgOutbox::new(schema.clone(), Ident::new("events").unwrap()).unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let err = log.migrate(&mut conn).await.unwrap_err();
    assert!(matches!(err, MigrateError::ModeConflict { .. }), "{err}");
    assert_eq!(
        relkind(&pool, &schema, "events").await.as_deref(),
        Some("S")
    );
}
