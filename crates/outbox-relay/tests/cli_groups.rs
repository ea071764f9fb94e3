//! Consumer groups of the PostgreSQL event log through `outbox-relay`
//! processes (issue 12 "Consumer groups", issue 13 `status`): two groups
//! with different sinks (NATS JetStream, a JSON-lines file) each receive
//! every committed event in per-key order; one group's sink outage and its
//! dead letters do not affect the other; `--start-from now` skips older
//! events; `status --json` and `group list --json` name the groups, shards
//! and relays; a group that stopped reading holds rotation back until
//! `group drop` removes it. Uses `DATABASE_URL` and `NATS_URL` (defaults on
//! loopback), a schema and streams of its own.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod support;

use outbox_core::{EventId, NewEvent};
use outbox_postgres::PgLogStore;
use outbox_postgres::Rotation;
use outbox_testkit::nats::NatsFixture;
use outbox_testkit::process::ChildGuard;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};
use support::pg::{database_url, drop_schema, log_store, migrated_log};
use support::{assert_success, free_addr, relay, stop};

/// One delivered event: (key, n, id), n being its commit rank.
type Seen = (String, u64, EventId);

/// Commits `count` events on topic `topic` (keys `k0`..`k3`), each in its
/// own transaction, numbered from `*next`. Returns their ids.
async fn commit(
    producer: &PgLogStore,
    topic: &str,
    count: usize,
    next: &mut u64,
) -> HashSet<EventId> {
    let mut ids = HashSet::new();
    for _ in 0..count {
        let n = *next;
        *next += 1;
        let mut tx = producer.pool().begin().await.unwrap();
        let ev = NewEvent::new("grp.test", topic, format!("{{\"n\":{n}}}").into_bytes())
            .with_key(format!("k{}", n % 4));
        ids.insert(producer.outbox().enqueue(&mut tx, ev).await.unwrap());
        tx.commit().await.unwrap();
    }
    ids
}

fn n_of(payload: &[u8]) -> u64 {
    serde_json::from_slice::<serde_json::Value>(payload).unwrap()["n"]
        .as_u64()
        .unwrap()
}

/// The events of a JSON-lines sink file, in file order.
fn jsonl(file: &Path) -> Vec<Seen> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            (
                v["key"].as_str().unwrap().to_owned(),
                n_of(v["payload"].as_str().unwrap().as_bytes()),
                v["id"].as_str().unwrap().parse().unwrap(),
            )
        })
        .collect()
}

