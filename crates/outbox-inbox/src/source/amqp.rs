//! [`AmqpSource`]: consumes an existing RabbitMQ queue with manual
//! acknowledgements.
//!
//! | option | default |
//! |---|---|
//! | uri | required (`amqp://user:password@host:5672/vhost`, `amqps://` for TLS; the password is never logged) |
//! | queue | required (must exist: the source declares nothing; a missing queue is [`SourceError::Config`]) |
//! | `prefetch` | 256 unacknowledged deliveries (`basic.qos`) |
//! | `consumer_tag` | chosen by the broker |
//! | `connect_timeout` | 10 s |
//! | connection name | `outbox-inbox` |
//!
//! [`Source::recv`] waits at most `wait` for the first delivery, then takes
//! whatever else the broker already pushed, up to `max`. A token is the
//! channel generation and the delivery tag: it is acknowledged
//! (`basic.ack`, not multiple) on the channel it came from; a token from a
//! channel that has since closed is skipped without error, since the broker
//! already put its message back in the queue.
//!
//! After the connection or the channel is lost, the next [`Source::recv`]
//! reports [`SourceError::Unavailable`] and the one after reconnects (after
//! a backoff of 100 ms doubling to 5 s once attempts fail) and
//! consumes again.
//!
//! [`RawMessage::headers`]: the header table (text values as they are,
//! other kinds written out: numbers, `true`/`false`, nested tables and
//! arrays as JSON-like text), then the `content_type` property as
//! `content-type` when the table has no such entry.
//! [`RawMessage::destination`]: the routing key. [`RawMessage::timestamp`]:
//! the `timestamp` property (seconds).

use super::{reconnect_delay, RawMessage, Received, Source, SourceError};
use futures::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, Consumer};
use outbox_core::redact_url;
use std::fmt;
use std::fmt::Write as _;
use std::time::Duration;
use tokio::time::Instant;

/// Where and how an [`AmqpSource`] consumes. `Debug` hides the password.
#[derive(Clone)]
pub struct AmqpSourceConfig {
    uri: String,
    queue: String,
    prefetch: u16,
    consumer_tag: String,
    connect_timeout: Duration,
    connection_name: String,
}

impl fmt::Debug for AmqpSourceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpSourceConfig")
            .field("uri", &redact_url(&self.uri))
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("consumer_tag", &self.consumer_tag)
            .field("connect_timeout", &self.connect_timeout)
            .field("connection_name", &self.connection_name)
            .finish()
    }
}

impl AmqpSourceConfig {
    /// Consumes `queue` on the broker at `uri`. Checked by
    /// [`validate`](Self::validate) (and when connecting).
    pub fn new(uri: impl Into<String>, queue: impl Into<String>) -> Self {
        Self {
            uri: uri.into(),
            queue: queue.into(),
            prefetch: 256,
            consumer_tag: String::new(),
            connect_timeout: Duration::from_secs(10),
            connection_name: "outbox-inbox".to_owned(),
        }
    }

    /// At most `n` deliveries unacknowledged at once (`basic.qos`; at least 1).
    pub fn with_prefetch(mut self, n: u16) -> Self {
        self.prefetch = n.max(1);
        self
    }

    /// The consumer tag (default: the broker picks one).
    pub fn with_consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.consumer_tag = tag.into();
        self
    }

    /// How long one connection attempt may take.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The connection name the broker shows in its management UI.
    pub fn with_connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// The queue's name.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The URI, password redacted.
    pub fn uri_redacted(&self) -> String {
        redact_url(&self.uri)
    }

    /// Checks the URI, the queue name and the durations; the error never
    /// shows the password.
    pub fn validate(&self) -> Result<(), SourceError> {
        self.uri.parse::<lapin::uri::AMQPUri>().map_err(|e| {
            SourceError::Config(format!(
                "AMQP URI {} is invalid: {e}",
                redact_url(&self.uri)
            ))
        })?;
        if self.queue.is_empty() || self.queue.len() > 255 {
            return Err(SourceError::Config(format!(
                "queue name {:?} is invalid: 1 to 255 bytes",
                self.queue
            )));
        }
        if self.consumer_tag.len() > 255 {
            return Err(SourceError::Config(
                "the consumer tag is longer than 255 bytes".into(),
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(SourceError::Config(
                "connect_timeout must be above zero".into(),
            ));
        }
        Ok(())
    }
}

/// Acknowledges one delivery: the channel it came on and its tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AmqpToken {
    generation: u64,
    delivery_tag: u64,
}

