//! The client side, for `outbox-relay status`: one line per relay from its
//! `/readyz`.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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

/// `GET path` on `addr` (HTTP/1.1, `Connection: close`): the body as JSON.
async fn get_json(addr: &str, path: &str) -> std::io::Result<serde_json::Value> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut raw = Vec::new();
    stream.take(64 * 1024).read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{path} did not answer JSON: {e}"),
        )
    })
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
