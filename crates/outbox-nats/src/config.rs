//! Connection and publishing options.

use crate::error::NatsError;
use outbox_broker::ConnectPolicy;
use outbox_core::cloudevents::Source;
use outbox_core::WireFormat;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

/// How the client authenticates. `Debug` never prints a secret.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum NatsAuth {
    /// No credentials (or credentials inside the server URLs).
    #[default]
    None,
    /// User name and password.
    UserPassword {
        /// User name.
        user: String,
        /// Password (redacted in `Debug`).
        password: String,
    },
    /// A token.
    Token(String),
    /// An NKey seed (`SU...`).
    NKey(String),
    /// A `.creds` file (JWT + NKey seed), read when connecting.
    CredentialsFile(PathBuf),
}

impl fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NatsAuth::None => f.write_str("None"),
            NatsAuth::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .field("password", &"***")
                .finish(),
            NatsAuth::Token(_) => f.write_str("Token(***)"),
            NatsAuth::NKey(_) => f.write_str("NKey(***)"),
            NatsAuth::CredentialsFile(path) => {
                f.debug_tuple("CredentialsFile").field(path).finish()
            }
        }
    }
}

/// TLS options. A `tls://` server URL also turns TLS on.
#[derive(Debug, Clone, Default)]
pub struct NatsTls {
    /// Refuse to talk to a server without TLS.
    pub required: bool,
    /// Extra PEM root certificates to trust (e.g. a private CA).
    pub root_certificates: Vec<PathBuf>,
    /// Client certificate and key (PEM) for mutual TLS.
    pub client_certificate: Option<(PathBuf, PathBuf)>,
}

/// Everything [`crate::NatsPublisher`] needs: servers, authentication, TLS,
/// subject mapping and publishing limits.
///
/// | option | default |
/// |---|---|
/// | servers | `nats://127.0.0.1:4222` |
/// | subject | `prefix.topic` (no prefix: the topic itself), or an explicit mapping |
/// | `max_in_flight` | 256 un-acknowledged publishes per batch |
/// | `ack_timeout` | 5 s (then `PUBLISH_TIMEOUT`: the sink is unavailable, maybe delivered) |
/// | `connect_timeout` | 5 s per attempt |
/// | `connect_attempts` | 8 (exponential backoff from 100 ms, jittered: about 1.5 s) |
/// | `wire_format` | [`WireFormat::Headers`]: the payload as the body; [`WireFormat::Envelope`]: the protobuf envelope |
/// | `reconnect_delay_max` | 250 ms between reconnect attempts (a returning server is in use within about a quarter of a second; a loopback or LAN connect attempt costs next to nothing) |
///
/// Connecting and reconnecting follow one [`ConnectPolicy`] (the same type
/// every outbox publisher uses); the three `connect`/`reconnect` options
/// above are its fields.
/// | no stream for the subject | permanent `PUBLISH_UNROUTABLE` |
#[derive(Clone)]
pub struct NatsConfig {
    pub(crate) servers: Vec<String>,
    pub(crate) auth: NatsAuth,
    pub(crate) tls: NatsTls,
    pub(crate) subject_prefix: Option<String>,
    pub(crate) subject_map: BTreeMap<String, String>,
    pub(crate) max_in_flight: usize,
    pub(crate) ack_timeout: Duration,
    pub(crate) connect: ConnectPolicy,
    pub(crate) unroutable_retryable: bool,
    pub(crate) client_name: Option<String>,
    pub(crate) ignore_discovered_servers: bool,
    pub(crate) wire_format: WireFormat,
    pub(crate) cloudevents_source: Option<Source>,
    pub(crate) min_dedup_window: Option<Duration>,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            servers: vec!["nats://127.0.0.1:4222".to_owned()],
            auth: NatsAuth::None,
            tls: NatsTls::default(),
            subject_prefix: None,
            subject_map: BTreeMap::new(),
            max_in_flight: 256,
            ack_timeout: Duration::from_secs(5),
            connect: ConnectPolicy::default()
                // 100, 200, then 250 ms apart: the first connection is tried
                // for about 1.5 s, as with 5 attempts up to 1 s apart.
                .with_attempts(8)
                .with_timeout(Duration::from_secs(5))
                .with_delays(Duration::from_millis(100), Duration::from_millis(250)),
            unroutable_retryable: false,
            client_name: Some("outbox-relay".to_owned()),
            ignore_discovered_servers: false,
            wire_format: WireFormat::Headers,
            cloudevents_source: None,
            min_dedup_window: None,
        }
    }
}