/// One open connection, its channel and consumer.
struct Live {
    connection: Connection,
    channel: Channel,
    consumer: Consumer,
    generation: u64,
}

impl Live {
    async fn close(self) {
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            self.connection.close(200, "outbox inbox closing"),
        )
        .await;
    }
}

/// Consumes a RabbitMQ queue. See the [module docs](self).
pub struct AmqpSource {
    config: AmqpSourceConfig,
    live: Option<Live>,
    /// Channels opened so far: the generation of the current one.
    generation: u64,
    /// Failed connection attempts in a row.
    failures: u32,
    /// No attempt before this instant (backoff after failures).
    next_attempt: Option<Instant>,
}

impl fmt::Debug for AmqpSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpSource")
            .field("uri", &self.config.uri_redacted())
            .field("queue", &self.config.queue)
            .field("connected", &self.live.is_some())
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl AmqpSource {
    /// Connects and starts consuming. A bad URI, refused credentials or a
    /// missing queue are [`SourceError::Config`]; an unreachable broker is
    /// [`SourceError::Unavailable`].
    pub async fn connect(config: AmqpSourceConfig) -> Result<Self, SourceError> {
        config.validate()?;
        let mut source = Self {
            config,
            live: None,
            generation: 0,
            failures: 0,
            next_attempt: None,
        };
        source.reconnect().await?;
        tracing::info!(
            uri = %source.config.uri_redacted(),
            queue = %source.config.queue,
            "AMQP source connected"
        );
        Ok(source)
    }

    /// The configuration.
    pub fn config(&self) -> &AmqpSourceConfig {
        &self.config
    }

    /// One attempt to open a connection, a channel and a consumer.
    async fn reconnect(&mut self) -> Result<(), SourceError> {
        if let Some(old) = self.live.take() {
            old.close().await;
        }
        let attempt = tokio::time::timeout(self.config.connect_timeout, open(&self.config)).await;
        let result = match attempt {
            Ok(r) => r,
            Err(_) => Err(SourceError::Unavailable(format!(
                "no connection to {} within {:?}",
                self.config.uri_redacted(),
                self.config.connect_timeout
            ))),
        };
        match result {
            Ok((connection, channel, consumer)) => {
                self.generation += 1;
                self.failures = 0;
                self.next_attempt = None;
                self.live = Some(Live {
                    connection,
                    channel,
                    consumer,
                    generation: self.generation,
                });
                Ok(())
            }
            Err(e) => {
                self.failures = self.failures.saturating_add(1);
                self.next_attempt = Some(Instant::now() + reconnect_delay(self.failures));
                Err(e)
            }
        }
    }

    /// The open consumer, reconnecting first when there is none: waiting
    /// (at most `wait`) for the backoff after failed attempts to pass.
    async fn live(&mut self, wait: Duration) -> Result<&mut Live, SourceError> {
        if self.live.is_none() {
            if let Some(at) = self.next_attempt {
                tokio::time::sleep_until(at.min(Instant::now() + wait)).await;
                if Instant::now() < at {
                    return Err(SourceError::Unavailable(format!(
                        "not connected to {} (next attempt in {:?})",
                        self.config.uri_redacted(),
                        at - Instant::now()
                    )));
                }
            }
            self.reconnect().await?;
            tracing::info!(queue = %self.config.queue, "AMQP source consuming again");
        }
        self.live
            .as_mut()
            .ok_or_else(|| SourceError::Unavailable("not connected".into()))
    }

    /// Forgets a broken connection (closing what is left of it).
    async fn lost(&mut self, why: &str) {
        tracing::warn!(queue = %self.config.queue, reason = %why, "AMQP source lost its channel");
        if let Some(live) = self.live.take() {
            live.close().await;
        }
    }
}

