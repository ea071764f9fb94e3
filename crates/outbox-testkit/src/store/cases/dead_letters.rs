//! Dead letters: what a dead letter records, listing, filtering, retrying
//! and purging them, a replayed one's place in its key's order, and rows
//! the store cannot decode.

use super::support::{
    claim, dead, dead_row, delivered, error, ev, ids, keyed, pending, permanent, req, retry,
    settle, stats, LATER,
};
use crate::store::{RowState, StoreHarness};
use outbox_core::{
    DeadLetterFilter, DeadLetterQuery, DeadLetterStore, ErrorCode, EventId, NewEvent, Resolution,
    Settlement,
};
use std::time::Duration;

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
pub async fn undecodable_row_is_dead_lettered_and_left_out_of_the_claim<H: StoreHarness>(h: &H) {
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
