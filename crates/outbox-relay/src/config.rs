//! Settings of every command: flags > environment > `outbox.toml` > defaults.
//!
//! No backend setting is named here: the flags, environment variables and
//! config-file keys of the store and sink backends come from their crates'
//! descriptors ([`crate::backends`]). The relay's own settings are declared
//! once below in the same form ([`Setting`]), so one piece of code turns
//! every setting into a clap argument, reads it back with its source, and
//! generates the README's table ([`crate::table`]).

use crate::backends::{self, Section};
use anyhow::{anyhow, bail, Context as _};
use clap::builder::BoolishValueParser;
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Args, Command, FromArgMatches};
use outbox_core::backend::{
    Descriptor, InvalidSetting, Role, Setting, SettingKind, SettingValue, Settings,
};
use outbox_core::cloudevents::Source as CloudEventsSource;
use outbox_core::{Jitter, RelayId, RetryPolicy, ShardSpec, WireFormat, DEFAULT_GROUP};
use outbox_worker::RelayOptions;
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The default config file, read when present and `--config` is not given.
pub(crate) const DEFAULT_CONFIG: &str = "outbox.toml";

const STORE_KEY: &str = "store";
const CONFIG_KEY: &str = "config";
const SINK_KEY: &str = "sink";
const GROUP_KEY: &str = "group";
const START_FROM_KEY: &str = "start_from";
const STORES_KEY: &str = "stores";

/// Where the store is: every command that talks to one.
const STORE: &[Setting] = &[
    Setting::text(
        STORE_KEY,
        "Store URL. `run`, `status` and `console` take several, each named: `--store NAME=URL` (repeated); `run` runs one relay per store delivering to one sink, its metrics and logs labelled store=NAME.",
    )
    .with_value_name("URL"),
    Setting::text(
        STORES_KEY,
        "`run`, `status`, `console`: a TOML file listing named stores, `[[store]]` tables of `name`, `url` and that store's own settings (group, schema, table, mode, pooler, batch_size, ...: the keys of outbox.toml); added to the `--store NAME=URL` ones.",
    )
    .with_value_name("FILE"),
    Setting::text(
        CONFIG_KEY,
        "TOML file of settings keyed by name (`batch_size = 50`); ./outbox.toml is read when it exists.",
    )
    .with_value_name("PATH"),
    Setting::text(
        GROUP_KEY,
        "Consumer group (PostgreSQL event log): every group receives every event, with its own cursors, retry lane and dead letters; the relays of one group share its shards. `status`, `dead` and `group` commands read this group. 1-63 ASCII letters, digits, `_`, `-`, `.`.",
    )
    .with_default(DEFAULT_GROUP)
    .with_value_name("NAME"),
];

const WIRE_FORMAT_KEY: &str = "wire_format";
const CLOUDEVENTS_SOURCE_KEY: &str = "cloudevents_source";

/// Where events go: `run`.
const SINK: &[Setting] = &[
    Setting::text(
        SINK_KEY,
        "Where events go: `stdout`, `jsonl:PATH` or a broker URL.",
    )
    .with_value_name("SINK"),
    Setting::text(
        WIRE_FORMAT_KEY,
        "How a broker sink lays events out: `headers` (the payload as the message body, the metadata in headers), `envelope` (the protobuf outbox.v1.Envelope as the body, content type application/x-protobuf, header Outbox-Wire-Format: outbox.v1.Envelope), `cloudevents` (CloudEvents 1.0 binary mode: the payload as the body, the attributes as ce_ / ce- / cloudEvents: headers) or `cloudevents-json` (CloudEvents 1.0 structured mode, application/cloudevents+json). The CloudEvents formats need `cloudevents_source`. Any format but `headers` with the stdout or jsonl: sink is refused: they write JSON lines.",
    )
    .with_default("headers")
    .with_value_name("FORMAT"),
    Setting::text(
        CLOUDEVENTS_SOURCE_KEY,
        "The CloudEvents `source` attribute of every event (a URI-reference, e.g. /orders or https://example.com/orders): required by the `cloudevents` and `cloudevents-json` wire formats.",
    )
    .with_value_name("URI"),
];

