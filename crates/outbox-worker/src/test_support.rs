//! What the relay's unit tests (`relay_tests.rs` on SQLite,
//! `relay_fault_tests.rs` on an in-memory store) share; store- and
//! sink-neutral pieces live in `outbox-testkit`.
#![allow(clippy::unwrap_used)]

use crate::{Progress, Relay};
use outbox_core::{Sink, Store};
use std::sync::{Arc, Mutex};

/// What a relay's listener saw, in order.
pub(crate) type Log = Arc<Mutex<Vec<Progress>>>;

/// `relay` with a listener that records every progress report in the
/// returned log.
pub(crate) fn logged<St: Store, Si: Sink>(relay: Relay<St, Si>) -> (Relay<St, Si>, Log) {
    let log: Log = Arc::default();
    let l = Arc::clone(&log);
    (
        relay.with_listener(move |p| l.lock().unwrap().push(p.clone())),
        log,
    )
}
