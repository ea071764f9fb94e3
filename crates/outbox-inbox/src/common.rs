//! Pieces both stores share: consumer name rules, the parts of a [`Hold`].

use crate::handler::Failure;
use crate::store::{Hold, PendingState, StoreError};

/// The longest consumer name accepted.
pub const MAX_CONSUMER_NAME: usize = 200;

/// Checks a consumer name: 1 to [`MAX_CONSUMER_NAME`] bytes, no control
/// characters.
pub(crate) fn check_consumer(name: &str) -> Result<(), StoreError> {
    if name.is_empty() || name.len() > MAX_CONSUMER_NAME || name.chars().any(char::is_control) {
        return Err(StoreError::Config(format!(
            "consumer name {name:?} must be 1 to {MAX_CONSUMER_NAME} bytes without control characters"
        )));
    }
    Ok(())
}

/// The state, attempts, delay in milliseconds and failure of a hold.
pub(crate) fn hold_parts(hold: &Hold) -> (PendingState, u32, i64, &Failure) {
    match hold {
        Hold::Retry {
            attempts,
            delay,
            failure,
        } => (
            PendingState::Retry,
            *attempts,
            i64::try_from(delay.as_millis()).unwrap_or(i64::MAX),
            failure,
        ),
        Hold::Dead { attempts, failure } => (PendingState::Dead, *attempts, 0, failure),
    }
}
