//! [`InboxOptions`]: how the consumer runs. Every setting has a default.

use crate::store::StoreError;
use outbox_core::{DeadHeadPolicy, RetryPolicy};
use std::time::Duration;

/// How the consumer runs.
#[derive(Debug, Clone)]
pub struct InboxOptions {
    pub(crate) lanes: usize,
    pub(crate) max_in_flight: usize,
    pub(crate) recv_batch: usize,
    pub(crate) lane_batch: usize,
    pub(crate) recv_wait: Duration,
    pub(crate) retry: RetryPolicy,
    pub(crate) dead_head: DeadHeadPolicy,
    pub(crate) retry_poll: Duration,
    pub(crate) retry_workers: usize,
    pub(crate) retention_every: Duration,
    pub(crate) shutdown_grace: Duration,
}

impl Default for InboxOptions {
    fn default() -> Self {
        Self {
            lanes: 8,
            max_in_flight: 2048,
            recv_batch: 512,
            lane_batch: 256,
            recv_wait: Duration::from_millis(200),
            retry: RetryPolicy::default(),
            dead_head: DeadHeadPolicy::Continue,
            retry_poll: Duration::from_millis(250),
            retry_workers: 2,
            retention_every: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

fn positive(what: &str, n: usize) -> Result<usize, StoreError> {
    if n == 0 {
        return Err(StoreError::Config(format!("{what} must be at least 1")));
    }
    Ok(n)
}

impl InboxOptions {
    /// Keys handled in parallel: each key maps to one of `n` lanes (a
    /// transaction at a time each), so different keys run in parallel and a
    /// key's messages run in arrival order (default 8).
    pub fn with_lanes(mut self, n: usize) -> Result<Self, StoreError> {
        self.lanes = positive("lanes", n)?;
        Ok(self)
    }

    /// Messages received but not yet acknowledged, at most (default 2048).
    pub fn with_max_in_flight(mut self, n: usize) -> Result<Self, StoreError> {
        self.max_in_flight = positive("max in flight", n)?;
        Ok(self)
    }

    /// Messages asked of the source per receive (default 512).
    pub fn with_recv_batch(mut self, n: usize) -> Result<Self, StoreError> {
        self.recv_batch = positive("receive batch", n)?;
        Ok(self)
    }

    /// Messages handled in one lane transaction at most (default 256). One
    /// commit covers them all; `1` commits each message alone.
    pub fn with_lane_batch(mut self, n: usize) -> Result<Self, StoreError> {
        self.lane_batch = positive("lane batch", n)?;
        Ok(self)
    }

    /// How long an idle receive waits for the first message (default 200 ms).
    pub fn with_recv_wait(mut self, wait: Duration) -> Self {
        self.recv_wait = wait.max(Duration::from_millis(1));
        self
    }

    /// The retry schedule of failed handlers (the outbox's policy and
    /// defaults: base 1 s, cap 15 min, 8 attempts, equal jitter).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// What a dead message does to its key's later messages (default
    /// [`DeadHeadPolicy::Continue`]: they are handled, the dead message
    /// waits alone for an operator; [`DeadHeadPolicy::Block`] parks them
    /// until it is replayed and handled, or purged).
    pub fn with_dead_head_policy(mut self, policy: DeadHeadPolicy) -> Self {
        self.dead_head = policy;
        self
    }

    /// How often the retry loop looks for due messages (default 250 ms).
    pub fn with_retry_poll(mut self, every: Duration) -> Self {
        self.retry_poll = every.max(Duration::from_millis(1));
        self
    }

    /// Retry loops working on different keys at once (default 2).
    pub fn with_retry_workers(mut self, n: usize) -> Result<Self, StoreError> {
        self.retry_workers = positive("retry workers", n)?;
        Ok(self)
    }

    /// How often the retention pass runs (default 60 s).
    pub fn with_retention_every(mut self, every: Duration) -> Self {
        self.retention_every = every.max(Duration::from_millis(10));
        self
    }

    /// How long a shutdown waits for lane transactions in flight before
    /// leaving their messages unacknowledged (default 10 s).
    pub fn with_shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    pub(crate) fn block_on_dead(&self) -> bool {
        self.dead_head == DeadHeadPolicy::Block
    }
}
