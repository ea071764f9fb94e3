//! Enqueue inside the caller's transaction ([`PgOutbox::enqueue`]), with
//! the COMMIT in the same round trip ([`PgOutbox::commit_with`], in
//! `enqueue/commit.rs`), or by COPY for backfills
//! ([`PgOutbox::enqueue_bulk`], in `enqueue/copy.rs`).

mod commit;
mod copy;
mod literal;

use crate::error::{EnqueueError, MigrateError};
use crate::ident::{Ident, InvalidIdentifier};
use crate::migrate::{self, render_all};
use crate::mode::PgMode;
use crate::names::log::LogNames;
use crate::names::queue::Names;
use crate::options::{DEFAULT_NOTIFY, DEFAULT_SCHEMA, DEFAULT_TABLE};
use chrono::{DateTime, Utc};
use outbox_core::{Delivery, EventId, EventLimits, NewEvent, Pooler};
use sqlx::{PgConnection, Postgres, Transaction};
use std::fmt;
use std::sync::{Arc, OnceLock};
use uuid::Uuid;

/// A cheap, cloneable handle to one outbox (schema + table): enqueues events
/// in the caller's transaction and applies the migrations.
///
/// It targets the outbox's mode: the event log (the default, read by
/// [`PgLogStore`](crate::PgLogStore)) or the queue table
/// ([`PgOutbox::in_mode`] with [`PgMode::Queue`], read by
/// [`PgStore`](crate::PgStore)). Either way an enqueue is ONE INSERT in the
/// caller's transaction.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_core::NewEvent;
/// use outbox_postgres::{Ident, PgOutbox};
///
/// let outbox = PgOutbox::new(Ident::new("app")?, Ident::new("outbox")?)?;
/// let mut tx = pool.begin().await?;
/// // ... the business writes, on &mut *tx ...
/// let id = outbox
///     .enqueue(&mut *tx, NewEvent::new("order.created", "orders", b"{}".to_vec()).with_key("order-42"))
///     .await?;
/// tx.commit().await?;
/// # let _ = id; Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgOutbox {
    pub(crate) names: Arc<Names>,
    /// The event log's names: `Some` in [`PgMode::Log`].
    log: Option<Arc<LogNames>>,
    sql: Arc<EnqueueSql>,
    limits: EventLimits,
    notify: bool,
    /// Statements unnamed (a pooler in transaction mode is in between).
    unnamed: bool,
}

/// One target's INSERT statements ([`Inserts`]) and the same wrapped in a
/// `pg_notify` (its channel bound last): what both enqueue handles run.
pub(crate) struct EnqueueSql {
    plain: Inserts,
    one_notify: String,
    batch_notify: String,
    delayed_one_notify: String,
    delayed_batch_notify: String,
    /// The quoted, qualified table the statements insert into (for the
    /// literal INSERT of `commit_with` and the COPY of `enqueue_bulk`).
    target: String,
    /// The column a delayed event sets.
    due_column: &'static str,
    /// Whether an undelayed event's value of `due_column` is `now()` (the
    /// queue table) rather than NULL (the log).
    undelayed_now: bool,
}

const COLUMNS: &str = "id, key, key_hash, event_type, topic, payload, headers";

/// One target's INSERT statements: for undelayed events (the seven columns,
/// unchanged by the delayed-events feature: an undelayed event pays nothing
/// for it) and for delayed ones (an eighth column, the target's due time,
/// `$8` absolute time / `$9` delay in µs from the database's `now()`).
pub(crate) struct Inserts {
    pub(crate) one: String,
    pub(crate) batch: String,
    pub(crate) delayed_one: String,
    pub(crate) delayed_batch: String,
}

