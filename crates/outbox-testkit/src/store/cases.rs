//! The cases. Each takes a fresh harness.

use super::*;

mod claim;
mod dead_letters;
mod enqueue;
mod held;
mod order;
mod settle;

pub use self::claim::*;
pub use self::dead_letters::*;
pub use self::enqueue::*;
pub use self::held::*;
pub use self::order::*;
pub use self::settle::*;

const LONG_LEASE: Duration = Duration::from_secs(600);
const LATER: Duration = Duration::from_secs(3600);

fn ev(n: usize) -> NewEvent {
    NewEvent::new(
        "test.event",
        "conformance",
        format!("payload-{n}").into_bytes(),
    )
}

fn keyed(key: &str, n: usize) -> NewEvent {
    ev(n).with_key(key)
}

fn req(relay: &str, batch_size: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new(relay),
        batch_size,
        lease: LONG_LEASE,
        shard: ShardSpec::ALL,
    }
}

fn ids(claim: &Claim) -> Vec<EventId> {
    claim.events.iter().map(|e| e.id).collect()
}

fn error(code: ErrorCode, message: &str) -> LastError {
    LastError {
        code,
        message: message.to_owned(),
    }
}

fn temporary(message: &str) -> LastError {
    error(ErrorCode::HANDLER_TEMPORARY_FAILURE, message)
}

fn permanent(message: &str) -> LastError {
    error(ErrorCode::HANDLER_PERMANENT_FAILURE, message)
}

fn retry(delay: Duration) -> Resolution {
    Resolution::Retry {
        delay,
        error: temporary("temporarily down"),
    }
}

fn dead(error: LastError) -> Resolution {
    Resolution::Dead { error }
}

fn delivered(ids: &[EventId]) -> Settlement {
    ids.iter().fold(Settlement::new(), |s, id| {
        s.with(*id, Resolution::Delivered)
    })
}

async fn claim<S: Store>(store: &S, req: ClaimRequest) -> Claim {
    store.claim(&req).await.expect("claim")
}

async fn settle<S: Store>(store: &S, token: FencingToken, s: Settlement) -> SettleReport {
    store.settle(token, &s).await.expect("settle")
}

async fn stats<S: Store>(store: &S) -> Stats {
    store.stats().await.expect("stats")
}

fn leased(attempts: u32, token: FencingToken, relay: &str) -> RowState {
    RowState::Leased {
        attempts,
        token,
        locked_by: relay.to_owned(),
        lease_expired: false,
    }
}

fn pending(attempts: u32, future: bool, code: Option<ErrorCode>) -> RowState {
    RowState::Pending {
        attempts,
        next_attempt_in_future: future,
        last_error_code: code,
    }
}

fn dead_row(code: ErrorCode, attempts: u32) -> RowState {
    RowState::Dead { code, attempts }
}
