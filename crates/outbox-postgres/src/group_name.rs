//! [`GroupName`]: the validated name of a consumer group.

use std::fmt;
use std::str::FromStr;

/// Longest group name, in bytes.
pub const MAX_GROUP_NAME_BYTES: usize = 63;

/// A consumer group's name: 1 to 63 ASCII letters, digits, `_`, `-` or `.`,
/// starting with a letter or a digit (`kafka-export`, `projections.v2`).
/// Names are bound as query parameters, never interpolated; the rule keeps
/// them readable in logs, metric labels and command lines.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupName(String);

/// Why a group name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidGroupName {
    /// The name is empty.
    #[error("a consumer group name cannot be empty")]
    Empty,
    /// The name is longer than [`MAX_GROUP_NAME_BYTES`].
    #[error("consumer group name is {len} bytes long; at most {MAX_GROUP_NAME_BYTES} are allowed")]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The name holds a character outside the allowed set.
    #[error(
        "consumer group name {name:?} holds {ch:?} at position {at}: use ASCII letters, digits, `_`, `-` and `.`"
    )]
    Character {
        /// The name.
        name: String,
        /// The refused character.
        ch: char,
        /// Its position (in characters, from 0).
        at: usize,
    },
    /// The name does not start with a letter or a digit.
    #[error("consumer group name {name:?} must start with an ASCII letter or digit")]
    Start {
        /// The name.
        name: String,
    },
}

impl GroupName {
    /// Checks `name` (see [`GroupName`]).
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidGroupName> {
        let name = name.into();
        if name.is_empty() {
            return Err(InvalidGroupName::Empty);
        }
        if let Some((at, ch)) = name
            .chars()
            .enumerate()
            .find(|(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
        {
            return Err(InvalidGroupName::Character { name, ch, at });
        }
        if name.len() > MAX_GROUP_NAME_BYTES {
            return Err(InvalidGroupName::TooLong { len: name.len() });
        }
        if !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
            return Err(InvalidGroupName::Start { name });
        }
        Ok(Self(name))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for GroupName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for GroupName {
    type Err = InvalidGroupName;

    fn from_str(s: &str) -> Result<Self, InvalidGroupName> {
        Self::new(s)
    }
}

impl AsRef<str> for GroupName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_names_are_checked() {
        for ok in ["default", "kafka-export", "projections.v2", "A_1", "9"] {
            assert_eq!(GroupName::new(ok).unwrap().as_str(), ok);
        }
        assert_eq!(GroupName::new(""), Err(InvalidGroupName::Empty));
        let e = GroupName::new("a b").unwrap_err();
        assert_eq!(
            e,
            InvalidGroupName::Character {
                name: "a b".into(),
                ch: ' ',
                at: 1
            }
        );
        assert!(e.to_string().contains("' ' at position 1"), "{e}");
        assert!(matches!(
            GroupName::new("x\"; DROP TABLE y; --"),
            Err(InvalidGroupName::Character { ch: '"', .. })
        ));
        assert!(matches!(
            GroupName::new("-x"),
            Err(InvalidGroupName::Start { .. })
        ));
        assert!(matches!(
            GroupName::new("é"),
            Err(InvalidGroupName::Character {
                ch: 'é', at: 0, ..
            })
        ));
        assert!(GroupName::new("g".repeat(63)).is_ok());
        assert_eq!(
            GroupName::new("g".repeat(64)),
            Err(InvalidGroupName::TooLong { len: 64 })
        );
    }
}
