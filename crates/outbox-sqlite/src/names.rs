//! The names of one outbox's tables and indexes, and SQL templating.

use crate::ident::Ident;
use crate::options::DEFAULT_TABLE;
use outbox_core::ident::InvalidIdentifier;

/// The table that records applied migrations of the default outbox:
/// `outbox_schema_migrations(version, name, checksum, applied_at)`. (An
/// outbox with another table `T` records them in `T_migrations`.)
pub const MIGRATIONS_TABLE: &str = "outbox_schema_migrations";

/// The tables of one outbox, derived from its events table name.
///
/// For a table `T`: dead letters in `T_dead`, migration history in
/// `T_migrations`, indexes `T_<name>` (the same rule as `outbox-postgres`).
/// The default table `outbox_events` keeps the names it had before table
/// names were configurable: `outbox_dead_letters` and
/// `outbox_schema_migrations`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Names {
    pub(crate) table: Ident,
    pub(crate) dead: Ident,
    pub(crate) history: Ident,
}

impl Names {
    pub(crate) fn new(table: Ident) -> Result<Self, InvalidIdentifier> {
        let (dead, history) = if table.as_str() == DEFAULT_TABLE {
            (
                Ident::from_static("outbox_dead_letters"),
                Ident::from_static(MIGRATIONS_TABLE),
            )
        } else {
            (
                table.with_suffix("_dead")?,
                table.with_suffix("_migrations")?,
            )
        };
        // Index names must fit too (the longest suffix is `_lease_token`).
        table.with_suffix("_lease_token")?;
        dead.with_suffix("_code")?;
        Ok(Self {
            table,
            dead,
            history,
        })
    }

    /// Replaces `{{events}}`, `{{dead}}`, `{{history}}` with the quoted table
    /// names and `{{events_X}}` / `{{dead_X}}` with the quoted index name
    /// `<table>_X` / `<dead table>_X`. Anything else is left as it is (the
    /// tests check that no `{{` survives in the SQL the crate uses).
    pub(crate) fn render(&self, template: &str) -> String {
        let mut out = String::with_capacity(template.len() + 64);
        let mut rest = template;
        while let Some(start) = rest.find("{{") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let Some(end) = after.find("}}") else {
                out.push_str(&rest[start..]);
                return out;
            };
            let name = &after[..end];
            match self.resolve(name) {
                Some(quoted) => out.push_str(&quoted),
                None => {
                    out.push_str("{{");
                    out.push_str(name);
                    out.push_str("}}");
                }
            }
            rest = &after[end + 2..];
        }
        out.push_str(rest);
        out
    }

    fn resolve(&self, name: &str) -> Option<String> {
        let quoted = |base: &Ident, suffix: &str| format!("\"{}{suffix}\"", base.as_str());
        match name {
            "events" => Some(self.table.quoted()),
            "dead" => Some(self.dead.quoted()),
            "history" => Some(self.history.quoted()),
            _ => {
                if let Some(s) = name.strip_prefix("events_") {
                    Some(quoted(&self.table, &format!("_{s}")))
                } else {
                    name.strip_prefix("dead_")
                        .map(|s| quoted(&self.dead, &format!("_{s}")))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_table_keeps_its_historic_names() {
        let n = Names::new(Ident::new("outbox_events").unwrap()).unwrap();
        assert_eq!(n.dead.as_str(), "outbox_dead_letters");
        assert_eq!(n.history.as_str(), "outbox_schema_migrations");
        assert_eq!(
            n.render("CREATE INDEX {{events_ready}} ON {{events}} ({{dead}}, {{dead_code}}) {{x}}"),
            "CREATE INDEX \"outbox_events_ready\" ON \"outbox_events\" (\"outbox_dead_letters\", \"outbox_dead_letters_code\") {{x}}"
        );
    }

    #[test]
    fn other_tables_derive_their_names() {
        let n = Names::new(Ident::new("orders_outbox").unwrap()).unwrap();
        assert_eq!(n.dead.as_str(), "orders_outbox_dead");
        assert_eq!(n.history.as_str(), "orders_outbox_migrations");
        assert_eq!(n.render("{{history}}"), "\"orders_outbox_migrations\"");
        assert!(Names::new(Ident::new("a".repeat(52)).unwrap()).is_err());
        assert!(Names::new(Ident::new("a".repeat(51)).unwrap()).is_ok());
    }
}
