//! The inbox conformance suite: the consumer loop against each consumer
//! database (PostgreSQL in its own schema, SQLite in its own file), written
//! once. Messages come from an in-memory source (`support::MemoryBroker`);
//! the brokers' own behaviour is `source_conformance.rs`'s.
#![cfg(all(feature = "postgres", feature = "sqlite"))]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use outbox_core::{DeadHeadPolicy, DeadLetterFilter, ErrorCode, EventId, Jitter, RetryPolicy};
use outbox_inbox::{
    Handler, Inbox, InboxDeadLetterStore, InboxOptions, InboxRetentionStore, InboxSchema,
    InboxStore, PendingCounts, PgInbox, Retention, SqliteInbox,
};
use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};
use support::{event, MemoryBroker, PgEffects, Script, SqliteEffects};

/// One consumer database for one test.
trait Harness: Sized + Send + Sync + 'static {
    type St: InboxStore + InboxSchema + InboxRetentionStore + InboxDeadLetterStore + std::fmt::Debug;
    type H: Handler<<Self::St as InboxStore>::Db>;
    fn new() -> impl Future<Output = Self> + Send;
    fn store(&self) -> Self::St;
    fn handler(&self, script: Script) -> Self::H;
    /// Effect rows in the order they were written: (event id, key).
    fn effects(&self) -> impl Future<Output = Vec<(EventId, String)>> + Send;
    /// Cuts every connection the inbox holds to its database (PostgreSQL:
    /// terminates the backends; SQLite: nothing to cut); returns how many.
    fn cut_connections(&self) -> impl Future<Output = u64> + Send;
    /// Moves every record into `slot` and ages it by `age`.
    fn age_records(&self, slot: u32, age: Duration) -> impl Future<Output = ()> + Send;
    /// Makes the held-back message `id` `age` older (its time of death, for
    /// a dead letter).
    fn age_pending(&self, id: EventId, age: Duration) -> impl Future<Output = ()> + Send;
}

