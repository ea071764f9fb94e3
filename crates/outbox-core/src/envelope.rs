//! The protobuf wire envelope (`proto/outbox/v1/envelope.proto`), compiled
//! at build time by protox + prost (no `protoc` needed).

#[allow(missing_docs, unreachable_pub, clippy::all)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/outbox.v1.rs"));
}

pub use generated::Envelope;

use crate::event::{Event, EventId};

impl From<&Event> for Envelope {
    fn from(e: &Event) -> Self {
        Envelope {
            id: e.id.to_string(),
            key: e.key.clone().unwrap_or_default(),
            event_type: e.event_type.clone(),
            topic: e.topic.clone(),
            payload: e.payload.clone(),
            headers: e.headers.clone(),
            created_at_unix_ms: e.created_at.timestamp_millis(),
            attempt: e.attempts,
        }
    }
}

impl Envelope {
    /// The event id, if the envelope's `id` is a valid UUID.
    pub fn event_id(&self) -> Option<EventId> {
        self.id.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn round_trips_through_bytes() {
        let ev = Event {
            id: EventId::new(),
            key: Some("k".into()),
            event_type: "t".into(),
            topic: "orders".into(),
            payload: vec![1, 2, 3],
            headers: [("a".to_string(), "b".to_string())].into(),
            created_at: chrono::DateTime::from_timestamp_millis(1_700_000_000_123).unwrap(),
            attempts: 2,
            next_attempt_at: chrono::DateTime::from_timestamp_millis(0).unwrap(),
            last_error: None,
        };
        let env = Envelope::from(&ev);
        let bytes = env.encode_to_vec();
        let back = Envelope::decode(bytes.as_slice()).unwrap();
        assert_eq!(back.event_id(), Some(ev.id));
        assert_eq!(back.payload, vec![1, 2, 3]);
        assert_eq!(back.headers.get("a").map(String::as_str), Some("b"));
        assert_eq!(back.created_at_unix_ms, 1_700_000_000_123);
        assert_eq!(back.attempt, 2);
    }
}
