use outbox_worker::core::NewEvent;
use outbox_worker::postgres::{Ident, PgLogOptions, PgLogStore, PgOutbox};
use outbox_worker::{HandlerRegistry, Relay, RelayOptions};
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let (schema, table) = (Ident::new("quickstart")?, Ident::new("events")?);
    // The store (the event log, the default mode) creates its tables on connect;
    // the enqueue handle is what producers need, it holds no connection.
    let options = PgLogOptions::new(url)
        .with_schema(schema.clone())
        .with_table(table.clone());
    let store = PgLogStore::connect(options.with_auto_migrate(true)).await?;
    let outbox = PgOutbox::new(schema, table)?;

    // The business row and its event commit (or roll back) together.
    let mut tx = store.pool().begin().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS quickstart.orders (id bigserial PRIMARY KEY, total bigint)",
    )
    .execute(&mut *tx)
    .await?;
    let order: i64 =
        sqlx::query_scalar("INSERT INTO quickstart.orders (total) VALUES (1999) RETURNING id")
            .fetch_one(&mut *tx)
            .await?;
    let event = NewEvent::new("order.created", "orders", format!(r#"{{"order":{order}}}"#))
        .with_key(format!("order-{order}"));
    let id = outbox.enqueue(&mut tx, event).await?;
    tx.commit().await?;

    // The relay delivers every committed event to a handler (or a broker's sink).
    let (seen, delivered) = std::sync::mpsc::channel();
    let handlers = HandlerRegistry::new().with_handler("order.created", move |event| {
        let seen = seen.clone();
        async move {
            seen.send(event.id).ok();
            Ok(())
        }
    });
    let relay = Relay::new(store, handlers, RelayOptions::default())?;
    tokio::time::timeout(Duration::from_secs(60), relay.run_until_idle()).await?;
    assert!(
        delivered.try_iter().any(|seen| seen == id),
        "event {id} not delivered"
    );
    println!("order {order}: event {id} delivered");
    Ok(())
}