struct Pg {
    pool: sqlx::PgPool,
    schema: String,
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
                if let Ok(mut c) = sqlx::PgConnection::connect(&support::database_url()).await {
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

impl Harness for Pg {
    type St = PgInbox;
    type H = PgEffects;

    async fn new() -> Self {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(12)
            .connect(&support::database_url())
            .await
            .expect("PostgreSQL on 127.0.0.1:5432 (or DATABASE_URL)");
        let schema = format!(
            "inbox_test_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query(&format!(
            "CREATE TABLE \"{schema}\".effects (seq bigserial PRIMARY KEY, event_id uuid NOT NULL, key text)"
        ))
        .execute(&pool)
        .await
        .unwrap();
        Self { pool, schema }
    }

    fn store(&self) -> PgInbox {
        PgInbox::new(self.pool.clone(), "billing")
            .unwrap()
            .with_schema(self.schema.clone())
            .unwrap()
    }

    fn handler(&self, script: Script) -> PgEffects {
        PgEffects {
            script,
            schema: self.schema.clone(),
        }
    }

    async fn effects(&self) -> Vec<(EventId, String)> {
        let rows: Vec<(uuid::Uuid, Option<String>)> = sqlx::query_as(&format!(
            "SELECT event_id, key FROM \"{}\".effects ORDER BY seq",
            self.schema
        ))
        .fetch_all(&self.pool)
        .await
        .unwrap();
        rows.into_iter()
            .map(|(id, k)| (EventId::from(id), k.unwrap_or_default()))
            .collect()
    }

    async fn cut_connections(&self) -> u64 {
        // Only this test's connections: their last statement names its schema.
        let cut: Vec<(bool,)> = sqlx::query_as(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
             AND backend_type = 'client backend' AND strpos(query, $1) > 0",
        )
        .bind(&self.schema)
        .fetch_all(&self.pool)
        .await
        .unwrap();
        cut.len() as u64
    }

    async fn age_records(&self, slot: u32, age: Duration) {
        sqlx::query(&format!(
            "UPDATE \"{}\".inbox_records SET slot = $1, handled_at = now() - make_interval(secs => $2)",
            self.schema
        ))
        .bind(i16::try_from(slot).unwrap())
        .bind(age.as_secs_f64())
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn age_pending(&self, id: EventId, age: Duration) {
        let done = sqlx::query(&format!(
            "UPDATE \"{}\".inbox_pending SET next_attempt_at = next_attempt_at - make_interval(secs => $1) \
             WHERE event_id = $2",
            self.schema
        ))
        .bind(age.as_secs_f64())
        .bind(id.as_uuid())
        .execute(&self.pool)
        .await
        .unwrap();
        assert_eq!(done.rows_affected(), 1);
    }
}

/// [`Pg`] with the inbox (and the handler's transaction) reaching the
/// database through PgBouncer in transaction mode; the harness's own reads
/// go straight to it.
struct PgBouncer {
    direct: Pg,
    pooled: sqlx::PgPool,
}

impl Harness for PgBouncer {
    type St = PgInbox;
    type H = PgEffects;

    async fn new() -> Self {
        let direct = Pg::new().await;
        let pooled = sqlx::postgres::PgPoolOptions::new()
            .max_connections(12)
            .connect(&support::pgbouncer_url())
            .await
            .expect("PgBouncer on 127.0.0.1:6432 (cargo xtask services), or PGBOUNCER_URL");
        Self { direct, pooled }
    }

    fn store(&self) -> PgInbox {
        PgInbox::new(self.pooled.clone(), "billing")
            .unwrap()
            .with_pooler(outbox_core::Pooler::Transaction)
            .with_schema(self.direct.schema.clone())
            .unwrap()
    }

    fn handler(&self, script: Script) -> PgEffects {
        self.direct.handler(script)
    }

    async fn effects(&self) -> Vec<(EventId, String)> {
        self.direct.effects().await
    }

    async fn cut_connections(&self) -> u64 {
        self.direct.cut_connections().await
    }

    async fn age_records(&self, slot: u32, age: Duration) {
        self.direct.age_records(slot, age).await
    }

    async fn age_pending(&self, id: EventId, age: Duration) {
        self.direct.age_pending(id, age).await
    }
}

struct Lite {
    pool: sqlx::SqlitePool,
    _dir: tempfile::TempDir,
}

impl Harness for Lite {
    type St = SqliteInbox;
    type H = SqliteEffects;

    async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let opts = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(dir.path().join("consumer.db"))
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(10));
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(opts)
            .await
            .unwrap();
        sqlx::query(
            "CREATE TABLE effects (seq INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL, key TEXT)",
        )
        .execute(&pool)
        .await
        .unwrap();
        Self { pool, _dir: dir }
    }

    fn store(&self) -> SqliteInbox {
        SqliteInbox::new(self.pool.clone(), "billing").unwrap()
    }

    fn handler(&self, script: Script) -> SqliteEffects {
        SqliteEffects { script }
    }

    async fn effects(&self) -> Vec<(EventId, String)> {
        let rows: Vec<(String, Option<String>)> =
            sqlx::query_as("SELECT event_id, key FROM effects ORDER BY seq")
                .fetch_all(&self.pool)
                .await
                .unwrap();
        rows.into_iter()
            .map(|(id, k)| (id.parse().unwrap(), k.unwrap_or_default()))
            .collect()
    }

    async fn cut_connections(&self) -> u64 {
        0
    }

