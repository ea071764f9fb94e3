//! Event-log store behaviour against a real PostgreSQL, each test in its
//! own schema: commit order, long transactions, the retry lane's per-key
//! order, dead-head policies, fencing, pipelined and partial settles.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod log_support;

use log_support::{claim, deliver, ids, req, LogDb, LEASE};
use outbox_core::{
    ClaimRequest, DeadHeadPolicy, DeadLetterFilter, DeadLetterQuery, DeadLetterStore, ErrorCode,
    EventId, LastError, NewEvent, Resolution, Settlement, ShardSpec, Store,
};
use outbox_postgres::PgLogStore;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

fn ev(key: &str, n: usize) -> NewEvent {
    NewEvent::new("test.event", "log", format!("{key}-{n}").into_bytes()).with_key(key)
}

fn loose(n: usize) -> NewEvent {
    NewEvent::new("test.event", "log", format!("loose-{n}").into_bytes())
}

fn temporary() -> LastError {
    LastError {
        code: ErrorCode::HANDLER_TEMPORARY_FAILURE,
        message: "down".into(),
    }
}

fn permanent() -> LastError {
    LastError {
        code: ErrorCode::HANDLER_PERMANENT_FAILURE,
        message: "poison".into(),
    }
}

/// Asserts the store's `(pending, in_flight, dead)` counts.
async fn assert_counts(store: &PgLogStore, want: (u64, u64, u64)) {
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.in_flight, s.dead), want);
}

/// Claims (10 at a time) and delivers until a claim comes back empty, at
/// most `rounds` claims; the ids in the order they were claimed.
async fn drain_in_order(store: &PgLogStore, rounds: usize) -> Vec<EventId> {
    let mut order = Vec::new();
    for _ in 0..rounds {
        let c = claim(store, "relay", 10).await;
        if c.events.is_empty() {
            break;
        }
        order.extend(ids(&c));
        deliver(store, &c).await;
    }
    order
}

/// Two producers: the event built first (smaller id) commits last. With a
/// relay polling between the commits, it is delivered second: commit order,
/// not id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_follows_commit_order_not_id_order() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let first_built = ev("k", 1);
    let second_built = ev("k", 2);
    assert!(first_built.id() < second_built.id());

    let mut slow = db.pool.begin().await.unwrap();
    db.log
        .enqueue(&mut slow, first_built.clone())
        .await
        .unwrap();
    let mut fast = db.pool.begin().await.unwrap();
    db.log
        .enqueue(&mut fast, second_built.clone())
        .await
        .unwrap();
    fast.commit().await.unwrap();

    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), vec![second_built.id()]);
    deliver(&store, &c).await;
    assert!(claim(&store, "relay", 10).await.events.is_empty());

    slow.commit().await.unwrap();
    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), vec![first_built.id()]);
    deliver(&store, &c).await;
    assert_eq!(store.stats().await.unwrap().pending, 0);
}

/// A transaction left open for the whole test holds back only its own
/// event; everything committed around it flows, and its event follows once
/// it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_transaction_delays_only_its_own_events() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let before = db.enqueue(vec![ev("a", 0)]).await;
    let mut long = db.pool.begin().await.unwrap();
    let held = db.log.enqueue(&mut long, ev("long", 0)).await.unwrap();

    let mut delivered = Vec::new();
    for round in 0..5 {
        let ids_in = db
            .enqueue(vec![ev("a", round + 1), ev("b", round), loose(round)])
            .await;
        let c = claim(&store, "relay", 100).await;
        let got = ids(&c);
        assert!(!got.contains(&held), "an uncommitted event was claimed");
        deliver(&store, &c).await;
        if round == 0 {
            assert_eq!(got[..1], before[..]);
            assert_eq!(got[1..], ids_in[..]);
        } else {
            assert_eq!(got, ids_in, "round {round}");
        }
        delivered.extend(got);
    }
    assert_eq!(delivered.len(), 16);

    long.commit().await.unwrap();
    let c = claim(&store, "relay", 100).await;
    assert_eq!(ids(&c), vec![held]);
    deliver(&store, &c).await;
    assert!(claim(&store, "relay", 100).await.events.is_empty());
}

