//! Lease renewal: every held claim's lease renewed each third of the lock
//! timeout, on the relay's task beside the loop, and what a renewal's
//! answer means (see the lease module).

use super::state::Relay;
use crate::lease::{Leases, Renewed, Use};
use outbox_core::{Retryable, Sink, Store};
use std::convert::Infallible;
use tokio::time::Instant;
use tracing::{debug, error, warn};

impl<St: Store, Si: Sink> Relay<St, Si> {
    /// Renews every held lease each third of the lock timeout. Never returns.
    pub(super) async fn renew_leases(&self, leases: &Leases) -> Infallible {
        let lease = self.options.lock_timeout();
        let period = lease / 3;
        loop {
            tokio::time::sleep(period).await;
            for token in leases.tokens() {
                let sent = Instant::now();
                match self.store.renew(token, lease).await {
                    Ok(held) => match leases.renewed(token, held, sent + lease) {
                        Renewed::Held | Renewed::Ignored => {
                            debug!(%token, held, "lease renewed");
                        }
                        Renewed::Lost {
                            claimed,
                            held,
                            usage,
                        } => {
                            match usage {
                                // The delivery in flight stops now and
                                // logs it (once, at WARN); a batch already
                                // delivered finds out at its settlement
                                // (fenced, logged at WARN there).
                                Use::Delivering => {
                                    debug!(%token, claimed, held, "lease lost on the batch being delivered");
                                }
                                Use::Prefetched => {
                                    warn!(%token, claimed, held, lock_timeout = ?lease, "lease lost on the batch claimed ahead; it will be given back, not delivered");
                                }
                            }
                        }
                    },
                    Err(err) => {
                        // Nothing moves: the lease ends by this relay's
                        // clock unless a later renewal succeeds in time.
                        self.meters().renew_errors.increment(1);
                        let ends_in = leases
                            .local_end(token)
                            .map(|end| end.saturating_duration_since(Instant::now()));
                        if err.is_retryable() {
                            warn!(%token, error = %err, ?ends_in, "lease renewal failed; trying again (the batch stops at its lease end by this relay's clock unless a renewal succeeds first)");
                        } else {
                            error!(%token, error = %err, ?ends_in, "lease renewal failed (not retryable); the batch stops at its lease end by this relay's clock");
                        }
                    }
                }
            }
        }
    }
}
