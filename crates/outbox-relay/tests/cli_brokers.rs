//! `outbox-relay run --sink nats://... | amqp://... | kafka://...`: the broker
//! sinks chosen from flags (issue 4 item 4, issue 5 item 5). A SQLite outbox
//! of committed events is relayed by the binary; the test then checks the
//! outbox drained with no dead letter (every event was acknowledged, not
//! returned as unroutable) and that the broker holds exactly that many
//! messages. Content checks live in the conformance and end-to-end suites.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
// Without a broker feature there is nothing to run.
#![cfg_attr(
    not(any(feature = "nats", feature = "amqp", feature = "kafka")),
    allow(dead_code, unused_imports)
)]

mod support;

use outbox_core::{DeadLetterQuery, DeadLetterStore, NewEvent};
use outbox_sqlite::{enqueue_batch, SqliteStore};
use outbox_testkit::process::ChildGuard;
use std::process::Stdio;
use std::time::{Duration, Instant};
use support::{relay, stop, wait_drained};

const EVENTS: usize = 50;

fn suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

/// Commits `EVENTS` events for `topic` into a fresh SQLite outbox.
async fn outbox_with_events(dir: &std::path::Path, topic: &str) -> (SqliteStore, String) {
    let url = format!("sqlite://{}", dir.join("outbox.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    let events: Vec<NewEvent> = (0..EVENTS)
        .map(|i| {
            NewEvent::new("cli.broker", topic, format!("{{\"n\":{i}}}").into_bytes())
                .with_key(format!("k{}", i % 5))
        })
        .collect();
    let mut tx = store.pool().begin().await.unwrap();
    enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    (store, url)
}

/// Runs `outbox-relay run` with `sink_args` until the outbox is drained
/// (bounded), stops it with SIGTERM and checks nothing was dead-lettered.
async fn relay_until_drained(store: &SqliteStore, url: &str, sink_args: &[&str]) {
    let mut child = ChildGuard::new(
        relay(&["run", "--store", url, "--poll-interval-ms", "100"])
            .args(sink_args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_drained(store, &mut child, Duration::from_secs(90)).await;
    stop(&mut child);
    let dead = store.list_dead(&DeadLetterQuery::default()).await.unwrap();
    assert!(dead.is_empty(), "dead letters: {dead:?}");
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_relays_to_nats_jetstream() {
    use outbox_nats::{NatsConfig, NatsPublisher};
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let s = suffix();
    let (prefix, stream) = (format!("outbox-cli.{s}"), format!("OUTBOX_CLI_{s}"));
    let admin = NatsPublisher::connect(NatsConfig::from_url(&url).unwrap())
        .await
        .unwrap_or_else(|e| {
            panic!("NATS is not reachable at {url} ({e}); start it or set NATS_URL")
        });
    admin
        .ensure_stream(&stream, &[&format!("{prefix}.>")])
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let (store, db) = outbox_with_events(dir.path(), "orders").await;
    relay_until_drained(
        &store,
        &db,
        &["--sink", &url, "--nats-subject-prefix", &prefix],
    )
    .await;

    let mut info = admin.jetstream().get_stream(&stream).await.unwrap();
    let messages = info.info().await.unwrap().state.messages;
    admin.jetstream().delete_stream(&stream).await.unwrap();
    assert_eq!(messages, EVENTS as u64);
}

#[cfg(feature = "amqp")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_relays_to_rabbitmq() {
    use outbox_amqp::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use outbox_amqp::lapin::types::FieldTable;
    use outbox_amqp::lapin::{Connection, ConnectionProperties};
    use outbox_amqp::{AmqpConfig, AmqpPublisher};
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let s = suffix();
    let (exchange, queue) = (format!("outbox-cli-{s}"), format!("outbox-cli-{s}"));
    let admin = AmqpPublisher::connect(AmqpConfig::from_url(&url).unwrap())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ is not reachable ({e}); start it or set AMQP_URL"));
    admin
        .declare_queue(&exchange, &queue, "orders.#")
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let (store, db) = outbox_with_events(dir.path(), "orders.created").await;
    relay_until_drained(&store, &db, &["--sink", &url, "--amqp-exchange", &exchange]).await;

    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let passive = QueueDeclareOptions {
        passive: true,
        durable: true,
        ..Default::default()
    };
    let q = channel
        .queue_declare(&queue, passive, FieldTable::default())
        .await
        .unwrap();
    let messages = q.message_count();
    channel
        .queue_delete(&queue, QueueDeleteOptions::default())
        .await
        .unwrap();
    channel
        .exchange_delete(&exchange, Default::default())
        .await
        .unwrap();
    admin.close().await;
    assert_eq!(messages as usize, EVENTS);
}

#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_relays_to_kafka() {
    use outbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use outbox_kafka::rdkafka::client::DefaultClientContext;
    use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
    use outbox_kafka::rdkafka::ClientConfig;
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let topic = format!("outbox-cli-{}", suffix());
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers);
    let admin: AdminClient<DefaultClientContext> = config.create().unwrap();
    let created = admin
        .create_topics(
            &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap_or_else(|e| {
            panic!("Kafka is not reachable at {brokers} ({e}); run `cargo xtask services`")
        });
    assert!(created.iter().all(Result::is_ok), "{created:?}");

    let dir = tempfile::tempdir().unwrap();
    let (store, db) = outbox_with_events(dir.path(), &topic).await;
    let sink = format!("kafka://{brokers}");
    relay_until_drained(
        &store,
        &db,
        &["--sink", &sink, "--kafka-property", "linger.ms=5"],
    )
    .await;

    // Read every message back (Tansu's watermarks are not a message count:
    // its offsets need not be dense).
    let consumer: BaseConsumer = {
        let mut c = config.clone();
        c.set("group.id", format!("outbox-cli-{}", suffix()))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false");
        c.create().unwrap()
    };
    consumer.subscribe(&[&topic]).unwrap();
    let mut ids = std::collections::HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while ids.len() < EVENTS && Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(500)) {
            use outbox_kafka::rdkafka::message::{Headers, Message};
            let id = m
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == outbox_core::headers::EVENT_ID))
                .and_then(|h| h.value.map(<[u8]>::to_vec));
            ids.insert(id);
        }
    }
    drop(consumer);
    let _ = admin.delete_topics(&[&topic], &AdminOptions::new()).await;
    assert_eq!(ids.len(), EVENTS, "distinct event ids read back");
}

