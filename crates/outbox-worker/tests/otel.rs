//! W3C trace context end to end (features `otel` and `sqlite`): an
//! application enqueues inside its `request` span into a real SQLite outbox,
//! the real relay delivers to in-process handlers, and the spans are
//! collected by the OpenTelemetry SDK's in-memory exporter.
//!
//! - the stored event carries the request span's `traceparent`;
//! - the handler's `Span::current()` is in the request's trace, and the
//!   exported `outbox_deliver` span is a child of the request span;
//! - the batch span links to the producer's span;
//! - a caller's own `traceparent` wins; an event enqueued outside any span
//!   has no trace header and its delivery span stays in the relay's trace.
//!
//! The subscriber is this test's thread default and the runtime is
//! single-threaded, so the handler tasks see it too.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_worker::core::headers::{TRACEPARENT, TRACESTATE};
use outbox_worker::core::{trace, EventId, NewEvent};
use outbox_worker::sqlite::{SqliteStore, SqliteStoreOptions};
use outbox_worker::{HandlerRegistry, Relay, RelayOptions};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

/// What a handler saw: the event's headers and its current span's context.
type Seen = Arc<Mutex<HashMap<EventId, (BTreeMap<String, String>, SpanContext)>>>;

const CALLERS: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test]
async fn a_handler_continues_the_trace_of_the_request_that_enqueued_the_event() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-otel-test"));
    let _default = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));

    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let store = SqliteStore::connect(SqliteStoreOptions::new(url))
        .await
        .unwrap();
    store.migrate().await.unwrap();

    // The application: one transaction inside its request span.
    let request = tracing::info_span!("request");
    let (request_cx, traced, explicit) = async {
        let mut tx = store.pool().begin().await.unwrap();
        let traced = store
            .outbox()
            .enqueue(
                &mut tx,
                NewEvent::new("order.created", "orders", b"{}".to_vec()).with_key("a"),
            )
            .await
            .unwrap();
        let explicit = store
            .outbox()
            .enqueue(
                &mut tx,
                NewEvent::new("order.created", "orders", b"{}".to_vec())
                    .with_key("b")
                    .with_header(TRACEPARENT, CALLERS),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let cx = tracing::Span::current()
            .context()
            .span()
            .span_context()
            .clone();
        (cx, traced, explicit)
    }
    .instrument(request.clone())
    .await;
    drop(request);
    assert!(request_cx.is_valid());
    // A background job outside any span.
    let untraced = {
        let mut tx = store.pool().begin().await.unwrap();
        let id = store
            .outbox()
            .enqueue(
                &mut tx,
                NewEvent::new("order.created", "orders", b"{}".to_vec()).with_key("c"),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        id
    };

    let seen: Seen = Arc::default();
    let handlers = {
        let seen = Arc::clone(&seen);
        HandlerRegistry::new().with_handler("order.created", move |event| {
            let seen = Arc::clone(&seen);
            async move {
                let cx = tracing::Span::current().context();
                let sc = cx.span().span_context().clone();
                seen.lock().unwrap().insert(event.id, (event.headers, sc));
                Ok(())
            }
        })
    };
    let summary = Relay::new(store, handlers, RelayOptions::default())
        .unwrap()
        .run_until_idle()
        .await;
    assert_eq!(summary.delivered, 3, "{summary:?}");

    let seen = seen.lock().unwrap().clone();
    // Captured at enqueue: the request span's traceparent, nothing else.
    let (headers, handler_sc) = &seen[&traced];
    assert_eq!(
        headers.get(TRACEPARENT),
        trace::traceparent(&request_cx).as_ref()
    );
    assert!(!headers.contains_key(TRACESTATE));
    // The handler runs in the request's trace.
    assert_eq!(handler_sc.trace_id(), request_cx.trace_id());
    assert_ne!(handler_sc.span_id(), request_cx.span_id());
    // The caller's header won, and the handler continues that trace.
    let (headers, explicit_sc) = &seen[&explicit];
    assert_eq!(headers.get(TRACEPARENT).map(String::as_str), Some(CALLERS));
    assert_eq!(
        explicit_sc.trace_id(),
        TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
    );
    // No span at enqueue: no header, and the delivery is the relay's own.
    let (headers, untraced_sc) = &seen[&untraced];
    assert!(!headers.contains_key(TRACEPARENT), "{headers:?}");
    assert!(untraced_sc.is_valid());
    assert_ne!(untraced_sc.trace_id(), request_cx.trace_id());

    // The exported spans.
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let named =
        |name: &str| -> Vec<&SpanData> { spans.iter().filter(|s| s.name == name).collect() };
    let by_span = |sc: &SpanContext| -> &SpanData {
        spans
            .iter()
            .find(|s| s.span_context.span_id() == sc.span_id())
            .unwrap_or_else(|| panic!("span {} not exported", sc.span_id()))
    };
    assert_eq!(named("request").len(), 1);
    assert_eq!(named("outbox_deliver").len(), 3);

    let deliver = by_span(handler_sc);
    assert_eq!(deliver.name, "outbox_deliver");
    assert_eq!(deliver.span_context.trace_id(), request_cx.trace_id());
    assert_eq!(deliver.parent_span_id, request_cx.span_id());
    let deliver = by_span(explicit_sc);
    assert_eq!(
        deliver.parent_span_id,
        SpanId::from_hex("00f067aa0ba902b7").unwrap()
    );
    assert!(deliver.parent_span_is_remote);

    // The untraced event's delivery is a child of the relay's batch span,
    // and the batch spans link to the producers' spans.
    let deliver = by_span(untraced_sc);
    let batch = spans
        .iter()
        .find(|s| s.span_context.span_id() == deliver.parent_span_id)
        .expect("the untraced delivery's parent is exported");
    assert_eq!(batch.name, "outbox_batch");
    let linked: Vec<(TraceId, SpanId)> = named("outbox_batch")
        .iter()
        .flat_map(|b| b.links.iter())
        .map(|l| (l.span_context.trace_id(), l.span_context.span_id()))
        .collect();
    assert!(
        linked.contains(&(request_cx.trace_id(), request_cx.span_id())),
        "{linked:?}"
    );
    assert_eq!(linked.len(), 2, "one link per traced event: {linked:?}");
}
