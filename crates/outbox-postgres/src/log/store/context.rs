//! [`Ctx`]: what the pieces of the store (claim, settle, lane, leases,
//! status, relay groups) share, handed to each of them explicitly.

use super::cursor::{Cursors, SeqFloors};
use super::guard::Guard;
use super::wake::Wake;
use crate::db::Db;
use crate::log::options::{GroupStart, PgLogOptions};
use crate::log::sql::Sql;
use crate::names::log::LogNames;
use outbox_core::DeadHeadPolicy;
use std::sync::Arc;
use std::time::Duration;

/// The context of one store (shared by its clones): the pool, the names
/// and statements of its outbox, its consumer group and options, and the
/// cursor state of this process.
pub(super) struct Ctx {
    pub(super) db: Db,
    pub(super) names: LogNames,
    pub(super) sql: Arc<Sql>,
    /// The consumer group.
    pub(super) group: String,
    pub(super) dead_head: DeadHeadPolicy,
    pub(super) new_group_start: GroupStart,
    /// How often an idle cursor records that it caught up.
    pub(super) idle_progress_every: Duration,
    /// Settles wait for their commit to be flushed.
    pub(super) durable_progress: bool,
    /// The cursors this process reads and their claims' tokens.
    pub(super) cursors: Cursors,
    /// Seq floors observed by completed claims.
    pub(super) floors: SeqFloors,
    /// The wake-up probe's state (claims reset it).
    pub(super) wake: Wake,
    /// When the schema, sequence and identity fences last passed.
    pub(super) guard: Guard,
}

impl Ctx {
    /// The context of a store of `options` on `db`.
    pub(super) fn new(db: Db, names: LogNames, sql: Arc<Sql>, options: &PgLogOptions) -> Self {
        Ctx {
            db,
            names,
            sql,
            group: options.group.clone(),
            dead_head: options.dead_head,
            new_group_start: options.new_group_start,
            idle_progress_every: options.idle_progress_every,
            durable_progress: options.durable_progress,
            cursors: Cursors::default(),
            floors: SeqFloors::default(),
            wake: Wake::new(options.probe_min, options.probe_max),
            guard: Guard::default(),
        }
    }

    /// The `(group, shard total, shard indexes)` binds of cursor `key`'s rows.
    pub(super) fn cursor_binds(&self, key: &super::cursor::CursorKey) -> (String, i32, Vec<i32>) {
        (
            self.group.clone(),
            i32::try_from(key.total).unwrap_or(i32::MAX),
            key.indexes(),
        )
    }
}
