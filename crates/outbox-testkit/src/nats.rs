//! The NATS JetStream fixture (feature `nats`): one stream per test,
//! a publisher configured for it, and a reader of what the stream holds.

use crate::broker::{first_socket_addr, nats_url, unique_suffix, Received};
use crate::publisher::PublisherHarness;
use outbox_nats::async_nats::{self, jetstream};
use outbox_nats::{NatsConfig, NatsPublisher, HEADER_MSG_ID};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

/// How long a read waits for messages that have not arrived yet.
const READ_BOUND: Duration = Duration::from_secs(30);

/// A stream of this test alone (`OUTBOX_TEST_<random>`) capturing the
/// subject of [`NatsFixture::topic`] under a prefix of its own
/// (`outbox-test.<random>`), on the server at `NATS_URL`.
#[derive(Debug)]
pub struct NatsFixture {
    url: String,
    prefix: String,
    stream: String,
    client: async_nats::Client,
    js: jetstream::Context,
    next_seq: Mutex<u64>,
}

impl NatsFixture {
    /// Connects to `NATS_URL` and creates the stream; panics with a clear
    /// message when the server cannot be reached.
    pub async fn new() -> Self {
        let url = nats_url();
        let client = async_nats::connect(&url).await.unwrap_or_else(|e| {
            panic!(
                "NATS is not reachable at {} ({e}); start it (`cargo xtask services`) or set NATS_URL",
                outbox_core::redact_url(&url)
            )
        });
        let suffix = unique_suffix();
        let f = Self {
            url,
            prefix: format!("outbox-test.{suffix}"),
            stream: format!("OUTBOX_TEST_{suffix}"),
            js: jetstream::new(client.clone()),
            client,
            next_seq: Mutex::new(1),
        };
        NatsPublisher::from_client(f.client.clone(), f.config())
            .ensure_stream(&f.stream, &[&f.subject(&f.topic())])
            .await
            .expect("create the test stream");
        f
    }

    /// The server URL(s).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The stream's name.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The topic whose events land in the stream.
    pub fn topic(&self) -> String {
        "orders".to_owned()
    }

    /// A topic no stream captures.
    pub fn unknown_topic(&self) -> String {
        "unbound".to_owned()
    }

    /// The subject a topic is published to.
    pub fn subject(&self, topic: &str) -> String {
        format!("{}.{topic}", self.prefix)
    }

    /// The server's `max_payload`.
    pub fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }

    /// The publisher configuration for this stream's subjects.
    pub fn config(&self) -> NatsConfig {
        self.config_for(&self.url)
    }

    /// [`config`](Self::config) with other server URL(s), e.g. a proxy's.
    pub fn config_for(&self, servers: &str) -> NatsConfig {
        NatsConfig::from_url(servers)
            .expect("valid NATS URL")
            .with_subject_prefix(&self.prefix)
            .with_connect_attempts(3)
    }

    /// A connected publisher.
    pub async fn sink(&self) -> NatsPublisher {
        NatsPublisher::connect(self.config())
            .await
            .expect("connect the publisher")
    }

    /// The server's TCP address (the first URL's).
    pub fn broker_addr(&self) -> SocketAddr {
        first_socket_addr(&self.url, 4222)
    }

    /// The JetStream context of the fixture's own connection.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// Messages the stream holds.
    pub async fn stored(&self) -> u64 {
        let mut stream = self.js.get_stream(&self.stream).await.expect("stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// The next `n` messages of the stream, in stream order (a cursor kept
    /// across calls). Panics when they do not arrive within 30 s.
    pub async fn next(&self, n: usize) -> Vec<Received> {
        let got = self.read(n).await;
        assert_eq!(
            got.len(),
            n,
            "only {} of {n} messages arrived in stream {}",
            got.len(),
            self.stream
        );
        got
    }

    /// Everything the stream holds from the cursor on: at least `expected`
    /// messages if they arrive within 30 s (fewer otherwise, for the
    /// caller's comparison to name), and every message stored beyond them.
    pub async fn drain(&self, expected: usize) -> Vec<Received> {
        let mut out = self.read(expected).await;
        loop {
            let seq = *self.next_seq.lock().await;
            let stored = self.stored().await;
            if seq > stored {
                return out;
            }
            out.extend(
                self.read(usize::try_from(stored + 1 - seq).unwrap_or(0))
                    .await,
            );
        }
    }

    async fn read(&self, n: usize) -> Vec<Received> {
        let stream = self.js.get_stream(&self.stream).await.expect("stream");
        let mut seq = self.next_seq.lock().await;
        let mut out = Vec::with_capacity(n);
        let deadline = Instant::now() + READ_BOUND;
        while out.len() < n && Instant::now() < deadline {
            match stream.get_raw_message(*seq).await {
                Ok(m) => {
                    out.push(received(&m));
                    *seq += 1;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        out
    }

    /// Deletes the stream.
    pub async fn cleanup(&self) {
        let _ = self.js.delete_stream(&self.stream).await;
    }
}

/// The fixture is the publisher conformance suite's harness: a proxied
/// sink ignores the servers a cluster advertises, waits 2 s for a PubAck and
/// reconnects at most 300 ms apart; an unreachable one is built lazily with
/// a 500 ms connect timeout.
impl PublisherHarness for NatsFixture {
    type Sink = NatsPublisher;

    fn topic(&self) -> String {
        NatsFixture::topic(self)
    }

    fn unknown_topic(&self) -> String {
        NatsFixture::unknown_topic(self)
    }

    fn max_payload_bytes(&self) -> usize {
        self.max_payload()
    }

    fn broker_addr(&self) -> SocketAddr {
        NatsFixture::broker_addr(self)
    }

    async fn sink(&self) -> NatsPublisher {
        NatsFixture::sink(self).await
    }

    async fn sink_via(&self, addr: SocketAddr) -> NatsPublisher {
        let config = self
            .config_for(&format!("nats://{addr}"))
            .with_ignore_discovered_servers(true)
            .with_ack_timeout(Duration::from_secs(2))
            .with_reconnect_delay_max(Duration::from_millis(300));
        NatsPublisher::connect(config).await.unwrap()
    }

    async fn sink_unreachable(&self, addr: SocketAddr) -> NatsPublisher {
        let config = self
            .config_for(&format!("nats://{addr}"))
            .with_ignore_discovered_servers(true)
            .with_connect_timeout(Duration::from_millis(500));
        NatsPublisher::lazy(config).await.unwrap()
    }

    async fn consume(&self, n: usize) -> Vec<Received> {
        self.next(n).await
    }

    async fn cleanup(&self) {
        NatsFixture::cleanup(self).await;
    }
}

/// A stored JetStream message in broker-neutral form.
pub fn received(m: &jetstream::message::StreamMessage) -> Received {
    let mut headers = BTreeMap::new();
    for (name, values) in m.headers.iter() {
        if let Some(v) = values.first() {
            headers.insert(name.to_string(), v.as_str().to_owned());
        }
    }
    let id = |name: &str| headers.get(name).and_then(|v| v.parse().ok());
    Received {
        message_id: id(HEADER_MSG_ID),
        event_id_header: id(outbox_core::headers::EVENT_ID),
        event_type: headers.get(outbox_core::headers::EVENT_TYPE).cloned(),
        key: headers.get(outbox_core::headers::KEY).cloned(),
        payload: m.payload.to_vec(),
        partition: None,
        offset: None,
        content_type: headers.get("content-type").cloned(),
        headers,
    }
}
