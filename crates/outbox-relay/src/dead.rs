//! `outbox-relay dead list|show|retry|purge`: dead letters an operator can
//! work with. Filters (`--id`, `--type`, `--code`, `--key`, `--older-than`,
//! `--newer-than`) become one [`DeadLetterFilter`] the store binds as query
//! parameters; ages are measured against the database clock. `retry` and
//! `purge` print how many dead letters they would touch first, then ask
//! (`y/N`) on a terminal; `--yes` skips the question, `--dry-run` stops
//! after the count, and without a terminal and without `--yes` they refuse
//! (a script never hangs on a prompt).

use crate::config::StoreArgs;
use anyhow::{bail, Context as _};
use clap::{Args, Subcommand};
use outbox_core::{
    DeadLetter, DeadLetterFilter, DeadLetterQuery, DeadLetterStore, ErrorCode, EventId,
};
use outbox_worker::JsonLinesSink;
use std::io::IsTerminal as _;
use std::time::Duration;

/// `dead ...`.
#[derive(Debug, Subcommand)]
pub(crate) enum DeadCommand {
    /// List dead letters, oldest id first.
    List(ListArgs),
    /// Show one dead letter: its event, headers, payload and final error.
    Show(ShowArgs),
    /// Replay dead letters: back to pending (attempts reset), behind the
    /// events of their key still pending.
    Retry(ActArgs),
    /// Delete dead letters for good.
    Purge(ActArgs),
}

/// Which dead letters: every criterion given must hold.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct FilterArgs {
    /// Only these event ids (repeat or comma-separate).
    #[arg(long, value_delimiter = ',', value_name = "ID")]
    id: Vec<EventId>,
    /// Only this event type, e.g. order.created.
    #[arg(long = "type", value_name = "TYPE")]
    event_type: Option<String>,
    /// Only this error code, e.g. HANDLER_NOT_REGISTERED.
    #[arg(long)]
    code: Option<String>,
    /// Only this key.
    #[arg(long)]
    key: Option<String>,
    /// Only dead letters dead for at least this long (database clock), e.g. 30m, 1h, 2d, 1h30m.
    #[arg(long, value_name = "AGE", value_parser = parse_age)]
    older_than: Option<Duration>,
    /// Only dead letters dead for less than this long (database clock), e.g. 30m, 1h, 2d.
    #[arg(long, value_name = "AGE", value_parser = parse_age)]
    newer_than: Option<Duration>,
}

impl FilterArgs {
    /// The store's filter.
    fn filter(&self) -> DeadLetterFilter {
        dead_filter(
            &self.id,
            self.event_type.as_deref(),
            self.code.as_deref(),
            self.key.as_deref(),
            self.older_than,
            self.newer_than,
        )
    }
}

/// `dead list`.
#[derive(Debug, Args)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    filter: FilterArgs,
    /// Most rows to show.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// One JSON object per line instead of text.
    #[arg(long)]
    json: bool,
}

/// `dead show ID`.
#[derive(Debug, Args)]
pub(crate) struct ShowArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The dead letter's event id.
    id: EventId,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// `dead retry` and `dead purge`: a selection (`--all`, or at least one
/// filter) and how to confirm it.
#[derive(Debug, Args)]
#[command(group(
    clap::ArgGroup::new("which")
        .required(true)
        .multiple(true)
        .args(["all", "id", "event_type", "code", "key", "older_than", "newer_than"])
))]
pub(crate) struct ActArgs {
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    filter: FilterArgs,
    /// Every dead letter (instead of filters).
    #[arg(long, conflicts_with_all = ["id", "event_type", "code", "key", "older_than", "newer_than"])]
    all: bool,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    yes: bool,
    /// Only print how many dead letters would be touched.
    #[arg(long, conflicts_with = "yes")]
    dry_run: bool,
}

