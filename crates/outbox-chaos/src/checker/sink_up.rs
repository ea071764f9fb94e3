//! The delivered rate while the sink is up, against the relay's steady
//! rate: the issue's "delivered rate while the sink is up >= 80% of the
//! relay's steady rate".
//!
//! The steady rate is the delivered rate of the warm-up (from the first
//! arrival to the first fault), when the relays keep up with the producer,
//! so it is the offered rate the relays proved they sustain (a lower bound
//! of their capacity; a drain rate would need a backlog, which only the
//! faults make). Each span the sink is up between two faults, from the
//! sink's return until the backlog it found is gone, must deliver at least
//! 80% of it; a span shorter than 2 s, or without a backlog, is reported
//! as n/a.

use crate::record::{secs, FaultRecord};
use serde::{Deserialize, Serialize};

/// Below this share of the steady rate a sink-up span is reported `slow`.
pub(crate) const MIN_SINK_UP_RATIO: f64 = 0.8;
/// Spans (and warm-ups) shorter than this are not measured, microseconds.
const MIN_MEASURE_US: i64 = 2_000_000;

/// The delivered rate while the sink is up, against the steady rate.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct SinkUpRates {
    /// Events/s first received in the warm-up, from the first arrival to
    /// the first fault; `None` when that is shorter than 2 s.
    pub(crate) steady_rate: Option<f64>,
    /// The warm-up measured, seconds.
    pub(crate) steady_window_s: f64,
    /// The share of the steady rate each measured span must reach.
    pub(crate) min_ratio: f64,
    /// Each span the sink was up after a sink fault.
    pub(crate) windows: Vec<SinkUpWindow>,
    /// The lowest measured share of the steady rate.
    pub(crate) worst_ratio: Option<f64>,
}

/// One span the sink was up, after it came back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SinkUpWindow {
    /// When the sink came back, seconds after the run started.
    pub(crate) at_s: f64,
    /// Until the next fault (or the last arrival), seconds.
    pub(crate) up_s: f64,
    /// Where the measure starts, seconds after the run started: the sink's
    /// return, or later when another fault was still in effect (a killed or
    /// stopped relay: until its lease ran out).
    pub(crate) from_s: f64,
    /// Events committed before `from_s` and not received by then.
    pub(crate) backlog: u64,
    /// Seconds measured: from `from_s` until that backlog was received (or
    /// the span ended).
    pub(crate) measured_s: f64,
    /// Events first received in the measured time.
    pub(crate) delivered: u64,
    /// `delivered / measured_s`, events/s.
    pub(crate) rate: Option<f64>,
    /// `rate / steady_rate`.
    pub(crate) ratio: Option<f64>,
    /// `ok`, `slow` (below the minimum ratio: fails the run), or `n/a: why`.
    pub(crate) verdict: String,
}

