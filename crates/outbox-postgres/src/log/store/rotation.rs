//! Rotation: when the current partition is older than the rotation
//! interval, the oldest one is truncated and becomes current, once every
//! cursor of every group has passed all of its rows and no transaction
//! holds it (see the [module docs](crate::log)). Runs in the background of
//! a store, or on demand ([`PgLogStore::rotate`](super::PgLogStore::rotate)).
//!
//! Rotation never makes a claim or a settle wait behind another session:
//! its `ACCESS EXCLUSIVE` request is made only when `pg_locks` shows no
//! session (and no prepared transaction) holding the partition beyond a
//! statement, and then with a 5 ms `lock_timeout`, tried again a few times
//! in a short loop (claims hold the partition for milliseconds, so one of
//! the tries finds the gap). A session that holds the partition longer (a
//! `pg_dump`, a psql session idle in a transaction, a prepared
//! transaction) holds rotation back: it is named in
//! [`PgLogStore::rotation_hold`](super::PgLogStore::rotation_hold) and the
//! metrics, and the next check comes a second later.

use super::context::Ctx;
use super::rows::micros;
use crate::db::{Db, Tx};
use crate::error::StoreError;
use crate::log::sql::Sql;
use crate::names::log::PARTITIONS;
use chrono::{DateTime, Utc};
use sqlx::Row;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// What one [`PgLogStore::rotate`](super::PgLogStore::rotate) call did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rotation {
    /// The oldest partition was truncated and is now current.
    Rotated {
        /// The new generation (its partition is `generation % 3`).
        generation: i64,
        /// Rotations so far.
        rotations: i64,
    },
    /// The current partition is younger than the rotation interval.
    NotDue,
    /// Not possible now; the reason says why (a cursor behind, a group with
    /// shards missing, no cursor at all, or the partition in use).
    Blocked(String),
}

/// A session or a prepared transaction that holds (or waits for) a lock on
/// the partition the next rotation truncates (see
/// [`PgLogStore::rotation_hold`](super::PgLogStore::rotation_hold)).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct PartitionHolder {
    /// Its backend's process id; `None` for a prepared (2PC) transaction,
    /// which no session holds any more.
    pub pid: Option<i32>,
    /// The session's `application_name` (`pg_dump`, `psql`, ...).
    pub application_name: Option<String>,
    /// The session's state (`active`, `idle in transaction`, ...).
    pub state: Option<String>,
    /// The backend type (`client backend`, `autovacuum worker`, ...).
    pub backend_type: Option<String>,
    /// Since when (database clock): its transaction's start, or when it
    /// was prepared.
    pub since: Option<DateTime<Utc>>,
    /// A prepared transaction's global id (`PREPARE TRANSACTION 'gid'`).
    pub gid: Option<String>,
    /// The lock modes it holds or waits for (`AccessShareLock`, ...).
    pub modes: Vec<String>,
    /// Whether one of its lock requests is still waiting.
    pub waiting: bool,
    /// How long it has held the partition when it was read.
    pub held_for: Duration,
}

/// A holder's transaction younger than this, running a statement, is
/// taken for a claim or a status query that ends in milliseconds: the
/// lock is tried past it (5 ms at most). An older one, or one idle in its
/// transaction, or a prepared transaction, holds rotation back.
const HOLDER_GRACE: Duration = Duration::from_secs(1);

impl PartitionHolder {
    /// An autovacuum worker: never counted as a writer (its lock is not a
    /// producer's open transaction), only as a holder while it lasts.
    pub fn is_autovacuum(&self) -> bool {
        self.backend_type.as_deref() == Some("autovacuum worker")
    }

    /// A prepared (2PC) transaction: `pg_locks` shows it without a pid.
    pub fn is_prepared(&self) -> bool {
        self.pid.is_none()
    }

    /// A transaction that may have written to the partition and is still
    /// open (a lock stronger than `ACCESS SHARE`, autovacuum's excepted):
    /// its rows may not be passed yet, so the partition cannot be
    /// truncated whatever the lock.
    pub fn is_writer(&self) -> bool {
        !self.is_autovacuum() && self.modes.iter().any(|m| m != "AccessShareLock")
    }