/// Runs a `dead` command.
pub(crate) async fn run(command: DeadCommand, secrets: &mut Vec<String>) -> anyhow::Result<()> {
    match command {
        DeadCommand::List(args) => {
            let (store, _) = crate::open::store(&args.store, secrets).await?;
            let query = DeadLetterQuery {
                filter: args.filter.filter(),
                limit: args.limit,
                after: None,
            };
            let dead = store
                .list_dead(&query)
                .await
                .context("cannot list dead letters")?;
            if args.json {
                for d in &dead {
                    println!("{}", to_json(d)?);
                }
            } else {
                print_dead_letters(&dead);
            }
            Ok(())
        }
        DeadCommand::Show(args) => {
            let (store, _) = crate::open::store(&args.store, secrets).await?;
            let query = DeadLetterQuery {
                filter: DeadLetterFilter::ids([args.id]),
                limit: 1,
                after: None,
            };
            let dead = store
                .list_dead(&query)
                .await
                .context("cannot read the dead letter")?;
            let Some(d) = dead.first() else {
                bail!("no dead letter with id {}", args.id);
            };
            if args.json {
                let line = serde_json::to_string_pretty(&to_json(d)?)?;
                println!("{line}");
            } else {
                print!("{}", show_text(d));
            }
            Ok(())
        }
        DeadCommand::Retry(args) => act(Act::Retry, args, secrets).await,
        DeadCommand::Purge(args) => act(Act::Purge, args, secrets).await,
    }
}

#[derive(Debug, Clone, Copy)]
enum Act {
    Retry,
    Purge,
}

impl Act {
    fn verb(self) -> &'static str {
        match self {
            Act::Retry => "retry",
            Act::Purge => "purge",
        }
    }
}

async fn act(what: Act, args: ActArgs, secrets: &mut Vec<String>) -> anyhow::Result<()> {
    let filter = args.filter.filter();
    if !args.all && filter.is_all() {
        // clap's group makes this unreachable; never turn "no filter" into "all".
        bail!("pass --all or at least one filter (--id, --type, --code, --key, --older-than, --newer-than)");
    }
    let verb = what.verb();
    let (store, _) = crate::open::store(&args.store, secrets).await?;
    let n = store
        .count_dead(&filter)
        .await
        .context("cannot count dead letters")?;
    println!("would {verb} {n} dead letter(s)");
    if args.dry_run || n == 0 {
        return Ok(());
    }
    if !args.yes {
        if !std::io::stdin().is_terminal() {
            bail!(
                "refusing to {verb} {n} dead letter(s) without confirmation: standard input is \
                 not a terminal; pass --yes to confirm, or --dry-run to only count"
            );
        }
        if !ask(&format!("{verb} {n} dead letter(s)? [y/N] ")).await? {
            println!("cancelled: nothing changed");
            return Ok(());
        }
    }
    match what {
        Act::Retry => {
            let moved = store
                .retry_dead(&filter)
                .await
                .context("cannot retry dead letters")?;
            println!("moved {moved} dead letter(s) back to pending");
        }
        Act::Purge => {
            let purged = store
                .purge_dead(&filter)
                .await
                .context("cannot purge dead letters")?;
            println!("purged {purged} dead letter(s)");
        }
    }
    Ok(())
}

/// Asks `question` on stderr and reads one line from stdin: true for `y`
/// or `yes` (any case).
pub(crate) async fn ask(question: &str) -> anyhow::Result<bool> {
    eprint!("{question}");
    let answer = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await
    .context("cannot read the answer")?
    .context("cannot read the answer")?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}

/// The store's filter of the dead-letter criteria the CLI and the console
/// take (ids, type, code, key, ages): every one that is set must hold.
pub(crate) fn dead_filter(
    ids: &[EventId],
    event_type: Option<&str>,
    code: Option<&str>,
    key: Option<&str>,
    older_than: Option<Duration>,
    newer_than: Option<Duration>,
) -> DeadLetterFilter {
    let mut f = DeadLetterFilter::all();
    if !ids.is_empty() {
        f = f.with_ids(ids.iter().copied());
    }
    if let Some(t) = event_type {
        f = f.with_event_type(t.to_owned());
    }
    if let Some(c) = code {
        f = f.with_code(ErrorCode::new(c.to_owned()));
    }
    if let Some(k) = key {
        f = f.with_key(k.to_owned());
    }
    if let Some(d) = older_than {
        f = f.older_than(d);
    }
    if let Some(d) = newer_than {
        f = f.newer_than(d);
    }
    f
}

