//! `inbox`: the consumer half. Per broker, a destination is prefilled with
//! the real publisher (default wire format), then read whole, in the same
//! run, by: the source alone (receive + acknowledge, no database: the
//! consume ceiling), the inbox on PostgreSQL with a handler that inserts
//! one row per message, and the same consumer loop and handler with the
//! inbox's record left out (the baseline of the dedup cost).

use super::inbox_tuning::Tuning;
use super::{with_usage, Ctx};
use crate::probe::{Meter, Usage};
use crate::report::Row;
use crate::run::Drained;
use crate::setup::{
    claimed_event, fresh_schema, inbox_destination, Broker, InboxDest, KEYS, PAYLOAD_BYTES,
};
use anyhow::{bail, Context, Result};
use futures::future::BoxFuture;
use outbox_core::{Event, EventId, HandlerError, InboundMessage, Outcome, Sink};
use outbox_inbox::source::amqp::{AmqpSource, AmqpSourceConfig};
use outbox_inbox::source::kafka::{KafkaSource, KafkaSourceConfig};
use outbox_inbox::source::nats::{NatsSource, NatsSourceConfig};
use outbox_inbox::source::{Received, Source, SourceError};
use outbox_inbox::{
    Handler, Hold, Inbox, InboxRetentionStore, InboxSchema, InboxStore, Pending, PgInbox,
    RetentionReport, StoreError, Verdict,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Postgres, Transaction};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The target: the inbox on PostgreSQL at least half the raw
/// consume ceiling of the same broker.
const INBOX_TARGET: f64 = 0.5;

/// A source that notes when the first message arrived: every measurement
/// is timed from there, so a consumer group's join (Kafka) or a durable
/// consumer's creation (JetStream) is not counted, alike for every row.
struct Timed<S> {
    inner: S,
    first: Arc<Mutex<Option<Instant>>>,
}

impl<S: Source> Source for Timed<S> {
    type Token = S::Token;

    async fn recv(
        &mut self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Received<S::Token>>, SourceError> {
        let got = self.inner.recv(max, wait).await?;
        if !got.is_empty() {
            if let Ok(mut f) = self.first.lock() {
                f.get_or_insert_with(Instant::now);
            }
        }
        Ok(got)
    }

    async fn ack(&mut self, tokens: Vec<S::Token>) -> Result<(), SourceError> {
        self.inner.ack(tokens).await
    }

    async fn close(self) -> Result<(), SourceError> {
        self.inner.close().await
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// The handler of both database rows: one `INSERT` of the message's id, key
/// and payload into a table with a serial primary key, in the inbox's
/// transaction (a realistic minimal effect).
struct OneRow {
    insert: String,
}

impl Handler<Postgres> for OneRow {
    fn handle<'a>(
        &'a self,
        m: &'a InboundMessage,
        tx: &'a mut Transaction<'static, Postgres>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            sqlx::query(&self.insert)
                .bind(m.id.as_uuid())
                .bind(m.key.as_deref())
                .bind(&m.payload)
                .execute(&mut **tx)
                .await?;
            Ok(())
        })
    }
}

/// The inbox's store with its dedup record left out: `admit` says every
/// message is new and writes nothing, so the consumer loop, its lanes, its
/// one transaction per lane batch and the handler run exactly as in the
/// inbox row, minus the record. Everything else is the real store's (the
/// consumer needs no dead-letter operations, so it has none).
#[derive(Clone, Debug)]
struct NoRecord(PgInbox);

impl InboxStore for NoRecord {
    type Db = Postgres;
    type Error = StoreError;

    fn consumer(&self) -> &str {
        self.0.consumer()
    }

