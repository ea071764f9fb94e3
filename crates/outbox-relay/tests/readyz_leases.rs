//! `/readyz` counts the shard leases a relay holds (PostgreSQL event log,
//! relay groups; issue 13 "leases held"). A lone relay holds all 64 virtual
//! shards and is ready. A relay that joins a group whose other member
//! holds every shard and never gives one back (it claimed once and never
//! rebalances again) holds none of its fair share of 32: past the grace
//! (lock timeout + 2 x max(poll interval, 1 s)) `/readyz` is 503 naming
//! it; once the holder goes away (it leaves, or its leases and its
//! announcement run out) the relay takes every shard, `/readyz` is 200
//! with 64 shards held, and the events committed meanwhile are delivered.
//! Uses `DATABASE_URL` (default on loopback), a schema of its own per test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod support;

use outbox_core::{ClaimRequest, EventId, NewEvent, RelayId, ShardSpec, Store};
use outbox_postgres::PgLogStore;
use outbox_testkit::process::ChildGuard;
use serde_json::Value;
use std::collections::HashSet;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};
use support::pg::{database_url, drop_schema, migrated_log};
use support::{assert_success, free_addr, get, relay, stop, wait_jsonl_ids};

/// The relay's lock timeout: its grace is 2 s + 2 x 1 s = 4 s.
const LOCK_TIMEOUT_MS: &str = "2000";

/// A store of the schema's event log, as another relay process has it.
async fn log_store(schema: &str) -> PgLogStore {
    support::pg::log_store(schema, |o| o.with_dynamic_shards(true)).await
}

/// Commits `n` events (keys `k0`..`k7`), one transaction each.
async fn commit(store: &PgLogStore, n: usize) -> HashSet<EventId> {
    let mut ids = HashSet::new();
    for i in 0..n {
        let mut tx = store.pool().begin().await.unwrap();
        let ev = NewEvent::new("leases.test", "t", format!("{{\"n\":{i}}}").into_bytes())
            .with_key(format!("k{}", i % 8));
        ids.insert(store.outbox().enqueue(&mut tx, ev).await.unwrap());
        tx.commit().await.unwrap();
    }
    ids
}

