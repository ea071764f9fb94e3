-- outbox-postgres migration 1: the events table, the dead letters, their indexes.
--
-- Placeholders are replaced by the library with validated, double-quoted
-- identifiers before this runs ({{events}} -> "schema"."table", ...). A team
-- applying this file with its own tool replaces them by hand, e.g.
--   {{events}} -> "outbox"."events"          {{dead}} -> "outbox"."events_dead"
--   {{claim_idx}} -> "events_claim_idx"      (and likewise for the other *_idx)

CREATE TABLE {{events}} (
    id                 uuid        PRIMARY KEY,            -- UUIDv7, time ordered; the broker dedup id
    key                text        NULL,                   -- partition / aggregate key
    key_hash           bigint      NOT NULL,               -- 32-bit FNV-1a of the key (or of the id text), 0..2^32-1
    event_type         text        NOT NULL,
    topic              text        NOT NULL,
    payload            bytea       NOT NULL,
    headers            jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at         timestamptz NOT NULL DEFAULT now(),
    attempts           integer     NOT NULL DEFAULT 0,
    -- When the event becomes claimable. While it is leased this equals
    -- locked_until, so "next_attempt_at <= now()" covers both a pending event
    -- that is due and a lease that expired (one column, one index).
    next_attempt_at    timestamptz NOT NULL DEFAULT now(),
    locked_by          text        NULL,
    locked_until       timestamptz NULL,
    lease_token        uuid        NULL,                   -- fencing token of the current claim
    last_error_code    text        NULL,
    last_error_message text        NULL,
    delivered_at       timestamptz NULL,                   -- only set when delivered rows are retained
    CONSTRAINT {{key_hash_check}} CHECK (key_hash >= 0 AND key_hash < 4294967296)
)
-- No index covers a column that a claim, retry or release changes, so those
-- UPDATEs are HOT (no new index entries, less bloat) when the page has room:
-- fillfactor leaves it. A queue table churns: vacuum it early, and never
-- truncate it (truncation takes an ACCESS EXCLUSIVE lock that stalls
-- producers and claims, for pages the next burst refills anyway).
WITH (fillfactor = 85, autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000,
      vacuum_truncate = false);

-- The claim: WHERE delivered_at IS NULL AND next_attempt_at <= now() ... ORDER BY id LIMIT n.
-- next_attempt_at is deliberately not indexed (it changes on every claim).
CREATE INDEX {{claim_idx}} ON {{events}} (id)
    WHERE delivered_at IS NULL;

-- Per-key order: "is an earlier event of this key still waiting or leased?"
CREATE INDEX {{key_idx}} ON {{events}} (key, id)
    WHERE key IS NOT NULL AND delivered_at IS NULL;

-- Retention purge of delivered rows (empty unless retention is configured).
CREATE INDEX {{delivered_idx}} ON {{events}} (delivered_at)
    WHERE delivered_at IS NOT NULL;

CREATE TABLE {{dead}} (
    id                 uuid        PRIMARY KEY,
    key                text        NULL,
    key_hash           bigint      NOT NULL,
    event_type         text        NOT NULL,
    topic              text        NOT NULL,
    payload            bytea       NOT NULL,
    headers            jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at         timestamptz NOT NULL,
    attempts           integer     NOT NULL,
    last_error_code    text        NOT NULL,
    last_error_message text        NOT NULL,
    dead_at            timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX {{dead_code_idx}} ON {{dead}} (last_error_code, id);
