-- outbox-sqlite schema, version 3: the control table (pause and resume).
--
-- One row per consumer group (SQLite has one implicit group, 'default').
-- `outbox-relay pause` sets `paused`; running relays read the row about
-- once a second and stop claiming while it is set (what they already
-- claimed is delivered and settled); `outbox-relay resume` clears it. No
-- row means the group runs. Times are the database's clock, in ms since
-- the epoch.

CREATE TABLE {{events_control}} (
    grp        TEXT    NOT NULL PRIMARY KEY,
    paused     INTEGER NOT NULL DEFAULT 0,
    paused_at  INTEGER NULL,
    paused_by  TEXT    NULL,
    reason     TEXT    NULL,
    updated_at INTEGER NOT NULL
);
