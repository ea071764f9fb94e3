//! Services, per-scenario resources (schemas, streams, queues, topics) and
//! backlog loading.

use anyhow::{anyhow, bail, Context, Result};
use futures::stream::{self, StreamExt, TryStreamExt};
use outbox_amqp::{AmqpConfig, AmqpPublisher};
use outbox_core::{Event, EventId, NewEvent, Outcome, Sink};
use outbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use outbox_kafka::rdkafka::client::DefaultClientContext;
use outbox_kafka::rdkafka::ClientConfig;
use outbox_kafka::{KafkaConfig, KafkaPublisher};
use outbox_nats::{NatsConfig, NatsPublisher};
use outbox_postgres::{Ident, PgLogOptions, PgLogStore, PgStore, PgStoreOptions};
use outbox_sqlite::SqliteStore;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

/// Payload size of every benchmark event (the 200 bytes).
pub(crate) const PAYLOAD_BYTES: usize = 200;
/// Distinct keys (aggregates) the events are spread over.
pub(crate) const KEYS: u64 = 10_000;
/// Event type of every benchmark event.
pub(crate) const EVENT_TYPE: &str = "bench.event";

/// Service addresses. `Debug` shows no URL (they may hold passwords).
#[derive(Clone)]
pub(crate) struct Services {
    pub(crate) database_url: String,
    pub(crate) nats_url: String,
    pub(crate) amqp_url: String,
    pub(crate) kafka_brokers: String,
}

impl fmt::Debug for Services {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Services")
            .field("database_url", &outbox_core::redact_url(&self.database_url))
            .field("kafka_brokers", &self.kafka_brokers)
            .finish_non_exhaustive()
    }
}

/// A short random suffix for resource names.
pub(crate) fn suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}

/// A 200-byte payload that differs per event (JSON-like text).
pub(crate) fn payload(i: u64) -> Vec<u8> {
    let mut p = format!("{{\"order\":{i},\"customer\":\"c-{}\",\"note\":\"", i % 977).into_bytes();
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while p.len() < PAYLOAD_BYTES - 2 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p.push(b'a' + u8::try_from(x % 26).unwrap_or(0));
    }
    p.extend_from_slice(b"\"}");
    p
}

/// The key of event `i`.
pub(crate) fn key(i: u64) -> String {
    format!("agg-{}", i % KEYS)
}

/// Event `i` to enqueue.
pub(crate) fn new_event(topic: &str, i: u64) -> NewEvent {
    NewEvent::new(EVENT_TYPE, topic, payload(i)).with_key(key(i))
}

/// Event `i` as a relay would have claimed it (for the broker ceilings,
/// which have no database).
pub(crate) fn claimed_event(topic: &str, i: u64) -> Event {
    let now = chrono::Utc::now();
    Event {
        id: EventId::new(),
        key: Some(key(i)),
        event_type: EVENT_TYPE.to_owned(),
        topic: topic.to_owned(),
        payload: payload(i),
        headers: BTreeMap::new(),
        created_at: now,
        attempts: 1,
        next_attempt_at: now,
        last_error: None,
    }
}

/// Everything a scenario created, removed by [`Resources::cleanup`] even when
/// the scenario failed.
#[derive(Debug, Default)]
pub(crate) struct Resources {
    schemas: Vec<String>,
    streams: Vec<String>,
    queues: Vec<String>,
    exchanges: Vec<String>,
    topics: Vec<String>,
    sqlite_dirs: Vec<std::path::PathBuf>,
}

