//! The SQL of [`PgLogStore`](super::PgLogStore), rendered once per store.

use crate::names::log::{LogNames, PARTITIONS};

/// Takes or keeps the cursor lease. `$1..$3` the cursor, `$4` relay, `$5`
/// the epoch this process holds (-1: none), `$6` lease in µs. Always one
/// row: `epoch` is NULL when another relay holds a current lease, `present`
/// is false when the cursor does not exist yet. The epoch stays only when
/// the same relay renews a lease that has not run out: after a lapse, the
/// batches claimed under it are void (their events come back), as a
/// per-event lease would make them.
const ACQUIRE: &str = "\
WITH u AS (
    UPDATE {{cursors}}
    SET epoch = CASE WHEN owner = $4 AND epoch = $5 AND lease_until > now()
                     THEN epoch ELSE epoch + 1 END,
        owner = $4,
        lease_until = now() + $6 * interval '1 microsecond'
    WHERE grp = $1 AND shard_total = $2 AND shard_index = $3
      AND (owner = $4 OR lease_until IS NULL OR lease_until <= now())
    RETURNING epoch, lease_until, lo::text AS lo, hi::text AS hi, pos_txid::text AS pos_txid, pos_seq,
              skip_txid::text[] AS skip_txid, skip_seq, lo_floor, hi_floor
)
SELECT u.epoch, u.lease_until, u.lo, u.hi, u.pos_txid, u.pos_seq, now(),
       EXISTS (SELECT 1 FROM {{cursors}} WHERE grp = $1 AND shard_total = $2 AND shard_index = $3),
       u.skip_txid, u.skip_seq, u.lo_floor, u.hi_floor, (SELECT token::text FROM {{boot}})
FROM (SELECT 1) one LEFT JOIN u ON true";

/// Creates a cursor at `$4` (a snapshot: nothing visible in it is delivered).
const CREATE_CURSOR: &str = "\
INSERT INTO {{cursors}} (grp, shard_total, shard_index, lo, hi)
VALUES ($1, $2, $3, $4::pg_snapshot, $4::pg_snapshot)
ON CONFLICT DO NOTHING";

const GROUP_STARTS: &str =
    "SELECT shard_total, shard_index, lo::text FROM {{cursors}} WHERE grp = $1";

const ORIGIN: &str = "SELECT origin::text FROM {{meta}}";

/// The claim: due lane rows first (of each key, its rows in lane order up
/// to the first one not due yet: after an outage a key's released head and
/// the events parked behind it go out in one batch, in order, instead of
/// one per key per round trip), then the log from
/// the read position: the rest of window (lo, hi), then, if that has fewer
/// than `$11` rows, the new window (hi, now). See the module docs.
///
/// The log branches are written in delivery order (in a window, the
/// transactions running at its lower snapshot precede its range) under one
/// `LIMIT $11`: PostgreSQL's `Append` runs its branches in order and the
/// limit stops it, so the new window is not read at all while the old one
/// fills the batch, and no branch is materialized to be counted. The rows
/// are a prefix of the delivery order; the store still sorts them by
/// (branch, ord / txid, seq), as the lane rows and the snapshot row come
/// first in no particular order.
///
/// Every log branch is an ordered index scan that stops after `$11` rows,
/// whatever the statistics say: a range branch starts at one row
/// comparison and has no upper bound in the index condition (visibility in
/// the window's upper snapshot is the bound), because an estimated range
/// makes the planner, on a table never analyzed, pick a bitmap scan and a
/// sort of the whole window (a quadratic drain). The transactions that
/// were running at the lower snapshot are read one by one (`LATERAL`), so
/// a huge transaction is read in slices too. A snapshot parameter is cast
/// once (`(SELECT $7::pg_snapshot)`), not once per row.
///
/// The first output row that has a snapshot (`cur_text`) carries the
/// snapshot and the lease check; every other row is an event (`w` set).
///
/// **Order inside a window is `seq`, the order of the INSERTs** (one
/// uncached sequence): a transaction takes its id at its first write, so
/// (txid, seq) order would put the event of a transaction that wrote
/// something, then waited for its aggregate's lock, before the event of
/// the transaction it waited for. A window's events are found by two
/// kinds of branch: the transactions running at its lower snapshot (by
/// their ids, index `(txid, seq)`), for their events at or below the lower
/// snapshot's *seq floor*; and a range scan in seq order (index `(seq)`)
/// from the floor, filtered by visibility in both snapshots. The floor of
/// a snapshot is a seq below every event of a transaction at or above its
/// xmax: each claim reads the sequence's last value and THEN takes a
/// transaction id of its own (`pg_current_xact_id()`, in that order in
/// one target list), so every transaction with a later id inserts above
/// that value; once the claim has completed its id is below the xmax of
/// every later snapshot, so the value is a floor for those (the store
/// keeps the latest one, see `PgLogStore`). Transactions running at the
/// lower snapshot with an id below its xmax are in its xip and are read by
/// id; all others are above the floor. The branches of a window are
/// disjoint (at or below the floor / above it) and each is in seq order,
/// so their concatenation is the window in seq order. The claim's own
/// transaction id commits asynchronously (it writes nothing).
///
/// The snapshot row also carries the database's incarnation token
/// (`{{boot}}`, unlogged: empty after crash recovery or on a promoted
/// standby) and the sequence value read.
///
/// `$1` group, `$2`/`$3` shard total and indexes (a cursor reads the keys of
/// one shard, or of a set of virtual shards that share one position), `$4`
/// lo, `$5` where the range of (lo, hi) resumes (max of lo's floor and the
/// read position's seq), `$6` xip(lo) finished by hi, `$7` hi, `$8` lo's
/// floor, `$9` the seq read so far in (lo, hi) (0: none), `$10` xip(hi),
/// `$11` limit, `$12` lane ords held by outstanding batches, `$13` keys held
/// by outstanding batches, `$14`/`$15` (txid, seq) of rows to skip (settled
/// before a change of holder; only the statements rendered with a skip
/// filter read them), `$16` our epoch (`lease_ok` is false when the lease
/// ran out or moved: the rows are then ignored and the lease taken again),
/// `$17` hi's floor, `$18` the snapshot that ends the new window (NULL:
/// the current one; a relay that reads several cursors passes the one its
/// first claim of a round took, so cursors that catch up end at the same
/// position and can be merged), `$19` the shards read as a bit mask
/// ([`shard_mask`]; only the rendering that tests keys against it reads it).
const CLAIM: &str = "\
WITH snap AS MATERIALIZED (
    SELECT COALESCE($18::pg_snapshot, pg_current_snapshot()) AS cur,
           (SELECT count(*) FROM {{cursors}}
             WHERE grp = $1 AND shard_total = $2 AND shard_index = ANY($3::int[])
               AND epoch = $16 AND lease_until > now()) = cardinality($3::int[]) AS lease_ok,
           (SELECT token::text FROM {{boot}}) AS boot,
           -- The sequence first, then our own transaction id: see above.
           coalesce(pg_sequence_last_value('{{order_lit}}'), 0) AS obs,
           pg_current_xact_id() AS obs_xid
),
lane_keys AS MATERIALIZED (
    SELECT key FROM {{lane}} WHERE grp = $1 AND key IS NOT NULL
    UNION
    SELECT key FROM {{dead}} WHERE grp = $1 AND blocking AND key IS NOT NULL
),
logged AS (
    SELECT * FROM (
        (SELECT 1 AS w, {{cols}}
           FROM unnest($6::xid8[]) AS x(t) CROSS JOIN LATERAL (
            SELECT e.* FROM {{log}} e
            WHERE e.txid = x.t AND e.seq > $9::bigint AND e.seq <= $8::bigint
              {{shard}}
              {{skip}}
            ORDER BY e.txid, e.seq LIMIT $11) e
          ORDER BY e.seq LIMIT $11)
        UNION ALL
        (SELECT 1, {{cols}} FROM {{log}} e
          WHERE e.seq > $5::bigint
            AND pg_visible_in_snapshot(e.txid, (SELECT $7::pg_snapshot))
            AND NOT pg_visible_in_snapshot(e.txid, (SELECT $4::pg_snapshot))
            {{shard}}
            {{skip}}
          ORDER BY e.seq LIMIT $11)
        UNION ALL
        (SELECT 2, {{cols}}
           FROM snap, unnest($10::xid8[]) AS x(t) CROSS JOIN LATERAL (
            SELECT e.* FROM {{log}} e
            WHERE e.txid = x.t AND e.seq <= $17::bigint
              {{shard}}
              {{skip}}
            ORDER BY e.txid, e.seq LIMIT $11) e
          WHERE pg_visible_in_snapshot(x.t, snap.cur)
          ORDER BY e.seq LIMIT $11)
        UNION ALL
        (SELECT 2, {{cols}} FROM {{log}} e
          WHERE e.seq > $17::bigint
            AND pg_visible_in_snapshot(e.txid, (SELECT cur FROM snap))
            AND NOT pg_visible_in_snapshot(e.txid, (SELECT $7::pg_snapshot))
            {{shard}}
            {{skip}}
          ORDER BY e.seq LIMIT $11)
    ) branches
    LIMIT $11
),
blocked AS MATERIALIZED (
    SELECT key, min(ord) AS ord FROM {{lane}}
    WHERE grp = $1 AND key IS NOT NULL AND next_attempt_at > now()
    GROUP BY key
),
due AS (
    SELECT l.* FROM {{lane}} l
    WHERE l.grp = $1 AND l.next_attempt_at <= now()
      {{lane_shard}}
      AND NOT (l.ord = ANY($12::bigint[]))
      AND (l.key IS NULL OR (
            NOT (l.key = ANY($13::text[]))
            AND NOT EXISTS (SELECT 1 FROM blocked b WHERE b.key = l.key AND b.ord < l.ord)
            AND NOT EXISTS (SELECT 1 FROM {{dead}} d
                            WHERE d.grp = l.grp AND d.key = l.key AND d.blocking)))
    ORDER BY l.ord LIMIT $11
)
SELECT cur::text AS cur_text, lease_ok, NULL::int AS w, NULL::xid8, NULL::bigint, NULL::bigint,
       NULL::uuid, NULL::text, NULL::text, NULL::text, NULL::bytea, NULL::text, NULL::timestamptz,
       NULL::int, NULL::timestamptz, NULL::text, NULL::text, NULL::boolean, boot, obs