    async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        self.0.begin().await
    }

    async fn admit(
        &self,
        _tx: &mut Transaction<'static, Postgres>,
        messages: &[InboundMessage],
        _block_on_dead: bool,
    ) -> Result<Vec<Verdict>, StoreError> {
        Ok(messages.iter().map(|_| Verdict::New).collect())
    }

    async fn hold(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        message: &InboundMessage,
        hold: &Hold,
    ) -> Result<(), StoreError> {
        self.0.hold(tx, message, hold).await
    }

    async fn due(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        limit: u32,
        block_on_dead: bool,
    ) -> Result<Vec<Pending>, StoreError> {
        self.0.due(tx, limit, block_on_dead).await
    }

    async fn complete(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        seq: i64,
        id: EventId,
    ) -> Result<bool, StoreError> {
        self.0.complete(tx, seq, id).await
    }

    async fn fail(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        seq: i64,
        hold: &Hold,
    ) -> Result<(), StoreError> {
        self.0.fail(tx, seq, hold).await
    }
}

impl InboxSchema for NoRecord {
    type Error = StoreError;

    async fn migrate(&self) -> Result<(), StoreError> {
        self.0.migrate().await
    }
}

impl InboxRetentionStore for NoRecord {
    type Error = StoreError;

    async fn retain(&self) -> Result<RetentionReport, StoreError> {
        self.0.retain().await
    }

    async fn is_recorded(&self, id: EventId) -> Result<bool, StoreError> {
        self.0.is_recorded(id).await
    }
}

/// Which consumer of a prefilled destination a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    Ceiling,
    Inbox,
    HandlerOnly,
}

impl Run {
    fn name(self) -> &'static str {
        match self {
            Run::Ceiling => "ceiling",
            Run::Inbox => "inbox",
            Run::HandlerOnly => "handler_only",
        }
    }
}

/// What one inbox run measured besides the drain.
struct Consumed {
    drained: Drained,
    /// Rows in the effects table afterwards, and distinct event ids there.
    rows: i64,
    distinct: i64,
    /// The inbox's own counts (duplicates, parked, retries, dead, faults).
    counts: outbox_inbox::InboxCounts,
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    super::percentile(&v, 0.5)
}

impl Ctx {
    /// `inbox`: per broker, the consume ceiling, the inbox on PostgreSQL
    /// and the handler without the inbox's record, on one prefilled
    /// destination.
    pub(super) async fn inbox(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        for b in Broker::ALL {
            if let Err(e) = self.inbox_broker(b).await {
                eprintln!("!! inbox {}: {e:#}", b.name());
                errors.push(format!("{}: {e:#}", b.name()));
            }
            self.cleanup().await;
        }
        if !errors.is_empty() {
            bail!("{}", errors.join("; "));
        }
        Ok(())
    }

