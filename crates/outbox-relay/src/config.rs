//! `run` configuration: flags > environment > `outbox.toml` > defaults.

use anyhow::{bail, Context as _};
use clap::Args;
use crate::any::BackendSettings;
use outbox_core::{Jitter, RelayId, RetryPolicy, ShardSpec};
use outbox_worker::RelayOptions;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The default config file, read when present and `--config` is not given.
pub(crate) const DEFAULT_CONFIG: &str = "outbox.toml";

/// Where the store is: used by every command that talks to one.
#[derive(Debug, Args)]
pub(crate) struct StoreArgs {
    /// Store URL, e.g. sqlite://outbox.db (or `store = ...` in the config file).
    #[arg(long, env = "OUTBOX_STORE", value_name = "URL")]
    pub(crate) store: Option<String>,
    /// TOML config file [default: ./outbox.toml when it exists].
    #[arg(long, env = "OUTBOX_CONFIG", value_name = "PATH")]
    pub(crate) config: Option<PathBuf>,
    /// PostgreSQL schema of the outbox tables [default: outbox].
    #[arg(long, env = "OUTBOX_PG_SCHEMA")]
    pub(crate) pg_schema: Option<String>,
    /// PostgreSQL events table [default: events].
    #[arg(long, env = "OUTBOX_PG_TABLE")]
    pub(crate) pg_table: Option<String>,
}

/// Relay settings of `run`. Each flag has an `OUTBOX_*` environment variable
/// and a config-file key of the same name (snake_case).
#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// Where events go: `stdout`, `jsonl:PATH`, `nats://HOST:PORT`,
    /// `amqp://USER:PASS@HOST:PORT/VHOST` or `kafka://HOST:PORT`.
    #[arg(long, env = "OUTBOX_SINK", value_name = "SINK")]
    pub(crate) sink: Option<String>,
    /// NATS: subject prefix (topic `orders` -> `PREFIX.orders`).
    #[arg(long, env = "OUTBOX_NATS_SUBJECT_PREFIX")]
    pub(crate) nats_subject_prefix: Option<String>,
    /// AMQP: exchange for topics without an `exchange/key` route [default: ""].
    #[arg(long, env = "OUTBOX_AMQP_EXCHANGE")]
    pub(crate) amqp_exchange: Option<String>,
    /// Kafka: topic prefix.
    #[arg(long, env = "OUTBOX_KAFKA_TOPIC_PREFIX")]
    pub(crate) kafka_topic_prefix: Option<String>,
    /// Kafka: a librdkafka property NAME=VALUE (repeatable), e.g. compression.type=lz4.
    #[arg(long = "kafka-property", value_name = "NAME=VALUE")]
    pub(crate) kafka_property: Vec<String>,
    /// Most events per claim [default: 20].
    #[arg(long, env = "OUTBOX_BATCH_SIZE")]
    pub(crate) batch_size: Option<u32>,
    /// Wait between claims when idle, in ms [default: 2000].
    #[arg(long, env = "OUTBOX_POLL_INTERVAL_MS")]
    pub(crate) poll_interval_ms: Option<u64>,
    /// Lease length of a claim, in ms [default: 60000].
    #[arg(long, env = "OUTBOX_LOCK_TIMEOUT_MS")]
    pub(crate) lock_timeout_ms: Option<u64>,
    /// First retry delay, in ms [default: 1000].
    #[arg(long, env = "OUTBOX_RETRY_BASE_MS")]
    pub(crate) retry_base_ms: Option<u64>,
    /// Largest retry delay, in ms [default: 900000].
    #[arg(long, env = "OUTBOX_RETRY_CAP_MS")]
    pub(crate) retry_cap_ms: Option<u64>,
    /// Attempts before an event is dead-lettered [default: 8].
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS")]
    pub(crate) max_attempts: Option<u32>,
    /// This relay's shard as INDEX/TOTAL, e.g. 0/4 [default: 0/1].
    #[arg(long, env = "OUTBOX_SHARD")]
    pub(crate) shard: Option<ShardSpec>,
    /// Lag alert threshold, in seconds [default: 300].
    #[arg(long, env = "OUTBOX_LAG_ALERT_SECS")]
    pub(crate) lag_alert_secs: Option<u64>,
    /// Lease owner id [default: relay-<pid>-<random>].
    #[arg(long, env = "OUTBOX_RELAY_ID")]
    pub(crate) relay_id: Option<String>,
    /// Claim again at once after a full batch [default: true].
    #[arg(long, env = "OUTBOX_DRAIN")]
    pub(crate) drain: Option<bool>,
    /// How long an in-flight batch may finish after SIGINT/SIGTERM, in ms [default: 30000].
    #[arg(long, env = "OUTBOX_SHUTDOWN_GRACE_MS")]
    pub(crate) shutdown_grace_ms: Option<u64>,
    /// Create or upgrade the outbox tables before starting.
    #[arg(long, env = "OUTBOX_MIGRATE")]
    pub(crate) migrate: Option<bool>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9464
    /// [default: off].
    #[arg(long, env = "OUTBOX_METRICS_ADDR", value_name = "ADDR")]
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,
}