FROM snap
UNION ALL
SELECT NULL, NULL, 0, NULL, NULL, d.ord, d.id, d.key, d.event_type,
       d.topic, d.payload, d.headers::text, d.created_at, d.attempts,
       d.next_attempt_at, d.last_error_code, d.last_error_message, false, NULL::text, NULL::bigint
FROM due d
UNION ALL
SELECT NULL, NULL, g.w, g.txid, g.seq, NULL, g.id, g.key, g.event_type,
       g.topic, g.payload, g.headers::text, g.created_at, 0,
       g.created_at, NULL, NULL,
       (g.key IS NOT NULL AND g.key IN (SELECT key FROM lane_keys))
         -- A delayed event not due yet parks (into the lane, due at deliver_at).
         OR coalesce(g.deliver_at > now(), false),
       NULL::text, NULL::bigint
FROM logged g";

/// The log columns a claim reads (`e`: a log row).
const CLAIM_COLS: &str = "e.txid, e.seq, e.id, e.key, e.event_type, e.topic, e.payload, \
                          e.headers, e.created_at, e.deliver_at";

/// The claim's filter of rows settled before a change of holder (`$14`/`$15`).
const CLAIM_SKIP: &str =
    "AND (e.txid, e.seq) NOT IN (SELECT * FROM UNNEST($14::xid8[], $15::bigint[]))";

/// Copies log rows into the retry lane, in the order given (the `ord`
/// default is evaluated row by row in that order). `$1` group, `$2`/`$3`
/// (txid, seq), `$4` attempts, `$5` delay in µs, `$6`/`$7` last error. A
/// delayed event is not due before its `deliver_at` (`greatest` ignores NULL).
const LOG_TO_LANE: &str = "\
INSERT INTO {{lane}} (grp, id, key, key_hash, event_type, topic, payload, headers, created_at,
                      attempts, next_attempt_at, last_error_code, last_error_message)
SELECT $1, x.id, x.key, x.key_hash, x.event_type, x.topic, x.payload, x.headers, x.created_at,
       x.attempts, greatest(now() + x.delay_us * interval '1 microsecond', x.deliver_at),
       x.code, x.message
FROM (
    SELECT e.id, e.key, e.key_hash, e.event_type, e.topic, e.payload, e.headers, e.created_at,
           e.deliver_at, t.attempts, t.delay_us, t.code, t.message
    FROM UNNEST($2::text[], $3::bigint[], $4::int[], $5::bigint[], $6::text[], $7::text[])
         WITH ORDINALITY AS t(txid, seq, attempts, delay_us, code, message, n)
    JOIN {{log}} e ON e.txid = t.txid::xid8 AND e.seq = t.seq
    ORDER BY t.n
    OFFSET 0
) x
ON CONFLICT DO NOTHING";

/// Dead-letters log rows. A dead letter of the same id is replaced
/// (`replaced` = true). `$1` group, `$2`/`$3` (txid, seq), `$4` attempts,
/// `$5`/`$6` error, `$7` blocking.
const LOG_TO_DEAD: &str = "\
INSERT INTO {{dead}} (grp, id, ord, key, key_hash, event_type, topic, payload, headers, created_at,
                      attempts, last_error_code, last_error_message, blocking)
SELECT $1, x.id, nextval('{{lane_ord_lit}}'), x.key, x.key_hash, x.event_type, x.topic, x.payload,
       x.headers, x.created_at, x.attempts, x.code, x.message, $7
