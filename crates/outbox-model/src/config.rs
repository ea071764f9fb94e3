//! What to explore: the actors, the bounds, and which protocol variant.

use std::error::Error;
use std::fmt;

/// The key of an event (its aggregate). Events of one key must be delivered
/// in the order the protocol promises.
pub(crate) type Key = u8;

/// Most producers a model holds.
pub(crate) const MAX_PRODUCERS: usize = 3;
/// Most events one producer inserts.
pub(crate) const MAX_EVENTS_PER_PRODUCER: usize = 2;
/// Most relays.
pub(crate) const MAX_RELAYS: usize = 2;
/// Largest batch size.
pub(crate) const MAX_BATCH: usize = 3;
/// Keys are `0..MAX_KEYS`.
pub(crate) const MAX_KEYS: usize = 4;

/// One producer: a transaction that inserts events of the given keys, in
/// that order, then commits (or aborts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Producer {
    /// The key of each event, in insertion order (1 or 2 events).
    pub keys: Vec<Key>,
    /// Whether the transaction may write a business row (and so take its
    /// xid) before its first event. Both orders are explored when true.
    pub business_write: bool,
}

impl Producer {
    /// A producer inserting one event per key in `keys`, that may write a
    /// business row first.
    pub fn new(keys: &[Key]) -> Self {
        Producer {
            keys: keys.to_vec(),
            business_write: true,
        }
    }

    /// Whether it may write a business row before its events.
    pub fn with_business_write(mut self, business_write: bool) -> Self {
        self.business_write = business_write;
        self
    }
}

/// How producers may commit; every allowed mode is explored at each commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitModes {
    /// `synchronous_commit = on`: durable when the commit returns.
    Sync,
    /// `synchronous_commit = off`: lost by a crash before the next flush.
    Async,
    /// Either, per commit.
    Both,
}

/// Whether a transaction's commit is flushed before it returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Durability {
    /// Flushed (and with it all WAL written before it).
    Sync,
    /// Durable only once a later flush happens.
    Async,
}

/// What a crash restart hands out again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// PostgreSQL: the WAL up to the last flush survives; the next xid and
    /// the sequence resume after everything assigned before that flush (an
    /// xid first appears in WAL at its first write, a sequence value is
    /// WAL-logged by the `nextval` that hands it out, before any later
    /// commit record). Xids and seq values assigned after the last flush
    /// are handed out again.
    WalPrefix,
    /// The brief's literal rule: the next xid is the highest durably
    /// *committed* xid + 1 and the sequence resumes after the highest seq
    /// of a durably committed row, so values seen (but not committed)
    /// before a flush can be handed out again. Stricter than PostgreSQL.
    LastDurableCommit,
}

/// Relay groups (`claim_dynamic` in `outbox-postgres`): in one round over
/// the sets a relay holds, an empty claim of one set leaves its snapshot
/// (`upto`, with its seq floor) and the later claims of the round end their
/// new window at it, so sets that catch up end at the same position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedSnapshots {
    /// One cursor per relay, no sharing.
    Off,
    /// As implemented in commit 3ca1731: the shared snapshot is kept for the
    /// whole round, including the `Relapse` retry after a claim found a new
    /// database incarnation, and is then used in the new incarnation.
    Unchecked,
    /// The fix this model proposes: the shared snapshot carries the
    /// incarnation token of the claim that took it and is only used by a
    /// claim of the same incarnation.
    PerIncarnation,
}

