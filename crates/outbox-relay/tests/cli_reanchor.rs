//! `outbox-relay reanchor` (issue 42, point 5): an event log restored into
//! another database (`pg_dump -n schema | psql`) is refused by `run` with
//! what happened and the command to run; `reanchor` without `--yes` (no
//! terminal) changes nothing; `reanchor --from origin --yes` lets the relay
//! deliver the retained log again. Uses `DATABASE_URL`, a schema and a
//! database of its own.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod support;

use outbox_core::{ClaimRequest, NewEvent, RelayId, Resolution, Settlement, ShardSpec, Store};
use outbox_postgres::sqlx;
use outbox_testkit::process::ChildGuard;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::pg::{database_url, drop_schema, log_store, migrated_log};
use support::{assert_success, relay, stop};

fn url_for(db: &str) -> String {
    let url = database_url();
    let (base, _) = url.rsplit_once('/').unwrap();
    format!("{base}/{db}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_log_is_refused_until_reanchor() {
    let (schema, pool) = migrated_log("cli_reanchor").await;
    let producer = log_store(&schema, |o| o).await;
    let mut tx = producer.pool().begin().await.unwrap();
    let id = producer
        .outbox()
        .enqueue(
            &mut tx,
            NewEvent::new("t", "topic", b"{}".to_vec()).with_key("k"),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // Delivered in the original database.
    let req = ClaimRequest {
        relay_id: RelayId::new("original"),
        batch_size: 10,
        lease: Duration::from_secs(60),
        shard: ShardSpec::ALL,
    };
    let claim = producer.claim(&req).await.unwrap();
    assert_eq!(claim.events.len(), 1);
    let settled = producer
        .settle(
            claim.token,
            &Settlement::new().with(id, Resolution::Delivered),
        )
        .await
        .unwrap();
    assert!(settled.all_applied());
    producer.leave(&req.relay_id).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sink = |name: &str| format!("jsonl:{}", dir.path().join(name).display());

    // pg_dump -n schema | psql into a new database.
    let db = format!(
        "cli_reanchor_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    sqlx::query(&format!("CREATE DATABASE \"{db}\""))
        .execute(&pool)
        .await
        .unwrap();
    let dump = Command::new("pg_dump")
        .args(["--no-owner", "-n", &schema, &database_url()])
        .output()
        .unwrap();
    assert!(dump.status.success());
    let mut psql = Command::new("psql")
        .args(["-q", "-v", "ON_ERROR_STOP=1", &url_for(&db)])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut psql.stdin.take().unwrap(), &dump.stdout).unwrap();
    assert!(psql.wait().unwrap().success());
    let copy = url_for(&db);
    let store_args = ["--store", copy.as_str(), "--pg-schema", schema.as_str()];

    // The relay on the copy refuses, saying what happened and what to run.
    let file = dir.path().join("b.jsonl");
    let mut running = ChildGuard::new(
        relay(&["run", "--sink", &sink("b.jsonl")])
            .args(store_args)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        std::fs::read_to_string(&file)
            .unwrap_or_default()
            .is_empty(),
        "claimed on the copy"
    );

    // Without --yes (no terminal) nothing changes.
    let out = relay(&["reanchor", "--from", "origin"])
        .args(store_args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("the log's positions belong to database \"test\""),
        "{text}"
    );
    assert!(
        text.contains("delivers the whole retained log again"),
        "{text}"
    );

    let out = relay(&["reanchor", "--from", "origin", "--yes"])
        .args(store_args)
        .output()
        .unwrap();
    assert_success(&out, "reanchor --from origin --yes");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("1 retained event(s) will be delivered again"),
        "{text}"
    );

    // The running relay resumes and delivers the retained event again.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&file)
        .unwrap_or_default()
        .contains(&id.to_string())
    {
        assert!(
            Instant::now() < deadline,
            "not delivered after the re-anchor"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop(&mut running);
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut running.child().stderr.take().unwrap(), &mut stderr)
        .unwrap();
    assert!(
        stderr.contains("another database of the same cluster"),
        "{stderr}"
    );
    assert!(
        stderr.contains("outbox-relay reanchor --from origin"),
        "{stderr}"
    );

    drop(producer);
    sqlx::query(&format!("DROP DATABASE \"{db}\" WITH (FORCE)"))
        .execute(&pool)
        .await
        .unwrap();
    drop_schema(&pool, &schema).await;
}
