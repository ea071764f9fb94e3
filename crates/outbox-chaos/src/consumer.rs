//! The independent consumers, one per broker, connected straight to the
//! broker, never through the fault proxy (except Kafka's with a private
//! broker, which advertises the proxy to every client: see kafka.rs). Each
//! records every message it receives (event id, key, sequence from the
//! payload, arrival time), copies included, until told to stop, and
//! resumes where it was when its connection fails (a private NATS server
//! or RabbitMQ node restarted by `broker-restart`). Each
//! creates and deletes its own destination: a JetStream stream with the deduplication window at its
//! minimum (so the relays' duplicates are stored and counted), a RabbitMQ
//! queue, a Kafka topic.

use crate::record::{now_us, parse_payload, Arrival, Ledger};
use anyhow::{bail, Context as _, Result};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use uuid::Uuid;

/// A broker destination for one run.
#[derive(Debug, Clone)]
pub(crate) enum Destination {
    /// Stream `stream` capturing `<prefix>.>`.
    Nats {
        url: String,
        stream: String,
        prefix: String,
        /// Replicas of the stream (3 on the run's own cluster).
        replicas: usize,
    },
    /// Queue `queue` (bound by name on the default exchange).
    Amqp { url: String, queue: String },
    /// Topic `topic`.
    Kafka { brokers: String, topic: String },
}

/// Kafka partitions of a run's topic.
const KAFKA_PARTITIONS: i32 = 3;

impl Destination {
    /// Creates the stream / queue / topic.
    pub(crate) async fn create(&self) -> Result<()> {
        match self {
            Self::Nats {
                url,
                stream,
                prefix,
                replicas,
            } => {
                let js = nats_js(url).await?;
                js.create_stream(outbox_nats::async_nats::jetstream::stream::Config {
                    name: stream.clone(),
                    subjects: vec![format!("{prefix}.>")],
                    // NATS's default dedup window (2 min), as a deployment's
                    // stream has it and the relay checks (at least twice
                    // its lock timeout): a copy sent again with the same
                    // Nats-Msg-Id within it is dropped by the server. That
                    // includes the copy a relay paused between handing a
                    // message to its client and the client writing it
                    // sends when it resumes, after the new lease holder
                    // published the key's later events (the `stop` fault):
                    // nothing in the process can take those bytes back. So
                    // the duplicates counted here are those a consumer
                    // sees, not every copy the relays sent.
                    duplicate_window: Duration::from_secs(120),
                    num_replicas: *replicas,
                    max_age: Duration::from_secs(6 * 3600),
                    ..Default::default()
                })
                .await
                .with_context(|| format!("creating JetStream stream {stream}"))?;
            }
            Self::Amqp { url, queue } => {
                // The durable queue the relays publish to through the
                // default exchange: the publisher's own declaration.
                let config = outbox_amqp::AmqpConfig::from_url(url)?;
                let publisher = outbox_amqp::AmqpPublisher::connect(config)
                    .await
                    .with_context(|| {
                        format!(
                            "RabbitMQ is not reachable at {}",
                            outbox_core::redact_url(url)
                        )
                    })?;
                publisher
                    .declare_queue("", queue, "")
                    .await
                    .with_context(|| format!("declaring queue {queue}"))?;
                publisher.close().await;
            }
            Self::Kafka { brokers, topic } => {
                use outbox_kafka::rdkafka::admin::{
                    AdminClient, AdminOptions, NewTopic, TopicReplication,
                };
                use outbox_kafka::rdkafka::client::DefaultClientContext;
                let admin: AdminClient<DefaultClientContext> = kafka_config(brokers)
                    .create()
                    .context("Kafka admin client")?;
                let results = admin
                    .create_topics(
                        &[NewTopic::new(
                            topic,
                            KAFKA_PARTITIONS,
                            TopicReplication::Fixed(1),
                        )],
                        &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
                    )
                    .await
                    .with_context(|| format!("Kafka is not reachable at {brokers}"))?;
                for r in results {
                    if let Err((t, code)) = r {
                        bail!("creating Kafka topic {t}: {code}");
                    }
                }
            }
        }
        Ok(())
    }

    /// Deletes what [`Destination::create`] made (best effort).
    pub(crate) async fn delete(&self) {
        match self {
            Self::Nats { url, stream, .. } => {
                if let Ok(js) = nats_js(url).await {
                    let _ = js.delete_stream(stream).await;
                }
            }
            Self::Amqp { url, queue } => {
                use outbox_amqp::lapin::options::QueueDeleteOptions;
                if let Ok(conn) = amqp_connect(url).await {
                    if let Ok(ch) = conn.create_channel().await {
                        let _ = ch.queue_delete(queue, QueueDeleteOptions::default()).await;
                    }
                    let _ = conn.close(200, "bye").await;
                }
            }
            Self::Kafka { brokers, topic } => {
                use outbox_kafka::rdkafka::admin::{AdminClient, AdminOptions};
                use outbox_kafka::rdkafka::client::DefaultClientContext;
                if let Ok(admin) =
                    kafka_config(brokers).create::<AdminClient<DefaultClientContext>>()
                {
                    let _ = admin.delete_topics(&[topic], &AdminOptions::new()).await;
                }
            }
        }
    }

