//! Reading row columns both PostgreSQL stores share: headers (strict for a
//! claim, lenient for a dead letter) and the last error.

use outbox_core::{ErrorCode, LastError};
use std::collections::BTreeMap;

/// The headers of a claimed event: a JSON object of strings, or the reason
/// the row cannot be delivered.
pub(crate) fn headers_strict(text: &str) -> Result<BTreeMap<String, String>, String> {
    if text == "{}" {
        // Most events carry no headers: no parser for them.
        return Ok(BTreeMap::new());
    }
    serde_json::from_str(text).map_err(|e| {
        format!("headers are not a JSON object of strings: {e} (headers: {text:.200})")
    })
}

/// The headers of a dead letter, as well as they can be shown: a dead
/// letter stays listable even when its headers are why it died. Non-string
/// values are shown as JSON text; headers that are not an object at all are
/// shown whole under `raw_key` (each mode keeps its own).
pub(crate) fn headers_lenient_under(text: &str, raw_key: &str) -> BTreeMap<String, String> {
    if let Ok(h) = serde_json::from_str(text) {
        return h;
    }
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        _ => BTreeMap::from([(raw_key.to_owned(), text.to_owned())]),
    }
}

/// The last error of a row from its `last_error_code` and `last_error_message` columns.
pub(crate) fn last_error(code: Option<String>, message: Option<String>) -> Option<LastError> {
    code.map(|code| LastError {
        code: ErrorCode::new(code),
        message: message.unwrap_or_default(),
    })
}
