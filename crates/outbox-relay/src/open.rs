//! Opening the store a command names: its settings resolved (flag > env >
//! file > default), the URL's backend connected, and a refused setting
//! explained by the flag, variable or file key it came from.

use crate::any::{AnyStore, ConnectError};
use crate::config::{Resolved, StoreArgs};

/// A connect error, with the flag, variable or file key of a refused setting.
pub(crate) fn connect_error(resolved: &Resolved, e: ConnectError) -> anyhow::Error {
    match e {
        ConnectError::Invalid { descriptor, error } => resolved.explain_invalid(descriptor, &error),
        e => e.into(),
    }
}

/// The store of `resolved` settings, and its URL.
pub(crate) async fn resolved_store(resolved: &Resolved) -> anyhow::Result<(AnyStore, String)> {
    let url = resolved.store_url()?;
    let scope = resolved.scope()?;
    let store = AnyStore::connect(&url, |d| resolved.backend_settings(d), &scope)
        .await
        .map_err(|e| connect_error(resolved, e))?;
    Ok((store, url))
}

/// The store a command's `args` name, and its URL; the passwords of the
/// resolved settings join `secrets`.
pub(crate) async fn store(
    args: &StoreArgs,
    secrets: &mut Vec<String>,
) -> anyhow::Result<(AnyStore, String)> {
    let resolved = args.resolve()?;
    secrets.extend(resolved.secrets());
    resolved_store(&resolved).await
}
