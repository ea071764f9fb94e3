//! W3C trace context to the broker (feature `otel`): an application
//! enqueues in its `request` span (itself continuing a caller's trace that
//! has a `tracestate`) into a real SQLite outbox, the real relay publishes to
//! a real broker, a real consumer reads the message: it carries the same
//! `traceparent` and `tracestate` as the stored event, which are the
//! request span's (same trace id). NATS JetStream (`NATS_URL`), RabbitMQ
//! (`AMQP_URL`) and Kafka (`KAFKA_BROKERS`, Tansu: the testkit fixture
//! creates a topic of its own, reads it back with an rdkafka consumer and
//! deletes it; it fails the test naming the brokers when Kafka is not up,
//! like `e2e_kafka`).
//!
//! The OpenTelemetry subscriber is this test's thread default (the runtime is
//! single-threaded), backed by the SDK's in-memory exporter.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use outbox_core::headers::{TRACEPARENT, TRACESTATE};
use outbox_core::{trace, NewEvent, RelayId};
use outbox_testkit::amqp::AmqpFixture;
use outbox_testkit::kafka::KafkaFixture;
use outbox_testkit::nats::NatsFixture;
use outbox_tests::{unique_suffix, App, Broker, Order, SqliteApp, TxEnd, RELAY_BOUND};
use outbox_worker::{Relay, RelayOptions};
use std::collections::BTreeMap;
use std::time::Duration;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

/// The trace the application's request belongs to (the specification's
/// example), with vendor entries that must travel too.
const UPSTREAM: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const UPSTREAM_STATE: &str = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE";

#[tokio::test]
async fn sqlite_to_nats_carries_the_trace_context() {
    broker_carries_the_trace_context::<NatsFixture>().await;
}

#[tokio::test]
async fn sqlite_to_amqp_carries_the_trace_context() {
    broker_carries_the_trace_context::<AmqpFixture>().await;
}

#[tokio::test]
async fn sqlite_to_kafka_carries_the_trace_context() {
    broker_carries_the_trace_context::<KafkaFixture>().await;
}

async fn broker_carries_the_trace_context<B: Broker>() {
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(InMemorySpanExporter::default())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-e2e-otel"));
    let _default = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));

    let app = SqliteApp::start().await;
    let broker = B::start().await;
    let what = format!("sqlite -> relay -> {}", B::NAME);

    // The application's request, continuing its caller's trace.
    let request = tracing::info_span!("request");
    let upstream = BTreeMap::from([
        (TRACEPARENT.to_owned(), UPSTREAM.to_owned()),
        (TRACESTATE.to_owned(), UPSTREAM_STATE.to_owned()),
    ]);
    assert!(trace::continue_trace(&request, &upstream).is_some());
    let order = Order {
        id: 1,
        customer: "ada".into(),
        total_cents: 4200,
    };
    let event =
        NewEvent::new("order.created", broker.topic(), b"{\"order\":1}".to_vec()).with_key("ada");
    let (ids, request_sc) = async {
        let ids = app.write_order(&order, vec![event], TxEnd::Commit).await;
        let sc = tracing::Span::current()
            .context()
            .span()
            .span_context()
            .clone();
        (ids, sc)
    }
    .instrument(request)
    .await;
    assert_eq!(
        request_sc.trace_id().to_string(),
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );

    // What the outbox row holds.
    let (stored_parent, stored_state): (Option<String>, Option<String>) = sqlx::query_as(
        "SELECT json_extract(headers, '$.traceparent'), json_extract(headers, '$.tracestate') \
         FROM outbox_events",
    )
    .fetch_one(app.store().pool())
    .await
    .unwrap();
    assert_eq!(
        stored_parent,
        trace::traceparent(&request_sc),
        "{what}: enqueue captured the request span"
    );
    assert_eq!(stored_state.as_deref(), Some(UPSTREAM_STATE));

    let options = RelayOptions::default()
        .with_poll_interval(Duration::from_millis(50))
        .with_relay_id(RelayId::new(format!("e2e-otel-{}", unique_suffix())));
    let relay = Relay::new(app.store(), broker.sink().await, options).unwrap();
    let summary = tokio::time::timeout(RELAY_BOUND, relay.run_until_idle())
        .await
        .unwrap_or_else(|_| panic!("{what}: the relay did not drain the outbox in time"));
    assert_eq!(summary.delivered, 1, "{what}: {summary:?}");

    let received = broker.consume(1).await;
    assert_eq!(received.len(), 1, "{what}: {received:?}");
    let m = &received[0];
    assert_eq!(m.event_id_header, Some(ids[0]));
    assert_eq!(
        m.headers.get(TRACEPARENT),
        stored_parent.as_ref(),
        "{what}: the message's traceparent is the stored event's"
    );
    assert_eq!(
        m.headers.get(TRACESTATE).map(String::as_str),
        Some(UPSTREAM_STATE)
    );
    // W3C: version-traceid-parentid-flags; the trace id is the request's.
    let message_trace_id = m
        .headers
        .get(TRACEPARENT)
        .and_then(|tp| tp.split('-').nth(1))
        .unwrap_or_else(|| panic!("{what}: no traceparent on the message: {m:?}"));
    assert_eq!(
        message_trace_id,
        request_sc.trace_id().to_string(),
        "{what}: the message belongs to the producer span's trace"
    );

    app.cleanup().await;
    broker.cleanup().await;
}
