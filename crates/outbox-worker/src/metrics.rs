//! Metric names the relay records through the [`metrics`] facade.
//!
//! Install any `metrics` recorder (Prometheus exporter, StatsD, ...) in the
//! process; without one the calls cost next to nothing. Call
//! [`describe_metrics`] once after installing it to publish units and help text.

/// Counter: events delivered and marked done.
pub const EVENTS_DELIVERED: &str = "outbox_events_delivered_total";
/// Counter, label `code`: failed deliveries scheduled for another attempt.
pub const EVENTS_RETRIED: &str = "outbox_events_retried_total";
/// Counter, label `code`: events moved to the dead letters.
pub const EVENTS_DEAD: &str = "outbox_events_dead_total";
/// Counter: events whose outcome could not be recorded because this relay's
/// lease had expired and another relay re-claimed them (fencing).
pub const LEASE_LOST: &str = "outbox_lease_lost_total";
/// Counter: events given back unattempted at shutdown.
pub const EVENTS_RELEASED: &str = "outbox_events_released_total";
/// Counter: store calls that failed (claim, complete, fail, release).
pub const STORE_ERRORS: &str = "outbox_store_errors_total";
/// Histogram, seconds: per event, from the claim to its recorded outcome.
pub const EVENT_PROCESS_SECONDS: &str = "outbox_event_process_seconds";
/// Gauge, seconds: age of the oldest event in the last batch (database clock).
pub const LAG_SECONDS: &str = "outbox_lag_seconds";
/// Gauge: 1 while [`LAG_SECONDS`] exceeds the configured lag alert, else 0.
pub const LAG_ALERT: &str = "outbox_lag_alert";

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
    describe_counter!(EVENTS_RELEASED, "Events released unattempted at shutdown");
    describe_counter!(STORE_ERRORS, "Failed store calls");
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
    describe_gauge!(LAG_ALERT, "1 while the lag exceeds the lag alert threshold");
}
