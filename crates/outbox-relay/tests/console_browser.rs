//! The console in a real browser: Debian's headless `chromium` driven
//! through `chromedriver` (W3C WebDriver, with the fantoccini client),
//! against PostgreSQL's event log (each test in its own schema). The
//! issue's cases: the overview shows the lag a test created; a dead letter
//! found by filter is replayed and then delivered by a running relay; purge
//! asks for confirmation; without the token every change is refused; a page
//! of 10,000 dead letters stays paged; the retry lane leads from a held key
//! to its dead head. With `OUTBOX_CONSOLE_SCREENSHOTS=DIR` (`cargo xtask
//! screenshots`) the pages are also saved as PNGs into DIR.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod console_support;
mod support;

use console_support::webdriver::{screenshot_dir, Browser};
use console_support::{dead_letters, held_keys, Console, TOKEN};
use outbox_core::{
    ClaimRequest, DeadLetterQuery, DeadLetterStore, ErrorCode, EventId, NewEvent, RelayId,
    Resolution, Settlement, ShardSpec, Store,
};
use outbox_postgres::{sqlx, PgLogStore};
use outbox_testkit::process::ChildGuard;
use std::process::Stdio;
use std::time::Duration;
use support::pg::{database_url, drop_schema, log_store, migrated_log};

fn store_args(schema: &str) -> Vec<String> {
    vec![
        "--store".into(),
        database_url(),
        "--pg-schema".into(),
        schema.into(),
    ]
}

async fn shot(browser: &Browser, name: &str) {
    if let Some(dir) = screenshot_dir() {
        browser.screenshot(&dir.join(format!("{name}.png"))).await;
    }
}

