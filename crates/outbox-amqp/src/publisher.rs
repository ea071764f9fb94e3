//! The AMQP publisher.

use crate::config::AmqpConfig;
use crate::error::AmqpError;
use futures::future::{BoxFuture, FutureExt};
use lapin::message::BasicReturnMessage;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::protocol::AMQPSoftError;
use lapin::publisher_confirm::Confirmation;
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox_broker::{ReconnectGate, SendWindow, Sent, WindowResult};
use outbox_core::cloudevents::Binding;
use outbox_core::{BrokerMessage, DeliveryError, ErrorCode, Event, Outcome, Sink};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

/// Publishes outbox events to RabbitMQ (AMQP 0.9.1) with publisher confirms
/// and `mandatory` set; an event is `Delivered` only on a confirm that is
/// not a nack, and only if the broker did not return it (basic.return).
///
/// Returns are matched to events by their `message_id` (the event id), not
/// by the confirm lapin hands them to: lapin attaches a basic.return to
/// whichever confirm resolves next, and a multiple-ack resolves several at
/// once, so the confirm carrying a return is often another message's.
///
/// One channel per publisher; batches are serialized on it. After the
/// connection broke it is opened again on a later batch, one attempt at a
/// time spaced by the config's [`ConnectPolicy`](outbox_broker::ConnectPolicy);
/// meanwhile batches fail at once as sink unavailable.
pub struct AmqpPublisher {
    config: Arc<AmqpConfig>,
    state: Mutex<State>,
}

struct State {
    live: Option<Live>,
    gate: ReconnectGate,
    last_error: Option<String>,
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
            .state
            .try_lock()
            .ok()
            .map(|s| s.live.as_ref().is_some_and(Live::healthy));
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

/// One event's result before returns are matched: final already, or the
/// broker's confirm (and the return lapin attached to it, maybe another
/// message's).
enum Ack {
    Final(Outcome),
    Confirmed {
        nack: bool,
        returned: Option<Box<BasicReturnMessage>>,
    },
}

impl WindowResult for Ack {
    fn sink_unavailable(&self) -> Option<&DeliveryError> {
        match self {
            Ack::Final(o) => o.sink_unavailable(),
            Ack::Confirmed { .. } => None,
        }
    }

    fn not_sent(error: DeliveryError) -> Self {
        Ack::Final(Outcome::Failed(error))
    }
}

impl AmqpPublisher {
    /// Connects now (retrying with the config's
    /// [`ConnectPolicy`](outbox_broker::ConnectPolicy) while the error is
    /// retryable), so that bad credentials or an unknown host show up at
    /// start-up.
    pub async fn connect(config: AmqpConfig) -> Result<Self, AmqpError> {
        config.check_cloudevents()?;
        let live = config
            .connect
            .connect(
                "amqp",
                || open(&config),
                AmqpError::is_retryable,
                || AmqpError::ConnectTimeout,
            )
            .await?;
        tracing::info!(uri = %config.uri_redacted(), "connected to the AMQP broker");
        let gate = ReconnectGate::new(config.connect);
        Ok(Self {
            config: Arc::new(config),
            state: Mutex::new(State {
                live: Some(live),
                gate,
                last_error: None,
            }),
        })
    }