/// The config file: the same keys as the `run` flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    store: Option<String>,
    sink: Option<String>,
    pg_schema: Option<String>,
    pg_table: Option<String>,
    nats_subject_prefix: Option<String>,
    amqp_exchange: Option<String>,
    kafka_topic_prefix: Option<String>,
    #[serde(default)]
    kafka_properties: BTreeMap<String, String>,
    batch_size: Option<u32>,
    poll_interval_ms: Option<u64>,
    lock_timeout_ms: Option<u64>,
    retry_base_ms: Option<u64>,
    retry_cap_ms: Option<u64>,
    max_attempts: Option<u32>,
    shard: Option<String>,
    lag_alert_secs: Option<u64>,
    metrics_addr: Option<std::net::SocketAddr>,
    relay_id: Option<String>,
    drain: Option<bool>,
    shutdown_grace_ms: Option<u64>,
    migrate: Option<bool>,
}

/// A fully resolved `run` configuration.
#[derive(Debug)]
pub(crate) struct RunConfig {
    pub(crate) store: String,
    pub(crate) sink: String,
    pub(crate) settings: BackendSettings,
    pub(crate) options: RelayOptions,
    pub(crate) migrate: bool,
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,
}

fn load_file(explicit: Option<&Path>) -> anyhow::Result<(FileConfig, Option<PathBuf>)> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => {
            let p = PathBuf::from(DEFAULT_CONFIG);
            if !p.exists() {
                return Ok((FileConfig::default(), None));
            }
            p
        }
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    let config: FileConfig =
        toml::from_str(&text).with_context(|| format!("invalid config file {}", path.display()))?;
    Ok((config, Some(path)))
}

fn config_name(path: Option<&Path>) -> String {
    path.map_or_else(|| DEFAULT_CONFIG.to_owned(), |p| p.display().to_string())
}

/// The store URL and its settings from flags, env or the config file.
pub(crate) fn resolve_store(args: &StoreArgs) -> anyhow::Result<(String, BackendSettings)> {
    let (file, path) = load_file(args.config.as_deref())?;
    let url = pick_store(args.store.clone(), file.store.clone(), path.as_deref())?;
    Ok((url, store_settings(args, &file)))
}

fn store_settings(args: &StoreArgs, file: &FileConfig) -> BackendSettings {
    let mut settings = BackendSettings::default();
    settings.pg_schema = args.pg_schema.clone().or_else(|| file.pg_schema.clone());
    settings.pg_table = args.pg_table.clone().or_else(|| file.pg_table.clone());
    settings
}

fn pick_store(
    flag: Option<String>,
    file: Option<String>,
    path: Option<&Path>,
) -> anyhow::Result<String> {
    match flag.or(file) {
        Some(s) if !s.trim().is_empty() => Ok(s),
        _ => bail!(
            "no store configured: pass --store sqlite://outbox.db, set OUTBOX_STORE, or add `store = \"sqlite://outbox.db\"` to {}",
            config_name(path)
        ),
    }
}

