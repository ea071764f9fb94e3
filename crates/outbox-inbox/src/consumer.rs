//! [`Inbox`]: the consumer loop. Receives from a [`Source`], hands each
//! message to the lane of its key, handles a lane's messages in one
//! transaction of the [`InboxStore`] (record + handler, commit), then
//! acknowledges them at the broker; a retry loop works through the messages
//! held back in the store.

use crate::handler::{run_handler, Failure, Handler};
use crate::metrics as m;
use crate::options::InboxOptions;
use crate::source::{reconnect_delay, Position, RawMessage, Source};
use crate::store::{Hold, InboxRetentionStore, InboxSchema, InboxStore, StoreError, Verdict};
use chrono::Utc;
use outbox_core::{fnv1a_64, ErrorCode, EventId, HandlerError, InboundMessage, Retryable};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};
use tracing::Instrument;

/// How long the loop waits for the broker while messages are in flight, so
/// that finished messages are acknowledged promptly.
const ACK_TICK: Duration = Duration::from_millis(5);

/// Counts of what the inbox did since it started.
#[derive(Debug, Default)]
pub struct InboxStats {
    handled: AtomicU64,
    duplicates: AtomicU64,
    parked: AtomicU64,
    retries: AtomicU64,
    dead: AtomicU64,
    undecodable: AtomicU64,
    faults: AtomicU64,
    out_of_order: AtomicU64,
}

/// A copy of [`InboxStats`] at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InboxCounts {
    /// Handlers run and committed.
    pub handled: u64,
    /// Copies recognised and only acknowledged.
    pub duplicates: u64,
    /// Messages parked behind an earlier one of their key.
    pub parked: u64,
    /// Failed attempts to be retried.
    pub retries: u64,
    /// Messages moved to the dead letters (undecodable ones included).
    pub dead: u64,
    /// Messages that were not outbox events (dead-lettered as `UNDECODABLE`).
    pub undecodable: u64,
    /// Database or broker faults retried (no attempt counted).
    pub faults: u64,
    /// Messages applied after a later message of their key, by the broker's
    /// position (see [`metrics::OUT_OF_ORDER`](crate::metrics::OUT_OF_ORDER)).
    pub out_of_order: u64,
}

impl InboxStats {
    /// The counts now.
    pub fn counts(&self) -> InboxCounts {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        InboxCounts {
            handled: g(&self.handled),
            duplicates: g(&self.duplicates),
            parked: g(&self.parked),
            retries: g(&self.retries),
            dead: g(&self.dead),
            undecodable: g(&self.undecodable),
            faults: g(&self.faults),
            out_of_order: g(&self.out_of_order),
        }
    }
}

/// Why [`Inbox::run`] stopped with an error: `E` is the store's
/// [`InboxSchema::Error`] ([`StoreError`] for the stores of this crate).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError<E = StoreError> {
    /// The store could not be prepared (migration, configuration).
    #[error(transparent)]
    Store(E),
    /// The source is misconfigured.
    #[error(transparent)]
    Source(#[from] crate::source::SourceError),
}

/// How many keys [`OrderWatch`] remembers; past it, it starts afresh.
const WATCHED_KEYS: usize = 100_000;

/// The broker position of the last message applied per key, to notice a
/// key's message applied after a later one (see
/// [`metrics::OUT_OF_ORDER`](crate::metrics::OUT_OF_ORDER)). Memory is
/// bounded: past [`WATCHED_KEYS`] keys it forgets them all (a reordering
/// across that moment goes unnoticed).
#[derive(Debug, Default)]
struct OrderWatch {
    last: Mutex<HashMap<String, Position>>,
}

impl OrderWatch {
    /// Records that `key`'s message at `at` was applied; returns the later
    /// position of the key applied before it, when there was one.
    fn applied(&self, key: &str, at: Position) -> Option<Position> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(prev) = last.get_mut(key) {
            if at.is_before(prev) {
                return Some(*prev);
            }
            *prev = at;
            return None;
        }
        if last.len() >= WATCHED_KEYS {
            last.clear();
        }
        last.insert(key.to_owned(), at);
        None
    }
}