/// An age: one or more `<number><unit>` with unit `s`, `m`, `h`, `d` or
/// `w`, e.g. `90s`, `30m`, `1h30m`, `2d`.
pub(crate) fn parse_age(text: &str) -> Result<Duration, String> {
    let bad =
        || format!("invalid age {text:?}: use e.g. 30m, 1h, 2d or 1h30m (units s, m, h, d, w)");
    let mut total: u64 = 0;
    let mut digits = String::new();
    let mut parts = 0;
    for c in text.trim().chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit: u64 = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            'w' => 7 * 86_400,
            _ => return Err(bad()),
        };
        let n: u64 = digits.parse().map_err(|_| bad())?;
        total = n
            .checked_mul(unit)
            .and_then(|s| total.checked_add(s))
            .ok_or_else(bad)?;
        digits.clear();
        parts += 1;
    }
    if parts == 0 || !digits.is_empty() {
        return Err(bad());
    }
    Ok(Duration::from_secs(total))
}

/// A dead letter as one JSON object: the event as the json-lines sink
/// writes it (payload as UTF-8 text or base64), `payload_json` when the
/// payload is JSON, and why and when it died.
fn to_json(d: &DeadLetter) -> anyhow::Result<serde_json::Value> {
    let mut line: serde_json::Value = serde_json::from_slice(&JsonLinesSink::encode(&d.event))?;
    if let Ok(payload) = serde_json::from_slice::<serde_json::Value>(&d.event.payload) {
        line["payload_json"] = payload;
    }
    line["error_code"] = d.error.code.as_str().into();
    line["error_message"] = d.error.message.as_str().into();
    line["dead_at"] = d
        .dead_at
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
        .into();
    Ok(line)
}

/// Most payload bytes `dead show` prints as hex.
const HEX_LIMIT: usize = 1024;

/// `dead show` as text.
fn show_text(d: &DeadLetter) -> String {
    use std::fmt::Write as _;
    let e = &d.event;
    let time =
        |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(out, "id:         {}", e.id);
    let _ = writeln!(out, "key:        {}", e.key.as_deref().unwrap_or("-"));
    let _ = writeln!(out, "type:       {}", e.event_type);
    let _ = writeln!(out, "topic:      {}", e.topic);
    let _ = writeln!(out, "attempts:   {}", e.attempts);
    let _ = writeln!(out, "created_at: {}", time(e.created_at));
    let _ = writeln!(out, "dead_at:    {}", time(d.dead_at));
    let _ = writeln!(out, "code:       {}", d.error.code);
    let _ = writeln!(out, "last error: {}", d.error.message);
    let _ = writeln!(
        out,
        "            (the store keeps the final error only, not one per attempt)"
    );
    if e.headers.is_empty() {
        let _ = writeln!(out, "headers:    (none)");
    } else {
        let _ = writeln!(out, "headers:");
        for (k, v) in &e.headers {
            let _ = writeln!(out, "  {k}: {v}");
        }
    }
    let p = &e.payload;
    match serde_json::from_slice::<serde_json::Value>(p) {
        Ok(json) => {
            let pretty = serde_json::to_string_pretty(&json).unwrap_or_default();
            let _ = writeln!(out, "payload (JSON, {} bytes):\n{pretty}", p.len());
        }
        Err(_) => match std::str::from_utf8(p) {
            Ok(text) => {
                let _ = writeln!(out, "payload (text, not JSON, {} bytes):\n{text}", p.len());
            }
            Err(_) => {
                let shown = &p[..p.len().min(HEX_LIMIT)];
                let _ = writeln!(
                    out,
                    "payload (binary, not UTF-8, {} bytes; hex, then as lossy UTF-8):",
                    p.len()
                );
                for row in shown.chunks(32) {
                    let hex: Vec<String> = row.iter().map(|b| format!("{b:02x}")).collect();
                    let _ = writeln!(out, "  {}", hex.join(" "));
                }
                if p.len() > shown.len() {
                    let _ = writeln!(out, "  ... ({} more bytes)", p.len() - shown.len());
                }
                let _ = writeln!(out, "  {}", String::from_utf8_lossy(shown));
            }
        },
    }
    out
}

