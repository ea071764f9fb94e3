//! End to end on NATS JetStream: SQLite / PostgreSQL -> relay ->
//! `NatsPublisher` -> a JetStream pull consumer (`NATS_URL`, default
//! `nats://127.0.0.1:4222`). Each test has its own stream and subject prefix.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use futures::StreamExt;
use outbox_nats::async_nats::{self, jetstream};
use outbox_nats::{NatsConfig, NatsPublisher};
use outbox_tests::{run_end_to_end, Broker, PostgresApp, Received, SqliteApp};
use std::collections::BTreeMap;
use std::time::Duration;

struct Nats {
    js: jetstream::Context,
    stream: String,
    prefix: String,
}

impl Broker for Nats {
    type Sink = NatsPublisher;
    const NAME: &'static str = "nats";

    async fn start() -> Self {
        let url = outbox_tests::nats_url();
        let client = async_nats::connect(&url).await.unwrap_or_else(|e| {
            panic!(
                "NATS is not reachable at {} ({e}); start it (`cargo xtask services`) or set NATS_URL",
                outbox_nats::redact_url(&url)
            )
        });
        let suffix = outbox_tests::unique_suffix();
        let nats = Self {
            js: jetstream::new(client),
            stream: format!("OUTBOX_E2E_{suffix}"),
            prefix: format!("outbox-e2e.{suffix}"),
        };
        let subject = format!("{}.>", nats.prefix);
        NatsPublisher::connect(nats.config())
            .await
            .unwrap()
            .ensure_stream(&nats.stream, &[&subject])
            .await
            .unwrap();
        nats
    }

    fn topic(&self) -> String {
        "orders".to_owned()
    }

    async fn sink(&self) -> NatsPublisher {
        NatsPublisher::connect(self.config()).await.unwrap()
    }

    async fn consume(&self, expected: usize) -> Vec<Received> {
        let mut stream = self.js.get_stream(&self.stream).await.unwrap();
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                deliver_policy: jetstream::consumer::DeliverPolicy::All,
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ..Default::default()
            })
            .await
            .unwrap();
        let mut messages = consumer.messages().await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let mut out = Vec::new();
        // Every publish was acknowledged before this runs, so the stream's
        // message count is final: read all of it, extras included.
        let stored = stream.info().await.unwrap().state.messages as usize;
        while out.len() < expected.max(stored) {
            let Ok(next) = tokio::time::timeout_at(deadline, messages.next()).await else {
                break;
            };
            let message = next
                .expect("the consumer's message stream ended")
                .expect("consumer error");
            message.ack().await.unwrap();
            out.push(to_received(&message));
        }
        out
    }

    async fn cleanup(self) {
        let _ = self.js.delete_stream(&self.stream).await;
    }
}

impl Nats {
    fn config(&self) -> NatsConfig {
        NatsConfig::from_url(&outbox_tests::nats_url())
            .unwrap()
            .with_subject_prefix(&self.prefix)
    }
}

fn to_received(m: &jetstream::Message) -> Received {
    let mut headers = BTreeMap::new();
    for (name, values) in m.headers.iter().flat_map(|h| h.iter()) {
        if let Some(v) = values.first() {
            headers.insert(name.to_string(), v.as_str().to_owned());
        }
    }
    let id = |name: &str| headers.get(name).and_then(|v| v.parse().ok());
    Received {
        message_id: id(outbox_nats::HEADER_MSG_ID),
        event_id_header: id(outbox_nats::HEADER_EVENT_ID),
        event_type: headers.get(outbox_nats::HEADER_EVENT_TYPE).cloned(),
        key: headers.get(outbox_nats::HEADER_KEY).cloned(),
        payload: m.payload.to_vec(),
        partition: None,
        headers,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_to_nats() {
    run_end_to_end::<SqliteApp, Nats>().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_to_nats() {
    run_end_to_end::<PostgresApp, Nats>().await;
}
