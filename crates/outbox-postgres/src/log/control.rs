//! Pause and resume ([`ControlStore`]) of the event log's consumer groups:
//! one row per group in `<table>_log_control` (migration 4). Any group may
//! be paused, also one whose relays have not started yet.

use super::PgLogStore;
use crate::control::ControlSql;
use crate::StoreError;
use outbox_core::{ControlStore, PauseNote, Paused};

impl PgLogStore {
    fn control_sql(&self) -> ControlSql {
        ControlSql::new(&self.log().names.render("{{control}}"))
    }
}

/// Every consumer group of the log; this store's relays watch
/// [`PgLogStore::group`].
impl ControlStore for PgLogStore {
    type Error = StoreError;

    async fn paused(&self, group: &str) -> Result<Option<Paused>, StoreError> {
        self.control_sql().paused(self.pool(), group).await
    }

    async fn set_paused(
        &self,
        group: &str,
        paused: bool,
        note: &PauseNote,
    ) -> Result<bool, StoreError> {
        self.control_sql()
            .set_paused(self.pool(), group, paused, note)
            .await
    }
}
