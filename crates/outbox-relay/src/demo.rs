//! `outbox-relay demo`: the embedded default end to end, no services needed.

use anyhow::{bail, Context as _};
use clap::Args;
use outbox_core::{
    DeadLetterQuery, DeadLetterStore, EventId, HandlerError, Jitter, NewEvent, RetryPolicy, Store,
};
use outbox_sqlite::sqlx::{self, Sqlite, Transaction};
use outbox_sqlite::{enqueue, SqliteStore};
use outbox_worker::{HandlerRegistry, Progress, Relay, RelayOptions};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Arguments of `demo`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// SQLite file to create (deleted first if it exists).
    #[arg(long, default_value = "outbox-demo.db")]
    db: PathBuf,
    /// Orders to place; each writes `order.created`, every second one also `order.paid`.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(2..=10_000))]
    events: u32,
}

fn remove_db(path: &Path) -> anyhow::Result<()> {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("cannot remove {}", Path::new(&p).display()))
            }
        }
    }
    Ok(())
}

async fn add_event(tx: &mut Transaction<'_, Sqlite>, event: NewEvent) -> anyhow::Result<EventId> {
    Ok(enqueue(tx, event).await?)
}

fn order_event(event_type: &str, order: u32, body: serde_json::Value) -> NewEvent {
    NewEvent::new(event_type, "orders", body.to_string().into_bytes())
        .with_key(format!("order-{order}"))
}

