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
//! long and expire only through [`StoreHarness::expire_lease`].

use outbox_core::{
    Claim, ClaimRequest, DeadLetterQuery, DeadLetterStore, DeliveryError, Disposition, ErrorCode,
    EventId, Failure, FencingToken, NewEvent, RelayId, ShardSpec, Stats, Store, ValidationError,
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

    /// Enqueues `events` with the store crate's own enqueue function inside a
    /// real transaction, then commits it (`commit = true`) or rolls it back.
    /// Returns the ids, or the validation error the enqueue function reported
    /// (database errors panic).
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
}

/// Expands to one `#[test]` per conformance case, in a module `conformance`,
/// each running on a fresh multi-thread tokio runtime with a fresh harness
/// built by `$harness` (an expression that may `.await`; items of the
/// invoking module are in scope). Names look like
/// `conformance::claim_honours_next_attempt_at`.
#[macro_export]
macro_rules! store_conformance_tests {
    ($harness:expr) => {
        $crate::__store_conformance_cases!($harness;
            claim_returns_committed_events_oldest_first,
            claim_respects_batch_size,
            claim_honours_next_attempt_at,
            leased_events_are_not_reclaimed_until_the_lease_expires,
            concurrent_claimers_never_share_an_event,
            complete_with_a_stale_token_changes_nothing,
            fail_and_release_with_a_stale_token_change_nothing,
            complete_deletes_the_batch_and_reports_unknown_ids,
            retry_schedules_the_event_and_records_the_error,
            dead_letter_after_max_attempts,
            dead_letters_can_be_listed_retried_and_purged,
            rolled_back_enqueue_never_appears,
            shard_filter_gives_each_event_to_its_owner_only,
            per_key_order_earlier_event_blocks_later_ones,
            release_returns_events_unattempted,
            stats_count_pending_in_flight_and_dead,
            enqueue_rejects_invalid_events_and_writes_nothing,
            batch_enqueue_writes_all,
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

    fn temporary(message: &str) -> DeliveryError {
        DeliveryError::retryable(ErrorCode::HANDLER_TEMPORARY_FAILURE, message)
    }

    fn permanent(message: &str) -> DeliveryError {
        DeliveryError::permanent(ErrorCode::HANDLER_PERMANENT_FAILURE, message)
    }

    fn retry(id: EventId, delay: Duration) -> Failure {
        Failure {
            id,
            error: temporary("temporarily down"),
            disposition: Disposition::Retry { delay },
        }
    }

    fn dead(id: EventId, error: DeliveryError) -> Failure {
        Failure {
            id,
            error,
            disposition: Disposition::Dead,
        }
    }

    async fn claim<S: Store>(store: &S, req: ClaimRequest) -> Claim {
        store.claim(&req).await.expect("claim")
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
        let report = store
            .fail(c.token, &[retry(later, LATER), retry(now, Duration::ZERO)])
            .await
            .unwrap();
        assert_eq!(report.applied, 2);
        assert!(report.all_applied());
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

    /// Two relays claiming concurrently (tokio tasks, many rounds) never get
    /// the same event, and together get all of them.
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
                    let report = store.complete(c.token, &mine).await.expect("complete");
                    assert!(report.all_applied(), "{relay} lost {:?}", report.lost);
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

    /// After a lease expired and another relay re-claimed the event, the old
    /// token's complete changes nothing and is reported lost; the new owner's
    /// complete works.
    pub async fn complete_with_a_stale_token_changes_nothing<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let id = h.enqueue(vec![ev(0)], true).await.unwrap()[0];
        let old = claim(&store, req("relay-a", 10)).await;
        h.expire_lease(id).await;
        let new = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&new), vec![id]);

        let report = store.complete(old.token, &[id]).await.unwrap();
        assert_eq!(report.applied, 0);
        assert_eq!(report.lost, vec![id]);
        assert_eq!(h.snapshot(id).await, leased(2, new.token, "relay-b"));

        let report = store.complete(new.token, &[id]).await.unwrap();
        assert_eq!(report.applied, 1);
        assert!(report.lost.is_empty());
        assert_eq!(h.snapshot(id).await, RowState::Missing);
        let report = store.complete(new.token, &[id]).await.unwrap();
        assert_eq!(report.lost, vec![id], "completing twice must report the id");
    }

    /// A stale token's fail (retry or dead) and release change nothing.
    pub async fn fail_and_release_with_a_stale_token_change_nothing<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let id = h.enqueue(vec![ev(0)], true).await.unwrap()[0];
        let old = claim(&store, req("relay-a", 10)).await;
        h.expire_lease(id).await;
        let new = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&new), vec![id]);

        let report = store.fail(old.token, &[retry(id, LATER)]).await.unwrap();
        assert_eq!((report.applied, report.lost.clone()), (0, vec![id]));
        let report = store
            .fail(old.token, &[dead(id, permanent("nope"))])
            .await
            .unwrap();
        assert_eq!((report.applied, report.lost.clone()), (0, vec![id]));
        let report = store.release(old.token, &[id]).await.unwrap();
        assert_eq!((report.applied, report.lost.clone()), (0, vec![id]));

        assert_eq!(h.snapshot(id).await, leased(2, new.token, "relay-b"));
        assert_eq!(stats(&store).await.dead, 0);
    }

    /// Complete removes a whole batch in one call and lists ids it did not own.
    pub async fn complete_deletes_the_batch_and_reports_unknown_ids<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h.enqueue((0..50).map(ev).collect(), true).await.unwrap();
        let c = claim(&store, req("relay-a", 100)).await;
        assert_eq!(ids(&c), all);
        let stranger = EventId::new();
        let mut to_complete = all.clone();
        to_complete.push(stranger);
        let report = store.complete(c.token, &to_complete).await.unwrap();
        assert_eq!(report.applied, 50);
        assert_eq!(report.lost, vec![stranger]);
        for id in &all {
            assert_eq!(h.snapshot(*id).await, RowState::Missing);
        }
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (0, 0, 0));
    }

    /// `Retry { delay }` clears the lease, schedules the event at
    /// `now() + delay` and records the error; several in one call.
    pub async fn retry_schedules_the_event_and_records_the_error<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h.enqueue(vec![ev(0), ev(1)], true).await.unwrap();
        let c = claim(&store, req("relay-a", 10)).await;
        let stranger = EventId::new();
        let failures = [
            retry(all[0], LATER),
            Failure {
                id: all[1],
                error: DeliveryError::retryable(ErrorCode::PUBLISH_TIMEOUT, "no ack in 5s"),
                disposition: Disposition::Retry { delay: LATER },
            },
            retry(stranger, LATER),
        ];
        let report = store.fail(c.token, &failures).await.unwrap();
        assert_eq!(report.applied, 2);
        assert_eq!(report.lost, vec![stranger]);
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
            let failure = if attempt < 3 {
                retry(id, Duration::ZERO)
            } else {
                dead(id, temporary("still down after 3 attempts"))
            };
            let report = store.fail(c.token, &[failure]).await.unwrap();
            assert_eq!(report.applied, 1);
        }
        assert_eq!(
            h.snapshot(id).await,
            RowState::Dead {
                code: ErrorCode::HANDLER_TEMPORARY_FAILURE,
                attempts: 3
            }
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

    /// Dead letters: keyset listing with a code filter, retry back to pending
    /// (attempts 0, last error kept), purge.
    pub async fn dead_letters_can_be_listed_retried_and_purged<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let all = h.enqueue((0..4).map(ev).collect(), true).await.unwrap();
        let c = claim(&store, req("relay-a", 10)).await;
        let not_registered = DeliveryError::permanent(
            ErrorCode::HANDLER_NOT_REGISTERED,
            "no handler for test.event",
        );
        let failures = [
            dead(all[0], permanent("bad payload")),
            dead(all[1], not_registered.clone()),
            dead(all[2], permanent("bad payload")),
        ];
        let report = store.fail(c.token, &failures).await.unwrap();
        assert_eq!(report.applied, 3);
        store.complete(c.token, &all[3..]).await.unwrap();
        assert_eq!(
            h.snapshot(all[1]).await,
            RowState::Dead {
                code: ErrorCode::HANDLER_NOT_REGISTERED,
                attempts: 1
            }
        );

        let list = |code: Option<ErrorCode>, limit: u32, after: Option<EventId>| {
            let store = &store;
            async move {
                store
                    .list_dead(&DeadLetterQuery { code, limit, after })
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
        assert_eq!(store.retry_dead(Some(&[all[0]])).await.unwrap(), 1);
        assert_eq!(
            h.snapshot(all[0]).await,
            pending(0, false, Some(ErrorCode::HANDLER_PERMANENT_FAILURE))
        );
        assert_eq!(store.retry_dead(Some(&[EventId::new()])).await.unwrap(), 0);
        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), vec![all[0]]);
        assert_eq!(c.events[0].attempts, 1);
        assert_eq!(
            c.events[0].last_error.as_ref().map(|e| e.code.clone()),
            Some(ErrorCode::HANDLER_PERMANENT_FAILURE)
        );
        store.complete(c.token, &[all[0]]).await.unwrap();

        // Purge one, then retry all the rest, then purge all.
        assert_eq!(store.purge_dead(Some(&[all[1]])).await.unwrap(), 1);
        assert_eq!(h.snapshot(all[1]).await, RowState::Missing);
        assert_eq!(store.retry_dead(None).await.unwrap(), 1);
        assert_eq!(
            h.snapshot(all[2]).await,
            pending(0, false, Some(ErrorCode::HANDLER_PERMANENT_FAILURE))
        );
        let c = claim(&store, req("relay-a", 10)).await;
        store
            .fail(c.token, &[dead(all[2], permanent("again"))])
            .await
            .unwrap();
        assert_eq!(store.purge_dead(None).await.unwrap(), 1);
        assert_eq!(h.snapshot(all[2]).await, RowState::Missing);
        assert!(list(None, 100, None).await.is_empty());
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (0, 0, 0));
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
        store.fail(first.token, &[retry(k1, LATER)]).await.unwrap();
        assert!(claim(&store, req("relay-b", 10)).await.events.is_empty());
        assert_eq!(h.snapshot(k2).await, pending(0, false, None));

        // m1 dead-lettered: it left the table, m2 flows.
        store
            .fail(first.token, &[dead(m1, permanent("bad"))])
            .await
            .unwrap();
        let c = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&c), vec![m2]);
        assert_eq!(h.snapshot(k2).await, pending(0, false, None));
    }

    /// Release gives events back unattempted: lease cleared, attempts as
    /// before the claim, claimable again at once.
    pub async fn release_returns_events_unattempted<H: StoreHarness>(h: &H) {
        let store = h.store().await;
        let id = h.enqueue(vec![ev(0)], true).await.unwrap()[0];
        let c = claim(&store, req("relay-a", 10)).await;
        let report = store.release(c.token, &[id]).await.unwrap();
        assert_eq!((report.applied, report.lost.len()), (1, 0));
        assert_eq!(h.snapshot(id).await, pending(0, false, None));

        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(c.events[0].attempts, 1);
        store
            .fail(c.token, &[retry(id, Duration::ZERO)])
            .await
            .unwrap();
        let c2 = claim(&store, req("relay-a", 10)).await;
        assert_eq!(c2.events[0].attempts, 2);
        store.release(c2.token, &[id]).await.unwrap();
        assert_eq!(
            h.snapshot(id).await,
            pending(1, false, Some(ErrorCode::HANDLER_TEMPORARY_FAILURE))
        );
        let report = store.release(c2.token, &[id]).await.unwrap();
        assert_eq!((report.applied, report.lost), (0, vec![id]));
        let c3 = claim(&store, req("relay-b", 10)).await;
        assert_eq!(ids(&c3), vec![id]);
        assert_eq!(c3.events[0].attempts, 2);
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
        store
            .fail(
                c.token,
                &[dead(all[0], permanent("x")), retry(all[1], LATER)],
            )
            .await
            .unwrap();
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (3, 1, 1));
        assert!(s.oldest_pending_age.is_some());

        h.expire_lease(all[2]).await;
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (4, 0, 1));

        let c = claim(&store, req("relay-a", 10)).await;
        assert_eq!(ids(&c), vec![all[2], all[3], all[4]]);
        store.complete(c.token, &ids(&c)).await.unwrap();
        let s = stats(&store).await;
        assert_eq!((s.pending, s.in_flight, s.dead), (1, 0, 1));
        store.purge_dead(None).await.unwrap();
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
}
