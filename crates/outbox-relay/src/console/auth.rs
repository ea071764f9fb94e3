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
//! - With one, **every page** needs the session too (the pages show
//!   dead-letter payloads and headers): a `GET` without one is redirected
//!   to the login (`303`, `next` naming the page), any other request is
//!   answered `401`; only the login page and the assets are open.
//! - Every `POST` other than the login needs a live session **and** the
//!   session's CSRF token in the form; a request the browser marks
//!   cross-site (`Sec-Fetch-Site: cross-site`, or an `Origin` other than
//!   the console's host, or one the console does not answer to) is
//!   refused before anything else.
//! - Whatever the token, a request whose `Host` the console does not
//!   answer to ([`Hosts`]: its listen address, `localhost` on loopback,
//!   `--allowed-host` names) is refused (`421`) before anything else: a
//!   web page whose own name was re-pointed at the console (DNS
//!   rebinding) reads nothing and posts nothing.
//! - Tokens are compared in constant time; a wrong token is logged (not the
//!   value) and answered `401`. Wrong tokens are throttled per client
//!   ([`Auth::try_token`]): after [`FREE_FAILURES`] a client waits, the
//!   wait doubling up to [`MAX_BACKOFF`]; other clients, and the right
//!   token from them, are never refused for it.

use super::error::ConsoleError;
use anyhow::{bail, Context as _};
use axum::http::{header, HeaderMap, StatusCode};
use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
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

/// Wrong tokens a client may give before it has to wait.
pub(crate) const FREE_FAILURES: u32 = 5;

/// The wait after the [`FREE_FAILURES`]th wrong token of a client,
/// doubled with each further one...
const FIRST_BACKOFF: Duration = Duration::from_secs(1);

/// ...up to this.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// A client's wrong tokens are forgotten this long after its last one
/// (and at once when it gives the right one).
const FORGET_AFTER: Duration = Duration::from_secs(900);

/// Most clients whose wrong tokens are remembered (beyond it, the one
/// that failed longest ago is forgotten).
const MAX_CLIENTS: usize = 4096;

/// A client's recent wrong tokens.
#[derive(Debug, Clone, Copy)]
struct Failures {
    /// Wrong tokens since its last right one (or since it was forgotten).
    count: u32,
    /// When the last one came.
    last: Instant,
    /// Before this, its logins are refused unchecked.
    wait_until: Instant,
}

/// The wait after a client's `count`th wrong token in a row.
fn backoff(count: u32) -> Option<Duration> {
    let beyond = count.checked_sub(FREE_FAILURES)?;
    let factor = 1u32.checked_shl(beyond.min(20)).unwrap_or(u32::MAX);
    Some(FIRST_BACKOFF.saturating_mul(factor).min(MAX_BACKOFF))
}

/// Whom the throttle counts: the peer's IPv4 address, or its IPv6
/// address's /64 (one host commonly holds a whole /64: counting addresses
/// would give it 2^64 budgets); an IPv4-mapped IPv6 address as its IPv4.
fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// What [`Auth::try_token`] made of a login.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// The admin token: the client's failures are forgotten.
    Right,
    /// A wrong token, counted; `Some`: the client must now wait this long.
    Wrong(Option<Duration>),
    /// Not checked: this client gave too many wrong tokens and waits for
    /// this long still.
    Wait(Duration),
}

/// The admin token and the live sessions.
pub(crate) struct Auth {
    token: String,
    ttl: Duration,
    sessions: Mutex<HashMap<String, Session>>,
    /// The recent wrong tokens of each client ([`client_key`]).
    failures: Mutex<HashMap<IpAddr, Failures>>,
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
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `given` is the admin token.
    pub(crate) fn check_token(&self, given: &str) -> bool {
        same(given.trim(), &self.token)
    }

    /// Checks `given`, a login from `client`, unless that client is
    /// waiting after too many wrong tokens ([`Attempt::Wait`]: not even
    /// the right token is checked then, so a client's guesses are bounded
    /// by its backoff). Throttling is per client: another client's
    /// failures never refuse a login, the right token from anyone not
    /// waiting is always taken.
    pub(crate) fn try_token(&self, client: IpAddr, given: &str) -> Attempt {
        self.try_token_at(client, given, Instant::now())
    }

