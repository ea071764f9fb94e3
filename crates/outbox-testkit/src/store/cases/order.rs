//! Order and routing: shards, per-key order (commit order, not id
//! order), and delayed events.

use super::support::{
    claim, dead, delivered, ev, ids, keyed, pending, permanent, req, retry, settle, LATER,
};
use crate::store::StoreHarness;
use outbox_core::{ClaimRequest, EventId, NewEvent, Settlement, ShardSpec, ValidationError};
use std::collections::BTreeSet;
use std::time::Duration;

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
