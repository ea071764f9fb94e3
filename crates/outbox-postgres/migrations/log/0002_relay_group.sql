-- outbox-postgres, event-log mode, migration 2: relay groups.
--
-- Relays started without a static shard (`--shard i/N`) share a consumer
-- group's work through leases on the cursors of a fixed set of virtual
-- shards: `virtual_shards` of them (a key belongs to virtual shard
-- `key_hash % virtual_shards`). Each relay of the group announces itself in
-- `_log_relays` (renewed while it runs, deleted when it leaves gracefully)
-- and holds its fair share of the group's cursor leases.
--
-- Changing `virtual_shards` later (see ARCHITECTURE.md, "Relay groups"):
-- stop the group's relays, update the column, delete the group's cursors of
-- the old count only after the new ones exist (the new cursors start where
-- the old ones that cover their keys all are).

ALTER TABLE {{meta}}
    ADD COLUMN virtual_shards integer NOT NULL DEFAULT 64
        CHECK (virtual_shards BETWEEN 1 AND 4096);

CREATE TABLE {{relays}} (
    grp        text        NOT NULL,
    relay      text        NOT NULL,
    seen_until timestamptz NOT NULL,   -- alive while this is in the future (database clock)
    joined_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (grp, relay)
);
