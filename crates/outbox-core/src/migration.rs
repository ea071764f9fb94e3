//! The embedded schema migrations every store ships, and the bookkeeping
//! they share.
//!
//! A store crate embeds its SQL files as a `&'static [Migration]` (version,
//! name, SQL template with `{{placeholder}}` identifiers), renders them for
//! the outbox's validated names and records what it applied in the outbox's
//! own history table. Deciding what to apply from that history is the same
//! for every store and lives here, as a pure function ([`pending`]); running
//! the SQL (a transaction, a lock, the history INSERT) is the store's, since
//! only it knows its database.

use std::fmt;

/// One embedded migration: a SQL file of a store crate's `migrations/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// Version, the file's numeric prefix, increasing from 1.
    pub version: i32,
    /// Name recorded in the history table.
    pub name: &'static str,
    /// The SQL, with `{{placeholder}}`s for the identifiers the store
    /// renders.
    pub sql: &'static str,
}

impl Migration {
    /// A stable checksum of the SQL template (64-bit FNV-1a,
    /// [`fnv1a_64`](crate::shard::fnv1a_64)): recorded in the history so an edited
    /// migration is noticed.
    pub fn checksum(&self) -> u64 {
        crate::shard::fnv1a_64(self.sql.as_bytes())
    }
}

/// What a history table holds that [`pending`] cannot accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HistoryError<R> {
    /// The history records a version this build does not embed: the outbox
    /// was migrated by a newer version of the store crate.
    UnknownVersion {
        /// The unknown version.
        version: i32,
        /// What the history recorded for it.
        recorded: R,
    },
    /// An applied migration's recorded checksum does not match the embedded
    /// SQL: a migration file was edited after it was applied, or the outbox
    /// belongs to another build.
    ChecksumMismatch {
        /// The embedded migration of that version.
        migration: Migration,
        /// What the history recorded for it.
        recorded: R,
    },
}

impl<R> fmt::Display for HistoryError<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HistoryError::UnknownVersion { version, .. } => {
                write!(f, "the history records unknown migration {version}")
            }
            HistoryError::ChecksumMismatch { migration, .. } => write!(
                f,
                "migration {} ({}) was applied from different SQL",
                migration.version, migration.name
            ),
        }
    }
}

impl<R: fmt::Debug> std::error::Error for HistoryError<R> {}

/// The migrations of `migrations` still to apply, in order, given the
/// `history` a store read from its history table as `(version, record)`
/// pairs (the record is whatever the store keeps: a checksum, a name).
///
/// Every recorded version must be embedded and `verify(migration, record)`
/// must accept its record; otherwise nothing is applied and the first
/// offending row is returned.
pub fn pending<R>(
    migrations: &[Migration],
    history: impl IntoIterator<Item = (i32, R)>,
    mut verify: impl FnMut(&Migration, &R) -> bool,
) -> Result<Vec<&Migration>, HistoryError<R>> {
    let mut applied = Vec::new();
    for (version, recorded) in history {
        match migrations.iter().find(|m| m.version == version) {
            None => return Err(HistoryError::UnknownVersion { version, recorded }),
            Some(m) if !verify(m, &recorded) => {
                return Err(HistoryError::ChecksumMismatch {
                    migration: *m,
                    recorded,
                })
            }
            Some(_) => applied.push(version),
        }
    }
    Ok(migrations
        .iter()
        .filter(|m| !applied.contains(&m.version))
        .collect())
}

/// Whether `migrations` is a valid embedded set: versions strictly
/// increasing from 1, no empty SQL. Each store's unit tests assert it.
pub fn is_well_formed(migrations: &[Migration]) -> bool {
    migrations.first().is_none_or(|m| m.version == 1)
        && migrations.windows(2).all(|w| w[0].version < w[1].version)
        && migrations.iter().all(|m| !m.sql.trim().is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SET: &[Migration] = &[
        Migration {
            version: 1,
            name: "one",
            sql: "CREATE TABLE {{a}} (x int)",
        },
        Migration {
            version: 2,
            name: "two",
            sql: "CREATE TABLE {{b}} (x int)",
        },
        Migration {
            version: 3,
            name: "three",
            sql: "CREATE TABLE {{c}} (x int)",
        },
    ];

    fn by_checksum(m: &Migration, recorded: &u64) -> bool {
        m.checksum() == *recorded
    }

    #[test]
    fn an_empty_history_applies_everything_in_order() {
        let todo = pending(SET, Vec::<(i32, u64)>::new(), by_checksum).unwrap();
        assert_eq!(
            todo.iter().map(|m| m.version).collect::<Vec<_>>(),
            [1, 2, 3]
        );
    }

    #[test]
    fn applied_versions_are_skipped_whatever_the_history_order() {
        let history = [(2, SET[1].checksum()), (1, SET[0].checksum())];
        let todo = pending(SET, history, by_checksum).unwrap();
        assert_eq!(todo.iter().map(|m| m.version).collect::<Vec<_>>(), [3]);
        let all = SET.iter().map(|m| (m.version, m.checksum()));
        assert!(pending(SET, all, by_checksum).unwrap().is_empty());
    }

    #[test]
    fn an_unknown_version_is_refused() {
        let err = pending(SET, [(1, SET[0].checksum()), (9, 7)], by_checksum).unwrap_err();
        assert_eq!(
            err,
            HistoryError::UnknownVersion {
                version: 9,
                recorded: 7
            }
        );
    }

    #[test]
    fn an_edited_migration_is_refused() {
        let err = pending(SET, [(2, 42)], by_checksum).unwrap_err();
        assert_eq!(
            err,
            HistoryError::ChecksumMismatch {
                migration: SET[1],
                recorded: 42
            }
        );
        assert!(err.to_string().contains("migration 2 (two)"), "{err}");
    }

    #[test]
    fn checksums_are_fnv1a_of_the_template() {
        assert_eq!(
            Migration {
                version: 1,
                name: "empty",
                sql: ""
            }
            .checksum(),
            0xcbf2_9ce4_8422_2325
        );
        assert_ne!(SET[0].checksum(), SET[1].checksum());
    }

    #[test]
    fn well_formed_sets() {
        assert!(is_well_formed(SET));
        assert!(is_well_formed(&[]));
        assert!(!is_well_formed(&[SET[1]]));
        assert!(!is_well_formed(&[SET[0], SET[2], SET[1]]));
    }
}
