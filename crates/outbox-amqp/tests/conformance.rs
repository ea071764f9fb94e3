//! The publisher conformance suite and AMQP-specific checks, against the
//! real RabbitMQ at `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use lapin::options::{BasicGetOptions, ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::types::AMQPValue;
use lapin::{Connection, ConnectionProperties};
use outbox_amqp::{AmqpConfig, AmqpPublisher};
use outbox_core::{ErrorCode, Outcome, Sink};
use outbox_testkit::publisher::{event, PublisherHarness, ReceivedMessage};
use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAX: usize = 1024 * 1024;

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// (scheme, user-info with '@' or "", host:port, rest of the URI)
fn split_uri(uri: &str) -> (String, String, String, String) {
    let i = uri.find("://").unwrap();
    let (scheme, rest) = (&uri[..i + 3], &uri[i + 3..]);
    let end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = (&rest[..end], &rest[end..]);
    let (userinfo, hostport) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    let hostport = if hostport.contains(':') {
        hostport.to_owned()
    } else {
        format!("{hostport}:5672")
    };
    (scheme.into(), userinfo.into(), hostport, path.into())
}

struct AmqpHarness {
    exchange: String,
    queue: String,
    connection: Connection,
    channel: lapin::Channel,
}

impl AmqpHarness {
    async fn new() -> Self {
        let url = amqp_url();
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "RabbitMQ is not reachable at {} ({e}); start it or set AMQP_URL",
                    outbox_amqp::redact_uri(&url)
                )
            });
        let channel = connection.create_channel().await.unwrap();
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..12];
        let h = Self {
            exchange: format!("outbox-test-{suffix}"),
            queue: format!("outbox-test-{suffix}"),
            connection,
            channel,
        };
        let p = AmqpPublisher::connect(h.config()).await.unwrap();
        p.declare_queue(&h.exchange, &h.queue, "orders")
            .await
            .unwrap();
        p.close().await;
        h
    }

    fn config(&self) -> AmqpConfig {
        AmqpConfig::from_url(&amqp_url())
            .unwrap()
            .with_exchange(&self.exchange)
            .with_max_message_bytes(MAX)
    }
}

fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

fn to_received(d: &lapin::message::Delivery) -> ReceivedMessage {
    let mut headers = BTreeMap::new();
    if let Some(table) = d.properties.headers() {
        for (k, v) in table.inner() {
            if let Some(t) = text(v) {
                headers.insert(k.as_str().to_owned(), t);
            }
        }
    }
    ReceivedMessage {
        payload: d.data.clone(),
        event_id: d
            .properties
            .message_id()
            .as_ref()
            .and_then(|s| s.as_str().parse().ok()),
        key: headers.get(outbox_amqp::HEADER_KEY).cloned(),
        event_type: d.properties.kind().as_ref().map(|s| s.as_str().to_owned()),
        headers,
    }
}

impl AmqpHarness {
    async fn get(&self, queue: &str, n: usize) -> Vec<lapin::message::Delivery> {
        let mut out = Vec::with_capacity(n);
        let deadline = Instant::now() + Duration::from_secs(30);
        while out.len() < n {
            let got = self
                .channel
                .basic_get(queue, BasicGetOptions { no_ack: true })
                .await
                .unwrap();
            match got {
                Some(m) => out.push(m.delivery),
                None => {
                    assert!(
                        Instant::now() < deadline,
                        "only {} of {n} messages arrived in queue {queue}",
                        out.len()
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        out
    }
}

impl PublisherHarness for AmqpHarness {
    type Sink = AmqpPublisher;

    fn topic(&self) -> String {
        "orders".to_owned()
    }

    fn unknown_topic(&self) -> String {
        "unbound".to_owned()
    }

    fn max_payload_bytes(&self) -> usize {
        MAX
    }

    fn broker_addr(&self) -> SocketAddr {
        let (_, _, hostport, _) = split_uri(&amqp_url());
        hostport.to_socket_addrs().unwrap().next().unwrap()
    }

    async fn sink(&self) -> AmqpPublisher {
        AmqpPublisher::connect(self.config()).await.unwrap()
    }

    async fn sink_via(&self, addr: SocketAddr) -> AmqpPublisher {
        let (scheme, userinfo, _, path) = split_uri(&amqp_url());
        let uri = format!("{scheme}{userinfo}{addr}{path}");
        let config = AmqpConfig::from_url(&uri)
            .unwrap()
            .with_exchange(&self.exchange)
            .with_connect_attempts(2)
            .with_connect_timeout(Duration::from_secs(2))
            .with_confirm_timeout(Duration::from_secs(5));
        AmqpPublisher::connect(config).await.unwrap()
    }

    async fn consume(&self, n: usize) -> Vec<ReceivedMessage> {
        self.get(&self.queue, n)
            .await
            .iter()
            .map(to_received)
            .collect()
    }

    async fn cleanup(&self) {
        let _ = self
            .channel
            .queue_delete(&self.queue, QueueDeleteOptions::default())
            .await;
        let _ = self
            .channel
            .exchange_delete(&self.exchange, ExchangeDeleteOptions::default())
            .await;
        let _ = self.connection.close(200, "test done").await;
    }
}

outbox_testkit::publisher_conformance_tests!(AmqpHarness::new().await);

async fn with_harness<F, Fut>(f: F)
where
    F: FnOnce(Arc<AmqpHarness>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let h = Arc::new(AmqpHarness::new().await);
    outbox_testkit::publisher::run_case(h, f).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_exchange_is_unroutable_and_spares_the_rest_of_the_batch() {
    with_harness(|h| async move {
        let sink = h.sink().await;
        let missing = format!("{}-missing/orders", h.exchange);
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
            Outcome::Delivered => panic!("missing exchange reported delivered"),
        }
        assert_eq!(outcomes[2], Outcome::Delivered);
        let got = h.consume(2).await;
        assert_eq!(got[0].event_id, Some(a.id));
        assert_eq!(got[1].event_id, Some(b.id));
        // `exchange/routing.key` topics reach an existing exchange too.
        let c = event(&format!("{}/orders", h.exchange), None, b"c".to_vec());
        assert_eq!(
            sink.deliver(std::slice::from_ref(&c)).await,
            vec![Outcome::Delivered]
        );
        assert_eq!(h.consume(1).await[0].event_id, Some(c.id));
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
        let mut e = event(&h.queue, Some("k"), b"{}".to_vec());
        e.headers
            .insert("content-type".into(), "application/json".into());
        let plain = event(&h.queue, None, b"raw".to_vec());
        let outcomes = sink.deliver(&[e.clone(), plain.clone()]).await;
        assert!(outcomes.iter().all(Outcome::is_delivered), "{outcomes:?}");
        let got = h.get(&h.queue, 2).await;
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
        let r = to_received(&got[1]);
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
            assert!(e.is_retryable());
            assert!(!e.message().contains("s3cr3t"));
        }
        Outcome::Delivered => panic!("delivered without a broker"),
    }
    let err = AmqpPublisher::connect(config).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert!(!err.to_string().contains("s3cr3t"), "{err}");
}
