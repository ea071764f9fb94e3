#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod control;
mod db;
mod dead_filter;
mod descriptor;
mod enqueue;
mod error;
mod follow;
mod group_name;
mod hosts;
mod ident;
mod migrate;
mod mode;
mod names;
mod options;
mod pool;
mod rows;

// The queue-table mode: one row per event, claimed by UPDATE, deleted when
// delivered. Its module docs say how it differs from the event log.
mod queue;

pub use descriptor::{PgBackend, PgLogBackend};
pub use enqueue::{enqueue, enqueue_batch, PgOutbox};
pub use error::{EnqueueError, Identity, MigrateError, Refusal, StoreError};
pub use group_name::{GroupName, InvalidGroupName, MAX_GROUP_NAME_BYTES};
pub use hosts::{PgHosts, TargetSessionAttrs};
pub use ident::Ident;
pub use migrate::log::LOG_MIGRATIONS;
pub use migrate::queue::MIGRATIONS;
pub use mode::PgMode;
pub use options::{DEFAULT_NOTIFY, DEFAULT_SCHEMA, DEFAULT_TABLE};
pub use queue::{PgStore, PgStoreOptions, ShardStats, DEFAULT_VACUUM_EVERY};

// The event-log mode (the default): snapshot-window batches, fenced
// per-shard cursors, rotation by TRUNCATE. Its module docs hold the design.
mod log;
pub use log::{
    CursorInfo, GroupContents, GroupDrop, GroupStart, GroupStatus, Horizon, IdentityCheck,
    InFlight, LeaseHolding, LogInfo, LogStatus, OldTransaction, PartitionHolder, PartitionInfo,
    PgLogOptions, PgLogStore, ReanchorFrom, Reanchored, RelayInfo, RelayLease, Rotation,
    RotationHold, ShardStatus, SlotHold, DEFAULT_REBALANCE_INTERVAL, DEFAULT_ROTATION_INTERVAL,
};

/// Names of the metrics the event-log store emits (through the `metrics`
/// facade; the application or the relay binary installs the exporter).
pub mod metrics {
    pub use crate::log::{
        INCARNATION_CHANGES, LANE_EVENTS, PARKED_KEYS, ROTATIONS, ROTATION_HELD_SECONDS,
        ROTATION_HOLDER, ROTATION_LOCK_TRIES, SHARDS_HELD, SHARDS_QUOTA, SHARD_LAG,
    };
}

/// Re-exported so users name the same sqlx types as this crate.
pub use sqlx;

#[cfg(test)]
mod send_checks {
    //! Compile-time checks that the public futures are `Send` (so they can
    //! be spawned and used from `Store` impls).
    fn is_send<T: Send>(_: T) {}

    #[allow(dead_code)]
    fn futures_are_send(conn: &mut sqlx::PgConnection, pool: sqlx::PgPool) {
        let o = crate::PgOutbox::default();
        is_send(o.migrate(conn));
        is_send(crate::PgStore::from_pool(
            pool,
            crate::PgStoreOptions::default(),
        ));
    }

    #[allow(dead_code)]
    fn enqueue_is_send(conn: &mut sqlx::PgConnection) {
        let e = outbox_core::NewEvent::new("a", "b", vec![]);
        is_send(crate::enqueue(conn, e));
    }

    #[allow(dead_code)]
    fn batch_is_send(conn: &mut sqlx::PgConnection) {
        let e = outbox_core::NewEvent::new("a", "b", vec![]);
        is_send(crate::enqueue_batch(conn, vec![e]));
    }
}
