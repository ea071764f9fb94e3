//! Backends describe themselves: what a store or publisher crate tells a
//! runner (the `outbox-relay` binary) about itself.
//!
//! Each store and publisher crate exports a `descriptor` module with one
//! type implementing [`Backend`]: its [`Descriptor`] (name, URL schemes and
//! settings), how it turns a URL plus [`Settings`] into its validated
//! configuration ([`Backend::configure`]), and how it connects
//! ([`Backend::connect`]). A runner derives everything else from that: the
//! command-line flag, environment variable and config-file key of each
//! setting follow one rule ([`Descriptor::flag`], [`Descriptor::env`],
//! [`Descriptor::key`]), and its documentation table is generated from the
//! same data, so no setting is written in four places.
//!
//! This module is plain data and one trait: no I/O, no runtime.
//!
//! ```
//! use outbox_core::backend::{Descriptor, Role, Setting, Settings};
//!
//! const SETTINGS: &[Setting] = &[
//!     Setting::text("schema", "Schema of the outbox tables.").with_default("outbox"),
//! ];
//! const PG: Descriptor = Descriptor::new("postgres", Role::Store, "pg")
//!     .with_schemes(&["postgres", "postgresql"])
//!     .with_example("postgres://user:password@host:5432/db")
//!     .with_settings(SETTINGS);
//!
//! let schema = &PG.settings()[0];
//! assert_eq!(PG.flag(schema), "pg-schema");
//! assert_eq!(PG.env(schema).as_deref(), Some("OUTBOX_PG_SCHEMA"));
//! assert_eq!(PG.key(schema), "pg_schema");
//! assert!(PG.handles("postgresql://db/app"));
//!
//! let values = Settings::new().with_text("schema", "billing");
//! assert_eq!(values.text("schema"), Some("billing"));
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::str::FromStr;

/// The prefix of every environment variable a runner derives from a
/// descriptor (`OUTBOX_PG_SCHEMA`).
pub const ENV_PREFIX: &str = "OUTBOX_";

/// What a backend is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Role {
    /// Where events live (a [`crate::Store`]).
    Store,
    /// Where events go (a [`crate::Sink`]).
    Sink,
}

/// The type of a setting's value, which decides how a runner reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SettingKind {
    /// Free text, validated by the backend.
    Text,
    /// `true` / `false` (a runner also accepts `1`/`0`, `yes`/`no`, `on`/`off`).
    Bool,
    /// A non-negative integer.
    Integer,
    /// `NAME=VALUE` pairs: a repeatable flag named after `item`
    /// (`--kafka-property NAME=VALUE`) and a table in the config file
    /// (`[kafka_properties]`); no environment variable.
    Map {
        /// The flag's noun (`property`).
        item: &'static str,
    },
}

/// One setting of a backend: its name, what it means, its default.
///
/// Built in `const` context: `Setting::text("schema", "...").with_default("outbox")`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Setting {
    name: &'static str,
    help: &'static str,
    kind: SettingKind,
    default: Option<&'static str>,
    value_name: &'static str,
    secret: bool,
}

impl Setting {
    const fn new(name: &'static str, kind: SettingKind, help: &'static str) -> Self {
        Self {
            name,
            help,
            kind,
            default: None,
            value_name: "VALUE",
            secret: false,
        }
    }

    /// A text setting. `name` is snake_case (`subject_prefix`).
    pub const fn text(name: &'static str, help: &'static str) -> Self {
        Self::new(name, SettingKind::Text, help)
    }

    /// A boolean setting.
    pub const fn bool(name: &'static str, help: &'static str) -> Self {
        Self::new(name, SettingKind::Bool, help).with_value_name("BOOL")
    }

    /// An integer setting.
    pub const fn integer(name: &'static str, help: &'static str) -> Self {
        Self::new(name, SettingKind::Integer, help).with_value_name("N")
    }

