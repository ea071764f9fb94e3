//! The event log's safety promises against a real PostgreSQL, each test in
//! its own schema: per-key order by the moment of each INSERT (not by
//! transaction id), positions dropped when the database is a new
//! incarnation (crash recovery or failover, simulated by emptying the
//! unlogged incarnation table as crash recovery does), a clean stop that
//! gives static shards back at once, the `block` dead-head policy inside
//! one claim, a fenced group drop, and a rotation that waits for claims
//! instead of giving up.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod log_support;

use log_support::{claim, deliver, ids, LogDb, LEASE};
use outbox_core::{
    DeadHeadPolicy, DeadLetterFilter, DeadLetterStore, ErrorCode, EventId, NewEvent, RelayId,
    Resolution, Settlement, Store,
};
use outbox_postgres::PgLogStore;
use outbox_postgres::{GroupDrop, Rotation};
use sqlx::Row;
use std::collections::HashMap;

fn ev(key: &str, n: usize) -> NewEvent {
    NewEvent::new("test.event", "log", format!("{key}-{n}").into_bytes()).with_key(key)
}

/// Claims `n` at a time and delivers until a claim comes back empty.
async fn drain(store: &PgLogStore, relay: &str, n: u32) -> Vec<EventId> {
    let mut order = Vec::new();
    for _ in 0..1_000 {
        let c = claim(store, relay, n).await;
        if c.events.is_empty() {
            break;
        }
        order.extend(ids(&c));
        deliver(store, &c).await;
    }
    order
}

/// A transaction that takes its id by a first write (the business row),
/// as a service does before it locks its aggregate.
async fn begin_with_xid(db: &LogDb) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// The reproduction: transaction A writes first (takes the older
/// id), then waits for the key's aggregate; B enqueues K#1 and commits; A
/// then enqueues K#2 and commits. Both land in one window. K#2's INSERT
/// came after K#1's commit, so K#1 goes first; ordering by transaction id
/// put K#2 first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_is_read_in_insertion_order_not_transaction_id_order() {
    let db = LogDb::new().await;
    let store = db.store().await;
    // The cursor exists and its window starts before both transactions.
    assert!(claim(&store, "relay", 10).await.events.is_empty());

    let mut a = begin_with_xid(&db).await;
    let mut b = begin_with_xid(&db).await;
    let k1 = db.log.enqueue(&mut b, ev("k", 1)).await.unwrap();
    b.commit().await.unwrap();
    let k2 = db.log.enqueue(&mut a, ev("k", 2)).await.unwrap();
    a.commit().await.unwrap();

    assert_eq!(drain(&store, "relay", 10).await, vec![k1, k2]);
}

/// Many such inversions in one large window (a relay that was away), read
/// in small slices: every key's events come in the order of their INSERTs,
/// and each exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_window_read_in_slices_keeps_every_keys_insertion_order() {
    let db = LogDb::new().await;
    let store = db.store().await;
    assert!(claim(&store, "relay", 10).await.events.is_empty());

    let mut want: HashMap<String, Vec<EventId>> = HashMap::new();
    for round in 0..10 {
        // Waiting transactions take their ids first, in key order...
        let mut waiting = Vec::new();
        for k in 0..6 {
            waiting.push((format!("k{k}"), begin_with_xid(&db).await));
        }
        // ...later ones enqueue and commit first...
        for k in 0..6 {
            let key = format!("k{k}");
            let id = db.enqueue(vec![ev(&key, round * 2)]).await[0];
            want.entry(key).or_default().push(id);
        }
        // ...then the waiting ones enqueue and commit, last taken first.
        while let Some((key, mut tx)) = waiting.pop() {
            let id = db
                .log
                .enqueue(&mut tx, ev(&key, round * 2 + 1))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            want.entry(key).or_default().push(id);
        }
    }

    let order = drain(&store, "relay", 7).await;
    assert_eq!(order.len(), 120, "each event once");
    let events: HashMap<EventId, String> = want
        .iter()
        .flat_map(|(k, v)| v.iter().map(move |id| (*id, k.clone())))
        .collect();
    let mut got: HashMap<String, Vec<EventId>> = HashMap::new();
    for id in order {
        got.entry(events[&id].clone()).or_default().push(id);
    }
    assert_eq!(got, want);
}