    async fn age_records(&self, slot: u32, age: Duration) {
        let age_ms = i64::try_from(age.as_millis()).unwrap();
        for s in 0..8 {
            if s == slot {
                continue;
            }
            sqlx::query(&format!(
                "INSERT INTO outbox_inbox_records_{slot} SELECT consumer, event_id, handled_at FROM outbox_inbox_records_{s}"
            ))
            .execute(&self.pool)
            .await
            .unwrap();
            sqlx::query(&format!("DELETE FROM outbox_inbox_records_{s}"))
                .execute(&self.pool)
                .await
                .unwrap();
        }
        sqlx::query(&format!(
            "UPDATE outbox_inbox_records_{slot} SET handled_at = handled_at - ?"
        ))
        .bind(age_ms)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn age_pending(&self, id: EventId, age: Duration) {
        let done = sqlx::query(
            "UPDATE outbox_inbox_pending SET next_attempt_at = next_attempt_at - ? WHERE event_id = ?",
        )
        .bind(i64::try_from(age.as_millis()).unwrap())
        .bind(id.to_string())
        .execute(&self.pool)
        .await
        .unwrap();
        assert_eq!(done.rows_affected(), 1);
    }
}

fn fast_retry() -> InboxOptions {
    InboxOptions::default()
        .with_dead_head_policy(DeadHeadPolicy::Block)
        .with_retry(
            RetryPolicy::new(
                Duration::from_millis(20),
                Duration::from_millis(100),
                3,
                Jitter::None,
            )
            .unwrap(),
        )
        .with_retry_poll(Duration::from_millis(10))
        .with_recv_wait(Duration::from_millis(20))
}

/// A running inbox and how to stop it.
struct Running<S: InboxStore + InboxSchema + InboxRetentionStore, H: Handler<S::Db>> {
    _inbox: Inbox<S, H>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<outbox_inbox::InboxCounts>,
}

impl<S: InboxStore + InboxSchema + InboxRetentionStore, H: Handler<S::Db>> Running<S, H> {
    fn start(inbox: Inbox<S, H>, broker: &MemoryBroker) -> Self {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let runner = inbox.clone();
        let source = broker.source();
        let task = tokio::spawn(async move {
            runner
                .run(source, async move {
                    let _ = rx.await;
                })
                .await
                .unwrap()
        });
        Self {
            _inbox: inbox,
            stop: Some(tx),
            task,
        }
    }

