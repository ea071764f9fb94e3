//! [`KeyOrder`]: the per-key order layer every relay puts in front of its sink.
//!
//! A sink may deliver a batch concurrently or pipelined (a broker publisher
//! keeps a window of sends in flight and awaits the acknowledgements
//! together). That is only safe for events of *different* keys: if `e1` and
//! `e2` of the same key are in flight together and `e1` fails, `e2` may be
//! acknowledged while `e1` waits for its retry, and the key's order is broken.
//!
//! [`KeyOrder`] wraps any [`Sink`] (in the spirit of a tower layer, without
//! the dependency) and splits a batch into *waves*: wave `i` holds the
//! `i`-th event of every key (key = [`Event::shard_key`]), in claim order. It
//! hands each wave to the inner sink in one [`Sink::deliver`] call (so the
//! inner sink still pipelines a whole wave) and only then decides what the
//! next wave may contain:
//!
//! | outcome of a key's event in a wave | later events of that key in the batch |
//! |------------------------------------|---------------------------------------|
//! | [`Outcome::Delivered`]             | continue |
//! | `Failed`, [`FailureKind::Permanent`](outbox_core::FailureKind::Permanent) | continue (the "continue" dead-head policy: one poison event does not stop its key) |
//! | `Failed`, [`FailureKind::Retryable`](outbox_core::FailureKind::Retryable) | [`Outcome::NotAttempted`], never passed to the inner sink |
//! | [`Outcome::NotAttempted`] or no outcome | [`Outcome::NotAttempted`] |
//! | `Failed`, [`FailureKind::Unavailable`](outbox_core::FailureKind::Unavailable) | the sink is down: *every* event after this wave is [`Outcome::NotAttempted`] |
//!
//! The relay releases not-attempted events (lease cleared, attempt not
//! counted); the store claims a key's events in order, so they come back
//! after the failed one.
//!
//! Cost: a batch whose events all have distinct keys is one wave and one
//! inner call, exactly as without the layer. A batch holding `n` events of
//! one key takes `n` sequential calls: per-key order cannot be kept with
//! more than one unacknowledged event of a key in flight.

use outbox_core::{Event, Outcome, Sink};
use std::collections::HashMap;
use std::fmt;

/// Builds [`KeyOrder`] sinks (the layer half of the tower-style pair).
///
/// ```
/// use outbox_worker::{HandlerRegistry, KeyOrderLayer};
///
/// let handlers = HandlerRegistry::new().with_handler("order.created", |_| async { Ok(()) });
/// let sink = KeyOrderLayer::new().layer(handlers);
/// assert!(sink.inner().contains("order.created"));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct KeyOrderLayer {
    _private: (),
}

impl KeyOrderLayer {
    /// The layer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Wraps `inner` in a [`KeyOrder`] sink.
    pub fn layer<S: Sink>(&self, inner: S) -> KeyOrder<S> {
        KeyOrder::new(inner)
    }
}

/// A [`Sink`] that keeps per-key order in front of an inner sink that
/// delivers each call concurrently or pipelined: see the [module
/// docs](self) for the waves and what blocks a key. The
/// [`Relay`](crate::Relay) wraps every sink in one; use it directly when
/// driving a sink by hand.
#[derive(Clone, Default)]
pub struct KeyOrder<S> {
    inner: S,
}

impl<S: fmt::Debug> fmt::Debug for KeyOrder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyOrder")
            .field("inner", &self.inner)
            .finish()
    }
}

impl<S> KeyOrder<S> {
    /// `inner` behind the per-key order layer.
    pub fn new(inner: S) -> Self {
        Self { inner }
    }

