//! The end-to-end scenario, written once: application transactions (committed
//! and rolled back) -> the real relay -> a real broker -> a real consumer, and
//! the checks on what the consumer received and what the outbox still holds.

use crate::app::{App, Order, OutboxRows, TxEnd};
use crate::broker::{Broker, Received};
use futures::FutureExt;
use outbox_core::{EventId, NewEvent, RelayId, Store};
use outbox_worker::{Relay, RelayOptions, RelaySummary};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::panic::{resume_unwind, AssertUnwindSafe};
use std::time::Duration;

/// Upper bound on one relay run (a guard against a hang, not a timed
/// assertion: a healthy run takes a fraction of it).
pub const RELAY_BOUND: Duration = Duration::from_secs(120);

/// Committed application transactions (orders).
const COMMITTED_ORDERS: i64 = 20;
/// Customers; each order's events are keyed by its customer.
const CUSTOMERS: i64 = 4;
/// Stock-keeping units; each order also reserves one, keyed by the SKU.
const SKUS: i64 = 3;
/// Relay batch size: the scenario's 80 events take two claims.
const BATCH_SIZE: u32 = 50;

/// The application's transactions, in the order they run.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Each transaction: the order row, its events (in enqueue order), and
    /// whether it commits or rolls back.
    pub transactions: Vec<(Order, Vec<NewEvent>, TxEnd)>,
}

impl Scenario {
    /// 20 committed orders, each writing an `orders` row and four events:
    /// `order.created`, `order.line_added`, `order.confirmed` keyed by the
    /// customer (4 customers, so 15 events per key spread over 5
    /// transactions) and `inventory.reserved` keyed by a SKU (3 SKUs),
    /// interleaved across keys; every event carries W3C trace context, a
    /// content type and an application header. Half-way through, one more
    /// order with the same shape of events is rolled back.
    pub fn new(topic: &str) -> Self {
        let mut transactions = Vec::new();
        for n in 1..=COMMITTED_ORDERS {
            transactions.push(order_transaction(topic, n, TxEnd::Commit));
            if n == COMMITTED_ORDERS / 2 {
                transactions.push(order_transaction(topic, 1000, TxEnd::Rollback));
            }
        }
        let s = Self { transactions };
        // Per-key order is enqueue order; the stores claim by id, so the ids
        // (UUIDv7, made when each event was built) must already increase.
        let ids: Vec<EventId> = s.committed().map(NewEvent::id).collect();
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "event ids are not increasing in enqueue order"
        );
        s
    }

    /// Events of committed transactions, in commit order.
    pub fn committed(&self) -> impl Iterator<Item = &NewEvent> {
        self.events_of(TxEnd::Commit)
    }

    /// Events of rolled-back transactions.
    pub fn rolled_back(&self) -> impl Iterator<Item = &NewEvent> {
        self.events_of(TxEnd::Rollback)
    }

    /// Ids of committed orders, ascending.
    pub fn committed_order_ids(&self) -> Vec<i64> {
        let mut ids: Vec<i64> = self
            .transactions
            .iter()
            .filter(|(_, _, end)| *end == TxEnd::Commit)
            .map(|(order, _, _)| order.id)
            .collect();
        ids.sort_unstable();
        ids
    }

    fn events_of(&self, wanted: TxEnd) -> impl Iterator<Item = &NewEvent> {
        self.transactions
            .iter()
            .filter(move |(_, _, end)| *end == wanted)
            .flat_map(|(_, events, _)| events)
    }
}

