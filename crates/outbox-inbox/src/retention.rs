//! The retention window of the deduplication records, shared by the stores.
//!
//! Records are written into [`RETENTION_SLOTS`] slots by the database's
//! clock: slot `floor(epoch_seconds / slot_seconds) mod RETENTION_SLOTS`, with
//! `slot_seconds = window / (RETENTION_SLOTS - 2)`. While slot `n` receives
//! records, slot `n + 1` (which received them `RETENTION_SLOTS - 1` slot
//! lengths ago) is emptied in bulk. A record therefore lives at least the
//! window (`RETENTION_SLOTS - 2` whole slot lengths) and at most
//! `RETENTION_SLOTS` slot lengths. A duplicate that arrives after its record
//! was removed is handled again: the documented limit of the inbox.

use crate::store::{StoreError, RETENTION_SLOTS};
use std::time::Duration;

/// The default retention window: 7 days.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);

/// A validated retention window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    window: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            window: DEFAULT_WINDOW,
        }
    }
}

impl Retention {
    /// A window of at least `RETENTION_SLOTS - 2` seconds (one second per slot).
    pub fn new(window: Duration) -> Result<Self, StoreError> {
        if window.as_secs() < u64::from(RETENTION_SLOTS - 2) {
            return Err(StoreError::Config(format!(
                "the retention window must be at least {} s, got {window:?}",
                RETENTION_SLOTS - 2
            )));
        }
        Ok(Self { window })
    }

    /// The window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The length of one slot in whole seconds.
    pub fn slot_seconds(&self) -> i64 {
        i64::try_from(self.window.as_secs() / u64::from(RETENTION_SLOTS - 2)).unwrap_or(i64::MAX)
    }

    /// The window in whole seconds.
    pub fn window_seconds(&self) -> i64 {
        i64::try_from(self.window.as_secs()).unwrap_or(i64::MAX)
    }
}

/// The slot after `current`.
pub(crate) fn next_slot(current: i64) -> i64 {
    (current + 1).rem_euclid(i64::from(RETENTION_SLOTS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seven_days_is_a_slot_of_28_hours() {
        let r = Retention::default();
        assert_eq!(r.slot_seconds(), 7 * 24 * 3600 / 6);
        assert!(Retention::new(Duration::from_secs(5)).is_err());
        assert_eq!(next_slot(7), 0);
        assert_eq!(next_slot(3), 4);
    }
}