    /// The wrapped sink.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Unwraps the inner sink.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// How a batch splits into waves.
struct Waves {
    /// Per event: the index of its key (keys numbered in first-seen order).
    key_of: Vec<usize>,
    /// Per event: its wave, the index among the events of its key.
    wave_of: Vec<usize>,
    /// Number of distinct keys.
    keys: usize,
    /// Number of waves (the most events of one key).
    count: usize,
}

/// An event's key for the waves, borrowed: its key, or for a keyless event
/// its id (as [`Event::shard_key`], without formatting the id).
#[derive(PartialEq, Eq, Hash)]
enum WaveKey<'a> {
    Key(&'a str),
    Id(outbox_core::EventId),
}

impl Waves {
    fn of(events: &[Event]) -> Self {
        // Per key: (key index, events seen so far). Borrowed keys: no
        // allocation per event (a keyless event is its own key, its id).
        let mut seen: HashMap<WaveKey<'_>, (usize, usize)> = HashMap::with_capacity(events.len());
        let mut key_of = Vec::with_capacity(events.len());
        let mut wave_of = Vec::with_capacity(events.len());
        let mut count = 0;
        for event in events {
            let next = seen.len();
            let key = match event.key.as_deref() {
                Some(k) => WaveKey::Key(k),
                None => WaveKey::Id(event.id),
            };
            let (key, n) = seen.entry(key).or_insert((next, 0));
            key_of.push(*key);
            wave_of.push(*n);
            *n += 1;
            count = count.max(*n);
        }
        Self {
            key_of,
            wave_of,
            keys: seen.len(),
            count,
        }
    }
}

impl<S: Sink> Sink for KeyOrder<S> {
    fn late_send_bound(&self) -> std::time::Duration {
        self.inner.late_send_bound()
    }

    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        let Waves {
            key_of,
            wave_of,
            keys,
            count,
        } = Waves::of(events);
        if count <= 1 {
            // Every key appears once: one wave, the batch as it is.
            return complete(self.inner.deliver(events).await, events.len());
        }

        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        // Keys whose later events must not be attempted in this batch.
        let mut blocked: Vec<bool> = vec![false; keys];
        let mut sink_down = false;
        // Each wave's members in batch order, grouped once (not one scan of
        // the batch per wave).
        let mut by_wave: Vec<Vec<usize>> = vec![Vec::new(); count];
        for (i, &wave) in wave_of.iter().enumerate() {
            by_wave[wave].push(i);
        }
        for wave in by_wave {
            let members: Vec<usize> = wave
                .into_iter()
                .filter(|&i| {
                    if sink_down || blocked[key_of[i]] {
                        outcomes[i] = Some(Outcome::NotAttempted);
                        false
                    } else {
                        true
                    }
                })
                .collect();
            if members.is_empty() {
                continue;
            }
            let wave_outcomes = if members.iter().copied().eq(0..members.len()) {
                // The wave is a prefix of the batch: no copy needed.
                self.inner.deliver(&events[..members.len()]).await
            } else {
                let batch: Vec<Event> = members.iter().map(|&i| events[i].clone()).collect();
                self.inner.deliver(&batch).await
            };
            let wave_outcomes = complete(wave_outcomes, members.len());
            for (i, outcome) in members.into_iter().zip(wave_outcomes) {
                match &outcome {
                    Outcome::Delivered => {}
                    Outcome::Failed(e) if e.is_sink_unavailable() => {
                        sink_down = true;
                        blocked[key_of[i]] = true;
                    }
                    Outcome::Failed(e) if !e.is_retryable() => {}
                    _ => blocked[key_of[i]] = true,
                }
                outcomes[i] = Some(outcome);
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or(Outcome::NotAttempted))
            .collect()
    }
}

/// Exactly `n` outcomes: a sink that returned too few has the missing ones
/// reported [`Outcome::NotAttempted`] (so the events are released, and the
/// later events of their keys wait), extra ones are dropped; both are logged.
fn complete(mut outcomes: Vec<Outcome>, n: usize) -> Vec<Outcome> {
    if outcomes.len() != n {
        tracing::error!(
            events = n,
            outcomes = outcomes.len(),
            "sink returned the wrong number of outcomes (a sink bug); missing ones are released unattempted"
        );
        outcomes.resize(n, Outcome::NotAttempted);
    }
    outcomes
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use outbox_core::{DeliveryError, ErrorCode, EventId};
    use std::collections::HashSet;
    use std::sync::Mutex;

    fn event(key: &str) -> Event {
        outbox_testkit::publisher::event("orders", Some(key), Vec::new())
    }

    /// Records every call and answers from a table of per-event outcomes
    /// (delivered when absent).
    #[derive(Default)]
    struct Fake {
        answers: HashMap<EventId, Outcome>,
        calls: Mutex<Vec<Vec<EventId>>>,
    }

    impl Sink for Fake {
        async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
            self.calls
                .lock()
                .unwrap()
                .push(events.iter().map(|e| e.id).collect());
            events
                .iter()
                .map(|e| {
                    self.answers
                        .get(&e.id)
                        .cloned()
                        .unwrap_or(Outcome::Delivered)
                })
                .collect()
        }
    }

    fn retryable() -> Outcome {
        Outcome::Failed(DeliveryError::retryable(
            ErrorCode::PUBLISH_REJECTED,
            "nack",
        ))
    }

