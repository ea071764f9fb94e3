//! The source conformance suite: every broker [`Source`] (NATS JetStream,
//! RabbitMQ, Kafka) passes the same cases against its real broker, with
//! messages published by that broker's real outbox publisher (the
//! `outbox-nats` / `outbox-amqp` / `outbox-kafka` [`Sink`]).
//!
//! Each broker module (behind its cargo feature) implements
//! [`SourceHarness`] over the testkit fixture (a fresh stream / queue /
//! topic per test) and invokes [`source_conformance_tests!`]; each case
//! becomes a test `<broker>::<case>`.
//!
//! What differs between brokers, and how the cases take it into account:
//! - Kafka commits one position per partition, and the NATS source of a
//!   restarted consumer reads the stream again from the durable consumer's
//!   acknowledgement floor (so that a key's order holds after a crash): an
//!   unacknowledged message comes back with every message after it,
//!   acknowledged or not (`CONTIGUOUS_REDELIVERY`); RabbitMQ redelivers
//!   exactly the unacknowledged messages.
//! - Kafka does not say whether a message is a redelivery
//!   (`REPORTS_REDELIVERY`).
//! - NATS redelivers an unacknowledged message once its `ack_wait` passed
//!   (the harness sets 2 s); RabbitMQ as soon as the connection closes;
//!   Kafka when the group's next member starts from the committed offset.
//!
//! "Nothing else comes again" is asserted on the broker's own state, never
//! by waiting for silence: nothing pending for the durable consumer
//! (JetStream consumer info), no message left in the queue (RabbitMQ), the
//! group's committed offsets at the high watermarks (Kafka).
//!
//! Wire formats (issue 43): every format a publisher can be configured
//! with (headers, envelope, CloudEvents binary and structured) arrives
//! through each real source and decodes to the published event; a
//! malformed CloudEvent, published raw with the broker's own client in that
//! broker's binding, is refused naming the missing attribute and, through a
//! running inbox with a PostgreSQL store, dead-lettered as `UNDECODABLE`
//! while the good events after it are applied.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_core::cloudevents::Binding;
use outbox_core::{DecodeError, Event, EventId, InboundMessage, Outcome, Sink, WireFormat};
use outbox_inbox::source::{Received, Source, SourceError};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a case waits for messages that must come (group joins and
/// NATS's ack_wait included).
const BOUND: Duration = Duration::from_secs(60);

/// The CloudEvents `source` every publisher of the suite states.
const CE_SOURCE: &str = "/outbox/conformance";

/// The CloudEvents `source` as the publishers' configs take it.
fn ce_source() -> outbox_core::cloudevents::Source {
    outbox_core::cloudevents::Source::new(CE_SOURCE).expect("a valid source")
}

/// A message as a foreign producer would put it on the broker, bypassing
/// the outbox publisher.
#[derive(Debug, Clone)]
pub struct RawPublish {
    /// Broker headers (AMQP: header-table entries, as long strings).
    pub headers: Vec<(String, String)>,
    /// The content type: the `content-type` header on Kafka and NATS, the
    /// `content_type` property on AMQP.
    pub content_type: Option<String>,
    /// Kafka only: the record key (the partition).
    pub key: Option<String>,
    /// The body.
    pub body: Vec<u8>,
}

/// What a broker provides to run the suite.
pub trait SourceHarness: Send + Sync + Sized + 'static {
    /// The source under test.
    type Source: Source;
    /// The publisher the events go through.
    type Sink: Sink;
    /// Whether an unacknowledged message comes back with every later one
    /// (Kafka's committed offsets).
    const CONTIGUOUS_REDELIVERY: bool;
    /// Whether the source reports redeliveries.
    const REPORTS_REDELIVERY: bool;
    /// The broker's CloudEvents binding (the prefix of the attribute
    /// headers in binary mode).
    const BINDING: Binding;

    /// A fresh destination.
    fn new() -> impl Future<Output = Self> + Send;
    /// The event topic whose events reach the destination.
    fn topic(&self) -> String;
    /// The destination a received message names (subject, routing key, topic).
    fn destination(&self) -> String;
    /// The real publisher.
    fn sink(&self) -> impl Future<Output = Self::Sink> + Send;
    /// The real publisher laying events out in `format`, with the
    /// CloudEvents source [`CE_SOURCE`].
    fn sink_with(&self, format: WireFormat) -> impl Future<Output = Self::Sink> + Send;
    /// Publishes `message` to the destination with the broker's own client
    /// (waiting for the broker's acknowledgement where it gives one).
    fn publish_raw(&self, message: RawPublish) -> impl Future<Output = ()> + Send;
    /// A source consuming as `name` (durable consumer / consumer group;
    /// RabbitMQ: the queue is the state, the name is its consumer tag).
    fn source(&self, name: &str) -> impl Future<Output = Self::Source> + Send;
    /// Builds a source for a destination that does not exist and returns
    /// the first error it gives (building or receiving).
    fn misconfigured(&self) -> impl Future<Output = SourceError> + Send;
    /// `Debug` of the source's config with `password` in its URL / properties.
    fn config_debug_with_password(&self, password: &str) -> String;
    /// The broker's address, when a source can be pointed at a TCP proxy in
    /// front of it (`None` for Kafka: its clients connect to the brokers
    /// the cluster advertises, not to the bootstrap address).
    fn broker_addr(&self) -> Option<SocketAddr>;
    /// A source consuming as `name` whose connection goes to `addr`.
    fn source_via(&self, addr: SocketAddr, name: &str)
        -> impl Future<Output = Self::Source> + Send;
    /// How many messages consumer `name` would still get (its source closed).
    fn remaining(&self, name: &str) -> impl Future<Output = u64> + Send;
    /// Deletes the destination.
    fn cleanup(&self) -> impl Future<Output = ()> + Send;
}

/// One `#[test]` per case, in a module named `$module`.
macro_rules! source_conformance_tests {
    ($module:ident, $harness:ty) => {
        source_conformance_tests!(@cases $module, $harness;
            every_event_arrives_and_decodes_intact,
            per_key_order_is_publish_order,
            unacked_comes_again_acked_does_not,
            out_of_order_acks_redeliver_only_the_gap,
            recv_with_nothing_published_returns_empty,
            missing_destination_is_a_config_error,
            config_debug_hides_the_password,
            lost_connection_is_unavailable_then_recovers,
            every_wire_format_arrives_and_decodes_intact,
            malformed_cloudevent_is_refused_naming_the_attribute,
            malformed_cloudevent_is_dead_lettered_and_the_next_applied,
        );
    };
    (@cases $module:ident, $harness:ty; $($case:ident),* $(,)?) => {
        mod $module {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    run_case::<$harness, _, _>(|h| async move { cases::$case(&*h).await }).await;
                }
            )*
        }
    };
}

