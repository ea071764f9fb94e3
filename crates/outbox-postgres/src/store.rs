//! [`PgStore`]: claims, settlements, lease renewal, stats, dead letters, wake-ups.

use crate::names::Names;
use crate::options::{redact_url, scrub};
use crate::{MigrateError, PgOutbox, PgStoreOptions, StoreError};
use chrono::{DateTime, Utc};
use outbox_core::{
    Claim, ClaimRequest, DeadLetter, DeadLetterFilter, DeadLetterQuery, DeadLetterStore, ErrorCode,
    Event, EventId, FencingToken, LastError, PoolSettings, Rejected, Resolution, SettleReport,
    Settlement, ShardSpec, Stats, Store, MAX_DEAD_LETTER_AGE,
};
use sqlx::postgres::{PgArguments, PgConnectOptions, PgListener, PgPoolOptions, PgRow};
use sqlx::{ConnectOptions, Connection, PgPool, Row};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use uuid::Uuid;

/// The outbox store on PostgreSQL. Cheap to clone (an `Arc`); background
/// tasks (the LISTEN connection, the retention purge) stop when the last
/// clone is dropped. `Debug` never shows the password.
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    outbox: PgOutbox,
    sql: StoreSql,
    url: Option<String>,
    listen: bool,
    retention: Option<Duration>,
    purge_batch: u32,
    wakeup: Option<Arc<Notify>>,
    /// Held for its `Drop`: stops the LISTEN and purge tasks with the last clone.
    _tasks: BackgroundTasks,
    vacuum: Option<Vacuum>,
    held: Held,
    floor: SeqFloor,
}

/// A lower bound of the pending rows' `seq` that claims walk from, so a
/// claim does not step over the index entries of the rows deleted since the
/// last vacuum (measured: 10,000 of them cost a claim 3.5 ms; from the
/// bound, 0.2 ms).
///
/// Every [`FLOOR_REFRESH`] a claim reads the sequence's last value `v` and
/// the snapshot's `xmax` (a candidate). Once every transaction that was
/// running then has ended (a later snapshot's `xmin` >= that `xmax`), each
/// row with `seq <= v` is committed and visible, or gone, so the bound
/// becomes `min(v + 1, the smallest pending seq)`. A long transaction holds
/// the candidate back (the bound stays where it was); a pending row found
/// below the bound lowers it at the next refresh. A failed claim (the
/// database may have crashed and restarted, handing out sequence values and
/// transaction ids again) resets it to 0.
#[derive(Default)]
struct SeqFloor {
    state: Mutex<FloorState>,
}

#[derive(Default, Clone, Copy)]
struct FloorState {
    /// Claims walk from here (0: from the start).
    bound: i64,
    /// `(v, xmax)` read at the last refresh that could not settle one.
    candidate: Option<(i64, i64)>,
    /// When the last refresh ran.
    read_at: Option<Instant>,
}

/// How often claims refresh [`SeqFloor`].
const FLOOR_REFRESH: Duration = Duration::from_secs(1);

/// The events each live claim of this store holds, so [`Store::renew`]
/// (which gets only the token) updates them by primary key: an index on
/// `lease_token` would make every claim's UPDATE a non-HOT one. Entries go
/// when their events are settled, when a renewal finds the lease lost, or
/// an hour after the claim was last claimed or renewed (a claim dropped
/// without a settlement; its rows come back when the lease expires).
#[derive(Default)]
struct Held {
    claims: Mutex<HashMap<FencingToken, HeldClaim>>,
}

struct HeldClaim {
    ids: HashSet<Uuid>,
    touched: Instant,
}

/// How long an unsettled, unrenewed claim is remembered for [`Store::renew`].
const HELD_FOR: Duration = Duration::from_secs(3600);

impl Held {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<FencingToken, HeldClaim>> {
        // A panic while holding this lock cannot leave the map inconsistent.
        self.claims
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn claimed(&self, token: FencingToken, ids: impl IntoIterator<Item = Uuid>) {
        let now = Instant::now();
        let mut claims = self.lock();
        claims.retain(|_, c| now.duration_since(c.touched) < HELD_FOR);
        let ids: HashSet<Uuid> = ids.into_iter().collect();
        if !ids.is_empty() {
            claims.insert(token, HeldClaim { ids, touched: now });
        }
    }

    fn settled(&self, token: FencingToken, ids: impl IntoIterator<Item = Uuid>) {
        let mut claims = self.lock();
        if let Some(c) = claims.get_mut(&token) {
            for id in ids {
                c.ids.remove(&id);
            }
            if c.ids.is_empty() {
                claims.remove(&token);
            }
        }
    }

    fn ids(&self, token: FencingToken) -> Option<Vec<Uuid>> {
        self.lock()
            .get(&token)
            .map(|c| c.ids.iter().copied().collect())
    }

    fn renewed(&self, token: FencingToken, held: u64) {
        let mut claims = self.lock();
        if held == 0 {
            claims.remove(&token);
        } else if let Some(c) = claims.get_mut(&token) {
            c.touched = Instant::now();
        }
    }
}

/// The opportunistic `VACUUM` of the events table (see
/// [`PgStoreOptions::with_vacuum_every`]).
struct Vacuum {
    every: u64,
    sql: String,
    removed: AtomicU64,
    /// A VACUUM is running, or vacuuming was turned off after an error.
    busy: Arc<AtomicBool>,
}

impl Vacuum {
    /// Counts `n` removed rows; starts a background VACUUM when the count
    /// crosses a multiple of `every` and none is running.
    fn removed(&self, pool: &PgPool, n: u64) {
        if n == 0 {
            return;
        }
        let before = self.removed.fetch_add(n, Ordering::Relaxed);
        if (before + n) / self.every == before / self.every {
            return;
        }
        if self
            .busy
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        let (pool, sql, busy) = (pool.clone(), self.sql.clone(), Arc::clone(&self.busy));
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            match sqlx::raw_sql(&sql).execute(&pool).await {
                Ok(_) => {
                    tracing::debug!(elapsed = ?started.elapsed(), "vacuumed the outbox table");
                    busy.store(false, Ordering::Release);
                }
                // Left `busy`: no further attempts from this store.
                Err(e) => tracing::warn!(
                    error = %e,
                    "VACUUM of the outbox table failed; not trying again (leave it to autovacuum, or grant ownership)"
                ),
            }
        });
    }
}

/// Applies `set` to the stats of the shard each row names (column 0: the
/// shard index; rows outside `out` are ignored).
fn fill_shards(
    out: &mut [ShardStats],
    rows: &[PgRow],
    set: impl Fn(&mut Stats, &PgRow) -> Result<(), sqlx::Error>,
) -> Result<(), StoreError> {
    for row in rows {
        let shard: i64 = row.try_get(0)?;
        if let Some(s) = usize::try_from(shard).ok().and_then(|i| out.get_mut(i)) {
            set(&mut s.stats, row)?;
        }
    }
    Ok(())
}

