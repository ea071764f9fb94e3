//! The publisher conformance suite: every broker [`Sink`] (NATS, AMQP,
//! Kafka) must pass the same cases against the real broker.
//!
//! A publisher crate implements [`PublisherHarness`] in its test file and
//! invokes [`publisher_conformance_tests!`](crate::publisher_conformance_tests);
//! each case becomes its own `#[test]` named `publisher_conformance::<case>`.
//!
//! Cases:
//! - `batch_is_delivered_and_consumed_back_intact`: payload bytes, headers,
//!   event id, key, event type and per-key order as a consumer sees them;
//! - `unknown_destination_is_a_permanent_unroutable_failure`;
//! - `oversized_message_is_a_permanent_too_large_failure`;
//! - `unreachable_broker_gives_unavailable_outcomes_then_delivers`: a
//!   [`TcpProxy`] between publisher and broker is cut, then restored; while
//!   it is cut every outcome is the sink's failure
//!   ([`FailureKind::Unavailable`](outbox_core::FailureKind)), never the
//!   event's;
//! - `broker_never_reachable_every_outcome_is_unavailable`: a publisher
//!   pointed where nothing listens reports every event as
//!   sink-unavailable, none as an event failure.
//!
//! Connection lost or refused, no acknowledgement in time, broker
//! unavailable, producer fenced: the sink's failure, nobody's attempt.
//! Unroutable, too large, invalid, nack / rejected: the event's failure,
//! retryable or permanent.

use crate::broker::Received;
use crate::proxy::TcpProxy;
pub mod wire;

use outbox_core::{ErrorCode, Event, EventId, Outcome, Sink};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a publisher crate provides to run the suite against its real broker.
/// One harness value is built per test case and owns a fresh destination
/// (stream, exchange + queue, topic) that no other test uses.
pub trait PublisherHarness: Send + Sync + 'static {
    /// The publisher under test.
    type Sink: Sink;

    /// A topic whose events end up in this harness's destination.
    fn topic(&self) -> String;

    /// A topic that routes nowhere (no stream / no bound queue / ...): the
    /// sink must report a permanent `PUBLISH_UNROUTABLE` for it.
    fn unknown_topic(&self) -> String;

    /// The largest payload the sink accepts for [`Self::topic`]; the suite
    /// expects a permanent `PUBLISH_TOO_LARGE` for this size + 1 and a
    /// delivery for half of it.
    fn max_payload_bytes(&self) -> usize;

    /// The broker's TCP address (where a [`TcpProxy`] forwards to).
    fn broker_addr(&self) -> SocketAddr;

    /// A sink connected straight to the broker.
    fn sink(&self) -> impl Future<Output = Self::Sink> + Send;

    /// A sink whose connection goes to `addr` (a proxy) instead of the broker.
    fn sink_via(&self, addr: SocketAddr) -> impl Future<Output = Self::Sink> + Send;

    /// A sink configured for `addr`, where nothing listens, built without
    /// connecting (the publisher's lazy constructor), with short timeouts.
    fn sink_unreachable(&self, addr: SocketAddr) -> impl Future<Output = Self::Sink> + Send;

    /// The next `n` messages of the destination, in broker order, read with
    /// the broker's own consumer API. Panics with a clear message when they
    /// do not arrive within a generous time.
    fn consume(&self, n: usize) -> impl Future<Output = Vec<Received>> + Send;

    /// Deletes the destination. Called after every case, also a failed one.
    fn cleanup(&self) -> impl Future<Output = ()> + Send;
}

