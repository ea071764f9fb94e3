//! The inbox at a slot boundary (issue 42, point 1): two copies of one
//! event admitted in transactions on either side of a boundary apply once,
//! and a retention pass racing a boundary never empties the slot that is or
//! is about to be current. The boundary is injected ([`SlotClock`]): no test
//! waits for the wall clock. PostgreSQL in its own schema, SQLite in its own
//! file.
#![cfg(all(feature = "postgres", feature = "sqlite"))]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use outbox_core::{EventId, InboundMessage, WireFormat};
use outbox_inbox::SlotClock;
use outbox_inbox::{
    InboxRetentionStore, InboxSchema, InboxStore, PgInbox, Retention, SqliteInbox, Verdict,
};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Slots of one day: a test's few seconds never reach a boundary the test
/// did not place on purpose.
fn retention() -> Retention {
    Retention::new(Duration::from_secs(6 * 24 * 3600)).unwrap()
}

fn now_ms() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// Sets `clock` so that the database's clock (the machine's: the database
/// runs on loopback) reads `into` milliseconds into slot `slot`
/// (`into < 0`: that many before the slot's end).
fn place(clock: &SlotClock, slot: i64, into: i64) {
    let len = retention().slot_millis();
    let now = now_ms();
    let cycle = now.div_euclid(8 * len) * 8 * len;
    let into = if into < 0 { len + into } else { into };
    clock.set_offset_ms(cycle + slot * len + into - now);
}

fn clock_at(slot: i64, into: i64) -> SlotClock {
    let c = SlotClock::new();
    place(&c, slot, into);
    c
}

const MINUTE: i64 = 60_000;

fn message() -> InboundMessage {
    InboundMessage {
        id: EventId::new(),
        key: Some("account-7".into()),
        event_type: "account.credited".into(),
        topic: "accounts".into(),
        content_type: "application/json".into(),
        payload: br#"{"credit":10}"#.to_vec(),
        headers: Default::default(),
        created_at: None,
        attempt: None,
        format: WireFormat::Headers,
    }
}

/// Waits (polling, bounded) until `done` or until `blocked` holds.
async fn until_blocked_or_done<F, Fut>(task: &tokio::task::JoinHandle<Verdict>, mut blocked: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    while !task.is_finished() && !blocked().await {
        assert!(Instant::now() < deadline, "neither blocked nor done");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ---------------------------------------------------------------- PostgreSQL

struct Pg {
    pool: sqlx::PgPool,
    schema: String,
}

impl Pg {
    async fn new() -> Self {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(6)
            .connect(&url)
            .await
            .expect("PostgreSQL on 127.0.0.1:5432 (or DATABASE_URL)");
        let schema = format!(
            "inbox_slot_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query(&format!(
            "CREATE TABLE \"{schema}\".effects (event_id uuid NOT NULL)"
        ))
        .execute(&pool)
        .await
        .unwrap();
        let pg = Self { pool, schema };
        pg.store(&SlotClock::new()).migrate().await.unwrap();
        pg
    }

    fn store(&self, clock: &SlotClock) -> PgInbox {
        PgInbox::new(self.pool.clone(), "billing")
            .unwrap()
            .with_schema(self.schema.clone())
            .unwrap()
            .with_retention(retention())
            .unwrap()
            .with_slot_clock(clock.clone())
    }

    async fn effects(&self, id: EventId) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM \"{}\".effects WHERE event_id = $1",
            self.schema
        ))
        .bind(id.as_uuid())
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// Records of `id` by slot.
    async fn slots_of(&self, id: EventId) -> Vec<i16> {
        sqlx::query_scalar(&format!(
            "SELECT slot FROM \"{}\".inbox_records WHERE event_id = $1 ORDER BY slot",
            self.schema
        ))
        .bind(id.as_uuid())
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    /// A record handled a whole window ago, in `slot`: what retention empties.
    async fn old_record(&self, slot: i16) -> uuid::Uuid {
        let id = uuid::Uuid::new_v4();
        sqlx::query(&format!(
            "INSERT INTO \"{}\".inbox_records (consumer, event_id, slot, handled_at) \
             VALUES ('billing', $1, $2, now() - interval '7 days')",
            self.schema
        ))
        .bind(id)
        .bind(slot)
        .execute(&self.pool)
        .await
        .unwrap();
        id
    }

    async fn has_record(&self, id: uuid::Uuid) -> bool {
        sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM \"{}\".inbox_records WHERE event_id = $1)",
            self.schema
        ))
        .bind(id)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// Whether backend `pid` waits for a lock.
    async fn waits(&self, pid: i32) -> bool {
        sqlx::query_scalar(
            "SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1",
        )
        .bind(pid)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
        .unwrap_or(false)
    }

    /// Whether an ACCESS EXCLUSIVE request waits on this schema's partition.
    async fn exclusive_waits(&self, partition: &str) -> bool {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 \
             AND c.relname = $2 AND l.mode = 'AccessExclusiveLock' AND NOT l.granted)",
        )
        .bind(&self.schema)
        .bind(partition)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        let schema = self.schema.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                use sqlx::Connection;
                let url = std::env::var("DATABASE_URL")
                    .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
                if let Ok(mut c) = sqlx::PgConnection::connect(&url).await {
                    let _ = sqlx::raw_sql(&format!(
                        "SET lock_timeout = '10s'; DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
                    ))
                    .execute(&mut c)
                    .await;
                }
            });
        })
        .join();
    }
}

