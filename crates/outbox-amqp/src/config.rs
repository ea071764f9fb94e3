//! Connection and publishing options.

use crate::error::AmqpError;
use outbox_broker::ConnectPolicy;
use outbox_core::cloudevents::Source;
use outbox_core::WireFormat;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// Where one event goes: an exchange and a routing key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Exchange name (`""` is the default exchange, which routes to the
    /// queue named by the routing key).
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
}

/// TLS options for `amqps://` URIs (rustls; the system roots are trusted).
#[derive(Clone, Default)]
pub struct AmqpTls {
    /// Extra PEM certificate chain to trust (a private CA), read at connect time.
    pub ca_certificate: Option<PathBuf>,
    /// Client identity for mutual TLS: a PKCS#12 file and its password.
    pub client_identity: Option<(PathBuf, String)>,
}

impl fmt::Debug for AmqpTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpTls")
            .field("ca_certificate", &self.ca_certificate)
            .field(
                "client_identity",
                &self.client_identity.as_ref().map(|(p, _)| (p, "***")),
            )
            .finish()
    }
}

/// Publishes waiting for their confirm at once, by default. RabbitMQ
/// confirms persistent messages after they reach its disk, in groups: a
/// window of 256 split a relay batch of 1,000 into four waves of that
/// latency, and measured 9.9k events/s for `publisher.deliver` on the
/// bench machine against 13.5k with the whole batch in flight
/// (BENCHMARKS.md, "RabbitMQ's confirm window").
const DEFAULT_MAX_IN_FLIGHT: usize = 2_048;

/// Everything [`crate::AmqpPublisher`] needs.
///
/// | option | default |
/// |---|---|
/// | uri | `amqp://guest:guest@127.0.0.1:5672/%2f` (`amqps://` for TLS) |
/// | route of topic `t` | explicit route if configured; else `exchange/key` split at the first `/`; else the default exchange (`""`) with routing key `t` |
/// | `max_in_flight` | 2,048 unconfirmed publishes (a whole relay batch of up to 1,000 in flight at once) |
/// | `max_message_bytes` | 16 MiB (RabbitMQ 4's default `max_message_size`) |
/// | `confirm_timeout` | 30 s (then `PUBLISH_TIMEOUT`: the sink is unavailable, maybe delivered) |
/// | `connect_timeout` | 10 s per attempt |
/// | `connect_attempts` | 3 for [`crate::AmqpPublisher::connect`], exponential backoff |
/// | reconnect | one attempt per batch after the connection broke, spaced by the policy's backoff (100 ms doubling to 500 ms: at most the relay breaker's probe delay of 0.5-1 s, so every probe after a broker's return tries to reconnect) |
/// | persistent (delivery mode 2) | on |
/// | `wire_format` | [`WireFormat::Headers`]: the payload as the body; [`WireFormat::Envelope`]: the protobuf envelope, `content_type` `application/x-protobuf` |
#[derive(Clone)]
pub struct AmqpConfig {
    pub(crate) uri: String,
    pub(crate) tls: AmqpTls,
    pub(crate) default_exchange: String,
    pub(crate) routes: BTreeMap<String, Route>,
    pub(crate) max_in_flight: usize,
    pub(crate) max_message_bytes: usize,
    pub(crate) confirm_timeout: Duration,
    pub(crate) connect: ConnectPolicy,
    pub(crate) persistent: bool,
    pub(crate) connection_name: String,
    pub(crate) wire_format: WireFormat,
    pub(crate) cloudevents_source: Option<Source>,
}

impl Default for AmqpConfig {
    fn default() -> Self {
        Self {
            uri: "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned(),
            tls: AmqpTls::default(),
            default_exchange: String::new(),
            routes: BTreeMap::new(),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_message_bytes: 16 * 1024 * 1024,
            confirm_timeout: Duration::from_secs(30),
            connect: ConnectPolicy::default()
                .with_attempts(3)
                .with_timeout(Duration::from_secs(10))
                .with_delays(Duration::from_millis(100), Duration::from_millis(500)),
            persistent: true,
            connection_name: "outbox-relay".to_owned(),
            wire_format: WireFormat::Headers,
            cloudevents_source: None,
        }
    }
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("uri", &redact_url(&self.uri))
            .field("tls", &self.tls)
            .field("default_exchange", &self.default_exchange)
            .field("routes", &self.routes)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect", &self.connect)
            .field("persistent", &self.persistent)
            .field("connection_name", &self.connection_name)
            .field("wire_format", &self.wire_format)
            .field("cloudevents_source", &self.cloudevents_source)
            .finish()
    }
}

use outbox_core::redact_url;

impl AmqpConfig {
    /// A configuration for `uri` (`amqp://user:pass@host:5672/vhost` or
    /// `amqps://...`), checked with lapin's URI parser.
    pub fn from_url(uri: &str) -> Result<Self, AmqpError> {
        uri.parse::<lapin::uri::AMQPUri>().map_err(|e| {
            AmqpError::InvalidConfig(format!("AMQP URI {} is invalid: {e}", redact_url(uri)))
        })?;
        Ok(Self {
            uri: uri.to_owned(),
            ..Self::default()
        })
    }

    /// Events whose topic has no explicit route and no `/` go to `exchange`
    /// with the topic as routing key (`""`, the default, is AMQP's default
    /// exchange: the topic names the queue).
    pub fn with_exchange(mut self, exchange: impl Into<String>) -> Self {
        self.default_exchange = exchange.into();
        self
    }

