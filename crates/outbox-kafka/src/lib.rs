#![doc = include_str!("../README.md")]

mod config;
pub mod descriptor;
mod error;
mod publisher;
mod secret;

pub use config::{KafkaConfig, DEFAULT_BROKERS, KAFKA_BROKERS_ENV};
pub use error::{KafkaError, UnknownTopic};
pub use publisher::{KafkaPublisher, OutboxProducer, TracingContext};
pub use rdkafka;
pub use secret::is_secret_property;
