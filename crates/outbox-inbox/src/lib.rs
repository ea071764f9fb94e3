#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod handler;
pub mod source;
pub mod store;

pub use handler::{handler_fn, Failure, FnHandler, Handler, HandlerError, Handlers};
pub use source::{RawMessage, Received, Source, SourceError};
pub use store::{DeadFilter, Hold, InboxStore, Pending, PendingState, StoreError, Verdict};
