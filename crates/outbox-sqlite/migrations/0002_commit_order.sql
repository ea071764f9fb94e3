-- outbox-sqlite schema, version 2: order by commit order, not by id.
--
-- SQLite has one writer, so the order rows are inserted in is the order
-- their transactions commit in. Version 1 ordered a key by the application's
-- UUIDv7 id, which a late commit or a skewed clock can reorder. The events
-- table is rebuilt with an explicit `seq INTEGER PRIMARY KEY AUTOINCREMENT`
-- (an alias of the rowid that VACUUM never renumbers and that is never
-- reused), existing rows keep their insertion order (their old rowid), and
-- claims order by `seq`. Dead letters remember their `seq`, so a replayed
-- dead letter returns to its place in its key's order.

CREATE TABLE {{events_v2}} (
    seq                INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    id                 BLOB    NOT NULL UNIQUE,
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

INSERT INTO {{events_v2}} (seq, id, key, key_hash, event_type, topic, payload, headers,
    created_at, attempts, next_attempt_at, locked_by, locked_until, lease_token,
    last_error_code, last_error_message)
SELECT rowid, id, key, key_hash, event_type, topic, payload, headers,
    created_at, attempts, next_attempt_at, locked_by, locked_until, lease_token,
    last_error_code, last_error_message
FROM {{events}} ORDER BY rowid;

DROP TABLE {{events}};

ALTER TABLE {{events_v2}} RENAME TO {{events}};

-- Claim, first branch: unleased events that are due, in commit order.
CREATE INDEX {{events_ready}} ON {{events}} (next_attempt_at, seq)
    WHERE locked_until IS NULL;

-- Claim, second branch: leases that may have expired.
CREATE INDEX {{events_leased}} ON {{events}} (locked_until)
    WHERE locked_until IS NOT NULL;

-- Per-key order check: earlier events (smaller seq) of the same key.
CREATE INDEX {{events_key_order}} ON {{events}} (key, seq)
    WHERE key IS NOT NULL;

-- Settle and renew find a claim's rows by its fencing token.
CREATE INDEX {{events_lease_token}} ON {{events}} (lease_token)
    WHERE lease_token IS NOT NULL;

-- A dead letter's place in commit order (NULL for rows dead-lettered
-- before version 2), restored when it is retried.
ALTER TABLE {{dead}} ADD COLUMN seq INTEGER NULL;