/// A store's background tasks (LISTEN, retention purge, log rotation):
/// aborted when the store's last clone drops them.
#[derive(Default)]
pub(crate) struct BackgroundTasks(Vec<JoinHandle<()>>);

impl BackgroundTasks {
    /// Runs `task` on the Tokio runtime until the store is dropped.
    pub(crate) fn spawn(&mut self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.0.push(tokio::spawn(task));
    }
}

impl Drop for BackgroundTasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore")
            .field("url", &self.inner.url.as_deref().map(redact_url))
            .field("schema", &self.inner.outbox.schema())
            .field("table", &self.inner.outbox.table())
            .field("notify", &self.inner.outbox.notifies())
            .field("listen", &self.inner.listen)
            .field("retention", &self.inner.retention)
            .field("pool_size", &self.inner.pool.size())
            .finish()
    }
}

/// The claim, one statement. See the crate docs ("Claim rules") for what it
/// guarantees. Order is `seq`, the insertion sequence (migration 2). The
/// shape, in short:
///
/// - `walked` / `ready`: the walk (`{{walk}}`: the oldest unparked, due
///   rows of `claim_idx`, at most `$7`) joined to each row's head
///   (`{{head}}`: its key's first pending row, one probe of `key_idx`). A
///   keyed row is blocked when its head is another row that is parked,
///   leased or in backoff. The first `$3` unblocked rows are locked (`SKIP
///   LOCKED`, so a concurrent claim takes the next ones); `walked` is a
///   materialized CTE, evaluated only as far as `ready` reads it and never
///   twice, and blocked rows are never locked.
/// - `parking`: when `ready` came back short, the walked rows whose head is
///   parked or in retry backoff are parked (those no one else has locked),
///   so the next claim does not walk them again. Rows behind a head that is
///   only leased (in flight) are parked only when the walk reached its
///   bound, i.e. when they may hide due rows beyond it; otherwise they are
///   skipped, so live traffic stays on the walk. A retry parks its key's
///   later rows itself.
/// - `parked_keys` / `heads` / `runs`: the keys that have parked rows (a
///   loose index scan of `parked_idx`, one probe per key), the ones whose
///   head is due, and for each a run of its due rows in order (an equal
///   share of the batch per key), locked in `run_rows`.
/// - `picked`: the oldest `$3` of both; `gaps`: per key, the first pending
///   row before its last picked one that was not picked (skipped for a key
///   whose only pick is its head). A picked row after its key's gap is left
///   out, so per-key order holds whatever was skipped, locked or not due.
const CLAIM_SQL: &str = "\
WITH RECURSIVE
parked_keys(key) AS (
    (SELECT e.key FROM {{events}} e
     WHERE e.parked AND e.delivered_at IS NULL
     ORDER BY e.key LIMIT 1)
  UNION ALL
    SELECT (SELECT e.key FROM {{events}} e
            WHERE e.parked AND e.delivered_at IS NULL AND e.key > k.key
            ORDER BY e.key LIMIT 1)
    FROM parked_keys k
    WHERE k.key IS NOT NULL
),
heads AS MATERIALIZED (
    SELECT h.key
    FROM parked_keys k
    CROSS JOIN LATERAL (
        SELECT e.key, e.key_hash, e.next_attempt_at FROM {{events}} e
        WHERE e.key = k.key AND e.delivered_at IS NULL
        ORDER BY e.seq LIMIT 1) h
    WHERE h.next_attempt_at <= now() {{head_shard_filter}}
),
runs AS (
    SELECT r.id, r.tid, r.seq
    FROM heads h
    CROSS JOIN LATERAL (
        SELECT x.id, x.tid, x.seq FROM (
            SELECT e.id, e.ctid AS tid, e.seq,
                   bool_and(e.next_attempt_at <= now()) OVER (ORDER BY e.seq) AS due
            FROM {{events}} e
            WHERE e.key = h.key AND e.delivered_at IS NULL
            ORDER BY e.seq
            LIMIT (SELECT greatest(1, ceil($3::float8 / greatest(count(*), 1)))::bigint FROM heads)
        ) x
        WHERE x.due) r
),
walked AS MATERIALIZED (
    SELECT w.id, w.tid, w.seq,
           h.seq = w.seq AS is_head,
           coalesce(h.seq <> w.seq AND h.busy, false) AS blocked,
           coalesce(h.seq <> w.seq AND h.parks, false) AS parks
    FROM ({{walk}}) w
    LEFT JOIN LATERAL ({{head}}) h ON true
),
ready AS (
    SELECT e.id, e.seq, e.key, e.next_attempt_at, c.is_head
    FROM walked c
    -- By row address (a TID scan): whatever the statistics say (an outbox
    -- table is often analyzed while nearly empty), the lock never becomes
    -- a join that rescans an index per walked row. A row updated since the
    -- walk's snapshot has a new address and is skipped by this claim.
    JOIN {{events}} e ON e.ctid = c.tid
    WHERE NOT c.blocked
      AND e.delivered_at IS NULL AND NOT e.parked AND e.next_attempt_at <= now()
    -- `walked` is read in `seq` order and only as far as needed.
    LIMIT $3
    FOR UPDATE OF e SKIP LOCKED
),
blocked AS (
    -- Only read when `ready` came back short, i.e. after it read all of
    -- `walked`: the walk and its head probes are not repeated.
    SELECT c.tid FROM walked c
    WHERE c.parks OR (c.blocked AND (SELECT count(*) FROM walked) >= $7)
),
run_rows AS (
    -- Driven from `runs` by row address: never a scan of the table.
    SELECT e.id, e.seq, e.key, e.next_attempt_at, false AS is_head
    FROM runs r
    JOIN {{events}} e ON e.ctid = r.tid
    WHERE e.id NOT IN (SELECT id FROM ready)
      AND e.delivered_at IS NULL AND e.next_attempt_at <= now()
    FOR UPDATE OF e SKIP LOCKED
),
picked AS MATERIALIZED (
    SELECT c.id, c.seq, c.key, c.next_attempt_at, c.is_head
    FROM (SELECT * FROM ready UNION ALL SELECT * FROM run_rows) c
    ORDER BY c.seq
    LIMIT $3
),
gaps AS MATERIALIZED (
    SELECT k.key,
           (SELECT p.seq FROM {{events}} p
            WHERE p.key = k.key AND p.seq < k.last AND p.delivered_at IS NULL
              AND p.seq NOT IN (SELECT seq FROM picked)
            ORDER BY p.seq LIMIT 1) AS gap
    FROM (SELECT key, max(seq) AS last FROM picked
          WHERE key IS NOT NULL
          GROUP BY key
          -- A key's only pick that is its first pending row has no gap.
          HAVING count(*) > 1 OR NOT bool_and(coalesce(is_head, false))) k
),
parking AS (
    UPDATE {{events}} e SET parked = true
    FROM (
        SELECT p.ctid AS tid FROM blocked b
        JOIN {{events}} p ON p.ctid = b.tid
        WHERE (SELECT count(*) FROM ready) < $3
          AND p.id NOT IN (SELECT id FROM picked)
          AND NOT p.parked AND p.delivered_at IS NULL
        FOR UPDATE OF p SKIP LOCKED) x
    WHERE e.ctid = x.tid
)
UPDATE {{events}} e
SET locked_by = $4,
    locked_until = now() + $5 * interval '1 microsecond',
    next_attempt_at = now() + $5 * interval '1 microsecond',
    lease_token = $6,
    attempts = e.attempts + 1
