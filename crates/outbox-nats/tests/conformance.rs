//! The publisher conformance suite and NATS-specific checks, against the
//! real NATS JetStream server at `NATS_URL` (default `nats://127.0.0.1:4222`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use async_nats::jetstream;
use outbox_core::{ErrorCode, Outcome, Sink};
use outbox_nats::{NatsConfig, NatsError, NatsPublisher};
use outbox_testkit::publisher::{event, PublisherHarness, ReceivedMessage};
use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

struct NatsHarness {
    suffix: String,
    stream: String,
    client: async_nats::Client,
    js: jetstream::Context,
    max_payload: usize,
    next_seq: Mutex<u64>,
}

impl NatsHarness {
    async fn new() -> Self {
        let url = nats_url();
        let client = async_nats::connect(&url).await.unwrap_or_else(|e| {
            panic!("NATS is not reachable at {url} ({e}); start it (cargo xtask services) or set NATS_URL")
        });
        let suffix = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let h = Self {
            stream: format!("OUTBOX_TEST_{suffix}"),
            max_payload: client.server_info().max_payload,
            js: jetstream::new(client.clone()),
            client,
            suffix,
            next_seq: Mutex::new(1),
        };
        let publisher = NatsPublisher::from_client(h.js_client(), h.config());
        publisher
            .ensure_stream(&h.stream, &[&h.subject("orders")])
            .await
            .unwrap();
        h
    }

    fn js_client(&self) -> async_nats::Client {
        self.client.clone()
    }

    fn subject(&self, topic: &str) -> String {
        format!("outbox-test.{}.{topic}", self.suffix)
    }

    fn config(&self) -> NatsConfig {
        NatsConfig::from_url(&nats_url())
            .unwrap()
            .with_subject_prefix(format!("outbox-test.{}", self.suffix))
            .with_connect_attempts(3)
    }
}

fn to_received(m: jetstream::message::StreamMessage) -> ReceivedMessage {
    let mut headers = BTreeMap::new();
    for (name, values) in m.headers.iter() {
        if let Some(v) = values.first() {
            headers.insert(name.to_string(), v.as_str().to_owned());
        }
    }
    ReceivedMessage {
        payload: m.payload.to_vec(),
        event_id: headers.get("Nats-Msg-Id").and_then(|v| v.parse().ok()),
        key: headers.get(outbox_nats::HEADER_KEY).cloned(),
        event_type: headers.get(outbox_nats::HEADER_EVENT_TYPE).cloned(),
        headers,
    }
}

impl PublisherHarness for NatsHarness {
    type Sink = NatsPublisher;

    fn topic(&self) -> String {
        "orders".to_owned()
    }

    fn unknown_topic(&self) -> String {
        "unbound".to_owned()
    }

    fn max_payload_bytes(&self) -> usize {
        self.max_payload
    }

    fn broker_addr(&self) -> SocketAddr {
        let url = nats_url();
        let first = url.split(',').next().unwrap();
        let hostport = first.rsplit("://").next().unwrap();
        let hostport = hostport.rsplit('@').next().unwrap();
        hostport.to_socket_addrs().unwrap().next().unwrap()
    }

    async fn sink(&self) -> NatsPublisher {
        NatsPublisher::connect(self.config()).await.unwrap()
    }

    async fn sink_via(&self, addr: SocketAddr) -> NatsPublisher {
        let config = self
            .config()
            .with_servers([format!("nats://{addr}")])
            .unwrap()
            .with_ignore_discovered_servers(true)
            .with_ack_timeout(Duration::from_secs(2))
            .with_reconnect_delay_max(Duration::from_millis(300));
        NatsPublisher::connect(config).await.unwrap()
    }

    async fn consume(&self, n: usize) -> Vec<ReceivedMessage> {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let mut seq = self.next_seq.lock().await;
        let mut out = Vec::with_capacity(n);
        let deadline = Instant::now() + Duration::from_secs(30);
        while out.len() < n {
            match stream.get_raw_message(*seq).await {
                Ok(m) => {
                    out.push(to_received(m));
                    *seq += 1;
                }
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "only {} of {n} messages arrived in stream {} ({e})",
                        out.len(),
                        self.stream
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        out
    }

    async fn cleanup(&self) {
        let _ = self.js.delete_stream(&self.stream).await;
    }
}

outbox_testkit::publisher_conformance_tests!(NatsHarness::new().await);

async fn with_harness<F, Fut>(f: F)
where
    F: FnOnce(std::sync::Arc<NatsHarness>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let h = std::sync::Arc::new(NatsHarness::new().await);
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
        let mut stream = h.js.get_stream(&h.stream).await.unwrap();
        assert_eq!(stream.info().await.unwrap().state.messages, 1);
        let got = h.consume(1).await;
        assert_eq!(got[0].event_id, Some(e.id));
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
            got[0].headers.get("Content-Type").map(String::as_str),
            Some("application/octet-stream")
        );
        assert!(!got[0].headers.contains_key("Outbox-Key"));
        assert_eq!(
            got[1].headers.get("Content-Type").map(String::as_str),
            Some("application/json")
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
        let info = p.ensure_stream(&h.stream, &[&subject]).await.unwrap();
        assert_eq!(info.config.subjects, vec![subject.clone()]);
        let err = p
            .ensure_stream(&h.stream, &[&subject, &h.subject("other")])
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
