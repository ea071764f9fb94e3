//! Errors of connecting and of topology management. Per-event publish
//! failures are not errors of this type: they are [`outbox_core::Outcome`]s.

use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use thiserror::Error;

/// Why connecting to the broker or declaring topology failed. Messages never
/// contain passwords.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AmqpError {
    /// The configuration is unusable (bad URI, unreadable certificate).
    #[error("invalid AMQP configuration: {0}")]
    InvalidConfig(String),
    /// Could not connect or open a channel (after the configured attempts).
    #[error("cannot connect to the AMQP broker: {0}")]
    Connect(#[source] lapin::Error),
    /// A connection attempt did not finish in time.
    #[error("connecting to the AMQP broker timed out")]
    ConnectTimeout,
    /// A broker operation (declare, bind, ...) failed.
    #[error("AMQP operation failed: {0}")]
    Broker(#[source] lapin::Error),
}

impl AmqpError {
    /// Whether trying again later may succeed (broker down, connection
    /// lost), as opposed to bad configuration, refused access or a topology
    /// conflict.
    pub fn is_retryable(&self) -> bool {
        match self {
            AmqpError::InvalidConfig(_) => false,
            AmqpError::ConnectTimeout => true,
            AmqpError::Connect(e) | AmqpError::Broker(e) => lapin_is_retryable(e),
        }
    }
}

/// Classifies a lapin error: I/O, lost connection or channel and broker-side
/// transient conditions are retryable; protocol refusals (access refused,
/// not found, precondition failed, ...) are not.
pub(crate) fn lapin_is_retryable(e: &lapin::Error) -> bool {
    match e {
        lapin::Error::IOError(_)
        | lapin::Error::InvalidChannelState(_)
        | lapin::Error::InvalidConnectionState(_)
        | lapin::Error::MissingHeartbeatError
        | lapin::Error::ChannelsLimitReached => true,
        lapin::Error::ProtocolError(p) => match p.kind() {
            AMQPErrorKind::Soft(s) => matches!(s, AMQPSoftError::RESOURCELOCKED),
            AMQPErrorKind::Hard(h) => matches!(
                h,
                AMQPHardError::CONNECTIONFORCED
                    | AMQPHardError::RESOURCEERROR
                    | AMQPHardError::INTERNALERROR
            ),
        },
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::AMQPError;
    use std::sync::Arc;

    #[test]
    fn classification() {
        let io = lapin::Error::IOError(Arc::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert!(AmqpError::Connect(io).is_retryable());
        let refused = lapin::Error::ProtocolError(AMQPError::new(
            AMQPSoftError::ACCESSREFUSED.into(),
            "no".into(),
        ));
        assert!(!AmqpError::Broker(refused).is_retryable());
        let forced = lapin::Error::ProtocolError(AMQPError::new(
            AMQPHardError::CONNECTIONFORCED.into(),
            "shutdown".into(),
        ));
        assert!(AmqpError::Broker(forced).is_retryable());
        assert!(!AmqpError::InvalidConfig("x".into()).is_retryable());
    }
}
