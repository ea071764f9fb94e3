//! [`RelayOptions`]: the relay's knobs, with the seed worker's names and defaults.

use outbox_core::{RelayId, RetryPolicy, ShardSpec};
use std::time::Duration;
use thiserror::Error;

/// How a [`crate::Relay`] claims, waits, retries and reports.
///
/// | option            | default          | meaning |
/// |-------------------|------------------|---------|
/// | `poll_interval`   | 2 s              | longest wait between claims while the outbox is empty (idle polling starts at 1 ms and doubles up to it) |
/// | `lock_timeout`    | 1 min            | lease length of a claim (database clock); renewed every third of it while the batch is held |
/// | `delivery_timeout`| `lock_timeout`   | longest a sink may take for one batch before the delivery is cancelled and its events released; at most `lock_timeout` |
/// | `retry`           | 1 s / 15 min / 8 attempts, equal jitter | [`RetryPolicy`] for failed deliveries |
/// | `batch_size`      | 20               | most events per claim while the relay keeps up |
/// | `max_batch_size`  | `batch_size`     | most events per claim while it catches up: full claims double the next one up to this |
/// | `lag_alert`       | 5 min            | `outbox_lag_alert` is 1 while the oldest event of a batch is older |
/// | `shard`           | `0/1` (all keys) | only claim events whose key hashes to this shard |
/// | `relay_id`        | `relay-<pid>-<random>` | lease owner recorded in the store |
/// | `drain`           | `true`           | claim again at once after a full batch |
/// | `shutdown_grace`  | 30 s             | how long an in-flight delivery may run after shutdown was asked |
/// | `max_rate`        | none             | most events handed to the sink per second (a token bucket of one batch) |
///
/// Build with [`RelayOptions::default`] and the `with_*` methods, then
/// [`RelayOptions::validate`] (also done by [`crate::Relay::new`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RelayOptions {
    poll_interval: Duration,
    lock_timeout: Duration,
    retry: RetryPolicy,
    batch_size: u32,
    max_batch_size: Option<u32>,
    lag_alert: Duration,
    shard: ShardSpec,
    relay_id: RelayId,
    drain: bool,
    shutdown_grace: Duration,
    /// `None`: the lock timeout.
    delivery_timeout: Option<Duration>,
    max_rate: Option<u32>,
}

/// Options that cannot work, with the offending value.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum InvalidOptions {
    /// `batch_size` was 0.
    #[error("batch size must be at least 1 (got 0)")]
    ZeroBatchSize,
    /// `poll_interval` was 0.
    #[error("poll interval must be greater than zero")]
    ZeroPollInterval,
    /// `lock_timeout` was below one second (SQL lease arithmetic is in whole
    /// milliseconds and a sub-second lease expires while the batch is delivered).
    #[error("lock timeout must be at least 1s (got {0:?})")]
    LockTimeoutTooShort(Duration),
    /// The relay id was empty.
    #[error("relay id must not be empty")]
    EmptyRelayId,
    /// `delivery_timeout` was 0.
    #[error("delivery timeout must be greater than zero")]
    ZeroDeliveryTimeout,
    /// `max_batch_size` was below `batch_size`.
    #[error("max batch size ({max}) must be at least the batch size ({batch})")]
    MaxBatchBelowBatch {
        /// `batch_size`.
        batch: u32,
        /// `max_batch_size`.
        max: u32,
    },
    /// `delivery_timeout` was set longer than `lock_timeout`: a batch must
    /// be delivered within one lease (see [`RelayOptions::with_delivery_timeout`]).
    #[error(
        "delivery timeout ({delivery_timeout:?}) must not be longer than the lock timeout ({lock_timeout:?}): \
         a batch is delivered within one lease; lower delivery_timeout or raise lock_timeout"
    )]
    DeliveryTimeoutAboveLease {
        /// `delivery_timeout`.
        delivery_timeout: Duration,
        /// `lock_timeout`.
        lock_timeout: Duration,
    },
    /// `max_rate` was 0 (leave it unset for no limit).
    #[error("max rate must be at least 1 event per second (leave it unset for no limit)")]
    ZeroMaxRate,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(2),
            lock_timeout: Duration::from_secs(60),
            retry: RetryPolicy::default(),
            batch_size: 20,
            max_batch_size: None,
            lag_alert: Duration::from_secs(5 * 60),
            shard: ShardSpec::ALL,
            relay_id: RelayId::generate(),
            drain: true,
            shutdown_grace: Duration::from_secs(30),
            delivery_timeout: None,
            max_rate: None,
        }
    }
}