FROM (
    SELECT e.id, e.key, e.key_hash, e.event_type, e.topic, e.payload, e.headers, e.created_at,
           t.attempts, t.code, t.message
    FROM UNNEST($2::text[], $3::bigint[], $4::int[], $5::text[], $6::text[])
         WITH ORDINALITY AS t(txid, seq, attempts, code, message, n)
    JOIN {{log}} e ON e.txid = t.txid::xid8 AND e.seq = t.seq
    ORDER BY t.n
    OFFSET 0
) x
ON CONFLICT (grp, id) DO UPDATE
SET ord = excluded.ord, key = excluded.key, key_hash = excluded.key_hash,
    event_type = excluded.event_type, topic = excluded.topic, payload = excluded.payload,
    headers = excluded.headers, created_at = excluded.created_at, attempts = excluded.attempts,
    last_error_code = excluded.last_error_code, last_error_message = excluded.last_error_message,
    dead_at = now(), blocking = excluded.blocking
RETURNING id, xmax::text <> '0'";

/// Settles lane rows: `$2` ords, `$3` kind (0 delivered, 1 retry, 2 dead),
/// `$4` attempts after this one, `$5` delay µs, `$6`/`$7` error, `$8` blocking.
const LANE_SETTLE: &str = "\
WITH t AS (
    SELECT * FROM UNNEST($2::bigint[], $3::int[], $4::int[], $5::bigint[], $6::text[], $7::text[])
        AS t(ord, kind, attempts, delay_us, code, message)
),
retried AS (
    UPDATE {{lane}} l
    SET attempts = t.attempts,
        next_attempt_at = now() + t.delay_us * interval '1 microsecond',
        last_error_code = t.code, last_error_message = t.message
    FROM t
    WHERE l.grp = $1 AND l.ord = t.ord AND t.kind = 1
    RETURNING l.id
),
removed AS (
    DELETE FROM {{lane}} l USING t
    WHERE l.grp = $1 AND l.ord = t.ord AND t.kind IN (0, 2)
    RETURNING l.*, t.kind, t.attempts AS new_attempts, t.code, t.message
),
buried AS (
    INSERT INTO {{dead}} (grp, id, ord, key, key_hash, event_type, topic, payload, headers,
                          created_at, attempts, last_error_code, last_error_message, blocking)
    SELECT grp, id, ord, key, key_hash, event_type, topic, payload, headers, created_at,
           new_attempts, code, message, $8
    FROM removed WHERE kind = 2
    ON CONFLICT (grp, id) DO UPDATE
    SET ord = excluded.ord, key = excluded.key, key_hash = excluded.key_hash,
        event_type = excluded.event_type, topic = excluded.topic, payload = excluded.payload,
        headers = excluded.headers, created_at = excluded.created_at, attempts = excluded.attempts,
        last_error_code = excluded.last_error_code,
        last_error_message = excluded.last_error_message, dead_at = now(),
        blocking = excluded.blocking
    RETURNING id, xmax::text <> '0' AS replaced
)
SELECT id, replaced FROM buried";

/// The fence of every settle: bumps nothing, but only matches while the
/// epoch is ours and the database is the incarnation we read our windows
/// in (`$14`, see [`BOOT`]), and row-locks the cursor until the
/// transaction ends. With `$5` set, also moves the settled position (with
/// the floors `$12`/`$13`); with `$9`/`$10` set, replaces the skip list;
/// with `$11` set, commits the transaction with that `synchronous_commit`
/// (see `PgLogOptions::with_durable_progress`).
const ADVANCE: &str = "\
UPDATE {{cursors}}
SET lo = COALESCE($5::pg_snapshot, lo),
    hi = COALESCE($6::pg_snapshot, hi),
    pos_txid = CASE WHEN $5 IS NULL THEN pos_txid ELSE $7::xid8 END,
    pos_seq = CASE WHEN $5 IS NULL THEN pos_seq ELSE $8::bigint END,
    lo_floor = CASE WHEN $5 IS NULL THEN lo_floor ELSE $12::bigint END,
    hi_floor = CASE WHEN $5 IS NULL THEN hi_floor ELSE $13::bigint END,
    skip_txid = COALESCE($9::xid8[], skip_txid),
    skip_seq = COALESCE($10::bigint[], skip_seq),
    updated_at = now()
WHERE grp = $1 AND shard_total = $2 AND shard_index = ANY($3::int[]) AND epoch = $4
  AND EXISTS (SELECT 1 FROM {{boot}} WHERE token = $14::uuid)
  AND ($11::text IS NULL OR set_config('synchronous_commit', $11::text, true) IS NOT NULL)
RETURNING epoch";

const RENEW: &str = "\
UPDATE {{cursors}} SET lease_until = now() + $5 * interval '1 microsecond'
WHERE grp = $1 AND shard_total = $2 AND shard_index = ANY($3::int[]) AND epoch = $4
  AND EXISTS (SELECT 1 FROM {{boot}} WHERE token = $6::uuid)
RETURNING lease_until";

/// The database's incarnation token: `{{boot}}` is UNLOGGED, so crash
/// recovery empties it and a promoted standby has it empty. A store that
/// finds it empty writes a new token (the first writer wins) and reads it.
const BOOT: &str = "\
WITH ins AS (
    INSERT INTO {{boot}} (token) VALUES ($1::uuid) ON CONFLICT DO NOTHING RETURNING token
)
SELECT token::text FROM ins UNION ALL SELECT token::text FROM {{boot}} LIMIT 1";

/// Renews the lease of a set of virtual-shard cursors a relay holds, while
/// it has not run out. `$1` group, `$2` total, `$3` indexes, `$4` epoch,
/// `$5` lease µs, `$6` relay. One row per cursor still held.
const RENEW_SET: &str = "\
UPDATE {{cursors}} SET lease_until = now() + $5 * interval '1 microsecond'
WHERE grp = $1 AND shard_total = $2 AND shard_index = ANY($3::int[]) AND epoch = $4
  AND owner = $6 AND lease_until > now()
  AND EXISTS (SELECT 1 FROM {{boot}} WHERE token = $7::uuid)
RETURNING lease_until, now()";

/// A relay of a group says it is alive (until `now() + $3` µs) and reads
/// the other live relays and how many of the `$4` virtual-shard cursors
/// exist. Relays silent for an hour are forgotten.
const HEARTBEAT: &str = "\
WITH hb AS (
    INSERT INTO {{relays}} (grp, relay, seen_until)
    VALUES ($1, $2, now() + $3 * interval '1 microsecond')
    ON CONFLICT (grp, relay) DO UPDATE SET seen_until = excluded.seen_until
    RETURNING 1
),
gc AS (
    DELETE FROM {{relays}} WHERE grp = $1 AND relay <> $2 AND seen_until < now() - interval '1 hour'
    RETURNING 1
)
SELECT ARRAY(SELECT relay FROM {{relays}}
             WHERE grp = $1 AND relay <> $2 AND seen_until > now() ORDER BY relay),
       (SELECT count(*) FROM {{cursors}} WHERE grp = $1 AND shard_total = $4),
       (SELECT count(*) FROM hb) + (SELECT count(*) FROM gc)";

