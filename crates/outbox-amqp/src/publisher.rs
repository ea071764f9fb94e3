//! The AMQP publisher.

use crate::{AmqpConfig, AmqpError};
use backon::{ExponentialBuilder, Retryable};
use futures::future::{self, BoxFuture};
use futures::stream::{FuturesOrdered, StreamExt};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::protocol::AMQPSoftError;
use lapin::publisher_confirm::Confirmation;
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox_core::{DeliveryError, ErrorCode, Event, Outcome, Sink};
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

/// Header (AMQP table entry) carrying the event type (also in the `type` property).
pub const HEADER_EVENT_TYPE: &str = outbox_core::headers::EVENT_TYPE;
/// Header carrying the event key (absent when the event has none).
pub const HEADER_KEY: &str = outbox_core::headers::KEY;
/// Header carrying the event id (also the `message_id` property).
pub const HEADER_EVENT_ID: &str = outbox_core::headers::EVENT_ID;

/// Publishes outbox events to RabbitMQ (AMQP 0.9.1) with publisher confirms
/// and `mandatory` set; an event is `Delivered` only on a confirm that is
/// neither a nack nor preceded by a basic.return.
///
/// One channel per publisher; batches are serialized on it. The connection
/// is opened again (with backoff) on the next batch after it broke.
pub struct AmqpPublisher {
    config: Arc<AmqpConfig>,
    live: Mutex<Option<Live>>,
}

struct Live {
    connection: Connection,
    channel: Channel,
    /// Exchanges confirmed to exist on this connection.
    exchanges: HashSet<String>,
}

impl fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let connected = self
            .live
            .try_lock()
            .ok()
            .map(|l| l.as_ref().is_some_and(Live::healthy));
        f.debug_struct("AmqpPublisher")
            .field("uri", &self.config.uri_redacted())
            .field("connected", &connected)
            .field("max_in_flight", &self.config.max_in_flight)
            .finish_non_exhaustive()
    }
}

impl Live {
    fn healthy(&self) -> bool {
        self.connection.status().connected() && self.channel.status().connected()
    }

    async fn close(self) {
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            self.connection.close(200, "outbox publisher closing"),
        )
        .await;
    }
}

impl AmqpPublisher {
    /// Connects now (retrying with backoff while the error is retryable), so
    /// that bad credentials or an unknown host show up at start-up.
    pub async fn connect(config: AmqpConfig) -> Result<Self, AmqpError> {
        let live = open(&config).await?;
        Ok(Self {
            config: Arc::new(config),
            live: Mutex::new(Some(live)),
        })
    }

    /// A publisher that connects on its first batch.
    pub fn lazy(config: AmqpConfig) -> Self {
        Self {
            config: Arc::new(config),
            live: Mutex::new(None),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &AmqpConfig {
        &self.config
    }

    /// Declares a durable topic exchange (unless `exchange` is empty), a
    /// durable queue, and binds the queue with `binding_key`. Idempotent;
    /// for demos and tests (production topology usually lives elsewhere).
    pub async fn declare_queue(
        &self,
        exchange: &str,
        queue: &str,
        binding_key: &str,
    ) -> Result<(), AmqpError> {
        let channel = self.side_channel().await?;
        if !exchange.is_empty() {
            channel
                .exchange_declare(
                    exchange,
                    ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(AmqpError::Broker)?;
        }
        channel
            .queue_declare(
                queue,
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(AmqpError::Broker)?;
        if !exchange.is_empty() {
            channel
                .queue_bind(
                    queue,
                    exchange,
                    binding_key,
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(AmqpError::Broker)?;
        }
        let _ = channel.close(200, "topology declared").await;
        Ok(())
    }

    /// Closes the connection (a later batch would open it again).
    pub async fn close(&self) {
        if let Some(live) = self.live.lock().await.take() {
            live.close().await;
        }
    }

    /// A fresh channel on the (re)opened connection.
    async fn side_channel(&self) -> Result<Channel, AmqpError> {
        let mut guard = self.live.lock().await;
        let live = self.ensure_live(&mut guard).await?;
        live.connection
            .create_channel()
            .await
            .map_err(AmqpError::Connect)
    }

    async fn ensure_live<'a>(
        &self,
        guard: &'a mut Option<Live>,
    ) -> Result<&'a mut Live, AmqpError> {
        if !guard.as_ref().is_some_and(Live::healthy) {
            if let Some(old) = guard.take() {
                tracing::info!(uri = %self.config.uri_redacted(), "AMQP connection or channel lost; reconnecting");
                old.close().await;
            }
            *guard = Some(open(&self.config).await?);
        }
        guard
            .as_mut()
            .ok_or_else(|| AmqpError::InvalidConfig("connection vanished".into()))
    }

    /// Publishes a batch (same as [`Sink::deliver`]).
    pub async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let mut guard = self.live.lock().await;
        let live = match self.ensure_live(&mut guard).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, batch = events.len(), "AMQP broker unreachable; batch not sent");
                // Even a non-retryable cause (bad credentials) fails the
                // events as retryable: they are not at fault, and an operator
                // fixing the configuration should not find them dead-lettered.
                let err =
                    DeliveryError::retryable(ErrorCode::PUBLISH_CONNECTION_LOST, e.to_string());
                return vec![Outcome::Failed(err); events.len()];
            }
        };