/// A transaction that enqueues, stays open across many windows (other
/// events flow and are settled meanwhile), enqueues again and commits:
/// both of its events are delivered, in order, nothing else twice. Its
/// first event lies far below the seq floor of the window it commits in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_transactions_early_events_are_not_skipped() {
    let db = LogDb::new().await;
    let store = db.store().await;
    assert!(claim(&store, "relay", 10).await.events.is_empty());

    let mut long = begin_with_xid(&db).await;
    let early = db.log.enqueue(&mut long, ev("long", 1)).await.unwrap();
    let mut others = Vec::new();
    for n in 0..20 {
        others.extend(db.enqueue(vec![ev("other", n)]).await);
        assert_eq!(drain(&store, "relay", 10).await, others[n..].to_vec());
    }
    let late = db.log.enqueue(&mut long, ev("long", 2)).await.unwrap();
    long.commit().await.unwrap();
    assert_eq!(drain(&store, "relay", 10).await, vec![early, late]);
    assert_eq!(store.stats().await.unwrap().pending, 0);
}

/// The stored cursor row, for a simulated lost write.
async fn cursor_row(db: &LogDb) -> (String, String, Option<String>, Option<i64>) {
    let row = sqlx::query(&format!(
        "SELECT lo::text, hi::text, pos_txid::text, pos_seq FROM {}",
        db.table("_cursors")
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

/// What a crash restart does to what the store relies on: settles that
/// committed asynchronously are forgotten (the cursor row goes back), and
/// crash recovery empties unlogged tables (the incarnation token).
async fn simulate_crash(db: &LogDb, cursor: &(String, String, Option<String>, Option<i64>)) {
    sqlx::query(&format!(
        "UPDATE {} SET lo = $1::pg_snapshot, hi = $2::pg_snapshot, \
         pos_txid = $3::xid8, pos_seq = $4",
        db.table("_cursors")
    ))
    .bind(&cursor.0)
    .bind(&cursor.1)
    .bind(&cursor.2)
    .bind(cursor.3)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(&format!("TRUNCATE {}", db.table("_boot")))
        .execute(&db.pool)
        .await
        .unwrap();
}

/// A settle that the crash forgot: the store held its position in memory
/// only. After the database's incarnation changed the store drops it and
/// resumes from the stored position: the events are delivered again
/// (at-least-once), never skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_incarnation_resumes_from_the_stored_position() {
    let db = LogDb::new().await;
    let store = db.store().await;
    assert!(claim(&store, "relay", 10).await.events.is_empty());
    let before = cursor_row(&db).await;

    let first = db.enqueue(vec![ev("k", 1), ev("k", 2)]).await;
    assert_eq!(drain(&store, "relay", 10).await, first);
    simulate_crash(&db, &before).await;

    let second = db.enqueue(vec![ev("k", 3)]).await;
    let again = drain(&store, "relay", 10).await;
    assert_eq!(
        again,
        [first, second].concat(),
        "redelivered from the stored position"
    );
    let boot: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", db.table("_boot")))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(boot, 1, "a new incarnation token was written");
}

/// A batch claimed before the crash: its settle and its renewals are
/// fenced afterwards (they could move the position with windows read in
/// the old incarnation), and its events come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_claimed_before_a_new_incarnation_is_fenced() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let events = db.enqueue(vec![ev("k", 1), ev("j", 1)]).await;
    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), events);
    let now = cursor_row(&db).await;
    simulate_crash(&db, &now).await;

    assert_eq!(
        store.renew(c.token, LEASE).await.unwrap(),
        0,
        "renewal fenced"
    );
    let s = ids(&c)
        .into_iter()
        .fold(Settlement::new(), |s, id| s.with(id, Resolution::Delivered));
    let r = store.settle(c.token, &s).await.unwrap();
    assert_eq!(r.applied, 0, "{r:?}");
    assert_eq!(r.fenced.len(), 2, "{r:?}");
    assert_eq!(drain(&store, "relay", 10).await, events);
}

/// A clean stop (`leave`) gives a static shard back: another relay takes
/// it at once, not after the lease runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_releases_static_shards_at_once() {
    let db = LogDb::new().await;
    let a = db.store().await;
    let b = db.store().await;
    let first = db.enqueue(vec![ev("k", 1)]).await;
    assert_eq!(drain(&a, "relay-a", 10).await, first);
    let second = db.enqueue(vec![ev("k", 2)]).await;
    assert!(
        claim(&b, "relay-b", 10).await.events.is_empty(),
        "relay-a's lease still holds the shard"
    );
    a.leave(&RelayId::new("relay-a")).await.unwrap();
    assert_eq!(drain(&b, "relay-b", 10).await, second);
}

/// A row whose headers cannot be decoded, of the undecodable kind the claim
/// dead-letters itself.
async fn insert_undecodable(db: &LogDb, key: &str) -> EventId {
    let bad = NewEvent::new("bad", "log", b"x".to_vec()).with_key(key);
    sqlx::query(&format!(
        "INSERT INTO {} (id, key, key_hash, event_type, topic, payload, headers) \
         VALUES ($1, $2, $3, 'bad', 'log', '\\x78', '{{\"n\": 1}}'::jsonb)",
        db.table("")
    ))
    .bind(bad.id().as_uuid())
    .bind(key)
    .bind(i64::from(bad.key_hash()))
    .execute(&db.pool)
    .await
    .unwrap();
    bad.id()
}

