//! The endpoints of one relay: what `/metrics`, `/healthz` and `/readyz`
//! answer (the [`Router`]), and the readiness rule. `http.rs` serves them;
//! `http/stores.rs` answers for several stores with the same pieces.

use super::leases::{lease_json, LeaseSource};
use super::probe::{StoreProbe, StoreState};
use crate::report::scrub;
use axum::http::{header, Method, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use outbox_worker::{PauseHandle, PauseStatus, SinkHealth, SinkState, SinkStatus};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// Renders the metrics text (the Prometheus recorder's handle).
pub(crate) type Render = Box<dyn Fn() -> String + Send + Sync>;

/// What the endpoints read.
pub(crate) struct Endpoints {
    /// `None` in a build without the `prometheus` feature.
    pub(crate) metrics: Option<Render>,
    pub(crate) sink: SinkHealth,
    pub(crate) store: StoreProbe,
    /// The relay's consumer group and its pause (`None`: not watched).
    pub(crate) pause: Option<PauseHandle>,
    /// The relay's shard leases (`None`: a store without them).
    pub(crate) leases: Option<LeaseSource>,
    /// See [`lease_grace`].
    pub(crate) lease_grace: Duration,
    /// Replaced by `***` in every error shown.
    pub(crate) secrets: Vec<String>,
}

impl std::fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoints")
            .field("metrics", &self.metrics.is_some())
            .field("sink", &self.sink)
            .field("store", &self.store)
            .field("pause", &self.pause)
            .field("leases", &self.leases.is_some())
            .field("lease_grace", &self.lease_grace)
            .finish_non_exhaustive()
    }
}

/// One response.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Response {
    pub(super) status: StatusCode,
    pub(super) content_type: &'static str,
    pub(super) body: String,
}

impl Response {
    pub(super) fn text(status: StatusCode, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }

    pub(super) fn json(status: StatusCode, body: &serde_json::Value) -> Self {
        Self {
            status,
            content_type: "application/json",
            body: format!("{body}\n"),
        }
    }
}

impl IntoResponse for Response {
    fn into_response(self) -> axum::response::Response {
        let headers = [
            (header::CONTENT_TYPE, self.content_type),
            (header::CACHE_CONTROL, "no-store"),
        ];
        let mut response = (self.status, headers, self.body).into_response();
        if self.status == StatusCode::METHOD_NOT_ALLOWED {
            response
                .headers_mut()
                .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        }
        response
    }
}

/// `/metrics`: the recorder's text, or `404` naming the missing feature
/// (`None`: a build without `prometheus`).
pub(super) fn metrics_text(render: Option<&Render>) -> Response {
    match render {
        Some(render) => Response {
            status: StatusCode::OK,
            content_type: "text/plain; version=0.0.4; charset=utf-8",
            body: render(),
        },
        None => Response::text(
            StatusCode::NOT_FOUND,
            "metrics need the `prometheus` feature (on by default)\n",
        ),
    }
}

/// An answer computed when asked (`/metrics`, `/readyz`).
pub(super) type Answer = Arc<dyn Fn() -> Response + Send + Sync>;

/// The routes: `/healthz`, and `metrics` and `ready` on `/metrics` and
/// `/readyz`, for `GET` and `HEAD` (axum answers `HEAD` with the `GET`
/// headers and no body); `405` for any other method, `404` for any other
/// path.
pub(super) fn router(metrics: Answer, ready: Answer) -> Router {
    let answer = |a: Answer| get(move || async move { a() }).fallback(not_allowed);
    Router::new()
        .route("/metrics", answer(metrics))
        .route("/readyz", answer(ready))
        .route(
            "/healthz",
            answer(Arc::new(|| Response::text(StatusCode::OK, "ok\n"))),
        )
        .fallback(|method: Method| async move {
            if method == Method::GET || method == Method::HEAD {
                Response::text(
                    StatusCode::NOT_FOUND,
                    "not found: try /metrics, /healthz or /readyz\n",
                )
            } else {
                not_allowed().await
            }
        })
}

