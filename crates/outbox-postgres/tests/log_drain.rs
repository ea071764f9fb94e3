//! A drain measurement of the event-log store (not a pass/fail timing
//! test): enqueue a backlog, drain it with a claim -> settle(all delivered)
//! loop, print the rates; then the same with a REPEATABLE READ snapshot
//! held by another connection through the drain.
//!
//! `cargo test -p outbox-postgres --test log_drain -- --ignored --nocapture`
//! (`OUTBOX_DRAIN_EVENTS`, default 100000; `OUTBOX_DRAIN_BATCH`, default 1000).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod log_support;

use log_support::LogDb;
use outbox_core::{ClaimRequest, NewEvent, RelayId, Resolution, Settlement, ShardSpec, Store};
use outbox_postgres::PgLogStore;
use sqlx::Row;
use std::time::{Duration, Instant};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn fill(db: &LogDb, n: usize) -> Duration {
    let started = Instant::now();
    let mut i = 0;
    while i < n {
        let events: Vec<NewEvent> = (i..(i + 1000).min(n))
            .map(|j| {
                NewEvent::new("bench.event", "bench", vec![b'x'; 200])
                    .with_key(format!("key-{}", j % 1000))
            })
            .collect();
        i += events.len();
        db.enqueue(events).await;
    }
    started.elapsed()
}

async fn drain(store: &PgLogStore, batch: u32) -> (usize, Duration) {
    let req = ClaimRequest {
        relay_id: RelayId::new("bench"),
        batch_size: batch,
        lease: Duration::from_secs(60),
        shard: ShardSpec::ALL,
    };
    let started = Instant::now();
    let mut n = 0;
    loop {
        let c = store.claim(&req).await.unwrap();
        if c.events.is_empty() {
            return (n, started.elapsed());
        }
        n += c.events.len();
        let s = c.events.iter().fold(Settlement::new(), |s, e| {
            s.with(e.id, Resolution::Delivered)
        });
        store.settle(c.token, &s).await.unwrap();
    }
}

/// The ceiling of this design: read the same rows in keyset batches of
/// `batch`, decoding the same columns, nothing else.
async fn max_txid(db: &LogDb) -> String {
    sqlx::query_scalar(&format!("SELECT max(txid)::text FROM {}", db.table("")))
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn ceiling(db: &LogDb, batch: i64, from_txid: &str) -> (usize, Duration) {
    let sql = format!(
        "SELECT e.txid::text, e.seq, e.id, e.key, e.event_type, e.topic, e.payload, \
                e.headers::text, e.created_at \
         FROM {} e WHERE (e.txid, e.seq) > ($1::xid8, $2) ORDER BY e.txid, e.seq LIMIT $3",
        db.table("")
    );
    let started = Instant::now();
    let (mut txid, mut seq, mut n) = (from_txid.to_owned(), i64::MAX, 0usize);
    loop {
        let rows = sqlx::query(&sql)
            .bind(&txid)
            .bind(seq)
            .bind(batch)
            .fetch_all(&db.pool)
            .await
            .unwrap();
        let Some(last) = rows.last() else {
            return (n, started.elapsed());
        };
        for r in &rows {
            let _: (uuid::Uuid, Option<String>, String, String, Vec<u8>, String) =
                (r.get(2), r.get(3), r.get(4), r.get(5), r.get(6), r.get(7));
        }
        n += rows.len();
        txid = last.get(0);
        seq = last.get(1);
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run with --ignored --nocapture"]
async fn drain_a_backlog() {
    let n = env("OUTBOX_DRAIN_EVENTS", 100_000);
    let batch = u32::try_from(env("OUTBOX_DRAIN_BATCH", 1000)).unwrap();
    let db = LogDb::with_pool_size(4).await;
    let store = db.store().await;
    // The cursor exists before the backlog (as with a running relay).
    assert!(store
        .claim(&ClaimRequest {
            relay_id: RelayId::new("bench"),
            batch_size: 1,
            lease: Duration::from_secs(60),
            shard: ShardSpec::ALL,
        })
        .await
        .unwrap()
        .events
        .is_empty());

    let filled = fill(&db, n).await;
    println!(
        "enqueue: {n} events in transactions of 1000 in {filled:.2?} ({:.0}/s)",
        rate(n, filled)
    );
    // Fresh rows cost their first reader the hint bits: measure the ceiling
    // on fresh rows first, then the drain; and the other way round.
    let (read, read_took) = ceiling(&db, i64::from(batch), "0").await;
    assert_eq!(read, n);
    let (got, took) = drain(&store, batch).await;
    assert_eq!(got, n);
    println!(
        "ceiling first (fresh rows): {read_took:.2?} ({:.0} rows/s); then drain: {took:.2?} ({:.0} events/s); drain/ceiling = {:.2}",
        rate(read, read_took),
        rate(got, took),
        rate(got, took) / rate(read, read_took)
    );
    let from = max_txid(&db).await;
    fill(&db, n).await;
    let (got, took) = drain(&store, batch).await;
    assert_eq!(got, n);
    let (read, read_took) = ceiling(&db, i64::from(batch), &from).await;
    assert_eq!(read, n);
    println!(
        "drain first (fresh rows): {took:.2?} ({:.0} events/s); then ceiling: {read_took:.2?} ({:.0} rows/s); drain/ceiling = {:.2}",
        rate(got, took),
        rate(read, read_took),
        rate(got, took) / rate(read, read_took)
    );

    // The same with a snapshot held by another connection through the drain.
    let filled = fill(&db, n).await;
    let mut holder = db.pool.acquire().await.unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM pg_class")
        .execute(&mut *holder)
        .await
        .unwrap();
    let (got, took) = drain(&store, batch).await;
    assert_eq!(got, n);
    println!(
        "drain (REPEATABLE READ snapshot held): {got} events, {took:.2?} ({:.0} events/s); enqueue took {filled:.2?}",
        rate(got, took)
    );
    let info = store.log_info().await.unwrap();
    for p in &info.partitions {
        println!(
            "  before rotation: partition {} current={} live~{} dead={} size={} kB",
            p.slot,
            p.current,
            p.live_tuples,
            p.dead_tuples,
            p.bytes / 1024
        );
    }
    sqlx::query("COMMIT").execute(&mut *holder).await.unwrap();
    drop(holder);

    for _ in 0..3 {
        let r = store.rotate_now().await.unwrap();
        println!("  rotate: {r:?}");
    }
    let info = store.log_info().await.unwrap();
    for p in &info.partitions {
        println!(
            "  after rotation: partition {} current={} live~{} dead={} size={} kB",
            p.slot,
            p.current,
            p.live_tuples,
            p.dead_tuples,
            p.bytes / 1024
        );
    }
}
