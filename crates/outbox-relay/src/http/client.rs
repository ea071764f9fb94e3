//! The client side: `outbox-relay status` (one line per relay from its
//! `/readyz`) and the console (a relay's `/metrics`) read other relays'
//! endpoints with hyper's client (hyper-util's, a fresh connection per
//! read and none kept idle: a probe every few seconds needs no pool).

use axum::body::Body;
use axum::http::{Request, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

/// The longest `/readyz` body read.
const MAX_READYZ: usize = 64 * 1024;
/// The longest body [`get_text`] reads.
#[cfg(feature = "console")]
const MAX_TEXT: usize = 1024 * 1024;

/// One line on the relay serving `addr` (its `--metrics-addr`), from its
/// `/readyz`: ready or not, the sink's breaker state (with its outages and
/// last error while not closed) and the store's state. Never fails: an
/// unreachable relay is a line saying so.
pub(crate) async fn relay_status(addr: &str) -> String {
    match tokio::time::timeout(Duration::from_secs(3), get_json(addr, "/readyz")).await {
        Ok(Ok(v)) => describe_readiness(addr, &v),
        Ok(Err(e)) => format!("relay {addr}: unreachable ({e})"),
        Err(_) => format!("relay {addr}: no answer within 3s"),
    }
}

/// `GET path` on `addr` (`host:port`): the body as text (at most 1 MiB),
/// whatever the status.
#[cfg(feature = "console")]
pub(crate) async fn get_text(addr: &str, path: &str) -> std::io::Result<String> {
    let body = get(addr, path, MAX_TEXT).await?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// `GET path` on `addr`: the body as JSON (at most 64 KiB), whatever the
/// status (`/readyz` answers 503 with the reasons).
async fn get_json(addr: &str, path: &str) -> std::io::Result<serde_json::Value> {
    let body = get(addr, path, MAX_READYZ).await?;
    serde_json::from_slice(&body).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{path} did not answer JSON: {e}"),
        )
    })
}

/// `GET path` on `addr`: the body, at most `limit` bytes.
async fn get(addr: &str, path: &str, limit: usize) -> std::io::Result<axum::body::Bytes> {
    let uri: Uri = format!("http://{addr}{path}").parse().map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{addr}: not a host:port ({e})"),
        )
    })?;
    let request = Request::get(uri)
        .body(Body::empty())
        .map_err(std::io::Error::other)?;
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<Body>();
    let response = client
        .request(request)
        .await
        .map_err(|e| std::io::Error::other(causes(&e)))?;
    axum::body::to_bytes(Body::new(response.into_body()), limit)
        .await
        .map_err(|e| std::io::Error::other(causes(&e)))
}

/// `e` and its causes, `: ` between them (hyper's own text alone says
/// little: "client error (Connect)").
fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let next = cause.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = cause.source();
    }
    text
}

/// The `status` line of one relay's `/readyz` answer.
pub(super) fn describe_readiness(addr: &str, v: &serde_json::Value) -> String {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or("?").to_owned();
    let ready = if v["ready"].as_bool() == Some(true) {
        "ready"
    } else {
        "not ready"
    };
    let mut sink = text(&v["sink"]["state"]);
    if let Some(outages) = v["sink"]["outages"].as_u64() {
        sink.push_str(&format!(", {outages} outage(s)"));
    }
    if let Some(code) = v["sink"]["last_error"]["code"].as_str() {
        sink.push_str(&format!(", last error {code}"));
    }
    let paused = if v["paused"].as_bool() == Some(true) {
        format!("; PAUSED (group {})", text(&v["pause"]["group"]))
    } else {
        String::new()
    };
    let leases = &v["leases"];
    let leases = match leases["kind"].as_str() {
        Some("relay_group") => {
            let mut s = format!(
                "; shards: {} held, fair share {} of {}",
                leases["shards_held"], leases["fair_share"], leases["total"]
            );
            if let Some(secs) = leases["held_none_secs"].as_f64() {
                s.push_str(&format!(", none held for {secs:.1} s"));
            }
            s
        }
        Some("static") => format!(
            "; shard {}: {}",
            text(&leases["shard"]),
            if leases["state"] == "ok" {
                "lease held"
            } else {
                "standby (another relay holds its lease)"
            }
        ),
        _ => String::new(),
    };
    format!(
        "relay {addr}: {ready}{paused}; sink: {sink}; store: {}{leases}",
        text(&v["store"]["state"])
    )
}
