//! A key's events are applied in the key's order also after a consumer
//! crashed holding some of them unacknowledged (issue 42, point 2), on each
//! real broker with a PostgreSQL inbox.
//!
//! The crash is simulated deterministically: a first inbox applies and
//! acknowledges the key's first events; then a plain source of the same
//! consumer receives the next ones and is dropped (NATS: dropped without a
//! word; RabbitMQ and Kafka: connection closed / group left) before
//! acknowledging anything, as a process killed between receiving and
//! committing; the key's later events are published; a restarted inbox
//! must apply the held ones before the later ones, each once.
//!
//! What each broker does (before the inbox did anything about it):
//! - NATS JetStream delivers the unacknowledged messages again only after
//!   `ack_wait`; a restarted consumer would get the later messages first.
//!   The NATS source therefore resumes from the durable consumer's
//!   acknowledgement floor (this test failed before that).
//! - RabbitMQ puts unacknowledged messages back at their place in the queue
//!   when the channel closes: they come first.
//! - Kafka resumes the group from the committed offset, which the source
//!   only moves over contiguously acknowledged offsets: the held messages
//!   come again first, with everything after them.
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use futures::future::BoxFuture;
use outbox_core::{DeadHeadPolicy, Event, HandlerError, InboundMessage, Outcome, Sink};
use outbox_inbox::source::{Position, RawMessage, Received, Source, SourceError};
use outbox_inbox::{Handler, Inbox, InboxCounts, InboxOptions, PgInbox};
use std::future::Future;
use std::time::{Duration, Instant};

/// How long a step may wait for what must come (ack_wait, group joins).
const BOUND: Duration = Duration::from_secs(90);

/// The key under test, and another key interleaved with it.
const KEY: &str = "account-7";
const OTHER: &str = "account-9";

/// The consumer's database: a schema of its own, an `effects` table whose
/// serial is the order of application.
struct Db {
    pool: sqlx::PgPool,
    schema: String,
}

impl Db {
    async fn new() -> Self {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .expect("PostgreSQL on 127.0.0.1:5432 (or DATABASE_URL)");
        let schema = format!(
            "crash_order_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query(&format!(
            "CREATE TABLE \"{schema}\".effects (serial bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL, n int NOT NULL)"
        ))
        .execute(&pool)
        .await
        .unwrap();
        Self { pool, schema }
    }

    fn inbox(&self, consumer: &str) -> Inbox<PgInbox, Effects> {
        let store = PgInbox::new(self.pool.clone(), consumer)
            .unwrap()
            .with_schema(self.schema.clone())
            .unwrap();
        let options = InboxOptions::default()
            .with_dead_head_policy(DeadHeadPolicy::Block)
            .with_lanes(2)
            .unwrap()
            .with_recv_wait(Duration::from_millis(50));
        Inbox::new(
            store,
            Effects {
                insert: format!(
                    "INSERT INTO \"{}\".effects (event_id, key, n) VALUES ($1, $2, $3)",
                    self.schema
                ),
            },
        )
        .with_options(options)
    }

    /// The effects of `key` in the order they were applied.
    async fn applied(&self, key: &str) -> Vec<i32> {
        sqlx::query_scalar(&format!(
            "SELECT n FROM \"{}\".effects WHERE key = $1 ORDER BY serial",
            self.schema
        ))
        .bind(key)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    async fn count(&self) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM \"{}\".effects", self.schema))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn drop(self) {
        sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
            .execute(&self.pool)
            .await
            .ok();
    }
}

/// One effect row per message: its key and the number in its payload.
struct Effects {
    insert: String,
}

impl Handler<sqlx::Postgres> for Effects {
    fn handle<'a>(
        &'a self,
        m: &'a InboundMessage,
        tx: &'a mut sqlx::Transaction<'static, sqlx::Postgres>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let n: i32 = std::str::from_utf8(&m.payload)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| HandlerError::permanent("payload is not a number"))?;
            sqlx::query(&self.insert)
                .bind(m.id.as_uuid())
                .bind(m.key.as_deref().unwrap_or_default())
                .bind(n)
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    }
}

/// What a broker provides to the scenario.
trait Broker: Sized {
    type Source: Source;
    type Sink: Sink;
    fn topic(&self) -> String;
    fn sink(&self) -> impl Future<Output = Self::Sink>;
    fn source(&self, consumer: &str) -> impl Future<Output = Self::Source>;
    /// Ends `source` as a crash would, acknowledging nothing.
    fn crash(&self, source: Self::Source) -> impl Future<Output = ()>;
    /// Messages consumer `consumer` would still get (delivered and not
    /// acknowledged included, where the broker tells).
    fn remaining(&self, consumer: &str) -> impl Future<Output = u64>;
    fn cleanup(&self) -> impl Future<Output = ()>;
}

