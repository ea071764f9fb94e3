//! The event-log protocol as a transition system: producers, the database
//! (xids, the seq sequence, commits, durability, crash restarts), the cursor
//! row (stored position, epoch, lease), relays (claims, deliveries, settles)
//! and the broker. See the crate docs for what each step means.

mod check;
mod database;
mod relays;

use std::fmt;
use std::hash::{Hash, Hasher};

use crate::config::{
    CommitModes, Config, ConfigError, Durability, Key, SharedSnapshots, MAX_BATCH,
    MAX_EVENTS_PER_PRODUCER, MAX_KEYS, MAX_PRODUCERS, MAX_RELAYS,
};
use crate::explore::{Invariant, Log, Model, Violation};
use crate::snapshot::{Seq, Snapshot, Xid};

/// Most events a model holds (`producer * 2 + index`).
const MAX_EVENTS: usize = MAX_PRODUCERS * MAX_EVENTS_PER_PRODUCER;
/// Epochs are indexes into [`State::epoch_settler`].
const MAX_EPOCH: u8 = 15;
/// The largest seq value handed out before the model reports a bound.
const MAX_SEQ: Seq = 200;
/// Steps a drain may take before it is reported as not terminating.
const DRAIN_STEPS: usize = 80;

/// A cursor position `(lo, hi, after, floor_lo, floor_hi)`: every event of
/// a transaction visible in `lo` is behind it; of the window "visible in
/// `hi`, not visible in `lo`", the events up to `after` are behind it too.
/// `floor_*` is a seq floor of each snapshot: every transaction whose xid
/// is at least the snapshot's `xmax` inserted only events above it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Position {
    /// The lower snapshot.
    pub lo: Snapshot,
    /// The upper snapshot.
    pub hi: Snapshot,
    /// Read position in the window: its seq (0: nothing read).
    pub after_seq: Seq,
    /// Read position's txid (only the `order_by_txid` variant reads it).
    pub after_txid: Xid,
    /// Seq floor of `lo`.
    pub floor_lo: Seq,
    /// Seq floor of `hi`.
    pub floor_hi: Seq,
}

impl Position {
    fn at(snapshot: Snapshot, floor: Seq) -> Self {
        Position {
            lo: snapshot,
            hi: snapshot,
            after_seq: 0,
            after_txid: 0,
            floor_lo: floor,
            floor_hi: floor,
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "(lo {}, hi {}, after ", self.lo, self.hi)?;
        if self.after_txid != 0 {
            write!(f, "x{}/", self.after_txid)?;
        }
        if self.after_seq == 0 {
            f.write_str("-")?;
        } else {
            write!(f, "s{}", self.after_seq)?;
        }
        write!(f, ", floors {}/{})", self.floor_lo, self.floor_hi)
    }
}

/// Where a producer transaction is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
enum Status {
    /// Not begun (it may begin at any time, also after a crash).
    #[default]
    Idle,
    /// Begun: holds locks, maybe an xid and rows.
    Running,
    /// Committed, commit not yet flushed.
    Committed,
    /// Committed and flushed.
    Durable,
    /// Rolled back (or running at a crash).
    Aborted,
    /// Committed, then forgotten by a crash (its commit was not flushed).
    Lost,
    /// Committed on the cluster the log moved from, and delivered before the
    /// move: history on the new cluster (the model moves a caught-up log).
    Moved,
}

impl Status {
    fn committed(self) -> bool {
        matches!(self, Status::Committed | Status::Durable | Status::Moved)
    }

    fn finished(self) -> bool {
        !matches!(self, Status::Idle | Status::Running)
    }
}

/// A producer transaction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Txn {
    status: Status,
    /// 0: no xid yet.
    xid: Xid,
    /// Events inserted so far.
    inserted: u8,
    /// Seq of each inserted event.
    seqs: [Seq; MAX_EVENTS_PER_PRODUCER],
    /// Wrote its business row.
    business: bool,
    /// Bit k: holds the lock of key k.
    locks: u8,
}

