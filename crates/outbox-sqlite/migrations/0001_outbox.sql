-- outbox-sqlite schema, version 1.
--
-- Names in double braces are replaced by the quoted names derived from the
-- configured table (default outbox_events, dead letters outbox_dead_letters).
--
-- Times are INTEGER milliseconds since the Unix epoch, always computed by the
-- database clock (CAST(unixepoch('subsec') * 1000 AS INTEGER)), never by the
-- application. Ids and fencing tokens are 16-byte UUID BLOBs; UUIDv7 bytes
-- sort in time order, so ORDER BY id is oldest first.

-- The hot table: only events not yet delivered. Delivered events are deleted,
-- dead ones move to outbox_dead_letters.
CREATE TABLE {{events}} (
    id                 BLOB    NOT NULL PRIMARY KEY,
    key                TEXT    NULL,
    -- 32-bit FNV-1a of the shard key (key, or id text), see outbox_core::key_hash.
    key_hash           INTEGER NOT NULL,
    event_type         TEXT    NOT NULL,
    topic              TEXT    NOT NULL,
    payload            BLOB    NOT NULL,
    -- JSON object of string -> string.
    headers            TEXT    NOT NULL DEFAULT '{}',
    created_at         INTEGER NOT NULL,
    attempts           INTEGER NOT NULL DEFAULT 0,
    next_attempt_at    INTEGER NOT NULL,
    locked_by          TEXT    NULL,
    locked_until       INTEGER NULL,
    lease_token        BLOB    NULL,
    last_error_code    TEXT    NULL,
    last_error_message TEXT    NULL
);

-- Claim, first branch: unleased events that are due, oldest first.
CREATE INDEX {{events_ready}} ON {{events}} (next_attempt_at, id)
    WHERE locked_until IS NULL;

-- Claim, second branch: leases that may have expired.
CREATE INDEX {{events_leased}} ON {{events}} (locked_until)
    WHERE locked_until IS NOT NULL;

-- Per-key order check: earlier events of the same key.
CREATE INDEX {{events_key_order}} ON {{events}} (key, id)
    WHERE key IS NOT NULL;

-- Dead letters live apart so the hot table stays small.
CREATE TABLE {{dead}} (
    id                 BLOB    NOT NULL PRIMARY KEY,
    key                TEXT    NULL,
    key_hash           INTEGER NOT NULL,
    event_type         TEXT    NOT NULL,
    topic              TEXT    NOT NULL,
    payload            BLOB    NOT NULL,
    headers            TEXT    NOT NULL DEFAULT '{}',
    created_at         INTEGER NOT NULL,
    attempts           INTEGER NOT NULL,
    next_attempt_at    INTEGER NOT NULL,
    last_error_code    TEXT    NOT NULL,
    last_error_message TEXT    NOT NULL,
    dead_at            INTEGER NOT NULL
);

CREATE INDEX {{dead_code}} ON {{dead}} (last_error_code, id);
