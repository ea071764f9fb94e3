//! [`PgOutbox::commit_with`]: the event's INSERT and the COMMIT in one
//! round trip.
//!
//! The INSERT is written with literal values ([`super::literal`]) and sent
//! with the COMMIT as ONE simple query: `INSERT ...; COMMIT AND CHAIN`.
//! PostgreSQL runs the statements of one simple query in order and skips
//! the rest after an error, so a refused INSERT never reaches the COMMIT.
//!
//! Why `COMMIT AND CHAIN` and not `COMMIT`: the sqlx [`Transaction`] this
//! takes still counts itself open (sqlx has no way to say "ended by a raw
//! statement"), and dropping it queues a `ROLLBACK` that goes out with the
//! connection's next message (the pool's release check, a `Sync` sqlx sends
//! for every returned connection, or the next statement on a bare
//! connection). After a plain `COMMIT` that `ROLLBACK` finds no transaction
//! and PostgreSQL answers WARNING 25P01, logged by sqlx at WARN and by the
//! server, once per call. `AND CHAIN` opens an empty transaction (no
//! snapshot, no transaction id, no lock) for that `ROLLBACK` to end: no
//! warning and no round trip of its own.
//!
//! [`PgOutbox::commit_with`]: crate::PgOutbox::commit_with

use super::literal::{self, NulByte};
use super::{due_params, headers_json, EnqueueSql};
use crate::error::EnqueueError;
use futures::TryStreamExt as _;
use outbox_core::{EventField, EventId, NewEvent, ValidationError};
use sqlx::{Either, Executor as _, Postgres, Transaction, TransactionManager as _};

/// How [`EnqueueSql::commit_with`]'s simple query ended.
enum Outcome {
    /// Both statements completed: committed.
    Committed,
    /// The server refused the INSERT: nothing ran after it; the transaction
    /// is aborted (still open).
    InsertFailed(sqlx::Error),
    /// The server refused the COMMIT (a deferred constraint, a
    /// serialization failure): the transaction was rolled back and ended.
    CommitFailed(sqlx::Error),
    /// The connection failed before the COMMIT's answer: the transaction
    /// may or may not have committed.
    Unknown(sqlx::Error),
}

impl EnqueueSql {
    /// Writes the validated `events` (none: the COMMIT alone) and commits
    /// `tx` in one round trip, notifying `channel` when given. On every
    /// error `tx` has ended rolled back, except [`EnqueueError::CommitUnknown`].
    pub(crate) async fn commit_with(
        &self,
        mut tx: Transaction<'_, Postgres>,
        events: Vec<NewEvent>,
        channel: Option<&str>,
    ) -> Result<Vec<EventId>, EnqueueError> {
        let depth = <Postgres as sqlx::Database>::TransactionManager::get_transaction_depth(&tx);
        if depth != 1 {
            // A savepoint: COMMIT would end the transaction around it.
            // Dropping `tx` rolls back to the savepoint.
            return Err(EnqueueError::NotTopLevel { depth });
        }
        let (sql, ids) = match self.literal_statement(events, channel) {
            Ok(built) => built,
            Err(e) => {
                end_rolled_back(tx, false).await;
                return Err(e);
            }
        };
        match run(&mut tx, &sql).await {
            Outcome::Committed => {
                // Dropping `tx` queues the ROLLBACK that ends the chained,
                // empty transaction (the module docs say why).
                drop(tx);
                Ok(ids)
            }
            Outcome::InsertFailed(e) => {
                end_rolled_back(tx, false).await;
                Err(EnqueueError::Database(e))
            }
            Outcome::CommitFailed(e) => {
                end_rolled_back(tx, true).await;
                Err(EnqueueError::Database(e))
            }
            Outcome::Unknown(source) => {
                tracing::warn!(
                    events = ids.len(),
                    first_event_id = ids.first().map(|id| id.to_string()),
                    error = %crate::error::Cause(&source),
                    "the connection failed after the COMMIT was sent: its outcome is unknown"
                );
                Err(EnqueueError::CommitUnknown { ids, source })
            }
        }
    }

    /// `INSERT ... VALUES (literals)...; COMMIT AND CHAIN` (wrapped in a
    /// `pg_notify` when `channel` is given) and the events' ids in order.
    fn literal_statement(
        &self,
        events: Vec<NewEvent>,
        channel: Option<&str>,
    ) -> Result<(String, Vec<EventId>), EnqueueError> {
        let mut ids = Vec::with_capacity(events.len());
        let mut sql = String::new();
        if !events.is_empty() {
            let insert = self.literal_insert(events, &mut ids)?;
            match channel {
                Some(channel) => {
                    sql.push_str("WITH ins AS (");
                    sql.push_str(&insert);
                    sql.push_str(") SELECT pg_notify(");
                    // The channel is a validated name: no NUL.
                    literal::push_text(&mut sql, channel).map_err(|_| {
                        EnqueueError::Database(sqlx::Error::Protocol(
                            "the outbox's channel name contains NUL".to_owned(),
                        ))
                    })?;
                    sql.push_str(", '')");
                }
                None => sql.push_str(&insert),
            }
            sql.push_str("; ");
        }
        sql.push_str("COMMIT AND CHAIN");
        Ok((sql, ids))
    }