    fn permanent() -> Outcome {
        Outcome::Failed(DeliveryError::permanent(
            ErrorCode::PUBLISH_TOO_LARGE,
            "big",
        ))
    }

    fn unavailable() -> Outcome {
        Outcome::Failed(DeliveryError::unavailable(
            ErrorCode::PUBLISH_CONNECTION_LOST,
            "connection reset",
        ))
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    fn deliver(fake: Fake, events: &[Event]) -> (Vec<Outcome>, Vec<Vec<EventId>>) {
        let sink = KeyOrderLayer::new().layer(fake);
        let outcomes = block_on(sink.deliver(events));
        let calls = sink.into_inner().calls.into_inner().unwrap();
        (outcomes, calls)
    }

    #[test]
    fn distinct_keys_are_one_call_with_the_batch_as_is() {
        let events = vec![event("a"), event("b"), event("c")];
        let (outcomes, calls) = deliver(Fake::default(), &events);
        assert_eq!(outcomes, vec![Outcome::Delivered; 3]);
        assert_eq!(calls, vec![events.iter().map(|e| e.id).collect::<Vec<_>>()]);
    }

    #[test]
    fn a_retryable_failure_blocks_the_rest_of_its_key_only() {
        // k: e1 e2 e3 pipelined with other keys; e1 fails retryably.
        let events = vec![
            event("k"),
            event("x"),
            event("k"),
            event("y"),
            event("x"),
            event("k"),
        ];
        let mut fake = Fake::default();
        fake.answers.insert(events[0].id, retryable());
        let (outcomes, calls) = deliver(fake, &events);
        assert_eq!(
            outcomes,
            vec![
                retryable(),
                Outcome::Delivered,
                Outcome::NotAttempted,
                Outcome::Delivered,
                Outcome::Delivered,
                Outcome::NotAttempted,
            ]
        );
        let id = |i: usize| events[i].id;
        // Wave 0 pipelines the heads of k, x and y; wave 1 only x's second
        // event: k's later events never reach the inner sink.
        assert_eq!(calls, vec![vec![id(0), id(1), id(3)], vec![id(4)]]);
        let passed: HashSet<EventId> = calls.into_iter().flatten().collect();
        assert!(!passed.contains(&id(2)) && !passed.contains(&id(5)));
    }

    #[test]
    fn a_permanent_failure_does_not_block_its_key() {
        let events = vec![event("k"), event("k"), event("k")];
        let mut fake = Fake::default();
        fake.answers.insert(events[0].id, permanent());
        let (outcomes, calls) = deliver(fake, &events);
        assert_eq!(
            outcomes,
            vec![permanent(), Outcome::Delivered, Outcome::Delivered]
        );
        assert_eq!(calls.len(), 3);
    }

    #[test]
    fn an_unavailable_sink_stops_the_batch() {
        let events = vec![event("a"), event("b"), event("a"), event("c"), event("b")];
        let mut fake = Fake::default();
        fake.answers.insert(events[1].id, unavailable());
        let (outcomes, calls) = deliver(fake, &events);
        assert_eq!(
            outcomes,
            vec![
                Outcome::Delivered,
                unavailable(),
                Outcome::NotAttempted,
                Outcome::Delivered,
                Outcome::NotAttempted,
            ]
        );
        assert_eq!(calls.len(), 1, "nothing is sent after an outage");
    }

    #[test]
    fn not_attempted_blocks_and_missing_outcomes_are_not_attempted() {
        struct Short;
        impl Sink for Short {
            async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
                vec![Outcome::Delivered; events.len().saturating_sub(1)]
            }
        }
        let events = vec![event("a"), event("b"), event("b")];
        let sink = KeyOrder::new(Short);
        let outcomes = block_on(sink.deliver(&events));
        // Wave 0 = [a, b]: b's outcome is missing, so b's second event waits.
        assert_eq!(
            outcomes,
            vec![
                Outcome::Delivered,
                Outcome::NotAttempted,
                Outcome::NotAttempted
            ]
        );
    }

    #[test]
    fn events_without_a_key_are_their_own_key() {
        let mut a = event("ignored");
        a.key = None;
        let mut b = event("ignored");
        b.key = None;
        let (outcomes, calls) = deliver(Fake::default(), &[a, b]);
        assert_eq!(outcomes, vec![Outcome::Delivered; 2]);
        assert_eq!(calls.len(), 1);
    }
}
