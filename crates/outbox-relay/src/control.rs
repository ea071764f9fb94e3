//! `outbox-relay pause` / `resume`: a consumer group's control row, which
//! running relays re-read about once a second (no restart). A paused
//! group's relays finish and settle what they claimed, then claim nothing
//! until `resume`.

use crate::any::AnyStore;
use crate::config::StoreArgs;
use anyhow::Context as _;
use clap::Args;
use outbox_core::{ControlStore, PauseNote, Paused};

/// `pause` and `resume`.
#[derive(Debug, Args)]
pub(crate) struct PauseArgs {
    /// The store; its `--group` is the consumer group to pause or resume
    /// (default `default`; the PostgreSQL queue table and SQLite have only
    /// that one).
    #[command(flatten)]
    store: StoreArgs,
    /// Why (`pause` only): shown by `status` and `/readyz`.
    #[arg(long, value_name = "TEXT")]
    reason: Option<String>,
    /// Who (`pause` only) [default: $USER].
    #[arg(long, value_name = "WHO")]
    by: Option<String>,
}

/// Pauses (`pause = true`) or resumes the group; prints what it did.
pub(crate) async fn run(
    args: PauseArgs,
    pause: bool,
    secrets: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (store, _url) = crate::open::store(&args.store, secrets).await?;
    let group = store.group().to_owned();
    let mut note = PauseNote::new();
    if let Some(by) = args.by.or_else(|| std::env::var("USER").ok()) {
        note = note.with_by(by);
    }
    if let Some(reason) = args.reason {
        note = note.with_reason(reason);
    }
    let what = if pause { "pause" } else { "resume" };
    let changed = store
        .set_paused(&group, pause, &note)
        .await
        .with_context(|| format!("cannot {what} consumer group {group:?}"))?;
    match (pause, changed) {
        (true, true) => println!(
            "paused consumer group {group:?}: its relays stop claiming within about a second (what they claimed is delivered and settled)"
        ),
        (true, false) => {
            let since = store
                .paused(&group)
                .await
                .ok()
                .flatten()
                .map_or_else(String::new, |p| format!(" ({})", describe(&p)));
            println!("consumer group {group:?} was already paused{since}");
        }
        (false, true) => println!(
            "resumed consumer group {group:?}: its relays claim again within about a second"
        ),
        (false, false) => println!("consumer group {group:?} was not paused"),
    }
    Ok(())
}

/// `since 2024-05-01T10:00:00Z by alice: deploy` (each part when known).
pub(crate) fn describe(p: &Paused) -> String {
    let mut s = format!(
        "since {}",
        p.since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    );
    if let Some(by) = &p.by {
        s.push_str(&format!(" by {by}"));
    }
    if let Some(reason) = &p.reason {
        s.push_str(&format!(": {reason}"));
    }
    s
}

/// The `status` line of the store's group: `paused: no` or `paused: yes
/// (since ...)`.
pub(crate) async fn status_line(store: &AnyStore) -> String {
    let group = store.group();
    match store.paused(group).await {
        Ok(None) => format!("paused:     no (consumer group {group:?})"),
        Ok(Some(p)) => format!(
            "paused:     YES, consumer group {group:?} {}; `outbox-relay resume` to deliver again",
            describe(&p)
        ),
        Err(e) => format!("paused:     unknown ({e}; run `outbox-relay migrate`?)"),
    }
}