    /// A publisher that connects on its first batch.
    ///
    /// It does no checks: a CloudEvents wire format without a source, which
    /// [`Self::connect`] refuses, sends events without a `source` attribute.
    pub fn lazy(config: AmqpConfig) -> Self {
        let gate = ReconnectGate::new(config.connect);
        Self {
            config: Arc::new(config),
            state: Mutex::new(State {
                live: None,
                gate,
                last_error: None,
            }),
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
        if let Some(live) = self.state.lock().await.live.take() {
            live.close().await;
        }
    }

    /// A fresh channel on the (re)opened connection.
    async fn side_channel(&self) -> Result<Channel, AmqpError> {
        let mut state = self.state.lock().await;
        if !state.live.as_ref().is_some_and(Live::healthy) {
            state.live = Some(open(&self.config).await?);
        }
        match &state.live {
            Some(live) => live
                .connection
                .create_channel()
                .await
                .map_err(AmqpError::Connect),
            None => Err(AmqpError::InvalidConfig("connection vanished".into())),
        }
    }

    /// The healthy connection, reopened if it broke and the reconnect gate
    /// allows an attempt now; else why not, as a sink-level failure.
    async fn ensure_live<'a>(&self, state: &'a mut State) -> Result<&'a mut Live, DeliveryError> {
        if !state.live.as_ref().is_some_and(Live::healthy) {
            if let Some(old) = state.live.take() {
                tracing::info!(uri = %self.config.uri_redacted(), "AMQP connection or channel lost; reconnecting");
                old.close().await;
            }
            if let Err(left) = state.gate.ready() {
                let last = state.last_error.as_deref().unwrap_or("connection lost");
                return Err(DeliveryError::unavailable(
                    ErrorCode::PUBLISH_CONNECTION_LOST,
                    format!(
                        "AMQP broker unreachable ({last}); next connection attempt in {left:?}"
                    ),
                ));
            }
            let attempt = tokio::time::timeout(self.config.connect.timeout, open(&self.config))
                .await
                .unwrap_or(Err(AmqpError::ConnectTimeout));
            match attempt {
                Ok(live) => {
                    tracing::info!(uri = %self.config.uri_redacted(), "connected to the AMQP broker");
                    state.gate.succeeded();
                    state.last_error = None;
                    state.live = Some(live);
                }
                Err(e) => {
                    let delay = state.gate.failed();
                    tracing::warn!(error = %e, next_attempt_in = ?delay, "AMQP connection failed");
                    // Even a non-retryable cause (bad credentials) is the
                    // sink's failure, not the events': an operator fixing
                    // the configuration should not find them dead-lettered.
                    state.last_error = Some(e.to_string());
                    return Err(DeliveryError::unavailable(
                        ErrorCode::PUBLISH_CONNECTION_LOST,
                        e.to_string(),
                    ));
                }
            }
        }
        state.live.as_mut().ok_or_else(|| {
            DeliveryError::unavailable(ErrorCode::PUBLISH_CONNECTION_LOST, "connection vanished")
        })
    }

    async fn send_batch(&self, events: &[Event]) -> Vec<Outcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let mut state = self.state.lock().await;
        let live = match self.ensure_live(&mut state).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, batch = events.len(), "AMQP batch not sent");
                return vec![Outcome::Failed(e); events.len()];
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
                    let err = DeliveryError::unavailable(
                        ErrorCode::PUBLISH_CONNECTION_LOST,
                        e.to_string(),
                    );
                    if let Some(old) = state.live.take() {
                        old.close().await;
                    }
                    return vec![Outcome::Failed(err); events.len()];
                }
            }
        }

        let channel = live.channel.clone();
        let acks = SendWindow::new(self.config.max_in_flight)
            .run(events, |event| self.send_one(&channel, event, &missing))
            .await;
        let outcomes = correlate_returns(events, acks);

        let broken = outcomes.iter().any(|o| o.sink_unavailable().is_some());
        if broken || !state.live.as_ref().is_some_and(Live::healthy) {
            if let Some(old) = state.live.take() {
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
    ) -> Sent<Ack, BoxFuture<'static, Ack>> {
        let refuse = |e: DeliveryError| Sent::Done(Ack::Final(Outcome::Failed(e)));
        let route = self.config.route_for(&event.topic);
        if missing.contains(&route.exchange) {
            return refuse(DeliveryError::permanent(
                ErrorCode::PUBLISH_UNROUTABLE,
                format!("exchange {:?} does not exist", route.exchange),
            ));
        }
        if route.routing_key.len() > 255 || route.exchange.len() > 255 {
            return refuse(DeliveryError::permanent(
                ErrorCode::PUBLISH_INVALID,
                "exchange and routing key must be at most 255 bytes",
            ));
        }
        let mut message = BrokerMessage::new(event).with_format(self.config.wire_format);
        if let Some(source) = &self.config.cloudevents_source {
            message = message.with_cloudevents(Binding::Amqp, source);
        }
        let body = message.body();
        // What is sent: the payload, or the envelope around it.
        let max = self.config.max_message_bytes;
        if body.len() > max {
            return refuse(DeliveryError::permanent(
                ErrorCode::PUBLISH_TOO_LARGE,
                format!(
                    "message body is {} bytes ({} format), above the maximum of {max}",
                    body.len(),
                    message.format()
                ),
            ));
        }
        let properties = match properties_for(&message, self.config.persistent) {
            Ok(p) => p,
            Err(e) => return refuse(e),
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
                &body,
                properties,
            )
            .await;
        match published {
            Ok(confirm) => Sent::InFlight(
                async move {
                    let ack = match tokio::time::timeout(confirm_timeout, confirm).await {
                        Err(_) => Ack::Final(Outcome::Failed(DeliveryError::unavailable(
                            ErrorCode::PUBLISH_TIMEOUT,
                            "no publisher confirm in time (maybe delivered)",
                        ))),
                        Ok(result) => confirmed(result),
                    };
                    if let Ack::Final(Outcome::Failed(e)) = &ack {
                        tracing::warn!(event_id = %id, code = %e.code(), error = %e.message(), "AMQP publish failed");
                    }
                    ack
                }
                .boxed(),
            ),
            Err(e) => {
                tracing::warn!(event_id = %id, error = %e, "AMQP publish not sent");
                refuse(DeliveryError::unavailable(
                    ErrorCode::PUBLISH_CONNECTION_LOST,
                    format!("publish not sent: {e}"),
                ))
            }
        }
    }
}

