//! Shared by the console's tests: the console process, a raw HTTP/1.1
//! client (no HTTP client crate in the tree), a login, and dead letters
//! made through the event log's own claim and settle.
#![allow(dead_code, unreachable_pub)]

pub mod webdriver;

use outbox_core::{
    ClaimRequest, ErrorCode, EventId, LastError, NewEvent, RelayId, Resolution, Settlement,
    ShardSpec, Store,
};
use outbox_postgres::{sqlx, PgLogStore};
use outbox_testkit::process::ChildGuard;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The admin token of the tests' consoles.
pub const TOKEN: &str = "test-admin-token-0123456789";

/// An HTTP answer.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Resp {
    /// The first header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One request to `addr` (HTTP/1.1, `Connection: close`), `None` when
/// nothing answers. `headers` are added as given (a `Host` among them
/// replaces the default, `addr`); a body is sent as a form.
pub fn try_http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Option<Resp> {
    let s = std::net::TcpStream::connect(addr).ok()?;
    exchange(s, addr, method, path, headers, body)
}

/// [`http`] from the local address `source` (e.g. `127.0.0.2`: another
/// client of a loopback console, as the console sees its peer address).
pub async fn http_from(
    source: &str,
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Resp {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(format!("{source}:0").parse().unwrap())
        .unwrap_or_else(|e| panic!("cannot bind a client socket to {source}: {e}"));
    let stream = socket.connect(addr.parse().unwrap()).await.unwrap();
    let stream = stream.into_std().unwrap();
    stream.set_nonblocking(false).unwrap();
    exchange(stream, addr, method, path, headers, body)
        .unwrap_or_else(|| panic!("no answer to {method} {path} from the console on {addr}"))
}

fn exchange(
    mut s: std::net::TcpStream,
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Option<Resp> {
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let mut req = format!("{method} {path} HTTP/1.1\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    req.push_str("Connection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    if let Some(b) = body {
        req.push_str(b);
    }
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    Some(Resp {
        status,
        headers,
        body: body.to_owned(),
    })
}

/// [`try_http`] that must get an answer.
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Resp {
    try_http(addr, method, path, headers, body)
        .unwrap_or_else(|| panic!("no answer to {method} {path} from the console on {addr}"))
}

/// `s` percent-encoded for a form or query.
pub fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            b => format!("%{b:02X}"),
        })
        .collect()
}