/// Virtual-shard cursors nobody holds (or this relay held and lost track
/// of), with their position as one comparable text. `$1` group, `$2`
/// total, `$3` relay, `$4` indexes the relay holds already.
const FREE_SHARDS: &str = "\
SELECT shard_index,
       concat_ws('|', lo::text, hi::text, pos_txid::text, pos_seq::text,
                 skip_txid::text, skip_seq::text)
FROM {{cursors}}
WHERE grp = $1 AND shard_total = $2 AND NOT (shard_index = ANY($4::int[]))
  AND (lease_until IS NULL OR lease_until <= now() OR owner = $3)
ORDER BY shard_index";

/// Takes the leases of free virtual-shard cursors under one new epoch
/// (greater than every epoch of the group, so it differs from each
/// cursor's previous one). `$1` group, `$2` total, `$3` indexes, `$4`
/// relay, `$5` lease µs. One row per cursor taken (another relay may have
/// been faster for some).
const ACQUIRE_SET: &str = "\
UPDATE {{cursors}} c
SET epoch = n.e, owner = $4, lease_until = now() + $5 * interval '1 microsecond'
FROM (SELECT coalesce(max(epoch), 0) + 1 AS e FROM {{cursors}} WHERE grp = $1) n
WHERE c.grp = $1 AND c.shard_total = $2 AND c.shard_index = ANY($3::int[])
  AND (c.lease_until IS NULL OR c.lease_until <= now() OR c.owner = $4)
RETURNING c.shard_index, c.epoch, c.lease_until, c.lo::text, c.hi::text, c.pos_txid::text,
          c.pos_seq, c.skip_txid::text[], c.skip_seq, now(), c.lo_floor, c.hi_floor,
          (SELECT token::text FROM {{boot}})";

/// Gives cursors back (a relay above its fair share, or leaving): their
/// position stays, the next holder continues from it. `$1` group, `$2`
/// total, `$3` indexes, `$4` epoch, `$5` relay.
const RELEASE_SET: &str = "\
UPDATE {{cursors}} SET owner = NULL, lease_until = NULL
WHERE grp = $1 AND shard_total = $2 AND shard_index = ANY($3::int[]) AND epoch = $4 AND owner = $5";

/// Merges cursors a relay holds at the same settled position into one set:
/// one new epoch, the position written to all. `$1` group, `$2` total,
/// `$3`/`$4` (index, epoch) pairs, `$5` relay, `$6`/`$7` lo/hi, `$8`/`$9`
/// (txid, seq), `$10` lease µs, `$11`/`$12` the floors of lo/hi, `$13` the
/// incarnation the position was read in. One row per cursor merged.
const MERGE_SET: &str = "\
UPDATE {{cursors}} c
SET epoch = n.e, lo = $6::pg_snapshot, hi = $7::pg_snapshot, pos_txid = $8::xid8,
    pos_seq = $9::bigint, skip_txid = '{}', skip_seq = '{}', updated_at = now(),
    lease_until = now() + $10 * interval '1 microsecond',
    lo_floor = $11::bigint, hi_floor = $12::bigint
FROM (SELECT coalesce(max(epoch), 0) + 1 AS e FROM {{cursors}} WHERE grp = $1) n
WHERE c.grp = $1 AND c.shard_total = $2 AND c.owner = $5 AND c.lease_until > now()
  AND EXISTS (SELECT 1 FROM {{boot}} WHERE token = $13::uuid)
  AND (c.shard_index, c.epoch) IN (SELECT * FROM UNNEST($3::int[], $4::bigint[]))
RETURNING c.epoch, c.lease_until";

/// Creates the missing virtual-shard cursors of a group, each at its own
/// start. `$1` group, `$2` total, `$3` indexes, `$4` start snapshots.
const CREATE_SET: &str = "\
INSERT INTO {{cursors}} (grp, shard_total, shard_index, lo, hi)
SELECT $1, $2, t.i, t.s::pg_snapshot, t.s::pg_snapshot
FROM UNNEST($3::int[], $4::text[]) AS t(i, s)
ON CONFLICT DO NOTHING";

const VIRTUAL_SHARDS: &str = "SELECT virtual_shards FROM {{meta}}";

/// Leaving a group gracefully.
const LEAVE: &str = "DELETE FROM {{relays}} WHERE grp = $1 AND relay = $2";

/// Counts what is not yet delivered, per cursor of the group (or from the
/// origin when the group has no cursor yet), plus the lane.
const STATS: &str = "\
WITH c AS (SELECT * FROM {{cursors}} WHERE grp = $1),
pend AS (
    SELECT e.created_at FROM c CROSS JOIN LATERAL (
        SELECT e.created_at FROM {{log}} e
        WHERE e.txid >= pg_snapshot_xmin(c.lo) AND NOT pg_visible_in_snapshot(e.txid, c.lo)
          AND e.key_hash % c.shard_total = c.shard_index
          AND NOT (pg_visible_in_snapshot(e.txid, c.hi) AND c.pos_txid IS NOT NULL
                   AND e.seq <= c.pos_seq)
    ) e
    UNION ALL
    SELECT e.created_at FROM {{log}} e, {{meta}} m
    WHERE NOT EXISTS (SELECT 1 FROM c)
      AND e.txid >= pg_snapshot_xmin(m.origin) AND NOT pg_visible_in_snapshot(e.txid, m.origin)
    UNION ALL
    SELECT created_at FROM {{lane}} WHERE grp = $1
)
SELECT (SELECT count(*) FROM pend),
       (SELECT (extract(epoch FROM (now() - min(created_at))) * 1000000)::bigint FROM pend),
       (SELECT count(*) FROM {{dead}} WHERE grp = $1),
       (SELECT count(*) FROM {{lane}} WHERE grp = $1),
       (SELECT count(*) FROM {{lane}} l WHERE grp = $1 AND l.key IS NOT NULL
          AND EXISTS (SELECT 1 FROM {{lane}} p WHERE p.grp = l.grp AND p.key = l.key AND p.ord < l.ord))";

const CURSORS: &str = "\
SELECT shard_total, shard_index, epoch, owner, lease_until, lease_until > now(),
       lo::text, hi::text, pos_txid::text, pos_seq, updated_at
FROM {{cursors}} WHERE grp = $1 ORDER BY shard_total, shard_index";

/// `$1` group, `$2..$7` the dead-letter filter
/// ([`dead_filter_sql`](crate::store::dead_filter_sql)), `$8` after this
/// id, `$9` limit.
const LIST_DEAD: &str = "\
SELECT id, key, event_type, topic, payload, headers::text, created_at, attempts, dead_at,
       last_error_code, last_error_message
FROM {{dead}}
WHERE grp = $1 AND {{filter}}
  AND ($8::uuid IS NULL OR id > $8)
ORDER BY id
LIMIT $9";