/// The delivered rate while the sink is up (see the module docs), or
/// `None` when no fault made the sink unreachable.
///
/// `by_commit`: committed events as `(commit, first arrival or i64::MAX)`,
/// sorted by commit, with `prefix_max` the running maximum of the arrivals;
/// `first_sorted`: the first arrivals, sorted; `lease_ms`: how long a
/// killed or stopped relay's claims keep their keys blocked; `run_start`:
/// the origin of the reported times.
pub(super) fn sink_up_rates(
    run_start: i64,
    by_commit: &[(i64, i64)],
    prefix_max: &[i64],
    first_sorted: &[i64],
    faults: &[FaultRecord],
    lease_ms: u64,
) -> Option<SinkUpRates> {
    let mut down: Vec<(i64, i64)> = faults
        .iter()
        .flat_map(FaultRecord::sink_down_spans)
        .collect();
    if down.is_empty() {
        return None;
    }
    down.sort_unstable();
    let mut merged: Vec<(i64, i64)> = Vec::new();
    for (a, b) in down {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    let arrived_in = |from: i64, to: i64| -> u64 {
        (first_sorted.partition_point(|t| *t < to) - first_sorted.partition_point(|t| *t < from))
            as u64
    };
    let last_arrival = first_sorted.last().copied().unwrap_or(i64::MIN);
    let first_fault = faults.iter().map(|f| f.start_us).min().unwrap_or(i64::MAX);

    // The steady rate: the warm-up, from the first arrival to the first fault.
    let warm_from = first_sorted.first().copied().unwrap_or(first_fault);
    let warm_us = first_fault.saturating_sub(warm_from).max(0);
    let steady_rate = (warm_us >= MIN_MEASURE_US)
        .then(|| arrived_in(warm_from, first_fault) as f64 / secs(warm_us));

    // What else was in effect: relay faults block their keys until the
    // lease runs out after them.
    let lease_us = i64::try_from(lease_ms.saturating_mul(1000)).unwrap_or(i64::MAX);
    let others: Vec<(i64, i64)> = faults
        .iter()
        .filter(|f| !f.is_sink_fault())
        .map(|f| {
            let end = if matches!(f.kind.as_str(), "kill" | "stop") {
                f.end_us.saturating_add(lease_us)
            } else {
                f.end_us
            };
            (f.start_us, end)
        })
        .collect();
    let windows: Vec<SinkUpWindow> = merged
        .iter()
        .map(|&(_, back)| {
            let next_fault = faults
                .iter()
                .map(|f| f.start_us)
                .chain(merged.iter().map(|(a, _)| *a))
                .filter(|t| *t >= back)
                .min();
            let up_end = next_fault.unwrap_or(last_arrival.max(back));
            let from = others
                .iter()
                .filter(|(a, b)| *a < back && *b > back)
                .map(|(_, b)| *b)
                .max()
                .unwrap_or(back);
            let n = by_commit.partition_point(|(c, _)| *c <= from);
            let backlog = by_commit[..n].iter().filter(|(_, arr)| *arr > from).count() as u64;
            let cleared = n
                .checked_sub(1)
                .map(|i| prefix_max[i])
                .filter(|t| *t != i64::MAX);
            let to = cleared.map_or(up_end, |c| c.min(up_end)).max(from);
            let mut w = SinkUpWindow {
                at_s: secs(back - run_start),
                up_s: secs(up_end - back),
                from_s: secs(from - run_start),
                backlog,
                measured_s: secs(to - from),
                delivered: arrived_in(from, to),
                rate: None,
                ratio: None,
                verdict: String::new(),
            };
            w.verdict = if up_end <= back {
                "n/a: the next fault started as the sink came back".to_owned()
            } else if from >= up_end {
                "n/a: another fault in effect until the next one".to_owned()
            } else if backlog == 0 {
                "n/a: no backlog".to_owned()
            } else if to - from < MIN_MEASURE_US {
                format!("n/a: measurable for {:.2} s only (< 2 s)", secs(to - from))
            } else {
                let rate = w.delivered as f64 / secs(to - from);
                w.rate = Some(rate);
                match steady_rate {
                    None => "n/a: no steady rate (warm-up < 2 s)".to_owned(),
                    Some(steady) => {
                        let ratio = if steady > 0.0 {
                            rate / steady
                        } else {
                            f64::INFINITY
                        };
                        w.ratio = Some(ratio);
                        if ratio >= MIN_SINK_UP_RATIO {
                            "ok".to_owned()
                        } else {
                            "slow".to_owned()
                        }
                    }
                }
            };
            w
        })
        .collect();
    let worst_ratio = windows
        .iter()
        .filter_map(|w| w.ratio)
        .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.min(r))));
    Some(SinkUpRates {
        steady_rate,
        steady_window_s: secs(warm_us),
        min_ratio: MIN_SINK_UP_RATIO,
        windows,
        worst_ratio,
    })
}

impl SinkUpRates {
    /// The sink-up lines of the summary: the steady rate, then one per span.
    pub(crate) fn lines(&self) -> Vec<String> {
        let mut out = vec![format!(
            "  sink up: steady rate {} (warm-up {:.1} s), each span with a backlog >= {:.0}% of it",
            self.steady_rate
                .map_or("n/a".to_owned(), |s| format!("{s:.0} ev/s")),
            self.steady_window_s,
            self.min_ratio * 100.0
        )];
        for w in &self.windows {
            out.push(format!(
                "    back at {:>6.1} s (up {:>5.1} s){}: backlog {:>6}, {:>6} delivered in {:>4.1} s = {:>7}  {}",
                w.at_s,
                w.up_s,
                if w.from_s > w.at_s {
                    format!(", measured from {:.1} s (another fault in effect)", w.from_s)
                } else {
                    String::new()
                },
                w.backlog,
                w.delivered,
                w.measured_s,
                w.rate.map_or("-".to_owned(), |r| format!("{r:.0} ev/s")),
                match w.ratio {
                    Some(x) => format!("{:.0}% {}", x * 100.0, w.verdict),
                    None => w.verdict.clone(),
                }
            ));
        }
        out
    }
}
