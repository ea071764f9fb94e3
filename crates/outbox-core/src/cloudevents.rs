//! CloudEvents 1.0: how an outbox event maps to a CloudEvent, the two
//! content modes ([`WireFormat::CloudEvents`](crate::WireFormat::CloudEvents),
//! binary; [`WireFormat::CloudEventsJson`](crate::WireFormat::CloudEventsJson),
//! structured), the per-broker header names ([`Binding`]) and the validated
//! `source` attribute ([`Source`]).
//!
//! | CloudEvents attribute | from the event |
//! |---|---|
//! | `specversion` | `1.0` |
//! | `id` | the event id (the deduplication id) |
//! | `source` | the configured [`Source`] (required) |
//! | `type` | the event type |
//! | `time` | when the event was enqueued ([`crate::Event::created_at`], the database clock) |
//! | `subject` | the event key (absent for a keyless event) |
//! | `partitionkey` | the event key (the Partitioning extension; absent for a keyless event) |
//! | `datacontenttype` | the payload's content type (the event's `content-type` header, else the publisher's default) |
//! | `traceparent`, `tracestate` | the event's trace context headers (the Distributed Tracing extension) |
//! | any other extension | each event header whose name is a valid attribute name (lower-case ASCII letters and digits) and not one of the names above |
//!
//! An event header whose name is not a valid attribute name (`X-Tenant`,
//! `trace-id`) travels as a plain broker header beside the attributes, in
//! both modes, and a consumer reads it back as a header.
//!
//! [`BrokerMessage`](crate::BrokerMessage) lays the attributes out;
//! [`InboundMessage::decode`](crate::InboundMessage::decode) reads both
//! modes back (and CloudEvents from other producers whose `id` is a UUID).

use crate::event::{Event, EventId};
use crate::headers;
use crate::wire::{DecodeError, InboundMessage, WireFormat};
use base64::Engine as _;
use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// The CloudEvents specification version every message states.
pub const SPEC_VERSION: &str = "1.0";
/// The media type of the JSON event format (structured mode).
pub const JSON_FORMAT: &str = "application/cloudevents+json";
/// The content type of a structured-mode message (the broker's content
/// type: the `content-type` header on Kafka and NATS, the `content_type`
/// property on AMQP).
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=UTF-8";

/// The context attributes this mapping sets itself (and `data`): an event
/// header of one of these names is never an extension attribute, it travels
/// as a plain broker header.
pub const CONTEXT_ATTRIBUTES: [&str; 11] = [
    "specversion",
    "id",
    "source",
    "type",
    "time",
    "subject",
    "datacontenttype",
    "dataschema",
    "partitionkey",
    "data",
    "data_base64",
];

/// Which broker's binary-mode header names a message uses: the prefix of
/// each attribute's header, and where `datacontenttype` goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Binding {
    /// Kafka: `ce_` headers, `datacontenttype` as the `content-type` header
    /// (CloudEvents Kafka protocol binding 1.0).
    #[default]
    Kafka,
    /// NATS: `ce-` headers, `datacontenttype` as the `content-type` header
    /// (the NATS binding's binary mode, as the Go and Java SDKs send it).
    Nats,
    /// AMQP (RabbitMQ, AMQP 0.9.1): `cloudEvents:` header-table entries,
    /// the names the AMQP 1.0 binding gives its application properties
    /// (which RabbitMQ maps to and from its 0.9.1 headers), and
    /// `datacontenttype` as the `content_type` property only.
    Amqp,
}

impl Binding {
    /// The prefix of an attribute's header name in binary mode.
    pub fn prefix(self) -> &'static str {
        match self {
            Self::Kafka => "ce_",
            Self::Nats => "ce-",
            Self::Amqp => "cloudEvents:",
        }
    }

    /// Whether the content type travels as a `content-type` header (Kafka,
    /// NATS) rather than only as a message property (AMQP).
    pub fn content_type_header(self) -> bool {
        !matches!(self, Self::Amqp)
    }
}

/// The prefixes [`InboundMessage::decode`] reads as attribute headers, on
/// any broker (compared without regard to letter case): `ce_` (Kafka),
/// `ce-` (NATS, HTTP), `cloudEvents:` and `cloudEvents_` (AMQP).
pub const ATTRIBUTE_PREFIXES: [&str; 4] = ["ce_", "ce-", "cloudEvents:", "cloudEvents_"];

