//! The pages' bodies, rendered from the `status` document (the same one
//! `outbox-relay status --json` prints), the store's dead letters and the
//! heads of its retry lane.

use super::groups::groups_of;
use super::html::{chart, duration, enc, esc, table, Viewer};
use super::params::DeadParams;
use super::samples::{Samples, WINDOW};
use outbox_core::{DeadLetter, EventId, HeadState, HeldKeys, Paused};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;

fn opt(n: Option<u64>) -> String {
    n.map_or_else(|| "-".to_owned(), |n| n.to_string())
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `since 2024-05-01T10:00:00Z by alice: deploy`.
fn pause_text(p: &Paused) -> String {
    crate::control::describe(p)
}

/// The pause / resume form of one group.
fn pause_form(base: &str, group: &str, paused: bool, viewer: &Viewer<'_>) -> String {
    if !viewer.can_act() {
        return String::new();
    }
    let csrf = viewer.csrf_field();
    let g = esc(group);
    if paused {
        format!(
            r#"<form method="post" action="{base}/groups/resume" class="inline">{csrf}<input type="hidden" name="group" value="{g}"><button type="submit" data-test="resume-{g}">Resume</button></form>"#
        )
    } else {
        format!(
            r#"<form method="post" action="{base}/groups/pause" class="inline">{csrf}<input type="hidden" name="group" value="{g}"><input name="reason" placeholder="reason" required maxlength="500" aria-label="reason to pause {g}"><button type="submit" data-test="pause-{g}">Pause</button></form>"#
        )
    }
}

/// The overview page's body; its links start with `base` (the store's
/// prefix, [`super::state::Console::base`]), as every page's do.
pub(crate) fn overview(
    base: &str,
    doc: &Value,
    paused: &BTreeMap<String, Option<Paused>>,
    samples: &Samples,
    sample_secs: u64,
    viewer: &Viewer<'_>,
) -> String {
    let mut out = String::new();
    let groups = groups_of(doc);
    let _ = write!(
        out,
        r#"<section class="cards">
<div class="card"><span class="label">store</span><span class="value">{mode}</span></div>
<div class="card"><span class="label">groups</span><span class="value">{n}</span></div>
<div class="card"><span class="label">events behind (all groups)</span><span class="value" id="total-pending">{pending}</span></div>
<div class="card"><span class="label">largest lag</span><span class="value">{lag}</span></div>
<div class="card"><span class="label">dead letters</span><span class="value">{dead}</span></div>
<div class="card"><span class="label">paused groups</span><span class="value">{npaused}</span></div>
</section>"#,
        mode = esc(&text(&doc["mode"])),
        n = groups.len(),
        pending = groups.iter().map(|g| g.pending).sum::<u64>(),
        lag = esc(&duration(
            groups.iter().filter_map(|g| g.lag_secs).reduce(f64::max)
        )),
        dead = groups.iter().map(|g| g.dead).sum::<u64>(),
        npaused = paused.values().filter(|p| p.is_some()).count(),
    );
    out.push_str("<h2>Consumer groups</h2>");
    let rows: Vec<String> = groups
        .iter()
        .map(|g| {
            let p = paused.get(&g.name).cloned().flatten();
            let state = match &p {
                Some(p) => format!(
                    r#"<span class="badge warn">paused</span> <span class="small">{}</span>"#,
                    esc(&pause_text(p))
                ),
                None => r#"<span class="badge ok">running</span>"#.to_owned(),
            };
            let codes: Vec<String> = g
                .dead_by_code
                .iter()
                .map(|(c, n)| {
                    format!(
                        r#"<a href="{base}/dead?group={}&amp;code={}">{} {n}</a>"#,
                        enc(&g.name),
                        enc(c),
                        esc(c)
                    )
                })
                .collect();
            let rotation = match &g.holds_rotation {
                Some(why) => format!(
                    r#"<span class="badge warn">holds rotation back</span> <span class="small">{}</span>"#,
                    esc(why)
                ),
                None => "-".to_owned(),
            };
            format!(
                r#"<td data-label="group"><strong>{name}</strong></td><td data-label="events behind" class="num" data-test="pending">{pending}</td><td data-label="lag" class="num" data-test="lag">{lag}</td><td class="num"><a href="{base}/lane?group={gq}">{lane}</a></td><td class="num"><a href="{base}/lane?group={gq}">{parked}</a></td><td class="num"><a href="{base}/dead?group={gq}">{dead}</a> <span class="small">{codes}</span></td><td>{rotation}</td><td>{state}</td><td>{form}</td>"#,
                name = esc(&g.name),
                gq = enc(&g.name),
                pending = g.pending,
                lag = esc(&duration(g.lag_secs)),
                lane = opt(g.retry_lane),
                parked = opt(g.parked_keys),
                dead = g.dead,
                codes = codes.join(", "),
                form = pause_form(base, &g.name, p.is_some(), viewer),
            )
        })
        .collect();
    out.push_str(&table(
        "groups",
        &[
            "Group",
            "Events behind",
            "Oldest pending (lag)",
            "Retry lane",
            "Parked keys",
            "Dead letters",
            "Rotation",
            "State",
            "",
        ],
        &rows,
    ));
    if !viewer.can_act() {
        out.push_str(match viewer {
            Viewer::ReadOnly => r#"<p class="muted small">Read-only: start the console with <code>--admin-token-file</code> or <code>--admin-token-env</code> to pause, resume, replay or purge.</p>"#,
            _ => r#"<p class="muted small"><a href="/login">Log in</a> with the admin token to pause, resume, replay or purge.</p>"#,
        });
    }

    out.push_str("<h2>Last hour</h2>");
    if samples.len() < 2 {
        let _ = write!(
            out,
            r#"<p class="muted">Collecting samples (one every {sample_secs} s, kept in memory for an hour): the charts appear with the second one.</p>"#
        );
    } else {
        out.push_str(r#"<div class="charts">"#);
        let window = WINDOW.as_secs_f64();
        out.push_str(&chart(
            "Lag: oldest pending event (seconds)",
            "s",
            window,
            &samples.series(|p| p.lag_secs),
        ));
        out.push_str(&chart(
            "Events behind",
            "",
            window,
            &samples.series(|p| p.pending as f64),
        ));
        if let Some(t) = samples.throughput() {
            out.push_str(&chart(
                "Throughput: events delivered per second",
                "/s",
                window,
                &[t],
            ));
        } else {
            out.push_str(r#"<p class="muted small">Throughput: start the console with <code>--relay ADDR</code> (a relay's <code>--metrics-addr</code>) to chart its delivered events per second.</p>"#);
        }
        out.push_str("</div>");
    }

    out.push_str("<h2>Relays' sinks</h2>");
    match doc["sinks"].as_array() {
        Some(sinks) if !sinks.is_empty() => {
            out.push_str("<ul>");
            for s in sinks {
                let _ = write!(out, "<li><code>{}</code></li>", esc(&text(&s["state"])));
            }
            out.push_str("</ul>");
        }
        _ => out.push_str(r#"<p class="muted">No relay to ask: start the console with <code>--relay ADDR</code> (a running relay's <code>--metrics-addr</code>, repeatable) to show each relay's sink state from its <code>/readyz</code>.</p>"#),
    }

    if doc["mode"] == "log" {
        out.push_str("<h2>Rotation and horizon</h2>");
        let log = &doc["log"];
        let held: Vec<String> = log["rotation_held_by"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|g| format!("<strong>{}</strong>", esc(&text(g))))
            .collect();
        let _ = write!(
            out,
            r#"<p data-test="rotation">Log generation {gen}, {rot} rotation(s), current partition since {since}. Next rotation: {held}.</p>"#,
            gen = esc(&text(&log["generation"])),
            rot = esc(&text(&log["rotations"])),
            since = esc(&text(&log["switched_at"])),
            held = if held.is_empty() {
                "not held back by any group".to_owned()
            } else {
                format!("held back by group {}", held.join(", "))
            }
        );
        let parts: Vec<String> = log["partitions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                format!(
                    r#"<td class="num">{}</td><td>{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td>"#,
                    esc(&text(&p["slot"])),
                    if p["current"] == true { "current" } else { "" },
                    esc(&text(&p["live_tuples"])),
                    esc(&text(&p["dead_tuples"])),
                    esc(&text(&p["bytes"])),
                )
            })
            .collect();
        out.push_str(&table(
            "partitions",
            &["Partition", "", "Live rows (est.)", "Dead rows", "Bytes"],
            &parts,
        ));
        let h = &doc["horizon"];
        let oldest = match h["oldest_transaction"].as_object() {
            None => "none".to_owned(),
            Some(t) => format!(
                "{} old (pid {}, application {}, {}{})",
                duration(t.get("age_secs").and_then(Value::as_f64)),
                text(&t["pid"]),
                text(&t["application_name"]),
                text(&t["state"]),
                if t.get("writer") == Some(&Value::Bool(true)) {
                    ", writer"
                } else {
                    ""
                },
            ),
        };
        let _ = write!(out, "<p>Oldest open transaction: {}.</p>", esc(&oldest));
        let slots: Vec<String> = h["replication_slots"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                format!(
                    "<td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>",
                    esc(&text(&s["name"])),
                    esc(&text(&s["type"])),
                    if s["active"] == true { "active" } else { "inactive" },
                    esc(&text(&s["xmin_age"])),
                    esc(&text(&s["catalog_xmin_age"])),
                )
            })
            .collect();
        if !slots.is_empty() {
            out.push_str(&table(
                "slots",
                &[
                    "Replication slot",
                    "Type",
                    "",
                    "xmin age",
                    "catalog xmin age",
                ],
                &slots,
            ));
        }
    }
    out
}

/// One store of the index of a console over several: its name and its
/// `status` document, or why it could not be read.
#[derive(Debug)]
pub(crate) struct IndexRow {
    pub(crate) name: String,
    pub(crate) status: Result<Value, String>,
}

/// The index of a console over several stores: one row per store, by
/// name, linking to its pages, with its headline (events behind, largest
/// lag, dead letters, over its groups).
pub(crate) fn index(rows: &[IndexRow]) -> String {
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            let link = format!(
                r#"<td data-label="store"><a href="/stores/{0}" data-test="store-{0}"><strong>{0}</strong></a></td>"#,
                esc(&r.name)
            );
            match &r.status {
                Ok(doc) => {
                    let groups = groups_of(doc);
                    format!(
                        r#"{link}<td>{mode}</td><td class="num">{n}</td><td class="num" data-test="pending-{name}">{pending}</td><td class="num">{lag}</td><td class="num"><a href="/stores/{name}/dead">{dead}</a></td><td><span class="badge ok">answers</span></td>"#,
                        name = esc(&r.name),
                        mode = esc(&text(&doc["mode"])),
                        n = groups.len(),
                        pending = groups.iter().map(|g| g.pending).sum::<u64>(),
                        lag = esc(&duration(
                            groups.iter().filter_map(|g| g.lag_secs).reduce(f64::max)
                        )),
                        dead = groups.iter().map(|g| g.dead).sum::<u64>(),
                    )
                }
                Err(e) => format!(
                    r#"{link}<td colspan="5" class="msg" data-test="down-{name}">{e}</td><td><span class="badge bad">unreachable</span></td>"#,
                    name = esc(&r.name),
                    e = esc(e),
                ),
            }
        })
        .collect();
    table(
        "stores",
        &[
            "Store",
            "Mode",
            "Groups",
            "Events behind (all groups)",
            "Largest lag",
            "Dead letters",
            "",
        ],
        &rows,
    )
}