/// A relay process's in-memory state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Relay {
    /// The epoch it believes it holds (0: none; it must acquire).
    epoch: u8,
    /// The database incarnation its windows were read in (recorded by its
    /// acquisition, as the store's `st.boot`).
    token: u8,
    /// Its read position (meaningful while `epoch != 0`).
    pos: Position,
    /// The read position moved past what this relay last settled or loaded
    /// (an empty claim may settle it: the store's idle progress).
    unsettled: bool,
    /// The latest observation of a completed claim statement, keyed by the
    /// incarnation it was made in: `S`, the sequence's last value read
    /// before that statement took its xid (the highest one seen, as the
    /// store's `observe`).
    obs: Option<(u8, Seq)>,
    /// A snapshot an earlier claim of this round (of another set of the
    /// relay) took, with its floor and the incarnation it was taken in.
    upto: Option<(Snapshot, Seq, u8)>,
    /// The batch in flight: event ids, how many, how many published.
    batch: [u8; MAX_BATCH],
    batch_len: u8,
    sent: u8,
    in_flight: bool,
    /// Cut from the database: no acquire, claim, settle or renewal; it
    /// still reaches the broker.
    cut: bool,
    /// Its own clock passed the conservative end of the lease it took (set
    /// again by its next acquisition).
    lease_ended: bool,
}

impl Relay {
    /// Loses its lease: the batch in flight and the read position go.
    fn lose_lease(&mut self) {
        self.epoch = 0;
        self.pos = Position::default();
        self.unsettled = false;
        self.batch = [0; MAX_BATCH];
        self.batch_len = 0;
        self.sent = 0;
        self.in_flight = false;
    }

    /// Drops what it read in another incarnation: windows, batch, epoch.
    /// (Its observation is keyed by the old incarnation and so is never
    /// used again; dropping it here only merges equivalent states.)
    fn forget_all(&mut self) {
        self.lose_lease();
        self.obs = None;
    }
}

/// The cursor row of the one shard.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Cursor {
    /// The stored position (as the database holds it now).
    pos: Position,
    /// The stored position as of the last flush (what a crash returns to).
    durable_pos: Position,
    /// Fencing epoch (bumped by every acquisition).
    epoch: u8,
    /// Lease owner: relay + 1, 0 none.
    owner: u8,
    /// The lease has not run out (by the database's clock).
    lease_valid: bool,
    /// The cluster the stored positions were written on (the meta row's
    /// identity).
    anchor: u8,
}

/// What the last flush made durable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Flushed {
    next_xid: Xid,
    next_seq: Seq,
    max_commit_xid: Xid,
}

/// One state of the whole system.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct State {
    next_xid: Xid,
    next_seq: Seq,
    latest_completed: Xid,
    max_commit_xid: Xid,
    incarnation: u8,
    /// The cluster (and database) the log lives on now.
    cluster: u8,
    flushed: Flushed,
    cursor: Cursor,
    /// Per key: the producer holding its lock, + 1.
    locks: [u8; MAX_KEYS],
    txns: [Txn; MAX_PRODUCERS],
    relays: [Relay; MAX_RELAYS],
    /// Per event: the events that must be delivered (first) before it.
    pred: [u8; MAX_EVENTS],
    /// Bit e: event e was delivered at least once.
    delivered: u8,
    /// Bit e: a copy of an older event of e's key was delivered after e's
    /// latest delivery, so e must be delivered again (a replay), or the
    /// run ends with a stale copy last.
    owed: u8,
    /// Per epoch: the relay (+1) whose settle succeeded under it.
    epoch_settler: [u8; MAX_EPOCH as usize + 1],
    crashes_left: u8,
    expiries_left: u8,
    claims_left: u8,
    partitions_left: u8,
    moves_left: u8,
}

