//! `outbox-relay status [--json] [--watch [SECS]]`: the store's counts for
//! the selected group, and for the PostgreSQL event log every consumer
//! group per shard (pending, lag, retry lane, parked keys, owner), dead
//! letters by code, which group holds rotation back, the relays holding
//! leases, and what holds the database horizon back.
//!
//! `--json` prints one JSON document (its fields are documented in the
//! crate README, "`status --json`"); with `--watch` one document per line
//! every SECS seconds. A field that does not apply to the store (e.g.
//! `groups` of a SQLite store) is `null`, never missing.
//!
//! Over several stores (`--store NAME=URL` repeated, `--stores FILE`, as
//! `run` takes them) each store's status comes under a heading with its
//! name, never its URL (`--json`: `{"stores": [...]}`, one document per
//! store whose `store` field is its name). A store that cannot be read
//! shows its error (passwords scrubbed) in its section; the others are
//! shown all the same, and the command then fails, naming it.

use crate::any::AnyStore;
use crate::config::stores::StoreSpec;
use crate::config::{Resolved, StoreArgs};
use anyhow::{bail, Context as _};
use clap::Args;
use outbox_core::{redact_url, Store};
use serde_json::{json, Value};
use std::io::IsTerminal as _;
use std::time::Duration;

/// `status`.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// A running relay's `--metrics-addr` (host:port) whose sink and store
    /// state to show, read from its `/readyz`. Repeatable.
    #[arg(long = "relay", value_name = "ADDR")]
    relays: Vec<String>,
    /// One JSON document instead of text (fields: see the README).
    #[arg(long)]
    json: bool,
    /// Show it again every SECS seconds (default 2) until Ctrl-C.
    #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2",
          value_parser = clap::value_parser!(u64).range(1..))]
    watch: Option<u64>,
}

/// Runs `status`.
pub(crate) async fn run(args: StatusArgs, secrets: &mut Vec<String>) -> anyhow::Result<()> {
    if let Some(specs) = crate::config::stores::plan(&args.store.resolve()?)? {
        return several(specs, &args, secrets).await;
    }
    let (store, url) = crate::open::store(&args.store, secrets).await?;
    let Some(every) = args.watch else {
        let doc = collect(&store, &url, &args.relays).await?;
        print(&doc, args.json);
        if !args.json {
            println!("{}", crate::control::status_line(&store).await);
        }
        return Ok(());
    };
    let clear = !args.json && std::io::stdout().is_terminal();
    let stop = tokio::signal::ctrl_c();
    tokio::pin!(stop);
    loop {
        let shown = collect(&store, &url, &args.relays).await;
        if clear {
            // Clear the screen, cursor home.
            print!("\x1b[2J\x1b[H");
        }
        match shown {
            Ok(doc) => {
                print(&doc, args.json);
                if !args.json {
                    println!("{}", crate::control::status_line(&store).await);
                }
            }
            // A database restart must not end the watch: say so, go on.
            Err(e) => {
                let text = crate::report::render(&e, secrets);
                if args.json {
                    println!("{}", json!({ "error": text }));
                } else {
                    println!("error: {text}");
                }
            }
        }
        tokio::select! {
            _ = &mut stop => return Ok(()),
            () = tokio::time::sleep(Duration::from_secs(every)) => {}
        }
    }
}

/// The longest `status` waits for one store of several (opened and
/// read): a store that does not answer is shown as such, not waited for.
const STORE_WAIT: Duration = Duration::from_secs(30);

/// One store of `status` over several: its name, its settings, and the
/// store once it could be opened (opened again on the next `--watch` round
/// when it could not).
struct Named {
    name: String,
    resolved: Resolved,
    store: Option<AnyStore>,
}

