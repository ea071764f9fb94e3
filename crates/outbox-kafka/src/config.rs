//! [`KafkaConfig`]: brokers, librdkafka properties, topic mapping.

use crate::error::{KafkaError, UnknownTopic};
use crate::secret::is_secret_property;
use outbox_broker::ConnectPolicy;
use outbox_core::cloudevents::Source;
use outbox_core::WireFormat;
use rdkafka::ClientConfig;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// Environment variable read by [`KafkaConfig::from_env`].
pub const KAFKA_BROKERS_ENV: &str = "KAFKA_BROKERS";
/// Brokers used by [`KafkaConfig::from_env`] when [`KAFKA_BROKERS_ENV`] is unset.
pub const DEFAULT_BROKERS: &str = "127.0.0.1:9092";

/// Properties the publisher sets itself; a conflicting value is refused when
/// the publisher is built.
const FIXED: &[(&str, &str)] = &[("enable.idempotence", "true"), ("acks", "all")];

/// Kafka publisher configuration.
///
/// Any librdkafka property passes through with [`with_property`](Self::with_property)
/// (SASL/SSL, compression, `linger.ms`, `batch.size`, ...). `enable.idempotence=true`
/// and `acks=all` are always set: they are what makes per-key order and
/// "ack before mark" hold, so a config that sets them otherwise is refused.
///
/// `Debug` redacts every property whose name looks secret (see [`is_secret_property`](crate::is_secret_property)).
#[derive(Clone)]
pub struct KafkaConfig {
    brokers: String,
    properties: BTreeMap<String, String>,
    topic_prefix: String,
    topic_map: BTreeMap<String, String>,
    unknown_topic: UnknownTopic,
    content_type: String,
    queue_full_timeout: Duration,
    max_in_flight: usize,
    connect: ConnectPolicy,
    wire_format: WireFormat,
    cloudevents_source: Option<Source>,
    /// Whether `message.timeout.ms` was set by the caller (not the default).
    message_timeout_set: bool,
}

/// librdkafka's name for `message.timeout.ms` and its alias.
const MESSAGE_TIMEOUT: &str = "message.timeout.ms";
const MESSAGE_TIMEOUT_ALIAS: &str = "delivery.timeout.ms";

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let props: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| {
                let v = if is_secret_property(k) {
                    "<redacted>"
                } else {
                    v.as_str()
                };
                (k.as_str(), v)
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("properties", &props)
            .field("topic_prefix", &self.topic_prefix)
            .field("topic_map", &self.topic_map)
            .field("unknown_topic", &self.unknown_topic)
            .field("content_type", &self.content_type)
            .field("queue_full_timeout", &self.queue_full_timeout)
            .field("max_in_flight", &self.max_in_flight)
            .field("connect", &self.connect)
            .field("wire_format", &self.wire_format)
            .field("cloudevents_source", &self.cloudevents_source)
            .finish()
    }
}

impl KafkaConfig {
    /// A config for a comma-separated broker list (`host:port,host2:port`).
    ///
    /// Defaults: `message.timeout.ms=30000` (a send not acknowledged within
    /// 30 s is reported as a retryable `PUBLISH_TIMEOUT`, well inside the
    /// relay's lease), `client.id=outbox`, no topic mapping, unknown topics
    /// permanent, content type `application/octet-stream`, wire format
    /// [`WireFormat::Headers`].
    pub fn new(brokers: impl Into<String>) -> Self {
        let mut properties = BTreeMap::new();
        properties.insert("message.timeout.ms".to_owned(), "30000".to_owned());
        properties.insert("client.id".to_owned(), "outbox".to_owned());
        Self {
            brokers: brokers.into(),
            properties,
            topic_prefix: String::new(),
            topic_map: BTreeMap::new(),
            unknown_topic: UnknownTopic::default(),
            content_type: outbox_core::headers::DEFAULT_CONTENT_TYPE.to_owned(),
            queue_full_timeout: Duration::from_secs(30),
            max_in_flight: 10_000,
            // librdkafka's reconnect backoff follows the cap (1 s).
            connect: ConnectPolicy::default()
                .with_delays(Duration::from_millis(100), Duration::from_secs(1)),
            wire_format: WireFormat::Headers,
            cloudevents_source: None,
            message_timeout_set: false,
        }
    }