    /// Whether it holds rotation back: a writer, a prepared transaction, a
    /// session idle in its transaction, or one that has held the partition
    /// for a second or more. Rotation never queues its lock behind one.
    /// (A session shown `idle` outside a transaction is one that just
    /// ended it: `pg_locks` and `pg_stat_activity` are read apart.)
    pub fn holds_back(&self) -> bool {
        self.is_writer()
            || self.is_prepared()
            || self
                .state
                .as_deref()
                .is_some_and(|s| s.starts_with("idle in transaction"))
            || self.held_for >= HOLDER_GRACE
    }
}

impl fmt::Display for PartitionHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.pid, &self.gid) {
            (None, Some(gid)) => write!(f, "prepared transaction '{gid}'")?,
            (None, None) => f.write_str("a prepared transaction")?,
            (Some(pid), _) => {
                write!(f, "pid {pid}")?;
                if let Some(app) = self.application_name.as_deref().filter(|a| !a.is_empty()) {
                    write!(f, " ({app})")?;
                }
                if let Some(state) = &self.state {
                    write!(f, " {state}")?;
                } else if let Some(kind) = &self.backend_type {
                    write!(f, " {kind}")?;
                }
            }
        }
        if let Some(since) = self.since {
            write!(f, " since {}", since.format("%Y-%m-%d %H:%M:%S%.3f UTC"))?;
        }
        Ok(())
    }
}

/// What holds the next rotation back, read live (see
/// [`PgLogStore::rotation_hold`](super::PgLogStore::rotation_hold)).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct RotationHold {
    /// The partition the next rotation truncates.
    pub partition: usize,
    /// When the next rotation became due (database clock): the current
    /// partition's start plus the rotation interval (may be in the future).
    pub due_at: DateTime<Utc>,
    /// Whether it is due now.
    pub due: bool,
    /// The session that holds it back (the oldest writer or lasting
    /// holder of the partition), if any.
    pub held_by: Option<PartitionHolder>,
    /// Every session holding a lock on the partition, brief ones included.
    pub holders: Vec<PartitionHolder>,
}

impl RotationHold {
    /// Since when the holder holds a due rotation back: the later of the
    /// due time and the holder's start. `None` when nothing holds it back
    /// or it is not due.
    pub fn held_since(&self) -> Option<DateTime<Utc>> {
        let h = self.held_by.as_ref().filter(|_| self.due)?;
        Some(h.since.map_or(self.due_at, |s| s.max(self.due_at)))
    }
}

/// The holders of partition `target`, one per session or prepared
/// transaction, oldest first.
async fn holders(
    conn: &mut Tx<'_>,
    sql: &Sql,
    target: usize,
) -> Result<Vec<PartitionHolder>, StoreError> {
    let rows = sqlx::query(&sql.rotate_holders[target])
        .fetch_all(&mut *conn)
        .await?;
    let mut out: Vec<PartitionHolder> = Vec::new();
    for r in &rows {
        let pid: Option<i32> = r.try_get(0)?;
        let gid: Option<String> = r.try_get(5)?;
        let mode: Option<String> = r.try_get(6)?;
        let granted: Option<bool> = r.try_get(7)?;
        let since: Option<DateTime<Utc>> = r.try_get(4)?;
        let now: DateTime<Utc> = r.try_get(8)?;
        let i = match out.iter().position(|h| h.pid == pid && h.gid == gid) {
            Some(i) => i,
            None => {
                out.push(PartitionHolder {
                    pid,
                    application_name: r.try_get(1)?,
                    state: r.try_get(2)?,
                    backend_type: r.try_get(3)?,
                    since,
                    gid: gid.clone(),
                    modes: Vec::new(),
                    waiting: false,
                    held_for: since
                        .and_then(|s| (now - s).to_std().ok())
                        .unwrap_or_default(),
                });
                out.len() - 1
            }
        };
        let h = &mut out[i];
        if let Some(mode) = mode {
            if !h.modes.contains(&mode) {
                h.modes.push(mode);
            }
        }
        h.waiting |= granted == Some(false);
    }
    Ok(out)
}

/// The holder that holds rotation back: the first writer, else the oldest
/// lasting holder.
fn holding_back(holders: &[PartitionHolder]) -> Option<&PartitionHolder> {
    holders
        .iter()
        .find(|h| h.is_writer())
        .or_else(|| holders.iter().find(|h| h.holds_back()))
}

/// What one attempt came to, for the background loop.
enum Attempt {
    Done(Rotation),
    /// Only brief holders were in the way: again soon.
    Busy(String),
    /// A session holds the partition (a writer or a lasting reader).
    Held(String, PartitionHolder),
}

