#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
pub mod cloudevents;
mod control;
mod dead_head;
mod decode;
mod envelope;
mod error;
mod event;
mod handler;
pub mod headers;
mod held;
pub mod ident;
mod message;
pub mod migration;
mod pool;
mod redact;
mod retry;
mod shard;
mod store;
#[cfg(feature = "otel")]
pub mod trace;
mod wire;

pub use control::{ControlStore, PauseNote, Paused, DEFAULT_GROUP};
pub use dead_head::DeadHeadPolicy;
pub use envelope::Envelope;
pub use error::{DeliveryError, ErrorCode, FailureKind, Outcome};
pub use event::{
    Delivery, DeliveryDelay, Event, EventField, EventId, EventLimits, EventParts, LastError,
    NewEvent, ValidationError, MAX_DELIVERY_DELAY,
};
pub use handler::{panic_message, HandlerError};
pub use held::{HeadState, HeldKey, HeldKeyStore, HeldKeys};
pub use message::BrokerMessage;
pub use pool::{PoolSettings, Pooler, UnknownPooler};
pub use redact::redact_url;
pub use retry::{InvalidRetryPolicy, Jitter, RetryPolicy};
pub use shard::{fnv1a_64, key_hash, shard_of, InvalidShardSpec, ShardSpec};
pub use store::{
    Claim, ClaimRequest, DeadLetter, DeadLetterFilter, DeadLetterQuery, DeadLetterStore,
    FencingToken, Rejected, RelayId, Resolution, Retryable, SettleReport, Settlement, Sink, Stats,
    Store, MAX_DEAD_LETTER_AGE,
};
pub use wire::{
    DecodeError, InboundMessage, UnknownWireFormat, WireFormat, ENVELOPE_CONTENT_TYPE,
    ENVELOPE_MARKER,
};