impl Inserts {
    /// The statements inserting into `target` (a quoted, qualified table:
    /// the queue table or the event log; both take the same seven columns).
    /// A delayed event also sets `due_column` (`next_attempt_at` of the
    /// queue, `deliver_at` of the log); `undelayed` is that column's value
    /// for an undelayed event of a batch that has delayed ones.
    pub(crate) fn new(target: &str, due_column: &str, undelayed: &str) -> Self {
        let due = "coalesce($8::timestamptz, now() + $9::bigint * interval '1 microsecond')";
        let due_row =
            format!("coalesce(at, now() + after_us * interval '1 microsecond', {undelayed})");
        let batch = |extra_col: &str, extra_val: &str, extra_arrays: &str, extra_names: &str| {
            format!(
                "INSERT INTO {target} ({COLUMNS}{extra_col}) \
                 SELECT id, key, key_hash, event_type, topic, payload, headers::jsonb{extra_val} \
                 FROM UNNEST($1::uuid[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::bytea[], $7::text[]{extra_arrays}) \
                 WITH ORDINALITY AS t(id, key, key_hash, event_type, topic, payload, headers{extra_names}, n) \
                 ORDER BY n"
            )
        };
        Self {
            one: format!(
                "INSERT INTO {target} ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)"
            ),
            batch: batch("", "", "", ""),
            delayed_one: format!(
                "INSERT INTO {target} ({COLUMNS}, {due_column}) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, {due})"
            ),
            delayed_batch: batch(
                &format!(", {due_column}"),
                &format!(", {due_row}"),
                ", $8::timestamptz[], $9::bigint[]",
                ", at, after_us",
            ),
        }
    }

    /// The single-event statement for `event`.
    pub(crate) fn one_for(&self, event: &NewEvent) -> &str {
        if is_delayed(event) {
            &self.delayed_one
        } else {
            &self.one
        }
    }

    /// The batch statement for `events` (validated).
    pub(crate) fn batch_for(&self, events: &[NewEvent]) -> &str {
        if events.iter().any(is_delayed) {
            &self.delayed_batch
        } else {
            &self.batch
        }
    }
}

/// Whether `event` asked for a delay (even a zero or invalid one: the
/// statement then has the delay's parameters, and validation refuses an
/// invalid one before anything is bound).
fn is_delayed(event: &NewEvent) -> bool {
    !matches!(event.delivery(), Ok(None))
}

impl EnqueueSql {
    /// The queue table's or the event log's statements (see [`Inserts::new`]).
    pub(crate) fn new(target: &str, due_column: &'static str, undelayed: &str) -> Self {
        let plain = Inserts::new(target, due_column, undelayed);
        let notify =
            |sql: &str, param: u32| format!("WITH ins AS ({sql}) SELECT pg_notify(${param}, '')");
        Self {
            one_notify: notify(&plain.one, 8),
            batch_notify: notify(&plain.batch, 8),
            delayed_one_notify: notify(&plain.delayed_one, 10),
            delayed_batch_notify: notify(&plain.delayed_batch, 10),
            plain,
            target: target.to_owned(),
            due_column,
            undelayed_now: undelayed == "now()",
        }
    }

    /// The single-event statement for `event`, notifying or not.
    fn one_for(&self, event: &NewEvent, notify: bool) -> &str {
        match (notify, is_delayed(event)) {
            (false, _) => self.plain.one_for(event),
            (true, false) => &self.one_notify,
            (true, true) => &self.delayed_one_notify,
        }
    }

    /// The batch statement for `events` (validated), notifying or not.
    fn batch_for(&self, events: &[NewEvent], notify: bool) -> &str {
        match (notify, events.iter().any(is_delayed)) {
            (false, _) => self.plain.batch_for(events),
            (true, false) => &self.batch_notify,
            (true, true) => &self.delayed_batch_notify,
        }
    }

    /// Adds one event's INSERT to the caller's transaction (`conn`), with
    /// `pg_notify(channel)` when a channel is given: the body of both
    /// handles' `enqueue`. Returns the event's id.
    pub(crate) async fn enqueue(
        &self,
        conn: &mut PgConnection,
        event: NewEvent,
        limits: &EventLimits,
        channel: Option<&str>,
        unnamed: bool,
    ) -> Result<EventId, EnqueueError> {
        let sql = self.one_for(&event, channel.is_some());
        let (id, mut q) = bind_event(sqlx::query(sql).persistent(!unnamed), event, limits)?;
        if let Some(channel) = channel {
            q = q.bind(channel);
        }
        q.execute(conn).await.map_err(EnqueueError::Database)?;
        Ok(id)
    }

