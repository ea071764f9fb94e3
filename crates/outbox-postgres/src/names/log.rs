//! The identifiers of one event-log outbox, derived from its schema and
//! table, and the SQL text built from them.

use crate::ident::{Ident, InvalidIdentifier};
use crate::names::Templates;

/// Number of rotating partitions (fixed by migration 1).
pub(crate) const PARTITIONS: usize = 3;

/// Validated names of everything one event-log outbox owns. Every object is
/// named `<table>_log...`; `<table>` itself becomes a view whose INSERTs land
/// in the log (an in-place upgrade drains a queue table of that name first).
#[derive(Debug, Clone)]
pub(crate) struct LogNames {
    templates: Templates,
}

impl std::ops::Deref for LogNames {
    type Target = Templates;

    fn deref(&self) -> &Templates {
        &self.templates
    }
}

/// `(placeholder, suffix, qualified)`: qualified names get the schema.
const OBJECTS: &[(&str, &str, bool)] = &[
    ("{{log}}", "_log", true),
    ("{{log_0}}", "_log_0", true),
    ("{{log_1}}", "_log_1", true),
    ("{{log_2}}", "_log_2", true),
    ("{{gen}}", "_log_gen", true),
    ("{{seq}}", "_log_seq", true),
    ("{{order_seq}}", "_log_order", true),
    ("{{boot}}", "_log_boot", true),
    ("{{meta}}", "_log_meta", true),
    ("{{cursors}}", "_log_cursors", true),
    ("{{relays}}", "_log_relays", true),
    ("{{lane}}", "_log_lane", true),
    ("{{lane_ord}}", "_log_lane_ord", true),
    ("{{dead}}", "_log_dead", true),
    ("{{history}}", "_log_migrations", true),
    ("{{control}}", "_log_control", true),
    // The queue-mode objects an in-place upgrade drains and replaces.
    ("{{queue_dead}}", "_dead", true),
    ("{{queue_history}}", "_migrations", true),
    ("{{queue_control}}", "_control", true),
    ("{{log_idx}}", "_log_idx", false),
    ("{{log_seq_idx}}", "_log_seq_idx", false),
    ("{{lane_key_idx}}", "_log_lane_key_idx", false),
    ("{{lane_id_idx}}", "_log_lane_id_idx", false),
    ("{{dead_code_idx}}", "_log_dead_code_idx", false),
    ("{{dead_key_idx}}", "_log_dead_key_idx", false),
];

impl LogNames {
    /// Derives and validates every name (each must fit in 63 bytes, so the
    /// table name may be at most 45 bytes long: `_log_dead_code_idx` is the longest suffix).
    pub(crate) fn new(schema: Ident, table: Ident) -> Result<Self, InvalidIdentifier> {
        let s = schema.quoted();
        let mut replacements = Vec::with_capacity(OBJECTS.len() + 3);
        for (placeholder, suffix, qualified) in OBJECTS {
            let local = table.with_suffix(suffix)?.quoted();
            let name = if *qualified {
                format!("{s}.{local}")
            } else {
                local
            };
            replacements.push((*placeholder, name));
        }
        // Names inside string literals ('"schema"."table_log_gen"'::regclass):
        // the identifier alphabet has no quote, so this cannot break out.
        for (placeholder, suffix) in [
            ("{{gen_lit}}", "_log_gen"),
            ("{{seq_lit}}", "_log_seq"),
            ("{{order_lit}}", "_log_order"),
            ("{{lane_ord_lit}}", "_log_lane_ord"),
        ] {
            replacements.push((
                placeholder,
                format!("{s}.{}", table.with_suffix(suffix)?.quoted()),
            ));
        }
        // The outbox's own name: a queue table before an upgrade, then a
        // view whose INSERTs land in the log.
        replacements.push(("{{outbox}}", format!("{s}.{}", table.quoted())));
        replacements.push(("{{schema}}", s));
        Ok(Self {
            templates: Templates::new(schema, table, replacements),
        })
    }

    /// The quoted, qualified name of partition `slot`.
    pub(crate) fn partition(&self, slot: usize) -> String {
        self.render(&format!("{{{{log_{slot}}}}}"))
    }

    /// Plain (unquoted) `schema.table_log_<n>` names of the partitions, for
    /// comparisons with catalog views.
    pub(crate) fn partition_relnames(&self) -> Vec<String> {
        (0..PARTITIONS)
            .map(|i| format!("{}_log_{i}", self.table))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_quoted_names() {
        let n = LogNames::new(Ident::new("app").unwrap(), Ident::new("Events").unwrap()).unwrap();
        assert_eq!(
            n.render("INSERT INTO {{log}}; {{cursors}}; '{{gen_lit}}'; {{log_idx}}"),
            "INSERT INTO \"app\".\"Events_log\"; \"app\".\"Events_log_cursors\"; '\"app\".\"Events_log_gen\"'; \"Events_log_idx\""
        );
        assert_eq!(n.partition(2), "\"app\".\"Events_log_2\"");
        assert_eq!(n.partition_relnames()[0], "Events_log_0");
    }

    #[test]
    fn derived_names_must_fit() {
        assert!(LogNames::new(
            Ident::new("s").unwrap(),
            Ident::new("t".repeat(45)).unwrap()
        )
        .is_ok());
        let err = LogNames::new(
            Ident::new("s").unwrap(),
            Ident::new("t".repeat(46)).unwrap(),
        )
        .unwrap_err();
        assert!(matches!(err, InvalidIdentifier::TooLong { .. }), "{err}");
    }
}
