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
//!
//! A pass reads the clock only once it holds the next slot's lock, and skips
//! when that slot is current or within [`Retention::boundary_margin_millis`]
//! of becoming current: it never empties a slot that transactions write into.
//! [`SlotClock`] shifts the clock the slots are computed from (tests).

use crate::store::{StoreError, RETENTION_SLOTS};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
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

    /// The length of one slot in milliseconds.
    pub fn slot_millis(&self) -> i64 {
        self.slot_seconds().saturating_mul(1000)
    }

    /// How close to the next slot boundary a retention pass may still empty
    /// the slot after the current one: a tenth of a slot, at most 5 minutes.
    /// Closer than that the pass skips (the next one does it): the slot it
    /// would empty is about to become current, and a clock stepped back by
    /// less than the margin cannot make a pass empty a slot that
    /// transactions already write into.
    pub fn boundary_margin_millis(&self) -> i64 {
        (self.slot_millis() / 10).min(BOUNDARY_MARGIN_CAP_MS)
    }
}

/// The longest margin a retention pass keeps before a slot boundary.
const BOUNDARY_MARGIN_CAP_MS: i64 = 5 * 60 * 1000;

/// Whether a retention pass whose clock reads `into_ms` into the current
/// slot may empty the next slot: not within the margin before its boundary.
pub(crate) fn may_empty_next(retention: &Retention, into_ms: i64) -> bool {
    retention.slot_millis() - into_ms >= retention.boundary_margin_millis()
}

/// The clock records are placed in slots by: the database's clock, shifted
/// by an offset. Production leaves the offset at zero. Tests set it to put a
/// transaction on either side of a slot boundary, or a retention pass just
/// before one, without waiting for the wall clock to get there; every
/// handle cloned from one `SlotClock` sees the same offset, and a change
/// applies to the next statement the store builds.
#[derive(Debug, Clone, Default)]
pub struct SlotClock {
    offset_ms: Arc<AtomicI64>,
}

impl SlotClock {
    /// A clock with no offset: the database's own.
    pub fn new() -> Self {
        Self::default()
    }

    /// Shifts the clock by `ms` milliseconds (negative: back).
    pub fn set_offset_ms(&self, ms: i64) {
        self.offset_ms.store(ms, Ordering::SeqCst);
    }

    /// The current offset in milliseconds.
    pub fn offset_ms(&self) -> i64 {
        self.offset_ms.load(Ordering::SeqCst)
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

    #[test]
    fn the_margin_is_a_tenth_of_a_slot_at_most_five_minutes() {
        let day = Retention::new(Duration::from_secs(6 * 24 * 3600)).unwrap();
        assert_eq!(day.boundary_margin_millis(), 300_000);
        let short = Retention::new(Duration::from_secs(60)).unwrap();
        assert_eq!(short.boundary_margin_millis(), 1_000);
        assert!(may_empty_next(&short, 0));
        assert!(may_empty_next(&short, 9_000));
        assert!(!may_empty_next(&short, 9_001));
        assert!(may_empty_next(&day, day.slot_millis() - 300_000));
        assert!(!may_empty_next(&day, day.slot_millis() - 150_000));
    }
}