/// Packs a position into two words.
fn position_words(p: &Position) -> (u64, u64) {
    (
        u64::from(p.lo.xip) | u64::from(p.hi.xip) << 32,
        u64::from(p.lo.xmax)
            | u64::from(p.hi.xmax) << 8
            | u64::from(p.after_seq) << 16
            | u64::from(p.after_txid) << 24
            | u64::from(p.floor_lo) << 32
            | u64::from(p.floor_hi) << 40,
    )
}

/// Packs up to 8 bytes into a word (no iterator: this runs for every
/// state, in debug builds too).
fn bytes_word(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    let n = bytes.len().min(8);
    word[..n].copy_from_slice(&bytes[..n]);
    u64::from_le_bytes(word)
}

impl Hash for State {
    /// By hand, a few words per actor: the derived hash of the nested
    /// structs was most of the explorer's time in a debug build. Every field
    /// is hashed, so equal states hash equally.
    fn hash<H: Hasher>(&self, h: &mut H) {
        h.write_u64(bytes_word(&[
            self.next_xid,
            self.next_seq,
            self.latest_completed,
            self.max_commit_xid,
            self.incarnation,
            self.flushed.next_xid,
            self.flushed.next_seq,
            self.flushed.max_commit_xid,
        ]));
        h.write_u64(bytes_word(&[
            self.cluster,
            self.cursor.anchor,
            self.owed,
            self.partitions_left,
            self.moves_left,
        ]));
        let c = &self.cursor;
        let (a, b) = position_words(&c.pos);
        h.write_u64(a);
        h.write_u64(b);
        let (a, b) = position_words(&c.durable_pos);
        h.write_u64(a);
        h.write_u64(b);
        h.write_u64(bytes_word(&[
            c.epoch,
            c.owner,
            u8::from(c.lease_valid),
            self.locks[0],
            self.locks[1],
            self.locks[2],
            self.locks[3],
            self.delivered,
        ]));
        for t in &self.txns {
            h.write_u64(bytes_word(&[
                t.status as u8,
                t.xid,
                t.inserted,
                t.seqs[0],
                t.seqs[1],
                u8::from(t.business),
                t.locks,
            ]));
        }
        for r in &self.relays {
            let (a, b) = position_words(&r.pos);
            h.write_u64(a);
            h.write_u64(b);
            let (obs_set, obs_token, obs_seq) = match r.obs {
                Some((t, s)) => (1, t, s),
                None => (0, 0, 0),
            };
            h.write_u64(bytes_word(&[
                r.epoch,
                r.token,
                u8::from(r.unsettled)
                    | obs_set << 1
                    | u8::from(r.in_flight) << 2
                    | u8::from(r.cut) << 3
                    | u8::from(r.lease_ended) << 4,
                obs_token,
                obs_seq,
                r.batch_len,
                r.sent,
            ]));
            h.write_u64(bytes_word(&r.batch));
            if let Some((snap, floor, token)) = r.upto {
                h.write_u64(u64::from(snap.xip) | u64::from(snap.xmax) << 32);
                h.write_u64(u64::from(floor) | u64::from(token) << 8);
            }
        }
        h.write_u64(bytes_word(&self.pred));
        h.write_u64(bytes_word(&self.epoch_settler[..8]));
        h.write_u64(bytes_word(&self.epoch_settler[8..]));
        h.write_u64(bytes_word(&[
            self.crashes_left,
            self.expiries_left,
            self.claims_left,
        ]));
    }
}

