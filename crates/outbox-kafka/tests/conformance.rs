//! The publisher conformance suite (`outbox-testkit`) against a real
//! Kafka-protocol broker: Tansu on `KAFKA_BROKERS` (default
//! `127.0.0.1:9092`; `cargo xtask services` starts it). Each case gets its
//! own topic (3 partitions), created with the admin client and deleted after.
//!
//! Kafka specifics:
//! - A keyless event is sent with its event id as the message key; the
//!   harness reports such a message as keyless.
//! - A Kafka client talks to the brokers *advertised in metadata*, not to
//!   the bootstrap address, so the suite's TCP proxy in front of the shared
//!   broker would be bypassed. The "broker unreachable" case (the only one
//!   that asks for `broker_addr`) therefore runs on a dedicated Tansu broker
//!   started by the harness, which advertises a local forwarder (a testkit
//!   `TcpProxy`); `sink_via` points that forwarder at the suite's proxy, so
//!   every connection the client makes goes through the cuttable proxy.
//!   (`tansu proxy`, a Kafka-aware proxy, was tried: it does not reconnect
//!   to its origin after a cut.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_kafka::{KafkaConfig, KafkaPublisher};
use outbox_testkit::broker::Received;
use outbox_testkit::kafka::{topic_name, KafkaFixture};
use outbox_testkit::process::{free_port, ChildGuard};
use outbox_testkit::proxy::TcpProxy;
use outbox_testkit::publisher::PublisherHarness;
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

struct KafkaHarness {
    /// The topic on the shared broker.
    shared: Arc<KafkaFixture>,
    /// The same topic on the dedicated broker, once the proxy case asked
    /// for it: then reads go there.
    dedicated_topic: Mutex<Option<Arc<KafkaFixture>>>,
    dedicated: Mutex<Option<Dedicated>>,
}

/// A Tansu broker of this harness alone, advertising `forwarder`.
struct Dedicated {
    _child: ChildGuard,
    direct: SocketAddr,
    forwarder: TcpProxy,
}

impl KafkaHarness {
    async fn new() -> Self {
        Self {
            shared: Arc::new(KafkaFixture::new().await),
            dedicated_topic: Mutex::new(None),
            dedicated: Mutex::new(None),
        }
    }

    /// Where reads go: the dedicated broker's topic once it exists.
    fn reader(&self) -> Arc<KafkaFixture> {
        let guard = self.dedicated_topic.lock().unwrap();
        guard.as_ref().unwrap_or(&self.shared).clone()
    }
}

fn tansu_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TANSU_BIN") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cargo"));
    let p = home.join("bin").join("tansu");
    if p.is_file() {
        p
    } else {
        PathBuf::from("tansu")
    }
}

impl PublisherHarness for KafkaHarness {
    type Sink = KafkaPublisher;

    fn topic(&self) -> String {
        self.shared.topic()
    }

    fn unknown_topic(&self) -> String {
        topic_name("conformance-missing")
    }

    fn max_payload_bytes(&self) -> usize {
        // librdkafka's message.max.bytes default.
        1_000_000
    }

    fn broker_addr(&self) -> SocketAddr {
        let mut dedicated = self.dedicated.lock().unwrap();
        if let Some(d) = dedicated.as_ref() {
            return d.direct;
        }
        let direct: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        // The broker advertises the forwarder, so every connection the
        // client makes (bootstrap and the advertised one) goes through it.
        let forwarder = TcpProxy::bind(direct);
        let bin = tansu_bin();
        let child = Command::new(&bin)
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://{direct}"),
                "--advertised-listener-url",
                &format!("tcp://{}", forwarder.addr()),
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting `{} broker`: {e}", bin.display()));
        let child = ChildGuard::new(child);
        let mut tries = 0;
        while TcpStream::connect(direct).is_err() {
            tries += 1;
            assert!(
                tries < 300,
                "dedicated tansu broker did not listen on {direct}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        *dedicated = Some(Dedicated {
            _child: child,
            direct,
            forwarder,
        });
        direct
    }

    async fn sink(&self) -> KafkaPublisher {
        self.shared.sink().await
    }

    async fn sink_via(&self, addr: SocketAddr) -> KafkaPublisher {
        let direct = self.broker_addr();
        if let Some(d) = self.dedicated.lock().unwrap().as_ref() {
            d.forwarder.set_upstream(addr);
        }
        // This case's topic and consumer live on the dedicated broker.
        let on_dedicated = KafkaFixture::on(&direct.to_string(), &self.shared.topic()).await;
        *self.dedicated_topic.lock().unwrap() = Some(Arc::new(on_dedicated));
        KafkaPublisher::new(self.shared.config_for(&addr.to_string())).unwrap()
    }

    async fn sink_unreachable(&self, addr: SocketAddr) -> KafkaPublisher {
        let config: KafkaConfig = self
            .shared
            .config_for(&addr.to_string())
            .with_delivery_timeout(Duration::from_secs(2));
        KafkaPublisher::lazy(config).unwrap()
    }

    async fn consume(&self, n: usize) -> Vec<Received> {
        self.reader().next(n).await
    }

    async fn cleanup(&self) {
        // Its consumer goes before its broker.
        let on_dedicated = self.dedicated_topic.lock().unwrap().take();
        drop(on_dedicated);
        let dedicated = self.dedicated.lock().unwrap().take();
        drop(dedicated);
        self.shared.cleanup().await;
    }
}

outbox_testkit::publisher_conformance_tests!(KafkaHarness::new().await);
