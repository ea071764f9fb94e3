//! `outbox-relay group list|drop`: the consumer groups of a PostgreSQL
//! event log. `list` shows each group's lag, pending events, retry lane,
//! dead letters and whether it holds rotation back; `drop NAME` deletes a
//! group's cursors, retry lane and dead letters after showing them, asking
//! (`y/N`) on a terminal unless `--yes`; it refuses while a relay holds a
//! lease on one of the group's cursors unless `--force` (a running relay
//! of a dropped group refuses to claim; restarted, it starts the group as
//! new). Its control row (a pause) and relay rows go with it.

#[cfg(feature = "postgres")]
use crate::any::AnyStore;
use crate::config::StoreArgs;
use anyhow::bail;
#[cfg(feature = "postgres")]
use anyhow::Context as _;
use clap::{Args, Subcommand};
#[cfg(feature = "postgres")]
use std::io::IsTerminal as _;

/// `group ...`.
#[derive(Debug, Subcommand)]
pub(crate) enum GroupCommand {
    /// List the consumer groups: shards, pending, lag, retry lane, dead
    /// letters, and whether each holds rotation back.
    List(ListArgs),
    /// Delete a consumer group: its cursors, retry lane and dead letters.
    Drop(DropArgs),
}

/// `group list`.
#[derive(Debug, Args)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// One JSON array of groups (the `groups` of `status --json`).
    #[arg(long)]
    json: bool,
}

/// `group drop NAME`.
#[derive(Debug, Args)]
pub(crate) struct DropArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The group to drop.
    #[arg(value_name = "NAME")]
    name: String,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    yes: bool,
    /// Drop it even while relays hold leases on its cursors (they refuse
    /// to claim from then on; restarted, they start the group as new).
    #[arg(long)]
    force: bool,
}

/// Runs a `group` command.
pub(crate) async fn run(command: GroupCommand, secrets: &mut Vec<String>) -> anyhow::Result<()> {
    let store_args = match &command {
        GroupCommand::List(a) => &a.store,
        GroupCommand::Drop(a) => &a.store,
    };
    let (store, _) = crate::open::store(store_args, secrets).await?;
    #[cfg(feature = "postgres")]
    if let AnyStore::PgLog(log) = &store {
        return match command {
            GroupCommand::List(args) => list(log, args.json).await,
            GroupCommand::Drop(args) => drop_group(log, &args).await,
        };
    }
    let _ = store;
    bail!(
        "consumer groups exist only in the PostgreSQL event log (`postgres://` with `--pg-mode log`, the default)"
    )
}

#[cfg(feature = "postgres")]
async fn list(log: &outbox_postgres::PgLogStore, as_json: bool) -> anyhow::Result<()> {
    let groups = log
        .groups()
        .await
        .context("cannot read the consumer groups")?;
    if as_json {
        let all: Vec<serde_json::Value> = groups.iter().map(crate::status::group_json).collect();
        println!("{}", serde_json::Value::Array(all));
        return Ok(());
    }
    if groups.is_empty() {
        println!("(no consumer group: no relay has claimed yet)");
        return Ok(());
    }
    println!(
        "{:<24} {:>6} {:>9} {:>9} {:>6} {:>6} {:>6}  ROTATION",
        "GROUP", "SHARDS", "PENDING", "LAG", "LANE", "PARKED", "DEAD"
    );
    for g in &groups {
        println!(
            "{:<24} {:>6} {:>9} {:>9} {:>6} {:>6} {:>6}  {}",
            g.name,
            g.status.shards.len(),
            g.pending(),
            g.lag()
                .map_or_else(|| "-".to_owned(), |l| format!("{:.1}s", l.as_secs_f64())),
            g.lane(),
            g.parked_keys(),
            g.status.dead,
            match &g.holds_rotation {
                Some(why) => format!("holds it back: {why}"),
                None => "-".to_owned(),
            },
        );
    }
    Ok(())
}

#[cfg(feature = "postgres")]
async fn drop_group(log: &outbox_postgres::PgLogStore, args: &DropArgs) -> anyhow::Result<()> {
    let name = outbox_postgres::GroupName::new(args.name.as_str())
        .map_err(|e| anyhow::anyhow!("invalid group NAME {:?}: {e}", args.name))?;
    let name = name.as_str();
    let what = log
        .group_contents(name)
        .await
        .context("cannot read the consumer group")?;
    if what.is_empty() {
        let known = log.group_names().await.unwrap_or_default();
        bail!(
            "no consumer group {name:?} in this outbox (groups: {})",
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        );
    }
    println!(
        "would drop group {name:?}: {} cursor(s), {} retry-lane row(s), {} dead letter(s)",
        what.cursors, what.lane, what.dead
    );
    let refuse = |by: &[String]| {
        anyhow::anyhow!(
            "relay(s) {} hold leases on group {name:?}'s cursors: stop them first (a running relay refuses to claim once its group is dropped), or pass --force",
            by.join(", ")
        )
    };
    if !what.leased_by.is_empty() && !args.force {
        return Err(refuse(&what.leased_by));
    }
    if !args.yes {
        if !std::io::stdin().is_terminal() {
            bail!(
                "refusing to drop group {name:?} without confirmation: standard input is not a terminal; pass --yes to confirm"
            );
        }
        if !crate::dead::ask(&format!("drop group {name:?}? [y/N] ")).await? {
            println!("cancelled: nothing changed");
            return Ok(());
        }
    }
    // The lease check is repeated inside the drop's own transaction: a
    // relay that took a lease since the question above keeps its group.
    let done = match log
        .drop_group(name, args.force)
        .await
        .context("cannot drop the consumer group")?
    {
        outbox_postgres::GroupDrop::Dropped(done) => done,
        outbox_postgres::GroupDrop::Leased { by } => return Err(refuse(&by)),
        other => bail!("unexpected outcome of dropping group {name:?}: {other:?}"),
    };
    println!(
        "dropped group {name:?}: {} cursor(s), {} retry-lane row(s), {} dead letter(s), {} control row(s), {} relay row(s)",
        done.cursors, done.lane, done.dead, done.control, done.relays
    );
    Ok(())
}