fn event(topic: &str, key: &str, n: u32) -> Event {
    outbox_testkit::publisher::event(topic, Some(key), n.to_string().into_bytes())
}

/// Publishes the events one call each, so the broker holds them in the
/// order given.
async fn publish<B: Broker>(b: &B, events: &[Event]) {
    let sink = b.sink().await;
    for e in events {
        let outcomes = sink.deliver(std::slice::from_ref(e)).await;
        assert_eq!(
            outcomes,
            vec![Outcome::Delivered],
            "event {} not published",
            e.id
        );
    }
}

/// Runs `inbox` on `source` until `done` holds (bounded), then stops it.
async fn run_until<B, S>(
    inbox: &Inbox<PgInbox, Effects>,
    source: S,
    what: &str,
    done: impl Fn() -> B,
) -> InboxCounts
where
    B: Future<Output = bool>,
    S: Source,
{
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = inbox.run(source, async move {
        let _ = stopped.await;
    });
    let watch = async {
        let deadline = Instant::now() + BOUND;
        while !done().await {
            assert!(Instant::now() < deadline, "{what}: not within {BOUND:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        stop.send(()).unwrap();
    };
    let (counts, ()) = tokio::join!(run, watch);
    counts.expect("the inbox ran")
}

/// Receives until `n` messages came.
async fn recv_n<S: Source>(source: &mut S, n: usize) -> Vec<Received<S::Token>> {
    let deadline = Instant::now() + BOUND;
    let mut got = Vec::new();
    while got.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} received",
            got.len()
        );
        got.extend(
            source
                .recv(n - got.len(), Duration::from_millis(500))
                .await
                .unwrap(),
        );
    }
    got
}

