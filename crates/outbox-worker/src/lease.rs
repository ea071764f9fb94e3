//! The leases a relay holds, and their renewal.
//!
//! A relay holds at most two claims at a time: the batch being delivered and,
//! in drain mode, the next batch claimed while that delivery ran. Both are
//! renewed (fenced, through [`Store::renew`](outbox_core::Store::renew))
//! every third of the lock timeout, so neither can expire while the relay is
//! alive and working on it; the lock timeout only bounds how long a crashed
//! relay's events stay leased.
//!
//! Each lease also carries the relay's own estimate of when it ends: the
//! instant the last successful claim or renewal was *sent* plus the lock
//! timeout. It is a lower bound of the database's lease end (the database
//! computes `now() + lease` later than the request left), so the relay can
//! use it as the deadline for retrying a settlement without ever relying on
//! its clock for the lease itself.
//!
//! A renewal that finds a lease lost marks it and wakes [`Leases::lost`]:
//! the relay awaits that next to the delivery of the batch and stops the
//! delivery the moment the loss is known (see the relay's docs, "A lease
//! lost during delivery").

use outbox_core::FencingToken;
use std::collections::HashMap;
use std::sync::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Whether a held claim is being delivered or waits its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Use {
    /// Handed to the sink.
    Delivering,
    /// Claimed ahead (drain mode), not yet handed to the sink.
    Prefetched,
}

#[derive(Debug)]
struct Lease {
    events: u64,
    until: Instant,
    /// Once a renewal found the lease lost: the events it still held then.
    lost: Option<u64>,
    usage: Use,
}

/// What a renewal found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewed {
    /// Still held in full; the deadline moved.
    Held,
    /// The token holds fewer events than it claimed (or none): the lease was
    /// lost, first noticed now.
    Lost {
        /// Events claimed.
        claimed: u64,
        /// Events still held.
        held: u64,
        /// What the claim was used for.
        usage: Use,
    },
    /// Already known lost, or no longer tracked (settled meanwhile).
    Ignored,
}

/// The claims a relay holds, shared by the relay loop and its renewal loop
/// (both run on the relay's task; the lock is never held across an await).
#[derive(Debug, Default)]
pub(crate) struct Leases {
    held: Mutex<HashMap<FencingToken, Lease>>,
    /// Woken whenever a renewal marks a lease lost.
    lost: Notify,
}