/// Runs a case as a task, cleans up, then re-raises the case's panic.
async fn run_case<H, F, Fut>(case: F)
where
    H: SourceHarness,
    F: FnOnce(Arc<H>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let h = Arc::new(H::new().await);
    let result = tokio::spawn(case(h.clone())).await;
    h.cleanup().await;
    if let Err(e) = result {
        match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("case did not finish: {e}"),
        }
    }
}

/// An event as a relay would claim it.
fn event(topic: &str, key: Option<&str>, payload: Vec<u8>) -> Event {
    outbox_testkit::publisher::event(topic, key, payload)
}

/// Publishes `events` with the real publisher, one call per round so that
/// per-key order is the order given (the relay hands a sink at most one
/// event of a key per call).
async fn publish<H: SourceHarness>(h: &H, events: &[Event]) {
    publish_via(&h.sink().await, events).await;
}

/// [`publish`] through `sink`.
async fn publish_via<S: Sink>(sink: &S, events: &[Event]) {
    let mut rounds: Vec<Vec<Event>> = Vec::new();
    let mut seen: HashMap<Option<String>, usize> = HashMap::new();
    for e in events {
        let round = match &e.key {
            Some(_) => {
                let n = seen.entry(e.key.clone()).or_insert(0);
                *n += 1;
                *n - 1
            }
            None => 0,
        };
        if rounds.len() <= round {
            rounds.resize(round + 1, Vec::new());
        }
        rounds[round].push(e.clone());
    }
    for round in rounds {
        let outcomes = sink.deliver(&round).await;
        assert_eq!(outcomes.len(), round.len());
        for (e, o) in round.iter().zip(&outcomes) {
            assert_eq!(o, &Outcome::Delivered, "event {} not published", e.id);
        }
    }
}

/// Decodes a received message as the inbox consumer does.
fn try_decode<T>(r: &Received<T>) -> Result<InboundMessage, DecodeError> {
    let raw = &r.message;
    InboundMessage::decode(
        raw.header_pairs(),
        &raw.body,
        &raw.destination,
        raw.timestamp,
    )
}

fn decode<T>(r: &Received<T>) -> InboundMessage {
    try_decode(r).unwrap_or_else(|e| panic!("{:?} does not decode: {e}", r.message))
}

/// The header naming which malformed message a message is.
const PROBE: &str = "x-probe";

/// The value of header `name` (any letter case) of a received message.
fn header<'m>(raw: &'m outbox_inbox::source::RawMessage, name: &str) -> Option<&'m str> {
    raw.headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Malformed CloudEvents as another producer could send them: in binary
/// mode in the broker's binding, one per required attribute, each lacking
/// that attribute; and one in structured mode lacking `source`. Each comes
/// with its probe (the [`PROBE`] header's value) and the attribute a
/// decoder must name.
fn malformed<H: SourceHarness>(key: &str) -> Vec<(String, &'static str, RawPublish)> {
    let prefix = H::BINDING.prefix();
    let body = b"malformed:\x00\xff\x80".to_vec();
    let mut out = Vec::new();
    for missing in ["specversion", "id", "source", "type"] {
        let probe = format!("binary-without-{missing}");
        let id = EventId::new().to_string();
        let time = chrono::Utc::now().to_rfc3339();
        let attributes = [
            ("specversion", "1.0"),
            ("id", id.as_str()),
            ("source", CE_SOURCE),
            ("type", "conformance.malformed"),
            ("time", time.as_str()),
            ("subject", key),
            ("partitionkey", key),
        ];
        let mut headers: Vec<(String, String)> = attributes
            .iter()
            .filter(|(name, _)| *name != missing)
            .map(|(name, value)| (format!("{prefix}{name}"), (*value).to_owned()))
            .collect();
        headers.push((PROBE.to_owned(), probe.clone()));
        out.push((
            probe,
            missing,
            RawPublish {
                headers,
                content_type: Some("application/octet-stream".to_owned()),
                key: Some(key.to_owned()),
                body: body.clone(),
            },
        ));
    }
    let structured = serde_json::json!({
        "specversion": "1.0",
        "id": EventId::new().to_string(),
        "type": "conformance.malformed",
        "partitionkey": key,
        "datacontenttype": "application/json",
        "data": {"n": 1},
    });
    let probe = "structured-without-source".to_owned();
    out.push((
        probe.clone(),
        "source",
        RawPublish {
            headers: vec![(PROBE.to_owned(), probe)],
            content_type: Some(outbox_core::cloudevents::STRUCTURED_CONTENT_TYPE.to_owned()),
            key: Some(key.to_owned()),
            body: serde_json::to_vec(&structured).expect("JSON"),
        },
    ));
    out
}

/// Receives until `n` messages arrived (panics naming what did arrive when
/// they do not within [`BOUND`]).
async fn recv_n<S: Source>(source: &mut S, n: usize) -> Vec<Received<S::Token>> {
    let deadline = Instant::now() + BOUND;
    let mut out: Vec<Received<S::Token>> = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} messages arrived from {} within {BOUND:?}",
            out.len(),
            source.describe()
        );
        match source.recv(n - out.len(), Duration::from_secs(1)).await {
            Ok(batch) => out.extend(batch),
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => panic!("{}: {e}", source.describe()),
        }
    }
    out
}

/// Receives until a message of event `id` arrived; returns everything received.
async fn recv_until<S: Source>(source: &mut S, id: EventId) -> Vec<Received<S::Token>> {
    let deadline = Instant::now() + BOUND;
    let mut out: Vec<Received<S::Token>> = Vec::new();
    while !out.iter().any(|r| decode(r).id == id) {
        assert!(
            Instant::now() < deadline,
            "event {id} did not come again from {} within {BOUND:?} (got {:?})",
            source.describe(),
            out.iter().map(|r| decode(r).id).collect::<Vec<_>>()
        );
        match source.recv(100, Duration::from_secs(1)).await {
            Ok(batch) => out.extend(batch),
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => panic!("{}: {e}", source.describe()),
        }
    }
    out
}

async fn ack_all<S: Source>(source: &mut S, received: Vec<Received<S::Token>>) {
    source
        .ack(received.into_iter().map(|r| r.token).collect())
        .await
        .expect("ack");
}