/// A retryable failure sends the event to the retry lane and the cursor
/// moves on; the key's later events (released in the batch, or arriving
/// later) wait behind it in order; other keys flow; once the head succeeds
/// the rest follow in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_lane_keeps_per_key_order() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let first = db
        .enqueue(vec![
            ev("k", 1),
            ev("m", 1),
            ev("k", 2),
            ev("k", 3),
            loose(1),
        ])
        .await;
    let (k1, m1, k2, k3, x1) = (first[0], first[1], first[2], first[3], first[4]);
    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), first);
    // What the relay's order layer does: k1 fails, k2 and k3 are not attempted.
    let r = store
        .settle(
            c.token,
            &Settlement::new()
                .with(
                    k1,
                    Resolution::Retry {
                        delay: Duration::from_millis(400),
                        error: temporary(),
                    },
                )
                .with(m1, Resolution::Delivered)
                .with(k2, Resolution::Released)
                .with(k3, Resolution::Released)
                .with(x1, Resolution::Delivered),
        )
        .await
        .unwrap();
    assert_eq!((r.applied, r.fenced.len()), (5, 0));

    let later = db.enqueue(vec![ev("k", 4), ev("m", 2)]).await;
    let (k4, m2) = (later[0], later[1]);
    // k is in backoff: only m flows; k4 is parked behind k3.
    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), vec![m2]);
    deliver(&store, &c).await;
    let lane: Vec<(uuid::Uuid, i32)> = sqlx::query_as(&format!(
        "SELECT id, attempts FROM {} ORDER BY ord",
        db.table("_lane")
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let lane_ids: Vec<EventId> = lane.iter().map(|(id, _)| EventId::from_uuid(*id)).collect();
    assert_eq!(lane_ids, vec![k1, k2, k3, k4]);
    assert_eq!(lane[0].1, 1, "the failed attempt is counted");
    assert_eq!(lane[1].1, 0, "a released event keeps its attempts");
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.in_flight), (4, 0));
    let status = store.status().await.unwrap();
    assert_eq!(status.shards.len(), 1);
    let shard = &status.shards[0];
    assert_eq!((shard.pending, shard.lane, shard.parked_keys), (0, 4, 1));
    assert!(shard.lag.is_some());
    assert_eq!(shard.cursor.owner.as_deref(), Some("relay"));
    assert!(shard.cursor.leased);
    assert_eq!(status.dead, 0);
    assert_eq!(status.log.partitions.len(), 3);

    // After the backoff, the key's due run (its head and the events parked
    // behind it) comes in one claim, in order; the relay's order layer
    // delivers it in waves.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let mut order = Vec::new();
    let mut claims = 0;
    for _ in 0..10 {
        let c = claim(&store, "relay", 10).await;
        if c.events.is_empty() {
            break;
        }
        claims += 1;
        if c.events[0].id == k1 {
            assert_eq!(c.events[0].attempts, 2);
            assert_eq!(
                c.events[0].last_error.as_ref().map(|e| e.code.clone()),
                Some(ErrorCode::HANDLER_TEMPORARY_FAILURE)
            );
        }
        order.extend(ids(&c));
        deliver(&store, &c).await;
    }
    assert_eq!(order, vec![k1, k2, k3, k4]);
    assert_eq!(claims, 1, "the key's run took {claims} claims");
    assert_counts(&store, (0, 0, 0)).await;
}

/// Dead-head policy `continue` (the default): once the head of a key is
/// dead-lettered, the key's next events are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_head_continue_lets_the_key_go_on() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let all = db.enqueue(vec![ev("k", 1), ev("k", 2)]).await;
    let c = claim(&store, "relay", 10).await;
    store
        .settle(
            c.token,
            &Settlement::new()
                .with(all[0], Resolution::Dead { error: permanent() })
                .with(all[1], Resolution::Released),
        )
        .await
        .unwrap();
    let k3 = db.enqueue(vec![ev("k", 3)]).await[0];
    // The released tail was given back to the log: k2 and k3 come together,
    // in order (the relay's order layer delivers them one after the other).
    let c = claim(&store, "relay", 10).await;
    assert_eq!(
        ids(&c),
        vec![all[1], k3],
        "the key continues after its dead head"
    );
    deliver(&store, &c).await;
    let dead = store.list_dead(&DeadLetterQuery::default()).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].event.id, all[0]);
    assert_eq!(dead[0].error.code, ErrorCode::HANDLER_PERMANENT_FAILURE);
}

