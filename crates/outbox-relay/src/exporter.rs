//! The Prometheus recorder behind `--metrics-addr`'s `/metrics`.

use crate::http;
#[cfg(feature = "prometheus")]
use anyhow::Context as _;

/// Installs the Prometheus recorder; `/metrics` renders its text.
#[cfg(feature = "prometheus")]
pub(crate) fn install_prometheus() -> anyhow::Result<Option<http::Render>> {
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
pub(crate) fn install_prometheus() -> anyhow::Result<Option<http::Render>> {
    tracing::warn!(
        "built without the `prometheus` feature: --metrics-addr serves /healthz and /readyz only"
    );
    Ok(None)
}
