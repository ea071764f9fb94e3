//! Validated SQL identifiers for the outbox table name.

use outbox_core::ident::InvalidIdentifier;

/// A table name that is safe to put in SQL: it matches
/// `[A-Za-z_][A-Za-z0-9_]*`, is at most [`MAX_IDENTIFIER_BYTES`](outbox_core::ident::MAX_IDENTIFIER_BYTES) long (the
/// same bound as `outbox-postgres`, so one name works on both stores) and
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

impl Ident {
    /// Validates `name` ([`outbox_core::ident::checked`], then the reserved
    /// prefix `sqlite_`, in any letter case).
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidIdentifier> {
        let name = outbox_core::ident::checked(name.into())?;
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
        // The common rules are tested in outbox-core (`ident::checked`).
        assert_eq!(
            Ident::new("main.table"),
            Err(InvalidIdentifier::InvalidCharacters(
                "main.table".to_owned()
            ))
        );
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
