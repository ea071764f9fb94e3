//! The JetStream publisher.

use crate::config::NatsConfig;
use crate::error::NatsError;
use async_nats::connection::State;
use async_nats::jetstream::context::{Publish, PublishError, PublishErrorKind};
use async_nats::jetstream::{self, stream};
use async_nats::HeaderMap;
use futures::future::{BoxFuture, FutureExt};
use outbox_broker::{SendWindow, Sent};
use outbox_core::cloudevents::Binding;
use outbox_core::{BrokerMessage, DeliveryError, ErrorCode, Event, FailureKind, Outcome, Sink};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// JetStream's deduplication header.
pub const HEADER_MSG_ID: &str = "Nats-Msg-Id";

/// Publishes outbox events to NATS JetStream and reports an event
/// `Delivered` only once its PubAck arrived. Cheap to clone.
#[derive(Clone)]
pub struct NatsPublisher {
    client: async_nats::Client,
    js: jetstream::Context,
    config: Arc<NatsConfig>,
    last_error: Arc<Mutex<Option<String>>>,
    /// The dedup window check, when configured
    /// ([`NatsConfig::with_min_dedup_window`]).
    dedup: Option<Arc<DedupCheck>>,
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
    /// with the config's [`ConnectPolicy`](outbox_broker::ConnectPolicy)
    /// while the error is retryable. Later reconnects are done by the client
    /// on its own, spaced by the same policy.
    pub async fn connect(config: NatsConfig) -> Result<Self, NatsError> {
        Self::open(config, false).await
    }

    /// A publisher whose client connects in the background (and keeps
    /// trying): it returns at once, even when no server is reachable. Until
    /// the connection is up every event of a batch fails as sink
    /// unavailable, with the last connection error in its message.
    pub async fn lazy(config: NatsConfig) -> Result<Self, NatsError> {
        Self::open(config, true).await
    }

    async fn open(config: NatsConfig, lazy: bool) -> Result<Self, NatsError> {
        outbox_core::cloudevents::require_source(
            config.wire_format,
            config.cloudevents_source.as_ref(),
        )
        .map_err(|e| NatsError::InvalidConfig(e.to_string()))?;
        let servers: Vec<async_nats::ServerAddr> = config
            .servers
            .iter()
            .map(|s| s.parse())
            .collect::<Result<_, _>>()
            .map_err(|e: std::io::Error| NatsError::InvalidConfig(e.kind().to_string()))?;
        let last_error = Arc::new(Mutex::new(None));
        let policy = config.connect;
        let with_events = |options: async_nats::ConnectOptions| {
            let last = last_error.clone();
            options.event_callback(move |event| {
                let last = last.clone();
                async move { record_event(&last, event) }
            })
        };
        let client = if lazy {
            // One attempt of our own first: async-nats's background
            // connector reports a failure by its kind only ("IO error"),
            // while this one keeps the cause (e.g. a TLS handshake failure)
            // for the outcomes' messages.
            let options = with_events(config.connect_options().await?);
            let first =
                tokio::time::timeout(policy.timeout, options.connect(servers.clone())).await;
            match first {
                Ok(Ok(client)) => client,
                failed => {
                    let cause = match failed {
                        Ok(Err(e)) => NatsError::from(e).to_string(),
                        _ => format!("no connection within {:?}", policy.timeout),
                    };
                    tracing::warn!(error = %cause, "NATS not reachable; connecting in the background");
                    if let Ok(mut l) = last_error.lock() {
                        *l = Some(cause);
                    }
                    with_events(config.connect_options().await?)
                        .retry_on_initial_connect()
                        .connect(servers.clone())
                        .await
                        .map_err(NatsError::from)?
                }
            }
        } else {
            let attempt = || async {
                with_events(config.connect_options().await?)
                    .connect(servers.clone())
                    .await
                    .map_err(NatsError::from)
            };
            policy
                .connect("nats", attempt, NatsError::is_retryable, || {
                    NatsError::Connect {
                        kind: async_nats::ConnectErrorKind::TimedOut,
                        message: format!("no connection within {:?}", policy.timeout),
                    }
                })
                .await?
        };
        if !lazy {
            tracing::info!(servers = ?config.servers_redacted(), "connected to NATS");
        }
        let mut publisher = Self::from_client(client, config);
        publisher.last_error = last_error;
        Ok(publisher)
    }

