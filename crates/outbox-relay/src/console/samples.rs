//! The charts' data: every `--sample-secs` the console reads the groups'
//! lag and events behind (the `status` document) and, with `--relay ADDR`,
//! the relays' `outbox_events_delivered_total` (their `/metrics`), and keeps
//! the last hour in memory. Nothing is stored: a restarted console starts
//! with empty charts.

use super::html::Series;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How far back the charts look.
pub(crate) const WINDOW: Duration = Duration::from_secs(3600);

/// One group at one sample.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GroupPoint {
    /// Events behind.
    pub(crate) pending: u64,
    /// Oldest pending age, seconds.
    pub(crate) lag_secs: f64,
}

#[derive(Debug, Clone)]
struct Sample {
    at: Instant,
    groups: BTreeMap<String, GroupPoint>,
    /// Events delivered so far by the `--relay` relays (sum of their
    /// counters), when at least one answered.
    delivered: Option<f64>,
}

/// The samples of the last [`WINDOW`].
#[derive(Debug, Default)]
pub(crate) struct Samples {
    points: Mutex<VecDeque<Sample>>,
}

impl Samples {
    fn points(&self) -> std::sync::MutexGuard<'_, VecDeque<Sample>> {
        self.points
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records one sample taken now.
    pub(crate) fn push(&self, groups: BTreeMap<String, GroupPoint>, delivered: Option<f64>) {
        let now = Instant::now();
        let mut points = self.points();
        points.push_back(Sample {
            at: now,
            groups,
            delivered,
        });
        while points
            .front()
            .is_some_and(|s| now.duration_since(s.at) > WINDOW)
        {
            points.pop_front();
        }
    }

    /// How many samples are kept.
    pub(crate) fn len(&self) -> usize {
        self.points().len()
    }

    /// One series per group of `value` (lag or pending) over the window.
    pub(crate) fn series(&self, value: impl Fn(&GroupPoint) -> f64) -> Vec<Series> {
        let now = Instant::now();
        let points = self.points();
        let mut by_group: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
        for s in points.iter() {
            let ago = now.duration_since(s.at).as_secs_f64();
            for (name, p) in &s.groups {
                by_group
                    .entry(name.as_str())
                    .or_default()
                    .push((ago, value(p)));
            }
        }
        by_group
            .into_iter()
            .map(|(name, points)| Series {
                name: name.to_owned(),
                points,
            })
            .collect()
    }

    /// Delivered events per second between consecutive samples (the
    /// `--relay` relays' counters; a counter that went down, a restarted
    /// relay, gives no point).
    pub(crate) fn throughput(&self) -> Option<Series> {
        let now = Instant::now();
        let points = self.points();
        let mut out = Vec::new();
        let mut prev: Option<(Instant, f64)> = None;
        for s in points.iter() {
            let Some(d) = s.delivered else {
                prev = None;
                continue;
            };
            if let Some((at, before)) = prev {
                let secs = s.at.duration_since(at).as_secs_f64();
                if d >= before && secs > 0.0 {
                    out.push((now.duration_since(s.at).as_secs_f64(), (d - before) / secs));
                }
            }
            prev = Some((s.at, d));
        }
        points
            .iter()
            .any(|s| s.delivered.is_some())
            .then(|| Series {
                name: "delivered / s (relays of --relay)".to_owned(),
                points: out,
            })
    }
}

/// The groups of a `status` document as chart points.
pub(crate) fn group_points(doc: &serde_json::Value) -> BTreeMap<String, GroupPoint> {
    super::groups::groups_of(doc)
        .into_iter()
        .map(|g| {
            (
                g.name.clone(),
                GroupPoint {
                    pending: g.pending,
                    lag_secs: g.lag_secs.unwrap_or(0.0),
                },
            )
        })
        .collect()
}

/// The sum of `outbox_events_delivered_total` over the series of a
/// Prometheus text page.
pub(crate) fn delivered_total(metrics: &str) -> Option<f64> {
    let mut found = false;
    let mut sum = 0.0;
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("outbox_events_delivered_total") else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        if let Some(v) = rest
            .rsplit(' ')
            .next()
            .and_then(|v| v.trim().parse::<f64>().ok())
        {
            sum += v;
            found = true;
        }
    }
    found.then_some(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivered_counters_are_summed_over_labels() {
        let text = "# TYPE outbox_events_delivered_total counter\n\
                    outbox_events_delivered_total{sink=\"nats\"} 10\n\
                    outbox_events_delivered_total{sink=\"x\"} 5\n\
                    outbox_events_delivered_total_other 99\n";
        assert_eq!(delivered_total(text), Some(15.0));
        assert_eq!(delivered_total("nothing 1\n"), None);
    }

    #[test]
    fn series_and_throughput_follow_the_samples() {
        let s = Samples::default();
        let g = |p: u64| {
            BTreeMap::from([(
                "default".to_owned(),
                GroupPoint {
                    pending: p,
                    lag_secs: 1.0,
                },
            )])
        };
        s.push(g(5), Some(100.0));
        s.push(g(7), Some(100.0));
        s.push(g(3), Some(50.0));
        assert_eq!(s.len(), 3);
        let series = s.series(|p| p.pending as f64);
        assert_eq!(series.len(), 1);
        let values: Vec<f64> = series[0].points.iter().map(|p| p.1).collect();
        assert_eq!(values, vec![5.0, 7.0, 3.0]);
        let t = s.throughput().unwrap();
        // 100 -> 100 is one point (0/s); 100 -> 50 (a restart) none.
        assert_eq!(t.points.len(), 1);
        assert_eq!(t.points[0].1, 0.0);
        assert!(Samples::default().throughput().is_none());
    }
}
