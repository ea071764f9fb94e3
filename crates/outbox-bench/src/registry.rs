//! The scenario registry: every scenario's name and what it measures, and
//! the sizes of a smoke, quick and full run.
//!
//! This file is the bench's fingerprint: the results section of
//! BENCHMARKS.md carries [`fingerprint`] of this file's text, and
//! `cargo xtask tidy` recomputes it from this file (xtask/src/bench.rs), so a
//! change of the scenario set or of a size makes the written numbers stale
//! until `cargo xtask bench` is run again. Comments and blank lines do not
//! count.

use std::time::Duration;

/// This file's text, the input of [`fingerprint`].
const SOURCE: &str = include_str!("registry.rs");

/// FNV-1a (64 bits) of this file's lines, each trimmed, blank lines and
/// `//` comment lines left out, as hex. xtask's tidy computes the same.
pub(crate) fn fingerprint() -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for line in SOURCE.lines().map(str::trim) {
        if line.is_empty() || line.starts_with("//") {
            continue;
        }
        for b in line.bytes().chain(std::iter::once(b'\n')) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// The scenarios, in run order, with what each measures.
pub(crate) const SCENARIOS: &[(&str, &str)] = &[
    (
        "drain",
        "backlog -> relay -> no-op handler vs the store's claim+settle ceiling: event log (default), queue table and SQLite for comparison",
    ),
    (
        "brokers",
        "backlog -> relay -> NATS / RabbitMQ / Kafka vs min(store ceiling, broker's publish-with-ack ceiling): event log (default), queue table for comparison",
    ),
    (
        "naive",
        "the naive one-at-a-time outbox (labelled) vs the relay on the event log (default) and on the queue table",
    ),
    (
        "latency",
        "commit -> handler latency at 1k and 10k events/s offered: event log (NOTIFY off) and queue table (LISTEN/NOTIFY)",
    ),
    (
        "producer",
        "8 concurrent business transactions: without / with the outbox insert (queue table NOTIFY off / on, event log) / with the event log's commit_with (INSERT + COMMIT in one round trip), interleaved in slices",
    ),
    (
        "backlog",
        "drain rate at a 10k backlog vs the big backlog: queue table and event log; the event log's drain vs its keyset read ceiling (the same rows read in batches of 1,000)",
    ),
    (
        "repeatable-read",
        "drain with a REPEATABLE READ transaction held open vs a clean drain: event log (default), queue table for comparison",
    ),
    (
        "scale-out",
        "1, 2 and 4 relays with static shards i/n: event log (default, one store per relay), queue table for comparison",
    ),
    (
        "event-log",
        "event log (PgLogStore) vs queue table (PgStore): claim+settle and relay drains, clean and with a REPEATABLE READ snapshot held",
    ),
    (
        "log-held-snapshot",
        "event log: big backlog drained clean vs with a REPEATABLE READ snapshot held, then rotation: dead tuples and size of the partitions before / after",
    ),
    (
        "sustained",
        "event log: 5k events/s offered for 10 min (quick 60 s), snapshot held in the middle: p50/p99 commit -> handler and log size per window",
    ),
    (
        "rotation-under-load",
        "event log: 4 relays drain a backlog while producers commit, background rotation every 5 s (full 20 s): lateness of each rotation, the log's size",
    ),
    (
        "log-scale-out",
        "event log: 1, 2, 4 relays with static shards i/n vs a relay group (dynamic shards), and the group's time to settle",
    ),
    (
        "rebalance",
        "event log relay group under a 2k events/s producer: join a 3rd relay, kill one, stop one gracefully (ms until the shards are shared)",
    ),
    (
        "fan-out",
        "event log: one backlog drained by 1 consumer group vs 2 groups at once, and the producer's cost with 1 vs 2 groups",
    ),
    (
        "blocked-keys",
        "queue table: claims when the heads of many keys are in retry backoff or leased (the parking of blocked keys) vs a claim with none blocked",
    ),
    (
        "inbox",
        "the consumer half, per broker: the inbox on PostgreSQL with a one-row handler vs the raw consume ceiling (source recv + ack), and the dedup record's cost per message",
    ),
    (
        "pooler",
        "event log through PgBouncer (transaction mode) vs direct: relay -> no-op handler drain and commit -> handler latency at 1k events/s, ratio / p99 difference to direct",
    ),
    (
        "tenants",
        "one relay process over 1, 4 and 16 databases (a named relay per database, one shared sink): total drain of a split backlog, and per-database commit -> handler p99 of fresh events while one database drains the big backlog",
    ),
];

/// Sizes and durations of a quick or full run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    /// The big backlog (drains, brokers, backlog scaling).
    pub(crate) backlog: u64,
    /// The small backlog of the scaling comparison.
    pub(crate) small_backlog: u64,
    /// Events per broker ceiling measurement.
    pub(crate) ceiling_events: u64,
    /// Backlog of the naive baseline and how long it runs.
    pub(crate) naive_backlog: u64,
    pub(crate) naive: Duration,
    /// Duration of each offered-load latency run.
    pub(crate) latency: Duration,
    /// Duration of each producer-overhead variant, and rounds of the three.
    pub(crate) producer: Duration,
    pub(crate) producer_rounds: u32,
    /// Backlog of the REPEATABLE READ scenarios.
    pub(crate) side_backlog: u64,
    /// Backlog of `log-scale-out` and `fan-out`: long enough that a relay
    /// group's one-off start-up (reported apart as `fair_share_after_ms`)
    /// does not decide the steady rate compared, and that a drain lasts
    /// seconds, not a fraction of one.
    pub(crate) group_backlog: u64,
    /// Rounds of the event-log comparison (the median is reported).
    pub(crate) log_rounds: u32,
    /// Time cap of any single drain.
    pub(crate) cap: Duration,
    /// Rounds of the event-log scale-out comparison (the median is
    /// reported), and repetitions of each rebalancing measurement.
    pub(crate) group_rounds: u32,
    pub(crate) rebalance_reps: u32,
    /// Events each producer-cost measurement of the fan-out enqueues.
    pub(crate) fanout_producer_events: u64,
    /// `sustained`: how long the producers offer load, the report window,
    /// and when (from the start) the REPEATABLE READ snapshot is held.
    pub(crate) sustained: Duration,
    pub(crate) sustained_window: Duration,
    pub(crate) sustained_hold: (Duration, Duration),
    /// `rotation-under-load`: the preloaded backlog, the events/s the
    /// producers offer, how long they do, and the rotation interval of the
    /// relays' stores.
    pub(crate) rotation_backlog: u64,
    pub(crate) rotation_rate: u64,
    pub(crate) rotation_run: Duration,
    pub(crate) rotation_interval: Duration,
    /// `blocked-keys`: the backlog whose keys' heads are blocked.
    pub(crate) blocked_backlog: u64,
    /// `inbox`: messages prefilled per broker (each consumer reads them
    /// all), and rounds of the inbox / handler-only pair (medians).
    pub(crate) inbox_events: u64,
    pub(crate) inbox_rounds: u32,
}