/// The attribute a binary-mode header names, lower-cased, if it has one of
/// the [`ATTRIBUTE_PREFIXES`].
pub fn attribute_of_header(name: &str) -> Option<String> {
    ATTRIBUTE_PREFIXES.iter().find_map(|p| {
        let head = name.get(..p.len())?;
        let rest = &name[p.len()..];
        (head.eq_ignore_ascii_case(p) && !rest.is_empty()).then(|| rest.to_ascii_lowercase())
    })
}

/// Whether `name` is a valid CloudEvents attribute name: one or more
/// lower-case ASCII letters and digits.
pub fn is_attribute_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Whether the event header `name` travels as an extension attribute: a
/// valid attribute name that is none of [`CONTEXT_ATTRIBUTES`].
pub fn is_extension(name: &str) -> bool {
    is_attribute_name(name) && !CONTEXT_ATTRIBUTES.contains(&name)
}

/// Whether a media type is JSON (`application/json`, `text/json`, any
/// `+json` suffix; parameters ignored): the structured mode then embeds
/// the payload as JSON (`data`) instead of `data_base64`.
pub fn is_json_content_type(content_type: &str) -> bool {
    let media = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    media == "application/json" || media == "text/json" || media.ends_with("+json")
}

/// The CloudEvents `source` attribute: a non-empty URI-reference (RFC 3986),
/// such as `/orders`, `urn:example:orders` or `https://example.com/orders`.
/// Required by the CloudEvents wire formats; validated when built.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Source(String);

/// A `source` that is not a non-empty URI-reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid CloudEvents source {value:?}: {reason}")]
pub struct InvalidSource {
    /// The text given.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl Source {
    /// Validates `source` as a non-empty URI-reference.
    pub fn new(source: impl Into<String>) -> Result<Self, InvalidSource> {
        let value = source.into();
        match check_uri_reference(&value) {
            Ok(()) => Ok(Self(value)),
            Err(reason) => Err(InvalidSource { value, reason }),
        }
    }

    /// The source's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Source {
    type Err = InvalidSource;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Source({:?})", self.0)
    }
}

/// A CloudEvents wire format was chosen without a [`Source`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("wire format {0} needs a CloudEvents source (the `source` attribute, a URI-reference such as /orders or https://example.com/orders), and none is set")]
pub struct MissingSource(pub WireFormat);

/// Checks that a publisher configured with `format` has the [`Source`] a
/// CloudEvents format requires.
pub fn require_source(format: WireFormat, source: Option<&Source>) -> Result<(), MissingSource> {
    if format.is_cloudevents() && source.is_none() {
        return Err(MissingSource(format));
    }
    Ok(())
}

/// RFC 3986 `URI-reference`, checked for what a configuration mistake looks
/// like: only URI characters, well-formed percent-escapes, a valid scheme
/// when there is one, one fragment, brackets only around an IP literal.
fn check_uri_reference(s: &str) -> Result<(), &'static str> {
    if s.is_empty() {
        return Err(
            "it is empty (a source is a URI-reference, e.g. /orders or https://example.com/orders)",
        );
    }
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' {
            let hex = |j: usize| b.get(j).is_some_and(u8::is_ascii_hexdigit);
            if !(hex(i + 1) && hex(i + 2)) {
                return Err("a '%' is not followed by two hex digits");
            }
            i += 3;
            continue;
        }
        let ok = c.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&'()*+,;=".contains(&c);
        if !ok {
            return Err("it holds a character a URI may not (space, quote, <, >, \\, ^, `, {, |, } or non-ASCII): percent-encode it");
        }
        i += 1;
    }
    if s.matches('#').count() > 1 {
        return Err("it has more than one '#'");
    }
    let first_end = s.find(['/', '?', '#']).unwrap_or(s.len());
    let mut rest = s;
    if let Some(colon) = s[..first_end].find(':') {
        let scheme = &s[..colon];
        let valid = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
        if !valid {
            return Err("the part before the first ':' is not a URI scheme (a relative reference whose first segment holds a ':' needs a leading ./)");
        }
        rest = &s[colon + 1..];
    }
    // Brackets only around the host of an authority (an IPv6 literal).
    let (authority, path) = match rest.strip_prefix("//") {
        Some(after) => after.split_at(after.find(['/', '?', '#']).unwrap_or(after.len())),
        None => ("", rest),
    };
    if path.contains(['[', ']']) {
        return Err("'[' and ']' may only enclose an IP literal host");
    }
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if authority.contains(['[', ']']) && !(host.starts_with('[') && host.contains(']')) {
        return Err("'[' and ']' may only enclose an IP literal host");
    }
    Ok(())
}

