-- outbox-postgres, event-log mode, migration 1: the rotating event log, the
-- cursors, the retry lane, the dead letters.
--
-- Double-brace placeholders are replaced by the library with validated,
-- double-quoted identifiers before this runs: every object is named after
-- the outbox table with a `_log...` suffix, e.g. for schema "outbox" and
-- table "events": "outbox"."events_log" (the partitioned log),
-- "outbox"."events_log_0" .. _2 (its partitions), "outbox"."events_log_gen",
-- _seq, _meta, _cursors, _lane, _lane_ord, _dead, and index names
-- "events_log_idx", "events_log_lane_key_idx", ... A `_lit` placeholder is the
-- same qualified name used inside a string literal. The design (why each
-- piece is there) is in the docs of the Rust module `outbox_postgres::log`.

-- The generation counter. Its value g says which partition receives new
-- events: g % 3. A sequence, because reading it is not transactional: a
-- producer in a REPEATABLE READ transaction that began before a rotation
-- still routes its INSERT to the partition that is current now.
CREATE SEQUENCE {{gen}} MINVALUE 0 START 0;
SELECT setval('{{gen_lit}}', 0, true);

-- Insertion order inside one transaction (the second ordering key after the
-- transaction id). Cached per session: only the order inside one session
-- (hence one transaction) matters.
CREATE SEQUENCE {{seq}} CACHE 100;

-- The event log: append-only. No row is ever updated or deleted; whole
-- partitions are truncated once every cursor has passed them.
CREATE TABLE {{log}} (
    txid       xid8        NOT NULL DEFAULT pg_current_xact_id(), -- the producer's transaction
    seq        bigint      NOT NULL DEFAULT nextval('{{seq_lit}}'),
    slot       smallint    NOT NULL DEFAULT (pg_sequence_last_value('{{gen_lit}}') % 3)::smallint,
    id         uuid        NOT NULL,           -- UUIDv7 from the application; the broker dedup id
    key        text        NULL,
    key_hash   bigint      NOT NULL,           -- 32-bit FNV-1a of the shard key, 0..2^32-1
    event_type text        NOT NULL,
    topic      text        NOT NULL,
    payload    bytea       NOT NULL,
    headers    jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
) PARTITION BY LIST (slot);

-- Three partitions: the current one, the previous one (still read by
-- lagging cursors, and the retention of delivered events), and the one that
-- is truncated to become current at the next rotation. Append-only tables
-- need no vacuum for space; autovacuum is left on for visibility maps and
-- statistics only.
CREATE TABLE {{log_0}} PARTITION OF {{log}} FOR VALUES IN (0);
CREATE TABLE {{log_1}} PARTITION OF {{log}} FOR VALUES IN (1);
CREATE TABLE {{log_2}} PARTITION OF {{log}} FOR VALUES IN (2);

-- The only index: a batch is a keyset range scan in (txid, seq) order.
CREATE INDEX {{log_idx}} ON {{log}} (txid, seq);

-- One row: where the log began (a new consumer group starts here) and when
-- the current partition became current.
CREATE TABLE {{meta}} (
    one         boolean     PRIMARY KEY DEFAULT true CHECK (one),
    origin      pg_snapshot NOT NULL,
    switched_at timestamptz NOT NULL DEFAULT now(),
    rotations   bigint      NOT NULL DEFAULT 0
);
INSERT INTO {{meta}} (origin) VALUES (pg_current_snapshot());

-- Progress of one consumer group on one shard: the last position whose
-- events are settled (a window (lo, hi) of two snapshots and the last
-- (txid, seq) settled inside it), and the lease that lets one relay read it.
CREATE TABLE {{cursors}} (
    grp         text        NOT NULL,
    shard_total integer     NOT NULL CHECK (shard_total >= 1),
    shard_index integer     NOT NULL CHECK (shard_index >= 0 AND shard_index < shard_total),
    epoch       bigint      NOT NULL DEFAULT 1,   -- fencing: +1 whenever another relay takes the lease
    owner       text        NULL,
    lease_until timestamptz NULL,
    lo          pg_snapshot NOT NULL,
    hi          pg_snapshot NOT NULL,
    pos_txid    xid8        NULL,                 -- NULL: nothing of (lo, hi) settled yet
    pos_seq     bigint      NULL,
    -- Events ahead of the position already settled by a partial settle (in
    -- the retry lane or the dead letters): a new holder re-reading from the
    -- position skips them. Empty unless a batch was settled in parts.
    skip_txid   xid8[]      NOT NULL DEFAULT '{}',
    skip_seq    bigint[]    NOT NULL DEFAULT '{}',
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (grp, shard_total, shard_index)
) WITH (fillfactor = 50);

-- Delivery order inside the retry lane (per group).
CREATE SEQUENCE {{lane_ord}};

-- The retry lane: events waiting for a retry, events released unattempted,
-- and events parked behind an earlier event of their key that is here. Small
-- by design; rows leave it when delivered or dead-lettered.
CREATE TABLE {{lane}} (
    grp                text        NOT NULL,
    ord                bigint      NOT NULL DEFAULT nextval('{{lane_ord_lit}}'),
    id                 uuid        NOT NULL,
    key                text        NULL,
    key_hash           bigint      NOT NULL,
    event_type         text        NOT NULL,
    topic              text        NOT NULL,
    payload            bytea       NOT NULL,
    headers            jsonb       NOT NULL,
    created_at         timestamptz NOT NULL,
    attempts           integer     NOT NULL,             -- attempts before the next claim
    next_attempt_at    timestamptz NOT NULL,
    last_error_code    text        NULL,
    last_error_message text        NULL,
    PRIMARY KEY (grp, ord)
);
-- "Is there an earlier event of this key in the lane?"
CREATE INDEX {{lane_key_idx}} ON {{lane}} (grp, key, ord) WHERE key IS NOT NULL;
-- One copy of an event per group (a re-read after a crash cannot park it twice).
CREATE UNIQUE INDEX {{lane_id_idx}} ON {{lane}} (grp, id);

CREATE TABLE {{dead}} (
    grp                text        NOT NULL,
    id                 uuid        NOT NULL,
    ord                bigint      NOT NULL,      -- its place in its key's order, kept for a replay
    key                text        NULL,
    key_hash           bigint      NOT NULL,
    event_type         text        NOT NULL,
    topic              text        NOT NULL,
    payload            bytea       NOT NULL,
    headers            jsonb       NOT NULL,
    created_at         timestamptz NOT NULL,
    attempts           integer     NOT NULL,
    last_error_code    text        NOT NULL,
    last_error_message text        NOT NULL,
    dead_at            timestamptz NOT NULL DEFAULT now(),
    blocking           boolean     NOT NULL,      -- dead-head policy `block`: holds back its key
    PRIMARY KEY (grp, id)
);
CREATE INDEX {{dead_code_idx}} ON {{dead}} (grp, last_error_code, id);
CREATE INDEX {{dead_key_idx}} ON {{dead}} (grp, key) WHERE blocking AND key IS NOT NULL;
