//! The statements of [`PgStore`](super::PgStore) (the queue table), rendered
//! once per store.

use crate::dead_filter::dead_filter_sql;
use crate::names::queue::Names;

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
pub(super) const CLAIM_SQL: &str = "\
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
pub(super) const CLAIM_WALK_SQL: &str = "
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
pub(super) const CLAIM_HEAD_SQL: &str = "
            SELECT h.seq, h.parked OR h.next_attempt_at > now() AS busy,
                   h.parked OR (h.next_attempt_at > now() AND h.locked_until IS NULL) AS parks
            FROM {{events}} h
            WHERE h.key = w.key AND h.delivered_at IS NULL
            ORDER BY h.seq LIMIT 1";

/// How many rows a claim may walk beyond its batch size. Bounds the work of
/// a claim that finds blocked rows (it parks what it walked; about 10 us a
/// row here) and so how many claims a backlog behind blocked keys takes to
/// park when a retry did not park it already.
pub(super) const WALK_BEYOND_BATCH: i64 = 512;

/// Settles a batch, one statement: `$1` token; `$2..$6` the settlement as
/// arrays (id, kind, delay in microseconds, error code, error message).
/// Returns one row per id the token still held: `(id, replaced)` where
/// `replaced` says a dead letter with that id already existed and was
/// overwritten by this newer failure.
pub(super) const SETTLE_SQL: &str = "\
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

pub(super) const DELIVERED_DELETE_SQL: &str = "\
DELETE FROM {{events}} e
    USING s
    WHERE e.id = s.id AND s.kind = 'delivered' AND e.lease_token = $1 AND e.delivered_at IS NULL
    RETURNING e.id";

pub(super) const DELIVERED_RETAIN_SQL: &str = "\
UPDATE {{events}} e
    SET delivered_at = now(), locked_by = NULL, locked_until = NULL, lease_token = NULL
    FROM s
    WHERE e.id = s.id AND s.kind = 'delivered' AND e.lease_token = $1 AND e.delivered_at IS NULL
    RETURNING e.id";

/// For [`SeqFloor`]: whether every transaction below `$1` (a candidate's
/// `xmax`) has ended, the smallest `seq` in the claim index (pending,
/// unparked; leased or not), the sequence's last value and this snapshot's
/// `xmax`.
pub(super) const SEQ_FLOOR_SQL: &str = "\
SELECT coalesce(txid_snapshot_xmin(txid_current_snapshot()) >= $1::bigint, false),
       (SELECT min(seq) FROM {{events}} WHERE delivered_at IS NULL AND NOT parked),
       (SELECT last_value FROM {{seq}}),
       txid_snapshot_xmax(txid_current_snapshot())";

pub(super) const RENEW_SQL: &str = "\
UPDATE {{events}}
SET locked_until = now() + $3 * interval '1 microsecond',
    next_attempt_at = now() + $3 * interval '1 microsecond'
WHERE id = ANY($1) AND lease_token = $2 AND delivered_at IS NULL";

pub(super) const STATS_SQL: &str = "\
SELECT count(*) FILTER (WHERE locked_until IS NULL OR locked_until <= now()),
       count(*) FILTER (WHERE locked_until > now()),
       (extract(epoch FROM (now() - min(created_at))) * 1000000)::bigint,
       (SELECT count(*) FROM {{dead}})
FROM {{events}}
WHERE delivered_at IS NULL";

pub(super) const SHARD_STATS_SQL: &str = "\
SELECT key_hash % $1,
       count(*) FILTER (WHERE locked_until IS NULL OR locked_until <= now()),
       count(*) FILTER (WHERE locked_until > now()),
       (extract(epoch FROM (now() - min(created_at))) * 1000000)::bigint
FROM {{events}}
WHERE delivered_at IS NULL
GROUP BY 1";

pub(super) const SHARD_DEAD_SQL: &str = "SELECT key_hash % $1, count(*) FROM {{dead}} GROUP BY 1";

pub(super) const PURGE_DELIVERED_SQL: &str = "\
DELETE FROM {{events}}
WHERE id IN (
    SELECT id FROM {{events}}
    WHERE delivered_at IS NOT NULL AND delivered_at < now() - $1 * interval '1 microsecond'
    ORDER BY delivered_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED)";

/// `$1..$6` the filter, `$7` after this id, `$8` limit.
pub(super) const LIST_DEAD_SQL: &str = "\
SELECT id, key, event_type, topic, payload, headers::text, created_at, attempts, dead_at,
       dead_at, last_error_code, last_error_message