    /// Validates `events` (nothing is written if one is refused) and adds
    /// them with ONE INSERT to the caller's transaction, with
    /// `pg_notify(channel)` when a channel is given: the body of both
    /// handles' `enqueue_batch`. Returns the ids in the given order.
    pub(crate) async fn enqueue_batch(
        &self,
        conn: &mut PgConnection,
        events: impl IntoIterator<Item = NewEvent>,
        limits: &EventLimits,
        channel: Option<&str>,
        unnamed: bool,
    ) -> Result<Vec<EventId>, EnqueueError> {
        let events = validate_batch(events, limits)?;
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let sql = self.batch_for(&events, channel.is_some());
        let (ids, mut q) = bind_batch(sqlx::query(sql).persistent(!unnamed), events)?;
        if let Some(channel) = channel {
            q = q.bind(channel);
        }
        q.execute(conn).await.map_err(EnqueueError::Database)?;
        Ok(ids)
    }
}

impl fmt::Debug for PgOutbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgOutbox")
            .field("schema", &self.names.schema)
            .field("table", &self.names.table)
            .field("mode", &self.mode())
            .field("notify", &self.notify)
            .field("limits", &self.limits)
            .finish()
    }
}

impl Default for PgOutbox {
    /// The outbox in `outbox.events` (event-log mode), with default limits
    /// and notify setting.
    fn default() -> Self {
        default_outbox().clone()
    }
}

fn default_outbox() -> &'static PgOutbox {
    static DEFAULT: OnceLock<PgOutbox> = OnceLock::new();
    DEFAULT.get_or_init(|| {
        let outbox = PgOutbox::new(
            Ident::from_static(DEFAULT_SCHEMA),
            Ident::from_static(DEFAULT_TABLE),
        );
        // The default names are constants that fit, so a failure here is a
        // bug caught by the unit tests.
        #[allow(clippy::expect_used)]
        outbox.expect("default outbox names are valid")
    })
}

impl PgOutbox {
    /// The event-log outbox `schema`.`table` (the default mode; with
    /// default limits). Fails when a derived name (`<table>_log_dead_code_idx`
    /// is the longest) would exceed 63 bytes: the table name may be at most
    /// 45 bytes long.
    pub fn new(schema: Ident, table: Ident) -> Result<Self, InvalidIdentifier> {
        Self::in_mode(schema, table, PgMode::Log)
    }

    /// The outbox `schema`.`table` in `mode`: [`PgMode::Log`] (what
    /// [`new`](Self::new) gives) or [`PgMode::Queue`], the queue table
    /// (derived names `<table>_dead`, `<table>_migrations`, index names; the
    /// table name may be at most 48 bytes long).
    pub fn in_mode(schema: Ident, table: Ident, mode: PgMode) -> Result<Self, InvalidIdentifier> {
        let names = Names::new(schema.clone(), table.clone())?;
        match mode {
            PgMode::Log => {
                let log = LogNames::new(schema, table)?;
                Ok(Self {
                    sql: Arc::new(EnqueueSql::new(
                        &log.render("{{log}}"),
                        "deliver_at",
                        "NULL",
                    )),
                    names: Arc::new(names),
                    log: Some(Arc::new(log)),
                    limits: EventLimits::default(),
                    notify: DEFAULT_NOTIFY,
                    unnamed: false,
                })
            }
            _ => Ok(Self::from_names(names)),
        }
    }

    /// A queue-mode outbox (the handle a [`PgStore`](crate::PgStore) hands out).
    pub(crate) fn from_names(names: Names) -> Self {
        Self {
            sql: Arc::new(EnqueueSql::new(
                &names.render("{{events}}"),
                "next_attempt_at",
                "now()",
            )),
            names: Arc::new(names),
            log: None,
            limits: EventLimits::default(),
            notify: DEFAULT_NOTIFY,
            unnamed: false,
        }
    }

    /// Which store reads what this handle enqueues.
    pub fn mode(&self) -> PgMode {
        if self.log.is_some() {
            PgMode::Log
        } else {
            PgMode::Queue
        }
    }

    /// Whether enqueue also issues `pg_notify` on [`channel`](Self::channel)
    /// (waking idle queue-mode relays at once). Event-log relays do not
    /// listen (they poll adaptively, a few ms after activity), so in
    /// [`PgMode::Log`] this setting is kept but nothing is sent.
    pub fn with_notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// The limits checked at enqueue.
    pub fn with_limits(mut self, limits: EventLimits) -> Self {
        self.limits = limits;
        self
    }