/// `--wire-format envelope`: every message on the stream is the protobuf
/// envelope of its event, marked as such; the broker's dedup id is still
/// the event id.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_wire_format_envelope_delivers_envelopes_to_nats() {
    use outbox_core::{headers, Envelope};
    use outbox_core::{ENVELOPE_CONTENT_TYPE, ENVELOPE_MARKER};
    use outbox_testkit::nats::NatsFixture;
    use prost::Message as _;
    let h = NatsFixture::new().await;
    let subject = h.subject("orders");
    let prefix = subject.strip_suffix(".orders").unwrap().to_owned();
    let dir = tempfile::tempdir().unwrap();
    let (store, db) = outbox_with_events(dir.path(), "orders").await;
    relay_until_drained(
        &store,
        &db,
        &[
            "--sink",
            h.url(),
            "--nats-subject-prefix",
            &prefix,
            "--wire-format",
            "envelope",
        ],
    )
    .await;

    let got = h.next(EVENTS).await;
    let stored = h.stored().await;
    h.cleanup().await;
    assert_eq!(stored, EVENTS as u64);
    let mut payloads = std::collections::BTreeSet::new();
    for m in &got {
        assert_eq!(
            m.headers.get(headers::WIRE_FORMAT).map(String::as_str),
            Some(ENVELOPE_MARKER)
        );
        assert_eq!(
            m.headers.get(headers::CONTENT_TYPE).map(String::as_str),
            Some(ENVELOPE_CONTENT_TYPE)
        );
        let env = Envelope::decode(m.payload.as_slice()).expect("an Envelope body");
        assert_eq!(env.event_id(), m.message_id, "Nats-Msg-Id is the event id");
        assert_eq!(env.event_type, "cli.broker");
        assert_eq!(env.topic, "orders");
        assert_eq!(Some(env.key.as_str()), m.key.as_deref());
        assert!(env.created_at_unix_ms > 0 && env.attempt == 1, "{env:?}");
        assert_eq!(
            env.headers.get(headers::CONTENT_TYPE).map(String::as_str),
            Some(headers::DEFAULT_CONTENT_TYPE)
        );
        payloads.insert(String::from_utf8(env.payload).unwrap());
    }
    let expected: std::collections::BTreeSet<String> =
        (0..EVENTS).map(|i| format!("{{\"n\":{i}}}")).collect();
    assert_eq!(payloads, expected);
}