        // Publishing to a missing exchange would close the channel and fail
        // every message in flight; check each new exchange first.
        let mut missing = HashSet::new();
        let mut checked = HashSet::new();
        for event in events {
            let exchange = self.config.route_for(&event.topic).exchange;
            if exchange.is_empty()
                || live.exchanges.contains(&exchange)
                || !checked.insert(exchange.clone())
            {
                continue;
            }
            match exchange_exists(&live.connection, &exchange).await {
                Ok(true) => {
                    live.exchanges.insert(exchange);
                }
                Ok(false) => {
                    missing.insert(exchange);
                }
                Err(e) => {
                    let err =
                        DeliveryError::retryable(ErrorCode::PUBLISH_CONNECTION_LOST, e.to_string());
                    let _ = guard.take();
                    return vec![Outcome::Failed(err); events.len()];
                }
            }
        }

        let window = self.config.max_in_flight;
        let mut outcomes = Vec::with_capacity(events.len());
        let mut pending: FuturesOrdered<BoxFuture<'static, Outcome>> = FuturesOrdered::new();
        for event in events {
            while pending.len() >= window {
                if let Some(o) = pending.next().await {
                    outcomes.push(o);
                }
            }
            pending.push_back(self.send_one(&live.channel, event, &missing).await);
        }
        while let Some(o) = pending.next().await {
            outcomes.push(o);
        }

        let broken = outcomes.iter().any(|o| {
            matches!(o, Outcome::Failed(e)
                if e.code() == &ErrorCode::PUBLISH_CONNECTION_LOST
                    || e.code() == &ErrorCode::PUBLISH_TIMEOUT)
        });
        if broken || !live.healthy() {
            if let Some(old) = guard.take() {
                old.close().await;
            }
        }
        outcomes
    }

    async fn send_one(
        &self,
        channel: &Channel,
        event: &Event,
        missing: &HashSet<String>,
    ) -> BoxFuture<'static, Outcome> {
        let route = self.config.route_for(&event.topic);
        if missing.contains(&route.exchange) {
            return done(DeliveryError::permanent(
                ErrorCode::PUBLISH_UNROUTABLE,
                format!("exchange {:?} does not exist", route.exchange),
            ));
        }
        if route.routing_key.len() > 255 || route.exchange.len() > 255 {
            return done(DeliveryError::permanent(
                ErrorCode::PUBLISH_INVALID,
                "exchange and routing key must be at most 255 bytes",
            ));
        }
        let max = self.config.max_message_bytes;
        if event.payload.len() > max {
            return done(DeliveryError::permanent(
                ErrorCode::PUBLISH_TOO_LARGE,
                format!(
                    "payload is {} bytes, above the maximum of {max}",
                    event.payload.len()
                ),
            ));
        }
        let properties = match properties_for(event, self.config.persistent) {
            Ok(p) => p,
            Err(e) => return done(e),
        };
        let id = event.id;
        let confirm_timeout = self.config.confirm_timeout;
        let published = channel
            .basic_publish(
                &route.exchange,
                &route.routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                &event.payload,
                properties,
            )
            .await;
        match published {
            Ok(confirm) => Box::pin(async move {
                let outcome = match tokio::time::timeout(confirm_timeout, confirm).await {
                    Err(_) => Outcome::Failed(DeliveryError::retryable(
                        ErrorCode::PUBLISH_TIMEOUT,
                        "no publisher confirm in time (maybe delivered)",
                    )),
                    Ok(result) => classify(result),
                };
                if let Outcome::Failed(e) = &outcome {
                    tracing::warn!(event_id = %id, code = %e.code(), error = %e.message(), "AMQP publish failed");
                }
                outcome
            }),
            Err(e) => {
                tracing::warn!(event_id = %id, error = %e, "AMQP publish not sent");
                done(DeliveryError::retryable(
                    ErrorCode::PUBLISH_CONNECTION_LOST,
                    format!("publish not sent: {e}"),
                ))
            }
        }
    }
}