/// The consumer: a store, a handler and options. Cheap to clone.
pub struct Inbox<St: InboxStore, H: Handler<St::Db>> {
    store: St,
    handler: Arc<H>,
    options: InboxOptions,
    stats: Arc<InboxStats>,
    order: Arc<OrderWatch>,
}

impl<St: InboxStore, H: Handler<St::Db>> Clone for Inbox<St, H> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            handler: self.handler.clone(),
            options: self.options.clone(),
            stats: self.stats.clone(),
            order: self.order.clone(),
        }
    }
}

impl<St: InboxStore + std::fmt::Debug, H: Handler<St::Db>> std::fmt::Debug for Inbox<St, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("store", &self.store)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

struct Job {
    messages: Vec<InboundMessage>,
    tickets: Vec<u64>,
    /// The broker's position of each message, where it tells.
    positions: Vec<Option<Position>>,
}

struct Done {
    acked: Vec<u64>,
    abandoned: usize,
}

struct Shared<St: InboxStore, H: Handler<St::Db>> {
    inbox: Inbox<St, H>,
    stopping: AtomicBool,
    stop: Notify,
}

impl<St: InboxStore, H: Handler<St::Db>> Shared<St, H> {
    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Sleeps `d`, or less when the inbox stops; returns whether it stops.
    async fn pause(&self, d: Duration) -> bool {
        if self.stopping() {
            return true;
        }
        tokio::select! {
            () = tokio::time::sleep(d) => self.stopping(),
            () = self.stop.notified() => true,
        }
    }
}

impl<St: InboxStore, H: Handler<St::Db>> Inbox<St, H> {
    /// An inbox on `store` that applies messages with `handler`, default
    /// options.
    pub fn new(store: St, handler: H) -> Self {
        Self {
            store,
            handler: Arc::new(handler),
            options: InboxOptions::default(),
            stats: Arc::new(InboxStats::default()),
            order: Arc::new(OrderWatch::default()),
        }
    }

    /// The same inbox with `options`.
    pub fn with_options(mut self, options: InboxOptions) -> Self {
        self.options = options;
        self
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.store
    }

    /// What it did so far.
    pub fn stats(&self) -> InboxCounts {
        self.stats.counts()
    }

