//! `outbox-chaos inbox-consumer`: one inbox consumer process, the consuming
//! service of the end-to-end runs (`outbox-chaos run --inbox ...`).
//!
//! It consumes the run's stream / queue / topic through the
//! `outbox-inbox` source of the broker, with the consumer's own database
//! (PostgreSQL: a schema of its own; SQLite: a file), and its handler
//! writes one row per event into the business table `effects` (event id,
//! key and sequence number parsed from the producer's payload, a time, and
//! an insertion-order serial) inside the inbox's transaction. A duplicate
//! effect (two rows of one event id) is what the inbox must never let
//! through. It is a process of its own so that the run can `kill -9` it
//! (mid-handler, mid-commit: at load both happen by chance).
//!
//! Every 500 ms, and when it stops, it writes its [`InboxCounts`] (handled,
//! duplicates absorbed, ...) to the counts file (atomically: a new file
//! renamed over the old): after a `kill -9` the run knows its counts up to
//! the last write.

use crate::record::{now_us, parse_payload};
use anyhow::{bail, Context as _, Result};
use futures::future::BoxFuture;
use outbox_core::{DeadHeadPolicy, HandlerError, InboundMessage};
use outbox_inbox::source::amqp::{AmqpSource, AmqpSourceConfig};
use outbox_inbox::source::kafka::{KafkaSource, KafkaSourceConfig};
use outbox_inbox::source::nats::{NatsSource, NatsSourceConfig};
use outbox_inbox::source::Source;
use outbox_inbox::{Handler, Inbox, InboxCounts, InboxOptions, PgInbox, Retention, SqliteInbox};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The business table of a PostgreSQL consumer database, in `schema`.
pub(crate) fn pg_effects(schema: &str) -> String {
    format!("\"{schema}\".effects")
}

/// The business table of a SQLite consumer database.
pub(crate) const SQLITE_EFFECTS: &str = "chaos_effects";

/// The inbox tables' prefix in a SQLite consumer database.
const SQLITE_PREFIX: &str = "chaos_";

/// The consumer's broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SourceKind {
    /// A JetStream durable pull consumer (the consumer name) on the stream.
    Nats,
    /// Competing consumers on the queue.
    Amqp,
    /// A consumer group (the consumer name) on the topic.
    Kafka,
}

/// `outbox-chaos inbox-consumer` arguments.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ConsumerArgs {
    /// The broker.
    #[arg(long, value_enum)]
    pub(crate) broker: SourceKind,
    /// NATS server URL, AMQP URI or Kafka bootstrap servers.
    #[arg(long)]
    pub(crate) url: String,
    /// JetStream stream, RabbitMQ queue or Kafka topic.
    #[arg(long)]
    pub(crate) destination: String,
    /// The consumer's database: a `postgres://` URL (with `--schema`) or a
    /// SQLite file path.
    #[arg(long)]
    pub(crate) db: String,
    /// PostgreSQL: the schema of the inbox tables and of `effects`.
    #[arg(long)]
    pub(crate) schema: Option<String>,
    /// PostgreSQL: the connections' `application_name` (what the
    /// `consumer-db-cut` fault terminates).
    #[arg(long, default_value = "outbox-chaos-inbox")]
    pub(crate) application_name: String,
    /// The consumer name (inbox records, NATS durable, Kafka group).
    #[arg(long)]
    pub(crate) consumer: String,
    /// Where its counts go (JSON, rewritten every 500 ms and at the end).
    #[arg(long)]
    pub(crate) counts: PathBuf,
    /// Lanes: keys handled in parallel.
    #[arg(long, default_value_t = 4)]
    pub(crate) lanes: usize,
    /// NATS: the durable consumer's ack wait, ms (then JetStream delivers
    /// an unacknowledged message again: after a kill, what the dead process
    /// held).
    #[arg(long, default_value_t = 2000)]
    pub(crate) ack_wait_ms: u64,
    /// Kafka: `session.timeout.ms` (a killed member's partitions move after it).
    #[arg(long, default_value_t = 6000)]
    pub(crate) session_timeout_ms: u64,
    /// The retention window of the dedup records, seconds (at least 6)
    /// [default: the inbox's 7 days]; the retention pass then runs four
    /// times per slot.
    #[arg(long)]
    pub(crate) retention_s: Option<u64>,
}

