//! `outbox-relay` against PostgreSQL (feature `postgres`): `migrate` into a
//! chosen schema, `run` delivering committed events to a JSON-lines file,
//! `status` reading the drained table, and the `dead` commands (show, list,
//! purge and retry with filters) in both modes. Uses `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); each run in its own schema.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod support;

use outbox_core::{
    ClaimRequest, DeadLetterQuery, DeadLetterStore, ErrorCode, EventId, LastError, NewEvent,
    RelayId, Resolution, Settlement, ShardSpec, Store,
};
use outbox_postgres::{sqlx, Ident, PgMode, PgOutbox};
use outbox_testkit::process::ChildGuard;
use std::collections::HashSet;
use std::process::Stdio;
use std::time::Duration;
use support::pg::{database_url, drop_schema, log_store, migrated_log, migrated_queue};
use support::{assert_success, jsonl_ids, relay, stop, wait_jsonl_ids};

/// Panics, printing `text`, unless one of its lines satisfies `line`.
fn assert_has_line(text: &str, line: impl Fn(&str) -> bool) {
    assert!(text.lines().any(line), "{text}");
}

/// The `status` line of `pending` events.
fn pending_is(n: u64) -> impl Fn(&str) -> bool {
    move |l| l.starts_with("pending:") && l.trim_end().ends_with(&format!(" {n}"))
}

/// The `status` line of the event-log mode.
fn log_mode(l: &str) -> bool {
    l.starts_with("mode:") && l.contains("log")
}

/// The application's side: 40 events of `event_type` (keys `k0`..`k3`),
/// each committed in its own transaction through `enqueue`, then one more
/// in a transaction rolled back. Returns the committed ids and the
/// rolled-back one.
async fn commit_40_roll_back_1(
    pool: &sqlx::PgPool,
    event_type: &str,
    enqueue: impl AsyncFn(&mut sqlx::PgConnection, NewEvent) -> EventId,
) -> (HashSet<EventId>, EventId) {
    let mut committed: HashSet<EventId> = HashSet::new();
    for i in 0..40 {
        let mut tx = pool.begin().await.unwrap();
        let ev = NewEvent::new(event_type, "cli", format!("{{\"n\":{i}}}").into_bytes())
            .with_key(format!("k{}", i % 4));
        committed.insert(enqueue(&mut *tx, ev).await);
        tx.commit().await.unwrap();
    }
    let mut tx = pool.begin().await.unwrap();
    let phantom = enqueue(
        &mut *tx,
        NewEvent::new(event_type, "cli", b"never".to_vec()),
    )
    .await;
    tx.rollback().await.unwrap();
    (committed, phantom)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_run_and_status_on_postgres() {
    let url = database_url();
    let (schema, pool) = migrated_queue("outbox_cli").await;
    let queue_args = [
        "--store",
        &url,
        "--pg-schema",
        &schema,
        "--pg-mode",
        "queue",
    ];

    // Commit 40 events in application transactions, roll one back.
    let outbox = PgOutbox::in_mode(
        Ident::new(schema.clone()).unwrap(),
        Ident::new("events").unwrap(),
        PgMode::Queue,
    )
    .unwrap();
    let (committed, phantom) = commit_40_roll_back_1(&pool, "cli.test", async |conn, ev| {
        outbox.enqueue(conn, ev).await.unwrap()
    })
    .await;

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    let mut child = ChildGuard::new(
        relay(&["run"])
            .args(queue_args)
            .args(["--sink", &format!("jsonl:{}", file.display())])
            .args(["--poll-interval-ms", "100"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );

    let delivered: HashSet<EventId> = wait_jsonl_ids(&file, committed.len(), &mut child)
        .await
        .into_iter()
        .collect();
    // Graceful stop: SIGTERM, exit 0.
    stop(&mut child);

    assert_eq!(delivered, committed, "every committed event, nothing else");
    assert!(!delivered.contains(&phantom));

    let out = relay(&["status"]).args(queue_args).output().unwrap();
    assert_success(&out, "status");
    assert_has_line(&String::from_utf8_lossy(&out.stdout), pending_is(0));
    let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM \"{schema}\".events"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0);

    // The operator's upgrade: events still pending in the queue table, then
    // `migrate` in the default mode moves them into the event log, where
    // `status` counts them.
    let mut tx = pool.begin().await.unwrap();
    let events = (0..5)
        .map(|i| NewEvent::new("cli.upgrade", "cli", format!("{i}").into_bytes()).with_key("k-up"));
    outbox.enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    let out = relay(&["migrate", "--store", &url, "--pg-schema", &schema])
        .output()
        .unwrap();
    assert_success(&out, "migrate (upgrade to the event log)");
    let out = relay(&["status", "--store", &url, "--pg-schema", &schema])
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&out.stdout);
    assert_success(&out, "status after the upgrade");
    assert_has_line(&status, log_mode);
    assert_has_line(&status, pending_is(5));
    // The queue mode now refuses the upgraded outbox, saying why.
    let out = relay(&["migrate"]).args(queue_args).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("upgraded to the event log"), "{err}");

    // A hostile schema name is refused by the CLI with a clear error.
    let out = relay(&[
        "status",
        "--store",
        &url,
        "--pg-schema",
        "x\"; DROP TABLE y; --",
    ])
    .output()
    .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid store setting"));

    drop_schema(&pool, &schema).await;
}

