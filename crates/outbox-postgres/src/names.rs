//! The identifiers one outbox uses, derived from its schema and table, and
//! the SQL text built from them once: what both modes' names are
//! ([`Templates`]), the queue table's ([`queue::Names`]) and the event log's
//! ([`log::LogNames`]). The enqueue handle and the migrations use both, so
//! they live here, below both stores.

use crate::ident::Ident;

pub(crate) mod log;
pub(crate) mod queue;

/// What the names of both modes (queue [`Names`](queue::Names), event log
/// [`LogNames`](log::LogNames)) are: the outbox's schema and
/// table, and the `{{placeholder}}`s its SQL templates are rendered with
/// (also what the migration runner takes). Each mode's names deref to it.
#[derive(Debug, Clone)]
pub(crate) struct Templates {
    pub(crate) schema: Ident,
    pub(crate) table: Ident,
    /// `(placeholder, quoted replacement)` pairs.
    replacements: Vec<(&'static str, String)>,
}

impl Templates {
    /// The names of `schema`.`table` with these replacements.
    pub(crate) fn new(
        schema: Ident,
        table: Ident,
        replacements: Vec<(&'static str, String)>,
    ) -> Self {
        Self {
            schema,
            table,
            replacements,
        }
    }

    /// Replaces every `{{placeholder}}` in `template`.
    pub(crate) fn render(&self, template: &str) -> String {
        self.replacements
            .iter()
            .fold(template.to_owned(), |sql, (from, to)| sql.replace(from, to))
    }
}
