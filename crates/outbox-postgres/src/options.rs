//! What both modes' configuration shares: the default names, the default
//! notify setting, and URL redaction.

/// Default schema: `outbox`.
pub const DEFAULT_SCHEMA: &str = "outbox";
/// Default events table: `events` (dead letters in `events_dead`, migration
/// history in `events_migrations`).
pub const DEFAULT_TABLE: &str = "events";
/// Whether enqueue issues `pg_notify` by default (see the crate docs for the
/// measurement behind it).
pub const DEFAULT_NOTIFY: bool = false;

pub(crate) use outbox_core::redact_url;

/// Removes every occurrence of `url`'s password from `text` (for error
/// messages of the driver that might echo parts of the URL).
pub(crate) fn scrub(text: &str, url: &str) -> String {
    let password = url
        .split_once("://")
        .and_then(|(_, rest)| rest.split('?').next())
        .and_then(|rest| rest.rsplit_once('@'))
        .and_then(|(userinfo, _)| userinfo.split_once(':'))
        .map(|(_, p)| p)
        .filter(|p| !p.is_empty());
    match password {
        Some(p) => text.replace(p, "***"),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrubs_passwords() {
        assert_eq!(
            scrub(
                "bad url postgres://app:hunter2@db",
                "postgres://app:hunter2@db"
            ),
            "bad url postgres://app:***@db"
        );
    }
}