/// Dead-head policy `block`: the key's later events wait (other keys
/// flow) until the dead letter is retried, which then goes first, or
/// purged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_head_block_holds_the_key_until_retry_or_purge() {
    let db = LogDb::new().await;
    let store = db
        .store_with(db.options().with_dead_head_policy(DeadHeadPolicy::Block))
        .await;
    let all = db
        .enqueue(vec![ev("k", 1), ev("k", 2), ev("j", 1), ev("j", 2)])
        .await;
    let (k1, k2, j1, j2) = (all[0], all[1], all[2], all[3]);
    let c = claim(&store, "relay", 10).await;
    store
        .settle(
            c.token,
            &Settlement::new()
                .with(k1, Resolution::Dead { error: permanent() })
                .with(k2, Resolution::Released)
                .with(j1, Resolution::Dead { error: permanent() })
                .with(j2, Resolution::Released),
        )
        .await
        .unwrap();
    let later = db.enqueue(vec![ev("k", 3), ev("other", 1)]).await;
    let (k3, other) = (later[0], later[1]);
    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), vec![other], "blocked keys must wait");
    deliver(&store, &c).await;
    assert!(claim(&store, "relay", 10).await.events.is_empty());

    // Retry k's dead head: it goes first, then the parked events, in order.
    assert_eq!(
        store
            .retry_dead(&DeadLetterFilter::ids([k1]))
            .await
            .unwrap(),
        1
    );
    assert_eq!(drain_in_order(&store, 5).await, vec![k1, k2, k3]);

    // Purge j's dead head: j2 flows.
    assert!(claim(&store, "relay", 10).await.events.is_empty());
    let purged = store.purge_dead(&DeadLetterFilter::ids([j1])).await;
    assert_eq!(purged.unwrap(), 1);
    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), vec![j2]);
    deliver(&store, &c).await;
    assert_counts(&store, (0, 0, 0)).await;
}

/// Dead-head policy `continue`: a replayed dead letter goes behind the
/// key's events waiting in the retry lane (a retry and a parked event),
/// not back ahead of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_head_continue_replay_goes_behind_the_keys_lane() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let all = db
        .enqueue(vec![ev("k", 1), ev("k", 2), ev("k", 3), loose(1)])
        .await;
    let (k1, k2, k3, l1) = (all[0], all[1], all[2], all[3]);
    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), all);
    let r = store
        .settle(
            c.token,
            &Settlement::new()
                .with(k1, Resolution::Dead { error: permanent() })
                .with(
                    k2,
                    Resolution::Retry {
                        delay: Duration::ZERO,
                        error: temporary(),
                    },
                )
                .with(k3, Resolution::Released)
                .with(l1, Resolution::Delivered),
        )
        .await
        .unwrap();
    assert!(r.all_applied(), "{r:?}");
    // k2 (retry) and k3 (released mid-batch) wait in the lane; replay k1.
    assert_eq!(
        store
            .retry_dead(&DeadLetterFilter::ids([k1]))
            .await
            .unwrap(),
        1
    );
    assert_eq!(drain_in_order(&store, 6).await, vec![k2, k3, k1]);
    assert_counts(&store, (0, 0, 0)).await;
}