    /// Uses an already connected client.
    pub fn from_client(client: async_nats::Client, config: NatsConfig) -> Self {
        let mut js = jetstream::new(client.clone());
        js.set_timeout(config.ack_timeout);
        let dedup = config.min_dedup_window.map(|min| {
            Arc::new(DedupCheck {
                js: js.clone(),
                min,
                checked: Mutex::default(),
            })
        });
        Self {
            client,
            js,
            config: Arc::new(config),
            last_error: Arc::new(Mutex::new(None)),
            dedup,
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
        // nats-server removes an account's stream directory when its last
        // stream is deleted; a stream created at that moment fails with
        // "error creating store for stream" (JetStream error 10049, seen in
        // CI with tests creating and deleting streams side by side). The
        // server is fine: tried again, twice, after 50 and 150 ms.
        let mut tries = 0;
        let stream = loop {
            match self.js.get_or_create_stream(config.clone()).await {
                Ok(stream) => break stream,
                Err(e) if tries < 2 && e.to_string().contains("error code 10049") => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(50 * (2 * tries - 1)))
                        .await;
                }
                Err(e) => return Err(NatsError::JetStream(e.to_string())),
            }
        };
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

    async fn send_batch(&self, events: &[Event]) -> Vec<Outcome> {
        if events.is_empty() {
            return Vec::new();
        }
        let state = self.client.connection_state();
        if state != State::Connected {
            let last = self
                .last_error
                .lock()
                .map(|l| l.clone())
                .unwrap_or_default();
            let message = match last {
                Some(last) => {
                    format!("not connected to NATS ({state}); last connection error: {last}")
                }
                None => format!("not connected to NATS ({state})"),
            };
            tracing::warn!(batch = events.len(), %message, "NATS batch not sent");
            let e = DeliveryError::unavailable(ErrorCode::PUBLISH_CONNECTION_LOST, message);
            return vec![Outcome::Failed(e); events.len()];
        }
        let max_payload = self.client.server_info().max_payload;
        let mut outcomes = SendWindow::new(self.config.max_in_flight)
            .run(events, |event| self.send_one(event, max_payload))
            .await;
        self.confirm_unroutable(events, &mut outcomes).await;
        outcomes
    }

    /// "No stream captures the subject" is the server's answer both when no
    /// stream does and while JetStream is not serving the stream yet (a
    /// server starting, restarting or shutting down has no responder on the
    /// subject). Before an event is dead-lettered for it, JetStream is asked
    /// once per subject which stream captures it: no stream (a definite
    /// answer) keeps the event's failure; a stream that captures it now, or
    /// no answer from JetStream at all, is the sink's failure (unavailable:
    /// the batch is given back unattempted and the breaker probes).
    async fn confirm_unroutable(&self, events: &[Event], outcomes: &mut [Outcome]) {
        let mut verdicts: Vec<(String, Option<DeliveryError>)> = Vec::new();
        for (event, outcome) in events.iter().zip(outcomes.iter_mut()) {
            let Outcome::Failed(e) = outcome else {
                continue;
            };
            if *e.code() != ErrorCode::PUBLISH_UNROUTABLE || e.kind() == FailureKind::Unavailable {
                continue;
            }
            let subject = self.config.subject_for(&event.topic);
            let verdict = match verdicts.iter().find(|(s, _)| *s == subject) {
                Some((_, v)) => v.clone(),
                None => {
                    let v = self.jetstream_verdict(&subject).await;
                    verdicts.push((subject, v.clone()));
                    v
                }
            };
            if let Some(unavailable) = verdict {
                *outcome = Outcome::Failed(unavailable);
            }
        }
    }

