//! The signal that stops a long-running command (`run`, `console`).

use tracing::{info, warn};

/// Completes on SIGINT (Ctrl-C) or SIGTERM.
pub(crate) async fn signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            warn!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => info!("SIGINT received: finishing the in-flight batch, then stopping"),
        () = term => info!("SIGTERM received: finishing the in-flight batch, then stopping"),
    }
}
