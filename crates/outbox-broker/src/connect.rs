//! [`ConnectPolicy`] and [`ReconnectGate`]: how publishers connect and reconnect.

use backon::{ExponentialBuilder, Retryable as _};
use std::future::Future;
use std::time::{Duration, Instant};

/// How a publisher connects to its broker and how long it waits between
/// reconnect attempts, the same for every broker.
///
/// | field | default | meaning |
/// |---|---|---|
/// | `attempts` | 5 | connection attempts of [`ConnectPolicy::connect`] (at least 1) |
/// | `timeout` | 5 s | bound on one attempt |
/// | `min_delay` | 100 ms | delay after the first failed attempt |
/// | `max_delay` | 2 s | cap of the exponential backoff (also between reconnect attempts: a broker that returns is in use again within about 2 s) |
///
/// Delays double from `min_delay` up to `max_delay`; [`ConnectPolicy::connect`]
/// jitters them so that relays restarting together do not reconnect in step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectPolicy {
    /// Connection attempts before [`ConnectPolicy::connect`] gives up (at least 1).
    pub attempts: usize,
    /// Bound on one attempt.
    pub timeout: Duration,
    /// Delay after the first failed attempt.
    pub min_delay: Duration,
    /// Largest delay between two attempts.
    pub max_delay: Duration,
}

impl Default for ConnectPolicy {
    fn default() -> Self {
        Self {
            attempts: 5,
            timeout: Duration::from_secs(5),
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(2),
        }
    }
}

impl ConnectPolicy {
    /// Sets the number of attempts (at least 1).
    pub fn with_attempts(mut self, attempts: usize) -> Self {
        self.attempts = attempts.max(1);
        self
    }

    /// Sets the bound on one attempt.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the first and the largest delay between attempts.
    pub fn with_delays(mut self, min: Duration, max: Duration) -> Self {
        self.min_delay = min;
        self.max_delay = max.max(min);
        self
    }

    /// The delay after `failures` consecutive failed attempts (1 = the
    /// first): `min_delay * 2^(failures-1)`, capped at `max_delay`, without
    /// jitter. Zero for 0 failures.
    pub fn delay(&self, failures: u32) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let factor = 1u32 << (failures - 1).min(20);
        self.min_delay.saturating_mul(factor).min(self.max_delay)
    }

    /// The backon builder of this policy (jittered, `attempts - 1` retries).
    pub fn backoff(&self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_max_times(self.attempts.max(1) - 1)
            .with_jitter()
    }

    /// Runs `attempt` until it succeeds, its error is not retryable, or the
    /// attempts are used up, each attempt bounded by `timeout` (a timed-out
    /// attempt fails with `timed_out()`, which is retried). `broker` names
    /// the broker in the log lines.
    pub async fn connect<T, E, A, Fut>(
        &self,
        broker: &'static str,
        attempt: A,
        is_retryable: impl FnMut(&E) -> bool,
        timed_out: impl Fn() -> E,
    ) -> Result<T, E>
    where
        A: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: std::fmt::Display,
    {
        let timeout = self.timeout;
        let mut attempt = attempt;
        let timed_out = &timed_out;
        let once = || {
            let fut = attempt();
            async move {
                tokio::time::timeout(timeout, fut)
                    .await
                    .unwrap_or_else(|_| Err(timed_out()))
            }
        };
        once.retry(self.backoff())
            .when(is_retryable)
            .notify(|e: &E, delay| {
                tracing::warn!(broker, error = %e, ?delay, "connection failed; retrying");
            })
            .await
    }
}

/// Spaces out reconnect attempts of a publisher that reconnects on its next
/// batch: after a failed attempt the next one is allowed only after
/// [`ConnectPolicy::delay`] of the consecutive failures; until then the
/// publisher answers "unavailable" at once.
#[derive(Debug, Clone)]
pub struct ReconnectGate {
    policy: ConnectPolicy,
    failures: u32,
    not_before: Option<Instant>,
}

impl ReconnectGate {
    /// A gate that allows an attempt now.
    pub fn new(policy: ConnectPolicy) -> Self {
        Self {
            policy,
            failures: 0,
            not_before: None,
        }
    }

    /// `Ok` when an attempt may be made now, else how long until it may.
    pub fn ready(&self) -> Result<(), Duration> {
        match self.not_before {
            Some(t) => match t.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Err(left),
                _ => Ok(()),
            },
            None => Ok(()),
        }
    }

    /// Records a failed attempt; returns the delay before the next one.
    pub fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let delay = self.policy.delay(self.failures);
        self.not_before = Some(Instant::now() + delay);
        delay
    }

    /// Records a successful connection: the next failure starts over.
    pub fn succeeded(&mut self) {
        self.failures = 0;
        self.not_before = None;
    }

    /// Consecutive failed attempts so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// Expands, inside the `impl` block of a publisher's configuration that