    fn label(&self) -> [(&'static str, String); 1] {
        [("consumer", self.store.consumer().to_owned())]
    }
}

/// Running: the store also prepares its tables ([`InboxSchema`]) and keeps
/// its records' retention ([`InboxRetentionStore`]).
impl<St, H> Inbox<St, H>
where
    St: InboxStore + InboxSchema + InboxRetentionStore,
    H: Handler<St::Db>,
{
    /// Runs until `shutdown` completes: migrates the store, then receives,
    /// handles and acknowledges. On shutdown, lane transactions in flight
    /// get the shutdown grace to finish and be acknowledged; what is left is
    /// not acknowledged (the broker redelivers it; the inbox absorbs it).
    /// Returns the counts of the run. Broker and database faults are retried
    /// for as long as it runs; only a misconfigured source ends it early.
    pub async fn run<S: Source>(
        &self,
        source: S,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<InboxCounts, InboxError<<St as InboxSchema>::Error>> {
        self.run_inner(source, shutdown, None).await
    }

    /// Like [`Inbox::run`], but stops by itself once nothing arrived for
    /// `idle` and nothing is in flight (messages held back for a later
    /// retry are not waited for). For batch jobs, examples and tests.
    pub async fn run_until_idle<S: Source>(
        &self,
        source: S,
        idle: Duration,
    ) -> Result<InboxCounts, InboxError<<St as InboxSchema>::Error>> {
        self.run_inner(source, std::future::pending(), Some(idle))
            .await
    }

    async fn run_inner<S: Source>(
        &self,
        mut source: S,
        shutdown: impl Future<Output = ()> + Send + 'static,
        idle: Option<Duration>,
    ) -> Result<InboxCounts, InboxError<<St as InboxSchema>::Error>> {
        let shared = Arc::new(Shared {
            inbox: self.clone(),
            stopping: AtomicBool::new(false),
            stop: Notify::new(),
        });
        // A database that is down or restarting at start is waited for; a
        // refused configuration ends the run.
        let mut failures = 0u32;
        while let Err(e) = self.store.migrate().await {
            if !e.is_retryable() {
                return Err(InboxError::Store(e));
            }
            self.fault("store");
            tracing::warn!(consumer = %self.store.consumer(), error = %e, "preparing the inbox tables failed; retrying");
            failures = failures.saturating_add(1);
            tokio::time::sleep(reconnect_delay(failures)).await;
        }
        let stopper = {
            let shared = shared.clone();
            tokio::spawn(async move {
                shutdown.await;
                shared.stopping.store(true, Ordering::Release);
                shared.stop.notify_waiters();
            })
        };
        let mut background = Vec::new();
        for _ in 0..self.options.retry_workers {
            background.push(tokio::spawn(retry_loop(shared.clone())));
        }
        background.push(tokio::spawn(retention_loop(shared.clone())));
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Done>();
        let mut lanes = Vec::with_capacity(self.options.lanes);
        let mut lane_tasks = Vec::with_capacity(self.options.lanes);
        for _ in 0..self.options.lanes {
            let (tx, rx) = mpsc::unbounded_channel::<Job>();
            lanes.push(tx);
            lane_tasks.push(tokio::spawn(lane_loop(shared.clone(), rx, done_tx.clone())));
        }
        drop(done_tx);
        let describe = source.describe();
        tracing::info!(consumer = %self.store.consumer(), source = %describe, lanes = self.options.lanes, "inbox started");

        let mut tokens: HashMap<u64, S::Token> = HashMap::new();
        let mut next_ticket = 0u64;
        let mut in_flight = 0usize;
        failures = 0;
        let mut fatal = None;
        let mut last_activity = Instant::now();
        loop {
            let mut finished = Vec::new();
            while let Ok(d) = done_rx.try_recv() {
                in_flight -= d.acked.len() + d.abandoned;
                finished.extend(d.acked);
            }
            self.ack(&mut source, &mut tokens, finished).await;
            if shared.stopping() {
                break;
            }
            if in_flight >= self.options.max_in_flight {
                tokio::select! {
                    d = done_rx.recv() => if let Some(d) = d {
                        in_flight -= d.acked.len() + d.abandoned;
                        self.ack(&mut source, &mut tokens, d.acked).await;
                    },
                    () = shared.stop.notified() => {}
                }
                continue;
            }
            let wait = if in_flight > 0 {
                ACK_TICK
            } else {
                self.options.recv_wait
            };
            let max = self
                .options
                .recv_batch
                .min(self.options.max_in_flight - in_flight);
            let batch = match source.recv(max, wait).await {
                Ok(b) => {
                    failures = 0;
                    if !b.is_empty() || in_flight > 0 {
                        last_activity = Instant::now();
                    } else if idle.is_some_and(|idle| last_activity.elapsed() >= idle) {
                        break;
                    }
                    b
                }
                Err(e) if e.is_retryable() => {
                    self.fault("source");
                    tracing::warn!(consumer = %self.store.consumer(), source = %describe, error = %e, "receiving failed; retrying");
                    failures = failures.saturating_add(1);
                    if shared.pause(reconnect_delay(failures)).await {
                        break;
                    }
                    continue;
                }
                Err(e) => {
                    tracing::error!(consumer = %self.store.consumer(), source = %describe, error = %e, "the source is misconfigured; stopping");
                    fatal = Some(e);
                    break;
                }
            };
            let mut jobs: Vec<Job> = (0..lanes.len())
                .map(|_| Job {
                    messages: Vec::new(),
                    tickets: Vec::new(),
                    positions: Vec::new(),
                })
                .collect();
            for r in batch {
                let position = S::position(&r.token);
                let ticket = next_ticket;
                next_ticket += 1;
                tokens.insert(ticket, r.token);
                in_flight += 1;
                if let Some(behind) = r.message.behind {
                    metrics::gauge!(m::BEHIND, &self.label()).set(behind as f64);
                }
                match InboundMessage::decode(
                    r.message.header_pairs(),
                    &r.message.body,
                    &r.message.destination,
                    r.message.timestamp,
                ) {
                    Ok(msg) => {
                        let lane = lane_of(&msg, lanes.len());
                        jobs[lane].messages.push(msg);
                        jobs[lane].tickets.push(ticket);
                        jobs[lane].positions.push(position);
                    }
                    Err(e) => {
                        // Not an outbox event: kept as a dead letter, never dropped.
                        let msg = undecodable(&r.message);
                        let failure = Failure {
                            code: ErrorCode::UNDECODABLE,
                            message: e.to_string(),
                            retryable: false,
                        };
                        tracing::warn!(consumer = %self.store.consumer(), event_id = %msg.id, error = %e, "undecodable message dead-lettered");
                        let hold = Hold::Dead {
                            attempts: 0,
                            failure,
                        };
                        if hold_with_retries(&shared, &msg, &hold).await {
                            self.stats.undecodable.fetch_add(1, Ordering::Relaxed);
                            self.stats.dead.fetch_add(1, Ordering::Relaxed);
                            metrics::counter!(m::DEAD, "consumer" => self.store.consumer().to_owned(), "code" => "UNDECODABLE").increment(1);
                            in_flight -= 1;
                            self.ack(&mut source, &mut tokens, vec![ticket]).await;
                        } else {
                            in_flight -= 1;
                            tokens.remove(&ticket);
                        }
                    }
                }
            }
            for (lane, job) in jobs.into_iter().enumerate() {
                if !job.messages.is_empty() && lanes[lane].send(job).is_err() {
                    tracing::error!("inbox lane {lane} stopped unexpectedly");
                }
            }
        }

        // Stop: no more receiving; lanes finish what they hold (bounded).
        shared.stopping.store(true, Ordering::Release);
        shared.stop.notify_waiters();
        drop(lanes);
        let deadline = Instant::now() + self.options.shutdown_grace;
        while in_flight > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, done_rx.recv()).await {
                Ok(Some(d)) => {
                    in_flight -= d.acked.len() + d.abandoned;
                    self.ack(&mut source, &mut tokens, d.acked).await;
                }
                Ok(None) | Err(_) => break,
            }
        }
        for t in lane_tasks {
            t.abort();
        }
        for t in background {
            t.abort();
        }
        stopper.abort();
        if let Err(e) = source.close().await {
            tracing::warn!(consumer = %self.store.consumer(), error = %e, "closing the source failed");
        }
        tracing::info!(consumer = %self.store.consumer(), unacknowledged = in_flight, "inbox stopped");
        match fatal {
            Some(e) => Err(InboxError::Source(e)),
            None => Ok(self.stats()),
        }
    }
}

