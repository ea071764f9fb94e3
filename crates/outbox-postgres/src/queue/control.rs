//! Pause and resume ([`ControlStore`](outbox_core::ControlStore)) of the queue table: one row in
//! `<table>_control` (migration 3) for its one group,
//! [`DEFAULT_GROUP`](outbox_core::DEFAULT_GROUP).

use super::PgStore;
use crate::control::{control_store, ControlSql};

impl PgStore {
    fn control_sql(&self) -> ControlSql {
        ControlSql::new(&self.outbox().names.render("{{control}}"), true)
    }
}

control_store!(
    /// The queue table's one group,
    /// [`DEFAULT_GROUP`](outbox_core::DEFAULT_GROUP); other names are
    /// refused with
    /// [`StoreError::UnknownGroup`](crate::error::StoreError::UnknownGroup).
    PgStore
);
