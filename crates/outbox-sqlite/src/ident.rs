//! Validated SQL identifiers for the outbox table name.

use outbox_core::ident::IdentError;
use thiserror::Error;

/// The longest table name accepted (the same bound as `outbox-postgres`, so
/// one name works on both stores).
pub const MAX_IDENTIFIER_BYTES: usize = 63;

/// A table name that is safe to put in SQL: it matches
/// `[A-Za-z_][A-Za-z0-9_]*`, is at most [`MAX_IDENTIFIER_BYTES`] long and
/// does not start with `sqlite_` (reserved by SQLite).
///
/// The store always writes it double-quoted (`"My_Table"`); because the
/// character set excludes quotes, the quoted form can never break out of the
/// identifier, and SQL keywords (`order`, `select`) are fine.
///
/// ```
/// use outbox_sqlite::Ident;
/// assert_eq!(Ident::new("outbox_events").unwrap().quoted(), "\"outbox_events\"");
/// assert!(Ident::new("x\"; DROP TABLE y; --").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ident(String);

/// Why a table name was refused.
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
    /// The name starts with `sqlite_`, a prefix SQLite reserves for itself.
    #[error("SQL identifier {0:?} is not allowed: names starting with \"sqlite_\" are reserved by SQLite")]
    Reserved(String),
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
        if name
            .get(..7)
            .is_some_and(|p| p.eq_ignore_ascii_case("sqlite_"))
        {
            return Err(InvalidIdentifier::Reserved(name));
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
        for ok in ["outbox_events", "_x", "Events_2", "order", &"a".repeat(63)] {
            assert_eq!(Ident::new(ok).unwrap().as_str(), ok);
        }
        assert_eq!(Ident::new("MyTable").unwrap().quoted(), "\"MyTable\"");
    }

    #[test]
    fn rejects_hostile_reserved_and_odd_names() {
        for bad in [
            "x\"; DROP TABLE y; --",
            "a b",
            "1abc",
            "main.table",
            "tab\u{e9}",
            "a-b",
            "a\"b",
            "a\0b",
            "[x]",
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
        assert_eq!(
            Ident::new("SQLite_master"),
            Err(InvalidIdentifier::Reserved("SQLite_master".into()))
        );
        assert!(Ident::new("sqlite").is_ok());
    }
}
