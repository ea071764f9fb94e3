//! Enqueue and stats: a rollback, an invalid event and a large batch, and
//! the counts of what the table holds.

use super::support::{
    claim, dead, delivered, ev, ids, leased, permanent, req, retry, settle, stats, LATER,
};
use crate::store::{RowState, StoreHarness};
use outbox_core::{
    DeadLetterFilter, DeadLetterStore, EventId, NewEvent, Settlement, Stats, ValidationError,
};

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
