//! The wake-up probe of [`Store::wakeup`](outbox_core::Store::wakeup):
//! polls `pg_current_snapshot()` (no table access), a few milliseconds
//! after activity, doubling up to a maximum while idle, and fires when the
//! snapshot changed since the last claim or probe.

use crate::db::Db;
use crate::error::StoreError;
use crate::log::sql::PROBE;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The probe's state, shared by a store's clones.
pub(super) struct Wake {
    /// Last snapshot seen by a claim or a probe.
    seen: Mutex<String>,
    /// Current probe delay in µs (reset to the minimum by a non-empty claim).
    delay_us: AtomicU64,
    min: Duration,
    max: Duration,
}

fn as_micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl Wake {
    /// A probe between `min` (after activity) and `max` (idle).
    pub(super) fn new(min: Duration, max: Duration) -> Self {
        Wake {
            seen: Mutex::new(String::new()),
            delay_us: AtomicU64::new(as_micros(min)),
            min,
            max,
        }
    }

    /// A claim saw `snapshot`: a probe fires only once it changes.
    pub(super) fn saw(&self, snapshot: &str) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.as_str() != snapshot {
            snapshot.clone_into(&mut seen);
        }
    }

    /// A claim handed out events: probe again soon.
    pub(super) fn active(&self) {
        self.delay_us.store(as_micros(self.min), Ordering::Relaxed);
    }

    /// The delay before the next probe.
    pub(super) fn delay(&self) -> Duration {
        Duration::from_micros(self.delay_us.load(Ordering::Relaxed))
    }

    /// A probe is about to wait `delay`: the next one waits twice as long,
    /// up to the maximum.
    pub(super) fn back_off(&self, delay: Duration) {
        let us = as_micros(delay);
        self.delay_us.store(
            us.saturating_mul(2).min(as_micros(self.max)),
            Ordering::Relaxed,
        );
    }

    /// One probe: whether the snapshot changed since the last claim or probe.
    pub(super) async fn probe(&self, db: &Db) -> Result<bool, StoreError> {
        let now: String = sqlx::query_scalar(PROBE).fetch_one(db).await?;
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if *seen == now {
            return Ok(false);
        }
        *seen = now;
        Ok(true)
    }
}