impl Leases {
    fn with<T>(&self, f: impl FnOnce(&mut HashMap<FencingToken, Lease>) -> T) -> T {
        // A poisoned lock only means a panic elsewhere; the map stays usable.
        let mut guard = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut guard)
    }

    /// Starts tracking a claim of `events` events whose lease ends no
    /// earlier than `until`.
    pub(crate) fn insert(&self, token: FencingToken, events: usize, until: Instant, usage: Use) {
        self.with(|m| {
            m.insert(
                token,
                Lease {
                    events: events as u64,
                    until,
                    lost: None,
                    usage,
                },
            )
        });
    }

    /// Marks a prefetched claim as handed to the sink.
    pub(crate) fn delivering(&self, token: FencingToken) {
        self.with(|m| {
            if let Some(l) = m.get_mut(&token) {
                l.usage = Use::Delivering;
            }
        });
    }

    /// Whether a renewal found the claim's lease lost.
    pub(crate) fn is_lost(&self, token: FencingToken) -> bool {
        self.lost_holding(token).is_some()
    }

    /// When a renewal found the claim's lease lost: the events it still held.
    fn lost_holding(&self, token: FencingToken) -> Option<u64> {
        self.with(|m| m.get(&token).and_then(|l| l.lost))
    }

    /// Completes once a renewal finds the lease of `token` lost (at once if
    /// one already did), with the number of its events the claim still
    /// held then (0: every one was taken over). Never completes for a
    /// claim that stays held or is no longer tracked.
    pub(crate) async fn lost(&self, token: FencingToken) -> u64 {
        loop {
            // Registered before the check: a loss marked in between still
            // wakes this waiter.
            let notified = self.lost.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if let Some(held) = self.lost_holding(token) {
                return held;
            }
            notified.await;
        }
    }

    /// Stops tracking (and renewing) a claim; returns its lease deadline.
    pub(crate) fn remove(&self, token: FencingToken) -> Option<Instant> {
        self.with(|m| m.remove(&token).map(|l| l.until))
    }

    /// The claims to renew now.
    pub(crate) fn tokens(&self) -> Vec<FencingToken> {
        self.with(|m| {
            m.iter()
                .filter(|(_, l)| l.lost.is_none())
                .map(|(t, _)| *t)
                .collect()
        })
    }

    /// Records a renewal of `token` that found `held` events still held;
    /// `until` is the new deadline if it was held in full.
    /// A lease found lost wakes every [`Leases::lost`] waiter.
    pub(crate) fn renewed(&self, token: FencingToken, held: u64, until: Instant) -> Renewed {
        let renewed = self.with(|m| {
            let Some(lease) = m.get_mut(&token) else {
                return Renewed::Ignored;
            };
            if lease.lost.is_some() {
                return Renewed::Ignored;
            }
            if held >= lease.events {
                lease.until = lease.until.max(until);
                Renewed::Held
            } else {
                lease.lost = Some(held);
                Renewed::Lost {
                    claimed: lease.events,
                    held,
                    usage: lease.usage,
                }
            }
        });
        if matches!(renewed, Renewed::Lost { .. }) {
            self.lost.notify_waiters();
        }
        renewed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn renewal_moves_the_deadline_or_marks_the_lease_lost_once() {
        let leases = Leases::default();
        let (a, b) = (FencingToken::new(), FencingToken::new());
        let t0 = Instant::now();
        leases.insert(a, 3, t0, Use::Delivering);
        leases.insert(b, 2, t0, Use::Prefetched);
        assert_eq!(leases.tokens().len(), 2);

        let later = t0 + Duration::from_secs(1);
        assert_eq!(leases.renewed(a, 3, later), Renewed::Held);
        assert_eq!(
            leases.renewed(b, 1, later),
            Renewed::Lost {
                claimed: 2,
                held: 1,
                usage: Use::Prefetched
            }
        );
        assert_eq!(leases.renewed(b, 0, later), Renewed::Ignored);
        assert!(leases.is_lost(b) && !leases.is_lost(a));
        assert_eq!(leases.tokens(), vec![a]);

        assert_eq!(leases.remove(a), Some(later));
        assert_eq!(
            leases.renewed(a, 0, later),
            Renewed::Ignored,
            "settled meanwhile"
        );
        leases.delivering(b);
        assert_eq!(leases.remove(b), Some(t0));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_waiter_learns_of_the_loss_with_the_events_still_held() {
        use futures::FutureExt;
        let leases = Leases::default();
        let (a, b) = (FencingToken::new(), FencingToken::new());
        let t0 = Instant::now();
        leases.insert(a, 3, t0, Use::Delivering);
        leases.insert(b, 2, t0, Use::Delivering);
        let mut lost_a = std::pin::pin!(leases.lost(a));
        assert_eq!(lost_a.as_mut().now_or_never(), None, "held: nothing yet");
        assert_eq!(leases.renewed(a, 3, t0), Renewed::Held);
        assert_eq!(lost_a.as_mut().now_or_never(), None, "renewed in full");
        assert!(matches!(leases.renewed(a, 1, t0), Renewed::Lost { .. }));
        assert_eq!(lost_a.await, 1, "woken, with the one event still held");
        // Asked after the loss: at once; another claim is not affected.
        assert_eq!(leases.lost(a).now_or_never(), Some(1));
        assert_eq!(leases.lost(b).now_or_never(), None);
        // Untracked: never.
        assert_eq!(leases.lost(FencingToken::new()).now_or_never(), None);
    }
}