/// One atomic step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Producer writes its business row (takes its xid).
    Write(u8),
    /// Producer takes the lock of its next event's key.
    Lock(u8),
    /// Producer inserts its next event (takes an xid if it has none, then
    /// a seq).
    Insert(u8),
    /// Producer commits, synchronously or not.
    Commit(u8, Durability),
    /// Producer rolls back.
    Abort(u8),
    /// Relay takes the lease (synchronous commit) and reads the stored
    /// position.
    Acquire(u8),
    /// Relay runs one claim statement.
    Claim(u8),
    /// Relay publishes the next event of its batch.
    Deliver(u8),
    /// Relay settles its fully published batch, or the position an empty
    /// claim reached (asynchronous commit, fenced by epoch and incarnation).
    Settle(u8),
    /// Relay learns (a renewal that reaches the database) that another
    /// relay took its lease.
    LearnLost(u8),
    /// Relay loses its connection to the database (it still reaches the
    /// broker).
    Cut(u8),
    /// Relay reconnects to the database.
    Heal(u8),
    /// Relay group round: a claim of another set of the relay, earlier in
    /// the round, comes back empty and leaves its snapshot to share.
    OtherClaim(u8),
    /// The lease holder did not renew in time (it paused, or it is cut
    /// from the database): its own clock passes the conservative end of
    /// its lease (the end its last successful renewal established, minus
    /// the clock-rate margin). With the lease clock it stops delivering.
    ClockEnds,
    /// The lease runs out by the database's clock (always after the
    /// holder's own conservative end): another relay may take it.
    Expire,
    /// The log moves to another cluster (a change of identity).
    Move,
    /// The operator re-anchors the positions on the new cluster (the
    /// command the relays' refusal names), choosing redelivery.
    Reanchor,
    /// The WAL is flushed (the WAL writer, or anyone's synchronous commit).
    Flush,
    /// The database crashes and restarts.
    Crash,
}

/// An event row as a claim reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Row {
    id: u8,
    xid: Xid,
    seq: Seq,
}

fn bound(what: &str) -> Violation {
    Violation::new(Invariant::Bound, what)
}

/// The protocol model: a [`Config`] and the transition rules.
#[derive(Clone, Debug)]
pub struct Protocol {
    config: Config,
}

