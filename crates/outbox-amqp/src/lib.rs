#![doc = include_str!("../README.md")]

mod config;
pub mod descriptor;
mod error;
mod publisher;

pub use config::{AmqpConfig, AmqpTls, Route};
pub use error::AmqpError;
pub use lapin;
pub use publisher::AmqpPublisher;
