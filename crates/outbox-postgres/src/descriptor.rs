//! How a runner (the `outbox-relay` binary) finds, configures and opens this
//! store: URL schemes `postgres://` and `postgresql://`, and the settings
//! that do not belong in the URL. See [`outbox_core::backend`].

use crate::options::{DEFAULT_SCHEMA, DEFAULT_TABLE};
use crate::{Ident, PgStore, PgStoreOptions, StoreError};
use outbox_core::backend::{Backend, Descriptor, InvalidSetting, Role, Setting, Settings};

const SCHEMA: &str = "schema";
const TABLE: &str = "table";

const SETTINGS: &[Setting] = &[
    Setting::text(SCHEMA, "PostgreSQL: schema of the outbox tables.")
        .with_default(DEFAULT_SCHEMA)
        .with_value_name("SCHEMA"),
    Setting::text(
        TABLE,
        "PostgreSQL: events table (dead letters in `<table>_dead`).",
    )
    .with_default(DEFAULT_TABLE)
    .with_value_name("TABLE"),
];

/// The PostgreSQL store as a [`Backend`].
#[derive(Debug, Clone, Copy, Default)]
pub struct PgBackend;

impl Backend for PgBackend {
    const DESCRIPTOR: Descriptor = Descriptor::new("postgres", Role::Store, "pg")
        .with_schemes(&["postgres", "postgresql"])
        .with_example("postgres://user:password@127.0.0.1:5432/db")
        .with_settings(SETTINGS);

    type Config = PgStoreOptions;
    type Connected = PgStore;
    type Error = StoreError;

    fn configure(url: &str, settings: &Settings) -> Result<PgStoreOptions, InvalidSetting> {
        let ident = |name: &str, value: &str| {
            Ident::new(value).map_err(|e| InvalidSetting::new(name, e.to_string()))
        };
        let mut options = PgStoreOptions::new(url);
        if let Some(schema) = settings.text(SCHEMA) {
            options = options.with_schema(ident(SCHEMA, schema)?);
        }
        if let Some(table) = settings.text(TABLE) {
            options = options.with_table(ident(TABLE, table)?);
        }
        Ok(options)
    }

    async fn connect(options: PgStoreOptions) -> Result<PgStore, StoreError> {
        PgStore::connect(options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_validated_identifiers() {
        let ok = PgBackend::configure(
            "postgres://app@db/app",
            &Settings::new().with_text(SCHEMA, "billing"),
        );
        assert!(ok.is_ok());
        let err = PgBackend::configure(
            "postgres://app@db/app",
            &Settings::new().with_text(SCHEMA, "x\"; DROP TABLE y; --"),
        )
        .unwrap_err();
        assert_eq!(err.setting(), SCHEMA);
        assert!(PgBackend::DESCRIPTOR.handles("postgresql://db/app"));
    }
}
