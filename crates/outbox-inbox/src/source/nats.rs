//! [`NatsSource`]: a JetStream durable pull consumer on an existing stream.
//!
//! | option | default |
//! |---|---|
//! | servers | required (`nats://host:4222`, a comma-separated list; `nats://user:password@host` or `nats://token@host` carry credentials, never logged) |
//! | stream | required (must exist: a missing stream is [`SourceError::Config`]) |
//! | durable consumer name | required (created when missing: explicit acks, deliver all) |
//! | filter subjects | none (every subject of the stream) |
//! | `max_ack_pending` | 1,024 messages delivered and not yet acknowledged |
//! | `ack_wait` | 30 s (then JetStream delivers the message again) |
//! | `connect_timeout` | 5 s |
//!
//! [`Source::recv`] sends one pull request (`batch = max`, `expires =
//! wait`, `no_wait`): the server answers at once with what the consumer has
//! (up to `max`), or holds the request until the first message arrives or
//! `wait` passes. A token acknowledges its one message (`+ACK`, not the
//! double ack: a lost ack means one redelivery, which the inbox absorbs).
//!
//! The client reconnects by itself (async-nats); while it is not connected
//! [`Source::recv`] reports [`SourceError::Unavailable`].
//!
//! **Per-key order after a crash.** JetStream delivers a message again
//! only once its `ack_wait` passed: what a killed process had received and
//! not acknowledged would come after the later messages its successor has
//! handled meanwhile. So before it subscribes (at start, and after a pull
//! subscription failed), the source reads the durable consumer's info;
//! when messages are delivered and not acknowledged, it first reads the
//! stream itself from the acknowledgement floor (`ack_floor + 1`) up to
//! the last delivered sequence, in stream order (messages of other
//! subjects than the filter skipped), and only then pulls. A replayed
//! message is acknowledged at the durable consumer by its stream sequence
//! (where it is still pending); replayed messages that were acknowledged
//! before come again as copies the inbox's records absorb, as after Kafka's
//! committed offset. The consumer is never deleted or
//! recreated, so a process sharing the durable is not disturbed (its
//! in-flight messages are replayed too, and recognised). Order across
//! processes sharing one durable (competing consumers) is not given.
//!
//! The `Nats-Msg-Id` header the outbox publisher sets (JetStream's
//! deduplication id, always the event id) is left out of
//! [`RawMessage::headers`], as AMQP's `message_id` property is: it is the
//! broker's, not the event's.

use super::{Position, RawMessage, Received, Source, SourceError};
use async_nats::connection::State;
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::message::Acker;
use async_nats::jetstream::stream::{ConsumerErrorKind, LastRawMessageErrorKind};
use async_nats::jetstream::{self, ErrorCode};
use chrono::DateTime;
use futures::StreamExt;
use outbox_core::redact_url;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// The header JetStream deduplicates by; not passed on (see the module docs).
const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Where and how a [`NatsSource`] consumes. `Debug` hides credentials in
/// the server URLs.
#[derive(Clone)]
pub struct NatsSourceConfig {
    servers: String,
    stream: String,
    durable: String,
    filter_subjects: Vec<String>,
    max_ack_pending: i64,
    ack_wait: Duration,
    connect_timeout: Duration,
}

