//! Configuration of [`PgLogStore`](super::PgLogStore).

use crate::ident::Ident;
use crate::options::{redact_url, DEFAULT_SCHEMA, DEFAULT_TABLE};
use outbox_core::{DeadHeadPolicy, PoolSettings, DEFAULT_GROUP};
use std::fmt;
use std::time::Duration;
/// Default [`PgLogOptions::with_rotation_interval`].
pub const DEFAULT_ROTATION_INTERVAL: Duration = Duration::from_secs(60);

/// Default [`PgLogOptions::with_rebalance_interval`].
pub const DEFAULT_REBALANCE_INTERVAL: Duration = Duration::from_millis(500);

/// How long a relay's announcement in its relay group lasts without
/// renewal, at least (see [`LeaseTimers::alive_for`]).
const MIN_ALIVE: Duration = Duration::from_secs(2);

/// The timers that one cursor lease length drives, in one place. A relay
/// asks for a lease of `lease` with every claim
/// ([`ClaimRequest::lease`](outbox_core::ClaimRequest::lease)); the store
/// derives four timers from it, each a fraction or a multiple chosen so
/// that the relay's own deadline (the claim's send time plus `lease`, see
/// `outbox-worker`'s lease tracking) is never reached by the store first:
///
/// | timer | value | why |
/// | --- | --- | --- |
/// | [`renew_after`](Self::renew_after) | `lease / 2` | a claim renews its cursor lease once half of it has passed: one UPDATE at most per half lease, not per claim, with half a lease to spare |
/// | [`idle_renew_after`](Self::idle_renew_after) | `lease / 3` | a relay group's rebalance (every rebalance interval) renews the sets no claim visited lately, early enough that two missed rebalances do not lose them |
/// | [`abandon_after`](Self::abandon_after) | `lease + lease / 4` | a batch neither settled nor renewed by then was given up by the relay (its settle failed until its own deadline): its events are read again; a quarter lease to spare past the relay's deadline |
/// | [`alive_for`](Self::alive_for) | `max(lease, 2 s, 4 × rebalance interval)` | a relay's announcement in its relay group: it outlives the relay's leases and a few rebalances, so a relay is not counted out between two of its rebalances |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LeaseTimers {
    lease: Duration,
}

impl LeaseTimers {
    /// The timers of a cursor lease of length `lease`.
    pub(crate) fn new(lease: Duration) -> Self {
        Self { lease }
    }

    /// A claim renews its cursor lease once this much of it has passed.
    pub(crate) fn renew_after(self) -> Duration {
        self.lease / 2
    }

    /// A relay group's rebalance renews a cursor set no claim visited for
    /// this long.
    pub(crate) fn idle_renew_after(self) -> Duration {
        self.lease / 3
    }

    /// A batch claimed or renewed now counts as given up this long from
    /// now when it still holds events.
    pub(crate) fn abandon_after(self) -> Duration {
        self.lease + self.lease / 4
    }

    /// How long a relay's announcement in its relay group lasts, with the
    /// group's rebalance interval `rebalance_every`.
    pub(crate) fn alive_for(self, rebalance_every: Duration) -> Duration {
        self.lease.max(MIN_ALIVE).max(rebalance_every * 4)
    }
}

/// How often the background rotation of a store looks whether rotation is
/// due: a quarter of the rotation interval, between 50 ms and 10 s.
pub(crate) fn rotation_check_every(rotation_interval: Duration) -> Duration {
    (rotation_interval / 4).clamp(Duration::from_millis(50), Duration::from_secs(10))
}

/// Where the cursors of a consumer group that has none yet start (see
/// [`PgLogOptions::with_new_group_start`]). A group that already has
/// cursors keeps its position whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum GroupStart {
    /// At the oldest retained event (the log's origin, or what rotation has
    /// kept): a new group reads the whole retained history. The default.
    #[default]
    Oldest,
    /// At the current snapshot: a new group reads only events committed
    /// after its first cursor was created. All the shards of the layout the
    /// first relay claims with are created at once, at the same snapshot.
    Now,
}

impl GroupStart {
    /// The setting's spelling: `oldest` or `now`.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupStart::Oldest => "oldest",
            GroupStart::Now => "now",
        }
    }
}

impl fmt::Display for GroupStart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for GroupStart {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "oldest" => Ok(GroupStart::Oldest),
            "now" => Ok(GroupStart::Now),
            other => Err(format!("unknown start {other:?}: use `oldest` or `now`")),
        }
    }
}