/// Expands to one `#[test]` per publisher conformance case, in a module
/// `publisher_conformance`, each on a fresh multi-thread tokio runtime with a
/// fresh harness built by `$harness` (an expression that may `.await`; items
/// of the invoking module are in scope). The harness's `cleanup` runs after
/// each case, whether it passed or not.
#[macro_export]
macro_rules! publisher_conformance_tests {
    ($harness:expr) => {
        $crate::__publisher_conformance_cases!($harness;
            batch_is_delivered_and_consumed_back_intact,
            unknown_destination_is_a_permanent_unroutable_failure,
            oversized_message_is_a_permanent_too_large_failure,
            unreachable_broker_gives_unavailable_outcomes_then_delivers,
            broker_never_reachable_every_outcome_is_unavailable,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __publisher_conformance_cases {
    ($harness:expr; $($case:ident),* $(,)?) => {
        mod publisher_conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $case() {
                    $crate::__private::block_on(async {
                        let harness = ::std::sync::Arc::new($harness);
                        $crate::publisher::run_case(harness, |h| async move {
                            $crate::publisher::cases::$case(&*h).await
                        })
                        .await;
                    });
                }
            )*
        }
    };
}

/// Runs one case as a task, then cleans up, then re-raises the case's panic.
#[doc(hidden)]
pub async fn run_case<H, F, Fut>(harness: Arc<H>, case: F)
where
    H: PublisherHarness,
    F: FnOnce(Arc<H>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let result = tokio::spawn(case(harness.clone())).await;
    harness.cleanup().await;
    if let Err(e) = result {
        match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("conformance case did not finish: {e}"),
        }
    }
}

/// A stored-looking event (as a relay would claim it) for `topic`.
pub fn event(topic: &str, key: Option<&str>, payload: Vec<u8>) -> Event {
    let now = chrono::Utc::now();
    Event {
        id: EventId::new(),
        key: key.map(str::to_owned),
        event_type: "conformance.event".to_owned(),
        topic: topic.to_owned(),
        payload,
        headers: BTreeMap::new(),
        created_at: now,
        attempts: 1,
        next_attempt_at: now,
        last_error: None,
    }
}

/// Asserts an event-level failure (an attempt of the event) with `code`.
fn assert_failed(outcome: &Outcome, code: &ErrorCode, retryable: bool, what: &str) {
    match outcome {
        Outcome::Failed(e) => {
            assert_eq!(e.code(), code, "{what}: wrong code ({e})");
            assert_eq!(
                e.is_retryable(),
                retryable,
                "{what}: expected retryable = {retryable}, got {e}"
            );
            assert!(
                !e.is_sink_unavailable(),
                "{what}: an event failure, not the sink's: {e}"
            );
        }
        other => panic!("{what}: expected {code} failure, got {other:?}"),
    }
}

/// Asserts a sink-level failure: nobody's attempt.
pub fn assert_unavailable(outcome: &Outcome, what: &str) {
    match outcome {
        Outcome::Failed(e) => assert!(
            e.is_sink_unavailable(),
            "{what}: expected the sink's failure (Unavailable), got the event's: {e}"
        ),
        other => panic!("{what}: expected an Unavailable failure, got {other:?}"),
    }
}

fn ids(messages: &[Received]) -> Vec<Option<EventId>> {
    messages.iter().map(Received::event_id).collect()
}

/// The cases. Each takes a fresh harness.
pub mod cases {
    use super::*;