    async fn stop(mut self) -> outbox_inbox::InboxCounts {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the inbox stops")
            .unwrap()
    }
}

/// Waits (bounded) until `cond` holds.
async fn until<F: Future<Output = bool>>(what: &str, mut cond: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn per_key(effects: &[(EventId, String)]) -> HashMap<String, Vec<EventId>> {
    let mut m: HashMap<String, Vec<EventId>> = HashMap::new();
    for (id, k) in effects {
        m.entry(k.clone()).or_default().push(*id);
    }
    m
}

async fn each_message_once_in_key_order<X: Harness>() {
    let h = X::new().await;
    let broker = MemoryBroker::default();
    let script = Script::default();
    let inbox = Inbox::new(h.store(), h.handler(script.clone())).with_options(fast_retry());
    let run = Running::start(inbox, &broker);
    let mut sent: HashMap<String, Vec<EventId>> = HashMap::new();
    let mut events = Vec::new();
    for i in 0..600 {
        let key = format!("k{}", i % 23);
        let e = event(&key, "ok");
        sent.entry(key).or_default().push(e.id);
        events.push(e);
    }
    for e in &events {
        broker.push_event(e);
    }
    // Every tenth message again (a redelivery) and a whole copy later (a
    // relay duplicate).
    for e in events.iter().step_by(10) {
        broker.push_event(e);
    }
    until("all handled", || async { h.effects().await.len() >= 600 }).await;
    for e in events.iter().step_by(7) {
        broker.push_event(e);
    }
    let total = 600 + 60 + events.iter().step_by(7).count();
    until("all acknowledged", || async {
        broker.acked().len() == total
    })
    .await;
    let counts = run.stop().await;
    let effects = h.effects().await;
    assert_eq!(effects.len(), 600, "one effect per event");
    assert_eq!(
        per_key(&effects),
        sent,
        "per-key order of the effects is arrival order"
    );
    assert_eq!(counts.handled, 600);
    assert_eq!(counts.duplicates, (total - 600) as u64);
    for e in events.iter().take(5) {
        assert!(h.store().is_recorded(e.id).await.unwrap());
    }
}

async fn retry_parks_the_key_and_keeps_order<X: Harness>() {
    let h = X::new().await;
    let broker = MemoryBroker::default();
    let script = Script::default();
    let inbox = Inbox::new(h.store(), h.handler(script.clone())).with_options(fast_retry());
    let run = Running::start(inbox, &broker);
    let a1 = event("a", "fail:2");
    let a2 = event("a", "ok");
    let a3 = event("a", "ok");
    let b1 = event("b", "ok");
    for e in [&a1, &a2, &b1, &a3] {
        broker.push_event(e);
    }
    until("a3 handled", || async { h.effects().await.len() == 4 }).await;
    let counts = run.stop().await;
    let effects = h.effects().await;
    let by_key = per_key(&effects);
    assert_eq!(by_key["a"], vec![a1.id, a2.id, a3.id]);
    assert_eq!(by_key["b"], vec![b1.id]);
    assert_eq!(script.runs(a1.id), 3, "two failures, then success");
    assert_eq!(counts.retries, 2);
    assert!(counts.parked >= 1, "{counts:?}");
    assert_eq!(
        h.store().pending_counts().await.unwrap(),
        PendingCounts {
            retry: 0,
            parked: 0,
            dead: 0
        }
    );
}

async fn dead_head_blocks_until_replayed<X: Harness>() {
    let h = X::new().await;
    let broker = MemoryBroker::default();
    let script = Script::default();
    let inbox = Inbox::new(h.store(), h.handler(script.clone())).with_options(fast_retry());
    let run = Running::start(inbox.clone(), &broker);
    let a1 = event("a", "dead");
    let a2 = event("a", "ok");
    let b1 = event("b", "ok");
    for e in [&a1, &a2, &b1] {
        broker.push_event(e);
    }
    until("b handled, a parked", || async {
        h.store().pending_counts().await.ok()
            == Some(PendingCounts {
                retry: 0,
                parked: 1,
                dead: 1,
            })
            && h.effects().await.len() == 1
    })
    .await;
    let dead = h
        .store()
        .dead_letters(&DeadLetterFilter::all(), 100)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message.id, a1.id);
    assert_eq!(
        dead[0].last_error.as_ref().unwrap().0.as_str(),
        "HANDLER_PERMANENT_FAILURE"
    );
    assert_eq!(dead[0].message.payload, b"dead");
    // A filter that matches nothing replays nothing.
    let none = DeadLetterFilter::all().with_code(ErrorCode::HANDLER_NOT_REGISTERED);
    assert_eq!(h.store().replay(&none).await.unwrap(), 0);
    script.heal();
    let by_id = DeadLetterFilter::ids([a1.id]);
    assert_eq!(h.store().replay(&by_id).await.unwrap(), 1);
    until("a replayed", || async { h.effects().await.len() == 3 }).await;
    run.stop().await;
    let by_key = per_key(&h.effects().await);
    assert_eq!(by_key["a"], vec![a1.id, a2.id]);
}

async fn dead_head_continue_lets_the_key_go_on_and_purge_removes<X: Harness>() {
    let h = X::new().await;
    let broker = MemoryBroker::default();
    let script = Script::default();
    let inbox = Inbox::new(h.store(), h.handler(script.clone()))
        .with_options(fast_retry().with_dead_head_policy(DeadHeadPolicy::Continue));
    let run = Running::start(inbox, &broker);
    let a1 = event("a", "dead");
    let a2 = event("a", "ok");
    broker.push_event(&a1);
    broker.push_event(&a2);
    until("a2 handled", || async { h.effects().await.len() == 1 }).await;
    // The dead message comes again: recognised, not handled twice.
    broker.push_event(&a1);
    until("all acked", || async { broker.acked().len() == 3 }).await;
    run.stop().await;
    assert_eq!(script.runs(a1.id), 1);
    assert_eq!(
        h.store().pending_counts().await.unwrap(),
        PendingCounts {
            retry: 0,
            parked: 0,
            dead: 1
        }
    );
    let all = DeadLetterFilter::all();
    assert_eq!(h.store().purge(&all).await.unwrap(), 1);
    assert_eq!(
        h.store().pending_counts().await.unwrap(),
        PendingCounts {
            retry: 0,
            parked: 0,
            dead: 0
        }
    );
}

async fn bad_messages_become_dead_letters<X: Harness>() {
    let h = X::new().await;
    let broker = MemoryBroker::default();
    let script = Script::default();
    let inbox = Inbox::new(h.store(), h.handler(script.clone())).with_options(fast_retry());
    let run = Running::start(inbox, &broker);
    // No outbox headers at all.
    broker.push(outbox_inbox::source::RawMessage {
        headers: vec![("x".into(), "y".into())],
        body: b"not an event".to_vec(),
        destination: "orders".into(),
        timestamp: None,
        redelivered: false,
        behind: None,
    });
    // A handler that panics once, then succeeds.
    let p = event("p", "panic");
    broker.push_event(&p);
    until("acked", || async { broker.acked().len() == 2 }).await;
    until("panic retried", || async { h.effects().await.len() == 1 }).await;
    let counts = run.stop().await;
    assert_eq!(counts.undecodable, 1);
    assert_eq!(counts.retries, 1, "the panic was one retryable attempt");
    let dead = h
        .store()
        .dead_letters(
            &DeadLetterFilter::all().with_code(ErrorCode::UNDECODABLE),
            100,
        )
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message.payload, b"not an event");
    assert!(dead[0]
        .last_error
        .as_ref()
        .unwrap()
        .1
        .contains("Outbox-Event-Id"));
}

