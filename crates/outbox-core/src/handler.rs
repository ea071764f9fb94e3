//! What an application's handler reports, for the relay's in-process
//! handlers (`outbox_worker::HandlerRegistry`) and the inbox's
//! (`outbox_inbox::HandlerRegistry`) alike.

use crate::error::{DeliveryError, ErrorCode};
use std::any::Any;
use std::fmt;

/// Why a handler could not process an event. Map your own errors to one of
/// the two kinds: [`HandlerError::retryable`] (`HANDLER_TEMPORARY_FAILURE`,
/// retried with backoff) or [`HandlerError::permanent`]
/// (`HANDLER_PERMANENT_FAILURE`, dead-lettered at once).
///
/// Any other error converts with `?` as a retryable one, its text as the
/// message: a database error inside a handler (a terminated connection, a
/// deadlock, a serialization failure) is the transaction's failure, not the
/// event's. An error that retrying cannot fix must say so with
/// [`HandlerError::permanent`]. This is also why `HandlerError` is not a
/// [`std::error::Error`] itself (as `anyhow::Error` is not): the blanket
/// conversion would otherwise include itself.
///
/// ```
/// use outbox_core::{ErrorCode, HandlerError};
///
/// fn parse(payload: &[u8]) -> Result<u32, HandlerError> {
///     let text = std::str::from_utf8(payload)
///         .map_err(|e| HandlerError::permanent(format!("payload is not UTF-8: {e}")))?;
///     // A `ParseIntError` through `?`: retryable.
///     Ok(text.parse::<u32>()?)
/// }
/// let e = parse(b"x").unwrap_err();
/// assert!(e.is_retryable());
/// assert_eq!(*e.code(), ErrorCode::HANDLER_TEMPORARY_FAILURE);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerError {
    code: ErrorCode,
    message: String,
}

impl HandlerError {
    /// A transient failure (a dependency is down, a timeout): retry later.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::HANDLER_TEMPORARY_FAILURE,
            message: message.into(),
        }
    }

    /// A failure retrying cannot fix (a malformed payload): dead-letter.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::HANDLER_PERMANENT_FAILURE,
            message: message.into(),
        }
    }

    /// No handler is registered for `event_type` (`HANDLER_NOT_REGISTERED`,
    /// permanent: dead-lettered, never silently dropped).
    pub fn not_registered(event_type: &str) -> Self {
        Self {
            code: ErrorCode::HANDLER_NOT_REGISTERED,
            message: format!("no handler registered for event type {event_type:?}"),
        }
    }

    /// The handler panicked with `payload` (`HANDLER_PANICKED`, retryable:
    /// the panic may be transient; dead-lettered after the last attempt).
    pub fn panicked(payload: &(dyn Any + Send)) -> Self {
        Self {
            code: ErrorCode::HANDLER_PANICKED,
            message: format!("handler panicked: {}", panic_message(payload)),
        }
    }

    /// Whether the event should be retried.
    pub fn is_retryable(&self) -> bool {
        self.code != ErrorCode::HANDLER_PERMANENT_FAILURE
            && self.code != ErrorCode::HANDLER_NOT_REGISTERED
    }

    /// `HANDLER_TEMPORARY_FAILURE`, `HANDLER_PERMANENT_FAILURE`,
    /// `HANDLER_NOT_REGISTERED` or `HANDLER_PANICKED`.
    pub fn code(&self) -> &ErrorCode {
        &self.code
    }

    /// The text stored as the event's last error.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    /// Retryable, with the error's text as the message.
    fn from(e: E) -> Self {
        Self::retryable(e.to_string())
    }
}

impl From<HandlerError> for DeliveryError {
    fn from(e: HandlerError) -> Self {
        if e.is_retryable() {
            DeliveryError::retryable(e.code, e.message)
        } else {
            DeliveryError::permanent(e.code, e.message)
        }
    }
}

/// The text of a panic's payload (`panic!("...")` gives a `&str` or a
/// `String`), or `non-text panic payload`.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-text panic payload".to_owned())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::error::FailureKind;

    #[test]
    fn each_kind_keeps_its_code_and_class_as_a_delivery_error() {
        let cases = [
            (
                HandlerError::retryable("down"),
                "HANDLER_TEMPORARY_FAILURE",
                FailureKind::Retryable,
            ),
            (
                HandlerError::permanent("bad"),
                "HANDLER_PERMANENT_FAILURE",
                FailureKind::Permanent,
            ),
            (
                HandlerError::not_registered("order.created"),
                "HANDLER_NOT_REGISTERED",
                FailureKind::Permanent,
            ),
            (
                HandlerError::panicked(&"boom"),
                "HANDLER_PANICKED",
                FailureKind::Retryable,
            ),
        ];
        for (e, code, kind) in cases {
            assert_eq!(e.code().as_str(), code);
            assert_eq!(e.is_retryable(), kind == FailureKind::Retryable);
            let d = DeliveryError::from(e.clone());
            assert_eq!(
                (d.code().as_str(), d.kind(), d.message()),
                (code, kind, e.message())
            );
        }
        assert_eq!(
            HandlerError::not_registered("order.created").message(),
            "no handler registered for event type \"order.created\""
        );
    }

    #[test]
    fn a_panic_payload_is_read_as_text_when_it_is_text() {
        let owned: Box<dyn Any + Send> = Box::new(String::from("owned"));
        let other: Box<dyn Any + Send> = Box::new(42_u8);
        assert_eq!(panic_message(&"static"), "static");
        assert_eq!(panic_message(owned.as_ref()), "owned");
        assert_eq!(panic_message(other.as_ref()), "non-text panic payload");
        assert_eq!(
            HandlerError::panicked(&"boom").message(),
            "handler panicked: boom"
        );
    }

    #[test]
    fn any_other_error_converts_as_retryable_with_its_text() {
        let e = HandlerError::from("x".parse::<u32>().unwrap_err());
        assert!(e.is_retryable());
        assert_eq!(e.message(), "invalid digit found in string");
    }
}
