//! The relay's metric handles, registered once when its run starts (with
//! the recorder installed then) instead of looked up by name and labels on
//! every call: the hot path pays an atomic add, not a registry lookup.
//!
//! A relay with a [`StoreName`](crate::StoreName) adds `store="<name>"` to
//! every metric it records; one without records exactly what it always
//! did (no `store` label). The few metrics whose labels come from the event
//! (`outbox_events_retried_total{code}`, `outbox_events_dead_total{code}`)
//! are built per call from [`Meters::labels`]: they are on failure paths.

use super::batch::ReleaseReason;
use crate::metrics as m;
use metrics::{Counter, Gauge, Histogram, Label};

/// The handles of one relay run.
pub(crate) struct Meters {
    /// `store="<name>"`, or nothing for an unnamed relay.
    labels: Vec<Label>,
    pub(crate) delivered: Counter,
    pub(crate) lease_lost: Counter,
    pub(crate) rejected: Counter,
    pub(crate) delivery_timeouts: Counter,
    pub(crate) process_seconds: Histogram,
    pub(crate) rate_limit_wait: Histogram,
    pub(crate) lag: Gauge,
    pub(crate) shard_lag: Gauge,
    pub(crate) lag_alert: Gauge,
    /// `outbox_lease_lost_deliveries_stopped_total`, by stage.
    pub(crate) lost_stopped: ByStage,
    /// `outbox_lease_expired_deliveries_stopped_total`, by stage.
    pub(crate) expired_stopped: ByStage,
    /// `outbox_store_errors_total{op="claim"}`.
    pub(crate) claim_errors: Counter,
    /// `outbox_store_errors_total{op="settle"}`.
    pub(crate) settle_errors: Counter,
    /// `outbox_store_errors_total{op="renew"}`.
    pub(crate) renew_errors: Counter,
    /// `outbox_store_errors_total{op="stats"}`.
    pub(crate) stats_errors: Counter,
    /// `outbox_events_released_total`, one per [`ReleaseReason`].
    released: [Counter; ReleaseReason::ALL.len()],
}

/// A counter with label `stage` = `delivering` or `claimed_ahead`.
pub(crate) struct ByStage {
    pub(crate) delivering: Counter,
    pub(crate) claimed_ahead: Counter,
}

impl Meters {
    /// Registers the handles with the recorder installed now; `labels` go
    /// on every metric, `shard` is the `shard` label of per-shard ones.
    pub(crate) fn new(labels: Vec<Label>, shard: String) -> Self {
        let counter = |name: &'static str| metrics::counter!(name, labels.clone());
        let with = |key: &'static str, value: String| {
            let mut l = labels.clone();
            l.push(Label::new(key, value));
            l
        };
        let counter_with = |name: &'static str, key, value: &str| {
            metrics::counter!(name, with(key, value.to_owned()))
        };
        let by_stage = |name: &'static str| ByStage {
            delivering: counter_with(name, "stage", "delivering"),
            claimed_ahead: counter_with(name, "stage", "claimed_ahead"),
        };
        Self {
            delivered: counter(m::EVENTS_DELIVERED),
            lease_lost: counter(m::LEASE_LOST),
            rejected: counter(m::EVENTS_REJECTED),
            delivery_timeouts: counter(m::DELIVERY_TIMEOUTS),
            process_seconds: metrics::histogram!(m::EVENT_PROCESS_SECONDS, labels.clone()),
            rate_limit_wait: metrics::histogram!(m::RATE_LIMIT_WAIT_SECONDS, labels.clone()),
            lag: metrics::gauge!(m::LAG_SECONDS, labels.clone()),
            shard_lag: metrics::gauge!(m::SHARD_LAG_SECONDS, with("shard", shard)),
            lag_alert: metrics::gauge!(m::LAG_ALERT, labels.clone()),
            lost_stopped: by_stage(m::LEASE_LOST_DELIVERIES_STOPPED),
            expired_stopped: by_stage(m::LEASE_EXPIRED_DELIVERIES_STOPPED),
            claim_errors: counter_with(m::STORE_ERRORS, "op", "claim"),
            settle_errors: counter_with(m::STORE_ERRORS, "op", "settle"),
            renew_errors: counter_with(m::STORE_ERRORS, "op", "renew"),
            stats_errors: counter_with(m::STORE_ERRORS, "op", "stats"),
            released: ReleaseReason::ALL
                .map(|reason| counter_with(m::EVENTS_RELEASED, "reason", reason.as_str())),
            labels,
        }
    }

    /// `outbox_events_released_total{reason}`.
    pub(crate) fn released(&self, reason: ReleaseReason) -> &Counter {
        &self.released[reason as usize]
    }

    /// This relay's labels plus `key` = `value`, for a metric whose label
    /// value is only known at the call.
    pub(crate) fn labels_with(&self, key: &'static str, value: String) -> Vec<Label> {
        let mut labels = self.labels.clone();
        labels.push(Label::new(key, value));
        labels
    }

    /// Sets the three lag gauges.
    pub(crate) fn set_lag(&self, seconds: f64, alert: bool) {
        self.lag.set(seconds);
        self.shard_lag.set(seconds);
        self.lag_alert.set(if alert { 1.0 } else { 0.0 });
    }
}
