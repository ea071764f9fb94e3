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
    let console = free_addr();
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
            "--console-addr",
            &console,
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
    // The console beside the relays lists every store by name, the one
    // down as unreachable (once its first connection gave up), and serves
    // each store's pages under its prefix.
    let deadline = Instant::now() + Duration::from_secs(60);
    let index = loop {
        if let Some((200, body)) = get(&console, "/") {
            break body;
        }
        assert!(Instant::now() < deadline, "the console did not answer");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for name in ["a", "b", "down"] {
        assert!(
            index.contains(&format!(r#"href="/stores/{name}""#)),
            "{index}"
        );
    }
    assert!(index.contains(r#"data-test="down-down""#), "{index}");
    assert!(
        !index.contains("s3cret") && !index.contains("://"),
        "{index}"
    );
    let (status, page) = get(&console, "/stores/b/dead").unwrap();
    assert_eq!(status, 200, "{page}");
    assert!(page.contains(r#"data-test="dead-count">0<"#), "{page}");
    assert_eq!(get(&console, "/stores/down/dead").unwrap().0, 503);
    stop(&mut child);
    let log = log.lock().unwrap();
    assert!(!log.contains("s3cret"), "{log}");
}

#[test]
fn a_store_name_that_is_not_url_safe_is_refused_by_status_and_console() {
    for command in ["status", "console"] {
        let err = stderr_of(&[
            command,
            "--store",
            "Tenant/A=sqlite://a.db",
            "--store",
            "b=sqlite://b.db",
        ]);
        // `Tenant/A=...` is no name at all (a `/`), so it reads as a URL
        // without a name among several.
        assert!(err.contains("has no name"), "{command}: {err}");
        let err = stderr_of(&[
            command,
            "--store",
            "Tenant=sqlite://a.db",
            "--store",
            "b=sqlite://b.db",
        ]);
        assert!(
            err.contains("invalid store name \"Tenant\""),
            "{command}: {err}"
        );
    }
}

/// `status` over a SQLite store, a PostgreSQL event log and a store that
/// cannot be reached: every store under its name (never its URL or
/// password), the one down says so in its section, and the exit code says
/// something failed; `--json` gives one object per store named by `store`.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_over_several_stores_shows_each_by_name_and_fails_for_the_one_down() {
    let (schema, pool) = support::pg::migrated_log("outbox_status_stores").await;
    let pg = support::pg::log_store(&schema, |o| o).await;
    let mut tx = pg.pool().begin().await.unwrap();
    for i in 0..4 {
        pg.outbox()
            .enqueue(
                &mut tx,
                NewEvent::new("stores.test", "kp", format!("{i}").into_bytes()),
            )
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = format!("sqlite://{}", dir.path().join("a.db").display());
    let _store_a = store_with(&a, 3, "ka").await;
    let list = dir.path().join("stores.toml");
    std::fs::write(
        &list,
        format!(
            "[[store]]\nname = \"b\"\nurl = \"{}\"\npg_schema = \"{schema}\"\n\n[[store]]\nname = \"down\"\nurl = \"postgres://relay:s3cret@127.0.0.1:1/nothing\"\n",
            support::pg::database_url()
        ),
    )
    .unwrap();
    let list = list.to_str().unwrap();
    let store_a = format!("a={a}");

    let out = relay(&["status", "--store", &store_a, "--stores", list])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let section = |name: &str| -> String {
        let from = stdout
            .find(&format!("== store {name} =="))
            .unwrap_or_else(|| panic!("no section of {name}: {stdout}"));
        let rest = &stdout[from + 1..];
        rest[..rest.find("== store ").unwrap_or(rest.len())].to_owned()
    };
    assert!(section("a").contains("pending:    3"), "{stdout}");
    assert!(section("a").contains("store:      a\n"), "{stdout}");
    let b = section("b");
    assert!(b.contains("pending:    4"), "{stdout}");
    assert!(b.contains("mode:       log"), "{stdout}");
    assert!(section("down").contains("unreachable: "), "{stdout}");
    assert!(
        stderr.contains("1 of 3 stores could not be read: down"),
        "{stderr}"
    );
    for text in [&stdout, &stderr] {
        // The driver may name the host it could not reach, never the URL
        // nor its password.
        for never in ["s3cret", "sqlite://", "postgres://"] {
            assert!(!text.contains(never), "{never} shown: {text}");
        }
    }

    let out = relay(&["status", "--json", "--store", &store_a, "--stores", list])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("s3cret") && !text.contains("://"), "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let stores = v["stores"].as_array().unwrap();
    let names: Vec<&str> = stores
        .iter()
        .map(|s| s["store"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a", "b", "down"], "{text}");
    assert_eq!(stores[0]["pending"], serde_json::json!(3), "{text}");
    assert_eq!(stores[1]["pending"], serde_json::json!(4), "{text}");
    assert_eq!(stores[1]["mode"], serde_json::json!("log"), "{text}");
    assert!(stores[2]["error"].is_string(), "{text}");

    // Every store up: exit 0.
    let out = relay(&["status", "--store", &store_a, "--store", &format!("c={a}")])
        .output()
        .unwrap();
    support::assert_success(&out, "status over two stores");
    drop(pg);
    support::pg::drop_schema(&pool, &schema).await;
}
