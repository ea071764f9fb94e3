//! Transaction snapshots (`pg_snapshot` text `xmin:xmax:xip,...`) and the
//! cursor position built from two of them.

use std::fmt;

/// A `pg_snapshot`: every transaction below `xmin` has ended, none at or
/// above `xmax` had completed, and `xip` lists the ones in between that were
/// still running. A transaction is visible (committed before the snapshot,
/// or aborted, whose rows nobody sees anyway) when it is below `xmax` and
/// not in `xip`. (A transaction at or above `xmax` may have started before
/// the snapshot: `xmax` is one past the latest *completed* id.)
///
/// `floor` is what this process knows of the log's insertion order at the
/// snapshot: every event of a transaction at or above `xmax` has a `seq`
/// above it. 0 (what [`Snap::parse`] gives) is always true; a window read
/// from a higher floor scans fewer rows (see the claim's docs). Equality
/// and hashing ignore it: it is knowledge about the snapshot, not part of it.
#[derive(Clone)]
pub(crate) struct Snap {
    pub(crate) xmin: u64,
    pub(crate) xmax: u64,
    /// Sorted, no duplicates, all in `xmin..xmax`.
    pub(crate) xip: Vec<u64>,
    pub(crate) floor: i64,
}

impl PartialEq for Snap {
    fn eq(&self, other: &Self) -> bool {
        self.xmin == other.xmin && self.xmax == other.xmax && self.xip == other.xip
    }
}

impl Eq for Snap {}

impl std::hash::Hash for Snap {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.xmin.hash(state);
        self.xmax.hash(state);
        self.xip.hash(state);
    }
}

impl Snap {
    /// Parses PostgreSQL's text form.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("malformed pg_snapshot {text:?}");
        let mut parts = text.trim().splitn(3, ':');
        let xmin: u64 = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let xmax: u64 = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
        let rest = parts.next().ok_or_else(bad)?;
        let mut xip = Vec::new();
        for x in rest.split(',').filter(|s| !s.is_empty()) {
            xip.push(x.parse::<u64>().map_err(|_| bad())?);
        }
        xip.sort_unstable();
        xip.dedup();
        if xmin > xmax || xip.iter().any(|x| *x < xmin || *x >= xmax) {
            return Err(bad());
        }
        Ok(Self {
            xmin,
            xmax,
            xip,
            floor: 0,
        })
    }

    /// The same snapshot with seq floor `floor` (negative reads as 0).
    pub(crate) fn with_floor(mut self, floor: i64) -> Self {
        self.floor = floor.max(0);
        self
    }

    /// `pg_visible_in_snapshot(x, self)`.
    pub(crate) fn visible(&self, x: u64) -> bool {
        x < self.xmin || (x < self.xmax && self.xip.binary_search(&x).is_err())
    }

    /// The transactions running at `self` that committed by `later`: the
    /// ones a window `(self, later)` takes below `self.xmax`.
    pub(crate) fn finished_by(&self, later: &Snap) -> Vec<u64> {
        self.xip
            .iter()
            .copied()
            .filter(|x| later.visible(*x))
            .collect()
    }

    /// The largest snapshot every one of `snaps` contains: a transaction is
    /// visible in it only when it is visible in all of them. `None` when
    /// `snaps` is empty.
    pub(crate) fn intersection<'a>(snaps: impl IntoIterator<Item = &'a Snap>) -> Option<Snap> {
        let snaps: Vec<&Snap> = snaps.into_iter().collect();
        let xmin = snaps.iter().map(|s| s.xmin).min()?;
        let xmax = snaps.iter().map(|s| s.xmax).min()?;
        let mut xip: Vec<u64> = snaps
            .iter()
            .flat_map(|s| s.xip.iter().copied())
            .filter(|x| *x >= xmin && *x < xmax)
            .collect();
        xip.sort_unstable();
        xip.dedup();
        // Transactions in [xmin, xmax) that some snapshot saw as running
        // are in `xip`; the ones below another snapshot's xmin but at or
        // above this xmin, and visible everywhere, stay visible. The floor
        // of the snapshot with the lowest xmax holds for the result; the
        // lowest floor is below it.
        let floor = snaps.iter().map(|s| s.floor).min().unwrap_or(0);
        Some(Snap {
            xmin,
            xmax,
            xip,
            floor,
        })
    }
}

impl fmt::Display for Snap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:", self.xmin, self.xmax)?;
        for (i, x) in self.xip.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Snap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Snap({self})")
    }
}

