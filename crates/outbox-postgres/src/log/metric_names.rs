//! The names of the metrics the event-log store records.

/// Counter: rotations of the event log (a partition truncated and reused),
/// counted by the process that rotated.
pub const ROTATIONS: &str = "outbox_log_rotations_total";
/// Counter: times this process found the database to be a new incarnation
/// (crash recovery or a promoted standby) and dropped the positions it held
/// in memory, counted once per cursor.
pub const INCARNATION_CHANGES: &str = "outbox_log_incarnation_changes_total";
/// Gauge, label `group`: events in the retry lane (retrying, released, or
/// parked behind an earlier event of their key). Updated by the background
/// rotation task.
pub const LANE_EVENTS: &str = "outbox_log_lane_events";
/// Gauge, label `group`: keys held back behind an earlier event of theirs in
/// the retry lane. Updated by the background rotation task.
pub const PARKED_KEYS: &str = "outbox_log_parked_keys";
/// Gauge, label `group`: virtual shards whose cursor lease this process's
/// relay holds (relay groups, see [`PgLogOptions::with_dynamic_shards`](super::PgLogOptions::with_dynamic_shards)).
pub const SHARDS_HELD: &str = "outbox_relay_shards_held";
/// Gauge, labels `group`, `shard` (`i/S`): age of the oldest event of that
/// virtual shard in the last batch claimed of it (0 once its set read
/// everything committed). Set by the relay holding the shard.
pub const SHARD_LAG: &str = "outbox_virtual_shard_lag_seconds";
/// Gauge, label `group`: the relay's fair share of the virtual shards.
pub const SHARDS_QUOTA: &str = "outbox_relay_shards_fair_share";
/// Gauge: seconds the due rotation has been held back by one session
/// (the same one since), 0 when nothing holds it back. Set by the process
/// whose background task attempts the rotation.
pub const ROTATION_HELD_SECONDS: &str = "outbox_log_rotation_held_seconds";
/// Gauge, labels `pid`, `application_name`, `state`, `gid` (a prepared
/// transaction's, `pid` empty): how long the session holding the rotation
/// back has held the partition (its transaction's age); set to 0 when it is
/// gone. See [`PgLogStore::rotation_hold`](super::PgLogStore::rotation_hold).
pub const ROTATION_HOLDER: &str = "outbox_log_rotation_holder_seconds";
/// Histogram: tries of the rotation's lock (5 ms each at most) until it
/// was had, per rotation.
pub const ROTATION_LOCK_TRIES: &str = "outbox_log_rotation_lock_tries";
