//! Claims and leases: what a claim returns and records, how a lease keeps
//! an event from other relays until it ends, and what renewing one does.

use super::support::{
    claim, delivered, ev, ids, keyed, leased, pending, req, retry, settle, stats, LATER, LONG_LEASE,
};
use crate::store::{RowState, StoreHarness};
use outbox_core::{ClaimRequest, ErrorCode, EventId, FencingToken, NewEvent, Settlement, Store};
use std::collections::HashSet;
use std::time::Duration;

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
