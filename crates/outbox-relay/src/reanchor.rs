//! `outbox-relay reanchor --from origin|now`: anchors a PostgreSQL event
//! log's stored positions to the database it is in now, after a
//! switchover, a restore, a copy or a pg_upgrade moved it (relays refuse
//! to claim until then, naming this command). The choice is the
//! operator's: `origin` delivers the whole retained log again
//! (duplicates, nothing lost), `now` skips everything in the log (events
//! not delivered yet are lost). Shows the stored and found identity, asks
//! (`y/N`) on a terminal unless `--yes`.

#[cfg(feature = "postgres")]
use crate::any::AnyStore;
use crate::config::StoreArgs;
use anyhow::bail;
#[cfg(feature = "postgres")]
use anyhow::Context as _;
use clap::{Args, ValueEnum};
#[cfg(feature = "postgres")]
use std::io::IsTerminal as _;

/// `reanchor`.
#[derive(Debug, Args)]
pub(crate) struct ReanchorArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Where every consumer group restarts: `origin` delivers the whole
    /// retained log again (duplicates: consumers drop them by event id);
    /// `now` skips everything in the log (events not delivered yet are
    /// LOST).
    #[arg(long, value_enum, value_name = "origin|now")]
    from: From,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    yes: bool,
}

/// `--from`.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum From {
    /// The retained log again.
    Origin,
    /// Skip to now.
    Now,
}

/// Runs `reanchor`.
pub(crate) async fn run(args: ReanchorArgs, secrets: &mut Vec<String>) -> anyhow::Result<()> {
    let (store, _) = crate::open::store(&args.store, secrets).await?;
    #[cfg(feature = "postgres")]
    if let AnyStore::PgLog(log) = &store {
        return reanchor(log, &args).await;
    }
    let _ = store;
    bail!(
        "reanchor applies to the PostgreSQL event log (`postgres://` with `--pg-mode log`, the default): \
         other stores keep no positions"
    )
}

#[cfg(feature = "postgres")]
async fn reanchor(log: &outbox_postgres::PgLogStore, args: &ReanchorArgs) -> anyhow::Result<()> {
    use outbox_postgres::ReanchorFrom;
    let check = log
        .identity()
        .await
        .context("cannot read the log's identity (is it migrated? run `outbox-relay migrate`)")?;
    match &check.stored {
        Some(stored) if check.matches() => println!(
            "the log's positions already belong to this database ({stored}): re-anchoring only resets them"
        ),
        Some(stored) => println!("the log's positions belong to {stored}; this is {}", check.found),
        None => println!("the log records no database; this is {}", check.found),
    }
    let (from, meaning) = match args.from {
        From::Origin => (
            ReanchorFrom::Origin,
            "every group delivers the whole retained log again (duplicates)",
        ),
        From::Now => (
            ReanchorFrom::Now,
            "every group skips everything in the log: events not delivered yet are LOST",
        ),
    };
    println!("would re-anchor from {from}: {meaning}");
    if !args.yes {
        if !std::io::stdin().is_terminal() {
            bail!(
                "refusing to re-anchor without confirmation: standard input is not a terminal; pass --yes to confirm"
            );
        }
        if !crate::dead::ask("re-anchor? [y/N] ").await? {
            println!("cancelled: nothing changed");
            return Ok(());
        }
    }
    let done = log
        .reanchor(from)
        .await
        .context("cannot re-anchor the log")?;
    let events = match from {
        ReanchorFrom::Origin => {
            format!("{} retained event(s) will be delivered again", done.events)
        }
        _ => format!("{} event(s) in the log skipped", done.events),
    };
    println!(
        "re-anchored to {}: {events}, {} cursor(s) reset, {} retry-lane copy(ies) dropped; running relays resume at their next claim",
        done.identity, done.cursors, done.lane_dropped
    );
    Ok(())
}
