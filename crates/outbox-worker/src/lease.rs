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

use outbox_core::FencingToken;
use std::collections::HashMap;
use std::sync::Mutex;
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
    lost: bool,
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
                    lost: false,
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
        self.with(|m| m.get(&token).is_some_and(|l| l.lost))
    }

    /// Stops tracking (and renewing) a claim; returns its lease deadline.
    pub(crate) fn remove(&self, token: FencingToken) -> Option<Instant> {
        self.with(|m| m.remove(&token).map(|l| l.until))
    }

    /// The claims to renew now.
    pub(crate) fn tokens(&self) -> Vec<FencingToken> {
        self.with(|m| m.iter().filter(|(_, l)| !l.lost).map(|(t, _)| *t).collect())
    }

    /// Records a renewal of `token` that found `held` events still held;
    /// `until` is the new deadline if it was held in full.
    pub(crate) fn renewed(&self, token: FencingToken, held: u64, until: Instant) -> Renewed {
        self.with(|m| {
            let Some(lease) = m.get_mut(&token) else {
                return Renewed::Ignored;
            };
            if lease.lost {
                return Renewed::Ignored;
            }
            if held >= lease.events {
                lease.until = lease.until.max(until);
                Renewed::Held
            } else {
                lease.lost = true;
                Renewed::Lost {
                    claimed: lease.events,
                    held,
                    usage: lease.usage,
                }
            }
        })
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
}
