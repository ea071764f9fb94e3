//! The relay's steps: taking the lease, the claim statement (and a
//! relay group's other claims), publishing, and settling the position.

use super::{bound, split, Position, Protocol, State, MAX_EPOCH};
use crate::config::{Durability, SharedSnapshots, MAX_BATCH};
use crate::explore::{Invariant, Log, Violation};

impl Protocol {
    pub(super) fn acquire(&self, s: &mut State, r: usize, log: &mut Log) -> Result<(), Violation> {
        if s.cursor.epoch >= MAX_EPOCH {
            return Err(bound("epochs"));
        }
        let x = self.alloc_xid(s)?;
        s.cursor.epoch += 1;
        s.cursor.owner = r as u8 + 1;
        s.cursor.lease_valid = true;
        self.commit_own(s, x, Durability::Sync);
        let relay = &mut s.relays[r];
        relay.lose_lease();
        relay.lease_ended = false;
        relay.epoch = s.cursor.epoch;
        relay.pos = s.cursor.pos;
        relay.token = s.incarnation;
        log.note(|| {
            format!(
                "R{r} takes the lease: epoch {} (xid {x}, sync); stored position {}",
                s.cursor.epoch, s.cursor.pos
            )
        });
        Ok(())
    }

    pub(super) fn claim(&self, s: &mut State, r: usize, log: &mut Log) -> Result<(), Violation> {
        // The statement: snapshot at its start, the reads (fixed by the
        // snapshots), then S = the sequence's last value, then its own xid,
        // then its commit.
        let cur = self.snapshot_now(s);
        let rows = self.rows(s);
        let observed = s.next_seq.saturating_sub(1);
        let x = self.alloc_xid(s)?;
        self.commit_own(s, x, self.config.claim_commit);
        let commit = self.config.claim_commit;

        let relay = s.relays[r];
        let checked = !self.config.no_incarnation_check;
        if checked && relay.token != s.incarnation {
            s.relays[r].forget_all();
            log.note(|| {
                format!(
                    "R{r} claims (xid {x}): incarnation {} != its {}: drops windows, \
                     observation and epoch",
                    s.incarnation, relay.token
                )
            });
            return Ok(());
        }
        // The floor of `cur`: the latest observation of a completed claim
        // in this incarnation, or the floor of `hi` (valid for any later
        // snapshot), whichever is higher (the store's
        // `floor_for_new_snapshot`).
        let (floor_cur, floor_from) = match relay.obs {
            Some((token, seq)) if !checked || token == relay.token => {
                (seq.max(relay.pos.floor_hi), "max(observation, floor(hi))")
            }
            _ => (relay.pos.floor_hi, "floor(hi)"),
        };
        // The statement completed: its observation is recorded.
        s.relays[r].obs = match relay.obs {
            Some((token, seq)) if token == s.incarnation || !checked => {
                Some((s.incarnation, seq.max(observed)))
            }
            _ => Some((s.incarnation, observed)),
        };
        if s.cursor.epoch != relay.epoch || !s.cursor.lease_valid {
            s.relays[r].lose_lease();
            log.note(|| {
                format!(
                    "R{r} claims with epoch {} (xid {x}): lease not ok (epoch {}, valid {}), \
                     rows ignored",
                    relay.epoch, s.cursor.epoch, s.cursor.lease_valid
                )
            });
            return Ok(());
        }
        let pos = relay.pos;
        // A relay group's round may end the new window at a snapshot an
        // earlier claim of the round took (the store's `upto`, kept across
        // this claim's relapses), if it is later than `hi`.
        let (cur, floor_cur, floor_from) = match relay.upto {
            Some((snap, floor, token))
                if (snap.xmax > pos.hi.xmax || snap == pos.hi)
                    && (self.config.shared_snapshots != SharedSnapshots::PerIncarnation
                        || token == s.incarnation) =>
            {
                (snap, floor, "the shared snapshot")
            }
            _ => (cur, floor_cur, floor_from),
        };
        s.relays[r].upto = None;
        let batch = usize::from(self.config.batch);
        let w1 = self.window(
            &rows,
            &pos.lo,
            &pos.hi,
            pos.floor_lo,
            (pos.after_txid, pos.after_seq),
        );
        let (events, new_pos) = if w1.len() >= batch {
            let events = &w1[..batch];
            let last = events[batch - 1];
            let new_pos = Position {
                after_seq: last.seq,
                after_txid: if self.config.order_by_txid {
                    last.xid
                } else {
                    0
                },
                ..pos
            };
            (events.to_vec(), new_pos)
        } else {
            let w2 = self.window(&rows, &pos.hi, &cur, pos.floor_hi, (0, 0));
            let room = batch - w1.len();
            let mut events = w1;
            // As the store: a full batch ends after its last event even when
            // that was the window's last (only a short read reaches `cur`).
            if w2.len() >= room {
                let last = w2[room - 1];
                events.extend_from_slice(&w2[..room]);
                let new_pos = Position {
                    lo: pos.hi,
                    hi: cur,
                    after_seq: last.seq,
                    after_txid: if self.config.order_by_txid {
                        last.xid
                    } else {
                        0
                    },
                    floor_lo: pos.floor_hi,
                    floor_hi: floor_cur,
                };
                (events, new_pos)
            } else {
                events.extend_from_slice(&w2);
                (events, Position::at(cur, floor_cur))
            }
        };
        let relay = &mut s.relays[r];
        relay.unsettled |= new_pos != pos;
        relay.pos = new_pos;
        relay.batch = [0; MAX_BATCH];
        for (slot, row) in relay.batch.iter_mut().zip(&events) {
            *slot = row.id;
        }
        relay.batch_len = events.len() as u8;
        relay.sent = 0;
        relay.in_flight = !events.is_empty();
        let epoch = relay.epoch;
        log.note(|| {
            let names: Vec<String> = events.iter().map(|e| self.name(s, e.id)).collect();
            format!(
                "R{r} claims (epoch {}): cur {cur}, floor(cur) {floor_cur} from {floor_from}; \
                 reads [{}]; read position {new_pos}; observes S={observed}, xid {x} ({commit:?})",
                epoch,
                names.join(", ")
            )
        });
        Ok(())
    }