/// `lock_timeout` of the rotation's lock, requested only when no session
/// holds the partition beyond a statement: a claim that starts meanwhile
/// waits at most this long (the old 500 ms queued wait stalled every relay
/// behind any reader, ARCHITECTURE.md).
const ROTATE_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '5ms'";
/// Tries of the lock per attempt; between them a pause of 1, 2, 4, 8, then
/// 10 ms (about 0.15 s in all): claims back to back still leave gaps of
/// a few milliseconds (publishing and settling happen between claims).
const LOCK_TRIES: u32 = 20;

/// One rotation attempt (see [`PgLogStore::rotate`](super::PgLogStore::rotate)).
pub(super) async fn rotate_once(
    db: &Db,
    sql: &Sql,
    interval: Duration,
) -> Result<Rotation, StoreError> {
    Ok(match attempt(db, sql, interval).await? {
        Attempt::Done(r) => r,
        Attempt::Busy(reason) | Attempt::Held(reason, _) => Rotation::Blocked(reason),
    })
}

async fn attempt(db: &Db, sql: &Sql, interval: Duration) -> Result<Attempt, StoreError> {
    let mut tx = db.begin().await?;
    let due = match sqlx::query(&sql.rotate_due)
        .bind(micros(interval)?)
        .fetch_one(&mut tx)
        .await
    {
        Ok(row) => row,
        Err(e) if lock_busy(&e) => {
            tx.rollback().await?;
            return Ok(Attempt::Busy("another rotation is running".into()));
        }
        Err(e) => return Err(e.into()),
    };
    let is_due: bool = due.try_get(0)?;
    let generation: i64 = due.try_get(1)?;
    // The generation is the committed one (the meta row's): a rotation
    // that committed but has not bumped the sequence yet is not undone by
    // truncating its partition again.
    sqlx::query(&sql.rotate_catch_up).execute(&mut tx).await?;
    if !is_due {
        tx.commit().await?;
        return Ok(Attempt::Done(Rotation::NotDue));
    }
    let target = usize::try_from((generation + 1).rem_euclid(PARTITIONS as i64)).unwrap_or(0);

    if let Some(reason) = rotate_check(&mut tx, sql, target).await? {
        tx.rollback().await?;
        return Ok(Attempt::Done(Rotation::Blocked(reason)));
    }
    sqlx::query(ROTATE_LOCK_TIMEOUT).execute(&mut tx).await?;
    // Every early return rolls back at once: a dropped transaction's
    // rollback waits for its connection's next use, and the meta row's
    // lock with it (the next attempt would find "another rotation").
    let mut tries = 0;
    loop {
        // Checked before every try: a writer (its rows may not be passed
        // yet: the check above could not see them) or a session holding the
        // partition beyond a statement is never queued behind.
        let found = holders(&mut tx, sql, target).await?;
        if let Some(h) = holding_back(&found) {
            let reason = if h.is_writer() {
                format!(
                    "partition {target} is in use: a transaction that wrote to it is still open ({h})"
                )
            } else {
                format!("partition {target} is held by {h}")
            };
            let h = h.clone();
            tx.rollback().await?;
            return Ok(Attempt::Held(reason, h));
        }
        tries += 1;
        let mut sp = tx.savepoint().await?;
        match sqlx::query(&sql.rotate_lock[target]).execute(&mut sp).await {
            Ok(_) => {
                sp.commit().await?;
                break;
            }
            Err(e) if lock_busy(&e) => {
                sp.rollback().await?;
                if tries >= LOCK_TRIES {
                    tx.rollback().await?;
                    return Ok(Attempt::Busy(format!(
                        "partition {target} is in use: its lock was busy {tries} times"
                    )));
                }
                tokio::time::sleep(
                    Duration::from_millis(1 << (tries - 1).min(4)).min(Duration::from_millis(10)),
                )
                .await;
            }
            Err(e) => return Err(e.into()),
        }
    }
    metrics::histogram!(crate::log::metric_names::ROTATION_LOCK_TRIES).record(f64::from(tries));
    if let Some(reason) = rotate_check(&mut tx, sql, target).await? {
        tx.rollback().await?;
        return Ok(Attempt::Done(Rotation::Blocked(reason)));
    }
    sqlx::query(&sql.rotate_truncate[target])
        .execute(&mut tx)
        .await?;
    let (rotations, generation): (i64, i64) =
        sqlx::query_as(&sql.rotate_done).fetch_one(&mut tx).await?;
    tx.commit().await?;
    // After the commit: producers that see the new generation write into
    // the truncated partition without waiting for this transaction.
    sqlx::query(&sql.rotate_bump)
        .bind(generation)
        .execute(db)
        .await?;
    tracing::debug!(
        generation,
        rotations,
        partition = target,
        tries,
        "rotated the outbox event log"
    );
    metrics::counter!(crate::log::metric_names::ROTATIONS).increment(1);
    Ok(Attempt::Done(Rotation::Rotated {
        generation,
        rotations,
    }))
}