/// Options of [`PgLogStore`](super::PgLogStore). `Debug` never shows the password.
#[derive(Clone)]
pub struct PgLogOptions {
    pub(crate) url: Option<String>,
    pub(crate) schema: Ident,
    pub(crate) table: Ident,
    pub(crate) group: String,
    pub(crate) dead_head: DeadHeadPolicy,
    pub(crate) new_group_start: GroupStart,
    pub(crate) rotation_interval: Duration,
    pub(crate) rotate_in_background: bool,
    /// Pool size, timeouts, auto-migrate and limits (the builders every
    /// store shares, [`outbox_core::pool_builders!`]).
    pub(crate) pool: PoolSettings,
    pub(crate) idle_progress_every: Duration,
    pub(crate) probe_min: Duration,
    pub(crate) probe_max: Duration,
    pub(crate) durable_progress: bool,
    pub(crate) dynamic_shards: bool,
    pub(crate) rebalance_every: Duration,
}

impl Default for PgLogOptions {
    fn default() -> Self {
        Self {
            url: None,
            schema: Ident::from_static(DEFAULT_SCHEMA),
            table: Ident::from_static(DEFAULT_TABLE),
            group: DEFAULT_GROUP.to_owned(),
            dead_head: DeadHeadPolicy::Continue,
            new_group_start: GroupStart::Oldest,
            rotation_interval: DEFAULT_ROTATION_INTERVAL,
            rotate_in_background: true,
            pool: PoolSettings::new(10, 1),
            idle_progress_every: Duration::from_secs(1),
            probe_min: Duration::from_millis(2),
            probe_max: Duration::from_millis(25),
            durable_progress: false,
            dynamic_shards: false,
            rebalance_every: DEFAULT_REBALANCE_INTERVAL,
        }
    }
}

impl PgLogOptions {
    /// Options for the database at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: Some(url.into()),
            ..Self::default()
        }
    }

    /// The schema of the outbox tables.
    pub fn with_schema(mut self, schema: Ident) -> Self {
        self.schema = schema;
        self
    }

    /// The outbox name: the log is `<table>_log` (partitions `<table>_log_0..2`),
    /// beside `<table>_log_cursors`, `_lane`, `_dead`, `_meta`. At most 45 bytes.
    pub fn with_table(mut self, table: Ident) -> Self {
        self.table = table;
        self
    }

    /// The consumer group: relays of one group share the work (one cursor
    /// per shard); each group gets every event. Default `"default"`. The
    /// name must be a valid [`GroupName`](crate::GroupName) (checked when
    /// the store connects: [`StoreError::InvalidGroup`](crate::StoreError::InvalidGroup)).
    pub fn with_group(mut self, group: impl Into<String>) -> Self {
        self.group = group.into();
        self
    }

    /// Relay groups: a relay that claims [`ShardSpec::ALL`](outbox_core::ShardSpec::ALL)
    /// joins its consumer group's relay group instead of reading one cursor
    /// for every key. The group's keys are split into the outbox's virtual
    /// shards (64 unless changed, see ARCHITECTURE.md); each relay holds the
    /// leases of a fair share of them, takes over the shards of a relay that
    /// died once their leases ran out, gives shards back when a relay joins
    /// (after the batch in flight) and all of its shards when it leaves
    /// ([`Store::leave`](outbox_core::Store::leave)). A relay that claims a
    /// static shard (`i/N`) is not affected. Default off for the library
    /// (one cursor: one relay reads, the others stand by); the
    /// `outbox-relay` binary turns it on unless `--shard` is given.
    pub fn with_dynamic_shards(mut self, yes: bool) -> Self {
        self.dynamic_shards = yes;
        self
    }

    /// How often a relay of a relay group renews its membership and checks
    /// its fair share (joins, deaths, departures are acted on within this,
    /// plus the lease timeout for a death). Default 500 ms.
    pub fn with_rebalance_interval(mut self, every: Duration) -> Self {
        self.rebalance_every = every.max(Duration::from_millis(10));
        self
    }

    /// Where the group's cursors start when the group has none yet (a group
    /// created later, or dropped and created again): [`GroupStart::Oldest`]
    /// (default) or [`GroupStart::Now`]. Ignored once the group has cursors.
    pub fn with_new_group_start(mut self, start: GroupStart) -> Self {
        self.new_group_start = start;
        self
    }

    /// What happens to a key after its head event was dead-lettered
    /// (default [`DeadHeadPolicy::Continue`]).
    pub fn with_dead_head_policy(mut self, policy: DeadHeadPolicy) -> Self {
        self.dead_head = policy;
        self
    }

    /// How long a partition stays current before the next rotation (which
    /// truncates the oldest one once every cursor has passed it). Delivered
    /// events stay readable for about twice this long. Default 60 s.
    pub fn with_rotation_interval(mut self, every: Duration) -> Self {
        self.rotation_interval = every;
        self
    }

    /// Whether this store tries to rotate in the background (every
    /// `rotation_interval / 4`, at least every 10 s). Default on; any number
    /// of stores may do it at once. Off: call [`PgLogStore::rotate`](super::PgLogStore::rotate).
    pub fn with_background_rotation(mut self, yes: bool) -> Self {
        self.rotate_in_background = yes;
        self
    }

    /// How often an idle cursor records that it has caught up (so rotation
    /// can proceed while a shard receives no events). Default 1 s.
    pub fn with_idle_progress_every(mut self, every: Duration) -> Self {
        self.idle_progress_every = every;
        self
    }

    /// Bounds of the adaptive wake-up probe of [`Store::wakeup`](outbox_core::Store::wakeup):
    /// `min` after activity, doubling up to `max` while idle. Defaults 2 ms and 25 ms:
    /// the first event after a quiet spell waits at most about `max` (plus a
    /// claim); an idle relay pays `1 / max` probes a second (a
    /// `pg_current_snapshot()`, no table access), and a claim for each probe
    /// that sees another transaction end.
    pub fn with_probe_interval(mut self, min: Duration, max: Duration) -> Self {
        self.probe_min = min.max(Duration::from_micros(100));
        self.probe_max = max.max(self.probe_min);
        self
    }

    /// Whether settles wait for their commit to be flushed to disk. Off by
    /// default: settles (and the lane and dead-letter writes of a claim)
    /// commit with `synchronous_commit = off`, saving a disk flush per
    /// batch; a crash of the *database* may then forget the last few
    /// milliseconds of progress, which redelivers those events (each
    /// carries its id for deduplication). Nothing is lost either way: the
    /// events themselves are written by the producers' own transactions.
    pub fn with_durable_progress(mut self, yes: bool) -> Self {
        self.durable_progress = yes;
        self
    }

    /// The schema.
    pub fn schema(&self) -> &Ident {
        &self.schema
    }

    /// The table.
    pub fn table(&self) -> &Ident {
        &self.table
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// Where a new group's cursors start.
    pub fn new_group_start(&self) -> GroupStart {
        self.new_group_start
    }
}