/// Prints dead letters as aligned text lines.
pub(crate) fn print_dead_letters(dead: &[DeadLetter]) {
    if dead.is_empty() {
        println!("(no dead letters)");
    }
    for d in dead {
        println!(
            "{}  {:<16} key={:<10} attempts={}  {}: {}",
            d.event.id,
            d.event.event_type,
            d.event.key.as_deref().unwrap_or("-"),
            d.event.attempts,
            d.error.code,
            d.error.message
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_parse_with_units_and_refuse_the_rest() {
        assert_eq!(parse_age("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_age("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_age("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_age("2d"), Ok(Duration::from_secs(172_800)));
        assert_eq!(parse_age("1w"), Ok(Duration::from_secs(604_800)));
        for bad in [
            "",
            "1",
            "h",
            "1x",
            "-1h",
            "1.5h",
            "1h 30m",
            "99999999999999999999w",
        ] {
            assert!(parse_age(bad).is_err(), "{bad:?} was accepted");
        }
    }

    fn letter(payload: &[u8]) -> DeadLetter {
        let now = chrono::Utc::now();
        DeadLetter::new(
            outbox_core::Event {
                id: EventId::new(),
                key: Some("k".into()),
                event_type: "order.created".into(),
                topic: "orders".into(),
                payload: payload.to_vec(),
                headers: [("traceparent".to_owned(), "00-ab-cd-01".to_owned())].into(),
                created_at: now,
                attempts: 3,
                next_attempt_at: now,
                last_error: Some(outbox_core::LastError {
                    code: ErrorCode::HANDLER_PERMANENT_FAILURE,
                    message: "bad".into(),
                }),
            },
            now,
        )
    }

    #[test]
    fn show_pretty_prints_json_and_falls_back_to_text_and_hex() {
        let json = show_text(&letter(br#"{"order":7,"items":[1,2]}"#));
        assert!(json.contains("payload (JSON, 25 bytes):\n{\n"), "{json}");
        assert!(json.contains("\n  \"order\": 7\n}"), "{json}");
        assert!(json.contains("  traceparent: 00-ab-cd-01"), "{json}");
        assert!(
            json.contains("code:       HANDLER_PERMANENT_FAILURE"),
            "{json}"
        );
        let text = show_text(&letter(b"plain words"));
        assert!(
            text.contains("payload (text, not JSON, 11 bytes):\nplain words"),
            "{text}"
        );
        let bin = show_text(&letter(&[0xff, 0x00, 0x41]));
        assert!(bin.contains("not UTF-8, 3 bytes"), "{bin}");
        assert!(bin.contains("  ff 00 41\n"), "{bin}");
        let big = show_text(&letter(&vec![0xfe; HEX_LIMIT + 5]));
        assert!(big.contains("... (5 more bytes)"), "{big}");
    }

    #[test]
    fn json_carries_the_payload_as_json_when_it_is() {
        let v = to_json(&letter(br#"{"order":7}"#)).unwrap();
        assert_eq!(v["payload_json"]["order"], 7);
        assert_eq!(v["error_code"], "HANDLER_PERMANENT_FAILURE");
        assert_eq!(v["attempts"], 3);
        let v = to_json(&letter(b"not json")).unwrap();
        assert!(v.get("payload_json").is_none());
        assert_eq!(v["payload"], "not json");
    }
}
