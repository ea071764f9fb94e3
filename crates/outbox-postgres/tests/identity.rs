//! Positions that know their database, the schema version fencing the
//! binaries, the fenced group drop and the order sequence's cache (issue
//! 42, points 5, 6 and 8), on the real database:
//!
//! - an outbox schema restored into another database (`pg_dump -n | psql`)
//!   is refused, then accepted after a re-anchor, from the origin (the
//!   retained log delivered again) or from now (skipped);
//! - a lease taken under schema version 4 is fenced by the migrations: the
//!   old settle changes nothing;
//! - a schema newer (or older) than this library is refused;
//! - a group dropped right after its relay's lease lapsed is not delivered
//!   again from the origin, and its control and relay rows are gone;
//! - an order sequence with a cache is refused at connect.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod log_support;

use log_support::*;
use outbox_core::{EventId, NewEvent, Store};
use outbox_postgres::{GroupDrop, PgLogStore, ReanchorFrom, Refusal, StoreError, LOG_MIGRATIONS};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};

fn ev(key: &str, n: usize) -> NewEvent {
    NewEvent::new("t", "topic", format!("{key}-{n}").into_bytes()).with_key(key)
}

fn refusal(r: Result<outbox_core::Claim, StoreError>) -> Refusal {
    match r {
        Err(StoreError::Refused(r)) => r,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// `url` with its database replaced by `db`.
fn url_for(db: &str) -> String {
    let url = database_url();
    let (base, _) = url.rsplit_once('/').unwrap();
    format!("{base}/{db}")
}

/// A database created for one test, dropped (with its sessions) afterwards.
struct TempDb(String);

impl Drop for TempDb {
    fn drop(&mut self) {
        let name = self.0.clone();
        let _ = std::thread::spawn(move || {
            let _ = std::process::Command::new("psql")
                .arg(database_url())
                .arg("-qc")
                .arg(format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                .status();
        })
        .join();
    }
}

/// The outbox schema of `db` restored into a new database by `pg_dump -n
/// schema | psql`, and a pool on it.
async fn restore_copy(db: &LogDb) -> (TempDb, PgPool) {
    let name = format!(
        "outbox_copy_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    sqlx::query(&format!("CREATE DATABASE \"{name}\""))
        .execute(&db.pool)
        .await
        .unwrap();
    let temp = TempDb(name.clone());
    let dump = std::process::Command::new("pg_dump")
        .arg("--no-owner")
        .arg("-n")
        .arg(db.schema.as_str())
        .arg(database_url())
        .output()
        .expect("pg_dump");
    assert!(
        dump.status.success(),
        "{}",
        String::from_utf8_lossy(&dump.stderr)
    );
    let mut psql = std::process::Command::new("psql")
        .arg("-q")
        .arg("-v")
        .arg("ON_ERROR_STOP=1")
        .arg(url_for(&name))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("psql");
    use std::io::Write as _;
    psql.stdin.take().unwrap().write_all(&dump.stdout).unwrap();
    assert!(psql.wait().unwrap().success(), "psql restore failed");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url_for(&name))
        .await
        .unwrap();
    (temp, pool)
}

/// Three events; the first two delivered and settled, the third not.
async fn two_of_three_delivered(db: &LogDb) -> (PgLogStore, Vec<EventId>) {
    let store = db.store().await;
    let first = db.enqueue(vec![ev("k", 1), ev("k", 2)]).await;
    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), first);
    deliver(&store, &c).await;
    let third = db.enqueue(vec![ev("k", 3)]).await;
    (store, [first, third].concat())
}

async fn restored_store(db: &LogDb, pool: PgPool) -> PgLogStore {
    PgLogStore::from_pool(pool, db.options()).await.unwrap()
}

/// Restored into another database, the log is refused with what happened
/// and the command; `reanchor --from origin` then delivers the whole
/// retained log again, in order, and what is committed later after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_into_another_database_is_refused_until_reanchored_from_the_origin() {
    let db = LogDb::new().await;
    let (_store, all) = two_of_three_delivered(&db).await;
    let (_temp, pool) = restore_copy(&db).await;
    let copy = restored_store(&db, pool.clone()).await;

    let refused = refusal(copy.claim(&req("relay", 10)).await);
    assert!(
        matches!(refused, Refusal::OtherDatabase { .. }),
        "{refused:?}"
    );
    let text = refused.to_string();
    assert!(
        text.contains("another database of the same cluster"),
        "{text}"
    );
    assert!(
        text.contains("outbox-relay reanchor --from origin"),
        "{text}"
    );
    assert!(text.contains("--from now"), "{text}");
    assert!(!copy.identity().await.unwrap().matches());
    assert!(copy
        .status()
        .await
        .unwrap()
        .identity
        .is_some_and(|i| !i.matches()));

    let done = copy.reanchor(ReanchorFrom::Origin).await.unwrap();
    assert_eq!((done.events, done.cursors), (3, 1));
    assert!(copy.identity().await.unwrap().matches());
    let c = claim(&copy, "relay", 10).await;
    assert_eq!(ids(&c), all, "the retained log again, in order");
    deliver(&copy, &c).await;

    // New events of the copy follow, none of the old ones again.
    let mut tx = pool.begin().await.unwrap();
    let later = copy.outbox().enqueue(&mut tx, ev("k", 4)).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(ids(&claim(&copy, "relay", 10).await), vec![later]);
}

