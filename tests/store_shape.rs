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

/// The shape, delegated to the store's own inherent constructors: a store
/// whose constructor changes shape fails to build here.
macro_rules! store_shape {
    ($store:ty, $options:ty, $pool:ty, $error:ty, $migrate_error:ty) => {
        impl StoreShape for $store {
            type Options = $options;
            type Pool = $pool;
            type Error = $error;
            type MigrateError = $migrate_error;

            fn connect(options: Self::Options) -> impl Future<Output = Result<Self, Self::Error>> {
                <$store>::connect(options)
            }

            fn from_pool(
                pool: Self::Pool,
                options: Self::Options,
            ) -> impl Future<Output = Result<Self, Self::Error>> {
                <$store>::from_pool(pool, options)
            }

            fn migrate(&self) -> impl Future<Output = Result<Vec<i32>, Self::MigrateError>> {
                <$store>::migrate(self)
            }
        }
    };
}

store_shape!(
    outbox_sqlite::SqliteStore,
    outbox_sqlite::SqliteStoreOptions,
    sqlx::SqlitePool,
    outbox_sqlite::StoreError,
    outbox_sqlite::MigrateError
);
store_shape!(
    outbox_postgres::PgStore,
    outbox_postgres::PgStoreOptions,
    sqlx::PgPool,
    outbox_postgres::StoreError,
    outbox_postgres::MigrateError
);
store_shape!(
    outbox_postgres::PgLogStore,
    outbox_postgres::PgLogOptions,
    sqlx::PgPool,
    outbox_postgres::StoreError,
    outbox_postgres::MigrateError
);

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