impl fmt::Debug for NatsSourceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSourceConfig")
            .field("servers", &redact_url(&self.servers))
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("filter_subjects", &self.filter_subjects)
            .field("max_ack_pending", &self.max_ack_pending)
            .field("ack_wait", &self.ack_wait)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl NatsSourceConfig {
    /// Consumes stream `stream` on `servers` (a comma-separated list of
    /// URLs) as durable consumer `durable`. Checked by
    /// [`validate`](Self::validate) (and when connecting).
    pub fn new(
        servers: impl Into<String>,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> Self {
        Self {
            servers: servers.into(),
            stream: stream.into(),
            durable: durable.into(),
            filter_subjects: Vec::new(),
            max_ack_pending: 1_024,
            ack_wait: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// Consumes only the messages of `subject` (wildcards allowed); call
    /// again to add more subjects.
    pub fn with_filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subjects.push(subject.into());
        self
    }

    /// Replaces the filter subjects.
    pub fn with_filter_subjects<S: Into<String>>(
        mut self,
        subjects: impl IntoIterator<Item = S>,
    ) -> Self {
        self.filter_subjects = subjects.into_iter().map(Into::into).collect();
        self
    }

    /// At most `n` messages delivered and not acknowledged at once (the
    /// server stops delivering beyond it; at least 1).
    pub fn with_max_ack_pending(mut self, n: u32) -> Self {
        self.max_ack_pending = i64::from(n.max(1));
        self
    }

    /// How long JetStream waits for an acknowledgement before delivering
    /// the message again.
    pub fn with_ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// How long one connection attempt may take.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The stream's name.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The durable consumer's name.
    pub fn durable(&self) -> &str {
        &self.durable
    }

    /// The server URLs, credentials redacted.
    pub fn servers_redacted(&self) -> String {
        redact_url(&self.servers)
    }

    /// Checks the URLs, names, subjects and durations; the error says which
    /// one is wrong (never showing a credential).
    pub fn validate(&self) -> Result<(), SourceError> {
        let servers = self.server_list();
        if servers.is_empty() {
            return Err(SourceError::Config("no NATS server URL given".into()));
        }
        for (i, s) in servers.iter().enumerate() {
            async_nats::ServerAddr::from_str(s).map_err(|e| {
                SourceError::Config(format!(
                    "NATS server URL #{} ({}) is invalid: {}",
                    i + 1,
                    redact_url(s),
                    e.kind()
                ))
            })?;
        }
        check_name("stream name", &self.stream)?;
        check_name("durable consumer name", &self.durable)?;
        for s in &self.filter_subjects {
            let tokens_ok = !s.is_empty()
                && s.split('.').all(|t| !t.is_empty())
                && !s.chars().any(char::is_whitespace);
            if !tokens_ok {
                return Err(SourceError::Config(format!(
                    "filter subject {s:?} is not a valid NATS subject"
                )));
            }
        }
        if self.ack_wait.is_zero() {
            return Err(SourceError::Config("ack_wait must be above zero".into()));
        }
        if self.connect_timeout.is_zero() {
            return Err(SourceError::Config(
                "connect_timeout must be above zero".into(),
            ));
        }
        Ok(())
    }

    fn server_list(&self) -> Vec<&str> {
        self.servers
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect()
    }

    fn consumer_config(&self) -> pull::Config {
        let mut config = pull::Config {
            durable_name: Some(self.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            deliver_policy: DeliverPolicy::All,
            ack_wait: self.ack_wait,
            max_ack_pending: self.max_ack_pending,
            ..Default::default()
        };
        match self.filter_subjects.as_slice() {
            [] => {}
            [one] => config.filter_subject = one.clone(),
            many => config.filter_subjects = many.to_vec(),
        }
        config
    }
}

/// A JetStream stream or consumer name: not empty, no whitespace, none of
/// `. * > / \`.
fn check_name(what: &str, name: &str) -> Result<(), SourceError> {
    let bad = name.is_empty()
        || name
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'));
    if bad {
        return Err(SourceError::Config(format!(
            "{what} {name:?} is invalid: it must be non-empty, without whitespace, '.', '*', '>', '/' or '\\'"
        )));
    }
    Ok(())
}

/// Acknowledges one JetStream message.
pub struct NatsToken {
    /// `None` for a message replayed from the stream (see the module docs):
    /// acknowledged by its stream sequence.
    acker: Option<Acker>,
    stream_sequence: u64,
}

impl NatsToken {
    /// The message's stream sequence.
    pub fn stream_sequence(&self) -> u64 {
        self.stream_sequence
    }
}

/// The stream sequences still to replay before pulling (see the module
/// docs): `next..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Replay {
    next: u64,
    last: u64,
}

impl fmt::Debug for NatsToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsToken")
            .field("stream_sequence", &self.stream_sequence)
            .finish_non_exhaustive()
    }
}

