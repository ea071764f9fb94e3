//! The console's admin token, sessions and CSRF tokens.
//!
//! - Without an admin token the console is read-only: every `POST` is
//!   refused (`403`).
//! - With one, an operator logs in with the token and a name (recorded with
//!   every change). The console answers with a session cookie
//!   (`HttpOnly; SameSite=Strict; Path=/`): a random id, 244 bits of the
//!   OS random source, mapped in memory to the operator's name, a CSRF
//!   token of the same strength and an expiry. The token itself is never
//!   stored in the browser, and a console restart ends every session.
//! - Every `POST` other than the login needs a live session **and** the
//!   session's CSRF token in the form; a request the browser marks
//!   cross-site (`Sec-Fetch-Site: cross-site`, or an `Origin` other than
//!   the console's host) is refused before anything else.
//! - Tokens are compared in constant time; a wrong token is logged (not the
//!   value) and answered `401`.

use super::ConsoleError;
use anyhow::{bail, Context as _};
use axum::http::{header, HeaderMap, StatusCode};
use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The session cookie's name.
pub(crate) const COOKIE: &str = "outbox_console";
/// The shortest admin token accepted.
const MIN_TOKEN_LEN: usize = 16;
/// Most sessions kept at once (the oldest are dropped beyond it).
const MAX_SESSIONS: usize = 1024;

/// Reads the admin token from `file` (surrounding whitespace trimmed) or
/// from the environment variable `var`; `None` when neither is given.
pub(crate) fn load_token(file: Option<&Path>, var: Option<&str>) -> anyhow::Result<Option<String>> {
    let (token, origin) = match (file, var) {
        (Some(path), _) => {
            warn_if_readable_by_others(path);
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the admin token file {}", path.display()))?;
            (
                text.trim().to_owned(),
                format!("the admin token file {}", path.display()),
            )
        }
        (None, Some(var)) => match std::env::var(var) {
            Ok(v) => (
                v.trim().to_owned(),
                format!("the environment variable {var}"),
            ),
            Err(_) => bail!("--admin-token-env {var}: the environment variable {var} is not set"),
        },
        (None, None) => return Ok(None),
    };
    if token.chars().count() < MIN_TOKEN_LEN {
        bail!(
            "{origin} holds a token of fewer than {MIN_TOKEN_LEN} characters: use a long random one, e.g. `openssl rand -hex 32`"
        );
    }
    Ok(Some(token))
}

#[cfg(unix)]
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o004 != 0 {
            tracing::warn!(
                file = %path.display(),
                "the admin token file is readable by every user: chmod 600 it"
            );
        }
    }
}

#[cfg(not(unix))]
fn warn_if_readable_by_others(_: &Path) {}

/// A random 64-hex-digit secret (two v4 UUIDs: 244 random bits from the
/// OS random source).
fn secret() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Whether `a` and `b` are equal, in time independent of where they differ.
fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A logged-in operator.
#[derive(Clone)]
pub(crate) struct Session {
    /// The name given at login.
    pub(crate) who: String,
    /// The CSRF token every form of this session carries.
    pub(crate) csrf: String,
    expires: Instant,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("who", &self.who)
            .field("csrf", &"***")
            .finish_non_exhaustive()
    }
}

/// What the request's cookie says.
#[derive(Debug)]
pub(crate) enum SessionState {
    /// No session cookie.
    None,
    /// A cookie naming no live session (expired, logged out, or from
    /// before a restart).
    Stale,
    /// A live session.
    Live(Session),
}

/// Wrong tokens tolerated within [`FAILURE_WINDOW`]; beyond them every
/// login (even with the right token) waits until the window has room.
const MAX_FAILURES: usize = 10;

/// The window [`MAX_FAILURES`] counts in.
const FAILURE_WINDOW: Duration = Duration::from_secs(60);

