//! How a runner (the `outbox-relay` binary) finds, configures and opens this
//! store: URL schemes `postgres://` and `postgresql://`, and the settings
//! that do not belong in the URL. See [`outbox_core::backend`].
//!
//! One descriptor, two stores: setting `mode` picks the event log
//! ([`PgLogBackend`] opens a [`PgLogStore`], the default)
//! or the queue table ([`PgBackend`] opens a [`PgStore`]). A runner
//! reads [`PgMode::from_settings`] and opens the matching backend; each
//! backend refuses the other's mode, so a runner that knows only
//! [`PgBackend`] never opens the queue table when the log was asked for.

use crate::error::StoreError;
use crate::ident::Ident;
use crate::log::{PgLogOptions, PgLogStore};
use crate::mode::{PgMode, MODE};
use crate::options::{DEFAULT_SCHEMA, DEFAULT_TABLE};
use crate::queue::{PgStore, PgStoreOptions};
use outbox_core::backend::{Backend, Descriptor, InvalidSetting, Role, Setting, Settings};
use outbox_core::Pooler;

const SCHEMA: &str = "schema";
const TABLE: &str = "table";
const POOLER: &str = "pooler";

const SETTINGS: &[Setting] = &[
    Setting::text(SCHEMA, "PostgreSQL: schema of the outbox tables.")
        .with_default(DEFAULT_SCHEMA)
        .with_value_name("SCHEMA"),
    Setting::text(
        TABLE,
        "PostgreSQL: events table (dead letters in `<table>_dead`; mode `log`: tables `<table>_log*`).",
    )
    .with_default(DEFAULT_TABLE)
    .with_value_name("TABLE"),
    Setting::text(
        MODE,
        "PostgreSQL: `log` (the event log: append-only, snapshot-window batches, rotation by TRUNCATE; migrating it upgrades a queue-mode outbox in place) or `queue` (the queue table).",
    )
    .with_default("log")
    .with_value_name("MODE"),
    Setting::text(
        POOLER,
        "PostgreSQL: what sits between this process and the server: `auto` (detected at connect: a server that answers on another port than the one dialled, or refuses the startup setting `options` as PgBouncer does, is taken as `transaction`, said in one log line), `none` (straight to PostgreSQL), `session` (a pooler in session mode, or a TCP proxy: statements stay prepared, the settings are SET on each new connection), `transaction` (PgBouncer's pool_mode = transaction and managed poolers built the same way: every statement in a transaction, unnamed, settings per transaction, the queue table's probe instead of LISTEN).",
    )
    .with_default("auto")
    .with_value_name("MODE"),
];

/// `settings`' mode, refused unless it is `expected`.
fn require_mode(settings: &Settings, expected: PgMode) -> Result<(), InvalidSetting> {
    let mode = PgMode::from_settings(settings)?;
    if mode == expected {
        Ok(())
    } else {
        Err(InvalidSetting::new(
            MODE,
            format!("mode `{mode}` is not opened by the `{expected}` backend"),
        ))
    }
}

/// The `pooler` setting (`auto` when unset).
fn pooler(settings: &Settings) -> Result<Pooler, InvalidSetting> {
    Ok(settings.parse::<Pooler>(POOLER)?.unwrap_or_default())
}

/// The `schema` and `table` settings, validated.
fn names(settings: &Settings) -> Result<(Option<Ident>, Option<Ident>), InvalidSetting> {
    let ident = |name: &str| {
        settings
            .text(name)
            .map(|value| Ident::new(value).map_err(|e| InvalidSetting::new(name, e.to_string())))
            .transpose()
    };
    Ok((ident(SCHEMA)?, ident(TABLE)?))
}

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
        require_mode(settings, PgMode::Queue)?;
        let (schema, table) = names(settings)?;
        let mut options = PgStoreOptions::new(url).with_pooler(pooler(settings)?);
        if let Some(schema) = schema {
            options = options.with_schema(schema);
        }
        if let Some(table) = table {
            options = options.with_table(table);
        }
        Ok(options)
    }

    async fn connect(options: PgStoreOptions) -> Result<PgStore, StoreError> {
        PgStore::connect(options).await
    }
}