/// `reanchor --from now` skips everything in the log (the undelivered
/// third event is lost, as the command says) and delivers what follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_reanchored_from_now_skips_the_retained_log() {
    let db = LogDb::new().await;
    let _ = two_of_three_delivered(&db).await;
    let (_temp, pool) = restore_copy(&db).await;
    let copy = restored_store(&db, pool.clone()).await;
    refusal(copy.claim(&req("relay", 10)).await);

    let done = copy.reanchor(ReanchorFrom::Now).await.unwrap();
    assert_eq!(done.events, 3);
    assert!(claim(&copy, "relay", 10).await.events.is_empty());
    let mut tx = pool.begin().await.unwrap();
    let later = copy.outbox().enqueue(&mut tx, ev("k", 4)).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(ids(&claim(&copy, "relay", 10).await), vec![later]);
    // The original database still holds its positions and delivers its third.
}

/// Applies the log migrations up to `version` as the runner would (the
/// history table, checksums), without the front view.
async fn migrate_to(db: &LogDb, version: i32) {
    let mut conn = db.pool.acquire().await.unwrap();
    conn.execute(
        format!(
            "DROP SCHEMA {s} CASCADE; CREATE SCHEMA {s};
             CREATE TABLE {s}.events_log_migrations (version integer PRIMARY KEY, name text NOT NULL,
                 checksum bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());",
            s = db.schema.quoted()
        )
        .as_str(),
    )
    .await
    .unwrap();
    for (m, (v, name, sql)) in LOG_MIGRATIONS.iter().zip(db.log.migration_sql()) {
        if v > version {
            break;
        }
        conn.execute(sql.as_str()).await.unwrap();
        sqlx::query(&format!(
            "INSERT INTO {}.events_log_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            db.schema.quoted()
        ))
        .bind(v)
        .bind(name)
        .bind(i64::from_ne_bytes(m.checksum().to_ne_bytes()))
        .execute(&mut *conn)
        .await
        .unwrap();
    }
}

