//! [`JsonLinesSink`]: one JSON object per event, to stdout or a file.

use base64::Engine as _;
use outbox_core::{DeliveryError, ErrorCode, Event, Outcome, Sink};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Code recorded when the JSON-lines sink could not write or sync its output
/// (the sink's failure, [`DeliveryError::unavailable`]: no attempt is
/// counted, the relay gives the batch back and probes until the disk takes
/// writes again).
pub const SINK_WRITE_FAILED: ErrorCode = ErrorCode::from_static("SINK_WRITE_FAILED");

/// Writes each event as one line of JSON:
///
/// ```json
/// {"id":"0190...","key":"order-1","event_type":"order.created","topic":"orders",
///  "headers":{"traceparent":"00-..."},"payload":"{\"id\":1}","payload_encoding":"utf8",
///  "created_at":"2025-01-01T00:00:00.000000Z","attempts":1}
/// ```
///
/// `payload` is the payload as text when it is valid UTF-8
/// (`"payload_encoding":"utf8"`), otherwise standard base64 with padding
/// (`"payload_encoding":"base64"`).
///
/// A batch is written in one `write`, flushed, and for a file `fsync`ed
/// (`sync_data`) before any of its events is reported delivered, so a crash
/// never loses an event that was marked done. A file is opened in append
/// mode and created if missing. A crash between the write and the outcome
/// being recorded can leave duplicate lines (at-least-once): dedup on `id`.
#[derive(Clone)]
pub struct JsonLinesSink {
    target: Arc<Mutex<Target>>,
    path: Option<PathBuf>,
}

enum Target {
    Stdout,
    File(File),
}

impl fmt::Debug for JsonLinesSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonLinesSink")
            .field("path", &self.path)
            .finish()
    }
}

/// The JSON object written for one event.
#[derive(serde::Serialize)]
struct Line<'a> {
    id: String,
    key: Option<&'a str>,
    event_type: &'a str,
    topic: &'a str,
    headers: &'a std::collections::BTreeMap<String, String>,
    payload: std::borrow::Cow<'a, str>,
    payload_encoding: &'static str,
    created_at: String,
    attempts: u32,
}

impl JsonLinesSink {
    /// Writes to the process's standard output.
    pub fn stdout() -> Self {
        Self {
            target: Arc::new(Mutex::new(Target::Stdout)),
            path: None,
        }
    }

    /// Appends to the file at `path`, creating it if missing. If the file
    /// ends with a torn line (a crash mid-write), a newline is added first so
    /// the torn line stays separate and new lines stay parseable.
    pub fn file(path: impl AsRef<Path>) -> io::Result<Self> {
        let path = path.as_ref().to_path_buf();
        let mut file = OpenOptions::new().create(true).append(true).open(&path)?;
        if ends_with_torn_line(&path)? {
            file.write_all(b"\n")?;
            file.sync_data()?;
        }
        Ok(Self {
            target: Arc::new(Mutex::new(Target::File(file))),
            path: Some(path),
        })
    }

    /// The output file, or `None` for stdout.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The JSON line (with its trailing newline) for one event.
    pub fn encode(event: &Event) -> Vec<u8> {
        let (payload, payload_encoding) = match std::str::from_utf8(&event.payload) {
            Ok(text) => (std::borrow::Cow::Borrowed(text), "utf8"),
            Err(_) => (
                std::borrow::Cow::Owned(
                    base64::engine::general_purpose::STANDARD.encode(&event.payload),
                ),
                "base64",
            ),
        };
        let line = Line {
            id: event.id.to_string(),
            key: event.key.as_deref(),
            event_type: &event.event_type,
            topic: &event.topic,
            headers: &event.headers,
            payload,
            payload_encoding,
            created_at: event
                .created_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            attempts: event.attempts,
        };
        // Serialising strings, maps of strings and integers cannot fail.
        let mut out = serde_json::to_vec(&line).unwrap_or_default();
        out.push(b'\n');
        out
    }
}

