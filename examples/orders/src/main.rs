//! `orders`: a small service on the transactional outbox.
//!
//! - `orders place CUSTOMER TOTAL_CENTS`: one transaction writes the order row
//!   and its `order.placed` event (key `customer-<CUSTOMER>`, so one
//!   customer's orders arrive in the order they were placed), then commits.
//!   Prints the order id and the event id.
//! - `orders relay [--stream NAME] [--until-idle]`: delivers the outbox to
//!   NATS JetStream until Ctrl-C (or until nothing is left).
//! - `orders billing --stream NAME [--until-idle]`: the consuming side, a
//!   second service: reads the `order.placed` events from the stream through
//!   the inbox and writes one invoice per order, exactly once (the invoice
//!   and the inbox's record of the event commit in one transaction).
//!
//! Settings come from the environment: `DATABASE_URL`, `ORDERS_SCHEMA`,
//! `NATS_URL`, `NATS_SUBJECT_PREFIX` (see the README).

use outbox_core::{DeadHeadPolicy, HandlerError, NewEvent};
use outbox_inbox::source::nats::{NatsSource, NatsSourceConfig};
use outbox_inbox::{handler_fn, HandlerRegistry, Inbox, InboxOptions, PgInbox};
use outbox_nats::{NatsConfig, NatsPublisher};
use outbox_postgres::{Ident, PgLogOptions, PgLogStore};
use outbox_worker::{Relay, RelayOptions};
use std::error::Error;
use std::io::Write;
use std::process::ExitCode;

type Result<T, E = Box<dyn Error + Send + Sync>> = std::result::Result<T, E>;

const USAGE: &str = "usage: orders place CUSTOMER TOTAL_CENTS | orders relay [--stream NAME] [--until-idle] | orders billing --stream NAME [--until-idle]";

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("orders: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &[String]) -> Result<()> {
    let settings = Settings::from_env()?;
    match args.first().map(String::as_str) {
        Some("place") => {
            let [customer, total] = &args[1..] else {
                return Err(USAGE.into());
            };
            let total: i64 = total
                .parse()
                .map_err(|_| format!("TOTAL_CENTS must be a whole number, not {total:?}"))?;
            let (order, event) = place(&settings, customer, total).await?;
            writeln!(std::io::stdout().lock(), "order {order} event {event}")?;
            Ok(())
        }
        Some("relay") => {
            let mut stream = None;
            let mut until_idle = false;
            let mut rest = args[1..].iter();
            while let Some(arg) = rest.next() {
                match arg.as_str() {
                    "--stream" => stream = Some(rest.next().ok_or(USAGE)?.clone()),
                    "--until-idle" => until_idle = true,
                    _ => return Err(USAGE.into()),
                }
            }
            relay(&settings, stream.as_deref(), until_idle).await
        }
        Some("billing") => {
            let mut stream = None;
            let mut until_idle = false;
            let mut rest = args[1..].iter();
            while let Some(arg) = rest.next() {
                match arg.as_str() {
                    "--stream" => stream = Some(rest.next().ok_or(USAGE)?.clone()),
                    "--until-idle" => until_idle = true,
                    _ => return Err(USAGE.into()),
                }
            }
            billing(&settings, stream.as_deref().ok_or(USAGE)?, until_idle).await
        }
        _ => Err(USAGE.into()),
    }
}

/// Where the service's data and its broker are.
struct Settings {
    database_url: String,
    schema: Ident,
    nats_url: String,
    subject_prefix: String,
}

impl Settings {
    fn from_env() -> Result<Self> {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
        Ok(Self {
            database_url: var("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"),
            schema: Ident::new(var("ORDERS_SCHEMA", "shop"))?,
            nats_url: var("NATS_URL", "nats://127.0.0.1:4222"),
            subject_prefix: var("NATS_SUBJECT_PREFIX", "shop"),
        })
    }

    /// The outbox (the event log, in the service's schema), its tables
    /// created or upgraded on first use.
    async fn store(&self) -> Result<PgLogStore> {
        let options = PgLogOptions::new(self.database_url.clone())
            .with_schema(self.schema.clone())
            .with_auto_migrate(true);
        Ok(PgLogStore::connect(options).await?)
    }
}

