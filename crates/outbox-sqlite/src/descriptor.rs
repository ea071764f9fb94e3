//! How a runner (the `outbox-relay` binary) finds, configures and opens this
//! store: URL scheme `sqlite://PATH`, and the settings that do not belong in
//! the URL. See [`outbox_core::backend`].

use crate::error::StoreError;
use crate::ident::Ident;
use crate::options::{SqliteStoreOptions, DEFAULT_TABLE};
use crate::store::SqliteStore;
use outbox_core::backend::{Backend, Descriptor, InvalidSetting, Role, Setting, Settings};
use sqlx::sqlite::SqliteConnectOptions;
use std::str::FromStr;

const TABLE: &str = "table";

const SETTINGS: &[Setting] = &[Setting::text(
    TABLE,
    "SQLite: events table (dead letters in `<table>_dead`).",
)
.with_default(DEFAULT_TABLE)
.with_value_name("TABLE")];

/// The SQLite store as a [`Backend`].
#[derive(Debug, Clone, Copy, Default)]
pub struct SqliteBackend;

impl Backend for SqliteBackend {
    const DESCRIPTOR: Descriptor = Descriptor::new("sqlite", Role::Store, "sqlite")
        .with_schemes(&["sqlite"])
        .with_example("sqlite://outbox.db")
        .with_settings(SETTINGS);

    type Config = SqliteStoreOptions;
    type Connected = SqliteStore;
    type Error = StoreError;

    fn configure(url: &str, settings: &Settings) -> Result<SqliteStoreOptions, InvalidSetting> {
        // Parsed here only to refuse a malformed URL before opening anything.
        SqliteConnectOptions::from_str(url).map_err(|e| InvalidSetting::url(e.to_string()))?;
        let mut options = SqliteStoreOptions::new(url);
        if let Some(table) = settings.text(TABLE) {
            let table = Ident::new(table).map_err(|e| InvalidSetting::new(TABLE, e.to_string()))?;
            options = options.with_table(table);
        }
        Ok(options)
    }

    async fn connect(options: SqliteStoreOptions) -> Result<SqliteStore, StoreError> {
        SqliteStore::connect(options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_validated() {
        let options = SqliteBackend::configure(
            "sqlite://outbox.db",
            &Settings::new().with_text(TABLE, "app_outbox"),
        )
        .unwrap();
        assert_eq!(options.table().as_str(), "app_outbox");
        let err = SqliteBackend::configure(
            "sqlite://outbox.db",
            &Settings::new().with_text(TABLE, "x\"; DROP TABLE y; --"),
        )
        .unwrap_err();
        assert_eq!(err.setting(), TABLE);
        assert!(SqliteBackend::DESCRIPTOR.handles("sqlite:///var/lib/app.db"));
    }
}
