//! Pause and resume ([`ControlStore`]): one row per consumer group in
//! `<table>_control` (migration 3). A SQLite outbox has one group,
//! [`DEFAULT_GROUP`]. Times come from the database's clock.

use crate::error::StoreError;
use crate::sql::now_ms;
use crate::store::SqliteStore;
use chrono::{DateTime, Utc};
use outbox_core::{ControlStore, PauseNote, Paused, DEFAULT_GROUP};
use sqlx::Row;

/// SQLite has one consumer group, [`DEFAULT_GROUP`].
fn only_default(group: &str) -> Result<(), StoreError> {
    if group == DEFAULT_GROUP {
        Ok(())
    } else {
        Err(StoreError::UnknownGroup(group.to_owned()))
    }
}

/// The one group, [`DEFAULT_GROUP`]; other names are refused with
/// [`StoreError::UnknownGroup`].
impl ControlStore for SqliteStore {
    type Error = StoreError;

    async fn paused(&self, group: &str) -> Result<Option<Paused>, StoreError> {
        only_default(group)?;
        let sql = self.outbox().names.render(
            "SELECT COALESCE(paused_at, updated_at) AS since, paused_by, reason \
             FROM {{events_control}} WHERE grp = ? AND paused",
        );
        let Some(row) = sqlx::query(&sql)
            .bind(group)
            .fetch_optional(self.pool())
            .await?
        else {
            return Ok(None);
        };
        let ms: i64 = row.try_get("since")?;
        let since = DateTime::<Utc>::from_timestamp_millis(ms).ok_or(StoreError::Clock(ms))?;
        let mut note = PauseNote::new();
        note.by = row.try_get("paused_by")?;
        note.reason = row.try_get("reason")?;
        Ok(Some(Paused::new(since, note)))
    }

    async fn set_paused(
        &self,
        group: &str,
        paused: bool,
        note: &PauseNote,
    ) -> Result<bool, StoreError> {
        only_default(group)?;
        let names = &self.outbox().names;
        let done = if paused {
            // A paused group keeps its first pause: 0 rows when it was paused.
            let sql = names.render(concat!(
                "INSERT INTO {{events_control}} (grp, paused, paused_at, paused_by, reason, updated_at) \
                 VALUES (?, 1, ",
                now_ms!(),
                ", ?, ?, ",
                now_ms!(),
                ") ON CONFLICT (grp) DO UPDATE SET paused = 1, paused_at = excluded.paused_at, \
                     paused_by = excluded.paused_by, reason = excluded.reason, \
                     updated_at = excluded.updated_at \
                 WHERE NOT paused"
            ));
            sqlx::query(&sql)
                .bind(group)
                .bind(note.by.as_deref())
                .bind(note.reason.as_deref())
                .execute(self.pool())
                .await?
        } else {
            let sql = names.render(concat!(
                "UPDATE {{events_control}} SET paused = 0, paused_at = NULL, paused_by = NULL, \
                     reason = NULL, updated_at = ",
                now_ms!(),
                " WHERE grp = ? AND paused"
            ));
            sqlx::query(&sql).bind(group).execute(self.pool()).await?
        };
        Ok(done.rows_affected() > 0)
    }
}