/// `status` over several stores: each store's section under its name,
/// every store shown even when another is down; fails (after showing them
/// all) when a store could not be read, unless `--watch`.
async fn several(
    specs: Vec<StoreSpec>,
    args: &StatusArgs,
    secrets: &mut Vec<String>,
) -> anyhow::Result<()> {
    let mut stores: Vec<Named> = specs
        .into_iter()
        .map(|spec| {
            secrets.extend(spec.resolved.secrets());
            // A store's section names it, never its URL, not even in an
            // error a driver wrote.
            if let Ok(url) = spec.resolved.store_url() {
                secrets.push(url);
            }
            Named {
                name: spec.name.to_string(),
                resolved: spec.resolved,
                store: None,
            }
        })
        .collect();
    let clear = args.watch.is_some() && !args.json && std::io::stdout().is_terminal();
    let stop = tokio::signal::ctrl_c();
    tokio::pin!(stop);
    loop {
        let shown = read_all(&mut stores, &args.relays, secrets).await;
        if clear {
            // Clear the screen, cursor home.
            print!("\x1b[2J\x1b[H");
        }
        let failed: Vec<&str> = shown
            .iter()
            .filter(|(_, r)| r.is_err())
            .map(|(name, _)| name.as_str())
            .collect();
        if args.json {
            let docs: Vec<Value> = shown
                .iter()
                .map(|(name, r)| match r {
                    Ok((doc, _)) => doc.clone(),
                    Err(e) => json!({ "store": name, "error": e }),
                })
                .collect();
            println!("{}", json!({ "stores": docs }));
        } else {
            for (name, r) in &shown {
                println!("== store {name} ==");
                match r {
                    Ok((doc, paused)) => {
                        print!("{}", text(doc));
                        println!("{paused}");
                    }
                    Err(e) => println!("unreachable: {e}"),
                }
            }
        }
        let Some(every) = args.watch else {
            if failed.is_empty() {
                return Ok(());
            }
            bail!(
                "{} of {} stores could not be read: {}",
                failed.len(),
                shown.len(),
                failed.join(", ")
            );
        };
        tokio::select! {
            _ = &mut stop => return Ok(()),
            () = tokio::time::sleep(Duration::from_secs(every)) => {}
        }
    }
}

/// Every store's status document (its `store` field its name) and pause
/// line, read at the same time, in the order given; a store that cannot be
/// opened or read gives its error, scrubbed of `secrets`.
async fn read_all(
    stores: &mut [Named],
    relays: &[String],
    secrets: &[String],
) -> Vec<(String, Result<(Value, String), String>)> {
    let reads: Vec<_> = stores
        .iter()
        .map(|s| {
            let (name, resolved, store) = (s.name.clone(), s.resolved.clone(), s.store.clone());
            let relays = relays.to_vec();
            tokio::spawn(async move {
                let read = async {
                    let store = match store {
                        Some(store) => store,
                        None => crate::open::resolved_store(&resolved).await?.0,
                    };
                    let read = collect(&store, "", &relays).await;
                    Ok::<_, anyhow::Error>((store, read))
                };
                match tokio::time::timeout(STORE_WAIT, read).await {
                    Ok(Ok((store, Ok(mut doc)))) => {
                        doc["store"] = json!(name);
                        let paused = crate::control::status_line(&store).await;
                        (Some(store), Ok((doc, paused)))
                    }
                    Ok(Ok((store, Err(e)))) => (Some(store), Err(e)),
                    Ok(Err(e)) => (None, Err(e)),
                    Err(_) => (
                        None,
                        Err(anyhow::anyhow!(
                            "no answer within {} s",
                            STORE_WAIT.as_secs()
                        )),
                    ),
                }
            })
        })
        .collect();
    let mut shown = Vec::with_capacity(stores.len());
    for (named, read) in stores.iter_mut().zip(reads) {
        let (store, result) = match read.await {
            Ok(done) => done,
            Err(e) => (
                None,
                Err(anyhow::anyhow!("the read of this store failed: {e}")),
            ),
        };
        if store.is_some() {
            named.store = store;
        }
        shown.push((
            named.name.clone(),
            result.map_err(|e| crate::report::render(&e, secrets)),
        ));
    }
    shown
}