/// Consumes a JetStream stream with a durable pull consumer. See the
/// [module docs](self).
pub struct NatsSource {
    config: NatsSourceConfig,
    client: async_nats::Client,
    js: jetstream::Context,
    /// `None` after the server said the consumer is gone: looked up (or
    /// created) again on the next [`Source::recv`].
    consumer: Option<PullConsumer>,
    /// The long-lived pull subscription `recv` reads from (`None` until the
    /// first `recv`, and after it failed).
    messages: Option<pull::Stream>,
    /// The stream, for the replay.
    stream: Option<jetstream::stream::Stream>,
    /// Whether the consumer's acknowledgement floor was checked since the
    /// pull subscription last went away.
    floor_checked: bool,
    /// What is left to replay before subscribing.
    replay: Option<Replay>,
}

impl fmt::Debug for NatsSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSource")
            .field("servers", &self.config.servers_redacted())
            .field("stream", &self.config.stream)
            .field("durable", &self.config.durable)
            .field("state", &self.client.connection_state())
            .finish_non_exhaustive()
    }
}

impl NatsSource {
    /// Connects, checks that the stream exists and looks up the durable
    /// consumer, creating it when missing. A missing stream, a bad URL or
    /// refused credentials are [`SourceError::Config`]; an unreachable
    /// server is [`SourceError::Unavailable`].
    pub async fn connect(config: NatsSourceConfig) -> Result<Self, SourceError> {
        config.validate()?;
        let servers: Vec<async_nats::ServerAddr> = config
            .server_list()
            .iter()
            .map(|s| s.parse())
            .collect::<Result<_, _>>()
            .map_err(|e: std::io::Error| SourceError::Config(e.kind().to_string()))?;
        let options = async_nats::ConnectOptions::new()
            .name("outbox-inbox")
            .connection_timeout(config.connect_timeout)
            // Reconnects by itself, at most a second apart.
            .reconnect_delay_callback(|attempts| {
                super::reconnect_delay(u32::try_from(attempts).unwrap_or(u32::MAX))
                    .min(Duration::from_secs(1))
            });
        let client = tokio::time::timeout(config.connect_timeout, options.connect(servers))
            .await
            .map_err(|_| {
                SourceError::Unavailable(format!(
                    "no connection to NATS at {} within {:?}",
                    config.servers_redacted(),
                    config.connect_timeout
                ))
            })?
            .map_err(|e| connect_error(&config, &e))?;
        let js = jetstream::new(client.clone());
        let mut source = Self {
            config,
            client,
            js,
            consumer: None,
            messages: None,
            stream: None,
            floor_checked: false,
            replay: None,
        };
        source.consumer().await?;
        tracing::info!(
            servers = %source.config.servers_redacted(),
            stream = %source.config.stream,
            durable = %source.config.durable,
            "NATS source connected"
        );
        Ok(source)
    }

    /// The configuration.
    pub fn config(&self) -> &NatsSourceConfig {
        &self.config
    }

    /// The durable consumer, looked up (created when missing) on first use.
    async fn consumer(&mut self) -> Result<PullConsumer, SourceError> {
        if let Some(consumer) = &self.consumer {
            return Ok(consumer.clone());
        }
        let stream = self
            .js
            .get_stream(&self.config.stream)
            .await
            .map_err(|e| match e.kind() {
                GetStreamErrorKind::JetStream(j)
                    if j.error_code() == ErrorCode::STREAM_NOT_FOUND =>
                {
                    SourceError::Config(format!(
                        "JetStream stream {:?} does not exist",
                        self.config.stream
                    ))
                }
                GetStreamErrorKind::EmptyName | GetStreamErrorKind::InvalidStreamName => {
                    SourceError::Config(format!("invalid stream name: {e}"))
                }
                GetStreamErrorKind::JetStream(j) => {
                    SourceError::Config(format!("stream {:?}: {j}", self.config.stream))
                }
                _ => SourceError::Unavailable(format!(
                    "JetStream did not answer for stream {:?}: {e}",
                    self.config.stream
                )),
            })?;
        let consumer: PullConsumer = stream
            .get_or_create_consumer(&self.config.durable, self.config.consumer_config())
            .await
            .map_err(|e| match e.kind() {
                ConsumerErrorKind::TimedOut | ConsumerErrorKind::Request => {
                    SourceError::Unavailable(format!(
                        "JetStream did not answer for consumer {:?}: {e}",
                        self.config.durable
                    ))
                }
                _ => SourceError::Config(format!(
                    "durable consumer {:?} on stream {:?}: {e}",
                    self.config.durable, self.config.stream
                )),
            })?;
        self.consumer = Some(consumer.clone());
        self.stream = Some(stream);
        Ok(consumer)
    }

