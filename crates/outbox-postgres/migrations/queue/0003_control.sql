-- outbox-postgres migration 3: the control table (pause and resume).
--
-- One row per consumer group (the queue table has one implicit group,
-- 'default'). `outbox-relay pause` sets `paused`; running relays read the
-- row about once a second and stop claiming while it is set (what they
-- already claimed is delivered and settled); `outbox-relay resume` clears
-- it. No row means the group runs. Times are the database's clock.

CREATE TABLE {{control}} (
    grp        text        PRIMARY KEY,
    paused     boolean     NOT NULL DEFAULT false,
    paused_at  timestamptz NULL,
    paused_by  text        NULL,
    reason     text        NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE {{control}} IS
    'outbox control rows (pause/resume per consumer group); managed by outbox-postgres';