/// The admin token and the live sessions.
pub(crate) struct Auth {
    token: String,
    ttl: Duration,
    sessions: Mutex<HashMap<String, Session>>,
    /// When the recent wrong tokens were given (at most [`MAX_FAILURES`]).
    failures: Mutex<std::collections::VecDeque<Instant>>,
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Auth")
            .field("token", &"***")
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl Auth {
    /// Sessions of `ttl` for holders of `token`.
    pub(crate) fn new(token: String, ttl: Duration) -> Self {
        Self {
            token,
            ttl,
            sessions: Mutex::new(HashMap::new()),
            failures: Mutex::new(std::collections::VecDeque::new()),
        }
    }

    /// Whether `given` is the admin token.
    pub(crate) fn check_token(&self, given: &str) -> bool {
        same(given.trim(), &self.token)
    }

    /// Checks `given` unless too many wrong tokens came lately: `Err`
    /// with how long to wait then (every guess is refused meanwhile, the
    /// right one too, so guessing is bounded at [`MAX_FAILURES`] a
    /// [`FAILURE_WINDOW`]); otherwise whether it is the token, a wrong
    /// one counted.
    pub(crate) fn try_token(&self, given: &str) -> Result<bool, Duration> {
        let mut failures = self
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        while failures
            .front()
            .is_some_and(|t| now.duration_since(*t) >= FAILURE_WINDOW)
        {
            failures.pop_front();
        }
        if failures.len() >= MAX_FAILURES {
            let oldest = failures.front().copied().unwrap_or(now);
            return Err(FAILURE_WINDOW.saturating_sub(now.duration_since(oldest)));
        }
        let ok = self.check_token(given);
        if !ok {
            failures.push_back(now);
        }
        Ok(ok)
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        // A panic while holding the lock cannot leave the map half-updated
        // (each update is one insert or remove): keep using it.
        self.sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new session for `who`: its cookie value and the session.
    pub(crate) fn login(&self, who: String) -> (String, Session) {
        let id = secret();
        let session = Session {
            who,
            csrf: secret(),
            expires: Instant::now() + self.ttl,
        };
        let mut sessions = self.sessions();
        let now = Instant::now();
        sessions.retain(|_, s| s.expires > now);
        if sessions.len() >= MAX_SESSIONS {
            if let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(k, _)| k.clone())
            {
                sessions.remove(&oldest);
            }
        }
        sessions.insert(id.clone(), session.clone());
        (id, session)
    }

    /// Ends the session of `headers`' cookie, if any.
    pub(crate) fn logout(&self, headers: &HeaderMap) {
        if let Some(id) = cookie(headers) {
            self.sessions().remove(&id);
        }
    }

    /// The session of `headers`' cookie.
    pub(crate) fn session(&self, headers: &HeaderMap) -> SessionState {
        let Some(id) = cookie(headers) else {
            return SessionState::None;
        };
        let mut sessions = self.sessions();
        match sessions.get(&id) {
            Some(s) if s.expires > Instant::now() => SessionState::Live(s.clone()),
            Some(_) => {
                sessions.remove(&id);
                SessionState::Stale
            }
            None => SessionState::Stale,
        }
    }

    /// The `Set-Cookie` value of session `id`.
    pub(crate) fn set_cookie(&self, id: &str) -> String {
        format!(
            "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}",
            self.ttl.as_secs()
        )
    }
}

/// The `Set-Cookie` value that deletes the session cookie.
pub(crate) fn clear_cookie() -> String {
    format!("{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0")
}

/// The session id of the request's `Cookie` header.
fn cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// Refuses a request the browser says comes from another site:
/// `Sec-Fetch-Site: cross-site` or `same-site`, or an `Origin` whose host
/// is not the request's `Host`.
pub(crate) fn same_origin(headers: &HeaderMap) -> Result<(), ConsoleError> {
    let refuse = || {
        ConsoleError::new(
            StatusCode::FORBIDDEN,
            "Cross-site request refused",
            "This request came from another site. Changes can only be made from the console's own pages.",
        )
    };
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
        if site != "same-origin" && site != "none" {
            return Err(refuse());
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let origin_host = origin
            .split_once("://")
            .map_or(origin, |(_, rest)| rest)
            .trim_end_matches('/');
        if origin == "null" || origin_host != host {
            return Err(refuse());
        }
    }
    Ok(())
}

/// The session allowed to make a change: the console has an admin token,
/// the request is same-origin, its cookie names a live session and `csrf`
/// (the form's field) is that session's token.
pub(crate) fn authorize(
    auth: Option<&Auth>,
    headers: &HeaderMap,
    csrf: Option<&str>,
) -> Result<Session, ConsoleError> {
    let Some(auth) = auth else {
        return Err(ConsoleError::read_only());
    };
    same_origin(headers)?;
    let session = match auth.session(headers) {
        SessionState::Live(s) => s,
        SessionState::None => {
            return Err(ConsoleError::new(
                StatusCode::UNAUTHORIZED,
                "Log in first",
                "Changes need the admin token: log in, then try again.",
            )
            .with_login())
        }
        SessionState::Stale => {
            return Err(ConsoleError::new(
                StatusCode::UNAUTHORIZED,
                "Session expired",
                "Your session expired or is no longer known (the console may have restarted): log in again, then repeat the change.",
            )
            .with_login())
        }
    };
    match csrf {
        Some(given) if same(given, &session.csrf) => Ok(session),
        _ => Err(ConsoleError::new(
            StatusCode::FORBIDDEN,
            "Form token mismatch",
            "The form's CSRF token does not belong to your session (a request from another page, or a form from an earlier session): reload the page and try again.",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with_cookie(id: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_str(&format!("other=1; {COOKIE}={id}")).unwrap(),
        );
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8089"));
        h
    }

    #[test]
    fn wrong_tokens_beyond_the_limit_lock_every_login_for_a_while() {
        let auth = Auth::new("0123456789abcdef".into(), Duration::from_secs(60));
        assert_eq!(auth.try_token("0123456789abcdef"), Ok(true));
        for _ in 0..MAX_FAILURES {
            assert_eq!(auth.try_token("guess"), Ok(false));
        }
        let wait = auth.try_token("0123456789abcdef").unwrap_err();
        assert!(
            wait > Duration::from_secs(50) && wait <= FAILURE_WINDOW,
            "{wait:?}"
        );
        // Once the window has passed, the token works again.
        let past = Instant::now().checked_sub(FAILURE_WINDOW).unwrap();
        auth.failures
            .lock()
            .unwrap()
            .iter_mut()
            .for_each(|t| *t = past);
        assert_eq!(auth.try_token("0123456789abcdef"), Ok(true));
    }

    #[test]
    fn sessions_need_the_cookie_and_the_csrf_token() {
        let auth = Auth::new("0123456789abcdef".into(), Duration::from_secs(60));
        assert!(auth.check_token(" 0123456789abcdef\n"));
        assert!(!auth.check_token("0123456789abcdeX"));
        assert!(!auth.check_token(""));
        let (id, s) = auth.login("alice".into());
        let h = with_cookie(&id);
        let ok = authorize(Some(&auth), &h, Some(&s.csrf)).unwrap();
        assert_eq!(ok.who, "alice");
        let e = authorize(Some(&auth), &h, Some("nope")).unwrap_err();
        assert_eq!(e.status, StatusCode::FORBIDDEN);
        let e = authorize(Some(&auth), &h, None).unwrap_err();
        assert_eq!(e.status, StatusCode::FORBIDDEN);
        let e = authorize(Some(&auth), &with_cookie("forged"), Some(&s.csrf)).unwrap_err();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        let e = authorize(None, &h, Some(&s.csrf)).unwrap_err();
        assert_eq!(e.status, StatusCode::FORBIDDEN);
        auth.logout(&h);
        let e = authorize(Some(&auth), &h, Some(&s.csrf)).unwrap_err();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
    }

    #[test]
    fn expired_sessions_are_refused() {
        let auth = Auth::new("0123456789abcdef".into(), Duration::ZERO);
        let (id, s) = auth.login("bob".into());
        let e = authorize(Some(&auth), &with_cookie(&id), Some(&s.csrf)).unwrap_err();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        assert!(e.title.contains("expired"), "{}", e.title);
    }

    #[test]
    fn cross_site_requests_are_refused() {
        let mut h = with_cookie("x");
        assert!(same_origin(&h).is_ok());
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:8089"),
        );
        assert!(same_origin(&h).is_ok());
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://evil.example"),
        );
        assert!(same_origin(&h).is_err());
        let mut h = with_cookie("x");
        h.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(same_origin(&h).is_err());
    }

    #[test]
    fn short_tokens_are_refused_and_debug_hides_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "short\n").unwrap();
        assert!(load_token(Some(&path), None).is_err());
        std::fs::write(&path, "  a-long-enough-admin-token \n").unwrap();
        assert_eq!(
            load_token(Some(&path), None).unwrap().as_deref(),
            Some("a-long-enough-admin-token")
        );
        assert_eq!(load_token(None, None).unwrap(), None);
        let auth = Auth::new("a-long-enough-admin-token".into(), Duration::from_secs(1));
        let (_, s) = auth.login("carol".into());
        assert!(!format!("{auth:?}{s:?}").contains("admin-token"));
        assert!(!format!("{s:?}").contains(&s.csrf));
    }
}
