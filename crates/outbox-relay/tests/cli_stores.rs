//! `outbox-relay run` over several stores: one relay per store into one
//! sink, metrics and `/readyz` by store name, a store that is down does not
//! stop the others; bad input (two stores with one name, a store list that
//! does not parse) is refused naming the problem.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod support;

use outbox_core::{NewEvent, Store};
use outbox_sqlite::{enqueue_batch, SqliteStore};
use outbox_testkit::process::ChildGuard;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{free_addr, get, relay, stop, wait_jsonl_ids};

fn stderr_of(args: &[&str]) -> String {
    let out = relay(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn two_stores_with_one_name_are_refused_naming_it() {
    let err = stderr_of(&[
        "run",
        "--store",
        "tenant-a=sqlite://a.db",
        "--store",
        "tenant-a=sqlite://b.db",
        "--sink",
        "stdout",
    ]);
    assert!(err.contains("two stores are named \"tenant-a\""), "{err}");
}

#[test]
fn a_store_list_that_does_not_parse_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("stores.toml");
    std::fs::write(&list, "[[store]\nname = \"a\"\n").unwrap();
    let err = stderr_of(&[
        "run",
        "--stores",
        list.to_str().unwrap(),
        "--sink",
        "stdout",
    ]);
    assert!(err.contains("invalid store list"), "{err}");
    assert!(err.contains("stores.toml"), "{err}");
    // A store of the list setting the process's sink is refused too.
    std::fs::write(
        &list,
        "[[store]]\nname = \"a\"\nurl = \"sqlite://a.db\"\nsink = \"stdout\"\n",
    )
    .unwrap();
    let err = stderr_of(&[
        "run",
        "--stores",
        list.to_str().unwrap(),
        "--sink",
        "stdout",
    ]);
    assert!(err.contains("`sink` in [[store]] a of"), "{err}");
}

#[test]
fn other_commands_take_one_store() {
    let err = stderr_of(&["migrate", "--store", "a=sqlite://a.db"]);
    assert!(err.contains("this command works on one store"), "{err}");
}

async fn store_with(url: &str, n: usize, key: &str) -> SqliteStore {
    let store = SqliteStore::connect(url).await.unwrap();
    store.migrate().await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let events: Vec<NewEvent> = (0..n)
        .map(|i| NewEvent::new("stores.test", key, format!("{i}").into_bytes()))
        .collect();
    enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    store
}

/// Two SQLite stores (one named on the command line, one in a list file)
/// and a PostgreSQL store that cannot be reached: the two deliver every
/// event to the one sink, `/metrics` counts them by store name, and
/// `/readyz` names the store that is down (503) without its password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relay_serves_several_stores_and_one_down_stops_none() {
    let dir = tempfile::tempdir().unwrap();
    let url = |f: &str| format!("sqlite://{}", dir.path().join(f).display());
    let (a, b) = (url("a.db"), url("b.db"));
    let store_a = store_with(&a, 7, "ka").await;
    let store_b = store_with(&b, 5, "kb").await;
    let list = dir.path().join("stores.toml");
    std::fs::write(
        &list,
        format!(
            "[[store]]\nname = \"b\"\nurl = \"{b}\"\nbatch_size = 2\n\n[[store]]\nname = \"down\"\nurl = \"postgres://relay:s3cret@127.0.0.1:1/nothing\"\n"
        ),
    )
    .unwrap();
    let addr = free_addr();
    let out = dir.path().join("out.jsonl");
    let mut child = ChildGuard::new(
        relay(&[
            "run",
            "--store",
            &format!("a={a}"),
            "--stores",
            list.to_str().unwrap(),
            "--poll-interval-ms",
            "100",
            "--metrics-addr",
            &addr,
        ])
        .arg("--sink")
        .arg(format!("jsonl:{}", out.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    // The relay's log, read as it is written (a pipe left unread would
    // block the relay once full).
    let log = Arc::new(Mutex::new(String::new()));
    let stderr = child.child().stderr.take().unwrap();
    let lines = Arc::clone(&log);
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let mut all = lines.lock().unwrap();
            all.push_str(&line);
            all.push('\n');
        }
    });
    let ids = wait_jsonl_ids(&out, 12, &mut child).await;
    assert_eq!(ids.len(), 12, "every event of a and b reached the one sink");
    for store in [&store_a, &store_b] {
        let stats = store.stats().await.unwrap();
        assert_eq!((stats.pending, stats.in_flight), (0, 0), "{stats:?}");
    }

    let deadline = Instant::now() + Duration::from_secs(30);
    let (body, ready) = loop {
        let body = get(&addr, "/metrics").map(|(_, b)| b).unwrap_or_default();
        let counted = |store: &str| -> f64 {
            body.lines()
                .filter(|l| {
                    l.starts_with("outbox_events_delivered_total")
                        && l.contains(&format!("store=\"{store}\""))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        if counted("a") == 7.0 && counted("b") == 5.0 {
            break (body, get(&addr, "/readyz").unwrap());
        }
        assert!(Instant::now() < deadline, "metrics by store: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        !body.contains("outbox_events_delivered_total{") || body.contains("store=\""),
        "{body}"
    );
    assert!(
        !body.contains("s3cret") && !body.contains("127.0.0.1:1"),
        "{body}"
    );
    let (status, text) = ready;
    assert_eq!(status, 503, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["stores"]["a"]["ready"], serde_json::json!(true), "{text}");
    assert_eq!(v["stores"]["b"]["ready"], serde_json::json!(true), "{text}");
    assert_eq!(
        v["stores"]["down"]["store"]["state"],
        serde_json::json!("opening"),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");
    // The down store's first connection gives up after the connect policy
    // (about 9 s), so its line comes when it comes: waited for, bounded.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !log.lock().unwrap().contains("store=down") {
        assert!(
            Instant::now() < deadline,
            "the store that is down is logged by name: {}",
            log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop(&mut child);
    let log = log.lock().unwrap();
    assert!(!log.contains("s3cret"), "{log}");
}