/// The outbox's dead-letter filter selects the inbox's dead letters by id,
/// event type, final error code, key and age (since they died); `replay`
/// and `purge` take the same selection.
async fn dead_letters_are_selected_by_type_code_key_and_age<X: Harness>() {
    use outbox_inbox::{Failure, Hold};
    let h = X::new().await;
    let store = h.store();
    store.migrate().await.unwrap();
    let dead = |key: Option<&str>, event_type: &str, code: ErrorCode| {
        let e = event("k", "dead");
        let r = support::raw(&e);
        let mut m =
            outbox_core::InboundMessage::decode(r.header_pairs(), &r.body, "orders", None).unwrap();
        m.key = key.map(str::to_owned);
        m.event_type = event_type.to_owned();
        let hold = Hold::Dead {
            attempts: 1,
            failure: Failure {
                code,
                message: "boom".into(),
                retryable: false,
            },
        };
        (m, hold)
    };
    // a: died two hours ago; b and c: just now; c has no key.
    let letters = [
        dead(
            Some("a"),
            "order.created",
            ErrorCode::HANDLER_PERMANENT_FAILURE,
        ),
        dead(
            Some("b"),
            "order.paid",
            ErrorCode::HANDLER_PERMANENT_FAILURE,
        ),
        dead(None, "order.created", ErrorCode::UNDECODABLE),
    ];
    let mut tx = store.begin().await.unwrap();
    for (m, hold) in &letters {
        store.hold(&mut tx, m, hold).await.unwrap();
    }
    tx.commit().await.unwrap();
    let [a, b, c] = [0, 1, 2].map(|i| letters[i].0.id);
    h.age_pending(a, Duration::from_secs(2 * 3600)).await;
    let hour = Duration::from_secs(3600);
    let selected = |f: DeadLetterFilter| {
        let store = store.clone();
        async move {
            let listed: Vec<EventId> = store
                .dead_letters(&f, 100)
                .await
                .unwrap()
                .into_iter()
                .map(|p| p.message.id)
                .collect();
            listed
        }
    };
    assert_eq!(selected(DeadLetterFilter::all()).await, [a, b, c]);
    assert_eq!(
        selected(DeadLetterFilter::all().with_event_type("order.created")).await,
        [a, c]
    );
    assert_eq!(
        selected(DeadLetterFilter::all().with_code(ErrorCode::UNDECODABLE)).await,
        [c]
    );
    assert_eq!(selected(DeadLetterFilter::all().with_key("a")).await, [a]);
    assert_eq!(
        selected(DeadLetterFilter::all().older_than(hour)).await,
        [a]
    );
    assert_eq!(
        selected(DeadLetterFilter::all().newer_than(hour)).await,
        [b, c]
    );
    assert_eq!(
        selected(
            DeadLetterFilter::all()
                .older_than(hour)
                .newer_than(3 * hour)
        )
        .await,
        [a]
    );
    assert_eq!(
        selected(DeadLetterFilter::all().older_than(3 * hour)).await,
        []
    );
    // Ages beyond any store's range are capped, not an error.
    assert_eq!(
        selected(DeadLetterFilter::all().older_than(Duration::MAX)).await,
        []
    );
    assert_eq!(
        selected(DeadLetterFilter::all().newer_than(Duration::MAX)).await,
        [a, b, c]
    );
    assert_eq!(selected(DeadLetterFilter::ids([])).await, []);
    assert_eq!(
        selected(DeadLetterFilter::ids([b, c]).with_event_type("order.paid")).await,
        [b]
    );
    let first_two: Vec<EventId> = store
        .dead_letters(&DeadLetterFilter::all(), 2)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.message.id)
        .collect();
    assert_eq!(first_two, [a, b]);
    // Replay and purge select the same way.
    assert_eq!(
        store
            .replay(&DeadLetterFilter::all().older_than(hour))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        store.pending_counts().await.unwrap(),
        PendingCounts {
            retry: 1,
            parked: 0,
            dead: 2
        }
    );
    assert_eq!(
        store
            .purge(&DeadLetterFilter::all().newer_than(hour).with_key("b"))
            .await
            .unwrap(),
        1
    );
    assert_eq!(selected(DeadLetterFilter::all()).await, [c]);
    assert_eq!(
        store.pending_counts().await.unwrap(),
        PendingCounts {
            retry: 1,
            parked: 0,
            dead: 1
        }
    );
}

