#![doc = include_str!("../README.md")]

mod config;
pub mod descriptor;
mod error;
mod publisher;

pub use config::{
    is_secret_property, KafkaConfig, UnknownTopic, DEFAULT_BROKERS, KAFKA_BROKERS_ENV,
};
pub use error::KafkaError;
pub use publisher::{KafkaPublisher, OutboxProducer, TracingContext};
pub use rdkafka;