impl Sizes {
    /// The sizes of a smoke, quick or full run.
    pub(crate) fn new(quick: bool, smoke: bool) -> Self {
        if smoke {
            Self {
                backlog: 5_000,
                small_backlog: 2_000,
                ceiling_events: 2_000,
                naive_backlog: 1_000,
                naive: Duration::from_secs(1),
                latency: Duration::from_secs(2),
                producer: Duration::from_secs(1),
                producer_rounds: 1,
                side_backlog: 3_000,
                group_backlog: 3_000,
                log_rounds: 1,
                cap: Duration::from_secs(60),
                group_rounds: 1,
                rebalance_reps: 1,
                fanout_producer_events: 500,
                sustained: Duration::from_secs(4),
                sustained_window: Duration::from_secs(1),
                sustained_hold: (Duration::from_secs(1), Duration::from_secs(3)),
                rotation_backlog: 3_000,
                rotation_rate: 500,
                rotation_run: Duration::from_secs(6),
                rotation_interval: Duration::from_secs(1),
                blocked_backlog: 5_000,
                inbox_events: 2_000,
                inbox_rounds: 1,
            }
        } else if quick {
            Self {
                backlog: 100_000,
                small_backlog: 10_000,
                ceiling_events: 50_000,
                naive_backlog: 20_000,
                naive: Duration::from_secs(8),
                latency: Duration::from_secs(10),
                producer: Duration::from_secs(5),
                producer_rounds: 1,
                side_backlog: 50_000,
                group_backlog: 200_000,
                log_rounds: 3,
                cap: Duration::from_secs(90),
                group_rounds: 1,
                rebalance_reps: 3,
                fanout_producer_events: 4_000,
                sustained: Duration::from_secs(60),
                sustained_window: Duration::from_secs(10),
                sustained_hold: (Duration::from_secs(20), Duration::from_secs(40)),
                rotation_backlog: 100_000,
                rotation_rate: 2_000,
                rotation_run: Duration::from_secs(40),
                rotation_interval: Duration::from_secs(5),
                blocked_backlog: 20_000,
                inbox_events: 50_000,
                inbox_rounds: 1,
            }
        } else {
            Self {
                backlog: 1_000_000,
                small_backlog: 10_000,
                ceiling_events: 200_000,
                naive_backlog: 40_000,
                naive: Duration::from_secs(20),
                latency: Duration::from_secs(30),
                producer: Duration::from_secs(10),
                producer_rounds: 2,
                side_backlog: 200_000,
                group_backlog: 1_000_000,
                log_rounds: 3,
                cap: Duration::from_secs(600),
                group_rounds: 3,
                rebalance_reps: 5,
                fanout_producer_events: 20_000,
                sustained: Duration::from_secs(600),
                sustained_window: Duration::from_secs(60),
                sustained_hold: (Duration::from_secs(180), Duration::from_secs(480)),
                rotation_backlog: 1_000_000,
                rotation_rate: 5_000,
                rotation_run: Duration::from_secs(180),
                rotation_interval: Duration::from_secs(20),
                blocked_backlog: 100_000,
                inbox_events: 200_000,
                inbox_rounds: 3,
            }
        }
    }
}
