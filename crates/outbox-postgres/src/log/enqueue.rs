//! The event log's names as the store holds them. Producers enqueue with
//! [`PgOutbox`](crate::PgOutbox), the one enqueue handle of both modes.

use super::names::LogNames;
use crate::Ident;
use std::sync::Arc;

/// The names of one event-log outbox (`schema`.`<table>_log...`), shared by
/// the store's parts.
#[derive(Clone, Debug)]
pub(crate) struct PgLog {
    pub(crate) names: Arc<LogNames>,
}

impl PgLog {
    pub(crate) fn from_names(names: LogNames) -> Self {
        Self {
            names: Arc::new(names),
        }
    }

    /// The schema.
    pub(crate) fn schema(&self) -> &Ident {
        &self.names.schema
    }

    /// The outbox table name the log's objects are named after.
    pub(crate) fn table(&self) -> &Ident {
        &self.names.table
    }
}
