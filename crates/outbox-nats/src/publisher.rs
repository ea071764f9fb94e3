//! The JetStream publisher.

use crate::{NatsConfig, NatsError};
use async_nats::connection::State;
use async_nats::jetstream::context::{Publish, PublishError, PublishErrorKind};
use async_nats::jetstream::{self, stream};
use async_nats::HeaderMap;
use backon::{ExponentialBuilder, Retryable};
use futures::future::{self, BoxFuture};
use futures::stream::{FuturesOrdered, StreamExt};
use outbox_core::{DeliveryError, ErrorCode, Event, Outcome, Sink};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Header carrying the event type.
pub const HEADER_EVENT_TYPE: &str = outbox_core::headers::EVENT_TYPE;
/// Header carrying the event key (absent when the event has none).
pub const HEADER_KEY: &str = outbox_core::headers::KEY;
/// Header carrying the event id (also sent as `Nats-Msg-Id`).
pub const HEADER_EVENT_ID: &str = outbox_core::headers::EVENT_ID;
/// JetStream's deduplication header.
pub const HEADER_MSG_ID: &str = "Nats-Msg-Id";
/// Content type: the event's `content-type` header, else `application/octet-stream`.
pub const HEADER_CONTENT_TYPE: &str = "Content-Type";

/// Publishes outbox events to NATS JetStream and reports an event
/// `Delivered` only once its PubAck arrived. Cheap to clone.
#[derive(Clone)]
pub struct NatsPublisher {
    client: async_nats::Client,
    js: jetstream::Context,
    config: Arc<NatsConfig>,
}

impl fmt::Debug for NatsPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsPublisher")
            .field("servers", &self.config.servers_redacted())
            .field("state", &self.client.connection_state())
            .field("max_in_flight", &self.config.max_in_flight)
            .finish_non_exhaustive()
    }
}

