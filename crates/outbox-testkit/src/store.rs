//! The store conformance suite.
//!
//! A store crate implements [`StoreHarness`] in a test file and invokes
//! [`store_conformance_tests!`](crate::store_conformance_tests):
//!
//! ```ignore
//! outbox_testkit::store_conformance_tests!(MyHarness::new().await);
//! ```
//!
//! The expression is evaluated once per case, inside the case's tokio
//! runtime (so it may `.await`), and must yield a fresh, isolated harness
//! (a new SQLite file, a new PostgreSQL schema). Every case asserts what the
//! tables hold (through [`StoreHarness::snapshot`] and `stats`), not only
//! that calls returned `Ok`. No case depends on wall-clock timing: leases are
//! long and expire only through [`StoreHarness::expire_lease`]. (One case,
//! delayed events, waits out a 2 s delay: it asserts on the database
//! clock's columns and gives the delivery 20 s.)
//!
//! The contract the cases pin, beyond the [`Store`] docs:
//! - `settle` records a mixed batch (delivered, retry, dead, released) at
//!   once; ids the token does not hold come back in `fenced`, in the order
//!   given, and nothing about them changes.
//! - A dead letter whose id already exists in the dead letters (the same
//!   event enqueued again after it died) replaces the older one with the
//!   newer failure; the id is counted in `applied` and reported in
//!   `rejected` with a reason; the rest of the batch settles.
//! - A row the store cannot decode is dead-lettered by `claim` with
//!   [`ErrorCode::UNDECODABLE`] and left out of the claim; it stays listable.
//! - Per-key order is commit order: an event committed later comes later,
//!   whatever its id.
//! - Dead-letter filters (ids, event type, code, key, age against the
//!   database clock) are ANDed; list, count, retry and purge honour them.
//! - A replayed dead letter is never claimed beside another event of its
//!   key that is in flight; it goes behind the key's pending events.
//! - A delayed event (`deliver_at` / `deliver_after`) is not claimed before
//!   its time (database clock); it delays no other key, and its key's later
//!   events wait behind it.
//! - `held_keys` names each event that failed and holds its key, with the
//!   key's events waiting behind it, the most waiting first.

use outbox_core::{
    DeadLetterStore, ErrorCode, EventId, FencingToken, NewEvent, Store, ValidationError,
};
use std::future::Future;
use std::time::Duration;

/// One event's row as the harness reads it straight from the tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowState {
    /// In neither the outbox nor the dead letters (never committed, or
    /// delivered and removed, or purged).
    Missing,
    /// In the outbox, not leased (or never claimed).
    Pending {
        /// Attempts so far.
        attempts: u32,
        /// Whether `next_attempt_at` is after the database's `now()`.
        next_attempt_in_future: bool,
        /// `last_error_code`, if any.
        last_error_code: Option<ErrorCode>,
    },
    /// In the outbox with a lease (current or expired).
    Leased {
        /// Attempts so far, including the leased one.
        attempts: u32,
        /// The lease's fencing token.
        token: FencingToken,
        /// The lease owner (`locked_by`).
        locked_by: String,
        /// Whether `locked_until <= now()` (database clock).
        lease_expired: bool,
    },
    /// In the dead letters.
    Dead {
        /// The final error code.
        code: ErrorCode,
        /// Attempts made.
        attempts: u32,
    },
}

/// What a store's test file provides so the suite can drive and inspect it.
///
/// One harness value = one fresh, isolated database (file, schema) that
/// every store handle it returns points at.
pub trait StoreHarness: Send + Sync + 'static {
    /// The store under test.
    type Store: Store + DeadLetterStore + outbox_core::HeldKeyStore;

    /// A store handle on this harness's database. May be called several times
    /// (the concurrency case takes one per claimer).
    fn store(&self) -> impl Future<Output = Self::Store> + Send;

    /// Enqueues `events` with the store crate's own enqueue function inside
    /// ONE real transaction, then commits it (`commit = true`) or rolls it
    /// back. Returns the ids, or the validation error the enqueue function
    /// reported (database errors panic). Events of one call commit together,
    /// in the given order; two calls commit in call order.
    fn enqueue(
        &self,
        events: Vec<NewEvent>,
        commit: bool,
    ) -> impl Future<Output = Result<Vec<EventId>, ValidationError>> + Send;

    /// Reads the event's row straight from the tables (not through the store API).
    fn snapshot(&self, id: EventId) -> impl Future<Output = RowState> + Send;

    /// Moves the event's `locked_until` into the past (database clock), as if
    /// the lease had run out.
    fn expire_lease(&self, id: EventId) -> impl Future<Output = ()> + Send;

    /// Inserts and commits, bypassing the enqueue function, one pending event
    /// row (no key, due now, never attempted) that the store cannot decode:
    /// e.g. its headers are valid JSON but not an object of strings
    /// (`["not", "a", "map"]`). Returns its id (the id itself is valid).
    fn insert_undecodable(&self) -> impl Future<Output = EventId> + Send;

    /// Moves the dead letter's `dead_at` back by `by`, as if it had been
    /// dead-lettered that much earlier (database clock).
    fn backdate_dead(&self, id: EventId, by: Duration) -> impl Future<Output = ()> + Send;
}

