//! [`KafkaPublisher`]: the [`Sink`] that publishes events to Kafka.

use crate::error::classify;
use crate::{Error, KafkaConfig};
use futures::future::join_all;
use outbox_core::{DeliveryError, ErrorCode, Event, Outcome, Sink};
use rdkafka::client::ClientContext;
use rdkafka::config::{FromClientConfigAndContext, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::future_producer::OwnedDeliveryResult;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Header carrying the event id (the consumer's deduplication id).
pub const HEADER_EVENT_ID: &str = outbox_core::headers::EVENT_ID;
/// Header carrying the event type.
pub const HEADER_EVENT_TYPE: &str = outbox_core::headers::EVENT_TYPE;
/// Header carrying the content type (the event's own `content-type` header,
/// else [`KafkaConfig::with_content_type`]).
pub const HEADER_CONTENT_TYPE: &str = "content-type";

/// How long a send waits before trying again when librdkafka's local queue is full.
const QUEUE_FULL_BACKOFF: Duration = Duration::from_millis(20);

/// Routes librdkafka's log lines and global errors to `tracing`
/// (librdkafka redacts secret properties in its own logs).
#[derive(Debug, Default, Clone, Copy)]
pub struct TracingContext;

impl ClientContext for TracingContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(target: "librdkafka", facility = fac, "{log_message}")
            }
            RDKafkaLogLevel::Warning => {
                tracing::warn!(target: "librdkafka", facility = fac, "{log_message}")
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", facility = fac, "{log_message}")
            }
            RDKafkaLogLevel::Debug => {
                tracing::debug!(target: "librdkafka", facility = fac, "{log_message}")
            }
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(target: "librdkafka", error = %error, "{reason}");
    }
}

/// The producer type the publisher uses.
pub type OutboxProducer = FutureProducer<TracingContext>;

/// Publishes outbox events to Kafka.
///
/// - Idempotent producer with `acks=all`, so librdkafka's internal retries
///   neither duplicate nor reorder messages of one partition.
/// - Message key = event key (the event id when the event has none), so all
///   events of a key land in one partition, in order.
/// - Topic = [`KafkaConfig::kafka_topic`] of the event topic.
/// - Headers: `Outbox-Event-Id`, `Outbox-Event-Type`, `content-type`, then
///   the event's own headers (trace context such as `traceparent` /
///   `tracestate` lives there). Event headers named like the first two are
///   skipped: the publisher's values are authoritative.
/// - A batch is enqueued whole (librdkafka batches and pipelines it), then
///   every delivery report is awaited together; an event is `Delivered` only
///   on a successful delivery report.
/// - A fatal producer error (librdkafka's idempotence state is broken,
///   e.g. after an unrecoverable sequence gap), or a broker refusing the
///   producer id (`PRODUCER_FENCED` and friends; Tansu 0.6 answers
///   librdkafka's epoch bump after message timeouts that way), fails the
///   affected events as retryable and replaces the producer at once: a new
///   producer gets a new producer id, and the retried events go out with it.
pub struct KafkaPublisher {
    config: KafkaConfig,
    producer: Mutex<OutboxProducer>,
    recreated: AtomicU64,
}

impl fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("config", &self.config)
            .field(
                "producers_recreated",
                &self.recreated.load(Ordering::Relaxed),
            )
            .finish_non_exhaustive()
    }
}

/// One event's send: refused before it reached librdkafka's queue, or
/// waiting for its delivery report.
enum Pending {
    Done(Outcome),
    Waiting(DeliveryFuture),
}

