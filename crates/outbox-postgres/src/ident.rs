//! Validated SQL identifiers for schema and table names.

pub(crate) use outbox_core::ident::{InvalidIdentifier, MAX_IDENTIFIER_BYTES};

/// A schema or table name that is safe to put in SQL: it matches
/// `[A-Za-z_][A-Za-z0-9_]*` and is at most 63 bytes long
/// ([`MAX_IDENTIFIER_BYTES`](outbox_core::ident::MAX_IDENTIFIER_BYTES): PostgreSQL truncates longer identifiers, so
/// they are refused instead).
///
/// The store always writes it double-quoted (`"My_Table"`), so case is kept
/// exactly as given. Because the character set excludes quotes, the quoted
/// form can never break out of the identifier.
///
/// ```
/// use outbox_postgres::Ident;
/// assert_eq!(Ident::new("outbox").unwrap().quoted(), "\"outbox\"");
/// assert!(Ident::new("x\"; DROP TABLE y; --").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ident(String);

impl Ident {
    /// Validates `name` ([`outbox_core::ident::checked`]).
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidIdentifier> {
        outbox_core::ident::checked(name.into()).map(Self)
    }
}

outbox_core::ident_type!(Ident, InvalidIdentifier);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_names() {
        for ok in ["outbox", "_x", "Events_2", &"a".repeat(63)] {
            assert_eq!(Ident::new(ok).unwrap().as_str(), ok);
        }
        assert_eq!(Ident::new("MyTable").unwrap().quoted(), "\"MyTable\"");
    }

    #[test]
    fn rejects_hostile_and_odd_names() {
        // The rules themselves are tested in outbox-core (`ident::checked`).
        assert_eq!(
            Ident::new("a-b"),
            Err(InvalidIdentifier::InvalidCharacters("a-b".to_owned()))
        );
        assert_eq!(Ident::new(""), Err(InvalidIdentifier::Empty));
        assert!(matches!(
            Ident::new("a".repeat(64)),
            Err(InvalidIdentifier::TooLong { len: 64, .. })
        ));
        // PostgreSQL has no reserved prefix.
        assert!(Ident::new("sqlite_x").is_ok());
    }
}