/// The meta row as status reads it: generation, due time, due now.
const HOLD_DUE: &str = "\
SELECT generation, switched_at + $1 * interval '1 microsecond',
       switched_at + $1 * interval '1 microsecond' <= now()
FROM {{meta}}";

/// What holds the next rotation back, read live (no lock taken).
pub(super) async fn hold(ctx: &Ctx, interval: Duration) -> Result<RotationHold, StoreError> {
    let mut tx = ctx.db.begin().await?;
    let (generation, due_at, due): (i64, DateTime<Utc>, bool) =
        sqlx::query_as(&ctx.names.render(HOLD_DUE))
            .bind(micros(interval)?)
            .fetch_one(&mut tx)
            .await?;
    let partition = usize::try_from((generation + 1).rem_euclid(PARTITIONS as i64)).unwrap_or(0);
    let holders = holders(&mut tx, &ctx.sql, partition).await?;
    tx.commit().await?;
    Ok(RotationHold {
        partition,
        due_at,
        due,
        held_by: holding_back(&holders).cloned(),
        holders,
    })
}

/// Why partition `target` may not be truncated now, if it may not.
async fn rotate_check(
    conn: &mut Tx<'_>,
    sql: &Sql,
    target: usize,
) -> Result<Option<String>, StoreError> {
    let row = sqlx::query(&sql.rotate_check[target])
        .fetch_one(&mut *conn)
        .await?;
    let cursors: i64 = row.try_get(0)?;
    let incomplete: bool = row.try_get(1)?;
    let behind: bool = row.try_get(2)?;
    Ok(if cursors == 0 {
        Some("no cursor exists yet (no relay has claimed)".to_owned())
    } else if incomplete {
        Some("a consumer group has cursors for only some of its shards".to_owned())
    } else if behind {
        Some(format!(
            "a cursor has not passed every event of partition {target}"
        ))
    } else {
        None
    })
}

/// After a rotation postponed because its partition was in use (brief
/// holders, or a session holding it), the next attempt comes this soon
/// (not a whole check interval later).
const ROTATE_RETRY_BUSY: Duration = Duration::from_secs(1);

