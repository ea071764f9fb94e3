//! Errors of connecting and of stream management. Per-event publish
//! failures are not errors of this type: they are [`outbox_core::Outcome`]s.

use thiserror::Error;

/// Why connecting to NATS or managing a stream failed. Messages never
/// contain passwords or tokens.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum NatsError {
    /// The configuration is unusable (bad URL, unreadable credentials file).
    #[error("invalid NATS configuration: {0}")]
    InvalidConfig(String),
    /// Could not connect (after the configured attempts).
    #[error("cannot connect to NATS: {message}")]
    Connect {
        /// What async-nats reported.
        kind: async_nats::ConnectErrorKind,
        /// Detail.
        message: String,
    },
    /// A stream exists but does not capture the subjects asked for.
    #[error("stream {stream} exists but does not capture subjects {missing:?}")]
    StreamMismatch {
        /// The stream name.
        stream: String,
        /// Subjects the stream's configuration lacks.
        missing: Vec<String>,
    },
    /// A JetStream API call failed.
    #[error("JetStream request failed: {0}")]
    JetStream(String),
}

impl NatsError {
    /// Whether trying again later may succeed (a down server, a timeout),
    /// as opposed to a configuration or authentication problem.
    pub fn is_retryable(&self) -> bool {
        use async_nats::ConnectErrorKind as K;
        match self {
            NatsError::InvalidConfig(_) | NatsError::StreamMismatch { .. } => false,
            NatsError::Connect { kind, .. } => {
                matches!(kind, K::Dns | K::TimedOut | K::Io | K::MaxReconnects)
            }
            NatsError::JetStream(_) => true,
        }
    }
}

impl From<async_nats::ConnectError> for NatsError {
    /// async-nats reports a failed TLS handshake (a certificate the trusted
    /// roots did not sign, a wrong host name) as an I/O error; it is
    /// classified as [`async_nats::ConnectErrorKind::Tls`] here, so that it
    /// is not retried and its message says TLS.
    fn from(e: async_nats::ConnectError) -> Self {
        let mut chain = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            let text = s.to_string();
            if !chain.contains(&text) {
                chain.push_str(": ");
                chain.push_str(&text);
            }
            source = s.source();
        }
        let lower = chain.to_ascii_lowercase();
        let tls = e.kind() == async_nats::ConnectErrorKind::Tls
            || ["certificate", "tls", "handshake"]
                .iter()
                .any(|w| lower.contains(w));
        if tls {
            NatsError::Connect {
                kind: async_nats::ConnectErrorKind::Tls,
                message: format!("TLS handshake failed: {chain}"),
            }
        } else {
            NatsError::Connect {
                kind: e.kind(),
                message: chain,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        let io = NatsError::Connect {
            kind: async_nats::ConnectErrorKind::Io,
            message: "refused".into(),
        };
        assert!(io.is_retryable());
        let auth = NatsError::Connect {
            kind: async_nats::ConnectErrorKind::AuthorizationViolation,
            message: "no".into(),
        };
        assert!(!auth.is_retryable());
        assert!(!NatsError::InvalidConfig("x".into()).is_retryable());
        let tls: NatsError = async_nats::ConnectError::from(std::io::Error::other(
            "invalid peer certificate: UnknownIssuer",
        ))
        .into();
        assert!(
            matches!(
                &tls,
                NatsError::Connect {
                    kind: async_nats::ConnectErrorKind::Tls,
                    ..
                }
            ),
            "{tls:?}"
        );
        assert!(!tls.is_retryable());
        assert!(tls.to_string().contains("TLS handshake failed"), "{tls}");
    }
}
