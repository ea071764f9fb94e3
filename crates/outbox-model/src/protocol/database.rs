//! Producers and the database: transaction ids, inserts, commits and
//! their locks, WAL flushes, and what a crash restart keeps.

use super::{bound, event_id, Flushed, Position, Protocol, State, Status, MAX_EPOCH, MAX_SEQ};
use crate::config::{Durability, Recovery, MAX_KEYS};
use crate::explore::{Invariant, Log, Violation};
use crate::snapshot::{Snapshot, Xid, MAX_XID};

impl Protocol {
    /// Marks everything committed so far durable: the WAL is flushed.
    pub(super) fn flush(&self, s: &mut State) {
        for t in &mut s.txns {
            if t.status == Status::Committed {
                t.status = Status::Durable;
            }
        }
        s.cursor.durable_pos = s.cursor.pos;
        s.flushed = Flushed {
            next_xid: s.next_xid,
            next_seq: s.next_seq,
            max_commit_xid: s.max_commit_xid,
        };
    }

    pub(super) fn has_unflushed(&self, s: &State) -> bool {
        s.txns.iter().any(|t| t.status == Status::Committed)
            || s.cursor.pos != s.cursor.durable_pos
            || s.flushed
                != (Flushed {
                    next_xid: s.next_xid,
                    next_seq: s.next_seq,
                    max_commit_xid: s.max_commit_xid,
                })
    }

    pub(super) fn alloc_xid(&self, s: &mut State) -> Result<Xid, Violation> {
        let x = s.next_xid;
        if x > MAX_XID {
            return Err(bound("more xids than a snapshot mask holds"));
        }
        s.next_xid += 1;
        Ok(x)
    }

    /// A relay's own transaction (claim, settle, acquire) commits at once.
    pub(super) fn commit_own(&self, s: &mut State, x: Xid, durability: Durability) {
        s.latest_completed = s.latest_completed.max(x);
        s.max_commit_xid = s.max_commit_xid.max(x);
        if durability == Durability::Sync {
            self.flush(s);
        }
    }

    pub(super) fn release_locks(&self, s: &mut State, p: usize) {
        for lock in &mut s.locks {
            if usize::from(*lock) == p + 1 {
                *lock = 0;
            }
        }
        s.txns[p].locks = 0;
    }

    pub(super) fn insert(&self, s: &mut State, p: usize, log: &mut Log) -> Result<(), Violation> {
        if s.txns[p].xid == 0 {
            s.txns[p].xid = self.alloc_xid(s)?;
        }
        let seq = s.next_seq;
        if seq >= MAX_SEQ {
            return Err(bound("seq"));
        }
        s.next_seq += 1;
        let i = usize::from(s.txns[p].inserted);
        let e = event_id(p, i);
        let key = self.key(e);
        // What the protocol promises to order before this event: events of
        // its key committed before this insert, and its own transaction's
        // earlier events of the key.
        let mut pred = 0u8;
        for (q, t) in s.txns.iter().enumerate() {
            if q != p && !t.status.committed() {
                continue;
            }
            for j in 0..usize::from(t.inserted) {
                let other = event_id(q, j);
                if self.key(other) == key {
                    pred |= 1 << other;
                }
            }
        }
        s.pred[usize::from(e)] = pred;
        let t = &mut s.txns[p];
        t.seqs[i] = seq;
        t.inserted += 1;
        t.status = Status::Running;
        let x = t.xid;
        log.note(|| format!("P{p} inserts e{p}.{i} (key {key}): xid {x}, seq {seq}"));
        Ok(())
    }