/// One relay holds a shard; another (another process) gets empty claims.
/// When the holder's lease runs out, the other takes over and re-reads the
/// unsettled events; the old holder's settle and renew then change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_holder_is_fenced() {
    let db = LogDb::new().await;
    let a = db.store().await;
    let b = db.store().await;
    let all = db.enqueue(vec![ev("k", 1), loose(1), ev("k", 2)]).await;
    let ca = claim(&a, "relay-a", 10).await;
    assert_eq!(ids(&ca), all);
    assert!(claim(&b, "relay-b", 10).await.events.is_empty(), "standby");

    db.expire_leases().await;
    let cb = claim(&b, "relay-b", 10).await;
    assert_eq!(
        ids(&cb),
        all,
        "the new holder re-reads what was not settled"
    );
    assert_eq!(cb.events[0].attempts, 1);

    let late = Settlement::new()
        .with(all[0], Resolution::Delivered)
        .with(all[1], Resolution::Dead { error: permanent() })
        .with(
            all[2],
            Resolution::Retry {
                delay: Duration::ZERO,
                error: temporary(),
            },
        );
    let r = a.settle(ca.token, &late).await.unwrap();
    assert_eq!((r.applied, r.fenced.clone()), (0, all.clone()));
    assert_eq!(a.renew(ca.token, LEASE).await.unwrap(), 0);
    assert_eq!(a.stats().await.unwrap().dead, 0, "the zombie wrote nothing");
    assert!(claim(&a, "relay-a", 10).await.events.is_empty());

    deliver(&b, &cb).await;
    assert!(claim(&b, "relay-b", 10).await.events.is_empty());
    db.expire_leases().await;
    assert!(
        claim(&a, "relay-a", 10).await.events.is_empty(),
        "settled events came back"
    );
}

/// Renew keeps the holder's lease current (database clock); a renew
/// after the lease was taken over returns 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_extends_the_cursor_lease() {
    let db = LogDb::new().await;
    let a = db.store().await;
    let b = db.store().await;
    db.enqueue(vec![ev("k", 1), ev("j", 1)]).await;
    let short = ClaimRequest {
        lease: Duration::from_secs(2),
        ..req("relay-a", 10)
    };
    let c = a.claim(&short).await.unwrap();
    assert_eq!(c.events.len(), 2);
    assert_eq!(a.renew(c.token, LEASE).await.unwrap(), 2);
    let until: bool = sqlx::query_scalar(&format!(
        "SELECT lease_until > now() + interval '500 seconds' FROM {}",
        db.table("_cursors")
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(until);
    assert!(claim(&b, "relay-b", 10).await.events.is_empty());
    let partial = Settlement::new().with(c.events[0].id, Resolution::Delivered);
    a.settle(c.token, &partial).await.unwrap();
    assert_eq!(a.renew(c.token, LEASE).await.unwrap(), 1);
    db.expire_leases().await;
    assert_eq!(claim(&b, "relay-b", 10).await.events.len(), 1);
    assert_eq!(a.renew(c.token, LEASE).await.unwrap(), 0);
}

/// A released tail (shutdown, sink unavailable) is given back to the log:
/// nothing is copied, the next claim reads it again with its attempt
/// undone. A released event followed by a delivered one goes to the lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_events_come_back_unattempted() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let all = db.enqueue((0..4).map(loose).collect()).await;
    let c = claim(&store, "relay", 10).await;
    store
        .settle(
            c.token,
            &Settlement::new()
                .with(all[0], Resolution::Delivered)
                .with(all[1], Resolution::Released)
                .with(all[2], Resolution::Released)
                .with(all[3], Resolution::Released),
        )
        .await
        .unwrap();
    let lane: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", db.table("_lane")))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(lane, 0, "a released tail is not copied");
    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), all[1..]);
    assert!(c.events.iter().all(|e| e.attempts == 1));

    // Released in the middle: copied to the lane, claimed again first.
    store
        .settle(
            c.token,
            &Settlement::new()
                .with(all[1], Resolution::Released)
                .with(all[2], Resolution::Delivered)
                .with(all[3], Resolution::Delivered),
        )
        .await
        .unwrap();
    let next = db.enqueue(vec![loose(9)]).await[0];
    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), vec![all[1], next]);
    assert_eq!(c.events[0].attempts, 1);
    deliver(&store, &c).await;
    assert_eq!(store.stats().await.unwrap().pending, 0);
}