/// What a consumer process writes to its counts file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Counts {
    /// Handlers run and committed (effects written).
    pub(crate) handled: u64,
    /// Copies the inbox recognised and only acknowledged.
    pub(crate) duplicates: u64,
    /// Messages parked behind an earlier one of their key.
    pub(crate) parked: u64,
    /// Failed handler attempts retried.
    pub(crate) retries: u64,
    /// Dead letters.
    pub(crate) dead: u64,
    /// Database or broker faults the inbox retried.
    pub(crate) faults: u64,
    /// Messages the inbox saw applied after a later one of their key (its
    /// `outbox_inbox_out_of_order_total`; by the broker's position, so
    /// never on RabbitMQ).
    #[serde(default)]
    pub(crate) out_of_order: u64,
    /// Written when the process stopped (not by the periodic writer).
    pub(crate) last: bool,
}

impl Counts {
    fn of(c: InboxCounts, last: bool) -> Self {
        Self {
            handled: c.handled,
            duplicates: c.duplicates,
            parked: c.parked,
            retries: c.retries,
            dead: c.dead,
            faults: c.faults,
            out_of_order: c.out_of_order,
            last,
        }
    }

    /// The sum of two processes' counts (`last`: both were final).
    pub(crate) fn add(self, o: Self) -> Self {
        Self {
            handled: self.handled + o.handled,
            duplicates: self.duplicates + o.duplicates,
            parked: self.parked + o.parked,
            retries: self.retries + o.retries,
            dead: self.dead + o.dead,
            faults: self.faults + o.faults,
            out_of_order: self.out_of_order + o.out_of_order,
            last: self.last && o.last,
        }
    }
}

fn write_counts(path: &Path, c: Counts) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(&c)?)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Reads a counts file.
pub(crate) fn read_counts(path: &Path) -> Option<Counts> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// The effect of one message: the producer's payload parsed (a payload it
/// cannot parse is a permanent failure: a dead letter, then a lost event
/// in the checker).
fn effect_of(msg: &InboundMessage) -> Result<(uuid::Uuid, String, i64), HandlerError> {
    let a = parse_payload(&msg.payload, 0)
        .ok_or_else(|| HandlerError::permanent("not a chaos producer payload"))?;
    let seq = i64::try_from(a.seq).map_err(|_| HandlerError::permanent("sequence too large"))?;
    Ok((a.id, a.key, seq))
}

/// Writes the effect row on PostgreSQL.
#[derive(Debug)]
struct PgEffects {
    insert: String,
}

impl Handler<sqlx::Postgres> for PgEffects {
    fn handle<'a>(
        &'a self,
        message: &'a InboundMessage,
        tx: &'a mut sqlx::Transaction<'static, sqlx::Postgres>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let (id, key, seq) = effect_of(message)?;
            sqlx::query(&self.insert)
                .bind(id)
                .bind(key)
                .bind(seq)
                .bind(now_us())
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    }
}

/// Writes the effect row on SQLite.
#[derive(Debug)]
struct SqliteEffects;

impl Handler<sqlx::Sqlite> for SqliteEffects {
    fn handle<'a>(
        &'a self,
        message: &'a InboundMessage,
        tx: &'a mut sqlx::Transaction<'static, sqlx::Sqlite>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let (id, key, seq) = effect_of(message)?;
            sqlx::query(&format!(
                "INSERT INTO {SQLITE_EFFECTS} (event_id, key, seq, at_us) VALUES (?, ?, ?, ?)"
            ))
            .bind(id.to_string())
            .bind(key)
            .bind(seq)
            .bind(now_us())
            .execute(&mut **tx)
            .await?;
            Ok(())
        })
    }
}

/// Creates the business table (the inbox creates its own).
pub(crate) async fn create_pg_effects(pool: &sqlx::PgPool, schema: &str) -> Result<()> {
    let mut tx = pool.begin().await?;
    // Two consumers starting together must not race on the DDL.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(format!("outbox-chaos-effects:{schema}"))
        .execute(&mut *tx)
        .await?;
    sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))
        .execute(&mut *tx)
        .await?;
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {} (serial bigserial PRIMARY KEY, event_id uuid NOT NULL, \
         key text NOT NULL, seq bigint NOT NULL, at_us bigint NOT NULL)",
        pg_effects(schema)
    ))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Creates the business table in a SQLite consumer database.