    /// A map of `NAME=VALUE` pairs; `item` names one pair in the flag
    /// (`map("properties", "property", ..)` gives `--kafka-property`).
    pub const fn map(name: &'static str, item: &'static str, help: &'static str) -> Self {
        Self::new(name, SettingKind::Map { item }, help).with_value_name("NAME=VALUE")
    }

    /// The value used when the setting is not given, as documentation (the
    /// backend applies it).
    pub const fn with_default(mut self, default: &'static str) -> Self {
        self.default = Some(default);
        self
    }

    /// The placeholder shown in help (`URL`, `PREFIX`).
    pub const fn with_value_name(mut self, value_name: &'static str) -> Self {
        self.value_name = value_name;
        self
    }

    /// Marks the values as secrets: never logged or shown.
    pub const fn secret(mut self) -> Self {
        self.secret = true;
        self
    }

    /// The snake_case name, unique within its backend.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// One line of help.
    pub const fn help(&self) -> &'static str {
        self.help
    }

    /// The value's type.
    pub const fn kind(&self) -> SettingKind {
        self.kind
    }

    /// The documented default, `None` when unset means "off" or "none".
    pub const fn default(&self) -> Option<&'static str> {
        self.default
    }

    /// The placeholder shown in help.
    pub const fn value_name(&self) -> &'static str {
        self.value_name
    }

    /// Whether values are secrets.
    pub const fn is_secret(&self) -> bool {
        self.secret
    }
}

/// What a backend says about itself. Built in `const` context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Descriptor {
    name: &'static str,
    role: Role,
    prefix: &'static str,
    schemes: &'static [&'static str],
    example: &'static str,
    settings: &'static [Setting],
}

impl Descriptor {
    /// A backend called `name` (also the runner's cargo feature for it),
    /// whose settings are prefixed by `prefix` (`pg` gives `--pg-schema`).
    pub const fn new(name: &'static str, role: Role, prefix: &'static str) -> Self {
        Self {
            name,
            role,
            prefix,
            schemes: &[],
            example: "",
            settings: &[],
        }
    }

    /// The URL schemes it handles (`postgres`, `postgresql`), lowercase.
    pub const fn with_schemes(mut self, schemes: &'static [&'static str]) -> Self {
        self.schemes = schemes;
        self
    }

    /// An example URL for help and errors.
    pub const fn with_example(mut self, example: &'static str) -> Self {
        self.example = example;
        self
    }

    /// The settings that do not belong in the URL.
    pub const fn with_settings(mut self, settings: &'static [Setting]) -> Self {
        self.settings = settings;
        self
    }

    /// The backend's name (`postgres`).
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// Store or sink.
    pub const fn role(&self) -> Role {
        self.role
    }

    /// The settings prefix (`pg`).
    pub const fn prefix(&self) -> &'static str {
        self.prefix
    }

    /// The URL schemes it handles.
    pub const fn schemes(&self) -> &'static [&'static str] {
        self.schemes
    }

    /// An example URL.
    pub const fn example(&self) -> &'static str {
        self.example
    }

    /// Its settings.
    pub const fn settings(&self) -> &'static [Setting] {
        self.settings
    }

    /// The setting called `name`, if it has one.
    pub fn setting(&self, name: &str) -> Option<&'static Setting> {
        self.settings.iter().find(|s| s.name == name)
    }

    /// Whether `url`'s scheme (before `:`, any case) is one of its schemes.
    pub fn handles(&self, url: &str) -> bool {
        url.split_once(':').is_some_and(|(scheme, _)| {
            self.schemes
                .iter()
                .any(|s| s.eq_ignore_ascii_case(scheme.trim()))
        })
    }

    /// The config-file key: `<prefix>_<name>` (`pg_schema`, `kafka_properties`).
    pub fn key(&self, setting: &Setting) -> String {
        format!("{}_{}", self.prefix, setting.name)
    }

    /// The long flag without dashes: `<prefix>-<name>` in kebab case
    /// (`pg-schema`); a map setting uses its item (`kafka-property`).
    pub fn flag(&self, setting: &Setting) -> String {
        let noun = match setting.kind {
            SettingKind::Map { item } => item,
            _ => setting.name,
        };
        format!("{}-{}", self.prefix, noun).replace('_', "-")
    }

    /// The environment variable: `OUTBOX_<PREFIX>_<NAME>` in upper case
    /// (`OUTBOX_PG_SCHEMA`); `None` for a map setting.
    pub fn env(&self, setting: &Setting) -> Option<String> {
        match setting.kind {
            SettingKind::Map { .. } => None,
            _ => Some(format!("{ENV_PREFIX}{}", self.key(setting)).to_ascii_uppercase()),
        }
    }
}

