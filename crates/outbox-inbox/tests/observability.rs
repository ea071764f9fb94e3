//! What the inbox reports (features `sqlite` and `otel`): its metrics
//! through the `metrics` facade, and a handler span that continues the
//! producer's trace from the message's `traceparent`.
#![cfg(all(feature = "sqlite", feature = "otel"))]
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod support;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use opentelemetry::trace::{SpanId, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use outbox_core::DeadHeadPolicy;
use outbox_inbox::{metrics as m, Inbox, InboxOptions, SqliteInbox};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::{event, MemoryBroker, Script, SqliteEffects};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

async fn sqlite() -> (sqlx::SqlitePool, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let opts = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("c.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(opts)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE effects (seq INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL, key TEXT)")
        .execute(&pool)
        .await
        .unwrap();
    (pool, dir)
}

/// The producer's span context in the test events' `traceparent`.
const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const PARENT: &str = "b7ad6b7169203331";

#[test]
fn counters_gauges_and_a_span_continuing_the_producers_trace() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();

    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("inbox-test"));
    let _default = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));

    // One thread: the inbox's tasks see this thread's subscriber.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let seen: Arc<Mutex<Vec<TraceId>>> = Arc::default();
    rt.block_on(async {
        let (pool, _dir) = sqlite().await;
        let broker = MemoryBroker::default();
        let script = Script::default();
        let handler = Traced {
            inner: SqliteEffects { script },
            seen: seen.clone(),
        };
        let inbox = Inbox::new(SqliteInbox::new(pool, "metrics").unwrap(), handler).with_options(
            InboxOptions::default()
                .with_dead_head_policy(DeadHeadPolicy::Block)
                .with_recv_wait(Duration::from_millis(20)),
        );
        let ok1 = event("a", "ok");
        let ok2 = event("b", "ok");
        let dead = event("c", "dead");
        for e in [&ok1, &ok2, &ok1, &dead] {
            broker.push_event(e);
        }
        let counts = inbox
            .run_until_idle(broker.source(), Duration::from_millis(300))
            .await
            .unwrap();
        assert_eq!((counts.handled, counts.duplicates, counts.dead), (2, 1, 1));
    });

    let snapshot = snapshotter.snapshot().into_vec();
    let value = |name: &str, label: Option<(&str, &str)>| {
        snapshot
            .iter()
            .find(|(k, _, _, _)| {
                k.key().name() == name
                    && k.key()
                        .labels()
                        .any(|l| l.key() == "consumer" && l.value() == "metrics")
                    && label.is_none_or(|(lk, lv)| {
                        k.key().labels().any(|l| l.key() == lk && l.value() == lv)
                    })
            })
            .map(|(_, _, _, v)| v)
    };
    assert_eq!(value(m::HANDLED, None), Some(&DebugValue::Counter(2)));
    assert_eq!(value(m::DUPLICATES, None), Some(&DebugValue::Counter(1)));
    assert_eq!(
        value(m::DEAD, Some(("code", "HANDLER_PERMANENT_FAILURE"))),
        Some(&DebugValue::Counter(1))
    );
    assert!(matches!(
        value(m::LAG_SECONDS, None),
        Some(DebugValue::Gauge(_))
    ));
    assert!(matches!(
        value(m::BATCH_SECONDS, None),
        Some(DebugValue::Histogram(_))
    ));

    // The handler ran in the producer's trace; the exported span's parent
    // is the producer's span.
    let trace = TraceId::from_hex(TRACE).unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(!seen.is_empty());
    assert!(seen.iter().all(|t| *t == trace), "{seen:?}");
    let spans = exporter.get_finished_spans().unwrap();
    let handle = spans
        .iter()
        .find(|s| s.name == "inbox.handle")
        .expect("an inbox.handle span");
    assert_eq!(handle.span_context.trace_id(), trace);
    assert_eq!(handle.parent_span_id, SpanId::from_hex(PARENT).unwrap());
}

/// The effects handler, recording the trace its span is in.
struct Traced {
    inner: SqliteEffects,
    seen: Arc<Mutex<Vec<TraceId>>>,
}

impl outbox_inbox::Handler<sqlx::Sqlite> for Traced {
    fn handle<'a>(
        &'a self,
        m: &'a outbox_core::InboundMessage,
        tx: &'a mut sqlx::Transaction<'static, sqlx::Sqlite>,
    ) -> futures::future::BoxFuture<'a, Result<(), outbox_core::HandlerError>> {
        let trace = tracing::Span::current()
            .context()
            .span()
            .span_context()
            .trace_id();
        self.seen.lock().unwrap().push(trace);
        self.inner.handle(m, tx)
    }
}