/// The heads of a group's retry lane ([`HeldKeyStore`](outbox_core::HeldKeyStore)):
/// a lane row that failed or waits for a later time (a key's first lane
/// row, unless a blocking dead letter of its key comes first; a keyless one
/// only when it failed), and a key's first blocking dead letter; each with
/// the key's lane rows behind it. `$1` group, `$2` limit.
const HELD_KEYS: &str = "\
WITH lane_heads AS (
    SELECT l.id, l.key, l.event_type, l.topic, l.payload, l.headers, l.created_at, l.attempts,
           l.next_attempt_at AS at, l.last_error_code, l.last_error_message, false AS dead
    FROM {{lane}} l
    WHERE l.grp = $1
      AND (l.last_error_code IS NOT NULL OR (l.key IS NOT NULL AND l.next_attempt_at > now()))
      AND (l.key IS NULL OR (
            NOT EXISTS (SELECT 1 FROM {{lane}} p WHERE p.grp = l.grp AND p.key = l.key AND p.ord < l.ord)
        AND NOT EXISTS (SELECT 1 FROM {{dead}} d WHERE d.grp = l.grp AND d.blocking AND d.key = l.key)))
),
dead_heads AS (
    SELECT d.id, d.key, d.event_type, d.topic, d.payload, d.headers, d.created_at, d.attempts,
           d.dead_at AS at, d.last_error_code, d.last_error_message, true AS dead
    FROM {{dead}} d
    WHERE d.grp = $1 AND d.blocking AND d.key IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM {{dead}} e
                      WHERE e.grp = d.grp AND e.blocking AND e.key = d.key AND e.ord < d.ord)
),
heads AS (SELECT * FROM lane_heads UNION ALL SELECT * FROM dead_heads)
SELECT h.id, h.key, h.event_type, h.topic, h.payload, h.headers::text, h.created_at, h.attempts,
       h.at, h.last_error_code, h.last_error_message, h.dead, w.n, w.first, count(*) OVER ()
FROM heads h
CROSS JOIN LATERAL (
    SELECT count(*) AS n, (array_agg(x.id ORDER BY x.ord))[1] AS first
    FROM {{lane}} x
    WHERE x.grp = $1 AND h.key IS NOT NULL AND x.key = h.key AND x.id <> h.id
) w
ORDER BY w.n DESC, h.created_at, h.id
LIMIT $2";

const COUNT_DEAD: &str = "SELECT count(*) FROM {{dead}} WHERE grp = $1 AND {{filter}}";

/// Replays dead letters into the retry lane, eligible now with attempts 0.
/// A *blocking* dead letter (policy `block`) keeps its place in its key's
/// order (`ord`): the key's later events are parked behind it, so it goes
/// first. A non-blocking one (policy `continue`: the key went on) takes a
/// new `ord`: it goes behind the key's events in the lane, and the key's
/// events the cursor reads later park behind it.
const RETRY_DEAD: &str = "\
WITH moved AS (
    DELETE FROM {{dead}} d
    WHERE d.grp = $1 AND {{filter}}
      AND NOT EXISTS (SELECT 1 FROM {{lane}} l WHERE l.grp = d.grp AND l.id = d.id)
    RETURNING d.*
)
INSERT INTO {{lane}} (grp, ord, id, key, key_hash, event_type, topic, payload, headers, created_at,
                      attempts, next_attempt_at, last_error_code, last_error_message)
SELECT grp, CASE WHEN blocking THEN ord ELSE nextval('{{lane_ord_lit}}') END, id, key, key_hash,
       event_type, topic, payload, headers, created_at, 0, now(), last_error_code,
       last_error_message
FROM moved
ORDER BY ord";

const PURGE_DEAD: &str = "DELETE FROM {{dead}} WHERE grp = $1 AND {{filter}}";

/// Rotation, step 1 (in the rotation transaction): is a rotation due, and
/// which generation is current. Locks the meta row (NOWAIT: another store
/// rotating right now makes this one skip).
const ROTATE_DUE: &str = "\
SELECT switched_at + $1 * interval '1 microsecond' <= now(), generation
FROM {{meta}} FOR UPDATE NOWAIT";

/// Rotation, step 2: may partition `{{part}}` be truncated? `cursors`: how
/// many exist; `incomplete`: a group whose shards are not all present;
/// `behind`: a cursor that has not passed every row of the partition. A
/// row is not passed when it is after the cursor's window (lo, hi) (at or
/// above xmax(hi), or of a transaction running at hi), or in the window
/// after the position (above xmax(lo), or of a transaction running at lo,
/// and after (pos_txid, pos_seq)). Every probe is an index scan from the
/// cursor's frontier, never from an xmin a long transaction holds back.
const ROTATE_CHECK: &str = "\
SELECT (SELECT count(*) FROM {{cursors}}),
       EXISTS (SELECT 1 FROM {{cursors}} GROUP BY grp, shard_total HAVING count(*) < shard_total),
       EXISTS (SELECT 1 FROM {{cursors}} c WHERE {{behind}})";

/// Cursor `c` has not passed every row of partition `{{part}}` (see
/// [`ROTATE_CHECK`]); also used per group by `outbox-relay status` / `group
/// list` to say which group holds rotation back.
pub(crate) const BEHIND_PARTITION: &str = "(
           (SELECT true FROM {{part}} e WHERE e.txid >= pg_snapshot_xmax(c.hi)
             ORDER BY e.txid, e.seq LIMIT 1) IS NOT NULL
        OR (SELECT true FROM pg_snapshot_xip(c.hi) AS x(t) CROSS JOIN LATERAL (
              SELECT 1 FROM {{part}} e WHERE e.txid = x.t ORDER BY e.txid, e.seq LIMIT 1) e
            LIMIT 1) IS NOT NULL
        OR (SELECT true FROM {{part}} e
             WHERE e.txid >= pg_snapshot_xmax(c.lo)
               AND (c.pos_seq IS NULL OR e.seq > c.pos_seq)
               AND pg_visible_in_snapshot(e.txid, c.hi)
             ORDER BY e.txid, e.seq LIMIT 1) IS NOT NULL
        OR (SELECT true FROM pg_snapshot_xip(c.lo) AS x(t) CROSS JOIN LATERAL (
              SELECT 1 FROM {{part}} e
               WHERE e.txid = x.t AND (c.pos_seq IS NULL OR e.seq > c.pos_seq)
               ORDER BY e.txid, e.seq LIMIT 1) e
            WHERE pg_visible_in_snapshot(x.t, c.hi)
            LIMIT 1) IS NOT NULL)";