    /// Reads the durable consumer's info and, when messages are delivered
    /// and not acknowledged, plans their replay from the acknowledgement
    /// floor (see the module docs).
    async fn check_floor(&mut self) -> Result<(), SourceError> {
        let mut consumer = self.consumer().await?;
        let info = consumer.info().await.map_err(|e| {
            self.consumer = None;
            SourceError::Unavailable(format!(
                "JetStream consumer info of {:?} failed: {e}",
                self.config.durable
            ))
        })?;
        self.replay = replay_of(info);
        if let Some(r) = self.replay {
            tracing::info!(
                stream = %self.config.stream,
                durable = %self.config.durable,
                unacknowledged = info.num_ack_pending,
                from = r.next,
                to = r.last,
                "NATS source: messages delivered and not acknowledged; replaying the stream from the acknowledgement floor so that each key's order holds"
            );
        }
        self.floor_checked = true;
        Ok(())
    }

    /// Up to `max` replayed messages, in stream order.
    async fn replayed(&mut self, max: usize) -> Result<Vec<Received<NatsToken>>, SourceError> {
        let Some(mut r) = self.replay else {
            return Ok(Vec::new());
        };
        if self.stream.is_none() {
            self.consumer().await?;
        }
        let Some(stream) = self.stream.as_ref() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        while out.len() < max && r.next <= r.last {
            match stream.get_raw_message(r.next).await {
                Ok(m) => {
                    if self.config.filter_subjects.is_empty()
                        || self
                            .config
                            .filter_subjects
                            .iter()
                            .any(|f| subject_matches(f, m.subject.as_str()))
                    {
                        out.push(replayed(m));
                    }
                }
                // Deleted since (limits, purge, a work queue's ack): nothing
                // to replay at this sequence.
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {}
                Err(e) => {
                    // Keep the place: the next receive goes on from here.
                    self.replay = Some(r);
                    if out.is_empty() {
                        return Err(SourceError::Unavailable(format!(
                            "JetStream message {} of stream {:?} could not be read for the replay: {e}",
                            r.next, self.config.stream
                        )));
                    }
                    return Ok(out);
                }
            }
            r.next += 1;
        }
        self.replay = (r.next <= r.last).then_some(r);
        Ok(out)
    }
}

/// The replay a consumer's info calls for: from the acknowledgement floor
/// to the last delivered message, when any is delivered and not
/// acknowledged.
fn replay_of(info: &async_nats::jetstream::consumer::Info) -> Option<Replay> {
    let next = info.ack_floor.stream_sequence.saturating_add(1);
    let last = info.delivered.stream_sequence;
    (info.num_ack_pending > 0 && next <= last).then_some(Replay { next, last })
}

/// Whether `subject` matches the NATS filter `filter` (`*` one token, `>`
/// the rest).
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

fn connect_error(config: &NatsSourceConfig, e: &async_nats::ConnectError) -> SourceError {
    use async_nats::ConnectErrorKind as K;
    // async-nats's messages hold no credential; the URLs are redacted.
    let message = format!(
        "cannot connect to NATS at {}: {e}",
        config.servers_redacted()
    );
    match e.kind() {
        K::Dns | K::TimedOut | K::Io | K::MaxReconnects => SourceError::Unavailable(message),
        _ => SourceError::Config(message),
    }
}

impl Source for NatsSource {
    type Token = NatsToken;