/// Admits `m` in a transaction of `store` and applies it when new; returns
/// the open transaction (the handler still "running") and the verdict.
async fn pg_admit(
    pg: &Pg,
    store: &PgInbox,
    m: &InboundMessage,
) -> (sqlx::Transaction<'static, sqlx::Postgres>, Verdict) {
    let mut tx = store.begin().await.unwrap();
    let v = store
        .admit(&mut tx, std::slice::from_ref(m), true)
        .await
        .unwrap()[0];
    if v == Verdict::New {
        sqlx::query(&format!(
            "INSERT INTO \"{}\".effects (event_id) VALUES ($1)",
            pg.schema
        ))
        .bind(m.id.as_uuid())
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    (tx, v)
}

/// Two copies of one event: the first admitted in a transaction of slot
/// `first` that stays open (its handler running), the second in a
/// transaction of slot `second` that starts meanwhile. The first commits
/// (or rolls back) only once the second is blocked or has decided.
async fn pg_two_copies(first: i64, second: i64, commit_first: bool) -> (Pg, EventId, Verdict) {
    let pg = Pg::new().await;
    // Either side of the boundary between slot 3 and slot 4.
    let into = |s: i64| if s == 3 { -MINUTE } else { MINUTE };
    let a = pg.store(&clock_at(first, into(first)));
    let b = pg.store(&clock_at(second, into(second)));
    let m = message();
    let (tx_a, v_a) = pg_admit(&pg, &a, &m).await;
    assert_eq!(v_a, Verdict::New);

    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let task = {
        let pool = pg.pool.clone();
        let schema = pg.schema.clone();
        let m = m.clone();
        tokio::spawn(async move {
            let mut tx = b.begin().await.unwrap();
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            pid_tx.send(pid).unwrap();
            let v = b
                .admit(&mut tx, std::slice::from_ref(&m), true)
                .await
                .unwrap()[0];
            if v == Verdict::New {
                sqlx::query(&format!(
                    "INSERT INTO \"{schema}\".effects (event_id) VALUES ($1)"
                ))
                .bind(m.id.as_uuid())
                .execute(&mut *tx)
                .await
                .unwrap();
            }
            tx.commit().await.unwrap();
            drop(pool);
            v
        })
    };
    let pid = pid_rx.await.unwrap();
    until_blocked_or_done(&task, || pg.waits(pid)).await;
    if commit_first {
        tx_a.commit().await.unwrap();
    } else {
        tx_a.rollback().await.unwrap();
    }
    let v_b = task.await.unwrap();
    (pg, m.id, v_b)
}

#[tokio::test]
async fn pg_copies_straddling_a_boundary_apply_once() {
    // The first copy's transaction started before the boundary, the second
    // after it; and the other way round (a lane transaction that started
    // before the boundary admits after a newer one).
    for (first, second) in [(3, 4), (4, 3)] {
        let (pg, id, v) = pg_two_copies(first, second, true).await;
        assert_eq!(
            v,
            Verdict::Duplicate,
            "copy in slot {second} after slot {first}'s"
        );
        assert_eq!(pg.effects(id).await, 1, "slots {first} then {second}");
        assert_eq!(pg.slots_of(id).await, vec![i16::try_from(first).unwrap()]);
    }
}

#[tokio::test]
async fn pg_copy_after_a_rolled_back_one_applies() {
    let (pg, id, v) = pg_two_copies(3, 4, false).await;
    assert_eq!(v, Verdict::New);
    assert_eq!(pg.effects(id).await, 1);
    assert_eq!(pg.slots_of(id).await, vec![4]);
}

#[tokio::test]
async fn pg_copies_in_one_slot_apply_once() {
    let (pg, id, v) = pg_two_copies(3, 3, true).await;
    assert_eq!(v, Verdict::Duplicate);
    assert_eq!(pg.effects(id).await, 1);
}

/// REPEATABLE READ takes its snapshot before the lock's wait: refused with
/// a message, instead of applying a copy twice.
#[tokio::test]
async fn pg_repeatable_read_is_refused() {
    let pg = Pg::new().await;
    let store = pg.store(&SlotClock::new());
    let mut tx = store.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = store.admit(&mut tx, &[message()], true).await.unwrap_err();
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("READ COMMITTED"), "{err}");
}

