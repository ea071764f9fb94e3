-- outbox-postgres, event-log mode, migration 4: the control table (pause
-- and resume per consumer group).
--
-- One row per consumer group. `outbox-relay pause --group G` sets `paused`;
-- the group's running relays read the row about once a second and stop
-- claiming while it is set (what they already claimed is delivered and
-- settled); `outbox-relay resume` clears it. No row means the group runs;
-- a group may be paused before its first relay starts. Times are the
-- database's clock. (Version 4: versions 2 and 3 are taken by other work.)

CREATE TABLE {{control}} (
    grp        text        PRIMARY KEY,
    paused     boolean     NOT NULL DEFAULT false,
    paused_at  timestamptz NULL,
    paused_by  text        NULL,
    reason     text        NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE {{control}} IS
    'outbox event-log control rows (pause/resume per consumer group); managed by outbox-postgres';