impl Resources {
    /// Drops every schema, stream, queue, topic and SQLite file recorded.
    pub(crate) async fn cleanup(&mut self, services: &Services) {
        if !self.schemas.is_empty() {
            match admin_pool(services).await {
                Ok(pool) => {
                    for s in self.schemas.drain(..) {
                        let sql = format!("DROP SCHEMA IF EXISTS \"{s}\" CASCADE");
                        if let Err(e) = sqlx::query(&sql).execute(&pool).await {
                            eprintln!("bench: could not drop schema {s}: {e}");
                        }
                    }
                    pool.close().await;
                }
                Err(e) => eprintln!("bench: could not connect to drop schemas: {e:#}"),
            }
        }
        if !self.streams.is_empty() {
            let connected = match nats_config(services) {
                Some(c) => NatsPublisher::connect(c.with_connect_attempts(1))
                    .await
                    .map_err(|e| e.to_string()),
                None => Err("NATS_URL is invalid".to_owned()),
            };
            match connected {
                Ok(p) => {
                    for s in self.streams.drain(..) {
                        if let Err(e) = p.jetstream().delete_stream(&s).await {
                            eprintln!("bench: could not delete stream {s}: {e}");
                        }
                    }
                }
                Err(e) => eprintln!("bench: could not connect to NATS to delete streams: {e}"),
            }
        }
        for q in self.queues.drain(..) {
            if let Err(e) = delete_queue(&services.amqp_url, &q).await {
                eprintln!("bench: could not delete queue {q}: {e:#}");
            }
        }
        for x in self.exchanges.drain(..) {
            if let Err(e) = delete_exchange(&services.amqp_url, &x).await {
                eprintln!("bench: could not delete exchange {x}: {e:#}");
            }
        }
        if !self.topics.is_empty() {
            let topics: Vec<String> = self.topics.drain(..).collect();
            if let Err(e) = delete_topics(&services.kafka_brokers, &topics).await {
                eprintln!("bench: could not delete topics {topics:?}: {e:#}");
            }
        }
        for d in self.sqlite_dirs.drain(..) {
            let _ = std::fs::remove_dir_all(&d);
        }
    }
}

/// `Option`-returning helper so `?` works in [`Resources::cleanup`].
fn nats_config(services: &Services) -> Option<NatsConfig> {
    NatsConfig::from_url(&services.nats_url).ok()
}

/// A small pool for administration (DDL, stats, VACUUM).
pub(crate) async fn admin_pool(services: &Services) -> Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&services.database_url)
        .await
        .with_context(|| {
            format!(
                "cannot connect to PostgreSQL at {} (is it running? `cargo xtask services`)",
                outbox_core::redact_url(&services.database_url)
            )
        })
}

/// A fresh schema `obench_<name>_<suffix>` with the outbox migrated into
/// it, and a store on it.
pub(crate) async fn pg_store(
    services: &Services,
    res: &mut Resources,
    name: &str,
    notify: bool,
    listen: bool,
    max_connections: u32,
) -> Result<PgStore> {
    let options = PgStoreOptions::new(services.database_url.clone())
        .with_schema(fresh_schema(res, name)?)
        .with_auto_migrate(true)
        .with_notify(notify)
        .with_listen(listen)
        .with_max_connections(max_connections);
    PgStore::connect(options)
        .await
        .with_context(|| cannot_open("store", services))
}

/// A fresh schema name `obench_<name>_<suffix>`, recorded in `res` for
/// cleanup (e.g. for an event log that several stores, one per relay as
/// separate processes would have, open with [`open_pg_log`]).
pub(crate) fn fresh_schema(res: &mut Resources, name: &str) -> Result<Ident> {
    let schema = format!("obench_{name}_{}", suffix());
    res.schemas.push(schema.clone());
    Ok(Ident::new(schema)?)
}

/// The error context of a Postgres `store` that would not open.
fn cannot_open(store: &str, services: &Services) -> String {
    format!(
        "cannot open the Postgres {store} at {}",
        outbox_core::redact_url(&services.database_url)
    )
}

/// Loads `n` events for `topic` into the Postgres outbox, 5,000 per INSERT
/// (`enqueue_batch`, one transaction each, two at a time). Returns the time taken.
pub(crate) async fn load_pg(store: &PgStore, topic: &str, n: u64) -> Result<Duration> {
    let started = Instant::now();
    load_chunks(topic, n, |events| async move {
        let mut tx = store.pool().begin().await?;
        store
            .outbox()
            .enqueue_batch(&mut tx, events)
            .await
            .context("enqueue_batch")?;
        tx.commit().await?;
        anyhow::Ok(())
    })
    .await?;
    analyze(store.pool(), store).await?;
    Ok(started.elapsed())
}