fn print(doc: &Value, as_json: bool) {
    if as_json {
        println!("{doc}");
    } else {
        print!("{}", text(doc));
    }
}

fn secs(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| {
        json!((d.as_secs_f64() * 1000.0).round() / 1000.0)
    })
}

/// The status document (the JSON form; the text form is rendered from it).
pub(crate) async fn collect(
    store: &AnyStore,
    url: &str,
    relays: &[String],
) -> anyhow::Result<Value> {
    let stats = store.stats().await.context("cannot read stats")?;
    let mut doc = json!({
        "store": redact_url(url),
        "mode": mode(store),
        "group": Value::Null,
        "pending": stats.pending,
        "in_flight": stats.in_flight,
        "dead": stats.dead,
        "oldest_secs": secs(stats.oldest_pending_age),
        "groups": Value::Null,
        "relays": Value::Null,
        "horizon": Value::Null,
        "log": Value::Null,
        "sinks": Value::Null,
    });
    #[cfg(feature = "postgres")]
    if let AnyStore::PgLog(log) = store {
        log_status(log, &mut doc).await?;
    }
    if !relays.is_empty() {
        let mut sinks = Vec::new();
        for addr in relays {
            sinks.push(json!({ "addr": addr, "state": crate::http::relay_status(addr).await }));
        }
        doc["sinks"] = Value::Array(sinks);
    }
    Ok(doc)
}

fn mode(store: &AnyStore) -> &'static str {
    match *store {
        #[cfg(feature = "sqlite")]
        AnyStore::Sqlite(_) => "sqlite",
        #[cfg(feature = "postgres")]
        AnyStore::Postgres(_) => "queue",
        #[cfg(feature = "postgres")]
        AnyStore::PgLog(_) => "log",
    }
}

/// The event log's groups, relays, horizon and partitions.
#[cfg(feature = "postgres")]
async fn log_status(log: &outbox_postgres::PgLogStore, doc: &mut Value) -> anyhow::Result<()> {
    let context = "cannot read the event log's status";
    doc["group"] = json!(log.group());
    let mut groups = log.groups().await.context(context)?;
    // The selected group is shown even before it has any row.
    if !groups.iter().any(|g| g.name == log.group()) {
        let name = outbox_postgres::GroupName::new(log.group()).context(context)?;
        groups.push(log.group_status(&name).await.context(context)?);
        groups.sort_by(|a, b| a.name.cmp(&b.name));
    }
    let generation = groups.first().map(|g| g.status.log.clone());
    let held_by: Vec<&str> = groups
        .iter()
        .filter(|g| g.holds_rotation.is_some())
        .map(|g| g.name.as_str())
        .collect();
    doc["groups"] = groups.iter().map(group_json).collect();
    let info = match generation {
        Some(info) => info,
        None => log.log_info().await.context(context)?,
    };
    let hold = log.rotation_hold().await.context(context)?;
    doc["log"] = json!({
        "generation": info.generation,
        "rotations": info.rotations,
        "switched_at": info.switched_at.to_rfc3339(),
        "rotation_held_by": held_by,
        "next_partition": hold.partition,
        "rotation_due_at": hold.due_at.to_rfc3339(),
        "rotation_held_by_session": hold.held_by.as_ref().map(holder_json),
        "rotation_held_since": hold.held_since().map(|t| t.to_rfc3339()),
        "partitions": info.partitions.iter().map(|p| json!({
            "slot": p.slot,
            "current": p.current,
            "live_tuples": p.live_tuples,
            "dead_tuples": p.dead_tuples,
            "bytes": p.bytes,
        })).collect::<Vec<_>>(),
    });
    doc["relays"] = log
        .relays()
        .await
        .context(context)?
        .iter()
        .map(|r| json!({ "relay": r.relay, "group": r.group, "shards": r.shards }))
        .collect();
    let h = log.horizon().await.context(context)?;
    doc["horizon"] = json!({
        "oldest_transaction": h.oldest_transaction.as_ref().map(|t| json!({
            "age_secs": secs(Some(t.age)),
            "pid": t.pid,
            "application_name": t.application_name,
            "state": t.state,
            "writer": t.writer,
        })),
        "replication_slots": h.slots.iter().map(|s| json!({
            "name": s.name,
            "type": s.slot_type,
            "active": s.active,
            "xmin_age": s.xmin_age,
            "catalog_xmin_age": s.catalog_xmin_age,
        })).collect::<Vec<_>>(),
        "prepared_transactions": h.prepared,
        "oldest_prepared_secs": secs(h.oldest_prepared),
    });
    Ok(())
}