    /// What sits between the application and PostgreSQL. With
    /// [`Pooler::Transaction`] (PgBouncer's `pool_mode = transaction`) the
    /// INSERT is sent as an unnamed statement, parsed at each enqueue,
    /// because a statement left prepared on a server connection is another
    /// client's next. Any other mode keeps it prepared per connection (the
    /// handle cannot see the connection it is given, so
    /// [`Pooler::Auto`] is [`Pooler::None`] here; the stores'
    /// [`outbox`](crate::PgLogStore::outbox) handles carry what their
    /// connect found). The caller's own statements in the same
    /// transaction need the same care (`sqlx::query(..).persistent(false)`).
    pub fn with_pooler(mut self, pooler: Pooler) -> Self {
        self.unnamed = pooler == Pooler::Transaction;
        self
    }

    /// Unnamed statements when `yes` (what a store's connect found).
    pub(crate) fn with_unnamed_statements(mut self, yes: bool) -> Self {
        self.unnamed = yes;
        self
    }

    /// The schema.
    pub fn schema(&self) -> &Ident {
        &self.names.schema
    }

    /// The events table.
    pub fn table(&self) -> &Ident {
        &self.names.table
    }

    /// The LISTEN/NOTIFY channel of this outbox: `schema.table`, or
    /// `outbox_<hash>` when that is longer than 63 bytes.
    pub fn channel(&self) -> &str {
        &self.names.channel
    }

    /// Whether enqueue notifies (never in [`PgMode::Log`]).
    pub fn notifies(&self) -> bool {
        self.notify && self.log.is_none()
    }

    /// The channel enqueue notifies, when it does.
    fn notify_channel(&self) -> Option<&str> {
        self.notifies().then_some(self.names.channel.as_str())
    }

    /// Adds one INSERT (plus `pg_notify` when enabled) to the caller's
    /// transaction: pass `&mut *tx`. Returns the event's id. The event is
    /// visible to relays only once the transaction commits.
    ///
    /// When the event is the transaction's last write,
    /// [`commit_with`](Self::commit_with) writes it and commits in one
    /// round trip instead of two; for backfills,
    /// [`enqueue_bulk`](Self::enqueue_bulk).
    pub async fn enqueue(
        &self,
        conn: &mut PgConnection,
        event: NewEvent,
    ) -> Result<EventId, EnqueueError> {
        self.sql
            .enqueue(
                conn,
                event,
                &self.limits,
                self.notify_channel(),
                self.unnamed,
            )
            .await
    }

    /// Adds many events with ONE INSERT (`UNNEST` of arrays) to the caller's
    /// transaction. All are validated first; nothing is written if one is
    /// refused. Returns the ids in the given order.
    pub async fn enqueue_batch(
        &self,
        conn: &mut PgConnection,
        events: impl IntoIterator<Item = NewEvent>,
    ) -> Result<Vec<EventId>, EnqueueError> {
        self.sql
            .enqueue_batch(
                conn,
                events,
                &self.limits,
                self.notify_channel(),
                self.unnamed,
            )
            .await
    }