/// A setting's value as given by the user, before the backend parses it.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SettingValue {
    /// A single value (text, boolean or integer as written).
    Text(String),
    /// `NAME=VALUE` pairs.
    Map(BTreeMap<String, String>),
}

impl fmt::Debug for SettingValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Values may be secrets (a SASL password): shapes only.
        match self {
            SettingValue::Text(_) => f.write_str("Text(..)"),
            SettingValue::Map(m) => f.debug_tuple("Map").field(&m.keys()).finish(),
        }
    }
}

/// The values given for one backend's settings, keyed by setting name
/// (`schema`, not `pg_schema`). `Debug` shows names only: values may be
/// secrets.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Settings {
    values: BTreeMap<String, SettingValue>,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.values.keys()).finish()
    }
}

impl Settings {
    /// No values: every setting at its default.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `name` to `value`.
    pub fn with_text(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.insert(name, SettingValue::Text(value.into()));
        self
    }

    /// Adds `key=value` to the map setting `name`.
    pub fn with_entry(
        mut self,
        name: impl Into<String>,
        key: impl Into<String>,
        value: impl Into<String>,
    ) -> Self {
        let entry = self
            .values
            .entry(name.into())
            .or_insert_with(|| SettingValue::Map(BTreeMap::new()));
        if let SettingValue::Text(_) = entry {
            *entry = SettingValue::Map(BTreeMap::new());
        }
        if let SettingValue::Map(map) = entry {
            map.insert(key.into(), value.into());
        }
        self
    }

    /// Sets `name` to `value`, replacing what was there.
    pub fn insert(&mut self, name: impl Into<String>, value: SettingValue) {
        self.values.insert(name.into(), value);
    }

    /// Whether nothing was given.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The names given.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.values.keys().map(String::as_str)
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<&SettingValue> {
        self.values.get(name)
    }

    /// The text value of `name`; `None` when not given (or given as a map).
    pub fn text(&self, name: &str) -> Option<&str> {
        match self.values.get(name) {
            Some(SettingValue::Text(s)) => Some(s),
            _ => None,
        }
    }

    /// `name` parsed with [`FromStr`]; the error names the setting.
    pub fn parse<T>(&self, name: &str) -> Result<Option<T>, InvalidSetting>
    where
        T: FromStr,
        T::Err: fmt::Display,
    {
        self.text(name)
            .map(|s| {
                s.trim()
                    .parse::<T>()
                    .map_err(|e| InvalidSetting::new(name, e.to_string()))
            })
            .transpose()
    }

    /// `name` as a boolean: `true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`.
    pub fn bool(&self, name: &str) -> Result<Option<bool>, InvalidSetting> {
        self.text(name)
            .map(|s| {
                parse_bool(s)
                    .ok_or_else(|| InvalidSetting::new(name, format!("{s:?} is not true or false")))
            })
            .transpose()
    }

    /// The pairs of the map setting `name` (empty when not given).
    pub fn map(&self, name: &str) -> impl Iterator<Item = (&str, &str)> {
        let map = match self.values.get(name) {
            Some(SettingValue::Map(m)) => Some(m),
            _ => None,
        };
        map.into_iter()
            .flatten()
            .map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// `true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off` (any case).
pub fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "y" | "on" => Some(true),
        "false" | "0" | "no" | "n" | "off" => Some(false),
        _ => None,
    }
}

/// A setting (or the URL, named `url`) that a backend refused. Its message
/// must not contain a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {setting}: {reason}")]
pub struct InvalidSetting {
    setting: String,
    reason: String,
}

