//! How a runner (the `outbox-relay` binary) finds, configures and connects
//! this publisher: URL schemes `amqp://` and `amqps://`, and the settings
//! that do not belong in the URL. See [`outbox_core::backend`].

use crate::config::AmqpConfig;
use crate::error::AmqpError;
use crate::publisher::AmqpPublisher;
use outbox_core::backend::{Backend, Descriptor, InvalidSetting, Role, Setting, Settings};

const EXCHANGE: &str = "exchange";

const SETTINGS: &[Setting] = &[Setting::text(
    EXCHANGE,
    "AMQP: exchange for topics without an `exchange/key` route (`\"\"` is the default exchange, routing key = topic).",
)
.with_default("")
.with_value_name("EXCHANGE")];

/// The RabbitMQ / AMQP 0.9.1 publisher as a [`Backend`].
#[derive(Debug, Clone, Copy, Default)]
pub struct AmqpBackend;

impl Backend for AmqpBackend {
    const DESCRIPTOR: Descriptor = Descriptor::new("amqp", Role::Sink, "amqp")
        .with_schemes(&["amqp", "amqps"])
        .with_example("amqp://guest:guest@127.0.0.1:5672/%2f")
        .with_settings(SETTINGS);

    type Config = AmqpConfig;
    type Connected = AmqpPublisher;
    type Error = AmqpError;

    fn configure(url: &str, settings: &Settings) -> Result<AmqpConfig, InvalidSetting> {
        let mut config =
            AmqpConfig::from_url(url).map_err(|e| InvalidSetting::url(e.to_string()))?;
        if let Some(exchange) = settings.text(EXCHANGE) {
            config = config.with_exchange(exchange);
        }
        Ok(config)
    }

    async fn connect(config: AmqpConfig) -> Result<AmqpPublisher, AmqpError> {
        AmqpPublisher::connect(config).await
    }

    /// Connects; when the broker is unreachable (a retryable error), warns
    /// and returns a publisher that connects on a later batch.
    async fn connect_lazy(config: AmqpConfig) -> Result<AmqpPublisher, AmqpError> {
        match AmqpPublisher::connect(config.clone()).await {
            Err(e) if e.is_retryable() => {
                tracing::warn!(error = %e, "AMQP broker not reachable; connecting on a later batch");
                Ok(AmqpPublisher::lazy(config))
            }
            connected => connected,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configures_from_url_and_settings() {
        let config = AmqpBackend::configure(
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            &Settings::new().with_text(EXCHANGE, "orders"),
        )
        .unwrap();
        assert_eq!(config.route_for("created").exchange, "orders");
        let err = AmqpBackend::configure("amqp://u:s3cret@[bad", &Settings::new()).unwrap_err();
        assert_eq!(err.setting(), InvalidSetting::URL);
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }
}
