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
//! - `unreachable_broker_gives_retryable_failures_then_delivers`: a
//!   [`TcpProxy`] between publisher and broker is cut, then restored.

use outbox_core::{ErrorCode, Event, EventId, Outcome, Sink};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// One message read back from the broker, in broker-neutral form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedMessage {
    /// The message body.
    pub payload: Vec<u8>,
    /// Application headers as the broker delivered them (the event's own
    /// headers must be among them, unchanged).
    pub headers: BTreeMap<String, String>,
    /// The event id the message carries (dedup id), if any.
    pub event_id: Option<EventId>,
    /// The event key the message carries, if any.
    pub key: Option<String>,
    /// The event type the message carries, if any.
    pub event_type: Option<String>,
}

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

    /// The next `n` messages of the destination, in broker order, read with
    /// the broker's own consumer API. Panics with a clear message when they
    /// do not arrive within a generous time.
    fn consume(&self, n: usize) -> impl Future<Output = Vec<ReceivedMessage>> + Send;

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
            unreachable_broker_gives_retryable_failures_then_delivers,
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

fn assert_failed(outcome: &Outcome, code: &ErrorCode, retryable: bool, what: &str) {
    match outcome {
        Outcome::Failed(e) => {
            assert_eq!(e.code(), code, "{what}: wrong code ({e})");
            assert_eq!(
                e.is_retryable(),
                retryable,
                "{what}: expected retryable = {retryable}, got {e}"
            );
        }
        other => panic!("{what}: expected {code} failure, got {other:?}"),
    }
}

fn ids(messages: &[ReceivedMessage]) -> Vec<Option<EventId>> {
    messages.iter().map(|m| m.event_id).collect()
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
        let by_id: HashMap<EventId, &ReceivedMessage> = got
            .iter()
            .map(|m| (m.event_id.expect("message carries the event id"), m))
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
                .filter_map(|m| m.event_id)
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
    /// every failure is retryable; once it is back, retries deliver.
    pub async fn unreachable_broker_gives_retryable_failures_then_delivers<H: PublisherHarness>(
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
                match o {
                    Outcome::Delivered => {
                        panic!("round {round}: Delivered while the broker is unreachable")
                    }
                    Outcome::Failed(e) => {
                        assert!(e.is_retryable(), "round {round}: not retryable: {e}")
                    }
                    Outcome::NotAttempted => {}
                    other => panic!("round {round}: unexpected outcome {other:?}"),
                }
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
                match o {
                    Outcome::Delivered => {}
                    Outcome::Failed(err) => {
                        assert!(err.is_retryable(), "after restore: {err}");
                        still.push(e);
                    }
                    Outcome::NotAttempted => still.push(e),
                    other => panic!("after restore: unexpected outcome {other:?}"),
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
            let id = m.event_id.expect("event id");
            assert!(wanted.contains(&id), "unexpected message {id}");
            seen.insert(id);
        }
    }
}

/// A TCP proxy for tests: forwards every connection to `upstream` until
/// [`cut`](Self::cut), which closes the open connections and turns new ones
/// away (accepted, then closed at once) until [`restore`](Self::restore).
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    state: Arc<Mutex<ProxyState>>,
    accept: AbortHandle,
}

#[derive(Debug, Default)]
struct ProxyState {
    cut: bool,
    connections: Vec<AbortHandle>,
}

impl TcpProxy {
    /// Listens on an ephemeral loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(Mutex::new(ProxyState::default()));
        let st = state.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut downstream, _)) = listener.accept().await else {
                    continue;
                };
                let mut guard = st.lock().expect("proxy state");
                if guard.cut {
                    drop(downstream);
                    continue;
                }
                let task = tokio::spawn(async move {
                    if let Ok(mut upstream) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut downstream, &mut upstream).await;
                    }
                });
                guard.connections.retain(|c| !c.is_finished());
                guard.connections.push(task.abort_handle());
            }
        })
        .abort_handle();
        Self {
            addr,
            state,
            accept,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every forwarded connection and refuses new ones.
    pub fn cut(&self) {
        let mut guard = self.state.lock().expect("proxy state");
        guard.cut = true;
        for c in guard.connections.drain(..) {
            c.abort();
        }
    }

    /// Forwards new connections again.
    pub fn restore(&self) {
        self.state.lock().expect("proxy state").cut = false;
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        if let Ok(mut guard) = self.state.lock() {
            for c in guard.connections.drain(..) {
                c.abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn roundtrip(s: &mut TcpStream) -> std::io::Result<[u8; 4]> {
        s.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await?;
        Ok(buf)
    }

    #[tokio::test]
    async fn proxy_forwards_cuts_and_restores() {
        let proxy = TcpProxy::start(echo_server().await).await;
        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(&roundtrip(&mut a).await.unwrap(), b"ping");

        proxy.cut();
        assert!(roundtrip(&mut a).await.is_err(), "open connection closed");
        let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(roundtrip(&mut b).await.is_err(), "new connection refused");

        proxy.restore();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(&roundtrip(&mut c).await.unwrap(), b"ping");
    }
}