impl fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConfig")
            .field(
                "servers",
                &self
                    .servers
                    .iter()
                    .map(|s| redact_url(s))
                    .collect::<Vec<_>>(),
            )
            .field("auth", &self.auth)
            .field("tls", &self.tls)
            .field("subject_prefix", &self.subject_prefix)
            .field("subject_map", &self.subject_map)
            .field("max_in_flight", &self.max_in_flight)
            .field("ack_timeout", &self.ack_timeout)
            .field("connect", &self.connect)
            .field("unroutable_retryable", &self.unroutable_retryable)
            .field("client_name", &self.client_name)
            .field("ignore_discovered_servers", &self.ignore_discovered_servers)
            .field("wire_format", &self.wire_format)
            .field("cloudevents_source", &self.cloudevents_source)
            .finish()
    }
}

use outbox_core::redact_url;

impl NatsConfig {
    /// Servers from a comma-separated list of URLs
    /// (`nats://host:4222,nats://other:4222`; `tls://` requires TLS;
    /// `nats://user:password@host` or `nats://token@host` carry credentials).
    pub fn from_url(urls: &str) -> Result<Self, NatsError> {
        let servers: Vec<String> = urls
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        Self::default().with_servers(servers)
    }

    /// Replaces the server list (each URL is validated).
    pub fn with_servers<S: Into<String>>(
        mut self,
        servers: impl IntoIterator<Item = S>,
    ) -> Result<Self, NatsError> {
        let servers: Vec<String> = servers.into_iter().map(Into::into).collect();
        if servers.is_empty() {
            return Err(NatsError::InvalidConfig("no NATS server URL given".into()));
        }
        for (i, s) in servers.iter().enumerate() {
            async_nats::ServerAddr::from_str(s).map_err(|e| {
                NatsError::InvalidConfig(format!(
                    "NATS server URL #{} ({}) is invalid: {}",
                    i + 1,
                    redact_url(s),
                    e.kind()
                ))
            })?;
        }
        self.servers = servers;
        Ok(self)
    }

    /// Authenticates with a user name and password.
    pub fn with_user_password(
        mut self,
        user: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.auth = NatsAuth::UserPassword {
            user: user.into(),
            password: password.into(),
        };
        self
    }