impl Sink for AmqpPublisher {
    fn deliver(&self, events: &[Event]) -> impl std::future::Future<Output = Vec<Outcome>> + Send {
        self.send_batch(events)
    }
}

/// A publisher confirm (or its failure), before returns are matched.
fn confirmed(result: lapin::Result<Confirmation>) -> Ack {
    match result {
        Ok(Confirmation::Ack(returned)) => Ack::Confirmed {
            nack: false,
            returned,
        },
        Ok(Confirmation::Nack(returned)) => Ack::Confirmed {
            nack: true,
            returned,
        },
        Ok(Confirmation::NotRequested) => Ack::Final(Outcome::Failed(DeliveryError::unavailable(
            ErrorCode::PUBLISH_REJECTED,
            "publisher confirms are not enabled on the channel",
        ))),
        Err(e) => Ack::Final(Outcome::Failed(DeliveryError::unavailable(
            ErrorCode::PUBLISH_CONNECTION_LOST,
            format!("channel closed before the confirm: {e}"),
        ))),
    }
}

/// The outcome of every event of a batch once all its confirms are in.
///
/// RabbitMQ sends a mandatory message's basic.return before its confirm;
/// lapin queues returns and hands each to the next confirm that resolves,
/// whichever message that is (a multiple-ack resolves several confirms in
/// arbitrary order). Within a batch whose confirms have all resolved, every
/// return has been handed to one of them. So the returns are collected
/// from all confirms first, keyed by their `message_id` (the event id), and
/// exactly the events they name are failed; every other acked event is
/// delivered.
fn correlate_returns(events: &[Event], acks: Vec<Ack>) -> Vec<Outcome> {
    let mut returned: HashMap<String, DeliveryError> = HashMap::new();
    for ack in &acks {
        if let Ack::Confirmed {
            returned: Some(message),
            ..
        } = ack
        {
            match message.properties.message_id() {
                Some(id) => {
                    returned.insert(id.as_str().to_owned(), classify_return(message));
                }
                None => tracing::warn!(
                    exchange = message.delivery.exchange.as_str(),
                    routing_key = message.delivery.routing_key.as_str(),
                    "AMQP broker returned a message without message_id; ignored"
                ),
            }
        }
    }
    events
        .iter()
        .zip(acks)
        .map(|(event, ack)| match ack {
            Ack::Final(outcome) => outcome,
            Ack::Confirmed { nack, .. } => {
                if let Some(e) = returned.remove(&event.id.to_string()) {
                    tracing::warn!(event_id = %event.id, code = %e.code(), error = %e.message(), "AMQP broker returned the message");
                    Outcome::Failed(e)
                } else if nack {
                    tracing::warn!(event_id = %event.id, "AMQP broker nacked the message");
                    Outcome::Failed(DeliveryError::retryable(
                        ErrorCode::PUBLISH_REJECTED,
                        "broker nacked the message",
                    ))
                } else {
                    Outcome::Delivered
                }
            }
        })
        .collect()
}