    fn try_token_at(&self, client: IpAddr, given: &str, now: Instant) -> Attempt {
        let key = client_key(client);
        let mut failures = self
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let known = failures
            .get(&key)
            .copied()
            .filter(|f| now.saturating_duration_since(f.last) < FORGET_AFTER);
        if let Some(f) = known {
            if f.wait_until > now {
                return Attempt::Wait(f.wait_until - now);
            }
        }
        if self.check_token(given) {
            failures.remove(&key);
            return Attempt::Right;
        }
        let count = known.map_or(0, |f| f.count).saturating_add(1);
        let wait = backoff(count);
        if failures.len() >= MAX_CLIENTS && !failures.contains_key(&key) {
            failures.retain(|_, f| now.saturating_duration_since(f.last) < FORGET_AFTER);
            if failures.len() >= MAX_CLIENTS {
                if let Some(oldest) = failures.iter().min_by_key(|(_, f)| f.last).map(|(k, _)| *k) {
                    failures.remove(&oldest);
                }
            }
        }
        failures.insert(
            key,
            Failures {
                count,
                last: now,
                wait_until: now + wait.unwrap_or_default(),
            },
        );
        Attempt::Wrong(wait)
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

/// The host names the console answers to: a request naming another in
/// its `Host` is refused, so a web page whose own name was re-pointed at
/// the console's address (DNS rebinding) reaches nothing. The port is not
/// compared: rebinding keeps the attacker's name, not the port, and an
/// SSH tunnel or a proxy changes the port but names the console.
#[derive(Debug, Clone)]
pub(crate) struct Hosts {
    /// The address the console listens on.
    bound: IpAddr,
    /// `--allowed-host` names, lowercase, each with its port if given.
    names: Vec<(String, Option<u16>)>,
}

impl Hosts {
    /// The names of a console listening on `bound`, and `allowed` (each
    /// `NAME` or `NAME:PORT`): an `Err` names a malformed one.
    pub(crate) fn new(bound: IpAddr, allowed: &[String]) -> anyhow::Result<Self> {
        let names = allowed
            .iter()
            .map(|a| {
                split_host(a).ok_or_else(|| {
                    anyhow::anyhow!(
                        "allowed host {a:?} is not a host name (NAME or NAME:PORT, e.g. console.example.com)"
                    )
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self { bound, names })
    }

    /// Whether `authority` (a `Host` value, or an `Origin`'s host and
    /// port) names this console: a `--allowed-host` name; the listen
    /// address (any address when it listens on all of them: an address
    /// typed in the browser cannot be re-pointed); a loopback address or
    /// `localhost` when it listens on loopback.
    pub(crate) fn allows(&self, authority: &str) -> bool {
        let Some((name, port)) = split_host(authority) else {
            return false;
        };
        if self
            .names
            .iter()
            .any(|(n, p)| *n == name && p.is_none_or(|p| Some(p) == port))
        {
            return true;
        }
        let local = self.bound.is_loopback() || self.bound.is_unspecified();
        match name.parse::<IpAddr>() {
            Ok(ip) => {
                self.bound.is_unspecified()
                    || ip == self.bound
                    || (self.bound.is_loopback() && ip.is_loopback())
            }
            Err(_) => local && name == "localhost",
        }
    }

    /// The names it answers to, for a message.
    pub(crate) fn describe(&self) -> String {
        let mut names = Vec::new();
        if self.bound.is_unspecified() {
            names.push("any IP address".to_owned());
        } else if self.bound.is_loopback() {
            names.push("loopback addresses".to_owned());
        } else {
            names.push(self.bound.to_string());
        }
        if self.bound.is_loopback() || self.bound.is_unspecified() {
            names.push("localhost".to_owned());
        }
        names.extend(self.names.iter().map(|(n, p)| match p {
            Some(p) => format!("{n}:{p}"),
            None => n.clone(),
        }));
        names.join(", ")
    }
}

/// `authority` (`name`, `name:port`, `[v6]`, `[v6]:port`) as its host,
/// lowercase and without a trailing dot (IPv6 without brackets), and port;
/// `None` when malformed or empty.
fn split_host(authority: &str) -> Option<(String, Option<u16>)> {
    let a = authority.trim();
    let (host, port) = if let Some(rest) = a.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        v6.parse::<Ipv6Addr>().ok()?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?),
        };
        (v6, port)
    } else {
        match a.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (a, None),
        }
    };
    let port = port.map(str::parse::<u16>).transpose().ok()?;
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let valid = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | ':' | '_'));
    valid.then_some((host, port))
}