/// `max_batch_size`: the one relay setting whose default is not the
/// library's. The library keeps `batch_size` (no growth, the seed's
/// behaviour); a deployed relay drains backlogs in batches of up to 1,000.
const MAX_BATCH_KEY: &str = "max_batch_size";
/// Its default in the binary (raised to `batch_size` when that is larger).
const DEFAULT_MAX_BATCH: u32 = 1000;

/// The relay loop: `run`. The defaults are `RelayOptions::default()`'s (the
/// `relay_defaults_are_the_library_defaults` test keeps them equal).
const RELAY: &[Setting] = &[
    Setting::integer("batch_size", "Most events per claim while the relay keeps up.")
        .with_default("20"),
    Setting::integer(
        MAX_BATCH_KEY,
        "Most events per claim while the relay catches up with a backlog: each full claim doubles the next one up to this; a short claim returns to batch_size. At least batch_size; equal to it: batches never grow.",
    )
    .with_default("1000"),
    Setting::integer("poll_interval_ms", "Wait between claims when idle, in ms.")
        .with_default("2000"),
    Setting::integer("lock_timeout_ms", "Lease length of a claim, in ms.").with_default("60000"),
    Setting::integer("retry_base_ms", "First retry delay, in ms.").with_default("1000"),
    Setting::integer("retry_cap_ms", "Largest retry delay, in ms.").with_default("900000"),
    Setting::integer("max_attempts", "Attempts before an event is dead-lettered.")
        .with_default("8"),
    Setting::text(
        "shard",
        "This relay's shard as INDEX/TOTAL: it owns the keys hashing to INDEX.",
    )
    .with_default("0/1")
    .with_value_name("INDEX/TOTAL"),
    Setting::integer("lag_alert_secs", "Lag alert threshold, in seconds.").with_default("300"),
    Setting::text(
        START_FROM_KEY,
        "Where a consumer group that has no cursors yet starts (PostgreSQL event log): `oldest` (the oldest retained event) or `now` (only events committed from now on). Ignored once the group has cursors.",
    )
    .with_default("oldest")
    .with_value_name("START"),
    Setting::text(
        "relay_id",
        "Lease owner id. The relay appends `#` and 6 random hex digits per process (`relay-a#3f09c2`), so two processes started with the same id never share leases; logs and `status` show the full id.",
    )
        .with_default("relay-<pid>-<random>")
        .with_value_name("ID"),
    Setting::bool("drain", "Claim again at once after a full batch.").with_default("true"),
    Setting::integer(
        "shutdown_grace_ms",
        "How long an in-flight batch may finish after SIGINT/SIGTERM, in ms.",
    )
    .with_default("30000"),
    Setting::integer(
        "delivery_timeout_ms",
        "Longest a sink may take for one batch, in ms; then the delivery is cancelled and its events released without an attempt. At most lock_timeout_ms (a batch is delivered within one lease); a longer value is refused at start.",
    )
    .with_default("lock_timeout_ms"),
    Setting::integer(
        "max_rate",
        "Most events handed to the sink per second (a token bucket of one batch: a batch waits for its tokens, bursts up to one batch); unset: no limit.",
    )
    .with_value_name("EVENTS_PER_SEC"),
    Setting::bool("migrate", "Create or upgrade the outbox tables before starting.")
        .with_default("false"),
    Setting::text(
        "metrics_addr",
        "Serve http://ADDR/metrics (Prometheus, feature `prometheus`), /healthz and /readyz (store answered, sink breaker closed, shard leases held), e.g. 127.0.0.1:9464.",
    )
    .with_value_name("ADDR"),
    Setting::text(
        CONSOLE_ADDR_KEY,
        "Serve the operator console (the pages of `outbox-relay console`, feature `console`) at http://ADDR/ beside the relay, e.g. 127.0.0.1:8089; with metrics_addr set, the overview shows this relay's sink state. Read-only unless an admin token is given.",
    )
    .with_value_name("ADDR"),
    Setting::bool(
        "console_allow_remote",
        "Serve the console on a non-loopback console_addr (put TLS in front of it: the console speaks plain HTTP).",
    )
    .with_default("false"),
    Setting::text(
        "console_allowed_hosts",
        "Host names the console also answers to, comma-separated (NAME or NAME:PORT: a proxy's or a DNS name of yours), besides console_addr (and localhost on loopback); a request naming another host is refused (421), so a web page cannot reach the console through DNS rebinding.",
    )
    .with_value_name("NAMES"),
    Setting::text(
        "console_admin_token_file",
        "A file holding the console's admin token (at least 16 characters); without one the console is read-only.",
    )
    .with_value_name("FILE"),
    Setting::text(
        "console_admin_token_env",
        "The environment variable holding the console's admin token (instead of console_admin_token_file).",
    )
    .with_value_name("VAR"),
];

