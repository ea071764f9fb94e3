//! The backends of this build, as their crates describe them, and the
//! sections of settings the command line, the environment and `outbox.toml`
//! are derived from.

use outbox_core::backend::{Descriptor, Role, Setting};

#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "nats",
    feature = "amqp",
    feature = "kafka"
))]
use outbox_core::backend::Backend as _;

/// The descriptors of the backends compiled into this build.
pub(crate) const COMPILED: &[Descriptor] = &[
    #[cfg(feature = "sqlite")]
    outbox_sqlite::descriptor::SqliteBackend::DESCRIPTOR,
    #[cfg(feature = "postgres")]
    outbox_postgres::PgBackend::DESCRIPTOR,
    #[cfg(feature = "nats")]
    outbox_nats::descriptor::NatsBackend::DESCRIPTOR,
    #[cfg(feature = "amqp")]
    outbox_amqp::descriptor::AmqpBackend::DESCRIPTOR,
    #[cfg(feature = "kafka")]
    outbox_kafka::descriptor::KafkaBackend::DESCRIPTOR,
];

/// A backend this binary can be built with, compiled in or not. Only used to
/// say "rebuild with `--features X`" for a URL or a key of a backend that is
/// not compiled in; the `known_backends_match_the_descriptors` test keeps it
/// equal to the descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Known {
    /// The cargo feature, equal to the backend's name.
    pub(crate) feature: &'static str,
    pub(crate) role: Role,
    pub(crate) prefix: &'static str,
    pub(crate) schemes: &'static [&'static str],
}

pub(crate) const KNOWN: &[Known] = &[
    Known {
        feature: "sqlite",
        role: Role::Store,
        prefix: "sqlite",
        schemes: &["sqlite"],
    },
    Known {
        feature: "postgres",
        role: Role::Store,
        prefix: "pg",
        schemes: &["postgres", "postgresql"],
    },
    Known {
        feature: "nats",
        role: Role::Sink,
        prefix: "nats",
        schemes: &["nats", "tls"],
    },
    Known {
        feature: "amqp",
        role: Role::Sink,
        prefix: "amqp",
        schemes: &["amqp", "amqps"],
    },
    Known {
        feature: "kafka",
        role: Role::Sink,
        prefix: "kafka",
        schemes: &["kafka"],
    },
];

/// The compiled backends of one role.
pub(crate) fn compiled(role: Role) -> impl Iterator<Item = &'static Descriptor> {
    COMPILED.iter().filter(move |d| d.role() == role)
}

/// The known backends that are not compiled into this build.
pub(crate) fn missing() -> impl Iterator<Item = &'static Known> {
    KNOWN
        .iter()
        .filter(|k| !COMPILED.iter().any(|d| d.name() == k.feature))
}

/// `sqlite://, postgres://`: the schemes of the compiled backends of `role`.
pub(crate) fn schemes(role: Role) -> String {
    compiled(role)
        .flat_map(|d| d.schemes().iter().map(|s| format!("{s}://")))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Lowercase scheme of `url` (the text before the first `:`), if any.
pub(crate) fn scheme_of(url: &str) -> Option<String> {
    let (scheme, _) = url.trim().split_once(':')?;
    let valid = !scheme.is_empty()
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    valid.then(|| scheme.to_ascii_lowercase())
}

/// A group of settings under one naming rule: the relay's own (flag
/// `--batch-size`, env `OUTBOX_BATCH_SIZE`, key `batch_size`) or a backend's
/// (the descriptor's rule: `--pg-schema`, `OUTBOX_PG_SCHEMA`, `pg_schema`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Section {
    pub(crate) backend: Option<&'static Descriptor>,
    pub(crate) settings: &'static [Setting],
}

impl Section {
    pub(crate) const fn relay(settings: &'static [Setting]) -> Self {
        Self {
            backend: None,
            settings,
        }
    }

    pub(crate) fn backend(d: &'static Descriptor) -> Self {
        Self {
            backend: Some(d),
            settings: d.settings(),
        }
    }

    /// The config-file key, also the setting's id on the command line.
    pub(crate) fn key(&self, s: &Setting) -> String {
        match self.backend {
            Some(d) => d.key(s),
            None => s.name().to_owned(),
        }
    }

    /// The long flag, without its dashes.
    pub(crate) fn flag(&self, s: &Setting) -> String {
        match self.backend {
            Some(d) => d.flag(s),
            None => s.name().replace('_', "-"),
        }
    }

    /// The environment variable, if the setting has one.
    pub(crate) fn env(&self, s: &Setting) -> Option<String> {
        match self.backend {
            Some(d) => d.env(s),
            None => Some(
                format!("{}{}", outbox_core::backend::ENV_PREFIX, s.name()).to_ascii_uppercase(),
            ),
        }
    }
}

/// Whether `spec` names a sink that writes JSON lines (`stdout`,
/// `jsonl:PATH`), not a broker: the wire format does not apply to it.
pub(crate) fn is_local_sink(spec: &str) -> bool {
    let spec = spec.trim();
    spec == "stdout" || spec.starts_with("jsonl:")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(all(
        feature = "sqlite",
        feature = "postgres",
        feature = "nats",
        feature = "amqp",
        feature = "kafka"
    ))]
    #[test]
    fn known_backends_match_the_descriptors() {
        let known: Vec<Known> = COMPILED
            .iter()
            .map(|d| Known {
                feature: d.name(),
                role: d.role(),
                prefix: d.prefix(),
                schemes: d.schemes(),
            })
            .collect();
        assert_eq!(known, KNOWN);
    }

    #[test]
    fn every_flag_env_and_key_is_unique() {
        let mut seen = std::collections::HashSet::new();
        for section in crate::config::all_sections() {
            for s in section.settings {
                assert!(seen.insert(section.key(s)), "key {}", section.key(s));
                assert!(seen.insert(format!("--{}", section.flag(s))));
                if let Some(env) = section.env(s) {
                    assert!(seen.insert(env.clone()), "env {env}");
                }
            }
        }
    }

    #[test]
    fn schemes_are_parsed_loosely() {
        assert_eq!(scheme_of("Postgres://x").as_deref(), Some("postgres"));
        assert_eq!(scheme_of("jsonl:out.jsonl").as_deref(), Some("jsonl"));
        assert_eq!(scheme_of("outbox.db"), None);
        assert_eq!(scheme_of("C:\\x"), Some("c".to_owned()));
    }
}
