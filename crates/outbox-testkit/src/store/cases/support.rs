//! What the cases share: fixed durations, event and request builders,
//! settlements, the store calls each case makes with `expect`, and the row
//! states cases compare snapshots with.

use crate::store::RowState;
use outbox_core::{
    Claim, ClaimRequest, ErrorCode, EventId, FencingToken, LastError, NewEvent, RelayId,
    Resolution, SettleReport, Settlement, ShardSpec, Stats, Store,
};
use std::time::Duration;

pub(super) const LONG_LEASE: Duration = Duration::from_secs(600);
pub(super) const LATER: Duration = Duration::from_secs(3600);

pub(super) fn ev(n: usize) -> NewEvent {
    NewEvent::new(
        "test.event",
        "conformance",
        format!("payload-{n}").into_bytes(),
    )
}

pub(super) fn keyed(key: &str, n: usize) -> NewEvent {
    ev(n).with_key(key)
}

pub(super) fn req(relay: &str, batch_size: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new(relay),
        batch_size,
        lease: LONG_LEASE,
        shard: ShardSpec::ALL,
    }
}

pub(super) fn ids(claim: &Claim) -> Vec<EventId> {
    claim.events.iter().map(|e| e.id).collect()
}

pub(super) fn error(code: ErrorCode, message: &str) -> LastError {
    LastError {
        code,
        message: message.to_owned(),
    }
}

pub(super) fn temporary(message: &str) -> LastError {
    error(ErrorCode::HANDLER_TEMPORARY_FAILURE, message)
}

pub(super) fn permanent(message: &str) -> LastError {
    error(ErrorCode::HANDLER_PERMANENT_FAILURE, message)
}

pub(super) fn retry(delay: Duration) -> Resolution {
    Resolution::Retry {
        delay,
        error: temporary("temporarily down"),
    }
}

pub(super) fn dead(error: LastError) -> Resolution {
    Resolution::Dead { error }
}

pub(super) fn delivered(ids: &[EventId]) -> Settlement {
    ids.iter().fold(Settlement::new(), |s, id| {
        s.with(*id, Resolution::Delivered)
    })
}

pub(super) async fn claim<S: Store>(store: &S, req: ClaimRequest) -> Claim {
    store.claim(&req).await.expect("claim")
}

pub(super) async fn settle<S: Store>(
    store: &S,
    token: FencingToken,
    s: Settlement,
) -> SettleReport {
    store.settle(token, &s).await.expect("settle")
}

pub(super) async fn stats<S: Store>(store: &S) -> Stats {
    store.stats().await.expect("stats")
}

pub(super) fn leased(attempts: u32, token: FencingToken, relay: &str) -> RowState {
    RowState::Leased {
        attempts,
        token,
        locked_by: relay.to_owned(),
        lease_expired: false,
    }
}

pub(super) fn pending(attempts: u32, future: bool, code: Option<ErrorCode>) -> RowState {
    RowState::Pending {
        attempts,
        next_attempt_in_future: future,
        last_error_code: code,
    }
}

pub(super) fn dead_row(code: ErrorCode, attempts: u32) -> RowState {
    RowState::Dead { code, attempts }
}