    /// Parses `kafka://host:port[,host2:port]`. Credentials in the URL are
    /// refused (they would end up in logs): set `sasl.username` /
    /// `sasl.password` with [`with_property`](Self::with_property) instead.
    pub fn from_url(url: &str) -> Result<Self, KafkaError> {
        let rest = url
            .strip_prefix("kafka://")
            .ok_or_else(|| KafkaError::InvalidUrl("the URL must start with kafka://".into()))?;
        let rest = rest.trim_end_matches('/');
        if rest.contains('@') {
            return Err(KafkaError::InvalidUrl(
                "credentials are not accepted in a kafka:// URL; set sasl.username and sasl.password properties".into(),
            ));
        }
        if rest.contains(['/', '?', '#']) {
            return Err(KafkaError::InvalidUrl(
                "a kafka:// URL holds only host:port pairs separated by commas".into(),
            ));
        }
        let mut hosts = Vec::new();
        for host in rest.split(',') {
            let host = host.trim();
            let valid = host
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
            if !valid {
                return Err(KafkaError::InvalidUrl(format!(
                    "{host:?} is not a host:port pair"
                )));
            }
            hosts.push(host);
        }
        Ok(Self::new(hosts.join(",")))
    }

    /// Brokers from `KAFKA_BROKERS` (a broker list or a `kafka://` URL),
    /// default `127.0.0.1:9092`.
    pub fn from_env() -> Result<Self, KafkaError> {
        match std::env::var(KAFKA_BROKERS_ENV) {
            Ok(v) if v.starts_with("kafka://") => Self::from_url(&v),
            Ok(v) if !v.trim().is_empty() => Ok(Self::new(v.trim())),
            _ => Ok(Self::new(DEFAULT_BROKERS)),
        }
    }