/// Polls the broker's state until consumer `name` has nothing left to get.
async fn assert_nothing_left<H: SourceHarness>(h: &H, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = h.remaining(name).await;
        if left == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "consumer {name} still has {left} message(s) to get"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn ids<T>(received: &[Received<T>]) -> Vec<EventId> {
    received.iter().map(|r| decode(r).id).collect()
}

fn consumer_name() -> String {
    format!("inbox-{}", uuid::Uuid::new_v4().simple())
}

/// The cases; each takes a fresh harness.
mod cases {
    use super::*;

    /// Mixed keys, keyless events, binary payloads, trace and own headers,
    /// content types: every event arrives once and decodes to what was
    /// published.
    pub(crate) async fn every_event_arrives_and_decodes_intact<H: SourceHarness>(h: &H) {
        let topic = h.topic();
        let keys = ["key-a", "key-b", "key-c"];
        let mut events = Vec::new();
        for i in 0..12u8 {
            let key = (i % 4 != 3).then(|| keys[usize::from(i) % 3]);
            let mut payload = format!("payload-{i}:").into_bytes();
            payload.extend_from_slice(&[0, 255, 128, i, b'\n']);
            let mut e = event(&topic, key, payload);
            e.event_type = format!("conformance.type{}", i % 3);
            e.headers.insert(
                "traceparent".into(),
                format!(
                    "00-0af7651916cd43dd8448eb211c80319c-{:016x}-01",
                    u64::from(i) + 1
                ),
            );
            e.headers.insert("x-tenant".into(), format!("tenant-{i}"));
            if i % 2 == 0 {
                e.headers
                    .insert("content-type".into(), "application/json".into());
            }
            events.push(e);
        }
        publish(h, &events).await;

        let name = consumer_name();
        let mut source = h.source(&name).await;
        let got = recv_n(&mut source, events.len()).await;
        let by_id: HashMap<EventId, (InboundMessage, &Received<_>)> =
            got.iter().map(|r| (decode(r).id, (decode(r), r))).collect();
        assert_eq!(
            by_id.len(),
            events.len(),
            "each event once: {:?}",
            ids(&got)
        );
        for e in &events {
            let (m, raw) = by_id
                .get(&e.id)
                .unwrap_or_else(|| panic!("event {} not received", e.id));
            assert_eq!(m.key, e.key, "key of {}", e.id);
            assert_eq!(m.event_type, e.event_type, "type of {}", e.id);
            assert_eq!(m.payload, e.payload, "payload of {}", e.id);
            let own: BTreeMap<String, String> = e
                .headers
                .iter()
                .filter(|(k, _)| !outbox_core::headers::is_reserved(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            assert_eq!(m.headers, own, "own headers of {}", e.id);
            let ct = e
                .headers
                .get("content-type")
                .map_or(outbox_core::headers::DEFAULT_CONTENT_TYPE, String::as_str);
            assert_eq!(m.content_type, ct, "content type of {}", e.id);
            assert_eq!(raw.message.destination, h.destination(), "destination");
            assert_eq!(m.topic, h.destination());
            assert!(
                raw.message.timestamp.is_some(),
                "broker timestamp of {}",
                e.id
            );
            assert!(!raw.message.redelivered, "first delivery of {}", e.id);
        }
        // `behind`, where the broker tells: never more than what was
        // published, and nothing behind the last message of the backlog.
        for r in &got {
            if let Some(b) = r.message.behind {
                assert!(
                    b < events.len() as u64,
                    "behind {b} of {} published",
                    events.len()
                );
            }
        }
        let last = got.last().expect("messages");
        assert!(
            matches!(last.message.behind, None | Some(0)),
            "nothing is behind the last message: {:?}",
            last.message.behind
        );
        ack_all(&mut source, got).await;
        source.close().await.expect("close");
        assert_nothing_left(h, &name).await;
    }

    /// Three keys, ten events each, published interleaved: each key's
    /// events arrive in publish order.
    pub(crate) async fn per_key_order_is_publish_order<H: SourceHarness>(h: &H) {
        let topic = h.topic();
        let keys = ["order-1", "order-2", "order-3"];
        let mut events = Vec::new();
        for i in 0..30usize {
            events.push(event(
                &topic,
                Some(keys[i % 3]),
                format!("{i}").into_bytes(),
            ));
        }
        publish(h, &events).await;
        let name = consumer_name();
        let mut source = h.source(&name).await;
        let got = recv_n(&mut source, events.len()).await;
        let decoded: Vec<InboundMessage> = got.iter().map(decode).collect();
        for key in keys {
            let sent: Vec<EventId> = events
                .iter()
                .filter(|e| e.key.as_deref() == Some(key))
                .map(|e| e.id)
                .collect();
            let received: Vec<EventId> = decoded
                .iter()
                .filter(|m| m.key.as_deref() == Some(key))
                .map(|m| m.id)
                .collect();
            assert_eq!(received, sent, "order of key {key}");
        }
        ack_all(&mut source, got).await;
        source.close().await.expect("close");
    }

    /// Two events; the first is acknowledged, the second not. A new source
    /// of the same consumer gets the second again, never the first.
    pub(crate) async fn unacked_comes_again_acked_does_not<H: SourceHarness>(h: &H) {
        let topic = h.topic();
        let first = event(&topic, Some("k"), b"1".to_vec());
        let second = event(&topic, Some("k"), b"2".to_vec());
        publish(h, &[first.clone(), second.clone()]).await;
        let name = consumer_name();

        let mut a = h.source(&name).await;
        let mut got = recv_n(&mut a, 2).await;
        assert_eq!(ids(&got), vec![first.id, second.id]);
        let unacked = got.pop().expect("second");
        ack_all(&mut a, got).await;
        a.close().await.expect("close");
        drop(unacked);

        let mut b = h.source(&name).await;
        let again = recv_until(&mut b, second.id).await;
        assert_eq!(
            ids(&again),
            vec![second.id],
            "only the unacknowledged event comes again"
        );
        if H::REPORTS_REDELIVERY {
            assert!(again[0].message.redelivered, "marked as a redelivery");
        }
        ack_all(&mut b, again).await;
        b.close().await.expect("close");
        // The broker holds nothing more for the consumer: the acknowledged
        // event will not come again either.
        assert_nothing_left(h, &name).await;
    }

    /// Five events of one key; the 2nd..5th are acknowledged (last first),
    /// the 1st not. A new source gets the 1st again and nothing before it
    /// is lost. RabbitMQ: only the 1st. Kafka: the 1st and every later one
    /// of its partition, in order (offsets are committed contiguously);
    /// NATS: the 1st and every later one delivered before the restart, in
    /// order (replayed from the acknowledgement floor).
    pub(crate) async fn out_of_order_acks_redeliver_only_the_gap<H: SourceHarness>(h: &H) {
        let topic = h.topic();
        let events: Vec<Event> = (0..5)
            .map(|i| event(&topic, Some("k"), format!("{i}").into_bytes()))
            .collect();
        let sent: Vec<EventId> = events.iter().map(|e| e.id).collect();
        publish(h, &events).await;
        let name = consumer_name();

        let mut a = h.source(&name).await;
        let mut got = recv_n(&mut a, 5).await;
        assert_eq!(ids(&got), sent);
        got.reverse();
        let unacked = got.pop().expect("the first");
        ack_all(&mut a, got).await;
        a.close().await.expect("close");
        drop(unacked);

        let mut b = h.source(&name).await;
        let again = if H::CONTIGUOUS_REDELIVERY {
            recv_n(&mut b, 5).await
        } else {
            recv_until(&mut b, sent[0]).await
        };
        if H::CONTIGUOUS_REDELIVERY {
            assert_eq!(
                ids(&again),
                sent,
                "the gap and everything after it, in order"
            );
        } else {
            assert_eq!(ids(&again), vec![sent[0]], "only the unacknowledged one");
        }
        ack_all(&mut b, again).await;
        b.close().await.expect("close");
        assert_nothing_left(h, &name).await;
    }

    /// Nothing published: recv returns an empty batch (it returns at all:
    /// the time it takes is not asserted).
    pub(crate) async fn recv_with_nothing_published_returns_empty<H: SourceHarness>(h: &H) {
        let mut source = h.source(&consumer_name()).await;
        let got = source
            .recv(10, Duration::from_millis(500))
            .await
            .expect("recv");
        assert!(got.is_empty(), "nothing was published: {:?}", ids(&got));
        assert!(source
            .recv(0, Duration::from_secs(5))
            .await
            .expect("max 0")
            .is_empty());
        source.close().await.expect("close");
    }

    /// A stream / queue / topic that does not exist: a configuration error,
    /// not a panic and not an endless "unavailable".
    pub(crate) async fn missing_destination_is_a_config_error<H: SourceHarness>(h: &H) {
        let e = h.misconfigured().await;
        assert!(
            matches!(e, SourceError::Config(_)),
            "expected a config error, got {e:?}"
        );
        assert!(!e.is_retryable());
    }

    /// The connection breaks (a proxy cuts it and refuses new ones): recv
    /// reports `Unavailable` (never panics, never an error of the
    /// configuration), acknowledging a token of the broken connection is
    /// not an error; once the broker is reachable again the source
    /// reconnects by itself and the unacknowledged message comes again.
    /// Kafka skips this case (see `broker_addr`); librdkafka reconnects on
    /// its own and an outage shows as empty batches.
    pub(crate) async fn lost_connection_is_unavailable_then_recovers<H: SourceHarness>(h: &H) {
        let Some(broker) = h.broker_addr() else {
            eprintln!("skipped: the source cannot be put behind a proxy");
            return;
        };
        let proxy = outbox_testkit::proxy::TcpProxy::start(broker).await;
        let topic = h.topic();
        let first = event(&topic, Some("k"), b"1".to_vec());
        let second = event(&topic, Some("k"), b"2".to_vec());
        publish(h, &[first.clone(), second.clone()]).await;
        let name = consumer_name();
        let mut source = h.source_via(proxy.addr(), &name).await;
        let mut got = recv_n(&mut source, 2).await;
        assert_eq!(ids(&got), vec![first.id, second.id]);
        let second_token = got.pop().expect("second");
        let first_token = got.pop().expect("first");
        drop(second_token);

        proxy.refuse();
        let deadline = Instant::now() + BOUND;
        loop {
            assert!(
                Instant::now() < deadline,
                "no Unavailable from {} while its broker is unreachable",
                source.describe()
            );
            match source.recv(10, Duration::from_millis(200)).await {
                Err(SourceError::Unavailable(_)) => break,
                Err(e) => panic!("a lost connection is not a configuration error: {e}"),
                Ok(batch) => assert!(batch.is_empty(), "{:?}", ids(&batch)),
            }
        }
        source
            .ack(vec![first_token.token])
            .await
            .expect("acking a token of a lost connection is not an error");

        proxy.restore();
        let again = recv_until(&mut source, second.id).await;
        for id in ids(&again) {
            assert!(id == first.id || id == second.id, "unexpected event {id}");
        }
        ack_all(&mut source, again).await;
        source.close().await.expect("close");
        assert_nothing_left(h, &name).await;
    }

    /// `Debug` of a config with a password never shows it.
    pub(crate) async fn config_debug_hides_the_password<H: SourceHarness>(h: &H) {
        let secret = "hunter2-s3cret";
        let debug = h.config_debug_with_password(secret);
        assert!(!debug.contains(secret), "{debug}");
    }

    /// One publisher per wire format (headers, envelope, CloudEvents binary
    /// and structured), each publishing a keyed event with a non-UTF-8
    /// payload and a keyless one with a JSON payload, both with trace
    /// context and a plain header: all eight arrive through the real source
    /// and decode, as the inbox decodes them, to the event published (id,
    /// type, key, topic, content type, payload bytes, trace context and own
    /// headers, creation time where the format carries it) in the format
    /// published.
    pub(crate) async fn every_wire_format_arrives_and_decodes_intact<H: SourceHarness>(h: &H) {
        let topic = h.topic();
        let formats = [
            WireFormat::Headers,
            WireFormat::Envelope,
            WireFormat::CloudEvents,
            WireFormat::CloudEventsJson,
        ];
        let mut sent: Vec<(Event, WireFormat)> = Vec::new();
        for (n, format) in (0u8..).zip(formats) {
            let mut bytes = format!("{format}:").into_bytes();
            bytes.extend_from_slice(&[0, 255, 128, 0xc3, 0x28, n, b'\n']);
            let mut keyed = event(&topic, Some(&format!("key-{format}")), bytes);
            keyed.event_type = format!("conformance.{format}.bytes");
            let mut json = event(
                &topic,
                None,
                format!(r#"{{"format":"{format}","n":[1,2.5,null],"s":"caf\u00e9 \\ \""}}"#)
                    .into_bytes(),
            );
            json.event_type = format!("conformance.{format}.json");
            json.headers
                .insert("content-type".into(), "application/json".into());
            for (i, e) in [&mut keyed, &mut json].into_iter().enumerate() {
                e.headers.insert(
                    "traceparent".into(),
                    format!(
                        "00-4bf92f3577b34da6a3ce929d0e0e4736-{:016x}-01",
                        u64::from(n) * 2 + i as u64 + 1
                    ),
                );
                e.headers
                    .insert("tracestate".into(), format!("outbox=conformance{n}"));
                e.headers.insert("x-tenant".into(), format!("tenant-{n}"));
            }
            publish_via(&h.sink_with(format).await, &[keyed.clone(), json.clone()]).await;
            sent.push((keyed, format));
            sent.push((json, format));
        }

        let name = consumer_name();
        let mut source = h.source(&name).await;
        let got = recv_n(&mut source, sent.len()).await;
        let by_id: HashMap<EventId, (InboundMessage, &Received<_>)> =
            got.iter().map(|r| (decode(r).id, (decode(r), r))).collect();
        assert_eq!(by_id.len(), sent.len(), "each event once: {:?}", ids(&got));
        let prefix = H::BINDING.prefix();
        for (e, format) in &sent {
            let what = format!("{format} event {}", e.id);
            let (m, raw) = by_id
                .get(&e.id)
                .unwrap_or_else(|| panic!("{what} not received"));
            assert_eq!(m.format, *format, "format of the {what}");
            assert_eq!(m.event_type, e.event_type, "type of the {what}");
            assert_eq!(m.key, e.key, "key of the {what}");
            assert_eq!(m.payload, e.payload, "payload bytes of the {what}");
            let ct = e
                .headers
                .get("content-type")
                .map_or(outbox_core::headers::DEFAULT_CONTENT_TYPE, String::as_str);
            assert_eq!(m.content_type, ct, "content type of the {what}");
            let own: BTreeMap<String, String> = e
                .headers
                .iter()
                .filter(|(k, _)| !outbox_core::headers::is_reserved(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            assert_eq!(
                m.headers, own,
                "trace context and own headers of the {what}"
            );
            assert_eq!(raw.message.destination, h.destination(), "destination");
            match format {
                // The envelope names the event's topic itself.
                WireFormat::Envelope => {
                    assert_eq!(m.topic, e.topic, "topic of the {what}");
                    assert_eq!(
                        m.created_at.map(|t| t.timestamp_millis()),
                        Some(e.created_at.timestamp_millis()),
                        "creation time of the {what}"
                    );
                    assert_eq!(m.attempt, Some(e.attempts), "attempt of the {what}");
                }
                _ => {
                    assert_eq!(m.topic, h.destination(), "topic of the {what}");
                    assert_eq!(m.attempt, None, "attempt of the {what}");
                }
            }
            match format {
                WireFormat::CloudEvents => {
                    assert_eq!(m.created_at, Some(e.created_at), "`time` of the {what}");
                    assert_eq!(
                        header(&raw.message, &format!("{prefix}source")),
                        Some(CE_SOURCE),
                        "the `source` attribute header of the {what}"
                    );
                    assert_eq!(
                        header(&raw.message, &format!("{prefix}specversion")),
                        Some("1.0"),
                        "the `specversion` attribute header of the {what}"
                    );
                }
                WireFormat::CloudEventsJson => {
                    assert_eq!(m.created_at, Some(e.created_at), "`time` of the {what}");
                    let body: serde_json::Value = serde_json::from_slice(&raw.message.body)
                        .unwrap_or_else(|err| panic!("the {what} is not JSON: {err}"));
                    assert_eq!(body["source"], CE_SOURCE, "`source` of the {what}");
                    assert_eq!(body["id"], e.id.to_string(), "`id` of the {what}");
                }
                _ => {}
            }
        }
        ack_all(&mut source, got).await;
        source.close().await.expect("close");
        assert_nothing_left(h, &name).await;
    }

    /// Malformed CloudEvents published raw with the broker's own client
    /// (binary mode in the broker's binding without `specversion`, `id`,
    /// `source` or `type`; structured mode without `source`) arrive
    /// through the real source and the inbox's decoding refuses each with
    /// the missing attribute named, never a panic.
    pub(crate) async fn malformed_cloudevent_is_refused_naming_the_attribute<H: SourceHarness>(
        h: &H,
    ) {
        let bad = malformed::<H>("key-malformed");
        for (_, _, raw) in &bad {
            h.publish_raw(raw.clone()).await;
        }
        let name = consumer_name();
        let mut source = h.source(&name).await;
        let got = recv_n(&mut source, bad.len()).await;
        let mut refused: BTreeMap<String, DecodeError> = BTreeMap::new();
        for r in &got {
            let probe = header(&r.message, PROBE)
                .unwrap_or_else(|| panic!("{:?} has no {PROBE} header", r.message));
            let err = match try_decode(r) {
                Ok(m) => panic!("malformed {probe} decoded as {m:?}"),
                Err(e) => e,
            };
            assert!(
                refused.insert(probe.to_owned(), err).is_none(),
                "{probe} twice"
            );
        }
        let expected: BTreeMap<String, DecodeError> = bad
            .iter()
            .map(|(probe, missing, _)| (probe.clone(), DecodeError::MissingAttribute(missing)))
            .collect();
        assert_eq!(refused, expected);
        for (probe, missing, _) in &bad {
            let text = refused[probe].to_string();
            assert!(
                text.contains(&format!("`{missing}`")),
                "{probe}: {text:?} does not name `{missing}`"
            );
        }
        ack_all(&mut source, got).await;
        source.close().await.expect("close");
        assert_nothing_left(h, &name).await;
    }

    /// The malformed CloudEvents of the case above, then two good ones of
    /// the same key (one per CloudEvents format, from the real publisher),
    /// consumed by a running inbox with a PostgreSQL store: each malformed
    /// one is a dead letter with code `UNDECODABLE` and the message naming
    /// its missing attribute, the good ones are applied in order, the run
    /// ends cleanly and everything is acknowledged at the broker.
    #[cfg(feature = "postgres")]
    pub(crate) async fn malformed_cloudevent_is_dead_lettered_and_the_next_applied<
        H: SourceHarness,
    >(
        h: &H,
    ) {
        use outbox_core::{DeadLetterFilter, ErrorCode};
        use outbox_inbox::{InboxDeadLetterStore, InboxRetentionStore, InboxSchema};
        let key = "key-malformed";
        let bad = malformed::<H>(key);
        for (_, _, raw) in &bad {
            h.publish_raw(raw.clone()).await;
        }
        let topic = h.topic();
        let mut good = Vec::new();
        for format in [WireFormat::CloudEvents, WireFormat::CloudEventsJson] {
            let mut payload = format!("good {format}:").into_bytes();
            payload.extend_from_slice(&[0, 255]);
            let e = event(&topic, Some(key), payload);
            publish_via(&h.sink_with(format).await, std::slice::from_ref(&e)).await;
            good.push((e, format));
        }

        let db = pg::Db::new().await;
        let name = consumer_name();
        let inbox = db.inbox(&name);
        // The watch below reads the tables before the run would create them.
        inbox.store().migrate().await.expect("migrate");
        let source = h.source(&name).await;
        let undecodable = DeadLetterFilter::all().with_code(ErrorCode::UNDECODABLE);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let run = inbox.run(source, async move {
            let _ = stopped.await;
        });
        let watch = async {
            let deadline = Instant::now() + BOUND;
            loop {
                let applied = db.applied().await.len();
                let dead = inbox
                    .store()
                    .dead_letters(&undecodable, 100)
                    .await
                    .unwrap()
                    .len();
                assert!(
                    applied <= good.len(),
                    "a malformed CloudEvent was applied: {:?}",
                    db.applied().await
                );
                if applied == good.len() && dead >= bad.len() {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "within {BOUND:?} only {applied} applied and {dead} dead letters ({:?})",
                    inbox.stats()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            stop.send(()).unwrap();
        };
        let (counts, ()) = tokio::join!(run, watch);
        let counts = counts.expect("the inbox ran to its shutdown");
        assert_eq!(
            (
                counts.handled,
                counts.undecodable,
                counts.dead,
                counts.retries
            ),
            (good.len() as u64, bad.len() as u64, bad.len() as u64, 0),
            "{counts:?}"
        );

        let expected: Vec<(EventId, Vec<u8>, String)> = good
            .iter()
            .map(|(e, format)| (e.id, e.payload.clone(), format.to_string()))
            .collect();
        assert_eq!(db.applied().await, expected, "the good events, in order");

        let dead = inbox.store().dead_letters(&undecodable, 100).await.unwrap();
        let by_probe: BTreeMap<String, (String, String)> = dead
            .iter()
            .map(|d| {
                let probe = d
                    .message
                    .headers
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(PROBE))
                    .map(|(_, v)| v.clone())
                    .unwrap_or_else(|| panic!("dead letter {} has no {PROBE}", d.message.id));
                let (code, message) = d.last_error.clone().expect("a dead letter's error");
                (probe, (code.as_str().to_owned(), message))
            })
            .collect();
        let wanted: BTreeMap<String, (String, String)> = bad
            .iter()
            .map(|(probe, missing, _)| {
                (
                    probe.clone(),
                    (
                        "UNDECODABLE".to_owned(),
                        DecodeError::MissingAttribute(missing).to_string(),
                    ),
                )
            })
            .collect();
        assert_eq!(by_probe, wanted, "the dead letters, by what they lack");
        for (probe, missing, raw) in &bad {
            let d = dead
                .iter()
                .find(|d| d.message.headers.get(PROBE).map(String::as_str) == Some(probe.as_str()))
                .expect("found above");
            assert_eq!(d.message.payload, raw.body, "{probe}: the raw body is kept");
            assert!(
                by_probe[probe].1.contains(&format!("`{missing}`")),
                "{probe} names `{missing}`"
            );
        }
        for (e, _) in &good {
            assert!(
                inbox.store().is_recorded(e.id).await.unwrap(),
                "{} recorded",
                e.id
            );
        }
        assert_nothing_left(h, &name).await;
        db.drop().await;
    }

    /// Without a PostgreSQL inbox the end-to-end half cannot run.
    #[cfg(not(feature = "postgres"))]
    pub(crate) async fn malformed_cloudevent_is_dead_lettered_and_the_next_applied<
        H: SourceHarness,
    >(
        _h: &H,
    ) {
        eprintln!("skipped: needs the `postgres` feature (run with --all-features)");
    }
}

/// A PostgreSQL inbox in a schema of its own, applying events into an
/// `applied` table in the handler's transaction.
#[cfg(feature = "postgres")]
mod pg {
    use futures::future::BoxFuture;
    use outbox_core::HandlerError;
    use outbox_core::{DeadHeadPolicy, EventId, InboundMessage};
    use outbox_inbox::{Handler, Inbox, InboxOptions, PgInbox};
    use std::time::Duration;

    pub(crate) struct Db {
        pool: outbox_inbox::sqlx::PgPool,
        schema: String,
    }

    impl Db {
        pub(crate) async fn new() -> Self {
            let url = std::env::var("DATABASE_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
            let pool = outbox_inbox::sqlx::postgres::PgPoolOptions::new()
                .max_connections(4)
                .connect(&url)
                .await
                .expect("PostgreSQL on 127.0.0.1:5432 (or DATABASE_URL)");
            let schema = format!(
                "source_conf_{}",
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            );
            outbox_inbox::sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
                .execute(&pool)
                .await
                .unwrap();
            outbox_inbox::sqlx::query(&format!(
                "CREATE TABLE \"{schema}\".applied (serial bigserial PRIMARY KEY, event_id uuid NOT NULL, payload bytea NOT NULL, format text NOT NULL)"
            ))
            .execute(&pool)
            .await
            .unwrap();
            Self { pool, schema }
        }

        pub(crate) fn inbox(&self, consumer: &str) -> Inbox<PgInbox, Applied> {
            let store = PgInbox::new(self.pool.clone(), consumer)
                .unwrap()
                .with_schema(self.schema.clone())
                .unwrap();
            Inbox::new(
                store,
                Applied {
                    insert: format!(
                        "INSERT INTO \"{}\".applied (event_id, payload, format) VALUES ($1, $2, $3)",
                        self.schema
                    ),
                },
            )
            .with_options(
                InboxOptions::default()
                    .with_dead_head_policy(DeadHeadPolicy::Block)
                    .with_lanes(2)
                    .unwrap()
                    .with_recv_wait(Duration::from_millis(50)),
            )
        }

        /// What the handler applied, in the order it was applied.
        pub(crate) async fn applied(&self) -> Vec<(EventId, Vec<u8>, String)> {
            let rows: Vec<(uuid::Uuid, Vec<u8>, String)> = outbox_inbox::sqlx::query_as(&format!(
                "SELECT event_id, payload, format FROM \"{}\".applied ORDER BY serial",
                self.schema
            ))
            .fetch_all(&self.pool)
            .await
            .unwrap();
            rows.into_iter()
                .map(|(id, payload, format)| (EventId::from(id), payload, format))
                .collect()
        }

        pub(crate) async fn drop(self) {
            outbox_inbox::sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
                .execute(&self.pool)
                .await
                .ok();
        }
    }

    /// One row per applied message: its id, payload and wire format.
    pub(crate) struct Applied {
        insert: String,
    }

    impl Handler<outbox_inbox::sqlx::Postgres> for Applied {
        fn handle<'a>(
            &'a self,
            m: &'a InboundMessage,
            tx: &'a mut outbox_inbox::sqlx::Transaction<'static, outbox_inbox::sqlx::Postgres>,
        ) -> BoxFuture<'a, Result<(), HandlerError>> {
            Box::pin(async move {
                outbox_inbox::sqlx::query(&self.insert)
                    .bind(m.id.as_uuid())
                    .bind(&m.payload)
                    .bind(m.format.to_string())
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        }
    }
}

#[cfg(feature = "nats")]
mod nats_harness {
    use super::*;
    use outbox_inbox::source::nats::{NatsSource, NatsSourceConfig};
    use outbox_nats::NatsPublisher;
    use outbox_testkit::nats::NatsFixture;

    pub(crate) struct Nats(NatsFixture);

    impl Nats {
        fn config(&self, name: &str) -> NatsSourceConfig {
            NatsSourceConfig::new(self.0.url(), self.0.stream(), name)
                .with_filter_subject(self.0.subject(&self.0.topic()))
                .with_ack_wait(Duration::from_secs(2))
        }
    }

    impl SourceHarness for Nats {
        type Source = NatsSource;
        type Sink = NatsPublisher;
        const CONTIGUOUS_REDELIVERY: bool = true;
        const REPORTS_REDELIVERY: bool = true;

        async fn new() -> Self {
            Self(NatsFixture::new().await)
        }

        fn topic(&self) -> String {
            self.0.topic()
        }

        fn destination(&self) -> String {
            self.0.subject(&self.0.topic())
        }

        const BINDING: Binding = Binding::Nats;

        async fn sink(&self) -> NatsPublisher {
            self.0.sink().await
        }

        async fn sink_with(&self, format: WireFormat) -> NatsPublisher {
            let config = self
                .0
                .config()
                .with_wire_format(format)
                .with_cloudevents_source(ce_source());
            NatsPublisher::connect(config)
                .await
                .expect("connect the publisher")
        }

        async fn publish_raw(&self, message: RawPublish) {
            let mut headers = outbox_nats::async_nats::HeaderMap::new();
            for (name, value) in message.headers {
                headers.insert(name.as_str(), value.as_str());
            }
            if let Some(ct) = message.content_type {
                headers.insert("content-type", ct.as_str());
            }
            self.0
                .jetstream()
                .publish_with_headers(self.destination(), headers, message.body.into())
                .await
                .expect("publish")
                .await
                .expect("PubAck");
        }

        async fn source(&self, name: &str) -> NatsSource {
            NatsSource::connect(self.config(name))
                .await
                .expect("NATS source")
        }

        fn broker_addr(&self) -> Option<SocketAddr> {
            Some(self.0.broker_addr())
        }

        async fn source_via(&self, addr: SocketAddr, name: &str) -> NatsSource {
            let config = NatsSourceConfig::new(format!("nats://{addr}"), self.0.stream(), name)
                .with_filter_subject(self.0.subject(&self.0.topic()))
                .with_ack_wait(Duration::from_secs(2));
            NatsSource::connect(config)
                .await
                .expect("NATS source via the proxy")
        }

        async fn misconfigured(&self) -> SourceError {
            let config = NatsSourceConfig::new(
                self.0.url(),
                format!("NO_SUCH_STREAM_{}", uuid::Uuid::new_v4().simple()),
                "inbox",
            );
            NatsSource::connect(config)
                .await
                .expect_err("no such stream")
        }

        fn config_debug_with_password(&self, password: &str) -> String {
            let c = NatsSourceConfig::new(
                format!("nats://app:{password}@127.0.0.1:4222,nats://{password}@other:4222"),
                "S",
                "d",
            );
            assert!(c.validate().is_ok());
            format!("{c:?} {}", c.servers_redacted())
        }

        async fn remaining(&self, name: &str) -> u64 {
            let stream = self
                .0
                .jetstream()
                .get_stream(self.0.stream())
                .await
                .unwrap();
            let info = stream.consumer_info(name).await.unwrap();
            info.num_pending + u64::try_from(info.num_ack_pending).unwrap()
        }

        async fn cleanup(&self) {
            self.0.cleanup().await;
        }
    }

    source_conformance_tests!(nats, Nats);
}

#[cfg(feature = "amqp")]
mod amqp_harness {
    use super::*;
    use outbox_amqp::AmqpPublisher;
    use outbox_inbox::source::amqp::{AmqpSource, AmqpSourceConfig};
    use outbox_testkit::amqp::AmqpFixture;

    pub(crate) struct Amqp(AmqpFixture);

    impl SourceHarness for Amqp {
        type Source = AmqpSource;
        type Sink = AmqpPublisher;
        const CONTIGUOUS_REDELIVERY: bool = false;
        const REPORTS_REDELIVERY: bool = true;

        async fn new() -> Self {
            Self(AmqpFixture::new().await)
        }

        fn topic(&self) -> String {
            self.0.topic()
        }

        fn destination(&self) -> String {
            // The routing key: the fixture binds the queue with the topic.
            self.0.topic()
        }

        const BINDING: Binding = Binding::Amqp;

        async fn sink(&self) -> AmqpPublisher {
            self.0.sink().await
        }

        async fn sink_with(&self, format: WireFormat) -> AmqpPublisher {
            let config = self
                .0
                .config()
                .with_wire_format(format)
                .with_cloudevents_source(ce_source());
            AmqpPublisher::connect(config)
                .await
                .expect("connect the publisher")
        }

        async fn publish_raw(&self, message: RawPublish) {
            use outbox_amqp::lapin::options::BasicPublishOptions;
            use outbox_amqp::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
            use outbox_amqp::lapin::BasicProperties;
            let mut table = FieldTable::default();
            for (name, value) in message.headers {
                table.insert(
                    ShortString::from(name),
                    AMQPValue::LongString(LongString::from(value)),
                );
            }
            let mut properties = BasicProperties::default().with_headers(table);
            if let Some(ct) = message.content_type {
                properties = properties.with_content_type(ShortString::from(ct));
            }
            self.0
                .channel()
                .basic_publish(
                    self.0.exchange(),
                    &self.0.topic(),
                    BasicPublishOptions::default(),
                    &message.body,
                    properties,
                )
                .await
                .expect("basic.publish")
                .await
                .expect("publish confirm");
        }

        async fn source(&self, name: &str) -> AmqpSource {
            let config = AmqpSourceConfig::new(self.0.url(), self.0.queue())
                .with_consumer_tag(name)
                .with_prefetch(64);
            AmqpSource::connect(config).await.expect("AMQP source")
        }

        fn broker_addr(&self) -> Option<SocketAddr> {
            Some(self.0.broker_addr())
        }

        async fn source_via(&self, addr: SocketAddr, name: &str) -> AmqpSource {
            let config = AmqpSourceConfig::new(self.0.url_via(addr), self.0.queue())
                .with_consumer_tag(name)
                .with_connect_timeout(Duration::from_secs(2));
            AmqpSource::connect(config)
                .await
                .expect("AMQP source via the proxy")
        }

        async fn misconfigured(&self) -> SourceError {
            let config = AmqpSourceConfig::new(
                self.0.url(),
                format!("no-such-queue-{}", uuid::Uuid::new_v4().simple()),
            );
            AmqpSource::connect(config)
                .await
                .expect_err("no such queue")
        }

        fn config_debug_with_password(&self, password: &str) -> String {
            let c = AmqpSourceConfig::new(format!("amqp://app:{password}@127.0.0.1:5672/%2f"), "q");
            assert!(c.validate().is_ok());
            format!("{c:?} {}", c.uri_redacted())
        }

        async fn remaining(&self, _name: &str) -> u64 {
            u64::from(self.0.message_count().await)
        }

        async fn cleanup(&self) {
            self.0.cleanup().await;
        }
    }

    source_conformance_tests!(amqp, Amqp);
}

#[cfg(feature = "kafka")]
mod kafka_harness {
    use super::*;
    use outbox_inbox::source::kafka::{KafkaSource, KafkaSourceConfig};
    use outbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
    use outbox_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
    use outbox_kafka::KafkaPublisher;
    use outbox_testkit::kafka::{KafkaFixture, PARTITIONS};

    pub(crate) struct Kafka(KafkaFixture);

    impl Kafka {
        fn config(&self, group: &str, topic: &str) -> KafkaSourceConfig {
            KafkaSourceConfig::new(self.0.brokers(), group, [topic])
                // A group of one member: join quickly.
                .with_property("session.timeout.ms", "6000")
                .with_property("heartbeat.interval.ms", "500")
                .with_property("topic.metadata.refresh.interval.ms", "1000")
        }
    }

    impl SourceHarness for Kafka {
        type Source = KafkaSource;
        type Sink = KafkaPublisher;
        const CONTIGUOUS_REDELIVERY: bool = true;
        const REPORTS_REDELIVERY: bool = false;

        async fn new() -> Self {
            Self(KafkaFixture::new().await)
        }

        fn topic(&self) -> String {
            self.0.topic()
        }

        fn destination(&self) -> String {
            self.0.topic()
        }

        const BINDING: Binding = Binding::Kafka;

        async fn sink(&self) -> KafkaPublisher {
            self.0.sink().await
        }

        async fn sink_with(&self, format: WireFormat) -> KafkaPublisher {
            let config = self
                .0
                .config()
                .with_wire_format(format)
                .with_cloudevents_source(ce_source());
            KafkaPublisher::new(config).expect("create the publisher")
        }

        async fn publish_raw(&self, message: RawPublish) {
            use outbox_kafka::rdkafka::message::{Header, OwnedHeaders};
            use outbox_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
            let producer: FutureProducer = ClientConfig::new()
                .set("bootstrap.servers", self.0.brokers())
                .create()
                .expect("producer");
            let mut headers = OwnedHeaders::new();
            for (name, value) in &message.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_bytes()),
                });
            }
            if let Some(ct) = &message.content_type {
                headers = headers.insert(Header {
                    key: "content-type",
                    value: Some(ct.as_bytes()),
                });
            }
            let topic = self.0.topic();
            let mut record = FutureRecord::<str, [u8]>::to(&topic)
                .payload(&message.body)
                .headers(headers);
            if let Some(key) = &message.key {
                record = record.key(key.as_str());
            }
            producer
                .send(record, Duration::from_secs(30))
                .await
                .map_err(|(e, _)| e)
                .expect("produce");
        }

        async fn source(&self, name: &str) -> KafkaSource {
            KafkaSource::new(self.config(name, &self.0.topic())).expect("Kafka source")
        }

        fn broker_addr(&self) -> Option<SocketAddr> {
            None
        }

        async fn source_via(&self, _addr: SocketAddr, name: &str) -> KafkaSource {
            self.source(name).await
        }

        async fn misconfigured(&self) -> SourceError {
            let mut source =
                KafkaSource::new(self.config(&consumer_name(), &self.0.unknown_topic()))
                    .expect("a source is built before the topic is looked up");
            let deadline = Instant::now() + BOUND;
            loop {
                match source.recv(10, Duration::from_secs(1)).await {
                    Err(e @ SourceError::Config(_)) => {
                        source.close().await.ok();
                        return e;
                    }
                    Err(e) => eprintln!("waiting for a config error, got {e}"),
                    Ok(got) => assert!(got.is_empty(), "messages from a missing topic"),
                }
                assert!(
                    Instant::now() < deadline,
                    "no error for a missing topic within {BOUND:?}"
                );
            }
        }

        fn config_debug_with_password(&self, password: &str) -> String {
            let c = KafkaSourceConfig::new("127.0.0.1:9092", "g", ["t"])
                .with_property("sasl.username", "app")
                .with_property("sasl.password", password);
            assert!(c.validate().is_ok());
            format!("{c:?}")
        }

        async fn remaining(&self, name: &str) -> u64 {
            let brokers = self.0.brokers().to_owned();
            let topic = self.0.topic();
            let group = name.to_owned();
            tokio::task::spawn_blocking(move || {
                let consumer: BaseConsumer = ClientConfig::new()
                    .set("bootstrap.servers", &brokers)
                    .set("group.id", &group)
                    .set("enable.auto.commit", "false")
                    .create()
                    .unwrap();
                let mut tpl = TopicPartitionList::new();
                for p in 0..PARTITIONS {
                    tpl.add_partition(&topic, p);
                }
                let committed = consumer
                    .committed_offsets(tpl, Duration::from_secs(10))
                    .unwrap();
                let mut left = 0u64;
                for p in 0..PARTITIONS {
                    let (low, high) = consumer
                        .fetch_watermarks(&topic, p, Duration::from_secs(10))
                        .unwrap();
                    let at = match committed.find_partition(&topic, p).map(|e| e.offset()) {
                        Some(Offset::Offset(o)) => o,
                        _ => low,
                    };
                    left += u64::try_from(high - at).unwrap_or(0);
                }
                left
            })
            .await
            .unwrap()
        }

        async fn cleanup(&self) {
            self.0.cleanup().await;
        }
    }

    source_conformance_tests!(kafka, Kafka);

    /// Kafka only: a second member joins the group while the first holds
    /// unacknowledged messages. The partitions are rebalanced (revoked ones
    /// committed as far as they are acknowledged); the unacknowledged
    /// messages come again, to whichever member now owns their partition,
    /// and once everything is acknowledged the group has nothing left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rebalance_hands_unacked_messages_on() {
        run_case::<Kafka, _, _>(|h| async move {
            let h = &*h;
            let topic = h.topic();
            let events: Vec<Event> = (0..30)
                .map(|i| event(&topic, Some(&format!("key-{}", i % 10)), vec![i]))
                .collect();
            publish(h, &events).await;
            let group = consumer_name();
            let mut a = h.source(&group).await;
            let got = recv_n(&mut a, events.len()).await;
            let held_key = decode(&got[0]).key.expect("keyed");
            let held: Vec<EventId> = events
                .iter()
                .filter(|e| e.key.as_deref() == Some(held_key.as_str()))
                .map(|e| e.id)
                .collect();
            let (keep, ack): (Vec<_>, Vec<_>) = got
                .into_iter()
                .partition(|r| decode(r).key.as_deref() == Some(held_key.as_str()));
            ack_all(&mut a, ack).await;
            drop(keep);

            // Both members poll (a member that does not poll holds the
            // rebalance up); each acknowledges what it gets.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<EventId>();
            let (stop_tx, stop) = tokio::sync::watch::channel(false);
            let member = |mut source: KafkaSource| {
                let tx = tx.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    while !*stop.borrow() {
                        match source.recv(100, Duration::from_millis(500)).await {
                            Ok(batch) => {
                                for r in &batch {
                                    let _ = tx.send(decode(r).id);
                                }
                                ack_all(&mut source, batch).await;
                            }
                            Err(e) => {
                                assert!(e.is_retryable(), "{e}");
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                        }
                    }
                    source.close().await.expect("close");
                })
            };
            let a = member(a);
            let b = member(h.source(&group).await);
            let deadline = Instant::now() + BOUND;
            let mut again = Vec::new();
            while !held.iter().all(|id| again.contains(id)) {
                let left = deadline.saturating_duration_since(Instant::now());
                match tokio::time::timeout(left, rx.recv()).await {
                    Ok(Some(id)) => again.push(id),
                    _ => {
                        panic!("after the rebalance only {again:?} came again, not all of {held:?}")
                    }
                }
            }
            stop_tx.send(true).expect("stop");
            a.await.expect("member a");
            b.await.expect("member b");
            let all: Vec<EventId> = events.iter().map(|e| e.id).collect();
            for id in &again {
                assert!(all.contains(id), "unexpected event {id}");
            }
            assert_nothing_left(h, &group).await;
        })
        .await;
    }
}
