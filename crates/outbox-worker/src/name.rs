//! The name of the store a relay serves ([`StoreName`]), when one process
//! runs relays over several stores (`outbox-relay run` with several
//! `--store`s). It labels every metric the relay records (`store="<name>"`)
//! and its tracing span; a relay without one records what it always did,
//! without the label.
//!
//! A name is a label, never a connection string: it is short and made of
//! `[a-z0-9_-]`, so a URL, a host or a password cannot end up in a metric
//! label or a log line through it.

use std::fmt;
use std::str::FromStr;

/// Longest store name, in bytes.
pub const STORE_NAME_MAX: usize = 63;

/// A validated store name: 1 to [`STORE_NAME_MAX`] characters of
/// `[a-z0-9_-]`, starting with a letter or a digit.
///
/// ```
/// use outbox_worker::StoreName;
/// assert_eq!(StoreName::new("tenant-7").unwrap().as_str(), "tenant-7");
/// assert!(StoreName::new("Tenant 7").is_err());
/// assert!(StoreName::new("postgres://db").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StoreName(String);

/// Why a string is not a [`StoreName`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid store name {shown:?}: {reason}")]
pub struct InvalidStoreName {
    /// The refused name, cut to [`STORE_NAME_MAX`] characters (hidden when
    /// it looks like a connection string).
    shown: String,
    reason: &'static str,
}

impl InvalidStoreName {
    /// What is wrong with the name.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

impl StoreName {
    /// Validates `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidStoreName> {
        let name = name.into();
        let refuse = |reason| InvalidStoreName {
            // A name that looks like a connection string is not echoed:
            // it may carry a password.
            shown: if name.contains(':') || name.contains('@') {
                "(hidden: it looks like a connection string)".to_owned()
            } else {
                name.chars().take(STORE_NAME_MAX).collect()
            },
            reason,
        };
        if name.is_empty() {
            return Err(refuse("a store name cannot be empty"));
        }
        if name.len() > STORE_NAME_MAX {
            return Err(refuse("a store name has at most 63 characters"));
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        {
            return Err(refuse(
                "a store name is made of lowercase letters, digits, '_' and '-'",
            ));
        }
        if !name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        {
            return Err(refuse("a store name starts with a letter or a digit"));
        }
        Ok(Self(name))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StoreName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for StoreName {
    type Err = InvalidStoreName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl AsRef<str> for StoreName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_short_lowercase_words() {
        for good in ["a", "tenant_1", "eu-west-2", "0", &"x".repeat(63)] {
            assert_eq!(StoreName::new(good).unwrap().as_str(), good);
        }
        for (bad, why) in [
            ("", "empty"),
            ("Tenant", "lowercase"),
            ("a b", "lowercase"),
            ("postgres://u:pw@h/db", "lowercase"),
            ("-a", "starts with"),
            ("_a", "starts with"),
        ] {
            let err = StoreName::new(bad).unwrap_err();
            assert!(err.to_string().contains(why), "{bad:?}: {err}");
        }
        let url = StoreName::new("postgres://u:secret@h/db").unwrap_err();
        assert!(!url.to_string().contains("secret"), "{url}");
        let long = StoreName::new("y".repeat(64)).unwrap_err();
        assert!(long.to_string().contains("at most 63"), "{long}");
        assert_eq!("ok".parse::<StoreName>().unwrap().to_string(), "ok");
    }
}
