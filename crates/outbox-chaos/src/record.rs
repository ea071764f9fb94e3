//! What the producer, the consumers and the fault injector record, and the
//! shared bookkeeping the run uses to know when everything has arrived.
//!
//! Times are microseconds on the wall clock (`SystemTime`), so records from
//! separate processes (or a later `outbox-chaos check`) compare directly.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};
use uuid::Uuid;

/// Microseconds since the Unix epoch, now.
pub(crate) fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// A span in microseconds as seconds.
pub(crate) fn secs(us: i64) -> f64 {
    us as f64 / 1e6
}

/// How the producer's transaction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum TxOutcome {
    /// `COMMIT` returned success: the event must arrive.
    Committed,
    /// Rolled back on purpose (or failed before `COMMIT`): must never arrive.
    RolledBack,
    /// `COMMIT` failed (connection lost during it): either is fine. Resolved
    /// after the run from the business table when the database answers.
    Unknown,
}

/// One event the producer wrote.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Produced {
    /// The event id (also in the payload).
    pub(crate) id: Uuid,
    /// The event key.
    pub(crate) key: String,
    /// The key's sequence number (increasing per key, in commit order).
    pub(crate) seq: u64,
    /// The business transaction's id (its row in the business table).
    pub(crate) tx: Uuid,
    /// How the transaction ended.
    pub(crate) outcome: TxOutcome,
    /// When `COMMIT` (or `ROLLBACK`) returned.
    pub(crate) at_us: i64,
}

/// One message a consumer received.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Arrival {
    /// The event id from the payload.
    pub(crate) id: Uuid,
    /// The key from the payload.
    pub(crate) key: String,
    /// The sequence number from the payload.
    pub(crate) seq: u64,
    /// When the consumer received it.
    pub(crate) at_us: i64,
}

/// The payload the producer writes: `<id> <key> <seq>`, then padding.
pub(crate) fn payload(id: Uuid, key: &str, seq: u64, pad: usize) -> Vec<u8> {
    let mut s = format!("{id} {key} {seq}");
    if pad > 0 {
        s.push(' ');
        s.extend(std::iter::repeat_n('x', pad));
    }
    s.into_bytes()
}

/// Parses a payload written by [`payload`].
pub(crate) fn parse_payload(bytes: &[u8], at_us: i64) -> Option<Arrival> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut parts = text.split(' ');
    let id = parts.next()?.parse().ok()?;
    let key = parts.next()?.to_owned();
    let seq = parts.next()?.parse().ok()?;
    Some(Arrival {
        id,
        key,
        seq,
        at_us,
    })
}

/// A fault as injected.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FaultRecord {
    /// The fault kind (`kill`, `stop`, ...).
    pub(crate) kind: String,
    /// What it hit (`relay-1`, `broker proxy`, ...).
    pub(crate) target: String,
    /// When it started.
    pub(crate) start_us: i64,
    /// When it was over (the process restarted or resumed, the connection
    /// restored): recovery is measured from here.
    pub(crate) end_us: i64,
    /// Where recovery is measured from, when not `end_us`: a stopped relay's
    /// events wait for its lease from the moment it stopped.
    #[serde(default)]
    pub(crate) recovery_from_us: Option<i64>,
    /// Whether a duplicate batch is expected from it (a relay killed or
    /// stopped past its lease: its claimed batch may be sent again).
    pub(crate) may_duplicate: bool,
    /// How many times it cut the relays' broker connections (an outage: 1,
    /// a flap: its cycles). Messages the broker stored whose acks were lost
    /// with the connection are sent again: at most one batch per cut.
    #[serde(default)]
    pub(crate) broker_cuts: u32,
    /// The spans the broker was unreachable, `(from_us, to_us)`: one for an
    /// outage, one per cycle of a flap, none for other kinds. Records
    /// written before this field have none: the checker then takes a broker
    /// fault's whole span as one outage.
    #[serde(default)]
    pub(crate) sink_down: Vec<(i64, i64)>,
    /// When the database accepted connections again after a `pg-crash`
    /// (a fresh connection answered `SELECT 1`); also the fault's `end_us`.
    #[serde(default)]
    pub(crate) db_ready_us: Option<i64>,
}