    async fn inbox_broker(&mut self, b: Broker) -> Result<()> {
        let n = self.sizes.inbox_events;
        let rounds = self.sizes.inbox_rounds.max(1) as usize;
        let tuning = self.inbox_tuning;
        // The ceiling, then per round the handler-only run and the inbox
        // run, in alternating order.
        let mut plan = vec![Run::Ceiling];
        for r in 0..rounds {
            if r % 2 == 0 {
                plan.extend([Run::HandlerOnly, Run::Inbox]);
            } else {
                plan.extend([Run::Inbox, Run::HandlerOnly]);
            }
        }
        let (sink, topic, dest) =
            inbox_destination(&self.services, &mut self.res, b, "inbox", plan.len()).await?;
        let prefill = Instant::now();
        publish(&sink, &topic, n).await?;
        let prefill_s = prefill.elapsed().as_secs_f64();
        drop(sink);

        let mut ceiling = None;
        let mut inbox_rates = Vec::new();
        let mut only_rates = Vec::new();
        let mut inbox_last = None;
        let mut only_last = None;
        for (i, run) in plan.iter().copied().enumerate() {
            let label = format!("{}_{i}", run.name());
            let c = match &dest {
                InboxDest::Nats { stream } => {
                    let mut config =
                        NatsSourceConfig::new(&self.services.nats_url, stream, label.clone());
                    if let Some(w) = tuning.window {
                        config = config.with_max_ack_pending(w);
                    }
                    let source = NatsSource::connect(config).await.context("NATS source")?;
                    self.consume(run, source, n, &tuning).await?
                }
                InboxDest::Amqp { queues } => {
                    let queue = queues.get(i).context("a queue per run")?;
                    let mut config = AmqpSourceConfig::new(&self.services.amqp_url, queue);
                    if let Some(w) = tuning.window {
                        config = config.with_prefetch(u16::try_from(w).unwrap_or(u16::MAX));
                    }
                    let source = AmqpSource::connect(config)
                        .await
                        .context("RabbitMQ source")?;
                    self.consume(run, source, n, &tuning).await?
                }
                InboxDest::Kafka { topic } => {
                    let group = format!("{topic}-{label}");
                    let source = KafkaSource::new(KafkaSourceConfig::new(
                        &self.services.kafka_brokers,
                        group,
                        [topic.as_str()],
                    ))
                    .context("Kafka source")?;
                    self.consume(run, source, n, &tuning).await?
                }
            };
            // A run cut by the time cap is reported with its note (the
            // rate is what it reached); one that consumed nothing fails.
            if c.drained.delivered == 0 {
                bail!(
                    "{} {}: consumed {} of {n} messages{}",
                    b.name(),
                    run.name(),
                    c.drained.delivered,
                    c.drained
                        .note()
                        .map(|x| format!(" ({x})"))
                        .unwrap_or_default()
                );
            }
            match run {
                Run::Ceiling => ceiling = Some(c),
                Run::Inbox => {
                    inbox_rates.push(c.drained.rate());
                    inbox_last = Some(c);
                }
                Run::HandlerOnly => {
                    only_rates.push(c.drained.rate());
                    only_last = Some(c);
                }
            }
        }
        let (Some(ceiling), Some(inbox), Some(only)) = (ceiling, inbox_last, only_last) else {
            bail!("a run is missing");
        };
        let ceiling_rate = ceiling.drained.rate();
        let inbox_rate = median(inbox_rates.clone());
        let only_rate = median(only_rates.clone());
        let base = |row: Row| {
            row.param("events", n)
                .param("keys", KEYS)
                .param("payload_bytes", PAYLOAD_BYTES as u64)
        };

        let row = Row::new(
            "inbox",
            format!(
                "CEILING {} consume: source recv + ack, no database",
                b.name()
            ),
            ceiling_rate,
            "msgs/s",
        );
        let row =
            with_usage(base(tuning.params(row)), &ceiling.drained).detail("prefill_s", prefill_s);
        self.rows.push(row);

        let row = Row::new(
            "inbox",
            format!(
                "inbox (PostgreSQL) {} -> one-row handler, record + effect per lane transaction",
                b.name()
            ),
            inbox_rate,
            "msgs/s",
        )
        .param("rounds", rounds as u64);
        let row = with_usage(base(tuning.params(row)), &inbox.drained)
            .detail("effect_rows", inbox.rows)
            .detail("distinct_event_ids", inbox.distinct)
            .detail("duplicates", inbox.counts.duplicates)
            .detail("parked", inbox.counts.parked)
            .detail("retries", inbox.counts.retries + inbox.counts.dead)
            .detail("faults", inbox.counts.faults)
            .detail(
                "rates",
                inbox_rates.iter().map(|r| r.round()).collect::<Vec<_>>(),
            )
            .against(format!("{} consume ceiling", b.name()), ceiling_rate)
            .target_ratio(
                format!(">= {INBOX_TARGET} of the consume ceiling"),
                INBOX_TARGET,
            );
        self.rows.push(row);

        let row = Row::new(
            "inbox",
            format!(
                "handler only (no inbox record) {} -> one-row handler, effect per lane transaction",
                b.name()
            ),
            only_rate,
            "msgs/s",
        )
        .param("rounds", rounds as u64);
        let row = with_usage(base(tuning.params(row)), &only.drained)
            .detail("effect_rows", only.rows)
            .detail(
                "rates",
                only_rates.iter().map(|r| r.round()).collect::<Vec<_>>(),
            )
            .against(format!("{} consume ceiling", b.name()), ceiling_rate);
        self.rows.push(row);

        // Wall time per message with the record minus without it, at the
        // drains' throughput (lanes in parallel), and the same for this
        // process's CPU.
        let per_msg = |rate: f64| if rate > 0.0 { 1e6 / rate } else { f64::NAN };
        let cost = per_msg(inbox_rate) - per_msg(only_rate);
        let cpu = |d: &Drained| d.usage.cpu_s * 1e6 / d.delivered.max(1) as f64;
        let row = Row::new(
            "inbox",
            format!("dedup cost: the inbox record per message, {}", b.name()),
            cost,
            "us/msg",
        )
        .param("rounds", rounds as u64);
        let row = base(tuning.params(row))
            .detail("inbox_us_per_msg", round2(per_msg(inbox_rate)))
            .detail("handler_only_us_per_msg", round2(per_msg(only_rate)))
            .detail(
                "consumer_cpu_us_per_msg_added",
                round2(cpu(&inbox.drained) - cpu(&only.drained)),
            )
            .against("handler only, us/msg", per_msg(only_rate));
        self.rows.push(row);
        Ok(())
    }

