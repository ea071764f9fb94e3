//! The store's side of readiness: [`Watched`] wraps the relay's store and
//! records what its last claim answered, or how long the one under way
//! has been waiting, in a [`StoreProbe`] that `/readyz` reads.

use outbox_core::{
    Claim, ClaimRequest, FencingToken, RelayId, SettleReport, Settlement, Stats, Store,
};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A claim unanswered for this long makes the relay unready: the store is
/// not answering (a pool waiting for a connection, a lock, a dead host).
pub(super) const CLAIM_STALL: Duration = Duration::from_secs(15);

/// What the store answered to the relay's last claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum StoreState {
    /// No claim has finished yet.
    Starting,
    /// The last claim succeeded.
    Ok,
    /// The last claim failed with this error (not yet scrubbed).
    Failed(String),
    /// A claim has been running for this long (at least [`CLAIM_STALL`]).
    Stalled(Duration),
}

#[derive(Debug)]
pub(super) struct ProbeState {
    pub(super) last: StoreState,
    /// When the claim under way started.
    pub(super) claiming_since: Option<Instant>,
}

/// The result of the relay's last claim, shared with `/readyz`.
#[derive(Debug, Clone)]
pub(crate) struct StoreProbe {
    state: Arc<Mutex<ProbeState>>,
}

impl StoreProbe {
    pub(super) fn new() -> Self {
        Self {
            state: Arc::new(Mutex::new(ProbeState {
                last: StoreState::Starting,
                claiming_since: None,
            })),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, ProbeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The last answer, or [`StoreState::Stalled`] when the claim under
    /// way has waited for [`CLAIM_STALL`] or longer.
    pub(super) fn get(&self) -> StoreState {
        let state = self.lock();
        match state.claiming_since.map(|t| t.elapsed()) {
            Some(waited) if waited >= CLAIM_STALL => StoreState::Stalled(waited),
            _ => state.last.clone(),
        }
    }
}

/// Marks a claim under way; clears the mark when dropped (also when the
/// claim is cancelled).
pub(super) struct Claiming<'a>(&'a StoreProbe);

impl<'a> Claiming<'a> {
    pub(super) fn start(probe: &'a StoreProbe) -> Self {
        probe.lock().claiming_since = Some(Instant::now());
        Self(probe)
    }

    pub(super) fn finish(self, answer: StoreState) {
        self.0.lock().last = answer;
    }
}

impl Drop for Claiming<'_> {
    fn drop(&mut self) {
        self.0.lock().claiming_since = None;
    }
}

/// A store that records the outcome of each claim in a [`StoreProbe`] and
/// otherwise is the store it wraps.
#[derive(Debug)]
pub(crate) struct Watched<S> {
    inner: S,
    probe: StoreProbe,
}

impl<S> Watched<S> {
    /// Wraps `inner`; the probe reports its claims.
    pub(crate) fn new(inner: S) -> (Self, StoreProbe) {
        let probe = StoreProbe::new();
        (
            Self {
                inner,
                probe: probe.clone(),
            },
            probe,
        )
    }
}

impl<S: Store> Store for Watched<S> {
    type Error = S::Error;

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, S::Error> {
        let claiming = Claiming::start(&self.probe);
        let result = self.inner.claim(req).await;
        claiming.finish(match &result {
            Ok(_) => StoreState::Ok,
            Err(e) => StoreState::Failed(e.to_string()),
        });
        result
    }

    async fn settle(
        &self,
        token: FencingToken,
        settlement: &Settlement,
    ) -> Result<SettleReport, S::Error> {
        // A settlement is watched like a claim: a relay retrying one through
        // an outage claims nothing meanwhile.
        let settling = Claiming::start(&self.probe);
        let result = self.inner.settle(token, settlement).await;
        settling.finish(match &result {
            Ok(_) => StoreState::Ok,
            Err(e) => StoreState::Failed(e.to_string()),
        });
        result
    }

    async fn renew(&self, token: FencingToken, lease: Duration) -> Result<u64, S::Error> {
        let result = self.inner.renew(token, lease).await;
        if let Err(e) = &result {
            self.probe.lock().last = StoreState::Failed(e.to_string());
        }
        result
    }

    async fn stats(&self) -> Result<Stats, S::Error> {
        self.inner.stats().await
    }

    async fn wakeup(&self) {
        self.inner.wakeup().await;
    }

    async fn leave(&self, relay: &RelayId) -> Result<(), S::Error> {
        self.inner.leave(relay).await
    }
}
