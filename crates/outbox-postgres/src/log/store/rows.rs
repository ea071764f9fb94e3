//! Small conversions shared by the pieces of the store: durations to
//! microseconds, counts, and the snapshots, positions and skip lists of
//! cursor rows.

use crate::error::StoreError;
use crate::log::snapshot::{Position, Snap};
use chrono::{DateTime, Utc};
use outbox_core::{Claim, FencingToken, ShardSpec};
use sqlx::postgres::PgRow;
use sqlx::Row;
use std::time::Duration;

pub(super) fn empty_claim(lease_until: DateTime<Utc>) -> Claim {
    Claim {
        token: FencingToken::new(),
        lease_until,
        events: Vec::new(),
        more: false,
    }
}

pub(super) fn micros(d: Duration) -> Result<i64, StoreError> {
    i64::try_from(d.as_micros()).map_err(|_| StoreError::DurationTooLarge(d))
}

pub(super) fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

pub(super) fn decode_err(what: String) -> StoreError {
    StoreError::Database(sqlx::Error::Decode(what.into()))
}

pub(super) fn snap(text: &str) -> Result<Snap, StoreError> {
    Snap::parse(text).map_err(decode_err)
}

pub(super) fn xid(text: &str) -> Result<u64, StoreError> {
    text.parse()
        .map_err(|_| decode_err(format!("malformed xid8 {text:?}")))
}

/// A cursor row's skip list (transactions passed out of order): the
/// `xid8[]` column `txids` zipped with the `bigint[]` column `seqs`.
pub(super) fn row_skip_list(
    row: &PgRow,
    txids: usize,
    seqs: usize,
) -> Result<Vec<(u64, i64)>, StoreError> {
    let txids: Vec<String> = row.try_get(txids)?;
    let seqs: Vec<i64> = row.try_get(seqs)?;
    txids
        .iter()
        .zip(seqs)
        .map(|(t, s)| Ok((xid(t)?, s)))
        .collect()
}

/// A shard's [`ShardSpec`] from its `(shard_index, shard_total)` columns
/// (a row that does not make one reads as [`ShardSpec::ALL`]).
pub(super) fn shard_spec(index: i32, total: i32) -> ShardSpec {
    ShardSpec::new(
        u32::try_from(index).unwrap_or(0),
        u32::try_from(total).unwrap_or(1),
    )
    .unwrap_or(ShardSpec::ALL)
}

/// A stored position: `(lo, hi)` with their seq floors, and the last
/// settled `(txid, seq)` of the window.
pub(super) fn position(
    (lo, lo_floor): (&str, i64),
    (hi, hi_floor): (&str, i64),
    pos_txid: Option<String>,
    pos_seq: Option<i64>,
) -> Result<Position, StoreError> {
    let after = match (pos_txid, pos_seq) {
        (Some(t), Some(s)) => Some((xid(&t)?, s)),
        _ => None,
    };
    Ok(Position {
        lo: snap(lo)?.with_floor(lo_floor),
        hi: snap(hi)?.with_floor(hi_floor),
        after,
    })
}