/// The scenario: events 1-2 of the key applied and acknowledged; 3-6
/// received by a consumer that crashes; 7-8 published after the crash; a
/// restarted inbox applies 3..8 in order, each once.
async fn crash_mid_batch_keeps_key_order<B: Broker>(b: &B) {
    let db = Db::new().await;
    let consumer = format!("crash-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let inbox = db.inbox(&consumer);
    let topic = b.topic();
    let events: Vec<Event> = (1..=8).map(|n| event(&topic, KEY, n)).collect();
    let others: Vec<Event> = (1..=8).map(|n| event(&topic, OTHER, n)).collect();
    let batch = |r: std::ops::Range<usize>| -> Vec<Event> {
        r.flat_map(|i| [events[i].clone(), others[i].clone()])
            .collect()
    };

    // 1-2 applied and acknowledged.
    publish(b, &batch(0..2)).await;
    let source = b.source(&consumer).await;
    run_until(&inbox, source, "first events applied", || async {
        db.count().await == 4
    })
    .await;

    // 3-6 received by a consumer that dies before acknowledging any.
    publish(b, &batch(2..6)).await;
    let mut doomed = b.source(&consumer).await;
    let held = recv_n(&mut doomed, 8).await;
    assert_eq!(held.len(), 8);
    drop(held);
    b.crash(doomed).await;

    // 7-8 published after the crash; the consumer restarts.
    publish(b, &batch(6..8)).await;
    let source = b.source(&consumer).await;
    let counts = run_until(
        &inbox,
        source,
        "everything applied and acknowledged",
        || async { db.count().await >= 16 && b.remaining(&consumer).await == 0 },
    )
    .await;

    let expected: Vec<i32> = (1..=8).collect();
    assert_eq!(
        db.applied(KEY).await,
        expected,
        "{KEY}: order of application ({counts:?})"
    );
    assert_eq!(
        db.applied(OTHER).await,
        expected,
        "{OTHER}: order of application"
    );
    db.drop().await;
}

/// A source in memory whose tokens are broker positions, delivering the
/// messages in the order given (positions need not follow it).
struct Positioned(std::collections::VecDeque<(u64, RawMessage)>);

impl Source for Positioned {
    type Token = u64;

    async fn recv(
        &mut self,
        max: usize,
        _wait: Duration,
    ) -> Result<Vec<Received<u64>>, SourceError> {
        let n = self.0.len().min(max);
        Ok(self
            .0
            .drain(..n)
            .map(|(token, message)| Received { message, token })
            .collect())
    }

    async fn ack(&mut self, _tokens: Vec<u64>) -> Result<(), SourceError> {
        Ok(())
    }

    async fn close(self) -> Result<(), SourceError> {
        Ok(())
    }

    fn describe(&self) -> String {
        "positioned".into()
    }

    fn position(token: &u64) -> Option<Position> {
        Some(Position {
            log: 0,
            offset: *token,
        })
    }
}

fn raw(e: &Event) -> RawMessage {
    let m = outbox_core::BrokerMessage::new(e);
    RawMessage {
        headers: m
            .headers()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        body: m.body().into_owned(),
        destination: e.topic.clone(),
        timestamp: Some(e.created_at),
        redelivered: false,
        behind: None,
    }
}

/// A key's message at an earlier broker position applied after a later
/// one (what competing consumers can do) is counted, once; a copy of an
/// applied message and another key's messages in order are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_applied_after_a_later_one_of_its_key_is_counted() {
    let db = Db::new().await;
    let inbox = db.inbox("order-watch");
    let (k2, k1, k3) = (event("t", KEY, 2), event("t", KEY, 1), event("t", KEY, 3));
    let (o1, o2) = (event("t", OTHER, 1), event("t", OTHER, 2));
    let arrivals = vec![
        (2, raw(&k2)),
        (10, raw(&o1)),
        (1, raw(&k1)),
        (11, raw(&o2)),
        (2, raw(&k2)),
        (3, raw(&k3)),
    ];
    let counts = inbox
        .run_until_idle(Positioned(arrivals.into()), Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!((counts.handled, counts.duplicates), (5, 1));
    assert_eq!(counts.out_of_order, 1, "{counts:?}");
    assert_eq!(db.applied(KEY).await, vec![2, 1, 3]);
    assert_eq!(db.applied(OTHER).await, vec![1, 2]);
    db.drop().await;
}

#[cfg(feature = "nats")]
mod nats {
    use super::*;
    use outbox_inbox::source::nats::{NatsSource, NatsSourceConfig};
    use outbox_nats::NatsPublisher;
    use outbox_testkit::nats::NatsFixture;

    struct Nats(NatsFixture);

    impl Broker for Nats {
        type Source = NatsSource;
        type Sink = NatsPublisher;

        fn topic(&self) -> String {
            self.0.topic()
        }

        async fn sink(&self) -> NatsPublisher {
            self.0.sink().await
        }

        async fn source(&self, consumer: &str) -> NatsSource {
            // A short ack_wait: the held messages come again within the
            // test (they must then be recognised, not applied again).
            let config = NatsSourceConfig::new(self.0.url(), self.0.stream(), consumer)
                .with_filter_subject(self.0.subject(&self.0.topic()))
                .with_ack_wait(Duration::from_secs(3));
            NatsSource::connect(config).await.expect("NATS source")
        }

        async fn crash(&self, source: NatsSource) {
            // A killed process says nothing: its pull subscription and
            // connection just go away.
            drop(source);
        }

        async fn remaining(&self, consumer: &str) -> u64 {
            let stream = self
                .0
                .jetstream()
                .get_stream(self.0.stream())
                .await
                .unwrap();
            let info = stream.consumer_info(consumer).await.unwrap();
            info.num_pending + u64::try_from(info.num_ack_pending).unwrap()
        }

        async fn cleanup(&self) {
            self.0.cleanup().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn restarted_consumer_applies_a_keys_held_events_first() {
        let b = Nats(NatsFixture::new().await);
        crash_mid_batch_keeps_key_order(&b).await;
        b.cleanup().await;
    }
}

#[cfg(feature = "amqp")]
mod amqp {
    use super::*;
    use outbox_amqp::AmqpPublisher;
    use outbox_inbox::source::amqp::{AmqpSource, AmqpSourceConfig};
    use outbox_testkit::amqp::AmqpFixture;

    struct Amqp(AmqpFixture);

    impl Broker for Amqp {
        type Source = AmqpSource;
        type Sink = AmqpPublisher;

        fn topic(&self) -> String {
            self.0.topic()
        }

        async fn sink(&self) -> AmqpPublisher {
            self.0.sink().await
        }

        async fn source(&self, consumer: &str) -> AmqpSource {
            let config = AmqpSourceConfig::new(self.0.url(), self.0.queue())
                .with_consumer_tag(consumer)
                .with_prefetch(64);
            AmqpSource::connect(config).await.expect("AMQP source")
        }

        async fn crash(&self, source: AmqpSource) {
            // The broker sees the connection end as after a kill: the
            // unacknowledged deliveries go back to the queue.
            source.close().await.ok();
        }

        async fn remaining(&self, _consumer: &str) -> u64 {
            u64::from(self.0.message_count().await)
        }

        async fn cleanup(&self) {
            self.0.cleanup().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn restarted_consumer_applies_a_keys_held_events_first() {
        let b = Amqp(AmqpFixture::new().await);
        crash_mid_batch_keeps_key_order(&b).await;
        b.cleanup().await;
    }
}

#[cfg(feature = "kafka")]
mod kafka {
    use super::*;
    use outbox_inbox::source::kafka::{KafkaSource, KafkaSourceConfig};
    use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
    use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
    use outbox_kafka::KafkaPublisher;
    use outbox_testkit::kafka::{KafkaFixture, PARTITIONS};

    struct Kafka(KafkaFixture);

    impl Broker for Kafka {
        type Source = KafkaSource;
        type Sink = KafkaPublisher;

        fn topic(&self) -> String {
            self.0.topic()
        }

        async fn sink(&self) -> KafkaPublisher {
            self.0.sink().await
        }

        async fn source(&self, consumer: &str) -> KafkaSource {
            let config = KafkaSourceConfig::new(self.0.brokers(), consumer, [self.0.topic()])
                .with_property("session.timeout.ms", "6000")
                .with_property("heartbeat.interval.ms", "500")
                .with_property("topic.metadata.refresh.interval.ms", "1000");
            KafkaSource::new(config).expect("Kafka source")
        }

        async fn crash(&self, source: KafkaSource) {
            // Leaves the group having committed only what was acknowledged
            // (nothing of the held messages): what a kill leaves behind,
            // without waiting out the session timeout.
            source.close().await.ok();
        }

        async fn remaining(&self, consumer: &str) -> u64 {
            let brokers = self.0.brokers().to_owned();
            let topic = self.0.topic();
            let group = consumer.to_owned();
            tokio::task::spawn_blocking(move || {
                let consumer: BaseConsumer = ClientConfig::new()
                    .set("bootstrap.servers", &brokers)
                    .set("group.id", &group)
                    .set("enable.auto.commit", "false")
                    .create()
                    .unwrap();
                let mut tpl = TopicPartitionList::new();
                for p in 0..PARTITIONS {
                    tpl.add_partition(&topic, p);
                }
                let committed = consumer
                    .committed_offsets(tpl, Duration::from_secs(10))
                    .unwrap();
                let mut left = 0u64;
                for p in 0..PARTITIONS {
                    let (low, high) = consumer
                        .fetch_watermarks(&topic, p, Duration::from_secs(10))
                        .unwrap();
                    let at = match committed.find_partition(&topic, p).map(|e| e.offset()) {
                        Some(Offset::Offset(o)) => o,
                        _ => low,
                    };
                    left += u64::try_from(high - at).unwrap_or(0);
                }
                left
            })
            .await
            .unwrap()
        }

        async fn cleanup(&self) {
            self.0.cleanup().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn restarted_consumer_applies_a_keys_held_events_first() {
        let b = Kafka(KafkaFixture::new().await);
        crash_mid_batch_keeps_key_order(&b).await;
        b.cleanup().await;
    }

    /// The child process's environment: brokers, topic, group.
    const CHILD_ENV: &str = "OUTBOX_CRASH_ORDER_KAFKA_CHILD";

    /// The source as the chaos run's inbox consumer configures it.
    fn chaos_source(brokers: &str, group: &str, topic: &str) -> KafkaSource {
        let config = KafkaSourceConfig::new(brokers, group, [topic])
            .with_property("session.timeout.ms", "6000")
            .with_property("heartbeat.interval.ms", "1500")
            .with_property("reconnect.backoff.ms", "100")
            .with_property("reconnect.backoff.max.ms", "1000");
        KafkaSource::new(config).expect("Kafka source")
    }

    /// Not a test: the consumer process that
    /// `consumers_killed_in_a_row_do_not_stall_the_group` kills with
    /// SIGKILL. Receives and acknowledges (slowly) until killed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a child process of consumers_killed_in_a_row_do_not_stall_the_group"]
    async fn killed_child_consumer() {
        let Ok(env) = std::env::var(CHILD_ENV) else {
            return;
        };
        let mut it = env.split('\t');
        let (brokers, topic, group) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        let mut source = chaos_source(brokers, group, topic);
        loop {
            let got = source.recv(8, Duration::from_millis(100)).await.unwrap();
            if !got.is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
                source
                    .ack(got.into_iter().map(|r| r.token).collect())
                    .await
                    .unwrap();
            }
        }
    }

    /// Per partition: the group's committed offset and the high watermark.
    fn committed_and_high(brokers: &str, topic: &str, group: &str) -> Vec<(i64, i64)> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            tpl.add_partition(topic, p);
        }
        let committed = consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .unwrap();
        (0..PARTITIONS)
            .map(|p| {
                let (low, high) = consumer
                    .fetch_watermarks(topic, p, Duration::from_secs(10))
                    .unwrap();
                let at = match committed.find_partition(topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => o,
                    _ => low,
                };
                (at, high)
            })
            .collect()
    }

    /// The chaos run's `consumer-kills` on Kafka (issue 42): a consumer
    /// process of the group `kill -9`ed about every second (every third
    /// one lives long enough to consume and commit), restarted each time,
    /// never leaving the group. Once the kills stop, its successor must
    /// get every message not committed within a bound, not be assigned
    /// and then starve.
    ///
    /// Fails (issue 42, open): each restart joins as a new member beside
    /// the dead ones; the leader assigns partitions to dead, not yet
    /// expired, members; when Tansu's heartbeat handling drops the expired
    /// members it keeps the group's generation and assignment, so no
    /// rebalance follows and their partitions are never consumed: in 4 of
    /// 4 runs the successor got none, or only some partitions', of the
    /// remaining messages in 40 s (a plain rdkafka consumer: none). See
    /// the Kafka source's module docs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "issue 42: Tansu 0.6 strands the partitions of members that expire while the group is formed"]
    async fn consumers_killed_in_a_row_do_not_stall_the_group() {
        const KILLS: usize = 12;
        const EACH: u32 = 60;
        const STALL: Duration = Duration::from_secs(40);
        let b = Kafka(KafkaFixture::new().await);
        let topic = b.topic();
        let brokers = b.0.brokers().to_owned();
        let group = format!("kills-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let exe = std::env::current_exe().unwrap();
        let mut n = 0;
        for kill in 0..KILLS {
            let events: Vec<Event> = (0..EACH)
                .map(|_| {
                    n += 1;
                    event(&topic, &format!("k{}", n % 16), n)
                })
                .collect();
            publish(&b, &events).await;
            let mut child = std::process::Command::new(&exe)
                .args([
                    "--exact",
                    "kafka::killed_child_consumer",
                    "--ignored",
                    "--nocapture",
                ])
                .env(CHILD_ENV, format!("{brokers}\t{topic}\t{group}"))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            let lives = if kill % 3 == 2 { 4500 } else { 1000 };
            tokio::time::sleep(Duration::from_millis(lives)).await;
            child.kill().unwrap(); // SIGKILL: the member stays in the group
            child.wait().unwrap();
        }
        let events: Vec<Event> = (0..EACH)
            .map(|_| {
                n += 1;
                event(&topic, &format!("k{}", n % 16), n)
            })
            .collect();
        publish(&b, &events).await;
        let (brokers2, topic2, group2) = (brokers.clone(), topic.clone(), group.clone());
        let before =
            tokio::task::spawn_blocking(move || committed_and_high(&brokers2, &topic2, &group2))
                .await
                .unwrap();
        let highs: Vec<i64> = before.iter().map(|(_, h)| *h).collect();
        let left: i64 = before.iter().map(|(c, h)| h - c).sum();
        assert!(left > 0, "the killed consumers left nothing: {before:?}");

        let started = Instant::now();
        let mut source = chaos_source(&brokers, &group, &topic);
        // One past the highest offset received, per partition.
        let mut next: Vec<i64> = before.iter().map(|(c, _)| *c).collect();
        let mut received = 0usize;
        while next.iter().zip(&highs).any(|(n, h)| n < h) {
            assert!(
                started.elapsed() < STALL,
                "after {KILLS} kills, a new consumer of the group got {received} messages in {STALL:?}; \
                 per partition (next, high): {:?}; committed before: {before:?}",
                next.iter().zip(&highs).collect::<Vec<_>>()
            );
            let got = source.recv(64, Duration::from_millis(500)).await.unwrap();
            received += got.len();
            for r in &got {
                let p = usize::try_from(r.token.partition()).unwrap();
                next[p] = next[p].max(r.token.offset() + 1);
            }
            source
                .ack(got.into_iter().map(|r| r.token).collect())
                .await
                .unwrap();
        }
        eprintln!(
            "after {KILLS} kills: {received} messages ({left} left) in {:?}",
            started.elapsed()
        );
        source.close().await.unwrap();
        b.cleanup().await;
    }
}
