//! The crate's error type and the mapping of rdkafka errors to
//! [`DeliveryError`]s.

use crate::secret::is_secret_property;
use outbox_core::{DeliveryError, ErrorCode};
use rdkafka::error::{KafkaError as RdKafkaError, RDKafkaErrorCode};

/// What an event whose Kafka topic does not exist becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum UnknownTopic {
    /// Fail permanently with `PUBLISH_UNROUTABLE` (dead-lettered at once).
    #[default]
    Permanent,
    /// Fail with a retryable `PUBLISH_UNROUTABLE`, for deployments where
    /// topics are created by another process that may lag behind.
    Retryable,
}

/// Building a [`KafkaConfig`](crate::KafkaConfig) or a
/// [`KafkaPublisher`](crate::KafkaPublisher) failed. Never contains the value
/// of a secret property.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaError {
    /// A `kafka://` URL could not be parsed.
    #[error("invalid kafka URL: {0}")]
    InvalidUrl(String),
    /// librdkafka (or the publisher) refused a property.
    #[error("invalid Kafka property {property}: {reason}")]
    Config {
        /// The property name.
        property: String,
        /// Why (the value is included only when the property is not secret).
        reason: String,
    },
    /// librdkafka could not create the producer.
    #[error("could not create the Kafka producer: {0}")]
    Client(String),
    /// No broker answered a metadata request (after the connect policy's attempts).
    #[error("no Kafka broker reachable: {0}")]
    Unreachable(String),
}

impl KafkaError {
    /// Whether trying again later may succeed (no broker answered yet), as
    /// opposed to a bad URL or property; the same question as
    /// `NatsError::is_retryable` and `AmqpError::is_retryable`.
    pub fn is_retryable(&self) -> bool {
        matches!(self, KafkaError::Unreachable(_))
    }

    /// Converts an rdkafka client-creation error, keeping secret values out.
    pub(crate) fn from_kafka(err: RdKafkaError) -> Self {
        match err {
            RdKafkaError::ClientConfig(_, desc, key, value) => {
                let reason = if is_secret_property(&key) || value.is_empty() {
                    desc
                } else {
                    format!("{desc} (value {value:?})")
                };
                KafkaError::Config {
                    property: key,
                    reason,
                }
            }
            RdKafkaError::ClientCreation(msg) => KafkaError::Client(msg),
            other => KafkaError::Client(other.to_string()),
        }
    }
}

/// Classifies an rdkafka error reported for one message (at enqueue or in
/// its delivery report). The event's failures:
///
/// - message too large -> permanent `PUBLISH_TOO_LARGE`;
/// - unknown topic / partition -> `PUBLISH_UNROUTABLE`, permanent or retryable
///   per [`UnknownTopic`]; an invalid topic name is always permanent;
/// - a record the broker calls invalid (bad timestamp, invalid record,
///   policy violation, unsupported format) -> permanent `PUBLISH_INVALID`;
/// - everything else, including codes this crate does not know -> retryable
///   `PUBLISH_REJECTED`: retrying an unknown failure at worst ends in a dead
///   letter after the retry policy's attempts, while guessing "permanent"
///   could dead-letter a healthy event at once.
///
/// The sink's failures ([`DeliveryError::unavailable`]: no attempt counted):
///
/// - no acknowledgement in time -> `PUBLISH_TIMEOUT` (maybe delivered);
/// - transport, all brokers down, resolve, TLS or authentication failure ->
///   `PUBLISH_CONNECTION_LOST`;
/// - no leader, not enough replicas, local queue full -> `PUBLISH_REJECTED`
///   (the broker cannot take anything right now);
/// - fatal producer error or a producer id the broker refuses (fenced,
///   invalid epoch, unknown producer id, sequence gap) -> `PUBLISH_REJECTED`
///   (the publisher recreates the producer before the next send).
pub(crate) fn classify(err: &RdKafkaError, unknown_topic: UnknownTopic) -> DeliveryError {
    let Some(code) = err.rdkafka_error_code() else {
        return match err {
            RdKafkaError::Canceled => DeliveryError::unavailable(
                ErrorCode::PUBLISH_CONNECTION_LOST,
                "the producer was dropped before the delivery report arrived",
            ),
            other => DeliveryError::retryable(ErrorCode::PUBLISH_REJECTED, other.to_string()),
        };
    };
    classify_code(code, unknown_topic)
}