    /// One multi-row INSERT of the validated, non-empty `events` with
    /// literal values, in the given order; their ids pushed to `ids`.
    pub(crate) fn literal_insert(
        &self,
        events: Vec<NewEvent>,
        ids: &mut Vec<EventId>,
    ) -> Result<String, EnqueueError> {
        let delayed = events.iter().any(super::is_delayed);
        let mut sql = format!(
            "INSERT INTO {} ({}{}{}) VALUES ",
            self.target,
            super::COLUMNS,
            if delayed { ", " } else { "" },
            if delayed { self.due_column } else { "" },
        );
        for (i, event) in events.into_iter().enumerate() {
            if i > 0 {
                sql.push_str(", ");
            }
            push_row(&mut sql, event, delayed, ids)?;
        }
        Ok(sql)
    }
}

/// Appends one event's `(..)` row (with its due time when the statement
/// has the column: `DEFAULT` for an undelayed event).
fn push_row(
    sql: &mut String,
    event: NewEvent,
    due_column: bool,
    ids: &mut Vec<EventId>,
) -> Result<(), EnqueueError> {
    let id = event.id();
    let due = due_params(&event)?;
    let key_hash = i64::from(event.key_hash());
    let nul = |field: EventField| {
        move |e: NulByte| EnqueueError::Invalid {
            id,
            source: ValidationError::ControlCharacter {
                field,
                code: 0,
                at: e.at,
            },
        }
    };
    let parts = event.into_parts();
    sql.push('(');
    literal::push_uuid(sql, parts.id.as_uuid());
    sql.push_str(", ");
    literal::push_opt_text(sql, parts.key.as_deref()).map_err(nul(EventField::Key))?;
    sql.push_str(", ");
    literal::push_i64(sql, key_hash);
    sql.push_str(", ");
    literal::push_text(sql, &parts.event_type).map_err(nul(EventField::EventType))?;
    sql.push_str(", ");
    literal::push_text(sql, &parts.topic).map_err(nul(EventField::Topic))?;
    sql.push_str(", ");
    literal::push_bytea(sql, &parts.payload);
    sql.push_str(", ");
    for (name, value) in &parts.headers {
        // Validation refuses these first; the JSON below would carry a NUL
        // as `\u0000`, which jsonb refuses.
        if let Some(at) = name.find('\0') {
            return Err(
                nul(EventField::HeaderName(name.escape_debug().to_string()))(NulByte { at }),
            );
        }
        if let Some(at) = value.find('\0') {
            return Err(nul(EventField::HeaderValue(name.clone()))(NulByte { at }));
        }
    }
    literal::push_jsonb(sql, &headers_json(&parts.headers))
        .map_err(nul(EventField::HeaderValue(String::new())))?;
    if due_column {
        sql.push_str(", ");
        match due {
            None => sql.push_str("DEFAULT"),
            Some((Some(at), _)) => literal::push_timestamptz(sql, at),
            Some((None, after_us)) => {
                sql.push_str("now() + ");
                literal::push_i64(sql, after_us.unwrap_or(0));
                sql.push_str(" * interval '1 microsecond'");
            }
        }
    }
    sql.push(')');
    ids.push(id);
    Ok(())
}

/// Sends `sql` (the INSERT and the COMMIT) and reads how far it went: each
/// completed statement yields one result, rows (a `pg_notify`) in between.
async fn run(tx: &mut Transaction<'_, Postgres>, sql: &str) -> Outcome {
    let statements = if sql.starts_with("COMMIT") { 1 } else { 2 };
    let mut completed = 0usize;
    // The executor's own method (not `RawSql::fetch_many`, generic over
    // the executor): the future stays `Send` for any lifetime.
    let conn: &mut sqlx::PgConnection = tx;
    let mut results = conn.fetch_many(sqlx::raw_sql(sql));
    loop {
        match results.try_next().await {
            Ok(Some(Either::Left(_))) => completed += 1,
            Ok(Some(Either::Right(_))) => {}
            Ok(None) if completed >= statements => return Outcome::Committed,
            Ok(None) => {
                return Outcome::Unknown(sqlx::Error::Protocol(format!(
                    "{completed} of {statements} statements answered"
                )))
            }
            // The COMMIT's answer arrived: committed, whatever came after.
            Err(_) if completed >= statements => return Outcome::Committed,
            // The last statement, the COMMIT, was refused.
            Err(e @ sqlx::Error::Database(_)) if completed + 1 == statements => {
                return Outcome::CommitFailed(e)
            }
            Err(e @ sqlx::Error::Database(_)) => return Outcome::InsertFailed(e),
            Err(e) => return Outcome::Unknown(e),
        }
    }
}

/// Ends `tx` rolled back on an error path (a round trip there is fine).
/// After a refused COMMIT the server has already ended the transaction
/// while sqlx still counts it open: a `BEGIN` first gives the `ROLLBACK`
/// a transaction to end (no WARNING 25P01). Errors are ignored: a broken
/// connection is closed by the pool, and the server rolls back.
async fn end_rolled_back(mut tx: Transaction<'_, Postgres>, server_ended: bool) {
    let conn: &mut sqlx::PgConnection = &mut tx;
    if server_ended && conn.execute(sqlx::raw_sql("BEGIN")).await.is_err() {
        return;
    }
    let _ = tx.rollback().await;
}