impl Sink for AmqpPublisher {
    fn deliver(&self, events: &[Event]) -> impl std::future::Future<Output = Vec<Outcome>> + Send {
        self.publish(events)
    }
}

fn done(e: DeliveryError) -> BoxFuture<'static, Outcome> {
    Box::pin(future::ready(Outcome::Failed(e)))
}

/// Maps a publisher confirm (or its failure) to an outcome.
fn classify(result: lapin::Result<Confirmation>) -> Outcome {
    match result {
        Ok(Confirmation::Ack(None)) => Outcome::Delivered,
        Ok(Confirmation::Ack(Some(returned))) | Ok(Confirmation::Nack(Some(returned)))
            if returned.reply_code == AMQPSoftError::NOROUTE.get_id() =>
        {
            Outcome::Failed(DeliveryError::permanent(
                ErrorCode::PUBLISH_UNROUTABLE,
                format!(
                    "broker returned the message: {} {} (no queue bound for exchange {:?}, routing key {:?})",
                    returned.reply_code,
                    returned.reply_text,
                    returned.delivery.exchange.as_str(),
                    returned.delivery.routing_key.as_str()
                ),
            ))
        }
        Ok(Confirmation::Ack(Some(returned))) => Outcome::Failed(DeliveryError::retryable(
            ErrorCode::PUBLISH_REJECTED,
            format!(
                "broker returned the message: {} {}",
                returned.reply_code, returned.reply_text
            ),
        )),
        Ok(Confirmation::Nack(_)) => Outcome::Failed(DeliveryError::retryable(
            ErrorCode::PUBLISH_REJECTED,
            "broker nacked the message",
        )),
        Ok(Confirmation::NotRequested) => Outcome::Failed(DeliveryError::retryable(
            ErrorCode::PUBLISH_REJECTED,
            "publisher confirms are not enabled on the channel",
        )),
        Err(e) => Outcome::Failed(DeliveryError::retryable(
            ErrorCode::PUBLISH_CONNECTION_LOST,
            format!("channel closed before the confirm: {e}"),
        )),
    }
}

/// The AMQP properties of `event`: message id, type, content type,
/// timestamp, delivery mode and the headers table.
fn properties_for(event: &Event, persistent: bool) -> Result<BasicProperties, DeliveryError> {
    let invalid = |what: &str| {
        DeliveryError::permanent(
            ErrorCode::PUBLISH_INVALID,
            format!("{what} is longer than AMQP's 255-byte limit"),
        )
    };
    let mut table = FieldTable::default();
    for (name, value) in &event.headers {
        if name.len() > 255 {
            return Err(invalid("a header name"));
        }
        table.insert(
            ShortString::from(name.as_str()),
            AMQPValue::LongString(LongString::from(value.as_str())),
        );
    }
    table.insert(
        HEADER_EVENT_TYPE.into(),
        AMQPValue::LongString(event.event_type.as_str().into()),
    );
    table.insert(
        HEADER_EVENT_ID.into(),
        AMQPValue::LongString(event.id.to_string().into()),
    );
    if let Some(key) = &event.key {
        table.insert(
            HEADER_KEY.into(),
            AMQPValue::LongString(key.as_str().into()),
        );
    }
    let content_type = event
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.as_str())
        .unwrap_or("application/octet-stream");
    if content_type.len() > 255 {
        return Err(invalid("the content type"));
    }
    if event.event_type.len() > 255 {
        return Err(invalid("the event type"));
    }
    Ok(BasicProperties::default()
        .with_message_id(event.id.to_string().into())
        .with_type(event.event_type.as_str().into())
        .with_content_type(content_type.into())
        .with_timestamp(u64::try_from(event.created_at.timestamp()).unwrap_or(0))
        .with_delivery_mode(if persistent { 2 } else { 1 })
        .with_headers(table))
}