/// [`classify`] for a bare error code.
pub(crate) fn classify_code(code: RDKafkaErrorCode, unknown_topic: UnknownTopic) -> DeliveryError {
    use RDKafkaErrorCode as C;
    let msg = format!("kafka: {code} ({code:?})");
    match code {
        C::MessageSizeTooLarge | C::InvalidMessageSize | C::MessageBatchTooLarge => {
            DeliveryError::permanent(ErrorCode::PUBLISH_TOO_LARGE, msg)
        }
        C::InvalidTopic => DeliveryError::permanent(ErrorCode::PUBLISH_UNROUTABLE, msg),
        C::UnknownTopic | C::UnknownTopicOrPartition | C::UnknownPartition => match unknown_topic {
            UnknownTopic::Permanent => DeliveryError::permanent(ErrorCode::PUBLISH_UNROUTABLE, msg),
            UnknownTopic::Retryable => DeliveryError::retryable(ErrorCode::PUBLISH_UNROUTABLE, msg),
        },
        C::InvalidRecord
        | C::InvalidTimestamp
        | C::PolicyViolation
        | C::UnsupportedForMessageFormat
        | C::KeySerialization
        | C::ValueSerialization => DeliveryError::permanent(ErrorCode::PUBLISH_INVALID, msg),
        C::MessageTimedOut | C::OperationTimedOut | C::RequestTimedOut | C::TimedOutQueue => {
            DeliveryError::unavailable(ErrorCode::PUBLISH_TIMEOUT, msg)
        }
        C::BrokerTransportFailure
        | C::AllBrokersDown
        | C::Resolve
        | C::NetworkException
        | C::BrokerNotAvailable
        | C::SSL
        | C::Authentication => DeliveryError::unavailable(ErrorCode::PUBLISH_CONNECTION_LOST, msg),
        // Purged by another delivery of this producer that was dropped
        // (see the publisher's `PurgeOnDrop`): not the event's fault.
        C::PurgeQueue | C::PurgeInflight => DeliveryError::unavailable(
            ErrorCode::PUBLISH_CONNECTION_LOST,
            format!("{msg}: a dropped delivery purged the producer's queue"),
        ),
        C::LeaderNotAvailable
        | C::NotLeaderForPartition
        | C::NotEnoughReplicas
        | C::NotEnoughReplicasAfterAppend
        | C::QueueFull => DeliveryError::unavailable(
            ErrorCode::PUBLISH_REJECTED,
            format!("{msg}: the broker cannot take messages now"),
        ),
        c if poisons_producer(c) => DeliveryError::unavailable(
            ErrorCode::PUBLISH_REJECTED,
            format!("{msg}: the producer is fenced or failed; it is recreated"),
        ),
        _ => DeliveryError::retryable(ErrorCode::PUBLISH_REJECTED, msg),
    }
}

/// Errors after which this producer's id / epoch is unusable: librdkafka's
/// fatal error, and the idempotence errors a broker returns when it no
/// longer accepts the producer id (some Kafka-compatible brokers answer an
/// epoch bump with `PRODUCER_FENCED`). A new producer gets a new id.
pub(crate) fn poisons_producer(code: RDKafkaErrorCode) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::FailureKind;
    use rdkafka::types::RDKafkaConfRes;

    fn kind_code(c: RDKafkaErrorCode, p: UnknownTopic) -> (FailureKind, String) {
        let e = classify(&RdKafkaError::MessageProduction(c), p);
        (e.kind(), e.code().to_string())
    }

    #[test]
    fn classification_table() {
        use FailureKind::{Permanent as P, Retryable as R, Unavailable as U};
        use RDKafkaErrorCode as C;
        let perm = UnknownTopic::Permanent;
        let cases = [
            (C::MessageSizeTooLarge, P, "PUBLISH_TOO_LARGE"),
            (C::MessageBatchTooLarge, P, "PUBLISH_TOO_LARGE"),
            (C::UnknownTopicOrPartition, P, "PUBLISH_UNROUTABLE"),
            (C::UnknownTopic, P, "PUBLISH_UNROUTABLE"),
            (C::InvalidTopic, P, "PUBLISH_UNROUTABLE"),
            (C::InvalidRecord, P, "PUBLISH_INVALID"),
            (C::MessageTimedOut, U, "PUBLISH_TIMEOUT"),
            (C::RequestTimedOut, U, "PUBLISH_TIMEOUT"),
            (C::AllBrokersDown, U, "PUBLISH_CONNECTION_LOST"),
            (C::BrokerTransportFailure, U, "PUBLISH_CONNECTION_LOST"),
            (C::SSL, U, "PUBLISH_CONNECTION_LOST"),
            (C::Fatal, U, "PUBLISH_REJECTED"),
            (C::ProducerFenced, U, "PUBLISH_REJECTED"),
            (C::NotLeaderForPartition, U, "PUBLISH_REJECTED"),
            (C::NotEnoughReplicas, U, "PUBLISH_REJECTED"),
            (C::QueueFull, U, "PUBLISH_REJECTED"),
            (C::OutOfOrderSequenceNumber, U, "PUBLISH_REJECTED"),
            (C::DuplicateSequenceNumber, R, "PUBLISH_REJECTED"),
        ];
        for (code, kind, name) in cases {
            assert_eq!(kind_code(code, perm), (kind, name.to_owned()), "{code:?}");
        }
        assert_eq!(
            kind_code(C::UnknownTopicOrPartition, UnknownTopic::Retryable),
            (R, "PUBLISH_UNROUTABLE".to_owned())
        );
        let canceled = classify(&RdKafkaError::Canceled, perm);
        assert_eq!(canceled.code(), &ErrorCode::PUBLISH_CONNECTION_LOST);
        assert!(canceled.is_sink_unavailable());
    }

    #[test]
    fn config_errors_never_echo_secret_values() {
        let e = KafkaError::from_kafka(RdKafkaError::ClientConfig(
            RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN,
            "No such configuration property".into(),
            "sasl.password".into(),
            "hunter2".into(),
        ));
        assert!(!e.to_string().contains("hunter2"), "{e}");
        assert!(!format!("{e:?}").contains("hunter2"));
        let e = KafkaError::from_kafka(RdKafkaError::ClientConfig(
            RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
            "Invalid value".into(),
            "linger.ms".into(),
            "abc".into(),
        ));
        assert!(e.to_string().contains("abc"), "{e}");
    }
}