/// `run`'s setting that serves the console beside the relay.
const CONSOLE_ADDR_KEY: &str = "console_addr";

/// Settings without a default that a command cannot do without.
pub(crate) const REQUIRED: &[&str] = &[STORE_KEY, SINK_KEY];

/// The settings of the commands that open a store.
pub(crate) fn store_sections() -> Vec<Section> {
    std::iter::once(Section::relay(STORE))
        .chain(backends::compiled(Role::Store).map(Section::backend))
        .collect()
}

/// The settings `run` adds to [`store_sections`].
fn run_sections() -> Vec<Section> {
    [Section::relay(SINK), Section::relay(RELAY)]
        .into_iter()
        .chain(backends::compiled(Role::Sink).map(Section::backend))
        .collect()
}

/// Every setting of this build, in table order.
pub(crate) fn all_sections() -> Vec<Section> {
    let mut all = store_sections();
    all.extend(run_sections());
    all
}

/// The setting whose config-file key is `key`.
fn find(key: &str) -> Option<(Section, &'static Setting)> {
    all_sections().into_iter().find_map(|section| {
        section
            .settings
            .iter()
            .find(|s| section.key(s) == key)
            .map(|s| (section, s))
    })
}

/// Help text computed from this build: the URL schemes it knows.
pub(crate) fn build_note(section: &Section, s: &Setting) -> Option<String> {
    if section.backend.is_some() {
        return None;
    }
    match s.name() {
        STORE_KEY => Some(format!("Schemes: {}.", backends::schemes(Role::Store))),
        SINK_KEY => {
            let brokers = backends::schemes(Role::Sink);
            Some(if brokers.is_empty() {
                "No broker in this build.".to_owned()
            } else {
                format!("Brokers: {brokers}.")
            })
        }
        _ => None,
    }
}

fn arg(section: &Section, s: &'static Setting) -> Arg {
    let mut help = s.help().to_owned();
    if let Some(note) = build_note(section, s) {
        help = format!("{help} {note}");
    }
    if let Some(default) = s.default() {
        help = format!("{help} [default: {}]", shown_default(default));
    }
    let mut arg = Arg::new(section.key(s))
        // `--store` repeats (`run` over several stores); the last one
        // counts as the one store of the other commands.
        .action(if section.backend.is_none() && s.name() == STORE_KEY {
            ArgAction::Append
        } else {
            ArgAction::Set
        })
        .long(section.flag(s))
        .value_name(s.value_name())
        .help(help)
        // An environment value may be a URL with a password.
        .hide_env_values(true);
    if let Some(env) = section.env(s) {
        arg = arg.env(env);
    }
    match s.kind() {
        // `--migrate` alone means true; `--drain false` still works.
        SettingKind::Bool => arg
            .value_parser(BoolishValueParser::new())
            .num_args(0..=1)
            .default_missing_value("true"),
        SettingKind::Integer => arg.value_parser(clap::value_parser!(u64)),
        SettingKind::Map { .. } => arg.action(ArgAction::Append).value_parser(parse_pair),
        _ => arg,
    }
}

/// A default as shown in help and in the table: `""` for the empty string.
pub(crate) fn shown_default(default: &str) -> &str {
    if default.is_empty() {
        "\"\""
    } else {
        default
    }
}

fn parse_pair(s: &str) -> Result<String, String> {
    match s.split_once('=') {
        Some((name, _)) if !name.trim().is_empty() => Ok(s.to_owned()),
        _ => Err("expected NAME=VALUE, e.g. compression.type=lz4".to_owned()),
    }
}