/// The default mode (the event log): `migrate` creates the event log, `run`
/// relays events committed through `PgLogStore`'s enqueue handle (one
/// transaction rolled back) to a JSON-lines file, `status` and `dead list`
/// read the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_mode_migrate_run_and_status() {
    let url = database_url();
    let (schema, pool) = migrated_log("outbox_clilog").await;
    let log_args = ["--store", &url, "--pg-schema", &schema];
    // The application's side: the log store's enqueue handle, no rotation.
    let producer = log_store(&schema, |o| o).await;
    let (committed, phantom) = commit_40_roll_back_1(&pool, "cli.log", async |conn, ev| {
        producer.outbox().enqueue(conn, ev).await.unwrap()
    })
    .await;

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    let mut child = ChildGuard::new(
        relay(&["run"])
            .args(log_args)
            .args(["--sink", &format!("jsonl:{}", file.display())])
            .args(["--poll-interval-ms", "100"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );

    let delivered = wait_jsonl_ids(&file, committed.len(), &mut child).await;
    // Graceful stop: SIGTERM, exit 0.
    stop(&mut child);

    let unique: HashSet<EventId> = delivered.iter().copied().collect();
    assert_eq!(unique, committed, "every committed event, nothing else");
    assert_eq!(delivered.len(), committed.len(), "no event twice");
    assert!(!unique.contains(&phantom));

    let out = relay(&["status"]).args(log_args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_success(&out, "status");
    assert_has_line(&text, log_mode);
    assert_has_line(&text, pending_is(0));
    assert_has_line(&text, |l| {
        l.trim_start().starts_with("shard 0/64:") && l.contains("pending 0")
    });
    let out = relay(&["dead", "list"]).args(log_args).output().unwrap();
    assert_success(&out, "dead list");
    assert!(String::from_utf8_lossy(&out.stdout).contains("(no dead letters)"));

    // A mode that does not exist is refused, naming the flag.
    let out = relay(&["status", "--store", &url, "--pg-mode", "stream"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--pg-mode") && err.contains("queue"), "{err}");

    drop(producer);
    drop_schema(&pool, &schema).await;
}

/// Three events dead-lettered through `store`: `a` (order.created, key k1,
/// JSON payload, a header, permanent failure), `b` (order.created, key k2,
/// binary payload, no handler), `c` (invoice.sent, key k1, text payload).
async fn three_dead_letters<S: Store + DeadLetterStore>(
    store: &S,
    pool: &sqlx::PgPool,
    enqueue: impl AsyncFn(&mut sqlx::PgConnection, NewEvent) -> EventId,
) -> [EventId; 3] {
    let events = [
        NewEvent::new("order.created", "cli", br#"{"n":1}"#.to_vec())
            .with_key("k1")
            .with_header(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
        NewEvent::new("order.created", "cli", vec![0xff, 0x00, 0x41]).with_key("k2"),
        NewEvent::new("invoice.sent", "cli", b"plain".to_vec()).with_key("k1"),
    ];
    let mut ids = Vec::new();
    let mut tx = pool.begin().await.unwrap();
    for e in events {
        ids.push(enqueue(&mut *tx, e).await);
    }
    tx.commit().await.unwrap();
    let claim = store
        .claim(&ClaimRequest {
            relay_id: RelayId::new("cli-test"),
            batch_size: 10,
            lease: Duration::from_secs(60),
            shard: ShardSpec::ALL,
        })
        .await
        .unwrap();
    assert_eq!(claim.events.len(), 3);
    let dead = |code: ErrorCode, message: &str| Resolution::Dead {
        error: LastError {
            code,
            message: message.to_owned(),
        },
    };
    let report = store
        .settle(
            claim.token,
            &Settlement::new()
                .with(ids[0], dead(ErrorCode::HANDLER_PERMANENT_FAILURE, "bad a"))
                .with(
                    ids[1],
                    dead(ErrorCode::HANDLER_NOT_REGISTERED, "no handler"),
                )
                .with(ids[2], dead(ErrorCode::HANDLER_PERMANENT_FAILURE, "bad c")),
        )
        .await
        .unwrap();
    assert_eq!(report.applied, 3);
    [ids[0], ids[1], ids[2]]
}

async fn dead_ids<S: DeadLetterStore>(store: &S) -> Vec<EventId> {
    store
        .list_dead(&DeadLetterQuery::default())
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.event.id)
        .collect()
}

/// `dead show`, `dead list` with a filter, and a filtered `dead purge` /
/// `dead retry`: the dry-run count, the refusal without a terminal, `--yes`.
async fn dead_commands<S: Store + DeadLetterStore>(args: &[&str], store: &S, ids: [EventId; 3]) {
    let [a, b, c] = ids;
    let run = |extra: &[&str]| {
        relay(&["dead"])
            .args(extra)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let stdout = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).into_owned();
    let stderr = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).into_owned();

    // show: the fields, the header, the payload pretty-printed as JSON.
    let out = run(&["show", &a.to_string()]);
    assert_success(&out, "dead show");
    let text = stdout(&out);
    for want in [
        format!("id:         {a}"),
        "key:        k1".to_owned(),
        "type:       order.created".to_owned(),
        "topic:      cli".to_owned(),
        "attempts:   1".to_owned(),
        "code:       HANDLER_PERMANENT_FAILURE".to_owned(),
        "last error: bad a".to_owned(),
        "  traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
        "payload (JSON, 7 bytes):\n{\n  \"n\": 1\n}".to_owned(),
    ] {
        assert!(text.contains(&want), "missing {want:?} in:\n{text}");
    }
    // A binary payload: hex.
    let out = run(&["show", &b.to_string()]);
    assert_success(&out, "dead show (binary)");
    assert!(stdout(&out).contains("  ff 00 41\n"), "{}", stdout(&out));
    // --json: one object.
    let out = run(&["show", &c.to_string(), "--json"]);
    assert_success(&out, "dead show --json");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["id"], c.to_string());
    assert_eq!(v["event_type"], "invoice.sent");
    assert_eq!(v["payload"], "plain");
    assert_eq!(v["error_code"], "HANDLER_PERMANENT_FAILURE");
    assert_eq!(v["error_message"], "bad c");
    // An id that is not a dead letter.
    let missing = EventId::new();
    let out = run(&["show", &missing.to_string()]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!("no dead letter with id {missing}")),
        "{}",
        stderr(&out)
    );

    // list with filters.
    let out = run(&["list", "--type", "order.created", "--json"]);
    assert_success(&out, "dead list --type");
    assert_eq!(jsonl_ids(&stdout(&out)), vec![a, b]);
    let out = run(&[
        "list",
        "--key",
        "k1",
        "--code",
        "HANDLER_PERMANENT_FAILURE",
        "--older-than",
        "1h",
    ]);
    assert_success(&out, "dead list --older-than");
    assert!(
        stdout(&out).contains("(no dead letters)"),
        "{}",
        stdout(&out)
    );

    // purge: a dry run counts and changes nothing.
    let out = run(&["purge", "--type", "order.created", "--dry-run"]);
    assert_success(&out, "dead purge --dry-run");
    assert_eq!(stdout(&out).trim(), "would purge 2 dead letter(s)");
    assert_eq!(dead_ids(store).await, vec![a, b, c]);
    // Without --yes and without a terminal: refused, nothing changed.
    let out = run(&["purge", "--type", "order.created"]);
    assert!(
        !out.status.success(),
        "purge without --yes ran: {}",
        stdout(&out)
    );
    assert!(stderr(&out).contains("not a terminal"), "{}", stderr(&out));
    assert!(stderr(&out).contains("--yes"), "{}", stderr(&out));
    assert_eq!(dead_ids(store).await, vec![a, b, c]);
    // No selection at all: refused by the argument parser.
    let out = run(&["purge", "--yes"]);
    assert!(!out.status.success());
    assert_eq!(dead_ids(store).await, vec![a, b, c]);
    // Filtered, confirmed: only b goes.
    let out = run(&[
        "purge",
        "--type",
        "order.created",
        "--code",
        "HANDLER_NOT_REGISTERED",
        "--yes",
    ]);
    assert_success(&out, "dead purge --yes");
    assert_eq!(
        stdout(&out),
        "would purge 1 dead letter(s)\npurged 1 dead letter(s)\n"
    );
    assert_eq!(dead_ids(store).await, vec![a, c]);

    // retry: nothing older than an hour; the key's two letters are newer.
    let out = run(&["retry", "--key", "k1", "--older-than", "1h", "--yes"]);
    assert_success(&out, "dead retry --older-than");
    assert_eq!(stdout(&out).trim(), "would retry 0 dead letter(s)");
    let out = run(&["retry", "--key", "k1", "--newer-than", "1h", "-y"]);
    assert_success(&out, "dead retry --newer-than");
    assert!(
        stdout(&out).contains("moved 2 dead letter(s) back to pending"),
        "{}",
        stdout(&out)
    );
    assert!(dead_ids(store).await.is_empty());
    let s = store.stats().await.unwrap();
    assert_eq!((s.pending, s.dead), (2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_show_list_purge_and_retry_with_filters() {
    use outbox_postgres::{PgStore, PgStoreOptions};
    let url = database_url();
    let (schema, pool) = migrated_queue("outbox_clidead").await;
    let args = [
        "--store",
        &url,
        "--pg-schema",
        &schema,
        "--pg-mode",
        "queue",
    ];
    let store = PgStore::connect(
        PgStoreOptions::new(&url).with_schema(Ident::new(schema.clone()).unwrap()),
    )
    .await
    .unwrap();
    let outbox = store.outbox().clone();
    let ids = three_dead_letters(&store, &pool, async |conn, ev| {
        outbox.enqueue(conn, ev).await.unwrap()
    })
    .await;
    dead_commands(&args, &store, ids).await;
    drop(store);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_mode_dead_show_list_purge_and_retry_with_filters() {
    let url = database_url();
    let (schema, pool) = migrated_log("outbox_clideadlog").await;
    let args = ["--store", &url, "--pg-schema", &schema, "--pg-mode", "log"];
    let store = log_store(&schema, |o| o).await;
    let log = store.outbox().clone();
    let ids = three_dead_letters(&store, &pool, async |conn, ev| {
        log.enqueue(conn, ev).await.unwrap()
    })
    .await;
    dead_commands(&args, &store, ids).await;
    drop(store);
    drop_schema(&pool, &schema).await;
}

/// The lines of a child's stdout, read on a thread.
fn stdout_lines(out: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead as _;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The next frame's `pending` count from `status --watch` output: the
/// `pending:` line of a text frame, or the `pending` field of a JSON
/// document (each line must be one); panics after 30 s without one.
fn next_pending(
    lines: &std::sync::mpsc::Receiver<String>,
    json: bool,
    seen: &mut Vec<String>,
) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = lines.recv_timeout(left).unwrap_or_else(|e| {
            panic!("no status frame within 30 s ({e}); output so far: {seen:#?}")
        });
        seen.push(line.clone());
        if json {
            let doc: serde_json::Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("not one JSON document per line ({e}): {line}"));
            assert_eq!(doc["mode"], "log", "{doc}");
            assert_eq!(doc["group"], "default", "{doc}");
            assert!(doc["groups"].is_array(), "{doc}");
            return doc["pending"]
                .as_u64()
                .unwrap_or_else(|| panic!("no pending count: {doc}"));
        }
        if let Some(n) = line.strip_prefix("pending:") {
            return n.trim().parse().unwrap();
        }
    }
}

/// `status --watch 1` (text, then `--json`) against a real event log: it
/// prints a frame a second; events committed between two frames show in a
/// later frame's pending count; SIGINT ends it with exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_watch_redraws_as_events_are_committed() {
    let url = database_url();
    let (schema, pool) = migrated_log("outbox_watch").await;
    let log_args = ["--store", &url, "--pg-schema", &schema];
    let producer = log_store(&schema, |o| o).await;

    for json in [false, true] {
        let mut cmd = relay(&["status", "--watch", "1"]);
        cmd.args(log_args);
        if json {
            cmd.arg("--json");
        }
        let mut child = ChildGuard::new(cmd.stdout(Stdio::piped()).spawn().unwrap());
        let lines = stdout_lines(child.child().stdout.take().unwrap());
        let mut seen = Vec::new();
        let before = next_pending(&lines, json, &mut seen);

        // One transaction: a frame sees none or all 7.
        let mut tx = pool.begin().await.unwrap();
        for i in 0..7 {
            let ev = NewEvent::new("cli.watch", "t", format!("{{\"n\":{i}}}").into_bytes())
                .with_key(format!("k{i}"));
            producer.outbox().enqueue(&mut tx, ev).await.unwrap();
        }
        tx.commit().await.unwrap();
        // The frame under way may still show the old count; a later one
        // (a second apart) shows the 7 new events, and nothing else.
        let mut frames = 1;
        loop {
            let now = next_pending(&lines, json, &mut seen);
            frames += 1;
            if now == before + 7 {
                break;
            }
            assert_eq!(
                now, before,
                "json {json}: unexpected count; frames: {seen:#?}"
            );
            assert!(frames < 10, "json {json}: the count never moved: {seen:#?}");
        }
        assert!(frames >= 2);
        // Still watching: another frame comes.
        next_pending(&lines, json, &mut seen);

        child.signal("INT");
        let status = outbox_testkit::process::wait_timeout(child.child(), Duration::from_secs(10));
        assert!(
            status.is_some_and(|s| s.success()),
            "json {json}: status --watch after SIGINT: {status:?}"
        );
    }

    drop(producer);
    drop_schema(&pool, &schema).await;
}
