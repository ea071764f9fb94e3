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
//!   started by the harness, which advertises a local forwarder; `sink_via`
//!   points that forwarder at the suite's proxy, so every connection the
//!   client makes goes through the cuttable proxy. (`tansu proxy`, a
//!   Kafka-aware proxy, was tried: it does not reconnect to its origin after
//!   a cut.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use outbox_core::EventId;
use outbox_kafka::rdkafka::consumer::StreamConsumer;
use outbox_kafka::rdkafka::message::{Headers, Message};
use outbox_kafka::{KafkaConfig, KafkaPublisher};
use outbox_testkit::publisher::{PublisherHarness, ReceivedMessage};
use std::collections::BTreeMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const PARTITIONS: i32 = 3;

fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

struct KafkaHarness {
    brokers: String,
    topic: String,
    consumer: Mutex<Option<Arc<StreamConsumer>>>,
    dedicated: Mutex<Option<Dedicated>>,
}

/// A Tansu broker of this harness alone, advertising `forwarder`.
struct Dedicated {
    child: Child,
    direct: SocketAddr,
    forward_to: Arc<Mutex<SocketAddr>>,
}

fn consumer_for(brokers: &str, topic: &str) -> Arc<StreamConsumer> {
    Arc::new(support::assigned_consumer(brokers, topic, PARTITIONS))
}

impl KafkaHarness {
    async fn new() -> Self {
        let brokers = brokers();
        let topic = support::topic_name("conformance");
        support::create_topic(&brokers, &topic, PARTITIONS).await;
        let consumer = consumer_for(&brokers, &topic);
        Self {
            brokers,
            topic,
            consumer: Mutex::new(Some(consumer)),
            dedicated: Mutex::new(None),
        }
    }

    fn config(&self, brokers: &str) -> KafkaConfig {
        // An unknown topic is reported after 3 s instead of librdkafka's
        // 30 s propagation allowance, and an unacknowledged send after 10 s
        // instead of 30 s, to keep the suite quick on loopback.
        KafkaConfig::new(brokers)
            .with_property("topic.metadata.propagation.max.ms", "3000")
            .with_delivery_timeout(Duration::from_secs(10))
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A plain TCP forwarder on an ephemeral port to whatever `target` holds
/// when a connection arrives (threads; lives until the test process ends).
fn start_forwarder(target: Arc<Mutex<SocketAddr>>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for downstream in listener.incoming() {
            let Ok(downstream) = downstream else { continue };
            let to = *target.lock().unwrap();
            std::thread::spawn(move || {
                let Ok(upstream) = TcpStream::connect(to) else {
                    return;
                };
                let (mut d_read, mut u_write) = (
                    downstream.try_clone().unwrap(),
                    upstream.try_clone().unwrap(),
                );
                let (mut u_read, mut d_write) = (upstream, downstream);
                let t = std::thread::spawn(move || {
                    let _ = std::io::copy(&mut d_read, &mut u_write);
                    let _ = u_write.shutdown(Shutdown::Both);
                });
                let _ = std::io::copy(&mut u_read, &mut d_write);
                let _ = d_write.shutdown(Shutdown::Both);
                let _ = t.join();
            });
        }
    });
    addr
}

impl PublisherHarness for KafkaHarness {
    type Sink = KafkaPublisher;

    fn topic(&self) -> String {
        self.topic.clone()
    }

    fn unknown_topic(&self) -> String {
        support::topic_name("conformance-missing")
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
        let forward_to = Arc::new(Mutex::new(direct));
        let advertised = start_forwarder(forward_to.clone());
        let bin = tansu_bin();
        let child = Command::new(&bin)
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://{direct}"),
                "--advertised-listener-url",
                &format!("tcp://{advertised}"),
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting `{} broker`: {e}", bin.display()));
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
            child,
            direct,
            forward_to,
        });
        direct
    }

    async fn sink(&self) -> KafkaPublisher {
        KafkaPublisher::new(self.config(&self.brokers)).unwrap()
    }

    async fn sink_via(&self, addr: SocketAddr) -> KafkaPublisher {
        let direct = self.broker_addr();
        if let Some(d) = self.dedicated.lock().unwrap().as_ref() {
            *d.forward_to.lock().unwrap() = addr;
        }
        // This case's topic and consumer live on the dedicated broker.
        support::create_topic(&direct.to_string(), &self.topic, PARTITIONS).await;
        *self.consumer.lock().unwrap() = Some(consumer_for(&direct.to_string(), &self.topic));
        KafkaPublisher::new(self.config(&addr.to_string())).unwrap()
    }

    async fn consume(&self, n: usize) -> Vec<ReceivedMessage> {
        let consumer = self.consumer.lock().unwrap().clone().unwrap();
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let msg = tokio::time::timeout(support::READ_BOUND, consumer.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "only {} of {n} messages arrived on {} within {:?}",
                        out.len(),
                        self.topic,
                        support::READ_BOUND
                    )
                });
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("consumer error (continuing): {e}");
                    continue;
                }
            };
            let mut headers = BTreeMap::new();
            if let Some(h) = msg.headers() {
                for header in h.iter() {
                    let value = header
                        .value
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                        .unwrap_or_default();
                    headers.insert(header.key.to_owned(), value);
                }
            }
            let event_id: Option<EventId> = headers
                .get(outbox_kafka::HEADER_EVENT_ID)
                .and_then(|v| v.parse().ok());
            let key = msg
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                // A keyless event is keyed by its id.
                .filter(|k| Some(k.as_str()) != event_id.map(|id| id.to_string()).as_deref());
            out.push(ReceivedMessage {
                payload: msg.payload().unwrap_or_default().to_vec(),
                event_type: headers.get(outbox_kafka::HEADER_EVENT_TYPE).cloned(),
                event_id,
                key,
                headers,
            });
        }
        out
    }

    async fn cleanup(&self) {
        // Close the consumer before deleting its topic: librdkafka 2.12
        // crashes (strcmp on a NULL name) when Tansu 0.6 answers its
        // by-topic-id metadata refresh for a deleted topic with a null name.
        let consumer = self.consumer.lock().unwrap().take();
        drop(consumer);
        let dedicated = self.dedicated.lock().unwrap().take();
        if let Some(mut d) = dedicated {
            let _ = d.child.kill();
            let _ = d.child.wait();
        }
        support::delete_topic(&self.brokers, &self.topic).await;
    }
}

outbox_testkit::publisher_conformance_tests!(KafkaHarness::new().await);
