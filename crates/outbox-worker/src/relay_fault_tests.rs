//! Relay logic under faults a real database cannot be asked for on cue:
//! settle and claim errors (retryable or not), rejected settlements, a lease
//! lost while a batch waits, delivery timeouts, idle polling and the store's
//! wake-up. An in-memory [`Store`] with fault injection and tokio's paused
//! clock make each case deterministic; the same behaviours on real stores
//! are in `relay_tests.rs` and `tests/relay_reliability.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::test_support::logged;
use crate::{HandlerRegistry, Progress, Relay, RelayOptions, RelaySummary, SinkState};
use chrono::Utc;
use outbox_core::{
    Claim, ClaimRequest, DeliveryError, ErrorCode, Event, EventId, FencingToken, LastError,
    Outcome, Rejected, Resolution, Retryable, SettleReport, Settlement, Sink, Stats, Store,
};
use outbox_testkit::sink::{fast_retry, CountingSink};
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

// ------------------------------------------------------------- the store

#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
struct MemError {
    retryable: bool,
    message: &'static str,
}

impl Retryable for MemError {
    fn is_retryable(&self) -> bool {
        self.retryable
    }
}

fn busy() -> MemError {
    MemError {
        retryable: true,
        message: "database is busy",
    }
}

fn broken() -> MemError {
    MemError {
        retryable: false,
        message: "no such table: outbox_events",
    }
}

struct Row {
    event: Event,
    token: Option<FencingToken>,
    until: Instant,
    next_at: Instant,
}

#[derive(Default)]
struct State {
    rows: Vec<Row>,
    dead: Vec<(Event, LastError)>,
    claims: u32,
    settles: u32,
    renews: u32,
    claim_faults: VecDeque<MemError>,
    settle_faults: VecDeque<MemError>,
    /// Ids a settlement reports rejected (then dead-letters).
    reject: HashMap<EventId, String>,
    /// The n-th non-empty claim (1-based) loses its lease at its first
    /// renewal, as if the relay had stalled and another relay re-claimed it.
    steal_claim: Option<u32>,
    /// How many events of the stolen claim the other relay takes (all
    /// when `None`).
    steal_rows: Option<usize>,
    stolen: HashSet<FencingToken>,
    /// When each renewal that lost a lease answered.
    lost_at: Vec<Instant>,
    /// Renewals fail (the database does not answer) until then.
    renew_down_until: Option<Instant>,
    nonempty_claims: u32,
    tokens: Vec<FencingToken>,
    /// Tokens in the order their settlements arrived.
    settled: Vec<FencingToken>,
}

/// An in-memory store on tokio's clock (so a paused test clock drives it).
#[derive(Clone, Default)]
struct MemStore {
    state: Arc<Mutex<State>>,
    wake: Arc<Notify>,
}

impl MemStore {
    fn add(&self, n: usize, keys: usize) -> Vec<EventId> {
        let mut st = self.state.lock().unwrap();
        let now = Instant::now();
        (0..n)
            .map(|i| {
                let event = Event {
                    id: EventId::new(),
                    key: Some(format!("k{}", i % keys)),
                    event_type: "t".into(),
                    topic: "orders".into(),
                    payload: Vec::new(),
                    headers: Default::default(),
                    created_at: Utc::now(),
                    attempts: 0,
                    next_attempt_at: Utc::now(),
                    last_error: None,
                };
                let id = event.id;
                st.rows.push(Row {
                    event,
                    token: None,
                    until: now,
                    next_at: now,
                });
                id
            })
            .collect()
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().unwrap())
    }
}

impl Store for MemStore {
    type Error = MemError;

    fn claim(&self, req: &ClaimRequest) -> impl Future<Output = Result<Claim, MemError>> + Send {
        let result = self.with(|st| {
            st.claims += 1;
            if let Some(err) = st.claim_faults.pop_front() {
                return Err(err);
            }
            let now = Instant::now();
            let token = FencingToken::new();
            let until = now + req.lease;
            let mut blocked: HashSet<String> = HashSet::new();
            let mut events = Vec::new();
            for row in &mut st.rows {
                let key = row.event.shard_key();
                if blocked.contains(&key) {
                    continue;
                }
                let free = row.token.is_none() || row.until <= now;
                if !free || row.next_at > now || events.len() >= req.batch_size as usize {
                    blocked.insert(key);
                    continue;
                }
                row.token = Some(token);
                row.until = until;
                row.event.attempts += 1;
                events.push(row.event.clone());
            }
            if !events.is_empty() {
                st.nonempty_claims += 1;
                st.tokens.push(token);
                if st.steal_claim == Some(st.nonempty_claims) {
                    st.stolen.insert(token);
                }
            }
            Ok(Claim {
                token,
                lease_until: Utc::now() + req.lease,
                more: events.len() >= req.batch_size as usize,
                events,
            })
        });
        std::future::ready(result)
    }