/// Waits until `file` holds every id of `want` (bounded); returns its events.
async fn wait_file(file: &Path, want: &HashSet<EventId>, relay: &mut ChildGuard) -> Vec<Seen> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen = jsonl(file);
        let ids: HashSet<EventId> = seen.iter().map(|s| s.2).collect();
        if want.is_subset(&ids) {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} events in {}",
            want.intersection(&ids).count(),
            want.len(),
            file.display()
        );
        if let Some(status) = relay.child().try_wait().unwrap() {
            panic!("relay exited early with {status}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Asserts that, duplicates removed (first occurrence kept), each key's
/// events came in commit order.
fn assert_per_key_order(seen: &[Seen], what: &str) {
    let mut first = HashSet::new();
    let mut by_key: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for (key, n, id) in seen {
        if first.insert(*id) {
            by_key.entry(key).or_default().push(*n);
        }
    }
    for (key, ns) in by_key {
        assert!(
            ns.windows(2).all(|w| w[0] < w[1]),
            "{what}: key {key} out of order: {ns:?}"
        );
    }
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `outbox-relay <args> <store args> --json`, parsed.
fn json_of(args: &[&str], store: &[&str]) -> serde_json::Value {
    let out = relay(args).args(store).arg("--json").output().unwrap();
    assert_success(&out, &args.join(" "));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{} is not JSON ({e}): {}", args.join(" "), stdout(&out)))
}

/// The group named `name` in a `group list --json` / `status --json` array.
fn group<'a>(groups: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    groups
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_groups_fan_out_independently_then_start_now_status_and_drop() {
    let url = database_url();
    let (schema, pool) = migrated_log("outbox_cligrp").await;
    let store_args = ["--store", url.as_str(), "--pg-schema", schema.as_str()];
    let producer = log_store(&schema, |o| o).await;

    // Group a: NATS JetStream. Group b: a JSON-lines file.
    let nats = NatsFixture::new().await;
    let topic = nats.topic();
    let prefix = nats
        .subject(&topic)
        .strip_suffix(&format!(".{topic}"))
        .unwrap()
        .to_owned();
    let dir = tempfile::tempdir().unwrap();
    let file_b = dir.path().join("b.jsonl");
    let run = |group: &str, id: &str, sink: &[&str]| {
        ChildGuard::new(
            relay(&["run", "--group", group, "--relay-id", id])
                .args(store_args)
                .args(sink)
                .args(["--poll-interval-ms", "100", "--lock-timeout-ms", "3000"])
                .args(["--retry-base-ms", "100", "--max-attempts", "2"])
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let nats_url = nats.url().to_owned();
    let to_nats = [
        "--sink",
        nats_url.as_str(),
        "--nats-subject-prefix",
        &prefix,
    ];
    let b_sink = format!("jsonl:{}", file_b.display());

    // Batch 1: 40 routable events, and 3 for a subject no stream captures
    // (NATS: PUBLISH_UNROUTABLE, a dead letter of group a only).
    let mut next = 0;
    let mut routable = commit(&producer, &topic, 40, &mut next).await;
    let unroutable = commit(&producer, &nats.unknown_topic(), 3, &mut next).await;
    let mut relay_a = run("a", "relay-a", &to_nats);
    let mut relay_b = run("b", "relay-b", &["--sink", &b_sink]);

    let mut all: HashSet<EventId> = routable.union(&unroutable).copied().collect();
    wait_file(&file_b, &all, &mut relay_b).await;
    let got_a = nats.drain(40).await;
    let ids_a: HashSet<EventId> = got_a.iter().filter_map(|r| r.message_id).collect();
    assert_eq!(ids_a, routable, "group a: every routable event");
    let deadline = Instant::now() + Duration::from_secs(30);
    let dead_a = loop {
        let groups = json_of(&["group", "list"], &store_args);
        let dead = group(&groups, "a").map_or(0, |g| g["dead"].as_u64().unwrap());
        if dead == 3 || Instant::now() > deadline {
            break groups;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let a = group(&dead_a, "a").unwrap();
    assert_eq!(a["dead"], 3, "{dead_a}");
    assert_eq!(a["dead_by_code"]["PUBLISH_UNROUTABLE"], 3, "{dead_a}");
    assert_eq!(group(&dead_a, "b").unwrap()["dead"], 0, "{dead_a}");
    // `dead list --group` reads one group's dead letters.
    let out = relay(&["dead", "list", "--group", "a", "--json"])
        .args(store_args)
        .output()
        .unwrap();
    assert_success(&out, "dead list --group a");
    let listed: HashSet<EventId> = stdout(&out)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(listed, unroutable);
    let out = relay(&["dead", "list", "--group", "b"])
        .args(store_args)
        .output()
        .unwrap();
    assert!(
        stdout(&out).contains("(no dead letters)"),
        "{}",
        stdout(&out)
    );

    // Group a's sink goes away (its relay now points at a dead port): group
    // b still delivers batch 2 at once; group a's events wait, not dead.
    stop(&mut relay_a);
    let dead_port = format!("nats://{}", free_addr());
    let metrics = free_addr();
    let mut relay_a = run(
        "a",
        "relay-a",
        &["--sink", &dead_port, "--metrics-addr", &metrics],
    );
    // Started (its signal handler is installed right after its listener).
    let deadline = Instant::now() + Duration::from_secs(30);
    while support::get(&metrics, "/healthz").is_none() {
        assert!(Instant::now() < deadline, "relay a (outage) did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let batch2 = commit(&producer, &topic, 40, &mut next).await;
    routable.extend(batch2.iter().copied());
    all.extend(batch2.iter().copied());
    let seen_b = wait_file(&file_b, &all, &mut relay_b).await;
    let status = json_of(&["status"], &store_args);
    let a = group(&status["groups"], "a").unwrap();
    assert!(a["pending"].as_u64().unwrap() >= 1, "{status}");
    assert_eq!(a["dead"], 3, "outage costs nothing: {status}");
    assert_eq!(
        group(&status["groups"], "b").unwrap()["pending"],
        0,
        "{status}"
    );
    // status --json names the groups, their shards and the relays.
    assert_eq!(status["mode"], "log");
    // A relay without --shard joins its group's relay group: it holds all
    // 64 virtual shards when alone.
    assert_eq!(a["shards"].as_array().unwrap().len(), 64, "{status}");
    assert_eq!(a["shards"][0]["shard"], "0/64", "{status}");
    // The lease owner is the configured id plus a per-process suffix.
    assert!(
        a["shards"][0]["owner"]
            .as_str()
            .is_some_and(|o| o.starts_with("relay-a#")),
        "{status}"
    );
    let relays: HashMap<String, String> = status["relays"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["relay"].as_str().unwrap().to_owned(),
                r["group"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        relays
            .iter()
            .find(|(relay, _)| relay.starts_with("relay-b#"))
            .map(|(_, group)| group.as_str()),
        Some("b"),
        "{status}"
    );
    assert!(
        status["horizon"]["replication_slots"].is_array(),
        "{status}"
    );
    assert!(status["log"]["generation"].is_i64(), "{status}");

    // The sink is back: group a catches up, nothing lost, order kept.
    stop(&mut relay_a);
    let mut relay_a = run("a", "relay-a", &to_nats);
    let got_a2 = nats.drain(40).await;
    let seen_a: Vec<Seen> = got_a
        .iter()
        .chain(&got_a2)
        .map(|r| {
            (
                r.key.clone().unwrap(),
                n_of(&r.payload),
                r.message_id.unwrap(),
            )
        })
        .collect();
    let ids_a: HashSet<EventId> = seen_a.iter().map(|s| s.2).collect();
    assert_eq!(ids_a, routable, "group a: every routable event once back");
    assert_per_key_order(&seen_a, "group a (NATS)");
    let ids_b: HashSet<EventId> = seen_b.iter().map(|s| s.2).collect();
    assert_eq!(ids_b, all, "group b: every committed event");
    assert_per_key_order(&seen_b, "group b (JSON lines)");

    // Group c starts from now: none of the 83 older events.
    let file_c = dir.path().join("c.jsonl");
    let c_sink = format!("jsonl:{}", file_c.display());
    let mut relay_c = ChildGuard::new(
        relay(&[
            "run",
            "--group",
            "c",
            "--start-from",
            "now",
            "--relay-id",
            "relay-c",
        ])
        .args(store_args)
        .args(["--sink", &c_sink, "--poll-interval-ms", "100"])
        .args(["--lock-timeout-ms", "1000"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while group(&json_of(&["group", "list"], &store_args), "c")
        .is_none_or(|c| c["shards"].as_array().unwrap().is_empty())
    {
        assert!(Instant::now() < deadline, "group c never claimed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let batch3 = commit(&producer, &topic, 8, &mut next).await;
    all.extend(batch3.iter().copied());
    let seen_c = wait_file(&file_c, &batch3, &mut relay_c).await;
    let ids_c: HashSet<EventId> = seen_c.iter().map(|s| s.2).collect();
    assert_eq!(
        ids_c, batch3,
        "group c: only events committed after it started"
    );
    assert_per_key_order(&seen_c, "group c");
    wait_file(&file_b, &all, &mut relay_b).await;

    // Group c stops reading; events committed after that are not passed
    // by c, so c holds back the rotation that would truncate them.
    stop(&mut relay_c);
    let batch4 = commit(&producer, &topic, 4, &mut next).await;
    all.extend(batch4.iter().copied());
    wait_file(&file_b, &all, &mut relay_b).await;
    nats.drain(12).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let reason = loop {
        match producer.rotate_now().await.unwrap() {
            Rotation::Blocked(reason) if reason.contains("has not passed") => {
                let groups = json_of(&["group", "list"], &store_args);
                let holders: Vec<&str> = groups
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|g| g["holds_rotation"] == true)
                    .map(|g| g["name"].as_str().unwrap())
                    .collect();
                if holders == ["c"] {
                    break reason;
                }
            }
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "rotation never came to be held by group c alone"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let status = json_of(&["status"], &store_args);
    assert_eq!(
        status["log"]["rotation_held_by"],
        serde_json::json!(["c"]),
        "{reason}: {status}"
    );
    let text = relay(&["status"]).args(store_args).output().unwrap();
    assert!(
        stdout(&text).contains("held back by group \"c\""),
        "{}",
        stdout(&text)
    );

    // `group drop` shows what it would delete and refuses without --yes
    // (no terminal); with --yes the group is gone and rotation proceeds.
    tokio::time::sleep(Duration::from_millis(1200)).await; // c's lease lapses
    let out = relay(&["group", "drop", "c"])
        .args(store_args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success(), "drop without --yes ran");
    assert!(
        stdout(&out).contains("would drop group \"c\": 64 cursor(s)"),
        "{}",
        stdout(&out)
    );
    assert!(stderr(&out).contains("--yes"), "{}", stderr(&out));
    assert!(group(&json_of(&["group", "list"], &store_args), "c").is_some());
    let out = relay(&["group", "drop", "c", "--yes"])
        .args(store_args)
        .output()
        .unwrap();
    assert_success(&out, "group drop c --yes");
    assert!(
        stdout(&out).contains("dropped group \"c\""),
        "{}",
        stdout(&out)
    );
    let groups = json_of(&["group", "list"], &store_args);
    assert!(group(&groups, "c").is_none(), "{groups}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match producer.rotate_now().await.unwrap() {
            Rotation::Rotated { .. } => break,
            Rotation::Blocked(reason) => assert!(
                Instant::now() < deadline,
                "rotation still blocked after the drop: {reason}"
            ),
            other => panic!("{other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let out = relay(&["group", "drop", "c", "--yes"])
        .args(store_args)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no consumer group \"c\""),
        "{}",
        stderr(&out)
    );

    stop(&mut relay_a);
    stop(&mut relay_b);
    let _ = nats.jetstream().delete_stream(nats.stream()).await;
    drop(producer);
    drop_schema(&pool, &schema).await;
}

/// Group names are checked before anything connects, naming the flag; a
/// store without groups refuses one.
#[test]
fn group_names_are_validated_and_need_the_event_log() {
    let out = relay(&[
        "run",
        "--store",
        "postgres://127.0.0.1:1/none",
        "--sink",
        "stdout",
        "--group",
        "kafka export",
    ])
    .output()
    .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("--group") && err.contains("' ' at position 5"),
        "{err}"
    );
    let out = relay(&["run", "--store", "postgres://127.0.0.1:1/none"])
        .args(["--sink", "stdout", "--start-from", "yesterday"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--start-from"), "{}", stderr(&out));
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("o.db").display());
    assert_success(
        &relay(&["migrate", "--store", &db]).output().unwrap(),
        "migrate SQLite",
    );
    let out = relay(&["status", "--store", &db, "--group", "exports"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("--group") && err.contains("PostgreSQL event log"),
        "{err}"
    );
    // The default group is every store's.
    let out = relay(&["dead", "list", "--store", &db, "--group", "default"])
        .output()
        .unwrap();
    assert_success(&out, "dead list --group default on SQLite");
}
