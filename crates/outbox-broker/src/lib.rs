#![doc = include_str!("../README.md")]

mod connect;
mod window;

pub use connect::{ConnectPolicy, ReconnectGate};
pub use window::{SendWindow, Sent, WindowResult};
