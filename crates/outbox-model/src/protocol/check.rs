//! The invariants checked on the way: no stored position passes an
//! undelivered committed event, and every drain delivers everything.

use super::{split, Action, Protocol, State, Status, DRAIN_STEPS};
use crate::explore::{Invariant, Log, Violation};

impl Protocol {
    /// Invariant 1 on one state: a stored position never passes a
    /// committed event that was not delivered.
    /// A stored position of another cluster is refused, never read: it is
    /// checked once re-anchored.
    pub(super) fn check_skip(&self, s: &State) -> Result<(), Violation> {
        if !self.anchored(s) {
            return Ok(());
        }
        for row in self.rows(s) {
            if s.delivered & (1 << row.id) != 0 {
                continue;
            }
            let (p, _) = split(row.id);
            let durable = s.txns[p].status == Status::Durable;
            let passed_by = if self.passes(&s.cursor.pos, &row) {
                Some(s.cursor.pos)
            } else if durable && self.passes(&s.cursor.durable_pos, &row) {
                Some(s.cursor.durable_pos)
            } else {
                None
            };
            if let Some(pos) = passed_by {
                return Err(Violation::new(
                    Invariant::NoSkip,
                    format!(
                        "stored position {pos} has passed {}, committed and never delivered",
                        self.name(s, row.id)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A complete run's end: from a state where every producer is done, the
    /// relays (no more faults, no claim budget) run until a lease holder's
    /// claim comes back empty; then every committed event must have been
    /// delivered.
    pub(super) fn drain(&self, start: &State, log: &mut Log) -> Result<(), Violation> {
        let mut s = start.clone();
        let relays = usize::from(self.config.relays);
        log.note(|| "every producer is done; the relays drain:".to_string());
        let mut drained = false;
        for _ in 0..DRAIN_STEPS {
            // No more faults: partitions heal first, and the operator
            // re-anchors moved positions as the relays' refusal says.
            let cut = (0..relays).find(|&r| s.relays[r].cut);
            let busy = (0..relays).find(|&r| s.relays[r].in_flight);
            let holder = (0..relays).find(|&r| {
                let relay = &s.relays[r];
                relay.epoch != 0
                    && relay.epoch == s.cursor.epoch
                    && s.cursor.lease_valid
                    && usize::from(s.cursor.owner) == r + 1
            });
            let action = if let Some(r) = cut {
                Action::Heal(r as u8)
            } else if !self.anchored(&s) {
                Action::Reanchor
            } else if let Some(r) = busy {
                let relay = &s.relays[r];
                if relay.sent < relay.batch_len {
                    Action::Deliver(r as u8)
                } else {
                    Action::Settle(r as u8)
                }
            } else if let Some(r) = holder {
                Action::Claim(r as u8)
            } else if let Some(r) = (0..relays).find(|&r| s.relays[r].epoch != 0) {
                // A relay that holds an epoch that is no longer good: its
                // claim is refused and it drops the epoch.
                Action::Claim(r as u8)
            } else if s.cursor.lease_valid && s.cursor.owner != 0 {
                Action::Acquire(s.cursor.owner - 1)
            } else {
                Action::Acquire(0)
            };
            let shared = match action {
                Action::Claim(r) => s.relays[usize::from(r)].upto.is_some(),
                _ => false,
            };
            let mut step_log = if log.is_on() { Log::on() } else { Log::off() };
            let result = self.apply(&s, action, false, &mut step_log);
            for line in step_log.take() {
                log.note(|| format!("  drain: {line}"));
            }
            s = result?;
            self.check_skip(&s)?;
            if let (Action::Claim(r), Some(h)) = (action, holder) {
                let relay = &s.relays[usize::from(r)];
                // Drained: the holder's claim read nothing up to a snapshot
                // taken now (not one shared by an earlier claim).
                if usize::from(r) == h && relay.epoch != 0 && !relay.in_flight && !shared {
                    drained = true;
                    break;
                }
            }
        }
        if !drained {
            return Err(Violation::new(
                Invariant::Drain,
                format!("the relays did not drain in {DRAIN_STEPS} steps"),
            ));
        }
        for row in self.rows(&s) {
            if s.delivered & (1 << row.id) == 0 {
                return Err(Violation::new(
                    Invariant::NoSkip,
                    format!(
                        "the run is complete and {} (committed) was never delivered",
                        self.name(&s, row.id)
                    ),
                ));
            }
        }
        if s.owed != 0 {
            let newer = s.owed.trailing_zeros() as u8;
            return Err(Violation::new(
                Invariant::StaleCopy,
                format!(
                    "the run is complete and the last delivery of {}'s key is a copy of an \
                     older event, delivered after {}'s last delivery and never followed by \
                     it again",
                    self.name(&s, newer),
                    self.name(&s, newer)
                ),
            ));
        }
        Ok(())
    }
}
