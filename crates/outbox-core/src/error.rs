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
    /// The broker did not acknowledge in time: maybe delivered (retryable).
    pub const PUBLISH_TIMEOUT: ErrorCode = ErrorCode::from_static("PUBLISH_TIMEOUT");
    /// The broker refused the message (nack, or a retriable broker error).
    pub const PUBLISH_REJECTED: ErrorCode = ErrorCode::from_static("PUBLISH_REJECTED");
    /// No queue / stream / topic would receive the message.
    pub const PUBLISH_UNROUTABLE: ErrorCode = ErrorCode::from_static("PUBLISH_UNROUTABLE");
    /// The message exceeds the broker's size limit (permanent).
    pub const PUBLISH_TOO_LARGE: ErrorCode = ErrorCode::from_static("PUBLISH_TOO_LARGE");
    /// The connection to the broker is down (retryable).
    pub const PUBLISH_CONNECTION_LOST: ErrorCode =
        ErrorCode::from_static("PUBLISH_CONNECTION_LOST");
    /// The broker rejected the message as invalid (permanent).
    pub const PUBLISH_INVALID: ErrorCode = ErrorCode::from_static("PUBLISH_INVALID");
    /// The relay was shutting down before the event was delivered (released, not failed).
    pub const RELAY_SHUTDOWN: ErrorCode = ErrorCode::from_static("RELAY_SHUTDOWN");
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

/// Whether a failed delivery may be tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// Try again after the retry policy's delay (unless attempts are exhausted).
    Retryable,
    /// Never retry: dead-letter now.
    Permanent,
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

    /// Whether the failure may be retried.
    pub fn is_retryable(&self) -> bool {
        self.kind == FailureKind::Retryable
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
pub enum Outcome {
    /// The destination took responsibility for the event (broker ack, handler Ok).
    Delivered,
    /// The event was not delivered.
    Failed(DeliveryError),
}

impl Outcome {
    /// Whether the event was delivered.
    pub fn is_delivered(&self) -> bool {
        matches!(self, Outcome::Delivered)
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