impl Protocol {
    /// The model of `config`, if it fits the model's bounds.
    pub fn new(config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Protocol { config })
    }

    /// Its configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    fn key(&self, event: u8) -> Key {
        let (p, i) = split(event);
        self.config
            .producers
            .get(p)
            .and_then(|spec| spec.keys.get(i))
            .copied()
            .unwrap_or(Key::MAX)
    }

    fn name(&self, s: &State, event: u8) -> String {
        let (p, i) = split(event);
        let t = &s.txns[p];
        format!(
            "e{p}.{i}(k{} x{} s{})",
            self.key(event),
            t.xid,
            t.seqs.get(i).copied().unwrap_or(0)
        )
    }

    /// The rows that exist for a reader now: inserted events of committed
    /// transactions (an aborted or lost transaction's rows are never
    /// visible, and a running one's are not yet).
    fn rows(&self, s: &State) -> Vec<Row> {
        let mut rows = Vec::new();
        for (p, t) in s.txns.iter().enumerate().take(self.config.producers.len()) {
            if !t.status.committed() || t.status == Status::Moved {
                continue;
            }
            for i in 0..usize::from(t.inserted) {
                rows.push(Row {
                    id: event_id(p, i),
                    xid: t.xid,
                    seq: t.seqs[i],
                });
            }
        }
        rows
    }

    /// `pg_current_snapshot()` now.
    fn snapshot_now(&self, s: &State) -> Snapshot {
        let mut snap = Snapshot::new(s.latest_completed.saturating_add(1));
        for t in &s.txns {
            if t.status == Status::Running && t.xid != 0 {
                snap = snap.with_running(t.xid);
            }
        }
        snap
    }

    /// Whether position `pos` has passed `row`.
    fn passes(&self, pos: &Position, row: &Row) -> bool {
        if pos.lo.visible(row.xid) {
            return true;
        }
        if !pos.hi.visible(row.xid) {
            return false;
        }
        if self.config.order_by_txid {
            (row.xid, row.seq) <= (pos.after_txid, pos.after_seq)
        } else {
            row.seq <= pos.after_seq
        }
    }

    /// The unread events of window `(lo, hi]` in delivery order.
    fn window(
        &self,
        rows: &[Row],
        lo: &Snapshot,
        hi: &Snapshot,
        floor_lo: Seq,
        after: (Xid, Seq),
    ) -> Vec<Row> {
        let (mut head, mut range): (Vec<Row>, Vec<Row>);
        if self.config.order_by_txid {
            // The old protocol: xip(lo) first, then the range from xmax(lo),
            // both in (txid, seq) order, resuming after `after`.
            head = rows
                .iter()
                .filter(|r| lo.in_progress(r.xid) && hi.visible(r.xid))
                .filter(|r| (r.xid, r.seq) > after)
                .copied()
                .collect();
            let start = after.max((lo.xmax, 0));
            range = rows
                .iter()
                .filter(|r| r.xid >= lo.xmax && hi.visible(r.xid))
                .filter(|r| (r.xid, r.seq) > start)
                .copied()
                .collect();
            head.sort_by_key(|r| (r.xid, r.seq));
            range.sort_by_key(|r| (r.xid, r.seq));
        } else {
            // The fix: the xip(lo) transactions' events at or below the
            // floor, then every event above max(floor, after) of the window,
            // all in seq order.
            head = rows
                .iter()
                .filter(|r| lo.in_progress(r.xid) && hi.visible(r.xid))
                .filter(|r| r.seq <= floor_lo && r.seq > after.1)
                .copied()
                .collect();
            range = rows
                .iter()
                .filter(|r| r.seq > floor_lo.max(after.1))
                .filter(|r| hi.visible(r.xid) && !lo.visible(r.xid))
                .copied()
                .collect();
            head.sort_by_key(|r| r.seq);
            range.sort_by_key(|r| r.seq);
        }
        head.extend(range);
        head
    }

    /// Applies `action`. `budgeted`: a claim counts against the claim
    /// budget (the drain's do not).
    fn apply(
        &self,
        state: &State,
        action: Action,
        budgeted: bool,
        log: &mut Log,
    ) -> Result<State, Violation> {
        let mut s = state.clone();
        match action {
            Action::Write(p) => {
                let p = usize::from(p);
                let x = self.alloc_xid(&mut s)?;
                let t = &mut s.txns[p];
                t.xid = x;
                t.business = true;
                t.status = Status::Running;
                log.note(|| format!("P{p} writes its business row: xid {x}"));
            }
            Action::Lock(p) => {
                let p = usize::from(p);
                let key = self.key(event_id(p, usize::from(s.txns[p].inserted)));
                s.locks[usize::from(key)] = p as u8 + 1;
                s.txns[p].locks |= 1 << key;
                s.txns[p].status = Status::Running;
                log.note(|| format!("P{p} takes the lock of key {key}"));
            }
            Action::Insert(p) => self.insert(&mut s, usize::from(p), log)?,
            Action::Commit(p, durability) => {
                let p = usize::from(p);
                let x = s.txns[p].xid;
                s.txns[p].status = Status::Committed;
                self.release_locks(&mut s, p);
                self.commit_own(&mut s, x, durability);
                log.note(|| format!("P{p} commits xid {x} ({durability:?})"));
            }
            Action::Abort(p) => {
                let p = usize::from(p);
                let x = s.txns[p].xid;
                s.txns[p].status = Status::Aborted;
                self.release_locks(&mut s, p);
                s.latest_completed = s.latest_completed.max(x);
                log.note(|| format!("P{p} rolls back xid {x}"));
            }
            Action::Acquire(r) => self.acquire(&mut s, usize::from(r), log)?,
            Action::Claim(r) => {
                if budgeted {
                    s.claims_left = s.claims_left.saturating_sub(1);
                }
                self.claim(&mut s, usize::from(r), log)?;
            }
            Action::Deliver(r) => self.deliver(&mut s, usize::from(r), log)?,
            Action::Settle(r) => self.settle(&mut s, usize::from(r), log)?,
            Action::OtherClaim(r) => {
                s.claims_left = s.claims_left.saturating_sub(1);
                self.other_claim(&mut s, usize::from(r), log)?;
            }
            Action::LearnLost(r) => {
                let r = usize::from(r);
                let old = s.relays[r].epoch;
                s.relays[r].lose_lease();
                s.relays[r].upto = None;
                log.note(|| {
                    format!(
                        "R{r} learns epoch {old} is gone (now {}): drops its batch",
                        s.cursor.epoch
                    )
                });
            }
            Action::Cut(r) => {
                s.partitions_left -= 1;
                s.relays[usize::from(r)].cut = true;
                log.note(|| format!("R{r} is cut from the database (it still reaches the broker)"));
            }
            Action::Heal(r) => {
                s.relays[usize::from(r)].cut = false;
                log.note(|| format!("R{r} reaches the database again"));
            }
            Action::ClockEnds => self.clock_ends(&mut s, log),
            Action::Expire => {
                s.cursor.lease_valid = false;
                log.note(|| {
                    format!(
                        "the lease of R{} (epoch {}) runs out by the database's clock",
                        s.cursor.owner.saturating_sub(1),
                        s.cursor.epoch
                    )
                });
            }
            Action::Move => self.move_cluster(&mut s, log),
            Action::Reanchor => self.reanchor(&mut s, log)?,
            Action::Flush => {
                self.flush(&mut s);
                log.note(|| "WAL flushed".to_string());
            }
            Action::Crash => self.crash(&mut s, log)?,
        }
        if s.crashes_left == 0 {
            // No crash can come any more: durability no longer matters, so
            // states that differ only in it are merged.
            self.flush(&mut s);
        }
        Ok(s)
    }
}

