//! Claim cost when many keys are blocked (issue 10): a 100k backlog over
//! 200 keys whose heads are all in retry backoff (or all leased), and due
//! events behind it. Prints the time of each claim, the settle that parked
//! the backlog, and the claim's `EXPLAIN (ANALYZE, BUFFERS)` plan.
//!
//! ```sh
//! cargo run --release -p outbox-postgres --example blocked_keys
//! ```
//! Uses `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`)
//! and a fresh schema `obench_blocked_<random>`, dropped at the end.
#![allow(clippy::print_stdout, clippy::expect_used, clippy::unwrap_used)]

use outbox_core::{
    ClaimRequest, ErrorCode, EventId, LastError, NewEvent, RelayId, Resolution, Settlement,
    ShardSpec, Store,
};
use outbox_postgres::{Ident, PgStore, PgStoreOptions};
use std::time::{Duration, Instant};

const BACKLOG: usize = 100_000;
const KEYS: usize = 200;
const DUE: usize = 2_000;

fn req(relay: &str, n: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new(relay),
        batch_size: n,
        lease: Duration::from_secs(600),
        shard: ShardSpec::ALL,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

async fn setup(url: &str) -> (PgStore, Ident) {
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let schema = Ident::new(format!("obench_blocked_{}", &suffix[..8])).unwrap();
    let store = PgStore::connect(
        PgStoreOptions::new(url)
            .with_schema(schema.clone())
            .with_listen(false)
            .with_auto_migrate(true),
    )
    .await
    .expect("connect");
    let started = Instant::now();
    for chunk in 0..BACKLOG / 5000 {
        let events = (0..5000).map(|i| {
            let n = chunk * 5000 + i;
            NewEvent::new("bench", "bench", vec![b'x'; 200]).with_key(format!("key-{}", n % KEYS))
        });
        let mut tx = store.pool().begin().await.unwrap();
        store.outbox().enqueue_batch(&mut tx, events).await.unwrap();
        tx.commit().await.unwrap();
    }
    println!(
        "loaded {BACKLOG} events over {KEYS} keys in {}",
        ms(started.elapsed())
    );
    (store, schema)
}

async fn enqueue_due(store: &PgStore) -> Vec<EventId> {
    let events = (0..DUE).map(|i| {
        let e = NewEvent::new("due", "bench", vec![b'y'; 200]);
        if i % 2 == 0 {
            e
        } else {
            e.with_key(format!("fresh-{i}"))
        }
    });
    let mut tx = store.pool().begin().await.unwrap();
    let ids = store.outbox().enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

async fn analyze(store: &PgStore, schema: &Ident) {
    sqlx::raw_sql(&format!("ANALYZE {}.\"events\"", schema.quoted()))
        .execute(store.pool())
        .await
        .unwrap();
}

async fn vacuum(store: &PgStore, schema: &Ident) {
    let started = Instant::now();
    sqlx::raw_sql(&format!("VACUUM {}.\"events\"", schema.quoted()))
        .execute(store.pool())
        .await
        .unwrap();
    println!("VACUUM of the events table: {}", ms(started.elapsed()));
}

/// The age in transactions of the oldest snapshot of another session in
/// this database: while one is old, dead index entries cannot be skipped
/// cheaply (nor vacuumed).
async fn horizon(store: &PgStore) -> String {
    let row: Option<(i64, String)> = sqlx::query_as(
        "SELECT age(backend_xmin)::bigint, coalesce(now() - xact_start, interval '0')::text \
         FROM pg_stat_activity \
         WHERE datname = current_database() AND backend_xmin IS NOT NULL \
           AND pid <> pg_backend_pid() \
         ORDER BY age(backend_xmin) DESC LIMIT 1",
    )
    .fetch_optional(store.pool())
    .await
    .unwrap();
    match row {
        Some((age, open)) => format!("oldest other snapshot: {age} transactions old, open {open}"),
        None => "no other snapshot open".to_owned(),
    }
}

async fn parked(store: &PgStore, schema: &Ident) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {}.\"events\" WHERE parked",
        schema.quoted()
    ))
    .fetch_one(store.pool())
    .await
    .unwrap()
}

/// Claims batches of `n` due events (delivering each) and prints each claim's time.
async fn claim_due(store: &PgStore, n: u32, rounds: usize) -> Vec<Duration> {
    let mut times = Vec::new();
    for _ in 0..rounds {
        let started = Instant::now();
        let c = store.claim(&req("relay-b", n)).await.unwrap();
        let took = started.elapsed();
        times.push(took);
        println!("  claim of {n}: {} events in {}", c.events.len(), ms(took));
        assert!(
            c.events.iter().all(|e| e.event_type == "due"),
            "a blocked event was claimed"
        );
        let s = c.events.iter().fold(Settlement::new(), |s, e| {
            s.with(e.id, Resolution::Delivered)
        });
        store.settle(c.token, &s).await.unwrap();
    }
    times
}