    async fn recv(
        &mut self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Received<NatsToken>>, SourceError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let state = self.client.connection_state();
        if state != State::Connected {
            return Err(SourceError::Unavailable(format!(
                "not connected to NATS at {} ({state})",
                self.config.servers_redacted()
            )));
        }
        // Before (re)subscribing: what was delivered and not acknowledged
        // comes first, read from the stream (see the module docs).
        if self.messages.is_none() {
            if !self.floor_checked {
                self.check_floor().await?;
            }
            if self.replay.is_some() {
                return self.replayed(max).await;
            }
        }
        // One long-lived pull subscription, refilled by the client in
        // batches as it is read: a receive takes what has arrived and waits
        // only when nothing has (a one-shot fetch per receive would wait out
        // its expiry whenever fewer than `max` messages may be delivered).
        if self.messages.is_none() {
            let consumer = self.consumer().await?;
            let batch = usize::try_from(self.config.max_ack_pending)
                .unwrap_or(1_024)
                .clamp(1, 1_024);
            let stream = consumer
                .stream()
                .max_messages_per_batch(batch)
                .messages()
                .await
                .map_err(|e| {
                    self.consumer = None;
                    SourceError::Unavailable(format!("JetStream pull subscription failed: {e}"))
                })?;
            self.messages = Some(stream);
        }
        let Some(stream) = self.messages.as_mut() else {
            return Ok(Vec::new());
        };
        let first =
            match tokio::time::timeout(wait.max(Duration::from_millis(1)), stream.next()).await {
                Err(_) => return Ok(Vec::new()),
                Ok(Some(Ok(m))) => m,
                Ok(Some(Err(e))) => {
                    // Missed heartbeats, a deleted consumer: subscribe again
                    // next time (what the dropped subscription held comes again
                    // after ack_wait).
                    self.messages = None;
                    self.consumer = None;
                    self.floor_checked = false;
                    return Err(SourceError::Unavailable(format!(
                        "JetStream pull failed: {e}"
                    )));
                }
                Ok(None) => {
                    self.messages = None;
                    self.floor_checked = false;
                    return Err(SourceError::Unavailable(
                        "JetStream pull subscription ended".to_owned(),
                    ));
                }
            };
        let mut out = vec![received(first)];
        while out.len() < max {
            match futures::FutureExt::now_or_never(stream.next()) {
                Some(Some(Ok(m))) => out.push(received(m)),
                Some(Some(Err(e))) => {
                    tracing::debug!(error = %e, got = out.len(), "JetStream pull ended early");
                    self.messages = None;
                    self.consumer = None;
                    self.floor_checked = false;
                    break;
                }
                Some(None) => {
                    self.messages = None;
                    self.floor_checked = false;
                    break;
                }
                None => break,
            }
        }
        Ok(out)
    }

    async fn ack(&mut self, tokens: Vec<NatsToken>) -> Result<(), SourceError> {
        for token in tokens {
            // An ack that does not reach the server is not an error: the
            // message is delivered again after ack_wait and absorbed.
            let Some(acker) = token.acker else {
                // A replayed message: acknowledged at the durable consumer
                // by its stream sequence (JetStream's ack subject; the
                // server finds the pending delivery by the stream sequence
                // and takes its own delivery sequence), so that it is not
                // delivered again once it is handled. Not pending (acked
                // already, or never delivered): the server ignores it.
                let subject = format!(
                    "$JS.ACK.{}.{}.1.{}.0.0.0",
                    self.config.stream, self.config.durable, token.stream_sequence
                );
                if let Err(e) = self.client.publish(subject, "+ACK".into()).await {
                    tracing::debug!(error = %e, seq = token.stream_sequence, "JetStream ack of a replayed message not sent");
                }
                continue;
            };
            if let Err(e) = acker.ack().await {
                tracing::debug!(error = %e, seq = token.stream_sequence, "JetStream ack not sent");
            }
        }
        Ok(())
    }

    async fn close(self) -> Result<(), SourceError> {
        // Acks are published on the connection: flush them before leaving.
        let flushed = tokio::time::timeout(Duration::from_secs(5), self.client.flush()).await;
        if !matches!(flushed, Ok(Ok(()))) {
            tracing::debug!("NATS flush on close did not finish; unflushed acks are redelivered");
        }
        drop(self.client.drain().await);
        Ok(())
    }

    fn describe(&self) -> String {
        format!("nats:{}/{}", self.config.stream, self.config.durable)
    }

    fn position(token: &NatsToken) -> Option<Position> {
        (token.stream_sequence > 0).then_some(Position {
            log: 0,
            offset: token.stream_sequence,
        })
    }
}

/// The headers of a JetStream message, without `Nats-Msg-Id`.
fn headers_of(map: Option<&async_nats::HeaderMap>) -> Vec<(String, String)> {
    let mut headers = Vec::new();
    if let Some(map) = map {
        for (name, values) in map.iter() {
            let name: &str = name.as_ref();
            if name.eq_ignore_ascii_case(MSG_ID_HEADER) {
                continue;
            }
            for value in values {
                headers.push((name.to_owned(), value.as_str().to_owned()));
            }
        }
    }
    headers
}

