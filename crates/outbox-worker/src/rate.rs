//! The rate limit ([`RelayOptions::with_max_rate`](crate::RelayOptions::with_max_rate)):
//! a token bucket in front of the sink.
//!
//! The bucket holds at most one batch of tokens (`batch_size`) and refills
//! at `max_rate` tokens per second. Before a claimed batch of `n` events is
//! handed to the sink, the relay takes `n` tokens, waiting first until
//! there are that many: one wait per batch, never a sleep per event, and a
//! burst (after an idle moment) of at most one batch. Every event handed to
//! the sink costs a token (also one that then fails or is held back by the
//! per-key order layer): the limit is on what reaches the sink.

use std::time::Duration;
use tokio::time::Instant;

/// A token bucket: `rate` tokens per second, at most `capacity`.
#[derive(Debug, Clone)]
pub(crate) struct TokenBucket {
    rate: f64,
    capacity: f64,
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    /// A full bucket of `capacity` tokens (at least 1) refilled at `rate`
    /// per second (more than 0).
    pub(crate) fn new(rate: f64, capacity: u32, now: Instant) -> Self {
        let capacity = f64::from(capacity.max(1));
        Self {
            rate,
            capacity,
            tokens: capacity,
            at: now,
        }
    }

    /// Takes `n` tokens (at most the capacity) at `now`; returns how long to
    /// wait before using them (zero when they were there). The tokens are
    /// taken at once, so the bucket may go below zero: the next caller waits
    /// for the debt to be refilled too.
    pub(crate) fn take(&mut self, n: usize, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.capacity);
        let n = (n as f64).min(self.capacity);
        self.tokens -= n;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn bursts_one_batch_then_waits_for_each_batch() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(200.0, 20, t0);
        // A full bucket: the first batch goes at once.
        assert_eq!(b.take(20, t0), Duration::ZERO);
        // The next one waits for 20 tokens at 200/s: 100 ms.
        let wait = b.take(20, t0);
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-9, "{wait:?}");
        // After waiting, a third batch waits another 100 ms.
        let wait = b.take(20, t0 + Duration::from_millis(100));
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-9, "{wait:?}");
    }

    #[test]
    fn a_partial_batch_waits_for_its_own_size_and_idle_time_refills_to_one_batch() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10.0, 20, t0);
        assert_eq!(b.take(20, t0), Duration::ZERO);
        let wait = b.take(5, t0);
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-9, "{wait:?}");
        // An hour idle refills one batch, not 36,000 tokens.
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(b.take(20, later), Duration::ZERO);
        assert!(b.take(1, later) > Duration::ZERO);
    }

    #[test]
    fn the_long_run_rate_is_the_limit() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(200.0, 20, t0);
        let mut now = t0;
        for _ in 0..30 {
            now += b.take(20, now);
        }
        // 600 events: the first 20 free, 580 at 200/s.
        let took = now - t0;
        assert!((took.as_secs_f64() - 2.9).abs() < 1e-6, "{took:?}");
    }
}