#[tokio::test]
async fn pg_retention_racing_a_boundary_keeps_the_new_slot() {
    let pg = Pg::new().await;
    // Slot 4 still holds the records of its previous turn.
    pg.old_record(4).await;
    // A transaction that started after the boundary (slot 4) admits a
    // message and is still open...
    let after = pg.store(&clock_at(4, MINUTE));
    let m = message();
    let (tx, v) = pg_admit(&pg, &after, &m).await;
    assert_eq!(v, Verdict::New);
    // ... while a retention pass that read its clock just before the
    // boundary (slot 3: slot 4 comes next) empties slot 4.
    let pass_clock = clock_at(3, -MINUTE);
    let pass = pg.store(&pass_clock);
    let task = tokio::spawn(async move { pass.retain().await.unwrap() });
    let deadline = Instant::now() + Duration::from_secs(20);
    while !task.is_finished() && !pg.exclusive_waits("inbox_records_4").await {
        assert!(
            Instant::now() < deadline,
            "the pass neither waited nor ended"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The boundary passes; the new slot's transaction commits.
    place(&pass_clock, 4, MINUTE);
    tx.commit().await.unwrap();
    let report = task.await.unwrap();
    assert!(
        after.is_recorded(m.id).await.unwrap(),
        "the record of the slot that became current was emptied ({report:?})"
    );
    assert_eq!(pg.effects(m.id).await, 1);
    // A copy arriving now is a duplicate.
    let (tx, v) = pg_admit(&pg, &after, &m).await;
    tx.commit().await.unwrap();
    assert_eq!(v, Verdict::Duplicate);
}

#[tokio::test]
async fn pg_retention_keeps_a_margin_before_the_boundary() {
    let pg = Pg::new().await;
    let old = pg.old_record(4).await;
    // A pass two and a half minutes before slot 4 becomes current: within
    // the margin, it leaves slot 4 alone.
    let clock = clock_at(3, -MINUTE * 5 / 2);
    let store = pg.store(&clock);
    let r = store.retain().await.unwrap();
    assert!(!r.emptied, "{r:?}");
    assert!(pg.has_record(old).await, "emptied within the margin");
    // Well inside slot 3, the same pass empties it.
    place(&clock, 3, retention().slot_millis() / 2);
    let r = store.retain().await.unwrap();
    assert_eq!((r.current_slot, r.emptied), (3, true));
    assert!(!pg.has_record(old).await);
}

// -------------------------------------------------------------------- SQLite

struct Lite {
    pool: sqlx::SqlitePool,
    _dir: tempfile::TempDir,
}

impl Lite {
    async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let opts = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(dir.path().join("consumer.db"))
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(20));
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(opts)
            .await
            .unwrap();
        sqlx::query("CREATE TABLE effects (event_id TEXT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        let lite = Self { pool, _dir: dir };
        lite.store(&SlotClock::new()).migrate().await.unwrap();
        lite
    }

    fn store(&self, clock: &SlotClock) -> SqliteInbox {
        SqliteInbox::new(self.pool.clone(), "billing")
            .unwrap()
            .with_retention(retention())
            .unwrap()
            .with_slot_clock(clock.clone())
    }

    async fn effects(&self, id: EventId) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = ?")
            .bind(id.to_string())
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn old_record(&self, slot: i64) -> String {
        let id = uuid::Uuid::new_v4().to_string();
        sqlx::query(&format!(
            "INSERT INTO outbox_inbox_records_{slot} (consumer, event_id, handled_at) \
             VALUES ('billing', ?, ?)"
        ))
        .bind(&id)
        .bind(now_ms() - 7 * 24 * 3600 * 1000)
        .execute(&self.pool)
        .await
        .unwrap();
        id
    }

    async fn in_slot(&self, slot: i64, id: &str) -> bool {
        sqlx::query_scalar(&format!(
            "SELECT EXISTS (SELECT 1 FROM outbox_inbox_records_{slot} WHERE event_id = ?)"
        ))
        .bind(id)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
}

async fn lite_admit(
    store: &SqliteInbox,
    m: &InboundMessage,
) -> (sqlx::Transaction<'static, sqlx::Sqlite>, Verdict) {
    let mut tx = store.begin().await.unwrap();
    let v = store
        .admit(&mut tx, std::slice::from_ref(m), true)
        .await
        .unwrap()[0];
    if v == Verdict::New {
        sqlx::query("INSERT INTO effects (event_id) VALUES (?)")
            .bind(m.id.to_string())
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    (tx, v)
}

/// SQLite has one writer: the second copy's transaction (`BEGIN
/// IMMEDIATE`) starts only once the first has ended, whatever its slot,
/// so it sees the first copy's record.
#[tokio::test]
async fn sqlite_copies_straddling_a_boundary_apply_once() {
    for (first, second) in [(3, 4), (4, 3)] {
        let lite = Lite::new().await;
        let into = |s: i64| if s == 3 { -MINUTE } else { MINUTE };
        let a = lite.store(&clock_at(first, into(first)));
        let b = lite.store(&clock_at(second, into(second)));
        let m = message();
        let (tx_a, v_a) = lite_admit(&a, &m).await;
        assert_eq!(v_a, Verdict::New);
        let task = {
            let m = m.clone();
            tokio::spawn(async move {
                let (tx, v) = lite_admit(&b, &m).await;
                tx.commit().await.unwrap();
                v
            })
        };
        tx_a.commit().await.unwrap();
        assert_eq!(task.await.unwrap(), Verdict::Duplicate);
        assert_eq!(lite.effects(m.id).await, 1);
        assert!(lite.in_slot(first, &m.id.to_string()).await);
        assert!(!lite.in_slot(second, &m.id.to_string()).await);
    }
}

/// The pass reads its clock inside its write transaction: a boundary that
/// passed while it waited for the writer makes it empty the slot after the
/// new one, never the new one.
#[tokio::test]
async fn sqlite_retention_racing_a_boundary_keeps_the_new_slot() {
    let lite = Lite::new().await;
    let old = lite.old_record(4).await;
    let after = lite.store(&clock_at(4, MINUTE));
    let m = message();
    let (tx, v) = lite_admit(&after, &m).await;
    assert_eq!(v, Verdict::New);
    let pass_clock = clock_at(3, -MINUTE);
    let pass = lite.store(&pass_clock);
    let task = tokio::spawn(async move { pass.retain().await.unwrap() });
    // The pass cannot begin before the writer ends; the boundary passes.
    place(&pass_clock, 4, MINUTE);
    tx.commit().await.unwrap();
    let r = task.await.unwrap();
    assert!(after.is_recorded(m.id).await.unwrap(), "{r:?}");
    assert!(lite.in_slot(4, &old).await, "{r:?}");
    assert_eq!(lite.effects(m.id).await, 1);
}

#[tokio::test]
async fn sqlite_retention_keeps_a_margin_before_the_boundary() {
    let lite = Lite::new().await;
    let old = lite.old_record(4).await;
    let clock = clock_at(3, -MINUTE * 5 / 2);
    let store = lite.store(&clock);
    let r = store.retain().await.unwrap();
    assert!(!r.emptied, "{r:?}");
    assert!(lite.in_slot(4, &old).await, "emptied within the margin");
    place(&clock, 3, retention().slot_millis() / 2);
    let r = store.retain().await.unwrap();
    assert_eq!((r.current_slot, r.emptied), (3, true));
    assert!(!lite.in_slot(4, &old).await);
}

#[tokio::test]
async fn pg_retention_never_queues_behind_a_reader_of_the_partition() {
    let pg = Pg::new().await;
    let old = pg.old_record(4).await;
    // A session reads the partition retention empties next and stays in
    // its transaction (a dump, a session idle in a transaction).
    let mut reader = pg.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT count(*) FROM \"{}\".inbox_records_4",
        pg.schema
    ))
    .execute(&mut *reader)
    .await
    .unwrap();
    let clock = clock_at(3, retention().slot_millis() / 2);
    let store = pg.store(&clock);
    // The pass gives up without queueing its lock request (a queued ACCESS
    // EXCLUSIVE request would make every admit wait behind it)...
    let r = store.retain().await.unwrap();
    assert!(!r.emptied, "{r:?}");
    assert!(!pg.exclusive_waits("inbox_records_4").await);
    assert!(pg.has_record(old).await);
    // ... and admits go on meanwhile.
    let m = message();
    let (tx, v) = pg_admit(&pg, &store, &m).await;
    tx.commit().await.unwrap();
    assert_eq!(v, Verdict::New);
    // Once the reader has gone, the next pass empties the slot.
    reader.commit().await.unwrap();
    let r = store.retain().await.unwrap();
    assert_eq!((r.current_slot, r.emptied), (3, true));
    assert!(!pg.has_record(old).await);
}