/// A second claim while the first batch is unsettled continues after it,
/// but stops before the next event of a key the first batch holds. Settled
/// out of order, the cursor moves only once both are settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_claims_keep_key_order_and_settle_in_any_order() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let all = db
        .enqueue(vec![
            ev("a", 1),
            ev("b", 1),
            ev("c", 1),
            ev("a", 2),
            ev("d", 1),
        ])
        .await;
    let c1 = claim(&store, "relay", 2).await;
    assert_eq!(ids(&c1), all[..2]);
    let c2 = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c2), vec![all[2]], "stops before a's next event");
    deliver(&store, &c2).await;
    let other = db.store().await;
    db.expire_leases().await;
    // A takeover now would re-read everything after c1's start: c2's event
    // is in the skip list, c1's are not settled.
    let cb = claim(&other, "relay-b", 10).await;
    assert_eq!(ids(&cb), vec![all[0], all[1], all[3], all[4]]);
    deliver(&other, &cb).await;
    // The old holder is fenced.
    let r = store
        .settle(
            c1.token,
            &Settlement::new().with(all[0], Resolution::Delivered),
        )
        .await
        .unwrap();
    assert_eq!(r.applied, 0);
    db.expire_leases().await;
    assert!(claim(&store, "relay", 10).await.events.is_empty());
}

/// A batch settled in parts, then taken over: the new holder skips what
/// was already dead-lettered or moved to the lane and re-reads the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_after_a_partial_settle_skips_what_was_settled() {
    let db = LogDb::new().await;
    let a = db.store().await;
    let b = db.store().await;
    let all = db.enqueue((0..4).map(loose).collect()).await;
    let c = claim(&a, "relay-a", 10).await;
    a.settle(
        c.token,
        &Settlement::new()
            .with(all[0], Resolution::Dead { error: permanent() })
            .with(
                all[1],
                Resolution::Retry {
                    delay: Duration::ZERO,
                    error: temporary(),
                },
            )
            .with(all[2], Resolution::Delivered),
    )
    .await
    .unwrap();
    db.expire_leases().await;
    let cb = claim(&b, "relay-b", 10).await;
    assert_eq!(ids(&cb), vec![all[1], all[3]], "lane first, then the log");
    assert_eq!(cb.events[0].attempts, 2);
    assert_eq!(cb.events[1].attempts, 1);
    deliver(&b, &cb).await;
    assert_counts(&b, (0, 0, 1)).await;
}

/// Each shard has its own cursor: events are claimed by their shard's
/// relay only, and one shard's backlog does not hold the other back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_progress_independently() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let events: Vec<NewEvent> = (0..40).map(|i| ev(&format!("key-{i}"), i)).collect();
    let owner: Vec<u32> = events.iter().map(|e| e.key_hash() % 2).collect();
    let all = db.enqueue(events).await;
    let shard = |i| ClaimRequest {
        shard: ShardSpec::new(i, 2).unwrap(),
        ..req(&format!("relay-{i}"), 100)
    };
    let c0 = store.claim(&shard(0)).await.unwrap();
    let want0: Vec<EventId> = all
        .iter()
        .zip(&owner)
        .filter(|(_, o)| **o == 0)
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(ids(&c0), want0);
    deliver(&store, &c0).await;
    // Shard 1 never claimed: its events are still pending.
    let s = store.stats().await.unwrap();
    assert_eq!(s.pending, 0, "stats count only cursors that exist");
    let c1 = store.claim(&shard(1)).await.unwrap();
    assert_eq!(c1.events.len(), 40 - want0.len());
    assert_eq!(store.cursors().await.unwrap().len(), 2);
}

/// A shard's claim reads exactly its keys, in both renderings of the shard
/// filter: the bit mask (64 shards: bits in every byte of it) and the list
/// used above the mask's limit (100,000 shards).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shards_claim_reads_exactly_its_keys_in_both_filter_renderings() {
    for total in [64u32, 100_000] {
        let db = LogDb::new().await;
        let store = db.store().await;
        let events: Vec<NewEvent> = (0..200).map(|i| ev(&format!("key-{i}"), i)).collect();
        let owner: Vec<u32> = events.iter().map(|e| e.key_hash() % total).collect();
        let all = db.enqueue(events).await;
        // Shards with events, including the highest index that has one.
        let mut shards: Vec<u32> = owner.clone();
        shards.sort_unstable();
        shards.dedup();
        let picked = [
            shards[0],
            shards[shards.len() / 2],
            shards[shards.len() - 1],
        ];
        for index in picked {
            let c = store
                .claim(&ClaimRequest {
                    shard: ShardSpec::new(index, total).unwrap(),
                    ..req(&format!("relay-{index}"), 500)
                })
                .await
                .unwrap();
            let want: Vec<EventId> = all
                .iter()
                .zip(&owner)
                .filter(|(_, o)| **o == index)
                .map(|(id, _)| *id)
                .collect();
            assert!(!want.is_empty());
            assert_eq!(ids(&c), want, "shard {index}/{total}");
        }
    }
}