pub(crate) async fn run(args: DemoArgs) -> anyhow::Result<()> {
    remove_db(&args.db)?;
    let url = format!("sqlite://{}", args.db.display());
    let store = SqliteStore::connect(&url)
        .await
        .with_context(|| format!("cannot create {}", args.db.display()))?;
    store.migrate().await.context("migration failed")?;
    sqlx::query(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, \
         total_cents INTEGER NOT NULL, status TEXT NOT NULL)",
    )
    .execute(store.pool())
    .await
    .context("cannot create the orders table")?;
    println!("outbox demo: SQLite file {}", args.db.display());
    println!();

    // Each business change and its events commit in ONE transaction.
    let customers = ["ada", "grace", "linus", "barbara", "ken"];
    for order in 1..=args.events {
        let customer = customers[(order as usize - 1) % customers.len()];
        let total = 1000 + order * 250;
        let mut tx = store.pool().begin().await?;
        sqlx::query(
            "INSERT INTO orders (id, customer, total_cents, status) VALUES (?, ?, ?, 'placed')",
        )
        .bind(i64::from(order))
        .bind(customer)
        .bind(i64::from(total))
        .execute(&mut *tx)
        .await?;
        let id = add_event(
            &mut tx,
            order_event(
                "order.created",
                order,
                serde_json::json!({"order_id": order, "customer": customer, "total_cents": total}),
            ),
        )
        .await?;
        tx.commit().await?;
        println!("order {order} placed by {customer}: enqueued order.created {id}");

        if order % 2 == 0 {
            let mut tx = store.pool().begin().await?;
            sqlx::query("UPDATE orders SET status = 'paid' WHERE id = ?")
                .bind(i64::from(order))
                .execute(&mut *tx)
                .await?;
            let id = add_event(
                &mut tx,
                order_event("order.paid", order, serde_json::json!({"order_id": order})),
            )
            .await?;
            tx.commit().await?;
            println!("order {order} paid: enqueued order.paid {id}");
        }
    }

    // Shipping fails transiently once (its handler is flaky); refunds have no handler.
    let mut tx = store.pool().begin().await?;
    sqlx::query("UPDATE orders SET status = 'shipped' WHERE id = 1")
        .execute(&mut *tx)
        .await?;
    let shipped = add_event(
        &mut tx,
        order_event(
            "order.shipped",
            1,
            serde_json::json!({"order_id": 1, "carrier": "dhl"}),
        ),
    )
    .await?;
    tx.commit().await?;
    println!("order 1 shipped: enqueued order.shipped {shipped} (its handler fails once)");

    let mut tx = store.pool().begin().await?;
    sqlx::query("UPDATE orders SET status = 'refunded' WHERE id = 2")
        .execute(&mut *tx)
        .await?;
    let refunded = add_event(
        &mut tx,
        order_event("order.refunded", 2, serde_json::json!({"order_id": 2})),
    )
    .await?;
    tx.commit().await?;
    println!("order 2 refunded: enqueued order.refunded {refunded} (no handler registered)");

    // A transaction that rolls back: neither the order nor its event exist.
    let phantom_order = args.events + 1000;
    let mut tx = store.pool().begin().await?;
    sqlx::query(
        "INSERT INTO orders (id, customer, total_cents, status) VALUES (?, 'mallory', 1, 'placed')",
    )
    .bind(i64::from(phantom_order))
    .execute(&mut *tx)
    .await?;
    let phantom = add_event(
        &mut tx,
        order_event(
            "order.created",
            phantom_order,
            serde_json::json!({"order_id": phantom_order}),
        ),
    )
    .await?;
    tx.rollback().await?;
    println!("order {phantom_order} rolled back: its event {phantom} must never be delivered");

    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(store.pool())
        .await?;
    let stats = store.stats().await?;
    println!();
    println!(
        "{orders} orders committed, {} events pending; starting the relay",
        stats.pending
    );
    println!();

    let shipping_failed_once = Arc::new(AtomicBool::new(false));
    let handlers = HandlerRegistry::new()
        .with_handler("order.created", |_event| async { Ok(()) })
        .with_handler("order.paid", |_event| async { Ok(()) })
        .with_handler("order.shipped", move |_event| {
            let first = !shipping_failed_once.swap(true, Ordering::SeqCst);
            async move {
                if first {
                    Err(HandlerError::retryable("shipping service unavailable"))
                } else {
                    Ok(())
                }
            }
        });

    let options = RelayOptions::default()
        .with_poll_interval(Duration::from_millis(100))
        .with_lock_timeout(Duration::from_secs(10))
        .with_retry(RetryPolicy::new(
            Duration::from_millis(200),
            Duration::from_secs(1),
            5,
            Jitter::Equal,
        )?)
        .with_batch_size(20);

    let delivered: Arc<Mutex<HashSet<EventId>>> = Arc::default();
    let seen = Arc::clone(&delivered);
    let relay = Relay::new(store.clone(), handlers, options)?.with_listener(move |p| {
        progress_line(p, &seen);
    });
    let summary = tokio::time::timeout(Duration::from_secs(60), relay.run_until_idle())
        .await
        .context("the relay did not finish within 60s")?;

    println!();
    println!(
        "delivered: {}, retried: {}, dead: {}",
        summary.delivered, summary.retried, summary.dead
    );
    let delivered = delivered
        .lock()
        .map_err(|_| anyhow::anyhow!("progress lock poisoned"))?
        .clone();
    if delivered.contains(&phantom) {
        bail!("the rolled-back event {phantom} was delivered");
    }
    println!("rolled-back event {phantom}: never delivered");
    if !delivered.contains(&shipped) {
        bail!("order.shipped {shipped} was not delivered after its retry");
    }

    let dead = store.list_dead(&DeadLetterQuery::default()).await?;
    println!();
    println!("dead letters ({}):", dead.len());
    crate::dead::print_dead_letters(&dead);
    println!();
    println!(
        "inspect: outbox-relay status --store {url}   replay: outbox-relay dead retry --store {url} --all"
    );
    // Closing the pool checkpoints the WAL: only the .db file is left behind.
    store.pool().close().await;
    Ok(())
}

#[allow(clippy::print_stdout)]
fn progress_line(p: &Progress, delivered: &Mutex<HashSet<EventId>>) {
    match p {
        Progress::Delivered {
            id,
            event_type,
            attempts,
        } => {
            if let Ok(mut set) = delivered.lock() {
                set.insert(*id);
            }
            println!("  delivered  {event_type:<15} {id}  (attempt {attempts})");
        }
        Progress::Retried {
            id,
            event_type,
            attempts,
            error,
            delay,
        } => println!(
            "  retried    {event_type:<15} {id}  {}: {} (attempt {attempts}, next try in {}ms)",
            error.code(),
            error.message(),
            delay.as_millis()
        ),
        Progress::Dead {
            id,
            event_type,
            attempts,
            error,
        } => println!(
            "  dead       {event_type:<15} {id}  {}: {} (attempt {attempts})",
            error.code(),
            error.message()
        ),
        Progress::LeaseLost { ids } => println!("  lease lost on {} event(s)", ids.len()),
        Progress::Released { ids } => println!("  released   {} event(s)", ids.len()),
        _ => {}
    }
}
