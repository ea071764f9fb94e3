//! Transaction ids, sequence values and PostgreSQL-style snapshots.

use std::fmt;

/// A transaction id. Small on purpose: the model hands out a few dozen at
/// most, and a crash hands some of them out again.
pub type Xid = u8;

/// A value of the log's insertion sequence (`seq`); 0 means "none".
pub type Seq = u8;

/// The largest xid a [`Snapshot`] can hold in its running set (its `xip` is
/// a 32-bit mask). The model reports a bound violation before exceeding it.
pub const MAX_XID: Xid = 31;

/// A snapshot as `pg_current_snapshot()` returns it: `xmax` is the latest
/// completed xid plus one, `xip` the xids below `xmax` still running.
///
/// A transaction that already has an xid `>= xmax` when the snapshot is
/// taken is running and invisible, and is *not* in `xip` (PostgreSQL does
/// the same: `xip` only lists xids below `xmax`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Snapshot {
    /// One past the latest completed (committed or aborted) xid.
    pub xmax: Xid,
    /// Bit `x` set: xid `x` (< `xmax`) was running.
    pub xip: u32,
}

impl Snapshot {
    /// A snapshot with nothing running.
    pub fn new(xmax: Xid) -> Self {
        Snapshot { xmax, xip: 0 }
    }

    /// Marks `xid` as running in this snapshot (ignored when `xid >= xmax`
    /// or beyond [`MAX_XID`]).
    pub fn with_running(mut self, xid: Xid) -> Self {
        if xid < self.xmax && xid <= MAX_XID {
            self.xip |= 1 << xid;
        }
        self
    }

    /// Whether `xid` was running (listed in `xip`).
    pub fn in_progress(&self, xid: Xid) -> bool {
        xid <= MAX_XID && (self.xip >> xid) & 1 == 1
    }

    /// `pg_visible_in_snapshot`: the transaction had completed when the
    /// snapshot was taken. An aborted transaction is "visible" too; its rows
    /// simply do not exist.
    pub fn visible(&self, xid: Xid) -> bool {
        xid < self.xmax && !self.in_progress(xid)
    }

    /// The lowest running xid, or `xmax` when nothing was running.
    pub fn xmin(&self) -> Xid {
        if self.xip == 0 {
            self.xmax
        } else {
            // At most 31: the mask has 32 bits.
            self.xip.trailing_zeros() as Xid
        }
    }
}

impl fmt::Display for Snapshot {
    /// PostgreSQL's text form, `xmin:xmax:xip,...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:", self.xmin(), self.xmax)?;
        let mut first = true;
        for x in 0..=MAX_XID {
            if self.in_progress(x) {
                if !first {
                    f.write_str(",")?;
                }
                write!(f, "{x}")?;
                first = false;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visibility_follows_xmax_and_xip() {
        let s = Snapshot::new(5).with_running(3).with_running(7);
        assert!(s.visible(1));
        assert!(!s.visible(3), "running at the snapshot");
        assert!(s.visible(4));
        assert!(!s.visible(5), "not completed before the snapshot");
        assert!(!s.in_progress(7), "xids >= xmax are never listed in xip");
        assert!(!s.visible(7));
        assert_eq!(s.xmin(), 3);
        assert_eq!(s.to_string(), "3:5:3");
        assert_eq!(Snapshot::new(2).to_string(), "2:2:");
    }
}