    /// Publishes a mixed batch (three keys interleaved, keyless events,
    /// binary payloads, trace headers) and reads it back.
    pub async fn batch_is_delivered_and_consumed_back_intact<H: PublisherHarness>(h: &H) {
        let sink = h.sink().await;
        assert!(
            sink.deliver(&[]).await.is_empty(),
            "empty batch, no outcomes"
        );

        let topic = h.topic();
        let keys = ["key-a", "key-b", "key-c"];
        let mut events = Vec::new();
        for i in 0..30u8 {
            let key = if i % 10 == 9 {
                None
            } else {
                Some(keys[usize::from(i) % 3])
            };
            let mut payload = format!("payload-{i}:").into_bytes();
            payload.extend_from_slice(&[0, 255, 128, i, b'\n', b'\r']);
            let mut e = event(&topic, key, payload);
            e.event_type = format!("conformance.type{}", i % 4);
            e.headers.insert(
                "traceparent".into(),
                format!(
                    "00-0af7651916cd43dd8448eb211c80319c-{:016x}-01",
                    u64::from(i) + 1
                ),
            );
            e.headers.insert("tracestate".into(), "vendor=value".into());
            e.headers.insert("x-tenant".into(), format!("tenant-{i}"));
            if i % 2 == 0 {
                e.headers
                    .insert("content-type".into(), "application/x-conformance".into());
            }
            events.push(e);
        }

        let outcomes = sink.deliver(&events).await;
        assert_eq!(outcomes.len(), events.len(), "one outcome per event");
        for (e, o) in events.iter().zip(&outcomes) {
            assert_eq!(o, &Outcome::Delivered, "event {} not delivered", e.id);
        }

        let got = h.consume(events.len()).await;
        assert_eq!(got.len(), events.len());
        let by_id: HashMap<EventId, &Received> = got
            .iter()
            .map(|m| (m.event_id().expect("message carries the event id"), m))
            .collect();
        assert_eq!(
            by_id.len(),
            events.len(),
            "each event exactly once: {:?}",
            ids(&got)
        );
        for e in &events {
            let m = by_id
                .get(&e.id)
                .unwrap_or_else(|| panic!("event {} not received", e.id));
            assert_eq!(m.payload, e.payload, "payload bytes of {}", e.id);
            assert_eq!(m.event_id_header, Some(e.id), "Outbox-Event-Id of {}", e.id);
            assert_eq!(m.key.as_deref(), e.key.as_deref(), "key of {}", e.id);
            assert_eq!(m.event_type.as_deref(), Some(e.event_type.as_str()));
            for (name, value) in &e.headers {
                assert_eq!(
                    m.headers.get(name),
                    Some(value),
                    "header {name} of {} (got {:?})",
                    e.id,
                    m.headers
                );
            }
        }
        for key in keys {
            let sent: Vec<EventId> = events
                .iter()
                .filter(|e| e.key.as_deref() == Some(key))
                .map(|e| e.id)
                .collect();
            let received: Vec<EventId> = got
                .iter()
                .filter(|m| m.key.as_deref() == Some(key))
                .filter_map(Received::event_id)
                .collect();
            assert_eq!(received, sent, "order of key {key}");
        }
    }

    /// An event for a destination nothing is bound to fails permanently with
    /// `PUBLISH_UNROUTABLE`; its neighbours in the batch are delivered.
    pub async fn unknown_destination_is_a_permanent_unroutable_failure<H: PublisherHarness>(h: &H) {
        let sink = h.sink().await;
        let before = event(&h.topic(), Some("k"), b"before".to_vec());
        let lost = event(&h.unknown_topic(), Some("k"), b"nowhere".to_vec());
        let after = event(&h.topic(), Some("k"), b"after".to_vec());
        let outcomes = sink.deliver(&[before.clone(), lost, after.clone()]).await;
        assert_eq!(outcomes.len(), 3);
        assert_eq!(outcomes[0], Outcome::Delivered);
        assert_failed(
            &outcomes[1],
            &ErrorCode::PUBLISH_UNROUTABLE,
            false,
            "unknown destination",
        );
        assert_eq!(outcomes[2], Outcome::Delivered);
        // A single unroutable event on its own, too.
        let alone = event(&h.unknown_topic(), None, b"alone".to_vec());
        let o = sink.deliver(&[alone]).await;
        assert_failed(&o[0], &ErrorCode::PUBLISH_UNROUTABLE, false, "alone");

        let got = h.consume(2).await;
        assert_eq!(ids(&got), vec![Some(before.id), Some(after.id)]);
        assert_eq!(got[1].payload, b"after");
    }

