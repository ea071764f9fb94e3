//! What the broker fixtures share: a message as a consumer received it, in
//! broker-neutral terms, and the service addresses tests use.

use outbox_core::EventId;
use std::collections::BTreeMap;

/// One message as a real consumer received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The broker's deduplication / message id parsed as an event id
    /// (`Nats-Msg-Id`, AMQP `message_id`; for Kafka the `Outbox-Event-Id`
    /// header, Kafka having no message id).
    pub message_id: Option<EventId>,
    /// The `Outbox-Event-Id` header, parsed.
    pub event_id_header: Option<EventId>,
    /// The event type (`Outbox-Event-Type` header; AMQP: the `type` property).
    pub event_type: Option<String>,
    /// The event key (Kafka: the message key unless it is the event id of a
    /// keyless event; elsewhere the `Outbox-Key` header).
    pub key: Option<String>,
    /// Payload bytes.
    pub payload: Vec<u8>,
    /// Every header / application property as text.
    pub headers: BTreeMap<String, String>,
    /// The broker's content type: AMQP's `content_type` property, else the
    /// `content-type` header.
    pub content_type: Option<String>,
    /// Kafka partition (`None` on brokers with one ordered queue / stream).
    pub partition: Option<i32>,
    /// Kafka offset in that partition (`None` elsewhere).
    pub offset: Option<i64>,
}

impl Received {
    /// The event id the message carries (its dedup id).
    pub fn event_id(&self) -> Option<EventId> {
        self.message_id
    }
}

/// `NATS_URL`, or `nats://127.0.0.1:4222`.
pub fn nats_url() -> String {
    env_or("NATS_URL", "nats://127.0.0.1:4222")
}

/// `AMQP_URL`, or `amqp://guest:guest@127.0.0.1:5672/%2f`.
pub fn amqp_url() -> String {
    env_or("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
}

/// `KAFKA_BROKERS`, or `127.0.0.1:9092`.
pub fn kafka_brokers() -> String {
    env_or("KAFKA_BROKERS", "127.0.0.1:9092")
}

/// 12 random lowercase hex characters, for per-test names.
pub fn unique_suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// The first `host:port` of a URL list (`nats://a@h:4222,nats://h2:4222`),
/// resolved; `default_port` when the URL has none.
pub fn first_socket_addr(urls: &str, default_port: u16) -> std::net::SocketAddr {
    use std::net::ToSocketAddrs;
    let first = urls.split(',').next().unwrap_or(urls);
    let rest = first.split_once("://").map_or(first, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let hostport = authority.rsplit('@').next().unwrap_or(authority);
    let hostport = if hostport.contains(':') {
        hostport.to_owned()
    } else {
        format!("{hostport}:{default_port}")
    };
    hostport
        .to_socket_addrs()
        .unwrap_or_else(|e| panic!("cannot resolve {hostport}: {e}"))
        .next()
        .unwrap_or_else(|| panic!("{hostport} resolves to nothing"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_address_of_a_url_list() {
        let a = first_socket_addr("nats://tok@127.0.0.1:4223,nats://x:1", 4222);
        assert_eq!(a.to_string(), "127.0.0.1:4223");
        let a = first_socket_addr("amqp://guest:guest@127.0.0.1/%2f", 5672);
        assert_eq!(a.to_string(), "127.0.0.1:5672");
        let a = first_socket_addr("127.0.0.1:9092,127.0.0.1:9093", 9092);
        assert_eq!(a.to_string(), "127.0.0.1:9092");
    }
}