/// The attributes of one event, text-valued, in the order they are sent:
/// `specversion`, `id`, `source`, `type`, `time`, then `subject` and
/// `partitionkey` for a keyed event, then the extensions.
/// (`datacontenttype` goes apart: a header or property in binary mode.)
pub(crate) fn attributes<'a>(
    id: &'a str,
    source: Option<&'a Source>,
    event: &'a Event,
    time: &'a str,
) -> Vec<(&'a str, &'a str)> {
    let mut out = vec![("specversion", SPEC_VERSION), ("id", id)];
    if let Some(s) = source {
        out.push(("source", s.as_str()));
    }
    out.push(("type", event.event_type.as_str()));
    out.push(("time", time));
    if let Some(key) = event.key.as_deref() {
        out.push(("subject", key));
        out.push(("partitionkey", key));
    }
    out.extend(
        event
            .headers
            .iter()
            .filter(|(k, _)| is_extension(k))
            .map(|(k, v)| (k.as_str(), v.as_str())),
    );
    out
}

/// The `time` attribute's text: RFC 3339 in UTC, sub-second digits as
/// the clock gave them.
pub(crate) fn time_text(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::AutoSi, true)
}

/// The event's own headers that travel as plain broker headers: not
/// reserved, not the content type, not an extension attribute.
pub(crate) fn plain_headers(event: &Event) -> impl Iterator<Item = (&str, &str)> {
    event
        .headers
        .iter()
        .filter(|(k, _)| !headers::is_reserved(k) && !is_extension(k))
        .map(|(k, v)| (k.as_str(), v.as_str()))
}

/// The JSON event format of `attributes` and the payload: `data` holds the
/// payload's own JSON text, byte for byte, when its content type is JSON
/// and it is one JSON value without surrounding whitespace; otherwise
/// `data_base64` holds it.
pub(crate) fn structured_body(
    attributes: &[(&str, &str)],
    content_type: &str,
    payload: &[u8],
) -> Vec<u8> {
    let string = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
    let mut out = String::with_capacity(payload.len() * 4 / 3 + 256);
    out.push('{');
    for (name, value) in attributes {
        out.push_str(&string(name));
        out.push(':');
        out.push_str(&string(value));
        out.push(',');
    }
    out.push_str("\"datacontenttype\":");
    out.push_str(&string(content_type));
    match embeddable_json(content_type, payload) {
        Some(json) => {
            out.push_str(",\"data\":");
            out.push_str(json);
        }
        None => {
            out.push_str(",\"data_base64\":\"");
            base64::engine::general_purpose::STANDARD.encode_string(payload, &mut out);
            out.push('"');
        }
    }
    out.push('}');
    out.into_bytes()
}

/// The payload as JSON text to embed as `data`, when that keeps its bytes.
fn embeddable_json<'p>(content_type: &str, payload: &'p [u8]) -> Option<&'p str> {
    if !is_json_content_type(content_type) {
        return None;
    }
    let (first, last) = (payload.first()?, payload.last()?);
    if first.is_ascii_whitespace() || last.is_ascii_whitespace() {
        return None;
    }
    let text = std::str::from_utf8(payload).ok()?;
    serde_json::from_str::<&RawValue>(text).ok()?;
    Some(text)
}

/// The attributes read from a message, before they are checked.
#[derive(Default)]
pub(crate) struct Attributes {
    specversion: Option<String>,
    id: Option<String>,
    source: Option<String>,
    event_type: Option<String>,
    time: Option<String>,
    subject: Option<String>,
    partitionkey: Option<String>,
    datacontenttype: Option<String>,
    /// Extensions (and `dataschema`), by attribute name.
    extensions: BTreeMap<String, String>,
}