    /// Authenticates with a token.
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.auth = NatsAuth::Token(token.into());
        self
    }

    /// Authenticates with an NKey seed.
    pub fn with_nkey(mut self, seed: impl Into<String>) -> Self {
        self.auth = NatsAuth::NKey(seed.into());
        self
    }

    /// Authenticates with a `.creds` file (read at connect time).
    pub fn with_credentials_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.auth = NatsAuth::CredentialsFile(path.into());
        self
    }

    /// Sets the TLS options.
    pub fn with_tls(mut self, tls: NatsTls) -> Self {
        self.tls = tls;
        self
    }

    /// Publishes topic `t` to subject `prefix.t`.
    pub fn with_subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        let p: String = prefix.into();
        self.subject_prefix = if p.is_empty() { None } else { Some(p) };
        self
    }

    /// Publishes topic `topic` to exactly `subject` (takes precedence over the prefix).
    pub fn with_subject_mapping(
        mut self,
        topic: impl Into<String>,
        subject: impl Into<String>,
    ) -> Self {
        self.subject_map.insert(topic.into(), subject.into());
        self
    }

    /// At most `n` publishes wait for their PubAck at once (minimum 1).
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// How long to wait for a PubAck before reporting `PUBLISH_TIMEOUT`.
    pub fn with_ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// The shortest deduplication window a stream needs for the relay's
    /// copies to be dropped by the server. A publish whose PubAck was lost
    /// (a leader killed, a connection cut) is stored once and sent again
    /// when the relay delivers the event again: after its breaker reopens,
    /// or after another relay took the lease over, up to about two lock
    /// timeouts later (`outbox-relay` sets twice its lock timeout). The
    /// first PubAck from each stream makes the publisher read the stream's
    /// `duplicate_window` once and log a WARN when it is shorter (copies
    /// then reach consumers, which must dedup them by `Nats-Msg-Id`).
    /// Unset: not checked.
    pub fn with_min_dedup_window(mut self, window: Duration) -> Self {
        self.min_dedup_window = Some(window);
        self
    }

    outbox_broker::connect_policy_builders!(
        "Attempts for the initial connection (minimum 1), with exponential backoff."
    );

    /// Longest delay between two reconnect attempts after the connection is lost.
    pub fn with_reconnect_delay_max(mut self, delay: Duration) -> Self {
        self.connect = self.connect.with_delays(self.connect.min_delay, delay);
        self
    }

    /// Reports "no stream bound to the subject" as retryable instead of
    /// permanent (for deployments that create streams after the relay starts).
    pub fn with_unroutable_retryable(mut self, retryable: bool) -> Self {
        self.unroutable_retryable = retryable;
        self
    }

    /// The client name the server shows in its connection list.
    pub fn with_client_name(mut self, name: impl Into<String>) -> Self {
        self.client_name = Some(name.into());
        self
    }

    /// Only ever connect to the configured servers, not to ones a cluster advertises.
    pub fn with_ignore_discovered_servers(mut self, ignore: bool) -> Self {
        self.ignore_discovered_servers = ignore;
        self
    }

    /// How events are laid out: the payload as the body with the metadata
    /// in headers ([`WireFormat::Headers`], the default), or the protobuf
    /// envelope as the body ([`WireFormat::Envelope`]; see
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

    /// The subject an event of `topic` is published to.
    pub fn subject_for(&self, topic: &str) -> String {
        if let Some(s) = self.subject_map.get(topic) {
            return s.clone();
        }
        match &self.subject_prefix {
            Some(p) if p.ends_with('.') => format!("{p}{topic}"),
            Some(p) => format!("{p}.{topic}"),
            None => topic.to_owned(),
        }
    }

    /// The configured server URLs, credentials redacted.
    pub fn servers_redacted(&self) -> Vec<String> {
        self.servers.iter().map(|s| redact_url(s)).collect()
    }

    pub(crate) async fn connect_options(&self) -> Result<async_nats::ConnectOptions, NatsError> {
        let mut o = match &self.auth {
            NatsAuth::None => async_nats::ConnectOptions::new(),
            NatsAuth::UserPassword { user, password } => {
                async_nats::ConnectOptions::with_user_and_password(user.clone(), password.clone())
            }
            NatsAuth::Token(t) => async_nats::ConnectOptions::with_token(t.clone()),
            NatsAuth::NKey(seed) => async_nats::ConnectOptions::with_nkey(seed.clone()),
            NatsAuth::CredentialsFile(path) => {
                async_nats::ConnectOptions::with_credentials_file(path.clone())
                    .await
                    .map_err(|e| {
                        NatsError::InvalidConfig(format!(
                            "cannot read NATS credentials file {}: {e}",
                            path.display()
                        ))
                    })?
            }
        };
        if self.tls.required {
            o = o.require_tls(true);
        }
        for ca in &self.tls.root_certificates {
            o = o.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.tls.client_certificate {
            o = o.add_client_certificate(cert.clone(), key.clone());
        }
        if let Some(name) = &self.client_name {
            o = o.name(name);
        }
        if self.ignore_discovered_servers {
            o = o.ignore_discovered_servers();
        }
        let policy = self.connect;
        o = o
            .connection_timeout(policy.timeout)
            // async-nats counts the attempt about to be made (1 = the
            // first, no delay before it).
            .reconnect_delay_callback(move |attempts| {
                policy.delay(u32::try_from(attempts.saturating_sub(1)).unwrap_or(u32::MAX))
            });
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_credentials_in_urls() {
        assert_eq!(redact_url("nats://u:secret@h:4222"), "nats://u:***@h:4222");
        assert_eq!(redact_url("nats://tok@h"), "nats://***@h");
        assert_eq!(redact_url("nats://h:4222"), "nats://h:4222");
        assert_eq!(redact_url("u:p@h"), "u:***@h");
    }

    #[test]
    fn debug_hides_secrets() {
        let c =
            NatsConfig::from_url("nats://alice:hunter2@127.0.0.1:4222, nats://tok3n@other:4222")
                .unwrap()
                .with_user_password("bob", "pa55word");
        let s = format!("{c:?}");
        assert!(
            !s.contains("hunter2") && !s.contains("tok3n") && !s.contains("pa55word"),
            "{s}"
        );
        assert!(s.contains("bob") && s.contains("other:4222"), "{s}");
        let t = format!("{:?}", c.clone().with_token("t0ken").with_nkey("SUSEED"));
        assert!(!t.contains("SUSEED"), "{t}");
        assert!(!format!("{:?}", c.with_token("t0ken")).contains("t0ken"));
    }

    #[test]
    fn parses_several_urls_and_rejects_bad_ones() {
        let c = NatsConfig::from_url("nats://a:4222,tls://b:4223").unwrap();
        assert_eq!(c.servers.len(), 2);
        assert!(matches!(
            NatsConfig::from_url(""),
            Err(NatsError::InvalidConfig(_))
        ));
        let e = NatsConfig::from_url("http://u:secret@x:1").unwrap_err();
        assert!(!e.to_string().contains("secret"), "{e}");
    }

    #[test]
    fn subject_mapping() {
        let c = NatsConfig::default();
        assert_eq!(c.subject_for("orders"), "orders");
        let c = c
            .with_subject_prefix("outbox")
            .with_subject_mapping("payments", "billing.payments");
        assert_eq!(c.subject_for("orders"), "outbox.orders");
        assert_eq!(c.subject_for("payments"), "billing.payments");
        assert_eq!(
            NatsConfig::default()
                .with_subject_prefix("x.")
                .subject_for("t"),
            "x.t"
        );
    }
}