/// Refuses a request the browser says comes from another site:
/// `Sec-Fetch-Site: cross-site` or `same-site`, or an `Origin` that is
/// not the request's `Host`, or names a host the console does not answer
/// to (`hosts`), or is not `http`/`https`.
pub(crate) fn same_origin(headers: &HeaderMap, hosts: &Hosts) -> Result<(), ConsoleError> {
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
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().map_err(|_| refuse())?;
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let Some(("http" | "https", rest)) = origin.split_once("://") else {
            return Err(refuse());
        };
        let origin_host = rest.trim_end_matches('/');
        if !origin_host.eq_ignore_ascii_case(host) || !hosts.allows(origin_host) {
            return Err(refuse());
        }
    }
    Ok(())
}

/// The live session of `headers`' cookie: `401` pages otherwise (log in
/// first, or the session expired).
pub(crate) fn require_session(auth: &Auth, headers: &HeaderMap) -> Result<Session, ConsoleError> {
    match auth.session(headers) {
        SessionState::Live(s) => Ok(s),
        SessionState::None => Err(ConsoleError::new(
            StatusCode::UNAUTHORIZED,
            "Log in first",
            "This console has an admin token: its pages and changes need a login; log in, then try again.",
        )
        .with_login()),
        SessionState::Stale => Err(ConsoleError::new(
            StatusCode::UNAUTHORIZED,
            "Session expired",
            "Your session expired or is no longer known (the console may have restarted): log in again, then repeat the change.",
        )
        .with_login()),
    }
}

/// The session allowed to make a change: the console has an admin token,
/// the request is same-origin, its cookie names a live session and `csrf`
/// (the form's field) is that session's token.
pub(crate) fn authorize(
    auth: Option<&Auth>,
    hosts: &Hosts,
    headers: &HeaderMap,
    csrf: Option<&str>,
) -> Result<Session, ConsoleError> {
    let Some(auth) = auth else {
        return Err(ConsoleError::read_only());
    };
    same_origin(headers, hosts)?;
    let session = require_session(auth, headers)?;
    match csrf {
        Some(given) if same(given, &session.csrf) => Ok(session),
        _ => Err(ConsoleError::new(
            StatusCode::FORBIDDEN,
            "Form token mismatch",
            "The form's CSRF token does not belong to your session (a request from another page, or a form from an earlier session): reload the page and try again.",
        )),
    }
}