/// Writes the order and its event in one transaction.
async fn place(settings: &Settings, customer: &str, total_cents: i64) -> Result<(i64, String)> {
    let store = settings.store().await?;
    let orders = format!("{}.orders", settings.schema);
    // The service's own table (a real service has its own migrations).
    sqlx_execute(
        &store,
        &format!(
            "CREATE TABLE IF NOT EXISTS {orders} (
                 id bigserial PRIMARY KEY,
                 customer text NOT NULL,
                 total_cents bigint NOT NULL,
                 placed_at timestamptz NOT NULL DEFAULT now())"
        ),
    )
    .await?;

    let mut tx = store.pool().begin().await?;
    let order: i64 = outbox_postgres::sqlx::query_scalar(&format!(
        "INSERT INTO {orders} (customer, total_cents) VALUES ($1, $2) RETURNING id"
    ))
    .bind(customer)
    .bind(total_cents)
    .fetch_one(&mut *tx)
    .await?;
    let payload = serde_json::json!({
        "order_id": order,
        "customer": customer,
        "total_cents": total_cents,
    });
    let event = NewEvent::new("order.placed", "orders", serde_json::to_vec(&payload)?)
        .with_key(format!("customer-{customer}"));
    // Same transaction: the event exists if and only if the order does.
    let event_id = store.outbox().enqueue(&mut tx, event).await?;
    tx.commit().await?;
    Ok((order, event_id.to_string()))
}

async fn sqlx_execute(store: &PgLogStore, sql: &str) -> Result<()> {
    outbox_postgres::sqlx::query(sql)
        .execute(store.pool())
        .await?;
    Ok(())
}

/// Delivers the outbox to NATS JetStream (`<prefix>.<topic>`, the event id
/// as `Nats-Msg-Id`, each publish acknowledged before it counts).
async fn relay(settings: &Settings, stream: Option<&str>, until_idle: bool) -> Result<()> {
    let store = settings.store().await?;
    let config =
        NatsConfig::from_url(&settings.nats_url)?.with_subject_prefix(&settings.subject_prefix);
    let sink = NatsPublisher::connect(config).await?;
    if let Some(name) = stream {
        let subjects = format!("{}.>", settings.subject_prefix);
        sink.ensure_stream(name, &[&subjects]).await?;
    }
    let relay = Relay::new(store, sink, RelayOptions::default())?;
    let summary = if until_idle {
        relay.run_until_idle().await
    } else {
        relay
            .run(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
    };
    writeln!(
        std::io::stdout().lock(),
        "delivered {} retried {} dead {}",
        summary.delivered,
        summary.retried,
        summary.dead
    )?;
    Ok(())
}

/// The billing service: one invoice per placed order, exactly once. Its
/// inbox (consumer `billing`) lives in the same schema as its invoices.
async fn billing(settings: &Settings, stream: &str, until_idle: bool) -> Result<()> {
    let pool = outbox_postgres::sqlx::PgPool::connect(&settings.database_url).await?;
    let schema = settings.schema.clone();
    let invoices = format!("{schema}.invoices");
    outbox_postgres::sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {schema}; "))
        .execute(&pool)
        .await?;
    outbox_postgres::sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {invoices} (
             id bigserial PRIMARY KEY,
             order_id bigint NOT NULL,
             customer text NOT NULL,
             total_cents bigint NOT NULL,
             event_id uuid NOT NULL)"
    ))
    .execute(&pool)
    .await?;
    let insert = format!(
        "INSERT INTO {invoices} (order_id, customer, total_cents, event_id) VALUES ($1, $2, $3, $4)"
    );
    let handlers = HandlerRegistry::new().with_handler(
        "order.placed",
        handler_fn(move |msg, tx| {
            let insert = insert.clone();
            Box::pin(async move {
                let order: serde_json::Value = serde_json::from_slice(&msg.payload)
                    .map_err(|e| HandlerError::permanent(format!("payload is not JSON: {e}")))?;
                let field = |name: &str| {
                    order
                        .get(name)
                        .cloned()
                        .ok_or_else(|| HandlerError::permanent(format!("payload has no {name}")))
                };
                let order_id = field("order_id")?.as_i64().unwrap_or_default();
                let customer = field("customer")?.as_str().unwrap_or_default().to_owned();
                let total = field("total_cents")?.as_i64().unwrap_or_default();
                // The effect, in the inbox's transaction.
                outbox_postgres::sqlx::query(&insert)
                    .bind(order_id)
                    .bind(customer)
                    .bind(total)
                    .bind(msg.id.as_uuid())
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        }),
    );
    let store = PgInbox::new(pool, "billing")?.with_schema(schema.as_str())?;
    let config = NatsSourceConfig::new(&settings.nats_url, stream, "billing")
        .with_filter_subject(format!("{}.orders", settings.subject_prefix));
    let source = NatsSource::connect(config).await?;
    // Block: an invoice must never be written for a later event of an order
    // whose earlier event is dead (the inbox's default, Continue, would).
    let inbox = Inbox::new(store, handlers)
        .with_options(InboxOptions::default().with_dead_head_policy(DeadHeadPolicy::Block));
    let counts = if until_idle {
        inbox
            .run_until_idle(source, std::time::Duration::from_secs(1))
            .await?
    } else {
        inbox
            .run(source, async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?
    };
    writeln!(
        std::io::stdout().lock(),
        "invoiced {} duplicates {} dead {}",
        counts.handled,
        counts.duplicates,
        counts.dead
    )?;
    Ok(())
}