/// Cuts events `0..n` for `topic` into chunks of 5,000 and runs `insert`
/// on each, two at a time.
async fn load_chunks<F, Fut>(topic: &str, n: u64, insert: F) -> Result<()>
where
    F: Fn(Vec<NewEvent>) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    const CHUNK: u64 = 5_000;
    let insert = &insert;
    let chunks: Vec<u64> = (0..n.div_ceil(CHUNK)).collect();
    stream::iter(chunks)
        .map(|c| async move {
            let from = c * CHUNK;
            let to = (from + CHUNK).min(n);
            insert((from..to).map(|i| new_event(topic, i)).collect()).await
        })
        .buffer_unordered(2)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// `ANALYZE` the events table so the planner sees the backlog (autovacuum,
/// which would do it, may be off).
async fn analyze(pool: &PgPool, store: &PgStore) -> Result<()> {
    let sql = format!(
        "ANALYZE \"{}\".\"{}\"",
        store.outbox().schema().as_str(),
        store.outbox().table().as_str()
    );
    sqlx::query(&sql).execute(pool).await?;
    Ok(())
}

/// A fresh schema `obench_<name>_<suffix>` with the event log
/// ([`PgLogStore`], the default mode) migrated into it, and a store on it (the
/// product defaults otherwise: background rotation on, progress settled
/// with `synchronous_commit = off`).
pub(crate) async fn pg_log_store(
    services: &Services,
    res: &mut Resources,
    name: &str,
    max_connections: u32,
) -> Result<PgLogStore> {
    let schema = fresh_schema(res, name)?;
    open_pg_log(services, &schema, max_connections, |o| o).await
}

/// An event-log store on `schema` (migrated if needed) with its own pool of
/// `max_connections`, the product defaults changed by `configure` (relay
/// groups, consumer group, rebalance interval).
pub(crate) async fn open_pg_log(
    services: &Services,
    schema: &Ident,
    max_connections: u32,
    configure: impl FnOnce(PgLogOptions) -> PgLogOptions,
) -> Result<PgLogStore> {
    let options = PgLogOptions::new(services.database_url.clone())
        .with_schema(schema.clone())
        .with_auto_migrate(true)
        .with_max_connections(max_connections);
    PgLogStore::connect(configure(options))
        .await
        .with_context(|| cannot_open("event-log store", services))
}

/// Loads `n` events for `topic` into the event log, 5,000 per INSERT
/// (`PgOutbox::enqueue_batch`, one transaction each, two at a time), as
/// [`load_pg`] does for the queue table. No `ANALYZE`: the log's plans do
/// not depend on statistics, and autovacuum may never analyze an
/// append-only table. Returns the time taken.
pub(crate) async fn load_pg_log(store: &PgLogStore, topic: &str, n: u64) -> Result<Duration> {
    let started = Instant::now();
    load_chunks(topic, n, |events| async move {
        let mut tx = store.pool().begin().await?;
        store
            .outbox()
            .enqueue_batch(&mut tx, events)
            .await
            .context("log enqueue_batch")?;
        tx.commit().await?;
        anyhow::Ok(())
    })
    .await?;
    Ok(started.elapsed())
}

/// A connection holding a `REPEATABLE READ` snapshot (taken by its first
/// statement) until [`release_snapshot`].
pub(crate) async fn hold_snapshot(services: &Services) -> Result<sqlx::PgConnection> {
    use sqlx::Connection as _;
    let mut conn = sqlx::PgConnection::connect(&services.database_url).await?;
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut conn)
        .await?;
    sqlx::query("SELECT count(*) FROM pg_class")
        .execute(&mut conn)
        .await?;
    Ok(conn)
}

/// Ends the transaction of [`hold_snapshot`] and closes its connection.
pub(crate) async fn release_snapshot(mut conn: sqlx::PgConnection) -> Result<()> {
    use sqlx::Connection as _;
    sqlx::query("ROLLBACK").execute(&mut conn).await?;
    conn.close().await?;
    Ok(())
}

