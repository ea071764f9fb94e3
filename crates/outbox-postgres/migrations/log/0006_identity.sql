-- outbox-postgres, event-log mode, migration 6: the database the positions
-- belong to, and the fence that migration 5 lacked.
--
-- 1. Identity. Stored positions (the cursors' snapshots and positions, the
-- origin, the seq floors) are transaction ids and sequence values of ONE
-- database of ONE cluster. The meta row records which: the cluster's
-- `system_identifier` (new after a logical-replication switchover, a
-- restore onto another cluster, a pg_upgrade; kept by a physical standby's
-- promotion, whose xids continue) and the database's oid (new after a
-- `pg_dump | psql` into another database of the same cluster; kept by
-- `ALTER DATABASE ... RENAME`) and name (shown to the operator, not
-- compared). A relay that finds another identity refuses to claim until
-- `outbox-relay reanchor` (`PgLogStore::reanchor`) sets the new one and
-- resets the positions (see ARCHITECTURE.md, "Positions trust one database
-- incarnation").
--
-- 2. The fence. Migration 5 changed what `pos_seq` means and reset every
-- position, but left the epochs: a relay of the previous version holding a
-- lease could still settle a position of the old meaning over the reset
-- one. Every lease is voided and every epoch bumped here (in the same
-- transaction as migration 5 when both are pending), so such a settle
-- changes 0 rows. Migration 5 itself is not edited: the runner checksums
-- applied migrations, and a database that applied it would refuse the
-- edited text. From this version on a relay also checks the schema version
-- whenever it takes a lease, so a later migration that bumps the epochs
-- fences relays of an older version for good (they refuse at their next
-- lease instead of taking it again).

ALTER TABLE {{meta}}
    ADD COLUMN system_identifier bigint      NULL,
    ADD COLUMN database_oid      bigint      NULL,
    ADD COLUMN database_name     text        NULL,
    ADD COLUMN anchored_at       timestamptz NULL;
UPDATE {{meta}}
SET system_identifier = (SELECT system_identifier FROM pg_control_system()),
    database_oid = (SELECT oid::bigint FROM pg_database WHERE datname = current_database()),
    database_name = current_database(),
    anchored_at = now();

UPDATE {{cursors}} SET epoch = epoch + 1, owner = NULL, lease_until = NULL;