impl InvalidSetting {
    /// The name a URL problem is reported under.
    pub const URL: &'static str = "url";

    /// `setting` (its name in the descriptor, or [`Self::URL`]) is invalid
    /// because of `reason`.
    pub fn new(setting: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            setting: setting.into(),
            reason: reason.into(),
        }
    }

    /// A problem with the URL.
    pub fn url(reason: impl Into<String>) -> Self {
        Self::new(Self::URL, reason)
    }

    /// The setting's name, or [`Self::URL`].
    pub fn setting(&self) -> &str {
        &self.setting
    }

    /// Why it is invalid.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// A store or publisher that a runner can pick from a URL at run time.
///
/// Implemented by a unit type in each backend crate's `descriptor` module.
pub trait Backend {
    /// Name, URL schemes and settings.
    const DESCRIPTOR: Descriptor;

    /// The validated configuration.
    type Config;
    /// What [`Self::connect`] gives: the store or the publisher.
    type Connected;
    /// Why connecting failed. Its messages never contain a password.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Parses and validates `url` and `settings` (only names the descriptor
    /// declares), without I/O beyond checking local paths.
    fn configure(url: &str, settings: &Settings) -> Result<Self::Config, InvalidSetting>;

    /// Connects (or opens) with a configuration from [`Self::configure`].
    fn connect(
        config: Self::Config,
    ) -> impl Future<Output = Result<Self::Connected, Self::Error>> + Send;

    /// Opens without waiting for the service to be reachable: a publisher
    /// whose broker is down returns at once and reports its batches as sink
    /// unavailable until it connects, so a relay started during an outage
    /// starts with its circuit breaker open instead of exiting. Errors that
    /// waiting cannot fix (invalid configuration, refused credentials, a
    /// failed TLS handshake) still fail here. Defaults to [`Self::connect`].
    fn connect_lazy(
        config: Self::Config,
    ) -> impl Future<Output = Result<Self::Connected, Self::Error>> + Send {
        Self::connect(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KAFKA: Descriptor = Descriptor::new("kafka", Role::Sink, "kafka")
        .with_schemes(&["kafka"])
        .with_settings(&[
            Setting::text("topic_prefix", "Prefix."),
            Setting::map("properties", "property", "librdkafka properties."),
        ]);

    #[test]
    fn names_follow_one_rule() {
        let [prefix, props] = KAFKA.settings() else {
            panic!("two settings")
        };
        assert_eq!(KAFKA.flag(prefix), "kafka-topic-prefix");
        assert_eq!(
            KAFKA.env(prefix).as_deref(),
            Some("OUTBOX_KAFKA_TOPIC_PREFIX")
        );
        assert_eq!(KAFKA.key(prefix), "kafka_topic_prefix");
        assert_eq!(KAFKA.flag(props), "kafka-property");
        assert_eq!(KAFKA.env(props), None);
        assert_eq!(KAFKA.key(props), "kafka_properties");
        assert!(KAFKA.handles("KAFKA://b:9092"));
        assert!(!KAFKA.handles("kafkax://b"));
        assert!(!KAFKA.handles("nothing"));
    }

    #[test]
    fn values_parse_with_named_errors() {
        let s = Settings::new()
            .with_text("n", "12")
            .with_text("bad", "x")
            .with_text("on", "Yes")
            .with_entry("props", "acks", "all");
        assert_eq!(s.parse::<u32>("n"), Ok(Some(12)));
        assert_eq!(s.parse::<u32>("missing"), Ok(None));
        let e = s.parse::<u32>("bad").unwrap_err();
        assert_eq!(e.setting(), "bad");
        assert_eq!(s.bool("on"), Ok(Some(true)));
        assert!(s.bool("bad").is_err());
        assert_eq!(s.map("props").collect::<Vec<_>>(), vec![("acks", "all")]);
        assert_eq!(format!("{s:?}"), r#"{"bad", "n", "on", "props"}"#);
    }
}
