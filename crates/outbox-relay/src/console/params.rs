//! Query strings and form bodies (`application/x-www-form-urlencoded`),
//! and the dead-letter selection they carry: the same filters as
//! `outbox-relay dead list` (type, code, key, older / newer than, ids),
//! checked here so a malformed one gets a `400` page naming it.

use super::error::ConsoleError;
use super::html::{enc, esc};
use axum::http::StatusCode;
use outbox_core::{DeadLetterFilter, EventId};
use std::time::Duration;

/// Most dead letters on one page.
pub(crate) const MAX_PAGE: u32 = 500;
/// Dead letters on one page unless `limit` says otherwise.
pub(crate) const DEFAULT_PAGE: u32 = 50;
/// Most ids one selection may name.
const MAX_IDS: usize = 1000;
/// Longest filter value.
const MAX_VALUE: usize = 500;

/// Decoded `name=value` pairs, in order.
#[derive(Debug, Default)]
pub(crate) struct Params(Vec<(String, String)>);

impl Params {
    /// Parses a query string or a form body.
    pub(crate) fn parse(raw: &[u8]) -> Self {
        Self(form_urlencoded::parse(raw).into_owned().collect())
    }

    /// The first value of `name`, trimmed; `None` when missing or empty.
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
    }

    /// Every non-empty value of `name`.
    pub(crate) fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
            .collect()
    }
}

fn bad(detail: String) -> ConsoleError {
    ConsoleError::new(StatusCode::BAD_REQUEST, "Invalid filter", detail)
}

/// A dead-letter selection: a group, the filters, and the page.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeadParams {
    /// The consumer group.
    pub(crate) group: String,
    /// `type`.
    pub(crate) event_type: Option<String>,
    /// `code`.
    pub(crate) code: Option<String>,
    /// `key`.
    pub(crate) key: Option<String>,
    /// `older_than` as typed, and parsed.
    pub(crate) older_than_text: Option<String>,
    older_than: Option<Duration>,
    /// `newer_than` as typed, and parsed.
    pub(crate) newer_than_text: Option<String>,
    newer_than: Option<Duration>,
    /// `id` (repeatable): only these.
    pub(crate) ids: Vec<EventId>,
    /// `after`: the page starts after this id.
    pub(crate) after: Option<EventId>,
    /// `limit`: rows per page.
    pub(crate) limit: u32,
}

fn value(p: &Params, name: &str, label: &str) -> Result<Option<String>, ConsoleError> {
    match p.get(name) {
        Some(v) if v.chars().count() > MAX_VALUE => Err(bad(format!(
            "the {label} filter is longer than {MAX_VALUE} characters"
        ))),
        Some(v) if v.chars().any(char::is_control) => {
            Err(bad(format!("the {label} filter holds a control character")))
        }
        v => Ok(v.map(str::to_owned)),
    }
}

fn age(
    p: &Params,
    name: &str,
    label: &str,
) -> Result<(Option<String>, Option<Duration>), ConsoleError> {
    match p.get(name) {
        None => Ok((None, None)),
        Some(text) => match crate::dead::parse_age(text) {
            Ok(d) => Ok((Some(text.to_owned()), Some(d))),
            Err(e) => Err(bad(format!("{label}: {e}"))),
        },
    }
}

fn event_id(text: &str, what: &str) -> Result<EventId, ConsoleError> {
    text.parse::<EventId>()
        .map_err(|_| bad(format!("{what} {text:?} is not an event id (a UUID)")))
}

