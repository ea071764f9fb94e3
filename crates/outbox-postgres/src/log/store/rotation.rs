//! Rotation: when the current partition is older than the rotation
//! interval, the oldest one is truncated and becomes current, once every
//! cursor of every group has passed all of its rows and no transaction
//! holds it (see the [module docs](crate::log)). Runs in the background of
//! a store, or on demand ([`PgLogStore::rotate`](super::PgLogStore::rotate)).

use super::rows::micros;
use crate::log::names::PARTITIONS;
use crate::log::sql::Sql;
use crate::StoreError;
use sqlx::{Acquire, PgPool, Row};
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

/// One rotation attempt (see [`PgLogStore::rotate`](super::PgLogStore::rotate)).
pub(super) async fn rotate_once(
    pool: &PgPool,
    sql: &Sql,
    interval: Duration,
) -> Result<Rotation, StoreError> {
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    let due = match sqlx::query(&sql.rotate_due)
        .bind(micros(interval)?)
        .fetch_one(&mut *tx)
        .await
    {
        Ok(row) => row,
        Err(e) if lock_busy(&e) => {
            return Ok(Rotation::Blocked("another rotation is running".into()))
        }
        Err(e) => return Err(e.into()),
    };
    let is_due: bool = due.try_get(0)?;
    let generation: i64 = due.try_get(1)?;
    // The generation is the committed one (the meta row's): a rotation
    // that committed but has not bumped the sequence yet is not undone by
    // truncating its partition again.
    sqlx::query(&sql.rotate_catch_up).execute(&mut *tx).await?;
    if !is_due {
        tx.commit().await?;
        return Ok(Rotation::NotDue);
    }
    let target = usize::try_from((generation + 1).rem_euclid(PARTITIONS as i64)).unwrap_or(0);

    if let Some(reason) = rotate_check(&mut tx, sql, target).await? {
        return Ok(Rotation::Blocked(reason));
    }
    // A transaction that wrote to it and is still open: its rows may not
    // be passed yet (the check above could not see them). Not waited for.
    let writer: bool = sqlx::query_scalar(&sql.rotate_writer[target])
        .fetch_one(&mut *tx)
        .await?;
    if writer {
        return Ok(Rotation::Blocked(format!(
            "partition {target} is in use: a transaction that wrote to it is still open"
        )));
    }
    // Claims and status queries hold ACCESS SHARE on every partition for
    // a few milliseconds each; with several relays claiming back to back
    // there is rarely a moment with none, so a NOWAIT lock starved the
    // rotation. The lock is queued instead: claims that start meanwhile
    // wait behind it for at most ROTATE_LOCK_TIMEOUT (then it gives up).
    sqlx::query(ROTATE_LOCK_TIMEOUT).execute(&mut *tx).await?;
    match sqlx::query(&sql.rotate_lock[target])
        .execute(&mut *tx)
        .await
    {
        Ok(_) => {}
        Err(e) if lock_busy(&e) => {
            return Ok(Rotation::Blocked(format!("partition {target} is in use")))
        }
        Err(e) => return Err(e.into()),
    }
    if let Some(reason) = rotate_check(&mut tx, sql, target).await? {
        return Ok(Rotation::Blocked(reason));
    }
    sqlx::query(&sql.rotate_truncate[target])
        .execute(&mut *tx)
        .await?;
    let (rotations, generation): (i64, i64) =
        sqlx::query_as(&sql.rotate_done).fetch_one(&mut *tx).await?;
    tx.commit().await?;
    // After the commit: producers that see the new generation write into
    // the truncated partition without waiting for this transaction.
    sqlx::query(&sql.rotate_bump)
        .bind(generation)
        .execute(&mut *conn)
        .await?;
    tracing::debug!(
        generation,
        rotations,
        partition = target,
        "rotated the outbox event log"
    );
    metrics::counter!(crate::log::metric_names::ROTATIONS).increment(1);
    Ok(Rotation::Rotated {
        generation,
        rotations,
    })
}

/// Why partition `target` may not be truncated now, if it may not.
async fn rotate_check(
    conn: &mut sqlx::PgConnection,
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

/// How long a rotation's lock waits for the claims (and other readers)
/// holding the partition before it gives up: 500 ms.
const ROTATE_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '500ms'";
/// After a rotation postponed because its lock was busy, the next attempt
/// comes this soon (not a whole check interval later).
const ROTATE_RETRY_BUSY: Duration = Duration::from_secs(1);

fn lock_busy(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

pub(super) async fn rotate_forever(
    pool: PgPool,
    sql: Arc<Sql>,
    group: String,
    interval: Duration,
    every: Duration,
) {
    let mut wait = every;
    loop {
        tokio::time::sleep(wait).await;
        wait = every;
        // The retry lane is small by design: counting it is cheap.
        match sqlx::query_as::<_, (i64, i64)>(&sql.lane_gauges)
            .bind(&group)
            .fetch_one(&pool)
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
        match rotate_once(&pool, &sql, interval).await {
            Ok(Rotation::Blocked(reason)) => {
                tracing::debug!(%reason, "outbox event-log rotation postponed");
                if reason.ends_with("is in use") || reason.starts_with("another rotation") {
                    wait = every.min(ROTATE_RETRY_BUSY);
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "outbox event-log rotation failed"),
        }
    }
}