pub(crate) async fn create_sqlite_effects(pool: &sqlx::SqlitePool) -> Result<()> {
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {SQLITE_EFFECTS} (serial INTEGER PRIMARY KEY AUTOINCREMENT, \
         event_id TEXT NOT NULL, key TEXT NOT NULL, seq INTEGER NOT NULL, at_us INTEGER NOT NULL)"
    ))
    .execute(pool)
    .await?;
    Ok(())
}

/// The PostgreSQL pool of a consumer database (tagged with `app`).
pub(crate) async fn pg_pool(url: &str, app: &str, max: u32) -> Result<sqlx::PgPool> {
    let opts = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .context("parsing the consumer database URL")?
        .application_name(app);
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(opts)
        .await
        .context("the consumer cannot connect to PostgreSQL")
}

/// The pool of a SQLite consumer database (WAL, a busy timeout: two
/// processes may share the file).
pub(crate) async fn sqlite_pool(path: &str, max: u32) -> Result<sqlx::SqlitePool> {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(30));
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(max)
        .connect_with(opts)
        .await
        .with_context(|| format!("the consumer cannot open {path}"))
}

/// Prepares a consumer database before any consumer starts: the inbox's
/// tables (its migration, with the retention window of `retention_s`
/// seconds when given) and `effects`.
pub(crate) async fn prepare_db(
    db: &str,
    schema: Option<&str>,
    consumer: &str,
    retention_s: Option<u64>,
) -> Result<()> {
    let retention = retention_s
        .map(|s| Retention::new(Duration::from_secs(s)))
        .transpose()?;
    if is_postgres(db) {
        let schema = schema.context("a PostgreSQL consumer database needs --schema")?;
        let pool = pg_pool(db, "outbox-chaos-prepare", 2).await?;
        let mut store = PgInbox::new(pool.clone(), consumer)?.with_schema(schema)?;
        if let Some(r) = retention {
            store = store.with_retention(r)?;
        }
        outbox_inbox::InboxSchema::migrate(&store).await?;
        create_pg_effects(&pool, schema).await?;
        pool.close().await;
    } else {
        let pool = sqlite_pool(db, 1).await?;
        let mut store = SqliteInbox::new(pool.clone(), consumer)?.with_prefix(SQLITE_PREFIX)?;
        if let Some(r) = retention {
            store = store.with_retention(r)?;
        }
        outbox_inbox::InboxSchema::migrate(&store).await?;
        create_sqlite_effects(&pool).await?;
        pool.close().await;
    }
    Ok(())
}

/// Whether a consumer database argument is a PostgreSQL URL.
pub(crate) fn is_postgres(db: &str) -> bool {
    db.starts_with("postgres://") || db.starts_with("postgresql://")
}

/// The consumer process: runs until SIGTERM / SIGINT.
pub(crate) async fn run_consumer(args: ConsumerArgs) -> Result<()> {
    // The inbox's and its source's own log lines, to the process's log
    // file (`RUST_LOG`, set by the run from `CHAOS_CONSUMER_LOG`).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let mut options = InboxOptions::default()
        .with_dead_head_policy(DeadHeadPolicy::Block)
        .with_lanes(args.lanes)?
        // Short, so that the run's drain sees the retried messages soon.
        .with_retry_poll(Duration::from_millis(100))
        .with_shutdown_grace(Duration::from_secs(5));
    let retention = match args.retention_s {
        Some(s) => {
            let r = Retention::new(Duration::from_secs(s))?;
            let slot = u64::try_from(r.slot_seconds()).unwrap_or(1).max(1);
            options = options.with_retention_every(Duration::from_millis(slot * 250));
            Some(r)
        }
        None => None,
    };
    if is_postgres(&args.db) {
        let schema = args
            .schema
            .clone()
            .context("a PostgreSQL consumer database needs --schema")?;
        let lanes = u32::try_from(args.lanes).unwrap_or(4);
        let pool = pg_pool(&args.db, &args.application_name, lanes + 4).await?;
        create_pg_effects(&pool, &schema).await?;
        let mut store = PgInbox::new(pool, args.consumer.clone())?.with_schema(schema.clone())?;
        if let Some(r) = retention {
            store = store.with_retention(r)?;
        }
        let handler = PgEffects {
            insert: format!(
                "INSERT INTO {} (event_id, key, seq, at_us) VALUES ($1, $2, $3, $4)",
                pg_effects(&schema)
            ),
        };
        with_source(&args, Inbox::new(store, handler).with_options(options)).await
    } else {
        let pool = sqlite_pool(&args.db, 4).await?;
        create_sqlite_effects(&pool).await?;
        let mut store =
            SqliteInbox::new(pool, args.consumer.clone())?.with_prefix(SQLITE_PREFIX)?;
        if let Some(r) = retention {
            store = store.with_retention(r)?;
        }
        with_source(
            &args,
            Inbox::new(store, SqliteEffects).with_options(options),
        )
        .await
    }
}