/// Logs the browser in as `who`.
async fn login(browser: &Browser, console: &Console, who: &str) {
    browser
        .goto(&format!("http://{}/login", console.addr))
        .await;
    browser.fill("input[name=who]", who).await;
    browser.fill("input[name=token]", TOKEN).await;
    browser.click("[data-test=login]").await;
    browser.wait_for_element("logged in", ".who").await;
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

/// Gives group `default` a cursor (one event claimed and delivered), then
/// commits `n` more events nobody claims: they are the group's lag.
async fn lag_of(store: &PgLogStore, pool: &sqlx::PgPool, n: usize) {
    let mut tx = pool.begin().await.unwrap();
    store
        .outbox()
        .enqueue(&mut tx, NewEvent::new("warm.up", "t", b"{}".to_vec()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let relay = RelayId::new("console-browser");
    let claim = store
        .claim(&ClaimRequest {
            relay_id: relay.clone(),
            batch_size: 10,
            lease: Duration::from_secs(60),
            shard: ShardSpec::ALL,
        })
        .await
        .unwrap();
    let mut s = Settlement::new();
    for e in &claim.events {
        s.push(e.id, Resolution::Delivered);
    }
    store.settle(claim.token, &s).await.unwrap();
    store.leave(&relay).await.unwrap();
    enqueue(store, pool, n).await;
}

/// Commits `n` events in one transaction.
async fn enqueue(store: &PgLogStore, pool: &sqlx::PgPool, n: usize) {
    let mut tx = pool.begin().await.unwrap();
    let events = (0..n).map(|i| {
        NewEvent::new(
            "order.created",
            "orders",
            format!("{{\"n\":{i}}}").into_bytes(),
        )
        .with_key(format!("k{}", i % 3))
    });
    store.outbox().enqueue_batch(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_the_lag_a_test_created() {
    let (schema, pool) = migrated_log("outbox_browser_lag").await;
    let store = log_store(&schema, |o| o).await;
    lag_of(&store, &pool, 7).await;
    let console = Console::start(&store_args(&schema), true, &[]);
    let browser = Browser::start().await;
    // A token is set: every page needs the login (which lands on `/`).
    login(&browser, &console, "olga").await;
    browser.goto(&format!("http://{}/", console.addr)).await;
    assert_eq!(browser.text("[data-test=pending]").await, "7");
    let lag = browser.text("[data-test=lag]").await;
    assert!(lag.ends_with(" s") || lag.contains("min"), "lag {lag:?}");
    assert!(browser.text("#total-pending").await.contains('7'));
    // The live refresh keeps it current: 3 more, without a reload.
    enqueue(&store, &pool, 3).await;
    browser
        .wait_for("the refreshed overview shows 10 behind", async |b| {
            b.text("[data-test=pending]").await == "10"
        })
        .await;
    // Let the sampler take two samples so the charts show.
    browser
        .wait_for("the charts", async |b| {
            b.goto(&format!("http://{}/", console.addr)).await;
            b.find("figure.chart polyline").await.is_some()
        })
        .await;
    shot(&browser, "overview").await;
    if let Some(dir) = screenshot_dir() {
        browser
            .screenshot_width(&dir.join("overview-phone.png"), 390)
            .await;
    }
    browser
        .goto(&format!("http://{}/shards", console.addr))
        .await;
    assert!(browser.source().await.contains("Group default"));
    shot(&browser, "shards").await;
    drop(browser);
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_lane_leads_from_a_held_key_to_its_dead_head() {
    let (schema, pool) = migrated_log("outbox_browser_lane").await;
    let store = log_store(&schema, |o| {
        o.with_dead_head_policy(outbox_core::DeadHeadPolicy::Block)
    })
    .await;
    let dead = held_keys(&store, &pool).await.dead;
    let console = Console::start(&store_args(&schema), false, &[]);
    let browser = Browser::start().await;
    browser.goto(&format!("http://{}/lane", console.addr)).await;
    assert_eq!(browser.text("[data-test=held-count]").await, "2");
    assert_eq!(browser.text("[data-test=held-key]").await, "acct-7");
    assert_eq!(browser.text("[data-test=waiting]").await, "3");
    shot(&browser, "retry-lane").await;
    browser.click(&format!("a[href^=\"/dead/{dead}\"]")).await;
    browser
        .wait_for_element("the dead head's detail", "[data-test=final-error]")
        .await;
    assert!(browser
        .text("[data-test=final-error]")
        .await
        .contains("card <expired>"));
    drop(browser);
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_found_by_filter_is_replayed_then_delivered() {
    let (schema, pool) = migrated_log("outbox_browser_replay").await;
    let store = log_store(&schema, |o| o).await;
    let wanted = dead_letters(
        &store,
        &pool,
        vec![NewEvent::new(
            "payment.failed",
            "payments",
            br#"{"amount":42,"currency":"EUR"}"#.to_vec(),
        )
        .with_key("acct-7")
        .with_header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )],
        ErrorCode::HANDLER_PERMANENT_FAILURE,
        "card declined: insufficient funds",
    )
    .await[0];
    let other = dead_letters(
        &store,
        &pool,
        vec![NewEvent::new("order.created", "orders", b"{}".to_vec()).with_key("k1")],
        ErrorCode::HANDLER_NOT_REGISTERED,
        "no handler for order.created",
    )
    .await[0];
    // A relay that delivers to a JSON-lines file: nothing to deliver yet.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    let mut relay = ChildGuard::new(
        support::relay(&["run"])
            .args(store_args(&schema))
            .args(["--sink", &format!("jsonl:{}", file.display())])
            .args(["--poll-interval-ms", "100"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let console = Console::start(&store_args(&schema), true, &[]);
    let browser = Browser::start().await;
    login(&browser, &console, "dana").await;
    browser.goto(&format!("http://{}/dead", console.addr)).await;
    assert_eq!(browser.text("[data-test=dead-count]").await, "2");
    browser
        .fill("#filters input[name=type]", "payment.failed")
        .await;
    browser.click("#filters button[type=submit]").await;
    browser
        .wait_for("the filtered list", async |b| {
            b.text("[data-test=dead-count]").await == "1"
        })
        .await;
    assert!(browser.source().await.contains(&wanted.to_string()));
    shot(&browser, "dead-letters").await;
    browser.click(&format!("a[href^=\"/dead/{wanted}\"]")).await;
    browser
        .wait_for_element("the detail page", "[data-test=payload]")
        .await;
    assert!(browser
        .text("[data-test=payload]")
        .await
        .contains("\"amount\": 42"));
    assert!(browser
        .text("[data-test=final-error]")
        .await
        .contains("card declined"));
    shot(&browser, "dead-letter").await;
    browser
        .goto(&format!("http://{}/dead?type=payment.failed", console.addr))
        .await;
    browser
        .click(&format!("input[name=id][value=\"{wanted}\"]"))
        .await;
    browser.click("[data-test=replay-selected]").await;
    browser
        .wait_for_element("the confirmation", "[data-test=confirm]")
        .await;
    assert_eq!(browser.text("[data-test=confirm-count]").await, "1");
    shot(&browser, "replay-confirm").await;
    assert_eq!(
        dead_ids(&store).await.len(),
        2,
        "nothing before the confirmation"
    );
    browser.click("[data-test=confirm]").await;
    browser
        .wait_for_element("the result", "[data-test=done]")
        .await;
    assert!(browser
        .text("[data-test=done]")
        .await
        .contains("Replayed 1"));
    let delivered = support::wait_jsonl_ids(&file, 1, &mut relay).await;
    assert_eq!(delivered, vec![wanted], "the replayed event is delivered");
    assert_eq!(dead_ids(&store).await, vec![other]);
    support::stop(&mut relay);
    drop(browser);
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_asks_for_confirmation_first() {
    let (schema, pool) = migrated_log("outbox_browser_purge").await;
    let store = log_store(&schema, |o| o).await;
    let events = (0..3)
        .map(|i| {
            NewEvent::new(
                "user.deleted",
                "users",
                format!("{{\"u\":{i}}}").into_bytes(),
            )
        })
        .collect();
    dead_letters(
        &store,
        &pool,
        events,
        ErrorCode::HANDLER_PERMANENT_FAILURE,
        "gone",
    )
    .await;
    let console = Console::start(&store_args(&schema), true, &[]);
    let browser = Browser::start().await;
    login(&browser, &console, "erin").await;
    browser.goto(&format!("http://{}/dead", console.addr)).await;
    browser.click("#select-all").await;
    browser.click("[data-test=purge-selected]").await;
    browser
        .wait_for_element("the confirmation", "[data-test=confirm]")
        .await;
    assert_eq!(browser.text("[data-test=confirm-count]").await, "3");
    assert!(browser
        .text("[data-test=confirm-text]")
        .await
        .starts_with("Purge 3"));
    shot(&browser, "purge-confirm").await;
    // Asking changed nothing; cancelling neither.
    assert_eq!(dead_ids(&store).await.len(), 3);
    browser.click("[data-test=cancel]").await;
    browser
        .wait_for_element("back on the list", "[data-test=dead-count]")
        .await;
    assert_eq!(browser.text("[data-test=dead-count]").await, "3");
    assert_eq!(dead_ids(&store).await.len(), 3);
    // Confirmed, they are gone.
    browser.click("[data-test=purge-all]").await;
    browser
        .wait_for_element("the confirmation", "[data-test=confirm]")
        .await;
    browser.click("[data-test=confirm]").await;
    browser
        .wait_for_element("the result", "[data-test=done]")
        .await;
    assert!(browser.text("[data-test=done]").await.contains("Purged 3"));
    assert!(dead_ids(&store).await.is_empty());
    drop(browser);
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_token_every_change_is_refused() {
    let (schema, pool) = migrated_log("outbox_browser_token").await;
    let store = log_store(&schema, |o| o).await;
    dead_letters(
        &store,
        &pool,
        vec![NewEvent::new("a", "t", b"{}".to_vec())],
        ErrorCode::HANDLER_PERMANENT_FAILURE,
        "x",
    )
    .await;
    // Forms the page does not offer, submitted by the browser anyway.
    let forge = |action: &str, fields: &[(&str, &str)]| {
        let inputs: String = fields
            .iter()
            .map(|(k, v)| format!("var i=document.createElement('input');i.name='{k}';i.value='{v}';f.appendChild(i);"))
            .collect();
        format!(
            "var f=document.createElement('form');f.method='post';f.action='{action}';{inputs}document.body.appendChild(f);f.submit();"
        )
    };
    let pause = [("group", "default"), ("reason", "forged")];
    let purge = [("do", "purge:all"), ("expected", "1")];

    // A read-only console: no forms, and a forged one is refused.
    let ro = Console::start(&store_args(&schema), false, &[]);
    let browser = Browser::start().await;
    browser.goto(&format!("http://{}/", ro.addr)).await;
    assert!(browser.find("form[method=post]").await.is_none());
    assert!(browser.source().await.contains("read-only"));
    browser.script(&forge("/groups/pause", &pause)).await;
    browser
        .wait_for_element("the refusal", "[data-test=error]")
        .await;
    assert!(browser.source().await.contains("Read-only console"));
    drop(ro);

    // With a token, not logged in: the page is the login form, and a
    // forged change is refused the same.
    let console = Console::start(&store_args(&schema), true, &[]);
    browser.goto(&format!("http://{}/dead", console.addr)).await;
    assert!(browser.find("[data-test=purge-all]").await.is_none());
    assert!(browser.find("[data-test=login]").await.is_some());
    browser.script(&forge("/dead/act", &purge)).await;
    browser
        .wait_for_element("the refusal", "[data-test=error]")
        .await;
    assert!(browser
        .text("[data-test=error-detail]")
        .await
        .contains("log in"));
    // Logged in, a form without the session's CSRF token is refused too.
    login(&browser, &console, "frank").await;
    browser.script(&forge("/groups/pause", &pause)).await;
    browser
        .wait_for_element("the refusal", "[data-test=error]")
        .await;
    assert!(browser.source().await.contains("CSRF"));
    // A wrong token opens no session.
    browser
        .goto(&format!("http://{}/login", console.addr))
        .await;
    browser.fill("input[name=who]", "mallory").await;
    browser
        .fill("input[name=token]", "definitely-not-the-token")
        .await;
    browser.click("[data-test=login]").await;
    browser
        .wait_for_element("the refusal", "[data-test=error]")
        .await;
    assert!(browser.source().await.contains("Wrong admin token"));
    assert_eq!(
        outbox_core::ControlStore::paused(&store, "default")
            .await
            .unwrap(),
        None
    );
    assert_eq!(dead_ids(&store).await.len(), 1);
    drop(browser);
    drop(console);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_dead_letters_stay_paged_in_the_browser() {
    let (schema, pool) = migrated_log("outbox_browser_10k").await;
    let store = log_store(&schema, |o| o).await;
    let events = (0..10_000)
        .map(|i| {
            NewEvent::new("bulk.event", "bulk", format!("{{\"i\":{i}}}").into_bytes())
                .with_key(format!("k{}", i % 100))
        })
        .collect();
    dead_letters(
        &store,
        &pool,
        events,
        ErrorCode::HANDLER_PERMANENT_FAILURE,
        "bulk",
    )
    .await;
    let console = Console::start(&store_args(&schema), true, &[]);
    let browser = Browser::start().await;
    login(&browser, &console, "gina").await;
    browser.goto(&format!("http://{}/dead", console.addr)).await;
    assert_eq!(browser.text("[data-test=dead-count]").await, "10000");
    let rows = async |b: &Browser| {
        b.script("return document.querySelectorAll('table.dead tbody tr').length;")
            .await
    };
    assert_eq!(rows(&browser).await, 50);
    let first = browser
        .script("return document.querySelector('table.dead tbody tr a').textContent;")
        .await;
    browser.click("[data-test=next-page]").await;
    browser
        .wait_for("the second page", async |b| {
            b.url().await.contains("after=")
        })
        .await;
    assert_eq!(rows(&browser).await, 50);
    let second = browser
        .script("return document.querySelector('table.dead tbody tr a').textContent;")
        .await;
    assert_ne!(first, second);
    // The page answers clicks: select all on the page, then confirm 50.
    browser.click("#select-all").await;
    browser.click("[data-test=purge-selected]").await;
    browser
        .wait_for_element("the confirmation", "[data-test=confirm]")
        .await;
    assert_eq!(browser.text("[data-test=confirm-count]").await, "50");
    assert_eq!(
        store
            .count_dead(&outbox_core::DeadLetterFilter::all())
            .await
            .unwrap(),
        10_000
    );
    drop(browser);
    drop(console);
    drop_schema(&pool, &schema).await;
}
