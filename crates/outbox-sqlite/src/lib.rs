#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod control;
pub mod descriptor;
mod enqueue;
mod error;
mod ident;
mod migrate;
mod names;
mod options;
mod sql;
mod store;

pub use enqueue::{enqueue, enqueue_batch, SqliteOutbox};
pub use error::{EnqueueError, MigrateError, StoreError};
pub use ident::Ident;
pub use migrate::{AppliedMigration, MIGRATIONS};
pub use names::MIGRATIONS_TABLE;
pub use options::{SqliteStoreOptions, DEFAULT_BUSY_TIMEOUT, DEFAULT_TABLE};
pub use store::SqliteStore;

/// Re-export of the sqlx types a caller needs (`Sqlite`, `SqlitePool`, `Transaction`).
pub use sqlx;

#[cfg(test)]
mod send_checks {
    //! Compile-time checks that the public futures are `Send` (so they can
    //! be spawned and used from `Store` impls and runners).
    #![allow(dead_code)]
    use sqlx::SqliteConnection;

    fn is_send<T: Send>(_: T) {}

    fn outbox_futures(conn: &mut SqliteConnection) {
        let o = crate::SqliteOutbox::default();
        is_send(o.migrate(conn));
    }

    fn enqueue_futures(conn: &mut SqliteConnection) {
        let o = crate::SqliteOutbox::default();
        is_send(o.enqueue_batch(conn, vec![outbox_core::NewEvent::new("a", "b", vec![])]));
    }

    fn enqueue_one(conn: &mut SqliteConnection) {
        is_send(crate::enqueue(
            conn,
            outbox_core::NewEvent::new("a", "b", vec![]),
        ));
    }

    fn applied(conn: &mut SqliteConnection) {
        is_send(crate::SqliteOutbox::default().applied_migrations(conn));
    }

    fn store_futures(store: crate::SqliteStore) {
        is_send(crate::SqliteStore::connect("sqlite::memory:"));
        is_send(store.migrate());
    }
}