impl<St: InboxStore, H: Handler<St::Db>> Inbox<St, H> {
    async fn ack<S: Source>(
        &self,
        source: &mut S,
        tokens: &mut HashMap<u64, S::Token>,
        tickets: Vec<u64>,
    ) {
        if tickets.is_empty() {
            return;
        }
        let batch: Vec<S::Token> = tickets.iter().filter_map(|t| tokens.remove(t)).collect();
        if let Err(e) = source.ack(batch).await {
            // Unacknowledged messages come again and are recognised.
            self.fault("source");
            tracing::warn!(consumer = %self.store.consumer(), error = %e, "acknowledging failed; the broker will redeliver");
        }
    }

    fn fault(&self, what: &'static str) {
        self.stats.faults.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::FAULTS, "consumer" => self.store.consumer().to_owned(), "what" => what)
            .increment(1);
    }

    /// Handles the messages held back that are due, until none is; returns
    /// how many it worked on. The running inbox does this on its own every
    /// retry poll; tests and tools call it directly.
    pub async fn retry_due(&self) -> Result<usize, St::Error> {
        let mut n = 0;
        while self.retry_one().await? {
            n += 1;
        }
        Ok(n)
    }

    /// One due head: handled (or recognised) and removed, or its failure
    /// recorded. Returns whether there was one.
    async fn retry_one(&self) -> Result<bool, St::Error> {
        let o = &self.options;
        let mut tx = self.store.begin().await?;
        let mut heads = self.store.due(&mut tx, 1, o.block_on_dead()).await?;
        let Some(head) = heads.pop() else {
            tx.rollback().await?;
            return Ok(false);
        };
        if !self
            .store
            .complete(&mut tx, head.seq, head.message.id)
            .await?
        {
            tx.commit().await?;
            self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::DUPLICATES, &self.label()).increment(1);
            return Ok(true);
        }
        match self.apply(&head.message, &mut tx).await {
            Ok(()) => {
                tx.commit().await?;
                self.handled(&head.message);
            }
            Err(e) => {
                tx.rollback().await?;
                let hold = self.hold_for(e, head.attempts + 1);
                let mut tx = self.store.begin().await?;
                self.store.fail(&mut tx, head.seq, &hold).await?;
                tx.commit().await?;
                self.count_hold(&head.message, &hold);
            }
        }
        Ok(true)
    }

    async fn apply(
        &self,
        msg: &InboundMessage,
        tx: &mut sqlx::Transaction<'static, St::Db>,
    ) -> Result<(), HandlerError> {
        let span = tracing::info_span!("inbox.handle", consumer = %self.store.consumer(), event_id = %msg.id, event_type = %msg.event_type);
        #[cfg(feature = "otel")]
        let _ = outbox_core::trace::continue_trace(&span, &msg.headers);
        run_handler(&*self.handler, msg, tx).instrument(span).await
    }

    fn handled(&self, msg: &InboundMessage) {
        self.stats.handled.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(m::HANDLED, &self.label()).increment(1);
        if let Some(created) = msg.created_at {
            let lag = (Utc::now() - created).num_milliseconds().max(0) as f64 / 1000.0;
            metrics::gauge!(m::LAG_SECONDS, &self.label()).set(lag);
        }
    }

    fn hold_for(&self, e: HandlerError, attempts: u32) -> Hold {
        let failure = Failure::from(e);
        if failure.retryable && self.options.retry.should_retry(attempts) {
            let delay = self
                .options
                .retry
                .next_delay(attempts, rand::random::<f64>());
            Hold::Retry {
                attempts,
                delay,
                failure,
            }
        } else {
            Hold::Dead { attempts, failure }
        }
    }

    fn count_hold(&self, msg: &InboundMessage, hold: &Hold) {
        match hold {
            Hold::Retry {
                attempts, failure, ..
            } => {
                self.stats.retries.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(m::RETRIES, &self.label()).increment(1);
                tracing::warn!(consumer = %self.store.consumer(), event_id = %msg.id, attempts, code = %failure.code, error = %failure.message, "handler failed; retrying later");
            }
            Hold::Dead { attempts, failure } => {
                self.stats.dead.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(m::DEAD, "consumer" => self.store.consumer().to_owned(), "code" => failure.code.as_str().to_owned()).increment(1);
                tracing::error!(consumer = %self.store.consumer(), event_id = %msg.id, attempts, code = %failure.code, error = %failure.message, "message dead-lettered");
            }
        }
    }

    /// One lane transaction for `messages`: admit, run the handlers of the
    /// new ones, commit. `Err(Ok(i))`: the handler of message `i` failed
    /// (everything rolled back); `Err(Err(e))`: the store failed.
    async fn try_batch(
        &self,
        messages: &[InboundMessage],
        positions: &[Option<Position>],
    ) -> Result<[u64; 3], BatchError<St::Error>> {
        let started = Instant::now();
        let mut tx = self.store.begin().await.map_err(BatchError::Store)?;
        let verdicts = self
            .store
            .admit(&mut tx, messages, self.options.block_on_dead())
            .await
            .map_err(BatchError::Store)?;
        let mut counts = [0u64; 3];
        for (i, (msg, v)) in messages.iter().zip(&verdicts).enumerate() {
            match v {
                Verdict::New => {
                    if let Err(e) = self.apply(msg, &mut tx).await {
                        // A rollback that fails means the connection broke:
                        // the database's fault, not the message's.
                        tx.rollback()
                            .await
                            .map_err(|e| BatchError::Store(e.into()))?;
                        return Err(BatchError::Handler(i, e));
                    }
                    counts[0] += 1;
                }
                Verdict::Duplicate => counts[1] += 1,
                Verdict::Parked => counts[2] += 1,
            }
        }
        tx.commit().await.map_err(|e| BatchError::Store(e.into()))?;
        metrics::histogram!(m::BATCH_SECONDS, &self.label())
            .record(started.elapsed().as_secs_f64());
        for (i, (msg, v)) in messages.iter().zip(&verdicts).enumerate() {
            if *v == Verdict::New {
                self.handled(msg);
                if let Some(at) = positions.get(i).copied().flatten() {
                    self.check_order(msg, at);
                }
            }
        }
        Ok(counts)
    }

    /// Counts and logs `msg` (at broker position `at`) when a later message
    /// of its key was applied before it.
    fn check_order(&self, msg: &InboundMessage, at: Position) {
        let Some(key) = msg.key.as_deref() else {
            return;
        };
        if let Some(later) = self.order.applied(key, at) {
            self.stats.out_of_order.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(m::OUT_OF_ORDER, &self.label()).increment(1);
            tracing::warn!(consumer = %self.store.consumer(), key, event_id = %msg.id, position = %at, after = %later, "message applied after a later message of its key (out of the broker's order)");
        }
    }

    fn count_batch(&self, counts: [u64; 3]) {
        self.stats
            .duplicates
            .fetch_add(counts[1], Ordering::Relaxed);
        self.stats.parked.fetch_add(counts[2], Ordering::Relaxed);
        if counts[1] > 0 {
            metrics::counter!(m::DUPLICATES, &self.label()).increment(counts[1]);
        }
        if counts[2] > 0 {
            metrics::counter!(m::PARKED, &self.label()).increment(counts[2]);
        }
    }
}