/// The shards & relays page's body.
pub(crate) fn shards(doc: &Value) -> String {
    let mut out = String::new();
    if doc["mode"] != "log" {
        let _ = write!(
            out,
            r#"<p>This store ({}) has no shard cursors: relays lease events one by one. Pending {}, in flight {}, oldest {}.</p>"#,
            esc(&text(&doc["mode"])),
            esc(&text(&doc["pending"])),
            esc(&text(&doc["in_flight"])),
            esc(&duration(doc["oldest_secs"].as_f64())),
        );
        return out;
    }
    out.push_str("<h2>Relays</h2>");
    let relays: Vec<String> = doc["relays"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let shards: Vec<String> = r["shards"]
                .as_array()
                .into_iter()
                .flatten()
                .map(text)
                .collect();
            format!(
                r#"<td><strong>{}</strong></td><td>{}</td><td class="num">{}</td><td class="small">{}</td>"#,
                esc(&text(&r["relay"])),
                esc(&text(&r["group"])),
                shards.len(),
                esc(&shards.join(" ")),
            )
        })
        .collect();
    if relays.is_empty() {
        out.push_str(r#"<p class="muted">No relay holds a lease.</p>"#);
    } else {
        out.push_str(&table(
            "relays",
            &["Relay", "Group", "Shards held", "Which"],
            &relays,
        ));
    }
    for g in groups_of(doc) {
        let _ = write!(out, "<h2>Group {}</h2>", esc(&g.name));
        if g.shards.is_empty() {
            out.push_str(
                r#"<p class="muted">No cursor yet: no relay of this group has claimed.</p>"#,
            );
            continue;
        }
        let rows: Vec<String> = g
            .shards
            .iter()
            .map(|s| {
                let lease = match (s["owner"].as_str(), s["leased"].as_bool()) {
                    (Some(_), Some(true)) => r#"<span class="badge ok">held</span>"#,
                    (Some(_), _) => r#"<span class="badge warn">lapsed</span>"#,
                    (None, _) => r#"<span class="badge">none</span>"#,
                };
                format!(
                    r#"<td>{}</td><td>{}</td><td>{lease}</td><td class="small">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="small">{}</td>"#,
                    esc(&text(&s["shard"])),
                    esc(&text(&s["owner"])),
                    esc(&text(&s["lease_until"])),
                    esc(&text(&s["pending"])),
                    esc(&duration(s["lag_secs"].as_f64())),
                    esc(&text(&s["retry_lane"])),
                    esc(&text(&s["parked_keys"])),
                    esc(&text(&s["epoch"])),
                    esc(&text(&s["updated_at"])),
                )
            })
            .collect();
        out.push_str(&table(
            "shards",
            &[
                "Shard",
                "Owner",
                "Lease",
                "Lease until",
                "Events behind",
                "Lag",
                "Retry lane",
                "Parked keys",
                "Epoch",
                "Position moved",
            ],
            &rows,
        ));
    }
    out
}

