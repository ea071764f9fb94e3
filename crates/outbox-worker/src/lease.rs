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
//!
//! **The lease ends by the relay's own clock too** (DESIGN.md invariant 15).
//! A renewal that fails (the database is unreachable, the statement times
//! out, the pool has no connection) moves nothing, and the relay cannot
//! learn that another relay took the events once the lease ran out in the
//! database. So the relay stops by itself: [`Leases::expired`] completes at
//! the *local lease end*, the last successful claim or renewal's send
//! instant plus the lock timeout, minus [`clock_margin`] (the two clocks may
//! run at slightly different rates). The database's lease cannot end
//! earlier: it computed `now() + lease` after the request left. A delivery
//! still running then is cancelled and its events released, and a batch
//! claimed ahead whose local lease ended is never handed to the sink.
//! A sink whose client may still send a message after the delivery was
//! dropped ([`Sink::late_send_bound`](outbox_core::Sink::late_send_bound),
//! librdkafka's queue) has that much more kept back, at most a quarter of
//! the lease (the relay warns when the sink asks for more).

use outbox_core::FencingToken;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The share of the lease kept back for clock rate drift (in percent):
/// the relay's monotonic clock and the database's clock may not run at
/// exactly the same rate (NTP slewing allows 0.05 %, a VM's clock after a
/// host migration far more). 3 % of a 1 min lease is 1.8 s.
pub(crate) const CLOCK_DRIFT_PERCENT: u32 = 3;
/// Kept back from every lease on top of [`CLOCK_DRIFT_PERCENT`]: timer
/// granularity, a delayed wake-up of the relay's task, and the time the
/// sink's last send may still be on the wire when the delivery is dropped.
pub(crate) const CLOCK_SLACK: Duration = Duration::from_millis(250);

/// How long before the lease end it knows of a relay stops delivering:
/// [`CLOCK_DRIFT_PERCENT`] of `lease` plus [`CLOCK_SLACK`] (less than the
/// shortest lease allowed, 1 s: 280 ms of it).
pub(crate) fn clock_margin(lease: Duration) -> Duration {
    lease * CLOCK_DRIFT_PERCENT / 100 + CLOCK_SLACK
}

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
#[derive(Debug)]
pub(crate) struct Leases {
    held: Mutex<HashMap<FencingToken, Lease>>,
    /// Woken whenever a renewal marks a lease lost.
    lost: Notify,
    /// Kept back from each lease end for the relay's own clock
    /// ([`clock_margin`] of the lock timeout) and the sink's late sends.
    margin: Duration,
}

impl Leases {
    /// No leases yet; each will be held for `lease` (the lock timeout), to
    /// a sink whose messages can still arrive up to `late_send` after their
    /// delivery was dropped ([`outbox_core::Sink::late_send_bound`]): the
    /// local lease end keeps that back too.
    pub(crate) fn new(lease: Duration, late_send: Duration) -> Self {
        Self {
            held: Mutex::default(),
            lost: Notify::new(),
            margin: clock_margin(lease) + late_send,
        }
    }

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

    /// The local lease end of `token` (see the module docs), if tracked.
    pub(crate) fn local_end(&self, token: FencingToken) -> Option<Instant> {
        let margin = self.margin;
        self.with(|m| m.get(&token).map(|l| l.until - margin))
    }

    /// Whether the local lease end of `token` has passed (`false` for a
    /// claim no longer tracked).
    pub(crate) fn is_expired(&self, token: FencingToken) -> bool {
        self.local_end(token)
            .is_some_and(|end| end <= Instant::now())
    }

    /// Completes once the local lease end of `token` passes without a
    /// successful renewal moving it (at once if it already has). Never
    /// completes for a claim that is not tracked.
    pub(crate) async fn expired(&self, token: FencingToken) {
        loop {
            let Some(end) = self.local_end(token) else {
                return std::future::pending().await;
            };
            if end <= Instant::now() {
                return;
            }
            // A renewal may move the end meanwhile: look again then.
            tokio::time::sleep_until(end).await;
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
        let leases = Leases::new(Duration::from_secs(1), Duration::ZERO);
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
        let leases = Leases::new(Duration::from_secs(1), Duration::ZERO);
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

    /// The local lease end: the claim's send instant plus the lease, minus
    /// the margin; a successful renewal moves it, a failed one does not.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_lease_ends_by_the_relays_clock_unless_a_renewal_moves_it() {
        use futures::FutureExt;
        let lease = Duration::from_secs(1);
        assert_eq!(clock_margin(lease), Duration::from_millis(280));
        assert_eq!(
            clock_margin(Duration::from_secs(60)),
            Duration::from_millis(2050)
        );
        let leases = Leases::new(lease, Duration::ZERO);
        let a = FencingToken::new();
        let sent = Instant::now();
        leases.insert(a, 2, sent + lease, Use::Delivering);
        assert_eq!(leases.local_end(a), Some(sent + Duration::from_millis(720)));
        let mut expired = std::pin::pin!(leases.expired(a));
        assert_eq!(expired.as_mut().now_or_never(), None);
        // A renewal sent at 500 ms succeeds: the end moves to 1220 ms.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(leases.renewed(a, 2, Instant::now() + lease), Renewed::Held);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!leases.is_expired(a), "renewed: not at 800 ms");
        assert_eq!(expired.as_mut().now_or_never(), None);
        // No renewal after that (they failed): it ends at 1220 ms.
        expired.await;
        assert_eq!(sent.elapsed(), Duration::from_millis(1220));
        assert!(leases.is_expired(a));
        // Untracked: never expired.
        leases.remove(a);
        assert!(!leases.is_expired(a));
        // A sink that can still send 300 ms after its delivery was dropped
        // (librdkafka's queue): the local end keeps that back too.
        let late = Leases::new(lease, Duration::from_millis(300));
        let b = FencingToken::new();
        let sent = Instant::now();
        late.insert(b, 1, sent + lease, Use::Delivering);
        assert_eq!(late.local_end(b), Some(sent + Duration::from_millis(420)));
        assert_eq!(leases.expired(a).now_or_never(), None);
    }
}