enum BatchError<E> {
    Handler(usize, HandlerError),
    Store(E),
}

/// The lane of a message: its order key's hash, so one key is always in
/// one lane.
fn lane_of(msg: &InboundMessage, lanes: usize) -> usize {
    let h = fnv1a_64(msg.order_key().as_bytes());
    usize::try_from(h % lanes as u64).unwrap_or(0)
}

/// A dead letter for a message that is not an outbox event: its raw
/// headers and body, under an id derived from them (a redelivery finds the
/// same id and is not stored twice).
fn undecodable(raw: &RawMessage) -> InboundMessage {
    let mut bytes = raw.body.clone();
    for (k, v) in &raw.headers {
        bytes.extend_from_slice(k.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(v.as_bytes());
        bytes.push(0);
    }
    let a = fnv1a_64(&bytes);
    bytes.reverse();
    let b = fnv1a_64(&bytes);
    let id = EventId::from(uuid::Builder::from_random_bytes(u128_bytes(a, b)).into_uuid());
    InboundMessage {
        id,
        key: None,
        event_type: String::new(),
        topic: raw.destination.clone(),
        content_type: outbox_core::headers::DEFAULT_CONTENT_TYPE.to_owned(),
        payload: raw.body.clone(),
        headers: raw.headers.iter().cloned().collect(),
        created_at: raw.timestamp,
        attempt: None,
        format: outbox_core::WireFormat::Headers,
    }
}

fn u128_bytes(a: u64, b: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&a.to_be_bytes());
    out[8..].copy_from_slice(&b.to_be_bytes());
    out
}