/// Resolves every `run` setting.
pub(crate) fn resolve_run(args: RunArgs) -> anyhow::Result<RunConfig> {
    let (file, path) = load_file(args.store.config.as_deref())?;
    let store = pick_store(
        args.store.store.clone(),
        file.store.clone(),
        path.as_deref(),
    )?;
    let mut settings = store_settings(&args.store, &file);
    settings.nats_subject_prefix = args.nats_subject_prefix.or(file.nats_subject_prefix);
    settings.amqp_exchange = args.amqp_exchange.or(file.amqp_exchange);
    settings.kafka_topic_prefix = args.kafka_topic_prefix.or(file.kafka_topic_prefix);
    settings.kafka_properties = file.kafka_properties;
    for prop in &args.kafka_property {
        let Some((name, value)) = prop.split_once('=') else {
            bail!("--kafka-property {prop:?} must be NAME=VALUE, e.g. compression.type=lz4");
        };
        settings
            .kafka_properties
            .insert(name.trim().to_owned(), value.to_owned());
    }
    let sink = match args.sink.or(file.sink) {
        Some(s) if !s.trim().is_empty() => s,
        _ => bail!(
            "no sink configured: pass --sink stdout (or jsonl:events.jsonl, nats://127.0.0.1:4222, amqp://guest:guest@127.0.0.1:5672/%2f, kafka://127.0.0.1:9092), set OUTBOX_SINK, or add `sink = \"stdout\"` to {}",
            config_name(path.as_deref())
        ),
    };
    let defaults = RelayOptions::default();
    let ms = |flag: Option<u64>, file: Option<u64>, default: Duration| {
        flag.or(file).map_or(default, Duration::from_millis)
    };
    let retry_default = defaults.retry();
    let retry = RetryPolicy::new(
        ms(args.retry_base_ms, file.retry_base_ms, retry_default.base()),
        ms(args.retry_cap_ms, file.retry_cap_ms, retry_default.cap()),
        args.max_attempts
            .or(file.max_attempts)
            .unwrap_or(retry_default.max_attempts()),
        Jitter::Equal,
    )
    .context("invalid retry settings (retry_base_ms, retry_cap_ms, max_attempts)")?;
    let shard = match (args.shard, file.shard) {
        (Some(s), _) => s,
        (None, Some(s)) => s
            .parse::<ShardSpec>()
            .with_context(|| format!("invalid `shard` in {}", config_name(path.as_deref())))?,
        (None, None) => ShardSpec::ALL,
    };
    let mut options = defaults
        .clone()
        .with_batch_size(
            args.batch_size
                .or(file.batch_size)
                .unwrap_or(defaults.batch_size()),
        )
        .with_poll_interval(ms(
            args.poll_interval_ms,
            file.poll_interval_ms,
            defaults.poll_interval(),
        ))
        .with_lock_timeout(ms(
            args.lock_timeout_ms,
            file.lock_timeout_ms,
            defaults.lock_timeout(),
        ))
        .with_retry(retry)
        .with_shard(shard)
        .with_lag_alert(
            args.lag_alert_secs
                .or(file.lag_alert_secs)
                .map_or(defaults.lag_alert(), Duration::from_secs),
        )
        .with_drain(args.drain.or(file.drain).unwrap_or(true))
        .with_shutdown_grace(ms(
            args.shutdown_grace_ms,
            file.shutdown_grace_ms,
            defaults.shutdown_grace(),
        ));
    if let Some(id) = args.relay_id.or(file.relay_id) {
        options = options.with_relay_id(RelayId::new(id));
    }
    options.validate().context("invalid relay settings")?;
    Ok(RunConfig {
        store,
        sink,
        settings,
        options,
        migrate: args.migrate.or(file.migrate).unwrap_or(false),
        metrics_addr: args.metrics_addr.or(file.metrics_addr),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_store_names_the_fix() {
        let err = pick_store(None, None, None).unwrap_err().to_string();
        assert!(err.contains("--store sqlite://"), "{err}");
        assert!(err.contains("OUTBOX_STORE"), "{err}");
        assert!(err.contains("outbox.toml"), "{err}");
    }

    #[test]
    fn unknown_config_keys_are_rejected() {
        let err = toml::from_str::<FileConfig>("stor = \"x\"").unwrap_err();
        assert!(err.to_string().contains("stor"), "{err}");
        let ok: FileConfig =
            toml::from_str("store = \"sqlite://a.db\"\nbatch_size = 5\nshard = \"1/4\"").unwrap();
        assert_eq!(ok.batch_size, Some(5));
    }
}
