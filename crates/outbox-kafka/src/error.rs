//! The crate's error type and the mapping of rdkafka errors to
//! [`DeliveryError`]s.

use crate::config::is_secret_property;
use crate::UnknownTopic;
use outbox_core::{DeliveryError, ErrorCode};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// Building a [`KafkaConfig`](crate::KafkaConfig) or a
/// [`KafkaPublisher`](crate::KafkaPublisher) failed. Never contains the value
/// of a secret property.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
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
}

impl Error {
    /// Converts an rdkafka client-creation error, keeping secret values out.
    pub(crate) fn from_kafka(err: KafkaError) -> Self {
        match err {
            KafkaError::ClientConfig(_, desc, key, value) => {
                let reason = if is_secret_property(&key) || value.is_empty() {
                    desc
                } else {
                    format!("{desc} (value {value:?})")
                };
                Error::Config {
                    property: key,
                    reason,
                }
            }
            KafkaError::ClientCreation(msg) => Error::Client(msg),
            other => Error::Client(other.to_string()),
        }
    }
}

/// Classifies an rdkafka error reported for one message (at enqueue or in
/// its delivery report).
///
/// - message too large -> permanent `PUBLISH_TOO_LARGE`;
/// - unknown topic / partition -> `PUBLISH_UNROUTABLE`, permanent or retryable
///   per [`UnknownTopic`]; an invalid topic name is always permanent;
/// - a record the broker calls invalid (bad timestamp, invalid record,
///   policy violation, unsupported format) -> permanent `PUBLISH_INVALID`;
/// - message timed out -> retryable `PUBLISH_TIMEOUT` (maybe delivered);
/// - transport / all brokers down / resolve -> retryable `PUBLISH_CONNECTION_LOST`;
/// - fatal producer error -> retryable `PUBLISH_REJECTED` (the publisher
///   recreates the producer before the next send);
/// - everything else, including every retriable Kafka code and codes this
///   crate does not know -> retryable `PUBLISH_REJECTED`: retrying an
///   unknown failure at worst ends in a dead letter after the retry
///   policy's attempts, while guessing "permanent" could dead-letter a
///   healthy event at once.
pub(crate) fn classify(err: &KafkaError, unknown_topic: UnknownTopic) -> DeliveryError {
    let Some(code) = err.rdkafka_error_code() else {
        return match err {
            KafkaError::Canceled => DeliveryError::retryable(
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
            DeliveryError::retryable(ErrorCode::PUBLISH_TIMEOUT, msg)
        }
        C::BrokerTransportFailure
        | C::AllBrokersDown
        | C::Resolve
        | C::NetworkException
        | C::BrokerNotAvailable
        | C::SSL
        | C::Authentication => DeliveryError::retryable(ErrorCode::PUBLISH_CONNECTION_LOST, msg),
        C::Fatal => DeliveryError::retryable(
            ErrorCode::PUBLISH_REJECTED,
            format!("{msg}: fatal producer error, the producer is recreated"),
        ),
        _ => DeliveryError::retryable(ErrorCode::PUBLISH_REJECTED, msg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::FailureKind;
    use rdkafka::types::RDKafkaConfRes;

    fn kind_code(c: RDKafkaErrorCode, p: UnknownTopic) -> (FailureKind, String) {
        let e = classify(&KafkaError::MessageProduction(c), p);
        (e.kind(), e.code().to_string())
    }

    #[test]
    fn classification_table() {
        use FailureKind::{Permanent as P, Retryable as R};
        use RDKafkaErrorCode as C;
        let perm = UnknownTopic::Permanent;
        let cases = [
            (C::MessageSizeTooLarge, P, "PUBLISH_TOO_LARGE"),
            (C::MessageBatchTooLarge, P, "PUBLISH_TOO_LARGE"),
            (C::UnknownTopicOrPartition, P, "PUBLISH_UNROUTABLE"),
            (C::UnknownTopic, P, "PUBLISH_UNROUTABLE"),
            (C::InvalidTopic, P, "PUBLISH_UNROUTABLE"),
            (C::InvalidRecord, P, "PUBLISH_INVALID"),
            (C::MessageTimedOut, R, "PUBLISH_TIMEOUT"),
            (C::RequestTimedOut, R, "PUBLISH_TIMEOUT"),
            (C::AllBrokersDown, R, "PUBLISH_CONNECTION_LOST"),
            (C::BrokerTransportFailure, R, "PUBLISH_CONNECTION_LOST"),
            (C::Fatal, R, "PUBLISH_REJECTED"),
            (C::NotLeaderForPartition, R, "PUBLISH_REJECTED"),
            (C::NotEnoughReplicas, R, "PUBLISH_REJECTED"),
            (C::QueueFull, R, "PUBLISH_REJECTED"),
            (C::OutOfOrderSequenceNumber, R, "PUBLISH_REJECTED"),
        ];
        for (code, kind, name) in cases {
            assert_eq!(kind_code(code, perm), (kind, name.to_owned()), "{code:?}");
        }
        assert_eq!(
            kind_code(C::UnknownTopicOrPartition, UnknownTopic::Retryable),
            (R, "PUBLISH_UNROUTABLE".to_owned())
        );
        let canceled = classify(&KafkaError::Canceled, perm);
        assert_eq!(canceled.code(), &ErrorCode::PUBLISH_CONNECTION_LOST);
        assert!(canceled.is_retryable());
    }

    #[test]
    fn config_errors_never_echo_secret_values() {
        let e = Error::from_kafka(KafkaError::ClientConfig(
            RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN,
            "No such configuration property".into(),
            "sasl.password".into(),
            "hunter2".into(),
        ));
        assert!(!e.to_string().contains("hunter2"), "{e}");
        assert!(!format!("{e:?}").contains("hunter2"));
        let e = Error::from_kafka(KafkaError::ClientConfig(
            RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
            "Invalid value".into(),
            "linger.ms".into(),
            "abc".into(),
        ));
        assert!(e.to_string().contains("abc"), "{e}");
    }
}