async fn database_faults_cost_no_attempt<X: Harness>() {
    let h = X::new().await;
    let broker = MemoryBroker::default();
    let script = Script::default();
    let inbox = Inbox::new(h.store(), h.handler(script.clone())).with_options(fast_retry());
    let run = Running::start(inbox, &broker);
    let mut ids = Vec::new();
    let mut cut = 0;
    for round in 0..5 {
        for i in 0..100 {
            let e = event(&format!("k{}", i % 7), "ok");
            ids.push(e.id);
            broker.push_event(&e);
        }
        if round % 2 == 0 {
            cut += h.cut_connections().await;
        }
    }
    until("all handled", || async { h.effects().await.len() >= 500 }).await;
    until("all acked", || async { broker.acked().len() == 500 }).await;
    let counts = run.stop().await;
    let effects = h.effects().await;
    assert_eq!(effects.len(), 500, "each once");
    assert_eq!(counts.retries, 0, "{counts:?}");
    assert_eq!(counts.dead, 0, "{counts:?}");
    if std::any::type_name::<X>().ends_with("Pg") {
        assert!(cut > 0, "the test cut no connection");
    }
}

async fn retention_empties_old_slots_in_bulk<X: Harness>() {
    let h = X::new().await;
    let store = h.store();
    store.migrate().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    let events: Vec<_> = (0..50).map(|i| event(&format!("k{i}"), "ok")).collect();
    let msgs: Vec<_> = events
        .iter()
        .map(|e| {
            let r = support::raw(e);
            outbox_core::InboundMessage::decode(r.header_pairs(), &r.body, "orders", None).unwrap()
        })
        .collect();
    store.admit(&mut tx, &msgs, true).await.unwrap();
    tx.commit().await.unwrap();
    let report = store.retain().await.unwrap();
    assert!(!report.emptied, "nothing old yet");
    // Every record into the slot after the current one, older than the window.
    let next = (report.current_slot + 1) % 8;
    h.age_records(
        next,
        Retention::default().window() + Duration::from_secs(60),
    )
    .await;
    assert!(store.is_recorded(events[0].id).await.unwrap());
    let report = store.retain().await.unwrap();
    assert!(report.emptied);
    assert!(!store.is_recorded(events[0].id).await.unwrap());
    // Young records in that slot (no pass ran for a whole slot) survive.
    let mut tx = store.begin().await.unwrap();
    store.admit(&mut tx, &msgs[..1], true).await.unwrap();
    tx.commit().await.unwrap();
    h.age_records(next, Duration::from_secs(0)).await;
    store.retain().await.unwrap();
    assert!(store.is_recorded(events[0].id).await.unwrap());
}