async fn drop_schema(store: &PgStore, schema: &Ident) {
    sqlx::raw_sql(&format!("DROP SCHEMA {} CASCADE", schema.quoted()))
        .execute(store.pool())
        .await
        .unwrap();
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let batch: u32 = std::env::var("BATCH")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(250);

    println!("## heads in retry backoff (batch {batch})");
    let (store, schema) = setup(&url).await;
    let heads = store.claim(&req("relay-a", KEYS as u32)).await.unwrap();
    assert_eq!(heads.events.len(), KEYS);
    let retry = heads.events.iter().fold(Settlement::new(), |s, e| {
        s.with(
            e.id,
            Resolution::Retry {
                delay: Duration::from_secs(3600),
                error: LastError {
                    code: ErrorCode::HANDLER_TEMPORARY_FAILURE,
                    message: "down".into(),
                },
            },
        )
    });
    let started = Instant::now();
    store.settle(heads.token, &retry).await.unwrap();
    println!(
        "settle of {KEYS} retries (parks their keys' {} later events): {}",
        parked(&store, &schema).await,
        ms(started.elapsed())
    );
    enqueue_due(&store).await;
    analyze(&store, &schema).await;
    println!("{}", horizon(&store).await);
    let times = claim_due(&store, batch, 3).await;
    println!(
        "max claim with due events (before VACUUM): {}",
        ms(times.iter().max().copied().unwrap_or_default())
    );
    // The parked rows left dead entries in the claim index (the old row
    // versions); a claim skips them, a VACUUM removes them.
    vacuum(&store, &schema).await;
    let plan = store.explain_claim(&req("relay-b", batch)).await.unwrap();
    let times = claim_due(&store, batch, 5).await;
    println!("EXPLAIN (ANALYZE, BUFFERS) of a claim of {batch}:\n{plan}");
    let empty_started = Instant::now();
    for _ in 0..2 {
        claim_due(&store, batch, 1).await;
    }
    println!(
        "max claim with due events: {}; two claims after the due events ran out: {}",
        ms(times.iter().max().copied().unwrap_or_default()),
        ms(empty_started.elapsed())
    );
    drop_schema(&store, &schema).await;

    println!("\n## heads leased by another relay (batch {batch})");
    let (store, schema) = setup(&url).await;
    let heads = store.claim(&req("relay-a", KEYS as u32)).await.unwrap();
    assert_eq!(heads.events.len(), KEYS);
    enqueue_due(&store).await;
    analyze(&store, &schema).await;
    println!("{}", horizon(&store).await);
    let mut claims = 0;
    let mut parking_times = Vec::new();
    let started = Instant::now();
    loop {
        let t = Instant::now();
        let c = store.claim(&req("relay-b", batch)).await.unwrap();
        parking_times.push(t.elapsed());
        claims += 1;
        if claims <= 2 || c.events.len() == batch as usize {
            println!(
                "  claim {claims}: {} events in {} ({} parked so far)",
                c.events.len(),
                ms(t.elapsed()),
                parked(&store, &schema).await
            );
        }
        let s = c.events.iter().fold(Settlement::new(), |s, e| {
            s.with(e.id, Resolution::Delivered)
        });
        let got = c.events.len();
        store.settle(c.token, &s).await.unwrap();
        if got == batch as usize || claims >= 400 {
            break;
        }
    }
    parking_times.sort();
    println!(
        "{claims} claims ({} in all; per claim median {}, max {}) until a full batch of due \
         events came back",
        ms(started.elapsed()),
        ms(parking_times[parking_times.len() / 2]),
        ms(parking_times[parking_times.len() - 1]),
    );
    let times = claim_due(&store, batch, 3).await;
    println!(
        "max claim with due events once parked (before VACUUM): {}",
        ms(times.iter().max().copied().unwrap_or_default())
    );
    vacuum(&store, &schema).await;
    let plan = store.explain_claim(&req("relay-b", batch)).await.unwrap();
    let times = claim_due(&store, batch, 3).await;
    println!("EXPLAIN (ANALYZE, BUFFERS) of a claim of {batch} once parked:\n{plan}");
    println!(
        "max claim with due events once parked: {}",
        ms(times.iter().max().copied().unwrap_or_default())
    );
    drop_schema(&store, &schema).await;
}