    /// Writes `event` and COMMITs `tx` in ONE round trip, for the usual
    /// case where the event is the transaction's last write: `BEGIN`, the
    /// business writes, then this instead of `enqueue` + `tx.commit()`
    /// (which is one round trip more). Returns the event's id once it is
    /// committed.
    ///
    /// The INSERT and `COMMIT AND CHAIN` go as one simple query with the
    /// values as literals (escaped, so no parameter and no prepared
    /// statement: it works the same behind a pooler in transaction mode).
    /// The event is validated as [`enqueue`](Self::enqueue) validates it,
    /// with the same errors. Taking `tx` by value is what ends it:
    ///
    /// - `Ok(id)`: committed.
    /// - [`EnqueueError::Invalid`], [`EnqueueError::Database`]: not
    ///   committed; `tx` was rolled back (the business writes too). A
    ///   refused INSERT never reaches the COMMIT, and a refused COMMIT (a
    ///   deferred constraint, a serialization failure) is a rollback.
    /// - [`EnqueueError::CommitUnknown`]: the connection failed after the
    ///   COMMIT was sent and before its answer. The transaction may or may
    ///   not have committed: look the event up by id once the database
    ///   answers (or make the retry idempotent), never assume either.
    /// - [`EnqueueError::NotTopLevel`]: `tx` is a savepoint (a transaction
    ///   begun inside another); nothing was sent, and it rolls back to its
    ///   savepoint. A COMMIT would end the outer transaction.
    ///
    /// The chained empty transaction the COMMIT opens is ended by the
    /// `ROLLBACK` sqlx queues when `tx` is dropped: a pooled connection
    /// sends it with the check the pool makes on every returned connection,
    /// a bare connection with its next statement (ARCHITECTURE.md,
    /// "commit_with" decision). When to use which: the crate docs'
    /// "Producing: `enqueue`, `commit_with` or `enqueue_bulk`".
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use outbox_core::NewEvent;
    /// use outbox_postgres::PgOutbox;
    ///
    /// let outbox = PgOutbox::default();
    /// let mut tx = pool.begin().await?;
    /// sqlx::query("UPDATE orders SET state = 'paid' WHERE id = 42")
    ///     .execute(&mut *tx)
    ///     .await?;
    /// let event = NewEvent::new("order.paid", "orders", b"{}".to_vec()).with_key("order-42");
    /// let id = outbox.commit_with(tx, event).await?; // committed
    /// # let _ = id; Ok(()) }
    /// ```
    pub async fn commit_with(
        &self,
        tx: Transaction<'_, Postgres>,
        event: NewEvent,
    ) -> Result<EventId, EnqueueError> {
        let ids = self.commit_with_batch(tx, [event]).await?;
        // One event in, one id out.
        ids.into_iter().next().ok_or_else(|| {
            EnqueueError::Database(sqlx::Error::Protocol(
                "commit_with: no id for the event".to_owned(),
            ))
        })
    }

    /// [`commit_with`](Self::commit_with) for many events: one multi-row
    /// INSERT (in the given order) and the COMMIT, in one round trip. All
    /// are validated first; if one is refused nothing is written and `tx`
    /// is rolled back. An empty batch sends the COMMIT alone. Returns the
    /// ids in the given order.
    pub async fn commit_with_batch(
        &self,
        tx: Transaction<'_, Postgres>,
        events: impl IntoIterator<Item = NewEvent>,
    ) -> Result<Vec<EventId>, EnqueueError> {
        let events = match validate_batch(events, &self.limits) {
            Ok(events) => events,
            Err(e) => {
                // Ends the caller's transaction as every other error does.
                let _ = tx.rollback().await;
                return Err(e);
            }
        };
        self.sql
            .commit_with(tx, events, self.notify_channel())
            .await
    }

    /// Adds many events with `COPY ... FROM STDIN` (binary format), for
    /// backfills and imports: no statement text grows with the batch, no
    /// parameter limit, the fastest way in. In the caller's transaction
    /// when `conn` is one (`&mut *tx`), or atomically on its own. All are
    /// validated first (nothing is written if one is refused); the events
    /// keep the given order, as with [`enqueue_batch`](Self::enqueue_batch)
    /// (the log's order columns take their defaults row by row). A delayed
    /// event's delay counts from the database's `now()`, read once first.
    /// With notify on (queue mode) one `pg_notify` follows. Returns the ids
    /// in the given order.
    ///
    /// Behind a pooler in transaction mode, run it inside a transaction.
    /// The whole batch is held in memory: pass a backfill in chunks (tens
    /// of thousands of events per call).
    pub async fn enqueue_bulk(
        &self,
        conn: &mut PgConnection,
        events: impl IntoIterator<Item = NewEvent>,
    ) -> Result<Vec<EventId>, EnqueueError> {
        let events = validate_batch(events, &self.limits)?;
        self.sql.copy_in(conn, events, self.notify_channel()).await
    }

    /// Applies this mode's missing migrations to the outbox's schema
    /// (creating the schema if needed), serialized by an advisory lock.
    /// Returns the versions applied by this call (empty when already up to
    /// date).
    ///
    /// In [`PgMode::Log`] this also upgrades a queue-mode outbox of the same
    /// name in place (its pending events and dead letters move into the log;
    /// migration 0002 of the log). In [`PgMode::Queue`]
    /// an outbox that was upgraded is refused with
    /// [`MigrateError::ModeConflict`].
    pub async fn migrate(&self, conn: &mut PgConnection) -> Result<Vec<i32>, MigrateError> {
        match &self.log {
            Some(log) => migrate::log::run(conn, log).await,
            None => migrate::queue::run(conn, &self.names).await,
        }
    }