    /// An empty claim of another set of relay `r` (same process, same
    /// incarnation token): its snapshot becomes the round's shared `upto`.
    pub(super) fn other_claim(
        &self,
        s: &mut State,
        r: usize,
        log: &mut Log,
    ) -> Result<(), Violation> {
        let cur = self.snapshot_now(s);
        let observed = s.next_seq.saturating_sub(1);
        let x = self.alloc_xid(s)?;
        self.commit_own(s, x, self.config.claim_commit);
        let relay = &mut s.relays[r];
        // That set's own fallback floor is not modelled: 0 (always valid).
        let floor = match relay.obs {
            Some((token, seq)) if token == s.incarnation => seq,
            _ => 0,
        };
        relay.obs = match relay.obs {
            Some((token, seq)) if token == s.incarnation => Some((token, seq.max(observed))),
            _ => Some((s.incarnation, observed)),
        };
        relay.upto = Some((cur, floor, s.incarnation));
        log.note(|| {
            format!(
                "R{r} claims another set of its group (empty): shares cur {cur} with floor \
                 {floor} for this round; observes S={observed}, xid {x}"
            )
        });
        Ok(())
    }

    pub(super) fn deliver(&self, s: &mut State, r: usize, log: &mut Log) -> Result<(), Violation> {
        let relay = &mut s.relays[r];
        let e = relay.batch[usize::from(relay.sent)];
        relay.sent += 1;
        let epoch = relay.epoch;
        let (p, _) = split(e);
        if !s.txns[p].status.committed() {
            return Err(Violation::new(
                Invariant::NoPhantom,
                format!(
                    "R{r} publishes {} of a {:?} transaction",
                    self.name(s, e),
                    s.txns[p].status
                ),
            ));
        }
        let mut pred = s.pred[usize::from(e)];
        while pred != 0 {
            let before = pred.trailing_zeros() as u8;
            pred &= pred - 1;
            let (q, _) = split(before);
            if s.txns[q].status.committed() && s.delivered & (1 << before) == 0 {
                return Err(Violation::new(
                    Invariant::KeyOrder,
                    format!(
                        "R{r} publishes {} before any delivery of {}, committed before it \
                         was inserted",
                        self.name(s, e),
                        self.name(s, before)
                    ),
                ));
            }
        }
        let again = s.delivered & (1 << e) != 0;
        s.delivered |= 1 << e;
        // Every newer event of the key already delivered must now be
        // delivered again (a replay), or this copy is a stale one.
        s.owed &= !(1u8 << e);
        for (j, pred) in s.pred.iter().enumerate() {
            if pred & (1 << e) != 0 && s.delivered & (1 << j) != 0 {
                s.owed |= 1 << j;
            }
        }
        log.note(|| {
            format!(
                "R{r} publishes {} (epoch {epoch}){}",
                self.name(s, e),
                if again { " again" } else { "" }
            )
        });
        Ok(())
    }