    /// Messages the stream / topic stores now, when the broker tells
    /// (JetStream: the stream's message count; Kafka: the sum of the
    /// partitions' high watermarks); `None` for a RabbitMQ queue (it
    /// forgets what it delivered) or when the broker does not answer.
    pub(crate) async fn stored_messages(&self) -> Option<u64> {
        match self {
            Self::Nats { url, stream, .. } => {
                let js = nats_js(url).await.ok()?;
                let s = js.get_stream(stream).await.ok()?;
                Some(s.cached_info().state.messages)
            }
            Self::Amqp { .. } => None,
            Self::Kafka { brokers, topic } => {
                use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
                let (brokers, topic) = (brokers.clone(), topic.clone());
                tokio::task::spawn_blocking(move || {
                    let c: BaseConsumer = kafka_config(&brokers).create().ok()?;
                    let mut total = 0u64;
                    for p in 0..KAFKA_PARTITIONS {
                        let (low, high) =
                            c.fetch_watermarks(&topic, p, Duration::from_secs(5)).ok()?;
                        total += u64::try_from(high - low).ok()?;
                    }
                    Some(total)
                })
                .await
                .ok()?
            }
        }
    }

    /// Consumes until `stop` turns true, recording every message.
    pub(crate) async fn consume(
        &self,
        ledger: Arc<Ledger>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<Vec<Arrival>> {
        let mut out = Vec::new();
        let mut record = |payload: &[u8]| {
            let at = now_us();
            let a = parse_payload(payload, at).unwrap_or_else(|| Arrival {
                // Unreadable: an id nobody produced, so it counts as unexpected.
                id: Uuid::now_v7(),
                key: String::new(),
                seq: 0,
                at_us: at,
            });
            ledger.arrived(a.id);
            out.push(a);
        };
        match self {
            Self::Nats { url, stream, .. } => {
                use outbox_nats::async_nats::jetstream::consumer::{
                    pull, AckPolicy, DeliverPolicy,
                };
                let js = nats_js(url).await?;
                // The consumer keeps the stream sequence it has read up to
                // and, whenever its server-side consumer fails (the
                // connection was cut, the server restarted: broker-restart),
                // makes a new one that starts right after it: nothing is
                // skipped and nothing is recorded twice by the consumer
                // itself (duplicates are the relays').
                let mut next_seq: u64 = 1;
                'outer: loop {
                    let created = async {
                        js.get_stream(stream)
                            .await?
                            .create_consumer(pull::Config {
                                deliver_policy: DeliverPolicy::ByStartSequence {
                                    start_sequence: next_seq,
                                },
                                ack_policy: AckPolicy::None,
                                inactive_threshold: Duration::from_secs(30),
                                ..Default::default()
                            })
                            .await
                            .map_err(anyhow::Error::from)
                    };
                    let messages = match created.await {
                        Ok(c) => c.messages().await.map_err(anyhow::Error::from),
                        Err(e) => Err(e),
                    };
                    let mut messages = match messages {
                        Ok(m) => m,
                        Err(e) => {
                            eprintln!("chaos consumer (nats): {e:#}; again in 100 ms");
                            tokio::select! {
                                () = tokio::time::sleep(Duration::from_millis(100)) => continue,
                                _ = stop.changed() => break,
                            }
                        }
                    };
                    loop {
                        tokio::select! {
                            m = messages.next() => match m {
                                Some(Ok(m)) => {
                                    if let Ok(info) = m.info() {
                                        next_seq = info.stream_sequence + 1;
                                    }
                                    record(&m.payload);
                                }
                                Some(Err(e)) => {
                                    eprintln!("chaos consumer (nats): {e}; a new consumer from stream sequence {next_seq}");
                                    continue 'outer;
                                }
                                None => continue 'outer,
                            },
                            _ = stop.changed() => break 'outer,
                        }
                    }
                }
            }
            Self::Amqp { url, queue } => {
                use outbox_amqp::lapin::options::{
                    BasicAckOptions, BasicConsumeOptions, BasicQosOptions,
                };
                use outbox_amqp::lapin::types::FieldTable;
                // Acknowledged after it is recorded (100 at a time), and consumed again on a
                // new connection whenever the connection fails (the broker
                // restarted: broker-restart): a message the broker handed
                // to a connection that died before it reached the consumer
                // is delivered again, not dropped as an automatic
                // acknowledgement would. A redelivered message whose id was
                // already recorded is the consumer's own copy (its ack was
                // lost with the connection) and is not recorded again
                // (duplicates are the relays'); in the rare case that it is
                // a relay's copy whose twin arrived first, one duplicate is
                // not counted, nothing is lost.
                let mut seen = std::collections::HashSet::new();
                let mut failing = false;
                loop {
                    let consumed = async {
                        let conn = amqp_connect(url).await?;
                        let ch = conn.create_channel().await?;
                        ch.basic_qos(1000, BasicQosOptions::default()).await?;
                        let consumer = ch
                            .basic_consume(
                                queue,
                                "chaos",
                                BasicConsumeOptions::default(),
                                FieldTable::default(),
                            )
                            .await
                            .context("basic.consume")?;
                        anyhow::Ok((conn, consumer))
                    };
                    let (conn, mut consumer) = match consumed.await {
                        Ok(c) => c,
                        Err(e) => {
                            if !std::mem::replace(&mut failing, true) {
                                eprintln!("chaos consumer (amqp): {e:#}; again every 100 ms");
                            }
                            tokio::select! {
                                () = tokio::time::sleep(Duration::from_millis(100)) => continue,
                                _ = stop.changed() => break,
                            }
                        }
                    };
                    if std::mem::take(&mut failing) {
                        eprintln!("chaos consumer (amqp): consuming again");
                    }
                    let mut unacked = 0u32;
                    let failed = loop {
                        tokio::select! {
                            d = consumer.next() => match d {
                                Some(Ok(d)) => {
                                    let id = parse_payload(&d.data, 0).map(|a| a.id);
                                    let own_copy = d.redelivered && id.is_some_and(|id| seen.contains(&id));
                                    if !own_copy {
                                        seen.extend(id);
                                        record(&d.data);
                                    }
                                    // One multiple-ack per 100 messages (the
                                    // prefetch is 1,000): a per-message ack
                                    // would slow the drain it measures.
                                    unacked += 1;
                                    if unacked == 100 {
                                        unacked = 0;
                                        let multiple = BasicAckOptions { multiple: true };
                                        if let Err(e) = d.acker.ack(multiple).await {
                                            break Some(format!("ack: {e}"));
                                        }
                                    }
                                }
                                Some(Err(e)) => break Some(e.to_string()),
                                None => break Some("the consumer ended".to_owned()),
                            },
                            _ = stop.changed() => break None,
                        }
                    };
                    // Closed (if it is still open) so that what it holds
                    // unacknowledged is delivered again at once.
                    let _ =
                        tokio::time::timeout(Duration::from_secs(1), conn.close(200, "bye")).await;
                    match failed {
                        Some(e) => eprintln!("chaos consumer (amqp): {e}; consuming again"),
                        None => break,
                    }
                }
            }
            Self::Kafka { brokers, topic } => {
                use outbox_kafka::rdkafka::consumer::{Consumer, StreamConsumer};
                use outbox_kafka::rdkafka::message::Message;
                use outbox_kafka::rdkafka::{Offset, TopicPartitionList};
                let consumer: StreamConsumer = kafka_config(brokers)
                    .set("group.id", format!("chaos-{topic}"))
                    .set("enable.auto.commit", "false")
                    .set("auto.offset.reset", "earliest")
                    // Behind the fault proxy of a private broker: back
                    // within a second of the broker, as the relays are.
                    .set("reconnect.backoff.ms", "100")
                    .set("reconnect.backoff.max.ms", "1000")
                    .create()
                    .context("Kafka consumer")?;
                let mut partitions = TopicPartitionList::new();
                for p in 0..KAFKA_PARTITIONS {
                    partitions.add_partition_offset(topic, p, Offset::Beginning)?;
                }
                consumer.assign(&partitions)?;
                loop {
                    tokio::select! {
                        m = consumer.recv() => match m {
                            Ok(m) => record(m.payload().unwrap_or_default()),
                            Err(e) => eprintln!("chaos consumer (kafka): {e}"),
                        },
                        _ = stop.changed() => break,
                    }
                }
            }
        }
        Ok(out)
    }
}

async fn nats_js(url: &str) -> Result<outbox_nats::async_nats::jetstream::Context> {
    // Back within half a second of the server (the relays' own reconnects
    // are capped at a second): the consumer's reconnection counts in the
    // recovery times.
    let client = outbox_nats::async_nats::ConnectOptions::new()
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis((100 * attempts as u64).min(500))
        })
        .connect(crate::nats_cluster::servers(url)?)
        .await
        .with_context(|| format!("NATS is not reachable at {url}"))?;
    Ok(outbox_nats::async_nats::jetstream::new(client))
}

async fn amqp_connect(url: &str) -> Result<outbox_amqp::lapin::Connection> {
    outbox_amqp::lapin::Connection::connect(
        url,
        outbox_amqp::lapin::ConnectionProperties::default(),
    )
    .await
    .with_context(|| {
        format!(
            "RabbitMQ is not reachable at {}",
            outbox_core::redact_url(url)
        )
    })
}

fn kafka_config(brokers: &str) -> outbox_kafka::rdkafka::ClientConfig {
    let mut c = outbox_kafka::rdkafka::ClientConfig::new();
    c.set("bootstrap.servers", brokers);
    c
}