    /// This mode's migration SQL with the outbox's names substituted, for
    /// teams that apply migrations with their own tool: `(version, name,
    /// sql)`. (The event log's in-place upgrade of a queue-mode outbox and
    /// its insertable `<table>` view are made by [`migrate`](Self::migrate)
    /// only.)
    pub fn migration_sql(&self) -> Vec<(i32, &'static str, String)> {
        match &self.log {
            Some(log) => render_all(migrate::log::LOG_MIGRATIONS, log),
            None => render_all(migrate::queue::MIGRATIONS, &self.names),
        }
    }
}

/// An INSERT statement being bound (`sqlx::query(..)`).
pub(crate) type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// Captures the caller's trace context into `event`'s headers (feature
/// `otel`), validates it and binds its seven columns (id, key, key hash, type,
/// topic, payload, headers as JSON) to `q`, in the order both modes' INSERT
/// statements expect, and for a delayed event (the statement of
/// [`Inserts::one_for`]) its due time as `$8`/`$9`. Returns the event's id
/// with the bound query.
pub(crate) fn bind_event<'q>(
    q: PgQuery<'q>,
    mut event: NewEvent,
    limits: &EventLimits,
) -> Result<(EventId, PgQuery<'q>), EnqueueError> {
    let id = event.id();
    event
        .prepare(limits)
        .map_err(|source| EnqueueError::Invalid { id, source })?;
    let due = due_params(&event)?;
    let key_hash = i64::from(event.key_hash());
    let outbox_core::EventParts {
        id,
        key,
        event_type,
        topic,
        payload,
        headers,
    } = event.into_parts();
    let q = q
        .bind(id.as_uuid())
        .bind(key)
        .bind(key_hash)
        .bind(event_type)
        .bind(topic)
        .bind(payload)
        .bind(headers_json(&headers));
    let q = match due {
        Some((at, after_us)) => q.bind(at).bind(after_us),
        None => q,
    };
    Ok((id, q))
}

/// A delayed event's `(absolute time, delay in µs)` parameters (one of them
/// set), `None` for an undelayed event.
fn due_params(event: &NewEvent) -> Result<Option<DueParams>, EnqueueError> {
    let delivery = event.delivery().map_err(|source| EnqueueError::Invalid {
        id: event.id(),
        source,
    })?;
    Ok(match delivery {
        None => None,
        Some(Delivery::At(at)) => Some((Some(at), None)),
        // Validated: at most MAX_DELIVERY_DELAY (100 years), far inside an i64 of µs.
        Some(Delivery::After(d)) => {
            Some((None, Some(i64::try_from(d.as_micros()).unwrap_or(i64::MAX))))
        }
    })
}

/// `$8` (absolute due time) and `$9` (delay in µs) of a delayed INSERT.
type DueParams = (Option<DateTime<Utc>>, Option<i64>);

/// Collects and validates a batch (nothing is bound if one is refused),
/// capturing the caller's trace context first (feature `otel`).
pub(crate) fn validate_batch(
    events: impl IntoIterator<Item = NewEvent>,
    limits: &EventLimits,
) -> Result<Vec<NewEvent>, EnqueueError> {
    NewEvent::prepare_all(events, limits)
        .map_err(|(id, source)| EnqueueError::Invalid { id, source })
}

