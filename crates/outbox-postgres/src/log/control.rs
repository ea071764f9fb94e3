//! Pause and resume ([`ControlStore`](outbox_core::ControlStore)) of the event log's consumer groups:
//! one row per group in `<table>_log_control` (migration 4). Any group may
//! be paused, also one whose relays have not started yet.

use super::store::PgLogStore;
use crate::control::{control_store, ControlSql};

impl PgLogStore {
    fn control_sql(&self) -> ControlSql {
        ControlSql::new(&self.log().names.render("{{control}}"), false)
    }
}

control_store!(
    /// Every consumer group of the log; this store's relays watch
    /// [`PgLogStore::group`].
    PgLogStore
);