/// The pre-0005 relay's lease and settle statements (its `ACQUIRE` and
/// `ADVANCE`): a relay of version 4 takes the lease, the schema is
/// migrated, and its settle of a (txid, seq) position changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_taken_before_migration_5_is_fenced() {
    let db = LogDb::new().await;
    migrate_to(&db, 4).await;
    let cursors = db.table("_cursors");
    sqlx::query(&format!(
        "INSERT INTO {cursors} (grp, shard_total, shard_index, lo, hi) \
         VALUES ('default', 1, 0, pg_current_snapshot(), pg_current_snapshot())"
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    // The old ACQUIRE: a new holding.
    let epoch: i64 = sqlx::query_scalar(&format!(
        "UPDATE {cursors} SET epoch = epoch + 1, owner = 'old-relay', \
         lease_until = now() + interval '10 minutes' \
         WHERE grp = 'default' AND shard_total = 1 AND shard_index = 0 RETURNING epoch"
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    sqlx::query(&format!(
        "INSERT INTO {} (id, key, key_hash, event_type, topic, payload) \
         VALUES (gen_random_uuid(), 'k', 1, 't', 'topic', '\\x00')",
        db.table("")
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let (pos_txid, pos_seq): (String, i64) = sqlx::query_as(&format!(
        "SELECT txid::text, seq FROM {} LIMIT 1",
        db.table("")
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();

    // The upgrade, while the old relay holds its lease.
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(db.log.migrate(&mut conn).await.unwrap(), vec![5, 6]);
    drop(conn);

    // The old ADVANCE, position of the old meaning, under its epoch.
    let changed = sqlx::query(&format!(
        "UPDATE {cursors} SET lo = pg_current_snapshot(), hi = pg_current_snapshot(), \
         pos_txid = $2::xid8, pos_seq = $3, updated_at = now() \
         WHERE grp = 'default' AND shard_total = 1 AND shard_index = ANY('{{0}}'::int[]) \
           AND epoch = $1"
    ))
    .bind(epoch)
    .bind(&pos_txid)
    .bind(pos_seq)
    .execute(&db.pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(changed, 0, "the old relay's settle was not fenced");
    let (pos, owner): (Option<i64>, Option<String>) = sqlx::query_as(&format!(
        "SELECT pos_seq, owner FROM {cursors} WHERE grp = 'default'"
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((pos, owner), (None, None), "position reset, lease voided");

    // A relay of this version delivers the event from the reset position.
    let store = db.store().await;
    assert_eq!(claim(&store, "new-relay", 10).await.events.len(), 1);
}

/// A schema migrated by a newer version is refused at the claim (the
/// message names the version found and the relay to run), as is an older
/// one (run migrate); auto-migrate refuses the newer one at connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_newer_or_older_than_known_is_refused() {
    let db = LogDb::new().await;
    let history = db.table("_migrations");
    sqlx::query(&format!(
        "INSERT INTO {history} (version, name, checksum, applied_by) VALUES (99, 'future', 0, '9.9.9')"
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let store = db.store().await;
    let r = refusal(store.claim(&req("relay", 10)).await);
    let text = r.to_string();
    assert!(
        matches!(r, Refusal::SchemaTooNew { found: 99, .. }),
        "{r:?}"
    );
    assert!(
        text.contains("schema version 99") && text.contains("run outbox-relay 9.9.9 or later"),
        "{text}"
    );
    assert!(
        PgLogStore::from_pool(db.pool.clone(), db.options().with_auto_migrate(true))
            .await
            .is_err()
    );

    sqlx::query(&format!("DELETE FROM {history} WHERE version >= 6"))
        .execute(&db.pool)
        .await
        .unwrap();
    let store = db.store().await;
    let r = refusal(store.claim(&req("relay", 10)).await);
    assert!(
        matches!(r, Refusal::SchemaTooOld { found: Some(5), .. }),
        "{r:?}"
    );
    assert!(r.to_string().contains("run `outbox-relay migrate`"), "{r}");
}

/// A relay's lease lapses, the group is dropped without force (it is not
/// leased), and the relay's next claim comes: it must not create the
/// cursor again at the origin (the whole retained log again). The drop
/// takes the group's pause and relay rows with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_dropped_after_its_lease_lapsed_is_not_delivered_again_from_the_origin() {
    let db = LogDb::new().await;
    let store = db.store().await;
    let group = store.group().to_owned();
    let events = db.enqueue(vec![ev("k", 1), ev("k", 2)]).await;
    let c = claim(&store, "relay", 10).await;
    assert_eq!(ids(&c), events);
    deliver(&store, &c).await;
    for (table, cols) in [
        ("_control", "(grp, paused) VALUES ($1, true)"),
        (
            "_relays",
            "(grp, relay, seen_until) VALUES ($1, 'relay', now())",
        ),
    ] {
        sqlx::query(&format!("INSERT INTO {} {cols}", db.table(table)))
            .bind(&group)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    db.expire_leases().await;

    match store.drop_group(&group, false).await.unwrap() {
        GroupDrop::Dropped(what) => {
            assert_eq!(
                (what.cursors, what.control, what.relays),
                (1, 1, 1),
                "{what:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    let r = refusal(store.claim(&req("relay", 10)).await);
    assert!(matches!(r, Refusal::GroupDropped { .. }), "{r:?}");
    assert!(
        r.to_string().contains("does not start the group again"),
        "{r}"
    );
    let left = store.group_contents(&group).await.unwrap();
    assert!(left.is_empty(), "{left:?}");
}

/// `ALTER SEQUENCE ... CACHE 20` on the order sequence is refused at
/// connect (auto-migrate) and at the claim, naming the fix; `CACHE 1`
/// makes it claim again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_sequence_with_a_cache_is_refused_at_connect() {
    let db = LogDb::new().await;
    let seq = db.table("_order");
    sqlx::query(&format!("ALTER SEQUENCE {seq} CACHE 20"))
        .execute(&db.pool)
        .await
        .unwrap();
    let err = PgLogStore::from_pool(db.pool.clone(), db.options().with_auto_migrate(true))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(
            err,
            StoreError::Refused(Refusal::SequenceCache { cache: 20, .. })
        ),
        "{err:?}"
    );
    assert!(
        text.contains(&format!("ALTER SEQUENCE {seq} CACHE 1")),
        "{text}"
    );
    let store = db.store().await;
    refusal(store.claim(&req("relay", 10)).await);

    sqlx::query(&format!("ALTER SEQUENCE {seq} CACHE 1"))
        .execute(&db.pool)
        .await
        .unwrap();
    let events = db.enqueue(vec![ev("k", 1)]).await;
    assert_eq!(ids(&claim(&store, "relay", 10).await), events);
}