/// Everything the explorer varies and bounds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// The producer transactions (each runs once; they interleave freely).
    pub producers: Vec<Producer>,
    /// Relays competing for the one shard's cursor lease.
    pub relays: u8,
    /// Claim batch size.
    pub batch: u8,
    /// Database crashes (restarts) allowed per run.
    pub crashes: u8,
    /// Lease expiries allowed per run: the holder does not renew in time
    /// (it paused, or it is cut from the database), so its lease ends by
    /// its own clock and then by the database's.
    pub lease_expiries: u8,
    /// Whether a lease may run out while its holder can reach the database
    /// (it paused: a GC pause, `SIGSTOP`, an overloaded host). When false, a
    /// lease runs out only while its holder is cut from the database
    /// ([`Config::partitions`]).
    pub pauses: bool,
    /// Network partitions allowed per run: a relay loses its connection to
    /// the database (no acquire, claim, settle or renewal) while it still
    /// reaches the broker, and may later reconnect.
    pub partitions: u8,
    /// Changes of cluster identity allowed per run (0 or 1): the outbox
    /// tables, cursors included, move to another cluster or database (a
    /// logical-replication switchover, a dump and restore) whose xid counter
    /// and sequence are lower than the stored positions' values.
    pub moves: u8,
    /// Claim statements allowed per run before the final drain (each claim
    /// takes an xid, so this bounds the state space).
    pub claims: u8,
    /// How producers may commit.
    pub producer_commits: CommitModes,
    /// Whether a producer may roll back (after its first write).
    pub aborts: bool,
    /// How the claim statement's own transaction commits. A claim that
    /// takes its xid with `pg_current_xact_id()` and writes no WAL commits
    /// without a flush whatever `synchronous_commit` says (PostgreSQL only
    /// flushes a commit whose transaction wrote WAL), hence `Async` by
    /// default.
    pub claim_commit: Durability,
    /// Which recovery rule a crash follows.
    pub recovery: Recovery,
    /// A relay may settle the position an empty claim reached (the store
    /// does so every `idle_progress_every`), so stored positions also move
    /// without deliveries. Multiplies the state count.
    pub idle_settles: bool,
    /// Relay groups: whether (and how) a claim may end its new window at a
    /// snapshot an earlier claim of the same round took.
    pub shared_snapshots: SharedSnapshots,
    /// Producers take their event key's lock before inserting (after their
    /// first write, if any) and hold it until they end.
    pub aggregate_locks: bool,
    /// BROKEN variant: windows read in `(txid, seq)` order, range from
    /// `xmax(lo)` (the protocol before the seq-floor fix).
    pub order_by_txid: bool,
    /// BROKEN variant: relays never compare the database incarnation token
    /// and keep their in-memory windows and observations across a crash.
    pub no_incarnation_check: bool,
    /// BROKEN variant: settles do not compare the epoch.
    pub no_fencing: bool,
    /// BROKEN variant: a relay has no lease clock of its own; only a
    /// renewal that reaches the database (and reports the loss) or a settle
    /// (fenced) stops it, so a relay cut from the database, or paused past
    /// its lease, publishes the rest of its batch after another relay took
    /// the lease.
    pub no_lease_clock: bool,
    /// BROKEN variant: the stored positions are not tied to the cluster that
    /// wrote them; after a move the relays resume from them as they are.
    pub no_identity_check: bool,
    /// Give up (reporting a truncated, non-exhaustive run) beyond this many
    /// states.
    pub max_states: usize,
}

impl Default for Config {
    /// Two producers, one event each on the same key, one relay, batch 1,
    /// no crash, no lease expiry, three claims, the fixed protocol.
    fn default() -> Self {
        Config {
            producers: vec![Producer::new(&[0]), Producer::new(&[0])],
            relays: 1,
            batch: 1,
            crashes: 0,
            lease_expiries: 0,
            pauses: true,
            partitions: 0,
            moves: 0,
            claims: 3,
            producer_commits: CommitModes::Sync,
            aborts: true,
            claim_commit: Durability::Async,
            recovery: Recovery::WalPrefix,
            idle_settles: false,
            shared_snapshots: SharedSnapshots::Off,
            aggregate_locks: true,
            order_by_txid: false,
            no_incarnation_check: false,
            no_fencing: false,
            no_lease_clock: false,
            no_identity_check: false,
            max_states: 5_000_000,
        }
    }
}

impl Config {
    /// The producers.
    pub fn with_producers(mut self, producers: Vec<Producer>) -> Self {
        self.producers = producers;
        self
    }

    /// Number of relays.
    pub fn with_relays(mut self, relays: u8) -> Self {
        self.relays = relays;
        self
    }

    /// Claim batch size.
    pub fn with_batch(mut self, batch: u8) -> Self {
        self.batch = batch;
        self
    }

    /// Database crashes per run.
    pub fn with_crashes(mut self, crashes: u8) -> Self {
        self.crashes = crashes;
        self
    }

    /// Lease expiries per run.
    pub fn with_lease_expiries(mut self, expiries: u8) -> Self {
        self.lease_expiries = expiries;
        self
    }

