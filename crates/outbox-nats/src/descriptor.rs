//! How a runner (the `outbox-relay` binary) finds, configures and connects
//! this publisher: URL schemes `nats://` and `tls://`, and the settings that
//! do not belong in the URL. See [`outbox_core::backend`].

use crate::config::NatsConfig;
use crate::error::NatsError;
use crate::publisher::NatsPublisher;
use outbox_core::backend::{Backend, Descriptor, InvalidSetting, Role, Setting, Settings};

const SUBJECT_PREFIX: &str = "subject_prefix";

const SETTINGS: &[Setting] = &[Setting::text(
    SUBJECT_PREFIX,
    "NATS: subject prefix (topic `orders` goes to `PREFIX.orders`).",
)
.with_value_name("PREFIX")];

/// The NATS JetStream publisher as a [`Backend`].
#[derive(Debug, Clone, Copy, Default)]
pub struct NatsBackend;

impl Backend for NatsBackend {
    const DESCRIPTOR: Descriptor = Descriptor::new("nats", Role::Sink, "nats")
        .with_schemes(&["nats", "tls"])
        .with_example("nats://127.0.0.1:4222")
        .with_settings(SETTINGS);

    type Config = NatsConfig;
    type Connected = NatsPublisher;
    type Error = NatsError;

    fn configure(url: &str, settings: &Settings) -> Result<NatsConfig, InvalidSetting> {
        let mut config =
            NatsConfig::from_url(url).map_err(|e| InvalidSetting::url(e.to_string()))?;
        if let Some(prefix) = settings.text(SUBJECT_PREFIX) {
            config = config.with_subject_prefix(prefix);
        }
        Ok(config)
    }

    async fn connect(config: NatsConfig) -> Result<NatsPublisher, NatsError> {
        NatsPublisher::connect(config).await
    }

    /// Connects; when no server is reachable (a retryable error), returns a
    /// publisher that keeps connecting in the background. A TLS or
    /// authentication failure still fails here.
    async fn connect_lazy(config: NatsConfig) -> Result<NatsPublisher, NatsError> {
        match NatsPublisher::connect(config.clone()).await {
            Err(e) if e.is_retryable() => NatsPublisher::lazy(config).await,
            connected => connected,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configures_from_url_and_settings() {
        let config = NatsBackend::configure(
            "nats://127.0.0.1:4222",
            &Settings::new().with_text(SUBJECT_PREFIX, "outbox"),
        )
        .unwrap();
        assert_eq!(config.subject_for("orders"), "outbox.orders");
        assert!(NatsBackend::DESCRIPTOR.handles("tls://h:4222"));
        let err = NatsBackend::configure("http://x", &Settings::new()).unwrap_err();
        assert_eq!(err.setting(), InvalidSetting::URL);
    }
}
