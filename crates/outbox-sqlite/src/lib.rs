#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

mod enqueue;
mod error;
mod migrate;
mod sql;
mod store;

pub use enqueue::{
    enqueue, enqueue_batch, enqueue_batch_with_limits, enqueue_with_limits, EnqueueError,
};
pub use error::SqliteStoreError;
pub use migrate::{AppliedMigration, MIGRATIONS_TABLE};
pub use store::SqliteStore;

/// Re-export of the sqlx types a caller needs (`Sqlite`, `SqlitePool`, `Transaction`).
pub use sqlx;
