-- outbox-postgres, event-log mode, migration 3: delayed events
-- (`NewEvent::deliver_at` / `deliver_after`).
--
-- deliver_at: when a delayed event may be delivered (database clock: the
-- producer's `now()` + the delay, or the absolute time asked for). NULL for
-- every undelayed event: adding a nullable column without a default is a
-- catalog change only (no table rewrite, no lock held for long), and an
-- undelayed INSERT does not name it, so it costs nothing.
--
-- A claim that reads a log row whose deliver_at is still ahead treats it
-- like a parked row: the row is copied into the retry lane with
-- next_attempt_at = deliver_at, so it waits there without holding back the
-- cursor, and the key's later events (read by the cursor afterwards) park
-- behind it in the lane: per-key order holds, other keys are not delayed.
-- (Migration 2 is allocated to another change.)

ALTER TABLE {{log}} ADD COLUMN deliver_at timestamptz NULL;
