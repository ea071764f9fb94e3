//! The URLs a run hands out: a service's URL rewritten to reach it through
//! the run's fault proxy, and the host and port a URL names.

use anyhow::{bail, Context as _, Result};
use outbox_testkit::proxy::TcpProxy;
use std::net::SocketAddr;
use std::sync::Arc;

/// Host and port of a URL (`scheme://[user[:pass]@]host:port[/...]`).
pub(crate) fn host_port(url: &str) -> Result<(String, u16)> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let hostport = hostport.split(',').next().unwrap_or(hostport);
    let (host, port) = hostport
        .rsplit_once(':')
        .with_context(|| format!("no port in {url:?}"))?;
    Ok((host.to_owned(), port.parse().context("bad port")?))
}

/// `url` through `proxy` (see [`via`]), or `url` itself when the run has
/// no proxy on that connection.
pub(crate) fn through(url: &str, proxy: Option<&Arc<TcpProxy>>) -> Result<String> {
    match proxy {
        Some(p) => via(url, p.addr()),
        None => Ok(url.to_owned()),
    }
}

/// `url` with its host:port replaced by `addr`.
pub(crate) fn via(url: &str, addr: SocketAddr) -> Result<String> {
    let (host, port) = host_port(url)?;
    let from = format!("{host}:{port}");
    let Some(i) = url.find(&from) else {
        bail!("cannot rewrite {url:?}");
    };
    Ok(format!("{}{addr}{}", &url[..i], &url[i + from.len()..]))
}

/// `url` (`postgres://[user[:pass]@]host[:port][/db][?query]`) naming the
/// database `db` instead of its own (`tenants`: one server, several
/// databases). A URL with no `://` is refused.
pub(crate) fn with_database(url: &str, db: &str) -> Result<String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        bail!("not a URL (no `://`): {}", outbox_core::redact_url(url));
    };
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let authority = before_query.split('/').next().unwrap_or(before_query);
    let mut out = format!("{scheme}://{authority}/{db}");
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

pub(crate) async fn resolve(url: &str) -> Result<SocketAddr> {
    let (host, port) = host_port(url)?;
    let found = tokio::net::lookup_host((host.as_str(), port))
        .await?
        .find(SocketAddr::is_ipv4);
    found.with_context(|| format!("cannot resolve {url}"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_rewritten_to_the_proxy() {
        let addr: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        assert_eq!(
            via("postgres://postgres@127.0.0.1:5432/test", addr).unwrap(),
            "postgres://postgres@127.0.0.1:40000/test"
        );
        assert_eq!(
            via("amqp://guest:guest@localhost:5672/%2f", addr).unwrap(),
            "amqp://guest:guest@127.0.0.1:40000/%2f"
        );
        assert_eq!(
            via("nats://127.0.0.1:4222", addr).unwrap(),
            "nats://127.0.0.1:40000"
        );
        assert_eq!(host_port("nats://h:1").unwrap(), ("h".to_owned(), 1));
    }

    #[test]
    fn a_url_names_another_database() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/test", "t1").unwrap(),
            "postgres://postgres@127.0.0.1:5432/t1"
        );
        assert_eq!(
            with_database("postgres://u:secret@h/test?sslmode=disable", "t1").unwrap(),
            "postgres://u:secret@h/t1?sslmode=disable"
        );
        assert_eq!(
            with_database("postgres://h:5432", "t1").unwrap(),
            "postgres://h:5432/t1"
        );
        assert_eq!(
            with_database("postgres://h:5432?application_name=x", "t1").unwrap(),
            "postgres://h:5432/t1?application_name=x"
        );
        let err = with_database("u:secret@h/test", "t1")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("secret"), "{err}");
    }
}