/// `Claim::more` tells the relay whether to claim again at once: a claim
/// that stopped at its batch size, or before a key that is still in
/// flight, says so; one that read everything committed does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_says_when_more_events_are_ready() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let [a1, a2, b1] = db
        .enqueue(vec![ev("a", 1), ev("a", 2), ev("b", 1)])
        .await
        .try_into()
        .unwrap();
    let first = claim(&store, "r", 1).await;
    assert_eq!(
        (ids(&first), first.more),
        (vec![a1], true),
        "stopped at the batch size"
    );
    // a1 in flight: the next claim ends before a2 (same key), so it is
    // empty, and b1 behind a2 waits too (the log is read in order).
    let ahead = claim(&store, "r", 10).await;
    assert!(ahead.events.is_empty(), "{:?}", ids(&ahead));
    assert!(ahead.more, "ready once a1 is settled");
    deliver(&store, &first).await;
    let rest = claim(&store, "r", 10).await;
    assert_eq!(
        (ids(&rest), rest.more),
        (vec![a2, b1], false),
        "read to the end"
    );
    deliver(&store, &rest).await;
    let none = claim(&store, "r", 10).await;
    assert!(none.events.is_empty() && !none.more);
}

/// A batch the relay gave up (its settle kept failing until the lease ran
/// out, e.g. through a database outage) while the same relay kept the
/// cursor lease: once the lease it was claimed under is over, its events
/// are read again (from the stored position), the late settle of the
/// given-up batch is fenced, and later events of its keys are not held
/// back. Before, the batch held its keys for ever: every later claim
/// stopped at them and the relay delivered nothing more.
async fn a_given_up_batch_comes_back(db: &LogDb, store: &PgLogStore) {
    let lease = Duration::from_millis(400);
    let short = |n| ClaimRequest {
        lease,
        ..req("relay-a", n)
    };
    let first = db.enqueue(vec![ev("k", 1), ev("j", 1)]).await;
    let given_up = store.claim(&short(10)).await.unwrap();
    assert_eq!(ids(&given_up), first);
    let later = db.enqueue(vec![ev("k", 2), ev("j", 2)]).await;
    let held_back = store.claim(&short(10)).await.unwrap();
    assert!(held_back.events.is_empty(), "k-2/j-2 wait behind k-1/j-1");
    assert!(held_back.more, "events are ready behind the keys in flight");

    // Past the lease (plus the store's margin): everything, in order.
    let start = std::time::Instant::now();
    let again = loop {
        let c = store.claim(&short(10)).await.unwrap();
        if !c.events.is_empty() || start.elapsed() > Duration::from_secs(5) {
            break c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let want: Vec<EventId> = first.iter().chain(&later).copied().collect();
    assert_eq!(
        ids(&again),
        want,
        "the given-up batch, then what waited behind it"
    );
    assert!(
        again.events.iter().all(|e| e.attempts == 1),
        "no attempt counted"
    );

    let late = ids(&given_up)
        .into_iter()
        .fold(Settlement::new(), |s, id| s.with(id, Resolution::Delivered));
    let r = store.settle(given_up.token, &late).await.unwrap();
    assert_eq!(
        (r.applied, r.fenced.len()),
        (0, 2),
        "the late settle is fenced"
    );
    deliver(store, &again).await;
    assert!(store.claim(&short(10)).await.unwrap().events.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_up_batch_comes_back_to_a_static_cursor() {
    let db = LogDb::new().await;
    let store = db.store().await;
    a_given_up_batch_comes_back(&db, &store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_up_batch_comes_back_to_a_relay_group_member() {
    let db = LogDb::new().await;
    let store = db.store_with(db.options().with_dynamic_shards(true)).await;
    a_given_up_batch_comes_back(&db, &store).await;
}

/// The relay's pipeline at the store: the settlement of one batch and the
/// claim of the next started together (in either order), with deliveries,
/// retries and releases mixed. Every event is delivered exactly once and
/// each key in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_while_the_next_claim_runs_loses_nothing_and_keeps_key_order() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let (keys, per_key) = (40, 30);
    let mut events = Vec::new();
    for n in 0..per_key {
        for k in 0..keys {
            events.push(ev(&format!("k{k}"), n));
        }
    }
    let all: HashSet<EventId> = db.enqueue(events).await.into_iter().collect();

    let mut delivered: HashSet<EventId> = HashSet::new();
    let mut seqs: HashMap<String, Vec<usize>> = HashMap::new();
    let (mut retried, mut released) = (0, 0);
    let mut held = claim(&store, "relay", 64).await;
    for round in 0..5_000usize {
        if delivered.len() == all.len() {
            break;
        }
        if held.events.is_empty() {
            held = claim(&store, "relay", 64).await;
            continue;
        }
        let mut s = Settlement::new();
        // As the relay's per-key order layer does: once an event of a key
        // is not delivered, the batch's later events of that key are
        // given back unattempted.
        let mut stopped: HashSet<&str> = HashSet::new();
        for (i, e) in held.events.iter().enumerate() {
            let key = e.key.as_deref().unwrap();
            let fate = if stopped.contains(key) {
                1
            } else {
                (round * 31 + i * 7) % 10
            };
            if fate < 2 {
                stopped.insert(key);
            }
            let r = match fate {
                0 => {
                    retried += 1;
                    Resolution::Retry {
                        delay: Duration::ZERO,
                        error: temporary(),
                    }
                }
                1 => {
                    released += 1;
                    Resolution::Released
                }
                _ => {
                    assert!(delivered.insert(e.id), "{} delivered twice", e.id);
                    let text = String::from_utf8(e.payload.clone()).unwrap();
                    let (key, n) = text.rsplit_once('-').unwrap();
                    seqs.entry(key.to_owned())
                        .or_default()
                        .push(n.parse().unwrap());
                    Resolution::Delivered
                }
            };
            s = s.with(e.id, r);
        }
        let next = req("relay", 64);
        // Either one is polled first.
        let (report, next) = if round % 2 == 0 {
            tokio::join!(store.settle(held.token, &s), store.claim(&next))
        } else {
            let (next, report) = tokio::join!(store.claim(&next), store.settle(held.token, &s));
            (report, next)
        };
        let report = report.unwrap();
        assert!(report.all_applied(), "{report:?}");
        held = next.unwrap();
    }
    assert!(retried > 0 && released > 0, "both slower paths ran");
    assert_eq!(delivered, all, "every event delivered");
    for (key, got) in &seqs {
        let want: Vec<usize> = (0..per_key).collect();
        assert_eq!(got, &want, "key {key} out of order");
    }
    assert_counts(&store, (0, 0, 0)).await;
}

/// The store's own pool (`PgLogStore::connect`) runs prepared statements
/// with their generic plan (the claim is planned once per connection, not
/// at every claim), and its claims keep commit order and per-key order
/// under that plan. A pool handed to `from_pool` keeps its own setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stores_own_pool_claims_with_generic_plans() {
    let db = LogDb::new().await;
    let own = PgLogStore::connect(db.options()).await.unwrap();
    let show = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, String>("SHOW plan_cache_mode")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(show(own.pool().clone()).await, "force_generic_plan");
    assert_eq!(show(db.store().await.pool().clone()).await, "auto");

    let mut all = Vec::new();
    for n in 0..5 {
        all.extend(db.enqueue(vec![ev("a", n), ev("b", n), loose(n)]).await);
    }
    // Claims of two: more claims than the five custom plans PostgreSQL
    // makes before it weighs a generic one.
    let mut order = Vec::new();
    for _ in 0..50 {
        let c = claim(&own, "relay", 2).await;
        if c.events.is_empty() {
            break;
        }
        order.extend(ids(&c));
        deliver(&own, &c).await;
    }
    assert_eq!(order, all, "commit order");
    assert_counts(&own, (0, 0, 0)).await;
}