/// A running `outbox-relay console` (or, [`Console::attach`]ed, the
/// console of a running relay).
pub struct Console {
    pub child: Option<ChildGuard>,
    pub addr: String,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

/// A logged-in browser: its cookie header and the session's CSRF token.
#[derive(Debug, Clone)]
pub struct Session {
    pub cookie: String,
    pub csrf: String,
}

impl Console {
    /// Starts `outbox-relay console <store_args> <extra>` on a free port
    /// (with the admin token file of [`TOKEN`] when `admin`), and waits
    /// (at most 60 s) until it answers.
    pub fn start(store_args: &[String], admin: bool, extra: &[&str]) -> Console {
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
        #[cfg(unix)]
        std::fs::set_permissions(
            &token_file,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        let log = dir.path().join("console.log");
        let addr = free_addr();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
        cmd.arg("console")
            .args(store_args)
            .args(["--listen", &addr, "--sample-secs", "1"])
            .args(extra)
            .env("RUST_LOG", "info")
            .env_remove("OUTBOX_CONFIG")
            .env_remove("OUTBOX_STORE")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if admin {
            cmd.arg("--admin-token-file").arg(&token_file);
        }
        let mut child = ChildGuard::new(cmd.spawn().unwrap());
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if try_http(&addr, "GET", "/assets/console.css", &[], None).is_some() {
                break;
            }
            if let Some(status) = child.child().try_wait().unwrap() {
                panic!(
                    "the console exited with {status}: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the console did not answer in 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Console {
            child: Some(child),
            addr,
            log,
            _dir: dir,
        }
    }

    /// The console another process serves on `addr` (`run --console-addr`).
    pub fn attach(addr: String) -> Console {
        let dir = tempfile::tempdir().unwrap();
        Console {
            child: None,
            addr,
            log: dir.path().join("console.log"),
            _dir: dir,
        }
    }

    /// `GET path` with `session`'s cookie.
    pub fn get(&self, path: &str, session: Option<&Session>) -> Resp {
        match session {
            Some(s) => http(&self.addr, "GET", path, &[("Cookie", &s.cookie)], None),
            None => http(&self.addr, "GET", path, &[], None),
        }
    }

    /// `POST path` of the form `body` with `session`'s cookie (and nothing
    /// else: the caller puts the CSRF token in the form).
    pub fn post(&self, path: &str, session: Option<&Session>, body: &str) -> Resp {
        match session {
            Some(s) => http(
                &self.addr,
                "POST",
                path,
                &[("Cookie", &s.cookie)],
                Some(body),
            ),
            None => http(&self.addr, "POST", path, &[], Some(body)),
        }
    }

    /// Logs in as `who` with [`TOKEN`].
    pub fn login(&self, who: &str) -> Session {
        let r = self.post(
            "/login",
            None,
            &format!("who={}&token={}", enc(who), enc(TOKEN)),
        );
        assert_eq!(r.status, 303, "login: {}", r.body);
        let set = r.header("set-cookie").expect("a session cookie");
        assert!(
            set.contains("HttpOnly") && set.contains("SameSite=Strict"),
            "{set}"
        );
        let cookie = set.split(';').next().unwrap().to_owned();
        let page = self.get(
            "/",
            Some(&Session {
                cookie: cookie.clone(),
                csrf: String::new(),
            }),
        );
        let csrf = csrf_of(&page.body).expect("a CSRF token on the page of a session");
        Session { cookie, csrf }
    }

    /// What the console logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// The CSRF token of the first form of `page`.
pub fn csrf_of(page: &str) -> Option<String> {
    let at = page.find(r#"name="csrf" value=""#)?;
    let rest = &page[at + r#"name="csrf" value=""#.len()..];
    Some(rest[..rest.find('"')?].to_owned())
}

/// `127.0.0.1:<port>` of a port that was free a moment ago.
pub fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// Commits `events` in one transaction, then claims and dead-letters all
/// of them through `store` (the event log's own claim and settle), code
/// `code` with message `message`. Returns their ids in commit order.
pub async fn dead_letters(
    store: &PgLogStore,
    pool: &sqlx::PgPool,
    events: Vec<NewEvent>,
    code: ErrorCode,
    message: &str,
) -> Vec<EventId> {
    let n = events.len();
    let mut tx = pool.begin().await.unwrap();
    let mut ids = Vec::with_capacity(n);
    let mut events = events.into_iter().peekable();
    while events.peek().is_some() {
        let chunk: Vec<NewEvent> = events.by_ref().take(1000).collect();
        ids.extend(store.outbox().enqueue_batch(&mut tx, chunk).await.unwrap());
    }
    tx.commit().await.unwrap();
    let mut done = 0;
    while done < n {
        let claim = store
            .claim(&ClaimRequest {
                relay_id: RelayId::new("console-test"),
                batch_size: 1000,
                lease: Duration::from_secs(60),
                shard: ShardSpec::ALL,
            })
            .await
            .unwrap();
        assert!(!claim.events.is_empty(), "claimed {done} of {n}, then none");
        let mut s = Settlement::new();
        for e in &claim.events {
            s.push(
                e.id,
                Resolution::Dead {
                    error: LastError {
                        code: code.clone(),
                        message: message.to_owned(),
                    },
                },
            );
        }
        let report = store.settle(claim.token, &s).await.unwrap();
        assert_eq!(report.applied as usize, claim.events.len());
        done += claim.events.len();
    }
    // Give the shard leases back: a relay started next claims at once.
    store.leave(&RelayId::new("console-test")).await.unwrap();
    ids
}

/// Commits `events` in one transaction and claims once through `store`:
/// the events the claim returned, settled with `resolution` (what it did
/// not return waits behind its key).
pub async fn enqueue_and_settle(
    store: &PgLogStore,
    pool: &sqlx::PgPool,
    events: Vec<NewEvent>,
    resolution: Resolution,
) -> Vec<EventId> {
    let mut tx = pool.begin().await.unwrap();
    let ids = store.outbox().enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    let claim = store
        .claim(&ClaimRequest {
            relay_id: RelayId::new("console-test"),
            batch_size: 100,
            lease: Duration::from_secs(60),
            shard: ShardSpec::ALL,
        })
        .await
        .unwrap();
    let mut s = Settlement::new();
    for e in &claim.events {
        s.push(e.id, resolution.clone());
    }
    store.settle(claim.token, &s).await.unwrap();
    ids
}

/// Two held keys of group `default` ([`held_keys`]).
pub struct Held {
    /// `acct-7`'s head: a `payment.captured` dead with
    /// HANDLER_PERMANENT_FAILURE `card <expired>`.
    pub dead: EventId,
    /// The three `payment.refunded` parked behind it, in order.
    pub behind_dead: Vec<EventId>,
    /// `order-1`'s head: an `order.created` waiting ten minutes for its
    /// retry after HANDLER_TEMPORARY_FAILURE `inventory service unavailable`.
    pub retried: EventId,
    /// The `order.paid` parked behind it.
    pub behind_retried: EventId,
}

/// Makes two held keys through `store` (an event log opened with the
/// dead-head policy `block`), then gives the shard leases back.
pub async fn held_keys(store: &PgLogStore, pool: &sqlx::PgPool) -> Held {
    let error = |code: ErrorCode, message: &str| LastError {
        code,
        message: message.to_owned(),
    };
    let dead = enqueue_and_settle(
        store,
        pool,
        vec![
            NewEvent::new("payment.captured", "payments", br#"{"amount":42}"#.to_vec())
                .with_key("acct-7"),
        ],
        Resolution::Dead {
            error: error(ErrorCode::HANDLER_PERMANENT_FAILURE, "card <expired>"),
        },
    )
    .await[0];
    let retried = enqueue_and_settle(
        store,
        pool,
        vec![NewEvent::new("order.created", "orders", b"{}".to_vec()).with_key("order-1")],
        Resolution::Retry {
            delay: Duration::from_secs(600),
            error: error(
                ErrorCode::HANDLER_TEMPORARY_FAILURE,
                "inventory service unavailable",
            ),
        },
    )
    .await[0];
    // Later events of both keys: the claim parks them behind their heads.
    let mut behind = enqueue_and_settle(
        store,
        pool,
        (0..3)
            .map(|i| {
                NewEvent::new(
                    "payment.refunded",
                    "payments",
                    format!("{{\"n\":{i}}}").into_bytes(),
                )
                .with_key("acct-7")
            })
            .chain([NewEvent::new("order.paid", "orders", b"{}".to_vec()).with_key("order-1")])
            .collect(),
        Resolution::Released,
    )
    .await;
    store.leave(&RelayId::new("console-test")).await.unwrap();
    let behind_retried = behind.pop().unwrap();
    Held {
        dead,
        behind_dead: behind,
        retried,
        behind_retried,
    }
}