fn augment(cmd: Command, sections: &[Section]) -> Command {
    sections.iter().fold(cmd, |cmd, section| {
        cmd.args(section.settings.iter().map(|s| arg(section, s)))
    })
}

/// Where a value came from, for error messages.
#[derive(Debug, Clone)]
enum Source {
    Flag(String),
    Env(String),
    File { key: String, path: PathBuf },
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag(flag) => write!(f, "--{flag}"),
            Source::Env(var) => f.write_str(var),
            Source::File { key, path } => write!(f, "`{key}` in {}", path.display()),
        }
    }
}

#[derive(Debug, Clone)]
struct Entry {
    value: SettingValue,
    source: Source,
}

/// Values by config-file key, with where each came from.
#[derive(Debug, Clone, Default)]
struct Layer {
    entries: BTreeMap<String, Entry>,
}

impl Layer {
    fn from_matches(m: &ArgMatches, sections: &[Section]) -> Self {
        let mut entries = BTreeMap::new();
        for section in sections {
            for s in section.settings {
                let id = section.key(s);
                let source = match m.value_source(&id) {
                    Some(ValueSource::CommandLine) => Source::Flag(section.flag(s)),
                    Some(ValueSource::EnvVariable) => {
                        Source::Env(section.env(s).unwrap_or_default())
                    }
                    _ => continue,
                };
                let raw: Vec<String> = m
                    .get_raw(&id)
                    .into_iter()
                    .flatten()
                    .map(|v| v.to_string_lossy().into_owned())
                    .collect();
                let value = match s.kind() {
                    SettingKind::Map { .. } => SettingValue::Map(
                        raw.iter()
                            .filter_map(|pair| pair.split_once('='))
                            .map(|(k, v)| (k.trim().to_owned(), v.to_owned()))
                            .collect(),
                    ),
                    _ => SettingValue::Text(raw.last().cloned().unwrap_or_default()),
                };
                entries.insert(id, Entry { value, source });
            }
        }
        Self { entries }
    }

    /// `self` with `top`'s values on top; maps are merged entry by entry.
    fn overlaid(mut self, top: &Layer) -> Self {
        for (key, entry) in &top.entries {
            match (self.entries.get_mut(key), &entry.value) {
                (
                    Some(Entry {
                        value: SettingValue::Map(below),
                        source,
                    }),
                    SettingValue::Map(above),
                ) => {
                    below.extend(above.iter().map(|(k, v)| (k.clone(), v.clone())));
                    *source = entry.source.clone();
                }
                _ => {
                    self.entries.insert(key.clone(), entry.clone());
                }
            }
        }
        self
    }

    fn text(&self, key: &str) -> Option<&str> {
        match self.entries.get(key).map(|e| &e.value) {
            Some(SettingValue::Text(s)) => Some(s),
            _ => None,
        }
    }
}

/// The settings of a command that opens a store (`--store`, `--config`, and
/// each compiled store backend's settings).
#[derive(Debug, Clone)]
pub(crate) struct StoreArgs {
    layer: Layer,
    /// Every `--store` given on the command line, in order.
    store_flags: Vec<String>,
}