async fn both_wire_formats_are_one_event<X: Harness>() {
    let h = X::new().await;
    let broker = MemoryBroker::default();
    let script = Script::default();
    let inbox = Inbox::new(h.store(), h.handler(script.clone())).with_options(fast_retry());
    let run = Running::start(inbox, &broker);
    let a = event("a", "ok");
    let b = event("a", "ok");
    broker.push(support::raw_as(&a, outbox_core::WireFormat::Envelope));
    broker.push(support::raw_as(&b, outbox_core::WireFormat::Headers));
    // The same event in the other format is the same event: a duplicate.
    broker.push(support::raw_as(&a, outbox_core::WireFormat::Headers));
    broker.push(support::raw_as(&b, outbox_core::WireFormat::Envelope));
    until("all acked", || async { broker.acked().len() == 4 }).await;
    let counts = run.stop().await;
    assert_eq!(
        h.effects().await,
        vec![(a.id, "a".to_owned()), (b.id, "a".to_owned())]
    );
    assert_eq!((counts.handled, counts.duplicates), (2, 2));
}

/// CloudEvents in both modes are the same event as the other formats (a
/// copy is a duplicate); a CloudEvent without a `source` is dead-lettered as
/// `UNDECODABLE`, the message naming the attribute.
async fn cloudevents_are_one_event_and_malformed_ones_dead<X: Harness>() {
    use outbox_core::cloudevents::Binding;
    use outbox_core::WireFormat;
    let h = X::new().await;
    let broker = MemoryBroker::default();
    let script = Script::default();
    let inbox = Inbox::new(h.store(), h.handler(script.clone())).with_options(fast_retry());
    let run = Running::start(inbox, &broker);
    let a = event("a", "ok");
    let b = event("a", "ok");
    broker.push(support::raw_cloudevent(
        &a,
        WireFormat::CloudEvents,
        Binding::Kafka,
    ));
    broker.push(support::raw_cloudevent(
        &b,
        WireFormat::CloudEventsJson,
        Binding::Nats,
    ));
    broker.push(support::raw_as(&a, WireFormat::Envelope));
    broker.push(support::raw_cloudevent(
        &b,
        WireFormat::CloudEvents,
        Binding::Nats,
    ));
    broker.push(support::raw_cloudevent(
        &a,
        WireFormat::CloudEventsJson,
        Binding::Kafka,
    ));
    let mut bad =
        support::raw_cloudevent(&event("a", "ok"), WireFormat::CloudEvents, Binding::Kafka);
    bad.headers.retain(|(k, _)| k != "ce_source");
    broker.push(bad);
    until("all acked", || async { broker.acked().len() == 6 }).await;
    let counts = run.stop().await;
    assert_eq!(
        h.effects().await,
        vec![(a.id, "a".to_owned()), (b.id, "a".to_owned())]
    );
    assert_eq!((counts.handled, counts.duplicates), (2, 3));
    assert_eq!(counts.undecodable, 1);
    let dead = h
        .store()
        .dead_letters(
            &DeadLetterFilter::all().with_code(ErrorCode::UNDECODABLE),
            100,
        )
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    let message = &dead[0].last_error.as_ref().unwrap().1;
    assert!(message.contains("`source`"), "{message}");
}

async fn bad_configuration_is_named<X: Harness>() {
    let h = X::new().await;
    let _ = h;
    assert!(InboxOptions::default().with_lanes(0).is_err());
    assert!(Retention::new(Duration::from_secs(1)).is_err());
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod postgres {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case::<Pg>().await;
                }
            )*
        }
        mod sqlite {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case::<Lite>().await;
                }
            )*
        }
        mod postgres_through_pgbouncer {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case::<PgBouncer>().await;
                }
            )*
        }
    };
}