impl NatsPublisher {
    /// Connects with the configured options, retrying the initial connection
    /// (exponential backoff, `connect_attempts` times) while the error is
    /// retryable. Later reconnects are done by the client on its own.
    pub async fn connect(config: NatsConfig) -> Result<Self, NatsError> {
        let servers: Vec<async_nats::ServerAddr> = config
            .servers
            .iter()
            .map(|s| s.parse())
            .collect::<Result<_, _>>()
            .map_err(|e: std::io::Error| NatsError::InvalidConfig(e.kind().to_string()))?;
        let attempt = || async {
            let options = config.connect_options().await?;
            options
                .connect(servers.clone())
                .await
                .map_err(NatsError::from)
        };
        let client = attempt
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(100))
                    .with_max_delay(Duration::from_secs(5))
                    .with_max_times(config.connect_attempts.saturating_sub(1))
                    .with_jitter(),
            )
            .when(NatsError::is_retryable)
            .notify(|e, delay| {
                tracing::warn!(error = %e, ?delay, "NATS connection failed; retrying");
            })
            .await?;
        tracing::info!(servers = ?config.servers_redacted(), "connected to NATS");
        Ok(Self::from_client(client, config))
    }

    /// Uses an already connected client.
    pub fn from_client(client: async_nats::Client, config: NatsConfig) -> Self {
        let mut js = jetstream::new(client.clone());
        js.set_timeout(config.ack_timeout);
        Self {
            client,
            js,
            config: Arc::new(config),
        }
    }

    /// The underlying client.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The JetStream context used for publishing.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// The configuration.
    pub fn config(&self) -> &NatsConfig {
        &self.config
    }

    /// Creates stream `name` capturing `subjects` (file storage, other
    /// settings at their defaults), or checks that an existing stream of
    /// that name captures every one of them.
    pub async fn ensure_stream(
        &self,
        name: &str,
        subjects: &[&str],
    ) -> Result<stream::Info, NatsError> {
        let config = stream::Config {
            name: name.to_owned(),
            subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        };
        let stream = self
            .js
            .get_or_create_stream(config)
            .await
            .map_err(|e| NatsError::JetStream(e.to_string()))?;
        let info = stream.cached_info().clone();
        let missing: Vec<String> = subjects
            .iter()
            .filter(|s| !info.config.subjects.iter().any(|have| have == *s))
            .map(|s| (*s).to_owned())
            .collect();
        if !missing.is_empty() {
            return Err(NatsError::StreamMismatch {
                stream: name.to_owned(),
                missing,
            });
        }
        Ok(info)
    }

    /// Publishes a batch (same as [`Sink::deliver`]).
    pub async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        if events.is_empty() {
            return Vec::new();
        }
        if self.client.connection_state() != State::Connected {
            tracing::warn!(
                batch = events.len(),
                "NATS connection is down; batch not sent"
            );
            let e = DeliveryError::retryable(
                ErrorCode::PUBLISH_CONNECTION_LOST,
                "not connected to NATS (reconnecting)",
            );
            return vec![Outcome::Failed(e); events.len()];
        }
        let max_payload = self.client.server_info().max_payload;
        let window = self.config.max_in_flight;
        let mut outcomes = Vec::with_capacity(events.len());
        let mut pending: FuturesOrdered<BoxFuture<'static, Outcome>> = FuturesOrdered::new();
        for event in events {
            while pending.len() >= window {
                if let Some(o) = pending.next().await {
                    outcomes.push(o);
                }
            }
            pending.push_back(self.send_one(event, max_payload).await);
        }
        while let Some(o) = pending.next().await {
            outcomes.push(o);
        }
        outcomes
    }

    /// Sends one event and returns the future of its outcome (already
    /// resolved when it could not be sent).
    async fn send_one(&self, event: &Event, max_payload: usize) -> BoxFuture<'static, Outcome> {
        let subject = self.config.subject_for(&event.topic);
        if !valid_publish_subject(&subject) {
            return done(DeliveryError::permanent(
                ErrorCode::PUBLISH_INVALID,
                format!("{subject:?} is not a valid NATS subject to publish to"),
            ));
        }
        let headers = headers_for(event);
        let size = event.payload.len() + header_bytes(&headers);
        if max_payload > 0 && size > max_payload {
            return done(DeliveryError::permanent(
                ErrorCode::PUBLISH_TOO_LARGE,
                format!("message is {size} bytes (payload + headers), above the server's max_payload of {max_payload}"),
            ));
        }
        let publish = Publish::build()
            .payload(event.payload.clone().into())
            .headers(headers)
            .message_id(event.id.to_string());
        let unroutable_retryable = self.config.unroutable_retryable;
        let id = event.id;
        match self.js.send_publish(subject.clone(), publish).await {
            Ok(ack) => Box::pin(async move {
                match ack.await {
                    Ok(_) => Outcome::Delivered,
                    Err(e) => {
                        let err = classify(&e, &subject, unroutable_retryable);
                        tracing::warn!(event_id = %id, code = %err.code(), error = %err.message(), "NATS publish failed");
                        Outcome::Failed(err)
                    }
                }
            }),
            Err(e) => {
                let err = classify(&e, &subject, unroutable_retryable);
                tracing::warn!(event_id = %id, code = %err.code(), error = %err.message(), "NATS publish not sent");
                done(err)
            }
        }
    }
}

impl Sink for NatsPublisher {
    fn deliver(&self, events: &[Event]) -> impl std::future::Future<Output = Vec<Outcome>> + Send {
        self.publish(events)
    }
}

fn done(e: DeliveryError) -> BoxFuture<'static, Outcome> {
    Box::pin(future::ready(Outcome::Failed(e)))
}

/// The NATS headers of `event`: its own headers, then ours (which win).
fn headers_for(event: &Event) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in &event.headers {
        h.insert(name.as_str(), value.as_str());
    }
    let content_type = event
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.as_str())
        .unwrap_or("application/octet-stream");
    h.insert(HEADER_CONTENT_TYPE, content_type);
    h.insert(HEADER_EVENT_TYPE, event.event_type.as_str());
    h.insert(HEADER_EVENT_ID, event.id.to_string());
    if let Some(key) = &event.key {
        h.insert(HEADER_KEY, key.as_str());
    }
    h
}

/// Bytes the header block takes on the wire, `Nats-Msg-Id` included.
fn header_bytes(h: &HeaderMap) -> usize {
    // "NATS/1.0\r\n" + "name: value\r\n"... + "\r\n"
    let mut n = 10 + 2;
    for (name, values) in h.iter() {
        for v in values {
            n += AsRef::<str>::as_ref(name).len() + 2 + v.as_str().len() + 2;
        }
    }
    n + HEADER_MSG_ID.len() + 2 + 36 + 2
}

/// A subject one may publish to: non-empty tokens, no wildcards, no whitespace.
fn valid_publish_subject(s: &str) -> bool {
    !s.is_empty()
        && s.split('.')
            .all(|t| !t.is_empty() && t != "*" && t != ">" && !t.contains(char::is_whitespace))
}