impl Attributes {
    /// Records attribute `name` (lower case) = `value`.
    pub(crate) fn set(&mut self, name: &str, value: String) {
        let slot = match name {
            "specversion" => &mut self.specversion,
            "id" => &mut self.id,
            "source" => &mut self.source,
            "type" => &mut self.event_type,
            "time" => &mut self.time,
            "subject" => &mut self.subject,
            "partitionkey" => &mut self.partitionkey,
            "datacontenttype" => &mut self.datacontenttype,
            "data" | "data_base64" => return,
            other => {
                self.extensions.insert(other.to_owned(), value);
                return;
            }
        };
        *slot = Some(value);
    }

    /// The inbound message, once the required attributes are there and
    /// valid: `payload` is the data, `content_type` the broker's (binary
    /// mode) or `None`, `plain` the plain broker headers.
    pub(crate) fn into_inbound(
        self,
        payload: Vec<u8>,
        content_type: Option<String>,
        destination: &str,
        broker_time: Option<DateTime<Utc>>,
        plain: BTreeMap<String, String>,
        format: WireFormat,
    ) -> Result<InboundMessage, DecodeError> {
        let present = |v: Option<String>, name: &'static str| {
            v.filter(|s| !s.is_empty())
                .ok_or(DecodeError::MissingAttribute(name))
        };
        let specversion = present(self.specversion, "specversion")?;
        if specversion.trim() != SPEC_VERSION {
            return Err(DecodeError::InvalidAttribute {
                name: "specversion",
                reason: format!("{specversion:?} is not {SPEC_VERSION}"),
            });
        }
        let id_text = present(self.id, "id")?;
        let id = id_text
            .trim()
            .parse::<EventId>()
            .map_err(|_| DecodeError::InvalidEventId(id_text.clone()))?;
        present(self.source, "source")?;
        let event_type = present(self.event_type, "type")?;
        let created_at = match self.time {
            Some(t) => Some(
                DateTime::parse_from_rfc3339(t.trim())
                    .map_err(|e| DecodeError::InvalidAttribute {
                        name: "time",
                        reason: format!("{t:?} is not an RFC 3339 timestamp: {e}"),
                    })?
                    .with_timezone(&Utc),
            ),
            None => broker_time,
        };
        let mut headers = plain;
        headers.extend(self.extensions);
        let content_type = content_type
            .or(self.datacontenttype)
            .unwrap_or_else(|| match format {
                // The JSON event format: no datacontenttype means JSON.
                WireFormat::CloudEventsJson => "application/json".to_owned(),
                _ => headers::DEFAULT_CONTENT_TYPE.to_owned(),
            });
        Ok(InboundMessage {
            id,
            key: self.partitionkey.or(self.subject).filter(|k| !k.is_empty()),
            event_type,
            topic: destination.to_owned(),
            content_type,
            payload,
            headers,
            created_at,
            attempt: None,
            format,
        })
    }
}

