//! How a runner (the `outbox-relay` binary) finds, configures and connects
//! this publisher: URL scheme `kafka://host:port[,host:port]`, and the
//! settings that do not belong in the URL. See [`outbox_core::backend`].

use crate::config::KafkaConfig;
use crate::error::KafkaError;
use crate::publisher::KafkaPublisher;
use outbox_core::backend::{Backend, Descriptor, InvalidSetting, Role, Setting, Settings};

const TOPIC_PREFIX: &str = "topic_prefix";
const PROPERTIES: &str = "properties";

const SETTINGS: &[Setting] = &[
    Setting::text(TOPIC_PREFIX, "Kafka: topic prefix (topic `orders` goes to `PREFIXorders`).")
        .with_value_name("PREFIX"),
    Setting::map(
        PROPERTIES,
        "property",
        "Kafka: a librdkafka property (repeatable), e.g. compression.type=lz4; SASL/SSL settings go here. Default: librdkafka's, plus idempotence and acks=all.",
    )
    .secret(),
];

/// The Kafka publisher as a [`Backend`].
#[derive(Debug, Clone, Copy, Default)]
pub struct KafkaBackend;

impl Backend for KafkaBackend {
    const DESCRIPTOR: Descriptor = Descriptor::new("kafka", Role::Sink, "kafka")
        .with_schemes(&["kafka"])
        .with_example("kafka://127.0.0.1:9092")
        .with_settings(SETTINGS);

    type Config = KafkaConfig;
    type Connected = KafkaPublisher;
    type Error = KafkaError;

    fn configure(url: &str, settings: &Settings) -> Result<KafkaConfig, InvalidSetting> {
        let mut config =
            KafkaConfig::from_url(url).map_err(|e| InvalidSetting::url(e.to_string()))?;
        if let Some(prefix) = settings.text(TOPIC_PREFIX) {
            config = config.with_topic_prefix(prefix);
        }
        for (name, value) in settings.map(PROPERTIES) {
            let name = name.trim();
            if name.is_empty() {
                return Err(InvalidSetting::new(
                    PROPERTIES,
                    "a property needs a name: NAME=VALUE",
                ));
            }
            config = config.with_property(name, value);
        }
        Ok(config)
    }

    async fn connect(config: KafkaConfig) -> Result<KafkaPublisher, KafkaError> {
        // Creating the producer does not wait for a broker: delivery does.
        KafkaPublisher::new(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configures_from_url_and_settings() {
        let config = KafkaBackend::configure(
            "kafka://127.0.0.1:9092",
            &Settings::new().with_text(TOPIC_PREFIX, "app.").with_entry(
                PROPERTIES,
                "compression.type",
                "lz4",
            ),
        )
        .unwrap();
        assert_eq!(config.kafka_topic("orders"), "app.orders");
        assert_eq!(config.property("compression.type"), Some("lz4"));
        let err = KafkaBackend::configure("kafka://u:p@h:1", &Settings::new()).unwrap_err();
        assert_eq!(err.setting(), InvalidSetting::URL);
    }
}
