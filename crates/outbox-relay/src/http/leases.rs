//! The shard leases a relay holds, as `/readyz` reports them (the module
//! docs' "Leases held"): where they are read from, the grace before a relay
//! that holds none of its share is not ready, and their JSON.

use outbox_core::{RelayId, ShardSpec};
use serde_json::json;
use std::time::Duration;

/// The shard leases the relay held at its last claim (see the module
/// docs, "Leases held").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Leases {
    /// A relay-group member (else a static shard).
    pub(crate) dynamic: bool,
    /// The shards whose lease it holds.
    pub(crate) shards: Vec<u32>,
    /// Of how many.
    pub(crate) total: u32,
    /// How many it should hold (a static shard: 1).
    pub(crate) fair_share: u32,
    /// How long it has held none of a share of at least one.
    pub(crate) held_none_for: Option<Duration>,
    /// Its `--shard` (a static shard's).
    pub(crate) shard: ShardSpec,
}

/// Reads the relay's [`Leases`] (`None`: no claim yet).
pub(crate) type LeaseSource = Box<dyn Fn() -> Option<Leases> + Send + Sync>;

/// How long a relay may hold none of its fair share before `/readyz`
/// says it is not ready: the lock timeout (a killed relay's leases run
/// out) plus twice the poll interval, at least 1 s (the relay rebalances
/// at its claims).
pub(crate) fn lease_grace(lock_timeout: Duration, poll_interval: Duration) -> Duration {
    lock_timeout + 2 * poll_interval.max(Duration::from_secs(1))
}

/// The lease reader of `relay` (claiming `shard`) on `store`: the event
/// log's; `None` for stores without shard leases.
#[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
pub(crate) fn lease_source(
    store: &crate::any::AnyStore,
    relay: &RelayId,
    shard: ShardSpec,
) -> Option<LeaseSource> {
    match store {
        #[cfg(feature = "postgres")]
        crate::any::AnyStore::PgLog(log) => {
            let (log, relay) = (log.clone(), relay.clone());
            Some(Box::new(move || {
                log.lease_holding(&relay).map(|h| Leases {
                    held_none_for: h.held_none_for(),
                    shard,
                    dynamic: h.dynamic,
                    shards: h.shards,
                    total: h.total,
                    fair_share: h.fair_share,
                })
            }))
        }
        _ => None,
    }
}

/// Rounded to 0.1 s.
fn tenths(d: Duration) -> f64 {
    (d.as_secs_f64() * 10.0).round() / 10.0
}

/// `"leases"` of the `/readyz` body, and the reason the relay is not
/// ready when its leases make it so.
pub(super) fn lease_json(l: &Leases, grace: Duration) -> (serde_json::Value, Option<String>) {
    let held = l.shards.len();
    let none_for = l.held_none_for.filter(|_| held == 0 && l.fair_share > 0);
    let mut reason = None;
    let state = match (l.dynamic, none_for) {
        (_, None) => "ok",
        (false, Some(_)) => "standby",
        (true, Some(d)) if d > grace => {
            reason = Some(format!(
                "holds 0 of its fair share of {} shards for {:.1} s",
                l.fair_share,
                d.as_secs_f64()
            ));
            "starved"
        }
        (true, Some(_)) => "waiting",
    };
    let mut v = json!({
        "kind": if l.dynamic { "relay_group" } else { "static" },
        "shards": l.shards,
        "shards_held": held,
        "fair_share": l.fair_share,
        "total": l.total,
        "state": state,
        "grace_secs": tenths(grace),
    });
    if !l.dynamic {
        v["shard"] = json!(l.shard.to_string());
    }
    if let Some(d) = none_for {
        v["held_none_secs"] = json!(tenths(d));
    }
    if let Some(r) = &reason {
        v["reason"] = json!(r);
    }
    (v, reason)
}
