//! When the fences (`fences.rs`) last passed: the [`Guard`] a store's
//! context holds, and how long a pass holds ([`RECHECK_EVERY`]).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a passed check holds without a new lease.
pub(super) const RECHECK_EVERY: Duration = Duration::from_secs(30);

/// When the fences last passed (shared by a store's clones).
#[derive(Default)]
pub(super) struct Guard {
    passed_at: Mutex<Option<Instant>>,
}

impl Guard {
    /// Whether the store's last pass is missing or older than [`RECHECK_EVERY`].
    pub(super) fn due(&self) -> bool {
        let at = self.passed_at.lock().unwrap_or_else(|p| p.into_inner());
        at.is_none_or(|t| t.elapsed() >= RECHECK_EVERY)
    }

    /// Records a pass (`ok`) or a refusal.
    pub(super) fn passed(&self, ok: bool) {
        *self.passed_at.lock().unwrap_or_else(|p| p.into_inner()) = ok.then(Instant::now);
    }
}