    pub(super) fn settle(&self, s: &mut State, r: usize, log: &mut Log) -> Result<(), Violation> {
        let relay = s.relays[r];
        if !self.config.no_incarnation_check && relay.token != s.incarnation {
            s.relays[r].forget_all();
            log.note(|| {
                format!(
                    "R{r} settles: incarnation {} != its {}: 0 rows; drops windows, \
                     observation and epoch",
                    s.incarnation, relay.token
                )
            });
            return Ok(());
        }
        let stale = relay.epoch != s.cursor.epoch;
        if stale && !self.config.no_fencing {
            s.relays[r].lose_lease();
            log.note(|| {
                format!(
                    "R{r} settles with epoch {}: fenced (epoch is {}), 0 rows",
                    relay.epoch, s.cursor.epoch
                )
            });
            return Ok(());
        }
        if stale {
            return Err(Violation::new(
                Invariant::Fencing,
                format!(
                    "R{r} with stale epoch {} (stored epoch {}) moves the stored position \
                     {} -> {}",
                    relay.epoch, s.cursor.epoch, s.cursor.pos, relay.pos
                ),
            ));
        }
        let settler = &mut s.epoch_settler[usize::from(relay.epoch)];
        if *settler != 0 && usize::from(*settler) != r + 1 {
            return Err(Violation::new(
                Invariant::Fencing,
                format!(
                    "R{r} and R{} both settle under epoch {}",
                    *settler - 1,
                    relay.epoch
                ),
            ));
        }
        *settler = r as u8 + 1;
        let x = self.alloc_xid(s)?;
        s.cursor.pos = relay.pos;
        self.commit_own(s, x, Durability::Async);
        let relay = &mut s.relays[r];
        relay.batch = [0; MAX_BATCH];
        relay.batch_len = 0;
        relay.sent = 0;
        relay.in_flight = false;
        relay.unsettled = false;
        let renew = relay.lease_ended && !self.config.no_lease_clock;
        if renew {
            // Its own clock says the lease is over: it takes it again
            // before its next claim.
            relay.lose_lease();
        }
        log.note(|| {
            format!(
                "R{r} settles epoch {}: stored position {} (xid {x}, async){}",
                relay.epoch,
                s.cursor.pos,
                if renew {
                    "; its lease ended by its clock: it drops the epoch"
                } else {
                    ""
                }
            )
        });
        Ok(())
    }

    /// The holder's own clock passes the conservative end of its lease.
    /// With the lease clock it cancels what it has not published yet
    /// (the events are released: the stored position has not passed them)
    /// and drops its epoch; a batch already published keeps its settle,
    /// which the epoch fences.
    pub(super) fn clock_ends(&self, s: &mut State, log: &mut Log) {
        s.expiries_left -= 1;
        let r = usize::from(s.cursor.owner.saturating_sub(1));
        let relay = &mut s.relays[r];
        relay.lease_ended = true;
        let why = if relay.cut {
            "it cannot reach the database to renew"
        } else {
            "it paused"
        };
        if self.config.no_lease_clock {
            log.note(|| {
                format!(
                    "R{r}'s lease (epoch {}) ends by its own clock ({why}); without a lease \
                     clock it goes on",
                    relay.epoch
                )
            });
            return;
        }
        if relay.in_flight && relay.sent == relay.batch_len {
            log.note(|| {
                format!(
                    "R{r}'s lease (epoch {}) ends by its own clock ({why}): its batch is \
                     published, only its fenced settle is left",
                    relay.epoch
                )
            });
            return;
        }
        let epoch = relay.epoch;
        let unsent = relay.batch_len - relay.sent;
        relay.lose_lease();
        relay.upto = None;
        log.note(|| {
            format!(
                "R{r}'s lease (epoch {epoch}) ends by its own clock ({why}): it stops \
                 delivering, {unsent} unpublished event(s) released"
            )
        });
    }
}