impl Args for StoreArgs {
    fn augment_args(cmd: Command) -> Command {
        augment(cmd, &store_sections())
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for StoreArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let store_flags = match m.value_source(STORE_KEY) {
            Some(ValueSource::CommandLine) => m
                .get_raw(STORE_KEY)
                .into_iter()
                .flatten()
                .map(|v| v.to_string_lossy().into_owned())
                .collect(),
            _ => Vec::new(),
        };
        Ok(Self {
            layer: Layer::from_matches(m, &store_sections()),
            store_flags,
        })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl StoreArgs {
    /// The command line and environment on top of the config file.
    pub(crate) fn resolve(&self) -> anyhow::Result<Resolved> {
        Resolved::load(&self.layer, &self.store_flags)
    }
}

/// The settings of `run`: [`StoreArgs`] plus the sink, the relay loop and
/// each compiled sink backend's settings.
#[derive(Debug, Clone)]
pub(crate) struct RunArgs {
    store: StoreArgs,
    layer: Layer,
}

impl Args for RunArgs {
    fn augment_args(cmd: Command) -> Command {
        augment(StoreArgs::augment_args(cmd), &run_sections())
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for RunArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(Self {
            store: StoreArgs::from_arg_matches(m)?,
            layer: Layer::from_matches(m, &run_sections()),
        })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl RunArgs {
    /// The command line and environment on top of the config file.
    pub(crate) fn resolve(&self) -> anyhow::Result<Resolved> {
        Resolved::load(
            &self.store.layer.clone().overlaid(&self.layer),
            &self.store.store_flags,
        )
    }
}

/// Every setting's value after layering, with its source.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    layer: Layer,
    file: Option<PathBuf>,
    /// Every `--store` of the command line (see [`stores`]).
    store_flags: Vec<String>,
}

impl Resolved {
    fn load(cli: &Layer, store_flags: &[String]) -> anyhow::Result<Self> {
        let explicit = cli.text(CONFIG_KEY).map(PathBuf::from);
        let (file, path) = load_file(explicit.as_deref())?;
        Ok(Self {
            layer: file.overlaid(cli),
            file: path,
            store_flags: store_flags.to_vec(),
        })
    }

    fn config_name(&self) -> String {
        self.file
            .as_deref()
            .map_or_else(|| DEFAULT_CONFIG.to_owned(), |p| p.display().to_string())
    }

    /// Where the value of `key` came from, or its flag when it was not given.
    fn origin(&self, key: &str) -> String {
        match self.layer.entries.get(key) {
            Some(entry) => entry.source.to_string(),
            None => find(key).map_or_else(
                || key.to_owned(),
                |(section, s)| format!("--{}", section.flag(s)),
            ),
        }
    }

    fn text(&self, key: &str) -> Option<&str> {
        debug_assert!(find(key).is_some(), "undeclared setting {key}");
        self.layer.text(key)
    }

    /// `key` parsed; the error names where the value came from.
    pub(crate) fn parse<T>(&self, key: &str) -> anyhow::Result<Option<T>>
    where
        T: std::str::FromStr,
        T::Err: fmt::Display,
    {
        let Some(text) = self.text(key) else {
            return Ok(None);
        };
        text.trim()
            .parse::<T>()
            .map(Some)
            .map_err(|e| anyhow!("invalid {} {text:?}: {e}", self.origin(key)))
    }

    fn bool(&self, key: &str) -> anyhow::Result<Option<bool>> {
        let Some(text) = self.text(key) else {
            return Ok(None);
        };
        outbox_core::backend::parse_bool(text)
            .map(Some)
            .ok_or_else(|| {
                anyhow!(
                    "invalid {} {text:?}: expected true or false",
                    self.origin(key)
                )
            })
    }

    /// The store URL.
    pub(crate) fn store_url(&self) -> anyhow::Result<String> {
        if self.names_several_stores() {
            bail!(
                "this command works on one store: pass --store URL (only `run`, `status` and `console` take several stores, --store NAME=URL or {})",
                self.origin(STORES_KEY)
            );
        }
        match self.text(STORE_KEY) {
            Some(s) if !s.trim().is_empty() => Ok(s.trim().to_owned()),
            _ => bail!(
                "no store configured: pass --store sqlite://outbox.db, set OUTBOX_STORE, or add `store = \"sqlite://outbox.db\"` to {}",
                self.config_name()
            ),
        }
    }

    /// The consumer group and, for `run`, where a new group starts.
    pub(crate) fn scope(&self) -> anyhow::Result<GroupScope> {
        let group = match self.text(GROUP_KEY).map(str::trim) {
            None => None,
            Some(name) => {
                #[cfg(feature = "postgres")]
                outbox_postgres::GroupName::new(name)
                    .map_err(|e| anyhow!("invalid {} {name:?}: {e}", self.origin(GROUP_KEY)))?;
                Some(name.to_owned())
            }
        };
        let start_now = match self.layer.text(START_FROM_KEY).map(str::trim) {
            None | Some("oldest") => false,
            Some("now") => true,
            Some(other) => bail!(
                "invalid {} {other:?}: use `oldest` or `now`",
                self.origin(START_FROM_KEY)
            ),
        };
        Ok(GroupScope {
            group,
            group_origin: self.origin(GROUP_KEY),
            start_now,
        })
    }

    /// The sink.
    pub(crate) fn sink(&self) -> anyhow::Result<String> {
        match self.text(SINK_KEY) {
            Some(s) if !s.trim().is_empty() => Ok(s.trim().to_owned()),
            _ => bail!(
                "no sink configured: pass --sink stdout (or jsonl:events.jsonl, or a broker URL such as nats://127.0.0.1:4222, amqp://guest:guest@127.0.0.1:5672/%2f, kafka://127.0.0.1:9092), set OUTBOX_SINK, or add `sink = \"stdout\"` to {}",
                self.config_name()
            ),
        }
    }

    /// The values given for `d`'s settings, by setting name.
    pub(crate) fn backend_settings(&self, d: &Descriptor) -> Settings {
        let mut settings = Settings::new();
        for s in d.settings() {
            if let Some(entry) = self.layer.entries.get(&d.key(s)) {
                settings.insert(s.name(), entry.value.clone());
            }
        }
        settings
    }

    /// A backend's refusal, told with the flag (or variable, or file key)
    /// the value came from.
    pub(crate) fn explain_invalid(&self, d: &Descriptor, e: &InvalidSetting) -> anyhow::Error {
        let role = role_name(d.role());
        if e.setting() == InvalidSetting::URL {
            let key = if d.role() == Role::Store {
                STORE_KEY
            } else {
                SINK_KEY
            };
            return anyhow!("invalid {role} URL ({}): {}", self.origin(key), e.reason());
        }
        let origin = d
            .setting(e.setting())
            .map_or_else(|| e.setting().to_owned(), |s| self.origin(&d.key(s)));
        anyhow!("invalid {role} setting {origin}: {}", e.reason())
    }

    /// Strings that must never be printed: the passwords of the store and
    /// sink URLs and the values of secret-looking map entries.
    pub(crate) fn secrets(&self) -> Vec<String> {
        let mut secrets = Vec::new();
        for key in [STORE_KEY, SINK_KEY] {
            if let Some(url) = self.layer.text(key) {
                secrets.extend(crate::report::url_secrets(url));
            }
        }
        for entry in self.layer.entries.values() {
            if let SettingValue::Map(map) = &entry.value {
                secrets.extend(
                    map.iter()
                        .filter(|(k, _)| crate::report::looks_secret(k))
                        .map(|(_, v)| v.clone()),
                );
            }
        }
        secrets
    }
}

/// Which consumer group a command works on (PostgreSQL event log).
#[derive(Debug, Clone, Default)]
pub(crate) struct GroupScope {
    /// The group, when one was given (`None`: the store's default group).
    pub(crate) group: Option<String>,
    /// Where it was given (flag, variable or file key), for errors.
    pub(crate) group_origin: String,
    /// A group without cursors starts now (`--start-from now`), not at the
    /// oldest retained event.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) start_now: bool,
}

impl GroupScope {
    /// The group named, unless it is the default group.
    pub(crate) fn named(&self) -> Option<&str> {
        self.group.as_deref().filter(|g| *g != DEFAULT_GROUP)
    }
}

/// `store` / `sink`.
pub(crate) fn role_name(role: Role) -> &'static str {
    match role {
        Role::Store => "store",
        Role::Sink => "sink",
        _ => "backend",
    }
}

fn load_file(explicit: Option<&Path>) -> anyhow::Result<(Layer, Option<PathBuf>)> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => {
            let p = PathBuf::from(DEFAULT_CONFIG);
            if !p.exists() {
                return Ok((Layer::default(), None));
            }
            p
        }
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    let table: toml::Table =
        toml::from_str(&text).with_context(|| format!("invalid config file {}", path.display()))?;
    let layer = file_layer(table, &path)?;
    Ok((layer, Some(path)))
}

/// The config file's values, each key checked against the settings.
fn file_layer(table: toml::Table, path: &Path) -> anyhow::Result<Layer> {
    let mut entries = BTreeMap::new();
    for (key, value) in table {
        let Some((_, setting)) = find(&key).filter(|_| key != CONFIG_KEY) else {
            if let Some(k) =
                backends::missing().find(|k| key.starts_with(&format!("{}_", k.prefix)))
            {
                tracing::warn!(
                    "ignoring `{key}` in {}: the {} backend is not compiled into this build (feature `{}`)",
                    path.display(), k.feature, k.feature
                );
                continue;
            }
            bail!("unknown key `{key}` in {}", path.display());
        };
        let value = match (setting.kind(), value) {
            (SettingKind::Map { .. }, toml::Value::Table(t)) => SettingValue::Map(
                t.into_iter()
                    .map(|(k, v)| scalar(&v).map(|v| (k, v)))
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        anyhow!(
                            "`{key}` in {} must hold NAME = \"VALUE\" pairs",
                            path.display()
                        )
                    })?,
            ),
            (SettingKind::Map { .. }, _) => bail!(
                "`{key}` in {} must be a table, e.g. [{key}]",
                path.display()
            ),
            (_, v) => SettingValue::Text(scalar(&v).ok_or_else(|| {
                anyhow!(
                    "`{key}` in {} must be a string, a number or a boolean",
                    path.display()
                )
            })?),
        };
        let source = Source::File {
            key: key.clone(),
            path: path.to_path_buf(),
        };
        entries.insert(key, Entry { value, source });
    }
    Ok(Layer { entries })
}

fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// A fully resolved `run` configuration (backend settings stay in
/// [`Resolved`] until the backends are opened).
#[derive(Debug)]
pub(crate) struct RunConfig {
    pub(crate) sink: String,
    /// How a broker sink lays events out (`--wire-format`).
    pub(crate) wire_format: WireFormat,
    /// The CloudEvents `source` (`--cloudevents-source`).
    pub(crate) cloudevents_source: Option<CloudEventsSource>,
    pub(crate) options: RelayOptions,
    pub(crate) migrate: bool,
    pub(crate) metrics_addr: Option<SocketAddr>,
    /// The console to serve beside the relay (`--console-addr`).
    #[cfg_attr(not(feature = "console"), allow(dead_code))]
    pub(crate) console: Option<ConsoleConfig>,
}

/// `run`'s console settings, resolved (the token file is read at start).
#[derive(Debug)]
#[cfg_attr(not(feature = "console"), allow(dead_code))]
pub(crate) struct ConsoleConfig {
    pub(crate) listen: SocketAddr,
    pub(crate) allow_remote: bool,
    pub(crate) token_file: Option<PathBuf>,
    pub(crate) token_env: Option<String>,
    /// Host names the console answers to besides `listen`.
    pub(crate) allowed_hosts: Vec<String>,
}

