//! The Prometheus recorder behind `--metrics-addr`'s `/metrics`.

use crate::http;
use anyhow::Context as _;
use std::net::SocketAddr;
use tokio::net::TcpListener;

/// `--metrics-addr`: the listener, bound now so that a taken port fails
/// the command before any relay starts, and the recorder `/metrics`
/// renders (installed only when there is a listener).
pub(crate) async fn bind_metrics(
    addr: Option<SocketAddr>,
) -> anyhow::Result<(Option<(SocketAddr, TcpListener)>, Option<http::Render>)> {
    let Some(addr) = addr else {
        return Ok((None, None));
    };
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot serve metrics on {addr}"))?;
    Ok((Some((addr, listener)), install_prometheus()?))
}

/// Installs the Prometheus recorder; `/metrics` renders its text.
#[cfg(feature = "prometheus")]
fn install_prometheus() -> anyhow::Result<Option<http::Render>> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("cannot install the Prometheus recorder")?;
    // What the exporter's own listener would do: drain histograms now and
    // then so they do not grow without bound between scrapes.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(Some(Box::new(move || handle.render())))
}

/// Without the exporter, `--metrics-addr` still serves the health
/// endpoints; `/metrics` says what is missing.
#[cfg(not(feature = "prometheus"))]
fn install_prometheus() -> anyhow::Result<Option<http::Render>> {
    tracing::warn!(
        "built without the `prometheus` feature: --metrics-addr serves /healthz and /readyz only"
    );
    Ok(None)
}