/// Any method but `GET` and `HEAD`.
async fn not_allowed() -> Response {
    Response::text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n")
}

impl Endpoints {
    /// The routes answering from these endpoints.
    pub(super) fn into_router(self) -> Router {
        let endpoints = Arc::new(self);
        let ready = endpoints.clone();
        router(
            Arc::new(move || endpoints.metrics()),
            Arc::new(move || ready.ready()),
        )
    }

    /// `/metrics`.
    pub(super) fn metrics(&self) -> Response {
        metrics_text(self.metrics.as_ref())
    }

    /// `/readyz`.
    pub(super) fn ready(&self) -> Response {
        readiness(
            &self.sink.status(),
            &self.store.get(),
            self.pause.as_ref().map(PauseHandle::status).as_ref(),
            self.leases
                .as_ref()
                .and_then(|read| read())
                .map(|l| lease_json(&l, self.lease_grace)),
            &self.secrets,
        )
    }
}

/// `/readyz`: ready when the store answered the last claim, the sink's
/// breaker is closed and the relay is not starved of shard leases
/// (`leases`: from [`lease_json`]); otherwise 503 naming the states and
/// their last errors, with every secret replaced by `***`.
///
/// A paused relay claims nothing, so neither state moves: it is ready (200,
/// `"paused": true`, the pause is deliberate) while it can read its control
/// row, and not ready (503) when that read failed.
fn readiness(
    sink: &SinkStatus,
    store: &StoreState,
    pause: Option<&PauseStatus>,
    leases: Option<(serde_json::Value, Option<String>)>,
    secrets: &[String],
) -> Response {
    let paused = pause.and_then(|p| p.paused.as_ref());
    let starved = leases.as_ref().is_some_and(|(_, reason)| reason.is_some());
    let ready = match (paused, pause) {
        (Some(_), Some(p)) => p.last_error.is_none(),
        _ => sink.state == SinkState::Closed && *store == StoreState::Ok && !starved,
    };
    let leases_json = leases.map(|(v, _)| v);
    let pause_json = pause.map(|p| {
        let mut v = json!({ "group": p.group, "paused": p.paused.is_some() });
        if let Some(paused) = &p.paused {
            v["since"] = json!(paused
                .since
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
            v["by"] = json!(paused.by);
            v["reason"] = json!(paused.reason.as_deref().map(|r| scrub(r, secrets)));
        }
        if let Some(e) = &p.last_error {
            v["last_error"] = json!(scrub(e, secrets));
        }
        v
    });
    let store_json = match store {
        StoreState::Starting => json!({ "state": "starting" }),
        StoreState::Ok => json!({ "state": "ok" }),
        StoreState::Failed(e) => json!({
            "state": "error",
            "last_error": scrub(e, secrets),
        }),
        StoreState::Stalled(waited) => json!({
            "state": "no_answer",
            "claim_waiting_secs": waited.as_secs(),
        }),
    };
    if ready {
        let mut body =
            json!({ "ready": true, "sink": { "state": sink.state.as_str() }, "store": store_json });
        if let Some(pause) = pause_json {
            body["paused"] = json!(paused.is_some());
            body["pause"] = pause;
        }
        if let Some(leases) = leases_json {
            body["leases"] = leases;
        }
        return Response::json(StatusCode::OK, &body);
    }
    let since = chrono::DateTime::<chrono::Utc>::from(sink.since)
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let last_error = sink.last_error.as_ref().map(|e| {
        json!({
            "code": e.code().as_str(),
            "message": scrub(e.message(), secrets),
        })
    });
    let mut body = json!({
        "ready": false,
        "sink": {
            "state": sink.state.as_str(),
            "since": since,
            "outages": sink.outages,
            "last_error": last_error,
        },
        "store": store_json,
    });
    if let Some(pause) = pause_json {
        body["paused"] = json!(paused.is_some());
        body["pause"] = pause;
    }
    if let Some(leases) = leases_json {
        body["leases"] = leases;
    }
    Response::json(StatusCode::SERVICE_UNAVAILABLE, &body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::client::describe_readiness;
    use crate::http::leases::{lease_grace, Leases};
    use crate::http::probe::{Claiming, CLAIM_STALL};
    use crate::http::server::{serve_on, Limits};
    use outbox_core::{DeliveryError, ErrorCode, ShardSpec};
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    fn body(r: &Response) -> serde_json::Value {
        serde_json::from_str(&r.body).unwrap_or_default()
    }

    #[test]
    fn a_claim_under_way_is_stalled_only_after_a_while() {
        let probe = StoreProbe::new();
        let claiming = Claiming::start(&probe);
        assert_eq!(probe.get(), StoreState::Starting);
        probe.lock().claiming_since = Some(Instant::now() - CLAIM_STALL);
        assert!(matches!(probe.get(), StoreState::Stalled(_)));
        claiming.finish(StoreState::Ok);
        assert_eq!(probe.get(), StoreState::Ok);
        // A cancelled claim leaves no mark behind.
        drop(Claiming::start(&probe));
        assert_eq!(probe.lock().claiming_since, None);
    }

    /// `method path` on `addr`: the whole answer as text, `None` when
    /// closed unanswered.
    async fn ask(addr: std::net::SocketAddr, method: &str, path: &str) -> Option<String> {
        let mut s = TcpStream::connect(addr).await.ok()?;
        s.write_all(format!("{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut raw))
            .await
            .ok()?
            .ok()?;
        (!raw.is_empty()).then(|| String::from_utf8_lossy(&raw).into_owned())
    }

    #[tokio::test]
    async fn routes() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let routes = router(
            Arc::new(|| Response::text(StatusCode::OK, "the metrics\n")),
            Arc::new(|| {
                Response::json(StatusCode::SERVICE_UNAVAILABLE, &json!({ "ready": false }))
            }),
        );
        serve_on(listener, Limits::default(), routes);
        let answer = |method: &'static str, path: &'static str| async move {
            ask(addr, method, path)
                .await
                .unwrap_or_default()
                .to_ascii_lowercase()
        };

        let health = answer("GET", "/healthz").await;
        assert!(health.starts_with("http/1.1 200 ok\r\n"), "{health}");
        assert!(
            health.contains("content-type: text/plain; charset=utf-8\r\n"),
            "{health}"
        );
        assert!(health.contains("cache-control: no-store\r\n"), "{health}");
        assert!(health.contains("connection: close\r\n"), "{health}");
        assert!(health.ends_with("\r\n\r\nok\n"), "{health}");

        let ready = answer("GET", "/readyz?verbose=1").await;
        assert!(ready.starts_with("http/1.1 503 "), "{ready}");
        assert!(
            ready.contains("content-type: application/json\r\n"),
            "{ready}"
        );
        assert!(ready.ends_with("\r\n\r\n{\"ready\":false}\n"), "{ready}");

        let metrics = answer("HEAD", "/metrics").await;
        assert!(metrics.starts_with("http/1.1 200 "), "{metrics}");
        assert!(metrics.contains("content-length: 12\r\n"), "{metrics}");
        assert!(metrics.ends_with("\r\n\r\n"), "HEAD: no body: {metrics}");

        let missing = answer("GET", "/").await;
        assert!(missing.starts_with("http/1.1 404 "), "{missing}");
        assert!(
            missing.ends_with("not found: try /metrics, /healthz or /readyz\n"),
            "{missing}"
        );

        for path in ["/readyz", "/nowhere"] {
            let post = answer("POST", path).await;
            assert!(post.starts_with("http/1.1 405 "), "{post}");
            assert!(post.contains("allow: get, head\r\n"), "{post}");
            assert!(post.ends_with("only get\n"), "{post}");
        }
    }

    #[test]
    fn ready_only_with_a_closed_sink_and_a_store_that_answered() {
        let closed = SinkStatus::default();
        let ok = readiness(&closed, &StoreState::Ok, None, None, &[]);
        assert_eq!(ok.status, 200);
        assert_eq!(body(&ok)["sink"]["state"], "closed");

        let starting = readiness(&closed, &StoreState::Starting, None, None, &[]);
        assert_eq!(starting.status, 503);
        assert_eq!(body(&starting)["store"]["state"], "starting");

        let secrets = vec!["hunter2".to_owned()];
        let failed = StoreState::Failed("pool timed out (postgres://u:hunter2@db)".into());
        let r = readiness(&closed, &failed, None, None, &secrets);
        assert_eq!(r.status, 503);
        assert!(!r.body.contains("hunter2"), "{}", r.body);
        assert_eq!(body(&r)["store"]["state"], "error");

        let mut open = SinkStatus::default();
        open.state = SinkState::Open;
        open.outages = 2;
        open.last_error = Some(DeliveryError::unavailable(
            ErrorCode::new("SINK_UNAVAILABLE"),
            "connection refused: nats://u:hunter2@127.0.0.1:4222",
        ));
        let r = readiness(&open, &StoreState::Ok, None, None, &secrets);
        assert_eq!(r.status, 503);
        let v = body(&r);
        assert_eq!(v["ready"], false);
        assert_eq!(v["sink"]["state"], "open");
        assert_eq!(v["sink"]["outages"], 2);
        assert_eq!(v["sink"]["last_error"]["code"], "SINK_UNAVAILABLE");
        assert!(!r.body.contains("hunter2"), "{}", r.body);
        assert_eq!(
            describe_readiness("a:1", &v),
            "relay a:1: not ready; sink: open, 2 outage(s), last error SINK_UNAVAILABLE; store: ok"
        );
        assert_eq!(
            describe_readiness("a:1", &body(&ok)),
            "relay a:1: ready; sink: closed; store: ok"
        );

        let stalled = StoreState::Stalled(Duration::from_secs(20));
        let r = readiness(&closed, &stalled, None, None, &[]);
        assert_eq!(r.status, 503);
        assert_eq!(body(&r)["store"]["state"], "no_answer");

        let mut half = open.clone();
        half.state = SinkState::HalfOpen;
        assert_eq!(
            readiness(&half, &StoreState::Ok, None, None, &[]).status,
            503
        );
    }

    #[test]
    fn a_paused_relay_is_ready_while_it_reads_its_control_row() {
        let closed = SinkStatus::default();
        let running = PauseStatus::new("default");
        let r = readiness(&closed, &StoreState::Ok, Some(&running), None, &[]);
        assert_eq!(r.status, 200);
        assert_eq!(body(&r)["paused"], false);
        assert_eq!(body(&r)["pause"]["group"], "default");

        let mut paused = PauseStatus::new("payments");
        paused.paused = Some(outbox_core::Paused::new(
            chrono::Utc::now(),
            outbox_core::PauseNote::new()
                .with_by("alice")
                .with_reason("deploy, see postgres://u:hunter2@db"),
        ));
        // No claim answered yet (it started paused): still ready.
        let r = readiness(
            &closed,
            &StoreState::Starting,
            Some(&paused),
            None,
            &["hunter2".into()],
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = body(&r);
        assert_eq!(v["ready"], true);
        assert_eq!(v["paused"], true);
        assert_eq!(v["pause"]["by"], "alice");
        assert!(!r.body.contains("hunter2"), "{}", r.body);
        assert_eq!(
            describe_readiness("a:1", &v),
            "relay a:1: ready; PAUSED (group payments); sink: closed; store: starting"
        );

        // The control row cannot be read: not ready.
        paused.last_error = Some("pool timed out".into());
        let r = readiness(&closed, &StoreState::Ok, Some(&paused), None, &[]);
        assert_eq!(r.status, 503);
        assert_eq!(body(&r)["pause"]["last_error"], "pool timed out");
    }

    // ------------------------------------------------ the listener's limits

    /// Serves `/big` (64 MiB, more than loopback socket buffers hold) and
    /// `ok` on every other path, within `limits`.
    async fn listening(limits: Limits) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let routes = Router::new()
            .route(
                "/big",
                axum::routing::get(|| async {
                    Response::text(StatusCode::OK, "x".repeat(64 << 20))
                }),
            )
            .fallback(|| async { Response::text(StatusCode::OK, "ok\n") });
        serve_on(listener, limits, routes);
        addr
    }

    fn limits(max_connections: usize, read_ms: u64, write_ms: u64) -> Limits {
        Limits {
            max_connections,
            read_timeout: Duration::from_millis(read_ms),
            write_timeout: Duration::from_millis(write_ms),
        }
    }

    /// `GET path`: the status, `None` when closed without an answer.
    async fn get(addr: std::net::SocketAddr, path: &str) -> Option<u16> {
        ask(addr, "GET", path)
            .await?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    }

    /// `GET path` until it answers 200 (every 50 ms, at most `bound`).
    async fn answers_within(addr: std::net::SocketAddr, path: &str, bound: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + bound;
        while tokio::time::Instant::now() < deadline {
            if get(addr, path).await == Some(200) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// Waits (at most `bound`) for the server to close `s`: what it had
    /// sent by then, `None` if still open.
    async fn closed_by_server(s: &mut TcpStream, bound: Duration) -> Option<Vec<u8>> {
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + bound;
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
                Err(_) => return None,
                Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            }
        }
    }

    /// Still open: nothing to read and no end of stream.
    fn is_open(s: &TcpStream) -> bool {
        let mut buf = [0u8; 1];
        matches!(s.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_are_closed_at_once_and_it_answers_again() {
        let addr = listening(limits(2, 2_000, 5_000)).await;
        assert_eq!(get(addr, "/healthz").await, Some(200));
        // Two idle connections take both slots...
        let idle = [
            TcpStream::connect(addr).await.unwrap(),
            TcpStream::connect(addr).await.unwrap(),
        ];
        // ... so a third one is closed unanswered while they are still open
        // (they last until the 2 s read timeout).
        let mut over = TcpStream::connect(addr).await.unwrap();
        let _ = over.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await;
        let got = closed_by_server(&mut over, Duration::from_secs(30)).await;
        assert_eq!(got.as_deref(), Some(&[][..]), "closed, no answer");
        assert!(
            idle.iter().all(is_open),
            "the idle connections were not what kept the third one out"
        );
        // Once the read timeout closed them, the endpoint answers again.
        assert!(answers_within(addr, "/healthz", Duration::from_secs(30)).await);
        for mut s in idle {
            let got = closed_by_server(&mut s, Duration::from_secs(30)).await;
            assert_eq!(got.as_deref(), Some(&[][..]), "idle: closed unanswered");
        }
    }

    #[tokio::test]
    async fn a_silent_or_trickling_client_is_closed_after_the_read_timeout() {
        let addr = listening(limits(4, 300, 5_000)).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let got = closed_by_server(&mut silent, Duration::from_secs(30)).await;
        assert_eq!(got.as_deref(), Some(&[][..]), "silent: closed unanswered");

        // One byte every 50 ms: each read succeeds, the head never ends in
        // time; the deadline is for the whole head.
        let trickle = TcpStream::connect(addr).await.unwrap();
        let (mut rd, mut wr) = trickle.into_split();
        let writer = tokio::spawn(async move {
            for b in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: 123456789\r\n\r\n" {
                if wr.write_all(&[*b]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        let mut raw = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), rd.read_to_end(&mut raw)).await;
        assert!(read.is_ok(), "the trickling client was not closed");
        assert!(raw.is_empty(), "{}", String::from_utf8_lossy(&raw));
        writer.abort();
        // Meanwhile a prompt client is answered.
        assert_eq!(get(addr, "/healthz").await, Some(200));
    }

    #[tokio::test]
    async fn a_request_head_over_8_kib_is_refused() {
        let addr = listening(limits(4, 5_000, 5_000)).await;
        let long = format!("/healthz?{}", "x".repeat(9 * 1024));
        assert_eq!(get(addr, &long).await, Some(431));
        let short = format!("/healthz?{}", "x".repeat(7 * 1024));
        assert_eq!(get(addr, &short).await, Some(200));
    }

    #[tokio::test]
    async fn a_client_that_does_not_read_is_closed_after_the_write_timeout() {
        // One slot: a client that asks for a big answer and never reads it
        // would hold it for ever without the write timeout.
        let addr = listening(limits(1, 5_000, 300)).await;
        let mut stuck = TcpStream::connect(addr).await.unwrap();
        stuck.write_all(b"GET /big HTTP/1.1\r\n\r\n").await.unwrap();
        assert!(answers_within(addr, "/healthz", Duration::from_secs(30)).await);
        drop(stuck);
    }

    fn group(held: u32, fair_share: u32, none_for: Option<u64>) -> Leases {
        Leases {
            dynamic: true,
            shards: (0..held).collect(),
            total: 64,
            fair_share,
            held_none_for: none_for.map(Duration::from_millis),
            shard: ShardSpec::ALL,
        }
    }

    #[test]
    fn a_relay_that_holds_none_of_its_fair_share_past_the_grace_is_not_ready() {
        let closed = SinkStatus::default();
        let grace = lease_grace(Duration::from_secs(2), Duration::from_millis(100));
        assert_eq!(grace, Duration::from_secs(4));
        let ready = |l: &Leases| {
            readiness(
                &closed,
                &StoreState::Ok,
                None,
                Some(lease_json(l, grace)),
                &[],
            )
        };

        let r = ready(&group(64, 64, None));
        assert_eq!(r.status, 200, "{}", r.body);
        let v = body(&r);
        assert_eq!(v["leases"]["kind"], "relay_group");
        assert_eq!(v["leases"]["shards_held"], 64);
        assert_eq!(v["leases"]["fair_share"], 64);
        assert_eq!(v["leases"]["total"], 64);
        assert_eq!(v["leases"]["state"], "ok");
        assert_eq!(
            describe_readiness("a:1", &v),
            "relay a:1: ready; sink: closed; store: ok; shards: 64 held, fair share 64 of 64"
        );

        // Joining: none yet, within the grace.
        let r = ready(&group(0, 32, Some(1_500)));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(body(&r)["leases"]["state"], "waiting");
        assert_eq!(body(&r)["leases"]["held_none_secs"], 1.5);

        // Kept out past the grace.
        let r = ready(&group(0, 32, Some(5_100)));
        assert_eq!(r.status, 503, "{}", r.body);
        let v = body(&r);
        assert_eq!(v["ready"], false);
        assert_eq!(v["leases"]["state"], "starved");
        assert_eq!(
            v["leases"]["reason"],
            "holds 0 of its fair share of 32 shards for 5.1 s"
        );
        assert_eq!(v["sink"]["state"], "closed");
        assert_eq!(
            describe_readiness("a:1", &v),
            "relay a:1: not ready; sink: closed, 0 outage(s); store: ok; shards: 0 held, fair share 32 of 64, none held for 5.1 s"
        );

        // More relays than shards: a share of 0 holds nothing and is ready.
        let r = ready(&group(0, 0, None));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(body(&r)["leases"]["fair_share"], 0);

        // A static shard another relay holds: a standby, ready.
        let standby = Leases {
            dynamic: false,
            shards: Vec::new(),
            total: 4,
            fair_share: 1,
            held_none_for: Some(Duration::from_secs(600)),
            shard: ShardSpec::new(2, 4).unwrap(),
        };
        let r = ready(&standby);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = body(&r);
        assert_eq!(v["leases"]["state"], "standby");
        assert_eq!(v["leases"]["shard"], "2/4");
        assert_eq!(
            describe_readiness("a:1", &v),
            "relay a:1: ready; sink: closed; store: ok; shard 2/4: standby (another relay holds its lease)"
        );

        // A paused relay is ready whatever it holds.
        let mut paused = PauseStatus::new("default");
        paused.paused = Some(outbox_core::Paused::new(
            chrono::Utc::now(),
            outbox_core::PauseNote::new(),
        ));
        let r = readiness(
            &closed,
            &StoreState::Ok,
            Some(&paused),
            Some(lease_json(&group(0, 32, Some(60_000)), grace)),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
}
