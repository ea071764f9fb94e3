//! `outbox-relay` through PgBouncer in transaction mode (`PGBOUNCER_URL`,
//! default `postgres://postgres@127.0.0.1:6432/test`, started by `cargo
//! xtask services`): every command on the pooler's URL, the producer
//! committing through it too, the console serving its overview, with the pooler detected (`--pg-pooler`
//! unset) or named; a pooler mode that does not exist refused; the
//! direct-connection mode against the pooler fails naming the setting.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod support;

use outbox_core::{EventId, NewEvent, Pooler};
use outbox_postgres::{sqlx, Ident, PgLogOptions, PgLogStore, PgMode, PgOutbox};
use outbox_testkit::process::ChildGuard;
use std::collections::HashSet;
use std::process::Stdio;
use support::pg::{drop_schema, fresh_schema};
use support::{assert_success, relay, stop, wait_jsonl_ids};

/// `PGBOUNCER_URL`, default PgBouncer on the loopback.
fn pgbouncer_url() -> String {
    std::env::var("PGBOUNCER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432/test".to_owned())
}

/// A pool through PgBouncer (the application's), with a clear failure
/// when it is not running.
async fn pooler_pool() -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&pgbouncer_url())
        .await
        .unwrap_or_else(|e| {
            panic!("PgBouncer is not reachable ({e}); start it with `cargo xtask services`")
        })
}

/// 30 events committed one transaction each through PgBouncer by `outbox`
/// (told the pooler is in transaction mode), and one rolled back.
async fn produce(pool: &sqlx::PgPool, outbox: &PgOutbox) -> (HashSet<EventId>, EventId) {
    let mut committed = HashSet::new();
    for i in 0..30 {
        let mut tx = pool.begin().await.unwrap();
        let ev = NewEvent::new("pooled.event", "cli", format!("{{\"n\":{i}}}").into_bytes())
            .with_key(format!("k{}", i % 3));
        committed.insert(outbox.enqueue(&mut tx, ev).await.unwrap());
        tx.commit().await.unwrap();
    }
    let mut tx = pool.begin().await.unwrap();
    let phantom = outbox
        .enqueue(
            &mut tx,
            NewEvent::new("pooled.event", "cli", b"never".to_vec()),
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    (committed, phantom)
}

/// Runs `outbox-relay run` on `args` into a JSON-lines file until the
/// committed events arrived, then stops it; returns what it delivered.
async fn relay_all(args: &[&str], expected: usize) -> Vec<EventId> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    let mut child = ChildGuard::new(
        relay(&["run"])
            .args(args)
            .args(["--sink", &format!("jsonl:{}", file.display())])
            .args(["--poll-interval-ms", "100"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let delivered = wait_jsonl_ids(&file, expected, &mut child).await;
    stop(&mut child);
    delivered
}

/// The event log through the pooler, the pooler detected: `migrate` on a
/// fresh schema, the producer's 30 commits, `run`, `status`, `dead list`,
/// `group list`, `pause` and `resume`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_and_the_producer_run_through_pgbouncer_detected() {
    let (schema, direct) = fresh_schema("outbox_clipgb").await;
    let url = pgbouncer_url();
    let args = ["--store", url.as_str(), "--pg-schema", schema.as_str()];
    let out = relay(&["migrate"]).args(args).output().unwrap();
    assert_success(&out, "migrate through PgBouncer");

    let pool = pooler_pool().await;
    let outbox = PgOutbox::new(
        Ident::new(schema.clone()).unwrap(),
        Ident::new(outbox_postgres::DEFAULT_TABLE).unwrap(),
    )
    .unwrap()
    .with_pooler(Pooler::Transaction);
    let (committed, phantom) = produce(&pool, &outbox).await;

    let delivered = relay_all(&args, committed.len()).await;
    let unique: HashSet<EventId> = delivered.iter().copied().collect();
    assert_eq!(unique, committed, "every committed event, nothing else");
    assert_eq!(delivered.len(), committed.len(), "no event twice");
    assert!(!unique.contains(&phantom));

    for (command, expect) in [
        (&["status"][..], "pending:"),
        (&["dead", "list"][..], "(no dead letters)"),
        (&["group", "list"][..], "default"),
        (&["pause", "--reason", "pooler test"][..], "paused"),
        (&["resume"][..], "resumed"),
    ] {
        let out = relay(command).args(args).output().unwrap();
        assert_success(&out, &command.join(" "));
        let text = String::from_utf8_lossy(&out.stdout).to_lowercase();
        assert!(text.contains(expect), "{}: {text}", command.join(" "));
    }

    // The console on the pooler's URL: its overview names the group.
    let addr = support::free_addr();
    let mut console = ChildGuard::new(
        relay(&["console"])
            .args(args)
            .args(["--listen", &addr])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let page = loop {
        if let Some((200, body)) = support::get(&addr, "/") {
            break body;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the console did not answer"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    stop(&mut console);
    assert!(page.contains("default"), "{page}");

    // The store a library user opens on the pooler's URL finds it too.
    let store = PgLogStore::connect(
        PgLogOptions::new(url.clone())
            .with_schema(Ident::new(schema.clone()).unwrap())
            .with_background_rotation(false),
    )
    .await
    .unwrap();
    assert_eq!(store.pooler(), Pooler::Transaction);
    drop(store);
    drop_schema(&direct, &schema).await;
}

/// The queue table through the pooler, the mode named: no LISTEN (the
/// probe finds the events), everything delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_table_runs_through_pgbouncer_on_its_probe() {
    let (schema, direct) = fresh_schema("outbox_clipgbq").await;
    let url = pgbouncer_url();
    let args = [
        "--store",
        url.as_str(),
        "--pg-schema",
        schema.as_str(),
        "--pg-mode",
        "queue",
        "--pg-pooler",
        "transaction",
    ];
    let out = relay(&["migrate"]).args(args).output().unwrap();
    assert_success(&out, "migrate --pg-mode queue through PgBouncer");
    let pool = pooler_pool().await;
    let outbox = PgOutbox::in_mode(
        Ident::new(schema.clone()).unwrap(),
        Ident::new(outbox_postgres::DEFAULT_TABLE).unwrap(),
        PgMode::Queue,
    )
    .unwrap()
    .with_pooler(Pooler::Transaction);
    let (committed, _) = produce(&pool, &outbox).await;
    let delivered = relay_all(&args, committed.len()).await;
    assert_eq!(delivered.len(), committed.len(), "no event twice");
    assert_eq!(delivered.into_iter().collect::<HashSet<_>>(), committed);
    let out = relay(&["status"]).args(args).output().unwrap();
    assert_success(&out, "status");
    drop_schema(&direct, &schema).await;
}

/// An unknown pooler mode is refused at start naming the flag; the
/// direct-connection mode through PgBouncer fails at connect and names
/// the setting to change.
#[test]
fn a_wrong_pooler_mode_is_refused_naming_the_setting() {
    let url = pgbouncer_url();
    let out = relay(&["status", "--store", &url, "--pg-pooler", "statement"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--pg-pooler") && err.contains("unknown pooler mode \"statement\""),
        "{err}"
    );
    let out = relay(&["status", "--store", &url, "--pg-pooler", "none"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unsupported startup parameter") && err.contains("--pg-pooler transaction"),
        "{err}"
    );
}
