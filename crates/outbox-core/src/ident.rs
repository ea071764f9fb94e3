//! The rules for SQL identifiers (schema and table names) shared by the
//! store crates: each keeps its own `Ident` type (built by [`ident_type!`]
//! and [`checked`], plus its own rules), and both report a refused name as
//! [`InvalidIdentifier`] (re-exported by each store crate).

use thiserror::Error;

/// The longest identifier accepted: PostgreSQL truncates identifiers longer
/// than this (`NAMEDATALEN - 1`), so the stores refuse them instead; SQLite
/// takes the same bound, so one name works on both stores.
pub const MAX_IDENTIFIER_BYTES: usize = 63;

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
    /// The name starts with `sqlite_`, a prefix SQLite reserves for itself
    /// (refused by the SQLite store only).
    #[error("SQL identifier {0:?} is not allowed: names starting with \"sqlite_\" are reserved by SQLite")]
    Reserved(String),
}

/// `name` if it passes [`validate`] with [`MAX_IDENTIFIER_BYTES`], else why
/// not (the refused name inside): the common part of every store's
/// `Ident::new`.
///
/// ```
/// use outbox_core::ident::{checked, InvalidIdentifier};
/// assert_eq!(checked("outbox".to_owned()).as_deref(), Ok("outbox"));
/// assert_eq!(checked(String::new()), Err(InvalidIdentifier::Empty));
/// assert_eq!(
///     checked("a-b".to_owned()),
///     Err(InvalidIdentifier::InvalidCharacters("a-b".to_owned()))
/// );
/// ```
pub fn checked(name: String) -> Result<String, InvalidIdentifier> {
    match validate(&name, MAX_IDENTIFIER_BYTES) {
        Ok(()) => Ok(name),
        Err(IdentError::Empty) => Err(InvalidIdentifier::Empty),
        Err(IdentError::TooLong { len }) => Err(InvalidIdentifier::TooLong { name, len }),
        Err(IdentError::InvalidCharacters) => Err(InvalidIdentifier::InvalidCharacters(name)),
    }
}

/// Why a name breaks the identifier rules of [`validate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdentError {
    /// The name was empty.
    Empty,
    /// The name had a character outside `[A-Za-z0-9_]`, or began with a digit.
    InvalidCharacters,
    /// The name was longer than the maximum; `len` is its length in bytes.
    TooLong {
        /// The name's length in bytes.
        len: usize,
    },
}

/// Checks that `name` matches `[A-Za-z_][A-Za-z0-9_]*` (so its double-quoted
/// form can never break out of the identifier) and is at most `max_len`
/// bytes long. The character check comes first.
///
/// ```
/// use outbox_core::ident::{validate, IdentError};
/// assert_eq!(validate("outbox_events", 63), Ok(()));
/// assert_eq!(validate("", 63), Err(IdentError::Empty));
/// assert_eq!(validate("1x", 63), Err(IdentError::InvalidCharacters));
/// assert_eq!(validate("abcd", 3), Err(IdentError::TooLong { len: 4 }));
/// ```
pub fn validate(name: &str, max_len: usize) -> Result<(), IdentError> {
    let mut bytes = name.bytes();
    let Some(first) = bytes.next() else {
        return Err(IdentError::Empty);
    };
    if !(first.is_ascii_alphabetic() || first == b'_')
        || !bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
    {
        return Err(IdentError::InvalidCharacters);
    }
    if name.len() > max_len {
        return Err(IdentError::TooLong { len: name.len() });
    }
    Ok(())
}

/// The common surface of a store's identifier newtype `$ty(String)` whose
/// `new(name)` validates and returns `Result<Self, $err>`: `as_str`,
/// `quoted` (the double-quoted SQL form), the crate-private
/// `from_static` (crate constants) and `with_suffix` (validated again),
/// `Debug` (`Ident(name)`), `Display`, `FromStr` and `TryFrom<&str>` /
/// `TryFrom<String>`. Each store keeps its own type (their rules differ:
/// SQLite reserves `sqlite_`), so one store's name is never taken for the
/// other's unchecked; the error is [`InvalidIdentifier`] for both.
#[macro_export]
macro_rules! ident_type {
    ($ty:ident, $err:ty) => {
        impl $ty {
            /// The name as given.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The double-quoted form used in SQL.
            pub fn quoted(&self) -> ::std::string::String {
                ::std::format!("\"{}\"", self.0)
            }

            /// A name known to be valid (crate constants only).
            pub(crate) fn from_static(name: &'static str) -> Self {
                debug_assert!(Self::new(name).is_ok(), "{name}");
                Self(name.to_owned())
            }

            /// `self` followed by `suffix`, validated again.
            pub(crate) fn with_suffix(&self, suffix: &str) -> ::std::result::Result<Self, $err> {
                Self::new(::std::format!("{}{suffix}", self.0))
            }
        }

        impl ::std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                ::std::write!(f, "Ident({})", self.0)
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = $err;
            fn from_str(s: &str) -> ::std::result::Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl ::std::convert::TryFrom<&str> for $ty {
            type Error = $err;
            fn try_from(s: &str) -> ::std::result::Result<Self, Self::Error> {
                Self::new(s)
            }
        }

        impl ::std::convert::TryFrom<::std::string::String> for $ty {
            type Error = $err;
            fn try_from(s: ::std::string::String) -> ::std::result::Result<Self, Self::Error> {
                Self::new(s)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_keeps_the_refused_name() {
        for bad in [
            "x\"; DROP TABLE y; --",
            "a b",
            "1abc",
            "schema.table",
            "tab\u{e9}",
            "a-b",
            "a\"b",
            "a\0b",
            "[x]",
        ] {
            assert_eq!(
                checked(bad.to_owned()),
                Err(InvalidIdentifier::InvalidCharacters(bad.to_owned())),
                "{bad:?}"
            );
        }
        assert_eq!(checked(String::new()), Err(InvalidIdentifier::Empty));
        assert!(matches!(
            checked("a".repeat(64)),
            Err(InvalidIdentifier::TooLong { len: 64, .. })
        ));
        let msg = checked("x\"; DROP TABLE y; --".to_owned())
            .unwrap_err()
            .to_string();
        assert!(msg.contains("not allowed"), "{msg}");
    }

    #[test]
    fn rules() {
        for ok in ["a", "_x", "Events_2", "order"] {
            assert_eq!(validate(ok, 63), Ok(()));
        }
        for bad in ["9a", "a-b", "a b", "x\"y", "é"] {
            assert_eq!(
                validate(bad, 63),
                Err(IdentError::InvalidCharacters),
                "{bad}"
            );
        }
        assert_eq!(validate(&"a".repeat(63), 63), Ok(()));
        assert_eq!(
            validate(&"a".repeat(64), 63),
            Err(IdentError::TooLong { len: 64 })
        );
        // Characters are checked before the length.
        assert_eq!(
            validate(&"-".repeat(64), 63),
            Err(IdentError::InvalidCharacters)
        );
    }
}