impl RelayOptions {
    /// The longest wait between claims while the outbox is empty (default
    /// 2 s). After an empty claim the relay checks again after a few
    /// milliseconds and doubles the wait up to this; any batch or store
    /// wake-up resets it.
    pub fn with_poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// Lease length of a claim (default 1 min, at least 1 s). While a batch
    /// (or the prefetched next batch) is held, the relay renews its lease
    /// every third of this, so a batch may be held (claimed ahead, waiting
    /// for the rate limit, delivered, settled) longer than the lease. When
    /// renewals fail (the database is unreachable) the lease ends by the
    /// relay's own clock: the delivery in flight is cancelled and its events
    /// released a little before the lease the last successful claim or
    /// renewal established runs out (3 % of this plus 250 ms earlier, for
    /// clock rate drift), so no other relay can hold the events while this
    /// one still sends them. It also bounds how long a crashed relay's
    /// events stay leased, and [`delivery_timeout`](Self::with_delivery_timeout).
    pub fn with_lock_timeout(mut self, d: Duration) -> Self {
        self.lock_timeout = d;
        self
    }

    /// Retry policy for failed deliveries (default [`RetryPolicy::default`]).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Most events per claim (default 20).
    pub fn with_batch_size(mut self, n: u32) -> Self {
        self.batch_size = n;
        self
    }

    /// The largest claim while the relay catches up with a backlog (default:
    /// `batch_size`, no growth). After a claim that came back full, the
    /// next claim asks for twice as many events, up to this; the first
    /// claim that comes back short returns to `batch_size`. Small batches
    /// keep latency and the duplicates of a crash (one batch) low while the
    /// relay keeps up; large ones drain a backlog (after a sink outage, a
    /// relay restart) at the store's and the sink's batch speed. With
    /// [`max_rate`](Self::with_max_rate) set, batches do not grow. `None`
    /// means `batch_size`; a value below `batch_size` is refused by
    /// [`RelayOptions::validate`].
    pub fn with_max_batch_size(mut self, n: Option<u32>) -> Self {
        self.max_batch_size = n;
        self
    }

    /// Lag above which `outbox_lag_alert` is raised (default 5 min).
    pub fn with_lag_alert(mut self, d: Duration) -> Self {
        self.lag_alert = d;
        self
    }

    /// The shard this relay owns (default all keys).
    pub fn with_shard(mut self, shard: ShardSpec) -> Self {
        self.shard = shard;
        self
    }

    /// The lease owner id (default [`RelayId::generate`]).
    pub fn with_relay_id(mut self, id: RelayId) -> Self {
        self.relay_id = id;
        self
    }

    /// Whether to claim again at once after a full batch (default true).
    pub fn with_drain(mut self, drain: bool) -> Self {
        self.drain = drain;
        self
    }

    /// How long an in-flight delivery may still run after shutdown was
    /// requested before it is abandoned and its events released (default 30 s).
    pub fn with_shutdown_grace(mut self, d: Duration) -> Self {
        self.shutdown_grace = d;
        self
    }

