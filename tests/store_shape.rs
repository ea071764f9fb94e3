//! Every store has the same constructors (issue 44): `connect(options)`,
//! `from_pool(pool, options)` and `migrate()`, each async and fallible.
//! Mostly a compile-time check: a store whose constructor changes shape no
//! longer implements [`StoreShape`], and this test stops building; the one
//! test runs SQLite's through the trait.
#![allow(clippy::unwrap_used, missing_docs)]

use std::future::Future;

/// The constructors every store has, with the store's own option, pool and
/// error types.
pub trait StoreShape: Sized {
    /// The store's options (its URL, names, pool settings).
    type Options;
    /// The sqlx pool it wraps.
    type Pool;
    /// What opening it fails with.
    type Error;
    /// What migrating fails with.
    type MigrateError;

    /// Opens a pool to the options' URL.
    fn connect(options: Self::Options) -> impl Future<Output = Result<Self, Self::Error>>;

    /// Wraps a pool the application already has.
    fn from_pool(
        pool: Self::Pool,
        options: Self::Options,
    ) -> impl Future<Output = Result<Self, Self::Error>>;

    /// Applies the missing migrations; the versions applied.
    fn migrate(&self) -> impl Future<Output = Result<Vec<i32>, Self::MigrateError>>;
}

impl StoreShape for outbox_sqlite::SqliteStore {
    type Options = outbox_sqlite::SqliteStoreOptions;
    type Pool = sqlx::SqlitePool;
    type Error = outbox_sqlite::StoreError;
    type MigrateError = outbox_sqlite::MigrateError;

    fn connect(options: Self::Options) -> impl Future<Output = Result<Self, Self::Error>> {
        Self::connect(options)
    }

    fn from_pool(
        pool: Self::Pool,
        options: Self::Options,
    ) -> impl Future<Output = Result<Self, Self::Error>> {
        Self::from_pool(pool, options)
    }

    fn migrate(&self) -> impl Future<Output = Result<Vec<i32>, Self::MigrateError>> {
        self.migrate()
    }
}

impl StoreShape for outbox_postgres::PgStore {
    type Options = outbox_postgres::PgStoreOptions;
    type Pool = sqlx::PgPool;
    type Error = outbox_postgres::StoreError;
    type MigrateError = outbox_postgres::MigrateError;

    fn connect(options: Self::Options) -> impl Future<Output = Result<Self, Self::Error>> {
        Self::connect(options)
    }

    fn from_pool(
        pool: Self::Pool,
        options: Self::Options,
    ) -> impl Future<Output = Result<Self, Self::Error>> {
        Self::from_pool(pool, options)
    }

    fn migrate(&self) -> impl Future<Output = Result<Vec<i32>, Self::MigrateError>> {
        self.migrate()
    }
}

impl StoreShape for outbox_postgres::PgLogStore {
    type Options = outbox_postgres::PgLogOptions;
    type Pool = sqlx::PgPool;
    type Error = outbox_postgres::StoreError;
    type MigrateError = outbox_postgres::MigrateError;

    fn connect(options: Self::Options) -> impl Future<Output = Result<Self, Self::Error>> {
        Self::connect(options)
    }

    fn from_pool(
        pool: Self::Pool,
        options: Self::Options,
    ) -> impl Future<Output = Result<Self, Self::Error>> {
        Self::from_pool(pool, options)
    }

    fn migrate(&self) -> impl Future<Output = Result<Vec<i32>, Self::MigrateError>> {
        self.migrate()
    }
}

/// Opens a store on a pool through the shared shape and migrates it.
async fn open_and_migrate<S: StoreShape>(pool: S::Pool, options: S::Options) -> Vec<i32>
where
    S::Error: std::fmt::Debug,
    S::MigrateError: std::fmt::Debug,
{
    let store = S::from_pool(pool, options).await.unwrap();
    store.migrate().await.unwrap()
}

#[tokio::test]
async fn a_store_opens_on_a_pool_and_migrates_through_the_shared_shape() {
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect("sqlite::memory:")
        .await
        .unwrap();
    let applied = open_and_migrate::<outbox_sqlite::SqliteStore>(
        pool.clone(),
        outbox_sqlite::SqliteStoreOptions::new("sqlite::memory:"),
    )
    .await;
    assert!(!applied.is_empty(), "a fresh database gets every migration");
    let again = open_and_migrate::<outbox_sqlite::SqliteStore>(
        pool,
        outbox_sqlite::SqliteStoreOptions::new("sqlite::memory:"),
    )
    .await;
    assert!(again.is_empty(), "migrated once: nothing more to apply");
}