/// A SQLite store in a fresh temporary directory.
pub(crate) async fn sqlite_store(res: &mut Resources, name: &str) -> Result<SqliteStore> {
    let dir = std::env::temp_dir().join(format!("obench_{name}_{}", suffix()));
    std::fs::create_dir_all(&dir)?;
    res.sqlite_dirs.push(dir.clone());
    let url = format!("sqlite://{}", dir.join("outbox.db").display());
    let store = SqliteStore::connect(&url).await?;
    store.migrate().await?;
    Ok(store)
}

/// Loads `n` events into the SQLite outbox, 5,000 per transaction.
pub(crate) async fn load_sqlite(store: &SqliteStore, topic: &str, n: u64) -> Result<Duration> {
    const CHUNK: u64 = 5_000;
    let started = Instant::now();
    let mut from = 0;
    while from < n {
        let to = (from + CHUNK).min(n);
        let events: Vec<NewEvent> = (from..to).map(|i| new_event(topic, i)).collect();
        let mut tx = store.pool().begin().await?;
        outbox_sqlite::enqueue_batch(&mut tx, events).await?;
        tx.commit().await?;
        from = to;
    }
    Ok(started.elapsed())
}

/// A broker the relay publishes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Broker {
    Nats,
    Amqp,
    Kafka,
}

impl Broker {
    /// All of them, in report order.
    pub(crate) const ALL: [Broker; 3] = [Broker::Nats, Broker::Amqp, Broker::Kafka];

    /// Display name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Broker::Nats => "nats-jetstream",
            Broker::Amqp => "rabbitmq",
            Broker::Kafka => "kafka (tansu)",
        }
    }
}

/// One of the publishers, as a single [`Sink`] type.
#[derive(Debug)]
pub(crate) enum BrokerSink {
    Nats(NatsPublisher),
    Amqp(AmqpPublisher),
    Kafka(KafkaPublisher),
}

impl Sink for BrokerSink {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        match self {
            BrokerSink::Nats(p) => p.deliver(events).await,
            BrokerSink::Amqp(p) => p.deliver(events).await,
            BrokerSink::Kafka(p) => p.deliver(events).await,
        }
    }

    fn late_send_bound(&self) -> std::time::Duration {
        match self {
            BrokerSink::Nats(p) => p.late_send_bound(),
            BrokerSink::Amqp(p) => p.late_send_bound(),
            BrokerSink::Kafka(p) => p.late_send_bound(),
        }
    }
}

/// A connected publisher and the fresh destination (stream / queue / topic)
/// it publishes to; the destination is recorded in `res` for cleanup.
pub(crate) async fn broker(
    services: &Services,
    res: &mut Resources,
    broker: Broker,
    name: &str,
) -> Result<(BrokerSink, String)> {
    let sfx = suffix();
    match broker {
        Broker::Nats => {
            let config = NatsConfig::from_url(&services.nats_url)
                .map_err(|e| anyhow!("NATS_URL is invalid: {e}"))?
                .with_connect_attempts(2);
            let p = NatsPublisher::connect(config)
                .await
                .context("cannot connect to NATS (is it running? `cargo xtask services`)")?;
            let stream = format!("OBENCH_{name}_{sfx}").to_uppercase();
            let subject = format!("obench.{name}.{sfx}");
            res.streams.push(stream.clone());
            p.ensure_stream(&stream, &[subject.as_str()]).await?;
            Ok((BrokerSink::Nats(p), subject))
        }
        Broker::Amqp => {
            let config = AmqpConfig::from_url(&services.amqp_url)?;
            let p = AmqpPublisher::connect(config)
                .await
                .context("cannot connect to RabbitMQ (is it running? `cargo xtask services`)")?;
            let queue = format!("obench.{name}.{sfx}");
            res.queues.push(queue.clone());
            p.declare_queue("", &queue, "").await?;
            Ok((BrokerSink::Amqp(p), queue))
        }
        Broker::Kafka => {
            let topic = format!("obench-{name}-{sfx}");
            res.topics.push(topic.clone());
            create_topic(&services.kafka_brokers, &topic).await?;
            // Fitted to the relays' default lease, as outbox-relay does.
            let config = KafkaConfig::new(services.kafka_brokers.clone())
                .with_lease(outbox_worker::RelayOptions::default().lock_timeout())?;
            let p = KafkaPublisher::new(config)?;
            Ok((BrokerSink::Kafka(p), topic))
        }
    }
}

