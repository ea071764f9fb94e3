//! The retry schedule: pure data and a pure function. Nothing here sleeps.

use std::time::Duration;
use thiserror::Error;

/// How the exponential delay is randomised, so that a recovered dependency
/// does not receive a synchronised wave of retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Jitter {
    /// No randomisation: the delay is exactly the capped exponential delay.
    None,
    /// `delay * (0.5 + 0.5 * r)`: between half and all of the delay (the Go
    /// worker's behaviour; the default).
    #[default]
    Equal,
    /// `delay * r`: anywhere between zero and the delay.
    Full,
}

/// Retry schedule for failed deliveries.
///
/// The delay before attempt `n + 1` after a failed attempt `n` (1-based) is
/// `min(base * 2^(n-1), cap)`, then jittered. After `max_attempts` failed
/// attempts an event is dead-lettered. Defaults: base 1 s, cap 15 min,
/// 8 attempts, equal jitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    base: Duration,
    cap: Duration,
    max_attempts: u32,
    jitter: Jitter,
}

/// A [`RetryPolicy`] that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum InvalidRetryPolicy {
    /// The base delay was zero.
    #[error("retry base delay must be greater than zero")]
    ZeroBase,
    /// The cap was below the base delay.
    #[error("retry cap ({cap:?}) must be at least the base delay ({base:?})")]
    CapBelowBase {
        /// The base delay given.
        base: Duration,
        /// The cap given.
        cap: Duration,
    },
    /// `max_attempts` was zero.
    #[error("max attempts must be at least 1")]
    ZeroAttempts,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(15 * 60),
            max_attempts: 8,
            jitter: Jitter::Equal,
        }
    }
}

impl RetryPolicy {
    /// A validated policy: `base > 0`, `cap >= base`, `max_attempts >= 1`.
    pub fn new(
        base: Duration,
        cap: Duration,
        max_attempts: u32,
        jitter: Jitter,
    ) -> Result<Self, InvalidRetryPolicy> {
        if base.is_zero() {
            return Err(InvalidRetryPolicy::ZeroBase);
        }
        if cap < base {
            return Err(InvalidRetryPolicy::CapBelowBase { base, cap });
        }
        if max_attempts == 0 {
            return Err(InvalidRetryPolicy::ZeroAttempts);
        }
        Ok(Self {
            base,
            cap,
            max_attempts,
            jitter,
        })
    }

    /// Base delay (before the first retry).
    pub fn base(&self) -> Duration {
        self.base
    }

    /// Largest delay before jitter.
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// Attempts after which an event is dead-lettered.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The jitter mode.
    pub fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// Whether an event that has now failed `attempts` times may be retried.
    pub fn should_retry(&self, attempts: u32) -> bool {
        attempts < self.max_attempts
    }

    /// The capped exponential delay after failed attempt `attempt` (1-based),
    /// before jitter: `min(base * 2^(attempt-1), cap)`. Attempt 0 is treated as 1.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(63);
        let factor = 1u64 << exp;
        let nanos = self.base.as_nanos().saturating_mul(u128::from(factor));
        if nanos >= self.cap.as_nanos() {
            self.cap
        } else {
            // nanos < cap, which fits in a Duration.
            Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        }
    }

    /// The delay to wait after failed attempt `attempt`, jittered with the
    /// random number `r` in `[0, 1]` (values outside are clamped). Pure: the
    /// caller supplies the randomness, so tests can pin it.
    pub fn next_delay(&self, attempt: u32, r: f64) -> Duration {
        let r = if r.is_nan() { 1.0 } else { r.clamp(0.0, 1.0) };
        let d = self.backoff(attempt);
        match self.jitter {
            Jitter::None => d,
            Jitter::Equal => d.mul_f64(0.5 + 0.5 * r).min(d),
            Jitter::Full => d.mul_f64(r).min(d),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn defaults_match_the_seed_worker() {
        let p = RetryPolicy::default();
        assert_eq!(p.base(), Duration::from_secs(1));
        assert_eq!(p.cap(), Duration::from_secs(900));
        assert_eq!(p.max_attempts(), 8);
        assert_eq!(p.jitter(), Jitter::Equal);
        assert_eq!(p.backoff(1), Duration::from_secs(1));
        assert_eq!(p.backoff(2), Duration::from_secs(2));
        assert_eq!(p.backoff(4), Duration::from_secs(8));
        assert_eq!(p.backoff(11), Duration::from_secs(900));
        assert_eq!(p.next_delay(3, 0.0), Duration::from_secs(2));
        assert!(p.should_retry(7));
        assert!(!p.should_retry(8));
    }

    #[test]
    fn invalid_policies_are_rejected() {
        let s = Duration::from_secs(1);
        assert_eq!(
            RetryPolicy::new(Duration::ZERO, s, 1, Jitter::None),
            Err(InvalidRetryPolicy::ZeroBase)
        );
        assert!(matches!(
            RetryPolicy::new(s * 2, s, 1, Jitter::None),
            Err(InvalidRetryPolicy::CapBelowBase { .. })
        ));
        assert_eq!(
            RetryPolicy::new(s, s, 0, Jitter::None),
            Err(InvalidRetryPolicy::ZeroAttempts)
        );
    }

    fn policy(jitter: Jitter) -> impl Strategy<Value = RetryPolicy> {
        (1u64..10_000, 1u64..1_000, 1u32..20).prop_map(move |(base_ms, mult, attempts)| {
            let base = Duration::from_millis(base_ms);
            RetryPolicy::new(base, base * mult as u32, attempts, jitter).unwrap()
        })
    }

    proptest! {
        #[test]
        fn never_above_the_cap(p in policy(Jitter::Full), a in 0u32..200, r in -1.0f64..2.0) {
            prop_assert!(p.next_delay(a, r) <= p.cap());
        }

        #[test]
        fn monotone_without_jitter(p in policy(Jitter::None), a in 0u32..100) {
            prop_assert!(p.next_delay(a, 0.3) <= p.next_delay(a + 1, 0.3));
        }

        #[test]
        fn equal_jitter_within_half_and_full(p in policy(Jitter::Equal), a in 1u32..100, r in 0.0f64..=1.0) {
            let base = p.backoff(a);
            let d = p.next_delay(a, r);
            prop_assert!(d <= base);
            prop_assert!(d.as_secs_f64() >= base.as_secs_f64() * 0.5 - 1e-9);
        }
    }
}
