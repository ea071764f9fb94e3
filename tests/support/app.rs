//! The application side: a business table (`orders`) and the outbox in one
//! database, written in one transaction. One implementation per store.

use outbox_core::{EventId, NewEvent, Store, ValidationError};
use outbox_postgres::{Ident, PgStore, PgStoreOptions};
use outbox_sqlite::SqliteStore;
use std::future::Future;
use std::time::Duration;

/// A business row of the application's own `orders` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    /// Primary key.
    pub id: i64,
    /// Customer name; also the key of the order's events.
    pub customer: String,
    /// Order total in cents.
    pub total_cents: i64,
}

/// How an application transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxEnd {
    /// `COMMIT`: the order and its events become visible together.
    Commit,
    /// `ROLLBACK`: neither the order nor its events ever existed.
    Rollback,
}

impl TxEnd {
    /// Ends `tx` this way.
    async fn finish<DB: sqlx::Database>(self, tx: sqlx::Transaction<'_, DB>) {
        match self {
            TxEnd::Commit => tx.commit().await.expect("COMMIT"),
            TxEnd::Rollback => tx.rollback().await.expect("ROLLBACK"),
        }
    }
}

/// Ends the transaction of a `try_enqueue`: `COMMIT` when the enqueue
/// worked; `ROLLBACK` and the reason when `invalid` finds the events refused
/// as invalid (it hands any other error back); panics on any other error.
async fn end_try_enqueue<DB: sqlx::Database, E: std::fmt::Display>(
    tx: sqlx::Transaction<'_, DB>,
    result: Result<Vec<EventId>, E>,
    invalid: impl FnOnce(E) -> Result<ValidationError, E>,
) -> Result<Vec<EventId>, ValidationError> {
    match result.map_err(invalid) {
        Ok(ids) => {
            tx.commit().await.expect("COMMIT");
            Ok(ids)
        }
        Err(Ok(source)) => {
            tx.rollback().await.expect("ROLLBACK");
            Err(source)
        }
        Err(Err(e)) => panic!("enqueue failed: {e}"),
    }
}

/// Rows left in the outbox tables, read with plain SQL (not through the
/// store's own stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxRows {
    /// Rows in the hot events table (pending, leased or scheduled for retry).
    pub events: i64,
    /// Rows in the dead-letter table.
    pub dead: i64,
}

/// An application on one store: its database, its `orders` table, its
/// outbox. [`App::start`] fails the test with a clear message when the
/// database cannot be reached.
///
/// The futures are not required to be `Send`: the tests drive them on the
/// test's own task (and sqlx's executor lifetimes defeat the compiler's
/// `Send` proof for some of them).
pub trait App: Sized + Send + Sync + 'static {
    /// The outbox store the relay claims from.
    type Store: Store + Clone;

    /// Store name for messages (`sqlite`, `postgres`).
    const NAME: &'static str;

    /// A fresh database (temporary file / fresh schema), migrated, with an
    /// empty `orders` table.
    fn start() -> impl Future<Output = Self>;

    /// A handle on the store, for the relay.
    fn store(&self) -> Self::Store;

    /// One application transaction: inserts `order`, enqueues `events` (in
    /// order, one INSERT each) and ends it with `end`. Returns the event ids.
    fn write_order(
        &self,
        order: &Order,
        events: Vec<NewEvent>,
        end: TxEnd,
    ) -> impl Future<Output = Vec<EventId>>;

    /// Enqueues `events` in a transaction of their own and commits it. An
    /// event the store refuses comes back as its [`ValidationError`] (the
    /// transaction is rolled back: nothing is written); any other failure
    /// fails the test.
    fn try_enqueue(
        &self,
        events: Vec<NewEvent>,
    ) -> impl Future<Output = Result<Vec<EventId>, ValidationError>>;

    /// Ids in the `orders` table, ascending.
    fn order_ids(&self) -> impl Future<Output = Vec<i64>>;

    /// What the outbox tables hold.
    fn outbox_rows(&self) -> impl Future<Output = OutboxRows>;

    /// Closes connections and removes the database (file / schema).
    fn cleanup(self) -> impl Future<Output = ()>;
}

/// SQLite in a temporary file (WAL mode, as an application would run it).
#[derive(Debug)]
pub struct SqliteApp {
    store: SqliteStore,
    dir: tempfile::TempDir,
}

impl App for SqliteApp {
    type Store = SqliteStore;
    const NAME: &'static str = "sqlite";