/// `next` if it is a path of this console (`/...`, not `//host` or
/// `/\host`, which browsers read as another site), else `/`: where a
/// login goes on.
pub(crate) fn local_path(next: Option<&str>) -> &str {
    match next {
        Some(n)
            if n.starts_with('/')
                && !n.starts_with("//")
                && !n.contains('\\')
                && n.len() <= 2048
                && !n.chars().any(char::is_control) =>
        {
            n
        }
        _ => "/",
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

    const TOKEN: &str = "0123456789abcdef";

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn hosts() -> Hosts {
        Hosts::new(ip("127.0.0.1"), &[]).unwrap()
    }

    #[test]
    fn wrong_tokens_make_their_client_wait_longer_and_longer_and_no_other() {
        let auth = Auth::new(TOKEN.into(), Duration::from_secs(60));
        let (a, b) = (ip("192.0.2.1"), ip("192.0.2.2"));
        let t0 = Instant::now();
        assert_eq!(auth.try_token_at(a, TOKEN, t0), Attempt::Right);
        for _ in 1..FREE_FAILURES {
            assert_eq!(auth.try_token_at(a, "guess", t0), Attempt::Wrong(None));
        }
        let first = Duration::from_secs(1);
        assert_eq!(
            auth.try_token_at(a, "guess", t0),
            Attempt::Wrong(Some(first))
        );
        // Waiting: not even the right token is checked for this client...
        assert_eq!(auth.try_token_at(a, TOKEN, t0), Attempt::Wait(first));
        // ...while every other client logs in (and fails on its own count).
        assert_eq!(auth.try_token_at(b, TOKEN, t0), Attempt::Right);
        assert_eq!(auth.try_token_at(b, "guess", t0), Attempt::Wrong(None));
        // Each further wrong token doubles the wait, up to MAX_BACKOFF.
        let mut now = t0;
        let mut wait = first;
        for _ in 0..12 {
            now += wait;
            let next = (wait * 2).min(MAX_BACKOFF);
            assert_eq!(
                auth.try_token_at(a, "guess", now),
                Attempt::Wrong(Some(next))
            );
            wait = next;
        }
        assert_eq!(wait, MAX_BACKOFF);
        let half = now + wait / 2;
        assert_eq!(auth.try_token_at(a, TOKEN, half), Attempt::Wait(wait / 2));
        // After its wait, the right token logs the client in and its
        // failures are forgotten.
        assert_eq!(auth.try_token_at(a, TOKEN, now + wait), Attempt::Right);
        assert_eq!(
            auth.try_token_at(a, "guess", now + wait),
            Attempt::Wrong(None)
        );
        // So are failures long past.
        let c = ip("192.0.2.3");
        for _ in 0..FREE_FAILURES {
            auth.try_token_at(c, "guess", t0);
        }
        assert!(matches!(auth.try_token_at(c, TOKEN, t0), Attempt::Wait(_)));
        assert_eq!(
            auth.try_token_at(c, "guess", t0 + FORGET_AFTER),
            Attempt::Wrong(None)
        );
    }

    #[test]
    fn an_ipv6_client_is_its_64_and_the_client_table_is_bounded() {
        let auth = Auth::new(TOKEN.into(), Duration::from_secs(60));
        let t0 = Instant::now();
        for i in 0..FREE_FAILURES {
            let from = ip(&format!("2001:db8:1:2::{}", i + 1));
            auth.try_token_at(from, "guess", t0);
        }
        // Another address of the same /64: the same client, waiting.
        assert!(matches!(
            auth.try_token_at(ip("2001:db8:1:2:ffff::9"), TOKEN, t0),
            Attempt::Wait(_)
        ));
        assert_eq!(
            auth.try_token_at(ip("2001:db8:1:3::1"), TOKEN, t0),
            Attempt::Right
        );
        assert_eq!(
            client_key(ip("::ffff:192.0.2.7")),
            ip("192.0.2.7"),
            "an IPv4-mapped address is its IPv4 client"
        );
        for i in 0..(MAX_CLIENTS as u32 + 10) {
            let from = IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i));
            auth.try_token_at(from, "guess", t0);
        }
        assert!(auth.failures.lock().unwrap().len() <= MAX_CLIENTS);
    }

    #[test]
    fn the_console_answers_to_its_own_names_only() {
        let lo = hosts();
        for ok in [
            "127.0.0.1:8089",
            "127.0.0.1",
            "localhost:8089",
            "LOCALHOST.",
            "localhost:9000",
            "[::1]:8089",
            "127.0.0.2:1",
        ] {
            assert!(lo.allows(ok), "{ok}");
        }
        for bad in [
            "",
            "evil.example:8089",
            "evil.example",
            "localhost.evil.example",
            "192.0.2.1:8089",
            "127.0.0.1:notaport",
            "[::1",
            "a b",
            "127.0.0.1:8089@evil.example",
        ] {
            assert!(!lo.allows(bad), "{bad}");
        }
        let named = Hosts::new(
            ip("127.0.0.1"),
            &["Console.Internal".into(), "proxy.example:443".into()],
        )
        .unwrap();
        assert!(named.allows("console.internal:8089"));
        assert!(named.allows("proxy.example:443"));
        assert!(!named.allows("proxy.example:444"));
        assert!(!named.allows("evil.example"));
        assert!(named.describe().contains("console.internal"));
        let remote = Hosts::new(ip("0.0.0.0"), &[]).unwrap();
        assert!(remote.allows("192.0.2.1:8089") && remote.allows("localhost"));
        assert!(!remote.allows("evil.example:8089"));
        let one = Hosts::new(ip("192.0.2.1"), &[]).unwrap();
        assert!(one.allows("192.0.2.1:8089"));
        assert!(!one.allows("192.0.2.2:8089") && !one.allows("localhost"));
        let e = Hosts::new(ip("127.0.0.1"), &["http://x/".into()]).unwrap_err();
        assert!(e.to_string().contains("http://x/"), "{e}");
    }

    #[test]
    fn a_login_goes_on_to_local_paths_only() {
        assert_eq!(local_path(Some("/dead/x?group=a")), "/dead/x?group=a");
        for bad in [
            None,
            Some(""),
            Some("//evil.example"),
            Some("/\\evil"),
            Some("https://e/"),
            Some("x"),
        ] {
            assert_eq!(local_path(bad), "/", "{bad:?}");
        }
    }

    #[test]
    fn sessions_need_the_cookie_and_the_csrf_token() {
        let auth = Auth::new(TOKEN.into(), Duration::from_secs(60));
        assert!(auth.check_token(" 0123456789abcdef\n"));
        assert!(!auth.check_token("0123456789abcdeX"));
        assert!(!auth.check_token(""));
        let (id, s) = auth.login("alice".into());
        let h = with_cookie(&id);
        let ok = authorize(Some(&auth), &hosts(), &h, Some(&s.csrf)).unwrap();
        assert_eq!(ok.who, "alice");
        let e = authorize(Some(&auth), &hosts(), &h, Some("nope")).unwrap_err();
        assert_eq!(e.status, StatusCode::FORBIDDEN);
        let e = authorize(Some(&auth), &hosts(), &h, None).unwrap_err();
        assert_eq!(e.status, StatusCode::FORBIDDEN);
        let e =
            authorize(Some(&auth), &hosts(), &with_cookie("forged"), Some(&s.csrf)).unwrap_err();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        let e = authorize(None, &hosts(), &h, Some(&s.csrf)).unwrap_err();
        assert_eq!(e.status, StatusCode::FORBIDDEN);
        auth.logout(&h);
        let e = authorize(Some(&auth), &hosts(), &h, Some(&s.csrf)).unwrap_err();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
    }

    #[test]
    fn expired_sessions_are_refused() {
        let auth = Auth::new(TOKEN.into(), Duration::ZERO);
        let (id, s) = auth.login("bob".into());
        let e = authorize(Some(&auth), &hosts(), &with_cookie(&id), Some(&s.csrf)).unwrap_err();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        assert!(e.title.contains("expired"), "{}", e.title);
    }

    #[test]
    fn cross_site_requests_are_refused() {
        let mut h = with_cookie("x");
        assert!(same_origin(&h, &hosts()).is_ok());
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:8089"),
        );
        assert!(same_origin(&h, &hosts()).is_ok());
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://evil.example"),
        );
        assert!(same_origin(&h, &hosts()).is_err());
        let mut h = with_cookie("x");
        h.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(same_origin(&h, &hosts()).is_err());
        // DNS rebinding: Host and Origin agree, but name another site.
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("evil.example:8089"));
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://evil.example:8089"),
        );
        assert!(same_origin(&h, &hosts()).is_err());
        let mut h = with_cookie("x");
        for origin in ["null", "ftp://127.0.0.1:8089", "http://localhost:8089"] {
            h.insert(header::ORIGIN, HeaderValue::from_static(origin));
            assert!(same_origin(&h, &hosts()).is_err(), "{origin}");
        }
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