/// A session (or prepared transaction) holding the partition the next
/// rotation truncates.
#[cfg(feature = "postgres")]
fn holder_json(h: &outbox_postgres::PartitionHolder) -> Value {
    json!({
        "pid": h.pid,
        "application_name": h.application_name,
        "state": h.state,
        "backend_type": h.backend_type,
        "since": h.since.map(|t| t.to_rfc3339()),
        "gid": h.gid,
        "modes": h.modes,
        "writer": h.is_writer(),
        "held_secs": secs(Some(h.held_for)),
    })
}

/// One group as JSON (also `group list --json`).
#[cfg(feature = "postgres")]
pub(crate) fn group_json(g: &outbox_postgres::GroupStatus) -> Value {
    json!({
        "name": g.name,
        "pending": g.pending(),
        "lag_secs": secs(g.lag()),
        "retry_lane": g.lane(),
        "parked_keys": g.parked_keys(),
        "dead": g.status.dead,
        "dead_by_code": g.dead_by_code,
        "holds_rotation": g.holds_rotation.is_some(),
        "rotation_held_because": g.holds_rotation,
        "shards": g.status.shards.iter().map(|s| json!({
            "shard": s.cursor.shard.to_string(),
            "pending": s.pending,
            "lag_secs": secs(s.lag),
            "retry_lane": s.lane,
            "parked_keys": s.parked_keys,
            "owner": s.cursor.owner,
            "leased": s.cursor.leased,
            "lease_until": s.cursor.lease_until.map(|t| t.to_rfc3339()),
            "epoch": s.cursor.epoch,
            "updated_at": s.cursor.updated_at.to_rfc3339(),
        })).collect::<Vec<_>>(),
    })
}

