//! The publisher conformance suite and NATS-specific checks, against the
//! real NATS JetStream server at `NATS_URL` (default `nats://127.0.0.1:4222`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_core::{ErrorCode, Outcome, Sink};
use outbox_nats::{NatsConfig, NatsError, NatsPublisher};
use outbox_testkit::nats::NatsFixture;
use outbox_testkit::publisher::{event, PublisherHarness};
use std::time::Duration;

// The shared fixture is the harness (`outbox-testkit`).
outbox_testkit::publisher_conformance_tests!(NatsFixture::new().await);

async fn with_harness<F, Fut>(f: F)
where
    F: FnOnce(std::sync::Arc<NatsFixture>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let h = std::sync::Arc::new(NatsFixture::new().await);
    outbox_testkit::publisher::run_case(h, f).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn republished_event_is_deduplicated_by_msg_id() {
    with_harness(|h| async move {
        let sink = h.sink().await;
        let e = event("orders", Some("k"), b"once".to_vec());
        assert_eq!(
            sink.deliver(std::slice::from_ref(&e)).await,
            vec![Outcome::Delivered]
        );
        assert_eq!(
            sink.deliver(std::slice::from_ref(&e)).await,
            vec![Outcome::Delivered]
        );
        assert_eq!(h.stored().await, 1);
        let got = h.consume(1).await;
        assert_eq!(got[0].event_id(), Some(e.id));
        assert_eq!(
            got[0].headers.get("Outbox-Event-Id"),
            Some(&e.id.to_string())
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn content_type_defaults_to_octet_stream() {
    with_harness(|h| async move {
        let sink = h.sink().await;
        let plain = event("orders", None, b"x".to_vec());
        let mut json = event("orders", None, b"{}".to_vec());
        json.headers
            .insert("content-type".into(), "application/json".into());
        let outcomes = sink.deliver(&[plain, json]).await;
        assert!(outcomes.iter().all(Outcome::is_delivered));
        let got = h.consume(2).await;
        assert_eq!(
            got[0].headers.get("content-type").map(String::as_str),
            Some("application/octet-stream")
        );
        assert!(!got[0].headers.contains_key("Outbox-Key"));
        assert_eq!(
            got[1].headers.get("content-type").map(String::as_str),
            Some("application/json")
        );
        // One spelling only: the event's own header is not sent twice.
        assert!(
            !got[1].headers.contains_key("Content-Type"),
            "{:?}",
            got[1].headers
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn unroutable_can_be_configured_retryable_and_wildcards_are_invalid() {
    with_harness(|h| async move {
        let sink = NatsPublisher::connect(h.config().with_unroutable_retryable(true))
            .await
            .unwrap();
        let o = sink
            .deliver(&[
                event("unbound", None, b"x".to_vec()),
                event("orders.*", None, b"x".to_vec()),
            ])
            .await;
        match &o[0] {
            Outcome::Failed(e) => {
                assert_eq!(e.code(), &ErrorCode::PUBLISH_UNROUTABLE);
                assert!(e.is_retryable());
            }
            other => panic!("{other:?}"),
        }
        match &o[1] {
            Outcome::Failed(e) => {
                assert_eq!(e.code(), &ErrorCode::PUBLISH_INVALID);
                assert!(!e.is_retryable());
            }
            other => panic!("{other:?}"),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ensure_stream_is_idempotent_and_detects_mismatch() {
    with_harness(|h| async move {
        let p = h.sink().await;
        let subject = h.subject("orders");
        let info = p.ensure_stream(h.stream(), &[&subject]).await.unwrap();
        assert_eq!(info.config.subjects, vec![subject.clone()]);
        let err = p
            .ensure_stream(h.stream(), &[&subject, &h.subject("other")])
            .await
            .unwrap_err();
        assert!(matches!(err, NatsError::StreamMismatch { .. }), "{err}");
        assert!(!err.is_retryable());
    })
    .await;
}

#[tokio::test]
async fn connect_failure_is_retryable_and_debug_hides_secrets() {
    // A port nothing listens on.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    let config = NatsConfig::from_url(&format!("nats://alice:s3cret@{addr}"))
        .unwrap()
        .with_connect_attempts(2)
        .with_connect_timeout(Duration::from_secs(1));
    assert!(!format!("{config:?}").contains("s3cret"));
    let err = NatsPublisher::connect(config).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert!(!err.to_string().contains("s3cret"), "{err}");
}

/// A stream keeping copies apart for less time than the relay may take to
/// send an event again is named in one WARN, at its first PubAck (the
/// stream's default 2 min window is not, against a 1 min need).
#[tokio::test]
async fn a_dedup_window_shorter_than_the_relay_needs_is_named_once() {
    let h = NatsFixture::new().await;
    let (logs, _guard) = outbox_testkit::logs::LogCapture::start(tracing::Level::WARN);
    let needs = |min: Duration| NatsPublisher::connect(h.config().with_min_dedup_window(min));
    let short = needs(Duration::from_secs(600)).await.unwrap();
    for n in 0..3 {
        let e = event(&h.topic(), Some("k"), vec![n]);
        assert_eq!(short.deliver(&[e]).await, vec![Outcome::Delivered]);
    }
    assert_eq!(
        logs.lines("WARN", "dedup window is shorter than the relay needs"),
        1,
        "{}",
        logs.text()
    );
    assert!(logs.contains(h.stream()), "{}", logs.text());
    let enough = needs(Duration::from_secs(60)).await.unwrap();
    let e = event(&h.topic(), Some("k"), vec![9]);
    assert_eq!(enough.deliver(&[e]).await, vec![Outcome::Delivered]);
    assert_eq!(
        logs.lines("WARN", "dedup window is shorter than the relay needs"),
        1
    );
    h.cleanup().await;
}
