//! Metric names the relay records through the [`metrics`] facade.
//!
//! Install any `metrics` recorder (Prometheus exporter, StatsD, ...) in the
//! process; without one the calls cost next to nothing. Call
//! [`describe_metrics`] once after installing it to publish units and help text.
//!
//! A relay built [`with_store_name`](crate::Relay::with_store_name) adds the
//! label `store="<name>"` to every metric below (one process relaying from
//! several databases); a relay without a name records them without it.
//! The relay registers its handles when its run starts, with the recorder
//! installed then: install the recorder before running the relay.

/// Counter: events delivered and marked done.
pub const EVENTS_DELIVERED: &str = "outbox_events_delivered_total";
/// Counter, label `code`: failed deliveries scheduled for another attempt.
pub const EVENTS_RETRIED: &str = "outbox_events_retried_total";
/// Counter, label `code`: events moved to the dead letters.
pub const EVENTS_DEAD: &str = "outbox_events_dead_total";
/// Counter: events whose outcome could not be recorded because this relay's
/// lease had expired and another relay re-claimed them (fencing).
pub const LEASE_LOST: &str = "outbox_lease_lost_total";
/// Counter, label `reason`: events given back unattempted (lease cleared,
/// attempt not counted). Reasons: `sink_unavailable` (the sink was down),
/// `not_attempted` (held back by the per-key order layer), `delivery_timeout`,
/// `shutdown`, `missing_outcome` (a sink bug), `lease_renewal` (a prefetched
/// batch whose lease could not be kept), `lease_lost` (the events a claim
/// still held when its delivery was stopped because the rest of its lease
/// was lost; see [`LEASE_LOST_DELIVERIES_STOPPED`]), `lease_expired` (the
/// lease ended by the relay's clock without a renewal; see
/// [`LEASE_EXPIRED_DELIVERIES_STOPPED`]).
pub const EVENTS_RELEASED: &str = "outbox_events_released_total";
/// Counter: events a settlement could not record as asked (the store
/// reported them `rejected`, with a reason logged at WARN).
pub const EVENTS_REJECTED: &str = "outbox_events_rejected_total";
/// Counter, label `op` (`claim`, `settle`, `renew`, `stats`, `control`): store calls that failed.
pub const STORE_ERRORS: &str = "outbox_store_errors_total";
/// Counter: batches whose delivery was cancelled after the delivery timeout.
pub const DELIVERY_TIMEOUTS: &str = "outbox_delivery_timeouts_total";
/// Counter, label `stage`: batches the relay stopped delivering, or never
/// handed to the sink, because a lease renewal found their lease lost
/// (another relay holds the events now and delivers them from the stored
/// position). `stage`: `delivering` (the delivery in flight was stopped:
/// nothing more of the batch went to the sink once the loss was known) or
/// `claimed_ahead` (claimed but not yet handed to the sink: drain mode's
/// batch claimed ahead, or one waiting for the rate limit). The events
/// taken over are counted in [`LEASE_LOST`].
pub const LEASE_LOST_DELIVERIES_STOPPED: &str = "outbox_lease_lost_deliveries_stopped_total";
/// Counter, label `stage` (as [`LEASE_LOST_DELIVERIES_STOPPED`]): batches
/// the relay stopped delivering, or never handed to the sink, because their
/// lease ended by the relay's own clock: no renewal succeeded (the database
/// did not answer) before the lease end the last successful claim or
/// renewal established, less a margin for clock drift. Their events are
/// released (`outbox_events_released_total{reason="lease_expired"}`) when
/// the database answers before the lease ends there; else they come back
/// when it does.
pub const LEASE_EXPIRED_DELIVERIES_STOPPED: &str = "outbox_lease_expired_deliveries_stopped_total";
/// Gauge: the sink's circuit breaker: 0 closed (delivering), 1 half-open
/// (probing with one small batch), 2 open (the sink is unavailable; not
/// claiming).
pub const SINK_STATE: &str = "outbox_sink_state";
/// Counter, label `to` (`closed`, `half_open`, `open`): circuit breaker transitions.
pub const SINK_STATE_TRANSITIONS: &str = "outbox_sink_state_transitions_total";
/// Histogram, seconds: per event, from the claim to its recorded outcome.
pub const EVENT_PROCESS_SECONDS: &str = "outbox_event_process_seconds";
/// Gauge, seconds: age of the oldest event in the last batch (database clock).
pub const LAG_SECONDS: &str = "outbox_lag_seconds";
/// Gauge, seconds, label `shard` (`index/total`, `all` when unsharded): age
/// of the oldest event in this relay's last batch of that shard.
pub const SHARD_LAG_SECONDS: &str = "outbox_shard_lag_seconds";
/// Gauge: 1 while [`LAG_SECONDS`] exceeds the configured lag alert, else 0.
pub const LAG_ALERT: &str = "outbox_lag_alert";

