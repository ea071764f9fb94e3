//! Delivery outcomes and their classification.

use std::borrow::Cow;
use std::fmt;

/// A stable, machine-readable failure code stored with a failed or dead
/// event (`last_error_code`). Codes never change meaning once published.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct ErrorCode(Cow<'static, str>);

impl ErrorCode {
    /// No handler is registered for the event type (permanent).
    pub const HANDLER_NOT_REGISTERED: ErrorCode = ErrorCode::from_static("HANDLER_NOT_REGISTERED");
    /// A handler reported a transient failure (retryable).
    pub const HANDLER_TEMPORARY_FAILURE: ErrorCode =
        ErrorCode::from_static("HANDLER_TEMPORARY_FAILURE");
    /// A handler reported a permanent failure (not retried).
    pub const HANDLER_PERMANENT_FAILURE: ErrorCode =
        ErrorCode::from_static("HANDLER_PERMANENT_FAILURE");
    /// A handler panicked (retryable: the panic may be transient).
    pub const HANDLER_PANICKED: ErrorCode = ErrorCode::from_static("HANDLER_PANICKED");
    /// The broker did not acknowledge in time: maybe delivered (sink
    /// unavailable: no attempt counted; the dedup id covers a duplicate).
    pub const PUBLISH_TIMEOUT: ErrorCode = ErrorCode::from_static("PUBLISH_TIMEOUT");
    /// The broker refused the message (nack, or a retriable broker error).
    pub const PUBLISH_REJECTED: ErrorCode = ErrorCode::from_static("PUBLISH_REJECTED");
    /// No queue / stream / topic would receive the message.
    pub const PUBLISH_UNROUTABLE: ErrorCode = ErrorCode::from_static("PUBLISH_UNROUTABLE");
    /// The message exceeds the broker's size limit (permanent).
    pub const PUBLISH_TOO_LARGE: ErrorCode = ErrorCode::from_static("PUBLISH_TOO_LARGE");
    /// The connection to the broker is down (sink unavailable: no attempt counted).
    pub const PUBLISH_CONNECTION_LOST: ErrorCode =
        ErrorCode::from_static("PUBLISH_CONNECTION_LOST");
    /// The broker rejected the message as invalid (permanent).
    pub const PUBLISH_INVALID: ErrorCode = ErrorCode::from_static("PUBLISH_INVALID");
    /// The relay was shutting down before the event was delivered (released, not failed).
    pub const RELAY_SHUTDOWN: ErrorCode = ErrorCode::from_static("RELAY_SHUTDOWN");
    /// The stored row could not be decoded into an event (dead-lettered by
    /// the store at claim time, with the decoding error as the reason).
    pub const UNDECODABLE: ErrorCode = ErrorCode::from_static("UNDECODABLE");
    /// The sink did not finish a batch within the relay's delivery timeout
    /// (the batch is cancelled and released).
    pub const DELIVERY_TIMEOUT: ErrorCode = ErrorCode::from_static("DELIVERY_TIMEOUT");
    /// An operator moved the event to the dead letters by hand.
    pub const MANUAL: ErrorCode = ErrorCode::from_static("MANUAL");

    /// A code from a static string (use `SCREAMING_SNAKE_CASE`).
    pub const fn from_static(code: &'static str) -> Self {
        Self(Cow::Borrowed(code))
    }

    /// A code read back from storage or built at run time.
    pub fn new(code: impl Into<String>) -> Self {
        Self(Cow::Owned(code.into()))
    }

    /// The code as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whose failure it is, and whether it may be tried again.
///
/// [`FailureKind::Retryable`] and [`FailureKind::Permanent`] are the
/// *event's* failures (unroutable, too large, rejected, handler error): they
/// count as one of its attempts. [`FailureKind::Unavailable`] is the *sink's*
/// failure (connection lost or refused, no acknowledgement before the
/// timeout, broker unavailable, producer fenced): it is nobody's attempt; the
/// relay gives the event back unattempted and stops claiming until the sink
/// is back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// The event's failure; try again after the retry policy's delay (unless
    /// attempts are exhausted).
    Retryable,
    /// The event's failure; never retry: dead-letter now.
    Permanent,
    /// The sink could not take the event at all: not an attempt of the
    /// event. It is released (attempt not counted) and delivered once the
    /// sink is back.
    Unavailable,
}

/// Why one event could not be delivered, classified.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct DeliveryError {
    kind: FailureKind,
    code: ErrorCode,
    message: String,
}

impl DeliveryError {
    /// A failure worth retrying.
    pub fn retryable(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            kind: FailureKind::Retryable,
            code,
            message: message.into(),
        }
    }

    /// The sink is unavailable (connection lost or refused, no ack before the
    /// timeout, broker unavailable, producer fenced): not the event's attempt.
    pub fn unavailable(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            kind: FailureKind::Unavailable,
            code,
            message: message.into(),
        }
    }

    /// A failure that retrying cannot fix.
    pub fn permanent(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            kind: FailureKind::Permanent,
            code,
            message: message.into(),
        }
    }

    /// Retryable or permanent.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }

    /// Whether the event may be tried again (an event-level retryable
    /// failure, or the sink's unavailability).
    pub fn is_retryable(&self) -> bool {
        matches!(self.kind, FailureKind::Retryable | FailureKind::Unavailable)
    }

    /// Whether this is the sink's failure rather than the event's: it costs
    /// the event no attempt.
    pub fn is_sink_unavailable(&self) -> bool {
        self.kind == FailureKind::Unavailable
    }

    /// The stable code.
    pub fn code(&self) -> &ErrorCode {
        &self.code
    }

    /// Human-readable detail (never contains secrets).
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// The result of delivering one event. A [`crate::Sink`] returns one per event,
/// in the order the events were given.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The destination took responsibility for the event (broker ack, handler Ok).
    Delivered,
    /// The event was not delivered. [`DeliveryError::kind`] says whether it
    /// was the event's attempt or the sink's unavailability.
    Failed(DeliveryError),
    /// The sink deliberately did not try this event (an earlier event of its
    /// key failed in the same batch, or the sink stopped after an outage).
    /// The relay releases it: lease cleared, attempt not counted.
    NotAttempted,
}

impl Outcome {
    /// Whether the event was delivered.
    pub fn is_delivered(&self) -> bool {
        matches!(self, Outcome::Delivered)
    }

    /// Whether this outcome costs the event an attempt (an event-level failure).
    pub fn is_attempt_failure(&self) -> bool {
        matches!(self, Outcome::Failed(e) if !e.is_sink_unavailable())
    }
}

impl From<Result<(), DeliveryError>> for Outcome {
    fn from(r: Result<(), DeliveryError>) -> Self {
        match r {
            Ok(()) => Outcome::Delivered,
            Err(e) => Outcome::Failed(e),
        }
    }
}