/// Stores `msg` as held back, retrying while the database is down; `false`
/// when the inbox stopped first.
async fn hold_with_retries<St: InboxStore, H: Handler<St::Db>>(
    shared: &Shared<St, H>,
    msg: &InboundMessage,
    hold: &Hold,
) -> bool {
    let inbox = &shared.inbox;
    let mut failures = 0u32;
    loop {
        let r = async {
            let mut tx = inbox.store.begin().await?;
            inbox.store.hold(&mut tx, msg, hold).await?;
            tx.commit().await?;
            Ok::<_, St::Error>(())
        }
        .await;
        match r {
            Ok(()) => return true,
            Err(e) => {
                inbox.fault("store");
                tracing::warn!(consumer = %inbox.store.consumer(), error = %e, "inbox database failed; retrying");
                failures = failures.saturating_add(1);
                if shared.pause(reconnect_delay(failures)).await {
                    return false;
                }
            }
        }
    }
}

async fn lane_loop<St: InboxStore, H: Handler<St::Db>>(
    shared: Arc<Shared<St, H>>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    done: mpsc::UnboundedSender<Done>,
) {
    while let Some(mut job) = jobs.recv().await {
        // Whatever else queued up for this lane joins the transaction.
        let max = shared.inbox.options.lane_batch;
        while job.messages.len() < max {
            match jobs.try_recv() {
                Ok(more) => {
                    job.messages.extend(more.messages);
                    job.tickets.extend(more.tickets);
                    job.positions.extend(more.positions);
                }
                Err(_) => break,
            }
        }
        let mut messages = job.messages;
        let mut tickets = job.tickets;
        let mut positions = job.positions;
        while !messages.is_empty() {
            let rest_m = messages.split_off(messages.len().min(max));
            let rest_t = tickets.split_off(tickets.len().min(max));
            let rest_p = positions.split_off(positions.len().min(max));
            let chunk_t = std::mem::replace(&mut tickets, rest_t);
            let chunk_m = std::mem::replace(&mut messages, rest_m);
            let chunk_p = std::mem::replace(&mut positions, rest_p);
            let n = chunk_t.len();
            let d = if handle_chunk(&shared, &chunk_m, &chunk_p).await {
                Done {
                    acked: chunk_t,
                    abandoned: 0,
                }
            } else {
                Done {
                    acked: Vec::new(),
                    abandoned: n,
                }
            };
            if done.send(d).is_err() {
                return;
            }
        }
    }
}