/// Rotation, before its lock: every other session and prepared transaction
/// that holds or waits for a lock on partition `{{part}}`, one row per
/// lock, oldest transaction first: pid (NULL for a prepared transaction),
/// application_name, state, backend_type, since (transaction start, or the
/// time it was prepared), the prepared transaction's gid, the lock mode,
/// granted, the database clock. A prepared (2PC) transaction's locks have no pid: pg_locks
/// shows its virtual transaction as `-1/<xid>`. Read in Rust
/// (`rotation::Holder`) to say which one is a writer and which one holds
/// rotation back.
const ROTATE_HOLDERS: &str = "\
SELECT l.pid, a.application_name, a.state, a.backend_type,
       coalesce(a.xact_start, p.prepared, a.query_start, a.backend_start) AS since,
       p.gid, l.mode, l.granted, clock_timestamp() AS now
FROM pg_locks l
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN LATERAL (
    -- A prepared transaction's lock has no pid; PostgreSQL 15 shows it under
    -- the virtual transaction it was prepared in (`-1/<xid>` only on some
    -- versions and lock kinds): the exact match when there is one, else
    -- every prepared transaction of this database, oldest first.
    SELECT string_agg(x.gid, ', ' ORDER BY x.prepared) AS gid, min(x.prepared) AS prepared
    FROM pg_prepared_xacts x
    WHERE x.database = current_database()
      AND (l.virtualtransaction = '-1/' || x.transaction::text
           OR NOT EXISTS (SELECT 1 FROM pg_prepared_xacts y
                          WHERE l.virtualtransaction = '-1/' || y.transaction::text))
) p ON l.pid IS NULL
WHERE l.locktype = 'relation' AND l.relation = '{{part}}'::regclass
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.pid IS DISTINCT FROM pg_backend_pid()
ORDER BY since NULLS FIRST, l.pid";

/// Rotation, last step (in the rotation transaction, under the meta row's
/// lock): the new generation is recorded with the rotation. `switched_at`
/// is the end of the rotation, not its start (`now()`): a rotation that
/// took longer than the interval does not make the next one due at once.
const ROTATE_DONE: &str = "\
UPDATE {{meta}} SET switched_at = clock_timestamp(), rotations = rotations + 1,
                    generation = generation + 1
RETURNING rotations, generation";

/// After the rotation committed (so producers never wait for the
/// truncation): the generation sequence, which producers route by, catches
/// up with the committed generation. Idempotent: a rotator that died
/// between its commit and this is caught up by the next rotation's
/// [`ROTATE_CATCH_UP`].
const ROTATE_BUMP: &str = "\
SELECT setval('{{gen_lit}}', $1::bigint)
WHERE coalesce(pg_sequence_last_value('{{gen_lit}}'), 0) < $1::bigint";

/// Rotation, step 1b (under the meta row's lock): the generation sequence
/// catches up with the committed generation, if a rotator has not bumped
/// it yet.
const ROTATE_CATCH_UP: &str = "\
SELECT setval('{{gen_lit}}', m.generation) FROM {{meta}} m
WHERE coalesce(pg_sequence_last_value('{{gen_lit}}'), 0) < m.generation";

/// The partitions as the statistics collector sees them. `$1` schema,
/// `$2` the partitions' names in slot order.
const PARTITIONS_INFO: &str = "\
SELECT p.slot::int, coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0),
       coalesce(pg_total_relation_size(c.oid), 0),
       (SELECT pg_sequence_last_value('{{gen_lit}}')), m.rotations, m.switched_at
FROM unnest($2::text[]) WITH ORDINALITY AS p(relname, slot)
JOIN pg_namespace n ON n.nspname = $1
LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.relname
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
CROSS JOIN {{meta}} m
ORDER BY p.slot";

/// Per cursor of the group: what it has not passed yet (count, oldest),
/// its retry lane (rows, keys with parked events), its lease.
const STATUS: &str = "\
SELECT c.shard_total, c.shard_index, c.owner, coalesce(c.lease_until > now(), false), c.epoch,
       c.updated_at, p.n,
       (extract(epoch FROM (now() - p.oldest)) * 1000000)::bigint,
       (SELECT count(*) FROM {{lane}} l
         WHERE l.grp = c.grp AND l.key_hash % c.shard_total = c.shard_index),
       (SELECT count(DISTINCT l.key) FROM {{lane}} l
         WHERE l.grp = c.grp AND l.key_hash % c.shard_total = c.shard_index AND l.key IS NOT NULL
           AND EXISTS (SELECT 1 FROM {{lane}} h
                       WHERE h.grp = l.grp AND h.key = l.key AND h.ord < l.ord)),
       (SELECT (extract(epoch FROM (now() - min(l.created_at))) * 1000000)::bigint FROM {{lane}} l
         WHERE l.grp = c.grp AND l.key_hash % c.shard_total = c.shard_index)
FROM {{cursors}} c
CROSS JOIN LATERAL (
    SELECT count(*) AS n, min(e.created_at) AS oldest FROM {{log}} e
    WHERE e.txid >= pg_snapshot_xmin(c.lo) AND NOT pg_visible_in_snapshot(e.txid, c.lo)
      AND e.key_hash % c.shard_total = c.shard_index
      AND NOT (pg_visible_in_snapshot(e.txid, c.hi) AND c.pos_txid IS NOT NULL
               AND e.seq <= c.pos_seq)
) p
WHERE c.grp = $1
ORDER BY c.shard_total, c.shard_index";

/// The oldest open transaction that has a transaction id (a writer: its
/// events, if any, wait for its commit; a partition it wrote to cannot be
/// rotated out).
const OLDEST_WRITER: &str = "\
SELECT (extract(epoch FROM (now() - min(xact_start))) * 1000000)::bigint
FROM pg_stat_activity WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()";

/// The retry lane's size and its parked keys (keys with an event waiting
/// behind an earlier one of theirs), for one group.
const LANE_GAUGES: &str = "\
SELECT count(*),
       count(DISTINCT l.key) FILTER (WHERE l.key IS NOT NULL AND EXISTS (
           SELECT 1 FROM {{lane}} h WHERE h.grp = l.grp AND h.key = l.key AND h.ord < l.ord))
FROM {{lane}} l WHERE l.grp = $1";

// Consumer groups (`groups.rs`), rendered there.

/// Every group that has cursors, a retry lane or dead letters.
pub(super) const GROUP_NAMES: &str = "\
SELECT grp FROM {{cursors}} UNION SELECT grp FROM {{lane}} UNION SELECT grp FROM {{dead}}
ORDER BY 1";

/// A group's dead letters by error code.
pub(super) const DEAD_BY_CODE: &str = "\
SELECT last_error_code, count(*) FROM {{dead}} WHERE grp = $1 GROUP BY 1 ORDER BY 1";

/// What a group holds: cursors, lane rows, dead letters, control and relay
/// rows, current lease holders.
pub(super) const CONTENTS: &str = "\
SELECT (SELECT count(*) FROM {{cursors}} WHERE grp = $1),
       (SELECT count(*) FROM {{lane}} WHERE grp = $1),
       (SELECT count(*) FROM {{dead}} WHERE grp = $1),
       (SELECT count(*) FROM {{control}} WHERE grp = $1),
       (SELECT count(*) FROM {{relays}} WHERE grp = $1),
       ARRAY(SELECT DISTINCT owner FROM {{cursors}}
             WHERE grp = $1 AND owner IS NOT NULL AND lease_until > now() ORDER BY 1)";