/// A message read from the stream for the replay: redelivered, no acker.
fn replayed(m: jetstream::message::StreamMessage) -> Received<NatsToken> {
    Received {
        message: RawMessage {
            headers: headers_of(Some(&m.headers)),
            body: m.payload.to_vec(),
            destination: m.subject.to_string(),
            timestamp: DateTime::from_timestamp(m.time.unix_timestamp(), m.time.nanosecond()),
            redelivered: true,
            behind: None,
        },
        token: NatsToken {
            acker: None,
            stream_sequence: m.sequence,
        },
    }
}

/// A pulled JetStream message as a [`RawMessage`] and its token.
fn received(m: jetstream::Message) -> Received<NatsToken> {
    let (delivered, pending, published, stream_sequence) = match m.info() {
        Ok(info) => (
            info.delivered,
            Some(info.pending),
            DateTime::from_timestamp(info.published.unix_timestamp(), info.published.nanosecond()),
            info.stream_sequence,
        ),
        Err(_) => (1, None, None, 0),
    };
    let (message, acker) = m.split();
    let headers = headers_of(message.headers.as_ref());
    Received {
        message: RawMessage {
            headers,
            body: message.payload.to_vec(),
            destination: message.subject.to_string(),
            timestamp: published,
            redelivered: delivered > 1,
            behind: pending,
        },
        token: NatsToken {
            acker: Some(acker),
            stream_sequence,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_what_is_wrong() {
        let ok = NatsSourceConfig::new("nats://127.0.0.1:4222", "ORDERS", "inbox")
            .with_filter_subject("orders.>");
        assert!(ok.validate().is_ok());
        let e = NatsSourceConfig::new("", "S", "d").validate().unwrap_err();
        assert!(e.to_string().contains("no NATS server"), "{e}");
        let e = NatsSourceConfig::new("nats://h:4222", "a.b", "d")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("stream name"), "{e}");
        let e = NatsSourceConfig::new("nats://h:4222", "S", "with space")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("durable consumer name"), "{e}");
        let e = ok
            .clone()
            .with_filter_subject("orders..x")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("filter subject"), "{e}");
        let e = ok
            .clone()
            .with_ack_wait(Duration::ZERO)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("ack_wait"), "{e}");
        assert!(matches!(e, SourceError::Config(_)));
    }

    #[test]
    fn debug_and_errors_hide_credentials() {
        let c = NatsSourceConfig::new(
            "nats://app:hunter2@127.0.0.1:4222,nats://t0ken@other:4222",
            "S",
            "d",
        );
        let s = format!("{c:?}");
        assert!(!s.contains("hunter2") && !s.contains("t0ken"), "{s}");
        assert!(s.contains("other:4222"), "{s}");
        let e = NatsSourceConfig::new("http://app:hunter2@h:1", "S", "d")
            .validate()
            .unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }

    #[test]
    fn filter_subjects_match_as_nats_does() {
        assert!(subject_matches("orders.>", "orders.a.b"));
        assert!(!subject_matches("orders.>", "orders"));
        assert!(subject_matches("orders.*", "orders.a"));
        assert!(!subject_matches("orders.*", "orders.a.b"));
        assert!(subject_matches("orders.a", "orders.a"));
        assert!(!subject_matches("orders.a", "orders.b"));
        assert!(subject_matches("*.a.>", "x.a.y"));
    }

    #[test]
    fn one_or_several_filter_subjects() {
        let c = NatsSourceConfig::new("nats://h:4222", "S", "d");
        assert!(c.consumer_config().filter_subject.is_empty());
        let one = c.clone().with_filter_subject("a.>").consumer_config();
        assert_eq!(one.filter_subject, "a.>");
        let many = c.with_filter_subjects(["a.>", "b.*"]).consumer_config();
        assert_eq!(many.filter_subjects, vec!["a.>", "b.*"]);
        assert_eq!(many.ack_policy, AckPolicy::Explicit);
        assert_eq!(many.durable_name.as_deref(), Some("d"));
    }
}
