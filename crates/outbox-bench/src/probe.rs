//! What a run costs this process (CPU seconds, peak RSS) and what machine it
//! ran on, read from `/proc` (no `unsafe`, no libc).

use serde::Serialize;
use std::time::{Duration, Instant};

/// `/proc/<pid>/stat` counts CPU time in clock ticks of `USER_HZ`, which the
/// kernel fixes at 100 for its user-space ABI.
const USER_HZ: f64 = 100.0;

/// User + system CPU seconds of this process (all threads) so far.
pub(crate) fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // The command name (field 2) may hold spaces; fields after ')' are fixed.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is index 0, so utime (field 14) is index 11, stime index 12.
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / USER_HZ
}

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// Peak resident set size (VmHWM) in MiB.
pub(crate) fn peak_rss_mib() -> f64 {
    status_kib("VmHWM:").map_or(0.0, |k| k as f64 / 1024.0)
}

/// Resets the peak RSS to the current RSS (`echo 5 > /proc/self/clear_refs`),
/// so a measurement is not inflated by what the setup (backlog load) used.
/// Returns whether the kernel allowed it.
pub(crate) fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// CPU, wall time and peak memory of one measured section.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meter {
    started: Instant,
    cpu0: f64,
}

/// What a [`Meter`] measured.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Usage {
    /// Wall-clock seconds.
    pub(crate) wall_s: f64,
    /// CPU seconds of this process (user + system, every thread).
    pub(crate) cpu_s: f64,
    /// Peak RSS during the section, MiB (lifetime peak if the reset was refused).
    pub(crate) peak_rss_mib: f64,
}

impl Meter {
    /// Starts measuring (and resets the peak RSS).
    pub(crate) fn start() -> Self {
        reset_peak_rss();
        Self {
            started: Instant::now(),
            cpu0: cpu_seconds(),
        }
    }

    /// Elapsed wall time so far.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Stops measuring.
    pub(crate) fn stop(&self) -> Usage {
        Usage {
            wall_s: self.started.elapsed().as_secs_f64(),
            cpu_s: (cpu_seconds() - self.cpu0).max(0.0),
            peak_rss_mib: peak_rss_mib(),
        }
    }
}

/// The machine a run was measured on.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Machine {
    pub(crate) cpus: usize,
    pub(crate) cpu_model: String,
    pub(crate) memory_gib: f64,
    pub(crate) kernel: String,
    pub(crate) date: String,
    pub(crate) postgres: String,
    pub(crate) postgres_settings: String,
    pub(crate) git_commit: String,
}

impl Machine {
    /// Reads the machine description (the Postgres fields are filled by the caller).
    pub(crate) fn describe() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_else(|| "unknown".to_owned());
        let memory_kib: f64 = std::fs::read_to_string("/proc/meminfo")
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default();
        let git_commit = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default();
        Self {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            memory_gib: (memory_kib / 1024.0 / 1024.0 * 10.0).round() / 10.0,
            kernel,
            date: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            postgres: String::new(),
            postgres_settings: String::new(),
            git_commit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let m = Meter::start();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        assert!(x > 0);
        let u = m.stop();
        assert!(u.peak_rss_mib > 0.0, "{u:?}");
        assert!(u.cpu_s >= 0.0 && u.wall_s > 0.0, "{u:?}");
        let d = Machine::describe();
        assert!(d.cpus >= 1 && d.memory_gib > 0.0, "{d:?}");
    }
}