/// What a basic.return means for its event.
fn classify_return(returned: &BasicReturnMessage) -> DeliveryError {
    if returned.reply_code == AMQPSoftError::NOROUTE.get_id() {
        DeliveryError::permanent(
            ErrorCode::PUBLISH_UNROUTABLE,
            format!(
                "broker returned the message: {} {} (no queue bound for exchange {:?}, routing key {:?})",
                returned.reply_code,
                returned.reply_text,
                returned.delivery.exchange.as_str(),
                returned.delivery.routing_key.as_str()
            ),
        )
    } else {
        DeliveryError::retryable(
            ErrorCode::PUBLISH_REJECTED,
            format!(
                "broker returned the message: {} {}",
                returned.reply_code, returned.reply_text
            ),
        )
    }
}

/// The AMQP properties of a message: message id, type, content type,
/// timestamp, delivery mode and the headers table
/// ([`BrokerMessage::headers`], as is).
fn properties_for(
    message: &BrokerMessage<'_>,
    persistent: bool,
) -> Result<BasicProperties, DeliveryError> {
    let invalid = |what: &str| {
        DeliveryError::permanent(
            ErrorCode::PUBLISH_INVALID,
            format!("{what} is longer than AMQP's 255-byte limit"),
        )
    };
    let mut table = FieldTable::default();
    for (name, value) in message.headers() {
        if name.len() > 255 {
            return Err(invalid("a header name"));
        }
        table.insert(
            ShortString::from(name),
            AMQPValue::LongString(LongString::from(value)),
        );
    }
    if message.content_type().len() > 255 {
        return Err(invalid("the content type"));
    }
    if message.event_type().len() > 255 {
        return Err(invalid("the event type"));
    }
    let created = message.event().created_at.timestamp();
    Ok(BasicProperties::default()
        .with_message_id(message.dedup_id().into())
        .with_type(message.event_type().into())
        .with_content_type(message.content_type().into())
        .with_timestamp(u64::try_from(created).unwrap_or(0))
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

/// Opens a connection and a confirm-mode channel (one attempt).
async fn open(config: &AmqpConfig) -> Result<Live, AmqpError> {
    let tls = tls_config(config)?;
    let properties = ConnectionProperties::default()
        .with_connection_name(config.connection_name.as_str().into());
    let connection = Connection::connect_with_config(&config.uri, properties, tls)
        .await
        .map_err(AmqpError::Connect)?;
    let channel = connection
        .create_channel()
        .await
        .map_err(AmqpError::Connect)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(AmqpError::Connect)?;
    Ok(Live {
        connection,
        channel,
        exchanges: HashSet::new(),
    })
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

    fn event() -> Event {
        let mut e = outbox_testkit::publisher::event("orders", Some("k1"), b"{}".to_vec());
        e.event_type = "order.created".into();
        e.headers = [("traceparent".to_owned(), "00-abc-def-01".to_owned())].into();
        e
    }

    #[test]
    fn properties_carry_id_type_headers_and_persistence() {
        let e = event();
        let p = properties_for(&BrokerMessage::new(&e), true).unwrap();
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
        assert_eq!(
            h.get(outbox_core::headers::KEY),
            Some(&AMQPValue::LongString("k1".into()))
        );
        assert_eq!(
            properties_for(&BrokerMessage::new(&e), false)
                .unwrap()
                .delivery_mode(),
            &Some(1)
        );
        assert_eq!(
            h.get(outbox_core::headers::CONTENT_TYPE),
            Some(&AMQPValue::LongString("application/octet-stream".into()))
        );
    }

    #[test]
    fn envelope_properties_say_protobuf_and_mark_the_format() {
        let e = event();
        let message = BrokerMessage::new(&e).with_format(outbox_core::WireFormat::Envelope);
        let p = properties_for(&message, true).unwrap();
        assert_eq!(
            p.content_type().as_ref().map(ShortString::as_str),
            Some(outbox_core::ENVELOPE_CONTENT_TYPE)
        );
        assert_eq!(
            p.message_id().as_ref().map(|s| s.as_str().to_owned()),
            Some(e.id.to_string())
        );
        let h = p.headers().as_ref().unwrap().inner();
        assert_eq!(
            h.get(outbox_core::headers::WIRE_FORMAT),
            Some(&AMQPValue::LongString(outbox_core::ENVELOPE_MARKER.into()))
        );
        assert_eq!(
            h.get(outbox_core::headers::CONTENT_TYPE),
            Some(&AMQPValue::LongString(
                outbox_core::ENVELOPE_CONTENT_TYPE.into()
            ))
        );
    }

    fn returned(event: &Event, reply_code: u16) -> Box<BasicReturnMessage> {
        Box::new(BasicReturnMessage {
            delivery: lapin::message::Delivery {
                delivery_tag: 0,
                exchange: "x".into(),
                routing_key: "nowhere".into(),
                redelivered: false,
                properties: BasicProperties::default().with_message_id(event.id.to_string().into()),
                data: Vec::new(),
                acker: Default::default(),
            },
            reply_code,
            reply_text: "NO_ROUTE".into(),
        })
    }

    #[test]
    fn returns_fail_the_event_they_name_not_the_confirm_they_came_with() {
        let events: Vec<Event> = (0..5).map(|_| event()).collect();
        let no_route = AMQPSoftError::NOROUTE.get_id();
        let acks = vec![
            // lapin handed event 2's return to event 0's confirm.
            Ack::Confirmed {
                nack: false,
                returned: Some(returned(&events[2], no_route)),
            },
            Ack::Confirmed {
                nack: false,
                returned: None,
            },
            Ack::Confirmed {
                nack: false,
                returned: None,
            },
            Ack::Confirmed {
                nack: true,
                returned: None,
            },
            Ack::Final(Outcome::Failed(DeliveryError::unavailable(
                ErrorCode::PUBLISH_TIMEOUT,
                "t",
            ))),
        ];
        let o = correlate_returns(&events, acks);
        assert_eq!(o[0], Outcome::Delivered);
        assert_eq!(o[1], Outcome::Delivered);
        match &o[2] {
            Outcome::Failed(e) => {
                assert_eq!(e.code(), &ErrorCode::PUBLISH_UNROUTABLE);
                assert!(!e.is_retryable());
            }
            other => panic!("{other:?}"),
        }
        match &o[3] {
            Outcome::Failed(e) => {
                assert_eq!(e.code(), &ErrorCode::PUBLISH_REJECTED);
                assert!(e.is_retryable() && !e.is_sink_unavailable());
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(&o[4], Outcome::Failed(e) if e.is_sink_unavailable()));
        // Another reply code is a retryable rejection.
        let acks = vec![Ack::Confirmed {
            nack: false,
            returned: Some(returned(&events[0], 313)),
        }];
        assert!(matches!(
            &correlate_returns(&events[..1], acks)[0],
            Outcome::Failed(e) if e.code() == &ErrorCode::PUBLISH_REJECTED && e.is_retryable()
        ));
    }

    #[test]
    fn a_lost_channel_is_the_sinks_failure() {
        let lost = confirmed(Err(lapin::Error::InvalidChannelState(
            lapin::ChannelState::Closed,
        )));
        assert!(matches!(lost, Ack::Final(Outcome::Failed(e)) if e.is_sink_unavailable()));
    }
}