/// A wire format the relay does not know fails `run` before it opens
/// anything, naming the value and where it came from; `envelope` with a
/// JSON-lines sink is refused, not ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_refuses_an_unknown_wire_format() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let out = relay(&[
        "run",
        "--store",
        &db,
        "--migrate",
        "--sink",
        "stdout",
        "--wire-format",
        "json",
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--wire-format") && stderr.contains("\"json\""),
        "{stderr}"
    );
    assert!(stderr.contains("envelope"), "names the choices: {stderr}");

    let out = relay(&["run", "--store", &db, "--sink", "stdout"])
        .env("OUTBOX_WIRE_FORMAT", "envelope")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("OUTBOX_WIRE_FORMAT") && stderr.contains("broker sinks only"),
        "{stderr}"
    );
}

/// `--wire-format cloudevents-json --cloudevents-source ...`: every message
/// the relay sends is a structured CloudEvent (`ce-` prefix unused), read
/// by the spec-written reader: the required attributes, the key as
/// `subject` and `partitionkey`, the payload as JSON `data`; JetStream's
/// dedup id is still the event id.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_wire_format_cloudevents_delivers_cloudevents_to_nats() {
    use outbox_testkit::nats::NatsFixture;
    use outbox_testkit::publisher::wire::read_cloudevent;
    for format in ["cloudevents", "cloudevents-json"] {
        let h = NatsFixture::new().await;
        let subject = h.subject("orders");
        let prefix = subject.strip_suffix(".orders").unwrap().to_owned();
        let dir = tempfile::tempdir().unwrap();
        let (store, db) = outbox_with_events(dir.path(), "orders").await;
        relay_until_drained(
            &store,
            &db,
            &[
                "--sink",
                h.url(),
                "--nats-subject-prefix",
                &prefix,
                "--wire-format",
                format,
                "--cloudevents-source",
                "/shop/orders",
            ],
        )
        .await;
        let got = h.next(EVENTS).await;
        h.cleanup().await;
        let mut payloads = std::collections::BTreeSet::new();
        for m in &got {
            let ce = read_cloudevent(m, "ce-");
            let a = |n: &str| ce.attributes.get(n).cloned();
            assert_eq!(a("specversion").as_deref(), Some("1.0"), "{format}");
            assert_eq!(a("id"), m.message_id.map(|id| id.to_string()));
            assert_eq!(a("source").as_deref(), Some("/shop/orders"));
            assert_eq!(a("type").as_deref(), Some("cli.broker"));
            assert!(a("time").is_some());
            assert_eq!(a("subject"), a("partitionkey"));
            assert!(a("subject").unwrap().starts_with('k'));
            assert_eq!(
                ce.datacontenttype.as_deref(),
                Some("application/octet-stream")
            );
            payloads.insert(String::from_utf8(ce.data).unwrap());
        }
        let expected: std::collections::BTreeSet<String> =
            (0..EVENTS).map(|i| format!("{{\"n\":{i}}}")).collect();
        assert_eq!(payloads, expected, "{format}");
    }
}

/// A CloudEvents format without `--cloudevents-source`, or with a source
/// that is not a URI-reference, fails `run` at start naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_refuses_cloudevents_without_a_valid_source() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let base = [
        "run",
        "--store",
        db.as_str(),
        "--migrate",
        "--sink",
        "nats://127.0.0.1:4222",
        "--wire-format",
        "cloudevents",
    ];
    let out = relay(&base).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--wire-format") && stderr.contains("--cloudevents-source"),
        "{stderr}"
    );
    let out = relay(&base)
        .env("OUTBOX_CLOUDEVENTS_SOURCE", "two words")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("OUTBOX_CLOUDEVENTS_SOURCE") && stderr.contains("\"two words\""),
        "{stderr}"
    );
}
