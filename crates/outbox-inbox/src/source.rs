//! The [`Source`] seam: where messages come from, as [`Sink`](outbox_core::Sink)
//! is where the relay's events go. One implementation per broker, behind
//! its cargo feature: Kafka ([`kafka`]), NATS JetStream ([`nats`]),
//! RabbitMQ ([`amqp`]). Every source passes the same conformance suite
//! (`tests/source_conformance.rs`).
//!
//! The contract:
//! - [`Source::recv`] returns what the broker delivered, each message with a
//!   [`Source::Token`] that acknowledges it;
//! - the consumer calls [`Source::ack`] only after the message's effect (or
//!   its record as a retry or a dead letter) is committed in the consumer's
//!   database; an unacknowledged message comes again (after a crash, a
//!   reconnect, a rebalance), and the inbox absorbs the copy;
//! - tokens are acknowledged in any order: a source whose broker only
//!   acknowledges contiguous positions (Kafka offsets) keeps the
//!   bookkeeping itself and commits the highest contiguous position;
//! - a broken connection is [`SourceError::Unavailable`]: the source
//!   reconnects on the next call; a token from before the reconnect may fail
//!   to acknowledge, which is not an error (the broker redelivers);
//! - [`Source::close`] flushes pending acknowledgements (Kafka commits its
//!   offsets) and leaves the consumer group / closes the connection.
//!
//! How the three brokers differ (each module's docs say more):
//!
//! | | NATS JetStream | RabbitMQ | Kafka |
//! |---|---|---|---|
//! | consumer state | durable pull consumer | the queue | consumer group offsets |
//! | an unacknowledged message comes again | to a restarted source at once, with every later one delivered before it (replayed from the acknowledgement floor); to a running one after `ack_wait` | when the channel closes | with every later one of its partition, when the partition is next assigned |
//! | `redelivered` | delivery count > 1 | the broker's flag | always `false` |
//! | `behind` | `num_pending` | `None` | `None` |
//! | missing destination ([`SourceError::Config`]) | when connecting | when connecting | on the first `recv` that hears of it |
//! | reconnects | async-nats, by itself | on the next `recv`, with backoff (100 ms doubling to 5 s) | librdkafka, by itself (an outage is empty batches) |
//! | after a crash, a key's held messages come | first: the source resumes from the consumer's acknowledgement floor | first: put back at their place in the queue | first: the group resumes from the committed offset |
//! | [`Source::position`] | stream sequence | `None` | topic/partition and offset |
//!
//! Per-key order after a crash: a restarted consumer must not handle a
//! key's later messages before the earlier ones its predecessor received
//! and did not acknowledge. Each source keeps that for one consumer process
//! per durable consumer / queue / partition (see the row above and
//! `tests/crash_order.rs`); competing consumers of one NATS durable or one
//! RabbitMQ queue share out a key's messages, and their order across the
//! processes is not given (the inbox counts what it sees applied out of
//! order in `outbox_inbox_out_of_order_total`).

use chrono::{DateTime, Utc};
use std::fmt;
use std::future::Future;
use std::time::Duration;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;

/// One message as a broker delivered it, before decoding.
#[derive(Clone, PartialEq, Eq)]
pub struct RawMessage {
    /// Its headers, in order (AMQP header values as text; Kafka header
    /// values as UTF-8, lossy).
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
    /// Where it came from: Kafka topic, NATS subject, AMQP routing key.
    pub destination: String,
    /// The broker's timestamp of the message, when it has one (Kafka record
    /// timestamp, JetStream stored time, AMQP `timestamp` property).
    pub timestamp: Option<DateTime<Utc>>,
    /// Whether the broker says it delivered this message before.
    pub redelivered: bool,
    /// How many messages are behind this one at the broker for this
    /// consumer, when the broker tells cheaply (JetStream `num_pending`,
    /// Kafka high watermark - offset - 1); `None` otherwise.
    pub behind: Option<u64>,
}

impl fmt::Debug for RawMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Header values and the body may hold secrets: names and sizes only.
        f.debug_struct("RawMessage")
            .field(
                "headers",
                &self.headers.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .field("body_len", &self.body.len())
            .field("destination", &self.destination)
            .field("timestamp", &self.timestamp)
            .field("redelivered", &self.redelivered)
            .field("behind", &self.behind)
            .finish()
    }
}

impl RawMessage {
    /// The headers as `(&str, &str)` pairs, for
    /// [`InboundMessage::decode`](outbox_core::InboundMessage::decode).
    pub fn header_pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        self.headers.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// Where a message stands in its broker's order: an ordered log (a
/// JetStream stream, one Kafka partition) and the message's place in it
/// (stream sequence, offset). Two positions compare only within one log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Position {
    /// The ordered log: `0` for a JetStream stream, a hash of topic and
    /// partition for Kafka.
    pub log: u64,
    /// The place in the log.
    pub offset: u64,
}

impl Position {
    /// Whether `self` comes before `other` in the same log.
    pub fn is_before(&self, other: &Position) -> bool {
        self.log == other.log && self.offset < other.offset
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.offset, self.log)
    }
}

/// A received message and the token that acknowledges it.
#[derive(Debug)]
pub struct Received<T> {
    /// The message.
    pub message: RawMessage,
    /// Pass it to [`Source::ack`] once the message's outcome is committed.
    pub token: T,
}

/// Why a source could not receive or acknowledge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// The broker is unreachable or the connection broke: the consumer
    /// waits (backoff) and calls again; the source reconnects.
    #[error("broker unavailable: {0}")]
    Unavailable(String),
    /// The source is misconfigured (no such stream / queue / topic, access
    /// refused): retrying will not help.
    #[error("source misconfigured: {0}")]
    Config(String),
}

impl SourceError {
    /// Whether calling again later can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

/// Where an inbox's messages come from. See the module docs for the
/// contract every implementation keeps.
pub trait Source: Send + 'static {
    /// Acknowledges one received message.
    type Token: Send + 'static;

    /// Up to `max` messages; waits at most `wait` for the first one and
    /// returns an empty batch when none came.
    fn recv(
        &mut self,
        max: usize,
        wait: Duration,
    ) -> impl Future<Output = Result<Vec<Received<Self::Token>>, SourceError>> + Send;

    /// Acknowledges messages whose outcome is committed, in any order.
    fn ack(
        &mut self,
        tokens: Vec<Self::Token>,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Flushes pending acknowledgements and disconnects.
    fn close(self) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// A short description for logs and metrics labels (broker and
    /// destination, never a credential).
    fn describe(&self) -> String;

    /// The broker's position of the message `token` acknowledges, when the
    /// broker orders messages in a log (JetStream stream sequence, Kafka
    /// offset); `None` otherwise (RabbitMQ). The inbox uses it to notice a
    /// key's message applied after a later one of the key.
    fn position(_token: &Self::Token) -> Option<Position> {
        None
    }
}

/// How long a source waits before reconnecting after a failed attempt:
/// doubling from 100 ms up to 5 s.
pub(crate) fn reconnect_delay(failures: u32) -> Duration {
    let ms = 100u64.saturating_mul(1u64 << failures.min(6));
    Duration::from_millis(ms.min(5_000))
}