async fn open(config: &AmqpSourceConfig) -> Result<(Connection, Channel, Consumer), SourceError> {
    let what = |e: lapin::Error| classify(config, &e);
    let properties = ConnectionProperties::default()
        .with_connection_name(config.connection_name.as_str().into());
    let connection = Connection::connect(&config.uri, properties)
        .await
        .map_err(what)?;
    let channel = connection.create_channel().await.map_err(what)?;
    channel
        .basic_qos(config.prefetch, BasicQosOptions::default())
        .await
        .map_err(what)?;
    let consumer = channel
        .basic_consume(
            &config.queue,
            &config.consumer_tag,
            BasicConsumeOptions {
                no_ack: false,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(what);
    match consumer {
        Ok(consumer) => Ok((connection, channel, consumer)),
        Err(e) => {
            let _ =
                tokio::time::timeout(Duration::from_secs(2), connection.close(200, "bye")).await;
            Err(e)
        }
    }
}

/// A missing queue or vhost and refused access are the configuration's
/// fault; everything else (I/O, a closed channel, a broker shutting down)
/// may pass.
fn classify(config: &AmqpSourceConfig, e: &lapin::Error) -> SourceError {
    let message = format!(
        "AMQP broker {} queue {:?}: {e}",
        config.uri_redacted(),
        config.queue
    );
    match e {
        lapin::Error::ProtocolError(p) => match p.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND | AMQPSoftError::ACCESSREFUSED)
            | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED | AMQPHardError::INVALIDPATH) => {
                SourceError::Config(message)
            }
            _ => SourceError::Unavailable(message),
        },
        _ => SourceError::Unavailable(message),
    }
}

impl Source for AmqpSource {
    type Token = AmqpToken;

    async fn recv(
        &mut self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Received<AmqpToken>>, SourceError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let live = self.live(wait).await?;
        let generation = live.generation;
        let mut out = Vec::new();
        let mut broken = None;
        match tokio::time::timeout(wait, live.consumer.next()).await {
            Err(_) => return Ok(out),
            Ok(Some(Ok(d))) => out.push(received(d, generation)),
            Ok(Some(Err(e))) => broken = Some(e.to_string()),
            Ok(None) => broken = Some("the broker cancelled the consumer".to_owned()),
        }
        while broken.is_none() && out.len() < max {
            match live.consumer.next().now_or_never() {
                None => break,
                Some(Some(Ok(d))) => out.push(received(d, generation)),
                Some(Some(Err(e))) => broken = Some(e.to_string()),
                Some(None) => broken = Some("the broker cancelled the consumer".to_owned()),
            }
        }
        if let Some(why) = broken {
            self.lost(&why).await;
            if out.is_empty() {
                return Err(SourceError::Unavailable(format!(
                    "AMQP consumer on queue {:?} stopped: {why}",
                    self.config.queue
                )));
            }
        }
        Ok(out)
    }

    async fn ack(&mut self, tokens: Vec<AmqpToken>) -> Result<(), SourceError> {
        let mut failed = None;
        if let Some(live) = &self.live {
            for token in tokens {
                if token.generation != live.generation {
                    // Its channel is gone: the broker requeued the message.
                    continue;
                }
                let acked = live
                    .channel
                    .basic_ack(token.delivery_tag, BasicAckOptions { multiple: false })
                    .await;
                if let Err(e) = acked {
                    // Tags are per channel: the rest cannot be acked on
                    // another one. The broker requeues them.
                    failed = Some(e.to_string());
                    break;
                }
            }
        }
        if let Some(why) = failed {
            self.lost(&format!("ack: {why}")).await;
        }
        Ok(())
    }

    async fn close(mut self) -> Result<(), SourceError> {
        if let Some(live) = self.live.take() {
            live.close().await;
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("amqp:{}", self.config.queue)
    }
}

/// A delivery as a [`RawMessage`] and its token.
fn received(d: Delivery, generation: u64) -> Received<AmqpToken> {
    let mut headers = Vec::new();
    if let Some(table) = d.properties.headers() {
        for (name, value) in table.inner() {
            headers.push((name.as_str().to_owned(), text(value)));
        }
    }
    let has_content_type = headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case(outbox_core::headers::CONTENT_TYPE));
    if !has_content_type {
        if let Some(ct) = d.properties.content_type() {
            headers.push((
                outbox_core::headers::CONTENT_TYPE.to_owned(),
                ct.as_str().to_owned(),
            ));
        }
    }
    let timestamp = d
        .properties
        .timestamp()
        .and_then(|s| i64::try_from(s).ok())
        .and_then(|s| chrono::DateTime::from_timestamp(s, 0));
    Received {
        message: RawMessage {
            headers,
            body: d.data,
            destination: d.routing_key.as_str().to_owned(),
            timestamp,
            redelivered: d.redelivered,
            behind: None,
        },
        token: AmqpToken {
            generation,
            delivery_tag: d.delivery_tag,
        },
    }
}

/// A header value as text: strings as they are, other kinds written out.
fn text(value: &AMQPValue) -> String {
    let mut out = String::new();
    write_value(&mut out, value, false);
    out
}