    /// One consumer of `n` prefilled messages from `source`: the source
    /// alone, the inbox, or the handler without the record.
    async fn consume<S: Source>(
        &mut self,
        run: Run,
        source: S,
        n: u64,
        tuning: &Tuning,
    ) -> Result<Consumed> {
        let first = Arc::new(Mutex::new(None));
        let source = Timed {
            inner: source,
            first: Arc::clone(&first),
        };
        let record = match run {
            Run::Ceiling => {
                let drained =
                    raw_consume(source, &first, n, tuning.recv_batch, self.sizes.cap).await?;
                return Ok(Consumed {
                    drained,
                    rows: 0,
                    distinct: 0,
                    counts: outbox_inbox::InboxCounts::default(),
                });
            }
            Run::Inbox => true,
            Run::HandlerOnly => false,
        };
        let cap = self.sizes.cap;
        let schema = fresh_schema(&mut self.res, &format!("inbox_{}", run.name()))?;
        let schema = schema.as_str().to_owned();
        let pool = PgPoolOptions::new()
            .max_connections(u32::try_from(tuning.lanes + 4).unwrap_or(32))
            .acquire_timeout(Duration::from_secs(30))
            .connect(&self.services.database_url)
            .await
            .context("PostgreSQL pool for the inbox")?;
        let effects = format!("\"{schema}\".effects");
        sqlx::raw_sql(&format!(
            "CREATE SCHEMA IF NOT EXISTS \"{schema}\"; \
             CREATE TABLE {effects} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
             event_id uuid NOT NULL, key text, payload bytea NOT NULL, \
             handled_at timestamptz NOT NULL DEFAULT now())"
        ))
        .execute(&pool)
        .await?;
        let handler = OneRow {
            insert: format!("INSERT INTO {effects} (event_id, key, payload) VALUES ($1, $2, $3)"),
        };
        let store = PgInbox::new(pool.clone(), "bench")?.with_schema(schema.clone())?;
        // Created before the clock starts (`run` migrates again: a no-op).
        store.migrate().await?;
        let options = tuning.options()?;
        let (drained, counts) = if record {
            let inbox = Inbox::new(store, handler).with_options(options);
            inbox_drain(inbox, source, &first, n, cap).await?
        } else {
            let inbox = Inbox::new(NoRecord(store), handler).with_options(options);
            inbox_drain(inbox, source, &first, n, cap).await?
        };
        let (rows, distinct): (i64, i64) = sqlx::query_as(&format!(
            "SELECT count(*), count(DISTINCT event_id) FROM {effects}"
        ))
        .fetch_one(&pool)
        .await?;
        pool.close().await;
        // One effect per handled message (all `n` unless the cap cut the
        // run), each for a different event.
        if rows != i64::try_from(counts.handled)? || distinct != rows {
            bail!(
                "{}: {rows} effect rows ({distinct} distinct ids) for {} handled messages",
                run.name(),
                counts.handled
            );
        }
        Ok(Consumed {
            drained,
            rows,
            distinct,
            counts,
        })
    }
}