/// Gauge, label `group`: 1 while the relay's consumer group is paused
/// (`outbox-relay pause`; the relay claims nothing), 0 while it runs. Set by
/// relays built [`with_control`](crate::Relay::with_control), at each read
/// of the group's control row (about once a second).
pub const PAUSED: &str = "outbox_paused";
/// Histogram, seconds: per batch that had to wait for the rate limit
/// ([`RelayOptions::with_max_rate`](crate::RelayOptions::with_max_rate)),
/// how long it waited before going to the sink.
pub const RATE_LIMIT_WAIT_SECONDS: &str = "outbox_rate_limit_wait_seconds";

/// Registers units and descriptions of every relay metric with the installed recorder.
pub fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(EVENTS_DELIVERED, "Events delivered and marked done");
    describe_counter!(
        EVENTS_RETRIED,
        "Failed deliveries scheduled for another attempt, by error code"
    );
    describe_counter!(EVENTS_DEAD, "Events dead-lettered, by error code");
    describe_counter!(
        LEASE_LOST,
        "Events whose outcome was not recorded because the lease was lost"
    );
    describe_counter!(
        EVENTS_RELEASED,
        "Events given back unattempted (attempt not counted), by reason"
    );
    describe_counter!(
        EVENTS_REJECTED,
        "Events a settlement could not record as asked"
    );
    describe_counter!(STORE_ERRORS, "Failed store calls, by operation");
    describe_counter!(
        DELIVERY_TIMEOUTS,
        "Deliveries cancelled after the delivery timeout"
    );
    describe_counter!(
        LEASE_LOST_DELIVERIES_STOPPED,
        "Batches not delivered further because their lease was lost, by stage"
    );
    describe_counter!(
        LEASE_EXPIRED_DELIVERIES_STOPPED,
        "Batches not delivered further because their lease ended by the relay's clock without a renewal, by stage"
    );
    describe_gauge!(
        SINK_STATE,
        "Sink circuit breaker: 0 closed, 1 half-open, 2 open"
    );
    describe_counter!(
        SINK_STATE_TRANSITIONS,
        "Sink circuit breaker transitions, by new state"
    );
    describe_histogram!(
        EVENT_PROCESS_SECONDS,
        Unit::Seconds,
        "Per event: time from claim to recorded outcome"
    );
    describe_gauge!(
        LAG_SECONDS,
        Unit::Seconds,
        "Age of the oldest event in the last batch"
    );
    describe_gauge!(
        SHARD_LAG_SECONDS,
        Unit::Seconds,
        "Age of the oldest event in the last batch of a shard"
    );
    describe_gauge!(LAG_ALERT, "1 while the lag exceeds the lag alert threshold");
    describe_gauge!(
        PAUSED,
        "1 while the relay's consumer group is paused (outbox-relay pause), else 0"
    );
    describe_histogram!(
        RATE_LIMIT_WAIT_SECONDS,
        Unit::Seconds,
        "Per rate-limited batch: wait for the rate limit (max_rate) before delivery"
    );
}
