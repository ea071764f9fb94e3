#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod common;
mod consumer;
mod handler;
pub mod metrics;
mod options;
#[cfg(feature = "postgres")]
mod pg;
mod retention;
pub mod source;
#[cfg(feature = "sqlite")]
mod sqlite;
mod store;

pub use common::MAX_CONSUMER_NAME;
pub use consumer::{Inbox, InboxCounts, InboxError, InboxStats};
pub use handler::{handler_fn, Failure, FnHandler, Handler, HandlerRegistry};
pub use options::InboxOptions;
#[cfg(feature = "postgres")]
pub use pg::PgInbox;
pub use retention::{Retention, SlotClock, DEFAULT_WINDOW};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteInbox;
/// The sqlx version the handlers and stores use.
pub use sqlx;
pub use store::{
    Hold, InboxDeadLetterStore, InboxRetentionStore, InboxSchema, InboxStore, Pending,
    PendingCounts, PendingState, RetentionReport, StoreError, Verdict, RETENTION_SLOTS,
};
