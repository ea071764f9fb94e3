//! The consumer groups of a `status` document (the one `outbox-relay
//! status --json` prints), as the pages and the chart sampler read them.

use serde_json::Value;

/// One consumer group as the pages show it.
#[derive(Debug, Clone, Default)]
pub(crate) struct GroupRow {
    pub(crate) name: String,
    pub(crate) pending: u64,
    pub(crate) lag_secs: Option<f64>,
    pub(crate) retry_lane: Option<u64>,
    pub(crate) parked_keys: Option<u64>,
    pub(crate) dead: u64,
    pub(crate) dead_by_code: Vec<(String, u64)>,
    pub(crate) holds_rotation: Option<String>,
    pub(crate) shards: Vec<Value>,
}

/// The groups of a `status` document: every group of the event log, or
/// the one implicit group (`default`) of the other stores.
pub(crate) fn groups_of(doc: &Value) -> Vec<GroupRow> {
    match doc["groups"].as_array() {
        Some(groups) => groups
            .iter()
            .map(|g| GroupRow {
                name: g["name"].as_str().unwrap_or("?").to_owned(),
                pending: g["pending"].as_u64().unwrap_or(0),
                lag_secs: g["lag_secs"].as_f64(),
                retry_lane: g["retry_lane"].as_u64(),
                parked_keys: g["parked_keys"].as_u64(),
                dead: g["dead"].as_u64().unwrap_or(0),
                dead_by_code: g["dead_by_code"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                    .collect(),
                holds_rotation: g["rotation_held_because"].as_str().map(str::to_owned),
                shards: g["shards"].as_array().cloned().unwrap_or_default(),
            })
            .collect(),
        None => vec![GroupRow {
            name: outbox_core::DEFAULT_GROUP.to_owned(),
            pending: doc["pending"].as_u64().unwrap_or(0) + doc["in_flight"].as_u64().unwrap_or(0),
            lag_secs: doc["oldest_secs"].as_f64(),
            dead: doc["dead"].as_u64().unwrap_or(0),
            ..GroupRow::default()
        }],
    }
}
