//! Test sinks and settings for relays under test (the relay library's own
//! tests and the binary's): a [`CountingSink`] that records how often each
//! event arrived, and [`fast_retry`], a retry policy measured in
//! milliseconds. Only `outbox-core` types: the test kit never depends on
//! the relay.

use outbox_core::{Event, EventId, Jitter, Outcome, RetryPolicy, Sink};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Delivers every event, counting the deliveries per event id; each batch
/// first takes [`CountingSink::with_delay`] (none by default: no timer at
/// all, so a paused tokio clock stays where it is). Clones share the counts.
#[derive(Debug, Clone, Default)]
pub struct CountingSink {
    delay: Duration,
    seen: Arc<Mutex<HashMap<EventId, u32>>>,
}

impl CountingSink {
    /// A sink whose every batch takes `delay` (a slow broker).
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// How often each event was delivered so far.
    pub fn counts(&self) -> HashMap<EventId, u32> {
        self.seen.lock().unwrap().clone()
    }
}

impl Sink for CountingSink {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let mut seen = self.seen.lock().unwrap();
        for e in events {
            *seen.entry(e.id).or_default() += 1;
        }
        vec![Outcome::Delivered; events.len()]
    }
}

/// Retries 10 ms, then 20 ms, doubling up to 40 ms, without jitter; an
/// event is dead after `max_attempts`.
pub fn fast_retry(max_attempts: u32) -> RetryPolicy {
    RetryPolicy::new(
        Duration::from_millis(10),
        Duration::from_millis(40),
        max_attempts,
        Jitter::None,
    )
    .unwrap()
}