/// The cursors of `$1` that have not passed every row of partition
/// `{{part}}` (the predicate of the rotation's own check, per cursor).
pub(super) const BEHIND: &str = "\
SELECT c.shard_total, c.shard_index FROM {{cursors}} c WHERE c.grp = $1 AND {{behind}}
ORDER BY 1, 2";

/// Shard layouts of `$1` with cursors for only some of their shards.
pub(super) const INCOMPLETE: &str = "\
SELECT shard_total, count(*) FROM {{cursors}} WHERE grp = $1
GROUP BY shard_total HAVING count(*) < shard_total ORDER BY 1";

/// The relays holding a current lease on a cursor (every group).
pub(super) const RELAYS: &str = "\
SELECT owner, grp, shard_total, shard_index FROM {{cursors}}
WHERE owner IS NOT NULL AND lease_until > now()
ORDER BY owner, grp, shard_total, shard_index";

/// The oldest open transaction with a snapshot or an id, other than ours.
pub(super) const OLDEST_TRANSACTION: &str = "\
SELECT (extract(epoch FROM (now() - xact_start)) * 1000000)::bigint, pid,
       coalesce(application_name, ''), state, backend_xid IS NOT NULL
FROM pg_stat_activity
WHERE xact_start IS NOT NULL AND pid <> pg_backend_pid()
  AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)
ORDER BY xact_start LIMIT 1";

/// The replication slots and the age of their horizons.
pub(super) const SLOTS: &str = "\
SELECT slot_name::text, slot_type, active,
       CASE WHEN xmin IS NULL THEN NULL ELSE age(xmin)::bigint END,
       CASE WHEN catalog_xmin IS NULL THEN NULL ELSE age(catalog_xmin)::bigint END
FROM pg_replication_slots ORDER BY slot_name";

/// Prepared transactions: how many, and the age of the oldest.
pub(super) const PREPARED: &str = "\
SELECT count(*), (extract(epoch FROM (now() - min(prepared))) * 1000000)::bigint
FROM pg_prepared_xacts";

/// A group's cursor rows locked for [`drop_group`](super::PgLogStore::drop_group):
/// their lease holders and whether each lease is current.
pub(super) const GROUP_OWNERS_FOR_UPDATE: &str = "\
SELECT owner, coalesce(lease_until > now(), false) FROM {{cursors}}
WHERE grp = $1 ORDER BY owner FOR UPDATE";

/// What [`drop_group`](super::PgLogStore::drop_group) deletes, in order:
/// the group's cursors, retry lane, dead letters, control row (a pause)
/// and relay rows (relay-group members).
pub(super) const GROUP_DELETE: [&str; 5] = [
    "DELETE FROM {{cursors}} WHERE grp = $1",
    "DELETE FROM {{lane}} WHERE grp = $1",
    "DELETE FROM {{dead}} WHERE grp = $1",
    "DELETE FROM {{control}} WHERE grp = $1",
    "DELETE FROM {{relays}} WHERE grp = $1",
];

/// The dead letters of group `$1`.
const DEAD_COUNT: &str = "SELECT count(*) FROM {{dead}} WHERE grp = $1";

/// The relays of group `$1` and the virtual shards (of `$2`) whose lease
/// each holds.
const RELAY_GROUP: &str = "\
SELECT r.relay, r.seen_until > now(),
       ARRAY(SELECT c.shard_index FROM {{cursors}} c
             WHERE c.grp = r.grp AND c.owner = r.relay AND c.shard_total = $2
               AND c.lease_until > now() ORDER BY c.shard_index)
FROM {{relays}} r WHERE r.grp = $1 ORDER BY r.relay";

/// Creates every cursor of layout `$2` for group `$1` at the current
/// snapshot (those that exist are kept) and returns that snapshot.
const CREATE_AT_NOW: &str = "\
WITH s AS MATERIALIZED (SELECT pg_current_snapshot() AS snap),
ins AS (
    INSERT INTO {{cursors}} (grp, shard_total, shard_index, lo, hi)
    SELECT $1, $2, i, s.snap, s.snap FROM s, generate_series(0, $2 - 1) AS i
    ON CONFLICT DO NOTHING
    RETURNING 1
)
SELECT s.snap::text, (SELECT count(*) FROM ins) FROM s";

/// Probe of the wake-up loop: the current snapshot.
pub(crate) const PROBE: &str = "SELECT pg_current_snapshot()::text";

pub(crate) struct Sql {
    pub(crate) acquire: String,
    pub(crate) create_cursor: String,
    pub(crate) group_starts: String,
    pub(crate) origin: String,
    /// The claim of a cursor that reads some shards, its keys tested against
    /// a bit mask of the shards (`$19`), without and with the skip filter
    /// ([`Sql::claim`]).
    claim_mask: [String; 2],
    /// The same, the shards as a list (`= ANY($3)`): for layouts too large
    /// for a mask ([`MASK_MAX_SHARDS`]).
    claim_some: [String; 2],
    /// The claim of a cursor that reads every key (`ShardSpec::ALL`: no
    /// shard filter), without and with the skip filter.
    claim_all: [String; 2],
    pub(crate) log_to_lane: String,
    pub(crate) log_to_dead: String,
    pub(crate) lane_settle: String,
    pub(crate) advance: String,
    pub(crate) renew: String,
    pub(crate) boot: String,
    pub(crate) renew_set: String,
    pub(crate) heartbeat: String,
    pub(crate) free_shards: String,
    pub(crate) acquire_set: String,
    pub(crate) release_set: String,
    pub(crate) merge_set: String,
    pub(crate) create_set: String,
    pub(crate) virtual_shards: String,
    pub(crate) leave: String,
    pub(crate) stats: String,
    pub(crate) cursors: String,
    pub(crate) list_dead: String,
    pub(crate) count_dead: String,
    pub(crate) held_keys: String,
    pub(crate) retry_dead: String,
    pub(crate) purge_dead: String,
    pub(crate) rotate_due: String,
    pub(crate) rotate_check: Vec<String>,
    pub(crate) rotate_lock: Vec<String>,
    /// Per partition: the other sessions and prepared transactions that
    /// hold (or wait for) a lock on it ([`ROTATE_HOLDERS`]).
    pub(crate) rotate_holders: Vec<String>,
    pub(crate) rotate_truncate: Vec<String>,
    pub(crate) rotate_done: String,
    pub(crate) rotate_bump: String,
    pub(crate) rotate_catch_up: String,
    pub(crate) partitions_info: String,
    pub(crate) status: String,
    pub(crate) lane_gauges: String,
    pub(crate) oldest_writer: &'static str,
    pub(crate) create_at_now: String,
    pub(crate) dead_count: String,
    pub(crate) relay_group: String,
}

/// The largest shard layout whose claim tests keys against a bit mask
/// (`$19`, `total` bits: 8 KiB here); larger layouts pass a list.
pub(crate) const MASK_MAX_SHARDS: u32 = 65_536;