    /// `None`: JetStream says no stream captures `subject` (the event's
    /// failure stands); `Some(error)`: the sink's failure to report instead.
    async fn jetstream_verdict(&self, subject: &str) -> Option<DeliveryError> {
        use jetstream::context::GetStreamByNameErrorKind as K;
        let wait = self.config.ack_timeout.min(CONFIRM_TIMEOUT);
        match tokio::time::timeout(wait, self.js.stream_by_subject(subject)).await {
            Ok(Err(e)) if matches!(e.kind(), K::NotFound) => None,
            Ok(Ok(stream)) => Some(DeliveryError::unavailable(
                ErrorCode::PUBLISH_UNROUTABLE,
                format!(
                    "JetStream did not route subject {subject:?}, yet stream {stream:?} captures it: the stream is not being served (server starting or restarting?)"
                ),
            )),
            Ok(Err(e)) => Some(DeliveryError::unavailable(
                ErrorCode::PUBLISH_UNROUTABLE,
                format!("JetStream did not route subject {subject:?} and does not answer which stream captures it ({e}): JetStream unavailable"),
            )),
            Err(_) => Some(DeliveryError::unavailable(
                ErrorCode::PUBLISH_UNROUTABLE,
                format!("JetStream did not route subject {subject:?} and did not answer within {wait:?} which stream captures it: JetStream unavailable"),
            )),
        }
    }

    /// Sends one event; the ack future is returned to the window.
    async fn send_one(
        &self,
        event: &Event,
        max_payload: usize,
    ) -> Sent<Outcome, BoxFuture<'static, Outcome>> {
        let subject = self.config.subject_for(&event.topic);
        if !valid_publish_subject(&subject) {
            return Sent::Done(Outcome::Failed(DeliveryError::permanent(
                ErrorCode::PUBLISH_INVALID,
                format!("{subject:?} is not a valid NATS subject to publish to"),
            )));
        }
        let mut message = BrokerMessage::new(event).with_format(self.config.wire_format);
        if let Some(source) = &self.config.cloudevents_source {
            message = message.with_cloudevents(Binding::Nats, source);
        }
        let headers = headers_for(&message);
        let body = message.body();
        // What is sent: the payload, or the envelope around it.
        let size = body.len() + header_bytes(&headers);
        if max_payload > 0 && size > max_payload {
            return Sent::Done(Outcome::Failed(DeliveryError::permanent(
                ErrorCode::PUBLISH_TOO_LARGE,
                format!("message is {size} bytes (body + headers, {} format), above the server's max_payload of {max_payload}", message.format()),
            )));
        }
        let publish = Publish::build()
            .payload(body.into_owned().into())
            .headers(headers)
            .message_id(message.dedup_id());
        let unroutable_retryable = self.config.unroutable_retryable;
        let id = event.id;
        let check = self.dedup.clone();
        match self.js.send_publish(subject.clone(), publish).await {
            Ok(ack) => Sent::InFlight(
                async move {
                    match ack.await {
                        Ok(ack) => {
                            if let Some(check) = check {
                                check.run(&ack.stream).await;
                            }
                            Outcome::Delivered
                        }
                        Err(e) => {
                            let err = classify(&e, &subject, unroutable_retryable);
                            tracing::warn!(event_id = %id, code = %err.code(), error = %err.message(), "NATS publish failed");
                            Outcome::Failed(err)
                        }
                    }
                }
                .boxed(),
            ),
            Err(e) => {
                let err = classify(&e, &subject, unroutable_retryable);
                tracing::warn!(event_id = %id, code = %err.code(), error = %err.message(), "NATS publish not sent");
                Sent::Done(Outcome::Failed(err))
            }
        }
    }
}

