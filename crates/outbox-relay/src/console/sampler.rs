//! The task that takes the charts' samples ([`super::samples`]) every
//! `--sample-secs`: the groups from the store's `status` document and,
//! with `--relay ADDR`, the relays' delivered totals from their `/metrics`.

use super::samples::{delivered_total, group_points};
use super::state::Console;
use crate::http::get_text;
use std::sync::Arc;
use std::time::Duration;

/// Samples every `every` until the runtime stops. A failed read (the store
/// is down) is skipped: the chart shows a gap, not a zero.
pub(crate) async fn run(console: Arc<Console>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let doc = match crate::status::collect(&console.store, &console.store_url, &[]).await {
            Ok(doc) => doc,
            Err(e) => {
                tracing::debug!(error = %crate::report::render(&e, &console.site.secrets), "console: no sample (store unreadable)");
                continue;
            }
        };
        let mut delivered = None;
        for addr in &console.relays {
            if let Ok(Ok(text)) =
                tokio::time::timeout(Duration::from_secs(3), get_text(addr, "/metrics")).await
            {
                if let Some(n) = delivered_total(&text) {
                    delivered = Some(delivered.unwrap_or(0.0) + n);
                }
            }
        }
        console.samples.push(group_points(&doc), delivered);
    }
}