/// Reads a structured-mode body (the JSON event format).
pub(crate) fn decode_structured(
    body: &[u8],
    destination: &str,
    broker_time: Option<DateTime<Utc>>,
    plain: BTreeMap<String, String>,
) -> Result<InboundMessage, DecodeError> {
    let members: BTreeMap<String, &RawValue> = serde_json::from_slice(body).map_err(|e| {
        DecodeError::InvalidCloudEvent(format!("the body is not a JSON event object: {e}"))
    })?;
    let mut attrs = Attributes::default();
    let mut data = None;
    let mut data_base64 = None;
    for (name, raw) in &members {
        let value = raw.get();
        match name.as_str() {
            "data" => data = Some(*raw),
            "data_base64" => data_base64 = Some(*raw),
            _ if value == "null" => {}
            _ => {
                let text = match serde_json::from_str::<String>(value) {
                    Ok(s) => s,
                    // Extension values may be integers or booleans.
                    Err(_) if !value.starts_with(['{', '[']) && is_extension(name) => {
                        value.to_owned()
                    }
                    Err(_) => {
                        return Err(DecodeError::InvalidCloudEvent(format!(
                            "the attribute {name:?} is not a string"
                        )))
                    }
                };
                attrs.set(name, text);
            }
        }
    }
    let json_data = attrs
        .datacontenttype
        .as_deref()
        .is_none_or(is_json_content_type);
    let payload = match (data, data_base64) {
        (Some(_), Some(_)) => {
            return Err(DecodeError::InvalidCloudEvent(
                "the event has both data and data_base64".into(),
            ))
        }
        (None, Some(b64)) => {
            let text: String = serde_json::from_str(b64.get()).map_err(|_| {
                DecodeError::InvalidCloudEvent("data_base64 is not a string".into())
            })?;
            base64::engine::general_purpose::STANDARD
                .decode(text.trim())
                .map_err(|e| {
                    DecodeError::InvalidCloudEvent(format!("data_base64 is not base64: {e}"))
                })?
        }
        // JSON data is its text; other data given as a JSON string is
        // that string's bytes.
        (Some(raw), None) if !json_data => match serde_json::from_str::<String>(raw.get()) {
            Ok(s) => s.into_bytes(),
            Err(_) => raw.get().as_bytes().to_vec(),
        },
        (Some(raw), None) => raw.get().as_bytes().to_vec(),
        (None, None) => Vec::new(),
    };
    attrs.into_inbound(
        payload,
        None,
        destination,
        broker_time,
        plain,
        WireFormat::CloudEventsJson,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_uri_references() {
        for ok in [
            "/orders",
            "orders",
            "./a:b",
            "urn:example:orders",
            "https://example.com/orders?x=1#f",
            "https://user@[::1]:8080/orders",
            "mailto:a@example.com",
            "/caf%C3%A9",
        ] {
            assert!(Source::new(ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("", "empty"),
            ("has space", "character"),
            ("/caf\u{e9}", "character"),
            ("%zz", "hex"),
            ("1http://x", "scheme"),
            ("a:b/c", ""),
            ("/a#b#c", "'#'"),
            ("/a[1]", "IP literal"),
        ] {
            if bad == "a:b/c" {
                // "a" is a valid scheme: a URI, not a mistake.
                assert!(Source::new(bad).is_ok());
                continue;
            }
            let err = Source::new(bad).unwrap_err();
            assert!(err.reason.contains(why), "{bad:?}: {err}");
            assert!(err.to_string().contains("CloudEvents source"), "{err}");
        }
    }

    #[test]
    fn attribute_names_and_prefixes() {
        assert!(is_attribute_name("traceparent"));
        assert!(is_attribute_name("x1"));
        assert!(!is_attribute_name("trace-id"));
        assert!(!is_attribute_name("Tenant"));
        assert!(!is_attribute_name(""));
        assert!(is_extension("tenant"));
        assert!(!is_extension("subject"));
        assert_eq!(attribute_of_header("ce_id").as_deref(), Some("id"));
        assert_eq!(attribute_of_header("CE-Type").as_deref(), Some("type"));
        assert_eq!(
            attribute_of_header("cloudEvents:source").as_deref(),
            Some("source")
        );
        assert_eq!(
            attribute_of_header("cloudevents_time").as_deref(),
            Some("time")
        );
        assert_eq!(attribute_of_header("ce_"), None);
        assert_eq!(attribute_of_header("content-type"), None);
        assert!(is_json_content_type("application/json; charset=utf-8"));
        assert!(is_json_content_type("application/vnd.x+json"));
        assert!(!is_json_content_type("text/plain"));
    }

    #[test]
    fn structured_body_keeps_json_bytes_and_base64s_the_rest() {
        let attrs = [("specversion", "1.0"), ("id", "x\"y")];
        let body = structured_body(&attrs, "application/json", b"{\"a\": [1, 2]}");
        let text = String::from_utf8(body).unwrap();
        assert!(text.contains("\"data\":{\"a\": [1, 2]}"), "{text}");
        assert!(text.contains("\"id\":\"x\\\"y\""), "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["datacontenttype"], "application/json");
        // Not JSON after all, or surrounded by whitespace: base64.
        for payload in [&b"{nope"[..], b" {} ", b"", b"\xff\x00"] {
            let v: serde_json::Value =
                serde_json::from_slice(&structured_body(&attrs, "application/json", payload))
                    .unwrap();
            assert!(v.get("data").is_none());
            let b64 = v["data_base64"].as_str().unwrap();
            assert_eq!(
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .unwrap(),
                payload
            );
        }
    }
}