/// The console settings of `run`: none without `console_addr`; refused
/// when this build has no console, and when both token sources are given.
fn console_config(r: &Resolved) -> anyhow::Result<Option<ConsoleConfig>> {
    let token_file = r.text("console_admin_token_file").map(PathBuf::from);
    let token_env = r.text("console_admin_token_env").map(str::to_owned);
    let Some(listen) = r.parse::<SocketAddr>(CONSOLE_ADDR_KEY)? else {
        if token_file.is_some() || token_env.is_some() {
            bail!(
                "a console admin token is set but no console is served: add {} (e.g. 127.0.0.1:8089)",
                r.origin(CONSOLE_ADDR_KEY)
            );
        }
        return Ok(None);
    };
    if !cfg!(feature = "console") {
        bail!(
            "{} asks for the console, but this build has no console: build outbox-relay with the `console` feature",
            r.origin(CONSOLE_ADDR_KEY)
        );
    }
    if token_file.is_some() && token_env.is_some() {
        bail!(
            "{} and {} both name the console's admin token: give one",
            r.origin("console_admin_token_file"),
            r.origin("console_admin_token_env")
        );
    }
    Ok(Some(ConsoleConfig {
        listen,
        allow_remote: r.bool("console_allow_remote")?.unwrap_or(false),
        token_file,
        token_env,
        allowed_hosts: r
            .text("console_allowed_hosts")
            .map(|t| {
                t.split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default(),
    }))
}

/// The relay's own settings of `run`.
pub(crate) fn run_config(r: &Resolved) -> anyhow::Result<RunConfig> {
    let sink = r.sink()?;
    let wire_format = r.parse::<WireFormat>(WIRE_FORMAT_KEY)?.unwrap_or_default();
    if wire_format != WireFormat::Headers && backends::is_local_sink(&sink) {
        // Refused, not ignored: whoever asked for envelopes expects a
        // consumer to decode them, and would silently get JSON instead.
        bail!(
            "{} is {wire_format}, but sink {sink:?} writes JSON lines: the wire format applies to broker sinks only (nats://, amqp://, kafka://); remove it or use `headers`",
            r.origin(WIRE_FORMAT_KEY)
        );
    }
    let cloudevents_source = r.parse::<CloudEventsSource>(CLOUDEVENTS_SOURCE_KEY)?;
    if wire_format.is_cloudevents() && cloudevents_source.is_none() {
        bail!(
            "{} is {wire_format}, which needs the CloudEvents source attribute: set {} to a URI-reference naming where the events come from, e.g. /orders or https://example.com/orders",
            r.origin(WIRE_FORMAT_KEY),
            r.origin(CLOUDEVENTS_SOURCE_KEY)
        );
    }
    let defaults = RelayOptions::default();
    let ms = |key: &str, default: Duration| -> anyhow::Result<Duration> {
        Ok(r.parse::<u64>(key)?.map_or(default, Duration::from_millis))
    };
    let retry_default = defaults.retry();
    let retry = RetryPolicy::new(
        ms("retry_base_ms", retry_default.base())?,
        ms("retry_cap_ms", retry_default.cap())?,
        r.parse::<u32>("max_attempts")?
            .unwrap_or(retry_default.max_attempts()),
        Jitter::Equal,
    )
    .context("invalid retry settings (retry_base_ms, retry_cap_ms, max_attempts)")?;
    let batch_size = r
        .parse::<u32>("batch_size")?
        .unwrap_or(defaults.batch_size());
    let max_batch_size = r
        .parse::<u32>(MAX_BATCH_KEY)?
        .unwrap_or(DEFAULT_MAX_BATCH.max(batch_size));
    let mut options = defaults
        .clone()
        .with_batch_size(batch_size)
        .with_max_batch_size(Some(max_batch_size))
        .with_poll_interval(ms("poll_interval_ms", defaults.poll_interval())?)
        .with_lock_timeout(ms("lock_timeout_ms", defaults.lock_timeout())?)
        .with_retry(retry)
        .with_shard(r.parse::<ShardSpec>("shard")?.unwrap_or(ShardSpec::ALL))
        .with_lag_alert(
            r.parse::<u64>("lag_alert_secs")?
                .map_or(defaults.lag_alert(), Duration::from_secs),
        )
        .with_drain(r.bool("drain")?.unwrap_or(defaults.drain()))
        .with_shutdown_grace(ms("shutdown_grace_ms", defaults.shutdown_grace())?)
        .with_max_rate(r.parse::<u32>("max_rate")?);
    // Unset: the lock timeout (whatever it was set to).
    if let Some(d) = r.parse::<u64>("delivery_timeout_ms")? {
        options = options.with_delivery_timeout(Duration::from_millis(d));
    }
    if let Some(id) = r.text("relay_id") {
        // Unique per process: two relays started with one `--relay-id`
        // (a copy-pasted manifest, a restart while the old process still
        // runs) would otherwise be ONE lease owner to the store, each
        // renewing and settling what the other holds. The configured part
        // stays readable (`RelayId::configured`); no metric is labelled by
        // the relay id, so the suffix adds no series.
        options = options.with_relay_id(RelayId::unique(id));
    }
    options.validate().context("invalid relay settings")?;
    Ok(RunConfig {
        sink,
        wire_format,
        cloudevents_source,
        options,
        migrate: r.bool("migrate")?.unwrap_or(false),
        metrics_addr: r.parse::<SocketAddr>("metrics_addr")?,
        console: console_config(r)?,
    })
}

pub(crate) mod stores;
#[cfg(test)]
mod tests;