FROM picked c
LEFT JOIN gaps g ON g.key = c.key
WHERE e.id = c.id AND (g.gap IS NULL OR c.seq < g.gap)
RETURNING e.id, e.key, e.event_type, e.topic, e.payload, e.headers::text, e.created_at,
          e.attempts, c.next_attempt_at, e.locked_until, e.last_error_code, e.last_error_message,
          e.seq";

/// The claim's walk: the oldest unparked, due rows from `seq` `$8` (see
/// [`SeqFloor`]), at most `$7`.
const CLAIM_WALK_SQL: &str = "
            SELECT e.id, e.ctid AS tid, e.seq, e.key FROM {{events}} e
            WHERE e.delivered_at IS NULL AND NOT e.parked AND e.next_attempt_at <= now()
              AND e.seq >= $8
              {{shard_filter}}
            ORDER BY e.seq
            LIMIT $7";

/// The first pending row of walked row `w`'s key (none for a keyless row),
/// whether it holds the key (`busy`: parked, leased or in backoff) and
/// whether the rows behind it are always parked (`parks`: parked or in
/// retry backoff). A leased head is in flight and settles within moments:
/// the rows behind it are parked only by a walk that reached its bound.
const CLAIM_HEAD_SQL: &str = "
            SELECT h.seq, h.parked OR h.next_attempt_at > now() AS busy,
                   h.parked OR (h.next_attempt_at > now() AND h.locked_until IS NULL) AS parks
            FROM {{events}} h
            WHERE h.key = w.key AND h.delivered_at IS NULL
            ORDER BY h.seq LIMIT 1";

/// How many rows a claim may walk beyond its batch size. Bounds the work of
/// a claim that finds blocked rows (it parks what it walked; about 10 us a
/// row here) and so how many claims a backlog behind blocked keys takes to
/// park when a retry did not park it already.
const WALK_BEYOND_BATCH: i64 = 512;

/// Settles a batch, one statement: `$1` token; `$2..$6` the settlement as
/// arrays (id, kind, delay in microseconds, error code, error message).
/// Returns one row per id the token still held: `(id, replaced)` where
/// `replaced` says a dead letter with that id already existed and was
/// overwritten by this newer failure.
const SETTLE_SQL: &str = "\
WITH s AS MATERIALIZED (
    SELECT * FROM unnest($2::uuid[], $3::text[], $4::bigint[], $5::text[], $6::text[])
        AS s(id, kind, delay_us, code, message)
),
delivered AS (
    {{delivered}}
),
retried AS (
    UPDATE {{events}} e
    SET next_attempt_at = now() + s.delay_us * interval '1 microsecond',
        locked_by = NULL, locked_until = NULL, lease_token = NULL,
        last_error_code = s.code, last_error_message = s.message
    FROM s
    WHERE e.id = s.id AND s.kind = 'retry' AND e.lease_token = $1 AND e.delivered_at IS NULL
    RETURNING e.id, e.key, e.seq
),
released AS (
    UPDATE {{events}} e
    SET locked_by = NULL, locked_until = NULL, lease_token = NULL,
        next_attempt_at = now(), attempts = greatest(e.attempts - 1, 0)
    FROM s
    WHERE e.id = s.id AND s.kind = 'released' AND e.lease_token = $1 AND e.delivered_at IS NULL
    RETURNING e.id
),
killed AS (
    DELETE FROM {{events}} e
    USING s
    WHERE e.id = s.id AND s.kind = 'dead' AND e.lease_token = $1 AND e.delivered_at IS NULL
    RETURNING e.id, e.key, e.key_hash, e.event_type, e.topic, e.payload, e.headers,
              e.created_at, e.attempts, s.code, s.message
),
existing AS (
    SELECT d.id FROM {{dead}} d JOIN s ON s.id = d.id AND s.kind = 'dead'
),
buried AS (
    INSERT INTO {{dead}} (id, key, key_hash, event_type, topic, payload, headers,
                          created_at, attempts, last_error_code, last_error_message)
    SELECT id, key, key_hash, event_type, topic, payload, headers,
           created_at, attempts, code, message
    FROM killed
    ON CONFLICT (id) DO UPDATE
    SET key = EXCLUDED.key, key_hash = EXCLUDED.key_hash, event_type = EXCLUDED.event_type,
        topic = EXCLUDED.topic, payload = EXCLUDED.payload, headers = EXCLUDED.headers,
        created_at = EXCLUDED.created_at, attempts = EXCLUDED.attempts,
        last_error_code = EXCLUDED.last_error_code,
        last_error_message = EXCLUDED.last_error_message, dead_at = now()
    RETURNING id
),
parking AS (
    UPDATE {{events}} e SET parked = true
    FROM retried r
    WHERE e.key = r.key AND e.seq > r.seq
      AND NOT e.parked AND e.delivered_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM s WHERE s.id = e.id)
)
SELECT id, false FROM delivered
UNION ALL SELECT id, false FROM retried
UNION ALL SELECT id, false FROM released
UNION ALL SELECT b.id, EXISTS (SELECT 1 FROM existing x WHERE x.id = b.id) FROM buried b";

const DELIVERED_DELETE_SQL: &str = "\
DELETE FROM {{events}} e
    USING s
    WHERE e.id = s.id AND s.kind = 'delivered' AND e.lease_token = $1 AND e.delivered_at IS NULL
    RETURNING e.id";

const DELIVERED_RETAIN_SQL: &str = "\
UPDATE {{events}} e
    SET delivered_at = now(), locked_by = NULL, locked_until = NULL, lease_token = NULL
    FROM s
    WHERE e.id = s.id AND s.kind = 'delivered' AND e.lease_token = $1 AND e.delivered_at IS NULL
    RETURNING e.id";