fn write_value(out: &mut String, value: &AMQPValue, quoted: bool) {
    let _ = match value {
        AMQPValue::LongString(s) => {
            let s = String::from_utf8_lossy(s.as_bytes());
            if quoted {
                write!(out, "{s:?}")
            } else {
                out.push_str(&s);
                Ok(())
            }
        }
        AMQPValue::ShortString(s) => {
            if quoted {
                write!(out, "{:?}", s.as_str())
            } else {
                out.push_str(s.as_str());
                Ok(())
            }
        }
        AMQPValue::Boolean(b) => write!(out, "{b}"),
        AMQPValue::ShortShortInt(n) => write!(out, "{n}"),
        AMQPValue::ShortShortUInt(n) => write!(out, "{n}"),
        AMQPValue::ShortInt(n) => write!(out, "{n}"),
        AMQPValue::ShortUInt(n) => write!(out, "{n}"),
        AMQPValue::LongInt(n) => write!(out, "{n}"),
        AMQPValue::LongUInt(n) => write!(out, "{n}"),
        AMQPValue::LongLongInt(n) => write!(out, "{n}"),
        AMQPValue::Float(n) => write!(out, "{n}"),
        AMQPValue::Double(n) => write!(out, "{n}"),
        AMQPValue::Timestamp(n) => write!(out, "{n}"),
        AMQPValue::DecimalValue(d) => {
            // value × 10^-scale, written exactly.
            let digits = d.value.to_string();
            let scale = usize::from(d.scale);
            if scale == 0 {
                write!(out, "{digits}")
            } else if digits.len() > scale {
                let (int, frac) = digits.split_at(digits.len() - scale);
                write!(out, "{int}.{frac}")
            } else {
                write!(out, "0.{}{digits}", "0".repeat(scale - digits.len()))
            }
        }
        AMQPValue::FieldArray(items) => {
            out.push('[');
            for (i, item) in items.as_slice().iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item, true);
            }
            out.push(']');
            Ok(())
        }
        AMQPValue::FieldTable(table) => {
            out.push('{');
            for (i, (k, v)) in table.inner().iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{:?}:", k.as_str());
                write_value(out, v, true);
            }
            out.push('}');
            Ok(())
        }
        AMQPValue::ByteArray(bytes) => {
            let s = String::from_utf8_lossy(bytes.as_slice());
            if quoted {
                write!(out, "{s:?}")
            } else {
                out.push_str(&s);
                Ok(())
            }
        }
        AMQPValue::Void => {
            if quoted {
                out.push_str("null");
            }
            Ok(())
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{DecimalValue, FieldArray, LongString, ShortString};

    #[test]
    fn header_values_as_text() {
        assert_eq!(text(&AMQPValue::LongString(LongString::from("a b"))), "a b");
        assert_eq!(text(&AMQPValue::ShortString(ShortString::from("x"))), "x");
        assert_eq!(text(&AMQPValue::Boolean(true)), "true");
        assert_eq!(text(&AMQPValue::LongLongInt(-42)), "-42");
        assert_eq!(
            text(&AMQPValue::DecimalValue(DecimalValue {
                scale: 2,
                value: 12345
            })),
            "123.45"
        );
        assert_eq!(
            text(&AMQPValue::DecimalValue(DecimalValue {
                scale: 3,
                value: 5
            })),
            "0.005"
        );
        let array = FieldArray::from(vec![
            AMQPValue::LongString(LongString::from("s")),
            AMQPValue::LongInt(1),
        ]);
        assert_eq!(text(&AMQPValue::FieldArray(array)), r#"["s",1]"#);
        let mut table = FieldTable::default();
        table.insert(ShortString::from("k"), AMQPValue::Boolean(false));
        assert_eq!(text(&AMQPValue::FieldTable(table)), r#"{"k":false}"#);
        assert_eq!(text(&AMQPValue::Void), "");
    }

    #[test]
    fn config_debug_and_errors_hide_the_password() {
        let c = AmqpSourceConfig::new("amqp://app:hunter2@127.0.0.1:5672/%2f", "q");
        assert!(!format!("{c:?}").contains("hunter2"));
        assert!(c.validate().is_ok());
        let bad = AmqpSourceConfig::new("nope://app:hunter2@h", "q");
        let e = bad.validate().unwrap_err();
        assert!(matches!(e, SourceError::Config(_)));
        assert!(!e.to_string().contains("hunter2"), "{e}");
        assert!(AmqpSourceConfig::new("amqp://h", "").validate().is_err());
    }
}
