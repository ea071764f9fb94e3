#![doc = include_str!("../README.md")]

mod config;
pub mod descriptor;
mod error;
mod publisher;

pub use async_nats;
pub use config::{NatsAuth, NatsConfig, NatsTls};
pub use error::NatsError;
pub use publisher::{NatsPublisher, HEADER_MSG_ID};