fn ends_with_torn_line(path: &Path) -> io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = File::open(path)?;
    if f.metadata()?.len() == 0 {
        return Ok(false);
    }
    f.seek(SeekFrom::End(-1))?;
    let mut last = [0u8; 1];
    f.read_exact(&mut last)?;
    Ok(last[0] != b'\n')
}

fn write_all(target: &Mutex<Target>, buf: &[u8]) -> io::Result<()> {
    let mut guard = target
        .lock()
        .map_err(|_| io::Error::other("sink lock poisoned"))?;
    match &mut *guard {
        Target::Stdout => {
            let mut out = io::stdout().lock();
            out.write_all(buf)?;
            out.flush()
        }
        Target::File(file) => {
            file.write_all(buf)?;
            file.flush()?;
            file.sync_data()
        }
    }
}

impl Sink for JsonLinesSink {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        let mut buf = Vec::with_capacity(events.len() * 256);
        for event in events {
            buf.extend_from_slice(&Self::encode(event));
        }
        let target = Arc::clone(&self.target);
        let result = tokio::task::spawn_blocking(move || write_all(&target, &buf))
            .await
            .map_err(|e| io::Error::other(e.to_string()))
            .and_then(|r| r);
        match result {
            Ok(()) => vec![Outcome::Delivered; events.len()],
            Err(err) => {
                tracing::warn!(error = %err, "json-lines sink write failed");
                let error = DeliveryError::unavailable(
                    SINK_WRITE_FAILED,
                    format!("writing the json-lines output failed: {err}"),
                );
                vec![Outcome::Failed(error); events.len()]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use outbox_core::EventId;

    fn event(payload: &[u8]) -> Event {
        Event {
            id: EventId::new(),
            key: Some("k".into()),
            event_type: "t".into(),
            topic: "orders".into(),
            payload: payload.to_vec(),
            headers: [("h".to_owned(), "v".to_owned())].into_iter().collect(),
            created_at: Utc::now(),
            attempts: 2,
            next_attempt_at: Utc::now(),
            last_error: None,
        }
    }

    #[test]
    fn utf8_payload_is_text_and_binary_is_base64() {
        let e = event(br#"{"a":1}"#);
        let v: serde_json::Value = serde_json::from_slice(&JsonLinesSink::encode(&e)).unwrap();
        assert_eq!(v["id"], e.id.to_string());
        assert_eq!(v["payload"], r#"{"a":1}"#);
        assert_eq!(v["payload_encoding"], "utf8");
        assert_eq!(v["headers"]["h"], "v");
        assert_eq!(v["attempts"], 2);
        assert_eq!(v["key"], "k");

        let b = event(&[0xff, 0x00, 0x01]);
        let v: serde_json::Value = serde_json::from_slice(&JsonLinesSink::encode(&b)).unwrap();
        assert_eq!(v["payload"], "/wAB");
        assert_eq!(v["payload_encoding"], "base64");
    }

    #[tokio::test]
    async fn file_sink_appends_one_line_per_event() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let sink = JsonLinesSink::file(&path).unwrap();
        let events = vec![event(b"one"), event(b"two")];
        let outcomes = sink.deliver(&events).await;
        assert_eq!(outcomes, vec![Outcome::Delivered, Outcome::Delivered]);
        // A torn line left by a crash is closed before new lines are appended.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"id\":\"tor")
            .unwrap();
        let again = JsonLinesSink::file(&path).unwrap();
        again.deliver(&events[..1]).await;
        let text = std::fs::read_to_string(&path).unwrap();
        let ids: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with("{\"id\":\"tor"))
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(
            ids,
            vec![
                events[0].id.to_string(),
                events[1].id.to_string(),
                events[0].id.to_string()
            ]
        );
        assert_eq!(text.lines().count(), 4);
    }
}