impl FaultRecord {
    /// Whether the fault made the sink (the broker) unreachable.
    pub(crate) fn is_sink_fault(&self) -> bool {
        matches!(
            self.kind.as_str(),
            "broker-outage" | "broker-flap" | "broker-restart" | "nats-leader-kill"
        )
    }

    /// The spans the sink was unreachable (see [`FaultRecord::sink_down`]).
    pub(crate) fn sink_down_spans(&self) -> Vec<(i64, i64)> {
        match (self.is_sink_fault(), self.sink_down.is_empty()) {
            (false, _) => Vec::new(),
            (true, true) => vec![(self.start_us, self.end_us)],
            (true, false) => self.sink_down.clone(),
        }
    }
}

const COMMITTED: u8 = 1;
const ARRIVED: u8 = 2;

/// Committed-but-not-arrived bookkeeping shared by the producer and the
/// consumer, so the run knows when the relays have caught up.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    flags: Mutex<HashMap<Uuid, u8>>,
    outstanding: AtomicU64,
    committed: AtomicU64,
    arrivals: AtomicU64,
}

impl Ledger {
    /// The producer saw `COMMIT` succeed for `id`.
    pub(crate) fn committed(&self, id: Uuid) {
        self.committed.fetch_add(1, Ordering::Relaxed);
        let mut flags = self.flags.lock().unwrap_or_else(|e| e.into_inner());
        let f = flags.entry(id).or_insert(0);
        if *f & COMMITTED == 0 {
            *f |= COMMITTED;
            if *f & ARRIVED == 0 {
                self.outstanding.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// A consumer received `id`.
    pub(crate) fn arrived(&self, id: Uuid) {
        self.arrivals.fetch_add(1, Ordering::Relaxed);
        let mut flags = self.flags.lock().unwrap_or_else(|e| e.into_inner());
        let f = flags.entry(id).or_insert(0);
        if *f & ARRIVED == 0 {
            *f |= ARRIVED;
            if *f & COMMITTED != 0 {
                self.outstanding.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// `id` turned out not committed after all (its transaction was lost
    /// with a primary, `pg-failover` with asynchronous replication): no
    /// longer waited for.
    pub(crate) fn forget(&self, id: Uuid) {
        let mut flags = self.flags.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = flags.get_mut(&id) {
            if *f & COMMITTED != 0 {
                *f &= !COMMITTED;
                if *f & ARRIVED == 0 {
                    self.outstanding.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Committed events not arrived yet.
    pub(crate) fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Events committed so far.
    pub(crate) fn committed_count(&self) -> u64 {
        self.committed.load(Ordering::Relaxed)
    }

    /// Messages received so far (duplicates included).
    pub(crate) fn arrival_count(&self) -> u64 {
        self.arrivals.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_round_trips() {
        let id = Uuid::now_v7();
        let a = parse_payload(&payload(id, "k7", 42, 16), 5).unwrap();
        assert_eq!((a.id, a.key.as_str(), a.seq, a.at_us), (id, "k7", 42, 5));
        assert!(parse_payload(b"garbage", 0).is_none());
    }

    #[test]
    fn ledger_counts_outstanding_in_either_order() {
        let l = Ledger::default();
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        l.committed(a);
        l.arrived(b); // arrives before its commit returned
        assert_eq!(l.outstanding(), 1);
        l.committed(b);
        assert_eq!(l.outstanding(), 1);
        l.arrived(a);
        l.arrived(a);
        assert_eq!(l.outstanding(), 0);
        assert_eq!(l.arrival_count(), 3);
    }
}