fn lock_busy(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

/// The metrics of the session holding rotation back: set while it holds,
/// zeroed when it is gone (the label set of the last one is kept).
#[derive(Default)]
struct HeldGauges {
    /// The holder's labels and since when (this process's clock) it holds.
    current: Option<(Vec<(&'static str, String)>, std::time::Instant)>,
}

impl HeldGauges {
    fn labels(h: &PartitionHolder) -> Vec<(&'static str, String)> {
        vec![
            ("pid", h.pid.map_or_else(String::new, |p| p.to_string())),
            (
                "application_name",
                h.application_name.clone().unwrap_or_default(),
            ),
            ("state", h.state.clone().unwrap_or_default()),
            ("gid", h.gid.clone().unwrap_or_default()),
        ]
    }

    fn held(&mut self, h: &PartitionHolder) {
        let labels = Self::labels(h);
        let since = match self.current.take() {
            Some((old, since)) if old == labels => since,
            Some((old, _)) => {
                metrics::gauge!(crate::log::metric_names::ROTATION_HOLDER, &old).set(0.0);
                std::time::Instant::now()
            }
            None => std::time::Instant::now(),
        };
        metrics::gauge!(crate::log::metric_names::ROTATION_HOLDER, &labels)
            .set(h.held_for.as_secs_f64());
        metrics::gauge!(crate::log::metric_names::ROTATION_HELD_SECONDS)
            .set(since.elapsed().as_secs_f64());
        self.current = Some((labels, since));
    }

    fn clear(&mut self) {
        if let Some((old, _)) = self.current.take() {
            metrics::gauge!(crate::log::metric_names::ROTATION_HOLDER, &old).set(0.0);
            metrics::gauge!(crate::log::metric_names::ROTATION_HELD_SECONDS).set(0.0);
        }
    }
}

pub(super) async fn rotate_forever(
    db: Db,
    sql: Arc<Sql>,
    group: String,
    interval: Duration,
    every: Duration,
) {
    let mut wait = every;
    let mut gauges = HeldGauges::default();
    loop {
        tokio::time::sleep(wait).await;
        wait = every;
        // The retry lane is small by design: counting it is cheap.
        match sqlx::query_as::<_, (i64, i64)>(&sql.lane_gauges)
            .bind(&group)
            .fetch_one(&db)
            .await
        {
            Ok((lane, parked)) => {
                metrics::gauge!(crate::log::metric_names::LANE_EVENTS, "group" => group.clone())
                    .set(lane as f64);
                metrics::gauge!(crate::log::metric_names::PARKED_KEYS, "group" => group.clone())
                    .set(parked as f64);
            }
            Err(e) => tracing::debug!(error = %e, "counting the retry lane failed"),
        }
        match attempt(&db, &sql, interval).await {
            Ok(Attempt::Held(reason, holder)) => {
                tracing::info!(%reason, "outbox event-log rotation held back");
                gauges.held(&holder);
                wait = every.min(ROTATE_RETRY_BUSY);
            }
            Ok(Attempt::Busy(reason)) => {
                tracing::debug!(%reason, "outbox event-log rotation postponed");
                gauges.clear();
                wait = every.min(ROTATE_RETRY_BUSY);
            }
            Ok(Attempt::Done(Rotation::Blocked(reason))) => {
                tracing::debug!(%reason, "outbox event-log rotation postponed");
                gauges.clear();
            }
            Ok(Attempt::Done(_)) => gauges.clear(),
            Err(e) => tracing::warn!(error = %e, "outbox event-log rotation failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(
        pid: Option<i32>,
        state: Option<&str>,
        kind: &str,
        modes: &[&str],
    ) -> PartitionHolder {
        PartitionHolder {
            pid,
            application_name: None,
            state: state.map(str::to_owned),
            backend_type: Some(kind.to_owned()),
            since: None,
            gid: pid.is_none().then(|| "g".to_owned()),
            modes: modes.iter().map(|m| (*m).to_owned()).collect(),
            waiting: false,
            held_for: Duration::from_millis(2),
        }
    }

    /// Autovacuum's lock (SHARE UPDATE EXCLUSIVE) is not a writer's: it
    /// never postpones rotation by an interval. A claim running a
    /// statement for milliseconds does not hold rotation back; a session
    /// idle in its transaction, a prepared transaction, a writer and a
    /// holder of a second or more do.
    #[test]
    fn who_holds_rotation_back() {
        let av = holder(
            Some(1),
            Some("active"),
            "autovacuum worker",
            &["ShareUpdateExclusiveLock"],
        );
        assert!(!av.is_writer() && !av.holds_back());
        let claim = holder(
            Some(2),
            Some("active"),
            "client backend",
            &["AccessShareLock"],
        );
        assert!(!claim.is_writer() && !claim.holds_back());
        let ended = holder(
            Some(5),
            Some("idle"),
            "client backend",
            &["AccessShareLock"],
        );
        assert!(!ended.holds_back());
        assert_eq!(holding_back(&[av.clone(), claim.clone(), ended]), None);
        let idle = holder(
            Some(3),
            Some("idle in transaction"),
            "client backend",
            &["AccessShareLock"],
        );
        assert!(!idle.is_writer() && idle.holds_back());
        let prepared = holder(None, None, "", &["AccessShareLock"]);
        assert!(prepared.is_prepared() && prepared.holds_back());
        assert!(prepared.to_string().contains("prepared transaction 'g'"));
        let writer = holder(
            Some(4),
            Some("active"),
            "client backend",
            &["RowExclusiveLock"],
        );
        assert!(writer.is_writer() && writer.holds_back());
        let mut long = claim.clone();
        long.held_for = HOLDER_GRACE;
        assert!(long.holds_back());
        // The writer first, whatever the order.
        assert_eq!(
            holding_back(&[idle.clone(), writer.clone()]).map(|h| h.pid),
            Some(Some(4))
        );
    }
}