    pub(super) fn crash(&self, s: &mut State, log: &mut Log) -> Result<(), Violation> {
        s.crashes_left -= 1;
        let mut lost = Vec::new();
        for p in 0..self.config.producers.len() {
            match s.txns[p].status {
                Status::Committed => {
                    for i in 0..s.txns[p].inserted {
                        let e = event_id(p, usize::from(i));
                        if s.delivered & (1 << e) != 0 {
                            return Err(Violation::new(
                                Invariant::NoPhantom,
                                format!(
                                    "a crash loses the commit of P{p} (xid {}, not flushed) \
                                     after {} was published",
                                    s.txns[p].xid,
                                    self.name(s, e)
                                ),
                            ));
                        }
                    }
                    s.txns[p].status = Status::Lost;
                    lost.push(format!("P{p} commit of xid {} lost", s.txns[p].xid));
                }
                Status::Running => {
                    s.txns[p].status = Status::Aborted;
                    s.txns[p].locks = 0;
                    lost.push(format!("P{p} (running) aborted"));
                }
                _ => {}
            }
        }
        s.locks = [0; MAX_KEYS];
        match self.config.recovery {
            Recovery::WalPrefix => {
                s.next_xid = s.flushed.next_xid;
                s.next_seq = s.flushed.next_seq;
            }
            Recovery::LastDurableCommit => {
                s.next_xid = s.flushed.max_commit_xid + 1;
                let mut max_seq = 0;
                for t in &s.txns {
                    if t.status == Status::Durable {
                        for seq in &t.seqs[..usize::from(t.inserted)] {
                            max_seq = max_seq.max(*seq);
                        }
                    }
                }
                s.next_seq = max_seq + 1;
            }
        }
        s.latest_completed = s.next_xid - 1;
        s.max_commit_xid = s.flushed.max_commit_xid;
        s.cursor.pos = s.cursor.durable_pos;
        s.incarnation += 1;
        log.note(|| {
            format!(
                "DATABASE CRASH: {}; restart with next xid {}, next seq {}, stored position {}, \
                 incarnation {}",
                if lost.is_empty() {
                    "no commit lost".to_string()
                } else {
                    lost.join(", ")
                },
                s.next_xid,
                s.next_seq,
                s.cursor.pos,
                s.incarnation
            )
        });
        Ok(())
    }

    /// Whether the stored positions belong to the cluster the log is on
    /// (always, for the variant without the check).
    pub(super) fn anchored(&self, s: &State) -> bool {
        self.config.no_identity_check || s.cursor.anchor == s.cluster
    }

    /// The relays caught up: every committed event has been delivered, no
    /// replay is half done and no relay holds an unpublished event. The
    /// model moves only such a log (see the crate docs): its rows are
    /// history on the new cluster.
    pub(super) fn caught_up(&self, s: &State) -> bool {
        s.owed == 0
            && s.relays
                .iter()
                .all(|r| !r.in_flight || r.sent == r.batch_len)
            && self
                .rows(s)
                .iter()
                .all(|row| s.delivered & (1 << row.id) != 0)
    }

    /// The log moves to another cluster: every committed row is copied
    /// (with the old cluster's xids and seqs as values), running
    /// transactions end with their sessions, the cursor row is copied as
    /// it is, and the new cluster hands out xids and seq values from 1
    /// again, below the stored positions. Its boot token is new too.
    pub(super) fn move_cluster(&self, s: &mut State, log: &mut Log) {
        s.moves_left -= 1;
        for t in &mut s.txns[..self.config.producers.len()] {
            match t.status {
                Status::Committed | Status::Durable => t.status = Status::Moved,
                Status::Running => {
                    t.status = Status::Aborted;
                    t.locks = 0;
                }
                _ => {}
            }
        }
        s.locks = [0; MAX_KEYS];
        s.cluster += 1;
        s.incarnation += 1;
        s.next_xid = 1;
        s.next_seq = 1;
        s.latest_completed = 0;
        s.max_commit_xid = 0;
        self.flush(s);
        log.note(|| {
            format!(
                "THE LOG MOVES to cluster {} (stored position {} copied; the new cluster's \
                 xids and seqs start at 1; incarnation {})",
                s.cluster, s.cursor.pos, s.incarnation
            )
        });
    }

    /// The operator's re-anchoring, choosing redelivery: the positions
    /// restart at the new cluster's origin with no seq floor (no value of
    /// the old cluster is kept), the leases are voided and the epoch
    /// bumped, and the meta row records the new identity (synchronously).
    pub(super) fn reanchor(&self, s: &mut State, log: &mut Log) -> Result<(), Violation> {
        if s.cursor.epoch >= MAX_EPOCH {
            return Err(bound("epochs"));
        }
        let x = self.alloc_xid(s)?;
        s.cursor.pos = Position::at(Snapshot::new(1), 0);
        s.cursor.epoch += 1;
        s.cursor.owner = 0;
        s.cursor.lease_valid = false;
        s.cursor.anchor = s.cluster;
        self.commit_own(s, x, Durability::Sync);
        log.note(|| {
            format!(
                "the operator re-anchors on cluster {}: stored position {}, epoch {}, lease void",
                s.cluster, s.cursor.pos, s.cursor.epoch
            )
        });
        Ok(())
    }
}