fn event_id(p: usize, i: usize) -> u8 {
    (p * MAX_EVENTS_PER_PRODUCER + i) as u8
}

fn split(event: u8) -> (usize, usize) {
    let e = usize::from(event);
    (e / MAX_EVENTS_PER_PRODUCER, e % MAX_EVENTS_PER_PRODUCER)
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn initial(&self) -> State {
        // The cursor starts at the origin snapshot: nothing has run yet.
        let origin = Position::at(Snapshot::new(1), 0);
        State {
            next_xid: 1,
            next_seq: 1,
            latest_completed: 0,
            max_commit_xid: 0,
            incarnation: 0,
            cluster: 0,
            flushed: Flushed {
                next_xid: 1,
                next_seq: 1,
                max_commit_xid: 0,
            },
            cursor: Cursor {
                pos: origin,
                durable_pos: origin,
                epoch: 0,
                owner: 0,
                lease_valid: false,
                anchor: 0,
            },
            locks: [0; MAX_KEYS],
            txns: [Txn::default(); MAX_PRODUCERS],
            relays: [Relay::default(); MAX_RELAYS],
            pred: [0; MAX_EVENTS],
            delivered: 0,
            owed: 0,
            epoch_settler: [0; MAX_EPOCH as usize + 1],
            crashes_left: self.config.crashes,
            expiries_left: self.config.lease_expiries,
            claims_left: self.config.claims,
            partitions_left: self.config.partitions,
            moves_left: self.config.moves,
        }
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        let c = &self.config;
        for (p, spec) in c.producers.iter().enumerate() {
            let t = &s.txns[p];
            if t.status.finished() {
                continue;
            }
            let id = p as u8;
            if spec.business_write && t.xid == 0 && t.inserted == 0 && !t.business {
                out.push(Action::Write(id));
            }
            if let Some(&key) = spec.keys.get(usize::from(t.inserted)) {
                if !c.aggregate_locks || t.locks & (1 << key) != 0 {
                    out.push(Action::Insert(id));
                } else if s.locks[usize::from(key)] == 0 {
                    out.push(Action::Lock(id));
                }
            } else {
                if c.producer_commits != CommitModes::Async {
                    out.push(Action::Commit(id, Durability::Sync));
                }
                if c.producer_commits != CommitModes::Sync {
                    out.push(Action::Commit(id, Durability::Async));
                }
            }
            if c.aborts && t.xid != 0 {
                out.push(Action::Abort(id));
            }
        }
        for r in 0..usize::from(c.relays) {
            let relay = &s.relays[r];
            let id = r as u8;
            if relay.cut {
                // Only the broker answers: it publishes what it holds.
                if relay.in_flight && relay.sent < relay.batch_len {
                    out.push(Action::Deliver(id));
                }
                out.push(Action::Heal(id));
                continue;
            }
            if s.partitions_left > 0 {
                out.push(Action::Cut(id));
            }
            if relay.epoch == 0 {
                let free = !s.cursor.lease_valid || usize::from(s.cursor.owner) == r + 1;
                if free && self.anchored(s) {
                    out.push(Action::Acquire(id));
                }
                continue;
            }
            if relay.in_flight {
                if relay.sent < relay.batch_len {
                    out.push(Action::Deliver(id));
                } else {
                    out.push(Action::Settle(id));
                }
            } else {
                if s.claims_left > 0 {
                    out.push(Action::Claim(id));
                    if c.shared_snapshots != SharedSnapshots::Off
                        && relay.upto.is_none()
                        && relay.token == s.incarnation
                    {
                        out.push(Action::OtherClaim(id));
                    }
                }
                if relay.unsettled && c.idle_settles {
                    // Idle progress: the position an empty claim reached.
                    out.push(Action::Settle(id));
                }
            }
            if relay.epoch != s.cursor.epoch {
                out.push(Action::LearnLost(id));
            }
        }
        if s.cursor.lease_valid && s.cursor.owner != 0 {
            let holder = &s.relays[usize::from(s.cursor.owner - 1)];
            if !holder.lease_ended {
                if s.expiries_left > 0 && (c.pauses || holder.cut) {
                    out.push(Action::ClockEnds);
                }
            } else {
                // The database's view of the end comes after the holder's
                // own conservative one (which its last renewal's start and
                // the clock-rate margin put earlier).
                out.push(Action::Expire);
            }
        }
        if s.moves_left > 0 && self.caught_up(s) {
            out.push(Action::Move);
        }
        if !self.anchored(s) {
            out.push(Action::Reanchor);
        }
        if s.crashes_left > 0 {
            out.push(Action::Crash);
            if self.has_unflushed(s) {
                out.push(Action::Flush);
            }
        }
    }

    fn step(&self, s: &State, action: Action, log: &mut Log) -> Result<State, Violation> {
        self.apply(s, action, true, log)
    }

    fn check(&self, s: &State, log: &mut Log) -> Result<(), Violation> {
        self.check_skip(s)?;
        let producers = self.config.producers.len();
        if s.txns[..producers].iter().all(|t| t.status.finished()) {
            self.drain(s, log)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(order_by_txid: bool) -> Protocol {
        Protocol::new(Config::default().with_order_by_txid(order_by_txid)).expect("valid")
    }

    fn row(id: u8, xid: Xid, seq: Seq) -> Row {
        Row { id, xid, seq }
    }

    /// Window (lo, hi): xid 3 was running at lo and inserted seq 1 before
    /// the floor (2) and seq 5 after it; xid 6 (>= xmax(lo)) inserted seq 3
    /// and seq 4; xid 2 is behind lo; xid 7 is not in hi.
    fn rows() -> Vec<Row> {
        vec![
            row(0, 3, 1),
            row(1, 3, 5),
            row(2, 6, 3),
            row(3, 6, 4),
            row(4, 2, 2),
            row(5, 7, 6),
        ]
    }

    fn ids(rows: &[Row]) -> Vec<u8> {
        rows.iter().map(|r| r.id).collect()
    }

    #[test]
    fn a_window_is_read_in_seq_order_from_its_floor() {
        let lo = Snapshot::new(5).with_running(3);
        let hi = Snapshot::new(7);
        let m = model(false);
        assert_eq!(ids(&m.window(&rows(), &lo, &hi, 2, (0, 0))), [0, 2, 3, 1]);
        // Resuming after seq 3: the head part is done.
        assert_eq!(ids(&m.window(&rows(), &lo, &hi, 2, (0, 3))), [3, 1]);
        // A wrong floor (xid 6 inserted seq 3 at or below it) loses events:
        // the floors must be right.
        assert_eq!(ids(&m.window(&rows(), &lo, &hi, 4, (0, 0))), [0, 1]);
    }

    #[test]
    fn the_old_order_is_by_txid() {
        let lo = Snapshot::new(5).with_running(3);
        let hi = Snapshot::new(7);
        let m = model(true);
        assert_eq!(ids(&m.window(&rows(), &lo, &hi, 0, (0, 0))), [0, 1, 2, 3]);
    }

    #[test]
    fn a_position_passes_by_seq_inside_its_window() {
        let lo = Snapshot::new(5).with_running(3);
        let hi = Snapshot::new(7);
        let pos = Position {
            lo,
            hi,
            after_seq: 3,
            after_txid: 0,
            floor_lo: 2,
            floor_hi: 2,
        };
        let m = model(false);
        assert!(m.passes(&pos, &row(4, 2, 2)), "visible in lo");
        assert!(m.passes(&pos, &row(0, 3, 1)));
        assert!(m.passes(&pos, &row(2, 6, 3)));
        assert!(!m.passes(&pos, &row(3, 6, 4)));
        assert!(
            !m.passes(&pos, &row(1, 3, 5)),
            "an older xid inserted later"
        );
        assert!(!m.passes(&pos, &row(5, 7, 6)), "not in hi");
    }

    /// Publishes `events` from relay 0 (as a batch, lease or not).
    fn publish(m: &Protocol, s: &State, events: &[u8]) -> State {
        let mut s = s.clone();
        let relay = &mut s.relays[0];
        relay.epoch = 1;
        relay.batch = [0; MAX_BATCH];
        relay.batch[..events.len()].copy_from_slice(events);
        relay.batch_len = events.len() as u8;
        relay.sent = 0;
        relay.in_flight = true;
        for _ in events {
            s = m
                .apply(&s, Action::Deliver(0), true, &mut Log::off())
                .expect("in order");
        }
        s
    }

    /// e0 (P0) committed before e2 (P1) was inserted, both of key 0: a
    /// copy of e0 after e2 owes a delivery of e2 (a replay pays it, a
    /// stale copy never does).
    #[test]
    fn a_copy_of_an_older_event_owes_the_newer_one() {
        let m = model(false);
        let mut s = m.initial();
        for action in [
            Action::Lock(0),
            Action::Insert(0),
            Action::Commit(0, Durability::Sync),
            Action::Lock(1),
            Action::Insert(1),
            Action::Commit(1, Durability::Sync),
        ] {
            s = m.apply(&s, action, true, &mut Log::off()).expect("step");
        }
        assert_eq!(s.pred[2], 1, "e0 is ordered before e2");
        let s = publish(&m, &s, &[0, 2]);
        assert_eq!(s.owed, 0, "in order");
        let s = publish(&m, &s, &[0]);
        assert_eq!(s.owed, 1 << 2, "a copy of e0 after e2");
        let replayed = publish(&m, &s, &[2]);
        assert_eq!(replayed.owed, 0, "the replay delivers e2 again");
        let again = publish(&m, &s, &[0]);
        assert_eq!(again.owed, 1 << 2, "still owed");
    }

    #[test]
    fn a_snapshot_ignores_running_xids_at_or_above_its_xmax() {
        let m = model(false);
        let mut s = m.initial();
        // P0 takes xid 1 and keeps running; P1 takes xid 2 and commits.
        s = m
            .apply(&s, Action::Write(0), true, &mut Log::off())
            .expect("step");
        s = m
            .apply(&s, Action::Insert(1), true, &mut Log::off())
            .expect("step");
        assert_eq!(m.snapshot_now(&s).to_string(), "1:1:");
        s = m
            .apply(
                &s,
                Action::Commit(1, Durability::Sync),
                true,
                &mut Log::off(),
            )
            .expect("step");
        assert_eq!(m.snapshot_now(&s).to_string(), "1:3:1");
    }
}