async fn exchange_exists(connection: &Connection, name: &str) -> Result<bool, lapin::Error> {
    let channel = connection.create_channel().await?;
    let declared = channel
        .exchange_declare(
            name,
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    match declared {
        Ok(()) => {
            let _ = channel.close(200, "exchange checked").await;
            Ok(true)
        }
        // The broker closed the side channel with 404: the exchange is missing.
        Err(lapin::Error::ProtocolError(e)) if e.get_id() == AMQPSoftError::NOTFOUND.get_id() => {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Opens a connection and a confirm-mode channel, retrying with backoff.
async fn open(config: &AmqpConfig) -> Result<Live, AmqpError> {
    let attempt = || async {
        let tls = tls_config(config)?;
        let properties = ConnectionProperties::default()
            .with_connection_name(config.connection_name.as_str().into());
        let connection = tokio::time::timeout(
            config.connect_timeout,
            Connection::connect_with_config(&config.uri, properties, tls),
        )
        .await
        .map_err(|_| AmqpError::ConnectTimeout)?
        .map_err(AmqpError::Connect)?;
        let channel = connection
            .create_channel()
            .await
            .map_err(AmqpError::Connect)?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(AmqpError::Connect)?;
        Ok::<_, AmqpError>(Live {
            connection,
            channel,
            exchanges: HashSet::new(),
        })
    };
    let live = attempt
        .retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(100))
                .with_max_delay(Duration::from_secs(5))
                .with_max_times(config.connect_attempts.saturating_sub(1))
                .with_jitter(),
        )
        .when(AmqpError::is_retryable)
        .notify(|e, delay| {
            tracing::warn!(error = %e, ?delay, "AMQP connection failed; retrying");
        })
        .await?;
    tracing::info!(uri = %config.uri_redacted(), "connected to the AMQP broker");
    Ok(live)
}

fn tls_config(config: &AmqpConfig) -> Result<OwnedTLSConfig, AmqpError> {
    let mut tls = OwnedTLSConfig::default();
    if let Some(path) = &config.tls.ca_certificate {
        let pem = std::fs::read_to_string(path).map_err(|e| {
            AmqpError::InvalidConfig(format!(
                "cannot read CA certificate {}: {e}",
                path.display()
            ))
        })?;
        tls.cert_chain = Some(pem);
    }
    if let Some((path, password)) = &config.tls.client_identity {
        let der = std::fs::read(path).map_err(|e| {
            AmqpError::InvalidConfig(format!(
                "cannot read client identity {}: {e}",
                path.display()
            ))
        })?;
        tls.identity = Some(OwnedIdentity {
            der,
            password: password.clone(),
        });
    }
    Ok(tls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;

    fn event() -> Event {
        Event {
            id: outbox_core::EventId::new(),
            key: Some("k1".into()),
            event_type: "order.created".into(),
            topic: "orders".into(),
            payload: b"{}".to_vec(),
            headers: [("traceparent".to_owned(), "00-abc-def-01".to_owned())].into(),
            created_at: Utc::now(),
            attempts: 1,
            next_attempt_at: Utc::now(),
            last_error: None,
        }
    }

    #[test]
    fn properties_carry_id_type_headers_and_persistence() {
        let e = event();
        let p = properties_for(&e, true).unwrap();
        assert_eq!(p.delivery_mode(), &Some(2));
        assert_eq!(
            p.message_id().as_ref().map(|s| s.as_str().to_owned()),
            Some(e.id.to_string())
        );
        assert_eq!(
            p.content_type().as_ref().map(ShortString::as_str),
            Some("application/octet-stream")
        );
        let h = p.headers().as_ref().unwrap().inner();
        assert_eq!(
            h.get("traceparent"),
            Some(&AMQPValue::LongString("00-abc-def-01".into()))
        );
        assert_eq!(h.get(HEADER_KEY), Some(&AMQPValue::LongString("k1".into())));
        assert_eq!(properties_for(&e, false).unwrap().delivery_mode(), &Some(1));
    }

    #[test]
    fn returned_and_nacked_messages_are_failures() {
        assert_eq!(classify(Ok(Confirmation::Ack(None))), Outcome::Delivered);
        match classify(Ok(Confirmation::Nack(None))) {
            Outcome::Failed(e) => {
                assert!(e.is_retryable());
                assert_eq!(e.code(), &ErrorCode::PUBLISH_REJECTED);
            }
            Outcome::Delivered => panic!("nack is not delivered"),
        }
    }
}
