//! The inbox side of an end-to-end run (`run --inbox`): the consumers'
//! database (its schema or SQLite file), the consumer processes and the
//! run's reader of their effects.

use crate::cli::{InboxDb, RunArgs};
use crate::consumer::Destination;
use crate::consumers::{ConsumerSpec, Consumers, EffectsDb};
use crate::inbox;
use anyhow::{Context as _, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::Mutex;

/// The schema of the inbox consumers' PostgreSQL database.
pub(crate) fn inbox_schema(name: &str) -> String {
    format!("{name}_inbox")
}

/// The inbox consumers' SQLite file.
pub(crate) fn inbox_sqlite(out: &Path, name: &str) -> PathBuf {
    out.join(format!("{name}-inbox.db"))
}

/// The inbox side of an end-to-end run.
pub(crate) struct EndToEnd {
    /// The consumer processes.
    pub(crate) consumers: Arc<Mutex<Consumers>>,
    /// How many.
    pub(crate) count: usize,
    /// Their business table, read by the run.
    pub(crate) effects: EffectsDb,
    /// PostgreSQL: an admin pool and the consumers' `application_name`
    /// (`consumer-db-cut`).
    pub(crate) consumer_db: Option<(sqlx::PgPool, String)>,
}

impl EndToEnd {
    /// Closes the run's pools on the consumers' database.
    pub(crate) async fn close(&self) {
        match &self.effects {
            EffectsDb::Postgres { pool, .. } => pool.close().await,
            EffectsDb::Sqlite { pool } => pool.close().await,
        }
    }
}

/// Prepares the consumers' database and starts the inbox consumers on
/// `url` (the broker as the relays reach it: through the fault proxy when
/// the plan cuts the broker, so that a cut hits the consumers too).
pub(crate) async fn start_inbox(
    args: &RunArgs,
    db: InboxDb,
    name: &str,
    out: &Path,
    dest: &Destination,
    url: &str,
) -> Result<EndToEnd> {
    let app = format!("{name}-inbox");
    let (db_arg, schema) = match db {
        InboxDb::Postgres => (args.database_url.clone(), Some(inbox_schema(name))),
        InboxDb::Sqlite => (inbox_sqlite(out, name).display().to_string(), None),
    };
    inbox::prepare_db(&db_arg, schema.as_deref(), name, args.inbox_retention_s).await?;
    let (effects, consumer_db) = match &schema {
        Some(schema) => {
            let pool = inbox::pg_pool(&db_arg, &format!("{name}-effects"), 2).await?;
            (
                EffectsDb::Postgres {
                    pool: pool.clone(),
                    schema: schema.clone(),
                },
                Some((pool, app.clone())),
            )
        }
        None => (
            EffectsDb::Sqlite {
                pool: inbox::sqlite_pool(&db_arg, 2).await?,
            },
            None,
        ),
    };
    let (broker, destination) = match dest {
        Destination::Nats { stream, .. } => ("nats", stream.clone()),
        Destination::Amqp { queue, .. } => ("amqp", queue.clone()),
        Destination::Kafka { topic, .. } => ("kafka", topic.clone()),
    };
    let mut cargs: Vec<String> = [
        ("--broker", broker.to_owned()),
        ("--url", url.to_owned()),
        ("--destination", destination),
        ("--db", db_arg),
        ("--application-name", app),
        ("--consumer", name.to_owned()),
        ("--lanes", args.consumer_lanes.to_string()),
        ("--ack-wait-ms", args.nats_ack_wait_ms.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_owned(), v])
    .collect();
    if let Some(schema) = schema {
        cargs.extend(["--schema".to_owned(), schema]);
    }
    if let Some(s) = args.inbox_retention_s {
        cargs.extend(["--retention-s".to_owned(), s.to_string()]);
    }
    // One process by default: two competing consumers on NATS or RabbitMQ
    // take a key's messages in parallel, and two members of a Kafka group
    // through Tansu left a dead member's partition unconsumed
    // (RELIABILITY.md, "One run").
    let count = args.consumers.max(1);
    let spec = ConsumerSpec {
        bin: std::env::current_exe().context("this binary's path")?,
        args: cargs,
        dir: out.to_owned(),
    };
    let consumers = Consumers::start(spec, count)?;
    Ok(EndToEnd {
        consumers: Arc::new(Mutex::new(consumers)),
        count,
        effects,
        consumer_db,
    })
}