/// Reads each stream's dedup window once, at its first PubAck, and names
/// one shorter than `min` in a WARN (see
/// [`NatsConfig::with_min_dedup_window`]).
struct DedupCheck {
    js: jetstream::Context,
    min: std::time::Duration,
    /// The streams read (or being read).
    checked: Mutex<std::collections::HashSet<String>>,
}

impl DedupCheck {
    /// Reads `stream`'s dedup window once (the first PubAck from it) and
    /// logs a WARN when it is shorter than `min`; a stream whose info cannot
    /// be read is tried again at its next PubAck.
    async fn run(&self, stream: &str) {
        let min = self.min;
        let first = self
            .checked
            .lock()
            .map(|mut s| !s.contains(stream) && s.insert(stream.to_owned()))
            .unwrap_or(false);
        if !first {
            return;
        }
        let window = match self.js.get_stream(stream).await {
            Ok(mut s) => s
                .info()
                .await
                .map(|i| i.config.duplicate_window)
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match window {
            Ok(window) if window < min => tracing::warn!(
                stream,
                duplicate_window = ?window,
                needed = ?min,
                "the stream's dedup window is shorter than the relay needs: a copy the relay sends again after a lost PubAck (a leader change, a cut connection, a relay taking over a lease) may be stored twice; raise the stream's duplicate_window (nats stream edit {stream} --dupe-window) or have consumers dedup by Nats-Msg-Id"
            ),
            Ok(window) => {
                tracing::debug!(stream, duplicate_window = ?window, "stream dedup window checked");
            }
            Err(e) => {
                if let Ok(mut s) = self.checked.lock() {
                    s.remove(stream);
                }
                tracing::debug!(stream, error = %e, "could not read the stream's dedup window");
            }
        }
    }
}

impl Sink for NatsPublisher {
    fn deliver(&self, events: &[Event]) -> impl std::future::Future<Output = Vec<Outcome>> + Send {
        self.send_batch(events)
    }
}

/// Keeps the last connection error (cleared on connect) for the message of
/// "not connected" outcomes, and logs the client's events.
fn record_event(last: &Mutex<Option<String>>, event: async_nats::Event) {
    match &event {
        async_nats::Event::Connected => {
            tracing::info!("NATS connection (re)established");
            if let Ok(mut l) = last.lock() {
                *l = None;
            }
        }
        async_nats::Event::ClientError(e) => {
            tracing::warn!(error = %e, "NATS connection error");
            // Keep a more detailed cause recorded earlier (the client's
            // event names only the kind of error).
            if let Ok(mut l) = last.lock() {
                if l.is_none() {
                    *l = Some(e.to_string());
                }
            }
        }
        other => tracing::info!(event = %other, "NATS client event"),
    }
}

/// The NATS headers of a message: [`BrokerMessage::headers`], as is.
fn headers_for(message: &BrokerMessage<'_>) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in message.headers() {
        h.insert(name, value);
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

/// Longest wait for JetStream's answer when a publish was not routed.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(2);

/// JetStream errors that say the service, not the message, is the problem.
fn jetstream_unavailable(code: jetstream::ErrorCode) -> bool {
    use jetstream::ErrorCode as C;
    [
        C::CLUSTER_NOT_AVAILABLE,
        C::CLUSTER_NOT_ACTIVE,
        C::CLUSTER_NOT_LEADER,
        C::CLUSTER_NO_PEERS,
        C::CLUSTER_INCOMPLETE,
        C::JETSTREAM_NOT_ENABLED,
        C::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
        C::INSUFFICIENT_RESOURCES,
        C::STORAGE_RESOURCES_EXCEEDED,
        C::MEMORY_RESOURCES_EXCEEDED,
        C::ACCOUNT_RESOURCES_EXCEEDED,
    ]
    .contains(&code)
}

/// Maps an async-nats publish error to a classified delivery error: the
/// connection (lost, no PubAck in time, JetStream unavailable) is the sink's
/// failure; a missing stream, a refused size or a rejected message is the
/// event's.
fn classify(e: &PublishError, subject: &str, unroutable_retryable: bool) -> DeliveryError {
    match e.kind() {
        PublishErrorKind::TimedOut => DeliveryError::unavailable(
            ErrorCode::PUBLISH_TIMEOUT,
            "no PubAck in time (maybe delivered)",
        ),
        PublishErrorKind::BrokenPipe => DeliveryError::unavailable(
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
                Some(j) if jetstream_unavailable(j.error_code()) => DeliveryError::unavailable(
                    ErrorCode::PUBLISH_REJECTED,
                    format!("JetStream unavailable: {j}"),
                ),
                Some(j) => DeliveryError::retryable(ErrorCode::PUBLISH_REJECTED, j.to_string()),
                // The command channel is closed: the client is gone.
                None => DeliveryError::unavailable(
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

    fn event() -> Event {
        let mut e = outbox_testkit::publisher::event("orders", Some("k1"), b"{}".to_vec());
        e.event_type = "order.created".into();
        e.headers = [
            ("content-type".to_owned(), "application/json".to_owned()),
            ("traceparent".to_owned(), "00-abc-def-01".to_owned()),
        ]
        .into();
        e
    }

    #[test]
    fn headers_carry_metadata_and_trace_context() {
        let e = event();
        let h = headers_for(&BrokerMessage::new(&e));
        assert_eq!(
            h.get(outbox_core::headers::CONTENT_TYPE)
                .map(|v| v.as_str()),
            Some("application/json")
        );
        assert_eq!(
            h.get(outbox_core::headers::EVENT_TYPE).map(|v| v.as_str()),
            Some("order.created")
        );
        assert_eq!(
            h.get(outbox_core::headers::KEY).map(|v| v.as_str()),
            Some("k1")
        );
        let id = e.id.to_string();
        assert_eq!(
            h.get(outbox_core::headers::EVENT_ID).map(|v| v.as_str()),
            Some(id.as_str())
        );
        assert_eq!(
            h.get("traceparent").map(|v| v.as_str()),
            Some("00-abc-def-01")
        );

        let mut bare = event();
        bare.headers.clear();
        bare.key = None;
        let h = headers_for(&BrokerMessage::new(&bare));
        assert_eq!(
            h.get(outbox_core::headers::CONTENT_TYPE)
                .map(|v| v.as_str()),
            Some("application/octet-stream")
        );
        assert!(h.get(outbox_core::headers::KEY).is_none());
    }

    #[test]
    fn envelope_headers_mark_the_format() {
        let e = event();
        let message = BrokerMessage::new(&e).with_format(outbox_core::WireFormat::Envelope);
        let h = headers_for(&message);
        assert_eq!(
            h.get(outbox_core::headers::CONTENT_TYPE)
                .map(|v| v.as_str()),
            Some(outbox_core::ENVELOPE_CONTENT_TYPE)
        );
        assert_eq!(
            h.get(outbox_core::headers::WIRE_FORMAT).map(|v| v.as_str()),
            Some(outbox_core::ENVELOPE_MARKER)
        );
        assert_eq!(
            h.get(outbox_core::headers::KEY).map(|v| v.as_str()),
            Some("k1")
        );
        assert!(headers_for(&BrokerMessage::new(&e))
            .get(outbox_core::headers::WIRE_FORMAT)
            .is_none());
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
        assert!(t.is_sink_unavailable(), "{t}");
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
        assert!(n.is_retryable() && !n.is_sink_unavailable());
        let b = classify(
            &PublishError::from(PublishErrorKind::BrokenPipe),
            "s",
            false,
        );
        assert_eq!(b.code(), &ErrorCode::PUBLISH_CONNECTION_LOST);
        assert!(b.is_sink_unavailable());
        let o = classify(&PublishError::from(PublishErrorKind::Other), "s", false);
        assert!(
            o.is_sink_unavailable(),
            "no JetStream answer: the client is gone"
        );
    }
}
