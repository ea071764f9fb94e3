//! The publisher conformance suite and AMQP-specific checks, against the
//! real RabbitMQ at `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_amqp::lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use outbox_amqp::lapin::types::FieldTable;
use outbox_amqp::lapin::ExchangeKind;
use outbox_amqp::{AmqpConfig, AmqpPublisher};
use outbox_core::{ErrorCode, EventId, Outcome, Sink};
use outbox_testkit::amqp::{received, AmqpFixture};
use outbox_testkit::broker::Received;
use outbox_testkit::publisher::{event, PublisherHarness};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

// The shared fixture is the harness (`outbox-testkit`).
outbox_testkit::publisher_conformance_tests!(AmqpFixture::new().await);

async fn with_harness<F, Fut>(f: F)
where
    F: FnOnce(Arc<AmqpFixture>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let h = Arc::new(AmqpFixture::new().await);
    outbox_testkit::publisher::run_case(h, f).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_exchange_is_unroutable_and_spares_the_rest_of_the_batch() {
    with_harness(|h| async move {
        let sink = h.sink().await;
        let missing = format!("{}-missing/orders", h.exchange());
        let a = event("orders", Some("k"), b"a".to_vec());
        let b = event("orders", Some("k"), b"b".to_vec());
        let outcomes = sink
            .deliver(&[a.clone(), event(&missing, None, b"x".to_vec()), b.clone()])
            .await;
        assert_eq!(outcomes[0], Outcome::Delivered);
        match &outcomes[1] {
            Outcome::Failed(e) => {
                assert_eq!(e.code(), &ErrorCode::PUBLISH_UNROUTABLE);
                assert!(!e.is_retryable());
            }
            other => panic!("missing exchange reported {other:?}"),
        }
        assert_eq!(outcomes[2], Outcome::Delivered);
        let got = h.consume(2).await;
        assert_eq!(got[0].event_id(), Some(a.id));
        assert_eq!(got[1].event_id(), Some(b.id));
        // `exchange/routing.key` topics reach an existing exchange too.
        let c = event(&format!("{}/orders", h.exchange()), None, b"c".to_vec());
        assert_eq!(
            sink.deliver(std::slice::from_ref(&c)).await,
            vec![Outcome::Delivered]
        );
        assert_eq!(h.consume(1).await[0].event_id(), Some(c.id));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn message_properties_and_default_exchange_routing() {
    with_harness(|h| async move {
        // Default exchange "": the topic names the queue.
        let sink = AmqpPublisher::connect(h.config().with_exchange(""))
            .await
            .unwrap();
        let mut e = event(h.queue(), Some("k"), b"{}".to_vec());
        e.headers
            .insert("content-type".into(), "application/json".into());
        let plain = event(h.queue(), None, b"raw".to_vec());
        let outcomes = sink.deliver(&[e.clone(), plain.clone()]).await;
        assert!(outcomes.iter().all(Outcome::is_delivered), "{outcomes:?}");
        let got = h.next_from(h.queue(), 2).await;
        let p = &got[0].properties;
        assert_eq!(p.delivery_mode(), &Some(2));
        assert_eq!(
            p.message_id().as_ref().map(|s| s.as_str().to_owned()),
            Some(e.id.to_string())
        );
        assert_eq!(
            p.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(
            p.kind().as_ref().map(|s| s.as_str()),
            Some("conformance.event")
        );
        assert_eq!(
            got[1]
                .properties
                .content_type()
                .as_ref()
                .map(|s| s.as_str()),
            Some("application/octet-stream")
        );
        let r = received(&got[1]);
        assert_eq!(r.key, None);
        assert_eq!(
            r.headers.get("Outbox-Event-Id"),
            Some(&plain.id.to_string())
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn connect_failure_is_retryable_and_debug_hides_the_password() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    let config = AmqpConfig::from_url(&format!("amqp://guest:s3cr3t@{addr}/%2f"))
        .unwrap()
        .with_connect_attempts(2)
        .with_connect_timeout(Duration::from_secs(1));
    assert!(!format!("{config:?}").contains("s3cr3t"));
    let lazy = AmqpPublisher::lazy(config.clone());
    assert!(!format!("{lazy:?}").contains("s3cr3t"));
    let outcomes = lazy.deliver(&[event("orders", None, b"x".to_vec())]).await;
    match &outcomes[0] {
        Outcome::Failed(e) => {
            assert_eq!(e.code(), &ErrorCode::PUBLISH_CONNECTION_LOST);
            assert!(e.is_sink_unavailable(), "{e}");
            assert!(!e.message().contains("s3cr3t"));
        }
        other => panic!("without a broker: {other:?}"),
    }
    // The next batch does not try again at once: the reconnect gate
    // answers, naming the last error and when it tries again.
    let outcomes = lazy.deliver(&[event("orders", None, b"x".to_vec())]).await;
    match &outcomes[0] {
        Outcome::Failed(e) => {
            assert!(e.is_sink_unavailable(), "{e}");
            assert!(e.message().contains("next connection attempt in"), "{e}");
        }
        other => panic!("without a broker: {other:?}"),
    }
    let err = AmqpPublisher::connect(config).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert!(!err.to_string().contains("s3cr3t"), "{err}");
}

/// lapin hands a basic.return to whichever publisher confirm resolves next,
/// and RabbitMQ acknowledges a busy channel with multiple-acks: the return
/// of an unroutable message routinely rides on another message's confirm.
/// A full-speed window of 500 mandatory messages, every third one to a
/// routing key no queue is bound with: exactly those fail as
/// `PUBLISH_UNROUTABLE`, every other one is delivered and in the queue.
#[tokio::test(flavor = "multi_thread")]
async fn returns_are_matched_to_their_message_in_a_full_speed_mixed_window() {
    with_harness(|h| async move {
        const N: usize = 500;
        // A second queue on the exchange so that routable messages take
        // two routes (more work per confirm, more multiple-acks); it is
        // exclusive to the fixture's connection, gone when that closes.
        let channel = h.channel();
        let extra = format!("{}-all", h.queue());
        channel
            .exchange_declare(
                h.exchange(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .queue_declare(
                &extra,
                QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .queue_bind(
                &extra,
                h.exchange(),
                "orders",
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let sink = AmqpPublisher::connect(h.config().with_max_in_flight(N).with_persistent(false))
            .await
            .unwrap();
        for round in 0..3 {
            let events: Vec<_> = (0..N)
                .map(|i| {
                    let topic = if i % 3 == 2 { "unbound" } else { "orders" };
                    event(
                        topic,
                        Some(&format!("k{}", i % 7)),
                        format!("{round}-{i}").into_bytes(),
                    )
                })
                .collect();
            let outcomes = sink.deliver(&events).await;
            assert_eq!(outcomes.len(), N);
            let mut wanted = HashSet::new();
            for (i, (e, o)) in events.iter().zip(&outcomes).enumerate() {
                if i % 3 == 2 {
                    match o {
                        Outcome::Failed(err) => {
                            assert_eq!(
                                err.code(),
                                &ErrorCode::PUBLISH_UNROUTABLE,
                                "round {round} #{i}: {err}"
                            );
                            assert!(!err.is_retryable());
                        }
                        other => panic!("round {round}: unroutable #{i} reported {other:?}"),
                    }
                } else {
                    assert_eq!(o, &Outcome::Delivered, "round {round}: routable #{i}");
                    wanted.insert(e.id);
                }
            }
            let got: HashSet<EventId> = h
                .consume(wanted.len())
                .await
                .iter()
                .filter_map(Received::event_id)
                .collect();
            assert_eq!(
                got, wanted,
                "round {round}: the queue holds exactly the delivered events"
            );
            assert_eq!(h.message_count().await, 0, "nothing else in the queue");
        }
    })
    .await;
}