    /// The longest a sink may take for one batch (default: the lock
    /// timeout). A delivery still running then is cancelled (its future
    /// dropped; a [`HandlerRegistry`](crate::HandlerRegistry) aborts its
    /// handler tasks) and its events are released unattempted, with a
    /// warning coded `DELIVERY_TIMEOUT`. A value longer than the lock
    /// timeout is refused by [`RelayOptions::validate`]
    /// ([`InvalidOptions::DeliveryTimeoutAboveLease`]): one batch's delivery
    /// fits in one lease, so a delivery is never kept alive by renewals
    /// alone (ARCHITECTURE.md, "Decisions").
    pub fn with_delivery_timeout(mut self, d: Duration) -> Self {
        self.delivery_timeout = Some(d);
        self
    }

    /// Most events handed to the sink per second (default: no limit). A
    /// token bucket of one batch (`batch_size` tokens) refilled at this
    /// rate: a claimed batch waits until there are enough tokens for all
    /// its events, then goes to the sink whole (never one sleep per event);
    /// after an idle moment at most one batch goes at once. The wait holds
    /// the batch's lease (renewed as usual). `Some(0)` is refused by
    /// [`RelayOptions::validate`].
    pub fn with_max_rate(mut self, events_per_second: Option<u32>) -> Self {
        self.max_rate = events_per_second;
        self
    }

    /// Poll interval.
    pub fn poll_interval(&self) -> Duration {
        self.poll_interval
    }

    /// Lease length.
    pub fn lock_timeout(&self) -> Duration {
        self.lock_timeout
    }

    /// Retry policy.
    pub fn retry(&self) -> &RetryPolicy {
        &self.retry
    }

    /// Batch size.
    pub fn batch_size(&self) -> u32 {
        self.batch_size
    }

    /// The largest claim while catching up (`batch_size` unless set higher).
    pub fn max_batch_size(&self) -> u32 {
        self.max_batch_size
            .unwrap_or(self.batch_size)
            .max(self.batch_size)
    }

    /// Lag alert threshold.
    pub fn lag_alert(&self) -> Duration {
        self.lag_alert
    }

    /// Shard spec.
    pub fn shard(&self) -> ShardSpec {
        self.shard
    }

    /// Relay id.
    pub fn relay_id(&self) -> &RelayId {
        &self.relay_id
    }

    /// Drain mode.
    pub fn drain(&self) -> bool {
        self.drain
    }

    /// Shutdown grace period.
    pub fn shutdown_grace(&self) -> Duration {
        self.shutdown_grace
    }

    /// Delivery timeout (the lock timeout unless set).
    pub fn delivery_timeout(&self) -> Duration {
        self.delivery_timeout.unwrap_or(self.lock_timeout)
    }

    /// Rate limit in events per second, if any.
    pub fn max_rate(&self) -> Option<u32> {
        self.max_rate
    }

