//! [`KafkaPublisher`]: the [`Sink`] that publishes events to Kafka.

use crate::config::KafkaConfig;
use crate::error::KafkaError;
use crate::error::{classify, poisons_producer};
use futures::future::{BoxFuture, FutureExt};
use outbox_broker::{SendWindow, Sent, WindowResult};
use outbox_core::cloudevents::Binding;
use outbox_core::{BrokerMessage, DeliveryError, ErrorCode, Event, Outcome, Sink};
use rdkafka::client::ClientContext;
use rdkafka::config::{FromClientConfigAndContext, RDKafkaLogLevel};
use rdkafka::error::{KafkaError as RdKafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::future_producer::OwnedDeliveryResult;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer, PurgeConfig};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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

    fn error(&self, error: RdKafkaError, reason: &str) {
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
/// - Headers: [`BrokerMessage::headers`], the same as on every broker: the
///   event's own headers (trace context such as `traceparent` /
///   `tracestate` lives there), then `content-type`, `Outbox-Event-Type`,
///   `Outbox-Event-Id` and `Outbox-Key`; in the envelope format
///   ([`KafkaConfig::with_wire_format`]) `content-type` is
///   `application/x-protobuf`, `Outbox-Wire-Format: outbox.v1.Envelope` is
///   added and the value is the protobuf envelope.
/// - A batch goes through the shared [`SendWindow`] (up to
///   [`KafkaConfig::with_max_in_flight`] sends waiting for their report;
///   librdkafka batches and pipelines them), every delivery report is
///   awaited together; an event is `Delivered` only on a successful
///   delivery report.
/// - A fatal producer error (librdkafka's idempotence state is broken,
///   e.g. after an unrecoverable sequence gap), or a broker refusing the
///   producer id (`PRODUCER_FENCED` and friends; Tansu 0.6 answers
///   librdkafka's epoch bump after message timeouts that way), fails the
///   affected events as sink unavailable and replaces the producer at once:
///   a new producer gets a new producer id, and the retried events go out
///   with it.
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

/// One event's result, with the error code that makes the producer
/// unusable if its report carried one.
struct Report(Outcome, Option<RDKafkaErrorCode>);

impl WindowResult for Report {
    fn sink_unavailable(&self) -> Option<&DeliveryError> {
        self.0.sink_unavailable()
    }

    fn not_sent(error: DeliveryError) -> Self {
        Report(Outcome::Failed(error), None)
    }
}

impl KafkaPublisher {
    /// Creates the producer and checks that a broker answers (a metadata
    /// request), retried with the config's
    /// [`ConnectPolicy`](outbox_broker::ConnectPolicy): an unreachable
    /// broker list shows up at start-up, as with the other publishers.
    pub async fn connect(config: KafkaConfig) -> Result<Self, KafkaError> {
        let publisher = Self::new(config)?;
        let policy = publisher.config.connect_policy();
        let timeout = policy.timeout;
        policy
            .connect(
                "kafka",
                || {
                    let producer = publisher.producer();
                    async move {
                        tokio::task::spawn_blocking(move || {
                            producer
                                .client()
                                .fetch_metadata(None, timeout)
                                .map(|_| ())
                                .map_err(|e| KafkaError::Unreachable(e.to_string()))
                        })
                        .await
                        .map_err(|e| KafkaError::Unreachable(e.to_string()))?
                    }
                },
                KafkaError::is_retryable,
                || KafkaError::Unreachable(format!("no broker answered within {timeout:?}")),
            )
            .await?;
        tracing::info!(brokers = publisher.config.brokers(), "connected to Kafka");
        Ok(publisher)
    }

    /// Creates the producer without any I/O: it connects lazily, and a
    /// broker that is down makes sends time out (`PUBLISH_TIMEOUT`, sink
    /// unavailable) instead of this call failing. The same as [`Self::new`].
    pub fn lazy(config: KafkaConfig) -> Result<Self, KafkaError> {
        Self::new(config)
    }

    /// Creates the producer. It connects lazily: a broker that is down makes
    /// sends time out (`PUBLISH_TIMEOUT`, sink unavailable), not this call fail.
    pub fn new(config: KafkaConfig) -> Result<Self, KafkaError> {
        outbox_core::cloudevents::require_source(config.wire_format(), config.cloudevents_source())
            .map_err(|e| KafkaError::Config {
                property: "cloudevents_source".into(),
                reason: e.to_string(),
            })?;
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
    /// queue is full; the delivery report's future goes to the window.
    async fn send_one(
        &self,
        producer: &OutboxProducer,
        event: &Event,
    ) -> Sent<Report, BoxFuture<'static, Report>> {
        let topic = self.config.kafka_topic(&event.topic);
        let mut message =
            BrokerMessage::with_default_content_type(event, self.config.content_type())
                .with_format(self.config.wire_format());
        if let Some(source) = self.config.cloudevents_source() {
            message = message.with_cloudevents(Binding::Kafka, source);
        }
        // The payload, or the envelope around it: librdkafka checks this
        // value against `message.max.bytes`.
        let body = message.body();
        let mut headers = OwnedHeaders::new_with_capacity(event.headers.len() + 5);
        for (name, value) in message.headers() {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        let mut record = FutureRecord::to(&topic)
            .key(message.partition_key())
            .payload(&*body)
            .headers(headers);
        let started = Instant::now();
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    let event_id = event.id;
                    let topic = event.topic.clone();
                    let unknown_topic = self.config.unknown_topic();
                    return Sent::InFlight(
                        async move {
                            delivery_report(event_id, &topic, delivery.await, unknown_topic)
                        }
                        .boxed(),
                    );
                }
                Err((RdKafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if started.elapsed() < self.config.queue_full_timeout() =>
                {
                    record = back;
                    tokio::time::sleep(QUEUE_FULL_BACKOFF).await;
                }
                Err((err, _)) => {
                    let error = classify(&err, self.config.unknown_topic());
                    tracing::warn!(event_id = %event.id, topic, %error, "kafka refused the event at enqueue");
                    let poison = err.rdkafka_error_code().filter(|c| poisons_producer(*c));
                    return Sent::Done(Report(Outcome::Failed(error), poison));
                }
            }
        }
    }
}

fn create_producer(config: &KafkaConfig) -> Result<OutboxProducer, KafkaError> {
    let cc = config.producer_config()?;
    FutureProducer::from_config_and_context(&cc, TracingContext).map_err(KafkaError::from_kafka)
}

/// The outcome of one delivery report (or of the report channel closing
/// because the producer went away).
fn delivery_report<E>(
    event_id: outbox_core::EventId,
    topic: &str,
    report: Result<OwnedDeliveryResult, E>,
    unknown_topic: crate::error::UnknownTopic,
) -> Report {
    match report {
        Ok(Ok((partition, offset))) => {
            tracing::debug!(event_id = %event_id, topic, partition, offset, "delivered to kafka");
            Report(Outcome::Delivered, None)
        }
        Ok(Err((err, _message))) => {
            let error = classify(&err, unknown_topic);
            tracing::warn!(event_id = %event_id, topic, %error, "kafka delivery failed");
            let poison = err.rdkafka_error_code().filter(|c| poisons_producer(*c));
            Report(Outcome::Failed(error), poison)
        }
        Err(_canceled) => Report(
            Outcome::Failed(DeliveryError::unavailable(
                ErrorCode::PUBLISH_CONNECTION_LOST,
                "the producer was dropped before the delivery report arrived",
            )),
            None,
        ),
    }
}

impl Sink for KafkaPublisher {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        if events.is_empty() {
            return Vec::new();
        }
        self.recreate_if_broken(None);
        let producer = self.producer();
        let guard = PurgeOnDrop(Some(producer.clone()));
        let reports = SendWindow::new(self.config.max_in_flight())
            .run(events, |event| self.send_one(&producer, event))
            .await;
        guard.disarm();
        let poisoned = reports.iter().find_map(|r| r.1);
        if poisoned.is_some() || reports.iter().any(|r| !r.0.is_delivered()) {
            // A fatal or fencing error fails every later send of this
            // producer instance: replace it now rather than at the next batch.
            self.recreate_if_broken(poisoned);
        }
        reports.into_iter().map(|r| r.0).collect()
    }

    /// `message.timeout.ms`: librdkafka may send a message that long after
    /// it was handed over (a dropped delivery purges what it still queues,
    /// but a paused process cannot).
    fn late_send_bound(&self) -> Duration {
        self.config.message_timeout()
    }
}

/// Armed while a delivery waits for its reports: dropped with the delivery
/// (the relay stopped it at its lease end or its delivery timeout), it
/// purges the messages librdkafka still queues, so none is sent later,
/// after another relay may have published the key's later events.
/// librdkafka's queues are the producer's, not the delivery's: a
/// concurrent delivery's queued messages fail too (`PURGE_QUEUE`, sink
/// unavailable: released, no attempt). Messages already sent stay in
/// flight; librdkafka drops them too once `message.timeout.ms` passes.
struct PurgeOnDrop(Option<OutboxProducer>);

impl PurgeOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for PurgeOnDrop {
    fn drop(&mut self) {
        if let Some(producer) = self.0.take() {
            producer.purge(PurgeConfig::default().queue().non_blocking());
            tracing::debug!("kafka delivery dropped: purged the messages librdkafka still queued");
        }
    }
}
