//! The identifiers of one queue-mode outbox, derived from its schema and
//! table.

use crate::ident::{Ident, InvalidIdentifier};
use crate::names::Templates;

/// Validated names of everything one (queue-mode) outbox owns in the database.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    templates: Templates,
    /// LISTEN/NOTIFY channel (plain text, passed as a parameter).
    pub(crate) channel: String,
}

impl std::ops::Deref for Names {
    type Target = Templates;

    fn deref(&self) -> &Templates {
        &self.templates
    }
}

impl Names {
    /// Derives and validates every name (each must fit in 63 bytes).
    pub(crate) fn new(schema: Ident, table: Ident) -> Result<Self, InvalidIdentifier> {
        let s = schema.quoted();
        let qualified = |suffix: &str| -> Result<String, InvalidIdentifier> {
            Ok(format!("{s}.{}", table.with_suffix(suffix)?.quoted()))
        };
        let local = |suffix: &str| -> Result<String, InvalidIdentifier> {
            Ok(table.with_suffix(suffix)?.quoted())
        };
        let replacements = vec![
            ("{{schema}}", s.clone()),
            ("{{events}}", format!("{s}.{}", table.quoted())),
            ("{{dead}}", qualified("_dead")?),
            ("{{history}}", qualified("_migrations")?),
            ("{{control}}", qualified("_control")?),
            ("{{seq}}", qualified("_seq")?),
            ("{{claim_idx}}", local("_claim_idx")?),
            ("{{key_idx}}", local("_key_idx")?),
            ("{{delivered_idx}}", local("_delivered_idx")?),
            ("{{parked_idx}}", local("_parked_idx")?),
            ("{{dead_code_idx}}", local("_dead_code_idx")?),
            ("{{key_hash_check}}", local("_key_hash_check")?),
        ];
        let plain = format!("{schema}.{table}");
        let channel = if plain.len() <= crate::ident::MAX_IDENTIFIER_BYTES {
            plain
        } else {
            format!("outbox_{:016x}", outbox_core::fnv1a_64(plain.as_bytes()))
        };
        Ok(Self {
            templates: Templates::new(schema, table, replacements),
            channel,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_quoted_names() {
        let n = Names::new(Ident::new("app").unwrap(), Ident::new("Events").unwrap()).unwrap();
        assert_eq!(
            n.render("SELECT 1 FROM {{events}} JOIN {{dead}} ON true; CREATE INDEX {{claim_idx}}"),
            "SELECT 1 FROM \"app\".\"Events\" JOIN \"app\".\"Events_dead\" ON true; CREATE INDEX \"Events_claim_idx\""
        );
        assert_eq!(n.channel, "app.Events");
    }

    #[test]
    fn derived_names_must_fit() {
        let long = Ident::new("t".repeat(60)).unwrap();
        let err = Names::new(Ident::new("s").unwrap(), long).unwrap_err();
        assert!(matches!(err, InvalidIdentifier::TooLong { .. }), "{err}");
        let n = Names::new(
            Ident::new("s".repeat(40)).unwrap(),
            Ident::new("t".repeat(40)).unwrap(),
        )
        .unwrap();
        assert!(n.channel.starts_with("outbox_") && n.channel.len() <= 63);
    }
}
