//! `outbox-relay console` over HTTP, as a real process against PostgreSQL
//! (the event log, each test in its own schema) and SQLite: the pages, the
//! read-only default, the token / session / CSRF refusals, the dead-letter
//! filters, paging, confirmation, replay and purge, pause and resume, and
//! the message pages of bad input and of a store that is down.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod console_support;
mod support;

use console_support::{
    dead_letters, enc, held_keys, http, http_from, Console, Held, Resp, Session, TOKEN,
};
use outbox_core::{
    ClaimRequest, ControlStore, DeadLetterQuery, DeadLetterStore, ErrorCode, EventId, NewEvent,
    RelayId, Resolution, Settlement, ShardSpec, Store,
};
use outbox_postgres::PgLogStore;
use std::time::{Duration, Instant};
use support::pg::{database_url, drop_schema, log_store, migrated_log};

fn store_args(url: &str, schema: &str) -> Vec<String> {
    vec![
        "--store".into(),
        url.into(),
        "--pg-schema".into(),
        schema.into(),
    ]
}

async fn dead_ids(store: &PgLogStore) -> Vec<EventId> {
    store
        .list_dead(&DeadLetterQuery::default())
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.event.id)
        .collect()
}

/// The text of `data-test="NAME">...<` on `page`.
fn marked<'a>(page: &'a str, name: &str) -> Option<&'a str> {
    let tag = format!(r#"data-test="{name}">"#);
    let at = page.find(&tag)? + tag.len();
    let rest = &page[at..];
    Some(&rest[..rest.find('<')?])
}

