//! The retry lane as an operator reads it ([`HeldKeyStore`]): which key
//! waits behind which head.

use super::support::{claim, delivered, ev, ids, keyed, req, retry, settle, temporary, LATER};
use crate::store::StoreHarness;
use outbox_core::{ErrorCode, EventId, Resolution, Settlement};
use outbox_core::{HeadState, HeldKeyStore};

/// A failed event holds its key: `held_keys` names it as the head, with
/// its error and next attempt, and counts the key's events waiting behind
/// it (the first of them named); a keyless failed event is a head with
/// nothing behind it; a delivered key is not listed; the limit keeps the
/// key with the most events waiting and still reports the total.
pub async fn held_keys_name_each_head_and_what_waits_behind_it<H: StoreHarness>(h: &H) {
    let store = h.store().await;
    let empty = store.held_keys(10).await.expect("held_keys");
    assert_eq!((empty.total, empty.heads.len()), (0, 0), "{empty:?}");

    let first = h.enqueue(vec![keyed("a", 0), ev(1)], true).await.unwrap();
    let (a0, n1) = (first[0], first[1]);
    let c = claim(&store, req("relay-a", 100)).await;
    assert_eq!(ids(&c), vec![a0, n1]);
    let s = Settlement::new()
        .with(
            a0,
            Resolution::Retry {
                delay: LATER,
                error: temporary("broker down"),
            },
        )
        .with(n1, retry(LATER));
    assert!(settle(&store, c.token, s).await.fenced.is_empty());

    let later = h
        .enqueue(vec![keyed("a", 2), keyed("a", 3), keyed("b", 4)], true)
        .await
        .unwrap();
    let (a2, a3, b4) = (later[0], later[1], later[2]);
    let c = claim(&store, req("relay-a", 100)).await;
    assert_eq!(ids(&c), vec![b4], "key a waits behind its retry");
    assert!(settle(&store, c.token, delivered(&[b4]))
        .await
        .fenced
        .is_empty());

    let held = store.held_keys(10).await.expect("held_keys");
    assert_eq!(held.total, 2, "{held:?}");
    let heads: Vec<EventId> = held.heads.iter().map(|k| k.head.id).collect();
    assert_eq!(heads, vec![a0, n1], "the most events waiting first");
    let a = &held.heads[0];
    assert_eq!(a.head.key.as_deref(), Some("a"));
    assert_eq!(a.waiting, 2, "{a:?}");
    assert_eq!(a.first_waiting, Some(a2), "a2 comes before a3 ({a3})");
    assert_eq!(
        a.last_error().map(|e| (e.code.clone(), e.message.as_str())),
        Some((ErrorCode::HANDLER_TEMPORARY_FAILURE, "broker down"))
    );
    match &a.state {
        HeadState::Retrying { next_attempt_at } => assert!(
            *next_attempt_at > a.head.created_at + chrono::Duration::minutes(30),
            "retry in an hour: {a:?}"
        ),
        other => panic!("a0 waits for its retry, not {other:?}"),
    }
    let n = &held.heads[1];
    assert_eq!(
        (n.head.key.as_deref(), n.waiting, n.first_waiting),
        (None, 0, None)
    );

    let top = store.held_keys(1).await.expect("held_keys");
    assert_eq!(top.total, 2);
    assert_eq!(
        top.heads.iter().map(|k| k.head.id).collect::<Vec<_>>(),
        vec![a0]
    );
}