    /// Checks the options (the retry policy and shard spec are validated when built).
    pub fn validate(&self) -> Result<(), InvalidOptions> {
        if self.batch_size == 0 {
            return Err(InvalidOptions::ZeroBatchSize);
        }
        if self.poll_interval.is_zero() {
            return Err(InvalidOptions::ZeroPollInterval);
        }
        if self.lock_timeout < Duration::from_secs(1) {
            return Err(InvalidOptions::LockTimeoutTooShort(self.lock_timeout));
        }
        if self.relay_id.as_str().is_empty() {
            return Err(InvalidOptions::EmptyRelayId);
        }
        if self.delivery_timeout().is_zero() {
            return Err(InvalidOptions::ZeroDeliveryTimeout);
        }
        if self.delivery_timeout() > self.lock_timeout {
            return Err(InvalidOptions::DeliveryTimeoutAboveLease {
                delivery_timeout: self.delivery_timeout(),
                lock_timeout: self.lock_timeout,
            });
        }
        if self.max_rate == Some(0) {
            return Err(InvalidOptions::ZeroMaxRate);
        }
        if let Some(max) = self.max_batch_size {
            if max < self.batch_size {
                return Err(InvalidOptions::MaxBatchBelowBatch {
                    batch: self.batch_size,
                    max,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_seed_workers() {
        let o = RelayOptions::default();
        assert_eq!(o.poll_interval(), Duration::from_secs(2));
        assert_eq!(o.lock_timeout(), Duration::from_secs(60));
        assert_eq!(o.batch_size(), 20);
        assert_eq!(o.retry().base(), Duration::from_secs(1));
        assert_eq!(o.retry().cap(), Duration::from_secs(900));
        assert_eq!(o.retry().max_attempts(), 8);
        assert_eq!(o.shard(), ShardSpec::ALL);
        assert!(o.drain());
        assert_eq!(o.delivery_timeout(), o.lock_timeout(), "follows the lease");
        let short = o.clone().with_lock_timeout(Duration::from_secs(10));
        assert_eq!(short.delivery_timeout(), Duration::from_secs(10));
        assert_eq!(short.validate(), Ok(()));
        assert_eq!(o.max_rate(), None);
        assert_eq!(o.max_batch_size(), 20, "no growth unless asked");
        assert_eq!(o.validate(), Ok(()));
    }

    #[test]
    fn validation_names_the_problem() {
        let o = RelayOptions::default();
        assert_eq!(
            o.clone()
                .with_batch_size(50)
                .with_max_batch_size(Some(40))
                .validate(),
            Err(InvalidOptions::MaxBatchBelowBatch { batch: 50, max: 40 })
        );
        let grows = o.clone().with_max_batch_size(Some(1000));
        assert_eq!((grows.validate(), grows.max_batch_size()), (Ok(()), 1000));
        assert_eq!(
            o.clone().with_batch_size(0).validate(),
            Err(InvalidOptions::ZeroBatchSize)
        );
        assert_eq!(
            o.clone().with_poll_interval(Duration::ZERO).validate(),
            Err(InvalidOptions::ZeroPollInterval)
        );
        assert!(matches!(
            o.clone()
                .with_lock_timeout(Duration::from_millis(10))
                .validate(),
            Err(InvalidOptions::LockTimeoutTooShort(_))
        ));
        assert_eq!(
            o.clone().with_relay_id(RelayId::new("")).validate(),
            Err(InvalidOptions::EmptyRelayId)
        );
        assert_eq!(
            o.clone().with_delivery_timeout(Duration::ZERO).validate(),
            Err(InvalidOptions::ZeroDeliveryTimeout)
        );
        assert_eq!(
            o.clone().with_max_rate(Some(0)).validate(),
            Err(InvalidOptions::ZeroMaxRate)
        );
        assert_eq!(o.with_max_rate(Some(1)).validate(), Ok(()));
    }

    /// A delivery timeout longer than the lease is refused at start, with
    /// a message naming both settings; equal or shorter is fine.
    #[test]
    fn a_delivery_timeout_longer_than_the_lease_is_refused() {
        let o = RelayOptions::default().with_lock_timeout(Duration::from_secs(60));
        let err = o
            .clone()
            .with_delivery_timeout(Duration::from_secs(300))
            .validate()
            .unwrap_err();
        assert_eq!(
            err,
            InvalidOptions::DeliveryTimeoutAboveLease {
                delivery_timeout: Duration::from_secs(300),
                lock_timeout: Duration::from_secs(60),
            }
        );
        let message = err.to_string();
        assert!(
            message.contains("delivery timeout (300s)")
                && message.contains("lock timeout (60s)")
                && message.contains("lower delivery_timeout or raise lock_timeout"),
            "{message}"
        );
        for ok in [60, 30] {
            let d = Duration::from_secs(ok);
            assert_eq!(o.clone().with_delivery_timeout(d).validate(), Ok(()));
        }
        // The lease shortened below an explicit delivery timeout: refused too.
        assert!(matches!(
            RelayOptions::default()
                .with_delivery_timeout(Duration::from_secs(30))
                .with_lock_timeout(Duration::from_secs(10))
                .validate(),
            Err(InvalidOptions::DeliveryTimeoutAboveLease { .. })
        ));
    }
}