    fn settle(
        &self,
        token: FencingToken,
        settlement: &Settlement,
    ) -> impl Future<Output = Result<SettleReport, MemError>> + Send {
        let result = self.with(|st| {
            st.settles += 1;
            if let Some(err) = st.settle_faults.pop_front() {
                return Err(err);
            }
            st.settled.push(token);
            let now = Instant::now();
            let mut report = SettleReport::default();
            for (id, resolution) in settlement.items() {
                let Some(pos) = st
                    .rows
                    .iter()
                    .position(|r| r.event.id == *id && r.token == Some(token))
                else {
                    report.fenced.push(*id);
                    continue;
                };
                report.applied += 1;
                if let Some(reason) = st.reject.remove(id) {
                    let row = st.rows.remove(pos);
                    let error = LastError {
                        code: ErrorCode::MANUAL,
                        message: reason.clone(),
                    };
                    st.dead.push((row.event, error));
                    report.rejected.push(Rejected { id: *id, reason });
                    continue;
                }
                match resolution {
                    Resolution::Delivered => {
                        st.rows.remove(pos);
                    }
                    Resolution::Retry { delay, error } => {
                        let row = &mut st.rows[pos];
                        row.token = None;
                        row.next_at = now + *delay;
                        row.event.last_error = Some(error.clone());
                    }
                    Resolution::Dead { error } => {
                        let row = st.rows.remove(pos);
                        st.dead.push((row.event, error.clone()));
                    }
                    Resolution::Released => {
                        let row = &mut st.rows[pos];
                        row.token = None;
                        row.next_at = now;
                        row.event.attempts -= 1;
                    }
                    _ => unreachable!("no other resolution exists yet"),
                }
            }
            Ok(report)
        });
        std::future::ready(result)
    }

    fn renew(
        &self,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<u64, MemError>> + Send {
        let held = self.with(|st| {
            st.renews += 1;
            let now = Instant::now();
            if st.renew_down_until.is_some_and(|until| now < until) {
                return Err(busy());
            }
            if st.stolen.remove(&token) {
                // Another relay took these events over (and its lease ran
                // out at once: they can be claimed again).
                let take = st.steal_rows.unwrap_or(usize::MAX);
                for row in st
                    .rows
                    .iter_mut()
                    .filter(|r| r.token == Some(token))
                    .take(take)
                {
                    row.token = Some(FencingToken::new());
                    row.until = now;
                    row.event.attempts -= 1;
                }
                st.lost_at.push(now);
            }
            let mut held = 0;
            for row in st.rows.iter_mut().filter(|r| r.token == Some(token)) {
                row.until = now + lease;
                held += 1;
            }
            Ok(held)
        });
        std::future::ready(held)
    }

    fn stats(&self) -> impl Future<Output = Result<Stats, MemError>> + Send {
        let stats = self.with(|st| {
            let now = Instant::now();
            let in_flight = st
                .rows
                .iter()
                .filter(|r| r.token.is_some() && r.until > now)
                .count() as u64;
            Stats {
                pending: st.rows.len() as u64 - in_flight,
                in_flight,
                dead: st.dead.len() as u64,
                oldest_pending_age: None,
            }
        });
        std::future::ready(Ok(stats))
    }

    fn wakeup(&self) -> impl Future<Output = ()> + Send {
        let wake = Arc::clone(&self.wake);
        async move { wake.notified().await }
    }
}

// ------------------------------------------------------------- the sinks

fn options() -> RelayOptions {
    RelayOptions::default()
        .with_poll_interval(Duration::from_millis(200))
        .with_lock_timeout(Duration::from_secs(1))
        .with_retry(fast_retry(4))
}

async fn idle<Si: Sink>(relay: Relay<MemStore, Si>) -> RelaySummary {
    tokio::time::timeout(Duration::from_secs(3600), relay.run_until_idle())
        .await
        .expect("the relay did not drain the store")
}

/// Captures the log lines written while it is the default subscriber.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        let writer = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    fn lines(&self, level: &str, needle: &str) -> usize {
        String::from_utf8(self.0.lock().unwrap().clone())
            .unwrap()
            .lines()
            .filter(|l| l.contains(level) && l.contains(needle))
            .count()
    }
}

