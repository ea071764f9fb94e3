//! The endpoints of a `run` over several stores (`--store NAME=URL`,
//! `--stores FILE`): one listener, the process's `/metrics` (every metric
//! labelled `store="<name>"`), and a `/readyz` made of one section per
//! store name.
//!
//! `/readyz` is `200` when every store's relay is ready (as one relay's
//! `/readyz` says: its store answered, the shared sink's breaker is closed
//! in that relay, its shard leases are held or it is paused), else `503`.
//! The body is `{"ready": bool, "stores": {"<name>": <that relay's
//! /readyz body>}}`; a store not open yet (its database down at start, or
//! migrating) is `{"ready": false, "store": {"state": "opening",
//! "last_error": ...}}`. Strict, as one relay is: a tenant database that is
//! down is a fault to see, and the body says which one. The other stores'
//! relays run on regardless: readiness stops nothing.

use super::endpoints::{metrics_text, router, Answer, Endpoints, Render, Response};
use crate::report::scrub;
use axum::http::StatusCode;
use serde_json::json;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use tokio::net::TcpListener;

/// One store of a `run` over several: opening until its relay starts, then
/// that relay's endpoints.
pub(crate) struct StoreSlot {
    name: String,
    state: Mutex<SlotState>,
}

enum SlotState {
    /// Not open yet; the last error opening it, if any.
    Opening(Option<String>),
    Running(Box<Endpoints>),
}

impl StoreSlot {
    /// The slot of store `name`, opening.
    pub(crate) fn new(name: &str) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_owned(),
            state: Mutex::new(SlotState::Opening(None)),
        })
    }

    fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opening the store failed with `error` (it is retried).
    pub(crate) fn failed(&self, error: String) {
        *self.lock() = SlotState::Opening(Some(error));
    }

    /// The store's relay runs: its section is `endpoints`' `/readyz`.
    pub(crate) fn running(&self, endpoints: Endpoints) {
        *self.lock() = SlotState::Running(Box::new(endpoints));
    }

    /// Whether this store is ready, and its section of the body.
    fn ready(&self, secrets: &[String]) -> (bool, serde_json::Value) {
        match &*self.lock() {
            SlotState::Running(endpoints) => {
                let answer = endpoints.ready();
                let body = serde_json::from_str(&answer.body).unwrap_or(serde_json::Value::Null);
                (answer.status == StatusCode::OK, body)
            }
            SlotState::Opening(error) => (
                false,
                json!({
                    "ready": false,
                    "store": {
                        "state": "opening",
                        "last_error": error.as_deref().map(|e| scrub(e, secrets)),
                    },
                }),
            ),
        }
    }
}

/// `/readyz` over `stores` (see the module docs).
fn readiness(stores: &[Arc<StoreSlot>], secrets: &[String]) -> Response {
    let mut all = true;
    let mut sections = serde_json::Map::new();
    for slot in stores {
        let (ready, body) = slot.ready(secrets);
        all &= ready;
        sections.insert(slot.name.clone(), body);
    }
    let status = if all {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    Response::json(status, &json!({ "ready": all, "stores": sections }))
}

/// Serves `/metrics` (from `metrics`), `/healthz` and `/readyz` over
/// `stores` on `listener`, within the default limits.
pub(crate) fn spawn_stores(
    listener: TcpListener,
    metrics: Option<Render>,
    stores: Vec<Arc<StoreSlot>>,
    secrets: Vec<String>,
) {
    let text: Answer = Arc::new(move || metrics_text(metrics.as_ref()));
    let ready: Answer = Arc::new(move || readiness(&stores, &secrets));
    super::server::serve_on(
        listener,
        super::server::Limits::default(),
        router(text, ready),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_not_open_yet_is_not_ready_and_says_why_without_secrets() {
        let (a, b) = (StoreSlot::new("a"), StoreSlot::new("b"));
        b.failed("connection refused for postgres://relay:s3cret@db-b/app".to_owned());
        let answer = readiness(&[a, b], &["s3cret".to_owned()]);
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
        let body: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
        assert_eq!(body["ready"], json!(false));
        assert_eq!(body["stores"]["a"]["store"]["state"], json!("opening"));
        assert_eq!(body["stores"]["a"]["store"]["last_error"], json!(null));
        let error = body["stores"]["b"]["store"]["last_error"].as_str().unwrap();
        assert!(error.contains("connection refused"), "{error}");
        assert!(!error.contains("s3cret"), "{error}");
    }
}