    /// Sets any librdkafka property (see librdkafka's CONFIGURATION.md), e.g.
    /// `security.protocol`, `sasl.mechanism`, `sasl.username`,
    /// `sasl.password`, `compression.type`, `linger.ms`, `batch.size`.
    pub fn with_property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let mut name = name.into();
        if name == MESSAGE_TIMEOUT_ALIAS || name == MESSAGE_TIMEOUT {
            // One name for the one setting: the last one given wins.
            name = MESSAGE_TIMEOUT.to_owned();
            self.message_timeout_set = true;
        }
        self.properties.insert(name, value.into());
        self
    }

    /// Fits the send timeout to a relay holding its claims for `lock` (its
    /// lock timeout). librdkafka keeps a message it was handed, and sends
    /// it when a broker answers, until `message.timeout.ms` passes, even
    /// after the relay dropped the delivery: a copy sent after the relay's
    /// lease ended could reach Kafka after another relay took the events
    /// over and published the key's later events. The relay keeps this
    /// timeout back from its lease end ([`outbox_core::Sink::late_send_bound`]),
    /// so it must be short against the lease: when not set, it becomes a
    /// quarter of `lock` (at most the default 30 s); one set above a
    /// quarter of `lock` (or to 0, no timeout) is refused.
    pub fn with_lease(self, lock: Duration) -> Result<Self, KafkaError> {
        if !self.message_timeout_set {
            let ms = (lock / 4).as_millis().clamp(1, 30_000).to_string();
            let mut config = self.with_property(MESSAGE_TIMEOUT, ms);
            config.message_timeout_set = false;
            return Ok(config);
        }
        let timeout = self.message_timeout();
        if timeout.is_zero() || timeout > lock / 4 {
            let set = self.property(MESSAGE_TIMEOUT).unwrap_or_default();
            return Err(KafkaError::Config {
                property: MESSAGE_TIMEOUT.to_owned(),
                reason: format!(
                    "{set} ms (0 = no timeout) is more than a quarter of the relay's lock timeout ({} ms): librdkafka could still send a message after the relay's lease ended, behind another relay's later events of its key; set it to at most {} ms or raise the lock timeout",
                    lock.as_millis(),
                    (lock / 4).as_millis()
                ),
            });
        }
        Ok(self)
    }

    /// How long librdkafka keeps trying to send a message
    /// (`message.timeout.ms`); `Duration::MAX` for 0 (no timeout) or a value
    /// that is not a number (librdkafka refuses it when the producer is made).
    pub fn message_timeout(&self) -> Duration {
        match self.property(MESSAGE_TIMEOUT).map(str::parse::<u64>) {
            Some(Ok(0)) | Some(Err(_)) => Duration::MAX,
            Some(Ok(ms)) => Duration::from_millis(ms),
            None => Duration::from_secs(300),
        }
    }

    /// Prefixes every Kafka topic (after [`with_topic_mapping`](Self::with_topic_mapping)), e.g. `prod.`.
    pub fn with_topic_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.topic_prefix = prefix.into();
        self
    }

    /// Sends events of topic `event_topic` to Kafka topic `kafka_topic`
    /// (the prefix is still applied).
    pub fn with_topic_mapping(
        mut self,
        event_topic: impl Into<String>,
        kafka_topic: impl Into<String>,
    ) -> Self {
        self.topic_map
            .insert(event_topic.into(), kafka_topic.into());
        self
    }

    /// What an event for a topic that does not exist becomes (default: permanent).
    pub fn with_unknown_topic(mut self, policy: UnknownTopic) -> Self {
        self.unknown_topic = policy;
        self
    }

    /// The `content-type` header for events that carry none of their own
    /// (default `application/octet-stream`).
    pub fn with_content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = content_type.into();
        self
    }

    /// How long a send waits for an acknowledgement before it is reported as a
    /// retryable `PUBLISH_TIMEOUT` (librdkafka `message.timeout.ms`, default 30 s).
    /// Keep it at most a quarter of the relay's lease (see [`Self::with_lease`]).
    pub fn with_delivery_timeout(self, timeout: Duration) -> Self {
        let ms = timeout.as_millis().max(1).to_string();
        self.with_property("message.timeout.ms", ms)
    }

    /// How long a send may wait in-process for room in librdkafka's local
    /// queue (`queue.buffering.max.messages`) before the event is reported as
    /// a retryable failure (default 30 s).
    pub fn with_queue_full_timeout(mut self, timeout: Duration) -> Self {
        self.queue_full_timeout = timeout;
        self
    }

    /// At most `n` sends wait for their delivery report at once (minimum 1;
    /// default 10 000: librdkafka batches and pipelines them itself).
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// How [`KafkaPublisher::connect`](crate::KafkaPublisher::connect)
    /// checks the brokers at start-up (attempts, timeout per metadata
    /// request, backoff). librdkafka reconnects by itself afterwards.
    pub fn with_connect_policy(mut self, policy: ConnectPolicy) -> Self {
        self.connect = policy;
        self
    }

    /// How events are laid out: the payload as the record value with the
    /// metadata in record headers ([`WireFormat::Headers`], the default),
    /// or the protobuf envelope as the value ([`WireFormat::Envelope`]; see
    /// [`outbox_core::BrokerMessage`]), or a CloudEvent
    /// ([`WireFormat::CloudEvents`] binary mode, [`WireFormat::CloudEventsJson`]
    /// structured mode; both need [`Self::with_cloudevents_source`]). The record key is the same in every format.
    /// librdkafka's `message.max.bytes` applies to the value sent (the
    /// envelope in that format): a larger record fails with a permanent
    /// `PUBLISH_TOO_LARGE`.
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

    /// The send window bound.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    /// The connect policy.
    pub fn connect_policy(&self) -> ConnectPolicy {
        self.connect
    }

    /// The broker list.
    pub fn brokers(&self) -> &str {
        &self.brokers
    }

    /// A property's value, if set.
    pub fn property(&self, name: &str) -> Option<&str> {
        self.properties.get(name).map(String::as_str)
    }

    /// The unknown-topic policy.
    pub fn unknown_topic(&self) -> UnknownTopic {
        self.unknown_topic
    }

    /// The default content type.
    pub fn content_type(&self) -> &str {
        &self.content_type
    }

    /// The queue-full wait bound.
    pub fn queue_full_timeout(&self) -> Duration {
        self.queue_full_timeout
    }

    /// The Kafka topic an event topic is published to: the explicit mapping
    /// if any, else the event topic; then the prefix.
    pub fn kafka_topic(&self, event_topic: &str) -> String {
        let base = self
            .topic_map
            .get(event_topic)
            .map_or(event_topic, String::as_str);
        format!("{}{}", self.topic_prefix, base)
    }

    /// An rdkafka [`ClientConfig`] with the brokers and every property, for
    /// building consumers or admin clients with the same connection and
    /// security settings. It holds secrets in clear: do not log it.
    pub fn client_config(&self) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &self.brokers);
        // librdkafka waits up to 10 s between reconnects by default; the
        // connect policy's cap (1 s) brings a returning broker back in use
        // sooner. A property given explicitly wins.
        cc.set(
            "reconnect.backoff.max.ms",
            self.connect.max_delay.as_millis().to_string(),
        );
        for (k, v) in &self.properties {
            cc.set(k, v);
        }
        cc
    }

    /// The producer's [`ClientConfig`]: [`client_config`](Self::client_config)
    /// plus `enable.idempotence=true` and `acks=all`. Refuses a config that
    /// sets those two otherwise.
    pub(crate) fn producer_config(&self) -> Result<ClientConfig, KafkaError> {
        for (name, required) in FIXED {
            if let Some(v) = self.properties.get(*name) {
                let ok = match *name {
                    "acks" => v == "all" || v == "-1",
                    _ => v.eq_ignore_ascii_case(required),
                };
                if !ok {
                    return Err(KafkaError::Config {
                        property: (*name).to_owned(),
                        reason: format!("the outbox publisher requires {name}={required}"),
                    });
                }
            }
        }
        let mut cc = self.client_config();
        for (name, value) in FIXED {
            cc.set(*name, *value);
        }
        Ok(cc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_redacts_secrets() {
        let c = KafkaConfig::new("b:9092")
            .with_property("sasl.username", "alice")
            .with_property("sasl.password", "hunter2-sasl")
            .with_property("ssl.key.password", "hunter2-key")
            .with_property("ssl.keystore.password", "hunter2-store")
            .with_property("sasl.oauthbearer.client.secret", "hunter2-oauth")
            .with_property("my.custom.Secret", "hunter2-custom")
            .with_property("compression.type", "lz4");
        let s = format!("{c:?}");
        assert!(!s.contains("hunter2"), "{s}");
        assert!(s.contains("alice"));
        assert!(s.contains("lz4"));
        assert_eq!(s.matches("<redacted>").count(), 5);
        // The values are still there for librdkafka.
        assert_eq!(c.property("sasl.password"), Some("hunter2-sasl"));
    }

    #[test]
    fn url_parsing() {
        let c = KafkaConfig::from_url("kafka://a:9092,b:9093").unwrap();
        assert_eq!(c.brokers(), "a:9092,b:9093");
        assert_eq!(
            KafkaConfig::from_url("kafka://127.0.0.1:9092/")
                .unwrap()
                .brokers(),
            "127.0.0.1:9092"
        );
        let e = KafkaConfig::from_url("kafka://u:pw-secret@a:9092").unwrap_err();
        assert!(!e.to_string().contains("pw-secret"));
        assert!(KafkaConfig::from_url("nats://a:1").is_err());
        assert!(KafkaConfig::from_url("kafka://a").is_err());
        assert!(KafkaConfig::from_url("kafka://a:x").is_err());
        assert!(KafkaConfig::from_url("kafka://").is_err());
    }

    #[test]
    fn topic_mapping() {
        let c = KafkaConfig::new("b:1")
            .with_topic_prefix("prod.")
            .with_topic_mapping("orders", "orders-v2");
        assert_eq!(c.kafka_topic("orders"), "prod.orders-v2");
        assert_eq!(c.kafka_topic("users"), "prod.users");
        assert_eq!(KafkaConfig::new("b:1").kafka_topic("users"), "users");
    }

    #[test]
    fn idempotence_and_acks_are_enforced() {
        assert!(KafkaConfig::new("b:1").producer_config().is_ok());
        assert!(KafkaConfig::new("b:1")
            .with_property("acks", "-1")
            .producer_config()
            .is_ok());
        let e = KafkaConfig::new("b:1")
            .with_property("acks", "1")
            .producer_config()
            .unwrap_err();
        assert!(e.to_string().contains("acks=all"), "{e}");
        assert!(KafkaConfig::new("b:1")
            .with_property("enable.idempotence", "false")
            .producer_config()
            .is_err());
        let cc = KafkaConfig::new("b:1").producer_config().unwrap();
        assert_eq!(cc.get("enable.idempotence"), Some("true"));
        assert_eq!(cc.get("acks"), Some("all"));
        assert_eq!(cc.get("bootstrap.servers"), Some("b:1"));
    }

    /// The relay keeps the send timeout back from its lease end: unset, it
    /// becomes a quarter of the lock timeout; set above that (or to
    /// 0, none), the config is refused with both numbers named.
    #[test]
    fn the_send_timeout_fits_the_relays_lease() {
        let lock = Duration::from_secs(3);
        let c = KafkaConfig::new("b:1").with_lease(lock).unwrap();
        assert_eq!(c.property("message.timeout.ms"), Some("750"));
        assert_eq!(c.message_timeout(), Duration::from_millis(750));
        let long = KafkaConfig::new("b:1")
            .with_lease(Duration::from_secs(600))
            .unwrap();
        assert_eq!(long.message_timeout(), Duration::from_secs(30), "capped");
        let ok = KafkaConfig::new("b:1")
            .with_property("delivery.timeout.ms", "700")
            .with_lease(lock)
            .unwrap();
        assert_eq!(ok.message_timeout(), Duration::from_millis(700), "alias");
        for too_long in ["751", "0"] {
            let err = KafkaConfig::new("b:1")
                .with_property("message.timeout.ms", too_long)
                .with_lease(lock)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("message.timeout.ms")
                    && err.contains(&format!("{too_long} ms"))
                    && err.contains("at most 750 ms"),
                "{err}"
            );
        }
    }

    #[test]
    fn delivery_timeout_sets_message_timeout() {
        let c = KafkaConfig::new("b:1").with_delivery_timeout(Duration::from_secs(5));
        assert_eq!(c.property("message.timeout.ms"), Some("5000"));
        assert_eq!(
            KafkaConfig::new("b:1").property("message.timeout.ms"),
            Some("30000")
        );
    }
}