/// A place in the log, for one shard: every event visible in `lo` is
/// behind it; of the events in the window `(lo, hi)` (visible in `hi`, not
/// in `lo`), the ones up to `after` in `seq` (insertion) order are behind
/// it too (`after` keeps the last one's txid for the record; only its seq
/// orders). `(hi, hi, None)` is the normal form of "window `(lo, hi)` done".
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct Position {
    pub(crate) lo: Snap,
    pub(crate) hi: Snap,
    pub(crate) after: Option<(u64, i64)>,
}

impl Position {
    /// The position at which nothing visible in `snap` is ahead.
    pub(crate) fn at(snap: Snap) -> Self {
        Self {
            lo: snap.clone(),
            hi: snap,
            after: None,
        }
    }

    /// Whether the event `(txid, seq)` is behind this position.
    pub(crate) fn passed(&self, txid: u64, seq: i64) -> bool {
        self.lo.visible(txid) || (self.hi.visible(txid) && self.after.is_some_and(|a| seq <= a.1))
    }
}

/// A transaction id read from an `xid8` column as it comes: binary (8 bytes,
/// big-endian: sqlx asks for binary results) or text. The claim decodes each
/// row's transaction id this way, without a `::text` cast per row on the
/// server and a string per row here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Xid8(pub(crate) u64);

/// `xid8`'s type OID (PostgreSQL 13+); sqlx has no built-in name for it.
const XID8_OID: sqlx::postgres::types::Oid = sqlx::postgres::types::Oid(5069);

impl sqlx::Type<sqlx::Postgres> for Xid8 {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        sqlx::postgres::PgTypeInfo::with_oid(XID8_OID)
    }

    /// `xid8`, or `bigint`: through a pooler in transaction mode the claim
    /// returns its transaction ids as `bigint` (same 8 big-endian bytes in
    /// binary), because sqlx looks the `xid8` type up by a named statement
    /// (`Sql::new`).
    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        *ty == Self::type_info() || *ty == <i64 as sqlx::Type<sqlx::Postgres>>::type_info()
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for Xid8 {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        match value.format() {
            sqlx::postgres::PgValueFormat::Binary => {
                let bytes: [u8; 8] = value.as_bytes()?.try_into().map_err(|_| {
                    format!(
                        "xid8 of {} bytes (8 expected)",
                        value.as_bytes().map_or(0, <[u8]>::len)
                    )
                })?;
                Ok(Self(u64::from_be_bytes(bytes)))
            }
            sqlx::postgres::PgValueFormat::Text => {
                let text = value.as_str()?;
                Ok(Self(
                    text.parse()
                        .map_err(|_| format!("malformed xid8 {text:?}"))?,
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let s = Snap::parse("10:20:12,15").unwrap();
        assert_eq!((s.xmin, s.xmax, s.xip.clone()), (10, 20, vec![12, 15]));
        assert_eq!(s.to_string(), "10:20:12,15");
        assert_eq!(Snap::parse("5:5:").unwrap().to_string(), "5:5:");
        for bad in ["", "1", "1:2", "3:2:", "1:5:7", "a:b:", "1:5:x"] {
            assert!(Snap::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn visibility_matches_postgres() {
        let s = Snap::parse("10:20:12,15").unwrap();
        assert!(s.visible(9) && s.visible(10) && s.visible(11) && s.visible(19));
        assert!(!s.visible(12) && !s.visible(15) && !s.visible(20) && !s.visible(25));
        let later = Snap::parse("15:30:15,22").unwrap();
        assert_eq!(s.finished_by(&later), vec![12]);
    }

    #[test]
    fn intersection_sees_only_what_all_see() {
        let a = Snap::parse("10:20:12,15").unwrap();
        let b = Snap::parse("14:18:14,16").unwrap();
        let i = Snap::intersection([&a, &b]).unwrap();
        for x in 0..40 {
            assert_eq!(i.visible(x), a.visible(x) && b.visible(x), "{x}");
        }
        assert!(Snap::intersection(std::iter::empty()).is_none());
    }

    #[test]
    fn position_passed() {
        let lo = Snap::parse("10:20:12").unwrap();
        let hi = Snap::parse("25:25:").unwrap();
        let p = Position {
            lo,
            hi,
            after: Some((20, 5)),
        };
        assert!(p.passed(11, 1)); // visible in lo
        assert!(p.passed(12, 1)); // in the window, inserted before `after`
        assert!(p.passed(20, 5));
        assert!(!p.passed(20, 6));
        assert!(p.passed(24, 4), "a later transaction id inserted earlier");
        assert!(!p.passed(24, 6));
        assert!(!p.passed(12, 9), "an earlier transaction id inserted later");
        assert!(!p.passed(25, 1)); // after hi
        let start = Position::at(Snap::parse("10:10:").unwrap());
        assert!(start.passed(9, 1) && !start.passed(10, 1));
    }
}
