//! The event-log mode: an append-only, commit-ordered outbox read in
//! snapshot windows, progress kept by one fenced cursor per shard, old
//! events removed by truncating whole partitions: [`PgLogStore`], the
//! default mode (the queue-table mode is [`PgStore`](crate::PgStore)).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_core::{NewEvent, Store};
//! use outbox_postgres::{PgLogOptions, PgLogStore};
//!
//! let store = PgLogStore::connect(
//!     PgLogOptions::new("postgres://app@localhost/app").with_auto_migrate(true),
//! )
//! .await?;
//! let mut tx = store.pool().begin().await?;
//! store.outbox().enqueue(&mut *tx, NewEvent::new("order.created", "orders", b"{}".to_vec())).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! # Design
//!
//! The queue-table mode UPDATEs every row when it is claimed and DELETEs it
//! when it is done: its throughput falls with the backlog, every dead tuple
//! stays while any snapshot is held, and vacuum competes with the claims.
//! This mode never updates or deletes an event row. It follows PgQ (Skype,
//! 2006; PgQue today): events are read in batches defined by two
//! transaction snapshots and old tables are truncated. What differs, and why:
//!
//! **Enqueue is one INSERT, nothing else.** Column defaults record the
//! producer's transaction id (`pg_current_xact_id()`, xid8), an insertion
//! sequence number (`seq`, from one uncached sequence: the global order of
//! the INSERTs; the transaction id is taken first, so a transaction's
//! events are numbered after its id exists), and the partition (`slot`). No trigger, no function
//! call of ours, no NOTIFY, no ticker process. The log is a table
//! partitioned by `LIST (slot)` into three partitions; the `slot` default
//! reads a *sequence* (`pg_sequence_last_value(<table>_log_gen) % 3`).
//! Reading a sequence is not transactional, so a producer in a long
//! REPEATABLE READ transaction still routes to the partition that is
//! current now, not to the one its snapshot saw. An INSERT locks only the
//! partition it routes to, so truncating another partition never blocks a
//! producer (checked in `tests/log_rotation.rs`).
//!
//! **A batch is a snapshot window.** A cursor position is `(lo, hi, after)`:
//! every event of a transaction visible in snapshot `lo` is behind it; of
//! the window "visible in `hi`, not visible in `lo`", the events up to
//! `after` in `seq` (insertion) order are behind it too. A claim reads the
//! rest of the current window and, when that has fewer rows than the batch
//! size, the next window `(hi, pg_current_snapshot())`, in one statement.
//! Each window is found in two parts: an index lookup of the transactions
//! that were running at `lo` and finished by `hi` (computed in Rust from
//! the snapshot text), for their events up to `lo`'s *seq floor*, and a
//! range scan in seq order from that floor, filtered by visibility in both
//! snapshots. The floor of a snapshot is a seq below every event of a
//! transaction at or above its xmax: every claim reads the sequence, then
//! takes a transaction id of its own, so every later transaction inserts
//! above the value read; snapshots taken after that claim completed use it
//! (see the claim's SQL docs for the argument). A transaction that stays
//! open for hours delays only its own events, and no claim scans what it
//! wrote before the window began. The shard filter (`key_hash % total =
//! index`) is in the query.
//!
//! **Plans that do not depend on statistics.** The log is append-only, so
//! autovacuum may never analyze it (and benchmarks run with autovacuum
//! off). Given a range `lo <= txid < hi` on a never-analyzed partition, the
//! planner guesses a few dozen rows and reads the whole window with a
//! bitmap scan and a sort, per claim: a quadratic drain (measured: 31k
//! events/s at a 100k backlog). So every branch of the claim is written
//! as an ordered index scan that stops after `batch size` rows: one row
//! comparison `(txid, seq) > (start)` as the only index condition,
//! visibility in the window's upper snapshot as the (filter) upper bound,
//! and the running-at-`lo` transactions read one by one with `LATERAL`
//! (so one huge transaction is read in slices too).
//!
//! **Order.** Across windows: commit order (a window holds exactly the
//! transactions that committed between two snapshots). Inside one window:
//! the order of the INSERTs (`seq`), as PgQ orders a batch. That is the
//! per-key promise: when the second event of a key was inserted after the
//! first one's transaction committed (both lock the key's aggregate, say),
//! the first is either in an earlier window or earlier in the same one.
//! Ordering a window by transaction id instead broke it for the usual
//! service shape: a transaction takes its id at its first write (its
//! business row), then waits for the aggregate's lock held by a later
//! transaction id. Both parts of a window are read as keyset scans of at
//! most `batch size` rows (index `(txid, seq)` per running transaction,
//! index `(seq)` for the range), so a huge window (a relay away for an
//! hour) is read in slices, never sorted per claim.
//!
//! **Progress is a cursor row per (consumer group, shard)**: its settled
//! position, its lease owner, its lease end (database clock) and a fencing
//! epoch that grows whenever another relay takes the lease. Only the lease
//! holder claims; other relays of the same shard get empty claims (they
//! are standbys). A claim renews the lease when half of it has passed
//! (one UPDATE at most per half lease, not per claim). A settle is one
//! transaction whose first statement is an UPDATE of the cursor guarded by
//! the epoch: a relay that lost its lease changes 0 rows and its whole
//! settle is reported fenced. The [`FencingToken`](outbox_core::FencingToken)
//! of a claim maps, in this process, to (cursor, epoch, batch window); the
//! batches a relay holds and their read position live in memory (a new
//! holder restarts from the settled position, which is what makes a crash
//! redeliver rather than lose). A batch that is fully settled moves the
//! position, in claim order; in the usual case (all delivered) that UPDATE
//! is the only statement of the settle. No per-event UPDATE or DELETE.
//! When a batch is settled in parts (or out of claim order) the rows it
//! already settled are listed in the cursor row (`skip_txid/skip_seq`,
//! written by the same fenced UPDATE), so a new holder re-reading from the
//! settled position does not deliver them again. A lease that ran out
//! (database clock, checked by every claim in the same statement) voids
//! the holder's unsettled batches even when the same relay claims again,
//! as a per-event lease would.
//!
//! **Durability of progress.** Settles commit with `synchronous_commit =
//! off` by default ([`PgLogOptions::with_durable_progress`] turns it on):
//! a crash of the database may forget the last few milliseconds of
//! progress, which redelivers those events; nothing is lost, because the
//! events themselves are committed by the producers' own transactions.
//! This saves a WAL flush per batch (a settle went from ~2 ms to ~0.4 ms).
//!
//! **Incarnations.** Crash recovery hands out again the transaction ids
//! whose WAL never reached disk (and a promoted asynchronous standby is
//! behind its primary), so a window, a seq floor or a lease held in memory
//! across a crash restart could make a claim count a new transaction as
//! already read. The unlogged table `<table>_log_boot` holds a random
//! token: crash recovery empties unlogged tables and a standby has it
//! empty. Every claim reads it (and writes a new one when it is empty),
//! every fenced write (settle, renewal, relay-group merge) requires the
//! token its state was read under, and a lease taken records it. When it
//! changed, the store drops its windows, leases and seq observations and
//! resumes from the stored position (metric
//! [`INCARNATION_CHANGES`](crate::log::INCARNATION_CHANGES)); what the lost asynchronous settles covered is
//! delivered again. A clean restart keeps unlogged tables, and loses
//! nothing to reuse.
//!
//! **Identity and fences.** Stored positions are trusted only in the
//! database that wrote them: the meta row records the cluster's
//! `system_identifier` and the database's oid ([`Identity`](crate::Identity)), and a claim
//! compares them with what it finds before it reads (at the store's first
//! claim, whenever a lease is newly taken, and every 30 s). After a move
//! (a logical-replication switchover, a restore or copy, a pg_upgrade) it
//! refuses with [`Refusal::OtherDatabase`](crate::Refusal::OtherDatabase), naming
//! [`PgLogStore::reanchor`] (`outbox-relay reanchor --from origin|now`):
//! one transaction that gives every retained event its own transaction id
//! and moves every cursor to a snapshot before it (the retained log again)
//! or after it (skipped), with seq floors at 0, epochs bumped, leases
//! voided and a new incarnation token. The same check refuses a schema
//! version other than this library's ([`Refusal::SchemaTooNew`](crate::Refusal::SchemaTooNew) names the
//! version that migrated it) and an order sequence with a cache
//! ([`Refusal::SequenceCache`](crate::Refusal::SequenceCache)); with `auto_migrate` they run at connect.
//!
//! **The retry lane** (`<table>_log_lane`) holds the few events that
//! cannot simply be passed: a retry (eligible at the database's `now()` +
//! delay, attempts counted), an event released mid-batch, and events
//! *parked* behind an earlier event of their key that is in the lane. The
//! cursor moves on; a claim reads due lane rows first (only the head of
//! each key), then the log, and parks any log event whose key has a lane
//! row (or a blocking dead letter) into the lane behind it, in order. So a
//! key in backoff holds back only that key. A batch whose released events
//! are its tail (shutdown, sink unavailable) is not copied: the cursor
//! simply stops before them. While events of a key are held by an
//! unsettled batch, a pipelined next claim stops before that key's next
//! event. Lane rows are updated and deleted one by one; the lane is small
//! by design (failures only), so that churn stays off the hot path.
//!
//! **Dead letters** (`<table>_log_dead`, per group) keep the event, its
//! error and its place in its key's order. [`DeadHeadPolicy::Continue`](outbox_core::DeadHeadPolicy::Continue)
//! (default) lets the key's next event go, and a dead letter retried later
//! enters the lane behind the key's lane rows (a new `ord`);
//! [`DeadHeadPolicy::Block`](outbox_core::DeadHeadPolicy::Block) parks the key's later events until the dead
//! letter is retried (it keeps its `ord` and goes first) or purged. A row whose headers cannot be decoded is dead-lettered
//! by the claim with `UNDECODABLE`, never retried in a loop.
//!
//! **Rotation** (background, or [`PgLogStore::rotate`]): when the current
//! partition is older than the rotation interval, the next one (the
//! oldest) is truncated and becomes current, if (1) every cursor of every
//! group has passed all of its rows (checked against the rows themselves,
//! not a timeline, so even a straggling producer that routed late is safe),
//! (2) every group has a cursor for each of its shards, (3) no session
//! holds the partition in a way that holds rotation back: a writer (a lock
//! above `ACCESS SHARE`: its rows may not be passed yet; autovacuum's lock
//! does not count), a prepared transaction (its locks have no pid in
//! `pg_locks`), a session idle in its transaction, or any holder of a
//! second or more (`pg_dump`), and (4) its `ACCESS EXCLUSIVE` lock is had
//! within a 5 ms `lock_timeout`, tried up to 20 times with pauses of 1-10
//! ms: claims and status queries hold `ACCESS SHARE` on every partition
//! for milliseconds, and one of the tries finds the gap between them. The
//! lock is never queued behind a session that holds the partition longer,
//! so no claim or settle waits behind a reader (it waited up to 500 ms
//! before, every 1.5 s, for as long as the reader stayed). The check (1)
//! is repeated under the lock. Otherwise rotation is postponed, the next
//! attempt within a second; the session holding it back is named by
//! [`PgLogStore::rotation_hold`], `outbox-relay status` and the metrics
//! [`ROTATION_HOLDER`] and [`ROTATION_HELD_SECONDS`].
//! The generation sequence moves after the
//! commit, so producers never wait for the truncation. Delivered events
//! stay readable for one to two rotation intervals (the retention). With
//! nothing ever updated or deleted, event partitions have no dead tuples
//! (except from rolled-back enqueues), and `TRUNCATE` gives their space
//! back at once whatever snapshot another session holds.
//!
//! **Wake-ups without NOTIFY.** [`Store::wakeup`](outbox_core::Store::wakeup)
//! polls `pg_current_snapshot()` (no table access) every 2 ms after a
//! non-empty claim, doubling to 25 ms while idle
//! ([`PgLogOptions::with_probe_interval`]); it fires when the snapshot
//! changed since the last claim or probe, i.e. some transaction ended.
//! The cap bounds the wait of the first event after a quiet spell (it was
//! 250 ms: the first events of a 1k events/s run waited up to 130 ms,
//! which alone made that run's p99 33 ms against 6 ms after its first
//! second).
//!
//! **Status.** [`PgLogStore::status`]: per shard, what its cursor has not
//! passed, the lag, the retry lane and the parked keys, plus the dead
//! letters, the oldest open writing transaction and the partitions.
//!
//! **Consumer groups**: each group ([`GroupName`](crate::GroupName)) reads every event with
//! its own cursors, lane and dead letters. A new cursor starts at what every
//! cursor of its group has passed (reconfiguring shards from 2 to 4
//! redelivers a little, never loses), or, for a new group, at the log's
//! origin (the oldest retained event, [`GroupStart::Oldest`], the default)
//! or at the current snapshot ([`GroupStart::Now`]: every shard of the
//! first relay's layout is created at once, at that snapshot). Rotation
//! waits for the slowest group; [`PgLogStore::groups`] says which group
//! holds it back, and [`PgLogStore::drop_group`] deletes a group's
//! cursors, lane, dead letters, control and relay rows in one fenced step
//! (it then holds nothing back; a relay that was reading it refuses to
//! claim, [`Refusal::GroupDropped`](crate::Refusal::GroupDropped), instead of starting it again at the
//! origin).
//! A group can be paused and resumed on its own
//! ([`ControlStore`](outbox_core::ControlStore): one row per group in
//! `<table>_log_control`, which its relays re-read about once a second;
//! `outbox-relay pause --group G`).
//!
//! # What this mode does not do (differences from the queue mode)
//! - No per-event lease: a shard is read by one relay at a time, the others
//!   are standbys that get empty claims (scale out with shards). Eight
//!   cases of the store conformance suite assume a second relay can claim
//!   other events of a shard while the first holds some, or count a
//!   crashed holder's attempt; see `tests/log_conformance.rs`.
//! - After a lease takeover the new holder redelivers the unsettled events
//!   with `attempts = 1`: an attempt cut short by a crash or lease loss is
//!   not counted (liveness rule 10), where the queue mode counts it.
//! - Which claim holds which event lives in the claiming process:
//!   `stats().in_flight` counts the events held by claims of this process
//!   (under a current lease), and a token is only known to the store (and
//!   its clones) that issued it.
//! - [`Claim::lease_until`](outbox_core::Claim::lease_until) is the cursor
//!   lease as stored; it is renewed when half of it has passed, so it is
//!   not always `now() + lease` of this claim.
//! - Order inside one snapshot window is insertion order (`seq`), not
//!   commit order: two transactions that do not serialise on anything may
//!   commit in the opposite order of their INSERTs.
//! - Rolled-back enqueues leave dead tuples in the current partition until
//!   it is truncated.
//! - Old shard layouts: a group's cursors of a shard layout no relay uses
//!   any more hold rotation back; drop them (`DELETE FROM <table>_log_cursors
//!   WHERE grp = ... AND shard_total = ...`). A group no relay reads any
//!   more holds rotation back too: drop it ([`PgLogStore::drop_group`],
//!   `outbox-relay group drop NAME`).

mod anchor;
mod control;
mod groups;
mod metric_names;
mod options;
mod reanchor;
mod snapshot;
mod sql;
mod store;

pub use anchor::IdentityCheck;
pub use reanchor::{ReanchorFrom, Reanchored};

pub use groups::{
    GroupContents, GroupDrop, GroupStatus, Horizon, OldTransaction, RelayLease, SlotHold,
};
pub use metric_names::{
    INCARNATION_CHANGES, LANE_EVENTS, PARKED_KEYS, ROTATIONS, ROTATION_HELD_SECONDS,
    ROTATION_HOLDER, ROTATION_LOCK_TRIES, SHARDS_HELD, SHARDS_QUOTA, SHARD_LAG,
};
pub use options::{
    GroupStart, PgLogOptions, DEFAULT_REBALANCE_INTERVAL, DEFAULT_ROTATION_INTERVAL,
};
pub use store::{
    CursorInfo, InFlight, LeaseHolding, LogInfo, LogStatus, PartitionHolder, PartitionInfo,
    PgLogStore, RelayInfo, Rotation, RotationHold, ShardStatus,
};
