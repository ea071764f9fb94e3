//! Multi-host URLs and a read-only server (issue 46): the store connects to
//! the first host that fits `target_session_attrs`, follows its hosts when
//! the one it uses goes away, and while no host is read-write its
//! operations fail at once with a retryable read-only error naming every
//! host, then resume when one is. The hosts are TCP proxies in front of
//! the test database (one of them cut), and a database of the test's own
//! made read-only (`default_transaction_read_only`, what a standby answers
//! too) and writable again. The real standby promoted under load is the
//! chaos suite's `pg-failover` fault (RELIABILITY.md).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod log_support;

use log_support::{database_url, pool, LogDb};
use outbox_core::{NewEvent, Pooler, Store};
use outbox_postgres::{Ident, PgHosts, PgLogOptions, PgLogStore, PgOutbox, StoreError};
use outbox_testkit::proxy::TcpProxy;
use sqlx::{Connection, PgConnection};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The test database's address.
fn upstream() -> SocketAddr {
    let hosts = PgHosts::parse(&database_url()).unwrap();
    let host = hosts.hosts().next().unwrap().to_owned();
    let host = host.replace("localhost", "127.0.0.1");
    host.parse().expect("DATABASE_URL's host as ip:port")
}

/// `DATABASE_URL` with its host list replaced by `hosts` and `query` added.
fn url_with_hosts(hosts: &[String], query: &str) -> String {
    let url = database_url();
    let (scheme, rest) = url.split_once("://").unwrap();
    let (userinfo, after) = rest.rsplit_once('@').map_or(("", rest), |(u, a)| (u, a));
    let path = after.find('/').map_or("", |i| &after[i..]);
    let path = path.split('?').next().unwrap();
    let at = if userinfo.is_empty() { "" } else { "@" };
    format!("{scheme}://{userinfo}{at}{}{path}?{query}", hosts.join(","))
}

fn options(log: &LogDb, url: String) -> PgLogOptions {
    PgLogOptions::new(url)
        .with_schema(log.schema.clone())
        .with_table(Ident::new("events").unwrap())
        .with_background_rotation(false)
        // The proxies forward TCP: said, so that `auto` does not take them
        // for a pooler in transaction mode.
        .with_pooler(Pooler::None)
        .with_connect_timeout(Duration::from_secs(3))
        .with_acquire_timeout(Duration::from_secs(5))
}

/// Claims until `n` events came, settling each batch delivered; the
/// claims' errors on the way are returned.
async fn claim_until(store: &PgLogStore, n: usize, within: Duration) -> (usize, Vec<StoreError>) {
    let deadline = Instant::now() + within;
    let (mut got, mut errors) = (0, Vec::new());
    while got < n && Instant::now() < deadline {
        match store.claim(&log_support::req("failover", 100)).await {
            Ok(claim) => {
                got += claim.events.len();
                if !claim.events.is_empty() {
                    log_support::deliver(store, &claim).await;
                }
            }
            Err(e) => errors.push(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (got, errors)
}

fn events(n: usize, key: &str) -> Vec<NewEvent> {
    (0..n)
        .map(|i| NewEvent::new("failover", "t", vec![i as u8]).with_key(key))
        .collect()
}

#[tokio::test]
async fn a_multi_host_url_skips_a_host_that_is_down_and_follows_when_its_host_goes() {
    let log = LogDb::new().await;
    let gone = TcpProxy::start(upstream()).await;
    gone.refuse();
    let a = TcpProxy::start(upstream()).await;
    let b = TcpProxy::start(upstream()).await;
    let url = url_with_hosts(
        &[
            gone.addr().to_string(),
            a.addr().to_string(),
            b.addr().to_string(),
        ],
        "target_session_attrs=read-write",
    );
    let store = PgLogStore::connect(options(&log, url)).await.unwrap();
    log.enqueue(events(3, "k")).await;
    let (got, errors) = claim_until(&store, 3, Duration::from_secs(10)).await;
    assert_eq!(got, 3, "{errors:?}");
    assert!(errors.is_empty(), "{errors:?}");

    // The host in use goes (its connections cut, new ones refused): the
    // store finds the next one and delivers what was committed meanwhile.
    a.refuse();
    log.enqueue(events(4, "k")).await;
    let (got, errors) = claim_until(&store, 4, Duration::from_secs(20)).await;
    assert_eq!(got, 4, "errors on the way: {errors:?}");
    assert!(
        errors.iter().all(StoreError::is_retryable),
        "only retryable errors while the host moves: {errors:?}"
    );
    assert!(
        errors.len() <= 3,
        "a few failed claims, not a loop: {errors:?}"
    );
}

/// A database of the test's own: the store's writes refused as on a standby
/// while `default_transaction_read_only` is on.
struct OwnDatabase {
    name: String,
}

impl OwnDatabase {
    async fn create() -> Self {
        let name = format!(
            "outbox_failover_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..10]
        );
        let admin = pool(1).await;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .unwrap();
        admin.close().await;
        OwnDatabase { name }
    }

    fn url(&self) -> String {
        let url = database_url();
        let (head, _) = url.rsplit_once('/').unwrap();
        format!("{head}/{}", self.name)
    }

    /// Sets `default_transaction_read_only` for new sessions and ends the
    /// existing ones (as a demotion or a failover does).
    async fn set_read_only(&self, on: bool) {
        let admin = pool(1).await;
        let verb = if on {
            "SET default_transaction_read_only = on"
        } else {
            "RESET default_transaction_read_only"
        };
        sqlx::query(&format!("ALTER DATABASE {} {verb}", self.name))
            .execute(&admin)
            .await
            .unwrap();
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()")
            .bind(&self.name)
            .execute(&admin)
            .await
            .unwrap();
        admin.close().await;
    }
}

impl Drop for OwnDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut c) = PgConnection::connect(&database_url()).await {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&mut c)
                        .await;
                }
            });
        })
        .join()
        .ok();
    }
}