/// Binds a validated batch to `q` as seven arrays (the columns of
/// [`bind_event`], for an `UNNEST` INSERT), plus the due-time arrays `$8`/`$9`
/// when one of the events is delayed (the statement of
/// [`Inserts::batch_for`]). Returns the ids in the given order.
pub(crate) fn bind_batch(
    q: PgQuery<'_>,
    events: Vec<NewEvent>,
) -> Result<(Vec<EventId>, PgQuery<'_>), EnqueueError> {
    let n = events.len();
    let delayed = events.iter().any(is_delayed);
    let mut ats: Vec<Option<DateTime<Utc>>> = Vec::new();
    let mut afters: Vec<Option<i64>> = Vec::new();
    let mut ids = Vec::with_capacity(n);
    let mut uuids: Vec<Uuid> = Vec::with_capacity(n);
    let mut keys: Vec<Option<String>> = Vec::with_capacity(n);
    let mut hashes: Vec<i64> = Vec::with_capacity(n);
    let mut types: Vec<String> = Vec::with_capacity(n);
    let mut topics: Vec<String> = Vec::with_capacity(n);
    let mut payloads: Vec<Vec<u8>> = Vec::with_capacity(n);
    let mut headers: Vec<String> = Vec::with_capacity(n);
    for e in events {
        if delayed {
            let (at, after) = due_params(&e)?.unwrap_or((None, None));
            ats.push(at);
            afters.push(after);
        }
        hashes.push(i64::from(e.key_hash()));
        let outbox_core::EventParts {
            id,
            key,
            event_type,
            topic,
            payload,
            headers: h,
        } = e.into_parts();
        ids.push(id);
        uuids.push(id.as_uuid());
        keys.push(key);
        types.push(event_type);
        topics.push(topic);
        payloads.push(payload);
        headers.push(headers_json(&h));
    }
    let q = q
        .bind(uuids)
        .bind(keys)
        .bind(hashes)
        .bind(types)
        .bind(topics)
        .bind(payloads)
        .bind(headers);
    let q = if delayed { q.bind(ats).bind(afters) } else { q };
    Ok((ids, q))
}

fn headers_json(headers: &std::collections::BTreeMap<String, String>) -> String {
    // A map of strings always serializes; the fallback is never used.
    serde_json::to_string(headers).unwrap_or_else(|_| "{}".to_owned())
}

/// Enqueues one event into the default outbox (`outbox.events`, event-log
/// mode) in the
/// caller's transaction (`&mut *tx`). See [`PgOutbox::enqueue`].
pub async fn enqueue(conn: &mut PgConnection, event: NewEvent) -> Result<EventId, EnqueueError> {
    default_outbox().enqueue(conn, event).await
}

/// Enqueues many events into the default outbox (`outbox.events`, event-log
/// mode) with one INSERT. See [`PgOutbox::enqueue_batch`].
pub async fn enqueue_batch(
    conn: &mut PgConnection,
    events: impl IntoIterator<Item = NewEvent>,
) -> Result<Vec<EventId>, EnqueueError> {
    default_outbox().enqueue_batch(conn, events).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_outbox_names() {
        let o = PgOutbox::default();
        assert_eq!(o.schema().as_str(), "outbox");
        assert_eq!(o.table().as_str(), "events");
        assert_eq!(o.channel(), "outbox.events");
        assert_eq!(o.mode(), PgMode::Log);
        let sql = &o.migration_sql()[0].2;
        assert!(
            sql.contains("CREATE TABLE \"outbox\".\"events_log\" ("),
            "{sql}"
        );
        assert!(!sql.contains("{{"), "{sql}");
        assert!(
            o.sql
                .plain
                .one
                .starts_with("INSERT INTO \"outbox\".\"events_log\" ("),
            "{}",
            o.sql.plain.one
        );
        // An undelayed event's INSERT does not name the delay column; a
        // delayed one sets the log's deliver_at.
        assert!(!o.sql.plain.one.contains("deliver_at"));
        assert!(!o.sql.plain.batch.contains("deliver_at"));
        assert!(o.sql.plain.delayed_one.contains("deliver_at)"));
        assert!(o.sql.plain.delayed_batch.contains("deliver_at)"));
        // Event-log relays do not listen: nothing is sent.
        assert!(!o.clone().with_notify(true).notifies());
    }

    #[test]
    fn queue_mode_targets_the_queue_table() {
        let o = PgOutbox::in_mode(
            Ident::new("app").unwrap(),
            Ident::new("events").unwrap(),
            PgMode::Queue,
        )
        .unwrap();
        assert_eq!(o.mode(), PgMode::Queue);
        let sql = &o.migration_sql()[0].2;
        assert!(sql.contains("CREATE TABLE \"app\".\"events\" ("), "{sql}");
        assert!(o
            .sql
            .plain
            .one
            .starts_with("INSERT INTO \"app\".\"events\" ("));
        assert!(o.with_notify(true).notifies());
    }

    #[test]
    fn log_mode_limits_the_table_name() {
        let long = Ident::new("t".repeat(46)).unwrap();
        let schema = Ident::new("s").unwrap();
        assert!(PgOutbox::new(schema.clone(), long.clone()).is_err());
        assert!(PgOutbox::in_mode(schema, long, PgMode::Queue).is_ok());
    }
}