/// Expands to one `#[test]` per conformance case, in a module `conformance`,
/// each running on a fresh multi-thread tokio runtime with a fresh harness
/// built by `$harness` (an expression that may `.await`; items of the
/// invoking module are in scope). Names look like
/// `conformance::claim_honours_next_attempt_at`.
#[macro_export]
macro_rules! store_conformance_tests {
    // Stores where one relay at a time holds a whole shard through a cursor
    // (the PostgreSQL event log): a second claimer of the same shard is a
    // standby and gets nothing, and a lease takeover re-reads the events
    // without counting the lost holder's attempt. The cases that assume
    // per-event leases are left out; the store's own tests cover what
    // they check under its model.
    ($harness:expr, single_holder_per_shard) => {
        $crate::__store_conformance_cases!($harness;
            claim_returns_committed_events_oldest_first,
            claim_respects_batch_size,
            claim_says_when_it_stopped_early,
            an_unsettled_batch_comes_back_to_its_own_relay,
            claim_honours_next_attempt_at,
            concurrent_claimers_never_share_an_event,
            settle_records_a_large_mixed_batch,
            settling_twice_fences_the_second_time,
            retry_records_last_error_and_next_attempt_at,
            dead_letter_after_max_attempts,
            dead_letter_id_conflict_settles_the_rest_of_the_batch,
            dead_letters_can_be_listed_retried_and_purged,
            dead_letters_are_selected_by_type_code_key_and_age,
            retried_dead_letter_goes_behind_its_keys_pending_events,
            undecodable_row_is_dead_lettered_and_left_out_of_the_claim,
            rolled_back_enqueue_never_appears,
            shard_filter_gives_each_event_to_its_owner_only,
            stats_count_pending_in_flight_and_dead,
            enqueue_rejects_invalid_events_and_writes_nothing,
            batch_enqueue_writes_all,
            delayed_events_wait_without_delaying_other_keys,
            delayed_event_stays_behind_a_retried_event_of_its_key,
            held_keys_name_each_head_and_what_waits_behind_it,
        );
    };
    ($harness:expr) => {
        $crate::__store_conformance_cases!($harness;
            claim_returns_committed_events_oldest_first,
            claim_respects_batch_size,
            claim_says_when_it_stopped_early,
            an_unsettled_batch_comes_back_to_its_own_relay,
            claim_honours_next_attempt_at,
            leased_events_are_not_reclaimed_until_the_lease_expires,
            concurrent_claimers_never_share_an_event,
            settle_records_a_mixed_batch_at_once,
            settle_records_a_large_mixed_batch,
            settle_with_a_stale_token_changes_nothing,
            settling_twice_fences_the_second_time,
            released_events_are_not_attempted,
            retry_records_last_error_and_next_attempt_at,
            dead_letter_after_max_attempts,
            dead_letter_id_conflict_settles_the_rest_of_the_batch,
            dead_letters_can_be_listed_retried_and_purged,
            dead_letters_are_selected_by_type_code_key_and_age,
            retried_dead_letter_goes_behind_its_keys_pending_events,
            undecodable_row_is_dead_lettered_and_left_out_of_the_claim,
            renew_extends_the_lease,
            renew_with_a_stale_token_returns_zero,
            rolled_back_enqueue_never_appears,
            shard_filter_gives_each_event_to_its_owner_only,
            per_key_order_earlier_event_blocks_later_ones,
            per_key_order_is_commit_order_not_id_order,
            stats_count_pending_in_flight_and_dead,
            enqueue_rejects_invalid_events_and_writes_nothing,
            batch_enqueue_writes_all,
            delayed_events_wait_without_delaying_other_keys,
            delayed_event_stays_behind_a_retried_event_of_its_key,
            held_keys_name_each_head_and_what_waits_behind_it,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __store_conformance_cases {
    ($harness:expr; $($case:ident),* $(,)?) => {
        mod conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $case() {
                    $crate::__private::block_on(async {
                        let harness = $harness;
                        $crate::store::cases::$case(&harness).await;
                    });
                }
            )*
        }
    };
}

pub mod cases;