outbox_core::pool_builders!(PgLogOptions, pool: max_connections, acquire_timeout, connect_timeout, auto_migrate, limits, pooler);

impl fmt::Debug for PgLogOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgLogOptions")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("group", &self.group)
            .field("dead_head", &self.dead_head)
            .field("new_group_start", &self.new_group_start)
            .field("rotation_interval", &self.rotation_interval)
            .field("rotate_in_background", &self.rotate_in_background)
            .field("pool", &self.pool)
            .field("idle_progress_every", &self.idle_progress_every)
            .field("probe_min", &self.probe_min)
            .field("probe_max", &self.probe_max)
            .field("durable_progress", &self.durable_progress)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_lease_length_drives_four_timers() {
        let t = LeaseTimers::new(Duration::from_secs(60));
        assert_eq!(t.renew_after(), Duration::from_secs(30));
        assert_eq!(t.idle_renew_after(), Duration::from_secs(20));
        assert_eq!(t.abandon_after(), Duration::from_secs(75));
        // The announcement outlives the lease, 2 s and four rebalances.
        assert_eq!(
            t.alive_for(Duration::from_millis(500)),
            Duration::from_secs(60)
        );
        let short = LeaseTimers::new(Duration::from_millis(300));
        assert_eq!(
            short.alive_for(Duration::from_millis(100)),
            Duration::from_secs(2)
        );
        assert_eq!(
            short.alive_for(Duration::from_secs(1)),
            Duration::from_secs(4)
        );
    }

    #[test]
    fn rotation_is_checked_four_times_an_interval_within_bounds() {
        assert_eq!(
            rotation_check_every(Duration::from_secs(60)),
            Duration::from_secs(10)
        );
        assert_eq!(
            rotation_check_every(Duration::from_secs(8)),
            Duration::from_secs(2)
        );
        assert_eq!(
            rotation_check_every(Duration::ZERO),
            Duration::from_millis(50)
        );
    }
}