/// Two `order.created` (`k1` with a JSON payload and a header, `k2`)
/// dead with HANDLER_PERMANENT_FAILURE, one `invoice.sent` (`k1`) with
/// HANDLER_NOT_REGISTERED.
async fn three(store: &PgLogStore, pool: &outbox_postgres::sqlx::PgPool) -> [EventId; 3] {
    let ab = dead_letters(
        store,
        pool,
        vec![
            NewEvent::new(
                "order.created",
                "orders",
                br#"{"n":1,"items":[1,2]}"#.to_vec(),
            )
            .with_key("k1")
            .with_header(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            NewEvent::new("order.created", "orders", b"<b>not json</b>".to_vec()).with_key("k2"),
        ],
        ErrorCode::HANDLER_PERMANENT_FAILURE,
        "bad <order>",
    )
    .await;
    let c = dead_letters(
        store,
        pool,
        vec![NewEvent::new("invoice.sent", "invoices", b"plain".to_vec()).with_key("k1")],
        ErrorCode::HANDLER_NOT_REGISTERED,
        "no handler",
    )
    .await;
    [ab[0], ab[1], c[0]]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_console_shows_every_page_and_refuses_every_change() {
    let (schema, pool) = migrated_log("outbox_console_ro").await;
    let store = log_store(&schema, |o| o).await;
    let [a, _, _] = three(&store, &pool).await;
    // A password in the store URL (PostgreSQL trusts loopback and ignores
    // it) must reach no page and no log line.
    let url = database_url().replacen("://postgres@", "://postgres:s3cret-pw@", 1);
    let console = Console::start(&store_args(&url, &schema), false, &[]);

    let overview = console.get("/", None);
    assert_eq!(overview.status, 200, "{}", overview.body);
    assert!(
        overview.body.contains("Consumer groups"),
        "{}",
        overview.body
    );
    assert!(overview.body.contains("read-only"), "{}", overview.body);
    assert!(
        !overview.body.contains("<form method=\"post\""),
        "{}",
        overview.body
    );
    assert!(overview
        .header("content-security-policy")
        .is_some_and(|v| v.contains("default-src 'none'")));
    let shards = console.get("/shards", None);
    assert_eq!(shards.status, 200);
    let list = console.get("/dead", None);
    assert_eq!(list.status, 200);
    assert_eq!(marked(&list.body, "dead-count"), Some("3"));
    assert!(
        !list.body.contains(r#"name="id""#),
        "no selection boxes read-only"
    );
    let detail = console.get(&format!("/dead/{a}"), None);
    assert_eq!(detail.status, 200);
    for page in [&overview, &shards, &list, &detail] {
        assert!(!page.body.contains("s3cret-pw"), "{}", page.body);
    }

    for (path, body) in [
        ("/groups/pause", "group=default&reason=x".to_owned()),
        ("/groups/resume", "group=default".to_owned()),
        ("/dead/confirm", "do=purge:all".to_owned()),
        ("/dead/act", "do=purge:all&expected=3".to_owned()),
        ("/login", format!("who=eve&token={}", enc(TOKEN))),
    ] {
        let r = console.post(path, None, &body);
        assert_eq!(r.status, 403, "{path}: {}", r.body);
        assert!(r.body.contains("Read-only console"), "{path}: {}", r.body);
    }
    assert_eq!(store.paused("default").await.unwrap(), None);
    assert_eq!(dead_ids(&store).await.len(), 3);

    // Unknown pages and methods get a page too.
    let r = console.get("/nope", None);
    assert_eq!(r.status, 404);
    assert!(r.body.contains("no such page"), "{}", r.body);
    let r = http(&console.addr, "DELETE", "/dead", &[], None);
    assert_eq!(r.status, 405);
    assert!(r.body.contains("Method not allowed"), "{}", r.body);
    assert!(!console.log_text().contains("s3cret-pw"));
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_need_the_token_a_session_and_its_csrf_token() {
    let (schema, pool) = migrated_log("outbox_console_auth").await;
    let store = log_store(&schema, |o| o).await;
    let console = Console::start(&store_args(&database_url(), &schema), true, &[]);
    let pause = |s: Option<&Session>, body: &str| console.post("/groups/pause", s, body);

    // No session.
    let r = pause(None, "group=default&reason=deploy");
    assert_eq!(r.status, 401, "{}", r.body);
    assert!(r.body.contains("Log in first"), "{}", r.body);
    // A wrong token opens none.
    let r = console.post("/login", None, "who=mallory&token=not-the-token-at-all");
    assert_eq!(r.status, 401, "{}", r.body);
    assert!(r.body.contains("Wrong admin token"), "{}", r.body);
    assert!(r.header("set-cookie").is_none());

    let s = console.login("alice");
    // The session without the form's CSRF token, or with another one.
    let r = pause(Some(&s), "group=default&reason=deploy");
    assert_eq!(r.status, 403, "{}", r.body);
    assert!(r.body.contains("CSRF"), "{}", r.body);
    let r = pause(Some(&s), "group=default&reason=deploy&csrf=0000");
    assert_eq!(r.status, 403, "{}", r.body);
    // A cookie naming no session (expired, or forged) with a real token.
    let forged = Session {
        cookie: "outbox_console=forged".into(),
        csrf: s.csrf.clone(),
    };
    let r = pause(
        Some(&forged),
        &format!("group=default&reason=x&csrf={}", s.csrf),
    );
    assert_eq!(r.status, 401, "{}", r.body);
    assert!(r.body.contains("Session expired"), "{}", r.body);
    // A cross-site form post, with the victim's cookie and even its token.
    let r = http(
        &console.addr,
        "POST",
        "/groups/pause",
        &[("Cookie", &s.cookie), ("Origin", "https://evil.example")],
        Some(&format!("group=default&reason=x&csrf={}", s.csrf)),
    );
    assert_eq!(r.status, 403, "{}", r.body);
    assert!(r.body.contains("Cross-site"), "{}", r.body);
    assert_eq!(store.paused("default").await.unwrap(), None);

    // Bad input: no reason, an unknown group.
    let r = pause(Some(&s), &format!("group=default&csrf={}", s.csrf));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("reason"), "{}", r.body);
    let r = pause(Some(&s), &format!("group=nosuch&reason=x&csrf={}", s.csrf));
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.body.contains("no consumer group"), "{}", r.body);

    // The real thing.
    let r = pause(
        Some(&s),
        &format!("group=default&reason=db+upgrade&csrf={}", s.csrf),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.body.contains("Paused consumer group default"),
        "{}",
        r.body
    );
    let p = store.paused("default").await.unwrap().expect("paused");
    assert_eq!(p.by.as_deref(), Some("alice (console)"));
    assert_eq!(p.reason.as_deref(), Some("db upgrade"));
    let overview = console.get("/", Some(&s));
    assert!(overview.body.contains("db upgrade"), "{}", overview.body);
    assert!(overview.body.contains("Resume"), "{}", overview.body);
    let r = console.post(
        "/groups/resume",
        Some(&s),
        &format!("group=default&csrf={}", s.csrf),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(store.paused("default").await.unwrap(), None);

    // After logout the session is gone.
    let r = console.post("/logout", Some(&s), &format!("csrf={}", s.csrf));
    assert_eq!(r.status, 303, "{}", r.body);
    let r = pause(Some(&s), &format!("group=default&reason=x&csrf={}", s.csrf));
    assert_eq!(r.status, 401, "{}", r.body);

    // Every change is in the audit log, by whom; the token is not.
    let log = console.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("console: pause of a consumer group") && l.contains("alice")),
        "{log}"
    );
    assert!(log.contains("console: resume of a consumer group"), "{log}");
    assert!(log.contains("login refused"), "{log}");
    assert!(!log.contains(TOKEN), "{log}");
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_filter_show_confirm_replay_and_purge() {
    let (schema, pool) = migrated_log("outbox_console_dead").await;
    let store = log_store(&schema, |o| o).await;
    let [a, b, c] = three(&store, &pool).await;
    let console = Console::start(&store_args(&database_url(), &schema), true, &[]);
    let s = console.login("bob");
    let count = |path: &str| {
        let r = console.get(path, Some(&s));
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        marked(&r.body, "dead-count").unwrap().to_owned()
    };
    assert_eq!(count("/dead"), "3");
    assert_eq!(count("/dead?type=order.created"), "2");
    assert_eq!(count("/dead?code=HANDLER_NOT_REGISTERED"), "1");
    assert_eq!(count("/dead?key=k2"), "1");
    assert_eq!(count("/dead?type=order.created&key=k1"), "1");
    assert_eq!(count("/dead?older_than=1h"), "0");
    assert_eq!(count("/dead?newer_than=1h"), "3");
    let page = console.get("/dead?type=invoice.sent", Some(&s)).body;
    assert!(page.contains(&c.to_string()) && !page.contains(&a.to_string()));

    // Bad filters and ids: a page saying what is wrong.
    for (path, status, needle) in [
        ("/dead?older_than=yesterday", 400, "invalid age"),
        ("/dead?limit=0", 400, "limit"),
        ("/dead?after=xyz", 400, "not an event id"),
        ("/dead?group=nosuch", 404, "no consumer group"),
        ("/dead/not-a-uuid", 400, "not an event id"),
    ] {
        let r = console.get(path, Some(&s));
        assert_eq!(r.status, status, "{path}: {}", r.body);
        assert!(r.body.contains(needle), "{path}: {}", r.body);
    }
    let missing = EventId::new();
    let r = console.get(&format!("/dead/{missing}"), Some(&s));
    assert_eq!(r.status, 404, "{}", r.body);

    // One event's detail: pretty JSON, headers, final error (escaped).
    let d = console.get(&format!("/dead/{a}"), Some(&s)).body;
    assert!(d.contains("JSON, 21 bytes"), "{d}");
    assert!(d.contains("  &quot;items&quot;: [\n    1,"), "{d}");
    assert!(d.contains("traceparent"), "{d}");
    assert!(
        d.contains("bad &lt;order&gt;") && !d.contains("bad <order>"),
        "{d}"
    );
    let d = console.get(&format!("/dead/{b}"), Some(&s)).body;
    assert!(
        d.contains("text, not JSON") && d.contains("&lt;b&gt;not json"),
        "{d}"
    );

    // Purge all of one code: the confirmation states the count and
    // changes nothing; the act does.
    let r = console.post(
        "/dead/confirm",
        Some(&s),
        &format!("do=purge:all&code=HANDLER_NOT_REGISTERED&csrf={}", s.csrf),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(marked(&r.body, "confirm-count"), Some("1"), "{}", r.body);
    assert_eq!(dead_ids(&store).await, vec![a, b, c]);
    let r = console.post(
        "/dead/act",
        Some(&s),
        &format!("do=purge:all&code=HANDLER_NOT_REGISTERED&csrf={}", s.csrf),
    );
    assert_eq!(r.status, 400, "unconfirmed: {}", r.body);
    let r = console.post(
        "/dead/act",
        Some(&s),
        &format!(
            "do=purge:all&code=HANDLER_NOT_REGISTERED&expected=1&csrf={}",
            s.csrf
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("Purged 1 dead letter"), "{}", r.body);
    assert_eq!(dead_ids(&store).await, vec![a, b]);

    // Replay a selection of one: it leaves the dead letters and is
    // claimable again, with its attempts reset.
    let r = console.post(
        "/dead/confirm",
        Some(&s),
        &format!("do=retry:selected&id={a}&csrf={}", s.csrf),
    );
    assert_eq!(marked(&r.body, "confirm-count"), Some("1"), "{}", r.body);
    let r = console.post(
        "/dead/confirm",
        Some(&s),
        &format!("do=retry:selected&csrf={}", s.csrf),
    );
    assert_eq!(r.status, 400, "nothing selected: {}", r.body);
    let r = console.post(
        "/dead/act",
        Some(&s),
        &format!("do=retry:selected&id={a}&expected=1&csrf={}", s.csrf),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("Replayed 1 dead letter"), "{}", r.body);
    assert_eq!(dead_ids(&store).await, vec![b]);
    let claim = store
        .claim(&ClaimRequest {
            relay_id: RelayId::new("console-test"),
            batch_size: 10,
            lease: Duration::from_secs(60),
            shard: ShardSpec::ALL,
        })
        .await
        .unwrap();
    let ids: Vec<EventId> = claim.events.iter().map(|e| e.id).collect();
    assert_eq!(ids, vec![a], "the replayed event is pending again");
    let settled = store
        .settle(
            claim.token,
            &Settlement::new().with(a, Resolution::Delivered),
        )
        .await
        .unwrap();
    assert_eq!(settled.applied, 1);

    // "All matching" that grew after the confirmation is refused.
    let r = console.post(
        "/dead/confirm",
        Some(&s),
        &format!("do=purge:all&csrf={}", s.csrf),
    );
    assert_eq!(marked(&r.body, "confirm-count"), Some("1"), "{}", r.body);
    let late = dead_letters(
        &store,
        &pool,
        vec![NewEvent::new("late", "t", b"x".to_vec())],
        ErrorCode::HANDLER_PERMANENT_FAILURE,
        "late",
    )
    .await;
    assert_eq!(late.len(), 1);
    let r = console.post(
        "/dead/act",
        Some(&s),
        &format!("do=purge:all&expected=1&csrf={}", s.csrf),
    );
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(r.body.contains("nothing was changed"), "{}", r.body);
    assert_eq!(dead_ids(&store).await.len(), 2);
    let r = console.post(
        "/dead/act",
        Some(&s),
        &format!("do=explode&csrf={}", s.csrf),
    );
    assert_eq!(r.status, 400, "{}", r.body);

    let log = console.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("console: purge of dead letters") && l.contains("bob")),
        "{log}"
    );
    assert!(log.contains("console: replay of dead letters"), "{log}");
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_dead_letters_are_paged() {
    let (schema, pool) = migrated_log("outbox_console_10k").await;
    let store = log_store(&schema, |o| o).await;
    let events: Vec<NewEvent> = (0..10_000)
        .map(|i| {
            NewEvent::new("bulk.event", "bulk", format!("{{\"i\":{i}}}").into_bytes())
                .with_key(format!("k{}", i % 100))
        })
        .collect();
    let ids = dead_letters(
        &store,
        &pool,
        events,
        ErrorCode::HANDLER_PERMANENT_FAILURE,
        "bulk",
    )
    .await;
    let mut sorted = ids.clone();
    sorted.sort();
    let console = Console::start(&store_args(&database_url(), &schema), false, &[]);
    let rows = |page: &str| page.matches(r#"class="mono">"#).count();
    let first = console.get("/dead", None);
    assert_eq!(first.status, 200);
    assert_eq!(marked(&first.body, "dead-count"), Some("10000"));
    assert_eq!(rows(&first.body), 50, "one page of 50");
    assert!(first.body.len() < 200_000, "{} bytes", first.body.len());
    assert!(first.body.contains(&sorted[0].to_string()));
    assert!(!first.body.contains(&sorted[50].to_string()));
    assert_eq!(ids.len(), 10_000);
    let next = first
        .body
        .split(r#"rel="next" data-test="next-page""#)
        .next()
        .and_then(|b| b.rsplit("href=\"").next())
        .map(|h| h.trim_end_matches("\" ").replace("&amp;", "&"))
        .expect("a next-page link");
    let second = console.get(&next, None);
    assert_eq!(second.status, 200, "{next}: {}", second.body);
    assert_eq!(rows(&second.body), 50);
    let row = |id: &EventId| format!(r#"href="/dead/{id}?"#);
    assert!(second.body.contains(&row(&sorted[50])), "{next}");
    assert!(!second.body.contains(&row(&sorted[49])));
    assert!(second.body.contains(&row(&sorted[99])));
    assert!(!second.body.contains(&row(&sorted[100])));
    let big = console.get("/dead?limit=500", None);
    assert_eq!(rows(&big.body), 500);
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_is_down_gives_a_503_page_and_the_console_recovers() {
    let (schema, pool) = migrated_log("outbox_console_down").await;
    let url = database_url();
    let authority = url
        .split_once('@')
        .map_or(url.as_str(), |(_, r)| r)
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let upstream: std::net::SocketAddr = authority.parse().expect("DATABASE_URL host:port");
    let proxy = outbox_testkit::proxy::TcpProxy::start(upstream).await;
    let via = url.replacen(&authority, &proxy.addr().to_string(), 1);
    let console = Console::start(&store_args(&via, &schema), false, &[]);
    assert_eq!(console.get("/", None).status, 200);
    proxy.cut();
    for path in ["/", "/dead", "/shards"] {
        let r = console.get(path, None);
        assert_eq!(r.status, 503, "{path}: {}", r.body);
        assert!(r.body.contains("The store did not answer"), "{}", r.body);
    }
    proxy.restore();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if console.get("/", None).status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the console did not recover");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_console_shows_its_one_group_and_pauses_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let out = support::relay(&["migrate", "--store", &url])
        .output()
        .unwrap();
    support::assert_success(&out, "migrate");
    let console = Console::start(&["--store".into(), url.clone()], true, &[]);
    let s = console.login("carol");
    let overview = console.get("/", Some(&s));
    assert_eq!(overview.status, 200, "{}", overview.body);
    assert!(overview.body.contains("sqlite") && overview.body.contains("default"));
    let shards = console.get("/shards", Some(&s));
    assert!(shards.body.contains("no shard cursors"), "{}", shards.body);
    assert_eq!(
        marked(&console.get("/dead", Some(&s)).body, "dead-count"),
        Some("0")
    );
    let r = console.post(
        "/groups/pause",
        Some(&s),
        &format!("group=default&reason=maintenance&csrf={}", s.csrf),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let store = outbox_sqlite::SqliteStore::connect(&url).await.unwrap();
    let p = store.paused("default").await.unwrap().expect("paused");
    assert_eq!(p.reason.as_deref(), Some("maintenance"));
}

#[test]
fn a_non_loopback_listen_address_is_refused_without_allow_remote() {
    let out = support::relay(&[
        "console",
        "--store",
        "sqlite://never-opened.db",
        "--listen",
        "0.0.0.0:0",
    ])
    .output()
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a loopback address") && err.contains("--allow-remote"),
        "{err}"
    );
    let out = support::relay(&[
        "console",
        "--store",
        "sqlite://never-opened.db",
        "--admin-token-env",
        "OUTBOX_TEST_UNSET_TOKEN_VAR",
    ])
    .output()
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("OUTBOX_TEST_UNSET_TOKEN_VAR"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_relay_the_overview_shows_its_sink_state_and_throughput() {
    let (schema, pool) = migrated_log("outbox_console_relay").await;
    let store = log_store(&schema, |o| o).await;
    let url = database_url();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    let metrics = console_support::free_addr();
    let mut relay = outbox_testkit::process::ChildGuard::new(
        support::relay(&["run"])
            .args(store_args(&url, &schema))
            .args(["--sink", &format!("jsonl:{}", file.display())])
            .args(["--poll-interval-ms", "100", "--metrics-addr", &metrics])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let console = Console::start(&store_args(&url, &schema), false, &["--relay", &metrics]);
    let mut tx = pool.begin().await.unwrap();
    let events = (0..20).map(|i| NewEvent::new("t", "t", format!("{i}").into_bytes()));
    store.outbox().enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    let delivered = support::wait_jsonl_ids(&file, 20, &mut relay).await;
    assert_eq!(delivered.len(), 20);
    // The sampler reads the relay's counter every second: the chart shows
    // once two samples have it.
    let deadline = Instant::now() + Duration::from_secs(60);
    let page = loop {
        let r = console.get("/", None);
        assert_eq!(r.status, 200, "{}", r.body);
        if r.body.contains("Throughput: events delivered per second") {
            break r.body;
        }
        assert!(Instant::now() < deadline, "no throughput chart: {}", r.body);
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(
        page.contains(&format!("relay {metrics}: ready")),
        "the relay's sink state: {page}"
    );
    assert!(page.contains("sink: closed"), "{page}");
    support::stop(&mut relay);
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_lane_shows_which_key_waits_behind_which_head() {
    let (schema, pool) = migrated_log("outbox_console_lane").await;
    let store = log_store(&schema, |o| {
        o.with_dead_head_policy(outbox_core::DeadHeadPolicy::Block)
    })
    .await;
    let Held {
        dead,
        behind_dead,
        retried,
        behind_retried,
    } = held_keys(&store, &pool).await;
    let console = Console::start(&store_args(&database_url(), &schema), false, &[]);

    let page = console.get("/lane?group=default", None);
    assert_eq!(page.status, 200, "{}", page.body);
    let body = &page.body;
    assert_eq!(marked(body, "held-count"), Some("2"), "{body}");
    // The dead head first (three events wait behind it), linked to its
    // detail; its message escaped.
    let at_dead = body.find(&dead.to_string()).expect("the dead head");
    let at_retried = body.find(&retried.to_string()).expect("the retried head");
    assert!(at_dead < at_retried, "most waiting first: {body}");
    assert!(
        body.contains(&format!("/dead/{dead}?group=default")),
        "{body}"
    );
    assert!(body.contains("dead, blocks its key"), "{body}");
    assert!(body.contains("card &lt;expired&gt;"), "{body}");
    assert!(body.contains("inventory service unavailable"), "{body}");
    let waiting: Vec<&str> = body
        .match_indices(r#"data-test="waiting">"#)
        .map(|(i, m)| {
            let rest = &body[i + m.len()..];
            &rest[..rest.find('<').unwrap()]
        })
        .collect();
    assert_eq!(waiting, vec!["3", "1"], "{body}");
    // Next in line: the first event parked behind each head.
    assert!(body.contains(&behind_dead[0].to_string()), "{body}");
    assert!(!body.contains(&behind_dead[1].to_string()), "{body}");
    assert!(body.contains(&behind_retried.to_string()), "{body}");
    // The overview links its lane counts here; a bad group is a 404 page.
    assert!(console.get("/", None).body.contains("/lane?group=default"));
    let r = console.get("/lane?group=nope", None);
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(
        r.body.contains("no consumer group &quot;nope&quot;"),
        "{}",
        r.body
    );
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_with_console_addr_serves_the_console_beside_the_relay() {
    let (schema, pool) = migrated_log("outbox_console_embedded").await;
    let store = log_store(&schema, |o| o).await;
    let url = database_url().replacen("://postgres@", "://postgres:s3cret-pw@", 1);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    // Before the relay starts: it would hold the shard lease otherwise.
    dead_letters(
        &store,
        &pool,
        vec![NewEvent::new("t", "t", b"x".to_vec())],
        ErrorCode::HANDLER_NOT_REGISTERED,
        "no handler",
    )
    .await;
    let (addr, metrics) = (console_support::free_addr(), console_support::free_addr());
    let mut relay = outbox_testkit::process::ChildGuard::new(
        support::relay(&["run"])
            .args(store_args(&url, &schema))
            .args(["--sink", &format!("jsonl:{}", file.display())])
            .args(["--poll-interval-ms", "100", "--metrics-addr", &metrics])
            .args(["--console-addr", &addr, "--console-admin-token-file"])
            .arg(&token)
            .args([
                "--console-allowed-hosts",
                "console.internal, ops.example:443",
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    // A token is set: every page needs the login.
    let deadline = Instant::now() + Duration::from_secs(60);
    while console_support::try_http(&addr, "GET", "/login", &[], None).is_none() {
        assert!(Instant::now() < deadline, "no console on {addr}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let console = Console::attach(addr.clone());
    let session = console.login("ops");
    // console_allowed_hosts names more hosts; others are still refused.
    for (host, status) in [
        ("console.internal:8089", 200),
        ("ops.example:443", 200),
        ("ops.example:8443", 421),
        ("evil.example", 421),
    ] {
        let r = http(
            &addr,
            "GET",
            "/shards",
            &[("Host", host), ("Cookie", &session.cookie)],
            None,
        );
        assert_eq!(r.status, status, "Host {host}: {}", r.body);
    }
    let page = loop {
        if let Some(r) =
            console_support::try_http(&addr, "GET", "/", &[("Cookie", &session.cookie)], None)
        {
            if r.body.contains(&format!("relay {metrics}: ready")) {
                break r;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no console with the relay's sink state on {addr}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(!page.body.contains("s3cret-pw"), "{}", page.body);
    let list = console.get("/dead?group=default", Some(&session));
    assert_eq!(marked(&list.body, "dead-count"), Some("1"), "{}", list.body);
    // The relay still relays.
    let mut tx = pool.begin().await.unwrap();
    store
        .outbox()
        .enqueue_batch(&mut tx, vec![NewEvent::new("t", "t", b"y".to_vec())])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(support::wait_jsonl_ids(&file, 1, &mut relay).await.len(), 1);
    support::stop(&mut relay);

    // A console on a non-loopback address needs --console-allow-remote.
    let out = support::relay(&["run"])
        .args(store_args(&database_url(), &schema))
        .args(["--sink", "stdout", "--console-addr", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a loopback address"), "{err}");
    drop_schema(&pool, &schema).await;
}

/// Texts of the dead letters of [`three`] and [`held_keys`] that no page
/// may show before the login: payloads, headers, errors, keys and types.
const SECRET_BITS: &[&str] = &[
    "items",
    "traceparent",
    "0af7651916cd43dd",
    "not json",
    "plain",
    "amount",
    "bad &lt;order&gt;",
    "card &lt;expired&gt;",
    "inventory service",
    "acct-7",
    "order.created",
    "invoice.sent",
    "payment.captured",
];

fn assert_shows_nothing(what: &str, r: &Resp) {
    for bit in SECRET_BITS {
        assert!(!r.body.contains(bit), "{what} shows {bit:?}: {}", r.body);
    }
    // The Location of a redirect repeats the asked path (the caller's own).
    for (k, v) in r
        .headers
        .iter()
        .filter(|(k, _)| !k.eq_ignore_ascii_case("location"))
    {
        assert!(
            !SECRET_BITS.iter().any(|b| v.contains(b)),
            "{what}: header {k}: {v}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_every_page_needs_the_login_and_shows_no_payload() {
    let (schema, pool) = migrated_log("outbox_console_gate").await;
    let store = log_store(&schema, |o| o).await;
    let [a, _, c] = three(&store, &pool).await;
    let blocking = log_store(&schema, |o| {
        o.with_dead_head_policy(outbox_core::DeadHeadPolicy::Block)
    })
    .await;
    let held = held_keys(&blocking, &pool).await;
    let console = Console::start(&store_args(&database_url(), &schema), true, &[]);
    let forged = Session {
        cookie: "outbox_console=forged".into(),
        csrf: String::new(),
    };
    let pages = [
        "/".to_owned(),
        "/shards".to_owned(),
        "/lane".to_owned(),
        "/lane?group=default".to_owned(),
        "/dead".to_owned(),
        "/dead?type=order.created&key=k1".to_owned(),
        format!("/dead/{a}"),
        format!("/dead/{c}?group=default"),
        format!("/dead/{}", held.dead),
        "/nope".to_owned(),
    ];
    for path in &pages {
        for session in [None, Some(&forged)] {
            let r = console.get(path, session);
            let what = format!("GET {path} (cookie: {})", session.is_some());
            assert_eq!(r.status, 303, "{what}: {}", r.body);
            let to = r.header("location").unwrap_or_default();
            assert!(to.starts_with("/login?next="), "{what}: {to}");
            assert_shows_nothing(&what, &r);
        }
    }
    // HEAD too, and every change (no session: 401 before anything is read).
    let r = http(&console.addr, "HEAD", &format!("/dead/{a}"), &[], None);
    assert_eq!(r.status, 303, "{}", r.body);
    for path in ["/dead/confirm", "/dead/act", "/groups/pause", "/logout"] {
        let r = console.post(path, None, "do=purge:all&group=default&reason=x");
        assert_eq!(r.status, 401, "POST {path}: {}", r.body);
        assert!(r.body.contains("Log in first"), "POST {path}: {}", r.body);
        assert_shows_nothing(&format!("POST {path}"), &r);
    }
    // The login page and the assets are open: the way in.
    let r = console.get(&format!("/login?next=%2Fdead%2F{a}"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains(r#"name="token""#), "{}", r.body);
    assert!(
        r.body
            .contains(&format!(r#"name="next" value="/dead/{a}""#)),
        "{}",
        r.body
    );
    assert_shows_nothing("the login page", &r);
    assert_eq!(console.get("/assets/console.css", None).status, 200);

    // After the login, back where the operator was going; only local paths.
    let login = |next: &str| {
        console.post(
            "/login",
            None,
            &format!("who=ops&token={}&next={}", enc(TOKEN), enc(next)),
        )
    };
    let r = login(&format!("/dead/{a}"));
    assert_eq!(r.status, 303, "{}", r.body);
    assert_eq!(r.header("location"), Some(format!("/dead/{a}").as_str()));
    for evil in [
        "//evil.example/x",
        "https://evil.example/",
        "/\\evil.example",
    ] {
        let r = login(evil);
        assert_eq!(r.status, 303, "{}", r.body);
        assert_eq!(r.header("location"), Some("/"), "next={evil}");
    }
    let s = console.login("ops");
    let detail = console.get(&format!("/dead/{a}"), Some(&s));
    assert_eq!(detail.status, 200, "{}", detail.body);
    assert!(detail.body.contains("traceparent"), "{}", detail.body);
    let lane = console.get("/lane", Some(&s));
    assert!(lane.body.contains("card &lt;expired&gt;"), "{}", lane.body);
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_host_is_refused_on_every_route() {
    let (schema, pool) = migrated_log("outbox_console_host").await;
    let store = log_store(&schema, |o| o).await;
    let [a, _, _] = three(&store, &pool).await;
    let args = store_args(&database_url(), &schema);
    let console = Console::start(&args, true, &[]);
    let port = console.addr.rsplit(':').next().unwrap().to_owned();
    // A page of evil.example whose name now resolves to 127.0.0.1 (DNS
    // rebinding): the browser sends its own name as Host and Origin.
    let host = format!("evil.example:{port}");
    let origin = format!("http://{host}");
    let s = console.login("ops");
    let gets = [
        "/".to_owned(),
        "/shards".to_owned(),
        "/lane".to_owned(),
        "/dead".to_owned(),
        format!("/dead/{a}"),
        "/login".to_owned(),
        "/assets/console.css".to_owned(),
        "/nope".to_owned(),
    ];
    let refused = |what: &str, r: &Resp| {
        assert_eq!(r.status, 421, "{what}: {}", r.body);
        assert!(r.body.contains("evil.example"), "{what}: {}", r.body);
        assert!(r.body.contains("--allowed-host"), "{what}: {}", r.body);
        assert!(r.header("set-cookie").is_none(), "{what}");
        assert_shows_nothing(what, r);
    };
    for path in &gets {
        for cookie in ["", s.cookie.as_str()] {
            let r = http(
                &console.addr,
                "GET",
                path,
                &[("Host", &host), ("Cookie", cookie)],
                None,
            );
            refused(&format!("GET {path}"), &r);
        }
    }
    let login = format!("who=eve&token={}", enc(TOKEN));
    let change = format!(
        "do=purge:all&expected=3&group=default&reason=x&csrf={}",
        s.csrf
    );
    for (path, body) in [
        ("/login", login.as_str()),
        ("/logout", change.as_str()),
        ("/groups/pause", change.as_str()),
        ("/groups/resume", change.as_str()),
        ("/dead/confirm", change.as_str()),
        ("/dead/act", change.as_str()),
    ] {
        let r = http(
            &console.addr,
            "POST",
            path,
            &[("Host", &host), ("Origin", &origin), ("Cookie", &s.cookie)],
            Some(body),
        );
        refused(&format!("POST {path}"), &r);
    }
    assert_eq!(store.paused("default").await.unwrap(), None);
    assert_eq!(dead_ids(&store).await.len(), 3);
    // A missing Host is refused too; the console's own names are not.
    let r = http(&console.addr, "GET", "/", &[("Host", "")], None);
    assert_eq!(r.status, 421, "{}", r.body);
    for ok in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        "LocalHost".into(),
    ] {
        let r = http(
            &console.addr,
            "GET",
            "/",
            &[("Host", &ok), ("Cookie", &s.cookie)],
            None,
        );
        assert_eq!(r.status, 200, "Host {ok}: {}", r.body);
    }
    // The Host matches, the Origin is another site: refused as cross-site.
    for other in [origin.as_str(), "null", &format!("http://localhost:{port}")] {
        let r = http(
            &console.addr,
            "POST",
            "/login",
            &[("Origin", other)],
            Some(&login),
        );
        assert_eq!(r.status, 403, "Origin {other}: {}", r.body);
        assert!(r.body.contains("Cross-site"), "{}", r.body);
        assert!(r.header("set-cookie").is_none());
    }
    drop(console);

    // A console without a token (which shows payloads to whoever reaches
    // it) refuses foreign names the same; --allowed-host adds a name.
    let ro = Console::start(&args, false, &["--allowed-host", "console.internal"]);
    let port = ro.addr.rsplit(':').next().unwrap().to_owned();
    let host = format!("evil.example:{port}");
    let r = http(
        &ro.addr,
        "GET",
        &format!("/dead/{a}"),
        &[("Host", &host)],
        None,
    );
    refused("read-only GET /dead/{a}", &r);
    let r = http(
        &ro.addr,
        "GET",
        &format!("/dead/{a}"),
        &[("Host", "console.internal")],
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("traceparent"), "{}", r.body);
    drop(ro);
    drop_schema(&pool, &schema).await;
}

/// Moves `until` to the end of the backoff `r` announces (`Retry-After`,
/// whole seconds rounded up: once it has passed, the backoff has too).
fn wait_for(until: &mut Instant, r: &Resp) {
    if let Some(secs) = r.header("retry-after") {
        let secs: u64 = secs.parse().unwrap();
        *until = (*until).max(Instant::now() + Duration::from_secs(secs));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_login_throttle_is_per_client_and_never_locks_out_the_right_token() {
    let (schema, pool) = migrated_log("outbox_console_throttle").await;
    let console = Console::start(&store_args(&database_url(), &schema), true, &[]);
    let (a, b) = ("127.0.0.1", "127.0.0.2");
    let wrong = "who=mallory&token=not-the-token-at-all";
    let right = format!("who=ops&token={}", enc(TOKEN));
    let login = |from: &'static str, body: String| {
        let addr = console.addr.clone();
        async move { http_from(from, &addr, "POST", "/login", &[], Some(&body)).await }
    };

    // Many wrong tokens from one client: a few are checked, then it waits
    // (429 with Retry-After), longer and longer.
    let mut statuses = Vec::new();
    let mut until = Instant::now();
    for _ in 0..30 {
        let r = login(a, wrong.to_owned()).await;
        assert!(r.header("set-cookie").is_none());
        wait_for(&mut until, &r);
        statuses.push(r.status);
    }
    assert!(statuses[..5].iter().all(|s| *s == 401), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 401 || *s == 429),
        "{statuses:?}"
    );
    assert!(statuses.contains(&429), "{statuses:?}");

    // The right token from another client logs in at once.
    let r = login(b, right.clone()).await;
    assert_eq!(r.status, 303, "{}", r.body);
    assert!(r.header("set-cookie").is_some());
    let r = login(a, wrong.to_owned()).await;
    wait_for(&mut until, &r);
    if r.status == 429 {
        assert!(r.body.contains("Too many wrong tokens"), "{}", r.body);
        assert!(r.body.contains("other clients"), "{}", r.body);
    }
    // A wrong one from that other client is only its own first failure.
    let r = login(b, wrong.to_owned()).await;
    assert_eq!(r.status, 401, "{}", r.body);

    // The guessing client, once its backoff has passed, logs in with the
    // right token; its failures are then forgotten.
    tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
    let r = login(a, right.clone()).await;
    assert_eq!(r.status, 303, "{}", r.body);
    let r = login(a, wrong.to_owned()).await;
    assert_eq!(r.status, 401, "{}", r.body);
    let log = console.log_text();
    assert!(log.contains("login refused"), "{log}");
    assert!(!log.contains(TOKEN), "{log}");
    drop(console);
    drop_schema(&pool, &schema).await;
}

/// Every path a page links to or posts to (`href`, `action`, `src`).
fn paths_of(page: &str) -> Vec<String> {
    let mut paths = Vec::new();
    for attr in [r#"href=""#, r#"action=""#, r#"src=""#] {
        let mut rest = page;
        while let Some(at) = rest.find(attr) {
            rest = &rest[at + attr.len()..];
            let value = &rest[..rest.find('"').unwrap()];
            paths.push(value.split('?').next().unwrap().to_owned());
        }
    }
    paths
}

/// The console over two stores (two event logs, each in its schema, from
/// a `--stores` list): `/` lists both by name (never their URL), each
/// store's pages are under `/stores/NAME` and show that store's data,
/// every link and form on them stays within that prefix (but the index,
/// the login and the assets, which are the console's), a form under a
/// prefix changes that store only, and one login holds for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_over_two_stores_lists_both_and_serves_each_under_its_prefix() {
    let (schema_a, pool) = migrated_log("outbox_console_sa").await;
    let (schema_b, _) = migrated_log("outbox_console_sb").await;
    let store_a = log_store(&schema_a, |o| o).await;
    let store_b = log_store(&schema_b, |o| o).await;
    let [a, _, _] = three(&store_a, &pool).await;
    let url = database_url().replacen("://postgres@", "://postgres:s3cret-pw@", 1);
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("stores.toml");
    std::fs::write(
        &list,
        format!(
            "[[store]]\nname = \"tenant-a\"\nurl = \"{url}\"\npg_schema = \"{schema_a}\"\n\n[[store]]\nname = \"tenant-b\"\nurl = \"{url}\"\npg_schema = \"{schema_b}\"\n"
        ),
    )
    .unwrap();
    let console = Console::start(&["--stores".into(), list.display().to_string()], true, &[]);
    let s = console.login("dana");

    let index = console.get("/", Some(&s));
    assert_eq!(index.status, 200, "{}", index.body);
    for (name, dead) in [("tenant-a", 3), ("tenant-b", 0)] {
        assert!(
            index
                .body
                .contains(&format!(r#"<a href="/stores/{name}/dead">{dead}</a>"#)),
            "{name}: {}",
            index.body
        );
        assert!(
            index.body.contains(&format!(r#"href="/stores/{name}""#)),
            "{}",
            index.body
        );
    }

    let list_a = console.get("/stores/tenant-a/dead", Some(&s));
    assert_eq!(list_a.status, 200, "{}", list_a.body);
    assert_eq!(marked(&list_a.body, "dead-count"), Some("3"));
    assert_eq!(marked(&list_a.body, "store-name"), Some("store tenant-a"));
    let list_b = console.get("/stores/tenant-b/dead", Some(&s));
    assert_eq!(
        marked(&list_b.body, "dead-count"),
        Some("0"),
        "{}",
        list_b.body
    );
    let link = format!("/stores/tenant-a/dead/{a}?group=default");
    assert!(list_a.body.contains(&link), "{}", list_a.body);
    let detail = console.get(&link, Some(&s));
    assert_eq!(detail.status, 200, "{}", detail.body);
    assert!(detail.body.contains(&a.to_string()), "{}", detail.body);
    let overview = console.get("/stores/tenant-a", Some(&s));
    assert_eq!(overview.status, 200, "{}", overview.body);
    let console_own = [
        "/",
        "/login",
        "/logout",
        "/assets/console.css",
        "/assets/console.js",
    ];
    for page in [
        &overview,
        &list_a,
        &detail,
        &console.get("/stores/tenant-a/lane", Some(&s)),
    ] {
        assert_eq!(page.status, 200, "{}", page.body);
        let paths = paths_of(&page.body);
        assert!(
            paths.iter().any(|p| p.starts_with("/stores/tenant-a/")),
            "{paths:?}"
        );
        for path in paths {
            assert!(
                path.starts_with("/stores/tenant-a/")
                    || path == "/stores/tenant-a"
                    || console_own.contains(&path.as_str()),
                "{path} leaves the store's prefix: {}",
                page.body
            );
        }
    }
    for page in [&index, &overview, &list_a, &detail] {
        for never in ["s3cret-pw", "postgres://", "127.0.0.1:5432"] {
            assert!(!page.body.contains(never), "{never}: {}", page.body);
        }
    }

    // A form under a store's prefix changes that store only.
    let r = console.post(
        "/stores/tenant-b/groups/pause",
        Some(&s),
        &format!("group=default&reason=tenant-b+upgrade&csrf={}", s.csrf),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains(r#"href="/stores/tenant-b""#), "{}", r.body);
    assert!(store_b.paused("default").await.unwrap().is_some());
    assert_eq!(store_a.paused("default").await.unwrap(), None);

    // No store of that name, and the one-store paths, are not pages here.
    assert_eq!(console.get("/stores/nope", Some(&s)).status, 404);
    assert_eq!(console.get("/dead", Some(&s)).status, 404);
    assert!(!console.log_text().contains("s3cret-pw"));
    drop(console);
    drop_schema(&pool, &schema_a).await;
    drop_schema(&pool, &schema_b).await;
}