/// keeps its [`ConnectPolicy`] in a field `connect`, to the connect builder
/// methods every publisher offers with the same meaning:
/// `with_connect_timeout`, `with_connect_attempts` (documented by
/// `$attempts_doc`: which constructor makes the attempts),
/// `with_connect_policy` and `connect_policy`.
///
/// ```
/// use outbox_broker::ConnectPolicy;
///
/// pub struct MyConfig {
///     connect: ConnectPolicy,
/// }
///
/// impl MyConfig {
///     outbox_broker::connect_policy_builders!(
///         "Attempts of `MyPublisher::connect` (minimum 1), with exponential backoff."
///     );
/// }
///
/// let config = MyConfig { connect: ConnectPolicy::default() }.with_connect_attempts(3);
/// assert_eq!(config.connect_policy().attempts, 3);
/// ```
#[macro_export]
macro_rules! connect_policy_builders {
    ($attempts_doc:literal) => {
        /// Timeout of one connection attempt.
        pub fn with_connect_timeout(mut self, timeout: ::std::time::Duration) -> Self {
            self.connect = self.connect.with_timeout(timeout);
            self
        }

        #[doc = $attempts_doc]
        pub fn with_connect_attempts(mut self, attempts: usize) -> Self {
            self.connect = self.connect.with_attempts(attempts);
            self
        }

        /// The whole connect / reconnect policy at once.
        pub fn with_connect_policy(mut self, policy: $crate::ConnectPolicy) -> Self {
            self.connect = policy;
            self
        }

        /// The connect / reconnect policy.
        pub fn connect_policy(&self) -> $crate::ConnectPolicy {
            self.connect
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn delays_double_and_are_capped() {
        let p = ConnectPolicy::default()
            .with_delays(Duration::from_millis(100), Duration::from_secs(1));
        let d: Vec<u64> = (0..7).map(|f| p.delay(f).as_millis() as u64).collect();
        assert_eq!(d, vec![0, 100, 200, 400, 800, 1000, 1000]);
        assert_eq!(p.delay(u32::MAX), Duration::from_secs(1));
        assert_eq!(ConnectPolicy::default().with_attempts(0).attempts, 1);
    }

    #[test]
    fn gate_spaces_attempts_and_resets_on_success() {
        let p =
            ConnectPolicy::default().with_delays(Duration::from_secs(60), Duration::from_secs(60));
        let mut g = ReconnectGate::new(p);
        assert!(g.ready().is_ok());
        assert_eq!(g.failed(), Duration::from_secs(60));
        let left = g.ready().unwrap_err();
        assert!(left > Duration::from_secs(59), "{left:?}");
        g.succeeded();
        assert!(g.ready().is_ok());
        assert_eq!(g.failures(), 0);
    }

    #[derive(Debug, PartialEq)]
    enum E {
        Refused,
        Denied,
        TimedOut,
    }
    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{self:?}")
        }
    }

    #[tokio::test(start_paused = true)]
    async fn connect_retries_retryable_errors_and_timeouts_then_gives_up() {
        let p = ConnectPolicy::default()
            .with_attempts(4)
            .with_timeout(Duration::from_secs(1));
        let calls = AtomicU32::new(0);
        let r: Result<(), E> = p
            .connect(
                "test",
                || {
                    let n = calls.fetch_add(1, Ordering::SeqCst);
                    async move {
                        if n % 2 == 0 {
                            Err(E::Refused)
                        } else {
                            // Hangs: the policy's timeout ends it.
                            std::future::pending().await
                        }
                    }
                },
                |e| *e != E::Denied,
                || E::TimedOut,
            )
            .await;
        assert_eq!(calls.load(Ordering::SeqCst), 4);
        assert_eq!(r, Err(E::TimedOut));

        let calls = AtomicU32::new(0);
        let r: Result<u8, E> = p
            .connect(
                "test",
                || {
                    let n = calls.fetch_add(1, Ordering::SeqCst);
                    async move {
                        if n < 2 {
                            Err(E::Refused)
                        } else {
                            Ok(7)
                        }
                    }
                },
                |e| *e != E::Denied,
                || E::TimedOut,
            )
            .await;
        assert_eq!(r, Ok(7));

        let calls = AtomicU32::new(0);
        let r: Result<(), E> = p
            .connect(
                "test",
                || {
                    calls.fetch_add(1, Ordering::SeqCst);
                    async { Err(E::Denied) }
                },
                |e| *e != E::Denied,
                || E::TimedOut,
            )
            .await;
        assert_eq!((r, calls.load(Ordering::SeqCst)), (Err(E::Denied), 1));
    }
}
