//! Pacing of the loop: the size of the next claim, the wait after an empty
//! one, the backoff after a failed one, and the wait itself.

use outbox_core::{Jitter, RetryPolicy, Retryable};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

/// First wait after an empty claim, and the wait after a partial batch;
/// it doubles up to the poll interval. 1 ms: at 1,000 events/s a relay
/// claims every 2-3 ms (each claim gets what committed meanwhile), and an
/// idle relay makes ten claims in its first second, then one per poll.
pub(super) const IDLE_FIRST: Duration = Duration::from_millis(1);

/// What ended a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Waited {
    Shutdown,
    Timer,
    Woken,
}

/// The size of the next claim: `batch_size` while the relay keeps up,
/// doubling after each full claim up to `max_batch_size` while it catches
/// up, back to `batch_size` at the first short claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BatchSizer {
    base: u32,
    max: u32,
    next: u32,
}

impl BatchSizer {
    pub(super) fn new(base: u32, max: u32) -> Self {
        Self {
            base,
            max: max.max(base),
            next: base,
        }
    }

    pub(super) fn next(&self) -> u32 {
        self.next
    }

    /// After a claim of `asked` events came back with `got`; `more`: the
    /// store said more events were ready (it stopped early).
    pub(super) fn observe(&mut self, asked: u32, got: usize, more: bool) {
        let full = got >= usize::try_from(asked).unwrap_or(usize::MAX);
        if full {
            self.next = asked.max(self.next).saturating_mul(2).min(self.max);
        } else if !more {
            self.next = self.base;
        }
    }
}

/// The wait after an empty claim: a few ms, doubling up to the poll interval.
pub(super) struct IdleBackoff {
    next: Duration,
    cap: Duration,
}

impl IdleBackoff {
    pub(super) fn new(cap: Duration) -> Self {
        Self {
            next: IDLE_FIRST.min(cap),
            cap,
        }
    }

    pub(super) fn reset(&mut self) {
        self.next = IDLE_FIRST.min(self.cap);
    }

    pub(super) fn first(&self) -> Duration {
        IDLE_FIRST.min(self.cap)
    }

    pub(super) fn next(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(self.cap);
        d
    }
}

/// How often a streak of retryable claim errors is said at WARN: the first
/// of the streak, then at most once per this long (the others at DEBUG),
/// so a database that stays away (a failover waiting for a primary, an
/// outage) is one line a minute, not one per backoff step.
const RETRYABLE_WARN_EVERY: Duration = Duration::from_secs(60);

/// Claim errors: a capped backoff, longer for errors retrying cannot fix.
pub(super) struct ClaimErrors {
    retryable: RetryPolicy,
    fatal: RetryPolicy,
    streak: u32,
    fatal_logged: bool,
    /// When a retryable error of this streak was last said at WARN.
    retryable_warned: Option<Instant>,
}

impl ClaimErrors {
    pub(super) fn new() -> Self {
        let policy =
            |base, cap| RetryPolicy::new(base, cap, u32::MAX, Jitter::Equal).unwrap_or_default();
        Self {
            retryable: policy(Duration::from_millis(250), Duration::from_secs(30)),
            fatal: policy(Duration::from_secs(5), Duration::from_secs(5 * 60)),
            streak: 0,
            fatal_logged: false,
            retryable_warned: None,
        }
    }

    pub(super) fn failed(&mut self, err: &(impl std::error::Error + Retryable)) -> Duration {
        self.streak = self.streak.saturating_add(1);
        if err.is_retryable() {
            let delay = self.retryable.next_delay(self.streak, rand::random());
            let now = Instant::now();
            if self
                .retryable_warned
                .is_none_or(|at| now.duration_since(at) >= RETRYABLE_WARN_EVERY)
            {
                self.retryable_warned = Some(now);
                warn!(
                    error = %err,
                    retry_in = ?delay,
                    failures = self.streak,
                    "claim failed; backing off"
                );
            } else {
                debug!(error = %err, retry_in = ?delay, failures = self.streak, "claim failed again");
            }
            delay
        } else {
            let delay = self.fatal.next_delay(self.streak, rand::random());
            if self.fatal_logged {
                warn!(error = %err, retry_in = ?delay, "claim still failing (not retryable)");
            } else {
                self.fatal_logged = true;
                error!(
                    error = %err,
                    retry_in = ?delay,
                    "claim failed with an error retrying will not fix (schema, permissions?); backing off longer"
                );
            }
            delay
        }
    }

    pub(super) fn succeeded(&mut self) {
        if self.streak > 0 {
            info!(failures = self.streak, "claiming works again");
        }
        self.streak = 0;
        self.fatal_logged = false;
        self.retryable_warned = None;
    }
}

/// A wait that the store's wake-up does not cut short.
pub(super) const NO_WAKEUP: Option<std::future::Pending<()>> = None;

/// Waits for `delay`, `wakeup` (if any) or shutdown.
pub(super) async fn wait(
    delay: Duration,
    shutdown: Pin<&mut (impl Future<Output = ()> + Send)>,
    wakeup: Option<impl Future<Output = ()> + Send>,
) -> Waited {
    let woken = async {
        match wakeup {
            Some(w) => w.await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = shutdown => Waited::Shutdown,
        () = tokio::time::sleep(delay) => Waited::Timer,
        () = woken => Waited::Woken,
    }
}

#[cfg(test)]
mod tests {
    use super::BatchSizer;

    #[test]
    fn the_batch_doubles_while_claims_come_back_full_and_resets_on_a_short_one() {
        let mut s = BatchSizer::new(20, 500);
        let mut asked = Vec::new();
        for _ in 0..7 {
            let n = s.next();
            asked.push(n);
            s.observe(n, n as usize, true);
        }
        assert_eq!(asked, vec![20, 40, 80, 160, 320, 500, 500]);
        // Short, but the store stopped early (keys in flight): keep the size.
        s.observe(500, 37, true);
        assert_eq!(s.next(), 500);
        // Short and nothing more: the backlog is gone.
        s.observe(500, 499, false);
        assert_eq!(s.next(), 20);
        // A full claim that was asked for less than the current size (the
        // one-event probe) does not shrink it.
        s.observe(20, 20, true);
        s.observe(1, 1, true);
        assert_eq!(s.next(), 80);
        // No room to grow: the size stays put.
        let mut flat = BatchSizer::new(20, 20);
        flat.observe(20, 20, true);
        assert_eq!(flat.next(), 20);
    }
}