    /// A payload one byte above the limit fails permanently with
    /// `PUBLISH_TOO_LARGE`; a large one within it is delivered intact.
    pub async fn oversized_message_is_a_permanent_too_large_failure<H: PublisherHarness>(h: &H) {
        let sink = h.sink().await;
        let max = h.max_payload_bytes();
        let big = event(&h.topic(), Some("k"), vec![7u8; max + 1]);
        let half: Vec<u8> = (0..max / 2).map(|i| (i % 251) as u8).collect();
        let fits = event(&h.topic(), Some("k"), half);
        let small = event(&h.topic(), Some("k"), b"small".to_vec());
        let outcomes = sink.deliver(&[big, fits.clone(), small.clone()]).await;
        assert_eq!(outcomes.len(), 3);
        assert_failed(
            &outcomes[0],
            &ErrorCode::PUBLISH_TOO_LARGE,
            false,
            "oversized",
        );
        assert_eq!(outcomes[1], Outcome::Delivered, "half the limit fits");
        assert_eq!(outcomes[2], Outcome::Delivered, "the sink still works");

        let got = h.consume(2).await;
        assert_eq!(ids(&got), vec![Some(fits.id), Some(small.id)]);
        assert!(got[0].payload == fits.payload, "large payload intact");
    }

    /// While the broker is unreachable nothing is reported `Delivered` and
    /// every failure is the sink's (Unavailable: no attempt counted); once
    /// it is back, the same events are delivered.
    pub async fn unreachable_broker_gives_unavailable_outcomes_then_delivers<
        H: PublisherHarness,
    >(
        h: &H,
    ) {
        let proxy = TcpProxy::start(h.broker_addr()).await;
        let sink = h.sink_via(proxy.addr()).await;
        let topic = h.topic();
        let first: Vec<Event> = (0..3)
            .map(|i| event(&topic, Some("k"), format!("first-{i}").into_bytes()))
            .collect();
        let outcomes = sink.deliver(&first).await;
        assert!(
            outcomes.iter().all(Outcome::is_delivered),
            "through the proxy: {outcomes:?}"
        );

        proxy.cut();
        let second: Vec<Event> = (0..5)
            .map(|i| event(&topic, Some("k"), format!("second-{i}").into_bytes()))
            .collect();
        for round in 0..2 {
            let outcomes = sink.deliver(&second).await;
            assert_eq!(outcomes.len(), second.len());
            for o in &outcomes {
                assert_unavailable(o, &format!("round {round} while the broker is cut off"));
            }
        }

        proxy.restore();
        let mut pending = second.clone();
        let deadline = Instant::now() + Duration::from_secs(90);
        while !pending.is_empty() {
            assert!(
                Instant::now() < deadline,
                "still not delivered after the broker came back: {} events",
                pending.len()
            );
            let outcomes = sink.deliver(&pending).await;
            let mut still = Vec::new();
            for (e, o) in pending.into_iter().zip(outcomes) {
                if !o.is_delivered() {
                    assert_unavailable(&o, "after restore");
                    still.push(e);
                }
            }
            pending = still;
            if !pending.is_empty() {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }

        // Every event arrives; duplicates (maybe-delivered during the cut)
        // are allowed, they carry the same event id.
        let wanted: HashSet<EventId> = first.iter().chain(&second).map(|e| e.id).collect();
        let mut seen = HashSet::new();
        let mut read = 0;
        while seen.len() < wanted.len() {
            assert!(
                read < wanted.len() * 3,
                "too many messages without seeing every event"
            );
            let m = h.consume(1).await.remove(0);
            read += 1;
            let id = m.event_id().expect("event id");
            assert!(wanted.contains(&id), "unexpected message {id}");
            seen.insert(id);
        }
    }

    /// A publisher whose broker was never reachable (connection refused)
    /// reports every event of a batch, of any destination, as the sink's
    /// failure: not one of them is charged an attempt.
    pub async fn broker_never_reachable_every_outcome_is_unavailable<H: PublisherHarness>(h: &H) {
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr")
        };
        let sink = h.sink_unreachable(closed).await;
        let events = vec![
            event(&h.topic(), Some("k"), b"a".to_vec()),
            event(&h.unknown_topic(), Some("k"), b"b".to_vec()),
            event(&h.topic(), None, vec![0u8; 64]),
        ];
        for round in 0..2 {
            let outcomes = sink.deliver(&events).await;
            assert_eq!(outcomes.len(), events.len(), "one outcome per event");
            for (i, o) in outcomes.iter().enumerate() {
                assert_unavailable(o, &format!("round {round}, event #{i}"));
            }
        }
    }
}