/// Policy `block`: a key whose head is dead-lettered by the claim itself
/// (undecodable) does not go on inside that same claim; its later event
/// waits until the dead letter is purged. Other keys flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_applies_inside_the_claim_that_dead_letters_the_head() {
    let db = LogDb::new().await;
    let store = db
        .store_with(db.options().with_dead_head_policy(DeadHeadPolicy::Block))
        .await;
    let bad = insert_undecodable(&db, "k").await;
    let later = db.enqueue(vec![ev("k", 2), ev("other", 1)]).await;

    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), vec![later[1]], "k's later event waits");
    deliver(&store, &c).await;
    assert!(drain(&store, "relay", 10).await.is_empty());
    let dead = store
        .count_dead(&DeadLetterFilter::default())
        .await
        .unwrap();
    assert_eq!(dead, 1);
    let listed = store
        .list_dead(&outbox_core::DeadLetterQuery::default())
        .await
        .unwrap();
    assert_eq!(listed[0].event.id, bad);
    assert_eq!(listed[0].error.code, ErrorCode::UNDECODABLE);

    assert_eq!(
        store
            .purge_dead(&DeadLetterFilter::default())
            .await
            .unwrap(),
        1
    );
    assert_eq!(drain(&store, "relay", 10).await, vec![later[0]]);
}

/// Dropping a group checks its leases and deletes in one transaction: a
/// relay holding a lease keeps its group unless the drop is forced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_drop_is_refused_while_a_relay_holds_a_lease() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let events = db.enqueue(vec![ev("k", 1)]).await;
    assert_eq!(drain(&store, "relay", 10).await, events);
    let group = store.group().to_owned();

    match store.drop_group(&group, false).await.unwrap() {
        GroupDrop::Leased { by } => assert_eq!(by, vec!["relay".to_owned()]),
        other => panic!("dropped a leased group: {other:?}"),
    }
    assert_eq!(store.group_contents(&group).await.unwrap().cursors, 1);

    match store.drop_group(&group, true).await.unwrap() {
        GroupDrop::Dropped(what) => {
            assert_eq!(what.cursors, 1);
            assert_eq!(what.leased_by, vec!["relay".to_owned()]);
        }
        other => panic!("{other:?}"),
    }
    assert!(store.group_contents(&group).await.unwrap().is_empty());
}

/// A reader holding the partition (a session idle in its transaction after
/// reading the log) is never waited for: the rotation says it is blocked
/// (it would otherwise queue its ACCESS EXCLUSIVE request, and every claim
/// behind it), and rotates once the reader has gone. Claims, which hold the
/// partition for milliseconds, are what the rotation's short lock tries
/// find gaps between (`tests/rotation_holder.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_does_not_wait_for_a_reader_and_rotates_once_it_left() {
    let db = LogDb::new().await;
    let store = db.store().await;
    assert!(claim(&store, "relay", 10).await.events.is_empty());
    // Make sure rotation is otherwise possible.
    assert!(matches!(
        store.rotate_now().await.unwrap(),
        Rotation::Rotated { .. }
    ));

    let mut reader = db.pool.begin().await.unwrap();
    sqlx::query(&format!("SELECT count(*) FROM {}", db.table("")))
        .execute(&mut *reader)
        .await
        .unwrap();
    let r = store.rotate_now().await.unwrap();
    assert!(matches!(r, Rotation::Blocked(_)), "{r:?}");
    reader.commit().await.unwrap();
    let r = store.rotate_now().await.unwrap();
    assert!(matches!(r, Rotation::Rotated { .. }), "{r:?}");
}

/// A rotator that committed but died before it moved the generation
/// sequence (the producers' routing): the next rotation continues from the
/// committed generation instead of truncating the same partition again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotation_continues_from_the_committed_generation() {
    let db = LogDb::new().await;
    let store = db.store().await;
    assert!(claim(&store, "relay", 10).await.events.is_empty());
    match store.rotate_now().await.unwrap() {
        Rotation::Rotated { generation, .. } => assert_eq!(generation, 1),
        other => panic!("{other:?}"),
    }
    // Undo the bump, as a rotator killed between its commit and the bump.
    sqlx::query(&format!("SELECT setval('{}', 0)", db.table("_gen")))
        .execute(&db.pool)
        .await
        .unwrap();
    match store.rotate_now().await.unwrap() {
        Rotation::Rotated { generation, .. } => assert_eq!(generation, 2),
        other => panic!("{other:?}"),
    }
    let info = store.log_info().await.unwrap();
    assert_eq!(info.generation, 2);
    assert!(info.partitions[2].current);
}