/// The claim's `$19`: bit `i` (PostgreSQL's `get_bit` order: the low bit of
/// byte `i / 8` first) set for each of `shards`; empty when
/// [`Sql::claim`] picks a rendering that does not read it (every shard
/// held, or more than [`MASK_MAX_SHARDS`]), so no claim ships a mask it
/// ignores.
pub(crate) fn shard_mask(total: u32, shards: &[u32]) -> Vec<u8> {
    if total > MASK_MAX_SHARDS || reads_every_shard(total, shards.len()) {
        return Vec::new();
    }
    let mut mask = vec![0u8; total.div_ceil(8) as usize];
    for &i in shards.iter().filter(|i| **i < total) {
        mask[(i / 8) as usize] |= 1 << (i % 8);
    }
    mask
}

/// A cursor holding `held` of `total` shards reads every key (no filter).
fn reads_every_shard(total: u32, held: usize) -> bool {
    usize::try_from(total).is_ok_and(|t| t <= held)
}

impl Sql {
    /// The claim statement for a cursor of `held` shards of `total` (all of
    /// them: it reads every key, no filter), `skip` when it has rows to skip
    /// (`$14`/`$15` not empty).
    pub(crate) fn claim(&self, total: u32, held: usize, skip: bool) -> &str {
        let set = if reads_every_shard(total, held) {
            &self.claim_all
        } else if total <= MASK_MAX_SHARDS {
            &self.claim_mask
        } else {
            &self.claim_some
        };
        &set[usize::from(skip)]
    }

    pub(crate) fn new(names: &LogNames, pooled: bool) -> Self {
        // sqlx looks up a result column's type it does not know (`xid8`)
        // with a prepared statement it names and keeps: through a pooler
        // in transaction mode that name is another client's next. There
        // the claim returns its transaction ids as `bigint` (cast per row).
        let xid_out = |sql: String| {
            if pooled {
                sql.replace("NULL::xid8", "NULL::bigint").replace(
                    "SELECT NULL, NULL, g.w, g.txid,",
                    "SELECT NULL, NULL, g.w, g.txid::text::bigint,",
                )
            } else {
                sql
            }
        };
        let dead = |sql: &str| {
            names.render(&sql.replace("{{filter}}", &crate::dead_filter::dead_filter_sql(2)))
        };
        let claim = |shard: &str, lane_shard: &str| {
            [false, true].map(|skip| {
                xid_out(
                    names.render(
                        &CLAIM
                            .replace("{{cols}}", CLAIM_COLS)
                            .replace("{{shard}}", shard)
                            .replace("{{lane_shard}}", lane_shard)
                            .replace("{{skip}}", if skip { CLAIM_SKIP } else { "" }),
                    ),
                )
            })
        };
        let per_partition = |template: &str| -> Vec<String> {
            (0..PARTITIONS)
                .map(|i| names.render(&template.replace("{{part}}", &names.partition(i))))
                .collect()
        };
        Self {
            acquire: names.render(ACQUIRE),
            create_cursor: names.render(CREATE_CURSOR),
            group_starts: names.render(GROUP_STARTS),
            origin: names.render(ORIGIN),
            // A bit test per row, whatever the number of shards held: a
            // list parameter is searched element by element (a generic
            // plan never hashes it), 4x the cost of one comparison per row
            // with 32 shards held (BENCHMARKS.md).
            claim_mask: claim(
                "AND get_bit($19::bytea, (e.key_hash % $2::bigint)::int) = 1",
                "AND l.key_hash % $2::bigint = ANY($3::int[])",
            ),
            claim_some: claim(
                "AND e.key_hash % $2::bigint = ANY($3::int[])",
                "AND l.key_hash % $2::bigint = ANY($3::int[])",
            ),
            // ShardSpec::ALL: no shard filter at all (a modulo's generic
            // selectivity estimate would skew the plan, and a filter on the
            // parameters alone puts a projecting node over every scan);
            // `$2`/`$3` are still read by the lease check.
            claim_all: claim("", ""),
            log_to_lane: names.render(LOG_TO_LANE),
            log_to_dead: names.render(LOG_TO_DEAD),
            lane_settle: names.render(LANE_SETTLE),
            advance: names.render(ADVANCE),
            renew: names.render(RENEW),
            boot: names.render(BOOT),
            renew_set: names.render(RENEW_SET),
            heartbeat: names.render(HEARTBEAT),
            free_shards: names.render(FREE_SHARDS),
            acquire_set: names.render(ACQUIRE_SET),
            release_set: names.render(RELEASE_SET),
            merge_set: names.render(MERGE_SET),
            create_set: names.render(CREATE_SET),
            virtual_shards: names.render(VIRTUAL_SHARDS),
            leave: names.render(LEAVE),
            stats: names.render(STATS),
            cursors: names.render(CURSORS),
            list_dead: dead(LIST_DEAD),
            count_dead: dead(COUNT_DEAD),
            held_keys: names.render(HELD_KEYS),
            retry_dead: dead(RETRY_DEAD),
            purge_dead: dead(PURGE_DEAD),
            rotate_due: names.render(ROTATE_DUE),
            rotate_check: per_partition(&ROTATE_CHECK.replace("{{behind}}", BEHIND_PARTITION)),
            rotate_lock: per_partition("LOCK TABLE {{part}} IN ACCESS EXCLUSIVE MODE"),
            rotate_holders: per_partition(ROTATE_HOLDERS),
            rotate_truncate: per_partition("TRUNCATE {{part}}"),
            rotate_done: names.render(ROTATE_DONE),
            rotate_bump: names.render(ROTATE_BUMP),
            rotate_catch_up: names.render(ROTATE_CATCH_UP),
            partitions_info: names.render(PARTITIONS_INFO),
            status: names.render(STATUS),
            lane_gauges: names.render(LANE_GAUGES),
            oldest_writer: OLDEST_WRITER,
            create_at_now: names.render(CREATE_AT_NOW),
            dead_count: names.render(DEAD_COUNT),
            relay_group: names.render(RELAY_GROUP),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shard_mask_sets_one_bit_per_shard_in_get_bit_order() {
        let mask = shard_mask(64, &[0, 9, 63]);
        assert_eq!(mask, [1, 2, 0, 0, 0, 0, 0, 0x80]);
        // Not a multiple of 8: the last byte is partial; out of range ignored.
        assert_eq!(shard_mask(10, &[8, 9, 10]), [0, 3]);
        // Too many shards for a mask: the list rendering is used instead.
        assert!(shard_mask(MASK_MAX_SHARDS + 1, &[0]).is_empty());
        // Every shard held: the claim reads no filter, so no mask is sent.
        assert!(shard_mask(2, &[0, 1]).is_empty());
        assert!(shard_mask(1, &[0]).is_empty());
        assert_eq!(shard_mask(MASK_MAX_SHARDS, &[0]).len(), 8_192);
    }
}
