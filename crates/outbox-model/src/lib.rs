#![doc = include_str!("../README.md")]
//!
//! # The model
//!
//! One shard of one consumer group of the PostgreSQL event log
//! (`outbox_postgres::log`, after commit 3ca1731: seq order inside a
//! window, seq floors, incarnation token). A state holds the database, the
//! cursor row, every relay process's memory and what the broker received;
//! an [`Action`](protocol::Action) is one atomic step of one actor. The
//! explorer ([`explore()`]) visits every state reachable within the bounds of
//! a [`Config`], breadth-first, with a set of visited states: every
//! interleaving of the steps, not a sample.
//!
//! **Producers** (1 to 3 transactions, 1 or 2 events each, keys 0 to 3). A
//! transaction takes its xid at its first write from a global counter; it
//! may first write a business row (taking its xid) and only later insert.
//! An insert takes the next value of one global sequence (`seq`) after the
//! xid. With aggregate locks (default) a transaction takes its next event's
//! key lock before the insert (after its first write, if any) and holds it
//! until it ends, so the second transaction of a key inserts after the
//! first committed. It commits synchronously or asynchronously (both
//! explored where allowed), or rolls back at any point after its first
//! write.
//!
//! **Database.** `latest_completed`, snapshots `(xmax, xip)` as
//! `pg_current_snapshot()` (a transaction that has an xid `>= xmax` when the
//! snapshot is taken is running, invisible and *not* in `xip`), a WAL flush
//! point: a synchronous commit (or a [`Flush`](protocol::Action::Flush), the
//! WAL writer or anyone else's synchronous commit, at any time) makes
//! everything before it durable. A **crash restart** forgets every commit
//! not yet flushed (those transactions are *lost*), aborts the running
//! ones, resumes the xid counter and the sequence after what was assigned
//! before the last flush ([`Recovery::WalPrefix`], what PostgreSQL does:
//! xids and seq values handed out after it are handed out *again*), sets
//! `latest_completed` to the next xid - 1, returns the stored position to
//! its last flushed value and changes the incarnation token (the unlogged
//! `_log_boot` table). Relay processes keep their memory across it.
//!
//! **Cursor row**: stored position `(lo, hi, after, floor_lo, floor_hi)`
//! and its flushed copy, epoch, owner, lease (valid or run out).
//!
//! **Relays** (1 or 2), each step atomic:
//! - *acquire* (lease free, run out, or its own): epoch + 1, synchronous
//!   commit; the relay loads the stored position and records the token;
//! - *claim*: one statement, atomic (its reads are fixed by its snapshots
//!   through MVCC, so only its observation's timing matters, and that is
//!   read-then-xid inside the statement): takes `cur` =
//!   `pg_current_snapshot()`, reads the rows of committed transactions,
//!   reads `S = ` the sequence's last value, then takes its own xid and
//!   commits it **without a flush** (it writes no WAL; see
//!   [`Config::claim_commit`]). The relay then compares the token (new
//!   incarnation: drop windows, batch, epoch and observation, re-acquire
//!   from the stored position), records the observation (keyed by
//!   incarnation, highest kept), checks the lease (epoch and validity; if
//!   not ok it drops its batch and epoch). Otherwise it reads, as the SQL
//!   does, up to `batch` events: of window `(lo, hi)` the transactions of
//!   `xip(lo)` visible in `hi` at or below `floor_lo` and above `after`,
//!   then every event above `max(floor_lo, after)` visible in `hi` and not
//!   in `lo`, all in seq order; if that is short, the window `(hi, cur)`
//!   the same way with `floor_hi`. `floor(cur)` is the highest observation
//!   of a completed claim in this incarnation or `floor_hi`, whichever is
//!   higher (the store's `floor_for_new_snapshot`). The new read position
//!   is after the last event read, or `(cur, cur)` with `floor(cur)` when
//!   the read was short (a full batch always ends after its last event);
//! - *deliver*: publishes the next event of its batch (one step per event,
//!   so an old holder's late publishes interleave with the new holder's);
//! - *settle*: one asynchronous transaction that stores the read position
//!   if the epoch (fencing) and the incarnation token still match; a
//!   fenced relay drops its batch and epoch and re-acquires. Optionally
//!   ([`Config::idle_settles`]) the position an empty claim reached is
//!   settled too, as the store's idle progress;
//! - *learn lost*: a relay whose lease another relay took (a failed
//!   renewal) stops, dropping the batch it was delivering;
//! - *lease expiry* (bounded): the holder pauses past its lease.
//!
//! Relay groups' shared snapshots ([`SharedSnapshots`]) are modelled by
//! one more step: an empty claim of another set of the relay, earlier in
//! the same round, whose snapshot (and floor) the cursor's next claim may
//! end its new window at.
//!
//! # Invariants
//!
//! Checked in every reachable state, at every step, and at the end of every
//! complete run:
//! 1. **No skip**: the stored position (now, and as flushed) never has
//!    passed an event of a committed (resp. durably committed) transaction
//!    that was never delivered. A complete run (every producer done) is
//!    continued by a deterministic, fault-free drain of the relays until a
//!    lease holder's claim of a snapshot taken now comes back empty; then
//!    every committed event must have been delivered, and the drain must
//!    terminate ([`Invariant::Drain`]).
//!    **No phantom**: an event is only delivered while its transaction is
//!    committed, and no crash loses a commit whose event was delivered.
//! 2. **Per-key order**: when an event is delivered, every event of its
//!    key that was committed before it was inserted (and every earlier
//!    event of its key in its own transaction) has been delivered at least
//!    once. Duplicates and redeliveries after a crash or a lease loss are
//!    allowed.
//! 3. **Fencing**: a settle whose epoch is stale never changes the stored
//!    position, and under one epoch only one relay's settles succeed.
//!
//! # Broken variants (each must yield a counterexample)
//! - [`Config::order_by_txid`]: windows in `(txid, seq)` order, range from
//!   `xmax(lo)` (before the fix): per-key order.
//! - [`Config::no_incarnation_check`]: relays keep windows and
//!   observations across a crash restart: a skip.
//! - [`Config::no_fencing`]: settles ignore the epoch: fencing.
//! - [`SharedSnapshots::Unchecked`] (as implemented): a skip after a crash.
//!
//! Two runs mark what the protocol relies on rather than what it breaks:
//! producers committing asynchronously can have an event delivered whose
//! transaction a crash then loses ([`CommitModes::Both`]; a flushing claim,
//! [`Durability::Sync`], would prevent it), and the stored floors need
//! PostgreSQL's recovery rule ([`Recovery::LastDurableCommit`] skips).
//!
//! # What the model abstracts away
//! - One shard, one consumer group, one cursor: no shard filter or key
//!   hashing, no virtual shards or set merges (`MERGE_SET`), no
//!   `Snap::intersection` of group starts, no cursor creation (the cursor
//!   exists at the origin snapshot `1:1:`).
//! - The retry lane, parking, released and partially settled batches, skip
//!   lists, attempts, dead letters, delayed events: every delivery
//!   succeeds at once.
//! - Rotation, partitions and truncation; retention.
//! - One batch in flight per relay (no pipelined claims, no held keys).
//! - The exact SQL, indexes, `LIMIT` mechanics and plans: the model
//!   computes what the claim's branches return, not how.
//! - Time: a lease runs out as an abstract event; renewals are not steps
//!   (their synchronous commit is one of the flushes [`Flush`] stands
//!   for); `now()` is not modelled.
//! - Relay process crashes (a relay that stops is a relay that never acts
//!   again, which the explorer covers), broker failures and acks,
//!   consumers.
//! - Failover to a standby: like a crash restart whose durable prefix is
//!   what the standby replayed (not modelled separately).
//! - Subtransactions, prepared transactions, xid wraparound (xid8), the
//!   sequence's 32-value WAL look-ahead (the model resumes exactly after
//!   the last flushed value: stricter than PostgreSQL).
//! - A producer whose transaction was lost or rolled back does not retry
//!   (a retry is a new event).
//!
//! Bounds: xids below 32 (a snapshot's `xip` is a 32-bit mask), 15 epochs,
//! at most 8 claims per run before the drain; a run that leaves them
//! reports [`Invariant::Bound`], a configuration problem, not a protocol
//! failure. Sizes that explore in seconds in a debug build are in
//! `tests/protocol.rs`; larger ones take minutes and gigabytes (about 500
//! bytes per state), run them with `--release`.
//!
//! [`Flush`]: protocol::Action::Flush

pub mod config;
pub mod explore;
pub mod protocol;
pub mod snapshot;

pub use config::{
    CommitModes, Config, ConfigError, Durability, Producer, Recovery, SharedSnapshots,
};
pub use explore::{explore, Counterexample, Invariant, Model, Outcome, Violation};
pub use protocol::Protocol;

/// Explores every interleaving of `config`'s model (up to
/// [`Config::max_states`]).
pub fn check(config: Config) -> Result<Outcome, ConfigError> {
    let max = config.max_states;
    let model = Protocol::new(config)?;
    Ok(explore(&model, max))
}