    /// Sends events of `topic` to `exchange` with `routing_key`.
    pub fn with_route(
        mut self,
        topic: impl Into<String>,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Self {
        self.routes.insert(
            topic.into(),
            Route {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
            },
        );
        self
    }

    /// TLS options (used with `amqps://`).
    pub fn with_tls(mut self, tls: AmqpTls) -> Self {
        self.tls = tls;
        self
    }

    /// At most `n` publishes wait for their confirm at once (minimum 1).
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// Larger message bodies (the payload, or in the envelope format the
    /// envelope around it) fail with a permanent `PUBLISH_TOO_LARGE` without
    /// being sent. Keep it at or below the broker's `max_message_size`: a
    /// broker refusing a message closes the channel, failing the whole window.
    pub fn with_max_message_bytes(mut self, n: usize) -> Self {
        self.max_message_bytes = n;
        self
    }

    /// How long to wait for a publisher confirm before `PUBLISH_TIMEOUT`.
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    outbox_broker::connect_policy_builders!(
        "Attempts of [`crate::AmqpPublisher::connect`] (minimum 1), with exponential backoff."
    );

    /// Persistent messages (delivery mode 2, the default) or transient ones.
    pub fn with_persistent(mut self, persistent: bool) -> Self {
        self.persistent = persistent;
        self
    }

    /// The connection name shown in the RabbitMQ management UI.
    pub fn with_connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// How events are laid out: the payload as the body with the metadata
    /// in properties and headers ([`WireFormat::Headers`], the default), or
    /// the protobuf envelope as the body with `content_type`
    /// `application/x-protobuf` ([`WireFormat::Envelope`]; see
    /// [`outbox_core::BrokerMessage`]), or a CloudEvent
    /// ([`WireFormat::CloudEvents`] binary mode, [`WireFormat::CloudEventsJson`]
    /// structured mode; both need [`Self::with_cloudevents_source`]).
    pub fn with_wire_format(mut self, format: WireFormat) -> Self {
        self.wire_format = format;
        self
    }

    /// The wire format.
    pub fn wire_format(&self) -> WireFormat {
        self.wire_format
    }

    /// The CloudEvents `source` attribute, required by the CloudEvents wire
    /// formats ([`WireFormat::CloudEvents`], [`WireFormat::CloudEventsJson`]):
    /// without it the publisher refuses to start.
    pub fn with_cloudevents_source(mut self, source: Source) -> Self {
        self.cloudevents_source = Some(source);
        self
    }

    /// The CloudEvents `source` attribute, if set.
    pub fn cloudevents_source(&self) -> Option<&Source> {
        self.cloudevents_source.as_ref()
    }

    /// A CloudEvents wire format without a source is refused.
    pub(crate) fn check_cloudevents(&self) -> Result<(), AmqpError> {
        outbox_core::cloudevents::require_source(self.wire_format, self.cloudevents_source.as_ref())
            .map_err(|e| AmqpError::InvalidConfig(e.to_string()))
    }

    /// The URI, password redacted.
    pub fn uri_redacted(&self) -> String {
        redact_url(&self.uri)
    }

    /// Where an event of `topic` is published.
    pub fn route_for(&self, topic: &str) -> Route {
        if let Some(r) = self.routes.get(topic) {
            return r.clone();
        }
        match topic.split_once('/') {
            Some((exchange, key)) => Route {
                exchange: exchange.to_owned(),
                routing_key: key.to_owned(),
            },
            None => Route {
                exchange: self.default_exchange.clone(),
                routing_key: topic.to_owned(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let c = AmqpConfig::default();
        let r = c.route_for("orders");
        assert_eq!(
            (r.exchange.as_str(), r.routing_key.as_str()),
            ("", "orders")
        );
        let c = c
            .with_exchange("outbox")
            .with_route("pay", "billing", "payments.new");
        let r = c.route_for("orders");
        assert_eq!(
            (r.exchange.as_str(), r.routing_key.as_str()),
            ("outbox", "orders")
        );
        let r = c.route_for("events/order.created");
        assert_eq!(
            (r.exchange.as_str(), r.routing_key.as_str()),
            ("events", "order.created")
        );
        let r = c.route_for("pay");
        assert_eq!(
            (r.exchange.as_str(), r.routing_key.as_str()),
            ("billing", "payments.new")
        );
    }

    #[test]
    fn debug_and_errors_hide_the_password() {
        let c = AmqpConfig::from_url("amqp://guest:s3cr3t@127.0.0.1:5672/%2f").unwrap();
        let s = format!("{c:?}");
        assert!(!s.contains("s3cr3t"), "{s}");
        assert!(s.contains("guest:***@127.0.0.1:5672"), "{s}");
        let t = AmqpTls {
            ca_certificate: None,
            client_identity: Some(("id.p12".into(), "p12pass".into())),
        };
        assert!(!format!("{:?}", c.with_tls(t)).contains("p12pass"));
        let e = AmqpConfig::from_url("amqp://u:s3cr3t@host:notaport/").unwrap_err();
        assert!(!e.to_string().contains("s3cr3t"), "{e}");
        assert_eq!(redact_url("amqp://host/"), "amqp://host/");
    }
}