#[tokio::test]
async fn a_read_only_server_makes_the_store_wait_with_a_clear_error_then_resume() {
    let db = OwnDatabase::create().await;
    let schema = Ident::new("outbox").unwrap();
    let outbox = PgOutbox::new(schema.clone(), Ident::new("events").unwrap()).unwrap();
    let mut conn = PgConnection::connect(&db.url()).await.unwrap();
    outbox.migrate(&mut conn).await.unwrap();
    let enqueue = |n: usize| {
        let (url, outbox) = (db.url(), outbox.clone());
        async move {
            let mut c = PgConnection::connect(&url).await.unwrap();
            let mut tx = c.begin().await.unwrap();
            outbox.enqueue_batch(&mut tx, events(n, "r")).await.unwrap();
            tx.commit().await.unwrap();
        }
    };
    enqueue(2).await;
    let url = format!("{}?target_session_attrs=read-write", db.url());
    let store = PgLogStore::connect(
        PgLogOptions::new(url.clone())
            .with_schema(schema.clone())
            .with_background_rotation(false)
            .with_pooler(Pooler::None),
    )
    .await
    .unwrap();
    let (got, errors) = claim_until(&store, 2, Duration::from_secs(10)).await;
    assert_eq!(got, 2, "{errors:?}");

    db.set_read_only(true).await;
    // A claim fails (its session ended, or the server refused the write),
    // then the next ones at once with the store's read-only error:
    // retryable, naming the host and what it is.
    let mut read_only = None;
    for _ in 0..10 {
        if let Err(e) = store.claim(&log_support::req("failover", 100)).await {
            assert!(e.is_retryable(), "{e}");
            if e.is_read_only() && e.to_string().contains("no host of") {
                read_only = Some(e);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let e = read_only.expect("a read-only error while the server is read-only");
    let shown = e.to_string();
    assert!(shown.contains("waiting for a primary"), "{shown}");
    assert!(shown.contains("read-only"), "{shown}");
    assert!(
        shown.contains(&upstream().port().to_string()),
        "names the host: {shown}"
    );
    // Waiting costs no connection per call: the error comes at once.
    let t = Instant::now();
    let again = store.claim(&log_support::req("failover", 100)).await;
    assert!(
        again.as_ref().is_err_and(StoreError::is_read_only),
        "{again:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // A new store on the read-only server: a clear, retryable error after
    // the connect timeout, never a password.
    let err = PgLogStore::connect(
        PgLogOptions::new(url.clone())
            .with_schema(schema.clone())
            .with_pooler(Pooler::None)
            .with_connect_timeout(Duration::from_millis(500)),
    )
    .await
    .unwrap_err();
    assert!(err.is_read_only() && err.is_retryable(), "{err}");
    assert!(
        err.to_string().contains("default_transaction_read_only"),
        "{err}"
    );

    // Writable again ("promoted"): the store resumes and delivers what was
    // committed after.
    db.set_read_only(false).await;
    enqueue(3).await;
    let (got, errors) = claim_until(&store, 3, Duration::from_secs(15)).await;
    assert_eq!(got, 3, "{errors:?}");
    drop(store);
}

#[tokio::test]
async fn a_write_refused_by_a_read_only_server_is_retryable_and_says_why() {
    let db = OwnDatabase::create().await;
    db.set_read_only(true).await;
    let mut conn = PgConnection::connect(&db.url()).await.unwrap();
    let e = sqlx::query("CREATE TABLE refused (i int)")
        .execute(&mut conn)
        .await
        .unwrap_err();
    let e = StoreError::Database(e);
    assert!(e.is_read_only() && e.is_retryable(), "{e}");
    let shown = e.to_string();
    assert!(shown.contains("25006"), "{shown}");
    assert!(shown.contains("waiting for a primary"), "{shown}");
}

#[test]
fn bad_multi_host_urls_are_refused_by_name_without_the_password() {
    for (url, says) in [
        (
            "postgres://app:hunter2@h1:5432,h2:5432/db?target_session_attrs=master",
            "target_session_attrs=\"master\"",
        ),
        ("postgres://app:hunter2@h1:5432,:x/db", ":x"),
    ] {
        let e = PgHosts::parse(url).unwrap_err();
        let shown = e.to_string();
        assert!(shown.contains(says), "{url}: {shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(!format!("{e:?}").contains("hunter2"), "{e:?}");
    }
}