/// For [`SeqFloor`]: whether every transaction below `$1` (a candidate's
/// `xmax`) has ended, the smallest `seq` in the claim index (pending,
/// unparked; leased or not), the sequence's last value and this snapshot's
/// `xmax`.
const SEQ_FLOOR_SQL: &str = "\
SELECT coalesce(txid_snapshot_xmin(txid_current_snapshot()) >= $1::bigint, false),
       (SELECT min(seq) FROM {{events}} WHERE delivered_at IS NULL AND NOT parked),
       (SELECT last_value FROM {{seq}}),
       txid_snapshot_xmax(txid_current_snapshot())";

const RENEW_SQL: &str = "\
UPDATE {{events}}
SET locked_until = now() + $3 * interval '1 microsecond',
    next_attempt_at = now() + $3 * interval '1 microsecond'
WHERE id = ANY($1) AND lease_token = $2 AND delivered_at IS NULL";

const STATS_SQL: &str = "\
SELECT count(*) FILTER (WHERE locked_until IS NULL OR locked_until <= now()),
       count(*) FILTER (WHERE locked_until > now()),
       (extract(epoch FROM (now() - min(created_at))) * 1000000)::bigint,
       (SELECT count(*) FROM {{dead}})
FROM {{events}}
WHERE delivered_at IS NULL";

const SHARD_STATS_SQL: &str = "\
SELECT key_hash % $1,
       count(*) FILTER (WHERE locked_until IS NULL OR locked_until <= now()),
       count(*) FILTER (WHERE locked_until > now()),
       (extract(epoch FROM (now() - min(created_at))) * 1000000)::bigint
FROM {{events}}
WHERE delivered_at IS NULL
GROUP BY 1";

const SHARD_DEAD_SQL: &str = "SELECT key_hash % $1, count(*) FROM {{dead}} GROUP BY 1";

const PURGE_DELIVERED_SQL: &str = "\
DELETE FROM {{events}}
WHERE id IN (
    SELECT id FROM {{events}}
    WHERE delivered_at IS NOT NULL AND delivered_at < now() - $1 * interval '1 microsecond'
    ORDER BY delivered_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED)";

/// The dead-letter selection of a [`DeadLetterFilter`], as six parameters
/// from `$first` on (bound by [`bind_dead_filter`], in this order): ids,
/// event type, error code, key, older than (µs), newer than (µs).
pub(crate) fn dead_filter_sql(first: usize) -> String {
    let p = |i: usize| format!("${}", first + i);
    format!(
        "({ids}::uuid[] IS NULL OR id = ANY({ids})) \
         AND ({ty}::text IS NULL OR event_type = {ty}) \
         AND ({code}::text IS NULL OR last_error_code = {code}) \
         AND ({key}::text IS NULL OR key = {key}) \
         AND ({old}::bigint IS NULL OR dead_at <= now() - {old} * interval '1 microsecond') \
         AND ({new}::bigint IS NULL OR dead_at > now() - {new} * interval '1 microsecond')",
        ids = p(0),
        ty = p(1),
        code = p(2),
        key = p(3),
        old = p(4),
        new = p(5),
    )
}

/// Binds the six parameters of [`dead_filter_sql`].
pub(crate) fn bind_dead_filter<'q>(
    q: sqlx::query::Query<'q, sqlx::Postgres, PgArguments>,
    f: &'q DeadLetterFilter,
) -> sqlx::query::Query<'q, sqlx::Postgres, PgArguments> {
    let age = |d: Duration| {
        // Capped at 100 years: fits in i64 microseconds and in timestamptz.
        i64::try_from(d.min(MAX_DEAD_LETTER_AGE).as_micros()).unwrap_or(i64::MAX)
    };
    q.bind(f.ids.as_deref().map(uuids))
        .bind(f.event_type.as_deref())
        .bind(f.code.as_ref().map(ErrorCode::as_str))
        .bind(f.key.as_deref())
        .bind(f.older_than.map(age))
        .bind(f.newer_than.map(age))
}

/// `$1..$6` the filter, `$7` after this id, `$8` limit.
const LIST_DEAD_SQL: &str = "\
SELECT id, key, event_type, topic, payload, headers::text, created_at, attempts, dead_at,
       dead_at, last_error_code, last_error_message
FROM {{dead}}
WHERE {{filter}}
  AND ($7::uuid IS NULL OR id > $7)
ORDER BY id
LIMIT $8";

const COUNT_DEAD_SQL: &str = "SELECT count(*) FROM {{dead}} WHERE {{filter}}";

/// A replayed dead letter takes a new `seq`: it goes behind the events of
/// its key still in the table (never beside one that is leased).
const RETRY_DEAD_SQL: &str = "\
WITH moved AS (
    DELETE FROM {{dead}} WHERE {{filter}} RETURNING *
)
INSERT INTO {{events}} (id, key, key_hash, event_type, topic, payload, headers, created_at,
                        attempts, next_attempt_at, last_error_code, last_error_message)
SELECT id, key, key_hash, event_type, topic, payload, headers, created_at,
       0, now(), last_error_code, last_error_message
FROM moved
ORDER BY dead_at, id";

const PURGE_DEAD_SQL: &str = "DELETE FROM {{dead}} WHERE {{filter}}";

struct StoreSql {
    /// Claim with the shard filter (`key_hash % $1 = $2`).
    claim_shard: String,
    /// Claim for `ShardSpec::ALL`: no filter, so the planner's row estimate
    /// is not skewed by the modulo (whose generic selectivity guess of 0.5%
    /// inflates the plan cost enough to trigger JIT compilation).
    claim: String,
    settle: String,
    seq_floor: String,
    renew: String,
    stats: String,
    shard_stats: String,
    shard_dead: String,
    purge_delivered: String,
    list_dead: String,
    count_dead: String,
    retry_dead: String,
    purge_dead: String,
}

impl StoreSql {
    fn new(names: &Names, retain: bool) -> Self {
        let dead = |sql: &str| names.render(&sql.replace("{{filter}}", &dead_filter_sql(1)));
        let claim = |shard: &str, head_shard: &str| {
            names.render(
                &CLAIM_SQL
                    .replace("{{walk}}", CLAIM_WALK_SQL)
                    .replace("{{head}}", CLAIM_HEAD_SQL)
                    .replace("{{shard_filter}}", shard)
                    .replace("{{head_shard_filter}}", head_shard),
            )
        };
        Self {
            // Written as an inequality on a CASE, the planner estimates the
            // filter at a third (its default for `expr > constant`) instead
            // of its 0.5% guess for `expr = constant`, which made it trade
            // the index walk in `seq` order for a whole-table scan and sort
            // (measured: 2 relays at 0.3 of one). The plain boolean CASE is
            // folded back into the equality by the planner.
            claim_shard: claim(
                "AND CASE WHEN e.key_hash % $1 = $2 THEN 1 ELSE 0 END > 0",
                "AND h.key_hash % $1 = $2",
            ),
            claim: claim("AND $1::bigint IS NOT NULL AND $2::bigint IS NOT NULL", ""),
            settle: names.render(&SETTLE_SQL.replace(
                "{{delivered}}",
                if retain {
                    DELIVERED_RETAIN_SQL
                } else {
                    DELIVERED_DELETE_SQL
                },
            )),
            seq_floor: names.render(SEQ_FLOOR_SQL),
            renew: names.render(RENEW_SQL),
            stats: names.render(STATS_SQL),
            shard_stats: names.render(SHARD_STATS_SQL),
            shard_dead: names.render(SHARD_DEAD_SQL),
            purge_delivered: names.render(PURGE_DELIVERED_SQL),
            list_dead: dead(LIST_DEAD_SQL),
            count_dead: dead(COUNT_DEAD_SQL),
            retry_dead: dead(RETRY_DEAD_SQL),
            purge_dead: dead(PURGE_DEAD_SQL),
        }
    }
}