conformance!(
    each_message_once_in_key_order,
    retry_parks_the_key_and_keeps_order,
    dead_head_blocks_until_replayed,
    dead_head_continue_lets_the_key_go_on_and_purge_removes,
    bad_messages_become_dead_letters,
    dead_letters_are_selected_by_type_code_key_and_age,
    database_faults_cost_no_attempt,
    retention_empties_old_slots_in_bulk,
    both_wire_formats_are_one_event,
    cloudevents_are_one_event_and_malformed_ones_dead,
    bad_configuration_is_named,
);

#[tokio::test]
async fn bad_names_are_refused() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy(&support::database_url())
        .unwrap();
    let err = PgInbox::new(pool.clone(), "c")
        .unwrap()
        .with_schema("bad-name")
        .unwrap_err();
    assert!(err.to_string().contains("bad-name"), "{err}");
    assert!(PgInbox::new(pool, "").is_err());
}

/// The inbox follows a primary that moves when its pool does (issue 46):
/// a pool over two hosts with `target_session_attrs=read-write`, made by
/// `outbox_postgres::PgHosts::connect_pool` (the inbox depends on no store
/// crate: the pool is the application's). The hosts are TCP proxies in
/// front of the test database; the one in use is refused mid-run (its
/// connections cut, new ones refused), as a primary that went away. Every
/// message is applied once, in its key's order, without a dead letter,
/// and the second host carries what came after.
#[tokio::test]
async fn a_pool_over_several_hosts_carries_the_inbox_to_the_next_host() {
    use outbox_postgres::PgHosts;
    use outbox_testkit::proxy::TcpProxy;
    let h = Pg::new().await;
    let upstream: std::net::SocketAddr = {
        let hosts = PgHosts::parse(&support::database_url()).unwrap();
        let host = hosts
            .hosts()
            .next()
            .unwrap()
            .replace("localhost", "127.0.0.1");
        host.parse().expect("DATABASE_URL's host as ip:port")
    };
    let (first, second) = (
        TcpProxy::start(upstream).await,
        TcpProxy::start(upstream).await,
    );
    let url = support::database_url();
    let (scheme, rest) = url.split_once("://").unwrap();
    let (userinfo, after) = rest.rsplit_once('@').unwrap_or(("", rest));
    let path = after[after.find('/').unwrap()..].split('?').next().unwrap();
    let at = if userinfo.is_empty() { "" } else { "@" };
    let url = format!(
        "{scheme}://{userinfo}{at}{},{}{path}?target_session_attrs=read-write",
        first.addr(),
        second.addr()
    );
    let pool = PgHosts::parse(&url)
        .unwrap()
        .connect_pool(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(8)
                .acquire_timeout(Duration::from_secs(2)),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let store = PgInbox::new(pool.clone(), "billing")
        .unwrap()
        .with_schema(h.schema.clone())
        .unwrap();
    let broker = MemoryBroker::default();
    let script = Script::default();
    let inbox = Inbox::new(store, h.handler(script.clone())).with_options(fast_retry());
    let run = Running::start(inbox, &broker);
    let mut sent: HashMap<String, Vec<EventId>> = HashMap::new();
    let mut push = |n: usize| {
        for i in 0..n {
            let key = format!("k{}", i % 11);
            let e = event(&key, "ok");
            sent.entry(key).or_default().push(e.id);
            broker.push_event(&e);
        }
    };
    push(200);
    until("the first messages handled", || async {
        h.effects().await.len() >= 200
    })
    .await;
    first.refuse();
    push(200);
    until("all handled", || async { h.effects().await.len() >= 400 }).await;
    until("all acked", || async { broker.acked().len() == 400 }).await;
    let counts = run.stop().await;
    pool.close().await;
    let effects = h.effects().await;
    assert_eq!(effects.len(), 400, "each once");
    assert_eq!(
        per_key(&effects),
        sent,
        "per-key order kept across the move"
    );
    assert_eq!(counts.dead, 0, "{counts:?}");
}