/// The PostgreSQL event-log store (`mode = log`) as a [`Backend`]: the same
/// descriptor as [`PgBackend`] (URL schemes, settings), another store.
#[derive(Debug, Clone, Copy, Default)]
pub struct PgLogBackend;

impl Backend for PgLogBackend {
    const DESCRIPTOR: Descriptor = PgBackend::DESCRIPTOR;

    type Config = PgLogOptions;
    type Connected = PgLogStore;
    type Error = StoreError;

    fn configure(url: &str, settings: &Settings) -> Result<PgLogOptions, InvalidSetting> {
        require_mode(settings, PgMode::Log)?;
        let (schema, table) = names(settings)?;
        // A runner's relays started without a static shard share the work
        // as a relay group.
        let mut options = PgLogOptions::new(url)
            .with_dynamic_shards(true)
            .with_pooler(pooler(settings)?);
        if let Some(schema) = schema {
            options = options.with_schema(schema);
        }
        if let Some(table) = table {
            options = options.with_table(table);
        }
        Ok(options)
    }

    async fn connect(options: PgLogOptions) -> Result<PgLogStore, StoreError> {
        PgLogStore::connect(options).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_validated_identifiers() {
        let ok = PgLogBackend::configure(
            "postgres://app@db/app",
            &Settings::new().with_text(SCHEMA, "billing"),
        );
        assert!(ok.is_ok());
        let err = PgLogBackend::configure(
            "postgres://app@db/app",
            &Settings::new().with_text(SCHEMA, "x\"; DROP TABLE y; --"),
        )
        .unwrap_err();
        assert_eq!(err.setting(), SCHEMA);
        assert!(PgBackend::DESCRIPTOR.handles("postgresql://db/app"));
    }

    #[test]
    fn mode_picks_the_backend() {
        let url = "postgres://app@db/app";
        assert_eq!(PgMode::from_settings(&Settings::new()), Ok(PgMode::Log));
        let log = Settings::new()
            .with_text(MODE, "log")
            .with_text(SCHEMA, "billing");
        assert_eq!(PgMode::from_settings(&log), Ok(PgMode::Log));
        let options = PgLogBackend::configure(url, &log).unwrap();
        assert_eq!(options.schema().as_str(), "billing");
        // Each backend refuses the other's mode.
        assert_eq!(PgBackend::configure(url, &log).unwrap_err().setting(), MODE);
        let queue = Settings::new().with_text(MODE, "Queue");
        assert!(PgBackend::configure(url, &queue).is_ok());
        assert!(PgLogBackend::configure(url, &Settings::new()).is_ok());
        assert_eq!(
            PgBackend::configure(url, &Settings::new())
                .unwrap_err()
                .setting(),
            MODE
        );
        let bad = Settings::new().with_text(MODE, "stream");
        let err = PgMode::from_settings(&bad).unwrap_err();
        assert_eq!(err.setting(), MODE);
        assert!(err.reason().contains("queue"), "{}", err.reason());
    }

    #[test]
    fn pooler_setting_is_read_and_an_unknown_mode_refused() {
        let url = "postgres://app@db/app";
        let auto = PgLogBackend::configure(url, &Settings::new()).unwrap();
        assert_eq!(auto.pool.pooler, Pooler::Auto);
        let tx = Settings::new().with_text(POOLER, "transaction");
        assert_eq!(
            PgLogBackend::configure(url, &tx).unwrap().pool.pooler,
            Pooler::Transaction
        );
        let queue = tx.with_text(MODE, "queue");
        assert_eq!(
            PgBackend::configure(url, &queue).unwrap().pool.pooler,
            Pooler::Transaction
        );
        let bad = Settings::new().with_text(POOLER, "statement");
        let err = PgLogBackend::configure(url, &bad).unwrap_err();
        assert_eq!(err.setting(), POOLER);
        assert!(err.reason().contains("transaction"), "{}", err.reason());
    }
}
