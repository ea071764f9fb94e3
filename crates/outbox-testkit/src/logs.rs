//! [`LogCapture`]: what `tracing` logs during a test, as text.

use std::sync::{Arc, Mutex};
use tracing::subscriber::DefaultGuard;

/// Captures what `tracing` logs on the current thread (as a scoped default
/// subscriber, plain text without colours) until the guard is dropped.
///
/// ```
/// let (logs, _guard) = outbox_testkit::logs::LogCapture::start(tracing::Level::INFO);
/// tracing::warn!(event_id = 7, "lease lost");
/// assert!(logs.contains("lease lost"));
/// ```
#[derive(Debug, Clone, Default)]
pub struct LogCapture(Arc<Mutex<Vec<u8>>>);

impl LogCapture {
    /// Starts capturing everything at `max_level` and above.
    pub fn start(max_level: tracing::Level) -> (Self, DefaultGuard) {
        let capture = Self::default();
        let writer = capture.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(max_level)
            .finish();
        let guard = tracing::subscriber::set_default(subscriber);
        (capture, guard)
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log buffer")).into_owned()
    }

    /// Whether `needle` was logged.
    pub fn contains(&self, needle: &str) -> bool {
        self.text().contains(needle)
    }

    /// How many logged lines contain both `level` (e.g. `"WARN"`) and `needle`.
    pub fn lines(&self, level: &str, needle: &str) -> usize {
        self.text()
            .lines()
            .filter(|l| l.contains(level) && l.contains(needle))
            .count()
    }
}

impl std::io::Write for LogCapture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("log buffer poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
