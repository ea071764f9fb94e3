-- outbox-postgres migration 2: insertion order from the database, and
-- parked rows (a claim's cost does not grow with the rows behind blocked keys).
--
-- seq: a database sequence assigned at INSERT. Claims and per-key order
-- follow it instead of the application-generated id, so clocks of
-- different producers no longer reorder a key: events of one transaction
-- keep their insertion order, and of two transactions that do not overlap
-- the one that committed first comes first. (An uncommitted event never
-- blocks a committed later one; two overlapping transactions of one key
-- are ordered by when they inserted.) Existing rows are numbered in id order.
--
-- parked: a keyed event whose key is blocked (an earlier event of the key is
-- in retry backoff, leased, or itself parked) leaves the claim index, and
-- claims reach it through its key instead (the parked keys are few, the rows
-- behind them may be many). A retry parks the later events of its key; a
-- claim parks the blocked rows it walked past when it could not fill its
-- batch. A parked row stays parked until it is delivered or dead-lettered;
-- it is claimed, retried and released like any other. See the crate docs
-- ("Claim rules").
--
-- This rewrites the events table once and rebuilds its indexes, holding an
-- exclusive lock on it meanwhile (producers wait): run it at a quiet moment
-- on a large backlog.

CREATE SEQUENCE {{seq}} AS bigint;
ALTER TABLE {{events}}
    ADD COLUMN seq bigint,
    ADD COLUMN parked boolean NOT NULL DEFAULT false;
UPDATE {{events}} e SET seq = o.n
FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM {{events}}) o
WHERE e.id = o.id;
SELECT setval('{{seq}}', (SELECT coalesce(max(seq), 0) + 1 FROM {{events}}), false);
ALTER TABLE {{events}}
    ALTER COLUMN seq SET DEFAULT nextval('{{seq}}'),
    ALTER COLUMN seq SET NOT NULL;
ALTER SEQUENCE {{seq}} OWNED BY {{events}}.seq;

-- The claim: unparked, pending rows in insertion order.
DROP INDEX {{schema}}.{{claim_idx}};
CREATE INDEX {{claim_idx}} ON {{events}} (seq)
    WHERE delivered_at IS NULL AND NOT parked;

-- Per-key order: a key's pending rows in insertion order (its first one is
-- its head).
DROP INDEX {{schema}}.{{key_idx}};
CREATE INDEX {{key_idx}} ON {{events}} (key, seq)
    WHERE key IS NOT NULL AND delivered_at IS NULL;

-- The keys that have parked rows (walked as a loose index scan: one probe per key).
CREATE INDEX {{parked_idx}} ON {{events}} (key)
    WHERE parked AND delivered_at IS NULL;
