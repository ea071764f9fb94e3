//! The inbox options the `inbox` scenario runs with ([`Tuning`]): set by
//! `--inbox-options`, carried on the scenarios' `Ctx`, read by `inbox.rs`. Apart
//! from both so the context and the scenario each take it from below.

use crate::report::Row;
use anyhow::{bail, Context, Result};
use outbox_core::DeadHeadPolicy;
use outbox_inbox::InboxOptions;

/// The inbox options the scenario runs with: the product defaults unless a
/// `--inbox-options` experiment changed them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    pub(crate) lanes: usize,
    pub(crate) lane_batch: usize,
    pub(crate) recv_batch: usize,
    pub(crate) max_in_flight: usize,
    /// RabbitMQ prefetch and JetStream max ack pending of every source.
    pub(crate) window: Option<u32>,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            lanes: 8,
            lane_batch: 256,
            recv_batch: 512,
            max_in_flight: 2048,
            window: None,
        }
    }
}

impl Tuning {
    /// Parses `lanes=8,lane_batch=256,recv_batch=512,max_in_flight=2048,window=1024`
    /// (any subset).
    pub(crate) fn parse(s: &str) -> Result<Self> {
        let mut t = Self::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .with_context(|| format!("inbox option {part:?}: expected name=value"))?;
            let n: usize = v
                .parse()
                .with_context(|| format!("inbox option {k}: {v:?} is not a number"))?;
            match k {
                "lanes" => t.lanes = n,
                "lane_batch" => t.lane_batch = n,
                "recv_batch" => t.recv_batch = n,
                "max_in_flight" => t.max_in_flight = n,
                "window" => t.window = Some(u32::try_from(n)?),
                other => bail!("unknown inbox option {other:?}"),
            }
        }
        Ok(t)
    }

    pub(super) fn options(&self) -> Result<InboxOptions> {
        Ok(InboxOptions::default()
            .with_dead_head_policy(DeadHeadPolicy::Block)
            .with_lanes(self.lanes)?
            .with_lane_batch(self.lane_batch)?
            .with_recv_batch(self.recv_batch)?
            .with_max_in_flight(self.max_in_flight)?)
    }

    pub(super) fn params(&self, row: Row) -> Row {
        let row = row
            .param("lanes", self.lanes as u64)
            .param("lane_batch", self.lane_batch as u64)
            .param("recv_batch", self.recv_batch as u64)
            .param("max_in_flight", self.max_in_flight as u64);
        match self.window {
            Some(w) => row.param("broker_window", u64::from(w)),
            None => row,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_parses_a_subset_and_refuses_unknown_names() {
        let t = Tuning::parse("lanes=16, lane_batch=64").unwrap_or_default();
        assert_eq!((t.lanes, t.lane_batch, t.recv_batch), (16, 64, 512));
        assert!(Tuning::parse("lanes=x").is_err());
        assert!(Tuning::parse("nope=1").is_err());
        assert_eq!(
            Tuning::parse("window=4096").map(|t| t.window).ok(),
            Some(Some(4096))
        );
    }
}