/// Publishes events `0..n` for `topic` with the real publisher, 1,000 per
/// `deliver` call; every one must be acknowledged by the broker.
async fn publish<Si: Sink>(sink: &Si, topic: &str, n: u64) -> Result<()> {
    const BATCH: u64 = 1_000;
    let mut from = 0;
    while from < n {
        let to = (from + BATCH).min(n);
        let events: Vec<Event> = (from..to).map(|i| claimed_event(topic, i)).collect();
        for o in sink.deliver(&events).await {
            match o {
                Outcome::Delivered => {}
                Outcome::Failed(e) => bail!("prefill to {topic} failed: {e}"),
                other => bail!("prefill to {topic}: {other:?}"),
            }
        }
        from = to;
    }
    Ok(())
}

/// The wall time from the first message received to `done`.
fn timed(first: &Mutex<Option<Instant>>, meter: &Meter, done: Instant) -> Usage {
    let mut usage = meter.stop();
    let started = first.lock().ok().and_then(|f| *f);
    if let Some(s) = started {
        usage.wall_s = done.saturating_duration_since(s).as_secs_f64();
    }
    usage
}

/// The consume ceiling: receive up to `recv_batch`, acknowledge them at
/// once (one `ack` call per receive), until `n` messages.
async fn raw_consume<S: Source>(
    mut source: Timed<S>,
    first: &Mutex<Option<Instant>>,
    n: u64,
    recv_batch: usize,
    cap: Duration,
) -> Result<Drained> {
    let meter = Meter::start();
    let mut got = 0u64;
    let mut capped = false;
    let mut error = None;
    while got < n {
        if meter.elapsed() > cap {
            capped = true;
            break;
        }
        match source.recv(recv_batch, Duration::from_millis(200)).await {
            Ok(batch) => {
                got += batch.len() as u64;
                let tokens = batch.into_iter().map(|r| r.token).collect();
                if let Err(e) = source.ack(tokens).await {
                    error.get_or_insert_with(|| e.to_string());
                }
            }
            Err(e) if e.is_retryable() => {
                error.get_or_insert_with(|| e.to_string());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => bail!("{}: {e}", source.describe()),
        }
    }
    let done = Instant::now();
    let usage = timed(first, &meter, done);
    if let Err(e) = source.close().await {
        error.get_or_insert_with(|| e.to_string());
    }
    Ok(Drained {
        delivered: got.min(n),
        usage,
        capped,
        error,
    })
}

/// Runs `inbox` over `source` until it has handled `n` messages (committed)
/// or `cap` passed; then stops it (its last acknowledgements are flushed).
async fn inbox_drain<St, H, S>(
    inbox: Inbox<St, H>,
    source: Timed<S>,
    first: &Mutex<Option<Instant>>,
    n: u64,
    cap: Duration,
) -> Result<(Drained, outbox_inbox::InboxCounts)>
where
    St: InboxStore + InboxSchema + InboxRetentionStore,
    H: Handler<St::Db>,
    S: Source,
{
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let runner = inbox.clone();
    let meter = Meter::start();
    let task = tokio::spawn(async move {
        runner
            .run(source, async move {
                let _ = stop_rx.await;
            })
            .await
    });
    let mut capped = false;
    let mut tick = tokio::time::interval(Duration::from_millis(2));
    while inbox.stats().handled < n {
        if meter.elapsed() > cap || task.is_finished() {
            capped = !task.is_finished();
            break;
        }
        tick.tick().await;
    }
    let done = Instant::now();
    let usage = timed(first, &meter, done);
    let _ = stop_tx.send(());
    let counts = task
        .await
        .context("inbox task")?
        .context("the inbox stopped with an error")?;
    let error = (counts.faults + counts.retries + counts.dead > 0).then(|| {
        format!(
            "{} faults, {} retries, {} dead",
            counts.faults, counts.retries, counts.dead
        )
    });
    Ok((
        Drained {
            delivered: counts.handled.min(n),
            usage,
            capped,
            error,
        },
        counts,
    ))
}
