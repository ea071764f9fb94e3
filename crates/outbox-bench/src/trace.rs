//! What the event log's background rotation did, counted from its own log
//! lines: `rotate_forever` in `outbox_postgres::log::store::rotation` logs every
//! postponed attempt at debug level with its reason, every rotation done
//! (debug) and every failed attempt (warn). [`RotationLog`] is a tracing
//! layer, given only that module's events at debug level (its own filter:
//! what the bench prints to stderr is still `OUTBOX_BENCH_LOG`), that
//! counts them by outcome and reason and records which partition each
//! rotation truncated, so a scenario can say why rotations were late
//! without driving a rotation of its own.

use std::collections::BTreeMap;
use std::sync::Mutex;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::{Context, Layer};

/// The module whose events are counted.
const TARGET: &str = "outbox_postgres::log::store";

/// Counts by outcome (`rotated`, `postponed: <reason>`, `failed: <error>`),
/// process-wide; [`take`] reads and resets them.
static COUNTS: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());
/// The partition each rotation truncated, in the order they were logged.
static TRUNCATED: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// What the background rotation logged since the last [`take`].
#[derive(Debug, Default)]
pub(crate) struct Outcomes {
    /// Attempts by outcome (`rotated`, `postponed: <reason>`, `failed: <error>`).
    pub(crate) counts: BTreeMap<String, u64>,
    /// The partition each rotation truncated, in log order.
    pub(crate) truncated: Vec<u64>,
}

/// The counting layer (see the module docs); install it with [`filter`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct RotationLog;

/// What [`RotationLog`] is given: [`TARGET`]'s events at debug level and above.
pub(crate) fn filter() -> Targets {
    Targets::new().with_target(TARGET, Level::DEBUG)
}

/// What was logged since the last call, and resets it.
pub(crate) fn take() -> Outcomes {
    Outcomes {
        counts: COUNTS
            .lock()
            .map(|mut c| std::mem::take(&mut *c))
            .unwrap_or_default(),
        truncated: TRUNCATED
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default(),
    }
}

impl<S: Subscriber> Layer<S> for RotationLog {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut f = Fields::default();
        event.record(&mut f);
        let key = match f.message.as_str() {
            "outbox event-log rotation postponed" => {
                format!("postponed: {}", without_digits(&f.reason))
            }
            "rotated the outbox event log" => {
                if let (Some(p), Ok(mut t)) = (f.partition, TRUNCATED.lock()) {
                    t.push(p);
                }
                "rotated".to_owned()
            }
            "outbox event-log rotation failed" => format!("failed: {}", f.error),
            _ => return,
        };
        if let Ok(mut c) = COUNTS.lock() {
            *c.entry(key).or_default() += 1;
        }
    }
}

/// `partition 2 is in use` -> `partition N is in use`: one count per kind
/// of reason, whichever partition it names.
fn without_digits(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_ascii_digit() { 'N' } else { c })
        .collect()
}

/// The fields of one event that [`RotationLog`] reads.
#[derive(Debug, Default)]
struct Fields {
    message: String,
    reason: String,
    error: String,
    partition: Option<u64>,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let slot = match field.name() {
            "message" => &mut self.message,
            "reason" => &mut self.reason,
            "error" => &mut self.error,
            _ => return,
        };
        *slot = format!("{value:?}");
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "partition" {
            self.partition = Some(value);
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        if field.name() == "partition" {
            self.partition = u64::try_from(value).ok();
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        let slot = match field.name() {
            "message" => &mut self.message,
            "reason" => &mut self.reason,
            "error" => &mut self.error,
            _ => return,
        };
        value.clone_into(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn counts_the_store_s_rotation_lines_by_reason() {
        let subscriber = tracing_subscriber::registry().with(RotationLog.with_filter(filter()));
        tracing::subscriber::with_default(subscriber, || {
            let reason = "partition 2 is in use";
            tracing::debug!(target: "outbox_postgres::log::store::rotation", %reason, "outbox event-log rotation postponed");
            let reason = "partition 0 is in use";
            tracing::debug!(target: "outbox_postgres::log::store::rotation", %reason, "outbox event-log rotation postponed");
            tracing::debug!(target: "outbox_postgres::log::store::rotation", generation = 4, partition = 1usize, "rotated the outbox event log");
            // Another module, or a line that is not about rotation: ignored.
            tracing::debug!(target: "outbox_postgres::store", %reason, "outbox event-log rotation postponed");
            tracing::debug!(target: "outbox_postgres::log::store::lease", "took the cursor lease");
        });
        let o = take();
        let c = &o.counts;
        assert_eq!(c.get("postponed: partition N is in use"), Some(&2), "{c:?}");
        assert_eq!(c.get("rotated"), Some(&1), "{c:?}");
        assert_eq!(c.len(), 2, "{c:?}");
        assert_eq!(o.truncated, vec![1]);
    }
}
