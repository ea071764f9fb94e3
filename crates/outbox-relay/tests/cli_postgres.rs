//! `outbox-relay` against PostgreSQL (feature `postgres`): `migrate` into a
//! chosen schema, `run` delivering committed events to a JSON-lines file,
//! `status` reading the drained table. Uses `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); each run in its own schema.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod support;

use outbox_core::{EventId, NewEvent};
use outbox_postgres::{sqlx, Ident, PgMode, PgOutbox};
use outbox_testkit::process::ChildGuard;
use std::collections::HashSet;
use std::process::Stdio;
use support::{assert_success, relay, stop, wait_jsonl_ids};

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A fresh schema name `<prefix>_<random>` and a pool on `url`.
async fn schema_and_pool(prefix: &str, url: &str) -> (String, sqlx::PgPool) {
    let schema = format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let pool = sqlx::PgPool::connect(url).await.unwrap_or_else(|e| {
        panic!("PostgreSQL is not reachable ({e}); start it or set DATABASE_URL")
    });
    (schema, pool)
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

async fn drop_schema(pool: &sqlx::PgPool, schema: &str) {
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_run_and_status_on_postgres() {
    let url = database_url();
    let (schema, pool) = schema_and_pool("outbox_cli", &url).await;

    let out = relay(&[
        "migrate",
        "--store",
        &url,
        "--pg-schema",
        &schema,
        "--pg-mode",
        "queue",
    ])
    .output()
    .unwrap();
    assert_success(&out, "migrate");

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
        relay(&[
            "run",
            "--store",
            &url,
            "--pg-schema",
            &schema,
            "--pg-mode",
            "queue",
            "--sink",
            &format!("jsonl:{}", file.display()),
            "--poll-interval-ms",
            "100",
        ])
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

    let out = relay(&[
        "status",
        "--store",
        &url,
        "--pg-schema",
        &schema,
        "--pg-mode",
        "queue",
    ])
    .output()
    .unwrap();
    let status = String::from_utf8_lossy(&out.stdout);
    assert_success(&out, "status");
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("pending:") && l.trim_end().ends_with(" 0")),
        "{status}"
    );
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
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("mode:") && l.contains("log")),
        "{status}"
    );
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("pending:") && l.trim_end().ends_with(" 5")),
        "{status}"
    );
    // The queue mode now refuses the upgraded outbox, saying why.
    let out = relay(&[
        "migrate",
        "--store",
        &url,
        "--pg-schema",
        &schema,
        "--pg-mode",
        "queue",
    ])
    .output()
    .unwrap();
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
    use outbox_postgres::{PgLogOptions, PgLogStore};
    let url = database_url();
    let (schema, pool) = schema_and_pool("outbox_clilog", &url).await;
    let log_args = ["--store", &url, "--pg-schema", &schema];

    let out = relay(&["migrate"]).args(log_args).output().unwrap();
    assert_success(&out, "migrate");

    // The application's side: the log store's enqueue handle, no rotation.
    let producer = PgLogStore::connect(
        PgLogOptions::new(&url)
            .with_schema(Ident::new(schema.clone()).unwrap())
            .with_background_rotation(false),
    )
    .await
    .unwrap();
    let (committed, phantom) = commit_40_roll_back_1(&pool, "cli.log", async |conn, ev| {
        producer.log().enqueue(conn, ev).await.unwrap()
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
    assert!(
        text.lines()
            .any(|l| l.starts_with("mode:") && l.contains("log")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("pending:") && l.trim_end().ends_with(" 0")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("shard 0/1:") && l.contains("pending 0")),
        "{text}"
    );
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