// ------------------------------------------------------------- the tests

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_retryable_settle_error_is_retried_and_the_batch_recorded_once() {
    let store = MemStore::default();
    let ids = store.add(3, 3);
    store.with(|st| st.settle_faults.extend([busy(), busy()]));
    let sink = CountingSink::default();
    let summary = idle(Relay::new(store.clone(), sink.clone(), options()).unwrap()).await;
    assert_eq!(summary.delivered, 3);
    assert_eq!(store.with(|st| st.settles), 3, "one settle, retried twice");
    assert!(ids.iter().all(|id| sink.counts()[id] == 1));
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_non_retryable_settle_error_is_logged_once_and_not_retried() {
    let captured = Captured::default();
    let _guard = captured.install();
    let store = MemStore::default();
    let ids = store.add(2, 2);
    store.with(|st| st.settle_faults.push_back(broken()));
    let sink = CountingSink::default();
    let summary = idle(Relay::new(store.clone(), sink.clone(), options()).unwrap()).await;
    // The failed settlement was not retried: the events came back after
    // their lease and were delivered (at least once) and settled then.
    assert_eq!(store.with(|st| st.settles), 2);
    assert!(ids.iter().all(|id| sink.counts()[id] == 2));
    assert_eq!(summary.delivered, 2);
    assert_eq!(captured.lines("ERROR", "not retryable"), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn settle_retries_stop_when_the_lease_would_run_out() {
    let store = MemStore::default();
    let ids = store.add(2, 2);
    // 1 s lease: retries at +50, +100, +200, +400 ms; the next (800 ms)
    // would outlive the lease, so the 5th error ends the loop.
    store.with(|st| st.settle_faults.extend(std::iter::repeat_n(busy(), 5)));
    let sink = CountingSink::default();
    let summary = idle(Relay::new(store.clone(), sink.clone(), options()).unwrap()).await;
    assert_eq!(store.with(|st| st.settles), 6);
    assert!(
        ids.iter().all(|id| sink.counts()[id] == 2),
        "{:?}",
        sink.counts()
    );
    assert_eq!(summary.delivered, 2);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn claim_errors_back_off_and_a_non_retryable_one_logs_error_once() {
    let captured = Captured::default();
    let _guard = captured.install();
    let store = MemStore::default();
    store.add(1, 1);
    store.with(|st| {
        st.claim_faults
            .extend([broken(), broken(), broken(), busy()])
    });
    let summary =
        idle(Relay::new(store.clone(), CountingSink::default(), options()).unwrap()).await;
    assert_eq!(summary.delivered, 1);
    assert_eq!(captured.lines("ERROR", "claim failed"), 1);
    assert_eq!(captured.lines("WARN", "claim still failing"), 2);
    assert_eq!(captured.lines("WARN", "claim failed; backing off"), 1);
}

/// A database that stays away (an outage, a failover waiting for its
/// primary) is said at WARN once a minute, not on every backoff step.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_streak_of_retryable_claim_errors_warns_once_a_minute() {
    let captured = Captured::default();
    let _guard = captured.install();
    let store = MemStore::default();
    store.add(1, 1);
    // Backoff 250 ms doubling to a 30 s cap, each delay jittered to
    // between half and all of it: the 12th error comes 76-152 s of
    // (paused) time after the first, so the streak is said at its start
    // and once or twice more, a minute apart, instead of 12 times.
    store.with(|st| st.claim_faults.extend(std::iter::repeat_n(busy(), 12)));
    let summary =
        idle(Relay::new(store.clone(), CountingSink::default(), options()).unwrap()).await;
    assert_eq!(summary.delivered, 1);
    assert_eq!(store.with(|st| st.claim_faults.len()), 0);
    let warned = captured.lines("WARN", "claim failed; backing off");
    assert!(
        (2..=3).contains(&warned),
        "{warned} WARN lines for 12 errors"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn rejected_events_are_reported_with_the_reason() {
    let captured = Captured::default();
    let _guard = captured.install();
    let store = MemStore::default();
    let ids = store.add(3, 3);
    store.with(|st| {
        st.reject
            .insert(ids[1], "dead letter id already exists".into())
    });
    let (relay, log) =
        logged(Relay::new(store.clone(), CountingSink::default(), options()).unwrap());
    let summary = idle(relay).await;
    assert_eq!((summary.delivered, summary.rejected), (2, 1));
    assert!(log.lock().unwrap().iter().any(|p| matches!(p,
        Progress::Rejected { id, reason } if *id == ids[1] && reason.contains("already exists"))));
    assert_eq!(captured.lines("WARN", "dead letter id already exists"), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn leases_are_renewed_while_a_slow_batch_is_delivered() {
    let store = MemStore::default();
    let ids = store.add(4, 4);
    // 2.5 s per batch (within the delivery timeout, the lease), 3 s lease:
    // the batch claimed ahead is held 5 s, through the first delivery.
    let sink = CountingSink::default().with_delay(Duration::from_millis(2500));
    let opts = options()
        .with_batch_size(2)
        .with_lock_timeout(Duration::from_secs(3));
    let summary = idle(Relay::new(store.clone(), sink.clone(), opts).unwrap()).await;
    assert_eq!((summary.delivered, summary.lease_lost), (4, 0));
    assert_eq!(summary.deliveries_expired, 0);
    assert!(ids.iter().all(|id| sink.counts()[id] == 1));
    // The first batch held 2.5 s, the second 5 s: renewed every second
    // (at 1 and 2 s both, at 3 and 4 s the second).
    assert!(store.with(|st| st.renews) >= 6);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_prefetched_batch_whose_lease_was_lost_is_never_delivered() {
    let captured = Captured::default();
    let _guard = captured.install();
    let store = MemStore::default();
    let ids = store.add(4, 4);
    // The second claim (made ahead, in drain mode) loses its lease.
    store.with(|st| st.steal_claim = Some(2));
    let sink = CountingSink::default().with_delay(Duration::from_millis(1500));
    let opts = options()
        .with_batch_size(2)
        .with_lock_timeout(Duration::from_secs(2));
    let (relay, log) = logged(Relay::new(store.clone(), sink.clone(), opts).unwrap());
    let summary = idle(relay).await;
    // The stolen events stayed with "the other relay" (nobody here), so this
    // relay delivered them only after that lease ran out: once each.
    assert!(
        ids.iter().all(|id| sink.counts().get(id) == Some(&1)),
        "{:?}",
        sink.counts()
    );
    assert_eq!(summary.lease_lost, 2);
    assert!(log
        .lock()
        .unwrap()
        .iter()
        .any(|p| matches!(p, Progress::LeaseLost { ids } if ids.len() == 2)));
    assert_eq!(
        captured.lines("WARN", "lease lost on the batch claimed ahead"),
        1
    );
    assert_eq!(summary.deliveries_stopped, 1);
}

/// Sends the events of a batch one at a time, `per_event` apart, and
/// records each send: (call number, when, event).
#[derive(Clone)]
struct OneByOne {
    per_event: Duration,
    calls: Arc<AtomicU32>,
    sent: Arc<Mutex<Vec<(u32, Instant, EventId)>>>,
}

impl OneByOne {
    fn new(per_event: Duration) -> Self {
        Self {
            per_event,
            calls: Arc::default(),
            sent: Arc::default(),
        }
    }

    fn sent(&self) -> Vec<(u32, Instant, EventId)> {
        self.sent.lock().unwrap().clone()
    }
}

impl Sink for OneByOne {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let mut outcomes = Vec::with_capacity(events.len());
        for e in events {
            tokio::time::sleep(self.per_event).await;
            self.sent.lock().unwrap().push((call, Instant::now(), e.id));
            outcomes.push(Outcome::Delivered);
        }
        outcomes
    }
}

/// The sum of counter `name` with label `stage` = `stage`.
fn stopped_counter(
    snapshot: &[(
        metrics_util::CompositeKey,
        Option<metrics::Unit>,
        Option<metrics::SharedString>,
        metrics_util::debugging::DebugValue,
    )],
    stage: &str,
) -> u64 {
    snapshot
        .iter()
        .filter(|(k, _, _, _)| {
            k.key().name() == crate::metrics::LEASE_LOST_DELIVERIES_STOPPED
                && k.key()
                    .labels()
                    .any(|l| l.key() == "stage" && l.value() == stage)
        })
        .map(|(_, _, _, v)| match v {
            metrics_util::debugging::DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum()
}

/// The lease of the batch being delivered is lost (a renewal finds the
/// events taken over) while a slow sink sends it one event at a time: the
/// delivery stops at once, nothing more of that batch reaches the sink, the
/// batch is not settled, the stop is counted and logged once, and the relay
/// goes on claiming (and delivers the events again once they are free).
#[test]
fn a_lost_lease_stops_the_delivery_in_flight() {
    use metrics_util::debugging::DebuggingRecorder;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let captured = Captured::default();
    let _guard = captured.install();
    let store = MemStore::default();
    let ids = store.add(4, 4);
    // The first claim loses its lease at its first renewal (1 s lease:
    // renewed after 333 ms), while the sink sends one event every 200 ms.
    store.with(|st| st.steal_claim = Some(1));
    let sink = OneByOne::new(Duration::from_millis(200));
    let (summary, log) = metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let (relay, log) = logged(Relay::new(store.clone(), sink.clone(), options()).unwrap());
            (idle(relay).await, log)
        })
    });

    let lost_at = store.with(|st| st.lost_at.clone());
    assert_eq!(lost_at.len(), 1, "one lease lost");
    let sent = sink.sent();
    // The first delivery (call 0) sent the first event before the loss and
    // nothing after it.
    let first: Vec<_> = sent.iter().filter(|(call, _, _)| *call == 0).collect();
    assert_eq!(first.len(), 1, "{sent:?}");
    assert!(first.iter().all(|(_, at, _)| *at < lost_at[0]), "{sent:?}");
    assert_eq!(first[0].2, ids[0]);
    // No event of the stopped batch was sent between the loss and the
    // relay's next claim of it (every later send is a later call, after
    // the loss).
    assert!(
        sent.iter()
            .filter(|(_, at, _)| *at >= lost_at[0])
            .all(|(call, _, _)| *call > 0),
        "{sent:?}"
    );
    // Not settled: the stopped claim's token never reached the store.
    let (tokens, settled, claims) =
        store.with(|st| (st.tokens.clone(), st.settled.clone(), st.claims));
    assert!(!settled.contains(&tokens[0]), "{settled:?}");
    // The relay went on claiming and delivered every event afterwards.
    assert!(claims >= 2, "{claims} claims");
    for id in &ids {
        assert!(
            sent.iter()
                .any(|(call, at, e)| e == id && *call > 0 && *at > lost_at[0]),
            "{id} not delivered after the loss: {sent:?}"
        );
    }
    assert_eq!(summary.delivered, 4);
    assert_eq!(summary.deliveries_stopped, 1);
    assert_eq!(summary.lease_lost, 4);
    assert!(log
        .lock()
        .unwrap()
        .iter()
        .any(|p| matches!(p, Progress::LeaseLost { ids: lost } if lost.len() == 4)));
    assert_eq!(captured.lines("WARN", "delivery stopped"), 1);
    assert_eq!(
        captured.lines("WARN", "lease lost"),
        1,
        "one WARN per batch"
    );
    let snapshot = snapshotter.snapshot().into_vec();
    assert_eq!(stopped_counter(&snapshot, "delivering"), 1);
    assert_eq!(stopped_counter(&snapshot, "claimed_ahead"), 0);
}

/// A partial loss (the claim still holds some events): the delivery stops
/// all the same; the events still held are released at once (not after
/// the lock timeout) and the ones taken over are fenced, with one WARN.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_partly_lost_lease_stops_the_delivery_and_releases_what_it_still_holds() {
    let captured = Captured::default();
    let _guard = captured.install();
    let store = MemStore::default();
    let ids = store.add(4, 4);
    store.with(|st| {
        st.steal_claim = Some(1);
        st.steal_rows = Some(2);
    });
    let sink = OneByOne::new(Duration::from_millis(200));
    let (relay, log) = logged(Relay::new(store.clone(), sink.clone(), options()).unwrap());
    let summary = idle(relay).await;
    let lost_at = store.with(|st| st.lost_at[0]);
    let sent = sink.sent();
    assert_eq!(
        sent.iter().filter(|(call, _, _)| *call == 0).count(),
        1,
        "{sent:?}"
    );
    assert!(sent
        .iter()
        .filter(|(_, at, _)| *at >= lost_at)
        .all(|(call, _, _)| *call > 0));
    assert_eq!(summary.deliveries_stopped, 1);
    assert_eq!(summary.lease_lost, 2, "the two taken over are fenced");
    assert_eq!(summary.delivered, 4);
    // The two still held were released by the stopped batch's settlement
    // (attempt not counted).
    let log = log.lock().unwrap().clone();
    assert!(log
        .iter()
        .any(|p| matches!(p, Progress::Released { ids: r } if r.len() == 2)));
    for id in &ids {
        assert!(log
            .iter()
            .any(|p| matches!(p, Progress::Delivered { id: d, attempts: 1, .. } if d == id)));
    }
    // Released, not left leased until the lock timeout: the next claim
    // took all four again (the two taken over were free at once).
    assert_eq!(
        sent.iter().filter(|(call, _, _)| *call == 1).count(),
        4,
        "{sent:?}"
    );
    assert_eq!(
        captured.lines("WARN", "lease lost"),
        1,
        "one WARN per batch"
    );
}

/// Renewals fail (the database does not answer) while a slow sink sends
/// its batch one event at a time: the relay stops the delivery at the lease
/// end its claim established, by its own clock (claim sent + 1 s lease -
/// 280 ms margin), releases the batch, and never hands the batch it claimed
/// ahead to the sink once that one's lease ended too. Once renewals work
/// again every event is delivered, each at most once per lease.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_lease_ends_by_the_relays_clock_when_renewals_fail() {
    let captured = Captured::default();
    let _guard = captured.install();
    let store = MemStore::default();
    let ids = store.add(4, 4);
    let t0 = Instant::now();
    let outage = Duration::from_secs(5);
    store.with(|st| st.renew_down_until = Some(t0 + outage));
    // 400 ms per event: a batch of two takes 800 ms, past the local lease
    // end (720 ms after its claim) when no renewal succeeds.
    let sink = OneByOne::new(Duration::from_millis(400));
    let (relay, log) =
        logged(Relay::new(store.clone(), sink.clone(), options().with_batch_size(2)).unwrap());
    let summary = idle(relay).await;

    let sent = sink.sent();
    // While renewals failed, no delivery sent more than its first event
    // (the second would have gone at 800 ms, past its lease end).
    let mut per_call: HashMap<u32, Vec<Instant>> = HashMap::new();
    for (call, at, _) in &sent {
        per_call.entry(*call).or_default().push(*at);
    }
    for (call, times) in &per_call {
        if times[0] < t0 + outage {
            assert_eq!(
                times.iter().filter(|at| **at < t0 + outage).count(),
                1,
                "call {call} sent past its lease end: {sent:?}"
            );
        }
    }
    // Stopped by the clock, both in delivery and claimed ahead (drain
    // mode's overlapping claim of the other two keys).
    assert!(summary.deliveries_expired >= 2, "{summary:?}");
    assert_eq!(summary.deliveries_stopped, 0, "no renewal reported a loss");
    assert!(
        captured.lines("WARN", "lease ended by this relay's clock") >= 1,
        "the delivery stop is logged"
    );
    assert!(
        captured.lines("WARN", "before it went to the sink") >= 1,
        "the batch claimed ahead is given back, not delivered"
    );
    // Released, not failed: each event delivered once, at its first attempt.
    assert_eq!(summary.delivered, 4);
    assert_eq!((summary.retried, summary.dead), (0, 0));
    let log = log.lock().unwrap().clone();
    for id in &ids {
        assert!(log
            .iter()
            .any(|p| matches!(p, Progress::Delivered { id: d, attempts: 1, .. } if d == id)));
    }
    assert!(log.iter().any(|p| matches!(p, Progress::Released { .. })));
}

/// Counts how many handler futures were dropped before they finished.
struct DropGuard(Arc<AtomicU32>);

impl Drop for DropGuard {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_delivery_that_outlives_the_timeout_is_cancelled_and_released() {
    let captured = Captured::default();
    let _guard = captured.install();
    let store = MemStore::default();
    let ids = store.add(3, 3);
    let hang = Arc::new(AtomicBool::new(true));
    let dropped = Arc::new(AtomicU32::new(0));
    let (h, d) = (Arc::clone(&hang), Arc::clone(&dropped));
    let handlers = HandlerRegistry::new().with_handler("t", move |_| {
        let hang = h.swap(false, Ordering::SeqCst);
        let guard = DropGuard(Arc::clone(&d));
        async move {
            if hang {
                std::future::pending::<()>().await;
            }
            drop(guard);
            Ok(())
        }
    });
    let opts = options()
        .with_lock_timeout(Duration::from_secs(10))
        .with_delivery_timeout(Duration::from_secs(5));
    let (relay, log) = logged(Relay::new(store.clone(), handlers, opts).unwrap());
    let summary = idle(relay).await;
    assert_eq!(summary.delivery_timeouts, 1);
    assert_eq!(summary.delivered, 3);
    assert_eq!((summary.retried, summary.dead), (0, 0));
    // The hanging handler's task was aborted, not left running; its guard
    // and the two finished ones make three drops... plus one per redelivery.
    tokio::task::yield_now().await;
    assert!(dropped.load(Ordering::SeqCst) >= 4);
    let log = log.lock().unwrap().clone();
    assert!(log
        .iter()
        .any(|p| matches!(p, Progress::Released { ids: r } if r.len() == 3)));
    // Released, not failed: every event was delivered at its first attempt.
    for id in &ids {
        assert!(log
            .iter()
            .any(|p| matches!(p, Progress::Delivered { id: d, attempts: 1, .. } if d == id)));
    }
    assert_eq!(captured.lines("WARN", "DELIVERY_TIMEOUT"), 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn idle_polling_starts_fast_and_backs_off_to_the_poll_interval() {
    let store = MemStore::default();
    let opts = options().with_poll_interval(Duration::from_secs(1));
    let sink = CountingSink::default();
    let relay = Relay::new(store.clone(), sink.clone(), opts).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async {
        let _ = stopped.await;
    }));
    tokio::time::sleep(Duration::from_secs(10)).await;
    // 1, 2, 4 ... 512 ms, then every second: about 20 claims in 10 s
    // (a fixed 1 s poll would make 10, a fixed 1 ms one 10,000).
    let claims = store.with(|st| st.claims);
    assert!((17..=23).contains(&claims), "{claims} claims");

    // Without a wake-up, a new event waits at most one poll interval.
    let ids = store.add(1, 1);
    let added = Instant::now();
    while sink.counts().is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(added.elapsed() <= Duration::from_secs(1));
    stop.send(()).unwrap();
    let summary = run.await.unwrap();
    assert_eq!(summary.delivered, 1);
    assert_eq!(sink.counts()[&ids[0]], 1);
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_store_wakeup_cuts_the_idle_wait_short() {
    let store = MemStore::default();
    // A poll interval of an hour: only the wake-up can explain a quick claim.
    let opts = options().with_poll_interval(Duration::from_secs(3600));
    let sink = CountingSink::default();
    let relay = Relay::new(store.clone(), sink.clone(), opts).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run(async {
        let _ = stopped.await;
    }));
    // Idle long enough that the next poll is many minutes away.
    tokio::time::sleep(Duration::from_secs(1200)).await;
    store.add(1, 1);
    let added = Instant::now();
    store.wake.notify_one();
    while sink.counts().is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        added.elapsed() < Duration::from_secs(1),
        "{:?}",
        added.elapsed()
    );
    stop.send(()).unwrap();
    assert_eq!(run.await.unwrap().delivered, 1);
}

/// Down for the first `down` calls: every event unavailable.
#[derive(Clone)]
struct DownFor {
    down: Arc<AtomicU32>,
}

impl Sink for DownFor {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        let left = self.down.load(Ordering::SeqCst);
        if left > 0 {
            self.down.store(left - 1, Ordering::SeqCst);
            let e = DeliveryError::unavailable(ErrorCode::PUBLISH_CONNECTION_LOST, "refused");
            return vec![Outcome::Failed(e); events.len()];
        }
        vec![Outcome::Delivered; events.len()]
    }
}

/// When the sink goes down with a prefetched batch in hand, the prefetched
/// (later) batch is given back before the failed one is settled: newest
/// first, so a store that reads in order rewinds over both.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn on_a_sink_outage_the_prefetched_batch_is_settled_first() {
    let store = MemStore::default();
    store.add(8, 8);
    let sink = DownFor {
        down: Arc::new(AtomicU32::new(1)),
    };
    let opts = options().with_batch_size(4);
    let summary = idle(Relay::new(store.clone(), sink, opts).unwrap()).await;
    assert_eq!(summary.delivered, 8);
    let (tokens, settled) = store.with(|st| (st.tokens.clone(), st.settled.clone()));
    // Claim 1 (delivered to the down sink) and claim 2 (prefetched with it).
    let (first, second) = (tokens[0], tokens[1]);
    let at = |t| settled.iter().position(|s| *s == t).unwrap();
    assert!(
        at(second) < at(first),
        "prefetched {second} settled after the failed {first}: {settled:?}"
    );
}

#[test]
fn the_sink_state_is_a_gauge_and_transitions_are_counted() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use metrics_util::MetricKind;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let (summary, states, health) = metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let store = MemStore::default();
            store.add(6, 3);
            let sink = DownFor {
                down: Arc::new(AtomicU32::new(3)),
            };
            let relay = Relay::new(store, sink, options()).unwrap();
            let health = relay.sink_health();
            let (relay, log) = logged(relay);
            let summary = idle(relay).await;
            let states: Vec<SinkState> = log
                .lock()
                .unwrap()
                .iter()
                .filter_map(|p| match p {
                    Progress::SinkStateChanged { to, .. } => Some(*to),
                    _ => None,
                })
                .collect();
            (summary, states, health)
        })
    });
    assert_eq!(health.state(), SinkState::Closed);
    assert_eq!(health.status().outages, 1);
    assert_eq!(
        health.status().last_error.map(|e| e.code().clone()),
        Some(ErrorCode::PUBLISH_CONNECTION_LOST)
    );
    assert_eq!(summary.sink_outages, 1);
    assert_eq!(summary.delivered, 6);
    assert_eq!(
        states,
        vec![
            SinkState::Open,
            SinkState::HalfOpen,
            SinkState::Open,
            SinkState::HalfOpen,
            SinkState::Open,
            SinkState::HalfOpen,
            SinkState::Closed
        ]
    );

    let snapshot = snapshotter.snapshot().into_vec();
    let transitions = |to: &str| -> u64 {
        snapshot
            .iter()
            .filter(|(k, _, _, _)| {
                k.kind() == MetricKind::Counter
                    && k.key().name() == crate::metrics::SINK_STATE_TRANSITIONS
                    && k.key().labels().any(|l| l.key() == "to" && l.value() == to)
            })
            .map(|(_, _, _, v)| match v {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    };
    assert_eq!(transitions("open"), 3);
    assert_eq!(transitions("half_open"), 3);
    assert_eq!(transitions("closed"), 1);
    let gauge = snapshot
        .iter()
        .find(|(k, _, _, _)| k.key().name() == crate::metrics::SINK_STATE)
        .map(|(_, _, _, v)| v);
    assert!(
        matches!(gauge, Some(DebugValue::Gauge(g)) if g.into_inner() == 0.0),
        "{gauge:?}"
    );
}

/// Two named relays over two stores, sharing one sink, in one process:
/// every metric each records carries its own `store` label (so their
/// counters are told apart), an unnamed relay's carry no `store` label, and
/// a named relay's log lines are in its `relay{store=...}` span.
#[test]
fn named_relays_label_their_metrics_and_logs_with_the_store_name() {
    use crate::StoreName;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use metrics_util::MetricKind;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let captured = Captured::default();
    let _guard = captured.install();
    let (a, b, plain) = (
        MemStore::default(),
        MemStore::default(),
        MemStore::default(),
    );
    a.add(3, 3);
    b.add(5, 5);
    plain.add(2, 2);
    // One settle of store a fails once (a WARN inside its span).
    a.with(|st| st.settle_faults.push_back(busy()));
    let sink = Arc::new(CountingSink::default());
    let (sa, sb, sp) = metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let named = |store: &MemStore, name: &str| {
                Relay::new(store.clone(), Arc::clone(&sink), options())
                    .unwrap()
                    .with_store_name(StoreName::new(name).unwrap())
            };
            let (ra, rb) = (named(&a, "tenant-a"), named(&b, "tenant_b"));
            assert_eq!(ra.store_name().map(StoreName::as_str), Some("tenant-a"));
            let rp = Relay::new(plain.clone(), Arc::clone(&sink), options()).unwrap();
            tokio::join!(idle(ra), idle(rb), idle(rp))
        })
    });
    assert_eq!((sa.delivered, sb.delivered, sp.delivered), (3, 5, 2));
    assert_eq!(sink.counts().len(), 10, "one sink got every event");

    let snapshot = snapshotter.snapshot().into_vec();
    let store_of = |key: &metrics_util::CompositeKey| {
        key.key()
            .labels()
            .find(|l| l.key() == "store")
            .map(|l| l.value().to_owned())
    };
    let delivered = |store: Option<&str>| -> u64 {
        snapshot
            .iter()
            .filter(|(k, _, _, _)| {
                k.kind() == MetricKind::Counter
                    && k.key().name() == crate::metrics::EVENTS_DELIVERED
                    && store_of(k).as_deref() == store
            })
            .map(|(_, _, _, v)| match v {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    };
    assert_eq!(delivered(Some("tenant-a")), 3);
    assert_eq!(delivered(Some("tenant_b")), 5);
    assert_eq!(delivered(None), 2);
    // Every metric is labelled: each name a named relay records comes with
    // its store label, none without one but the unnamed relay's.
    for name in [
        crate::metrics::EVENTS_DELIVERED,
        crate::metrics::LAG_SECONDS,
        crate::metrics::SHARD_LAG_SECONDS,
        crate::metrics::SINK_STATE,
        crate::metrics::EVENT_PROCESS_SECONDS,
    ] {
        let stores: HashSet<Option<String>> = snapshot
            .iter()
            .filter(|(k, _, _, _)| k.key().name() == name)
            .map(|(k, _, _, _)| store_of(k))
            .collect();
        let want: HashSet<Option<String>> = [Some("tenant-a"), Some("tenant_b"), None]
            .into_iter()
            .map(|s| s.map(str::to_owned))
            .collect();
        assert_eq!(stores, want, "{name}");
    }
    let settle_errors: Vec<Option<String>> = snapshot
        .iter()
        .filter(|(k, _, _, _)| {
            k.key().name() == crate::metrics::STORE_ERRORS
                && k.key()
                    .labels()
                    .any(|l| l.key() == "op" && l.value() == "settle")
        })
        .filter(|(_, _, _, v)| matches!(v, DebugValue::Counter(n) if *n > 0))
        .map(|(k, _, _, _)| store_of(k))
        .collect();
    assert_eq!(settle_errors, vec![Some("tenant-a".to_owned())]);
    assert_eq!(
        captured.lines("WARN", "relay{store=tenant-a}"),
        1,
        "the settle retry's WARN is in the relay's span: {}",
        String::from_utf8_lossy(&captured.0.lock().unwrap())
    );
}
