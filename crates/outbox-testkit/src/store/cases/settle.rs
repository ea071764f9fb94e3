//! Settlements: delivered, retry, dead and released recorded as asked, at
//! once, and fenced for a token that no longer holds the events.

use super::support::{
    claim, dead, dead_row, delivered, error, ev, ids, keyed, leased, pending, permanent, req,
    retry, settle, stats, temporary, LATER,
};
use crate::store::{RowState, StoreHarness};
use outbox_core::{DeadLetterQuery, DeadLetterStore, ErrorCode, EventId, Resolution, Settlement};
use std::time::Duration;

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