/// Handles one lane chunk to its committed outcome; `false` when the inbox
/// stopped while the database was failing (nothing to acknowledge then).
///
/// One transaction for the whole chunk; when a handler fails, the messages
/// before it are committed in one transaction, the failing one is held back
/// (a retry or a dead letter), and the rest goes on as a chunk (the later
/// messages of the failing key are parked behind it by `admit`).
async fn handle_chunk<St: InboxStore, H: Handler<St::Db>>(
    shared: &Shared<St, H>,
    messages: &[InboundMessage],
    positions: &[Option<Position>],
) -> bool {
    let inbox = &shared.inbox;
    let mut rest = messages;
    // Kept in step with `rest` (empty or shorter when the source gives none).
    let mut at = positions;
    let mut failures = 0u32;
    while !rest.is_empty() {
        let store_error = match inbox.try_batch(rest, at).await {
            Ok(counts) => {
                inbox.count_batch(counts);
                return true;
            }
            Err(BatchError::Handler(0, e)) => {
                let hold = inbox.hold_for(e, 1);
                if !hold_with_retries(shared, &rest[0], &hold).await {
                    return false;
                }
                inbox.count_hold(&rest[0], &hold);
                rest = &rest[1..];
                at = advance(at, 1);
                continue;
            }
            Err(BatchError::Handler(i, _)) => match inbox.try_batch(&rest[..i], at).await {
                Ok(counts) => {
                    inbox.count_batch(counts);
                    rest = &rest[i..];
                    at = advance(at, i);
                    continue;
                }
                // A handler that failed only on the second run: its own turn
                // at the head comes on the next pass.
                Err(BatchError::Handler(j, e)) => {
                    if j > 0 {
                        continue;
                    }
                    let hold = inbox.hold_for(e, 1);
                    if !hold_with_retries(shared, &rest[0], &hold).await {
                        return false;
                    }
                    inbox.count_hold(&rest[0], &hold);
                    rest = &rest[1..];
                    at = advance(at, 1);
                    continue;
                }
                Err(BatchError::Store(e)) => e,
            },
            Err(BatchError::Store(e)) => e,
        };
        inbox.fault("store");
        tracing::warn!(consumer = %inbox.store.consumer(), error = %store_error, "inbox database failed; retrying");
        failures = failures.saturating_add(1);
        if shared.pause(reconnect_delay(failures)).await {
            return false;
        }
    }
    true
}