impl DeadParams {
    /// The selection of `p`, in `default_group` unless `group` names one.
    pub(crate) fn parse(p: &Params, default_group: &str) -> Result<Self, ConsoleError> {
        let (older_than_text, older_than) = age(p, "older_than", "older than")?;
        let (newer_than_text, newer_than) = age(p, "newer_than", "newer than")?;
        let ids = p.all("id");
        if ids.len() > MAX_IDS {
            return Err(bad(format!(
                "{} ids selected: at most {MAX_IDS} at once (use a filter and \"all matching\" instead)",
                ids.len()
            )));
        }
        let ids = ids
            .into_iter()
            .map(|t| event_id(t, "id"))
            .collect::<Result<Vec<_>, _>>()?;
        let after = p.get("after").map(|t| event_id(t, "after")).transpose()?;
        let limit = match p.get("limit") {
            None => DEFAULT_PAGE,
            Some(t) => match t.parse::<u32>() {
                Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
                _ => {
                    return Err(bad(format!(
                        "limit {t:?}: use a number of rows from 1 to {MAX_PAGE}"
                    )))
                }
            },
        };
        let code = value(p, "code", "code")?;
        if let Some(c) = &code {
            if !c
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '.' || ch == '-')
            {
                return Err(bad(format!(
                    "code {c:?}: error codes are letters, digits and _ (e.g. HANDLER_PERMANENT_FAILURE)"
                )));
            }
        }
        Ok(Self {
            group: value(p, "group", "group")?.unwrap_or_else(|| default_group.to_owned()),
            event_type: value(p, "type", "type")?,
            code,
            key: value(p, "key", "key")?,
            older_than_text,
            older_than,
            newer_than_text,
            newer_than,
            ids,
            after,
            limit,
        })
    }

    /// The store's filter (every criterion set must hold).
    pub(crate) fn filter(&self) -> DeadLetterFilter {
        crate::dead::dead_filter(
            &self.ids,
            self.event_type.as_deref(),
            self.code.as_deref(),
            self.key.as_deref(),
            self.older_than,
            self.newer_than,
        )
    }

    /// Whether no filter (and no id) is set.
    pub(crate) fn filter_is_empty(&self) -> bool {
        self.filter().is_all()
    }

    /// The filters in words, for pages and the audit log.
    pub(crate) fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(t) = &self.event_type {
            parts.push(format!("type {t}"));
        }
        if let Some(c) = &self.code {
            parts.push(format!("code {c}"));
        }
        if let Some(k) = &self.key {
            parts.push(format!("key {k}"));
        }
        if let Some(o) = &self.older_than_text {
            parts.push(format!("dead for at least {o}"));
        }
        if let Some(n) = &self.newer_than_text {
            parts.push(format!("dead for less than {n}"));
        }
        match self.ids.len() {
            0 => {}
            1 => parts.push(format!("event {}", self.ids[0])),
            n => parts.push(format!("{n} selected events")),
        }
        if parts.is_empty() {
            "no filter".to_owned()
        } else {
            parts.join(", ")
        }
    }

    fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut out = vec![("group", self.group.clone())];
        let mut push = |k: &'static str, v: &Option<String>| {
            if let Some(v) = v {
                out.push((k, v.clone()));
            }
        };
        push("type", &self.event_type);
        push("code", &self.code);
        push("key", &self.key);
        push("older_than", &self.older_than_text);
        push("newer_than", &self.newer_than_text);
        out
    }

    /// The filters as a query string (no ids), starting after `after`.
    pub(crate) fn query(&self, after: Option<EventId>) -> String {
        let mut pairs = self.pairs();
        if let Some(a) = after {
            pairs.push(("after", a.to_string()));
        }
        if self.limit != DEFAULT_PAGE {
            pairs.push(("limit", self.limit.to_string()));
        }
        pairs
            .iter()
            .map(|(k, v)| format!("{k}={}", enc(v)))
            .collect::<Vec<_>>()
            .join("&")
    }

    /// The filters and ids as hidden form fields.
    pub(crate) fn hidden_fields(&self) -> String {
        let mut out: String = self
            .pairs()
            .iter()
            .map(|(k, v)| format!(r#"<input type="hidden" name="{k}" value="{}">"#, esc(v)))
            .collect();
        for id in &self.ids {
            out.push_str(&format!(
                r#"<input type="hidden" name="id" value="{}">"#,
                esc(&id.to_string())
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_round_trip_and_bad_ones_are_named() {
        let id = EventId::new();
        let raw = format!(
            "group=g1&type=order.created&code=HANDLER_NOT_REGISTERED&key=k+1&older_than=1h&id={id}&limit=20"
        );
        let d = DeadParams::parse(&Params::parse(raw.as_bytes()), "default").unwrap();
        assert_eq!(d.group, "g1");
        assert_eq!(d.key.as_deref(), Some("k 1"));
        assert_eq!(d.ids, vec![id]);
        assert_eq!(d.limit, 20);
        let f = d.filter();
        assert_eq!(f.older_than, Some(Duration::from_secs(3600)));
        assert_eq!(f.ids, Some(vec![id]));
        let again = DeadParams::parse(&Params::parse(d.query(None).as_bytes()), "x").unwrap();
        assert_eq!(again.filter().with_ids([id]), f);
        assert!(d.describe().contains("key k 1"));

        let empty = DeadParams::parse(&Params::parse(b""), "default").unwrap();
        assert!(empty.filter_is_empty());
        assert_eq!(empty.group, "default");

        for (raw, needle) in [
            ("older_than=yesterday", "invalid age"),
            ("newer_than=5", "invalid age"),
            ("after=nope", "not an event id"),
            ("id=1234", "not an event id"),
            ("limit=0", "limit"),
            ("limit=100000", "limit"),
            ("code=a%20b", "error codes"),
            ("key=a%00b", "control character"),
        ] {
            let e = DeadParams::parse(&Params::parse(raw.as_bytes()), "default").unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{raw}");
            assert!(e.detail.contains(needle), "{raw}: {}", e.detail);
        }
    }
}
