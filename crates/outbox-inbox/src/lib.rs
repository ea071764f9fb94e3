#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod common;
mod consumer;
pub mod handler;
pub mod metrics;
mod options;
#[cfg(feature = "postgres")]
pub mod pg;
pub mod retention;
pub mod source;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod store;

pub use common::MAX_CONSUMER_NAME;
pub use consumer::{Inbox, InboxCounts, InboxError, InboxStats};
pub use handler::{handler_fn, Failure, FnHandler, Handler, HandlerRegistry};
pub use options::{DeadHead, InboxOptions};
#[cfg(feature = "postgres")]
pub use pg::PgInbox;
pub use retention::Retention;
pub use source::{RawMessage, Received, Source, SourceError};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteInbox;
/// The sqlx version the handlers and stores use.
pub use sqlx;
pub use store::{
    DeadFilter, Hold, InboxStore, Pending, PendingState, RetentionReport, StoreError, Verdict,
};