/// Counts of one shard (see [`PgStore::stats_by_shard`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ShardStats {
    /// The shard.
    pub shard: ShardSpec,
    /// Its counts.
    pub stats: Stats,
}

fn micros(d: Duration) -> Result<i64, StoreError> {
    i64::try_from(d.as_micros()).map_err(|_| StoreError::DurationTooLarge(d))
}

fn age(us: Option<i64>) -> Option<Duration> {
    us.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)))
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// The headers of a claimed event: a JSON object of strings, or the reason
/// the row cannot be delivered.
pub(crate) fn headers_strict(text: &str) -> Result<BTreeMap<String, String>, String> {
    if text == "{}" {
        // Most events carry no headers: no parser for them.
        return Ok(BTreeMap::new());
    }
    serde_json::from_str(text).map_err(|e| {
        format!("headers are not a JSON object of strings: {e} (headers: {text:.200})")
    })
}

/// The headers of a dead letter, as well as they can be shown: a dead
/// letter stays listable even when its headers are why it died. Non-string
/// values are shown as JSON text; headers that are not an object at all are
/// shown whole under `outbox-raw-headers`.
fn headers_lenient(text: &str) -> BTreeMap<String, String> {
    headers_lenient_under(text, "outbox-raw-headers")
}

/// [`headers_lenient`] with the key that holds headers that are not a JSON
/// object at all (each mode keeps its own).
pub(crate) fn headers_lenient_under(text: &str, raw_key: &str) -> BTreeMap<String, String> {
    if let Ok(h) = serde_json::from_str(text) {
        return h;
    }
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        _ => BTreeMap::from([(raw_key.to_owned(), text.to_owned())]),
    }
}

pub(crate) fn last_error(code: Option<String>, message: Option<String>) -> Option<LastError> {
    code.map(|code| LastError {
        code: ErrorCode::new(code),
        message: message.unwrap_or_default(),
    })
}

/// Reads `id, key, event_type, topic, payload, headers, created_at, attempts,
/// next_attempt_at` (columns 0-8) and `last_error_code, last_error_message`
/// (columns 10-11). The outer error is the driver's (a column of the wrong
/// type: the schema is not what this library migrated); the inner one says
/// why this row's content cannot make an event.
fn event_from(
    row: &PgRow,
    headers: impl Fn(&str) -> Result<BTreeMap<String, String>, String>,
) -> Result<Result<Event, (EventId, String)>, StoreError> {
    let id = EventId::from_uuid(row.try_get::<Uuid, _>(0)?);
    let text: String = row.try_get(5)?;
    let attempts: i32 = row.try_get(7)?;
    let headers = match headers(&text) {
        Ok(h) => h,
        Err(why) => return Ok(Err((id, why))),
    };
    Ok(Ok(Event {
        id,
        key: row.try_get(1)?,
        event_type: row.try_get(2)?,
        topic: row.try_get(3)?,
        payload: row.try_get(4)?,
        headers,
        created_at: row.try_get(6)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        next_attempt_at: row.try_get(8)?,
        last_error: last_error(row.try_get(10)?, row.try_get(11)?),
    }))
}

fn uuids(ids: &[EventId]) -> Vec<Uuid> {
    ids.iter().map(EventId::as_uuid).collect()
}

/// `host:port/database` (or the socket path), never the credentials.
fn server_name(o: &PgConnectOptions) -> String {
    let place = match o.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", o.get_host(), o.get_port()),
    };
    match o.get_database() {
        Some(db) => format!("{place}/{db}"),
        None => place,
    }
}

/// The pool of both PostgreSQL stores: `url` parsed (errors without the
/// password), `jit = off` (JIT compilation costs tens of milliseconds per
/// claim and buys nothing for these small, index-driven statements), a
/// first connection tried until `connect_timeout` ([`first_connection`]),
/// then a lazy pool of `max_connections` (both from `settings`). `session`:
/// more settings of the pool's sessions.
pub(crate) async fn connect_pool(
    url: Option<&str>,
    settings: &PoolSettings,
    session: &[(&str, &str)],
) -> Result<PgPool, StoreError> {
    let url =
        url.ok_or_else(|| StoreError::InvalidUrl("no URL given (set DATABASE_URL)".to_owned()))?;
    let connect: PgConnectOptions = url
        .parse()
        .map_err(|e: sqlx::Error| StoreError::InvalidUrl(scrub(&e.to_string(), url)))?;
    let connect = connect
        .options([("jit", "off")])
        .options(session.iter().copied());
    first_connection(&connect, settings.connect_timeout, url).await?;
    Ok(PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        .connect_lazy_with(connect))
}

