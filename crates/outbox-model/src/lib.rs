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
//! and its flushed copy, epoch, owner, lease (valid or run out by the
//! database's clock), and the identity of the cluster the positions were
//! written on (the meta row's `system_identifier` and database).
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
//! - *learn lost*: a relay whose lease another relay took (a renewal that
//!   reaches the database and reports the loss) stops, dropping the batch
//!   it was delivering;
//! - *lease end* (bounded, [`Config::lease_expiries`]): the holder does
//!   not renew in time, because it paused ([`Config::pauses`]) or because
//!   it is cut from the database. Two steps, in this order: its **own
//!   clock** passes the conservative end its last successful renewal
//!   established (the renewal's start plus the lease, minus a margin for
//!   clock rate), then the **database's clock** passes the lease's end and
//!   another relay may take it. At its own end the holder stops: it
//!   cancels what it has not published (the events are released: the
//!   stored position has not passed them) and drops its epoch; a batch
//!   already published keeps only its settle, which the epoch fences. It
//!   takes the lease again (a new epoch) before its next claim;
//! - *cut / reconnect* (bounded, [`Config::partitions`]): a relay loses its
//!   connection to the database while it still reaches the broker. Cut, it
//!   can only publish what it holds: no acquire, claim, settle or renewal
//!   (so no learning of a loss either).
//!
//! **A change of cluster identity** ([`Config::moves`]): the outbox tables,
//! cursor row included, move to another cluster or database (a
//! logical-replication switchover, a dump and restore). Rows keep the old
//! cluster's xids and seqs as values, running transactions end with their
//! sessions, the new cluster hands out xids and seq values from 1 (below
//! the stored snapshots and floors) and has its own boot token. Relays
//! refuse to take a lease while the stored identity is not the cluster's;
//! the operator's re-anchoring (the command the refusal names), choosing
//! redelivery, restarts the positions at the new cluster's origin with no
//! seq floor, voids the lease and bumps the epoch.
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
//!    A stored position of another cluster is refused, never read: it is
//!    checked once re-anchored (always, in the variant without the
//!    identity check).
//!    **No phantom**: an event is only delivered while its transaction is
//!    committed, and no crash loses a commit whose event was delivered.
//! 2. **Per-key order**: never an older event of a key delivered after a
//!    newer one of that key was delivered, except as a replay. "Older"
//!    means committed before the newer one was inserted (or earlier in the
//!    same transaction): what README's "Guarantees" and DESIGN invariant
//!    12 promise. At-least-once allows redelivery after a crash or a lease
//!    loss, so the property has two halves:
//!    - **first copies in order** ([`Invariant::KeyOrder`], checked at
//!      every delivery): when an event is delivered, every older event of
//!      its key has been delivered at least once. This is the chaos
//!      checker's definition (`outbox-chaos`, `checker.rs`: an event's
//!      first arrival below the highest first-arrived seq of its key is a
//!      violation; later copies are counted as duplicates);
//!    - **no stale copy** ([`Invariant::StaleCopy`], checked at the end of
//!      every complete run, after the drain): a copy of an older event
//!      delivered after a newer one was delivered is allowed only as part
//!      of a replay that then delivers the newer one again. Equivalently,
//!      the *last* copies of a key's events arrive in the key's order, so
//!      a consumer without dedup that applies what it receives ends on the
//!      key's newest event. A relay redelivering its batch after a takeover
//!      while the new holder has already moved on is the violation the
//!      chaos checker's first-arrival rule cannot see.
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
//! - [`Config::no_lease_clock`]: a relay cut from the database publishes
//!   the rest of its batch after the new holder delivered the key's newer
//!   event: a stale copy.
//! - [`Config::no_identity_check`]: after a move, relays resume from the
//!   old cluster's positions and the new cluster's first transaction looks
//!   delivered: a skip.
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
//! - Time: a lease's end is two abstract events (the holder's clock, then
//!   the database's), ordered as the margin makes them; renewals are not
//!   steps (their synchronous commit is one of the flushes [`Flush`] stands
//!   for; a holder whose own clock ended takes a new epoch instead of
//!   renewing); `now()` is not modelled. A publish is atomic at the broker:
//!   one handed to the network before the holder's end and acknowledged
//!   after the takeover is not modelled (the margin must cover it), and a
//!   settle is atomic at the database (the epoch fences one that arrives
//!   late).
//! - The move copies a caught-up log (every committed event delivered, no
//!   replay half done, no relay holding an unpublished event); its rows
//!   are history on the new cluster. What a
//!   re-anchoring does with events the old cluster had not delivered, and
//!   old rows whose foreign xids a new snapshot cannot place, are not
//!   modelled; the re-anchoring's skip choice neither.
//! - Relay process crashes (a relay that stops is a relay that never acts
//!   again, which the explorer covers), broker failures and acks,
//!   consumers.
//! - Failover to a standby: like a crash restart whose durable prefix is
//!   what the standby replayed (not modelled separately; a promoted
//!   physical standby keeps the cluster's identity, so it is not a move).
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

mod config;
mod explore;
mod protocol;
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