fn order_transaction(topic: &str, n: i64, end: TxEnd) -> (Order, Vec<NewEvent>, TxEnd) {
    let customer = format!("customer-{}", n % CUSTOMERS);
    let sku = format!("sku-{}", n % SKUS);
    let order = Order {
        id: n,
        customer: customer.clone(),
        total_cents: 1000 + n,
    };
    // One trace per transaction, one span per event.
    let trace_id = format!("{:032x}", 0x4bf9_2f35_77b3_4da6_u128 << 64 | n as u128);
    let event = |step: usize, event_type: &str, key: &str, body: String| {
        NewEvent::new(event_type, topic, body.into_bytes())
            .with_key(key)
            .with_header(
                "traceparent",
                format!("00-{trace_id}-{:016x}-01", (n as u64) << 8 | step as u64),
            )
            .with_header("tracestate", "outbox=e2e")
            .with_header("content-type", "application/json")
            .with_header("x-order-id", n.to_string())
    };
    let events = vec![
        event(
            1,
            "order.created",
            &customer,
            format!(
                r#"{{"order":{n},"customer":"{customer}","total":"{}.{:02} €"}}"#,
                order.total_cents / 100,
                order.total_cents % 100
            ),
        ),
        event(
            2,
            "inventory.reserved",
            &sku,
            format!(r#"{{"order":{n},"sku":"{sku}","qty":{}}}"#, n % 5 + 1),
        ),
        event(
            3,
            "order.line_added",
            &customer,
            format!(r#"{{"order":{n},"line":1,"sku":"{sku}"}}"#),
        ),
        event(
            4,
            "order.confirmed",
            &customer,
            format!(r#"{{"order":{n},"status":"confirmed"}}"#),
        ),
    ];
    (order, events, end)
}

/// Runs the whole scenario for store `A` and broker `B`, cleaning up the
/// database and the broker's destination whether it passes or fails.
pub async fn run_end_to_end<A: App, B: Broker>() {
    let app = A::start().await;
    let broker = match AssertUnwindSafe(B::start()).catch_unwind().await {
        Ok(broker) => broker,
        Err(panic) => {
            app.cleanup().await;
            resume_unwind(panic);
        }
    };
    let outcome = AssertUnwindSafe(scenario(&app, &broker))
        .catch_unwind()
        .await;
    app.cleanup().await;
    broker.cleanup().await;
    if let Err(panic) = outcome {
        resume_unwind(panic);
    }
}

async fn scenario<A: App, B: Broker>(app: &A, broker: &B) {
    let what = format!("{} -> relay -> {}", A::NAME, B::NAME);
    let scenario = Scenario::new(&broker.topic());
    let committed = scenario.committed().count();

    // 1. The application: business rows and events, atomically.
    for (order, events, end) in &scenario.transactions {
        let expected: Vec<EventId> = events.iter().map(NewEvent::id).collect();
        let ids = app.write_order(order, events.clone(), *end).await;
        assert_eq!(ids, expected, "enqueue returns the ids known before commit");
    }
    assert_eq!(
        app.order_ids().await,
        scenario.committed_order_ids(),
        "{what}: the orders table holds exactly the committed orders"
    );
    assert_eq!(
        app.outbox_rows().await,
        OutboxRows {
            events: committed as i64,
            dead: 0
        },
        "{what}: the outbox holds exactly the committed transactions' events"
    );

    // 2. The real relay, until the outbox is drained.
    let summary = relay_until_idle(app.store(), broker.sink().await, &what).await;
    assert_eq!(
        (summary.delivered, summary.dead),
        (committed as u64, 0),
        "{what}: the relay delivered every committed event and dead-lettered none ({summary:?})"
    );

    // 3. A real consumer on the real broker.
    let received = broker.consume(committed).await;
    let failures_happened = summary.retried > 0 || summary.lease_lost > 0;
    check_delivery(&scenario, &received, failures_happened, &what);

    // 4. Nothing left behind.
    assert_eq!(
        app.outbox_rows().await,
        OutboxRows { events: 0, dead: 0 },
        "{what}: the outbox tables are empty after the relay drained them"
    );
    let stats = app.store().stats().await.expect("store stats");
    assert_eq!(
        (stats.pending, stats.in_flight, stats.dead),
        (0, 0, 0),
        "{what}: store stats after the run: {stats:?}"
    );
}

async fn relay_until_idle<St: Store, Si: outbox_core::Sink>(
    store: St,
    sink: Si,
    what: &str,
) -> RelaySummary {
    let options = RelayOptions::default()
        .with_poll_interval(Duration::from_millis(50))
        .with_batch_size(BATCH_SIZE)
        .with_relay_id(RelayId::new(format!("e2e-{}", crate::unique_suffix())));
    let relay = Relay::new(store, sink, options).expect("valid relay options");
    tokio::time::timeout(RELAY_BOUND, relay.run_until_idle())
        .await
        .unwrap_or_else(|_| {
            panic!("{what}: the relay did not drain the outbox within {RELAY_BOUND:?}")
        })
}

/// Checks what a consumer received against the scenario:
/// - every committed event arrived, with its payload bytes, its id as the
///   broker's message id and in the event-id header, its type, its key and
///   all its headers (trace context included);
/// - nothing from a rolled-back transaction, nothing unknown;
/// - no duplicate unless `duplicates_allowed` (the relay saw failures);
/// - per key, the events arrived in commit order (on a partitioned broker:
///   all in one partition, in offset order).
pub fn check_delivery(
    scenario: &Scenario,
    received: &[Received],
    duplicates_allowed: bool,
    what: &str,
) {
    let expected: HashMap<EventId, &NewEvent> = scenario.committed().map(|e| (e.id(), e)).collect();
    let rolled_back: HashSet<EventId> = scenario.rolled_back().map(NewEvent::id).collect();

    let mut seen: HashMap<EventId, usize> = HashMap::new();
    let mut arrival_by_key: BTreeMap<String, Vec<EventId>> = BTreeMap::new();
    let mut partition_by_key: BTreeMap<String, HashSet<i32>> = BTreeMap::new();
    for (i, msg) in received.iter().enumerate() {
        let id = msg.message_id.unwrap_or_else(|| {
            panic!("{what}: message #{i} has no event id as message id: {msg:?}")
        });
        assert!(
            !rolled_back.contains(&id),
            "{what}: message #{i} is event {id} of the ROLLED-BACK transaction"
        );
        let event = expected
            .get(&id)
            .unwrap_or_else(|| panic!("{what}: message #{i} is not a committed event: {msg:?}"));
        assert_eq!(
            msg.event_id_header,
            Some(id),
            "{what}: event-id header of {id}"
        );
        assert_eq!(
            msg.payload,
            event.payload(),
            "{what}: payload bytes of {id}"
        );
        assert_eq!(
            msg.event_type.as_deref(),
            Some(event.event_type()),
            "{what}: event type of {id}"
        );
        assert_eq!(msg.key.as_deref(), event.key(), "{what}: key of {id}");
        for (name, value) in event.headers() {
            assert_eq!(
                msg.headers.get(name),
                Some(value),
                "{what}: header {name:?} of {id} (received headers: {:?})",
                msg.headers
            );
        }
        let count = seen.entry(id).or_default();
        *count += 1;
        if *count == 1 {
            let key = event.key().unwrap_or_default().to_owned();
            if let Some(p) = msg.partition {
                partition_by_key.entry(key.clone()).or_default().insert(p);
            }
            arrival_by_key.entry(key).or_default().push(id);
        }
    }

    let missing: Vec<EventId> = scenario
        .committed()
        .map(NewEvent::id)
        .filter(|id| !seen.contains_key(id))
        .collect();
    assert!(
        missing.is_empty(),
        "{what}: {} of {} committed events never arrived, e.g. {:?}",
        missing.len(),
        expected.len(),
        &missing[..missing.len().min(5)]
    );
    if !duplicates_allowed {
        let duplicated: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            duplicated.is_empty(),
            "{what}: duplicates without any failed delivery: {duplicated:?}"
        );
    }

    let mut committed_by_key: BTreeMap<String, Vec<EventId>> = BTreeMap::new();
    for e in scenario.committed() {
        committed_by_key
            .entry(e.key().unwrap_or_default().to_owned())
            .or_default()
            .push(e.id());
    }
    for (key, partitions) in &partition_by_key {
        assert_eq!(
            partitions.len(),
            1,
            "{what}: events of key {key:?} landed in several partitions: {partitions:?}"
        );
    }
    assert!(committed_by_key.len() > 1 && committed_by_key.values().all(|v| v.len() > 1));
    assert_eq!(
        arrival_by_key, committed_by_key,
        "{what}: per-key arrival order differs from commit order"
    );
}