/// Opens (and closes) one connection, trying again while the server
/// refuses connections or is starting up, until `timeout`. Returns the last
/// attempt's error: the pool would only say it timed out.
async fn first_connection(
    options: &PgConnectOptions,
    timeout: Duration,
    url: &str,
) -> Result<(), StoreError> {
    let started = Instant::now();
    let deadline = started + timeout;
    let mut backoff = Duration::from_millis(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let error = match tokio::time::timeout(left, options.connect()).await {
            Ok(Ok(conn)) => {
                // Only the answer mattered; a failing close changes nothing.
                let _ = conn.close().await;
                return Ok(());
            }
            Ok(Err(e)) => Some(e),
            Err(_) => None,
        };
        let starting = match &error {
            Some(sqlx::Error::Io(e)) => e.kind() == std::io::ErrorKind::ConnectionRefused,
            Some(sqlx::Error::Database(db)) => db.code().is_some_and(|c| c == "57P03"),
            _ => false,
        };
        if !starting || Instant::now() + backoff >= deadline {
            let error = error.map(|e| redacted(e, url));
            return Err(StoreError::Connect {
                server: server_name(options),
                error,
                waited: started.elapsed(),
            });
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// The driver's error with any echo of the URL's password removed (the
/// error types that carry free text are rebuilt as `Configuration`).
fn redacted(e: sqlx::Error, url: &str) -> sqlx::Error {
    let text = e.to_string();
    let clean = scrub(&text, url);
    if clean == text {
        e
    } else {
        sqlx::Error::Configuration(clean.into())
    }
}

impl PgStore {
    fn note_removed(&self, rows: u64) {
        if let Some(v) = &self.inner.vacuum {
            v.removed(&self.inner.pool, rows);
        }
    }

    /// Connects a pool to `options`' URL, applies the migrations when
    /// [`PgStoreOptions::with_auto_migrate`] is set, and starts the LISTEN
    /// task (unless turned off) and the retention purge (when configured).
    ///
    /// A server that refuses connections (e.g. still starting) is tried
    /// again until the connect timeout
    /// ([`PgStoreOptions::with_connect_timeout`]); the error then names the
    /// last attempt's cause ("connection refused", an authentication failure,
    /// a missing database...), never the password.
    pub async fn connect(options: PgStoreOptions) -> Result<Self, StoreError> {
        let pool = connect_pool(options.url.as_deref(), &options.pool, &[]).await?;
        Self::from_pool(pool, options).await
    }

    /// A store on an existing pool (the options' URL and pool size are
    /// ignored). Must be called inside a Tokio runtime.
    pub async fn from_pool(pool: PgPool, options: PgStoreOptions) -> Result<Self, StoreError> {
        let names = Names::new(options.schema.clone(), options.table.clone())?;
        let outbox = PgOutbox::from_names(names)
            .with_notify(options.notify)
            .with_limits(options.pool.limits);
        if options.pool.auto_migrate {
            let mut conn = pool.acquire().await?;
            outbox.migrate(&mut conn).await?;
        }
        let sql = StoreSql::new(&outbox.names, options.retention.is_some());
        let mut tasks = BackgroundTasks::default();
        let wakeup = if options.listen {
            let notify = Arc::new(Notify::new());
            tasks.spawn(listen(
                pool.clone(),
                outbox.channel().to_owned(),
                Arc::clone(&notify),
            ));
            Some(notify)
        } else {
            None
        };
        if let Some(retention) = options.retention {
            let retention_us = micros(retention)?;
            tasks.spawn(purge_loop(
                pool.clone(),
                sql.purge_delivered.clone(),
                retention_us,
                options.purge_batch,
                options.purge_interval,
            ));
        }
        let vacuum = options.vacuum_every.map(|every| Vacuum {
            every,
            sql: outbox.names.render("VACUUM (TRUNCATE false) {{events}}"),
            removed: AtomicU64::new(0),
            busy: Arc::new(AtomicBool::new(false)),
        });
        Ok(Self {
            inner: Arc::new(Inner {
                vacuum,
                pool,
                outbox,
                sql,
                url: options.url,
                listen: options.listen,
                retention: options.retention,
                purge_batch: options.purge_batch,
                wakeup,
                _tasks: tasks,
                held: Held::default(),
                floor: SeqFloor::default(),
            }),
        })
    }

    /// The enqueue handle for this store's outbox (same schema, table,
    /// limits and notify setting).
    pub fn outbox(&self) -> &PgOutbox {
        &self.inner.outbox
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// Applies the missing migrations (see [`PgOutbox::migrate`]).
    pub async fn migrate(&self) -> Result<Vec<i32>, MigrateError> {
        let mut conn = self
            .inner
            .pool
            .acquire()
            .await
            .map_err(MigrateError::Database)?;
        self.inner.outbox.migrate(&mut conn).await
    }

    /// Counts per shard for `total` shards (shard `i` owns `key_hash % total == i`),
    /// one entry per shard, empty shards included. `total` of 0 is treated as 1.
    pub async fn stats_by_shard(&self, total: u32) -> Result<Vec<ShardStats>, StoreError> {
        let total = total.max(1);
        let mut out: Vec<ShardStats> = (0..total)
            .filter_map(|i| ShardSpec::new(i, total).ok())
            .map(|shard| ShardStats {
                shard,
                stats: Stats::default(),
            })
            .collect();
        let rows = sqlx::query(&self.inner.sql.shard_stats)
            .bind(i64::from(total))
            .fetch_all(&self.inner.pool)
            .await?;
        fill_shards(&mut out, &rows, |stats, row| {
            stats.pending = count(row.try_get(1)?);
            stats.in_flight = count(row.try_get(2)?);
            stats.oldest_pending_age = age(row.try_get(3)?);
            Ok(())
        })?;
        let rows = sqlx::query(&self.inner.sql.shard_dead)
            .bind(i64::from(total))
            .fetch_all(&self.inner.pool)
            .await?;
        fill_shards(&mut out, &rows, |stats, row| {
            stats.dead = count(row.try_get(1)?);
            Ok(())
        })?;
        Ok(out)
    }

    /// Deletes up to `limit` delivered rows older than the retention (only
    /// meaningful with [`PgStoreOptions::with_retention`]; the background task
    /// calls this). Returns how many were deleted.
    pub async fn purge_delivered(&self, limit: u32) -> Result<u64, StoreError> {
        let retention = micros(self.inner.retention.unwrap_or_default())?;
        let done = sqlx::query(&self.inner.sql.purge_delivered)
            .bind(retention)
            .bind(i64::from(limit))
            .execute(&self.inner.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// The retention purge batch size.
    pub fn purge_batch(&self) -> u32 {
        self.inner.purge_batch
    }

    /// The claim statement's plan for `req`, as `EXPLAIN (ANALYZE, BUFFERS)`
    /// prints it, run in a transaction that is rolled back (nothing is
    /// claimed or parked). For benchmarks and diagnosis.
    pub async fn explain_claim(&self, req: &ClaimRequest) -> Result<String, StoreError> {
        let lease_us = micros(req.lease)?;
        let sql = format!(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {}",
            self.claim_sql(req)
        );
        let mut tx = self.inner.pool.begin().await?;
        let lines: Vec<String> = sqlx::query_scalar(&sql)
            .bind(i64::from(req.shard.total()))
            .bind(i64::from(req.shard.index()))
            .bind(i64::from(req.batch_size))
            .bind(req.relay_id.as_str())
            .bind(lease_us)
            .bind(FencingToken::new().as_uuid())
            .bind(walk_limit(req.batch_size))
            .fetch_all(&mut *tx)
            .await?;
        tx.rollback().await?;
        Ok(lines.join("\n"))
    }

    /// The claim's `seq` lower bound (see [`SeqFloor`]).
    async fn seq_floor(&self) -> Result<i64, StoreError> {
        let lock = || {
            self.inner
                .floor
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        let known = *lock();
        if known.read_at.is_some_and(|at| at.elapsed() < FLOOR_REFRESH) {
            return Ok(known.bound);
        }
        lock().read_at = Some(Instant::now());
        let (settled, min_pending, last, xmax): (bool, Option<i64>, i64, i64) =
            sqlx::query_as(&self.inner.sql.seq_floor)
                .bind(known.candidate.map(|(_, xmax)| xmax))
                .fetch_one(&self.inner.pool)
                .await?;
        let mut state = lock();
        match (settled, known.candidate) {
            (true, Some((v, _))) => {
                state.bound = min_pending.map_or(v + 1, |m| m.min(v + 1));
                state.candidate = Some((last, xmax));
            }
            _ => {
                if let Some(m) = min_pending {
                    state.bound = state.bound.min(m);
                }
                state.candidate = state.candidate.or(Some((last, xmax)));
            }
        }
        Ok(state.bound)
    }

    fn claim_sql(&self, req: &ClaimRequest) -> &str {
        if req.shard.total() > 1 {
            &self.inner.sql.claim_shard
        } else {
            &self.inner.sql.claim
        }
    }

    /// Records the undecodable rows of a claim as dead letters (fenced by
    /// the claim's token, like any settlement).
    async fn bury_undecodable(
        &self,
        token: FencingToken,
        bad: Vec<(EventId, String)>,
    ) -> Result<(), StoreError> {
        let mut s = Settlement::new();
        for (id, why) in &bad {
            tracing::error!(event_id = %id, reason = %why, "outbox row cannot be decoded; dead-lettered");
            s.push(
                *id,
                Resolution::Dead {
                    error: LastError {
                        code: ErrorCode::UNDECODABLE,
                        message: why.clone(),
                    },
                },
            );
        }
        let report = self.settle(token, &s).await?;
        if !report.fenced.is_empty() {
            tracing::warn!(
                fenced = report.fenced.len(),
                "undecodable outbox rows were re-claimed before they could be dead-lettered"
            );
        }
        Ok(())
    }
}

fn walk_limit(batch_size: u32) -> i64 {
    i64::from(batch_size) + WALK_BEYOND_BATCH
}

/// The settlement as the arrays [`SETTLE_SQL`] takes. An id listed twice
/// keeps its first resolution; the later ones are reported as rejected.
struct SettleArgs {
    ids: Vec<Uuid>,
    kinds: Vec<&'static str>,
    delays: Vec<i64>,
    codes: Vec<Option<String>>,
    messages: Vec<Option<String>>,
    /// The distinct ids, in the order given.
    order: Vec<EventId>,
    duplicates: Vec<Rejected>,
    /// Rows a settlement removes from the events table (for the vacuum count).
    removing: bool,
}

impl SettleArgs {
    fn new(settlement: &Settlement, retain: bool) -> Result<Self, StoreError> {
        let n = settlement.len();
        let mut a = SettleArgs {
            ids: Vec::with_capacity(n),
            kinds: Vec::with_capacity(n),
            delays: Vec::with_capacity(n),
            codes: Vec::with_capacity(n),
            messages: Vec::with_capacity(n),
            order: Vec::with_capacity(n),
            duplicates: Vec::new(),
            removing: false,
        };
        let mut seen = HashSet::with_capacity(n);
        for (id, resolution) in settlement.items() {
            if !seen.insert(*id) {
                a.duplicates.push(Rejected {
                    id: *id,
                    reason: "listed more than once in the settlement: only its first resolution \
                             was recorded"
                        .to_owned(),
                });
                continue;
            }
            let (kind, delay, error) = match resolution {
                Resolution::Delivered => ("delivered", 0, None),
                Resolution::Retry { delay, error } => ("retry", micros(*delay)?, Some(error)),
                Resolution::Dead { error } => ("dead", 0, Some(error)),
                Resolution::Released => ("released", 0, None),
                // A resolution added to core after this store was written:
                // record nothing for it rather than guess.
                _ => {
                    a.duplicates.push(Rejected {
                        id: *id,
                        reason: format!(
                            "resolution `{}` is not supported by this version of outbox-postgres; \
                             the event stays leased until its lease expires",
                            resolution.name()
                        ),
                    });
                    continue;
                }
            };
            a.removing |= kind == "dead" || (kind == "delivered" && !retain);
            a.ids.push(id.as_uuid());
            a.kinds.push(kind);
            a.delays.push(delay);
            a.codes.push(error.map(|e| e.code.as_str().to_owned()));
            a.messages.push(error.map(|e| e.message.clone()));
            a.order.push(*id);
        }
        Ok(a)
    }
}

async fn listen(pool: PgPool, channel: String, notify: Arc<Notify>) {
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(sqlx::Error::PoolClosed) => return,
            Err(e) => {
                tracing::warn!(error = %crate::error::Cause(&e), "outbox LISTEN connection failed; retrying in 1s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if let Err(e) = listener.listen(&channel).await {
            tracing::warn!(error = %crate::error::Cause(&e), channel, "outbox LISTEN failed; retrying in 1s");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        tracing::debug!(channel, "outbox listening for notifications");
        // Anything committed while we were not listening is found by a poll.
        notify.notify_one();
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => notify.notify_one(),
                // Connection lost and re-established: notifications may be lost.
                Ok(None) => notify.notify_one(),
                Err(sqlx::Error::PoolClosed) => return,
                Err(e) => {
                    tracing::warn!(error = %crate::error::Cause(&e), channel, "outbox LISTEN connection broke; reconnecting in 1s");
                    notify.notify_one();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
            }
        }
    }
}

async fn purge_loop(pool: PgPool, sql: String, retention_us: i64, batch: u32, every: Duration) {
    loop {
        loop {
            match sqlx::query(&sql)
                .bind(retention_us)
                .bind(i64::from(batch))
                .execute(&pool)
                .await
            {
                Ok(done) if done.rows_affected() >= u64::from(batch) => continue,
                Ok(done) => {
                    if done.rows_affected() > 0 {
                        tracing::debug!(
                            purged = done.rows_affected(),
                            "purged delivered outbox rows"
                        );
                    }
                    break;
                }
                Err(sqlx::Error::PoolClosed) => return,
                Err(e) => {
                    tracing::warn!(error = %crate::error::Cause(&e), "purging delivered outbox rows failed");
                    break;
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

impl Store for PgStore {
    type Error = StoreError;

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let token = FencingToken::new();
        let lease_us = micros(req.lease)?;
        if req.batch_size == 0 {
            return Ok(Claim {
                token,
                lease_until: Utc::now(),
                events: Vec::new(),
                more: false,
            });
        }
        let floor = self.seq_floor().await?;
        let rows = sqlx::query(self.claim_sql(req))
            .bind(i64::from(req.shard.total()))
            .bind(i64::from(req.shard.index()))
            .bind(i64::from(req.batch_size))
            .bind(req.relay_id.as_str())
            .bind(lease_us)
            .bind(token.as_uuid())
            .bind(walk_limit(req.batch_size))
            .bind(floor)
            .fetch_all(&self.inner.pool)
            .await
            .inspect_err(|_| {
                // The floor is the only state this store keeps across
                // statements. A failed claim may mean a database crash
                // restart, after which sequence values and transaction ids
                // are handed out again below it: walk from the start until
                // the next refresh has a bound read in this incarnation.
                *self
                    .inner
                    .floor
                    .state
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = FloorState::default();
            })?;
        let mut lease_until: Option<DateTime<Utc>> = None;
        let mut ordered = Vec::with_capacity(rows.len());
        let mut bad = Vec::new();
        for row in &rows {
            lease_until = Some(row.try_get(9)?);
            let seq: i64 = row.try_get(12)?;
            match event_from(row, headers_strict)? {
                Ok(e) => ordered.push((seq, e)),
                Err(undecodable) => bad.push(undecodable),
            }
        }
        // Insertion order (the database sequence), which is per-key order.
        ordered.sort_by_key(|(seq, _)| *seq);
        let events: Vec<Event> = ordered.into_iter().map(|(_, e)| e).collect();
        self.inner
            .held
            .claimed(token, events.iter().map(|e| e.id.as_uuid()));
        if !bad.is_empty() {
            self.bury_undecodable(token, bad).await?;
        }
        if !events.is_empty() {
            tracing::debug!(
                relay = %req.relay_id,
                shard = %req.shard,
                count = events.len(),
                token = %token,
                "claimed outbox events"
            );
        }
        Ok(Claim::up_to_batch_size(
            req,
            token,
            // No rows: nothing is leased, so the time is only informative.
            lease_until.unwrap_or_else(Utc::now),
            events,
        ))
    }

    async fn settle(
        &self,
        token: FencingToken,
        settlement: &Settlement,
    ) -> Result<SettleReport, StoreError> {
        let args = SettleArgs::new(settlement, self.inner.retention.is_some())?;
        let mut report = SettleReport {
            rejected: args.duplicates,
            ..SettleReport::default()
        };
        if args.ids.is_empty() {
            return Ok(report);
        }
        let rows: Vec<(Uuid, bool)> = sqlx::query_as(&self.inner.sql.settle)
            .bind(token.as_uuid())
            .bind(&args.ids)
            .bind(&args.kinds)
            .bind(&args.delays)
            .bind(&args.codes)
            .bind(&args.messages)
            .fetch_all(&self.inner.pool)
            .await?;
        let applied: HashSet<Uuid> = rows.iter().map(|(id, _)| *id).collect();
        report.applied = applied.len() as u64;
        report.fenced = args
            .order
            .iter()
            .filter(|id| !applied.contains(&id.as_uuid()))
            .copied()
            .collect();
        for (id, replaced) in rows {
            if replaced {
                report.rejected.push(Rejected {
                    id: EventId::from_uuid(id),
                    reason: "a dead letter with this id already existed (the same id was \
                             enqueued again after it died); it was replaced by this newer failure"
                        .to_owned(),
                });
            }
        }
        self.inner.held.settled(token, args.ids.iter().copied());
        if args.removing {
            let removed = args
                .order
                .iter()
                .zip(&args.kinds)
                .filter(|(id, kind)| {
                    applied.contains(&id.as_uuid())
                        && (**kind == "dead"
                            || (**kind == "delivered" && self.inner.retention.is_none()))
                })
                .count();
            self.note_removed(removed as u64);
        }
        if !report.fenced.is_empty() {
            tracing::debug!(
                token = %token,
                fenced = report.fenced.len(),
                "settlement fenced out: the lease was lost"
            );
        }
        Ok(report)
    }

    async fn renew(&self, token: FencingToken, lease: Duration) -> Result<u64, StoreError> {
        let lease_us = micros(lease)?;
        let Some(ids) = self.inner.held.ids(token) else {
            return Ok(0);
        };
        let held = sqlx::query(&self.inner.sql.renew)
            .bind(ids)
            .bind(token.as_uuid())
            .bind(lease_us)
            .execute(&self.inner.pool)
            .await?
            .rows_affected();
        self.inner.held.renewed(token, held);
        Ok(held)
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let row = sqlx::query(&self.inner.sql.stats)
            .fetch_one(&self.inner.pool)
            .await?;
        Ok(Stats {
            pending: count(row.try_get(0)?),
            in_flight: count(row.try_get(1)?),
            oldest_pending_age: age(row.try_get(2)?),
            dead: count(row.try_get(3)?),
        })
    }

    fn wakeup(&self) -> impl std::future::Future<Output = ()> + Send {
        let notify = self.inner.wakeup.clone();
        async move {
            match notify {
                // `notify_one` keeps a permit when nobody waits, so a
                // notification between two calls is not lost.
                Some(n) => n.notified().await,
                None => std::future::pending().await,
            }
        }
    }
}

impl DeadLetterStore for PgStore {
    type Error = StoreError;

    async fn list_dead(&self, query: &DeadLetterQuery) -> Result<Vec<DeadLetter>, StoreError> {
        let rows = bind_dead_filter(sqlx::query(&self.inner.sql.list_dead), &query.filter)
            .bind(query.after.map(|id| id.as_uuid()))
            .bind(i64::from(query.limit))
            .fetch_all(&self.inner.pool)
            .await?;
        rows.iter()
            .map(|row| {
                let event = match event_from(row, |h| Ok(headers_lenient(h)))? {
                    Ok(event) => event,
                    Err((id, detail)) => return Err(StoreError::Corrupt { id, detail }),
                };
                let dead_at: DateTime<Utc> = row.try_get(8)?;
                Ok(DeadLetter::new(event, dead_at))
            })
            .collect()
    }

    async fn count_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let n: i64 = bind_dead_filter(sqlx::query(&self.inner.sql.count_dead), filter)
            .fetch_one(&self.inner.pool)
            .await?
            .try_get(0)?;
        Ok(count(n))
    }

    async fn retry_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        let moved = bind_dead_filter(sqlx::query(&self.inner.sql.retry_dead), filter)
            .execute(&self.inner.pool)
            .await?
            .rows_affected();
        if moved > 0 {
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(self.inner.outbox.channel())
                .execute(&self.inner.pool)
                .await?;
        }
        Ok(moved)
    }

    async fn purge_dead(&self, filter: &DeadLetterFilter) -> Result<u64, StoreError> {
        Ok(
            bind_dead_filter(sqlx::query(&self.inner.sql.purge_dead), filter)
                .execute(&self.inner.pool)
                .await?
                .rows_affected(),
        )
    }
}
