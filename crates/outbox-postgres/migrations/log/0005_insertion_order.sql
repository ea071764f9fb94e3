-- outbox-postgres, event-log mode, migration 5: per-key order by the moment
-- of each event's INSERT, and the database incarnation.
--
-- 1. Order. A window of the log used to be read in (txid, seq) order, but a
-- transaction takes its id at its FIRST write: a service that writes its
-- business row, then waits for its aggregate's lock, enqueues with an older
-- id than the transaction it waited for. The log is now read in `seq` order
-- inside a window, and `seq` must therefore be the global order of the
-- INSERTs: a new sequence without a per-session cache (a cached sequence
-- hands each session a block of 100 numbers, so its order is per session
-- only). The column default moves to it; rows already in the log keep their
-- numbers (the new sequence starts above every number the old one handed
-- out, cached blocks included). `pos_seq` now means "events of the window
-- up to this seq are settled": positions recorded in (txid, seq) order are
-- reset to the start of their window (those events are delivered again:
-- at-least-once), as are skip lists. Stop the relays of an older version
-- before this migration.
--
-- 2. Seq floors. `lo_floor` / `hi_floor`: for the cursor's snapshots, a
-- sequence number below every event of a transaction at or above the
-- snapshot's xmax (0 is always true, only slower: see the claim's docs in
-- `outbox_postgres::log`).
--
-- 3. Incarnation. An UNLOGGED table is emptied by crash recovery and is
-- empty on a promoted standby: its token changes exactly when transaction
-- ids may be handed out again. Every claim reads it; fenced writes check it.

CREATE SEQUENCE {{order_seq}} AS bigint;
SELECT setval('{{order_lit}}', coalesce(pg_sequence_last_value('{{seq_lit}}'), 0) + 1, false);
ALTER TABLE {{log}} ALTER COLUMN seq SET DEFAULT nextval('{{order_lit}}');
DROP SEQUENCE {{seq}};

-- The window's range is read in seq order from the window's seq floor.
CREATE INDEX {{log_seq_idx}} ON {{log}} (seq);

ALTER TABLE {{cursors}}
    ADD COLUMN lo_floor bigint NOT NULL DEFAULT 0,
    ADD COLUMN hi_floor bigint NOT NULL DEFAULT 0;
UPDATE {{cursors}}
SET pos_txid = NULL, pos_seq = NULL, skip_txid = '{}', skip_seq = '{}';

CREATE UNLOGGED TABLE {{boot}} (
    one   boolean     PRIMARY KEY DEFAULT true CHECK (one),
    token uuid        NOT NULL,
    since timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE {{boot}} IS
    'outbox event-log database incarnation (unlogged: emptied by crash recovery and on a promoted standby); managed by outbox-postgres';

-- 4. Rotation. The generation a rotation truncates for is the one in the
-- meta row, updated by the rotation under the row's lock; the sequence that
-- producers route by catches up with it after the commit (and at the next
-- rotation if a rotator died in between). Read from the sequence, a second
-- rotator could read the old generation between a rotation's commit and
-- its bump, and truncate the same partition again.
ALTER TABLE {{meta}} ADD COLUMN generation bigint NOT NULL DEFAULT 0;
UPDATE {{meta}} SET generation = coalesce(pg_sequence_last_value('{{gen_lit}}'), 0);