/// `at` without its first `n` positions (empty when shorter).
fn advance(at: &[Option<Position>], n: usize) -> &[Option<Position>] {
    at.get(n..).unwrap_or(&[])
}

async fn retry_loop<St: InboxStore, H: Handler<St::Db>>(shared: Arc<Shared<St, H>>) {
    let inbox = &shared.inbox;
    let mut failures = 0u32;
    loop {
        let pause = match inbox.retry_due().await {
            Ok(_) => {
                failures = 0;
                inbox.options.retry_poll
            }
            Err(e) => {
                inbox.fault("store");
                tracing::warn!(consumer = %inbox.store.consumer(), error = %e, "retry pass failed");
                failures = failures.saturating_add(1);
                reconnect_delay(failures).max(inbox.options.retry_poll)
            }
        };
        if shared.pause(pause).await {
            return;
        }
    }
}

async fn retention_loop<St: InboxStore + InboxRetentionStore, H: Handler<St::Db>>(
    shared: Arc<Shared<St, H>>,
) {
    let inbox = &shared.inbox;
    loop {
        match inbox.store.retain().await {
            Ok(r) if r.emptied => {
                tracing::info!(consumer = %inbox.store.consumer(), slot = r.current_slot, "inbox retention emptied the next slot");
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(consumer = %inbox.store.consumer(), error = %e, "inbox retention pass failed; retrying later");
            }
        }
        if shared.pause(inbox.options.retention_every).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(log: u64, offset: u64) -> Position {
        Position { log, offset }
    }

    #[test]
    fn order_watch_reports_an_earlier_position_after_a_later_one() {
        let w = OrderWatch::default();
        assert_eq!(w.applied("k", at(0, 5)), None);
        assert_eq!(w.applied("k", at(0, 7)), None);
        assert_eq!(w.applied("k", at(0, 6)), Some(at(0, 7)));
        // Still compared with the latest: 8 is in order.
        assert_eq!(w.applied("k", at(0, 8)), None);
        // Another log (a Kafka partition) is not compared.
        assert_eq!(w.applied("k", at(1, 1)), None);
        assert_eq!(w.applied("j", at(0, 1)), None);
        assert_eq!(advance(&[None, None], 5).len(), 0);
        assert_eq!(advance(&[None, None], 1).len(), 1);
    }
}
