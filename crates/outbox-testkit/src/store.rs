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

use outbox_core::{
    Claim, ClaimRequest, DeadLetterFilter, DeadLetterQuery, DeadLetterStore, ErrorCode, EventId,
    FencingToken, LastError, NewEvent, RelayId, Resolution, SettleReport, Settlement, ShardSpec,
    Stats, Store, ValidationError,
};
use std::collections::{BTreeSet, HashSet};
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
    type Store: Store + DeadLetterStore;

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

/// The cases. Each takes a fresh harness.
pub mod cases {
    use super::*;

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

    /// Committed events come back oldest first, complete, with attempts = 1
    /// and a lease recorded in the table; a second claim gets nothing.
    pub async fn claim_returns_committed_events_oldest_first<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let events = vec![
            keyed("order-1", 0).with_header("traceparent", "00-0af7651916cd43dd-01"),
            ev(1),
            keyed("order-2", 2).with_header("a", "b"),
        ];
        let want = events.clone();
        let ids_in = h.enqueue(events, true).await.unwrap();
        assert_eq!(ids_in, want.iter().map(NewEvent::id).collect::<Vec<_>>());

        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), ids_in, "oldest first");
        for (got, want) in c.events.iter().zip(&want) {
            assert_eq!(got.key.as_deref(), want.key());
            assert_eq!(got.event_type, want.event_type());
            assert_eq!(got.topic, want.topic());
            assert_eq!(got.payload, want.payload());
            assert_eq!(&got.headers, want.headers());
            assert_eq!(got.attempts, 1);
            assert_eq!(got.last_error, None);
            assert!(got.created_at <= c.lease_until);
            assert!(got.next_attempt_at <= c.lease_until);
        }
        for id in &ids_in {
            assert_eq!(h.snapshot(*id).await, leased(1, c.token, "relay-a"));
        }
        let again = claim(&store, req("relay-b", 10)).await;
        assert!(again.events.is_empty(), "leased events were claimed twice");
        assert_ne!(again.token, c.token);
    }

    /// A claim takes at most `batch_size` events, the oldest ones.
    pub async fn claim_respects_batch_size<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h.enqueue((0..5).map(ev).collect(), true).await.unwrap();
        let first = claim(&store, req("relay-a", 2)).await;
        assert_eq!(ids(&first), all[..2]);
        let rest = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&rest), all[2..]);
        assert_ne!(first.token, rest.token);
        assert_eq!(h.snapshot(all[0]).await, leased(1, first.token, "relay-a"));
        assert_eq!(h.snapshot(all[4]).await, leased(1, rest.token, "relay-a"));
    }

    /// A retry scheduled in the future is not claimed; one due now is, with
    /// its attempt count and last error.
    pub async fn claim_honours_next_attempt_at<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let ids_in = h.enqueue(vec![ev(0), ev(1)], true).await.unwrap();
        let (later, now) = (ids_in[0], ids_in[1]);
        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), ids_in);
        let report = settle(
            &store,
            c.token,
            Settlement::new()
                .with(later, retry(LATER))
                .with(now, retry(Duration::ZERO)),
        )
        .await;
        assert_eq!(report.applied, 2);
        assert!(report.all_applied());
        assert!(report.rejected.is_empty());
        let code = Some(ErrorCode::HANDLER_TEMPORARY_FAILURE);
        assert_eq!(h.snapshot(later).await, pending(1, true, code.clone()));
        assert_eq!(h.snapshot(now).await, pending(1, false, code.clone()));

        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), vec![now], "a future retry was claimed");
        assert_eq!(c.events[0].attempts, 2);
        let last = c.events[0].last_error.clone().expect("last error");
        assert_eq!(last.code, ErrorCode::HANDLER_TEMPORARY_FAILURE);
        assert_eq!(last.message, "temporarily down");
        assert_eq!(h.snapshot(later).await, pending(1, true, code));
    }

    /// A claim that stopped at the batch size says more events are ready
    /// (`Claim::more`: the relay claims again without waiting); one that
    /// read everything does not.
    pub async fn claim_says_when_it_stopped_early<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h.enqueue((0..5).map(ev).collect(), true).await.unwrap();
        let first = claim(&store, req("relay-a", 3)).await;
        assert_eq!(ids(&first), all[..3]);
        assert!(first.more, "stopped at the batch size");
        let rest = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&rest), all[3..]);
        assert!(!rest.more, "read everything");
        let none = claim(&store, req("relay-a", 10)).await;
        assert!(none.events.is_empty());
        assert!(!none.more);
    }

    /// A batch its relay never settles (the relay gave it up: its settle
    /// failed until the lease ran out) comes back to the same relay once
    /// the lease it was claimed under is over, per key in order, and the
    /// late settle is fenced. Real time: a 300 ms lease.
    pub async fn an_unsettled_batch_comes_back_to_its_own_relay<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let short = || ClaimRequest {
            lease: Duration::from_millis(300),
            ..req("relay-a", 10)
        };
        let all = h
            .enqueue(vec![keyed("k", 0), keyed("j", 1), keyed("k", 2)], true)
            .await
            .unwrap();
        let given_up = claim(&store, short()).await;
        assert!(!given_up.events.is_empty());
        let start = std::time::Instant::now();
        let mut back = Vec::new();
        while back.len() < all.len() && start.elapsed() < Duration::from_secs(10) {
            let c = claim(&store, short()).await;
            back.extend(ids(&c));
            if !c.events.is_empty() {
                // Settled at once, so the rest of a key can follow.
                settle(&store, c.token, delivered(&ids(&c))).await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut sorted_back = back.clone();
        sorted_back.sort_unstable();
        let mut sorted_all = all.clone();
        sorted_all.sort_unstable();
        assert_eq!(
            sorted_back, sorted_all,
            "every event came back once: {back:?}"
        );
        let at = |id: EventId| back.iter().position(|b| *b == id);
        assert!(at(all[0]) < at(all[2]), "key k in order: {back:?}");
        let late = settle(&store, given_up.token, delivered(&ids(&given_up))).await;
        assert_eq!(late.applied, 0, "the late settle is fenced: {late:?}");
    }

    /// A leased event is not claimed again until its lease expires; then it
    /// is, by the next relay, with a new token and attempts + 1.
    pub async fn leased_events_are_not_reclaimed_until_the_lease_expires<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let id = h.enqueue(vec![ev(0)], true).await.unwrap()[0];
        let first = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&first), vec![id]);
        assert!(claim(&store, req("relay-b", 10)).await.events.is_empty());

        h.expire_lease(id).await;
        assert_eq!(
            h.snapshot(id).await,
            RowState::Leased {
                attempts: 1,
                token: first.token,
                locked_by: "relay-a".into(),
                lease_expired: true
            }
        );
        let second = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&second), vec![id]);
        assert_eq!(second.events[0].attempts, 2);
        assert_ne!(second.token, first.token);
        assert_eq!(h.snapshot(id).await, leased(2, second.token, "relay-b"));
    }

    /// Two relays claiming and settling concurrently (tokio tasks, many
    /// rounds) never get the same event, and together get all of them.
    pub async fn concurrent_claimers_never_share_an_event<H: StoreHarness>(h: &H) {
        const N: usize = 300;
        let events: Vec<NewEvent> = (0..N)
            .map(|i| {
                if i % 2 == 0 {
                    keyed(&format!("key-{}", i % 7), i)
                } else {
                    ev(i)
                }
            })
            .collect();
        let all = h.enqueue(events, true).await.unwrap();
        let mut tasks = Vec::new();
        for relay in ["relay-a", "relay-b"] {
            let store = h.store().await;
            tasks.push(tokio::spawn(async move {
                let mut got = Vec::new();
                loop {
                    let c = claim(&store, req(relay, 7)).await;
                    if c.events.is_empty() {
                        break;
                    }
                    let mine = ids(&c);
                    let report = settle(&store, c.token, delivered(&mine)).await;
                    assert!(report.all_applied(), "{relay} fenced {:?}", report.fenced);
                    assert_eq!(report.applied, mine.len() as u64);
                    got.extend(mine);
                    tokio::task::yield_now().await;
                }
                got
            }));
        }
        let mut seen = HashSet::new();
        let mut total = 0;
        for task in tasks {
            for id in task.await.expect("claimer task") {
                total += 1;
                assert!(seen.insert(id), "event {id} was claimed twice");
            }
        }
        assert_eq!(total, N);
        assert_eq!(seen, all.iter().copied().collect::<HashSet<_>>());
        let store = h.store().await;
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (0, 0, 0));
    }

    /// One settle records delivered, retry, dead and released events of one
    /// claim together; an id the token never held is reported fenced.
    pub async fn settle_records_a_mixed_batch_at_once<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h.enqueue((0..4).map(ev).collect(), true).await.unwrap();
        let (done, again, gone, back) = (all[0], all[1], all[2], all[3]);
        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), all);
        let stranger = EventId::new();
        let report = settle(
            &store,
            c.token,
            Settlement::new()
                .with(done, Resolution::Delivered)
                .with(
                    again,
                    Resolution::Retry {
                        delay: LATER,
                        error: error(ErrorCode::PUBLISH_REJECTED, "nack"),
                    },
                )
                .with(stranger, Resolution::Delivered)
                .with(gone, dead(permanent("bad payload")))
                .with(back, Resolution::Released),
        )
        .await;
        assert_eq!(report.applied, 4);
        assert_eq!(report.fenced, vec![stranger]);
        assert!(report.rejected.is_empty(), "{:?}", report.rejected);

        assert_eq!(h.snapshot(done).await, RowState::Missing);
        assert_eq!(
            h.snapshot(again).await,
            pending(1, true, Some(ErrorCode::PUBLISH_REJECTED))
        );
        assert_eq!(
            h.snapshot(gone).await,
            dead_row(ErrorCode::HANDLER_PERMANENT_FAILURE, 1)
        );
        assert_eq!(h.snapshot(back).await, pending(0, false, None));
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (2, 0, 1));

        let c = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&c), vec![back], "only the released event is due");
        assert_eq!(c.events[0].attempts, 1);
    }

    /// A batch larger than any internal statement chunk settles completely
    /// and exactly as asked.
    pub async fn settle_records_a_large_mixed_batch<H: StoreHarness>(h: &H) {
        const N: usize = 1203;
        let store = h.store().await;
        let all = h.enqueue((0..N).map(ev).collect(), true).await.unwrap();
        let c = claim(&store, req("relay-a", 2000)).await;
        assert_eq!(ids(&c), all);
        let mut s = Settlement::new();
        for (i, id) in all.iter().enumerate() {
            let resolution = match i % 4 {
                0 => Resolution::Delivered,
                1 => retry(LATER),
                2 => dead(permanent(&format!("bad {i}"))),
                _ => Resolution::Released,
            };
            s.push(*id, resolution);
        }
        let report = settle(&store, c.token, s).await;
        assert_eq!(report.applied, N as u64);
        assert!(report.fenced.is_empty(), "{} fenced", report.fenced.len());
        assert!(report.rejected.is_empty());
        let per_kind = |k: usize| (0..N).filter(|i| i % 4 == k).count() as u64;
        let st = stats(&store).await;
        assert_eq!(st.pending, per_kind(1) + per_kind(3));
        assert_eq!((st.in_flight, st.dead), (0, per_kind(2)));
        for i in [0, 1, 2, 3, N - 4, N - 3, N - 2, N - 1] {
            let want = match i % 4 {
                0 => RowState::Missing,
                1 => pending(1, true, Some(ErrorCode::HANDLER_TEMPORARY_FAILURE)),
                2 => dead_row(ErrorCode::HANDLER_PERMANENT_FAILURE, 1),
                _ => pending(0, false, None),
            };
            assert_eq!(h.snapshot(all[i]).await, want, "event {i}");
        }
        let c = claim(&store, req("relay-a", 2000)).await;
        let released: Vec<EventId> = (0..N).filter(|i| i % 4 == 3).map(|i| all[i]).collect();
        assert_eq!(ids(&c), released);
    }

    /// After the leases expired and another relay re-claimed the events, the
    /// old token's settle (of every kind) changes nothing and reports every
    /// id fenced; the new owner's settle works.
    pub async fn settle_with_a_stale_token_changes_nothing<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h.enqueue((0..4).map(ev).collect(), true).await.unwrap();
        let old = claim(&store, req("relay-a", 10)).await;
        for id in &all {
            h.expire_lease(*id).await;
        }
        let new = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&new), all);

        let report = settle(
            &store,
            old.token,
            Settlement::new()
                .with(all[0], Resolution::Delivered)
                .with(all[1], retry(LATER))
                .with(all[2], dead(permanent("nope")))
                .with(all[3], Resolution::Released),
        )
        .await;
        assert_eq!(report.applied, 0);
        assert_eq!(report.fenced, all);
        assert!(report.rejected.is_empty());
        for id in &all {
            assert_eq!(h.snapshot(*id).await, leased(2, new.token, "relay-b"));
        }
        assert_eq!(stats(&store).await.dead, 0);
        assert!(store
            .list_dead(&DeadLetterQuery::default())
            .await
            .unwrap()
            .is_empty());

        let report = settle(&store, new.token, delivered(&all)).await;
        assert_eq!((report.applied, report.fenced.len()), (4, 0));
        for id in &all {
            assert_eq!(h.snapshot(*id).await, RowState::Missing);
        }
    }

    /// Settling the same batch twice: the second time every id is fenced and
    /// nothing changes (no double release, no second dead letter).
    pub async fn settling_twice_fences_the_second_time<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h.enqueue((0..4).map(ev).collect(), true).await.unwrap();
        let c = claim(&store, req("relay-a", 10)).await;
        let s = Settlement::new()
            .with(all[0], Resolution::Delivered)
            .with(all[1], retry(Duration::ZERO))
            .with(all[2], dead(permanent("first")))
            .with(all[3], Resolution::Released);
        let first = settle(&store, c.token, s.clone()).await;
        assert_eq!((first.applied, first.fenced.len()), (4, 0));
        let states = [
            RowState::Missing,
            pending(1, false, Some(ErrorCode::HANDLER_TEMPORARY_FAILURE)),
            dead_row(ErrorCode::HANDLER_PERMANENT_FAILURE, 1),
            pending(0, false, None),
        ];
        for (id, want) in all.iter().zip(&states) {
            assert_eq!(&h.snapshot(*id).await, want);
        }

        let second = settle(&store, c.token, s).await;
        assert_eq!(second.applied, 0);
        assert_eq!(second.fenced, all);
        for (id, want) in all.iter().zip(&states) {
            assert_eq!(&h.snapshot(*id).await, want, "changed by the second settle");
        }
        assert_eq!(stats(&store).await.dead, 1);
    }

    /// Released gives events back unattempted: lease cleared, attempts as
    /// before the claim (a retry's counted attempt stays), claimable at once.
    pub async fn released_events_are_not_attempted<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let id = h.enqueue(vec![ev(0)], true).await.unwrap()[0];
        let c = claim(&store, req("relay-a", 10)).await;
        let report = settle(&store, c.token, Settlement::release_all([id])).await;
        assert_eq!((report.applied, report.fenced.len()), (1, 0));
        assert_eq!(h.snapshot(id).await, pending(0, false, None));

        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(c.events[0].attempts, 1);
        settle(
            &store,
            c.token,
            Settlement::new().with(id, retry(Duration::ZERO)),
        )
        .await;
        let c2 = claim(&store, req("relay-a", 10)).await;
        assert_eq!(c2.events[0].attempts, 2);
        settle(&store, c2.token, Settlement::release_all([id])).await;
        assert_eq!(
            h.snapshot(id).await,
            pending(1, false, Some(ErrorCode::HANDLER_TEMPORARY_FAILURE))
        );
        let report = settle(&store, c2.token, Settlement::release_all([id])).await;
        assert_eq!((report.applied, report.fenced), (0, vec![id]));
        let c3 = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&c3), vec![id]);
        assert_eq!(c3.events[0].attempts, 2);
    }

    /// `Retry` clears the lease, schedules the event at `now() + delay` and
    /// records the error code and message.
    pub async fn retry_records_last_error_and_next_attempt_at<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h.enqueue(vec![ev(0), ev(1)], true).await.unwrap();
        let c = claim(&store, req("relay-a", 10)).await;
        let report = settle(
            &store,
            c.token,
            Settlement::new().with(all[0], retry(LATER)).with(
                all[1],
                Resolution::Retry {
                    delay: LATER,
                    error: error(ErrorCode::PUBLISH_TIMEOUT, "no ack in 5s"),
                },
            ),
        )
        .await;
        assert_eq!((report.applied, report.fenced.len()), (2, 0));
        assert_eq!(
            h.snapshot(all[0]).await,
            pending(1, true, Some(ErrorCode::HANDLER_TEMPORARY_FAILURE))
        );
        assert_eq!(
            h.snapshot(all[1]).await,
            pending(1, true, Some(ErrorCode::PUBLISH_TIMEOUT))
        );
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (2, 0, 0));
        assert!(claim(&store, req("relay-a", 10)).await.events.is_empty());

        // The message is kept too: visible once the retry is due.
        let id = h.enqueue(vec![ev(2)], true).await.unwrap()[0];
        let c = claim(&store, req("relay-a", 10)).await;
        settle(
            &store,
            c.token,
            Settlement::new().with(
                id,
                Resolution::Retry {
                    delay: Duration::ZERO,
                    error: error(ErrorCode::PUBLISH_TIMEOUT, "no ack in 7s"),
                },
            ),
        )
        .await;
        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), vec![id]);
        assert_eq!(
            c.events[0].last_error,
            Some(error(ErrorCode::PUBLISH_TIMEOUT, "no ack in 7s"))
        );
        assert!(c.events[0].next_attempt_at <= c.lease_until);
    }

    /// After several retries the relay dead-letters the event: it moves to the
    /// dead letters with its code, message and attempt count.
    pub async fn dead_letter_after_max_attempts<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let id = h.enqueue(vec![keyed("k", 0)], true).await.unwrap()[0];
        for attempt in 1..=3 {
            let c = claim(&store, req("relay-a", 10)).await;
            assert_eq!(ids(&c), vec![id]);
            assert_eq!(c.events[0].attempts, attempt);
            let resolution = if attempt < 3 {
                retry(Duration::ZERO)
            } else {
                dead(temporary("still down after 3 attempts"))
            };
            let report = settle(&store, c.token, Settlement::new().with(id, resolution)).await;
            assert_eq!(report.applied, 1);
        }
        assert_eq!(
            h.snapshot(id).await,
            dead_row(ErrorCode::HANDLER_TEMPORARY_FAILURE, 3)
        );
        let listed = store.list_dead(&DeadLetterQuery::default()).await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].event.id, id);
        assert_eq!(listed[0].event.attempts, 3);
        assert_eq!(listed[0].event.key.as_deref(), Some("k"));
        assert_eq!(listed[0].error.code, ErrorCode::HANDLER_TEMPORARY_FAILURE);
        assert_eq!(listed[0].error.message, "still down after 3 attempts");
        assert!(listed[0].dead_at >= listed[0].event.created_at);
        assert!(claim(&store, req("relay-a", 10)).await.events.is_empty());
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (0, 0, 1));
    }

    /// The same event enqueued again after it was dead-lettered, and dead
    /// again: the settle does not fail; the newer failure replaces the old
    /// dead letter, the id is reported in `rejected` with a reason, and the
    /// rest of the batch settles.
    pub async fn dead_letter_id_conflict_settles_the_rest_of_the_batch<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let event = ev(0);
        let id = h.enqueue(vec![event.clone()], true).await.unwrap()[0];
        let c = claim(&store, req("relay-a", 10)).await;
        settle(
            &store,
            c.token,
            Settlement::new().with(id, dead(permanent("first death"))),
        )
        .await;
        assert_eq!(
            h.snapshot(id).await,
            dead_row(ErrorCode::HANDLER_PERMANENT_FAILURE, 1)
        );

        let all = h.enqueue(vec![ev(1), event, ev(2)], true).await.unwrap();
        assert_eq!(all[1], id);
        let (a, b) = (all[0], all[2]);
        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), all);
        let report = settle(
            &store,
            c.token,
            Settlement::new()
                .with(a, Resolution::Delivered)
                .with(
                    id,
                    dead(error(ErrorCode::HANDLER_NOT_REGISTERED, "second death")),
                )
                .with(b, retry(LATER)),
        )
        .await;
        assert!(report.fenced.is_empty(), "{:?}", report.fenced);
        assert_eq!(report.applied, 3);
        let rejected: Vec<EventId> = report.rejected.iter().map(|r| r.id).collect();
        assert_eq!(rejected, vec![id]);
        assert!(!report.rejected[0].reason.is_empty());

        assert_eq!(h.snapshot(a).await, RowState::Missing);
        assert_eq!(
            h.snapshot(b).await,
            pending(1, true, Some(ErrorCode::HANDLER_TEMPORARY_FAILURE))
        );
        assert_eq!(
            h.snapshot(id).await,
            dead_row(ErrorCode::HANDLER_NOT_REGISTERED, 1)
        );
        let listed = store.list_dead(&DeadLetterQuery::default()).await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].event.id, id);
        assert_eq!(listed[0].error.message, "second death");
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (1, 0, 1));
    }

    /// Dead letters: keyset listing with a code filter, retry back to pending
    /// (attempts 0, last error kept), purge.
    pub async fn dead_letters_can_be_listed_retried_and_purged<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h.enqueue((0..4).map(ev).collect(), true).await.unwrap();
        let c = claim(&store, req("relay-a", 10)).await;
        let not_registered = error(
            ErrorCode::HANDLER_NOT_REGISTERED,
            "no handler for test.event",
        );
        let report = settle(
            &store,
            c.token,
            Settlement::new()
                .with(all[0], dead(permanent("bad payload")))
                .with(all[1], dead(not_registered))
                .with(all[2], dead(permanent("bad payload")))
                .with(all[3], Resolution::Delivered),
        )
        .await;
        assert_eq!(report.applied, 4);
        assert_eq!(
            h.snapshot(all[1]).await,
            dead_row(ErrorCode::HANDLER_NOT_REGISTERED, 1)
        );

        let list = |code: Option<ErrorCode>, limit: u32, after: Option<EventId>| {
            let store = &store;
            async move {
                store
                    .list_dead(&DeadLetterQuery {
                        filter: match code {
                            Some(code) => DeadLetterFilter::all().with_code(code),
                            None => DeadLetterFilter::all(),
                        },
                        limit,
                        after,
                    })
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|d| d.event.id)
                    .collect::<Vec<_>>()
            }
        };
        assert_eq!(list(None, 100, None).await, all[..3]);
        assert_eq!(list(None, 2, None).await, all[..2]);
        assert_eq!(list(None, 2, Some(all[1])).await, all[2..3]);
        assert_eq!(
            list(Some(ErrorCode::HANDLER_NOT_REGISTERED), 100, None).await,
            vec![all[1]]
        );
        assert_eq!(
            list(Some(ErrorCode::HANDLER_PERMANENT_FAILURE), 100, None).await,
            vec![all[0], all[2]]
        );
        let full = store.list_dead(&DeadLetterQuery::default()).await.unwrap();
        assert_eq!(full[1].error.message, "no handler for test.event");
        assert_eq!(full[1].event.payload, b"payload-1");

        // Retry one: back to pending, attempts 0, last error kept, claimable now.
        assert_eq!(
            store
                .retry_dead(&DeadLetterFilter::ids([all[0]]))
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            h.snapshot(all[0]).await,
            pending(0, false, Some(ErrorCode::HANDLER_PERMANENT_FAILURE))
        );
        assert_eq!(
            store
                .retry_dead(&DeadLetterFilter::ids([EventId::new()]))
                .await
                .unwrap(),
            0
        );
        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), vec![all[0]]);
        assert_eq!(c.events[0].attempts, 1);
        assert_eq!(
            c.events[0].last_error.as_ref().map(|e| e.code.clone()),
            Some(ErrorCode::HANDLER_PERMANENT_FAILURE)
        );
        settle(&store, c.token, delivered(&[all[0]])).await;

        // Purge one, then retry all the rest, then purge all.
        assert_eq!(
            store
                .purge_dead(&DeadLetterFilter::ids([all[1]]))
                .await
                .unwrap(),
            1
        );
        assert_eq!(h.snapshot(all[1]).await, RowState::Missing);
        assert_eq!(store.retry_dead(&DeadLetterFilter::all()).await.unwrap(), 1);
        assert_eq!(
            h.snapshot(all[2]).await,
            pending(0, false, Some(ErrorCode::HANDLER_PERMANENT_FAILURE))
        );
        let c = claim(&store, req("relay-a", 10)).await;
        settle(
            &store,
            c.token,
            Settlement::new().with(all[2], dead(permanent("again"))),
        )
        .await;
        assert_eq!(store.purge_dead(&DeadLetterFilter::all()).await.unwrap(), 1);
        assert_eq!(h.snapshot(all[2]).await, RowState::Missing);
        assert!(list(None, 100, None).await.is_empty());
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (0, 0, 0));
    }

    /// Filters select dead letters by event type, error code, key and age
    /// (`dead_at` against the database's `now()`), ANDed together and with
    /// ids; list, count, retry and purge all honour them.
    pub async fn dead_letters_are_selected_by_type_code_key_and_age<H: StoreHarness>(h: &H) {
        const HOUR: Duration = Duration::from_secs(3600);
        const DAY: Duration = Duration::from_secs(24 * 3600);
        let store = h.store().await;
        let events = vec![
            NewEvent::new("order.created", "t", b"a".to_vec()).with_key("k1"),
            NewEvent::new("order.created", "t", b"b".to_vec()).with_key("k2"),
            NewEvent::new("invoice.sent", "t", b"c".to_vec()).with_key("k1"),
            NewEvent::new("invoice.sent", "t", b"d".to_vec()),
        ];
        let all = h.enqueue(events, true).await.unwrap();
        let (a, b, c, d) = (all[0], all[1], all[2], all[3]);
        let claimed = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&claimed), all);
        let not_registered = error(ErrorCode::HANDLER_NOT_REGISTERED, "no handler");
        let report = settle(
            &store,
            claimed.token,
            Settlement::new()
                .with(a, dead(permanent("bad a")))
                .with(b, dead(not_registered))
                .with(c, dead(permanent("bad c")))
                .with(d, dead(permanent("bad d"))),
        )
        .await;
        assert_eq!(report.applied, 4);
        // a died 3 days ago, b 2 hours ago, c and d just now.
        h.backdate_dead(a, 3 * DAY).await;
        h.backdate_dead(b, 2 * HOUR).await;

        let list = |filter: DeadLetterFilter| {
            let store = &store;
            async move {
                store
                    .list_dead(&DeadLetterQuery::new(filter))
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|d| d.event.id)
                    .collect::<Vec<_>>()
            }
        };
        let count = |filter: DeadLetterFilter| {
            let store = &store;
            async move { store.count_dead(&filter).await.unwrap() }
        };
        let retry = |filter: DeadLetterFilter| {
            let store = &store;
            async move { store.retry_dead(&filter).await.unwrap() }
        };
        let purge = |filter: DeadLetterFilter| {
            let store = &store;
            async move { store.purge_dead(&filter).await.unwrap() }
        };
        let f = DeadLetterFilter::all;
        assert_eq!(list(f()).await, all);
        assert_eq!(list(f().with_event_type("order.created")).await, vec![a, b]);
        assert_eq!(
            list(f().with_code(ErrorCode::HANDLER_NOT_REGISTERED)).await,
            vec![b]
        );
        assert_eq!(list(f().with_key("k1")).await, vec![a, c]);
        assert_eq!(list(f().with_key("nope")).await, vec![]);
        assert_eq!(list(f().older_than(HOUR)).await, vec![a, b]);
        assert_eq!(list(f().older_than(DAY)).await, vec![a]);
        assert_eq!(list(f().newer_than(HOUR)).await, vec![c, d]);
        assert_eq!(list(f().newer_than(DAY)).await, vec![b, c, d]);
        assert_eq!(list(f().older_than(HOUR).newer_than(DAY)).await, vec![b]);
        assert_eq!(
            list(f().with_event_type("invoice.sent").with_key("k1")).await,
            vec![c]
        );
        assert_eq!(
            list(
                f().with_ids([a, b, c])
                    .with_code(ErrorCode::HANDLER_PERMANENT_FAILURE)
            )
            .await,
            vec![a, c]
        );
        assert_eq!(
            list(f().with_ids([b]).with_event_type("invoice.sent")).await,
            vec![]
        );
        assert_eq!(list(f().with_ids([])).await, vec![]);
        // An age beyond any store's range is capped, not an error.
        assert_eq!(list(f().older_than(Duration::MAX)).await, vec![]);
        assert_eq!(list(f().newer_than(Duration::MAX)).await, all);
        // Pagination within a filter.
        let page = store
            .list_dead(&DeadLetterQuery {
                filter: f().with_event_type("order.created"),
                limit: 1,
                after: Some(a),
            })
            .await
            .unwrap();
        assert_eq!(page.iter().map(|d| d.event.id).collect::<Vec<_>>(), vec![b]);

        assert_eq!(count(f()).await, 4);
        assert_eq!(count(f().with_key("k1")).await, 2);
        assert_eq!(count(f().older_than(HOUR)).await, 2);
        assert_eq!(count(f().with_ids([d, EventId::new()])).await, 1);
        assert_eq!(count(f().with_ids([])).await, 0);

        // Retry and purge touch only what the filter selects.
        assert_eq!(
            retry(f().with_event_type("invoice.sent").with_key("k1")).await,
            1
        );
        assert_eq!(
            h.snapshot(c).await,
            pending(0, false, Some(ErrorCode::HANDLER_PERMANENT_FAILURE))
        );
        assert_eq!(purge(f().older_than(DAY)).await, 1, "only a is a day old");
        assert_eq!(h.snapshot(a).await, RowState::Missing);
        let not_registered = || f().with_code(ErrorCode::HANDLER_NOT_REGISTERED);
        assert_eq!(purge(not_registered().newer_than(HOUR)).await, 0);
        assert_eq!(retry(not_registered().older_than(HOUR)).await, 1);
        assert_eq!(
            h.snapshot(b).await,
            pending(0, false, Some(ErrorCode::HANDLER_NOT_REGISTERED))
        );
        assert_eq!(
            h.snapshot(d).await,
            dead_row(ErrorCode::HANDLER_PERMANENT_FAILURE, 1)
        );
        assert_eq!(list(f()).await, vec![d]);
        assert_eq!(stats(&store).await.dead, 1);
    }

    /// A replayed dead letter never runs beside another event of its key:
    /// while a later event of its key is in flight it is not claimed, and
    /// it is delivered after that event (it goes behind the key's events
    /// still pending).
    pub async fn retried_dead_letter_goes_behind_its_keys_pending_events<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h
            .enqueue(vec![keyed("k", 1), keyed("k", 2)], true)
            .await
            .unwrap();
        let (first, second) = (all[0], all[1]);
        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), all);
        settle(
            &store,
            c.token,
            Settlement::new()
                .with(first, dead(permanent("poison")))
                .with(second, retry(Duration::ZERO)),
        )
        .await;
        // The key's later event is in flight when its dead head is replayed.
        let held = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&held), vec![second]);
        assert_eq!(
            store
                .retry_dead(&DeadLetterFilter::ids([first]))
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            h.snapshot(first).await,
            pending(0, false, Some(ErrorCode::HANDLER_PERMANENT_FAILURE))
        );
        let beside = claim(&store, req("relay-a", 10)).await;
        assert!(
            beside.events.is_empty(),
            "a replayed dead letter was claimed beside its key's event in flight: {:?}",
            ids(&beside)
        );
        settle(&store, held.token, delivered(&[second])).await;
        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), vec![first]);
        assert_eq!(c.events[0].attempts, 1);
        settle(&store, c.token, delivered(&[first])).await;
        assert_eq!(h.snapshot(first).await, RowState::Missing);
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (0, 0, 0));
    }

    /// A row the store cannot decode is dead-lettered by the claim with
    /// `UNDECODABLE` and a reason, left out of the claim (never left leased),
    /// and the events around it are claimed and settle normally.
    pub async fn undecodable_row_is_dead_lettered_and_left_out_of_the_claim<H: StoreHarness>(
        h: &H,
    ) {
        let store = h.store().await;
        let before = h.enqueue(vec![ev(0)], true).await.unwrap()[0];
        let bad = h.insert_undecodable().await;
        let after = h.enqueue(vec![ev(1)], true).await.unwrap()[0];

        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), vec![before, after]);
        assert!(
            matches!(h.snapshot(bad).await, RowState::Dead { code, .. } if code == ErrorCode::UNDECODABLE),
            "{:?}",
            h.snapshot(bad).await
        );
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (0, 2, 1));
        assert!(claim(&store, req("relay-b", 10)).await.events.is_empty());

        let report = settle(&store, c.token, delivered(&[before, after])).await;
        assert_eq!((report.applied, report.fenced.len()), (2, 0));

        // It stays queryable, with the decoding error as the reason.
        let listed = store
            .list_dead(&DeadLetterQuery::new(
                DeadLetterFilter::all().with_code(ErrorCode::UNDECODABLE),
            ))
            .await
            .unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].event.id, bad);
        assert_eq!(listed[0].error.code, ErrorCode::UNDECODABLE);
        assert!(!listed[0].error.message.is_empty());
    }

    /// Renew extends every lease the token still holds to `now() + lease`:
    /// a lease that had run out is current again and not claimable by
    /// another relay; other claims' leases are untouched.
    pub async fn renew_extends_the_lease<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let mine = h.enqueue(vec![ev(0), ev(1)], true).await.unwrap();
        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), mine);
        let theirs = h.enqueue(vec![ev(2)], true).await.unwrap()[0];
        let other = claim(&store, req("relay-c", 10)).await;
        assert_eq!(ids(&other), vec![theirs]);
        for id in mine.iter().chain([&theirs]) {
            h.expire_lease(*id).await;
        }

        assert_eq!(store.renew(c.token, LONG_LEASE).await.unwrap(), 2);
        for id in &mine {
            assert_eq!(h.snapshot(*id).await, leased(1, c.token, "relay-a"));
        }
        assert_eq!(
            h.snapshot(theirs).await,
            RowState::Leased {
                attempts: 1,
                token: other.token,
                locked_by: "relay-c".into(),
                lease_expired: true
            }
        );
        let b = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&b), vec![theirs], "a renewed lease was claimed");

        let report = settle(&store, c.token, delivered(&mine)).await;
        assert_eq!((report.applied, report.fenced.len()), (2, 0));
        assert_eq!(store.renew(c.token, LONG_LEASE).await.unwrap(), 0);
    }

    /// Renew with a token whose events were re-claimed by another relay
    /// returns 0 and leaves the new owner's lease alone.
    pub async fn renew_with_a_stale_token_returns_zero<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let id = h.enqueue(vec![ev(0)], true).await.unwrap()[0];
        let old = claim(&store, req("relay-a", 10)).await;
        h.expire_lease(id).await;
        let new = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&new), vec![id]);
        h.expire_lease(id).await;

        assert_eq!(store.renew(old.token, LONG_LEASE).await.unwrap(), 0);
        assert_eq!(
            h.snapshot(id).await,
            RowState::Leased {
                attempts: 2,
                token: new.token,
                locked_by: "relay-b".into(),
                lease_expired: true
            },
            "a stale renew touched the new owner's lease"
        );
        assert_eq!(
            store.renew(FencingToken::new(), LONG_LEASE).await.unwrap(),
            0
        );
        assert_eq!(store.renew(new.token, LONG_LEASE).await.unwrap(), 1);
        assert_eq!(h.snapshot(id).await, leased(2, new.token, "relay-b"));
    }

    /// An event enqueued in a rolled-back transaction never appears.
    pub async fn rolled_back_enqueue_never_appears<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let gone = h.enqueue(vec![ev(0), ev(1)], false).await.unwrap();
        let kept = h.enqueue(vec![ev(2)], true).await.unwrap();
        for id in &gone {
            assert_eq!(h.snapshot(*id).await, RowState::Missing);
        }
        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), kept);
        assert_eq!(
            stats(&store).await.pending + stats(&store).await.in_flight,
            1
        );
    }

    /// With shards i/N each event is claimed only by the shard owning its
    /// shard key, and the shards together claim everything.
    pub async fn shard_filter_gives_each_event_to_its_owner_only<H: StoreHarness>(h: &H) {
        const TOTAL: u32 = 3;
        let store = h.store().await;
        let mut events: Vec<NewEvent> = (0..60)
            .map(|i| keyed(&format!("key-{}", i % 12), i))
            .collect();
        events.extend((60..75).map(ev));
        let keys: Vec<String> = events.iter().map(NewEvent::shard_key).collect();
        let all = h.enqueue(events, true).await.unwrap();
        let mut union = BTreeSet::new();
        for index in 0..TOTAL {
            let shard = ShardSpec::new(index, TOTAL).unwrap();
            let c = claim(
                &store,
                ClaimRequest {
                    shard,
                    ..req(&format!("relay-{index}"), 1000)
                },
            )
            .await;
            for e in &c.events {
                assert!(
                    shard.owns(e.shard_key().as_bytes()),
                    "shard {shard} claimed {} (key {:?})",
                    e.id,
                    e.key
                );
                assert!(union.insert(e.id), "{} claimed by two shards", e.id);
            }
            let expected: Vec<EventId> = all
                .iter()
                .zip(&keys)
                .filter(|(_, k)| shard.owns(k.as_bytes()))
                .map(|(id, _)| *id)
                .collect();
            assert_eq!(ids(&c), expected, "shard {shard}");
        }
        assert_eq!(union, all.iter().copied().collect::<BTreeSet<_>>());
    }

    /// Per-key order: while an earlier event of key k is leased or waiting for
    /// a retry, later events of k are not claimed; other keys (and keyless
    /// events) flow. Once the earlier event leaves the table, the next follows.
    pub async fn per_key_order_earlier_event_blocks_later_ones<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h
            .enqueue(
                vec![
                    keyed("k", 0),
                    keyed("m", 1),
                    keyed("k", 2),
                    keyed("other", 3),
                    keyed("m", 4),
                    ev(5),
                ],
                true,
            )
            .await
            .unwrap();
        let (k1, m1, k2, other, m2, none) = (all[0], all[1], all[2], all[3], all[4], all[5]);

        let first = claim(&store, req("relay-a", 2)).await;
        assert_eq!(ids(&first), vec![k1, m1]);
        // k1 and m1 leased: k2 and m2 wait.
        let c = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&c), vec![other, none]);
        assert_eq!(h.snapshot(k2).await, pending(0, false, None));
        assert_eq!(h.snapshot(m2).await, pending(0, false, None));

        // k1 waits for a retry an hour away: k2 still waits.
        settle(
            &store,
            first.token,
            Settlement::new().with(k1, retry(LATER)),
        )
        .await;
        assert!(claim(&store, req("relay-b", 10)).await.events.is_empty());
        assert_eq!(h.snapshot(k2).await, pending(0, false, None));

        // m1 dead-lettered: it left the table, m2 flows.
        settle(
            &store,
            first.token,
            Settlement::new().with(m1, dead(permanent("bad"))),
        )
        .await;
        let c = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&c), vec![m2]);
        assert_eq!(h.snapshot(k2).await, pending(0, false, None));
    }

    /// Per-key order is commit order, not id order: an event whose id is
    /// smaller (built first) but whose transaction commits later is claimed
    /// after the earlier commit, and waits behind it while it is leased.
    pub async fn per_key_order_is_commit_order_not_id_order<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let built_first = keyed("k", 0);
        let built_second = keyed("k", 1);
        let loose_first = ev(2);
        let loose_second = ev(3);
        assert!(built_first.id() < built_second.id());
        assert!(loose_first.id() < loose_second.id());
        let committed_first = h
            .enqueue(vec![built_second, loose_second], true)
            .await
            .unwrap();
        let committed_last = h
            .enqueue(vec![built_first, loose_first], true)
            .await
            .unwrap();

        let all = claim(&store, req("relay-a", 10)).await;
        let want: Vec<EventId> = committed_first
            .iter()
            .chain(&committed_last)
            .copied()
            .collect();
        assert_eq!(ids(&all), want, "claims follow commit order");
        settle(&store, all.token, Settlement::release_all(want.clone())).await;

        // The earlier commit of k, leased, holds back the later one.
        let head = claim(&store, req("relay-a", 1)).await;
        assert_eq!(ids(&head), vec![committed_first[0]]);
        let rest = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&rest), vec![committed_first[1], committed_last[1]]);
        assert_eq!(h.snapshot(committed_last[0]).await, pending(0, false, None));
        settle(&store, head.token, delivered(&ids(&head))).await;
        let tail = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&tail), vec![committed_last[0]]);
    }

    /// Stats count pending (including expired leases and scheduled retries),
    /// in-flight (unexpired leases) and dead, and the oldest event's age.
    pub async fn stats_count_pending_in_flight_and_dead<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        assert_eq!(stats(&store).await, Stats::default());

        let all = h.enqueue((0..5).map(ev).collect(), true).await.unwrap();
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (5, 0, 0));
        assert!(s.oldest_pending_age.is_some());

        let c = claim(&store, req("relay-a", 3)).await;
        settle(
            &store,
            c.token,
            Settlement::new()
                .with(all[0], dead(permanent("x")))
                .with(all[1], retry(LATER)),
        )
        .await;
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (3, 1, 1));
        assert!(s.oldest_pending_age.is_some());

        h.expire_lease(all[2]).await;
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (4, 0, 1));

        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), vec![all[2], all[3], all[4]]);
        settle(&store, c.token, delivered(&ids(&c))).await;
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (1, 0, 1));
        store.purge_dead(&DeadLetterFilter::all()).await.unwrap();
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (1, 0, 0));
        assert!(s.oldest_pending_age.is_some());
    }

    /// An invalid event is refused with its `ValidationError`, and a batch
    /// with one invalid event writes none of them.
    pub async fn enqueue_rejects_invalid_events_and_writes_nothing<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let bad_topic = NewEvent::new("test.event", "", b"x".to_vec());
        assert_eq!(
            h.enqueue(vec![bad_topic.clone()], true).await,
            Err(ValidationError::EmptyTopic)
        );
        assert_eq!(h.snapshot(bad_topic.id()).await, RowState::Missing);

        let good = ev(0);
        let too_big = NewEvent::new("test.event", "t", vec![0u8; 1024 * 1024 + 1]);
        let bad_header = ev(2).with_header("bad name", "v");
        assert_eq!(
            h.enqueue(vec![good.clone(), too_big], true).await,
            Err(ValidationError::PayloadTooLarge {
                size: 1024 * 1024 + 1,
                max: 1024 * 1024
            })
        );
        assert!(matches!(
            h.enqueue(vec![good.clone(), bad_header], true).await,
            Err(ValidationError::InvalidHeaderName(_))
        ));
        assert_eq!(h.snapshot(good.id()).await, RowState::Missing);
        assert_eq!(stats(&store).await, Stats::default());
        assert!(claim(&store, req("relay-a", 10)).await.events.is_empty());
    }

    /// A large batch (over one INSERT chunk) is written completely, in order.
    pub async fn batch_enqueue_writes_all<H: StoreHarness>(h: &H) {
        const N: usize = 1234;
        let store = h.store().await;
        let events: Vec<NewEvent> = (0..N).map(ev).collect();
        let want: Vec<EventId> = events.iter().map(NewEvent::id).collect();
        let all = h.enqueue(events, true).await.unwrap();
        assert_eq!(all, want);
        assert_eq!(stats(&store).await.pending, N as u64);
        let c = claim(&store, req("relay-a", 2000)).await;
        assert_eq!(ids(&c), all);
        assert_eq!(
            c.events[N - 1].payload,
            format!("payload-{}", N - 1).into_bytes()
        );
        assert_eq!(h.snapshot(all[N / 2]).await, leased(1, c.token, "relay-a"));
    }

    /// Delays of 0 s, 2 s and 1 h: the 0 s event and an undelayed event of
    /// another key enqueued after the delayed ones come at once; the 2 s
    /// event (and a keyless one, delayed 2 s too) not before 2 s on the
    /// database clock, then is delivered; its key's later event never
    /// before it; the 1 h event (an absolute time) and its key's later
    /// event not within the test (dropped with the test's database). A
    /// negative delay is refused at enqueue.
    pub async fn delayed_events_wait_without_delaying_other_keys<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let refused = h
            .enqueue(
                vec![keyed("x", 99).deliver_after(chrono::TimeDelta::seconds(-1))],
                true,
            )
            .await;
        assert_eq!(
            refused,
            Err(ValidationError::NegativeDelay { micros: -1_000_000 })
        );

        let start = std::time::Instant::now();
        let now0 = keyed("a", 0).deliver_after(Duration::ZERO);
        let two = keyed("b", 1).deliver_after(Duration::from_secs(2));
        let keyless_two = ev(2).deliver_after(chrono::TimeDelta::seconds(2));
        let hour = keyed("c", 3).deliver_at(chrono::Utc::now() + chrono::TimeDelta::hours(1));
        let delayed = h
            .enqueue(vec![now0, two, keyless_two, hour], true)
            .await
            .unwrap();
        let (a0, b2, n2, c1h) = (delayed[0], delayed[1], delayed[2], delayed[3]);
        let later = h
            .enqueue(vec![keyed("e", 4), keyed("b", 5), keyed("c", 6)], true)
            .await
            .unwrap();
        let (e, b_next, c_next) = (later[0], later[1], later[2]);

        // Claim and deliver everything that comes, recording when (test
        // clock) and in which order.
        let mut got: Vec<(EventId, std::time::Duration)> = Vec::new();
        let mut b2_event = None;
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !got.iter().any(|(id, _)| *id == b_next) && std::time::Instant::now() < deadline {
            let c = claim(&store, req("relay-a", 100)).await;
            if c.events.is_empty() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            for ev in &c.events {
                got.push((ev.id, start.elapsed()));
                if ev.id == b2 {
                    b2_event = Some(ev.clone());
                }
            }
            let report = settle(&store, c.token, delivered(&ids(&c))).await;
            assert!(report.fenced.is_empty(), "{report:?}");
        }
        let at = |id: EventId| got.iter().position(|(g, _)| *g == id);
        let when = |id: EventId| got.iter().find(|(g, _)| *g == id).map(|(_, t)| *t);
        for id in [a0, e, b2, n2, b_next] {
            assert!(at(id).is_some(), "{id} not delivered within 20 s: {got:?}");
        }
        // Undelayed (and zero-delay) events are not held back by the delayed ones.
        assert!(
            at(a0) < at(b2) && at(e) < at(b2) && at(e) < at(n2),
            "{got:?}"
        );
        assert!(
            when(e).unwrap() < Duration::from_millis(1500),
            "the undelayed event of another key waited: {got:?}"
        );
        // Not before 2 s: the database's own columns (insert time -> due
        // time), and the claim itself (the test started its clock before
        // the inserting transaction began, on the same host).
        let b2_event = b2_event.unwrap();
        assert!(
            b2_event.next_attempt_at - b2_event.created_at >= chrono::TimeDelta::seconds(2),
            "{b2_event:?}"
        );
        for id in [b2, n2] {
            assert!(
                when(id).unwrap() >= Duration::from_millis(1990),
                "{id} delivered before its 2 s delay: {got:?}"
            );
        }
        // Per-key order: the key's later event waited behind the delayed one.
        assert!(at(b2) < at(b_next), "{got:?}");
        // The 1 h event and the later event of its key: not within the test.
        for id in [c1h, c_next] {
            assert_eq!(at(id), None, "{got:?}");
        }
        let c = claim(&store, req("relay-a", 100)).await;
        assert!(c.events.is_empty(), "{:?}", ids(&c));
    }

    /// A delayed event behind an event of its key that is retried for
    /// longer than the delay still waits for it: order k1 (retried), k2
    /// (delayed 1 s), k3.
    pub async fn delayed_event_stays_behind_a_retried_event_of_its_key<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let ids_in = h
            .enqueue(
                vec![
                    keyed("k", 0),
                    keyed("k", 1).deliver_after(Duration::from_secs(1)),
                    keyed("k", 2),
                ],
                true,
            )
            .await
            .unwrap();
        let c = claim(&store, req("relay-a", 100)).await;
        assert_eq!(ids(&c), vec![ids_in[0]], "only the key's first event");
        let s = Settlement::new().with(ids_in[0], retry(Duration::from_millis(1500)));
        assert!(settle(&store, c.token, s).await.fenced.is_empty());

        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while got.len() < 3 && std::time::Instant::now() < deadline {
            let c = claim(&store, req("relay-a", 100)).await;
            if c.events.is_empty() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            got.extend(ids(&c));
            let report = settle(&store, c.token, delivered(&ids(&c))).await;
            assert!(report.fenced.is_empty(), "{report:?}");
        }
        assert_eq!(
            got, ids_in,
            "per-key order: retried first, then the delayed one"
        );
    }
}