async fn with_source<St, H>(args: &ConsumerArgs, inbox: Inbox<St, H>) -> Result<()>
where
    St: outbox_inbox::InboxStore + outbox_inbox::InboxSchema + outbox_inbox::InboxRetentionStore,
    H: Handler<St::Db>,
{
    match args.broker {
        SourceKind::Nats => {
            let config = NatsSourceConfig::new(&args.url, &args.destination, &args.consumer)
                .with_ack_wait(Duration::from_millis(args.ack_wait_ms));
            // Started during a broker outage: wait for the broker as a
            // supervisor's restarts would.
            let source = connect_retrying("nats", || NatsSource::connect(config.clone())).await?;
            consume(args, inbox, source).await
        }
        SourceKind::Amqp => {
            let config = AmqpSourceConfig::new(&args.url, &args.destination)
                .with_prefetch(256)
                .with_connection_name(args.consumer.clone());
            let source = connect_retrying("amqp", || AmqpSource::connect(config.clone())).await?;
            consume(args, inbox, source).await
        }
        SourceKind::Kafka => {
            let config =
                KafkaSourceConfig::new(&args.url, &args.consumer, [args.destination.clone()])
                    .with_property("session.timeout.ms", args.session_timeout_ms.to_string())
                    .with_property(
                        "heartbeat.interval.ms",
                        (args.session_timeout_ms / 4).max(100).to_string(),
                    )
                    .with_property("reconnect.backoff.ms", "100")
                    .with_property("reconnect.backoff.max.ms", "1000");
            let source = KafkaSource::new(config)?;
            consume(args, inbox, source).await
        }
    }
}

async fn connect_retrying<S, F, Fut>(what: &str, connect: F) -> Result<S>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<S, outbox_inbox::source::SourceError>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        match connect().await {
            Ok(s) => return Ok(s),
            Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                eprintln!("inbox consumer ({what}): {e}; again in 250 ms");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => bail!("inbox consumer ({what}): {e}"),
        }
    }
}

async fn consume<St, H, S>(args: &ConsumerArgs, inbox: Inbox<St, H>, source: S) -> Result<()>
where
    St: outbox_inbox::InboxStore + outbox_inbox::InboxSchema + outbox_inbox::InboxRetentionStore,
    H: Handler<St::Db>,
    S: Source,
{
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listening for SIGTERM")?;
    let shutdown = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    let writer = {
        let (inbox, path) = (inbox.clone(), args.counts.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if let Err(e) = write_counts(&path, Counts::of(inbox.stats(), false)) {
                    eprintln!("inbox consumer: writing {}: {e:#}", path.display());
                }
            }
        })
    };
    eprintln!(
        "inbox consumer {}: {} on {}",
        args.consumer,
        source.describe(),
        if is_postgres(&args.db) {
            "postgres"
        } else {
            "sqlite"
        }
    );
    let result = inbox.run(source, shutdown).await;
    writer.abort();
    let counts = match &result {
        Ok(c) => *c,
        Err(_) => inbox.stats(),
    };
    write_counts(&args.counts, Counts::of(counts, true))?;
    eprintln!("inbox consumer {}: stopped, {counts:?}", args.consumer);
    result.map(|_| ()).map_err(anyhow::Error::from)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_and_round_trip() {
        let a = Counts {
            handled: 3,
            duplicates: 2,
            last: true,
            ..Counts::default()
        };
        let b = Counts {
            handled: 1,
            duplicates: 5,
            faults: 1,
            ..Counts::default()
        };
        let s = a.add(b);
        assert_eq!(
            (s.handled, s.duplicates, s.faults, s.last),
            (4, 7, 1, false)
        );
        let dir = std::env::temp_dir().join(format!("chaos-counts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("c.json");
        write_counts(&p, s).unwrap();
        assert_eq!(read_counts(&p), Some(s));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