FROM {{dead}}
WHERE {{filter}}
  AND ($7::uuid IS NULL OR id > $7)
ORDER BY id
LIMIT $8";

/// The heads of the table ([`HeldKeyStore`](outbox_core::HeldKeyStore)):
/// a key's first undelivered event when it failed or waits for a later
/// time (a keyless one only when it failed), with the key's undelivered
/// events behind it. A leased row's `next_attempt_at` is its lease end, so
/// a first attempt in flight is not a head. Read as two halves, unparked
/// and parked, so each is a scan of its partial index (the claim's and the
/// parked keys'): the pending rows only, never the delivered rows a table
/// retains. Columns as [`event_from`] reads them, then `locked_until`,
/// waiting, first waiting, total. `$1` limit.
///
/// [`event_from`]: super::rows::event_from
pub(super) const HELD_KEYS_SQL: &str = "\
WITH candidates AS (
    SELECT e.* FROM {{events}} e
    WHERE e.delivered_at IS NULL AND NOT e.parked
      AND (e.last_error_code IS NOT NULL
           OR (e.key IS NOT NULL AND e.locked_until IS NULL AND e.next_attempt_at > now()))
    UNION ALL
    SELECT e.* FROM {{events}} e
    WHERE e.delivered_at IS NULL AND e.parked
      AND (e.last_error_code IS NOT NULL
           OR (e.locked_until IS NULL AND e.next_attempt_at > now()))
),
heads AS (
    SELECT e.* FROM candidates e
    WHERE e.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {{events}} p WHERE p.key = e.key AND p.delivered_at IS NULL AND p.seq < e.seq)
)
SELECT h.id, h.key, h.event_type, h.topic, h.payload, h.headers::text, h.created_at, h.attempts,
       h.next_attempt_at, NULL, h.last_error_code, h.last_error_message,
       CASE WHEN h.locked_until > now() THEN h.locked_until END, w.n, w.first, count(*) OVER ()
FROM heads h
CROSS JOIN LATERAL (
    SELECT count(*) AS n, (array_agg(x.id ORDER BY x.seq))[1] AS first
    FROM {{events}} x
    WHERE h.key IS NOT NULL AND x.key = h.key AND x.delivered_at IS NULL AND x.seq > h.seq
) w
ORDER BY w.n DESC, h.created_at, h.id
LIMIT $1";

pub(super) const COUNT_DEAD_SQL: &str = "SELECT count(*) FROM {{dead}} WHERE {{filter}}";

/// A replayed dead letter takes a new `seq`: it goes behind the events of
/// its key still in the table (never beside one that is leased).
pub(super) const RETRY_DEAD_SQL: &str = "\
WITH moved AS (
    DELETE FROM {{dead}} WHERE {{filter}} RETURNING *
)
INSERT INTO {{events}} (id, key, key_hash, event_type, topic, payload, headers, created_at,
                        attempts, next_attempt_at, last_error_code, last_error_message)
SELECT id, key, key_hash, event_type, topic, payload, headers, created_at,
       0, now(), last_error_code, last_error_message
FROM moved
ORDER BY dead_at, id";

pub(super) const PURGE_DEAD_SQL: &str = "DELETE FROM {{dead}} WHERE {{filter}}";

pub(super) struct StoreSql {
    /// Claim with the shard filter (`key_hash % $1 = $2`).
    pub(super) claim_shard: String,
    /// Claim for `ShardSpec::ALL`: no filter, so the planner's row estimate
    /// is not skewed by the modulo (whose generic selectivity guess of 0.5%
    /// inflates the plan cost enough to trigger JIT compilation).
    pub(super) claim: String,
    pub(super) settle: String,
    pub(super) seq_floor: String,
    pub(super) renew: String,
    pub(super) stats: String,
    pub(super) shard_stats: String,
    pub(super) shard_dead: String,
    pub(super) purge_delivered: String,
    pub(super) list_dead: String,
    pub(super) count_dead: String,
    pub(super) held_keys: String,
    pub(super) retry_dead: String,
    pub(super) purge_dead: String,
}

impl StoreSql {
    pub(super) fn new(names: &Names, retain: bool) -> Self {
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
            held_keys: names.render(HELD_KEYS_SQL),
            retry_dead: dead(RETRY_DEAD_SQL),
            purge_dead: dead(PURGE_DEAD_SQL),
        }
    }
}