/// `outbox-relay run` (a relay group: no `--shard`) on `schema` to the
/// JSON-lines `file`, serving `/readyz` on `addr`.
fn spawn_relay(schema: &str, file: &Path, addr: &str) -> ChildGuard {
    ChildGuard::new(
        relay(&["run", "--store", &database_url(), "--pg-schema", schema])
            .args(["--sink", &format!("jsonl:{}", file.display())])
            .args(["--metrics-addr", addr])
            .args(["--lock-timeout-ms", LOCK_TIMEOUT_MS])
            .args(["--poll-interval-ms", "100"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Polls `/readyz` until it answers `status` with a body `accept`s
/// (bounded); returns the body.
async fn wait_readyz(
    addr: &str,
    status: u16,
    accept: impl Fn(&Value) -> bool,
    bound: Duration,
    relay: &mut ChildGuard,
) -> Value {
    let deadline = Instant::now() + bound;
    let mut last = None;
    loop {
        if let Some((s, body)) = get(addr, "/readyz") {
            if s == status {
                let v: Value = serde_json::from_str(&body).unwrap();
                if accept(&v) {
                    return v;
                }
            }
            last = Some((s, body));
        }
        assert!(
            Instant::now() < deadline,
            "/readyz did not answer {status} as expected within {bound:?}; last answer: {last:?}"
        );
        if let Some(exit) = relay.child().try_wait().unwrap() {
            panic!("relay exited early with {exit}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Holds all 64 shards (what a lone relay ends with).
fn holds_all(v: &Value) -> bool {
    v["leases"]["shards_held"] == 64
}

/// Asserts a ready relay that holds all 64 virtual shards.
fn assert_holds_all(v: &Value) {
    assert_eq!(v["ready"], true, "{v}");
    let leases = &v["leases"];
    assert_eq!(leases["kind"], "relay_group", "{v}");
    assert_eq!(leases["shards_held"], 64, "{v}");
    assert_eq!(leases["fair_share"], 64, "{v}");
    assert_eq!(leases["total"], 64, "{v}");
    assert_eq!(leases["state"], "ok", "{v}");
    let shards: Vec<u64> = leases["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_u64().unwrap())
        .collect();
    assert_eq!(shards, (0..64).collect::<Vec<u64>>(), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_relay_holds_every_shard_and_is_ready() {
    let (schema, pool) = migrated_log("outbox_ready_lone").await;
    let producer = log_store(&schema).await;
    let committed = commit(&producer, 10).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    let addr = free_addr();
    let mut child = spawn_relay(&schema, &file, &addr);

    let ready = wait_readyz(&addr, 200, holds_all, Duration::from_secs(30), &mut child).await;
    assert_holds_all(&ready);
    let delivered: HashSet<EventId> = wait_jsonl_ids(&file, committed.len(), &mut child)
        .await
        .into_iter()
        .collect();
    assert_eq!(delivered, committed);

    // `status --relay` shows the same from the relay's /readyz.
    let out = relay(&["status", "--store", &database_url(), "--pg-schema", &schema])
        .args(["--relay", &addr])
        .output()
        .unwrap();
    assert_success(&out, "status --relay");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.starts_with(&format!("relay {addr}: ready"))
                && l.contains("shards: 64 held, fair share 64 of 64")),
        "{text}"
    );

    stop(&mut child);
    drop(producer);
    drop_schema(&pool, &schema).await;
}

/// How the relay that keeps every shard goes away.
#[derive(Debug, Clone, Copy)]
enum Gone {
    /// `Store::leave`: it gives every cursor back and deletes its
    /// announcement.
    Leaves,
    /// Nothing: its leases and its announcement run out.
    RunsOut,
}

async fn starved_until_the_holder_goes(gone: Gone) {
    let (schema, pool) = migrated_log("outbox_ready_starved").await;
    // The other "relay": it joins alone, takes all 64 shards, and never
    // claims (so never rebalances, never gives a shard back) again.
    let holder = log_store(&schema).await;
    let holder_id = RelayId::new("holder-that-keeps-everything");
    let lease = match gone {
        Gone::Leaves => Duration::from_secs(300),
        Gone::RunsOut => Duration::from_secs(15),
    };
    let taken = Instant::now();
    holder
        .claim(&ClaimRequest {
            relay_id: holder_id.clone(),
            batch_size: 10,
            lease,
            shard: ShardSpec::ALL,
        })
        .await
        .unwrap();
    let held = holder.lease_holding(&holder_id).unwrap();
    assert_eq!(held.shards.len(), 64, "{held:?}");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    let addr = free_addr();
    let mut child = spawn_relay(&schema, &file, &addr);
    let committed = commit(&holder, 10).await;

    // Joined (fair share 32 of 64), holds none, and past the grace: 503.
    // (Before its first claim it is 503 too: the store is `starting`.)
    let starved = |v: &Value| v["leases"]["state"] == "starved";
    let down = wait_readyz(&addr, 503, starved, Duration::from_secs(30), &mut child).await;
    eprintln!("/readyz while another relay keeps every shard: {down}");
    let leases = &down["leases"];
    assert_eq!(leases["kind"], "relay_group", "{down}");
    assert_eq!(leases["state"], "starved", "{down}");
    assert_eq!(leases["shards_held"], 0, "{down}");
    assert_eq!(leases["shards"], serde_json::json!([]), "{down}");
    assert_eq!(leases["fair_share"], 32, "{down}");
    assert_eq!(leases["total"], 64, "{down}");
    assert_eq!(leases["grace_secs"], 4.0, "{down}");
    assert!(leases["held_none_secs"].as_f64().unwrap() >= 4.0, "{down}");
    assert!(
        leases["reason"]
            .as_str()
            .unwrap()
            .starts_with("holds 0 of its fair share of 32 shards for "),
        "{down}"
    );
    // Only the leases keep it out.
    assert_eq!(down["sink"]["state"], "closed", "{down}");
    assert_eq!(down["store"]["state"], "ok", "{down}");
    assert!(
        !file.exists() || std::fs::read_to_string(&file).unwrap().is_empty(),
        "nothing delivered while another relay holds every shard"
    );
    if let Gone::RunsOut = gone {
        assert!(
            taken.elapsed() < lease,
            "the holder's lease ran out before the check; raise it"
        );
    }

    match gone {
        Gone::Leaves => holder.leave(&holder_id).await.unwrap(),
        Gone::RunsOut => {}
    }
    let up = wait_readyz(
        &addr,
        200,
        holds_all,
        lease + Duration::from_secs(30),
        &mut child,
    )
    .await;
    eprintln!("/readyz once the holder is gone ({gone:?}): {up}");
    assert_holds_all(&up);
    let delivered: HashSet<EventId> = wait_jsonl_ids(&file, committed.len(), &mut child)
        .await
        .into_iter()
        .collect();
    assert_eq!(delivered, committed, "every event committed meanwhile");

    stop(&mut child);
    drop(holder);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_while_another_relay_keeps_every_shard_until_it_leaves() {
    starved_until_the_holder_goes(Gone::Leaves).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_while_another_relay_keeps_every_shard_until_its_leases_run_out() {
    starved_until_the_holder_goes(Gone::RunsOut).await;
}
