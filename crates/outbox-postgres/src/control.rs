//! Pause and resume ([`ControlStore`](outbox_core::ControlStore)) on PostgreSQL: one row per consumer
//! group in `<table>_control` (queue mode, migration 3, see
//! `queue/control.rs`) or `<table>_log_control` (event-log mode, migration
//! 4, see `log/control.rs`). Times come from the database's `now()`.

use crate::db::Db;
use crate::error::StoreError;
use chrono::{DateTime, Utc};
use outbox_core::{PauseNote, Paused, DEFAULT_GROUP};
use sqlx::Row;

/// The SQL of one control table, rendered once per call (a relay reads it
/// about once a second).
pub(crate) struct ControlSql {
    read: String,
    pause: String,
    resume: String,
    /// Only [`DEFAULT_GROUP`] exists (queue mode); other names are refused.
    default_only: bool,
}

impl ControlSql {
    /// The statements for the quoted, qualified table `table`; with
    /// `default_only`, a group other than [`DEFAULT_GROUP`] is refused with
    /// [`StoreError::UnknownGroup`].
    pub(crate) fn new(table: &str, default_only: bool) -> Self {
        Self {
            default_only,
            read: format!(
                "SELECT COALESCE(paused_at, updated_at) AS since, paused_by, reason \
                 FROM {table} WHERE grp = $1 AND paused"
            ),
            // A paused group keeps its first pause: 0 rows when it was paused.
            pause: format!(
                "INSERT INTO {table} AS c (grp, paused, paused_at, paused_by, reason, updated_at) \
                 VALUES ($1, true, now(), $2, $3, now()) \
                 ON CONFLICT (grp) DO UPDATE SET paused = true, paused_at = now(), \
                     paused_by = EXCLUDED.paused_by, reason = EXCLUDED.reason, updated_at = now() \
                 WHERE NOT c.paused"
            ),
            resume: format!(
                "UPDATE {table} SET paused = false, paused_at = NULL, paused_by = NULL, \
                     reason = NULL, updated_at = now() \
                 WHERE grp = $1 AND paused"
            ),
        }
    }

    /// The group's pause, if it is paused.
    pub(crate) async fn paused(&self, db: &Db, group: &str) -> Result<Option<Paused>, StoreError> {
        self.check(group)?;
        let row = sqlx::query(&self.read)
            .bind(group)
            .fetch_optional(db)
            .await?;
        row.map(|row| {
            let since: DateTime<Utc> = row.try_get("since")?;
            let mut note = PauseNote::new();
            note.by = row.try_get("paused_by")?;
            note.reason = row.try_get("reason")?;
            Ok(Paused::new(since, note))
        })
        .transpose()
    }

    /// Pauses or resumes; whether the state changed.
    pub(crate) async fn set_paused(
        &self,
        db: &Db,
        group: &str,
        paused: bool,
        note: &PauseNote,
    ) -> Result<bool, StoreError> {
        self.check(group)?;
        let done = if paused {
            sqlx::query(&self.pause)
                .bind(group)
                .bind(note.by.as_deref())
                .bind(note.reason.as_deref())
                .execute(db)
                .await?
        } else {
            sqlx::query(&self.resume).bind(group).execute(db).await?
        };
        Ok(done.rows_affected() > 0)
    }

    /// Refuses a group this outbox does not have.
    fn check(&self, group: &str) -> Result<(), StoreError> {
        if self.default_only && group != DEFAULT_GROUP {
            return Err(StoreError::UnknownGroup(group.to_owned()));
        }
        Ok(())
    }
}

/// [`ControlStore`] for a PostgreSQL store type `$store` (both modes) with
/// `control_sql() -> ControlSql` and `pool()`: the two impls differ only in
/// the type and in what `control_sql` says (table, groups).
macro_rules! control_store {
    ($(#[$doc:meta])* $store:ty) => {
        $(#[$doc])*
        impl outbox_core::ControlStore for $store {
            type Error = $crate::error::StoreError;

            async fn paused(
                &self,
                group: &str,
            ) -> Result<Option<outbox_core::Paused>, $crate::error::StoreError> {
                self.control_sql().paused(self.db(), group).await
            }

            async fn set_paused(
                &self,
                group: &str,
                paused: bool,
                note: &outbox_core::PauseNote,
            ) -> Result<bool, $crate::error::StoreError> {
                self.control_sql()
                    .set_paused(self.db(), group, paused, note)
                    .await
            }
        }
    };
}
pub(crate) use control_store;
