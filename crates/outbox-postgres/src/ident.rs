//! Validated SQL identifiers for schema and table names.

use outbox_core::ident::IdentError;
use thiserror::Error;

/// PostgreSQL truncates identifiers longer than this (`NAMEDATALEN - 1`);
/// we refuse them instead.
pub const MAX_IDENTIFIER_BYTES: usize = 63;

/// A schema or table name that is safe to put in SQL: it matches
/// `[A-Za-z_][A-Za-z0-9_]*` and is at most 63 bytes long.
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

/// Why a schema or table name was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum InvalidIdentifier {
    /// The name was empty.
    #[error("SQL identifier must not be empty")]
    Empty,
    /// The name was longer than [`MAX_IDENTIFIER_BYTES`].
    #[error("SQL identifier {name:?} is {len} bytes long, above the maximum of {MAX_IDENTIFIER_BYTES} bytes")]
    TooLong {
        /// The refused name.
        name: String,
        /// Its length in bytes.
        len: usize,
    },
    /// The name had a character outside `[A-Za-z0-9_]`, or began with a digit.
    #[error("SQL identifier {0:?} is not allowed: use only ASCII letters, digits and '_', not starting with a digit")]
    InvalidCharacters(String),
}

impl Ident {
    /// Validates `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidIdentifier> {
        let name = name.into();
        match outbox_core::ident::validate(&name, MAX_IDENTIFIER_BYTES) {
            Ok(()) => {}
            Err(IdentError::Empty) => return Err(InvalidIdentifier::Empty),
            Err(IdentError::TooLong { len }) => {
                return Err(InvalidIdentifier::TooLong { name, len })
            }
            Err(_) => return Err(InvalidIdentifier::InvalidCharacters(name)),
        }
        Ok(Self(name))
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
        for bad in [
            "x\"; DROP TABLE y; --",
            "a b",
            "1abc",
            "schema.table",
            "tab\u{e9}",
            "a-b",
            "a\"b",
            "a\0b",
        ] {
            assert_eq!(
                Ident::new(bad),
                Err(InvalidIdentifier::InvalidCharacters(bad.to_owned())),
                "{bad:?}"
            );
        }
        assert_eq!(Ident::new(""), Err(InvalidIdentifier::Empty));
        assert!(matches!(
            Ident::new("a".repeat(64)),
            Err(InvalidIdentifier::TooLong { len: 64, .. })
        ));
        let msg = Ident::new("x\"; DROP TABLE y; --").unwrap_err().to_string();
        assert!(msg.contains("not allowed"), "{msg}");
    }
}