/// Maps an async-nats publish error to a classified delivery error.
fn classify(e: &PublishError, subject: &str, unroutable_retryable: bool) -> DeliveryError {
    match e.kind() {
        PublishErrorKind::TimedOut => DeliveryError::retryable(
            ErrorCode::PUBLISH_TIMEOUT,
            "no PubAck in time (maybe delivered)",
        ),
        PublishErrorKind::BrokenPipe => DeliveryError::retryable(
            ErrorCode::PUBLISH_CONNECTION_LOST,
            "connection to NATS lost before the PubAck",
        ),
        PublishErrorKind::StreamNotFound => {
            let msg = format!("no JetStream stream captures subject {subject:?}");
            if unroutable_retryable {
                DeliveryError::retryable(ErrorCode::PUBLISH_UNROUTABLE, msg)
            } else {
                DeliveryError::permanent(ErrorCode::PUBLISH_UNROUTABLE, msg)
            }
        }
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            DeliveryError::retryable(ErrorCode::PUBLISH_REJECTED, e.to_string())
        }
        PublishErrorKind::Other => {
            let js =
                std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>());
            match js {
                Some(j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM =>
                {
                    DeliveryError::permanent(ErrorCode::PUBLISH_TOO_LARGE, j.to_string())
                }
                Some(j) => DeliveryError::retryable(ErrorCode::PUBLISH_REJECTED, j.to_string()),
                // The command channel is closed: the client is gone.
                None => DeliveryError::retryable(
                    ErrorCode::PUBLISH_CONNECTION_LOST,
                    format!("publish not sent: {e}"),
                ),
            }
        }
    }
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
            headers: [
                ("content-type".to_owned(), "application/json".to_owned()),
                ("traceparent".to_owned(), "00-abc-def-01".to_owned()),
            ]
            .into(),
            created_at: Utc::now(),
            attempts: 1,
            next_attempt_at: Utc::now(),
            last_error: None,
        }
    }

    #[test]
    fn headers_carry_metadata_and_trace_context() {
        let e = event();
        let h = headers_for(&e);
        assert_eq!(
            h.get(HEADER_CONTENT_TYPE).map(|v| v.as_str()),
            Some("application/json")
        );
        assert_eq!(
            h.get(HEADER_EVENT_TYPE).map(|v| v.as_str()),
            Some("order.created")
        );
        assert_eq!(h.get(HEADER_KEY).map(|v| v.as_str()), Some("k1"));
        let id = e.id.to_string();
        assert_eq!(
            h.get(HEADER_EVENT_ID).map(|v| v.as_str()),
            Some(id.as_str())
        );
        assert_eq!(
            h.get("traceparent").map(|v| v.as_str()),
            Some("00-abc-def-01")
        );

        let mut bare = event();
        bare.headers.clear();
        bare.key = None;
        let h = headers_for(&bare);
        assert_eq!(
            h.get(HEADER_CONTENT_TYPE).map(|v| v.as_str()),
            Some("application/octet-stream")
        );
        assert!(h.get(HEADER_KEY).is_none());
    }

    #[test]
    fn subjects_with_wildcards_are_refused() {
        assert!(valid_publish_subject("orders.eu"));
        assert!(!valid_publish_subject("orders.*"));
        assert!(!valid_publish_subject("orders.>"));
        assert!(!valid_publish_subject("a..b"));
        assert!(!valid_publish_subject(".a"));
    }

    #[test]
    fn classification_of_publish_errors() {
        let t = classify(&PublishError::from(PublishErrorKind::TimedOut), "s", false);
        assert!(t.is_retryable());
        assert_eq!(t.code(), &ErrorCode::PUBLISH_TIMEOUT);
        let n = classify(
            &PublishError::from(PublishErrorKind::StreamNotFound),
            "s",
            false,
        );
        assert!(!n.is_retryable());
        assert_eq!(n.code(), &ErrorCode::PUBLISH_UNROUTABLE);
        let n = classify(
            &PublishError::from(PublishErrorKind::StreamNotFound),
            "s",
            true,
        );
        assert!(n.is_retryable());
        let b = classify(
            &PublishError::from(PublishErrorKind::BrokenPipe),
            "s",
            false,
        );
        assert_eq!(b.code(), &ErrorCode::PUBLISH_CONNECTION_LOST);
        assert!(b.is_retryable());
    }
}