    /// Whether a holder that reaches the database may still let its lease
    /// run out (by pausing).
    pub fn with_pauses(mut self, pauses: bool) -> Self {
        self.pauses = pauses;
        self
    }

    /// Network partitions (a relay cut from the database) per run.
    pub fn with_partitions(mut self, partitions: u8) -> Self {
        self.partitions = partitions;
        self
    }

    /// Changes of cluster identity per run.
    pub fn with_moves(mut self, moves: u8) -> Self {
        self.moves = moves;
        self
    }

    /// Claims per run before the drain.
    pub fn with_claims(mut self, claims: u8) -> Self {
        self.claims = claims;
        self
    }

    /// How producers may commit.
    pub fn with_producer_commits(mut self, modes: CommitModes) -> Self {
        self.producer_commits = modes;
        self
    }

    /// Whether producers may roll back.
    pub fn with_aborts(mut self, aborts: bool) -> Self {
        self.aborts = aborts;
        self
    }

    /// How claims commit.
    pub fn with_claim_commit(mut self, durability: Durability) -> Self {
        self.claim_commit = durability;
        self
    }

    /// The crash recovery rule.
    pub fn with_recovery(mut self, recovery: Recovery) -> Self {
        self.recovery = recovery;
        self
    }

    /// Whether empty claims may settle their position.
    pub fn with_idle_settles(mut self, yes: bool) -> Self {
        self.idle_settles = yes;
        self
    }

    /// Whether claims may end at a snapshot shared by a relay-group round.
    pub fn with_shared_snapshots(mut self, shared: SharedSnapshots) -> Self {
        self.shared_snapshots = shared;
        self
    }

    /// Whether producers serialize on their key's lock.
    pub fn with_aggregate_locks(mut self, locks: bool) -> Self {
        self.aggregate_locks = locks;
        self
    }

    /// BROKEN variant: `(txid, seq)` order inside a window.
    pub fn with_order_by_txid(mut self, yes: bool) -> Self {
        self.order_by_txid = yes;
        self
    }

    /// BROKEN variant: no incarnation token check.
    pub fn with_no_incarnation_check(mut self, yes: bool) -> Self {
        self.no_incarnation_check = yes;
        self
    }

    /// BROKEN variant: settles not fenced by the epoch.
    pub fn with_no_fencing(mut self, yes: bool) -> Self {
        self.no_fencing = yes;
        self
    }

    /// BROKEN variant: no lease clock in the relay.
    pub fn with_no_lease_clock(mut self, yes: bool) -> Self {
        self.no_lease_clock = yes;
        self
    }

    /// BROKEN variant: no cluster identity check.
    pub fn with_no_identity_check(mut self, yes: bool) -> Self {
        self.no_identity_check = yes;
        self
    }

    /// State limit.
    pub fn with_max_states(mut self, max: usize) -> Self {
        self.max_states = max;
        self
    }

    /// Checks the configuration fits the model's fixed-size state.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |what: &'static str| Err(ConfigError(what));
        if self.producers.is_empty() || self.producers.len() > MAX_PRODUCERS {
            return bad("1 to 3 producers");
        }
        for p in &self.producers {
            if p.keys.is_empty() || p.keys.len() > MAX_EVENTS_PER_PRODUCER {
                return bad("1 or 2 events per producer");
            }
            if p.keys.iter().any(|k| usize::from(*k) >= MAX_KEYS) {
                return bad("keys 0 to 3");
            }
        }
        if self.relays == 0 || usize::from(self.relays) > MAX_RELAYS {
            return bad("1 or 2 relays");
        }
        if self.batch == 0 || usize::from(self.batch) > MAX_BATCH {
            return bad("batch size 1 to 3");
        }
        if self.claims > 8 || self.crashes > 2 || self.lease_expiries > 3 {
            return bad("at most 8 claims, 2 crashes, 3 lease expiries");
        }
        if self.partitions > 2 || self.moves > 1 {
            return bad("at most 2 partitions and 1 move");
        }
        Ok(())
    }
}

/// A [`Config`] outside the model's bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConfigError(&'static str);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "model configuration out of bounds: {}", self.0)
    }
}

impl Error for ConfigError {}
