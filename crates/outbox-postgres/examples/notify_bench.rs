//! Producer throughput with and without `pg_notify` at enqueue.
//!
//! 8 tasks each run single-event transactions (BEGIN; INSERT; COMMIT) in a
//! loop for a few seconds, against a fresh schema, with a listening store
//! attached (as a running relay would be). Rounds alternate off/on so drift
//! on the machine affects both. Run with:
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!   cargo run -p outbox-postgres --example notify_bench [-- SECONDS_PER_ROUND]
//! ```
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use outbox_core::NewEvent;
use outbox_postgres::{Ident, PgOutbox, PgStore, PgStoreOptions};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PRODUCERS: usize = 8;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let secs: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let schema = Ident::new(format!(
        "outbox_bench_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ))?;
    let options = PgStoreOptions::new(url)
        .with_schema(schema.clone())
        .with_max_connections(PRODUCERS as u32 + 2)
        .with_auto_migrate(true);
    let store = PgStore::connect(options).await?;

    let mut results = Vec::new();
    for round in 0..4 {
        let notify = round % 2 == 1;
        let outbox = store.outbox().clone().with_notify(notify);
        let rate = run(&store, &outbox, Duration::from_secs(secs)).await?;
        println!("round {round}: notify={notify:<5} {rate:>8.0} events/s");
        results.push((notify, rate));
    }
    let mean = |on: bool| {
        let r: Vec<f64> = results.iter().filter(|r| r.0 == on).map(|r| r.1).collect();
        r.iter().sum::<f64>() / r.len() as f64
    };
    let (off, on) = (mean(false), mean(true));
    println!("| notify | events/s (mean of 2 x {secs} s, {PRODUCERS} producers) |");
    println!("|---|---|");
    println!("| off | {off:.0} |");
    println!("| on  | {on:.0} |");
    println!(
        "notify costs {:.1}% of producer throughput",
        (1.0 - on / off) * 100.0
    );

    sqlx::query(&format!("DROP SCHEMA {} CASCADE", schema.quoted()))
        .execute(store.pool())
        .await?;
    Ok(())
}

async fn run(
    store: &PgStore,
    outbox: &PgOutbox,
    duration: Duration,
) -> Result<f64, Box<dyn std::error::Error>> {
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for p in 0..PRODUCERS {
        let (pool, outbox) = (store.pool().clone(), outbox.clone());
        let (stop, count) = (Arc::clone(&stop), Arc::clone(&count));
        tasks.push(tokio::spawn(async move {
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let mut tx = pool.begin().await.expect("begin");
                let e = NewEvent::new("bench.event", "bench", vec![0u8; 256])
                    .with_key(format!("key-{p}-{}", n % 100));
                outbox.enqueue(&mut tx, e).await.expect("enqueue");
                tx.commit().await.expect("commit");
                count.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    // Empty the table between rounds so both modes insert into the same size.
    sqlx::query(&format!(
        "TRUNCATE {}.{}",
        outbox.schema().quoted(),
        outbox.table().quoted()
    ))
    .execute(store.pool())
    .await?;
    Ok(count.load(Ordering::Relaxed) as f64 / elapsed)
}
