//! PostgreSQL pieces of the binary's tests: the database URL, a fresh
//! schema per test, a schema migrated by `outbox-relay migrate`, and the
//! application's event-log handle on it.

use super::{assert_success, relay};
use outbox_postgres::{sqlx, Ident, PgLogOptions, PgLogStore};

/// `DATABASE_URL`, default the loopback server's `test` database.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A fresh schema name `<prefix>_<random>` (not created) and a pool on
/// [`database_url`].
pub async fn fresh_schema(prefix: &str) -> (String, sqlx::PgPool) {
    let schema = format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let pool = sqlx::PgPool::connect(&database_url())
        .await
        .unwrap_or_else(|e| {
            panic!("PostgreSQL is not reachable ({e}); start it or set DATABASE_URL")
        });
    (schema, pool)
}

/// [`fresh_schema`] with the event log (the default mode) created in it by
/// `outbox-relay migrate`.
pub async fn migrated_log(prefix: &str) -> (String, sqlx::PgPool) {
    migrated(prefix, &[]).await
}

/// [`fresh_schema`] with a queue-mode outbox created in it by
/// `outbox-relay migrate --pg-mode queue`.
pub async fn migrated_queue(prefix: &str) -> (String, sqlx::PgPool) {
    migrated(prefix, &["--pg-mode", "queue"]).await
}

async fn migrated(prefix: &str, mode: &[&str]) -> (String, sqlx::PgPool) {
    let (schema, pool) = fresh_schema(prefix).await;
    let out = relay(&[
        "migrate",
        "--store",
        &database_url(),
        "--pg-schema",
        &schema,
    ])
    .args(mode)
    .output()
    .expect("run outbox-relay migrate");
    assert_success(&out, "migrate");
    (schema, pool)
}

/// The event log of `schema` as an application (or another relay) opens
/// it, with `configure` applied; no background rotation.
pub async fn log_store(
    schema: &str,
    configure: impl FnOnce(PgLogOptions) -> PgLogOptions,
) -> PgLogStore {
    let options = PgLogOptions::new(database_url())
        .with_schema(Ident::new(schema.to_owned()).expect("a valid schema name"))
        .with_background_rotation(false);
    PgLogStore::connect(configure(options))
        .await
        .expect("open the event log")
}

/// Drops `schema` and everything in it.
pub async fn drop_schema(pool: &sqlx::PgPool, schema: &str) {
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(pool)
        .await
        .expect("drop the test schema");
}
