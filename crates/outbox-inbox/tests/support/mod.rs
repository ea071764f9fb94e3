//! Test support: an in-memory [`Source`] (the consumer loop's tests; the
//! brokers have their own suite in `source_conformance.rs`), a scripted
//! handler that writes one effect row per message, and a harness per
//! consumer database.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use futures::future::BoxFuture;
use outbox_core::{BrokerMessage, Event, EventId, HandlerError, InboundMessage};
use outbox_inbox::source::{RawMessage, Received, Source, SourceError};
use outbox_inbox::Handler;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// A broker in memory: what tests push is received; acks are recorded.
#[derive(Clone, Default)]
pub struct MemoryBroker {
    queue: Arc<Mutex<VecDeque<(u64, RawMessage)>>>,
    acked: Arc<Mutex<Vec<u64>>>,
    next: Arc<Mutex<u64>>,
    notify: Arc<Notify>,
}

impl MemoryBroker {
    pub fn push(&self, raw: RawMessage) -> u64 {
        let mut n = self.next.lock().unwrap();
        *n += 1;
        self.queue.lock().unwrap().push_back((*n, raw));
        self.notify.notify_waiters();
        *n
    }

    pub fn push_event(&self, e: &Event) -> u64 {
        self.push(raw(e))
    }

    pub fn acked(&self) -> Vec<u64> {
        self.acked.lock().unwrap().clone()
    }

    pub fn source(&self) -> MemorySource {
        MemorySource(self.clone())
    }
}

pub struct MemorySource(MemoryBroker);

impl Source for MemorySource {
    type Token = u64;

    async fn recv(
        &mut self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Received<u64>>, SourceError> {
        let take = |b: &MemoryBroker| {
            let mut q = b.queue.lock().unwrap();
            let n = q.len().min(max);
            q.drain(..n)
                .map(|(token, message)| Received { message, token })
                .collect::<Vec<_>>()
        };
        let got = take(&self.0);
        if !got.is_empty() {
            return Ok(got);
        }
        let _ = tokio::time::timeout(wait, self.0.notify.notified()).await;
        Ok(take(&self.0))
    }

    async fn ack(&mut self, tokens: Vec<u64>) -> Result<(), SourceError> {
        self.0.acked.lock().unwrap().extend(tokens);
        Ok(())
    }

    async fn close(self) -> Result<(), SourceError> {
        Ok(())
    }

    fn describe(&self) -> String {
        "memory".into()
    }
}

/// The broker message of an event, as a publisher sends it (default format).
pub fn raw(e: &Event) -> RawMessage {
    raw_as(e, outbox_core::WireFormat::Headers)
}

/// The broker message of an event in wire format `format`.
pub fn raw_as(e: &Event, format: outbox_core::WireFormat) -> RawMessage {
    raw_message(e, BrokerMessage::new(e).with_format(format))
}

/// The broker message of an event as a CloudEvent in `format`, with the
/// header names of `binding`.
pub fn raw_cloudevent(
    e: &Event,
    format: outbox_core::WireFormat,
    binding: outbox_core::cloudevents::Binding,
) -> RawMessage {
    let source = outbox_core::cloudevents::Source::new("/inbox/tests").unwrap();
    let m = BrokerMessage::new(e)
        .with_format(format)
        .with_cloudevents(binding, &source);
    raw_message(e, m)
}

fn raw_message(e: &Event, m: BrokerMessage<'_>) -> RawMessage {
    RawMessage {
        headers: m
            .headers()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        body: m.body().into_owned(),
        destination: e.topic.clone(),
        timestamp: Some(e.created_at),
        redelivered: false,
        behind: None,
    }
}

/// An event of `key` whose payload tells the scripted handler what to do.
pub fn event(key: &str, payload: &str) -> Event {
    let now = chrono::Utc::now();
    Event {
        id: EventId::new(),
        key: Some(key.to_owned()),
        event_type: "order.created".into(),
        topic: "orders".into(),
        payload: payload.as_bytes().to_vec(),
        headers: [(
            "traceparent".to_owned(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
        )]
        .into(),
        created_at: now,
        attempts: 1,
        next_attempt_at: now,
        last_error: None,
    }
}

/// What the scripted handler does, by payload:
/// - `fail:N`: fails retryably the first N times it runs for that event;
/// - `dead`: fails permanently until [`Script::heal`];
/// - `panic`: panics the first time;
/// - anything else: succeeds.
///
/// Every success writes an effect row (event id, key) in the transaction.
#[derive(Clone, Default)]
pub struct Script {
    runs: Arc<Mutex<HashMap<EventId, u32>>>,
    healed: Arc<Mutex<bool>>,
}

impl Script {
    pub fn heal(&self) {
        *self.healed.lock().unwrap() = true;
    }

    pub fn runs(&self, id: EventId) -> u32 {
        self.runs.lock().unwrap().get(&id).copied().unwrap_or(0)
    }

    /// `Ok(())` to write the effect, or the scripted failure.
    pub fn decide(&self, m: &InboundMessage) -> Result<(), HandlerError> {
        let n = {
            let mut runs = self.runs.lock().unwrap();
            let n = runs.entry(m.id).or_insert(0);
            *n += 1;
            *n
        };
        let p = String::from_utf8_lossy(&m.payload).into_owned();
        if let Some(k) = p.strip_prefix("fail:") {
            let k: u32 = k.parse().unwrap();
            if n <= k {
                return Err(HandlerError::retryable(format!("scripted failure {n}")));
            }
        } else if p == "dead" && !*self.healed.lock().unwrap() {
            return Err(HandlerError::permanent("scripted permanent failure"));
        } else if p == "panic" && n == 1 {
            panic!("scripted panic");
        }
        Ok(())
    }
}

/// The effects handler on PostgreSQL: one row in `{schema}.effects`.
pub struct PgEffects {
    pub script: Script,
    pub schema: String,
}

impl Handler<sqlx::Postgres> for PgEffects {
    fn handle<'a>(
        &'a self,
        m: &'a InboundMessage,
        tx: &'a mut sqlx::Transaction<'static, sqlx::Postgres>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            self.script.decide(m)?;
            // Unnamed: the same handler runs through PgBouncer in
            // transaction mode (inbox.rs, `PgBouncer`).
            sqlx::query(&format!(
                "INSERT INTO \"{}\".effects (event_id, key) VALUES ($1, $2)",
                self.schema
            ))
            .persistent(false)
            .bind(m.id.as_uuid())
            .bind(m.key.as_deref())
            .execute(&mut **tx)
            .await?;
            Ok(())
        })
    }
}

/// The effects handler on SQLite: one row in `effects`.
pub struct SqliteEffects {
    pub script: Script,
}

impl Handler<sqlx::Sqlite> for SqliteEffects {
    fn handle<'a>(
        &'a self,
        m: &'a InboundMessage,
        tx: &'a mut sqlx::Transaction<'static, sqlx::Sqlite>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            self.script.decide(m)?;
            sqlx::query("INSERT INTO effects (event_id, key) VALUES (?, ?)")
                .bind(m.id.to_string())
                .bind(m.key.as_deref())
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    }
}

pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// `PGBOUNCER_URL`, default PgBouncer in transaction mode on the loopback
/// (`cargo xtask services` starts it).
pub fn pgbouncer_url() -> String {
    std::env::var("PGBOUNCER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432/test".to_owned())
}