/// Where a prefilled backlog for the inbox lives: every consumer of a
/// measurement reads all of it from the start.
#[derive(Debug, Clone)]
pub(crate) enum InboxDest {
    /// A stream; each consumer is a new durable consumer of it.
    Nats { stream: String },
    /// One queue per consumer, each bound to the exchange the publisher
    /// publishes to, so one publish fills every copy.
    Amqp { queues: Vec<String> },
    /// A topic; each consumer is a new consumer group reading from the
    /// earliest offset.
    Kafka { topic: String },
}

/// A connected publisher, the topic to publish under, and a fresh
/// destination that `copies` consumers can each read whole (RabbitMQ: a
/// topic exchange with `copies` queues bound to it); recorded in `res` for
/// cleanup.
pub(crate) async fn inbox_destination(
    services: &Services,
    res: &mut Resources,
    which: Broker,
    name: &str,
    copies: usize,
) -> Result<(BrokerSink, String, InboxDest)> {
    match which {
        Broker::Nats => {
            let (sink, subject) = broker(services, res, which, name).await?;
            let stream = res
                .streams
                .last()
                .cloned()
                .context("the stream just created")?;
            Ok((sink, subject, InboxDest::Nats { stream }))
        }
        Broker::Amqp => {
            let sfx = suffix();
            let exchange = format!("obench.{name}.{sfx}.x");
            let topic = format!("obench.{name}.{sfx}");
            let config = AmqpConfig::from_url(&services.amqp_url)?.with_exchange(exchange.clone());
            let p = AmqpPublisher::connect(config)
                .await
                .context("cannot connect to RabbitMQ (is it running? `cargo xtask services`)")?;
            res.exchanges.push(exchange.clone());
            let mut queues = Vec::with_capacity(copies);
            for i in 0..copies {
                let queue = format!("{topic}.{i}");
                res.queues.push(queue.clone());
                p.declare_queue(&exchange, &queue, &topic).await?;
                queues.push(queue);
            }
            Ok((BrokerSink::Amqp(p), topic, InboxDest::Amqp { queues }))
        }
        Broker::Kafka => {
            let (sink, topic) = broker(services, res, which, name).await?;
            Ok((sink, topic.clone(), InboxDest::Kafka { topic }))
        }
    }
}

fn kafka_admin(brokers: &str) -> Result<AdminClient<DefaultClientContext>> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .context("kafka admin client")
}

async fn create_topic(brokers: &str, topic: &str) -> Result<()> {
    let admin = kafka_admin(brokers)?;
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .with_context(|| {
            format!("creating Kafka topic {topic} on {brokers} (is Tansu running? `cargo xtask services`)")
        })?;
    for r in results {
        if let Err((t, code)) = r {
            bail!("creating Kafka topic {t} failed: {code}");
        }
    }
    Ok(())
}

async fn delete_topics(brokers: &str, topics: &[String]) -> Result<()> {
    let admin = kafka_admin(brokers)?;
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    admin
        .delete_topics(
            &names,
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await?;
    Ok(())
}

async fn delete_exchange(url: &str, exchange: &str) -> Result<()> {
    use outbox_amqp::lapin::options::ExchangeDeleteOptions;
    use outbox_amqp::lapin::{Connection, ConnectionProperties};
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .exchange_delete(exchange, ExchangeDeleteOptions::default())
        .await?;
    let _ = conn.close(200, "bench cleanup").await;
    Ok(())
}

async fn delete_queue(url: &str, queue: &str) -> Result<()> {
    use outbox_amqp::lapin::options::QueueDeleteOptions;
    use outbox_amqp::lapin::{Connection, ConnectionProperties};
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .queue_delete(queue, QueueDeleteOptions::default())
        .await?;
    let _ = conn.close(200, "bench cleanup").await;
    Ok(())
}