    async fn start() -> Self {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let url = format!("sqlite://{}", dir.path().join("app.db").display());
        let store = SqliteStore::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("cannot open SQLite database {url}: {e}"));
        store.migrate().await.expect("migrate the SQLite outbox");
        sqlx::query(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, \
             total_cents INTEGER NOT NULL)",
        )
        .execute(store.pool())
        .await
        .expect("create the orders table");
        Self { store, dir }
    }

    fn store(&self) -> SqliteStore {
        self.store.clone()
    }

    async fn write_order(&self, order: &Order, events: Vec<NewEvent>, end: TxEnd) -> Vec<EventId> {
        let mut tx = self.store.pool().begin().await.expect("BEGIN");
        sqlx::query("INSERT INTO orders (id, customer, total_cents) VALUES (?, ?, ?)")
            .bind(order.id)
            .bind(&order.customer)
            .bind(order.total_cents)
            .execute(&mut *tx)
            .await
            .expect("insert the order");
        let ids = outbox_sqlite::enqueue_batch(&mut tx, events)
            .await
            .expect("enqueue in the order's transaction");
        end.finish(tx).await;
        ids
    }

    async fn try_enqueue(&self, events: Vec<NewEvent>) -> Result<Vec<EventId>, ValidationError> {
        let mut tx = self.store.pool().begin().await.expect("BEGIN");
        let result = outbox_sqlite::enqueue_batch(&mut tx, events).await;
        end_try_enqueue(tx, result, |e| match e {
            outbox_sqlite::EnqueueError::Invalid { source, .. } => Ok(source),
            e => Err(e),
        })
        .await
    }

    async fn order_ids(&self) -> Vec<i64> {
        sqlx::query_scalar("SELECT id FROM orders ORDER BY id")
            .fetch_all(self.store.pool())
            .await
            .expect("read the orders table")
    }

    async fn outbox_rows(&self) -> OutboxRows {
        let pool = self.store.pool();
        OutboxRows {
            events: sqlx::query_scalar("SELECT count(*) FROM outbox_events")
                .fetch_one(pool)
                .await
                .expect("count outbox_events"),
            dead: sqlx::query_scalar("SELECT count(*) FROM outbox_dead_letters")
                .fetch_one(pool)
                .await
                .expect("count outbox_dead_letters"),
        }
    }

    async fn cleanup(self) {
        self.store.pool().close().await;
        drop(self.store);
        let _ = self.dir.close();
    }
}

/// PostgreSQL in a fresh schema `outbox_e2e_<random>` (outbox tables and the
/// `orders` table both live there), dropped by [`App::cleanup`].
#[derive(Debug)]
pub struct PostgresApp {
    store: PgStore,
    schema: Ident,
}

impl PostgresApp {
    fn table(&self, name: &str) -> String {
        format!("{}.\"{name}\"", self.schema.quoted())
    }
}

impl App for PostgresApp {
    type Store = PgStore;
    const NAME: &'static str = "postgres";

    async fn start() -> Self {
        let url = crate::database_url();
        let schema = Ident::new(format!("outbox_e2e_{}", crate::unique_suffix()))
            .expect("a valid schema name");
        let options = PgStoreOptions::new(url.clone())
            .with_schema(schema.clone())
            .with_max_connections(5)
            .with_acquire_timeout(Duration::from_secs(10));
        let store = PgStore::connect(options).await.unwrap_or_else(|e| {
            panic!(
                "PostgreSQL is not reachable at {} ({e}); start it (`cargo xtask services`) \
                 or set DATABASE_URL",
                outbox_core::redact_url(&url)
            )
        });
        store
            .migrate()
            .await
            .expect("migrate the PostgreSQL outbox");
        let app = Self { store, schema };
        sqlx::query(&format!(
            "CREATE TABLE {} (id BIGINT PRIMARY KEY, customer TEXT NOT NULL, \
             total_cents BIGINT NOT NULL)",
            app.table("orders")
        ))
        .execute(app.store.pool())
        .await
        .expect("create the orders table");
        app
    }

    fn store(&self) -> PgStore {
        self.store.clone()
    }

    async fn write_order(&self, order: &Order, events: Vec<NewEvent>, end: TxEnd) -> Vec<EventId> {
        let mut tx = self.store.pool().begin().await.expect("BEGIN");
        sqlx::query(&format!(
            "INSERT INTO {} (id, customer, total_cents) VALUES ($1, $2, $3)",
            self.table("orders")
        ))
        .bind(order.id)
        .bind(&order.customer)
        .bind(order.total_cents)
        .execute(&mut *tx)
        .await
        .expect("insert the order");
        let ids = self
            .store
            .outbox()
            .enqueue_batch(&mut tx, events)
            .await
            .expect("enqueue in the order's transaction");
        end.finish(tx).await;
        ids
    }

    async fn try_enqueue(&self, events: Vec<NewEvent>) -> Result<Vec<EventId>, ValidationError> {
        let mut tx = self.store.pool().begin().await.expect("BEGIN");
        let result = self.store.outbox().enqueue_batch(&mut tx, events).await;
        end_try_enqueue(tx, result, |e| match e {
            outbox_postgres::EnqueueError::Invalid { source, .. } => Ok(source),
            e => Err(e),
        })
        .await
    }

    async fn order_ids(&self) -> Vec<i64> {
        sqlx::query_scalar(&format!(
            "SELECT id FROM {} ORDER BY id",
            self.table("orders")
        ))
        .fetch_all(self.store.pool())
        .await
        .expect("read the orders table")
    }

    async fn outbox_rows(&self) -> OutboxRows {
        let pool = self.store.pool();
        let count = |table: String| async move {
            sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM {table}"))
                .fetch_one(pool)
                .await
                .unwrap_or_else(|e| panic!("count {table}: {e}"))
        };
        OutboxRows {
            events: count(self.table("events")).await,
            dead: count(self.table("events_dead")).await,
        }
    }

    async fn cleanup(self) {
        let drop_schema = format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema.quoted());
        if let Err(e) = sqlx::query(&drop_schema).execute(self.store.pool()).await {
            eprintln!("cleanup: {drop_schema} failed: {e}");
        }
        // Dropping the last handle stops the store's LISTEN task; the pool's
        // connections close with it.
        drop(self.store);
    }
}
