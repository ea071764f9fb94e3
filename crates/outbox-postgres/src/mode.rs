//! Which of the two stores an outbox is read by ([`PgMode`]): what the
//! enqueue handle targets and what a runner's setting `mode` picks.

use outbox_core::backend::{InvalidSetting, Settings};
use std::fmt;
use std::str::FromStr;

/// The runner setting that names the mode.
pub(crate) const MODE: &str = "mode";

/// Which PostgreSQL store a runner opens (setting `mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum PgMode {
    /// The queue table: [`PgStore`](crate::PgStore), opened by
    /// [`PgBackend`](crate::PgBackend).
    Queue,
    /// The event log (the default): [`PgLogStore`](crate::PgLogStore), opened
    /// by [`PgLogBackend`](crate::PgLogBackend).
    #[default]
    Log,
}

impl PgMode {
    /// The setting's spelling: `queue` or `log`.
    pub fn as_str(self) -> &'static str {
        match self {
            PgMode::Queue => "queue",
            PgMode::Log => "log",
        }
    }

    /// The mode `settings` ask for (`log` when unset).
    pub fn from_settings(settings: &Settings) -> Result<Self, InvalidSetting> {
        Ok(settings.parse::<PgMode>(MODE)?.unwrap_or_default())
    }
}

impl fmt::Display for PgMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PgMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "queue" => Ok(PgMode::Queue),
            "log" => Ok(PgMode::Log),
            other => Err(format!("unknown mode {other:?}: use `queue` or `log`")),
        }
    }
}