/// The dead letters page: the filter form, the count, one page of rows
/// with selection boxes, and the links to the next page.
pub(crate) fn dead_list(
    base: &str,
    params: &DeadParams,
    groups: &[String],
    total: u64,
    rows: &[DeadLetter],
    next: Option<EventId>,
    viewer: &Viewer<'_>,
) -> String {
    let mut out = String::new();
    let options = group_options(groups, &params.group);
    let val = |v: &Option<String>| esc(v.as_deref().unwrap_or(""));
    let _ = write!(
        out,
        r#"<form method="get" action="{base}/dead" class="filters" id="filters">
<label>Group <select name="group">{options}</select></label>
<label>Type <input name="type" value="{t}" placeholder="order.created"></label>
<label>Code <input name="code" value="{c}" placeholder="HANDLER_PERMANENT_FAILURE"></label>
<label>Key <input name="key" value="{k}"></label>
<label>Older than <input name="older_than" value="{o}" placeholder="1h" size="6"></label>
<label>Newer than <input name="newer_than" value="{n}" placeholder="30m" size="6"></label>
<button type="submit">Filter</button> <a href="{base}/dead?group={gq}">clear</a>
</form>"#,
        t = val(&params.event_type),
        c = val(&params.code),
        k = val(&params.key),
        o = val(&params.older_than_text),
        n = val(&params.newer_than_text),
        gq = enc(&params.group),
    );
    let _ = write!(
        out,
        r#"<p><strong data-test="dead-count">{total}</strong> dead letter(s) of group <strong>{}</strong> match{}.{}</p>"#,
        esc(&params.group),
        if params.filter_is_empty() {
            String::new()
        } else {
            format!(" ({})", esc(&params.describe()))
        },
        if total as usize > rows.len() || params.after.is_some() {
            format!(
                " Showing {} from {}.",
                rows.len(),
                match params.after {
                    Some(a) => format!("after {a}"),
                    None => "the first".to_owned(),
                }
            )
        } else {
            String::new()
        }
    );
    if rows.is_empty() {
        out.push_str(r#"<p class="muted">No dead letters.</p>"#);
    } else {
        let act = viewer.can_act();
        if act {
            let _ = write!(
                out,
                r#"<form method="post" action="{base}/dead/confirm" id="select">{}{}"#,
                viewer.csrf_field(),
                params.hidden_fields()
            );
        }
        let rows: Vec<String> = rows
            .iter()
            .map(|d| {
                let e = &d.event;
                let id = e.id.to_string();
                let link = format!("{base}/dead/{}?group={}", enc(&id), enc(&params.group));
                format!(
                    r#"{check}<td><a href="{link}" class="mono">{id}</a></td><td>{ty}</td><td>{key}</td><td>{code}</td><td class="msg">{msg}</td><td class="num">{att}</td><td class="small">{at}</td>"#,
                    check = if act {
                        format!(
                            r#"<td><input type="checkbox" name="id" value="{}" aria-label="select {}"></td>"#,
                            esc(&id),
                            esc(&id)
                        )
                    } else {
                        String::new()
                    },
                    id = esc(&id),
                    ty = esc(&e.event_type),
                    key = esc(e.key.as_deref().unwrap_or("-")),
                    code = esc(d.error.code.as_str()),
                    msg = esc(&truncate(&d.error.message, 160)),
                    att = e.attempts,
                    at = esc(&d.dead_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
                )
            })
            .collect();
        let mut headers = vec![
            "Event id",
            "Type",
            "Key",
            "Code",
            "Final error",
            "Attempts",
            "Dead since",
        ];
        if act {
            headers.insert(
                0,
                r#"<input type="checkbox" id="select-all" aria-label="select all on this page">"#,
            );
        }
        out.push_str(&table("dead", &headers, &rows));
        if act {
            let _ = write!(
                out,
                r#"<p class="actions">
<button type="submit" name="do" value="retry:selected" data-test="replay-selected">Replay selected</button>
<button type="submit" name="do" value="purge:selected" class="danger" data-test="purge-selected">Purge selected</button>
<span class="sep"></span>
<button type="submit" name="do" value="retry:all" data-test="replay-all">Replay all {total} matching</button>
<button type="submit" name="do" value="purge:all" class="danger" data-test="purge-all">Purge all {total} matching</button>
</p></form>"#
            );
        }
    }
    let mut pager = String::new();
    if params.after.is_some() {
        let _ = write!(
            pager,
            r#"<a href="{base}/dead?{}">First page</a> "#,
            esc(&params.query(None))
        );
    }
    if let Some(next) = next {
        let _ = write!(
            pager,
            r#"<a href="{base}/dead?{}" rel="next" data-test="next-page">Next page</a>"#,
            esc(&params.query(Some(next)))
        );
    }
    if !pager.is_empty() {
        let _ = write!(out, r#"<nav class="pager">{pager}</nav>"#);
    }
    out
}

/// The `<option>`s of a group picker, `current` selected.
fn group_options(groups: &[String], current: &str) -> String {
    groups
        .iter()
        .map(|g| {
            format!(
                r#"<option value="{0}"{1}>{0}</option>"#,
                esc(g),
                if g == current { " selected" } else { "" }
            )
        })
        .collect()
}

/// The retry lane page: a group picker, then each head (the event its key
/// waits for, and why) with how many events wait behind it.
pub(crate) fn lane(base: &str, group: &str, groups: &[String], held: &HeldKeys) -> String {
    let mut out = String::new();
    let options = group_options(groups, group);
    let _ = write!(
        out,
        r#"<form method="get" action="{base}/lane" class="filters"><label>Group <select name="group">{options}</select></label> <button type="submit">Show</button></form>
<p><strong data-test="held-count">{total}</strong> head(s) in the retry lane of group <strong>{g}</strong>{shown}. A head is an event that failed and waits for its retry (or is being retried), an event scheduled for later, or a dead letter that blocks its key (dead-head policy <code>block</code>): every later event of its key waits behind it, in order.</p>"#,
        total = held.total,
        g = esc(group),
        shown = if held.total as usize > held.heads.len() {
            format!(
                ", the {} with the most events waiting shown",
                held.heads.len()
            )
        } else {
            String::new()
        },
    );
    if held.heads.is_empty() {
        out.push_str(
            r#"<p class="muted" data-test="lane-empty">Nothing waits: no key is held back.</p>"#,
        );
        return out;
    }
    let time =
        |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let now = chrono::Utc::now();
    let rows: Vec<String> = held
        .heads
        .iter()
        .map(|h| {
            let e = &h.head;
            let id = e.id.to_string();
            let (state, head_cell) = match &h.state {
                HeadState::Dead { dead_at } => (
                    format!(r#"<span class="badge bad">dead, blocks its key</span> <span class="small">since {}</span>"#, esc(&time(*dead_at))),
                    format!(
                        r#"<a href="{base}/dead/{}?group={}" class="mono">{}</a>"#,
                        enc(&id),
                        enc(group),
                        esc(&id)
                    ),
                ),
                HeadState::InFlight { lease_until } => (
                    format!(r#"<span class="badge ok">being retried</span> <span class="small">lease until {}</span>"#, esc(&time(*lease_until))),
                    format!(r#"<span class="mono">{}</span>"#, esc(&id)),
                ),
                HeadState::Retrying { next_attempt_at } if *next_attempt_at <= now => (
                    format!(r#"<span class="badge ok">due</span> <span class="small">the next claim takes it (since {})</span>"#, esc(&time(*next_attempt_at))),
                    format!(r#"<span class="mono">{}</span>"#, esc(&id)),
                ),
                HeadState::Retrying { next_attempt_at } => (
                    format!(r#"<span class="badge warn">waits</span> <span class="small">next attempt {}</span>"#, esc(&time(*next_attempt_at))),
                    format!(r#"<span class="mono">{}</span>"#, esc(&id)),
                ),
            };
            let error = h.last_error().map_or_else(
                || "-".to_owned(),
                |l| format!("{}: {}", esc(l.code.as_str()), esc(&truncate(&l.message, 160))),
            );
            format!(
                r#"<td data-test="held-key">{key}</td><td>{head_cell}</td><td>{ty}</td><td>{state}</td><td class="num">{att}</td><td class="msg">{error}</td><td class="num" data-test="waiting">{waiting}</td><td class="mono small">{first}</td>"#,
                key = esc(e.key.as_deref().unwrap_or("- (no key)")),
                ty = esc(&e.event_type),
                att = e.attempts,
                waiting = h.waiting,
                first = esc(&h.first_waiting.map_or_else(|| "-".to_owned(), |i| i.to_string())),
            )
        })
        .collect();
    out.push_str(&table(
        "lane",
        &[
            "Key",
            "Head event",
            "Type",
            "State",
            "Attempts",
            "Last error",
            "Waiting behind",
            "Next in line",
        ],
        &rows,
    ));
    out
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(max).collect();
        t.push('…');
        t
    }
}

/// Most payload bytes shown as hex.
const HEX_LIMIT: usize = 4096;

/// One dead letter: its event, headers, payload and final error, and the
/// replay / purge buttons.
pub(crate) fn dead_detail(base: &str, group: &str, d: &DeadLetter, viewer: &Viewer<'_>) -> String {
    let e = &d.event;
    let time =
        |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let mut out = String::new();
    let fields = [
        ("Event id", e.id.to_string()),
        ("Group", group.to_owned()),
        ("Type", e.event_type.clone()),
        ("Topic", e.topic.clone()),
        ("Key", e.key.clone().unwrap_or_else(|| "-".to_owned())),
        ("Attempts", e.attempts.to_string()),
        ("Created", time(e.created_at)),
        ("Dead since", time(d.dead_at)),
        ("Final error code", d.error.code.as_str().to_owned()),
    ];
    out.push_str(r#"<dl class="fields">"#);
    for (k, v) in fields {
        let _ = write!(out, "<dt>{k}</dt><dd>{}</dd>", esc(&v));
    }
    let _ = write!(
        out,
        r#"<dt>Final error</dt><dd><pre data-test="final-error">{}</pre><span class="muted small">The store keeps the final error only, not one per attempt.</span></dd></dl>"#,
        esc(&d.error.message)
    );
    out.push_str("<h2>Headers</h2>");
    if e.headers.is_empty() {
        out.push_str(r#"<p class="muted">(none)</p>"#);
    } else {
        let rows: Vec<String> = e
            .headers
            .iter()
            .map(|(k, v)| {
                format!(
                    "<td class=\"mono\">{}</td><td class=\"mono\">{}</td>",
                    esc(k),
                    esc(v)
                )
            })
            .collect();
        out.push_str(&table("headers", &["Header", "Value"], &rows));
    }
    let p = &e.payload;
    match serde_json::from_slice::<Value>(p) {
        Ok(json) => {
            let pretty = serde_json::to_string_pretty(&json).unwrap_or_default();
            let _ = write!(
                out,
                r#"<h2>Payload <span class="muted small">JSON, {} bytes</span></h2><pre class="payload" data-test="payload">{}</pre>"#,
                p.len(),
                esc(&pretty)
            );
        }
        Err(_) => match std::str::from_utf8(p) {
            Ok(text) => {
                let _ = write!(
                    out,
                    r#"<h2>Payload <span class="muted small">text, not JSON, {} bytes</span></h2><pre class="payload" data-test="payload">{}</pre>"#,
                    p.len(),
                    esc(text)
                );
            }
            Err(_) => {
                let shown = &p[..p.len().min(HEX_LIMIT)];
                let hex: Vec<String> = shown
                    .chunks(32)
                    .map(|row| {
                        row.iter()
                            .map(|b| format!("{b:02x}"))
                            .collect::<Vec<_>>()
                            .join(" ")
                    })
                    .collect();
                let _ = write!(
                    out,
                    r#"<h2>Payload <span class="muted small">binary, {} bytes, hex{}</span></h2><pre class="payload" data-test="payload">{}</pre>"#,
                    p.len(),
                    if p.len() > shown.len() {
                        format!(", first {HEX_LIMIT}")
                    } else {
                        String::new()
                    },
                    esc(&hex.join("\n"))
                );
            }
        },
    }
    if viewer.can_act() {
        let id = esc(&e.id.to_string());
        let _ = write!(
            out,
            r#"<form method="post" action="{base}/dead/confirm" class="actions">{}<input type="hidden" name="group" value="{}"><input type="hidden" name="id" value="{id}">
<button type="submit" name="do" value="retry:selected" data-test="replay-one">Replay this event</button>
<button type="submit" name="do" value="purge:selected" class="danger" data-test="purge-one">Purge this event</button></form>"#,
            viewer.csrf_field(),
            esc(group)
        );
    }
    let _ = write!(
        out,
        r#"<p><a href="{base}/dead?group={}">Back to the dead letters</a></p>"#,
        enc(group)
    );
    out
}

/// What a confirmation page asks.
#[derive(Debug)]
pub(crate) struct Confirm<'a> {
    /// The store's prefix of the form's and the link's paths.
    pub(crate) base: &'a str,
    pub(crate) retry: bool,
    pub(crate) all: bool,
    pub(crate) count: u64,
    pub(crate) params: &'a DeadParams,
}

/// The confirmation page's body: how many, what happens, and the form
/// that does it (carrying the same selection and the count confirmed).
pub(crate) fn confirm(c: &Confirm<'_>, viewer: &Viewer<'_>) -> String {
    let verb = if c.retry { "Replay" } else { "Purge" };
    let what = if c.retry {
        "They go back to pending with their attempts reset, behind the events of their key still pending, and the relays deliver them again."
    } else {
        "They are deleted for good: this cannot be undone."
    };
    let scope = if c.params.filter_is_empty() && c.all {
        "every dead letter".to_owned()
    } else {
        c.params.describe()
    };
    format!(
        r#"<section class="confirm">
<p class="big" data-test="confirm-text">{verb} <strong data-test="confirm-count">{count}</strong> dead letter(s) of group <strong>{group}</strong>?</p>
<p>Selection: {scope}.</p>
<p>{what}</p>
<form method="post" action="{base}/dead/act">{csrf}{hidden}<input type="hidden" name="do" value="{do_}"><input type="hidden" name="expected" value="{count}">
<button type="submit" class="{cls}" data-test="confirm">Yes, {verb_lc} {count}</button> <a href="{base}/dead?{back}" data-test="cancel">Cancel</a>
</form>
</section>"#,
        count = c.count,
        group = esc(&c.params.group),
        scope = esc(&scope),
        csrf = viewer.csrf_field(),
        hidden = c.params.hidden_fields(),
        do_ = if c.retry { "retry" } else { "purge" }.to_owned()
            + if c.all { ":all" } else { ":selected" },
        cls = if c.retry { "" } else { "danger" },
        verb_lc = verb.to_lowercase(),
        back = esc(&c.params.query(None)),
        base = c.base,
    )
}
