#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

mod enqueue;
mod error;
mod ident;
mod migrate;
mod names;
mod options;
mod sql;
mod store;

pub use enqueue::{
    enqueue, enqueue_batch, enqueue_batch_with_limits, enqueue_with_limits, SqliteOutbox,
};
#[allow(deprecated)]
pub use error::SqliteStoreError;
pub use error::{EnqueueError, MigrateError, StoreError};
pub use ident::{Ident, InvalidIdentifier, MAX_IDENTIFIER_BYTES};
pub use migrate::{AppliedMigration, Migration, MIGRATIONS, MIGRATIONS_TABLE};
pub use options::{SqliteStoreOptions, DEFAULT_BUSY_TIMEOUT, DEFAULT_TABLE};
pub use store::SqliteStore;

/// Re-export of the sqlx types a caller needs (`Sqlite`, `SqlitePool`, `Transaction`).
pub use sqlx;
