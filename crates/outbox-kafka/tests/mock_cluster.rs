//! Fault tests against librdkafka's in-process mock cluster
//! (`rdkafka::mocking`): brokers down and request errors while events are in
//! flight. The mock cluster stands in for a broker only here, where faults
//! must be injected on demand; the conformance suite runs against Tansu.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use outbox_core::{ErrorCode, Event, EventId, Outcome, Sink};
use outbox_kafka::rdkafka::mocking::MockCluster;
use outbox_kafka::rdkafka::producer::Producer;
use outbox_kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use outbox_kafka::{KafkaConfig, KafkaPublisher, UnknownTopic};
use outbox_testkit::broker::Received;
use outbox_testkit::kafka::{message_count, read_back, topic_name};
use outbox_testkit::publisher::assert_unavailable;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

/// An event as a relay would have claimed it, with trace headers.
fn event(topic: &str, key: Option<&str>, n: usize) -> Event {
    let mut e = outbox_testkit::publisher::event(topic, key, format!("payload-{n}").into_bytes());
    e.event_type = "test.event".to_owned();
    e.headers = BTreeMap::from([
        (
            "traceparent".to_owned(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
        ),
        ("tracestate".to_owned(), "vendor=value".to_owned()),
        ("x-n".to_owned(), n.to_string()),
    ]);
    e
}

const PARTITIONS: i32 = 3;

type Mock = MockCluster<'static, outbox_kafka::rdkafka::producer::DefaultProducerContext>;

fn cluster(topic: &str) -> Mock {
    let mock = MockCluster::new(3).unwrap();
    mock.create_topic(topic, PARTITIONS, 3).unwrap();
    mock
}

/// A fresh topic named after `name` on a new mock cluster, and the
/// cluster's bootstrap servers.
fn mock_topic(name: &str) -> (String, Mock, String) {
    let topic = topic_name(name);
    let mock = cluster(&topic);
    let brokers = mock.bootstrap_servers();
    (topic, mock, brokers)
}

/// Delivers one event for `key` (warming up metadata and the producer id)
/// and asserts it was delivered; returns it.
async fn warm_up(publisher: &KafkaPublisher, topic: &str, key: &str) -> Vec<Event> {
    let warm = vec![event(topic, Some(key), 0)];
    assert_eq!(publisher.deliver(&warm).await, vec![Outcome::Delivered]);
    warm
}

/// `outcome` is a failure with `code`, retryable or not as `retryable` says.
fn assert_failed(outcome: &Outcome, code: &ErrorCode, retryable: bool, context: &str) {
    match outcome {
        Outcome::Failed(e) => {
            assert_eq!(e.code(), code, "{context}: {e}");
            assert_eq!(e.is_retryable(), retryable, "{context}: {e}");
        }
        other => panic!("{context}: expected {code:?}, got {other:?}"),
    }
}

fn ids(events: &[Event]) -> BTreeSet<EventId> {
    events.iter().map(|e| e.id).collect()
}

fn received_ids(received: &[Received]) -> BTreeSet<EventId> {
    received.iter().filter_map(Received::event_id).collect()
}

/// Reads the topic back: every event of `warm` and `events` is there, and
/// (when `exactly`) nothing else, no duplicate.
async fn assert_topic_holds(
    brokers: &str,
    topic: &str,
    warm: &[Event],
    events: &[Event],
    exactly: bool,
) {
    let all: Vec<Event> = warm.iter().chain(events).cloned().collect();
    let got = read_back(brokers, topic, PARTITIONS, all.len()).await;
    assert_eq!(received_ids(&got), ids(&all));
    let stored = message_count(brokers, topic, PARTITIONS);
    if exactly {
        assert_eq!(stored, all.len() as i64, "duplicates");
    } else {
        assert!(stored >= all.len() as i64);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn delivers_with_key_headers_and_per_key_order() {
    let (topic, _mock, brokers) = mock_topic("mock-basic");
    let publisher = KafkaPublisher::new(KafkaConfig::new(&brokers)).unwrap();
    let keys = ["a", "b", "c", "d"];
    let events: Vec<_> = (0..40)
        .map(|n| event(&topic, Some(keys[n % keys.len()]), n))
        .chain([event(&topic, None, 40)])
        .collect();

    let outcomes = publisher.deliver(&events).await;
    assert_eq!(outcomes, vec![Outcome::Delivered; events.len()]);

    let got = read_back(&brokers, &topic, PARTITIONS, events.len()).await;
    assert_eq!(received_ids(&got), ids(&events));
    assert_eq!(
        message_count(&brokers, &topic, PARTITIONS),
        events.len() as i64
    );
    // Key, headers, payload per event.
    for ev in &events {
        let r = got.iter().find(|r| r.event_id() == Some(ev.id)).unwrap();
        // A keyless event is keyed by its id, which the reader reports as keyless.
        assert_eq!(r.key, ev.key);
        assert_eq!(r.payload, ev.payload);
        assert_eq!(r.headers[outbox_core::headers::EVENT_TYPE], "test.event");
        assert_eq!(r.headers["content-type"], "application/octet-stream");
        assert_eq!(r.headers["traceparent"], ev.headers["traceparent"]);
        assert_eq!(r.headers["tracestate"], "vendor=value");
        assert_eq!(r.headers["x-n"], ev.headers["x-n"]);
    }
    // One partition per key, and in that partition the key's events in enqueue order.
    let mut by_key: BTreeMap<&str, Vec<&Received>> = BTreeMap::new();
    for r in got.iter().filter(|r| r.key.is_some()) {
        by_key.entry(r.key.as_deref().unwrap()).or_default().push(r);
    }
    for key in keys {
        let mut msgs = by_key.remove(key).unwrap();
        let partitions: BTreeSet<Option<i32>> = msgs.iter().map(|r| r.partition).collect();
        assert_eq!(partitions.len(), 1, "key {key} spread over {partitions:?}");
        msgs.sort_by_key(|r| r.offset);
        let order: Vec<EventId> = msgs.iter().filter_map(|r| r.event_id()).collect();
        let expected: Vec<EventId> = events
            .iter()
            .filter(|e| e.key.as_deref() == Some(key))
            .map(|e| e.id)
            .collect();
        assert_eq!(order, expected, "order of key {key}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn brokers_down_then_up_while_in_flight_delivers_everything_once() {
    let (topic, mock, brokers) = mock_topic("mock-down-up");
    let publisher = Arc::new(
        KafkaPublisher::new(
            KafkaConfig::new(&brokers).with_delivery_timeout(Duration::from_secs(120)),
        )
        .unwrap(),
    );
    // Warm up (metadata, producer id) so the outage hits produce requests.
    let warm = warm_up(&publisher, &topic, "k0").await;

    mock.broker_down(-1).unwrap();
    let events: Vec<_> = (1..=30)
        .map(|n| event(&topic, Some(&format!("k{}", n % 5)), n))
        .collect();
    let task = {
        let publisher = publisher.clone();
        let events = events.clone();
        tokio::spawn(async move { publisher.deliver(&events).await })
    };
    // Keep the brokers down until librdkafka has taken the whole batch.
    while (publisher.producer().in_flight_count()) < events.len() as i32 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Nothing can have been acknowledged while every broker is down.
    assert!(
        !task.is_finished(),
        "deliver returned while all brokers were down"
    );
    mock.broker_up(-1).unwrap();

    let outcomes = task.await.unwrap();
    assert_eq!(outcomes, vec![Outcome::Delivered; events.len()]);
    assert_topic_holds(&brokers, &topic, &warm, &events, true).await;
}

/// A relay drops a delivery at its lease end (by its own clock) while every
/// broker is down: librdkafka must not keep the messages and send them once
/// a broker is back, after another relay took the events over and
/// published the key's later ones (a stale copy last). The dropped delivery
/// purges what librdkafka still queues; the producer works on afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_delivery_leaves_nothing_to_send_later() {
    let (topic, mock, brokers) = mock_topic("mock-dropped");
    // librdkafka's default send timeout: without the purge the message
    // waits that long for a broker.
    let old = KafkaPublisher::new(KafkaConfig::new(&brokers)).unwrap();
    let warm = warm_up(&old, &topic, "k").await;

    mock.broker_down(-1).unwrap();
    let first = vec![event(&topic, Some("k"), 1)];
    let dropped = tokio::time::timeout(Duration::from_millis(300), old.deliver(&first)).await;
    assert!(dropped.is_err(), "delivered while every broker was down");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while old.producer().in_flight_count() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "librdkafka still holds {} message(s) of the dropped delivery",
            old.producer().in_flight_count()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    mock.broker_up(-1).unwrap();

    // The relay that took the events over: the key's event again, then its
    // next one.
    let new = KafkaPublisher::new(KafkaConfig::new(&brokers)).unwrap();
    let taken_over = [first[0].clone(), event(&topic, Some("k"), 2)];
    assert_eq!(
        new.deliver(&taken_over[..1]).await,
        vec![Outcome::Delivered]
    );
    assert_eq!(
        new.deliver(&taken_over[1..]).await,
        vec![Outcome::Delivered]
    );
    // The old producer still delivers (its idempotence sequence skipped the
    // purged message).
    let later = vec![event(&topic, Some("k"), 3)];
    let mut outcome = Vec::new();
    for _ in 0..20 {
        outcome = old.deliver(&later).await;
        if outcome == vec![Outcome::Delivered] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(outcome, vec![Outcome::Delivered]);
    let sent: Vec<Event> = taken_over.iter().chain(&later).cloned().collect();
    // Each once: no late copy of the first event from the old producer.
    assert_topic_holds(&brokers, &topic, &warm, &sent, true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn brokers_down_past_the_timeout_fail_unavailable_then_redelivery_succeeds() {
    let (topic, mock, brokers) = mock_topic("mock-timeout");
    let publisher = KafkaPublisher::new(
        KafkaConfig::new(&brokers).with_delivery_timeout(Duration::from_secs(2)),
    )
    .unwrap();
    let warm = warm_up(&publisher, &topic, "k").await;

    mock.broker_down(-1).unwrap();
    let events: Vec<_> = (1..=10).map(|n| event(&topic, Some("k"), n)).collect();
    let outcomes = publisher.deliver(&events).await;
    for o in &outcomes {
        assert_unavailable(o, "every broker down");
        match o {
            Outcome::Failed(e) => assert_eq!(e.code(), &ErrorCode::PUBLISH_TIMEOUT, "{e}"),
            other => panic!("reported {other:?} while every broker was down"),
        }
    }
    mock.broker_up(-1).unwrap();

    // The relay retries the events that failed, as often as its retry
    // policy allows, until they are delivered (librdkafka may still be in
    // its reconnect backoff for the first rounds).
    let mut left = events.clone();
    for _round in 0..30 {
        if left.is_empty() {
            break;
        }
        let outcomes = publisher.deliver(&left).await;
        left = left
            .into_iter()
            .zip(outcomes)
            .filter_map(|(e, o)| {
                if o.is_delivered() {
                    None
                } else {
                    assert_unavailable(&o, "librdkafka still reconnecting");
                    Some(e)
                }
            })
            .collect();
    }
    assert!(left.is_empty(), "{} events never delivered", left.len());
    // Every event at least once; a timed-out send may also have landed
    // ("maybe delivered"), which the consumer dedups by Outbox-Event-Id.
    assert_topic_holds(&brokers, &topic, &warm, &events, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn retriable_request_errors_are_retried_without_duplicates() {
    let (topic, mock, brokers) = mock_topic("mock-req-errors");
    let publisher = KafkaPublisher::new(KafkaConfig::new(&brokers)).unwrap();
    let warm = warm_up(&publisher, &topic, "k").await;

    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__TRANSPORT,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        ],
    );
    let events: Vec<_> = (1..=20)
        .map(|n| event(&topic, Some(&format!("k{}", n % 3)), n))
        .collect();
    let outcomes = publisher.deliver(&events).await;
    assert_eq!(outcomes, vec![Outcome::Delivered; events.len()]);

    assert_topic_holds(&brokers, &topic, &warm, &events, true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn message_too_large_is_permanent_and_does_not_block_the_batch() {
    let (topic, _mock, brokers) = mock_topic("mock-too-large");
    let publisher =
        KafkaPublisher::new(KafkaConfig::new(&brokers).with_property("message.max.bytes", "10000"))
            .unwrap();
    let mut big = event(&topic, Some("k"), 1);
    big.payload = vec![b'x'; 20_000];
    let events = vec![
        event(&topic, Some("k"), 0),
        big,
        event(&topic, Some("k"), 2),
    ];
    let outcomes = publisher.deliver(&events).await;
    assert_eq!(outcomes[0], Outcome::Delivered);
    assert_eq!(outcomes[2], Outcome::Delivered);
    assert_failed(
        &outcomes[1],
        &ErrorCode::PUBLISH_TOO_LARGE,
        false,
        "client-side too large",
    );
    let got = read_back(&brokers, &topic, PARTITIONS, 2).await;
    assert_eq!(
        received_ids(&got),
        ids(&[events[0].clone(), events[2].clone()])
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn broker_rejecting_as_too_large_is_permanent() {
    let (topic, mock, brokers) = mock_topic("mock-broker-too-large");
    let publisher = KafkaPublisher::new(KafkaConfig::new(&brokers)).unwrap();
    warm_up(&publisher, &topic, "k").await;
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    let events = vec![event(&topic, Some("k"), 1)];
    let outcomes = publisher.deliver(&events).await;
    assert_failed(
        &outcomes[0],
        &ErrorCode::PUBLISH_TOO_LARGE,
        false,
        "broker-side too large",
    );
    // The producer keeps working afterwards.
    let next = vec![event(&topic, Some("k"), 2)];
    assert_eq!(publisher.deliver(&next).await, vec![Outcome::Delivered]);
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_topic_follows_the_configured_policy() {
    let (topic, mock, brokers) = mock_topic("mock-known");
    let missing = topic_name("mock-missing");
    mock.topic_error(
        &missing,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART,
    )
    .unwrap();
    for (policy, retryable) in [
        (UnknownTopic::Permanent, false),
        (UnknownTopic::Retryable, true),
    ] {
        let publisher = KafkaPublisher::new(
            KafkaConfig::new(&brokers)
                .with_unknown_topic(policy)
                .with_property("topic.metadata.propagation.max.ms", "100")
                .with_property("allow.auto.create.topics", "false"),
        )
        .unwrap();
        let events = vec![event(&missing, Some("k"), 0), event(&topic, Some("k"), 1)];
        let outcomes = publisher.deliver(&events).await;
        assert_eq!(outcomes[1], Outcome::Delivered);
        assert_failed(
            &outcomes[0],
            &ErrorCode::PUBLISH_UNROUTABLE,
            retryable,
            &format!("{policy:?}"),
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn fatal_producer_error_fails_unavailable_and_replaces_the_producer() {
    let (topic, mock, brokers) = mock_topic("mock-fatal");
    let publisher = KafkaPublisher::new(KafkaConfig::new(&brokers)).unwrap();
    let warm = warm_up(&publisher, &topic, "k").await;
    assert_eq!(publisher.producers_recreated(), 0);

    // A sequence desynchronisation on the head-of-line request: librdkafka
    // raises a fatal idempotence error and the producer instance is unusable.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER],
    );
    let events: Vec<_> = (1..=5).map(|n| event(&topic, Some("k"), n)).collect();
    let outcomes = publisher.deliver(&events).await;
    for o in &outcomes {
        // The producer's failure, not the events': no attempt counted.
        assert_unavailable(o, "fatal producer error");
    }
    assert_eq!(publisher.producers_recreated(), 1);

    // The relay retries them on the fresh producer.
    assert_eq!(
        publisher.deliver(&events).await,
        vec![Outcome::Delivered; events.len()]
    );
    assert_topic_holds(&brokers, &topic, &warm, &events, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn connect_checks_that_a_broker_answers() {
    let topic = topic_name("mock-connect");
    let mock = cluster(&topic);
    let publisher = KafkaPublisher::connect(KafkaConfig::new(mock.bootstrap_servers()))
        .await
        .unwrap();
    let e = vec![event(&topic, Some("k"), 0)];
    assert_eq!(publisher.deliver(&e).await, vec![Outcome::Delivered]);

    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let policy = outbox_broker::ConnectPolicy::default()
        .with_attempts(2)
        .with_timeout(Duration::from_secs(1));
    let err =
        KafkaPublisher::connect(KafkaConfig::new(closed.to_string()).with_connect_policy(policy))
            .await
            .unwrap_err();
    assert!(
        matches!(err, outbox_kafka::KafkaError::Unreachable(_)),
        "{err}"
    );
}