fn num(v: &Value) -> String {
    match v {
        Value::Null => "-".to_owned(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn lag(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| "-".to_owned(), |s| format!("{s:.1}s"))
}

/// The text form of the document.
fn text(doc: &Value) -> String {
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    line(format!("store:      {}", num(&doc["store"])));
    line(format!("pending:    {}", num(&doc["pending"])));
    line(format!("in flight:  {}", num(&doc["in_flight"])));
    line(format!("dead:       {}", num(&doc["dead"])));
    line(format!("oldest:     {}", lag(&doc["oldest_secs"])));
    if doc["mode"] == "log" {
        line(format!(
            "mode:       log (consumer group {:?}: the counts above)",
            num(&doc["group"])
        ));
        for g in doc["groups"].as_array().into_iter().flatten() {
            let codes: Vec<String> = g["dead_by_code"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(code, n)| format!("{code} {n}"))
                .collect();
            line(format!(
                "group {:?}: pending {}, lag {}, retry lane {}, parked keys {}, dead {}{}{}",
                num(&g["name"]),
                num(&g["pending"]),
                lag(&g["lag_secs"]),
                num(&g["retry_lane"]),
                num(&g["parked_keys"]),
                num(&g["dead"]),
                if codes.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", codes.join(", "))
                },
                match g["rotation_held_because"].as_str() {
                    Some(why) => format!("; holds rotation back: {why}"),
                    None => String::new(),
                },
            ));
            let shards = g["shards"].as_array().map_or(&[][..], Vec::as_slice);
            if shards.is_empty() {
                line("  no cursor yet (no relay of this group has claimed)".to_owned());
            }
            for s in shards {
                let lease = match (s["owner"].as_str(), s["leased"].as_bool()) {
                    (Some(owner), Some(true)) => format!("held by {owner}"),
                    (Some(owner), _) => format!("lapsed (was {owner})"),
                    (None, _) => "none".to_owned(),
                };
                line(format!(
                    "  shard {}:  pending {}, lag {}, retry lane {}, parked keys {}, lease {lease}",
                    num(&s["shard"]),
                    num(&s["pending"]),
                    lag(&s["lag_secs"]),
                    num(&s["retry_lane"]),
                    num(&s["parked_keys"]),
                ));
            }
        }
        let relays: Vec<String> = doc["relays"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                let shards: Vec<String> = r["shards"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(num)
                    .collect();
                format!(
                    "{} (group {:?}: {})",
                    num(&r["relay"]),
                    num(&r["group"]),
                    shards.join(" ")
                )
            })
            .collect();
        line(format!(
            "relays:     {}",
            if relays.is_empty() {
                "none holds a lease".to_owned()
            } else {
                relays.join(", ")
            }
        ));
        let h = &doc["horizon"];
        let oldest = match h["oldest_transaction"].as_object() {
            None => "none".to_owned(),
            Some(t) => format!(
                "{} (pid {}, application {:?}, {}{})",
                lag(&t["age_secs"]),
                num(&t["pid"]),
                num(&t["application_name"]),
                num(&t["state"]),
                if t["writer"] == true { ", writer" } else { "" },
            ),
        };
        line(format!("horizon:    oldest transaction {oldest}"));
        for s in h["replication_slots"].as_array().into_iter().flatten() {
            line(format!(
                "  slot {:?} ({}, {}): xmin age {}, catalog_xmin age {}",
                num(&s["name"]),
                num(&s["type"]),
                if s["active"] == true {
                    "active"
                } else {
                    "inactive"
                },
                num(&s["xmin_age"]),
                num(&s["catalog_xmin_age"]),
            ));
        }
        if h["prepared_transactions"].as_u64().unwrap_or(0) > 0 {
            line(format!(
                "  prepared transactions: {}, oldest {}",
                num(&h["prepared_transactions"]),
                lag(&h["oldest_prepared_secs"])
            ));
        }
        let log = &doc["log"];
        let held: Vec<String> = log["rotation_held_by"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|g| format!("{:?}", num(g)))
            .collect();
        line(format!(
            "log:        generation {}, {} rotation(s), next rotation {}",
            num(&log["generation"]),
            num(&log["rotations"]),
            if held.is_empty() {
                "not held back by any group".to_owned()
            } else {
                format!("held back by group {}", held.join(", "))
            }
        ));
        let session = &log["rotation_held_by_session"];
        if !session.is_null() {
            let who = match (session["pid"].as_i64(), session["gid"].as_str()) {
                (None, Some(gid)) => format!("prepared transaction '{gid}'"),
                (pid, _) => format!(
                    "pid {} ({}, {})",
                    pid.map_or("-".to_owned(), |p| p.to_string()),
                    num(&session["application_name"]),
                    num(&session["state"])
                ),
            };
            line(format!(
                "  rotation of partition {} held back by {who}{}, holding it since {}; held back since {}",
                num(&log["next_partition"]),
                if session["writer"] == true { " (a writer)" } else { "" },
                num(&session["since"]),
                num(&log["rotation_held_since"]),
            ));
        }
    }
    match doc["sinks"].as_array() {
        None => line(
            "sink:       add --relay ADDR (a relay's --metrics-addr) to show its sink state"
                .to_owned(),
        ),
        Some(sinks) => {
            for s in sinks {
                line(num(&s["state"]));
            }
        }
    }
    out
}