impl KafkaPublisher {
    /// Creates the producer. It connects lazily: a broker that is down makes
    /// sends time out (`PUBLISH_TIMEOUT`), not this call fail.
    pub fn new(config: KafkaConfig) -> Result<Self, Error> {
        let producer = create_producer(&config)?;
        tracing::info!(?config, "kafka publisher created");
        Ok(Self {
            config,
            producer: Mutex::new(producer),
            recreated: AtomicU64::new(0),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    /// The current producer (a cheap clone sharing the same librdkafka
    /// instance), e.g. to flush it or read its metadata.
    pub fn producer(&self) -> OutboxProducer {
        self.producer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// How many times the producer was replaced after a fatal error.
    pub fn producers_recreated(&self) -> u64 {
        self.recreated.load(Ordering::Relaxed)
    }

    /// Replaces the producer if librdkafka reports a fatal error on it, or
    /// if `poisoned` (a delivery failed with an error that leaves this
    /// producer id unusable).
    fn recreate_if_broken(&self, poisoned: Option<RDKafkaErrorCode>) {
        let mut guard = self
            .producer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let reason = match (guard.client().fatal_error(), poisoned) {
            (Some((code, reason)), _) => format!("fatal error {code}: {reason}"),
            (None, Some(code)) => format!("delivery failed with {code}"),
            (None, None) => return,
        };
        match create_producer(&self.config) {
            Ok(fresh) => {
                *guard = fresh;
                self.recreated.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    reason,
                    "kafka producer unusable; replaced it with a new one"
                );
            }
            Err(err) => {
                tracing::error!(reason, error = %err, "kafka producer unusable and could not be replaced");
            }
        }
    }

    /// Hands one event to librdkafka's queue, waiting (bounded) while the
    /// queue is full.
    async fn enqueue(&self, producer: &OutboxProducer, event: &Event) -> Pending {
        let topic = self.config.kafka_topic(&event.topic);
        let id = event.id.to_string();
        let key = event.key.as_deref().unwrap_or(&id);
        let content_type = event
            .headers
            .get(HEADER_CONTENT_TYPE)
            .map_or(self.config.content_type(), String::as_str);
        let mut headers = OwnedHeaders::new_with_capacity(event.headers.len() + 3)
            .insert(Header {
                key: HEADER_EVENT_ID,
                value: Some(id.as_str()),
            })
            .insert(Header {
                key: HEADER_EVENT_TYPE,
                value: Some(event.event_type.as_str()),
            })
            .insert(Header {
                key: HEADER_CONTENT_TYPE,
                value: Some(content_type),
            });
        for (name, value) in &event.headers {
            if matches!(
                name.as_str(),
                HEADER_EVENT_ID | HEADER_EVENT_TYPE | HEADER_CONTENT_TYPE
            ) {
                continue;
            }
            headers = headers.insert(Header {
                key: name.as_str(),
                value: Some(value.as_str()),
            });
        }
        let mut record = FutureRecord::to(&topic)
            .key(key)
            .payload(event.payload.as_slice())
            .headers(headers);
        let started = Instant::now();
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Pending::Waiting(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if started.elapsed() < self.config.queue_full_timeout() =>
                {
                    record = back;
                    tokio::time::sleep(QUEUE_FULL_BACKOFF).await;
                }
                Err((err, _)) => {
                    let error = classify(&err, self.config.unknown_topic());
                    tracing::warn!(event_id = %event.id, topic, %error, "kafka refused the event at enqueue");
                    return Pending::Done(Outcome::Failed(error));
                }
            }
        }
    }
}

fn create_producer(config: &KafkaConfig) -> Result<OutboxProducer, Error> {
    let cc = config.producer_config()?;
    FutureProducer::from_config_and_context(&cc, TracingContext).map_err(Error::from_kafka)
}

/// The outcome of one delivery report (or of the report channel closing
/// because the producer went away).
fn delivery_outcome<E>(
    event: &Event,
    report: Result<OwnedDeliveryResult, E>,
    config: &KafkaConfig,
) -> (Outcome, Option<RDKafkaErrorCode>) {
    match report {
        Ok(Ok((partition, offset))) => {
            tracing::debug!(event_id = %event.id, topic = %event.topic, partition, offset, "delivered to kafka");
            (Outcome::Delivered, None)
        }
        Ok(Err((err, _message))) => {
            let error = classify(&err, config.unknown_topic());
            tracing::warn!(event_id = %event.id, topic = %event.topic, %error, "kafka delivery failed");
            let poison = err.rdkafka_error_code().filter(|c| poisons_producer(*c));
            (Outcome::Failed(error), poison)
        }
        Err(_canceled) => (
            Outcome::Failed(DeliveryError::retryable(
                ErrorCode::PUBLISH_CONNECTION_LOST,
                "the producer was dropped before the delivery report arrived",
            )),
            None,
        ),
    }
}

/// Errors after which this producer's id / epoch is unusable: librdkafka's
/// fatal error, and the idempotence errors a broker returns when it no
/// longer accepts the producer id (some Kafka-compatible brokers answer an
/// epoch bump with `PRODUCER_FENCED`). A new producer gets a new id.
fn poisons_producer(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::Fatal
            | C::ProducerFenced
            | C::InvalidProducerEpoch
            | C::InvalidProducerIdMapping
            | C::UnknownProducerId
            | C::OutOfOrderSequenceNumber
            | C::Fenced
    )
}

impl Sink for KafkaPublisher {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        self.recreate_if_broken(None);
        let producer = self.producer();
        let mut pending = Vec::with_capacity(events.len());
        for event in events {
            pending.push(self.enqueue(&producer, event).await);
        }
        let reports = pending
            .into_iter()
            .zip(events)
            .map(|(p, event)| async move {
                match p {
                    Pending::Done(outcome) => (outcome, None),
                    Pending::Waiting(delivery) => {
                        delivery_outcome(event, delivery.await, &self.config)
                    }
                }
            });
        let results = join_all(reports).await;
        let poisoned = results.iter().find_map(|(_, p)| *p);
        if poisoned.is_some() || results.iter().any(|(o, _)| !o.is_delivered()) {
            // A fatal or fencing error fails every later send of this
            // producer instance: replace it now rather than at the next batch.
            self.recreate_if_broken(poisoned);
        }
        results.into_iter().map(|(o, _)| o).collect()
    }
}
